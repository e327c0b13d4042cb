"""Attention modules with the tutorials' names, on a fused core.

The classes are those of "A simple self-attention mechanism": its signatures and defaults (plus
``dropout=0.0``), its parameter names (``W_query``, ``W_key``, ``W_value``, ``out_proj``), created in
its order with its initialisation, so under its ``torch.manual_seed`` calls they print its numbers.
The other tutorials' classes of the same names differ (the GPT-style guide's ``CausalAttention``
creates ``W_keys`` first and defaults to ``dropout=0.1``; its and the exercises' projections are
biased, ``qkv_bias=True`` here; Exercise 5's ``MultiHeadAttention`` has no output projection):
:mod:`attnlab.tutorials` has each variant exactly. Underneath, every forward pass goes through
:func:`attnlab.functional.scaled_dot_product_attention`, which uses torch's fused kernel whenever
the attention weights are not requested.

Argument order: attnlab follows "A simple self-attention mechanism",
``MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads)``; the GPT-style guide and the
attention-review exercises put ``num_heads`` third. Keyword arguments fix the order, not the other
differences above.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from attnlab import hardware
from attnlab.checks import (
    autocast_on,
    check_attn_mask,
    check_bool,
    check_length,
    check_module_input,
    finite_real,
    is_int,
    is_real,
    non_negative_int,
    positive_int,
)
from attnlab.functional import (
    attend,
    check_window,
    combine_masks,
    positions_mask,
    scaled_dot_product_attention,
    softcap_score_mod,
)
from attnlab.positions import (
    alibi_bias,
    alibi_slopes_on,
    apply_rope,
    check_rope_scaling,
    rope_cos_sin,
    rope_inv_freq,
)
from attnlab.quantized import QuantizedTensor

__all__ = [
    "CausalAttention",
    "KVCache",
    "Linear",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "OffsetRMSNorm",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "SlotCache",
]


# --------------------------------------------------------------------------------------------
# Constructor checks that know the tutorials' argument orders
# --------------------------------------------------------------------------------------------
# The tutorials disagree on the order of (context_length, dropout, num_heads): a positional call
# written for another tutorial lands a token count in `dropout` or leaves `num_heads` out. Every
# error that such a call can trigger carries this hint.
_ORDER_HINT = (
    " (attnlab follows the order of 'A simple self-attention mechanism', "
    "{cls}(d_in, d_out, context_length, dropout, num_heads); the GPT-style guide and the attention-review "
    "exercises put num_heads third: pass the arguments by keyword, "
    "{cls}(d_in=..., d_out=..., num_heads=..., context_length=..., dropout=...))"
)


def _check_dropout(value: object, cls: str | None = None) -> float:
    """``cls``: a class with ``num_heads`` in the simple tutorial's order, whose error gets the hint."""
    if not is_real(value) or not 0.0 <= value < 1.0:
        hint = _ORDER_HINT.format(cls=cls) if cls and is_real(value) and value >= 1 else ""
        raise ValueError(f"dropout must be a float in [0, 1), got {value!r}{hint}")
    return float(value)


def _check_num_heads(value: object, cls: str) -> int:
    """num_heads is keyword-defaulted to None only so that a missing one gets this message."""
    if value is None:
        raise TypeError(f"{cls}() missing required argument 'num_heads'{_ORDER_HINT.format(cls=cls)}")
    if not is_int(value):
        raise TypeError(f"num_heads must be a positive int, got {value!r}{_ORDER_HINT.format(cls=cls)}")
    return positive_int("num_heads", value)


