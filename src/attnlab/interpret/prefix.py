"""Tracing a prompt that begins like one traced before: only its new tokens run.

While a reader types, each prompt is the last one with a few characters added or removed at the
end, so their token ids share a long prefix. In causal attention the rows of that prefix do not
change when later tokens come: query ``i`` sees keys ``0..i`` only. :func:`retrace` therefore keeps,
with each attention trace, the keys and values of its tokens (one :class:`~attnlab.attention.KVCache`
per layer), and for the next prompt runs the model on the tokens after the shared prefix alone, over
those keys and values, the way generation decodes: the new queries' attention rows ``(new, total)``
are recorded, the cached rows are copied. The result is what :func:`~attnlab.interpret.trace` with
``stages=False, logits=False`` returns on the whole prompt, up to float rounding (the kernels sum
in another order when the shapes differ), checked by the tests against a fresh trace.

    kept = retrace(model, ids)                   # a full pass, keys and values kept
    kept = retrace(model, ids_after_edit, kept)  # only the tokens after the shared prefix run
    kept.trace.weights                           # (L, B, H, T, T), as trace(...) would give
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.attention import KVCache
from attnlab.checks import broadcast_shape
from attnlab.interpret.hooks import HookPoint, attention_layers, eval_mode, hooks
from attnlab.interpret.tracing import Trace, full_mask, stop_before_head

__all__ = ["KeptTrace", "retrace", "shared_prefix"]


@dataclass
class KeptTrace:
    """An attention trace and what it takes to extend it.

    Attributes:
        trace: as :func:`~attnlab.interpret.trace` with ``stages=False, logits=False`` returns it:
            ``weights (L, B, H, T, T)`` float32, ``logits`` None.
        caches: one plain :class:`~attnlab.attention.KVCache` per layer holding the keys and values of
            the ``T`` tokens (slot ``j`` = token ``j``); :func:`retrace` copies what it reuses, so a kept
            trace can be extended any number of times.
        reused: the leading positions taken from the trace it extended (0: all ``T`` ran).
    """

    trace: Trace
    caches: list[KVCache]
    reused: int = 0


def shared_prefix(a: Tensor, b: Tensor) -> int:
    """How many leading positions two ``(B, T)`` id tensors agree on in every row (0 when their
    batch sizes differ)."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        return 0
    n = min(a.shape[1], b.shape[1])
    differ = (a[:, :n] != b[:, :n].to(a.device)).any(dim=0).nonzero()  # positions where some row differs
    return int(differ[0]) if differ.numel() else n


