"""Functional core of attnlab: attention as plain functions on tensors.

Every module in :mod:`attnlab.attention` is a thin wrapper over these functions.
Argument names and conventions follow :func:`torch.nn.functional.scaled_dot_product_attention`:

* a **boolean** mask means ``True`` = *may attend*; a **float** mask is *added* to the scores;
* ``scale`` defaults to ``1 / sqrt(E)`` where ``E`` is the query/key width;
* shapes are ``query (..., L, E)``, ``key (..., S, E)``, ``value (..., S, Ev)`` -> ``(..., L, Ev)``.

Where attnlab goes beyond torch (bottom-right causal alignment, ``is_causal`` together with a mask,
zero output for query rows with nothing to attend, returning the applied weights) the docstrings
say so.

The attention variants of models after GPT-2 are arguments of the same functions:

* ``window=W``: sliding-window causal attention (Mistral, Gemma): query ``p`` sees keys ``p - W < j <= p``;
  ``sinks=n`` also keeps the first ``n`` keys visible (StreamingLLM's attention sinks). On the CPU a
  band-blocked fused path (:mod:`attnlab.sliding`) makes its cost grow with ``T * W``, not ``T^2``.
* ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)``: the signatures of
  ``torch.nn.attention.flex_attention``, evaluated exactly on broadcast index tensors ``b (B,1,1,1)``,
  ``h (1,H,1,1)``, ``q_idx (1,1,L,1)``, ``kv_idx (1,1,1,S)`` (the fused path takes a ``mask_mod`` and an
  additive ``score_mod`` as masks); on CUDA they go to ``flex_attention`` itself. As in flex,
  ``q_idx >= kv_idx`` is top-left aligned; ``is_causal`` stays bottom-right.
* Positions for RoPE and ALiBi live in :mod:`attnlab.positions`; :func:`positions_mask` builds the
  causal / window / sink / padding mask of queries and keys at explicit positions (a KV cache whose
  keys are not in order).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab import hardware, sliding
from attnlab.checks import (
    broadcast_shape,
    check_attn_mask,
    check_bool,
    check_device,
    check_float_tensor,
    check_same_dtype_and_device,
    finite_real,
    is_bool,
    is_int,
    is_real,
)

__all__ = [
    "MaskMod",
    "ScoreMod",
    "attend",
    "attention_scores",
    "causal_mask",
    "check_window",
    "combine_masks",
    "heads_matmul",
    "padding_mask",
    "positions_mask",
    "scaled_dot_product_attention",
    "simple_self_attention",
    "softcap_score_mod",
]

Backend = Literal["auto", "fused", "reference", "flex"]
BACKENDS = ("auto", "fused", "reference", "flex")
ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def check_window(window: object, sinks: object = 0) -> tuple[int | None, int]:
    """``(window, sinks)`` as ints, or a ValueError: ``window`` None or an int >= 1, ``sinks`` an int
    >= 0 that needs a window (without one every earlier key is visible anyway)."""
    if window is not None and (not is_int(window) or window < 1):
        raise ValueError(
            f"window must be a positive int (keys each query sees, itself included) or None, got {window!r}"
        )
    if not is_int(sinks) or sinks < 0:
        raise ValueError(f"sinks must be a non-negative int, got {sinks!r}")
    if sinks and window is None:
        raise ValueError(f"sinks={sinks} keeps the first keys visible beside a sliding window: set window too")
    return (None if window is None else int(window)), int(sinks)


def softcap_score_mod(cap: float) -> ScoreMod:
    """Soft-capping as a ``score_mod``: ``cap * tanh(score / cap)`` (Gemma 2's attention logits, cap 50).

    Close to the identity for scores much smaller than ``cap``, and never beyond ``+-cap``: no head
    can grow one score so large that its softmax becomes a one-hot."""
    if not finite_real(cap) or cap <= 0:  # (0 or NaN would make every weight NaN or uniform, silently)
        raise ValueError(f"cap must be a positive finite number, got {cap!r}")

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return cap * torch.tanh(score / cap)

    score_mod.finite = True  # (a finite score stays finite: no pass over the scores to check it, every forward)
    return score_mod


def causal_mask(
    q_len: int,
    k_len: int | None = None,
    *,
    window: int | None = None,
    sinks: int = 0,
    device: torch.device | str | None = None,
) -> Tensor:
    """Boolean causal mask of shape ``(q_len, k_len)``, ``True`` = may attend.

    Aligned bottom-right: query ``i`` of ``L`` sees keys ``j <= i + S - L``. With ``L == S`` this is
    the usual lower triangle; with fewer queries than keys (decoding with a KV cache) the last query
    sees every key. torch's own ``is_causal`` aligns top-left instead, which is wrong for a cache.

    ``window=W`` keeps the band of the ``W`` latest keys, ``i + S - L - W < j`` (a query sees itself
    and ``W - 1`` keys before it: Mistral's and Hugging Face's convention); ``sinks=n`` also keeps
    keys ``j < n`` (StreamingLLM).
    """
    k_len = q_len if k_len is None else k_len
    for name, v in (("q_len", q_len), ("k_len", k_len)):
        if not is_int(v) or v < 0:
            raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    window, sinks = check_window(window, sinks)
    q_len, k_len, device = int(q_len), int(k_len), check_device("device", device)
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)
    if window is None or window >= k_len:  # (a window as long as the keys hides none of them)
        return mask
    band = torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu(diagonal=k_len - q_len - window + 1)
    band[:, :sinks] = True
    return mask & band


def positions_mask(
    q_positions: Tensor, k_positions: Tensor, *, causal: bool = True, window: int | None = None, sinks: int = 0
) -> Tensor:
    """Which keys each query may attend, from explicit positions: bool ``(..., L, S)``, True = may attend.

    Args:
        q_positions: ``(L,)`` or ``(B, L)`` integer positions of the queries; k_positions: ``(S,)`` or
            ``(B, S)`` of the keys, in any order (a ring-buffer KV cache holds them rotated).
            A negative position marks padding (or an empty cache slot): such a key is never visible,
            such a query sees nothing.
        causal: key position ``<=`` query position.
        window, sinks: query ``p`` sees keys ``p - window < j`` or ``j < sinks`` (see :func:`causal_mask`).
    """
    window, sinks = check_window(window, sinks)
    check_bool("causal", causal)
    for name, p in (("q_positions", q_positions), ("k_positions", k_positions)):
        if not isinstance(p, Tensor) or p.is_floating_point() or p.is_complex() or p.dtype == torch.bool:
            got = p.dtype if isinstance(p, Tensor) else type(p).__name__
            raise TypeError(f"{name} must be an integer tensor of positions, (L,) or (B, L), got {got}")
        if p.dim() not in (1, 2):
            raise ValueError(f"{name} must have shape (L,) or (B, L), got {tuple(p.shape)}")
    if q_positions.device != k_positions.device:
        raise ValueError(
            f"q_positions and k_positions must be on one device, got {q_positions.device} and {k_positions.device}"
        )
    batches = {p.shape[0] for p in (q_positions, k_positions) if p.dim() == 2} - {1}
    if len(batches) > 1:
        raise ValueError(
            f"q_positions and k_positions must have the same batch (or one of 1), got {tuple(q_positions.shape)} "
            f"and {tuple(k_positions.shape)}"
        )
    qp, kp = q_positions[..., :, None], k_positions[..., None, :]  # (..., L, 1), (..., 1, S)
    mask = (qp >= 0) & (kp >= 0)  # (..., L, S)
    if causal:
        mask = mask & (kp <= qp)
    if window is not None:
        mask = mask & ((qp - kp < window) | (kp < sinks))
    return mask


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
    device = check_device("device", device)
    check_bool("left", left)
    try:
        lengths = torch.as_tensor(lengths, device=device)
    except (TypeError, ValueError, RuntimeError):  # None, text, ragged lists
        raise ValueError(f"lengths must be a 1-D sequence of ints, got {lengths!r}") from None
    if lengths.shape == (0,):  # no sequences: (an empty list is float32 to torch)
        lengths = lengths.long()
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
    check_bool("return_weights", return_weights)
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
    window: object = None,
    sinks: object = 0,
    score_mod: object = None,
    mask_mod: object = None,
) -> None:
    """Raise a clear error for bad input."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_float_tensor(name, t, 2)
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
    check_window(window, sinks)
    if window is not None and not is_causal:
        raise ValueError(f"window={window} is a sliding *causal* window: pass is_causal=True with it")
    for name, mod in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if mod is not None and not callable(mod):
            raise TypeError(f"{name} must be a function (flex_attention's signature) or None, got {type(mod).__name__}")
        if mod is not None and query.dim() != 4:
            raise ValueError(
                f"{name} takes (b, h, q_idx, kv_idx) indices, as flex_attention: query must be (B, H, L, E), "
                f"got shape {tuple(query.shape)}"
            )
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
        check_attn_mask(attn_mask, device=query.device, dtype=query.dtype, target=target, input_name="query")


def combine_masks(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """Two attention masks applied together (either may be None): bool & bool (True = may attend),
    a float mask with -inf where a bool one is False, or the sum of two float masks."""
    for name, m in (("a", a), ("b", b)):
        if m is not None and (not isinstance(m, Tensor) or not (m.dtype == torch.bool or m.is_floating_point())):
            got = m.dtype if isinstance(m, Tensor) else type(m).__name__
            raise TypeError(f"{name} must be None or a bool or floating-point mask tensor, got {got}")
    if a is None or b is None:
        return b if a is None else a
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
    if broadcast_shape(tuple(a.shape), tuple(b.shape)) is None:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)} must broadcast to one shape")
    if a.dtype == torch.bool and b.dtype == torch.bool:
        return a & b
    if a.dtype == torch.bool:
        a, b = b, a
    if b.dtype == torch.bool:
        return a.masked_fill(~b, float("-inf"))
    return a + b