class _DropsTutorialMask(nn.Module):
    """Base for modules whose tutorial versions stored a causal ``mask`` buffer in the state dict.

    attnlab builds causal masks on the fly (or lets the fused kernel do it), so state dicts hold
    weights only; a state dict saved from the tutorials' own classes still loads: its ``mask``
    entries are dropped on the way in.
    """

    def __init__(self) -> None:
        super().__init__()
        self.register_load_state_dict_pre_hook(self._drop_mask_key)

    @staticmethod
    def _drop_mask_key(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        state_dict.pop(prefix + "mask", None)


# --------------------------------------------------------------------------------------------
# Single-head self-attention
# --------------------------------------------------------------------------------------------
class SelfAttention_v1(nn.Module):
    """Self-attention with raw weight matrices, ``x @ W`` (the tutorials' first trainable version).

    Args:
        d_in: input embedding width.
        d_out: width of queries, keys, values and the output.
    Shapes:
        ``x (n, d_in)`` or ``(b, n, d_in)`` -> ``(n, d_out)`` or ``(b, n, d_out)``.
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.d_in = positive_int("d_in", d_in)
        self.d_out = positive_int("d_out", d_out)
        # Same order and init as the tutorial: under torch.manual_seed(123) the same numbers.
        self.W_query = nn.Parameter(torch.rand(d_in, d_out))
        self.W_key = nn.Parameter(torch.rand(d_in, d_out))
        self.W_value = nn.Parameter(torch.rand(d_in, d_out))

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        check_module_input("x", x, self.d_in, self.W_query)
        queries = x @ self.W_query  # (..., n, d_out)
        keys = x @ self.W_key  # (..., n, d_out)
        values = x @ self.W_value  # (..., n, d_out)
        return scaled_dot_product_attention(queries, keys, values, return_weights=return_weights)


class SelfAttention_v2(nn.Module):
    """Self-attention with ``nn.Linear`` projections (optionally biased).

    Shapes: ``x (n, d_in)`` or ``(b, n, d_in)`` -> ``(..., n, d_out)``.
    """

    def __init__(self, d_in: int, d_out: int, qkv_bias: bool = False) -> None:
        super().__init__()
        self.d_in = positive_int("d_in", d_in)
        self.d_out = positive_int("d_out", d_out)
        qkv_bias = check_bool("qkv_bias", qkv_bias)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        check_module_input("x", x, self.d_in, self.W_query.weight)
        queries = self.W_query(x)  # (..., n, d_out)
        keys = self.W_key(x)  # (..., n, d_out)
        values = self.W_value(x)  # (..., n, d_out)
        return scaled_dot_product_attention(queries, keys, values, return_weights=return_weights)


class CausalAttention(_DropsTutorialMask):
    """Single-head causal self-attention with dropout on the attention weights.

    Args:
        d_in, d_out: input and output widths.
        context_length: the longest input accepted (longer inputs raise a ValueError).
        dropout: dropout probability on the attention weights (training only); default 0.0.
        qkv_bias: bias in the query/key/value projections.
    Shapes: ``x (n, d_in)`` or ``(b, n, d_in)`` -> ``(..., n, d_out)``.
    """

    def __init__(
        self, d_in: int, d_out: int, context_length: int, dropout: float = 0.0, qkv_bias: bool = False
    ) -> None:
        super().__init__()
        self.d_in = positive_int("d_in", d_in)
        self.d_out = positive_int("d_out", d_out)
        self.context_length = positive_int("context_length", context_length)
        qkv_bias = check_bool("qkv_bias", qkv_bias)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(_check_dropout(dropout))  # (no num_heads: no order to mix up)

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        check_module_input("x", x, self.d_in, self.W_query.weight)
        check_length(x.shape[-2], self.context_length)
        queries = self.W_query(x)  # (..., n, d_out)
        keys = self.W_key(x)  # (..., n, d_out)
        values = self.W_value(x)  # (..., n, d_out)
        p = self.dropout.p if self.training else 0.0
        return scaled_dot_product_attention(
            queries, keys, values, dropout_p=p, is_causal=True, return_weights=return_weights
        )


class MultiHeadAttentionWrapper(nn.Module):
    """Multi-head attention as a stack of ``num_heads`` independent :class:`CausalAttention` heads.

    Each head maps ``d_in -> d_out``; the outputs are concatenated, so the result is
    ``num_heads * d_out`` wide (as in the tutorial). The forward pass runs all heads in one fused
    call on the stacked head weights: same numbers as head-by-head, at the speed of one module.

    ``dropout`` defaults to 0.0; ``num_heads`` is required (a missing one is a TypeError that
    shows the keyword form, since the tutorials order these arguments differently).

    Shapes: ``x (n, d_in)`` or ``(b, n, d_in)`` -> ``(..., n, num_heads * d_out)``;
    with ``return_weights=True`` also ``(..., num_heads, n, n)`` weights.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float = 0.0,
        num_heads: int | None = None,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        _check_num_heads(num_heads, "MultiHeadAttentionWrapper")
        _check_dropout(dropout, "MultiHeadAttentionWrapper")
        self.d_in, self.d_out, self.num_heads, self.context_length = d_in, d_out, num_heads, context_length
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, d_out, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        first = self.heads[0]
        check_module_input("x", x, self.d_in, first.W_query.weight)
        check_length(x.shape[-2], self.context_length)
        H, hd = self.num_heads, self.d_out
        qkv = [torch.cat([getattr(h, name).weight for h in self.heads]) for name in ("W_query", "W_key", "W_value")]
        biases = [
            torch.cat([getattr(h, name).bias for h in self.heads]) if first.W_query.bias is not None else None
            for name in ("W_query", "W_key", "W_value")
        ]
        # Heads first, (H, ..., n, d_out): dropout then draws its masks head after head, as the
        # tutorial's loop over heads does, so a seed gives the tutorial's numbers in training too.
        q, k, v = (F.linear(x, w, b).unflatten(-1, (H, hd)).movedim(-2, 0) for w, b in zip(qkv, biases, strict=True))
        p = first.dropout.p if self.training else 0.0
        out = scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, return_weights=return_weights)
        out, weights = out if return_weights else (out, None)
        out = out.movedim(0, -2).flatten(-2)  # (..., n, H * d_out)
        return (out, weights.movedim(0, -3)) if return_weights else out  # weights (..., H, n, n)


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------
class KVCache:
    """Preallocated key/value cache for incremental decoding with :class:`MultiHeadAttention`.

    Keys and values are written in place into ``(B, Hkv, max_length, hd)`` buffers, so appending a
    token costs O(1) copies, never a quadratic re-concatenation.

    Two layouts:

    * plain (the default): slot ``t`` holds token ``t``; appending past ``max_length`` is an error.
      (GPT-2's absolute positions make every cached key stale once the window slides, so its
      generation re-encodes instead.)
    * ``rolling=True``: a ring buffer for relative positions (RoPE, ALiBi, none) and sliding
      windows. The first ``sinks`` slots keep the first ``sinks`` tokens (attention sinks); the
      other ``max_length - sinks`` slots hold the most recent tokens, the oldest overwritten first.
      Memory stays ``max_length`` slots however long generation runs. Keys are stored *after*
      rotation, at their original positions, so nothing is ever re-encoded. A module without a
      window then attends to those slots alone (StreamingLLM), not to every earlier token as its
      forward over the whole text would: give it ``window=`` to attend so in both.

    The cache also records each slot's position (``positions (B, max_length)``, -1 = empty or
    padding), so a module can mask exactly what a full forward pass would.

    The cache is for inference only (under ``torch.no_grad()`` or ``torch.inference_mode()``, as in
    :func:`attnlab.generation.generate`): autograd cannot backpropagate through buffers that later steps
    overwrite in place, so appending with a gradient raises. To train, feed the sequence whole, without a cache.

    Args:
        batch_size, max_length, num_kv_heads, head_dim: buffer geometry.
        dtype, device: of the buffers (by default the module's, when made with
            :meth:`MultiHeadAttention.new_kv_cache`); the module refuses a cache on another device than
            its input or, outside autocast, of another dtype than its weights.
        rolling: ring buffer (see above) instead of a cache that fills up.
        sinks: with ``rolling``, slots kept for the first tokens (``< max_length``).

    Attributes:
        length: slots in use (``<= max_length``); seen: tokens appended since :meth:`reset`.
    """

    static = False  # see SlotCache

    def __init__(
        self,
        batch_size: int,
        max_length: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        rolling: bool = False,
        sinks: int = 0,
    ) -> None:
        positive_int("batch_size", batch_size)
        positive_int("max_length", max_length)
        positive_int("num_kv_heads", num_kv_heads)
        positive_int("head_dim", head_dim)
        self.rolling = check_bool("rolling", rolling)
        self.sinks = non_negative_int("sinks", sinks)
        if sinks and not rolling:
            raise ValueError("sinks are slots a rolling cache never overwrites: pass rolling=True with them")
        if sinks >= max_length:
            raise ValueError(f"sinks={sinks} must be less than max_length={max_length} (room for recent tokens)")
        shape = (batch_size, num_kv_heads, max_length, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (B, Hkv, max_len, hd)
        self.values = torch.zeros(shape, dtype=dtype, device=device)  # (B, Hkv, max_len, hd)
        self.positions = torch.full((batch_size, max_length), -1, dtype=torch.long, device=device)  # (B, max_len)
        self.length = 0
        self.seen = 0

    @property
    def max_length(self) -> int:
        return self.keys.shape[2]

    def reset(self) -> None:
        """Forget the cached tokens (the buffers are reused)."""
        self.length = 0
        self.seen = 0
        self.positions.fill_(-1)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k, v (B, Hkv, T, hd)`` after the cached tokens; return views of all of them.

        Both must match the buffers' batch, heads, head width, dtype and device (nothing is cast
        silently); on any error the cache is left as it was. A rolling cache must use :meth:`update`."""
        if self.rolling:
            raise ValueError("a rolling kv_cache reorders its slots: use update(k, v, positions)")
        self._check_kv(k, v)
        return self._write(k, v)

    def _check_kv(self, k: object, v: object) -> None:
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, Tensor) or t.dim() != 4:
                got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"{name} must be a (batch, kv_heads, tokens, head_dim) tensor, got {got}")
            if t.dtype != self.keys.dtype or t.device != self.keys.device:
                raise TypeError(
                    f"{name} is {t.dtype} on {t.device}, but the kv_cache holds {self.keys.dtype} on {self.keys.device}"
                )
        if v.shape != k.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        held = (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3])
        B, H, _, hd = k.shape
        if (B, H, hd) != held:
            raise ValueError(f"kv_cache holds (batch, kv_heads, head_dim) = {held}, got {(B, H, hd)}")

    def check_usable(self, batch_size: int, device: torch.device, module: MultiHeadAttention) -> None:
        """ValueError / TypeError unless ``module`` may append ``batch_size`` rows of keys and values
        computed on ``device`` to this cache (its heads, head width, device and, outside autocast,
        the dtype of its weights)."""
        geometry = (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3])
        wanted = (batch_size, module.num_kv_heads, module.head_dim)
        if geometry != wanted:
            raise ValueError(f"kv_cache holds (batch, kv_heads, head_dim) = {geometry}, got {wanted}")
        if self.keys.device != device:
            raise ValueError(
                f"kv_cache is on {self.keys.device} but x is on {device}; "
                f"make it with new_kv_cache() after moving the module"
            )
        weight_dtype = module.W_key.weight.dtype
        if self.keys.dtype != weight_dtype and not autocast_on(device):
            raise TypeError(
                f"kv_cache has dtype {self.keys.dtype} but the module's weights are {weight_dtype}; "
                f"make it with new_kv_cache() after converting the module"
            )
        if self.rolling and not module.has_positions:
            raise ValueError(
                "a rolling kv_cache holds keys at positions a plain module cannot tell apart; use a plain cache "
                "(new_kv_cache()) or give the module rope/alibi/window"
            )

    def _check_room(self, T: int) -> None:
        if not self.rolling and self.length + T > self.max_length:
            raise ValueError(
                f"kv_cache is full: it holds {self.length} of max_length={self.max_length} tokens and "
                f"{T} more were fed; reset() it or make a larger one (new_kv_cache(max_length=...))"
            )

    @staticmethod
    def _check_no_grad(k: Tensor, v: Tensor) -> None:
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            raise RuntimeError(
                "kv_cache is for inference only: its buffers are overwritten in place, which autograd "
                "cannot backpropagate through; run under torch.no_grad() or torch.inference_mode(), "
                "or feed the whole sequence without a kv_cache to train"
            )

    def _write(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`append` for keys and values a module projected itself (their layout is right)."""
        T = k.shape[2]
        self._check_room(T)
        self._check_no_grad(k, v)
        end = self.length + T
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = self.seen = end
        return self.keys[:, :, :end], self.values[:, :, :end]  # (B, Hkv, S, hd) each

    def update(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, bool]:
        """Write ``k, v (B, Hkv, T, hd)`` of tokens at ``positions`` (``(1, T)`` shared or ``(B, T)``,
        -1 = padding) and return what their queries attend over.

        Returns:
            ``(keys, values, key_positions, ordered)``: keys and values ``(B, Hkv, S, hd)``, their
            positions ``(B, S)``, and ``ordered``: slot ``j`` holds the ``j``-th token fed, for every
            returned slot (the usual bottom-right causal layout). When a chunk of several tokens would
            overwrite keys its own first queries still need (a rolling cache that wraps), the old slots
            and the new keys are returned side by side (a copy) and written afterwards.
        """
        T = k.shape[2]
        t0, n, cap = self.seen, self.sinks, self.max_length
        if not self.rolling or (t0 + T <= cap and (n == 0 or positions.shape[0] == 1)):
            # Every token gets the slot of its index (no padding moves a sink): a plain write (length = t0).
            keys, values = self._write(k, v)
            self.positions[:, t0 : t0 + T] = positions
            return keys, values, self.positions[:, : t0 + T], True
        self._check_no_grad(k, v)  # (a rolling cache has always room)
        if T == 1 or t0 + T <= cap:  # nothing this chunk still needs is overwritten
            self._write_rolling(k, v, positions, t0)
            S = self.length
            return self.keys[:, :, :S], self.values[:, :, :S], self.positions[:, :S], False
        S = self.length
        keys = torch.cat([self.keys[:, :, :S], k], dim=2)  # (B, Hkv, S + T, hd)
        values = torch.cat([self.values[:, :, :S], v], dim=2)
        key_positions = torch.cat([self.positions[:, :S], positions.expand(self.positions.shape[0], T)], dim=1)
        self._write_rolling(k, v, positions, t0)
        return keys, values, key_positions, False

    def ring_slot(self, index: int) -> int:
        """The slot of a rolling cache that the token fed at ``index`` (``>= sinks``, past the pinned
        ones) goes to: ``sinks + (index - sinks) % (max_length - sinks)``, the oldest once the ring is full."""
        return self.sinks + (index - self.sinks) % (self.max_length - self.sinks)

    def _write_rolling(self, k: Tensor, v: Tensor, positions: Tensor, t0: int) -> None:
        """The ring write of tokens fed at indices ``t0, t0 + 1, ...``: tokens at positions ``< sinks``
        go to the sink slot of their position (per row), the others to their :meth:`ring_slot`,
        overwriting the oldest."""
        B, T = self.positions.shape[0], k.shape[2]
        n, cap = self.sinks, self.max_length
        R = cap - n
        positions = positions.expand(B, T)  # (B, T)
        if n:
            pinned = (positions >= 0) & (positions < n)  # (B, T)
            rows, cols = pinned.nonzero(as_tuple=True)
            if rows.numel():
                slots = positions[rows, cols]
                self.keys[rows, :, slots] = k[rows, :, cols]
                self.values[rows, :, slots] = v[rows, :, cols]
                self.positions[rows, slots] = slots
            positions = positions.masked_fill(pinned, -1)  # their ring slots must not show them twice
        first = max(t0, n, t0 + T - R)  # indices before `first` are overwritten within this chunk
        while first < t0 + T:
            slot = self.ring_slot(first)
            run = min(t0 + T - first, cap - slot)  # contiguous slots up to the end of the ring
            src = slice(first - t0, first - t0 + run)
            self.keys[:, :, slot : slot + run] = k[:, :, src]
            self.values[:, :, slot : slot + run] = v[:, :, src]
            self.positions[:, slot : slot + run] = positions[:, src]
            first += run
        self.seen = t0 + T
        self.length = min(cap, self.seen)


