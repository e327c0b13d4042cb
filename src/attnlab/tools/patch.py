"""``attnlab patch``: which heads and positions carry the answer, by activation patching.

The corrupted prompt is run with one clean activation at a time; the report lists the patches that
move the logit difference of the two answers the most, either way (toward the clean run's, or away
from it, as IOI's negative name movers do), with the sign of the move, and a picture shows
each site as a heatmap (layer x head, layer x position).
"""

from __future__ import annotations

import base64
import contextlib
import html
import io
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import Any

import torch
from torch import Tensor

from attnlab.files import atomic_write_bytes, atomic_write_text
from attnlab.interpret import (
    SITES,
    activation_patching,
    logit_diff,
    notebook_patching_html,
    patching_section,
    token_strings,
)
from attnlab.interpret.page import OFFLINE_CSP, read_asset
from attnlab.interpret.patch_view import PATTERNS_BUDGET, VIEW_SITES, answer_token, head_patterns
from attnlab.tokenizers import prompt_tokens
from attnlab.tools.loading import LoadedModel, model_name

__all__ = ["PatchReport", "patch_page", "patch_report", "patching_view", "save_patch_picture"]


@dataclass
class PatchReport:
    """The results of :func:`patch_report`: raw metric values per site, and the two ends."""

    tokens: list[str]
    answers: tuple[str, str]
    clean_value: float
    corrupted_value: float
    results: dict[str, Tensor] = field(default_factory=dict)
    # For the interactive view (view_data): the token ids of both prompts and of the answers, the
    # prompts' text, and every head's attention pattern on each prompt ((L, H, T, T) twice, or None).
    ids: tuple[list[int], list[int]] | None = None
    answer_ids: tuple[int, int] | None = None
    texts: tuple[str, str] | None = None
    patterns: tuple[Tensor, Tensor] | None = None
    tokenizer: Any = field(default=None, repr=False)
    name: str = "model"  # the model's name (tools.loading.model_name), the page's title

    def restored(self, site: str) -> Tensor:
        """The site's results normalized: 0 = the corrupted run, 1 = the clean one."""
        return (self.results[site] - self.corrupted_value) / (self.clean_value - self.corrupted_value)

    def top(self, site: str, k: int) -> list[tuple[str, float, float]]:
        """The ``k`` patches of largest effect either way: ``(label, raw value, restored fraction)``.

        The effect of a patch is how far it moves the metric from the corrupted run's, as a fraction
        of the clean run's distance: ``restored``. They are ranked by ``|restored|`` so that a patch
        moving the metric strongly the *other* way (IOI's negative name movers) is listed too; the
        sign of ``restored`` tells the two apart. Ties keep the order of the results (layer first).
        """
        restored = self.restored(site)
        flat, values = restored.flatten(), self.results[site].flatten()
        order = torch.sort(flat.abs(), descending=True, stable=True).indices[:k]
        where = torch.stack(torch.unravel_index(order, restored.shape), dim=-1).tolist()  # (k, restored.dim())
        return [(self.label(site, w), float(values[i]), float(flat[i])) for w, i in zip(where, order, strict=True)]

    def label(self, site: str, index: list[int]) -> str:
        kind = SITES[site][1]
        if kind == "pos":
            return f"layer {index[0]} position {index[1]} {self.tokens[index[1]]!r}"
        if kind == "head":
            return f"{index[0]}.{index[1]}"
        if kind == "dest_src":  # (layer, head, query, key)
            query, key = (f"{self.tokens[i]!r} ({i})" for i in index[2:])
            return f"{index[0]}.{index[1]} {query} on {key}"
        if kind == "neuron":
            return f"layer {index[0]} neuron {index[1]}"
        if kind == "pos_neuron":
            return f"layer {index[0]} neuron {index[2]} at position {index[1]} {self.tokens[index[1]]!r}"
        return f"{index[0]}.{index[2]} at position {index[1]} {self.tokens[index[1]]!r}"

    def view_data(self) -> dict[str, Any]:
        """The patching view's page data (:func:`attnlab.interpret.patching_section`): the sites with
        a heatmap (layer x head, layer x position) and the heads' patterns when they were kept."""
        if self.ids is None or self.answer_ids is None:
            raise ValueError("this PatchReport has no token ids: make it with patch_report() to draw its view")
        return patching_section(
            self.tokenizer,
            self.ids[0],
            self.ids[1],
            self.answer_ids,
            (self.clean_value, self.corrupted_value),
            self.results,
            texts=self.texts or (None, None),
            patterns=self.patterns,
        )

    def _repr_html_(self) -> str:
        """In Jupyter: the inspector's patching view inline (heatmaps to hover, heads to click), or the
        page of ``attnlab patch --out page.html`` for a report without token ids."""
        if self.ids is None or not any(SITES[s][1] in ("head", "pos") for s in self.results):
            return patch_page(self)
        return notebook_patching_html(self.view_data())

    def format(self, top: int = 10) -> str:
        a, b = self.answers
        lines = [
            f"metric: logit({a!r}) - logit({b!r}) at the last token",
            f"clean run {self.clean_value:+.4f}, corrupted run {self.corrupted_value:+.4f}",
        ]
        for site in self.results:
            lines.append(
                f"\n{site}: the {top} patches of largest effect, either way (value, fraction restored: "
                "+ toward the clean run, - away from it)"
            )
            for label, value, frac in self.top(site, top):
                lines.append(f"  {label:40} {value:+.4f}  {frac:+.3f}")
        return "\n".join(lines)


