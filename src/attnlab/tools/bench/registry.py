"""The competitors: every attention implementation the benchmarks time, under one set of names.

:data:`IMPLEMENTATIONS` maps a name to an :class:`Impl` (how to build it, what it computes, which
competitor it must agree with); the same names serve ``attnlab bench``, ``benchmarks/attention.py``
and the memory probe's subprocess, which builds through :func:`build_module`.

Layers map ``x (b, T, d_model) -> (b, T, d_model)`` (the wrappers: ``(b, T, num_heads * head_dim)``,
the same width); the ``*-core`` entries take packed ``q, k, v (b, T, 3 * d_model)`` and return the
per-head context ``(b, num_heads, T, d_model // num_heads)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "IMPLEMENTATIONS",
    "AttentionCore",
    "Impl",
    "TorchCausalMHA",
    "TutorialLoopAttention",
    "build_competitors",
    "build_module",
    "max_abs_difference",
    "share_weights",
]


class TutorialLoopAttention(nn.Module):
    """The tutorials' first attention, as loops: one head of width ``d``, causal.

    "A simple self-attention mechanism" computes each score as ``torch.dot(x_i, query)`` in a Python
    loop, a softmax, then sums ``weight_j * value_j`` in another loop; this does that for every query
    (with trainable ``W_query``/``W_key``/``W_value`` and the ``1/sqrt(d)`` scaling), so it computes
    the tutorial's ``CausalAttention`` in ``O(T^2)`` interpreter steps.

    Shapes: ``x (b, T, d_in)`` -> ``(b, T, d_out)``.
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        queries, keys, values = self.W_query(x), self.W_key(x), self.W_value(x)  # (b, T, d_out) each
        scale = keys.shape[-1] ** -0.5
        batches = []
        for b in range(x.shape[0]):
            rows = []
            for i in range(x.shape[1]):
                scores = torch.stack([torch.dot(queries[b, i], keys[b, j]) for j in range(i + 1)])  # (i+1,)
                weights = torch.softmax(scores * scale, dim=0)  # (i+1,)
                context = torch.zeros_like(values[b, 0])  # (d_out,)
                for j in range(i + 1):
                    context = context + weights[j] * values[b, j]
                rows.append(context)
            batches.append(torch.stack(rows))  # (T, d_out)
        return torch.stack(batches)  # (b, T, d_out)


class TorchCausalMHA(nn.Module):
    """``torch.nn.MultiheadAttention`` as a causal self-attention layer ``x -> y``.

    ``need_weights=False`` and ``is_causal=True`` with the matching ``attn_mask`` (the hint needs the
    mask too) let torch route to its fused kernel; ``bias`` covers the input and output projections.

    Shapes: ``x (b, n, d_model)`` -> ``(b, n, d_model)``.
    """

    def __init__(self, d_model: int, num_heads: int, context_length: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.mha = nn.MultiheadAttention(d_model, num_heads, dropout=dropout, bias=bias, batch_first=True)
        self.context_length = context_length
        self._mask: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[-2]
        # torch's convention is the opposite of attnlab's: True = may NOT attend.
        if self._mask is None or self._mask.shape[0] != n or self._mask.device != x.device:
            self._mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)  # (n, n)
        return self.mha(x, x, x, need_weights=False, attn_mask=self._mask, is_causal=True)[0]  # (b, n, d)


class AttentionCore(nn.Module):
    """Causal multi-head attention without projections: packed ``q, k, v`` in, context out.

    Isolates what the implementations differ in. ``impl``: ``"attnlab"`` (its functional core),
    ``"torch"`` (``F.scaled_dot_product_attention``) or ``"tutorial"`` (explicit scores, their
    ``triu`` mask buffer, softmax of scaled scores, ``@ V``).

    Shapes: ``qkv (b, n, 3 * d_model)`` -> ``(b, num_heads, n, d_model // num_heads)``.
    """

    def __init__(self, d_model: int, num_heads: int, context_length: int, impl: str) -> None:
        super().__init__()
        if impl not in ("attnlab", "torch", "tutorial"):
            raise ValueError(f"impl must be 'attnlab', 'torch' or 'tutorial', got {impl!r}")
        self.num_heads, self.head_dim, self.impl = num_heads, d_model // num_heads, impl
        if impl == "tutorial":
            self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, qkv: Tensor) -> Tensor:
        from attnlab.functional import scaled_dot_product_attention

        b, n, _ = qkv.shape
        q, k, v = qkv.view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # each (b, H, n, hd)
        if self.impl == "attnlab":
            return scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, H, n, hd)
        if self.impl == "torch":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, H, n, hd)
        # The tutorials' steps, as written in their MultiHeadAttention.forward.
        attn_scores = q @ k.transpose(2, 3)  # (b, H, n, n)
        attn_scores.masked_fill_(self.mask.bool()[:n, :n], -torch.inf)
        attn_weights = torch.softmax(attn_scores / k.shape[-1] ** 0.5, dim=-1)  # (b, H, n, n)
        return attn_weights @ v  # (b, H, n, hd)


