"""``attnlab viz``: look at attention. Heatmaps (PNG) and a self-contained HTML viewer.

Every weight shown comes out of the model through the library's own ``return_weights=True`` path
(:func:`attnlab.functional.scaled_dot_product_attention`): there is no second implementation of
attention here, so what you see is what the model computed.

Two sources of attention:

* no ``--checkpoint``: the tutorials' six-word example, "Your journey starts with one step"
  (:data:`attnlab.tutorial_code.INPUTS`), through the modules of "A simple self-attention
  mechanism" under the tutorial's seeds;
* ``--checkpoint DIR --prompt TEXT``: a trained GPT, one heatmap per layer and head.

Library use::

    from attnlab.tools.viz import attention_maps, save_png, save_html, AttentionView
    maps = attention_maps(model, idx)  # [(H, T, T) per attention module]
"""

from __future__ import annotations

import contextlib
import html
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from attnlab import attention as _attention
from attnlab.files import atomic_open, atomic_write_text
from attnlab.functional import simple_self_attention
from attnlab.tools.loading import load_model

__all__ = [
    "AttentionView",
    "LayerMaps",
    "add_arguments",
    "attention_maps",
    "demo_view",
    "model_view",
    "render_html",
    "run",
    "save_html",
    "save_png",
    "token_label",
]

# Modules whose forward takes ``return_weights`` (they all route it to the functional core).
ATTENTION_TYPES: tuple[type[nn.Module], ...] = (
    _attention.MultiHeadAttention,
    _attention.MultiHeadAttentionWrapper,
    _attention.CausalAttention,
    _attention.SelfAttention_v2,
    _attention.SelfAttention_v1,
)


# --------------------------------------------------------------------------------------------
# Data: what is drawn
# --------------------------------------------------------------------------------------------
@dataclass
class LayerMaps:
    """One row of the grid: the attention weights of one attention module.

    Attributes:
        name: row title ("layer 3", "MultiHeadAttention (seed 123)").
        weights: ``(H, T, S)`` weights, row ``i`` = where query token ``i`` attends.
        heads: the original index of each of the ``H`` heads (they survive ``--head`` selection).
    """

    name: str
    weights: Tensor
    heads: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.weights, Tensor) or self.weights.dim() != 3:
            raise ValueError(
                f"weights must be a (heads, queries, keys) tensor, got "
                f"{tuple(self.weights.shape) if isinstance(self.weights, Tensor) else type(self.weights).__name__}"
            )
        if not self.heads:
            self.heads = list(range(self.weights.shape[0]))
        if len(self.heads) != self.weights.shape[0]:
            raise ValueError(f"heads has {len(self.heads)} entries for {self.weights.shape[0]} heads")


@dataclass
class AttentionView:
    """Everything a picture needs: a title, the token labels and the weights per layer.

    Attributes:
        title: the figure/page title.
        tokens: ``T`` token strings as the model saw them (labels are made with :func:`token_label`).
        layers: one :class:`LayerMaps` per row; all have ``T`` queries and ``T`` keys.
        text: the original text (shown verbatim in the HTML page).
        note: one line saying where the weights come from.
    """

    title: str
    tokens: list[str]
    layers: list[LayerMaps]
    text: str = ""
    note: str = ""

    def __post_init__(self) -> None:
        T = len(self.tokens)
        if T == 0:
            raise ValueError("tokens must not be empty")
        if not self.layers:
            raise ValueError("layers must not be empty")
        for layer in self.layers:
            if tuple(layer.weights.shape[1:]) != (T, T):
                raise ValueError(
                    f"layer {layer.name!r} has weights of shape {tuple(layer.weights.shape)}, "
                    f"expected (heads, {T}, {T}) for {T} tokens"
                )

    def select(self, layers: Sequence[int] | None = None, heads: Sequence[int] | None = None) -> AttentionView:
        """A view restricted to some layers (row indices) and heads (head indices); negatives count back."""
        rows = list(range(len(self.layers)))
        if layers is not None:
            rows = [_resolve_index("--layer", i, len(self.layers)) for i in layers]
        out = []
        for r in rows:
            layer = self.layers[r]
            if heads is None:
                out.append(layer)
                continue
            n = layer.weights.shape[0]
            if len(rows) > 1 and any(not -n <= h < n for h in heads):
                continue  # rows with fewer heads (the tutorial view mixes 1- and 2-head modules)
            idx = [_resolve_index("--head", h, n) for h in heads]
            out.append(LayerMaps(layer.name, layer.weights[idx], [layer.heads[i] for i in idx]))
        if not out:
            most = max(layer.weights.shape[0] for layer in self.layers)
            raise ValueError(f"--head {list(heads or [])}: no selected layer has that head (at most {most} heads)")
        return AttentionView(self.title, self.tokens, out, self.text, self.note)


