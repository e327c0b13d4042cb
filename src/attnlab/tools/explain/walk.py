"""The printer of ``attnlab explain``: titles, prose, code, tensors with their shapes, checks and
tutorial-bug notes, every line within :data:`WIDTH` columns."""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import torch
from torch import Tensor

__all__ = ["WIDTH", "Walk", "print_options", "shape_of"]

WIDTH = 80  # every printed line fits an 80-column terminal
_TEXT = WIDTH - 2  # prose is wrapped a little narrower

# The fields of torch's print options that print_options saves and restores.
PRINT_FIELDS = ("precision", "threshold", "edgeitems", "linewidth", "sci_mode")


@contextlib.contextmanager
def print_options(**options: object) -> Iterator[None]:
    """Set torch's print options for the block, then restore the caller's."""
    opts = torch._tensor_str.PRINT_OPTS
    saved = {name: getattr(opts, name) for name in PRINT_FIELDS}
    torch.set_printoptions(**options)
    try:
        yield
    finally:
        torch.set_printoptions(**saved)


@contextlib.contextmanager
def tutorial_defaults() -> Iterator[None]:
    """float32 tensors on the CPU for the block, as the tutorials make them, whatever the caller set
    (a notebook's ``torch.set_default_dtype(torch.float64)`` would change every printed number); the
    caller's defaults come back afterwards."""
    dtype, device = torch.get_default_dtype(), torch.get_default_device()
    torch.set_default_dtype(torch.float32)
    moved = device.type != "cpu"
    if moved:  # (None: no default device at all; setting "cpu" would install a mode every call pays for)
        torch.set_default_device(None)
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        if moved:
            torch.set_default_device(device)


def shape_of(t: Tensor) -> str:
    """``(2, 3)``, ``(6,)``, ``()``: a shape as Python writes a tuple."""
    return "(" + ", ".join(str(s) for s in t.shape) + (",)" if t.dim() == 1 else ")")


class Walk:
    """Writes a lesson: titles, prose, tensors with their shapes, checks and tutorial-bug notes.

    Args:
        file: where the lesson prints.
        bpe_dir: GPT-2's BPE files for lessons that tokenize as the tutorials do (None: the default
            of :class:`attnlab.tokenizers.GPT2Tokenizer`).
        interactive: whether :meth:`ask` may wait for the learner to press Enter.
    """

    _INDENT = "  "  # tensors are indented under their header line

    def __init__(
        self, file: TextIO, *, bpe_dir: str | os.PathLike[str] | None = None, interactive: bool = False
    ) -> None:
        self.file = file
        self.bpe_dir = None if bpe_dir is None else Path(bpe_dir)
        self.interactive = interactive

    def line(self, text: str = "") -> None:
        """One line as it is (a table row, a blank line)."""
        print(text, file=self.file)

    def _wrap(self, text: str, first: str = "", rest: str = "") -> None:
        for para in text.split("\n"):
            lines = textwrap.wrap(
                para, width=_TEXT, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
            )
            for line in lines or [first.rstrip()]:
                self.line(line)

    def title(self, name: str, headline: str, source: str) -> None:
        self.line("=" * _TEXT)
        self._wrap(f"{name}: {headline}", rest="  ")
        self._wrap(f"(following {source})", rest=" ")
        self.line("=" * _TEXT)

    def banner(self, text: str) -> None:
        """The heading of a run of lessons (a whole tutorial)."""
        self.line("#" * _TEXT)
        self._wrap(text, rest="  ")
        self.line("#" * _TEXT)

    def section(self, title: str) -> None:
        """A tutorial's section title, above the lessons that follow it."""
        self.line()
        self.line("-" * _TEXT)
        self._wrap(f"Section: {title}", rest="  ")
        self.line("-" * _TEXT)

    def ask(self, number: int, question: str, answer: str) -> None:
        """A question, then (after the learner presses Enter, when interactive) its answer."""
        self.line()
        self._wrap(f"Q{number}. {question}", rest="    ")
        if self.interactive:
            self.file.write("    (think of your answer, then press Enter) ")
            self.file.flush()
            sys.stdin.readline()  # "" at end of input: go on
        self._wrap(answer, first="  A: ", rest="     ")

    def say(self, text: str) -> None:
        """A paragraph of explanation."""
        self.line()
        self._wrap(text)

    def step(self, code: str) -> None:
        """The code a step runs, as the tutorial (or attnlab) writes it."""
        self.line()
        self._wrap(code, first=">>> ", rest="... ")

    def show(self, name: str, t: Tensor, note: str) -> None:
        """``name  shape (..)`` then a one-line note on what happened, then the tensor."""
        self.line()
        self._wrap(f"{name}  shape {shape_of(t)}", rest="    ")
        if note:
            self._wrap(note, first="  # ", rest="  # ")
        for line in self._format(t):
            self.line(self._INDENT + line)

    def value(self, name: str, v: float | int | str, note: str = "") -> None:
        """A scalar on one line, with an optional note."""
        if isinstance(v, float):
            text = f"{v:.4f}"
        elif isinstance(v, int):
            text = f"{v:,}"
        else:
            text = v
        self._wrap(f"{name} = {text}" + (f"   # {note}" if note else ""), rest="    ")

    def check(self, label: str, a: Tensor, b: Tensor) -> float:
        """Print (and return) the largest absolute difference between two tensors."""
        diff = (a.double() - b.double()).abs()
        # -inf - -inf is nan: equal infinities count as no difference.
        diff = torch.where(torch.isnan(diff) & (a == b), torch.zeros_like(diff), diff)
        worst = float(diff.max()) if diff.numel() else 0.0
        self._wrap(f"check: {label}: max |difference| = {worst:.1e}", rest="    ")
        return worst

    def notice(self, text: str) -> None:
        """A paragraph the learner must not miss (what to pass when something is missing)."""
        self.line()
        self._wrap(text, first="! ", rest="  ")

    def bug(self, source: str, text: str) -> None:
        """A clearly marked note on a tutorial's mistake (verified against the tutorial's text)."""
        self.line()
        self._wrap(f"** Tutorial bug in {source} **", rest="   ")
        self._wrap(text, first="!  ", rest="!  ")

    def _format(self, t: Tensor) -> list[str]:
        """torch's own formatting (as in the tutorials), without the ``tensor(`` wrapper."""
        t = t.detach().cpu()
        if t.dim() == 0:
            return [f"{t.item():.4f}" if t.is_floating_point() else str(t.item())]
        prefix = "tensor("
        room = WIDTH - len(self._INDENT)
        # torch lays elements out to fit `linewidth` counting the "tensor(" indent; stripping that
        # prefix afterwards leaves lines of at most `room` characters.
        # torch's wrapping can overshoot its linewidth by a character or two (1-D tensors in
        # scientific notation): narrow it until every line fits.
        for linewidth in range(room + len(prefix), 20, -2):
            with print_options(precision=4, linewidth=linewidth, threshold=1000, edgeitems=3):
                text = repr(t)
            lines = text.split("\n")
            if not (text.startswith(prefix) and text.endswith(")")):  # pragma: no cover - defensive
                return lines
            lines[0] = lines[0][len(prefix) :]
            lines[1:] = [line[len(prefix) :] if line.startswith(" " * len(prefix)) else line for line in lines[1:]]
            lines[-1] = lines[-1][:-1]
            if all(len(line) <= room for line in lines):
                break
        return lines