# -- The registry ----------------------------------------------------------------------------
# Builders: (d_model, num_heads, context_length, dropout) -> module. The library's modules are
# imported on first use, so listing the competitors costs nothing.
def _multi_head(module: str, wrapper: bool = False) -> Callable[..., nn.Module]:
    """``module``'s ``MultiHeadAttention`` (or ``MultiHeadAttentionWrapper`` of ``d_model // num_heads``-wide
    heads): attnlab.attention and attnlab.tutorial_code name and order their arguments alike."""

    def build(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
        classes = importlib.import_module(module)
        if wrapper:
            return classes.MultiHeadAttentionWrapper(d_model, d_model // num_heads, context_length, dropout, num_heads)
        return classes.MultiHeadAttention(d_model, d_model, context_length, dropout, num_heads)

    return build


def _tutorial_matrix(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
    from attnlab.tutorial_code import CausalAttention

    return CausalAttention(d_model, d_model, context_length, dropout)


def _tutorial_loop(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
    return TutorialLoopAttention(d_model, d_model)  # no dropout, no mask buffer: it only loops j <= i


def _torch(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
    return TorchCausalMHA(d_model, num_heads, context_length, dropout)


def _core(impl: str) -> Callable[..., nn.Module]:
    def build(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
        if dropout:
            raise ValueError("the attention-core competitors have no dropout; pass dropout=0.0")
        return AttentionCore(d_model, num_heads, context_length, impl)

    return build


@dataclass(frozen=True)
class Impl:
    """One competitor: how to build it, what it computes, and what it must agree with."""

    label: str
    build: Callable[..., nn.Module]
    projections: int  # d x d matmuls applied to the tokens (Q, K, V, any output projection; 0: a core)
    one_head: bool = False  # a single head of width d instead of num_heads heads
    explicit_scores: bool = False  # materialises every head's (T, T) scores (the tutorials' limit)
    reference: str | None = None  # the competitor computing the same function (None: it is one)

    def flops(self, batch: int, seq_len: int, d_model: int) -> float:
        """Floating-point operations of one forward, counting every matmul densely.

        Each projection ``2*B*T*d*d``; scores and weighted sum ``2 * 2*B*T^2*d`` (no implementation
        here skips the causal half); forward+backward is about ``3x`` this.
        """
        B, T, d = batch, seq_len, d_model
        return 2.0 * B * T * d * d * self.projections + 4.0 * B * T * T * d

    def score_bytes(self, batch: int, seq_len: int, num_heads: int, itemsize: int = 4) -> int:
        """What the forward holds at once in ``(T, T)`` tensors: 0 for the fused/looping ones; for the
        explicit ones scores, scaled scores and weights, three ``(batch, heads, T, T)`` tensors that
        coexist inside ``softmax(scores / s)``."""
        if not self.explicit_scores:
            return 0
        return 3 * batch * (1 if self.one_head else num_heads) * seq_len * seq_len * itemsize


IMPLEMENTATIONS: dict[str, Impl] = {
    "tutorial-loop": Impl(
        "tutorial loop (1 head, per-token Python loops)", _tutorial_loop, 3, one_head=True, reference="tutorial-matrix"
    ),
    "tutorial-matrix": Impl(
        "tutorial CausalAttention (1 head, matrix form)", _tutorial_matrix, 3, one_head=True, explicit_scores=True
    ),
    "tutorial-wrapper": Impl(
        "tutorial MultiHeadAttentionWrapper (stacked heads)",
        _multi_head("attnlab.tutorial_code", wrapper=True),
        3,
        explicit_scores=True,
        reference="attnlab-wrapper",
    ),
    "tutorial": Impl(
        "tutorial MultiHeadAttention (weight split)",
        _multi_head("attnlab.tutorial_code"),
        4,
        explicit_scores=True,
        reference="attnlab",
    ),
    "attnlab": Impl("attnlab.MultiHeadAttention", _multi_head("attnlab.attention"), 4),
    "torch": Impl("torch.nn.MultiheadAttention", _torch, 4, reference="attnlab"),
    "attnlab-wrapper": Impl("attnlab.MultiHeadAttentionWrapper", _multi_head("attnlab.attention", wrapper=True), 3),
    # Attention only (input: packed q, k, v of shape (b, T, 3 * d_model)).
    "attnlab-core": Impl("attnlab scaled_dot_product_attention", _core("attnlab"), 0),
    "torch-core": Impl("torch F.scaled_dot_product_attention", _core("torch"), 0, reference="attnlab-core"),
    "tutorial-core": Impl(
        "tutorial scores/mask/softmax/@V", _core("tutorial"), 0, explicit_scores=True, reference="attnlab-core"
    ),
}


def build_module(spec: str, /, **kwargs: object) -> nn.Module:
    """Build an :data:`IMPLEMENTATIONS` name, or an importable ``"package.module:callable"``, from ``kwargs``
    (for the registry: ``d_model``, ``num_heads``, ``context_length``, optionally ``dropout``)."""
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str, got {type(spec).__name__}")
    if spec in IMPLEMENTATIONS:
        return IMPLEMENTATIONS[spec].build(**kwargs)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(
            f"unknown implementation {spec!r}: spec must be one of {', '.join(IMPLEMENTATIONS)} "
            "or 'package.module:callable'"
        )
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec!r} is not callable")
    return obj(**kwargs)


@torch.no_grad()
def share_weights(source: nn.Module, target: nn.Module) -> None:
    """Copy an attention layer's weights into another implementation of the same function.

    Knows the attnlab/tutorial layout (``W_query``/``W_key``/``W_value``, ``out_proj``), the wrapper's
    (``heads[i].W_*``) and :class:`TorchCausalMHA`'s (packed ``in_proj_weight``). A bias the source
    lacks is zeroed in the target; a non-zero bias or output projection the target lacks is a
    ValueError (they could not compute the same function).
    """
    names = ("W_query", "W_key", "W_value")

    def params(m: nn.Module) -> tuple[list[Tensor], list[Tensor | None], nn.Module | None]:
        """([Wq, Wk, Wv] as (out, in)), [bq, bk, bv], the output projection (None: none)."""
        if isinstance(m, TorchCausalMHA):
            b = m.mha.in_proj_bias
            bs = [None] * 3 if b is None else list(b.chunk(3))
            return list(m.mha.in_proj_weight.chunk(3)), bs, m.mha.out_proj
        if hasattr(m, "heads"):
            ws = [torch.cat([getattr(h, n).weight for h in m.heads]) for n in names]
            has_bias = getattr(m.heads[0], names[0]).bias is not None
            return ws, [torch.cat([getattr(h, n).bias for h in m.heads]) if has_bias else None for n in names], None
        return [getattr(m, n).weight for n in names], [getattr(m, n).bias for n in names], getattr(m, "out_proj", None)

    def put(dst: Tensor | None, src: Tensor | None) -> None:
        if dst is None and src is not None and bool(src.any()):
            raise ValueError(
                f"share_weights: the source {type(source).__name__} has a non-zero bias that the target "
                f"{type(target).__name__} lacks, so they cannot compute the same function"
            )
        if dst is not None and src is None:
            dst.zero_()
        elif dst is not None:
            dst.copy_(src)

    ws, bs, src_out = params(source)
    if isinstance(target, TorchCausalMHA):
        target.mha.in_proj_weight.copy_(torch.cat(ws))
        if target.mha.in_proj_bias is not None:
            for dst, src in zip(target.mha.in_proj_bias.chunk(3), bs, strict=True):
                put(dst, src)
        dst_out = target.mha.out_proj
    elif hasattr(target, "heads"):
        hd = ws[0].shape[0] // len(target.heads)
        for i, h in enumerate(target.heads):
            rows = slice(i * hd, (i + 1) * hd)
            for n, w, b in zip(names, ws, bs, strict=True):
                getattr(h, n).weight.copy_(w[rows])
                put(getattr(h, n).bias, None if b is None else b[rows])
        dst_out = None
    else:
        for n, w, b in zip(names, ws, bs, strict=True):
            getattr(target, n).weight.copy_(w)
            put(getattr(target, n).bias, b)
        dst_out = getattr(target, "out_proj", None)
    if (src_out is None) != (dst_out is None):
        raise ValueError(
            f"share_weights: one of {type(source).__name__} and {type(target).__name__} has an output projection "
            "and the other has none, so they cannot compute the same function"
        )
    if dst_out is not None:
        dst_out.weight.copy_(src_out.weight)
        put(dst_out.bias, src_out.bias)


@torch.no_grad()
def max_abs_difference(modules: Mapping[str, nn.Module], x: Tensor) -> dict[str, float]:
    """Largest ``|y_name - y_first|`` of each module's forward against the first module's."""
    outs = {name: m(x) for name, m in modules.items()}
    first = next(iter(outs.values()))
    return {name: float((y - first).abs().max()) for name, y in outs.items()}


def build_competitors(
    names: Iterable[str], x: Tensor, **kwargs: object
) -> tuple[dict[str, nn.Module], dict[str, float]]:
    """Build ``names`` from ``kwargs``, give each its reference's weights and check they agree on ``x``.

    A reference not among ``names`` is built for the check only. Returns ``(modules, diffs)``: name ->
    module in the given order, and each one's largest ``|y - y_reference|`` on ``x`` (``(b, T, d_model)``,
    packed ``(b, T, 3 * d_model)`` for the cores).
    """
    modules = {name: build_module(name, **kwargs) for name in names}
    diffs = {}
    for name, module in modules.items():
        ref_name = IMPLEMENTATIONS[name].reference
        if ref_name is None:
            continue
        ref = modules.get(ref_name) or build_module(ref_name, **kwargs)
        if IMPLEMENTATIONS[name].projections:  # the cores have no weights
            share_weights(ref, module)
        diffs[name] = max_abs_difference({ref_name: ref, name: module}, x)[name]
    return modules, diffs