def _resolve_index(arg: str, i: int, n: int) -> int:
    if not -n <= i < n:
        raise ValueError(f"{arg} {i} is out of range: there are {n} (valid: 0..{n - 1}, or -1 for the last)")
    return i % n


def token_label(token: str) -> str:
    """A printable label for one token: spaces as ``␣``, newlines as ``↵``, tabs as ``⇥``.

    Byte-level tokens are often pure whitespace; without this they would be invisible.
    """
    out = []
    for ch in token:
        if ch == " ":
            out.append("␣")
        elif ch == "\n":
            out.append("↵")
        elif ch == "\t":
            out.append("⇥")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out) or "∅"


# --------------------------------------------------------------------------------------------
# Capturing attention from a model
# --------------------------------------------------------------------------------------------
def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost attention modules of ``model`` (a wrapper's inner heads are not called)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, ATTENTION_TYPES) and not any(
            name.startswith(prefix + ".") or prefix == "" for prefix, _ in found
        ):
            found.append((name, module))
    return [m for _, m in found]


@contextlib.contextmanager
def capture_attention(model: nn.Module) -> Iterator[list[Tensor]]:
    """Record the attention weights of every attention module called inside the block.

    A forward pre-hook turns on ``return_weights=True`` (the library's own path, which
    materialises the weights the model applies); a forward hook takes the weights off again, so
    the model's code sees exactly the output it would without the hook. Weights are appended in
    call order, detached. Hooks are removed on exit.
    """
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(
            f"model ({type(model).__name__}) contains no attnlab attention module "
            f"({', '.join(t.__name__ for t in ATTENTION_TYPES)}), so there is no attention to show"
        )
    captured: list[Tensor] = []
    caller_wanted: dict[int, list[bool]] = {}

    def observe(module: nn.Module, record: _attention.AttentionRecord) -> None:
        captured.append(record.weights.detach())

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        caller_wanted.setdefault(id(module), []).append(bool(kwargs.get("return_weights", False)))
        return args, {**kwargs, "return_weights": True}

    def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: tuple[Tensor, Tensor]):
        out, weights = output
        captured.append(weights.detach())
        return output if caller_wanted[id(module)].pop() else out

    # MultiHeadAttention reports every attend() to its observer (a GPT calls attend() directly, past
    # forward hooks); the single-head modules and the wrapper are called through forward.
    handles = []
    observed = [m for m in modules if isinstance(m, _attention.MultiHeadAttention)]
    try:
        for m in observed:
            m.observer = observe
        for m in modules:
            if m not in observed:
                handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
                handles.append(m.register_forward_hook(post_hook, with_kwargs=True))
        yield captured
    finally:
        for h in handles:
            h.remove()
        for m in observed:
            m.observer = None


