"""The lessons of ``attnlab explain``, by name, and running them.

A lesson is a function ``(walk) -> {name: tensor}`` registered with :func:`lesson`; lessons run in
the order they were registered (the modules imported by :mod:`attnlab.tools.explain`, then the order
inside each), so a new set of lessons is a new module of ``@lesson`` functions, imported there.
:data:`TUTORIALS` lists the five tutorials and their sections, in which order :func:`run_tutorial`
runs a tutorial's lessons (``attnlab explain --tutorial NAME``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import torch
from torch import Tensor

from attnlab.tools.explain.walk import Walk, print_options, tutorial_defaults

__all__ = [
    "GPT_GUIDE",
    "IMPLEMENT",
    "LESSONS",
    "ONE_HEAD",
    "REVIEW",
    "SIMPLE",
    "TUTORIALS",
    "Lesson",
    "Tutorial",
    "check_lesson_names",
    "check_tutorial_name",
    "lesson",
    "lesson_names",
    "run_lesson",
    "run_tutorial",
    "tutorial_lessons",
]

# The tutorials, by title (the project's text never names them by anything else).
SIMPLE = '"A simple self-attention mechanism"'
IMPLEMENT = '"Implement the Self-Attention Mechanism in PyTorch"'
GPT_GUIDE = '"Implementing GPT-Style Attention: A Step-by-Step Guide with PyTorch"'
REVIEW = 'the attention-review exercises ("Attention Review")'
ONE_HEAD = '"Self attention for a single individual head"'

LessonFunc = Callable[[Walk], dict[str, Tensor]]


@dataclass(frozen=True)
class Tutorial:
    """A tutorial: its name for ``--tutorial``, its title (as lessons record it) and its sections'
    titles in the tutorial's order (a notebook without headings is cut at its cells)."""

    key: str
    title: str
    sections: tuple[str, ...]


TUTORIALS: dict[str, Tutorial] = {
    t.key: t
    for t in (
        Tutorial(
            "simple",
            SIMPLE,
            (
                "Calculate the scores",
                "Calculate the Attention Weights",
                "Calculating the context vector",
                "Computing attention weights for all input tokens",
                "Implementing self-attention with trainable weights",
                "A self-attention class using PyTorch's Linear layers",
                "Causal attention AKA masked attention",
                "Masking additional attention weights with dropout",
                "Implementing a compact causal attention class",
                "Multi-head attention",
                "Implementing multi-head attention with weight splits",
            ),
        ),
        Tutorial(
            "implement",
            IMPLEMENT,
            (
                "Setup",
                "Single head self-attention",
                "Unnormalized attention scores",
                "Compute unnormalized attention scores for ALL input words",
                "Normalized attention scores",
                "Compute z vector",
                "Multi-head self-attention",
                "Cross-attention",
            ),
        ),
        Tutorial(
            "gpt-style",
            GPT_GUIDE,
            (
                "Simplified Self-Attention Mechanism",
                "Adding Trainable Weights to Self-Attention",
                "Causal Attention: Masking Future Tokens",
                "Adding Dropout",
                "Multi-Head Attention",
                "The GPT Architecture: Harnessing the Power of Multi-Head Attention",
            ),
        ),
        Tutorial(
            "review",
            REVIEW,
            (
                "Concept Questions",
                "Attention Review",
                "Causal Attention",
                "Multi-head Attention",
                "Optional: Update BadLM to use multi-head attention",
            ),
        ),
        Tutorial(
            "one-head",
            ONE_HEAD,
            (
                "In [38]: version 4 : self attention",
                "In [33]: the head with values",
                "Notes: encoder and decoder blocks",
                "Notes: self-attention and cross-attention",
                "In [47]: scaled attention",
            ),
        ),
    )
}


@dataclass(frozen=True)
class Lesson:
    """A lesson: its name on the command line, a one-line summary, the headline of its title, the
    tutorial it follows (one of the titles above), optionally the tutorial's section, and the
    function that prints its steps and returns its key tensors."""

    name: str
    summary: str
    headline: str
    tutorial: str
    func: LessonFunc
    section: str = ""


LESSONS: dict[str, Lesson] = {}