def retrace(model: nn.Module, idx: Tensor, kept: KeptTrace | None = None, *, tokenizer: object = None) -> KeptTrace:
    """``trace(model, idx, stages=False, logits=False)``, reusing what ``kept`` shares with ``idx``.

    Args:
        model: an attnlab :class:`~attnlab.GPT` (the model ``kept`` was traced with).
        idx: ``(B, T)`` or ``(T,)`` token ids, no padding.
        kept: an earlier result of :func:`retrace` on the same model, or None (a full pass). Where its
            ids and ``idx`` share a prefix of ``P`` positions and every layer is causal, the model runs
            on the ``T - P`` tokens after it only (none when ``idx`` is a prefix of the kept ids).
        tokenizer: kept with the trace (labels in Jupyter), as :func:`~attnlab.interpret.trace`.
    Returns:
        A :class:`KeptTrace` of ``idx`` (``reused = P``); ``kept`` is left as it was. The model's
        training mode and hooks are as they were afterwards, even after an error.
    """
    layers = attention_layers(model)
    if kept is not None and not isinstance(kept, KeptTrace):
        raise TypeError(f"kept must be a KeptTrace from retrace(), or None, got {type(kept).__name__}")
    if kept is not None and kept.trace.model is not model:
        raise ValueError("kept is a trace of another model: retrace reuses keys and values of the same model only")
    if isinstance(idx, Tensor) and idx.dim() == 1:
        idx = idx.unsqueeze(0)  # (1, T)
    if hasattr(model, "check_idx"):
        idx = model.check_idx(idx)
    B, T = idx.shape
    # Causal attention leaves the rows of a shared prefix as they were; a bidirectional layer would not.
    P = 0 if kept is None or not all(a.causal for a in layers) else shared_prefix(kept.trace.idx, idx)
    if P == T:  # idx is a prefix of the kept ids: nothing to run
        return _truncated(kept, idx, tokenizer)
    L, old = len(layers), None if kept is None else kept.trace
    caches = [a.new_kv_cache(B, T) for a in layers]  # plain caches: slot j holds token j
    for cache, before in zip(caches, kept.caches if P else (), strict=False):
        cache.update(before.keys[:, :, :P], before.values[:, :, :P], before.positions[:, :P])
    weights: list[Tensor] = []  # one (L, B, H, T, T) float32 tensor, filled as the layers reach hook_pattern
    records: list[tuple | None] = [None] * L  # per layer: (mask, is_causal, scale, softcap)

    def on_pattern(pattern: Tensor, hook: HookPoint) -> None:
        i, call = hook.layer(), hook.call
        if records[i] is not None:
            raise RuntimeError(f"layer {i} attended twice in one forward pass; retrace expects one call per layer")
        w = pattern.detach()  # (B, H, T - P, T): the new queries' rows over every key
        if not weights:
            weights.append(torch.empty((L, B, w.shape[1], T, T), dtype=torch.float32, device=w.device))
            if P:
                weights[0][..., :P, :P] = old.weights[..., :P, :P]  # the shared rows, unchanged
                weights[0][..., :P, P:] = 0.0  # causal: no earlier query sees a new key
        weights[0][i, :, :, P:].copy_(w)
        records[i] = (full_mask(call, T - P, T, w.device), bool(call.is_causal), float(call.scale), call.softcap)

    fns = {f"blocks.{i}.attn.hook_pattern": on_pattern for i in range(L)}
    with eval_mode(model), torch.no_grad(), hooks(model, fns), stop_before_head(model):  # no logits needed
        model(idx[:, P:], kv_caches=caches)
    missing = [i for i, r in enumerate(records) if r is None]
    if missing:
        raise RuntimeError(f"layers {missing} reported no attention during the forward pass")
    masks = [r[0] for r in records]
    if P:
        masks = [_joined(before, m, P, T) for before, m in zip(old.masks, masks, strict=True)]
    out = Trace(
        idx=idx,
        weights=weights[0],
        logits=None,
        scale=[r[2] for r in records],
        is_causal=[r[1] for r in records],
        masks=[None if m is None else m.detach() for m in masks],
        softcaps=[r[3] for r in records],
        model=model,
        tokenizer=tokenizer,
    )
    return KeptTrace(out, caches, P)


def _truncated(kept: KeptTrace, idx: Tensor, tokenizer: object) -> KeptTrace:
    """``kept`` cut to its first ``T`` tokens (``idx``, a prefix of its ids)."""
    T, old = idx.shape[1], kept.trace
    caches = []
    for a, before in zip(attention_layers(old.model), kept.caches, strict=True):
        cache = a.new_kv_cache(idx.shape[0], T)
        cache.update(before.keys[:, :, :T], before.values[:, :, :T], before.positions[:, :T])
        caches.append(cache)
    out = Trace(
        idx=idx,
        weights=old.weights[..., :T, :T].clone(),
        logits=None,
        scale=list(old.scale),
        is_causal=list(old.is_causal),
        masks=[None if m is None else m[..., :T, :T] for m in old.masks],
        softcaps=None if old.softcaps is None else list(old.softcaps),
        model=old.model,
        tokenizer=tokenizer,
    )
    return KeptTrace(out, caches, T)


def _joined(before: Tensor | None, new: Tensor | None, P: int, T: int) -> Tensor | None:
    """A layer's mask over the whole prompt, ``(..., T, T)``: the kept trace's rows ``[:P]`` (over
    its keys ``[:P]``), then the new queries' rows over every key. Above the diagonal of the shared
    rows, which causal attention never reads, it holds False (a bool mask) or -inf (a bias)."""
    if before is None and new is None:
        return None
    ref = new if new is not None else before
    allow = torch.ones((1, 1), dtype=torch.bool, device=ref.device)  # a missing mask masks nothing
    before = (allow if before is None else before)[..., :P, :P]
    new = allow if new is None else new
    if before.dtype != new.dtype:  # (the same layer gives the same kind of mask on every pass)
        raise RuntimeError(f"a layer's mask changed kind between passes: {before.dtype} then {new.dtype}")
    lead = broadcast_shape(tuple(before.shape[:-2]), tuple(new.shape[:-2]))
    if lead is None:
        raise RuntimeError(f"a layer's masks do not broadcast: {tuple(before.shape)} and {tuple(new.shape)}")
    before = before.expand(*lead, P, P)
    new = new.expand(*lead, T - P, T)
    fill = False if new.dtype == torch.bool else float("-inf")
    upper = torch.full((*lead, P, T - P), fill, dtype=new.dtype, device=new.device)
    return torch.cat([torch.cat([before, upper], dim=-1), new], dim=-2)  # (..., T, T)