def attention_maps(model: nn.Module, idx: Tensor, **forward_kwargs) -> list[Tensor]:
    """Run ``model(idx)`` once in eval mode and return each attention module's weights.

    Args:
        model: any module containing attnlab attention modules (a GPT, a single
            :class:`~attnlab.MultiHeadAttention`, ...).
        idx: the model's input; for a GPT, token ids ``(T,)`` or ``(B, T)``.
        forward_kwargs: passed on to ``model``.
    Returns:
        one tensor per attention call, in call order (= layer order). With 1-D integer ``idx`` (one
        sequence, fed as a batch of one): ``(H, T, S)``, single-head modules giving ``H = 1``.
        Otherwise the weights as the modules return them: ``(B, H, T, S)`` for multi-head modules.

    Dropout is off (eval mode) while capturing; the model's training flag is restored afterwards.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(idx, Tensor):
        raise TypeError(f"idx must be a torch.Tensor, got {type(idx).__name__}")
    single = idx.dim() == 1 and not idx.is_floating_point()
    x = idx.unsqueeze(0) if single else idx
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), capture_attention(model) as captured:
            model(x, **forward_kwargs)
    finally:
        model.train(was_training)
    if not captured:
        raise ValueError("the model ran but called none of its attention modules")
    maps = []
    for w in captured:
        if single:
            w = w[0] if w.dim() == 4 else w  # (1, H, T, S) -> (H, T, S); a 1-head (1, T, S) is (H=1, T, S)
        elif w.dim() == 2:
            w = w.unsqueeze(0)  # an unbatched single-head module: (T, S) -> (1, T, S)
        maps.append(w.float().cpu())
    return maps


# --------------------------------------------------------------------------------------------
# The two views: the tutorials' example and a trained GPT
# --------------------------------------------------------------------------------------------
def demo_view() -> AttentionView:
    """The six words of "A simple self-attention mechanism" through its modules, under its seeds.

    Rows: parameter-free attention (``softmax(x x^T)``), ``SelfAttention_v2`` (seed 789),
    ``CausalAttention`` with the same weights (seed 789), the stacked-heads wrapper and the
    weight-split ``MultiHeadAttention`` (seed 123, ``d_out=2``, two heads). The global RNG is left
    as it was.
    """
    from attnlab.tutorial_code import INPUTS, WORDS

    x = INPUTS.clone()  # (6, 3)
    T, d_in, d_out = x.shape[0], x.shape[1], 2
    layers: list[LayerMaps] = []
    with torch.no_grad():
        _, w = simple_self_attention(x, return_weights=True)  # (6, 6)
        layers.append(LayerMaps("simple self-attention: softmax(x·xᵀ)", w.unsqueeze(0)))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(789)
            sa = _attention.SelfAttention_v2(d_in, d_out)
            layers.append(LayerMaps("SelfAttention_v2 (seed 789)", sa(x, return_weights=True)[1].unsqueeze(0)))
            torch.manual_seed(789)  # same draws as SelfAttention_v2: the tutorial masks those weights
            ca = _attention.CausalAttention(d_in, d_out, T, 0.0).eval()
            layers.append(LayerMaps("CausalAttention (seed 789)", ca(x, return_weights=True)[1].unsqueeze(0)))
            torch.manual_seed(123)
            wrap = _attention.MultiHeadAttentionWrapper(d_in, d_out, T, 0.0, num_heads=2).eval()
            layers.append(LayerMaps("MultiHeadAttentionWrapper (seed 123)", wrap(x, return_weights=True)[1]))
            torch.manual_seed(123)
            mha = _attention.MultiHeadAttention(d_in, d_out, T, 0.0, num_heads=2).eval()
            layers.append(LayerMaps("MultiHeadAttention (seed 123)", mha(x, return_weights=True)[1]))
    return AttentionView(
        title="Your journey starts with one step",
        tokens=list(WORDS),
        layers=layers,
        text=" ".join(WORDS),
        note='The six 3-d word embeddings of "A simple self-attention mechanism", through its modules '
        "under the tutorial's seeds (row = query word, column = the word it attends to).",
    )


def model_view(
    model: nn.Module, ids: Sequence[int], tokens: Sequence[str], *, title: str = "", text: str = ""
) -> AttentionView:
    """The attention of ``model`` on one sequence of token ids: one row per layer, one column per head."""
    ids = [int(i) for i in ids]
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give a longer --prompt")
    if len(tokens) != len(ids):
        raise ValueError(f"tokens has {len(tokens)} labels for {len(ids)} ids")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    maps = attention_maps(model, torch.tensor(ids, dtype=torch.long, device=device))
    layers = [LayerMaps(f"layer {i}", w) for i, w in enumerate(maps)]
    return AttentionView(
        title=title or text,
        tokens=list(tokens),
        layers=layers,
        text=text,
        note=f"{type(model).__name__}: {len(layers)} layers x {layers[0].weights.shape[0]} heads, {len(ids)} tokens "
        f"(row = query token, column = the token it attends to).",
    )


# --------------------------------------------------------------------------------------------
# PNG (matplotlib)
# --------------------------------------------------------------------------------------------
def _mpl_label(token: str) -> str:
    """A matplotlib-safe label: ``$`` would otherwise start mathtext."""
    return token_label(token).replace("$", r"\$")


def save_png(view: AttentionView, path: str | os.PathLike, *, dpi: int = 110) -> Path:
    """Draw a grid of heatmaps (rows = layers, columns = heads) and write it atomically.

    Each panel has the query tokens down the side and the key tokens along the bottom. Each row
    has its own colour bar from 0 to that row's largest weight, so a layer's heads compare
    directly and a flat layer still shows its structure. With at most 8 tokens the weights are
    printed in the cells, as the tutorials print them. The format follows the suffix (``.png``,
    ``.svg``, ``.pdf``).
    """
    # A bare Figure renders with Agg on savefig: no pyplot, no GUI backend, no global state.
    from matplotlib.figure import Figure

    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    T = len(view.tokens)
    n_rows = len(view.layers)
    n_cols = max(layer.weights.shape[0] for layer in view.layers)
    many = n_rows * n_cols > 16
    label_all = not many and T <= 32  # else token labels only on the outer panels
    cell = min(max(0.30 * T + 1.0, 2.4), 7.0) if not many else min(max(0.16 * T + 0.9, 1.6), 4.0)
    # Font from the row pitch (points per token); below 3.5 pt only every k-th token is labelled.
    fontsize = min(9.0, 0.75 * cell * 72.0 / T)
    every = max(1, math.ceil(3.5 / fontsize))
    fontsize = max(fontsize, 3.5)
    title_size = 8.0 if not many else 7.0
    labels = [_mpl_label(t) for t in view.tokens]
    ticks = list(range(0, T, every))

    fig = Figure(figsize=(n_cols * cell + 2.2, n_rows * (cell + 0.5) + 0.6), layout="constrained")
    title = view.title if len(view.title) <= 90 else view.title[:87] + "..."
    fig.suptitle(title.replace("$", r"\$"), fontsize=12, fontweight="bold")
    rows = fig.subfigures(n_rows, 1, squeeze=False)[:, 0]
    for r, (row, layer) in enumerate(zip(rows, view.layers, strict=True)):
        w = layer.weights.float().numpy()  # (H, T, T)
        vmax = float(w.max()) or 1.0
        row.suptitle(layer.name.replace("$", r"\$"), fontsize=title_size + 1, x=0.02, ha="left")
        axes = row.subplots(1, n_cols, squeeze=False)[0]
        image = None
        for c, ax in enumerate(axes):
            if c >= w.shape[0]:
                ax.set_axis_off()
                continue
            image = ax.imshow(w[c], cmap="viridis", vmin=0.0, vmax=vmax, interpolation="nearest", aspect="equal")
            ax.set_title(f"head {layer.heads[c]}", fontsize=title_size)
            # Key labels on every panel, or only where no panel sits below (the grid can be ragged).
            # Unlabelled axes get no ticks at all: thousands of tick artists are what make a
            # large grid slow to draw.
            below = view.layers[r + 1].weights.shape[0] if r + 1 < n_rows else 0
            show_x = label_all or c >= below
            show_y = label_all or c == 0
            ax.set_xticks(ticks if show_x else [], [labels[k] for k in ticks] if show_x else [],
                          rotation=90, fontsize=fontsize)  # fmt: skip
            ax.set_yticks(ticks if show_y else [], [labels[k] for k in ticks] if show_y else [],
                          fontsize=fontsize)  # fmt: skip
            ax.tick_params(length=0)
            if show_x:
                ax.set_xlabel("key (attended to)", fontsize=title_size)
            if show_y:
                ax.set_ylabel("query (attending)", fontsize=title_size)
            if T <= 8:
                for i in range(T):
                    for j in range(T):
                        v = float(w[c, i, j])
                        dark = v < 0.6 * vmax  # viridis is dark at the bottom: white text there
                        ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6.5,
                                color="white" if dark else "black")  # fmt: skip
        used = [ax for c, ax in enumerate(axes) if c < w.shape[0]]
        if image is not None:
            row.colorbar(image, ax=used, shrink=0.85, aspect=15, label="attention weight")

    with atomic_open(path, "wb") as f:
        fig.savefig(f, format=fmt, dpi=dpi)
    return path


# --------------------------------------------------------------------------------------------
# HTML (one self-contained page)
# --------------------------------------------------------------------------------------------
def _json_for_script(obj: object) -> str:
    """JSON safe to put inside ``<script type="application/json">``.

    ``<``, ``>`` and ``&`` become ``\\u003c`` etc., so no token text can close the script element
    (``</script>``) or open a comment; ``JSON.parse`` reads them back unchanged.
    """
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def view_to_dict(view: AttentionView, *, decimals: int = 4) -> dict:
    """The JSON data the HTML page embeds (weights rounded to ``decimals`` places)."""
    scale = 10**decimals

    def rows(m: Tensor) -> list[list[float]]:
        return [[round(float(v) * scale) / scale for v in row] for row in m.tolist()]

    return {
        "title": view.title,
        "text": view.text,
        "note": view.note,
        "tokens": list(view.tokens),
        "labels": [token_label(t) for t in view.tokens],
        "layers": [
            {"name": layer.name, "heads": list(layer.heads), "weights": [rows(h) for h in layer.weights.float()]}
            for layer in view.layers
        ],
    }


def render_html(view: AttentionView) -> str:
    """The page as a string: inline CSS and JS, the data as JSON, no network access at all."""
    return (
        _HTML_TEMPLATE.replace("__TITLE__", html.escape(view.title or "attention"))
        .replace("__CSS__", _CSS)
        .replace("__JS__", _JS)
        .replace("__DATA__", _json_for_script(view_to_dict(view)))
    )


def save_html(view: AttentionView, path: str | os.PathLike) -> Path:
    """Write :func:`render_html` atomically to ``path``."""
    page = render_html(view)
    atomic_write_text(path, page)
    return Path(path)


_HTML_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; \
script-src 'unsafe-inline'; img-src data:">
<title>__TITLE__ · attnlab</title>
<style>__CSS__</style>
</head>
<body>
<header>
  <h1 id="title"></h1>
  <p id="note" class="note"></p>
</header>
<section class="controls" aria-label="choose what to show">
  <label>Layer <select id="layer-select"></select></label>
  <label>Head <select id="head-select"></select></label>
  <fieldset>
    <legend>Hovering a token shows</legend>
    <label><input type="radio" name="direction" value="row" checked> where it attends</label>
    <label><input type="radio" name="direction" value="col"> who attends to it</label>
  </fieldset>
  <label><input type="checkbox" id="stretch"> stretch colours to this head's largest weight</label>
</section>
<section aria-label="tokens">
  <div id="tokens" class="tokens"></div>
  <p id="readout" class="readout">Hover over (or tab to) a token to see where it attends.</p>
</section>
<main class="panes">
  <section class="pane">
    <h2 id="matrix-title"></h2>
    <div id="matrix" class="matrix" role="grid"></div>
    <div class="legend"><span>0</span><span class="bar"></span><span id="legend-max">1</span></div>
  </section>
  <section class="pane">
    <h2>All heads <small>(click one to select it)</small></h2>
    <div id="thumbs" class="thumbs"></div>
  </section>
</main>
<footer>Made by <code>attnlab viz</code>. Weights come from the model's own
<code>return_weights=True</code> path. Rows are queries, columns are keys.</footer>
<script type="application/json" id="attn-data">__DATA__</script>
<script>__JS__</script>
</body>
</html>
"""

