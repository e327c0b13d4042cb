"""Functional core of attnlab: attention as plain functions on tensors.

Every module in :mod:`attnlab.attention` is a thin wrapper over these functions.
Argument names and conventions follow :func:`torch.nn.functional.scaled_dot_product_attention`:

* a **boolean** mask means ``True`` = *may attend*; a **float** mask is *added* to the scores;
* ``scale`` defaults to ``1 / sqrt(E)`` where ``E`` is the query/key width;
* shapes are ``query (..., L, E)``, ``key (..., S, E)``, ``value (..., S, Ev)`` -> ``(..., L, Ev)``.

Where attnlab goes beyond torch (bottom-right causal alignment, ``is_causal`` together with a mask,
zero output for query rows with nothing to attend, returning the applied weights) the docstrings
say so.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.checks import (
    broadcast_shape,
    check_attn_mask,
    check_float_tensor,
    check_same_dtype_and_device,
    finite_real,
    is_bool,
    is_int,
    is_real,
)

__all__ = [
    "attend",
    "attention_scores",
    "causal_mask",
    "padding_mask",
    "scaled_dot_product_attention",
    "simple_self_attention",
]

Backend = Literal["auto", "fused", "reference"]


def causal_mask(
    q_len: int,
    k_len: int | None = None,
    *,
    device: torch.device | str | None = None,
) -> Tensor:
    """Boolean causal mask of shape ``(q_len, k_len)``, ``True`` = may attend.

    Aligned bottom-right: query ``i`` of ``L`` sees keys ``j <= i + S - L``. With ``L == S`` this is
    the usual lower triangle; with fewer queries than keys (decoding with a KV cache) the last query
    sees every key. torch's own ``is_causal`` aligns top-left instead, which is wrong for a cache.
    """
    k_len = q_len if k_len is None else k_len
    for name, v in (("q_len", q_len), ("k_len", k_len)):
        if not is_int(v) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    q_len, k_len = int(q_len), int(k_len)
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)


def padding_mask(
    lengths: Tensor | list[int],
    max_len: int | None = None,
    *,
    left: bool = False,
    device: torch.device | str | None = None,
) -> Tensor:
    """Boolean key mask of shape ``(B, max_len)`` from sequence lengths, ``True`` = real token.

    ``left=True`` puts the padding on the left (the layout batched generation uses). Unsqueeze it
    to ``(B, 1, 1, S)`` to use it as an ``attn_mask`` over heads and queries. Note the polarity: the
    opposite of ``torch.nn.MultiheadAttention``'s ``key_padding_mask`` (where ``True`` = ignore).
    """
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(f"lengths must be a 1-D sequence of ints, got {lengths.dtype} {tuple(lengths.shape)}")
    if (lengths < 0).any():
        raise ValueError(f"lengths must be non-negative, got {lengths.tolist()}")
    if max_len is not None and (not is_int(max_len) or max_len < 0):
        raise ValueError(f"max_len must be a non-negative int or None, got {max_len!r}")
    longest = int(lengths.max()) if lengths.numel() else 0
    max_len = longest if max_len is None else max_len
    if max_len < longest:
        raise ValueError(f"max_len={max_len} is shorter than the longest sequence ({longest})")
    pos = torch.arange(max_len, device=lengths.device)  # (S,)
    if left:
        return pos.unsqueeze(0) >= (max_len - lengths).unsqueeze(1)  # (B, S)
    return pos.unsqueeze(0) < lengths.unsqueeze(1)  # (B, S)


def simple_self_attention(x: Tensor, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """Parameter-free self-attention of the tutorials' first step.

    ``scores = x @ x^T`` (no scaling), ``weights = softmax(scores, dim=-1)``, ``context = weights @ x``.

    Args:
        x: ``(n, d)`` or ``(..., n, d)`` token embeddings.
        return_weights: also return the ``(..., n, n)`` attention weights.
    Returns:
        ``(..., n, d)`` context vectors, or ``(context, weights)``.
    """
    check_float_tensor("x", x, 2)
    scores = x @ x.transpose(-2, -1)  # (..., n, n)
    weights = torch.softmax(scores, dim=-1)  # (..., n, n)
    context = weights @ x  # (..., n, d)
    return (context, weights) if return_weights else context


def _validate(
    query: object,
    key: object,
    value: object,
    attn_mask: object,
    dropout_p: object,
    is_causal: object,
    scale: object,
    enable_gqa: bool,
) -> tuple[int, ...]:
    """Raise a clear error for bad input; return the broadcast batch shape of the scores."""
    check_float_tensor("query", query, 2)
    check_float_tensor("key", key, 2)
    check_float_tensor("value", value, 2)
    check_same_dtype_and_device("query", query, "key", key)
    check_same_dtype_and_device("query", query, "value", value)
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(
            f"query and key must have the same last dimension E, got query {tuple(query.shape)} "
            f"and key {tuple(key.shape)}"
        )
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"key and value must have the same number of positions S (dim -2), got key {tuple(key.shape)} "
            f"and value {tuple(value.shape)}"
        )
    kv_batch = broadcast_shape(tuple(key.shape[:-2]), tuple(value.shape[:-2]))  # as torch, they may broadcast
    if kv_batch is None:
        raise ValueError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} have batch dimensions that do not broadcast"
        )
    if not is_real(dropout_p) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    # Any finite scale, as torch: 0 gives uniform weights, a negative one favours dissimilar keys.
    if scale is not None and not finite_real(scale):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    if scale is None and query.shape[-1] == 0:
        raise ValueError(
            f"query and key have width E = 0 (query shape {tuple(query.shape)}): the default scale 1/sqrt(E) "
            "is undefined; give them at least one feature or pass scale="
        )
    if not is_bool(is_causal):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if enable_gqa and query.dim() < 3:
        raise ValueError(
            f"with enable_gqa=True query needs a heads dimension (..., Hq, L, E), got query {tuple(query.shape)}"
        )

    key_batch = kv_batch
    if enable_gqa and key.dim() < 3:
        # Grouping works on dim -3 (the heads); a 2-D key has none to group.
        raise ValueError(
            f"with enable_gqa=True key needs a heads dimension (..., Hkv, S, E), got key {tuple(key.shape)}"
        )
    if enable_gqa and kv_batch[-1] != query.shape[-3]:
        hq, hkv = query.shape[-3], kv_batch[-1]
        if hkv == 0 or hq % hkv != 0:
            raise ValueError(
                f"with enable_gqa=True the query heads ({hq}, dim -3 of query) must be a multiple "
                f"of the key/value heads ({hkv}, dim -3 of key)"
            )
        key_batch = (*kv_batch[:-1], hq)
    batch = broadcast_shape(tuple(query.shape[:-2]), tuple(key_batch))
    if batch is None:
        hint = " (set enable_gqa=True for grouped-query attention)" if query.dim() >= 3 else ""
        raise ValueError(
            f"query {tuple(query.shape)} and key {tuple(key.shape)} have batch dimensions that do not broadcast{hint}"
        ) from None

    if attn_mask is not None:
        target = (*batch, query.shape[-2], key.shape[-2])
        check_attn_mask(
            attn_mask,
            device=query.device,
            dtype=query.dtype,
            target=target,
            input_name="query",
        )
    return tuple(batch)


def _merge_masks(attn_mask: Tensor | None, is_causal: bool, L: int, S: int, device: torch.device) -> Tensor | None:
    """One mask from ``attn_mask`` and causality: bool ('may attend'), float (additive) or None.

    The result has at least 2 dimensions: a ``(S,)`` or scalar mask broadcasts, but torch's kernels
    and the row checks below need an ``(L, S)`` pair of dimensions."""
    if attn_mask is not None and attn_mask.dim() < 2:
        attn_mask = attn_mask.reshape((1,) * (2 - attn_mask.dim()) + tuple(attn_mask.shape))  # (1, S) or (1, 1)
    if not is_causal:
        return attn_mask
    causal = causal_mask(L, S, device=device)  # (L, S)
    if attn_mask is None:
        return causal
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))


def _row_has_key(mask: Tensor) -> Tensor:
    """``(..., L, 1)`` bool: True where a query row has at least one key it may attend."""
    if mask.dtype == torch.bool:
        return mask.any(dim=-1, keepdim=True)
    return (mask != float("-inf")).any(dim=-1, keepdim=True)


def _expand_kv(query: Tensor, key: Tensor, value: Tensor, enable_gqa: bool) -> tuple[Tensor, Tensor]:
    """Repeat grouped key/value heads (dim -3) up to the query heads, for the explicit path.

    A heads dimension of 1 is left to broadcast."""
    if not (enable_gqa and query.dim() >= 3):
        return key, value
    hq = query.shape[-3]

    def expand(t: Tensor) -> Tensor:
        if t.dim() < 3 or t.shape[-3] in (hq, 1):
            return t
        return t.repeat_interleave(hq // t.shape[-3], dim=-3)  # (..., Hq, S, E)

    return expand(key), expand(value)


def _drop_unattended(key: Tensor, value: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Zero the keys and values that no query may attend (padding), so that what they hold (NaN,
    inf) cannot leak into the output: a fused kernel adds the mask to the scores (NaN + -inf is NaN)
    and multiplies the zero weights into the values (0 * NaN is NaN). Gradients into them are zero,
    as they should be. ``mask``: the merged ``(..., L, S)`` mask (bool or additive)."""
    if mask is None:
        return key, value
    used = mask.any(dim=-2) if mask.dtype == torch.bool else (mask != float("-inf")).any(dim=-2)  # (..., S)
    if used.dim() >= 2 and key.dim() >= 3 and used.shape[-2] not in (1, key.shape[-3]):
        # Grouped-query attention: a key/value head is used when one of its query heads uses it.
        used = used.unflatten(-2, (key.shape[-3], used.shape[-2] // key.shape[-3])).any(dim=-2)  # (..., Hkv, S)
    used = used.unsqueeze(-1)  # (..., S, 1)
    return torch.where(used, key, 0.0), torch.where(used, value, 0.0)


def _masked_scores(query: Tensor, key: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """``Q K^T * scale``, then ``-inf`` where a bool mask is False, or a float mask added."""
    scores = (query @ key.transpose(-2, -1)) * scale  # (..., L, S)
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask


def _reference(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, dropout_p: float, scale: float
) -> tuple[Tensor, Tensor]:
    """Explicit ``softmax(Q K^T * scale + mask) V``, materialising the weights."""
    scores = _masked_scores(query, key, mask, scale)  # (..., L, S)
    if mask is None:
        weights = torch.softmax(scores, dim=-1)  # (..., L, S)
    else:
        # A row with nothing to attend is all -inf and softmax would give 0/0 = NaN, forward and
        # backward. Fill it before the softmax (so no NaN is ever formed) and zero its weights.
        empty = (scores == float("-inf")).all(dim=-1, keepdim=True)  # (..., L, 1)
        weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if dropout_p > 0.0:
        # The same call as nn.Dropout: under the same seed, the same mask as the tutorials' dropout.
        weights = F.dropout(weights, p=dropout_p)
    return weights @ value, weights  # (..., L, Ev), (..., L, S)


def attention_scores(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
) -> Tensor:
    """The attention scores ``Q K^T * scale + mask``: the step before the softmax, shape ``(..., L, S)``.

    Same arguments and meaning as :func:`scaled_dot_product_attention`. Masked positions hold
    ``-inf``, as in the tutorials' ``attn_scores.masked_fill(mask.bool(), -torch.inf)``; pass
    ``scale=1.0`` for the tutorials' unscaled scores. Meant for learning and inspection: the fused
    path never forms this ``(L, S)`` matrix.

    Args:
        query: ``(..., L, E)``; with ``enable_gqa`` ``(..., Hq, L, E)``.
        key: ``(..., S, E)``; with ``enable_gqa`` ``(..., Hkv, S, E)``.
        attn_mask: broadcastable to ``(..., L, S)``; bool ``True`` = may attend, float added.
        is_causal: causal mask aligned bottom-right (query ``i`` sees keys ``<= i + S - L``).
        scale: multiplier of ``Q K^T``; default ``1/sqrt(E)``.
    Returns:
        ``(..., L, S)`` scores, ``-inf`` where masked.
    """
    _validate(query, key, key, attn_mask, 0.0, is_causal, scale, enable_gqa)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    is_causal = bool(is_causal)
    key, _ = _expand_kv(query, key, key, enable_gqa)
    mask = _merge_masks(attn_mask, is_causal, query.shape[-2], key.shape[-2], query.device)
    return _masked_scores(query, key, mask, scale)  # (..., L, S)


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
    return_weights: bool = False,
    backend: Backend = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """``softmax(Q K^T * scale + mask) V`` with torch's argument conventions, made safe.

    Args:
        query: ``(..., L, E)``; with ``enable_gqa`` ``(..., Hq, L, E)``.
        key: ``(..., S, E)``; with ``enable_gqa`` ``(..., Hkv, S, E)``, ``Hq % Hkv == 0``.
        value: ``(..., S, Ev)``. The batch dimensions ``...`` of the three broadcast, as in torch.
        attn_mask: broadcastable to ``(..., L, S)``. Bool: ``True`` = may attend. Float: added to the
            scores (same dtype as ``query``; ``-inf`` masks, NaN and ``+inf`` are refused).
        dropout_p: dropout on the attention weights, applied whenever > 0 (as in torch: pass 0.0
            at evaluation time).
        is_causal: causal masking, aligned **bottom-right** (query ``i`` of ``L`` sees keys
            ``<= i + S - L``), so ``L < S`` works for KV-cache decoding. May be combined with
            ``attn_mask`` (both apply); torch refuses that combination.
        scale: multiplier of the scores; default ``1/sqrt(E)``.
        enable_gqa: let ``key``/``value`` have fewer heads than ``query`` (grouped-query attention).
        return_weights: return ``(output, weights)`` where ``weights (..., L, S)`` are the weights
            actually applied to ``value`` (after masking and dropout).
        backend: ``"auto"`` uses torch's fused kernel unless weights are requested; ``"fused"``
            forces it; ``"reference"`` forces the explicit path.

    A query row with no key to attend (fully masked) gets a zero output and zero weights, with
    finite gradients, on every backend. A key that no query may attend (padding) never contributes,
    whatever it and its value hold (NaN, inf), on every backend.

    Returns:
        ``(..., L, Ev)``, or ``(output, weights)`` when ``return_weights=True``.
    """
    if backend not in ("auto", "fused", "reference"):
        raise ValueError(f"backend must be 'auto', 'fused' or 'reference', got {backend!r}")
    if return_weights and backend == "fused":
        raise ValueError("return_weights=True needs the reference backend: the fused kernel never forms the weights")
    _validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return attend(
        query,
        key,
        value,
        attn_mask,
        float(dropout_p),
        bool(is_causal),
        None if scale is None else float(scale),
        enable_gqa=bool(enable_gqa),
        return_weights=return_weights,
        backend=backend,
    )


def attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
    return_weights: bool = False,
    backend: Backend = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`scaled_dot_product_attention` without its argument checks, for callers inside the
    library that built (or already checked) every input: a module attending over the projections it
    made, with a mask it has validated. Same arguments and results."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    L, S = query.shape[-2], key.shape[-2]
    if is_causal and L == 1:
        is_causal = False  # bottom-right aligned, a single query (a decoding step) sees every key

    if backend == "reference" or return_weights:
        key, value = _expand_kv(query, key, value, enable_gqa)
        mask = _merge_masks(attn_mask, is_causal, L, S, query.device)
        key, value = _drop_unattended(key, value, mask)
        out, weights = _reference(query, key, value, mask, dropout_p, scale)
        return (out, weights) if return_weights else out

    if attn_mask is None and (not is_causal or L == S):
        # torch's top-left is_causal equals bottom-right when L == S: keep its fastest path.
        return F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    mask = _merge_masks(attn_mask, is_causal, L, S, query.device)
    key, value = _drop_unattended(key, value, mask)
    # Rows with no key: let the kernel attend anywhere there (so it cannot form NaN), then zero
    # their output; masked_fill's backward sends zero gradient into those rows.
    has_key = _row_has_key(mask)  # (..., L, 1)
    safe = mask | ~has_key if mask.dtype == torch.bool else mask.masked_fill(~has_key, 0.0)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=safe, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa
    )
    return out.masked_fill(~has_key, 0.0)  # (..., L, Ev)