def lesson(
    name: str, summary: str, *, headline: str, tutorial: str, section: str = ""
) -> Callable[[LessonFunc], LessonFunc]:
    """Register the decorated function as lesson ``name`` (after those registered before it)."""

    def register(func: LessonFunc) -> LessonFunc:
        if name in LESSONS:
            raise ValueError(f"a lesson named {name!r} is already registered ({LESSONS[name].func.__qualname__})")
        known = next((t for t in TUTORIALS.values() if t.title == tutorial), None)
        if known is not None and section and section not in known.sections:
            raise ValueError(f"lesson {name!r}: {tutorial} has no section {section!r}; its sections: {known.sections}")
        LESSONS[name] = Lesson(name, summary, headline, tutorial, func, section)
        return func

    return register


def lesson_names() -> list[str]:
    """The lessons' names, in teaching order."""
    return list(LESSONS)


def check_lesson_names(names: list[str]) -> list[str]:
    """``names`` if every one is a lesson; otherwise a ValueError naming the unknown ones and the valid ones."""
    unknown = [n for n in names if n not in LESSONS]
    if unknown:
        quoted = ", ".join(repr(n) for n in unknown)
        raise ValueError(f"unknown lesson {quoted}; choose from: {', '.join(LESSONS)}")
    return names


def check_tutorial_name(name: str) -> Tutorial:
    """The tutorial called ``name`` (its key, e.g. ``"simple"``, or its title, any case); otherwise a
    ValueError listing the names."""
    if not isinstance(name, str):
        raise TypeError(f"tutorial must be a str, got {type(name).__name__}")
    wanted = name.strip().strip('"').lower()
    for t in TUTORIALS.values():
        if wanted in (t.key, t.title.strip('"').lower()):
            return t
    choices = "; ".join(f"{t.key} ({t.title})" for t in TUTORIALS.values())
    raise ValueError(f"unknown tutorial {name!r}; choose from: {choices}")


def tutorial_lessons(name: str) -> list[Lesson]:
    """The lessons of tutorial ``name`` (see :func:`check_tutorial_name`) in the tutorial's order:
    by section, then in registration order; lessons without a known section come last."""
    t = check_tutorial_name(name)
    ours = [entry for entry in LESSONS.values() if entry.tutorial == t.title]
    order = {section: i for i, section in enumerate(t.sections)}
    return sorted(ours, key=lambda entry: order.get(entry.section, len(order)))  # sorted() is stable


def _interactive(file: TextIO | None) -> bool:
    """Whether a lesson may wait for the learner: printing to the terminal, reading from one."""
    try:
        return file is None and sys.stdin is not None and sys.stdin.isatty() and sys.stdout.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def run_lesson(
    name: str,
    file: TextIO | None = None,
    *,
    bpe_dir: str | os.PathLike[str] | None = None,
    interactive: bool | None = None,
) -> dict[str, Tensor]:
    """Print lesson ``name`` to ``file`` (default stdout) and return its key tensors.

    ``bpe_dir``: GPT-2's BPE files, for the lessons that tokenize as the tutorials do (see
    :class:`~attnlab.tokenizers.GPT2Tokenizer`); ``interactive``: whether a lesson may wait for the
    learner (default: printing to stdout, stdin and stdout terminals). The lesson runs in float32 on
    the CPU; the random state, torch's print options, default dtype and device and autograd mode are
    restored afterwards; an unknown name is a ValueError listing them.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    check_lesson_names([name])
    interactive = _interactive(file) if interactive is None else bool(interactive)
    entry = LESSONS[name]
    walk = Walk(sys.stdout if file is None else file, bpe_dir=bpe_dir, interactive=interactive)
    with torch.random.fork_rng(devices=[]), torch.no_grad(), print_options(precision=4), tutorial_defaults():
        walk.title(entry.name, entry.headline, entry.tutorial)
        return entry.func(walk)


def run_tutorial(
    name: str,
    file: TextIO | None = None,
    *,
    bpe_dir: str | os.PathLike[str] | None = None,
    interactive: bool | None = None,
) -> dict[str, dict[str, Tensor]]:
    """Print the lessons of tutorial ``name`` in the tutorial's order, each section's lessons under
    the section's title; return ``{lesson name: its tensors}``. Arguments as :func:`run_lesson`."""
    t = check_tutorial_name(name)
    walk = Walk(sys.stdout if file is None else file)
    entries = tutorial_lessons(t.key)
    walk.banner(f"Following {t.title}: {len(entries)} lessons, in its order (attnlab explain --tutorial {t.key})")
    results, section = {}, None
    for entry in entries:
        if entry.section != section:
            section = entry.section
            walk.section(section or "(beyond its sections)")
        walk.line()
        results[entry.name] = run_lesson(entry.name, file, bpe_dir=bpe_dir, interactive=interactive)
    return results