_CSS = """
:root { --ink: #1f2933; --muted: #616e7c; --line: #d9dee5; --accent: #d9480f; }
* { box-sizing: border-box; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: var(--ink); margin: 0 auto; padding: 1rem 1.5rem 2rem; max-width: 1400px; }
h1 { font-size: 1.4rem; margin: 0.2rem 0; word-break: break-word; }
h2 { font-size: 1.05rem; margin: 0.5rem 0; }
.note, footer, small { color: var(--muted); }
footer { margin-top: 1.5rem; font-size: 0.85rem; }
.controls { display: flex; flex-wrap: wrap; gap: 0.6rem 1.4rem; align-items: center;
            padding: 0.6rem 0; border-bottom: 1px solid var(--line); }
.controls fieldset { border: 1px solid var(--line); border-radius: 6px; padding: 0.1rem 0.6rem 0.3rem; }
.controls legend { font-size: 0.8rem; color: var(--muted); }
select { font: inherit; padding: 0.1rem 0.3rem; }
.tokens { display: flex; flex-wrap: wrap; gap: 4px; margin: 0.8rem 0 0.3rem; }
.tok { position: relative; padding: 0.15rem 0.4rem 0.9rem; border: 1px solid var(--line); border-radius: 4px;
       cursor: default; white-space: pre; font-family: ui-monospace, "DejaVu Sans Mono", monospace;
       background-color: rgb(255, 255, 255); transition: background-color 80ms; }
.tok:focus { outline: 2px solid #3b5bdb; }
.tok.active { border-color: var(--accent); box-shadow: 0 0 0 2px var(--accent); }
.tok .w { position: absolute; left: 0; right: 0; bottom: 0.05rem; font-size: 0.62rem; text-align: center;
          color: var(--muted); font-family: system-ui, sans-serif; }
.readout { min-height: 1.5em; color: var(--muted); margin: 0.2rem 0 0.6rem; }
.panes { display: flex; flex-wrap: wrap; gap: 2rem; align-items: flex-start; }
.pane { flex: 0 1 auto; min-width: 0; }
.matrix { display: grid; gap: 1px; justify-content: start; font-size: 12px;
          font-family: ui-monospace, "DejaVu Sans Mono", monospace; }
.matrix .cell { width: var(--cell); height: var(--cell); font-size: 9px; line-height: var(--cell);
                text-align: center; font-family: system-ui, sans-serif; }
.matrix .cell.on-path { outline: 1px solid var(--accent); outline-offset: -1px; }
.matrix .rlab { text-align: right; padding-right: 4px; white-space: pre; overflow: hidden;
                max-width: 9rem; line-height: var(--cell); }
.matrix .clab { writing-mode: vertical-rl; transform: rotate(180deg); white-space: pre; overflow: hidden;
                max-height: 7rem; text-align: left; width: var(--cell); line-height: var(--cell); }
.matrix .lab.active { color: var(--accent); font-weight: 700; }
.legend { display: flex; gap: 0.4rem; align-items: center; font-size: 0.75rem; color: var(--muted);
          margin-top: 0.4rem; }
.legend .bar { display: inline-block; width: 10rem; height: 0.7rem;
  background: linear-gradient(to right, rgb(255,255,255), rgb(254,227,145), rgb(246,134,56), rgb(190,40,40),
                              rgb(90,10,60)); }
.thumbs { display: grid; gap: 6px; align-items: center; }
.thumbs .rowname { font-size: 0.75rem; color: var(--muted); padding-right: 4px; white-space: nowrap; }
.thumb { border: 2px solid transparent; padding: 0; background: none; cursor: pointer; display: flex;
         flex-direction: column; align-items: center; font: inherit; font-size: 0.65rem; color: var(--muted); }
.thumb canvas { width: 64px; height: 64px; image-rendering: pixelated; border: 1px solid var(--line); }
.thumb.selected { border-color: var(--accent); border-radius: 4px; color: var(--ink); }
"""