class SlotCache:
    """A :class:`KVCache`'s buffers, written at the slots a decoding step names: its tokens' indices.

    :meth:`update` changes no Python number (the cache's ``seen`` and ``length`` stay as they are: the
    caller counts the steps), and attention reads every slot with a mask from the slots' positions.
    So one step has the same shapes at every position, which is what lets ``torch.compile`` trace the
    model's own forward once for a whole generation (:class:`attnlab.decoding.FastDecoder`). Valid while
    slot ``j`` holds token ``j``: a plain cache, or a rolling one that has not wrapped.
    """

    static = True

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.keys, self.values, self.positions = cache.keys, cache.values, cache.positions  # (B, Hkv, M, hd) x2, (B, M)
        self.rolling, self.sinks = cache.rolling, cache.sinks
        self.slots = torch.arange(cache.max_length, device=cache.keys.device)[None]  # (1, M): slot j, position j

    @property
    def max_length(self) -> int:
        return self.keys.shape[2]

    @property
    def seen(self) -> int:
        return self.cache.seen

    def update(self, k: Tensor, v: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, bool]:
        """Write ``k, v (B, Hkv, n, hd)`` of the tokens at ``positions (1, n)`` into those slots; return
        every slot's keys, values and positions (empty slots, past the newest token, are masked as
        causality masks later keys)."""
        at = positions[0]  # (n,)
        self.keys.index_copy_(2, at, k.to(self.keys.dtype))
        self.values.index_copy_(2, at, v.to(self.values.dtype))
        self.positions.index_copy_(1, at, positions.expand(self.positions.shape[0], -1))
        return self.keys, self.values, self.slots, False


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters, state dict, hooks and math) whose product is
    :func:`attnlab.hardware.linear` (``F.linear``, or oneDNN's matmul for float32 inference on some CPUs). The
    projections of :class:`MultiHeadAttention` and :class:`attnlab.GPT`'s MLP and head.
    Shapes: ``(..., in_features) -> (..., out_features)``."""

    def forward(self, x: Tensor) -> Tensor:
        return hardware.linear(x, self.weight, self.bias)


class OffsetRMSNorm(nn.Module):
    """RMSNorm whose gain is ``offset + weight`` (Gemma: ``offset=1``, so a zero weight is the identity).

    Computed in float32 (float64 stays float64) and cast back afterwards, as Gemma does (Llama casts
    before the gain). The weight starts at ``1 - offset``: a gain of 1, as ``nn.RMSNorm``'s. Shapes:
    ``(..., dim) -> (..., dim)``.
    """

    def __init__(self, dim: int, eps: float = 1e-6, offset: float = 1.0) -> None:
        super().__init__()
        self.eps, self.offset = float(eps), float(offset)
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.weight, 1.0 - self.offset)

    def forward(self, x: Tensor) -> Tensor:
        h = x if x.dtype == torch.float64 else x.float()
        y = F.rms_norm(h, (x.shape[-1],), eps=self.eps)  # (..., dim) float32 or float64
        return (y * (self.offset + self.weight.to(h.dtype))).type_as(x)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}"


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that also takes an input of another dtype than its weight: under autocast a
    projection's bfloat16 output meets a float32 gain (QK-norm), which torch's fused kernel refuses (a
    warning every step, then a slower path); here it is normalized in float32, then cast back."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        return F.rms_norm(x.float(), self.normalized_shape, self.weight.float(), self.eps).type_as(x)


def rms_norm(dim: int, eps: float, offset: float = 0.0) -> nn.Module:
    """:class:`RMSNorm` (gain ``weight``), or :class:`OffsetRMSNorm` for a gain ``offset + weight``."""
    return RMSNorm(dim, eps=eps) if offset == 0 else OffsetRMSNorm(dim, eps, offset)


# --------------------------------------------------------------------------------------------
# Multi-head attention with weight splits: the tutorials' class and the production module
# --------------------------------------------------------------------------------------------
class MultiHeadAttention(_DropsTutorialMask):
    """Multi-head attention: one projection split into ``num_heads`` heads, then ``out_proj``.

    The class of "A simple self-attention mechanism", and the production module. Parameters ``W_query``, ``W_key``,
    ``W_value`` and ``out_proj`` are created in the tutorial's order; in self-attention the three
    input projections run as one fused matmul.

    Args:
        d_in: input width.
        d_out: output width, split into ``num_heads`` heads of ``head_dim = d_out // num_heads``.
        context_length: the longest input sequence (with a KV cache: the cache's ``max_length``). A module
            with positions (RoPE, ALiBi, a window) takes longer inputs: then it is only the default cache size.
        dropout: dropout on the attention weights (training only); default 0.0.
        num_heads: number of query heads; required (keyword-defaulted only so that a call in
            another tutorial's argument order gets a TypeError showing the keyword form).
        qkv_bias: bias in the query/key/value projections.
        causal: causal (decoder) self-attention; ``False`` gives a bidirectional encoder block.
            Cross-attention (``context`` given) is never causally masked.
        num_kv_heads: key/value heads for grouped-query attention (default ``num_heads``).
        kv_dim: width of the ``context`` sequence for cross-attention (default ``d_in``).
        out_bias: bias in ``out_proj``.

    Attention since GPT-2 (keyword options, all off by default; see :mod:`attnlab.positions`):
        rope: rotate queries and keys by their positions (RoPE); ``rope_theta`` its base (10000;
            Llama 3: 500000), ``rope_scaling`` a Hugging Face-style dict (``linear``, ``llama3``).
        alibi: add ALiBi's ``-slope_h * distance`` to the scores (no parameters).
        window: sliding causal window: each query sees itself and the ``window - 1`` keys before it.
        sinks: with ``window``, the first ``sinks`` tokens stay visible to every query.
        qk_norm: RMSNorm (with a learned gain) on each query and key head before the scores
            (Qwen 3, Gemma 3; nanochat without the gain), which keeps the logits bounded;
            ``"full"``: one RMSNorm over all the heads' queries (and one over the keys) before they
            are split into heads (OLMo 2).
        norm_eps: epsilon of those RMSNorms; norm_offset: their gain is ``norm_offset + weight``
            (Gemma 3: 1).
        head_dim: width of each head (default ``d_out // num_heads``); the projections are then
            ``num_heads * head_dim`` wide and ``out_proj`` maps that back to ``d_out`` (Gemma, Qwen 3).
        scale: the multiplier of ``q k^T`` (default ``1 / sqrt(head_dim)``; Gemma 2: a configured
            ``query_pre_attn_scalar ** -0.5``).
        softcap: soft-cap the scaled scores, ``softcap * tanh(scores / softcap)``, before masking
            and the softmax (Gemma 2: 50), so no score exceeds the cap.
        rope_dim: with ``rope``, rotate only the first ``rope_dim`` features of each head (partial
            rotary: GPT-NeoX/Pythia a quarter, Phi-4-mini three quarters); the others carry no position.

    A module with positions (``rope``, ``alibi`` or ``window``) attends at explicit positions: by
    default ``0, 1, ...`` after the tokens in its cache; ``positions`` in :meth:`forward` overrides
    them, and a ``key_mask`` makes padding take no position (a left-padded row sees exactly what it
    would alone). Its KV cache may be rolling (:class:`KVCache`), so generation never re-encodes.

    Forward:
        ``x (b, n, d_in)`` or ``(n, d_in)``; optional ``context (b, m, kv_dim)`` for cross-attention;
        ``attn_mask`` bool (True = may attend) or float (added), broadcastable to
        ``(b, num_heads, n, S)``; ``key_mask (b, S)`` bool, True = real token (the opposite of
        ``nn.MultiheadAttention``'s ``key_padding_mask``); ``kv_cache`` a :class:`KVCache` to
        append to and attend over; ``return_weights`` for ``(b, num_heads, n, S)`` weights;
        ``positions (n,)`` or ``(b, n)`` integer positions of the new tokens (modules with positions).
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        context_length: int,
        dropout: float = 0.0,
        num_heads: int | None = None,
        qkv_bias: bool = False,
        *,
        causal: bool = True,
        num_kv_heads: int | None = None,
        kv_dim: int | None = None,
        out_bias: bool = True,
        rope: bool = False,
        rope_theta: float = 10000.0,
        rope_scaling: dict | None = None,
        alibi: bool = False,
        window: int | None = None,
        sinks: int = 0,
        qk_norm: bool | str = False,
        norm_eps: float = 1e-6,
        norm_offset: float = 0.0,
        head_dim: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        rope_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.d_in = positive_int("d_in", d_in)
        self.d_out = positive_int("d_out", d_out)
        self.context_length = positive_int("context_length", context_length)
        self.num_heads = _check_num_heads(num_heads, "MultiHeadAttention")
        _check_dropout(dropout, "MultiHeadAttention")
        if head_dim is None and d_out % num_heads != 0:
            raise ValueError(f"d_out must be divisible by num_heads, got d_out={d_out} and num_heads={num_heads}")
        num_kv_heads = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_heads must be divisible by num_kv_heads, got num_heads={num_heads} and "
                f"num_kv_heads={num_kv_heads}"
            )
        self.kv_dim = d_in if kv_dim is None else positive_int("kv_dim", kv_dim)
        self.num_kv_heads = num_kv_heads
        self.head_dim = d_out // num_heads if head_dim is None else positive_int("head_dim", head_dim)
        self.inner_dim = num_heads * self.head_dim  # = d_out unless head_dim is given
        self.causal = check_bool("causal", causal)
        qkv_bias, out_bias = check_bool("qkv_bias", qkv_bias), check_bool("out_bias", out_bias)
        kv_out = num_kv_heads * self.head_dim
        self.W_query = Linear(d_in, self.inner_dim, bias=qkv_bias)
        self.W_key = Linear(self.kv_dim, kv_out, bias=qkv_bias)
        self.W_value = Linear(self.kv_dim, kv_out, bias=qkv_bias)
        self.out_proj = Linear(self.inner_dim, d_out, bias=out_bias)
        self.dropout = nn.Dropout(dropout)
        # Attention since GPT-2 (created after the tutorials' parameters: their numbers stay the same).
        self.rope = check_bool("rope", rope)
        self.alibi = check_bool("alibi", alibi)
        if self.rope and self.alibi:
            raise ValueError("rope and alibi are two ways to encode positions in attention: choose one")
        if not finite_real(rope_theta) or rope_theta <= 1:
            raise ValueError(f"rope_theta must be a number > 1, got {rope_theta!r}")
        self.rope_theta = float(rope_theta)
        self.rope_scaling = check_rope_scaling(rope_scaling)
        self.rope_dim = self.head_dim if rope_dim is None else positive_int("rope_dim", rope_dim)
        if self.rope_dim > self.head_dim:
            raise ValueError(f"rope_dim={rope_dim} must be at most head_dim={self.head_dim}")
        if self.rope:
            rope_inv_freq(self.rope_dim, self.rope_theta, self.rope_scaling)  # odd rope_dim: a ValueError here
        self.window, self.sinks = check_window(window, sinks)
        if self.window is not None and not self.causal:
            raise ValueError(f"window={window} is a sliding causal window: it needs causal=True")
        if not (isinstance(qk_norm, bool) or qk_norm in ("head", "full")):
            raise TypeError(f"qk_norm must be a bool, 'head' (= True) or 'full', got {qk_norm!r}")
        self.qk_norm = True if qk_norm == "head" else qk_norm  # False, True (per head) or "full"
        if not finite_real(norm_eps) or not 0 < norm_eps < 1:
            raise ValueError(f"norm_eps must be a small positive float, got {norm_eps!r}")
        if not finite_real(norm_offset):
            raise ValueError(f"norm_offset must be a number, got {norm_offset!r}")
        q_width, k_width = (self.inner_dim, kv_out) if qk_norm == "full" else (self.head_dim, self.head_dim)
        self.q_norm = rms_norm(q_width, float(norm_eps), float(norm_offset)) if self.qk_norm else None
        self.k_norm = rms_norm(k_width, float(norm_eps), float(norm_offset)) if self.qk_norm else None
        if scale is not None and not finite_real(scale):
            raise ValueError(f"scale must be a finite number or None, got {scale!r}")
        self.scale = 1.0 / math.sqrt(self.head_dim) if scale is None else float(scale)  # (as attend's default)
        if softcap is not None and (not finite_real(softcap) or softcap <= 0):
            raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
        self.softcap = None if softcap is None else float(softcap)
        self._score_mod = None if softcap is None else softcap_score_mod(self.softcap)
        # Set by attnlab.interpret.hooks for the length of a hooked pass: hook(step, tensor) -> tensor,
        # and hook.attend, attend() with each step a hook point. None (the default) costs one test.
        self.hook: Any = None

    def new_kv_cache(
        self,
        batch_size: int,
        max_length: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        rolling: bool = False,
        sinks: int | None = None,
    ) -> KVCache:
        """A :class:`KVCache` for this module.

        ``max_length`` defaults to ``context_length``, or, for ``rolling=True`` with a window,
        ``window + sinks``: all a sliding window ever needs. ``sinks`` defaults to the module's."""
        w = self.W_key.weight
        sinks = self.sinks if sinks is None else non_negative_int("sinks", sinks)
        if max_length is None:
            max_length = self.window + sinks if rolling and self.window is not None else self.context_length
        return KVCache(
            batch_size,
            max_length,
            self.num_kv_heads,
            self.head_dim,
            dtype=w.dtype if dtype is None else dtype,
            device=w.device if device is None else device,
            rolling=rolling,
            sinks=sinks if rolling else 0,
        )

    @property
    def has_positions(self) -> bool:
        """Whether attention depends on positions beyond causality: RoPE, ALiBi or a window."""
        return self.rope or self.alibi or self.window is not None

    def _project_qkv(self, x: Tensor, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Queries from ``x``; keys and values from ``context`` (cross) or ``x`` (self)."""
        weights = (self.W_query.weight, self.W_key.weight, self.W_value.weight)
        fusable = not any(hardware.owns_linear(w) for w in weights) or (
            all(type(w) is QuantizedTensor for w in weights) and not torch.compiler.is_compiling()
        )
        if context is None and x.shape[:-1].numel() >= 16 and fusable:
            # One matmul for Q, K and V: the weights are concatenated, the parameters stay separate.
            # The copy pays off only over enough tokens: a decoding step runs the three matmuls below.
            # Quantized weights concatenate their packed blocks, so the product (and its order of sums)
            # is the dense model's; compiled, inductor fuses each dequantization into its own product.
            # LoRA's weight updates are products of their own: nothing to gain from a copy.
            w = torch.cat(weights)  # (d_out + 2kv, d_in)
            b = None
            if self.W_query.bias is not None:
                b = torch.cat([self.W_query.bias, self.W_key.bias, self.W_value.bias])
            kv_out = self.num_kv_heads * self.head_dim
            return hardware.linear(x, w, b).split([self.inner_dim, kv_out, kv_out], dim=-1)
        source = x if context is None else context
        return self.W_query(x), self.W_key(source), self.W_value(source)

    def _project_heads(self, xq: Tensor, xk: Tensor, xv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Each head's projection of its own input: ``xq (b, n, H, d_in)``, ``xk, xv (b, n, Hkv, d_in)`` ->
        ``(b, n, H * hd)``, ``(b, n, Hkv * hd)`` x2. Each input goes through the whole projection (the
        module as it is: biases, LoRA, quantized weights) and keeps its head's slice: H times the work."""

        def own(linear: nn.Module, x: Tensor) -> Tensor:
            out = linear(x).unflatten(-1, (x.shape[2], self.head_dim))  # (b, n, heads in, heads out, hd)
            return out.diagonal(dim1=2, dim2=3).transpose(-1, -2).flatten(-2)  # (b, n, heads * hd)

        return own(self.W_query, xq), own(self.W_key, xk), own(self.W_value, xv)

    def forward(
        self,
        x: Tensor,
        context: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        key_mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_weights: bool = False,
        positions: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        check_bool("return_weights", return_weights)
        unbatched = isinstance(x, Tensor) and x.dim() == 2
        x, context, mask, positions = self._check_forward(x, context, attn_mask, key_mask, kv_cache, positions)
        result = self.attend(
            x, context, mask=mask, kv_cache=kv_cache, return_weights=return_weights, positions=positions
        )
        if unbatched:  # drop the batch of 1 that _check_forward added
            result = tuple(r.squeeze(0) for r in result) if return_weights else result.squeeze(0)
        return result

    def attend(
        self,
        x: Tensor | None,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        return_weights: bool = False,
        positions: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        heads: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The computation of :meth:`forward`, on inputs already checked (a GPT calls this directly).

        Args:
            x: ``(b, n, d_in)``; context: ``(b, m, kv_dim)`` or None.
            mask: one bool (True = may attend) or float mask broadcastable to ``(b, H, n, S)``.
            kv_cache: a cache this module may use (see :meth:`new_kv_cache`).
            positions: for a module with positions, ``(1, n)`` or ``(b, n)`` positions of the new
                tokens (-1 = padding); None: ``seen, seen + 1, ...`` after the cached tokens.
            rope: ``(cos, sin)`` of those positions, ``(1 or b, 1, n, head_dim)`` (a GPT computes them
                once for all its layers); None: computed here.
            heads: in place of ``x`` (None), each head's own input (TransformerLens's split inputs):
                ``(b, n, H, d_in)`` for the queries, ``(b, n, Hkv, d_in)`` for the keys and the values.
        Returns:
            ``(b, n, d_out)``, and the ``(b, H, n, S)`` weights with ``return_weights``.
        """
        q, k, v = self._project_qkv(x, context) if heads is None else self._project_heads(*heads)
        b, n = q.shape[:2]
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)  # all heads' queries (keys) together to unit RMS (OLMo 2)
        q = q.view(b, n, self.num_heads, self.head_dim)  # (b, n, H, hd)
        k = k.view(b, k.shape[1], self.num_kv_heads, self.head_dim)  # (b, m, Hkv, hd)
        v = v.view(b, v.shape[1], self.num_kv_heads, self.head_dim)  # (b, m, Hkv, hd)
        hook = self.hook
        if hook is not None:  # attnlab.interpret.hooks: read or replace the projections
            q, k, v = hook("q", q), hook("k", k), hook("v", v)
        if self.qk_norm is True:
            q, k = self.q_norm(q), self.k_norm(k)  # each head's vector to unit RMS, times a learned gain
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (b, H, n, hd), (b, Hkv, m, hd) x2
        is_causal = self.causal and context is None
        window, sinks, q_pos, k_pos = None, 0, None, None
        if self.has_positions:
            q, k, v, mask, is_causal, window, sinks, q_pos, k_pos = self._at_positions(
                q, k, v, mask, kv_cache, positions, rope
            )
        elif kv_cache is not None and kv_cache.static:  # a decoding step's slots: causality from their positions
            k, v, k_pos, _ = kv_cache.update(k, v, positions)  # (b, Hkv, M, hd) x2, (1, M)
            mask, is_causal = combine_masks(mask, positions_mask(positions, k_pos)[:, None]), False  # (b, 1, n, M)
            q_pos = positions  # (1, n): told to hooks with the slots' positions
        elif kv_cache is not None:
            dt = kv_cache.keys.dtype  # differs from k's only under autocast
            k, v = kv_cache._write(k.to(dt), v.to(dt))  # (b, Hkv, S = past + n, hd)
        if autocast_on(q.device):
            # Under autocast the projections come out in the autocast dtype while a cache or a
            # float mask keeps its own: attend in the queries' dtype.
            k, v = k.to(q.dtype), v.to(q.dtype)  # (b, Hkv, S, hd)
            if mask is not None and mask.is_floating_point():
                mask = mask.to(q.dtype)
        # With hooks set on them, the steps (rot_q, rot_k, attn_scores, pattern, z) are computed one by one,
        # and their hooks are told how this pass attends (the positions and the soft cap besides attend's own).
        stepwise = hook is not None and hook.stepwise
        told = {"q_positions": q_pos, "k_positions": k_pos, "softcap": self.softcap} if stepwise else {}
        result = (hook.attend if stepwise else attend)(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout.p if self.training else 0.0,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.num_kv_heads != self.num_heads,
            window=window,
            sinks=sinks,
            score_mod=self._score_mod,  # soft-capping (None: the fused kernels)
            return_weights=return_weights,
            # A soft cap is not a bias a fused kernel can add: the explicit path, as transformers' eager Gemma 2.
            backend="reference" if self._score_mod is not None else "auto",
            **told,
        )
        heads, weights = result if return_weights else (result, None)  # (b, H, n, hd), (b, H, n, S)
        if hook is not None and "result" in hook.fns:
            out = self._project_heads_apart(heads, hook)  # (b, n, d_out)
        else:
            out = self.out_proj(heads.transpose(1, 2).reshape(b, n, self.inner_dim))  # (b, n, d_out)
        return (out, weights) if return_weights else out

    def _project_heads_apart(self, heads: Tensor, hook: Any) -> Tensor:
        """The output projection of ``heads (b, H, n, hd)`` as the sum of each head's share, the shares
        ``(b, n, H, d_out)`` (without the bias) through the ``result`` hook (TransformerLens's
        ``hook_result``): ``(b, n, d_out)``. Only while that point is hooked: the shares are H times
        the output's size."""
        if self.out_proj._forward_pre_hooks:
            # out_proj does not run whole here: its pre-hooks (ablate's, the circuits' edits) still get
            # its input, the heads side by side, as they would if it did.
            b, H, n, hd = heads.shape
            x = heads.transpose(1, 2).reshape(b, n, H * hd)
            with_kwargs = self.out_proj._forward_pre_hooks_with_kwargs
            for key, pre_hook in list(self.out_proj._forward_pre_hooks.items()):
                if key in with_kwargs:  # (registered with_kwargs=True: (args, kwargs) in and out)
                    changed = pre_hook(self.out_proj, (x,), {})
                    changed = None if changed is None else changed[0]
                else:
                    changed = pre_hook(self.out_proj, (x,))
                if changed is not None:
                    x = changed[0] if isinstance(changed, tuple) else changed
            heads = x.reshape(b, n, H, hd).transpose(1, 2)  # (b, H, n, hd)
        w = self.out_proj.weight  # (d_out, H * hd)
        w = w.dequantize(heads.dtype) if isinstance(w, QuantizedTensor) else w.to(heads.dtype)
        per_head = w.view(self.d_out, self.num_heads, self.head_dim)  # (d_out, H, hd)
        result = hook("result", torch.einsum("bhne,dhe->bnhd", heads, per_head))  # (b, n, H, d_out)
        out = result.sum(2)  # (b, n, d_out)
        return out if self.out_proj.bias is None else out + self.out_proj.bias

    def _at_positions(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        kv_cache: KVCache | None,
        positions: Tensor | None,
        rope: tuple[Tensor, Tensor] | None,
    ) -> tuple:
        """RoPE, the cache and the masks of a module with positions.

        Returns ``(q, k, v, mask, is_causal, window, sinks, q_positions, k_positions)`` for
        :func:`attnlab.functional.attend`. Queries and keys in plain order (no cache, or a cache
        that has not wrapped, and default positions) keep causality and the window as arguments,
        so training runs the band-blocked sliding-window path; anything else (padding, a rolling
        cache, explicit positions) becomes one mask computed from the positions themselves.
        """
        n = q.shape[2]
        default = positions is None
        if default:
            past = 0 if kv_cache is None else kv_cache.seen
            positions = torch.arange(past, past + n, device=q.device)[None]  # (1, n)
        if self.rope:
            cos, sin = rope if rope is not None else self.rope_cos_sin(positions, q.dtype)
            cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # (angles in float32; rotate in the queries' dtype)
            if self.rope_dim == self.head_dim:
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (b, H, n, hd), (b, Hkv, n, hd)
            else:  # partial rotary: the first rope_dim features turn, the rest keep no position
                r = self.rope_dim
                q = torch.cat([apply_rope(q[..., :r], cos, sin), q[..., r:]], dim=-1)  # (b, H, n, hd)
                k = torch.cat([apply_rope(k[..., :r], cos, sin), k[..., r:]], dim=-1)  # (b, Hkv, n, hd)
        ordered, k_pos = True, positions
        if kv_cache is not None:
            if not kv_cache.static:  # (a slot cache never wraps: its decoder stops at the last slot)
                self._check_ring(kv_cache, n)
            dt = kv_cache.keys.dtype  # differs from k's only under autocast
            k, v, k_pos, ordered = kv_cache.update(k.to(dt), v.to(dt), positions)  # (b, Hkv, S, hd), (b, S)
        window, sinks, is_causal = self.window, self.sinks, self.causal
        if window is None and kv_cache is not None and kv_cache.rolling:
            window, sinks = kv_cache.max_length - kv_cache.sinks, kv_cache.sinks  # the ring is the window
        if default and ordered:
            pass  # index j is position j: causality and the window stay arguments (the fast paths)
        elif default and n == 1 and kv_cache.max_length - kv_cache.sinks <= window and kv_cache.sinks <= sinks:
            # A decoding step over a ring no longer than its window, whose sink slots are its sinks, sees every slot.
            is_causal, window, sinks = False, None, 0
        else:
            visible = positions_mask(positions, k_pos, causal=is_causal, window=window, sinks=sinks)  # (1|b, n, S)
            mask = combine_masks(mask, visible[:, None])  # (b, H or 1, n, S)
            is_causal, window, sinks = False, None, 0
        if self.alibi:
            slopes = alibi_slopes_on(self.num_heads, q.device, q.dtype)  # (H,)
            bias = alibi_bias(slopes, positions, k_pos)  # (1|b, H, n, S)
            mask = combine_masks(bias, mask)
        return q, k, v, mask, is_causal, window, sinks, positions, k_pos

    def _check_ring(self, cache: KVCache, n: int) -> None:
        """A rolling cache shorter than the window (+ sinks) may fill up, but not wrap: it would drop
        keys the window still sees."""
        ring = cache.max_length - cache.sinks
        too_small = self.window is not None and (ring < self.window or cache.sinks < self.sinks)
        if cache.rolling and too_small and cache.seen + n > cache.max_length:
            raise ValueError(
                f"kv_cache is full: its {cache.sinks} sink and {ring} ring slots hold {cache.seen} tokens, and "
                f"{n} more would overwrite keys a window of {self.window} with {self.sinks} sinks still sees; make it "
                f"with new_kv_cache(rolling=True) (window + sinks slots)"
            )

    def rope_cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """RoPE's ``(cos, sin)`` for ``positions (1 or b, n)``, shaped ``(1 or b, 1, n, rope_dim)``."""
        cos, sin = rope_cos_sin(positions, self.rope_dim, self.rope_theta, scaling=self.rope_scaling, dtype=dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def _check_forward(
        self,
        x: object,
        context: object,
        attn_mask: object,
        key_mask: object,
        kv_cache: object,
        positions: object = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
        """:meth:`forward`'s arguments checked, batched (an unbatched input gets a batch of 1), and the
        two masks merged into one broadcastable to ``(b, H, n, S)``; for a module with positions the
        key mask turns into positions instead (padding gets -1 and takes no position).

        Everything is checked before anything changes: a bad mask leaves a KV cache as it was.
        """
        check_module_input("x", x, self.d_in, self.W_query.weight)
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(0)  # (1, n, d_in)
        b, n, _ = x.shape
        if context is not None:
            check_module_input("context", context, self.kv_dim, self.W_key.weight)
            if context.dim() == 2:
                context = context.unsqueeze(0)
            if context.shape[0] != b:
                raise ValueError(f"context has batch size {context.shape[0]} but x has {b}")
            if kv_cache is not None:
                raise ValueError("kv_cache is for self-attention; for cross-attention project the context once")
            if self.has_positions:
                raise ValueError("rope, alibi and window relate queries and keys of one sequence: not cross-attention")
        elif self.kv_dim != self.d_in:
            raise ValueError(
                f"this module was built for cross-attention (kv_dim={self.kv_dim} != d_in={self.d_in}); "
                f"pass the context sequence"
            )
        if kv_cache is not None:
            if not isinstance(kv_cache, KVCache):
                raise TypeError(f"kv_cache must be an attnlab KVCache or None, got {type(kv_cache).__name__}")
            kv_cache.check_usable(b, x.device, self)
            kv_cache._check_room(n)
        elif not self.has_positions:  # relative positions and windows have no longest input
            check_length(n, self.context_length)
        if positions is not None:
            positions = self._check_positions(positions, b, n, x.device)
        # The masks cover every key: the cached ones and the new ones.
        S = (n if context is None else context.shape[1]) + (0 if kv_cache is None else kv_cache.length)
        if attn_mask is not None:
            if kv_cache is not None and kv_cache.rolling:
                raise ValueError("attn_mask cannot follow a rolling kv_cache's reordered slots: use key_mask")
            # (unbatched input has been given a batch of 1: an (H, n, S) mask broadcasts to it)
            check_attn_mask(
                attn_mask,
                device=x.device,
                dtype=x.dtype,
                target=(b, self.num_heads, n, S),
                input_name="x",
                any_float_dtype=autocast_on(x.device),  # attend() casts a float mask to the autocast dtype
            )
        if key_mask is None:
            return x, context, attn_mask, positions
        S = (n if context is None else context.shape[1]) + (0 if kv_cache is None else kv_cache.seen)
        if not isinstance(key_mask, Tensor) or key_mask.dtype != torch.bool:
            got = key_mask.dtype if isinstance(key_mask, Tensor) else type(key_mask).__name__
            raise TypeError(
                f"key_mask must be a bool tensor, True = real token (the opposite of "
                f"nn.MultiheadAttention's key_padding_mask), got {got}"
            )
        if unbatched and key_mask.dim() == 1:
            key_mask = key_mask.unsqueeze(0)  # (1, S)
        if tuple(key_mask.shape) != (b, S):
            raise ValueError(f"key_mask must have shape (batch, keys) = {(b, S)}, got {tuple(key_mask.shape)}")
        if key_mask.device != x.device:
            raise ValueError(f"key_mask is on {key_mask.device} but x is on {x.device}")
        if self.has_positions:
            # Padding takes no position: each real token's position counts the real tokens before it.
            new = key_mask[:, S - n :]  # (b, n)
            if positions is None:
                positions = key_mask.long().cumsum(-1)[:, S - n :] - 1  # (b, n)
            return x, context, attn_mask, positions.expand(b, n).masked_fill(~new, -1)
        km = key_mask[:, None, None, :]  # (b, 1, 1, S)
        return x, context, combine_masks(attn_mask, km), positions

    def _check_positions(self, positions: object, b: int, n: int, device: torch.device) -> Tensor:
        if not self.has_positions:
            raise ValueError("positions only matter to a module with rope, alibi or window")
        if not isinstance(positions, Tensor) or positions.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"positions must be an integer tensor, got {getattr(positions, 'dtype', positions)!r}")
        if positions.shape not in ((n,), (1, n), (b, n)):
            raise ValueError(f"positions must have shape {(n,)} or {(b, n)}, got {tuple(positions.shape)}")
        if positions.device != device:
            raise ValueError(f"positions are on {positions.device} but x is on {device}")
        positions = positions.long().reshape(-1, n)  # (1 or b, n)
        if positions.numel() and int(positions.min()) < -1:
            raise ValueError("positions must be >= 0 (or -1 for padding)")
        return positions

    def extra_repr(self) -> str:
        extra = f"num_heads={self.num_heads}, head_dim={self.head_dim}, causal={self.causal}"
        if self.num_kv_heads != self.num_heads:
            extra += f", num_kv_heads={self.num_kv_heads}"
        if self.rope:
            extra += f", rope_theta={self.rope_theta:g}"
        if self.alibi:
            extra += ", alibi=True"
        if self.window is not None:
            extra += f", window={self.window}" + (f", sinks={self.sinks}" if self.sinks else "")
        if self.qk_norm:
            extra += f", qk_norm={self.qk_norm!r}"
        if self.rope and self.rope_dim != self.head_dim:
            extra += f", rope_dim={self.rope_dim}"
        if self.softcap is not None:
            extra += f", softcap={self.softcap:g}"
        return extra