def patch_report(
    loaded: LoadedModel,
    clean: str,
    corrupted: str,
    answers: tuple[str, str],
    sites: list[str],
    *,
    patterns: bool | None = None,
    clean_flag: str = "--clean",
    progress: bool = False,
) -> PatchReport:
    """Activation patching of ``sites`` (see :data:`attnlab.interpret.SITES`) for two prompts of the
    same number of tokens, with the metric logit(answers[0]) - logit(answers[1]).

    ``patterns``: also keep every head's attention pattern on both prompts (the view shows a clicked
    head's); None: when they fit :data:`attnlab.interpret.patch_view.PATTERNS_BUDGET` as bytes.
    ``progress``: a bar of each site's patched runs on stderr, where stderr is a terminal (tqdm)."""
    model, tok = loaded.model, loaded.tokenizer
    for site in sites:
        if site not in SITES:
            raise ValueError(f"--site must be one of {', '.join(SITES)}, got {site!r}")
    V, names = model.config.vocab_size, ("--answers: the first answer", "--answers: the second answer")
    a, b = (answer_token(tok, t, V, name) for t, name in zip(answers, names, strict=True))
    device = next(model.parameters()).device
    ids = [torch.tensor(prompt_tokens(tok, t), dtype=torch.long, device=device) for t in (clean, corrupted)]
    ctx = model.config.context_length
    for flag, i in zip((clean_flag, "--corrupted"), ids, strict=True):
        if i.numel() == 0:
            raise ValueError(f"{flag} encodes to no tokens: give a prompt of at least one token")
        if i.numel() > ctx and not model.config.relative:  # (relative positions slide a window over a long one)
            raise ValueError(
                f"{flag} is {i.numel()} tokens long, more than the model's context_length={ctx}; shorten it"
            )
    if ids[0].numel() != ids[1].numel():
        raise ValueError(
            f"{clean_flag} and --corrupted must have the same number of tokens, "
            f"got {ids[0].numel()} and {ids[1].numel()}"
        )
    metric = logit_diff(a, b)
    with torch.no_grad():
        values = [float(metric(model(i[None]))) for i in ids]
    if values[0] == values[1]:
        raise ValueError("the clean and corrupted prompts give the same logit difference: nothing to restore")
    report = PatchReport(
        token_strings(tok, ids[0].tolist()),
        tuple(answers),
        values[0],
        values[1],
        ids=(ids[0].tolist(), ids[1].tolist()),
        answer_ids=(a, b),
        texts=(clean, corrupted),
        tokenizer=tok,
        name=model_name(loaded),
    )
    L, H, T = model.config.n_layers, model.config.n_heads, ids[0].numel()
    if patterns or (patterns is None and L * H * T * (T + 1) <= PATTERNS_BUDGET):
        report.patterns = (head_patterns(model, ids[0])[1].cpu(), head_patterns(model, ids[1])[1].cpu())
    for site in sites:
        with _bar(site, progress) as bar:
            report.results[site] = activation_patching(model, ids[0], ids[1], metric, site, progress=bar)
    return report