# Plain ES2017, no libraries. Everything is built with createElement + textContent: token text is
# never parsed as HTML.
_JS = r"""
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("attn-data").textContent);
  const T = data.tokens.length;
  const $ = (id) => document.getElementById(id);
  const state = { layer: 0, head: 0, query: null, dir: "row", stretch: false };

  // White -> yellow -> orange -> red -> plum: a sequential scale readable in print and for most
  // colour-blind viewers; t in [0, 1].
  const STOPS = [[255, 255, 255], [254, 227, 145], [246, 134, 56], [190, 40, 40], [90, 10, 60]];
  function colour(t) {
    t = Math.min(1, Math.max(0, t || 0)) * (STOPS.length - 1);
    const i = Math.min(STOPS.length - 2, Math.floor(t)), f = t - i;
    const a = STOPS[i], b = STOPS[i + 1];
    return [0, 1, 2].map((k) => Math.round(a[k] + (b[k] - a[k]) * f));
  }
  const css = (rgb) => "rgb(" + rgb.join(", ") + ")";
  const W = () => data.layers[state.layer].weights[state.head];  // (T, T) of the selected head
  function headMax(w) { let m = 0; for (const row of w) for (const v of row) m = Math.max(m, v); return m || 1; }
  const scaleMax = () => (state.stretch ? headMax(W()) : 1);

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // ---- header and selects
  $("title").textContent = data.title || data.text;
  $("note").textContent = data.note;
  document.title = (data.title || "attention") + " · attnlab";
  const layerSel = $("layer-select"), headSel = $("head-select");
  data.layers.forEach((layer, i) => layerSel.appendChild(new Option(layer.name, String(i))));
  function fillHeads() {
    headSel.textContent = "";
    data.layers[state.layer].heads.forEach((h, i) => headSel.appendChild(new Option("head " + h, String(i))));
    headSel.value = String(state.head);
  }

  // ---- token strip
  const tokBox = $("tokens"), tokEls = [];
  data.labels.forEach((label, i) => {
    const t = el("span", "tok", label);
    t.tabIndex = 0;
    t.dataset.index = String(i);
    t.title = JSON.stringify(data.tokens[i]);
    const w = el("span", "w", "");
    t.appendChild(w);
    t.addEventListener("mouseenter", () => setQuery(i));
    t.addEventListener("focus", () => setQuery(i));
    tokBox.appendChild(t);
    tokEls.push({ tok: t, w: w });
  });

  // ---- the selected head's matrix
  const matrix = $("matrix");
  // Long prompts get small cells (the matrix stays about 700 px wide); below 7 px a label could
  // not be read, so the axes go unlabelled and each cell's tooltip names its tokens instead.
  const cellPx = Math.max(3, Math.min(34, Math.floor(700 / Math.max(T, 1))));
  const axisLabel = (j) => (cellPx >= 7 ? data.labels[j] : "");
  matrix.style.setProperty("--cell", cellPx + "px");
  matrix.style.fontSize = Math.min(12, cellPx - 1) + "px";  // labels no taller than a row
  const showNumbers = cellPx >= 30;
  matrix.style.gridTemplateColumns = "auto repeat(" + T + ", " + cellPx + "px)";
  const cells = [], rowLabs = [], colLabs = [];
  matrix.appendChild(el("div", "corner", ""));
  for (let j = 0; j < T; j++) {
    const c = el("div", "lab clab", axisLabel(j));
    colLabs.push(c); matrix.appendChild(c);
  }
  for (let i = 0; i < T; i++) {
    const r = el("div", "lab rlab", axisLabel(i));
    rowLabs.push(r); matrix.appendChild(r);
    const row = [];
    for (let j = 0; j < T; j++) {
      const c = el("div", "cell", "");
      c.dataset.q = String(i); c.dataset.k = String(j);
      c.addEventListener("mouseenter", () => setQuery(state.dir === "row" ? i : j));
      row.push(c); matrix.appendChild(c);
    }
    cells.push(row);
  }

  function drawMatrix() {
    const w = W(), m = scaleMax();
    for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
      const c = cells[i][j];
      c.style.backgroundColor = css(colour(w[i][j] / m));
      c.dataset.weight = w[i][j].toFixed(4);
      if (showNumbers) {  // few tokens: print the weights, as the tutorials do
        c.textContent = w[i][j].toFixed(2);
        c.style.color = w[i][j] / m > 0.55 ? "white" : "#333";
      }
      c.title = data.labels[i] + " \u2192 " + data.labels[j] + ": " + w[i][j].toFixed(4);
    }
    const layer = data.layers[state.layer];
    $("matrix-title").textContent = layer.name + " \u00b7 head " + layer.heads[state.head];
    $("legend-max").textContent = m.toFixed(state.stretch ? 3 : 0);
  }

  // ---- hover: highlight intensity = weight
  function highlight() {
    const w = W(), m = scaleMax(), q = state.query;
    for (let j = 0; j < T; j++) {
      const { tok, w: wl } = tokEls[j];
      tok.classList.toggle("active", j === q);
      if (q === null) {
        tok.style.backgroundColor = "rgb(255, 255, 255)"; tok.dataset.weight = ""; wl.textContent = "";
        continue;
      }
      const v = state.dir === "row" ? w[q][j] : w[j][q];
      tok.style.backgroundColor = css(colour(v / m));
      tok.style.color = v / m > 0.6 ? "white" : "";
      tok.dataset.weight = v.toFixed(4);
      wl.textContent = v.toFixed(2);
    }
    for (let i = 0; i < T; i++) {
      rowLabs[i].classList.toggle("active", state.dir === "row" && i === q);
      colLabs[i].classList.toggle("active", state.dir === "col" && i === q);
      for (let j = 0; j < T; j++)
        cells[i][j].classList.toggle("on-path", q !== null && (state.dir === "row" ? i === q : j === q));
    }
    if (q === null) return;
    const label = JSON.stringify(data.tokens[q]);
    let best = 0;
    for (let j = 1; j < T; j++)
      if ((state.dir === "row" ? w[q][j] : w[j][q]) > (state.dir === "row" ? w[q][best] : w[best][q])) best = j;
    const bv = state.dir === "row" ? w[q][best] : w[best][q];
    const other = JSON.stringify(data.tokens[best]) + " (" + bv.toFixed(3) + ").";
    $("readout").textContent = "Token " + q + " " + label
      + (state.dir === "row" ? " attends most to token " : " is attended most by token ") + best + " " + other;
  }
  function setQuery(i) { state.query = i; highlight(); }

  // ---- thumbnails of every head, one row per layer
  const thumbs = $("thumbs"), thumbEls = [];
  const nCols = Math.max(...data.layers.map((l) => l.heads.length));
  thumbs.style.gridTemplateColumns = "auto repeat(" + nCols + ", auto)";
  data.layers.forEach((layer, li) => {
    thumbs.appendChild(el("div", "rowname", layer.name));
    const row = [];
    layer.heads.forEach((h, hi) => {
      const b = el("button", "thumb", "");
      b.type = "button";
      b.dataset.layer = String(li); b.dataset.head = String(hi);
      b.title = layer.name + " \u00b7 head " + h;
      const cv = document.createElement("canvas");
      cv.width = T; cv.height = T;
      const ctx = cv.getContext("2d"), img = ctx.createImageData(T, T), w = layer.weights[hi];
      for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
        const rgb = colour(w[i][j]), p = 4 * (i * T + j);
        img.data[p] = rgb[0]; img.data[p + 1] = rgb[1]; img.data[p + 2] = rgb[2]; img.data[p + 3] = 255;
      }
      ctx.putImageData(img, 0, 0);
      b.appendChild(cv);
      b.appendChild(el("span", "", "head " + h));
      b.addEventListener("click", () => select(li, hi));
      row.push(b); thumbs.appendChild(b);
    });
    for (let k = layer.heads.length; k < nCols; k++) thumbs.appendChild(el("div", "", ""));
    thumbEls.push(row);
  });

  function select(layer, head) {
    const layerChanged = layer !== state.layer;
    state.layer = layer;
    state.head = Math.min(head, data.layers[layer].heads.length - 1);
    layerSel.value = String(state.layer);
    if (layerChanged || headSel.options.length === 0) fillHeads();
    headSel.value = String(state.head);
    thumbEls.forEach((row, li) => row.forEach((b, hi) =>
      b.classList.toggle("selected", li === state.layer && hi === state.head)));
    drawMatrix();
    highlight();
  }

  layerSel.addEventListener("change", () => select(Number(layerSel.value), state.head));
  headSel.addEventListener("change", () => select(state.layer, Number(headSel.value)));
  document.querySelectorAll('input[name="direction"]').forEach((r) =>
    r.addEventListener("change", () => { state.dir = r.value; highlight(); }));
  $("stretch").addEventListener("change", (e) => { state.stretch = e.target.checked; drawMatrix(); highlight(); });

  select(0, 0);
  document.body.dataset.ready = "1";
})();
"""


