"""What ``attnlab viz`` shows: attention weights captured from a model, per layer and head.

Every weight comes out of the model through the library's own ``return_weights=True`` path
(:func:`attnlab.functional.scaled_dot_product_attention`): there is no second implementation of
attention here, so what is shown is what the model computed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch import Tensor

from attnlab import attention as _attention
from attnlab.attention import MultiHeadAttention
from attnlab.interpret import AttentionRecord, HookPoint, attention_hooks, record_module, token_label
from attnlab.interpret.hooks import eval_mode
from attnlab.interpret.inspector import resolve_index
from attnlab.tools.loading import load_demo

__all__ = [
    "ATTENTION_TYPES",
    "AttentionView",
    "LayerMaps",
    "attention_maps",
    "capture_attention",
    "demo_view",
    "model_view",
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


# -- Data: what is drawn ---------------------------------------------------------------------
@dataclass
class LayerMaps:
    """One row of the grid: the attention weights of one attention module."""

    name: str  # row title ("layer 3", "MultiHeadAttention (seed 123)")
    weights: Tensor  # (H, T, S): row i = where query token i attends
    heads: list[int] = field(default_factory=list)  # each head's original index (after --head selection)

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
    """Everything a picture needs: a title, the token labels and the weights per layer."""

    title: str
    tokens: list[str]  # T token strings as the model saw them (labelled by token_label)
    layers: list[LayerMaps]  # one per row, each with T queries and T keys
    text: str = ""  # the original text (shown verbatim in the HTML page)
    note: str = ""  # one line saying where the weights come from
    # The tutorials' modules: one record per layer (queries, keys, values...), so the page shows their steps.
    records: list[AttentionRecord] | None = None

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
            rows = [resolve_index("--layer", i, len(self.layers)) for i in layers]
        out, kept = [], []
        for r in rows:
            layer = self.layers[r]
            if heads is not None:
                n = layer.weights.shape[0]
                if len(rows) > 1 and any(not -n <= h < n for h in heads):
                    continue  # rows with fewer heads (the tutorial view mixes 1- and 2-head modules)
                idx = [resolve_index("--head", h, n) for h in heads]
                layer = LayerMaps(layer.name, layer.weights[idx], [layer.heads[i] for i in idx])
            out.append(layer)
            kept.append(r)
        if not out:
            most = max(layer.weights.shape[0] for layer in self.layers)
            raise ValueError(f"--head {list(heads or [])}: no selected layer has that head (at most {most} heads)")
        # A record per kept row; its heads are picked by the row's LayerMaps.heads.
        records = None if self.records is None else [self.records[r] for r in kept]
        return AttentionView(self.title, self.tokens, out, self.text, self.note, records)


# -- Capturing attention from a model --------------------------------------------------------
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

    A :class:`~attnlab.MultiHeadAttention` hands the weights it applied at its ``pattern`` hook point
    (:func:`attnlab.interpret.attention_hooks`); the other modules get a pre-hook that turns on
    ``return_weights=True`` and a hook that takes the weights off again, so the model sees the output
    it would without them. Weights are appended in call order, detached; the hooks go on exit.
    """
    modules = _attention_modules(model)
    if not modules:
        raise ValueError(
            f"model ({type(model).__name__}) contains no attnlab attention module "
            f"({', '.join(t.__name__ for t in ATTENTION_TYPES)}), so there is no attention to show"
        )
    captured: list[Tensor] = []
    caller_wanted: dict[int, list[bool]] = {}

    def keep(pattern: Tensor, hook: HookPoint) -> None:
        captured.append(pattern.detach())

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        caller_wanted.setdefault(id(module), []).append(bool(kwargs.get("return_weights", False)))
        return args, {**kwargs, "return_weights": True}

    def post_hook(module: nn.Module, args: tuple, kwargs: dict, output: tuple[Tensor, Tensor]):
        out, weights = output
        captured.append(weights.detach())
        return output if caller_wanted[id(module)].pop() else out

    # A MultiHeadAttention's pattern is a hook point (a GPT calls attend() directly, past forward hooks);
    # the single-head modules and the wrapper are called through forward.
    hooked = [m for m in modules if isinstance(m, MultiHeadAttention)]
    handles = []
    try:
        with attention_hooks(hooked, {"pattern": keep}):
            for m in modules:
                if not isinstance(m, MultiHeadAttention):
                    handles.append(m.register_forward_pre_hook(pre_hook, with_kwargs=True))
                    handles.append(m.register_forward_hook(post_hook, with_kwargs=True))
            yield captured
    finally:
        for h in handles:
            h.remove()


def attention_maps(model: nn.Module, idx: Tensor, **forward_kwargs) -> list[Tensor]:
    """Run ``model(idx)`` once in eval mode and return each attention module's weights.

    ``model``: any module containing attnlab attention modules; ``idx``: its input (for a GPT, token
    ids ``(T,)`` or ``(B, T)``). Returns one tensor per attention call, in call order (= layer order):
    ``(H, T, S)`` for 1-D integer ``idx`` (single-head modules: ``H = 1``), else as the modules return
    them (``(B, H, T, S)`` for multi-head ones). The model's training flag is restored afterwards.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(idx, Tensor):
        raise TypeError(f"idx must be a torch.Tensor, got {type(idx).__name__}")
    single = idx.dim() == 1 and not idx.is_floating_point()
    x = idx.unsqueeze(0) if single else idx
    with eval_mode(model), torch.no_grad(), capture_attention(model) as captured:
        model(x, **forward_kwargs)
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


# -- The two views: the tutorials' example and a trained GPT ---------------------------------
def demo_view() -> AttentionView:
    """The six words of "A simple self-attention mechanism" through its modules, under its seeds.

    One row per module of :func:`attnlab.tools.loading.load_demo`. The global RNG is left as it was.
    """
    demo = load_demo()
    records = [record_module(module, demo.inputs) for _, module in demo.modules]
    layers = [LayerMaps(name, rec.weights[0]) for (name, _), rec in zip(demo.modules, records, strict=True)]
    note = 'The six 3-d word embeddings of "A simple self-attention mechanism", through its modules '
    note += "under the tutorial's seeds (row = query word, column = the word it attends to)."
    text = " ".join(demo.words)
    return AttentionView("Your journey starts with one step", list(demo.words), layers, text, note, records)


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
    note = f"{type(model).__name__}: {len(layers)} layers x {layers[0].weights.shape[0]} heads, {len(ids)} tokens "
    note += "(row = query token, column = the token it attends to)."
    return AttentionView(title=title or text, tokens=list(tokens), layers=layers, text=text, note=note)