@contextlib.contextmanager
def _bar(site: str, shown: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A ``progress(done, total)`` that moves a tqdm bar on stderr (shown only on a terminal: tqdm's
    ``disable=None``), or None where not ``shown`` or tqdm is not installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:
        shown = False
    if not shown:
        yield None
        return
    with tqdm(desc=site, unit="run", file=sys.stderr, disable=None, dynamic_ncols=True, leave=False) as bar:

        def move(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        yield move


def _png(report: PatchReport, site: str) -> bytes:
    """The site's heatmap of fractions restored, as PNG bytes."""
    from matplotlib.figure import Figure

    data = report.restored(site)
    kind = SITES[site][1]
    if kind in ("pos_head", "pos_neuron"):
        data = data.abs().amax(-1)  # (L, T): the strongest head (neuron) at each layer and position
    elif kind == "dest_src":
        data = data.abs().amax((1, 3))  # (L, T): the strongest weight of any head at each layer and query
    L, n = data.shape
    width = 10.0 if kind == "neuron" else max(4.0, 0.45 * n + 2)  # (thousands of neurons: a strip each layer)
    fig = Figure(figsize=(width, max(3.0, 0.22 * L + 1.5)), dpi=110)
    ax = fig.add_subplot()
    lim = max(float(data.abs().max()), 1e-6)
    im = ax.imshow(data.numpy(), cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="fraction restored (0 corrupted, 1 clean)")
    ax.set_ylabel("layer")
    if kind in ("head", "neuron"):
        ax.set_xlabel(kind)
    else:
        ax.set_xticks(range(n), [t.replace("$", r"\$") for t in report.tokens], rotation=60, ha="right", fontsize=7)
    ax.set_title(f"activation patching: {site}", fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def save_patch_picture(report: PatchReport, path: str | os.PathLike[str], *, top: int = 10) -> Path:
    """A PNG of the first site's heatmap, or (``.html``) one page with every site's heatmap and table."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".png":
        atomic_write_bytes(path, _png(report, next(iter(report.results))))
        return path
    if suffix not in (".html", ".htm"):
        raise ValueError(f"--out must end in .html or .png, got {str(path)!r}")
    atomic_write_text(path, patch_page(report, top=top))
    return path


def patch_page(report: PatchReport, *, top: int = 10) -> str:
    """One self-contained HTML page (``assets/patch_report.html``, loading nothing): every site's
    heatmap (PNG inline) and its top patches."""
    a, b = (html.escape(repr(x)) for x in report.answers)
    parts = []
    for site in report.results:
        img = base64.b64encode(_png(report, site)).decode()
        rows = "".join(
            f"<tr><td>{html.escape(label)}</td><td>{value:+.4f}</td><td>{frac:+.3f}</td></tr>"
            for label, value, frac in report.top(site, top)
        )
        parts.append(
            f"<h2>{site}</h2><img alt='{site} heatmap' src='data:image/png;base64,{img}'>"
            f"<table><tr><th>patch</th><th>value</th><th>restored</th></tr>{rows}</table>"
        )
    return Template(read_asset("patch_report.html")).substitute(
        csp=OFFLINE_CSP,
        title=html.escape(report.name),
        a=a,
        b=b,
        clean=f"{report.clean_value:+.4f}",
        corrupted=f"{report.corrupted_value:+.4f}",
        tokens=html.escape(" | ".join(report.tokens)),
        sections="\n".join(parts),
    )


def patching_view(loaded: LoadedModel, clean: str, corrupted: str, answers: tuple[str, str]) -> dict[str, Any]:
    """The inspector page's patching view (``attnlab viz --prompt CLEAN --corrupted TEXT --answers A B``):
    ``head_out`` and ``resid_pre``, with every head's pattern on both prompts when they fit."""
    return patch_report(loaded, clean, corrupted, answers, list(VIEW_SITES), clean_flag="--prompt").view_data()