# --------------------------------------------------------------------------------------------
# Text output (no --out): numbers in the terminal, as the tutorials print them
# --------------------------------------------------------------------------------------------
def format_text(view: AttentionView, width: int = 80) -> str:
    """The weights as tables when they fit ``width`` columns, otherwise each query's strongest key."""
    T = len(view.tokens)
    labels = [token_label(t) for t in view.tokens]
    lw = min(10, max(len(s) for s in labels))
    fits = lw + 1 + 7 * T <= width
    lines = [view.title, ""]
    for layer in view.layers:
        for h, w in zip(layer.heads, layer.weights, strict=True):
            lines.append(f"{layer.name} · head {h}  (rows: queries, columns: keys)")
            if fits:
                lines.append(" " * (lw + 1) + "".join(f"{s[:6]:>7}" for s in labels))
                for i in range(T):
                    lines.append(f"{labels[i][:lw]:>{lw}} " + "".join(f"{float(v):7.4f}" for v in w[i]))
            else:
                for i in range(T):
                    j = int(w[i].argmax())
                    lines.append(f"  {i:>4} {labels[i][:12]:<12} -> {j:>4} {labels[j][:12]:<12} {float(w[i, j]):.3f}")
            lines.append("")
    return "\n".join(lines)


def _token_strings(tokenizer: object, ids: Sequence[int]) -> list[str]:
    """Each id decoded on its own. A byte that is only part of a UTF-8 character is shown as ``\\xNN``."""
    out = []
    for i in ids:
        s = tokenizer.decode([i])
        if s == "\ufffd" and getattr(tokenizer, "name", "") == "byte":
            s = f"\\x{i:02x}"
        out.append(s)
    return out


def load_model_view(checkpoint: str | os.PathLike, prompt: str, *, bpe_dir: str | None = None) -> AttentionView:
    """Load a checkpoint directory and view its attention on ``prompt``."""
    loaded = load_model(checkpoint, bpe_dir=bpe_dir)
    model, tokenizer = loaded.model, loaded.tokenizer
    ids = list(tokenizer.encode(prompt))
    ctx = getattr(getattr(model, "config", None), "context_length", None)
    if ctx is not None and len(ids) > ctx:
        raise ValueError(f"--prompt is {len(ids)} tokens long, more than the model's context_length={ctx}; shorten it")
    return model_view(model, ids, _token_strings(tokenizer, ids), title=prompt, text=prompt)