def _merge_masks(
    attn_mask: Tensor | None,
    is_causal: bool,
    L: int,
    S: int,
    device: torch.device,
    window: int | None = None,
    sinks: int = 0,
) -> Tensor | None:
    """One mask from ``attn_mask`` and causality (with its window): bool ('may attend'), float
    (additive) or None.

    The result has at least 2 dimensions: a ``(S,)`` or scalar mask broadcasts, but torch's kernels
    and the row checks below need an ``(L, S)`` pair of dimensions."""
    attn_mask = None if attn_mask is None else torch.atleast_2d(attn_mask)  # (S,) -> (1, S), () -> (1, 1)
    if not is_causal:
        return attn_mask
    return combine_masks(attn_mask, causal_mask(L, S, window=window, sinks=sinks, device=device))  # (..., L, S)


def _visible(mask: Tensor) -> Tensor:
    """A bool or additive mask as bool, True = may attend (an additive mask hides with ``-inf``)."""
    return mask if mask.dtype == torch.bool else mask != float("-inf")


def heads_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a (..., H, n, k) @ b (..., Hkv, k, m) -> (..., H, n, m)``, query head ``h`` against key/value head
    ``h // (H // Hkv)`` (grouped-query attention's heads, as ``b.repeat_interleave`` would pair them):
    each group's ``H // Hkv`` heads are the rows of one product, so ``b`` is never copied per query head.
    ``Hkv`` of ``H`` or 1 (or fewer than 3 dims) is a plain ``a @ b``."""
    if a.dim() < 3 or b.dim() < 3 or b.shape[-3] in (a.shape[-3], 1):
        return a @ b
    *lead, H, n, k = a.shape
    Hkv = b.shape[-3]
    if H % Hkv:
        raise ValueError(f"b's {Hkv} heads must divide a's {H} heads (grouped-query attention), got {H} and {Hkv}")
    grouped = a.reshape(*lead, Hkv, (H // Hkv) * n, k) @ b  # (..., Hkv, g * n, m): heads kv * g + j, rows j * n + i
    return grouped.view(*grouped.shape[:-3], H, n, b.shape[-1])  # the leading dims as broadcast with b's


def _drop_unattended(key: Tensor, value: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Zero the keys and values that no query may attend (padding), so that what they hold (NaN,
    inf) cannot leak into the output: a fused kernel adds the mask to the scores (NaN + -inf is NaN)
    and multiplies the zero weights into the values (0 * NaN is NaN). Gradients into them are zero,
    as they should be. ``mask``: the merged ``(..., L, S)`` mask (bool or additive)."""
    if mask is None:
        return key, value
    mask = torch.atleast_2d(mask)  # a (S,) mask: one row of queries
    used = _visible(mask).any(dim=-2)  # (..., S)
    if used.dim() >= 2 and key.dim() >= 3 and used.shape[-2] not in (1, key.shape[-3]):
        # Grouped-query attention: a key/value head is used when one of its query heads uses it.
        used = used.unflatten(-2, (key.shape[-3], used.shape[-2] // key.shape[-3])).any(dim=-2)  # (..., Hkv, S)
    used = used.unsqueeze(-1)  # (..., S, 1)
    return torch.where(used, key, 0.0), torch.where(used, value, 0.0)


def _index_grids(shape: tuple[int, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """flex's ``(b, h, q_idx, kv_idx)`` for scores of ``shape (B, H, L, S)``, as broadcastable int64
    tensors ``(B,1,1,1)``, ``(1,H,1,1)``, ``(1,1,L,1)``, ``(1,1,1,S)``: a mod evaluated on them computes
    at once what flex's vmap computes element by element."""
    return tuple(
        torch.arange(n, device=device).view([n if d == i else 1 for d in range(4)]) for i, n in enumerate(shape)
    )  # type: ignore[return-value]


def _mask_from_mod(mask_mod: MaskMod, shape: tuple[int, ...], device: torch.device) -> Tensor:
    """``mask_mod`` evaluated on the index grids: bool, broadcastable to ``shape (B, H, L, S)``."""
    mask = mask_mod(*_index_grids(shape, device))
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"mask_mod must return a bool tensor (True = may attend), got {got}")
    if broadcast_shape(tuple(mask.shape), shape) != shape:
        raise ValueError(f"mask_mod returned shape {tuple(mask.shape)}, which does not broadcast to the scores {shape}")
    return mask


def _modded_scores(scores: Tensor, score_mod: ScoreMod) -> Tensor:
    """``score_mod`` applied to the whole ``(B, H, L, S)`` score tensor at once."""
    out = score_mod(scores, *_index_grids(tuple(scores.shape), scores.device))
    if not isinstance(out, Tensor) or not out.is_floating_point():
        raise TypeError(f"score_mod must return a float tensor, got {getattr(out, 'dtype', type(out).__name__)}")
    # (a NaN query's scores stay NaN: only what the mod made is an error)
    if not getattr(score_mod, "finite", False) and bool(((out.isnan() | out.isposinf()) & scores.isfinite()).any()):
        raise ValueError("score_mod returned NaN or +inf for a finite score: it must give finite scores or -inf")
    return out.to(scores.dtype).expand_as(scores)


def _additive_bias(
    score_mod: ScoreMod,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    reach: Callable[[], float] = lambda: 0.0,
):
    """``f`` where ``score_mod(s, ...) == s + f(b, h, q_idx, kv_idx)`` (a float mask for the fused kernel),
    or None when the mod is not additive (e.g. soft-capping). Checked at probe scores in float32 at least
    (bfloat16's rounding would hide a mod as close to the identity as soft-capping is near 0), within the
    rounding of the dtype the mod computes in (a bias it holds in bfloat16 gives bfloat16 scores), at a
    large score, where a cap bends far beyond any rounding, and at ``±reach()``, the largest score the
    call can make (a clamp at 40 is the identity at every smaller probe)."""
    grids = _index_grids(shape, device)
    probe_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    base = score_mod(torch.zeros((), dtype=probe_dtype, device=device), *grids)
    if not isinstance(base, Tensor) or not base.is_floating_point():
        raise TypeError(f"score_mod must return a float tensor, got {getattr(base, 'dtype', type(base).__name__)}")
    if bool(torch.isnan(base).any() | torch.isposinf(base).any()):
        raise ValueError("score_mod returned NaN or +inf for a score of 0: it must give finite scores or -inf")

    def shifts_by_base(p: float) -> bool:  # score_mod(p) == p + base, within rounding
        out = score_mod(torch.tensor(p, dtype=probe_dtype, device=device), *grids)
        tol = 8 * torch.finfo(torch.promote_types(out.dtype, base.dtype)).eps
        shifted = out - p
        return bool(((shifted == base) | ((shifted - base).abs() <= tol * (1 + base.abs() + abs(p)))).all())

    if not all(shifts_by_base(p) for p in (1.5, -3.25, 30.0)):
        return None
    far = reach()  # (measured only for a mod that passed the probes above)
    if math.isfinite(far) and far > 30.0 and not (shifts_by_base(far) and shifts_by_base(-far)):
        return None
    return base.to(dtype)


def _masked_scores(
    query: Tensor, key: Tensor, mask: Tensor | None, scale: float, score_mod: ScoreMod | None = None
) -> Tensor:
    """``Q K^T * scale``, modified by ``score_mod``, then ``-inf`` where a bool mask is False, or a float
    mask added.

    In place on the fresh product where the result has its shape and dtype (no ``score_mod``, whose
    output its backward may keep): no backward here needs the overwritten values, and each
    ``(B, H, L, S)`` temporary not made saves a pass over memory."""
    if query.dtype == torch.float16:  # (its range: Q K^T can overflow where the scaled scores fit)
        root = math.sqrt(scale)  # each side scaled first, as torch's math backend does
        scores = heads_matmul(query * root, key.transpose(-2, -1) * root)  # (..., L, S)
    else:
        scores = heads_matmul(query, key.transpose(-2, -1)).mul_(scale)  # (..., L, S)
    if score_mod is not None:
        scores = _modded_scores(scores, score_mod)  # (B, H, L, S)
    if mask is None:
        return scores
    shape = tuple(scores.shape)
    own = score_mod is None and broadcast_shape(tuple(mask.shape), shape) == shape  # (the mask fits the scores)
    if mask.dtype == torch.bool:
        return scores.masked_fill_(~mask, float("-inf")) if own else scores.masked_fill(~mask, float("-inf"))
    return scores.add_(mask) if own and mask.dtype == scores.dtype else scores + mask


def _reference(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    dropout_p: float,
    scale: float,
    score_mod: ScoreMod | None = None,
) -> tuple[Tensor, Tensor]:
    """Explicit ``softmax(score_mod(Q K^T * scale) + mask) V``, materialising the weights."""
    scores = _masked_scores(query, key, mask, scale, score_mod)  # (..., L, S)
    if mask is None and score_mod is None:
        weights = torch.softmax(scores, dim=-1)  # (..., L, S)
    else:
        # A row with nothing to attend is all -inf and softmax would give 0/0 = NaN, forward and
        # backward. With gradients, fill it before the softmax (so no NaN is ever formed) and zero its
        # weights; without, zero the softmax's NaN there in place (the same weights, one pass fewer).
        if scores.shape[-1]:  # one reduction, no (..., L, S) bool temporary; all -inf <=> max -inf (NaN: neither)
            empty = scores.amax(dim=-1, keepdim=True) == float("-inf")  # (..., L, 1)
        else:  # no keys at all (amax has no identity)
            empty = scores.new_ones((*scores.shape[:-1], 1), dtype=torch.bool)
        if scores.requires_grad:  # (a mask or a score_mod's tensors may carry gradients too)
            weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
        else:
            weights = torch.softmax(scores, dim=-1).masked_fill_(empty, 0.0)
    if dropout_p > 0.0:
        # The same call as nn.Dropout: under the same seed, the same mask as the tutorials' dropout.
        weights = F.dropout(weights, p=dropout_p)
    return heads_matmul(weights, value), weights  # (..., L, Ev), (..., L, S)


def attention_scores(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    *,
    enable_gqa: bool = False,
    window: int | None = None,
    sinks: int = 0,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
) -> Tensor:
    """The attention scores ``score_mod(Q K^T * scale) + mask``: the step before the softmax, ``(..., L, S)``.

    Same arguments and meaning as :func:`scaled_dot_product_attention`. Masked positions hold
    ``-inf``, as in the tutorials' ``attn_scores.masked_fill(mask.bool(), -torch.inf)``; pass
    ``scale=1.0`` for the tutorials' unscaled scores. Meant for learning and inspection: the fused
    path never forms this ``(L, S)`` matrix.

    Args:
        query: ``(..., L, E)``; with ``enable_gqa`` ``(..., Hq, L, E)``.
        key: ``(..., S, E)``; with ``enable_gqa`` ``(..., Hkv, S, E)``.
        attn_mask: broadcastable to ``(..., L, S)``; bool ``True`` = may attend, float added.
        is_causal, scale, window, sinks, score_mod, mask_mod: see :func:`scaled_dot_product_attention`.
    Returns:
        ``(..., L, S)`` scores, ``-inf`` where masked.
    """
    _validate(query, key, key, attn_mask, 0.0, is_causal, scale, enable_gqa, window, sinks, score_mod, mask_mod)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    L, S = query.shape[-2], key.shape[-2]  # (grouped key heads stay as they are: _masked_scores pairs them)
    mask = _merge_masks(attn_mask, bool(is_causal), L, S, query.device, window, int(sinks))
    if mask_mod is not None:
        mask = combine_masks(mask, _mask_from_mod(mask_mod, (*query.shape[:-2], L, S), query.device))
    return _masked_scores(query, key, mask, scale, score_mod)  # (..., L, S)


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
    window: int | None = None,
    sinks: int = 0,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    return_weights: bool = False,
    backend: Backend = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """``softmax(score_mod(Q K^T * scale) + mask) V`` with torch's argument conventions, made safe.

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
        window: with ``is_causal``, a sliding window: query ``i`` sees only the ``window`` latest keys
            up to its own position (itself included). ``None``: no window.
        sinks: with ``window``, the first ``sinks`` keys stay visible to every query (attention sinks).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, flex_attention's signature,
            applied to ``Q K^T * scale`` before any mask. Needs 4-D ``(B, H, L, E)`` inputs.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (True = may attend), applied with the
            other masks. Needs 4-D inputs.
        return_weights: return ``(output, weights)`` where ``weights (..., L, S)`` are the weights
            actually applied to ``value`` (after masking and dropout).
        backend: ``"auto"`` uses torch's fused kernel unless weights are requested (or a
            ``score_mod`` is not additive), and ``flex_attention`` for the mods and windows on CUDA;
            ``"fused"`` forces the fused kernel (a ``score_mod`` must then be additive,
            ``score + f(b, h, q_idx, kv_idx)``: attnlab checks this at three probe scores);
            ``"reference"`` forces the explicit path; ``"flex"`` forces
            ``torch.nn.attention.flex_attention`` (compiled on CUDA; on the CPU it runs unfused and
            has no backward, so it is for comparisons without gradients).

    A query row with no key to attend (fully masked) gets a zero output and zero weights, with
    finite gradients, on every backend. A key that no query may attend (padding) never contributes,
    whatever it and its value hold (NaN, inf), on every backend.

    Returns:
        ``(..., L, Ev)``, or ``(output, weights)`` when ``return_weights=True``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    return_weights = check_bool("return_weights", return_weights)  # ("yes" would be truthy)
    if return_weights and backend in ("fused", "flex"):
        raise ValueError(
            f"return_weights=True needs the reference backend: the {backend} kernel never forms the weights"
        )
    _validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, window, sinks, score_mod, mask_mod)
    if backend == "flex":
        _check_flex(query, key, value, dropout_p)
    return attend(
        query,
        key,
        value,
        attn_mask,
        float(dropout_p),
        bool(is_causal),
        None if scale is None else float(scale),
        enable_gqa=bool(enable_gqa),
        window=None if window is None else int(window),
        sinks=int(sinks),
        score_mod=score_mod,
        mask_mod=mask_mod,
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
    window: int | None = None,
    sinks: int = 0,
    score_mod: ScoreMod | None = None,
    mask_mod: MaskMod | None = None,
    return_weights: bool = False,
    backend: Backend = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`scaled_dot_product_attention` without its argument checks, for callers inside the
    library that built (or already checked) every input: a module attending over the projections it
    made, with a mask it has validated. Same arguments and results."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    L, S = query.shape[-2], key.shape[-2]
    if window is not None and window >= S:
        window, sinks = None, 0  # bottom-right aligned, no query has a key outside its window
    if is_causal and L == 1 and window is None:
        is_causal = False  # bottom-right aligned, a single query (a decoding step) sees every key
    mods = score_mod is not None or mask_mod is not None

    if backend == "flex" or (
        backend == "auto" and not return_weights and (mods or window is not None) and _flex_runs(query, dropout_p)
    ):
        key, value = _drop_unattended(key, value, attn_mask)  # the keys attn_mask hides from every query
        return _flex(query, key, value, attn_mask, is_causal, scale, enable_gqa, window, sinks, score_mod, mask_mod)

    if score_mod is not None and backend != "reference" and not return_weights:

        def reach() -> float:  # |q . k| |scale| <= |q| |k| |scale|: the largest score this call makes
            with torch.no_grad():
                return (
                    abs(scale) * float(query.norm(dim=-1).amax()) * float(key.norm(dim=-1).amax()) if L and S else 0.0
                )

        bias = _additive_bias(score_mod, (*query.shape[:-2], L, S), query.dtype, query.device, reach)
        if bias is None and backend == "fused":
            raise ValueError(
                "score_mod is not additive (score_mod(s) != s + f(b, h, q_idx, kv_idx), e.g. soft-capping): the fused "
                "kernel can only add a bias to the scores; use backend='reference' (or 'flex' on CUDA)"
            )
        if bias is not None:
            attn_mask, score_mod = combine_masks(attn_mask, bias), None
        else:
            backend = "reference"
    if mask_mod is not None:
        attn_mask = combine_masks(attn_mask, _mask_from_mod(mask_mod, (*query.shape[:-2], L, S), query.device))

    if backend == "reference" or return_weights:  # (grouped heads paired by heads_matmul, never copied)
        mask = _merge_masks(attn_mask, is_causal, L, S, query.device, window, sinks)
        key, value = _drop_unattended(key, value, mask)
        out, weights = _reference(query, key, value, mask, dropout_p, scale, score_mod)
        return (out, weights) if return_weights else out

    if window is not None and attn_mask is None and _sliding_runs(query, key, value, dropout_p, window):
        H = query.shape[1]  # the band kernel takes one key/value head per query head (grouped ones repeated)
        key, value = (
            t.repeat_interleave(H // t.shape[1], 1) if 1 < t.shape[1] < H else t.expand(-1, H, -1, -1)
            for t in (key, value)
        )
        return _keep_nan(sliding.sliding_window_attention(query, key, value, window, sinks, scale), query)

    if attn_mask is None and window is None and (not is_causal or (L == S and (scale is None or scale > 0))):
        # torch's top-left is_causal equals bottom-right when L == S: keep its fastest path. (Its CPU
        # kernel masks before it scales: a scale of 0 turns the masked -inf into NaN, a negative one
        # into +inf; those take the boolean mask below.)
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
        return _keep_nan(out, query)
    mask = _merge_masks(attn_mask, is_causal, L, S, query.device, window, sinks)
    key, value = _drop_unattended(key, value, mask)
    # Rows with no key: let the kernel attend anywhere there (so it cannot form NaN), then zero
    # their output; masked_fill's backward sends zero gradient into those rows.
    has_key = _visible(mask).any(dim=-1, keepdim=True)  # (..., L, 1)
    safe = mask | ~has_key if mask.dtype == torch.bool else mask.masked_fill(~has_key, 0.0)
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=safe, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa
    )
    return _keep_nan(out, query).masked_fill(~has_key, 0.0)  # (..., L, Ev)


def _keep_nan(out: Tensor, query: Tensor) -> Tensor:
    """``out`` with NaN in the rows whose query holds a NaN or an inf, as the softmax of their scores has
    it. torch's CPU kernel takes a row of NaN scores for a row with no key and returns zeros: a broken
    weight would then give finite, wrong outputs. ``query * 0`` is 0 where the query is finite (no
    overflow, unlike a sum of the query), NaN elsewhere; its gradient is zero. A single query (a
    decoding step) is left as the kernel gives it: its three operations a layer would slow every token,
    and a broken query weight has already made the prompt's pass NaN (a NaN stream passes on anyway,
    through the residual)."""
    if out.device.type != "cpu" or query.shape[-2] == 1:
        return out
    return out + (query * 0).sum(-1, keepdim=True)  # (..., L, Ev) + (..., L, 1)


# --------------------------------------------------------------------------------------------
# The sliding-window fast path and flex_attention
# --------------------------------------------------------------------------------------------
def _sliding_runs(query: Tensor, key: Tensor, value: Tensor, dropout_p: float, window: int) -> bool:
    """Whether :mod:`attnlab.sliding` computes this call: CPU self-attention ``(B, H, T, E)`` (same
    batch and width for all three, no dropout) long enough for the band to save work."""
    T = query.shape[-2]
    return (
        query.device.type == "cpu"
        and sliding.available()
        and dropout_p == 0.0
        and query.dim() == 4
        and key.shape[-2] == T
        and key.shape[:-3] == query.shape[:-3] == value.shape[:-3]
        and key.shape[-1] == value.shape[-1] == query.shape[-1]
        and 4 * window <= T
    )


def _flex_runs(query: Tensor, dropout_p: float) -> bool:
    """Whether ``backend="auto"`` hands mods and windows to flex_attention: on CUDA, 4-D inputs,
    no dropout, a head width its kernels take."""
    E = query.shape[-1]
    return query.is_cuda and query.dim() == 4 and dropout_p == 0.0 and E >= 16 and E & (E - 1) == 0


def _check_flex(query: Tensor, key: Tensor, value: Tensor, dropout_p: float) -> None:
    if query.dim() != 4:
        raise ValueError(f"backend='flex' needs 4-D (B, H, L, E) inputs, got query {tuple(query.shape)}")
    if dropout_p:
        raise ValueError("backend='flex' has no dropout: pass dropout_p=0.0 or use another backend")
    if not query.is_cuda and torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise ValueError(
            "backend='flex' on the CPU has no backward (torch's flex_attention): use it under torch.no_grad(), "
            "or backend='fused' / 'reference'"
        )


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, options=hardware.compile_options())


@functools.lru_cache(maxsize=32)
def _window_block_mask(L: int, S: int, window: int | None, sinks: int, device: torch.device) -> object:
    """flex's block mask of bottom-right causal attention with an optional window (for any batch and head)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal_mod(S - L, window, sinks), None, None, L, S, device=device)


def _causal_mod(offset: int, window: int | None, sinks: int) -> MaskMod:
    """Bottom-right causal (query ``i`` at position ``i + offset``) with an optional window, as a mask_mod."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        visible = kv_idx <= q_idx + offset
        if window is not None:
            visible = visible & ((q_idx + offset - kv_idx < window) | (kv_idx < sinks))
        return visible

    return mask_mod


def _flex(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float,
    enable_gqa: bool,
    window: int | None,
    sinks: int,
    score_mod: ScoreMod | None,
    mask_mod: MaskMod | None,
) -> Tensor:
    """The call on ``torch.nn.attention.flex_attention``: causality, window, sinks, ``mask_mod`` and a
    bool ``attn_mask`` become one block mask; ``score_mod`` and a float ``attn_mask`` one score_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, L, _ = query.shape
    S = key.shape[-2]
    key, value = (t.expand(B, *t.shape[1:]) for t in (key, value))  # flex wants one batch size
    bool_mask = float_mask = None
    if attn_mask is not None:
        m = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)).expand(B, H, L, S)
        if m.dtype == torch.bool:
            bool_mask = m
        else:  # its -inf entries mask (in the block mask: a row with nothing left is then 0, not NaN)
            bool_mask, float_mask = m != float("-inf"), m.masked_fill(m == float("-inf"), 0.0)

    if mask_mod is None and bool_mask is None:
        block_mask = _window_block_mask(L, S, window, sinks, query.device) if is_causal else None
    else:
        causal = _causal_mod(S - L, window, sinks) if is_causal else None

        def combined(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            visible = q_idx >= 0
            for fn in (causal, mask_mod):
                if fn is not None:
                    visible = visible & fn(b, h, q_idx, kv_idx)
            if bool_mask is not None:
                visible = visible & bool_mask[b, h, q_idx, kv_idx]
            return visible

        block_mask = create_block_mask(combined, B, H, L, S, device=query.device)

    mod = score_mod
    if float_mask is not None:

        def mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            if score_mod is not None:
                score = score_mod(score, b, h, q_idx, kv_idx)
            return score + float_mask[b, h, q_idx, kv_idx]

    kwargs = {"score_mod": mod, "block_mask": block_mask, "scale": scale, "enable_gqa": enable_gqa}
    if query.is_cuda:
        return _compiled_flex()(query, key, value, **kwargs)
    if not torch.is_grad_enabled():  # flex refuses CPU inputs that require grad even under no_grad
        query, key, value = query.detach(), key.detach(), value.detach()
    with warnings.catch_warnings():  # on the CPU flex runs unfused by design here (comparisons, no backward)
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(query, key, value, **kwargs)
