"""Quantized weights that stay quantized: a GGUF file's blocks as a weight the library's layers accept.

A GGUF file stores most matrices in blocks of 32 or 256 weights, each block a few small integers per
weight and one or two scales (llama.cpp's ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``, ``Q8_0`` and the
"K-quants" ``Q2_K`` to ``Q6_K``), or as half-precision numbers (``F16``, ``BF16``). Dequantized to
float32 at load, a 4-bit model takes 7 to 8 times its file in memory. :class:`QuantizedTensor` keeps
the blocks instead and computes with them:

* It is a ``torch.Tensor`` subclass of the *logical* shape ``(out_features, in_features)`` and dtype
  (float32 by default), whose data are the file's fields, one tensor each (the scales as the file's
  float16 numbers, the 4- and 5-bit integers still packed two to a byte, the K-quants' 6-bit
  sub-block scales unpacked to one byte each; Q4_K's, Q5_K's and Q6_K's sub-block scales as the
  float32 products their weights are multiplied by, see :func:`_split_k`). The repacking is lossless:
  :meth:`QuantizedTensor.dequantize` gives exactly the numbers ``gguf.quants.dequantize`` gives, by
  the same float32 operations.
* ``F.linear(x, w)`` (so :class:`attnlab.attention.Linear`, which calls it for such a weight)
  dequantizes a tile of rows at a time (by torch operations, or for the 4-bit formats by one compiled
  loop once compiling pays: see :data:`COMPILE_AFTER_S`) and multiplies it with oneDNN/MKL's matmul,
  so only one tile is ever dense; a one-row product (a decoding step) is each format's sum over its
  packed fields, which inductor turns into one loop over the bytes (fewer bytes read per token than a
  float32 weight's; for AVX2's 8 float lanes, the bytes read as 32-bit words: ``Format.matvec8``):
  inside a compiled step, and uncompiled as a compiled function of its own once the process has
  decoded long enough to pay for compiling it (the tiles until then). ``F.embedding(ids, w)``
  dequantizes the rows looked up.
* In bfloat16 (``model.to(torch.bfloat16)``: a generation path of its own) the 4-bit formats (Q4_0,
  Q4_1, Q4_K) compute with torch's int4 weight-only kernel (``_weight_int4pack_mm_for_cpu``), eager
  and compiled: their blocks repacked losslessly into torch's layout (see :func:`int4_pack`; the
  kernel's float32 dequantization of the pack is gguf's, bit for bit), its scales then rounded to
  bfloat16. Float32 weights keep the tiled products (torch's float32 int4 kernel is a scalar loop).
* Gradients flow to the activations (``x.grad``: the transposed product, tile by tile again), never to
  the weight: a quantized weight is frozen (LoRA adapts it through a parametrization whose update is
  a product of its own beside the blocks: :class:`attnlab.training.lora.LowRankUpdated`).
* Moving rows (``torch.cat``, ``split``, slicing, ``index_select`` on dimension 0: how checkpoints fuse
  or split projections), ``.to(device)``, ``.to(dtype)`` (the logical dtype; the blocks stay as
  they are), ``detach`` and ``clone`` keep the blocks. Any other operation on the weight computes on
  its dequantized values (correct, and dense for that one result).

This is the design of torchao's ``AffineQuantizedTensor`` (a wrapper subclass with
``__tensor_flatten__`` so that ``torch.compile`` sees the inner tensors) and gpt-fast's weight-only
quantized linear layers, on GGUF's own block layouts.

    w = QuantizedTensor.from_blocks("Q4_1", raw, shape=(out, in))   # raw: (out, in // 32 * 20) uint8
    y = F.linear(x, w)                                               # (..., in) -> (..., out)
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab import hardware
from attnlab.checks import is_int

__all__ = [
    "FORMATS",
    "QuantizedTensor",
    "dequantize",
    "from_safetensors",
    "is_quantized",
    "stored_tensors",
    "to_safetensors",
]

QK_K = 256  # the K-quants' super-block
_CODE = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]  # (see _stable_hash_for_caching)
# Dense weights of this many elements at most are dequantized at once by an eager product (one tile of
# rows; compiled tiles: COMPILED_TILE_ELEMENTS): small enough to stay in the CPU's caches between the
# dequantization and the matmul reading it, and a small part of the model's memory (a tile is the one
# dense piece of a quantized weight at a time).
TILE_ELEMENTS = 1 << 18
# On an accelerator (CUDA, MPS) a tile's time is in launching its dozen kernels, not in a cache: a product
# there dequantizes a matrix at once, up to this many elements (256 MB in float32; an 8B model's head in
# eight tiles).
ACCELERATOR_TILE_ELEMENTS = 1 << 26


# --------------------------------------------------------------------------------------------
# The block formats: how each is split into fields at load and dequantized by torch operations
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Format:
    """One GGML block format.

    Attributes:
        name: GGML's name (``"Q4_1"``).
        block: weights per block.
        nbytes: bytes per block in the file.
        split: ``split(blocks (R, nb, nbytes) uint8 numpy) -> {field: array (R, nb, ...)}``, lossless.
        dequantize: ``dequantize(fields (R, nb, ...) each) -> (R, nb * block) float32``.
        matvec: ``matvec(fields, x (nb, block) float32) -> (R,)``: the one-row product ``w @ x`` as a
            sum over the packed fields, for ``torch.compile``.
        tile: ``dequantize`` written for ``torch.compile``, the same numbers (None: the format's tiles
            stay eager).
        matvec8: ``matvec`` for vector units of 8 float lanes (AVX2), its fields named in ``words`` read
            as int32 words (None: ``matvec`` there too).
        tile8: ``tile`` for 8 float lanes, from the same words: ``(tile8(fields) -> (R, nb * block), order
            (block,))``, its column ``i`` of a block being the block's weight ``order[i]`` (None: ``tile``).
    """

    name: str
    block: int
    nbytes: int
    split: Callable[[np.ndarray], dict[str, np.ndarray]]
    dequantize: Callable[[dict[str, Tensor]], Tensor]
    matvec: Callable[[dict[str, Tensor], Tensor], Tensor]
    tile: Callable[[dict[str, Tensor]], Tensor] | None = None
    matvec8: Callable[[dict[str, Tensor], Tensor], Tensor] | None = None
    words: tuple[str, ...] = ()
    tile8: tuple[Callable[[dict[str, Tensor]], Tensor], Tensor] | None = None


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per entry (..., 2) uint8 as float16 (...,): the file's scale, bit for bit."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _nibbles(qs: Tensor) -> Tensor:
    """``(..., n)`` bytes -> ``(..., 2n)``: the low nibbles of all bytes, then the high ones (GGML's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _nibbles_float(qs: Tensor, offset: int = 0) -> Tensor:
    """:func:`_nibbles` minus ``offset`` as float32, each half written straight into the result (one
    pass over the floats, where a concatenation and a conversion would make two)."""
    n = qs.shape[-1]
    out = torch.empty(*qs.shape[:-1], 2 * n, dtype=torch.float32, device=qs.device)
    lo, hi = qs & 0x0F, qs >> 4
    if offset:  # (on the bytes, before they are floats: exact small integers either way)
        lo, hi = lo.to(torch.int8) - offset, hi.to(torch.int8) - offset
    out[..., :n] = lo
    out[..., n:] = hi
    return out


def _bits(b: Tensor, width: int) -> Tensor:
    """``(..., n, m)`` bytes -> ``(..., n * 8 // width, m)``: each row of bytes becomes ``8 // width``
    rows of its ``width``-bit groups, the lowest bits first (GGML's order)."""
    mask = (1 << width) - 1
    parts = [(b >> s) & mask for s in range(0, 8, width)]  # each (..., n, m)
    return torch.stack(parts, dim=-2).flatten(-3, -2)  # (..., n, 8 // width, m) -> (..., n * 8 // width, m)


def _unpack_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes of packed 6-bit scales and mins -> ``(sc, m)``, 8 each (uint8)."""
    s = scales.reshape(*scales.shape[:-1], 3, 4)
    d, m, m_d = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _unpack_q3_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes of 16 packed 6-bit scales -> 16 signed scales (int8, ``value - 32``)."""
    lo, hi = scales[..., :8], scales[..., 8:]
    lo = np.concatenate([lo & 0x0F, lo >> 4], axis=-1)  # (..., 16)
    hi = np.concatenate([(hi >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-1)  # (..., 16)
    return ((lo | (hi << 4)).astype(np.int8) - np.int8(32)).astype(np.int8)


# Each is gguf's formula with the same float32 operations (a scale times an integer is exact in float32:
# an 11-bit float16 mantissa times an integer of at most 8 bits), in as few passes over the tile as
# eager torch allows: the integers become floats once, then the scale and offset apply in place
# (``addcmul`` with a broadcast scale, or mixed-dtype promotion, take slower loops).
def _col(t: Tensor) -> Tensor:
    """A per-block (or per-sub-block) scale ``(R, nb[, s])`` as float32 ``(R, nb[, s], 1)``."""
    return t.float().unsqueeze(-1)


def _q8_0(f: dict[str, Tensor]) -> Tensor:
    return f["qs"].float().mul_(_col(f["d"])).flatten(-2)  # (R, nb, 32) * (R, nb, 1)


def _q4_0(f: dict[str, Tensor]) -> Tensor:
    q = _nibbles_float(f["qs"], 8)  # (R, nb, 32) in [-8, 8)
    return q.mul_(_col(f["d"])).flatten(-2)


def _q4_1(f: dict[str, Tensor]) -> Tensor:
    return _nibbles_float(f["qs"]).mul_(_col(f["d"])).add_(_col(f["m"])).flatten(-2)  # d * q + m


def _q5(f: dict[str, Tensor]) -> Tensor:
    """The five-bit values (R, nb, 32): the nibbles, and bit i of the block's 32-bit ``qh`` as bit 4."""
    high = _bits(f["qh"].unsqueeze(-1), 1).flatten(-2)  # (R, nb, 4, 1) -> (R, nb, 32): bit i of byte i // 8
    return _nibbles(f["qs"]) | (high << 4)


def _q5_0(f: dict[str, Tensor]) -> Tensor:
    return (_q5(f).to(torch.int8) - 16).float().mul_(_col(f["d"])).flatten(-2)


def _q5_1(f: dict[str, Tensor]) -> Tensor:
    return _q5(f).float().mul_(_col(f["d"])).add_(_col(f["m"])).flatten(-2)


def _sub_scales(d: Tensor, sc: Tensor) -> Tensor:
    """A super-block's scale ``d (R, nb)`` times its sub-blocks' integer scales ``sc (R, nb, s)``:
    ``(R, nb, s, 1)`` float32 (exact: at most 11 + 8 significant bits)."""
    return _col(d.float().unsqueeze(-1) * sc.float())


def _q2_k(f: dict[str, Tensor]) -> Tensor:
    sc = f["scales"]  # (R, nb, 16): a 4-bit scale and a 4-bit min per 16 weights
    q = _bits(f["qs"].unflatten(-1, (2, 32)), 2)  # (R, nb, 2, 32) -> (R, nb, 8, 32)
    q = q.reshape(*q.shape[:-2], 16, 16).float()
    return q.mul_(_sub_scales(f["d"], sc & 0x0F)).sub_(_sub_scales(f["dmin"], sc >> 4)).flatten(-3)


def _q3_k(f: dict[str, Tensor]) -> Tensor:
    low = _bits(f["qs"].unflatten(-1, (2, 32)), 2)  # (R, nb, 8, 32): two bits of each weight
    high = _bits(f["hmask"].unsqueeze(-2), 1) ^ 1  # (R, nb, 8, 32): the third bit, set meaning "no offset"
    q = low.to(torch.int8) - (high << 2).to(torch.int8)
    q = q.reshape(*q.shape[:-2], 16, 16).float()
    return q.mul_(_sub_scales(f["d"], f["scales"])).flatten(-3)


def _q4_k(f: dict[str, Tensor]) -> Tensor:
    q = _bits(f["qs"].unflatten(-1, (4, 32)), 4).float()  # (R, nb, 8, 32)
    return q.mul_(_col(f["scale"])).sub_(_sub_scales(f["dmin"], f["m"])).flatten(-3)


def _q5_k(f: dict[str, Tensor]) -> Tensor:
    low = _bits(f["qs"].unflatten(-1, (4, 32)), 4)  # (R, nb, 8, 32)
    high = _bits(f["qh"].unsqueeze(-2), 1)  # (R, nb, 8, 32)
    q = (low | (high << 4)).float()
    return q.mul_(_col(f["scale"])).sub_(_sub_scales(f["dmin"], f["m"])).flatten(-3)


def _q6_k(f: dict[str, Tensor]) -> Tensor:
    low = _bits(f["ql"].unflatten(-1, (2, 64)), 4)  # (R, nb, 4, 64)
    low = low.reshape(*low.shape[:-2], 8, 32)
    high = _bits(f["qh"].unflatten(-1, (2, 32)), 2)  # (R, nb, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    q = q.reshape(*q.shape[:-2], 16, 16).float()
    return q.mul_(_col(f["scale"])).flatten(-3)


def _dense(f: dict[str, Tensor]) -> Tensor:
    return f["w"].float().flatten(-2)


# The dequantizations of the 4-bit formats written for torch.compile (a tile, see _dense_tile): eager, the
# functions above are the fast ones (in place, a pass per operation); compiled, their in-place writes into
# slices of a buffer become scatters, while these pure expressions become one loop over the tile.
def _bit_groups(b: Tensor, width: int) -> Tensor:
    """``(..., m)`` bytes -> ``(..., 8 // width, m)``: :func:`_bits` as one broadcast shift (no stack)."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=b.device)
    return (b.unsqueeze(-2) >> shifts[:, None]) & ((1 << width) - 1)


def _tile_q4_0(f: dict[str, Tensor]) -> Tensor:
    q = _bit_groups(f["qs"], 4).float() - 8  # (R, nb, 2, 16): the low nibbles, then the high ones
    return (q * f["d"].float()[..., None, None]).flatten(-3)


def _tile_q4_1(f: dict[str, Tensor]) -> Tensor:
    q = _bit_groups(f["qs"], 4).float()  # (R, nb, 2, 16)
    return (q * f["d"].float()[..., None, None] + f["m"].float()[..., None, None]).flatten(-3)


def _tile_q4_k(f: dict[str, Tensor]) -> Tensor:
    q = _bit_groups(f["qs"].unflatten(-1, (4, 32)), 4).flatten(-3, -2).float()  # (R, nb, 4, 2, 32) -> (R, nb, 8, 32)
    return (q * _col(f["scale"]) - _sub_scales(f["dmin"], f["m"])).flatten(-3)


# The tiles for 8 float lanes read the bytes as words (whole vector loads, see _as_words): Q4_0's and
# Q4_1's each word broadcast and shifted by 8 amounts (as _nibble_words), Q4_K's 8 words at once, one
# nibble of each. Their columns come out in the words' order, so the product takes x's columns in
# that order too (_product).
def _nibble_order() -> Tensor:
    """The weight at each column of a block of :func:`_tile8_q4_0`: nibble j of word k, ``16 (j % 2) + 4k + j // 2``."""
    k, j = torch.meshgrid(torch.arange(4), torch.arange(8), indexing="ij")
    return (16 * (j % 2) + 4 * k + j // 2).flatten()


def _tile8_q4_0(f: dict[str, Tensor]) -> Tensor:
    q = ((f["qs"].unsqueeze(-1) >> 4 * _iota(8, f["qs"])) & 15).float()  # (R, nb, 4, 8): nibble j of word k
    return ((q - 8) * f["d"].float()[..., None, None]).flatten(1)


def _tile8_q4_1(f: dict[str, Tensor]) -> Tensor:
    q = ((f["qs"].unsqueeze(-1) >> 4 * _iota(8, f["qs"])) & 15).float()  # (R, nb, 4, 8)
    return (q * f["d"].float()[..., None, None] + f["m"].float()[..., None, None]).flatten(1)


def _tile8_q4_k(f: dict[str, Tensor]) -> Tensor:
    w = f["qs"].unflatten(-1, (4, 8))[:, :, :, None, None, :]  # (R, nb, g, 1, 1, k) words
    h, b = _iota(2, w)[:, None, None], _iota(4, w)[:, None]
    q = ((w >> 8 * b + 4 * h) & 15).float()  # (R, nb, g, h, b, k): byte b of word k, its nibble h
    scale = f["scale"].view(*f["dmin"].shape, 4, 2, 1, 1)  # sub-block 2g + h
    low = _sub_scales(f["dmin"], f["m"]).view(*f["dmin"].shape, 4, 2, 1, 1)
    return (q * scale - low).flatten(1)


def _word_order() -> Tensor:
    """Q4_K's weight at each column of :func:`_tile8_q4_k`'s block: ``64 g + 32 h + 4 k + b``."""
    g, h, b, k = torch.meshgrid(*(torch.arange(n) for n in (4, 2, 4, 8)), indexing="ij")
    return (64 * g + 32 * h + 4 * k + b).flatten()


# The one-row products (a decoding step under torch.compile): the sum over blocks written on the packed
# fields, each field multiplied by the slice of ``x`` its integers stand for, so that inductor makes one
# vectorized loop over the bytes. The dequantized weight's order (a block's low nibbles, then its high
# ones) would make every weight a gather, which inductor's CPU code does not vectorize. Each scale goes
# onto ``x``'s slice before the product, so that a row's whole sum is one reduction (a reduction per
# block of 16 or 32 would end every block in a horizontal sum).
def _row_sums(t: Tensor) -> Tensor:
    """``t (R, nb, ...)`` summed over all but its first dim; compiled, the terms of the blocks' first and
    second halves are added first, so that each iteration of inductor's loop reads two places of a row
    at once. The loops do much arithmetic per byte, so few of their reads from memory are in flight at
    a time; two streams a row keep twice as many in flight (see docs/performance.md)."""
    # (the formats of 32 weights a block; the K-quants' loops, longer, came out slower so: _block_sums)
    dims, n = tuple(range(1, t.dim())), t.shape[1]
    if not _read_in_halves(n):
        return t.sum(dims)
    return (t[:, : n // 2] + t[:, n // 2 :]).sum(dims)


def _in_halves(blocks: int) -> bool:
    """Whether a row of ``blocks`` blocks is summed in two halves (:func:`_row_sums`): an even count, 4 or more."""
    return blocks % 2 == 0 and blocks >= 4


def _read_in_halves(blocks: int | torch.SymInt) -> bool:
    """Whether the code being compiled now reads a row of ``blocks`` blocks in two halves: a fixed count
    that :func:`_in_halves` takes, or a symbolic one where :func:`_compile_ahead` traces for such counts."""
    paired = _in_halves(blocks) if isinstance(blocks, int) else _tracing_even_blocks
    return paired and torch.compiler.is_compiling()


_tracing_even_blocks = False  # set while _compile_ahead traces code for even counts of blocks (under _AHEAD_LOCK)


def _nibble_dot(qs: Tensor, x: Tensor, lo_scale: Tensor, hi_scale: Tensor, pair: bool = True) -> Tensor:
    """``qs (R, ..., n)`` bytes, ``x (..., 2n)``, scales ``(R, ...)`` -> ``(R,)``: the sum over every block
    of ``lo_scale * (low nibbles . x[:n]) + hi_scale * (high nibbles . x[n:])``."""
    n = qs.shape[-1]
    lo = (qs & 0x0F).float() * (lo_scale.unsqueeze(-1) * x[..., :n])
    hi = (qs >> 4).float() * (hi_scale.unsqueeze(-1) * x[..., n:])
    return _row_sums(lo + hi) if pair else (lo + hi).sum(tuple(range(1, lo.dim())))  # (flattened: a gather)


def _mv_dense(f: dict[str, Tensor], x: Tensor) -> Tensor:
    return (f["w"].float() * x).sum((-2, -1))  # (R, in, 1) * (in, 1)


def _mv_q8_0(f: dict[str, Tensor], x: Tensor) -> Tensor:
    # Each block as two halves of 16: inductor loads 16 bytes at once into a vector of 16 floats' width.
    qs, x = f["qs"].unflatten(-1, (2, 16)), x.unflatten(-1, (2, 16))  # (R, nb, 2, 16), (nb, 2, 16)
    return _row_sums(qs.float() * (f["d"].float()[..., None, None] * x))  # sum of q * (d x)


def _mv_q4_0(f: dict[str, Tensor], x: Tensor) -> Tensor:
    d = f["d"].float()  # (R, nb)
    return _nibble_dot(f["qs"], x, d, d) - 8 * (d * x.sum(-1)).sum(-1)  # d * ((q - 8) . x)


def _mv_q4_1(f: dict[str, Tensor], x: Tensor) -> Tensor:
    d = f["d"].float()  # (R, nb)
    return _nibble_dot(f["qs"], x, d, d) + (f["m"].float() * x.sum(-1)).sum(-1)  # d * (q . x) + m * sum(x)


def _mv_q2_k(f: dict[str, Tensor], x: Tensor) -> Tensor:
    # Weight 128h + 32s + i of a super-block: bits 2s, 2s + 1 of qs[32h + i], in sub-block 8h + 2s + i // 16,
    # whose scale and min are the low and high nibble of its byte of ``scales``. One term per s.
    sc = f["scales"]  # (R, nb, 16)
    scale = (f["d"].float().unsqueeze(-1) * (sc & 0x0F).float()).unflatten(-1, (2, 4, 2))  # (R, nb, h, s, i // 16)
    mins = f["dmin"].float().unsqueeze(-1) * (sc >> 4).float()  # (R, nb, 16)
    qs = f["qs"].unflatten(-1, (2, 2, 16))  # (R, nb, h, i // 16, i % 16)
    xs = x.unflatten(-1, (2, 4, 2, 16))  # (nb, h, s, i // 16, i % 16)
    total = -(mins * x.unflatten(-1, (16, 16)).sum(-1)).sum((-2, -1))
    for s in range(4):
        q = ((qs >> (2 * s)) & 0x03).float()  # (R, nb, h, 2, 16)
        total = total + (q * (scale[..., s, :].unsqueeze(-1) * xs[:, :, s])).sum((1, 2, 3, 4))
    return total


def _mv_q3_k(f: dict[str, Tensor], x: Tensor) -> Tensor:
    # As Q2_K's two bits, less 4 where bit 4h + s of hmask[i] is clear; one signed scale per sub-block.
    scale = (f["d"].float().unsqueeze(-1) * f["scales"].float()).unflatten(-1, (2, 4, 2))  # (R, nb, h, s, i // 16)
    qs = f["qs"].unflatten(-1, (2, 2, 16))  # (R, nb, h, i // 16, i % 16)
    hmask = f["hmask"].unflatten(-1, (2, 16))  # (R, nb, i // 16, i % 16)
    xs = x.unflatten(-1, (2, 4, 2, 16))  # (nb, h, s, i // 16, i % 16)
    total = None
    for h in range(2):
        for s in range(4):
            high = (hmask >> (4 * h + s)) & 1  # (R, nb, 2, 16)
            q = ((qs[:, :, h] >> (2 * s)) & 0x03).float() + 4 * high.float() - 4
            term = (q * (scale[:, :, h, s].unsqueeze(-1) * xs[:, h, s])).sum((1, 2, 3))
            total = term if total is None else total + term
    return total


def _mv_q4_k(f: dict[str, Tensor], x: Tensor) -> Tensor:
    # Sub-blocks 2g and 2g + 1 of 32 weights are the low and high nibbles of the same 32 bytes.
    scale = f["scale"].unflatten(-1, (4, 2))  # (R, nb, 4, 2)
    q = f["qs"].unflatten(-1, (4, 32))  # (R, nb, 4, 32)
    scaled = _nibble_dot(q, x.unflatten(-1, (4, 64)), scale[..., 0], scale[..., 1], pair=False)  # (R,)
    return scaled - _k_mins(f, x)  # d * sc * q - dmin * m


def _mv_q5(f: dict[str, Tensor], x: Tensor) -> Tensor:
    """``d * (q . x)`` of Q5_0's and Q5_1's five-bit ``q``: the nibbles, and bit i of ``qh`` times 16."""
    d = f["d"].float()  # (R, nb)
    bits = (f["qh"].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8, device=x.device)) & 1  # (R, nb, 4, 8)
    high = _row_sums(bits.float() * (d[..., None, None] * x.unflatten(-1, (4, 8))))
    return _nibble_dot(f["qs"], x, d, d) + 16 * high


def _mv_q5_0(f: dict[str, Tensor], x: Tensor) -> Tensor:
    return _mv_q5(f, x) - 16 * (f["d"].float() * x.sum(-1)).sum(-1)  # d * ((q - 16) . x)


def _mv_q5_1(f: dict[str, Tensor], x: Tensor) -> Tensor:
    return _mv_q5(f, x) + (f["m"].float() * x.sum(-1)).sum(-1)  # d * (q . x) + m * sum(x)


def _mv_q5_k(f: dict[str, Tensor], x: Tensor) -> Tensor:
    # Q4_K's nibbles and mins, and bit k of qh[i] as the fifth bit of sub-block k's weight i.
    scale = f["scale"]  # (R, nb, 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device).unsqueeze(-1)  # (8, 1)
    bits = (f["qh"].unsqueeze(-2) >> shifts) & 1  # (R, nb, 8, 32)
    high = (bits.float() * (scale.unsqueeze(-1) * x.unflatten(-1, (8, 32)))).sum((1, 2, 3))
    return _mv_q4_k(f, x) + 16 * high


def _mv_q6_k(f: dict[str, Tensor], x: Tensor) -> Tensor:
    # Weight 128h + 32j + i of a super-block (half h, quarter j, i < 32): the low four bits are the
    # nibble (j // 2) of ql[64h + 32(j % 2) + i], the high two are bits 2j, 2j + 1 of qh[32h + i]; its
    # scale is that of sub-block 8h + 2j + i // 16. One term per quarter, each read straight from the bytes.
    ql = f["ql"].unflatten(-1, (2, 2, 2, 16))  # (R, nb, h, j % 2, i // 16, i % 16)
    qh = f["qh"].unflatten(-1, (2, 2, 16))  # (R, nb, h, i // 16, i % 16)
    scale = f["scale"].unflatten(-1, (2, 4, 2))  # (R, nb, h, j, i // 16)
    xs = x.unflatten(-1, (2, 4, 2, 16))  # (nb, h, j, i // 16, i % 16)
    total = None
    for j in range(4):
        q = ((ql[..., j % 2, :, :] >> (4 * (j // 2))) & 0x0F) | (((qh >> (2 * j)) & 0x03) << 4)  # (R, nb, h, 2, 16)
        term = (q.float() - 32) * (scale[..., j, :].unsqueeze(-1) * xs[:, :, j])
        term = term.sum((1, 2, 3, 4))  # (R,)
        total = term if total is None else total + term
    return total


# The one-row products for vector units of 8 float lanes (AVX2). There inductor loads a block's 16 or 32
# bytes into 8 lanes by a partial vector load (a copy through memory), which costs several times the
# product's arithmetic. These read the packed bytes as 32-bit words instead (the fields in ``Format.words``,
# viewed as int32): 8 words of a block a vector load, or one word broadcast and shifted by 8 amounts at once.
# ``x`` is reordered once to the order the words' bits come out in.
def _iota(n: int, like: Tensor) -> Tensor:
    return torch.arange(n, dtype=torch.int32, device=like.device)


def _reordered(x: Tensor, index: Tensor) -> Tensor:
    """``x (nb, block)`` as ``(nb, *index.shape)``: ``x[:, index]``, computed into a buffer of its own under
    the compiler (inlined, it would be a gather inside the product's loop, element by element)."""
    x = x[:, index.long()]
    return _realized(x) if torch.compiler.is_compiling() and not x.requires_grad else x


def _nibble_words(w: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """A block's 16 bytes of nibbles as ``w (R, nb, 4)`` int32 words: ``(nibbles (R, nb, 4, 8) float32,
    x (nb, 4, 8))``, nibble ``j`` of word ``k`` being weight ``16 (j % 2) + 4k + j // 2`` (low nibbles first)."""
    k, j = _iota(4, x)[:, None], _iota(8, x)
    return ((w.unsqueeze(-1) >> 4 * j) & 15).float(), _reordered(x, 16 * (j % 2) + 4 * k + j // 2)


def _mv8_q8_0(f: dict[str, Tensor], x: Tensor) -> Tensor:
    b, k = _iota(4, x)[:, None], _iota(8, x)
    xs = _reordered(x, 4 * k + b)  # (nb, 4, 8): byte b of word k is weight 4k + b
    q = ((f["qs"].unsqueeze(-2) << 24 - 8 * b) >> 24).float()  # (R, nb, 4, 8): byte b to the top, then back, signed
    return _row_sums(q * (f["d"].float()[..., None, None] * xs))


def _mv8_q4_0(f: dict[str, Tensor], x: Tensor) -> Tensor:
    d = f["d"].float()  # (R, nb)
    q, xs = _nibble_words(f["qs"], x)
    return _row_sums(q * (d[..., None, None] * xs)) - 8 * (d * x.sum(-1)).sum(-1)


def _mv8_q4_1(f: dict[str, Tensor], x: Tensor) -> Tensor:
    q, xs = _nibble_words(f["qs"], x)
    scaled = _row_sums(q * (f["d"].float()[..., None, None] * xs))
    return scaled + (f["m"].float() * x.sum(-1)).sum(-1)


def _mv8_q5(f: dict[str, Tensor], x: Tensor) -> Tensor:
    """``d * (q . x)`` of Q5_0's and Q5_1's five-bit ``q``: the nibbles, and bit i of the word ``qh`` times 16."""
    d = f["d"].float()  # (R, nb)
    q, xs = _nibble_words(f["qs"], x)
    k, j = _iota(4, x)[:, None], _iota(8, x)
    high = (f["qh"].unsqueeze(-1) >> 16 * (j % 2) + 4 * k + j // 2) & 1  # (R, nb, 4, 8): qh (R, nb, 1)
    return _row_sums((q + 16 * high.float()) * (d[..., None, None] * xs))


def _mv8_q5_0(f: dict[str, Tensor], x: Tensor) -> Tensor:
    return _mv8_q5(f, x) - 16 * (f["d"].float() * x.sum(-1)).sum(-1)


def _mv8_q5_1(f: dict[str, Tensor], x: Tensor) -> Tensor:
    return _mv8_q5(f, x) + (f["m"].float() * x.sum(-1)).sum(-1)


def _k_nibbles(f: dict[str, Tensor], x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q4_K's and Q5_K's ``qs (R, nb, 32)`` words: ``(nibbles (R, nb, g, b, h, k), x (nb, g, b, h, k), the
    sub-blocks' scales (R, nb, g, 1, h, 1))``. Group g is 32 bytes (8 words k), byte b of word k holds
    weight 4k + b of sub-block 2g (its low nibble, h = 0) and of 2g + 1 (high, h = 1)."""
    g, b, h, k = _iota(4, x)[:, None, None, None], _iota(4, x)[:, None, None], _iota(2, x)[:, None], _iota(8, x)
    xs = _reordered(x, 64 * g + 32 * h + 4 * k + b)  # (nb, 4, 4, 2, 8)
    w = f["qs"].unflatten(-1, (4, 8))[:, :, :, None, None, :]  # (R, nb, g, 1, 1, k)
    q = ((w >> 8 * b + 4 * h) & 15).float()  # (R, nb, g, b, h, k)
    return q, xs, f["scale"].unflatten(-1, (4, 2))[:, :, :, None, :, None]


def _k_mins(f: dict[str, Tensor], x: Tensor) -> Tensor:
    """Q4_K's and Q5_K's ``sum(dmin * m * x)`` over each row's sub-blocks ``(R,)``: a short pass of its own,
    a vector of the 8 sub-blocks' mins a super-block."""
    return ((f["dmin"].float().unsqueeze(-1) * f["m"].float()) * x.unflatten(-1, (8, 32)).sum(-1)).sum((1, 2))


HALVED_K_QUANTS = ("Q4_K", "Q5_K")  # the K-quants whose 8-lane products read a row in two halves (_block_sums)


def _block_sums(
    format: str, terms: Callable[[dict[str, Tensor], Tensor], Tensor], f: dict[str, Tensor], x: Tensor
) -> Tensor:
    """``terms(f, x) (R, nb, ...)`` summed over all but the rows, read in two halves where
    :func:`_row_sums` reads them so and ``format`` is one of :data:`HALVED_K_QUANTS`: the terms of the
    first and second halves of the blocks computed from their halves of the fields and of ``x`` and
    added. (For the K-quants' long terms inductor's code for :func:`_row_sums`' slices of one tensor of
    terms is not vectorized; these slices of the inputs are.) Q2_K's, Q3_K's and Q6_K's products are not
    read so: their loops in halves came out slower at every size, many times so on a vocabulary's rows,
    where Q4_K's and Q5_K's came out as fast or faster (docs/performance.md)."""
    n = x.shape[0]
    if format in HALVED_K_QUANTS and _read_in_halves(n):
        h = n // 2
        t = terms({k: v[:, :h] for k, v in f.items()}, x[:h]) + terms({k: v[:, h:] for k, v in f.items()}, x[h:])
    else:
        t = terms(f, x)
    return t.sum(tuple(range(1, t.dim())))


# The loop over the nibbles reads one float32 scale per 8 weights; the mins, one byte each beside a
# float16 factor, are summed by a pass of their own (converted in the loop, they slowed every vector).
def _q4_k_terms(f: dict[str, Tensor], x: Tensor) -> Tensor:
    q, xs, scale = _k_nibbles(f, x)
    return q * (scale * xs)


def _mv8_q4_k(f: dict[str, Tensor], x: Tensor) -> Tensor:
    return _block_sums("Q4_K", _q4_k_terms, f, x) - _k_mins(f, x)


def _q5_k_terms(f: dict[str, Tensor], x: Tensor) -> Tensor:
    # The fifth bit of sub-block s's weight i is bit s of byte i of qh: of word k, bit 8b + s.
    q, xs, scale = _k_nibbles(f, x)
    g, b, h = _iota(4, x)[:, None, None, None], _iota(4, x)[:, None, None], _iota(2, x)[:, None]
    high = (f["qh"][:, :, None, None, None, :] >> 8 * b + 2 * g + h) & 1  # (R, nb, g, b, h, k)
    return (q + 16 * high.float()) * (scale * xs)


def _mv8_q5_k(f: dict[str, Tensor], x: Tensor) -> Tensor:
    return _block_sums("Q5_K", _q5_k_terms, f, x) - _k_mins(f, x)


def _by_half(s: Tensor, k: Tensor) -> Tensor:
    """Per-sub-block values ``s (..., 2)`` of the two halves of 16 weights, spread over the 8 words
    ``k (8,)`` of 32 bytes (words 0-3: the first half): ``(..., 8)``."""
    return torch.where(k < 4, s[..., :1], s[..., 1:])


def _q2_k_terms(f: dict[str, Tensor], x: Tensor) -> Tensor:
    # Weight 128h + 32s + 4k + b: bits 8b + 2s of qs's word (h, k), in sub-block 8h + 2s + k // 4, whose
    # scale and min are the low and high nibble of its byte of ``scales``.
    h, s, b, k = _iota(2, x)[:, None, None, None], _iota(4, x)[:, None, None], _iota(4, x)[:, None], _iota(8, x)
    xs = _reordered(x, 128 * h + 32 * s + 4 * k + b)  # (nb, h, s, b, k)
    w = f["qs"].unflatten(-1, (2, 8))[:, :, :, None, None, :]  # (R, nb, h, 1, 1, k)
    q = ((w >> 8 * b + 2 * s) & 3).float()  # (R, nb, h, s, b, k)
    sc = f["scales"].unflatten(-1, (2, 4, 2))  # (R, nb, h, s, k // 4)
    scale = f["d"].float()[..., None, None, None] * (sc & 0x0F).float()
    mins = f["dmin"].float()[..., None, None, None] * (sc >> 4).float()
    scale, mins = _by_half(scale, k).unsqueeze(-2), _by_half(mins, k).unsqueeze(-2)  # (R, nb, h, s, 1, k)
    return (q * scale - mins) * xs


def _mv8_q2_k(f: dict[str, Tensor], x: Tensor) -> Tensor:
    return _block_sums("Q2_K", _q2_k_terms, f, x)


def _q3_k_terms(f: dict[str, Tensor], x: Tensor) -> Tensor:
    # As Q2_K's two bits, less 4 where bit 8b + 4h + s of hmask's word k is clear; a signed scale per sub-block.
    h, s, b, k = _iota(2, x)[:, None, None, None], _iota(4, x)[:, None, None], _iota(4, x)[:, None], _iota(8, x)
    xs = _reordered(x, 128 * h + 32 * s + 4 * k + b)  # (nb, h, s, b, k)
    w = f["qs"].unflatten(-1, (2, 8))[:, :, :, None, None, :]  # (R, nb, h, 1, 1, k)
    high = (f["hmask"][:, :, None, None, None, :] >> 8 * b + 4 * h + s) & 1  # (R, nb, h, s, b, k)
    q = (((w >> 8 * b + 2 * s) & 3) + 4 * high - 4).float()
    scale = f["d"].float()[..., None, None, None] * f["scales"].float().unflatten(-1, (2, 4, 2))  # (R, nb, h, s, 2)
    return q * (_by_half(scale, k).unsqueeze(-2) * xs)


def _mv8_q3_k(f: dict[str, Tensor], x: Tensor) -> Tensor:
    return _block_sums("Q3_K", _q3_k_terms, f, x)


def _q6_k_terms(f: dict[str, Tensor], x: Tensor) -> Tensor:
    # Weight 128h + 32j + 4k + b (j = 2 jh + jm): low four bits from bits 8b + 4 jh of ql's word (h, jm, k),
    # high two from bits 8b + 2j of qh's word (h, k); its sub-block 8h + 2j + k // 4.
    jh, jm = _iota(2, x)[:, None, None, None], _iota(2, x)[:, None, None]
    b, k = _iota(4, x)[:, None], _iota(8, x)
    xs = _reordered(x, 128 * _iota(2, x)[:, None, None, None, None] + 32 * (2 * jh + jm) + 4 * k + b)
    ql = f["ql"].unflatten(-1, (2, 2, 8))[:, :, :, None, :, None, :]  # (R, nb, h, 1, jm, 1, k)
    qh = f["qh"].unflatten(-1, (2, 8))[:, :, :, None, None, None, :]  # (R, nb, h, 1, 1, 1, k)
    q = ((ql >> 8 * b + 4 * jh) & 15) | (((qh >> 8 * b + 4 * jh + 2 * jm) & 3) << 4)  # (R, nb, h, jh, jm, b, k)
    s = f["scale"].unflatten(-1, (2, 2, 2, 2))  # (R, nb, h, jh, jm, k // 4)
    scale = _by_half(s, k).unsqueeze(-2)  # (R, nb, h, jh, jm, 1, k)
    return (q.float() - 32) * (scale * xs)


def _mv8_q6_k(f: dict[str, Tensor], x: Tensor) -> Tensor:
    return _block_sums("Q6_K", _q6_k_terms, f, x)


def _split(*spec: tuple[str, int, str]) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """A splitter of blocks into fields ``(name, bytes, kind)``, kind ``f16``, ``u8`` or ``i8``."""

    def split(blocks: np.ndarray) -> dict[str, np.ndarray]:
        out, at = {}, 0
        for name, n, kind in spec:
            b = blocks[..., at : at + n]
            at += n
            if kind == "f16":
                out[name] = _f16(b)
            else:
                out[name] = np.ascontiguousarray(b).view(np.int8 if kind == "i8" else np.uint8)
        return out

    return split


def _split_k(qh: bool) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    """Q4_K (``qh=False``) and Q5_K: ``scale`` (the 8 sub-blocks' ``d * sc``, float32), dmin, ``m`` (the
    sub-blocks' 6-bit mins, one byte each), [qh,] qs.

    The scales are kept as the products, not as ``d`` and the 6-bit ``sc``: a float16 times an integer of
    6 bits is exact in float32, so these are the numbers gguf multiplies by, and the products' loops
    read one float a sub-block instead of converting two numbers for every 8 weights (22 more bytes a
    block of 144: the mins stay packed, summed apart, see :func:`_k_mins`)."""
    rest = _split(("qh", QK_K // 8, "u8"), ("qs", QK_K // 2, "u8")) if qh else _split(("qs", QK_K // 2, "u8"))

    def split(blocks: np.ndarray) -> dict[str, np.ndarray]:
        sc, m = _unpack_k_scales(blocks[..., 4:16])
        scale = _f16(blocks[..., 0:2]).astype(np.float32)[..., None] * sc.astype(np.float32)
        return {"scale": scale, "dmin": _f16(blocks[..., 2:4]), "m": m} | rest(blocks[..., 16:])

    return split


def _split_q3_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    out = _split(("hmask", QK_K // 8, "u8"), ("qs", QK_K // 4, "u8"))(blocks[..., : QK_K // 8 + QK_K // 4])
    at = QK_K // 8 + QK_K // 4
    return out | {"scales": _unpack_q3_scales(blocks[..., at : at + 12]), "d": _f16(blocks[..., at + 12 : at + 14])}


def _split_q6_k(blocks: np.ndarray) -> dict[str, np.ndarray]:
    """Q6_K: ql, qh, ``scale`` (the 16 sub-blocks' ``d * scales``, float32: exact, and one float a sub-block
    for the products' loops to read, as :func:`_split_k` keeps Q4_K's; 46 more bytes a block of 210)."""
    out = _split(("ql", 128, "u8"), ("qh", 64, "u8"))(blocks[..., :192])
    scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    return out | {"scale": _f16(blocks[..., 208:210]).astype(np.float32)[..., None] * scales}


def _split_dense(dtype: Any) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    def split(blocks: np.ndarray) -> dict[str, np.ndarray]:
        return {"w": np.ascontiguousarray(blocks).view(dtype)}

    return split


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("F16", 1, 2, _split_dense(np.float16), _dense, _mv_dense),
        # (BF16: int16 in numpy, viewed as bfloat16 in torch)
        Format("BF16", 1, 2, _split_dense(np.int16), _dense, _mv_dense),
        Format("Q8_0", 32, 34, _split(("d", 2, "f16"), ("qs", 32, "i8")), _q8_0, _mv_q8_0, None, _mv8_q8_0, ("qs",)),
        Format(
            "Q4_0",
            32,
            18,
            _split(("d", 2, "f16"), ("qs", 16, "u8")),
            _q4_0,
            _mv_q4_0,
            _tile_q4_0,
            _mv8_q4_0,
            ("qs",),
            (_tile8_q4_0, _nibble_order()),
        ),
        Format(
            "Q4_1",
            32,
            20,
            _split(("d", 2, "f16"), ("m", 2, "f16"), ("qs", 16, "u8")),
            _q4_1,
            _mv_q4_1,
            _tile_q4_1,
            _mv8_q4_1,
            ("qs",),
            (_tile8_q4_1, _nibble_order()),
        ),
        Format(
            "Q5_0",
            32,
            22,
            _split(("d", 2, "f16"), ("qh", 4, "u8"), ("qs", 16, "u8")),
            _q5_0,
            _mv_q5_0,
            None,
            _mv8_q5_0,
            ("qs", "qh"),
        ),
        Format(
            "Q5_1",
            32,
            24,
            _split(("d", 2, "f16"), ("m", 2, "f16"), ("qh", 4, "u8"), ("qs", 16, "u8")),
            _q5_1,
            _mv_q5_1,
            None,
            _mv8_q5_1,
            ("qs", "qh"),
        ),
        Format(
            "Q2_K",
            QK_K,
            84,
            _split(("scales", 16, "u8"), ("qs", 64, "u8"), ("d", 2, "f16"), ("dmin", 2, "f16")),
            _q2_k,
            _mv_q2_k,
            None,
            _mv8_q2_k,
            ("qs",),
        ),
        Format("Q3_K", QK_K, 110, _split_q3_k, _q3_k, _mv_q3_k, None, _mv8_q3_k, ("qs", "hmask")),
        Format(
            "Q4_K",
            QK_K,
            144,
            _split_k(qh=False),
            _q4_k,
            _mv_q4_k,
            _tile_q4_k,
            _mv8_q4_k,
            ("qs",),
            (_tile8_q4_k, _word_order()),
        ),
        Format("Q5_K", QK_K, 176, _split_k(qh=True), _q5_k, _mv_q5_k, None, _mv8_q5_k, ("qs", "qh")),
        Format(
            "Q6_K",
            QK_K,
            210,
            _split_q6_k,
            _q6_k,
            _mv_q6_k,
            None,
            _mv8_q6_k,
            ("ql", "qh"),
        ),
    )
}


# --------------------------------------------------------------------------------------------
# One run of rows in one format
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Part:
    """Rows of a :class:`QuantizedTensor` in one format: ``fields`` each ``(rows, blocks per row, ...)``."""

    format: str
    fields: dict[str, Tensor]

    @property
    def rows(self) -> int:
        return next(iter(self.fields.values())).shape[0]

    def map(self, fn: Callable[[Tensor], Tensor]) -> Part:
        return Part(self.format, {k: fn(v) for k, v in self.fields.items()})

    def dequantize(self) -> Tensor:
        """``(rows, in_features)`` float32, as ``gguf.quants.dequantize`` computes it."""
        return FORMATS[self.format].dequantize(self.fields)


def dequantize(format: str, fields: dict[str, Tensor]) -> Tensor:
    """The float32 weights ``(rows, in_features)`` of one format's ``fields`` (see :data:`FORMATS`)."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    return Part(format, fields).dequantize()


# --------------------------------------------------------------------------------------------
# torch's int4 weight-only kernel: the 4-bit formats repacked, losslessly
# --------------------------------------------------------------------------------------------
# ``torch.ops.aten._weight_int4pack_mm_for_cpu(x (M, K), packed, group, scales_and_zeros (K // group, N, 2))``
# computes ``x @ w.T`` with ``w = (q - 8) * scale + zero`` per group of ``group`` weights of a row
# (``q`` in 0..15, each weight dequantized by one fused multiply-add in float32). GGML's 4-bit formats are
# that with groups of 32: Q4_0 is ``d * (q - 8)`` (scale d, zero 0), Q4_1 ``d * q + m`` (scale d, zero
# m + 8d), Q4_K's sub-block of 32 ``(d * sc) * q - dmin * m`` (scale d * sc, zero 8 * d * sc - dmin * m).
# A float16 scale times an integer below 2**6 is exact in float32, and so is the zero wherever the
# sum fits in float32's 24 bits (Q4_0 and Q4_1 always in practice; :func:`int4_affine` says where):
# then ``(q - 8) * scale + zero`` is gguf's number bit for bit, whatever the order of its roundings.
#
# In torch 2.13 on x86 the kernel is vectorized (AVX512/AVX2) for bfloat16 only: float32 activations with
# float32 scales take its scalar loop, far slower than the dense float32 matmul (docs/performance.md),
# and bfloat16 wants bfloat16 scales (8 significant bits for the file's 11: not lossless) and rounds
# its outputs to bfloat16. So a weight carries the pack
# (:attr:`QuantizedTensor.int4`) where it computes in one of :data:`INT4_DTYPES` -- ``model.to(torch.bfloat16)``,
# a generation path of its own -- and the default float32 weights keep the exact tiled products below.
INT4_FORMATS = ("Q4_0", "Q4_1", "Q4_K")
INT4_GROUP = 32
INT4_DTYPES = (torch.bfloat16,)


@dataclass(frozen=True)
class Int4Pack:
    """A weight ``(N, K)`` in the layout of torch's int4 kernel: ``weight`` from
    ``_convert_weight_to_int4pack_for_cpu`` (uint8), ``scales_and_zeros (K // 32, N, 2)`` in the dtype the
    kernel computes in."""

    weight: Tensor
    scales_and_zeros: Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.scales_and_zeros.dtype


def int4_affine(p: Part) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A 4-bit part's weights as ``w = (q - 8) * scale + zero`` per group of 32: ``q (R, K)`` uint8 in
    0..15, ``scale`` and ``zero`` ``(R, K // 32)`` float32, and ``exact (R, K // 32)`` bool: whether the
    float32 ``zero`` is the exact sum (then the group's weights are gguf's numbers bit for bit)."""
    f = p.fields
    if p.format == "Q4_K":
        q = _bits(f["qs"].unflatten(-1, (4, 32)), 4)  # (R, nb, 8, 32)
        scale = f["scale"]  # (R, nb, 8): d * sc, exact
        low = f["dmin"].float().unsqueeze(-1) * f["m"].float()  # exact
        zero = scale * 8 - low
        exact = zero.double() == scale.double() * 8 - low.double()
    elif p.format in ("Q4_0", "Q4_1"):
        q = _nibbles(f["qs"])  # (R, nb, 32)
        scale = f["d"].float()
        if p.format == "Q4_0":
            zero, exact = torch.zeros_like(scale), torch.ones_like(scale, dtype=torch.bool)
        else:
            zero = f["m"].float() + scale * 8
            exact = zero.double() == f["m"].double() + scale.double() * 8
    else:
        raise ValueError(f"{p.format} is not one of the 4-bit formats {INT4_FORMATS}")
    rows = q.shape[0]
    return q.reshape(rows, -1), scale.reshape(rows, -1), zero.reshape(rows, -1), exact.reshape(rows, -1)


def int4_pack(parts: Sequence[Part], dtype: torch.dtype = torch.bfloat16) -> Int4Pack:
    """``parts`` (all in :data:`INT4_FORMATS`, on the CPU) in torch's int4 layout, scales and zeros in ``dtype``."""
    affine = [int4_affine(p) for p in parts]
    q, scale, zero = (torch.cat([a[i] for a in affine]) for i in range(3))  # (N, K), (N, K // 32) twice
    pad = -q.shape[0] % 16  # the kernel's blocks of rows are 16 to 64: rows of zeros up to a multiple of 16
    if pad:
        q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (q, scale, zero))
    weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)  # (N, K // 2) uint8
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return Int4Pack(weight, scales_and_zeros)


def int4_mm(x: Tensor, pack: Int4Pack, out_features: int) -> Tensor:
    """``x (..., K) @ w.T -> (..., N)`` by torch's int4 kernel (``x`` in the pack's dtype)."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.contiguous(), pack.weight, INT4_GROUP, pack.scales_and_zeros)
    if y.shape[-1] != out_features:  # (the pack's rows of zeros)
        y = y[:, :out_features]
    return y.reshape(*x.shape[:-1], out_features)


def _int4_fits(parts: Sequence[Part], shape: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether a weight of these parts computes with the int4 kernel: 4-bit formats on the CPU, a
    dtype of :data:`INT4_DTYPES`."""
    device = next(iter(parts[0].fields.values())).device
    return dtype in INT4_DTYPES and device.type == "cpu" and all(p.format in INT4_FORMATS for p in parts)


# --------------------------------------------------------------------------------------------
# The weight type
# --------------------------------------------------------------------------------------------
class QuantizedTensor(Tensor):
    """A ``(out_features, in_features)`` weight kept in GGML blocks (see the module docstring).

    Build one with :meth:`from_blocks` (a file's bytes) or :meth:`from_parts`. Its ``dtype`` is the
    dtype it computes in (float32 unless ``.to(dtype)`` said otherwise); ``storage_bytes`` is what
    the blocks take in memory.
    """

    parts: tuple[Part, ...]
    int4: Int4Pack | None  # torch's int4 layout of the same weights, where the int4 kernel computes its products
    owns_linear = True  # attnlab.hardware.linear hands F.linear to it (see linear below)

    @staticmethod
    def __new__(
        cls,
        parts: Sequence[Part],
        shape: tuple[int, int],
        dtype: torch.dtype = torch.float32,
        int4: Int4Pack | None = None,
    ) -> QuantizedTensor:
        device = next(iter(parts[0].fields.values())).device
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)

    def __init__(
        self,
        parts: Sequence[Part],
        shape: tuple[int, int],
        dtype: torch.dtype = torch.float32,
        int4: Int4Pack | None = None,
    ) -> None:
        self.parts = tuple(parts)
        self.int4 = int4
        # Plain ints for the hot path (a subclass's .shape goes through __torch_function__).
        self.rows_and_columns = (int(shape[0]), int(shape[1]))

    # Building ---------------------------------------------------------------------------------
    @classmethod
    def from_blocks(cls, format: str, raw: np.ndarray, shape: tuple[int, int]) -> QuantizedTensor:
        """The weight of shape ``(out, in)`` whose rows are the bytes ``raw (out, in // block * nbytes)``
        (one GGUF tensor's data, rows of blocks) in GGML format ``format``."""
        if format not in FORMATS:
            raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
        if not isinstance(raw, np.ndarray):
            raise TypeError(f"raw must be a numpy array of the file's bytes (uint8), got {type(raw).__name__}")
        ok = isinstance(shape, (tuple, list)) and len(shape) == 2 and all(is_int(s) and s > 0 for s in shape)
        if not ok:
            raise ValueError(f"shape must be (out_features, in_features), two positive ints, got {shape!r}")
        fmt = FORMATS[format]
        out, inp = (int(s) for s in shape)
        if inp % fmt.block:
            raise ValueError(f"in_features={inp} is not a whole number of {format} blocks of {fmt.block}")
        nb = inp // fmt.block
        if raw.dtype != np.uint8 or raw.size != out * nb * fmt.nbytes:
            raise ValueError(
                f"raw must be {out * nb * fmt.nbytes} bytes (uint8) for {shape} in {format}, got {raw.size} {raw.dtype}"
            )
        blocks = raw.reshape(out, nb, fmt.nbytes)
        fields = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in fmt.split(blocks).items()}
        if format == "BF16":
            fields["w"] = fields["w"].view(torch.bfloat16)
        return cls([Part(format, fields)], (out, inp))

    @classmethod
    def from_parts(
        cls,
        parts: Sequence[Part],
        in_features: int,
        dtype: torch.dtype = torch.float32,
        int4: Int4Pack | None = None,
    ) -> QuantizedTensor:
        return cls(parts, (sum(p.rows for p in parts), in_features), dtype, int4)

    def _with(
        self, parts: Sequence[Part], dtype: torch.dtype | None = None, int4: Int4Pack | None = None
    ) -> QuantizedTensor:
        """The same kind of weight on ``parts`` (its int4 pack only where ``int4`` hands one over)."""
        return QuantizedTensor.from_parts(parts, self.shape[1], self.dtype if dtype is None else dtype, int4)

    # What it is ----------------------------------------------------------------------------------
    @property
    def formats(self) -> tuple[str, ...]:
        return tuple(p.format for p in self.parts)

    @property
    def storage_bytes(self) -> int:
        """The bytes its blocks take (the file's size of this matrix, give or take the unpacked scales),
        and its int4 pack's where it has one (about as many again)."""
        pack = [] if self.int4 is None else [self.int4.weight, self.int4.scales_and_zeros]
        return sum(t.numel() * t.element_size() for t in stored_tensors(self) + pack)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        int4 = "" if self.int4 is None else ", int4 kernel"
        return (
            f"QuantizedTensor({'+'.join(self.formats)}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}{int4})"
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The dense weight ``(out, in)`` in ``dtype`` (default: its own)."""
        dtype = self.dtype if dtype is None else dtype
        dense = [p.dequantize() for p in self.parts]
        w = dense[0] if len(dense) == 1 else torch.cat(dense)
        return w if w.dtype == dtype else w.to(dtype)

    def rows(self, index: Tensor) -> Tensor:
        """Rows ``index`` (any shape of ids) dense, ``(*index.shape, in)`` in its dtype: an embedding lookup."""
        flat = index.reshape(-1)
        if len(self.parts) == 1:
            w = self.parts[0].map(lambda t: t.index_select(0, flat)).dequantize()
        else:
            w = self.dequantize(torch.float32).index_select(0, flat)
        return w.to(self.dtype).reshape(*index.shape, self.shape[1])

    # torch.compile and the subclass protocol --------------------------------------------------
    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        # Dynamo's guards call this for every quantized weight at every compiled step: made once (again
        # only if an int4 pack was added since).
        made = self.__dict__.get("_flattened")
        if made is not None and made[0] is self.int4:
            return list(made[1]), made[2]
        names = []
        for i, p in enumerate(self.parts):
            for k, t in p.fields.items():
                setattr(self, f"_p{i}_{k}", t)
                names.append(f"_p{i}_{k}")
        layout = tuple((p.format, tuple(p.fields)) for p in self.parts)
        if self.int4 is not None:
            self._int4_weight, self._int4_scales_and_zeros = self.int4.weight, self.int4.scales_and_zeros
            names += ["_int4_weight", "_int4_scales_and_zeros"]
        ctx = (layout, self.shape[1], self.dtype, self.int4 is not None)
        self._flattened = (self.int4, names, ctx)
        return list(names), ctx

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, Tensor], ctx: Any, outer_size: Any, outer_stride: Any) -> QuantizedTensor:
        layout, in_features, dtype, has_int4 = ctx
        parts = [Part(f, {k: inner[f"_p{i}_{k}"] for k in keys}) for i, (f, keys) in enumerate(layout)]
        int4 = Int4Pack(inner["_int4_weight"], inner["_int4_scales_and_zeros"]) if has_int4 else None
        return QuantizedTensor.from_parts(parts, in_features, dtype, int4)

    def _stable_hash_for_caching(self) -> str:
        """What torch.compile's caches key this weight by: its layout, never its values, and this
        module's code (the graph a product compiles to is written here: a cache filled by an older
        version of it would otherwise be reused)."""
        layout = [tuple(p.fields) for p in self.parts]
        return repr((self.formats, tuple(self.shape), str(self.dtype), layout, self.int4 is not None, _CODE))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        handler = _FUNCTIONS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        handler = _ATEN.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        # Anything else computes on the dense values (correct; dense for this one result only).
        args, kwargs = torch.utils._pytree.tree_map_only(QuantizedTensor, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)


def _packed(w: QuantizedTensor) -> QuantizedTensor:
    """``w`` with its int4 pack where the int4 kernel computes its products (see :data:`INT4_DTYPES`)."""
    if w.int4 is None and _int4_fits(w.parts, w.shape, w.dtype):
        w.int4 = int4_pack(w.parts, w.dtype)
    return w


def is_quantized(w: object) -> bool:
    """Whether ``w`` is a :class:`QuantizedTensor` (a weight kept in blocks)."""
    return isinstance(w, QuantizedTensor)


# --------------------------------------------------------------------------------------------
# Saving: a weight's block fields as safetensors tensors
# --------------------------------------------------------------------------------------------
SAFETENSORS_KEY = "attnlab.quantized"  # the metadata entry: {weight name: [in_features, dtype, [format, ...]]}


def to_safetensors(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``state`` as safetensors takes it: each quantized weight ``name`` as its parts' block fields
    ``"{name}:{part}:{field}"`` (the file's bytes, not a dense copy), and the metadata entry that
    says how they go back together (:func:`from_safetensors`)."""
    tensors: dict[str, Tensor] = {}
    layout: dict[str, Any] = {}
    for name, w in state.items():
        if not is_quantized(w):
            tensors[name] = w
            continue
        layout[name] = [w.shape[1], str(w.dtype).removeprefix("torch."), list(w.formats)]
        for i, p in enumerate(w.parts):
            for field, t in p.fields.items():
                tensors[f"{name}:{i}:{field}"] = t
    return tensors, ({SAFETENSORS_KEY: json.dumps(layout)} if layout else {})


def from_safetensors(tensors: dict[str, Tensor], metadata: dict[str, str] | None, where: str) -> dict[str, Tensor]:
    """The state :func:`to_safetensors` wrote: ``tensors`` with each quantized weight's fields back in
    one :class:`QuantizedTensor`. Raises ``ValueError`` naming ``where`` where the layout does not hold."""
    raw = (metadata or {}).get(SAFETENSORS_KEY)
    if raw is None:
        return tensors
    try:
        layout = json.loads(raw)
    except ValueError:
        raise ValueError(f"{where}: its {SAFETENSORS_KEY} metadata is not JSON") from None
    if not isinstance(layout, dict):
        raise ValueError(f"{where}: its {SAFETENSORS_KEY} metadata must be a JSON object, got {raw[:80]!r}")
    state = dict(tensors)
    for name, entry in layout.items():
        ok = isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], int) and entry[0] > 0
        if not (ok and entry[1] in _COMPUTE_DTYPES and isinstance(entry[2], list) and entry[2]):
            raise ValueError(
                f"{where}: quantized weight {name!r} is described as {entry!r}, not [in_features, dtype, [format, ...]]"
            )
        in_features, dtype, formats = entry
        parts = []
        for i, format in enumerate(formats):
            if format not in FORMATS or in_features % FORMATS[format].block:
                raise ValueError(
                    f"{where}: quantized weight {name!r}: {format!r} is not a format of rows of {in_features}"
                )
            empty = np.zeros(in_features // FORMATS[format].block * FORMATS[format].nbytes, np.uint8)
            fields = {}
            for field, like in QuantizedTensor.from_blocks(format, empty, (1, in_features)).parts[0].fields.items():
                t = state.pop(f"{name}:{i}:{field}", None)
                if t is None or t.dtype != like.dtype or t.shape[1:] != like.shape[1:] or t.shape[0] < 1:
                    got = "nothing" if t is None else f"{t.dtype} {tuple(t.shape)}"
                    raise ValueError(
                        f"{where}: quantized weight {name!r} part {i} ({format}) needs a field {field!r} of "
                        f"{like.dtype} (rows, {', '.join(map(str, like.shape[1:]))}), got {got}"
                    )
                fields[field] = t
            if len({t.shape[0] for t in fields.values()}) != 1:
                raise ValueError(
                    f"{where}: quantized weight {name!r} part {i}: its fields have different numbers of rows"
                )
            parts.append(Part(format, fields))
        state[name] = _packed(QuantizedTensor.from_parts(parts, in_features, getattr(torch, dtype)))
    stray = [k for k in state if ":" in k]
    if stray:
        raise ValueError(f"{where}: block fields of no quantized weight in its metadata: {stray[:5]}")
    return state


_COMPUTE_DTYPES = ("float32", "float64", "bfloat16", "float16")


def stored_tensors(w: Tensor) -> list[Tensor]:
    """The tensors ``w``'s numbers are stored in: a quantized weight's block fields (not its int4 pack,
    made from them), else ``w`` itself, detached. What hashing or checking its bytes reads."""
    return [t for p in w.parts for t in p.fields.values()] if is_quantized(w) else [w.detach()]


# --------------------------------------------------------------------------------------------
# The products
# --------------------------------------------------------------------------------------------
def _tiles(w: QuantizedTensor, compiled: bool) -> Iterator[tuple[int, int, Part]]:
    """``w``'s rows as tiles ``(start, stop, part)`` within one part each, of :data:`TILE_ELEMENTS`
    (``compiled``: :data:`COMPILED_TILE_ELEMENTS`; off the CPU: :data:`ACCELERATOR_TILE_ELEMENTS`) at most."""
    elements = COMPILED_TILE_ELEMENTS if compiled else TILE_ELEMENTS
    elements = elements if w.device.type == "cpu" else ACCELERATOR_TILE_ELEMENTS
    step, at = max(1, elements // max(1, w.shape[1])), 0
    for p in w.parts:
        for i in range(0, p.rows, step):
            j = min(i + step, p.rows)
            yield at + i, at + j, p.map(lambda t, i=i, j=j: t[i:j])
        at += p.rows


def _product(x: Tensor, w: QuantizedTensor) -> Tensor:
    """``x (..., in) @ w.T -> (..., out)``, a tile of ``w``'s rows dense at a time.

    By ``F.linear`` (MKL in torch's x86 builds) on every CPU, not :func:`attnlab.hardware.linear`'s oneDNN:
    a tile is multiplied once, from the caches it was just dequantized into, where oneDNN's setup per call
    is the slower part; and a process that computes with quantized weights alone never pays the memory of
    oneDNN's kernels."""
    compiled = _compiling_pays(x)
    tiles, reordered = list(_tiles(w, compiled)), {}
    if len(tiles) == 1:
        return _tile_linear(x, tiles[0][2], compiled, reordered)
    out = x.new_empty(*x.shape[:-1], w.shape[0])  # (..., out): each tile's columns written in place
    for i, j, tile in tiles:
        out[..., i:j] = _tile_linear(x, tile, compiled, reordered)
    return out


def _tile_linear(x: Tensor, tile: Part, compiled: bool, reordered: dict[str, Tensor]) -> Tensor:
    """``F.linear(x, tile dense)``: by the format's ``tile8`` where it runs (compiled for 8 float lanes),
    with ``x``'s columns in its words' order (made once a product: ``reordered``), else :func:`_dense_tile`."""
    format = FORMATS[tile.format]
    w = _tile8(tile, compiled) if format.tile8 is not None else None
    if w is None:
        return F.linear(x, _dense_tile(tile, x.dtype, compiled))
    if tile.format not in reordered:
        n, order = x.shape[-1], format.tile8[1]
        columns = (torch.arange(0, n, format.block)[:, None] + order).flatten()  # (n,)
        reordered[tile.format] = x[..., columns.to(x.device)]
    return F.linear(reordered[tile.format], w if w.dtype == x.dtype else w.to(x.dtype))


def _tile8(tile: Part, compiled: bool) -> Tensor | None:
    """The tile dense by its format's ``tile8`` (columns in the words' order), or None where that does
    not run: uncompiled, too small, or code for other than 8 float lanes."""
    if not (_compiles(tile, compiled) and _eight_lanes()):
        return None
    try:
        return _ahead("tile8", tile)(tile.fields)
    except Exception as e:  # (no C++ compiler, or inductor failing on this platform: the eager tiles are exact too)
        _compile_failed(e, "tiles are dequantized")
        return None


def _product_t(g: Tensor, w: QuantizedTensor) -> Tensor:
    """``g (..., out) @ w -> (..., in)``: the gradient of :func:`_product` with respect to ``x``."""
    compiled, total = _compiling_pays(g), None
    for i, j, tile in _tiles(w, compiled):
        part = g[..., i:j] @ _dense_tile(tile, g.dtype, compiled)  # (..., in)
        total = part if total is None else total + part
    return total


class _Frozen:
    """A quantized weight passed to an autograd Function as an opaque object (no gradient, no tracing)."""

    def __init__(self, w: QuantizedTensor) -> None:
        self.w = w


class _Linear(torch.autograd.Function):
    """The tiled product with a tiled backward for ``x``: autograd keeps the blocks, never a dense weight."""

    @staticmethod
    def forward(x: Tensor, frozen: _Frozen) -> Tensor:
        return _product(x, frozen.w)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.frozen = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _product_t(grad, ctx.frozen.w), None


@torch.library.custom_op("attnlab::realized", mutates_args=())
def _realized(x: Tensor) -> Tensor:
    """``x`` computed once into a buffer of its own. Inductor would otherwise inline what made ``x``
    (a norm, a gate) into the product's loop and compute it again for every row of the weight."""
    return x.clone()


@_realized.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


def _one_row(format: Format, compiling: bool) -> tuple[Callable[..., Tensor], tuple[str, ...]]:
    """``format``'s one-row product and the fields it reads as words: ``matvec8`` for code compiled for 8
    float lanes (AVX2; ``compiling``: code made now), else ``matvec``."""
    if compiling and format.matvec8 is not None and hardware.compiled_vector_bits() == 256:
        return format.matvec8, format.words
    return format.matvec, ()


def _as_words(fields: dict[str, Tensor], words: tuple[str, ...]) -> dict[str, Tensor]:
    """``fields`` with those named in ``words`` viewed as int32 (their last dim a quarter as long).

    Through float32: compiled, the bytes come in as float32 and become int32 inside the loop (a
    bitcast, the same bits), because torch's AVX2 code loads a whole vector of floats at once but a
    vector of int32 by a copy through memory, which stalled the loop on every load."""
    return {n: _words(t) if n in words else t for n, t in fields.items()} if words else fields


def _words(t: Tensor) -> Tensor:
    """``t``'s bytes as int32 words, viewed through float32 (see :func:`_as_words`)."""
    return t.view(torch.float32).view(torch.int32)


def _matvec(x: Tensor, w: QuantizedTensor, compiled: bool = False) -> Tensor:
    """``x (..., in)`` holding one row ``@ w.T -> (..., out)``, each part by its format's ``matvec`` (compiled
    ahead with ``compiled``: see below). Kept lean: uncompiled, it runs for every product of a decoding step."""
    row = x.reshape(-1)  # (in,)
    row = row if row.dtype == torch.float32 else row.float()
    if torch.compiler.is_compiling() and not row.requires_grad:  # (the op has no backward)
        row = _realized(row)
    outs = []
    for p in w.parts:
        x_blocks = row.view(-1, FORMATS[p.format].block)  # (blocks, block)
        if compiled and _fits(p.fields):
            outs.append(_ahead("matvec", p)(p.fields, x_blocks))
        else:
            matvec, words = _one_row(FORMATS[p.format], torch.compiler.is_compiling())
            outs.append(matvec(_as_words(p.fields, words), x_blocks))
    y = outs[0] if len(outs) == 1 else torch.cat(outs)  # (out,)
    y = y.view(*x.shape[:-1], y.shape[0])
    return y if y.dtype == x.dtype else y.to(x.dtype)


# Uncompiled, the products are compiled functions of their own where compiling pays: torch has no eager
# kernel for GGML's blocks, and dequantizing a tile with torch operations reads and writes it a pass per
# operation, where inductor's loop reads the packed bytes once:
# * a decoding step's one-row products, each format's sum over its packed fields (shapes dynamic: a
#   format compiles once per process, see _compile_ahead; inductor's cache keeps the code between processes);
# * a product of more rows dequantizes each tile by its format's ``tile`` compiled (the 4-bit formats),
#   in tiles of COMPILED_TILE_ELEMENTS: with no temporaries beside it, a larger tile takes fewer calls.
# Weights (and tiles) under COMPILE_MIN_ELEMENTS stay eager: a compiled call's own cost is more than their
# whole dequantization.
# Compiling costs seconds once per process (importing the compiler and loading its cached code; more with
# an empty cache) and holds the compiler's own memory, more than a small model's file: a short job never
# wins that back (a page's 8 generated tokens, a model loaded for one forward). So a process's
# products take the eager tiles until their dequantizations have taken COMPILE_AFTER_S seconds in all (at
# most what compiling would have saved), then compile from then on: the ski-rental rule, rent until the
# rent paid equals the price of buying. A small model compiles after some tens of tokens or forwards, an
# 8B model in its first. Without a working compiler the eager tiles do it all.
COMPILE_MIN_ELEMENTS = 1 << 16
COMPILE_AFTER_S = 3.0  # the price: about what compiling takes, warm cache (docs/performance.md)
COMPILED_TILE_ELEMENTS = 1 << 20
_compiler_works = True  # False once a compile failed
_rent_paid_s = 0.0  # the seconds this process's eager dequantizations of tiles have taken


def _compiling_pays(x: Tensor) -> bool:
    """Whether this product of ``x`` runs compiled (see above)."""
    return _compiler_works and x.device.type == "cpu" and _rent_paid_s >= COMPILE_AFTER_S


def _pay_rent(seconds: float) -> None:
    global _rent_paid_s
    _rent_paid_s += seconds


def compile_from_now() -> None:
    """Products compile from now on, whatever rent was paid. For a training run: the switch from the
    eager tiles changes the order of some sums, and the clock decides when it comes (sooner on a busy
    machine), so two runs, or a run and its resumption, would differ in their last bits. The switch is
    the process's: later products of any quantized model compile too."""
    _pay_rent(max(0.0, COMPILE_AFTER_S - _rent_paid_s))


def _compile_failed(e: Exception, what: str) -> None:
    global _compiler_works
    warnings.warn(f"quantized {what} without torch.compile ({type(e).__name__}: {e})", stacklevel=3)
    _compiler_works = False


def _compile_ahead(
    fn: Callable[..., Tensor],
    fields: dict[str, Tensor],
    x_width: int | None,
    words: tuple[str, ...] = (),
    options: dict[str, Any] | None = None,
    paired: bool = False,
) -> Callable[..., Tensor]:
    """``fn(fields)`` (``x_width``: ``fn(fields, x (blocks, x_width))``) compiled once by inductor for every
    number of rows and blocks (the fields' first two dims, ``x``'s first; ``fields`` gives their dtypes
    and other dims, not their values), and called without guards; the fields named in ``words`` reach
    ``fn`` as int32 words (:func:`_as_words`).

    Not ``torch.compile``: each of its calls first checks its guards on every input, some 20 us, as long
    as a small matrix's one-row product itself, and a decoding step makes over a hundred of them. Here
    ``torch.export`` traces ``fn`` and inductor compiles the graph (``standalone_compile``: the code
    ``torch.compile`` would make, its inputs' sizes and strides asserted instead of guarded); :func:`_fits`
    says which inputs it takes."""
    names = tuple(fields)

    def as_floats(f: dict[str, Tensor]) -> dict[str, Tensor]:  # the words come in as float32 (see _as_words)
        return {n: t.view(torch.float32) if n in words else t for n, t in f.items()}

    fields = as_floats(fields)
    rows = torch.export.Dim("rows", min=2)
    # ``paired``: for an even number of blocks, 4 or more, which :func:`_row_sums` reads in two halves.
    blocks = 2 * torch.export.Dim("half", min=2) if paired else torch.export.Dim("blocks", min=2)
    # The example's sizes are inductor's hints (tiny ones make slower loops) and must differ from every
    # fixed size of the fields (16, 32, 256, ...): torch.export would take an equal size for that one.
    # A row's sum of more than 4096 terms at the hint would be a cascade summation, a few times slower per
    # term, and not needed here (each vector lane sums a few thousand terms at most): 14 or 15 super-blocks.
    n_blocks = (18 if paired else 19) if x_width is None or 19 * x_width <= 4096 else (14 if paired else 15)
    example = [torch.zeros(1009, n_blocks, *t.shape[2:], dtype=t.dtype) for t in fields.values()]
    dims: list[dict[int, Any]] = [{0: rows, 1: blocks}] * len(names)
    if x_width is not None:
        example.append(torch.zeros(n_blocks, x_width))
        dims.append({0: blocks})

    class Program(torch.nn.Module):  # (what torch.export traces)
        def forward(self, *args: Tensor) -> Tensor:
            f = {n: t.view(torch.int32) if n in words else t for n, t in zip(names, args[: len(names)], strict=True)}
            return fn(f, *args[len(names) :])

    from torch._inductor import standalone_compile  # (the compiler, imported once compiling pays)

    global _tracing_even_blocks
    _tracing_even_blocks = paired
    try:
        program = torch.export.export(Program(), tuple(example), dynamic_shapes=(tuple(dims),))  # (one entry: *args)
    finally:
        _tracing_even_blocks = False
    options = {"config_patches": options or hardware.compile_options()}
    compiled = standalone_compile(program.graph_module, example, dynamic_shapes="from_graph", options=options)

    def call(fields: dict[str, Tensor], *x: Tensor) -> Tensor:
        f = as_floats(fields)
        return compiled(*(f[n] for n in names), *x)[0]

    return call


def _fits(fields: dict[str, Tensor]) -> bool:
    """Whether :func:`_compile_ahead`'s code takes these fields: contiguous, two rows and blocks or more."""
    first = next(iter(fields.values()))
    return first.shape[0] > 1 and first.shape[1] > 1 and all(t.is_contiguous() for t in fields.values())


_AHEAD: dict[tuple[str, str, bool], Callable[..., Tensor]] = {}  # (what, format, paired) -> its compiled code
_AHEAD_LOCK = threading.Lock()


def _pairs(format: Format, blocks: int) -> bool:
    """Whether ``format``'s compiled one-row product reads a row of ``blocks`` blocks in two halves (the
    32-weight formats' :func:`_row_sums`, Q4_K's and Q5_K's code for 8 lanes' :func:`_block_sums`)."""
    return _in_halves(blocks) and (format.block == 32 or (format.name in HALVED_K_QUANTS and _eight_lanes()))


def _eight_lanes() -> bool:
    """Whether the code compiled now is made for vector units of 8 float lanes (AVX2)."""
    if hardware.compiled_vector_bits() is None:  # (once a process: the vector width the code is made for)
        hardware.compile_options()
    return hardware.compiled_vector_bits() == 256


def _compiles(tile: Part, compiled: bool) -> bool:
    """Whether a tile is dequantized by compiled code where ``compiled``: large enough to pay for a
    call (COMPILE_MIN_ELEMENTS) and of fields the code takes (:func:`_fits`)."""
    blocks = next(iter(tile.fields.values())).shape[1]  # (fields: (rows, blocks, ...))
    elements = tile.rows * blocks * FORMATS[tile.format].block
    return compiled and elements >= COMPILE_MIN_ELEMENTS and _fits(tile.fields)


def _ahead(what: str, part: Part) -> Callable[..., Tensor]:
    """``FORMATS[part.format]``'s ``matvec`` or ``tile`` compiled ahead (once per format and process; a
    ``matvec`` once for an even number of blocks, 4 or more, and once for the others: see :func:`_pairs`)."""
    blocks = next(iter(part.fields.values())).shape[1]
    key = (what, part.format, what == "matvec" and _pairs(FORMATS[part.format], blocks))
    code = _AHEAD.get(key)
    if code is None:
        with _AHEAD_LOCK:
            if key not in _AHEAD:
                format = FORMATS[part.format]
                options = hardware.compile_options()  # (before _one_row: it reads the vector width named)
                if what == "matvec":
                    fn, words = _one_row(format, compiling=True)
                    _AHEAD[key] = _compile_ahead(fn, part.fields, format.block, words, options, paired=key[2])
                elif what == "tile8":
                    _AHEAD[key] = _compile_ahead(format.tile8[0], part.fields, None, format.words, options)
                else:
                    _AHEAD[key] = _compile_ahead(format.tile, part.fields, None, options=options)
            code = _AHEAD[key]
    return code


def _dense_tile(tile: Part, dtype: torch.dtype, compiled: bool) -> Tensor:
    """A tile's rows dense ``(rows, in)`` in ``dtype``, by its format's ``tile`` compiled where
    ``compiled`` and the format has one, else eager (the same numbers)."""
    w, format = None, FORMATS[tile.format]
    if format.tile is not None and _compiles(tile, compiled):
        try:
            w = _ahead("tile", tile)(tile.fields)
        except Exception as e:  # (no C++ compiler, or inductor failing on this platform: eager is exact too)
            _compile_failed(e, "tiles are dequantized")
    if w is None:
        start = time.perf_counter()
        w = tile.dequantize()
        if not compiled:
            _pay_rent(time.perf_counter() - start)
    return w if w.dtype == dtype else w.to(dtype)


def _eager_matvec(x: Tensor, w: QuantizedTensor) -> Tensor | None:
    """:func:`_matvec` by the compiled one-row products, or None where they do not run (see above)."""
    rows, n = w.rows_and_columns
    if not (x.numel() == n == x.shape[-1] and rows * n >= COMPILE_MIN_ELEMENTS and _compiling_pays(x)):
        return None
    try:
        return _matvec(x, w, compiled=True)
    except Exception as e:  # (no C++ compiler, or inductor failing on this platform: the tiles are exact too)
        _compile_failed(e, "one-row products run")
        return None


def linear(x: Tensor, w: QuantizedTensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, w, bias)`` for a quantized ``w``: ``(..., in) -> (..., out)`` in ``x``'s dtype."""
    if isinstance(x, QuantizedTensor):
        raise TypeError("F.linear's input is a QuantizedTensor: only the weight may be quantized")
    if w.int4 is not None and x.dtype == w.int4.dtype and not (torch.is_grad_enabled() and x.requires_grad):
        y = int4_mm(x, w.int4, w.shape[0])  # eager and compiled alike (inductor calls the kernel)
    elif torch.compiler.is_compiling():
        if x.device.type == "cpu" and x.shape[:-1].numel() == 1:
            y = _matvec(x, w)  # one loop over the blocks, no matrix
        else:
            y = F.linear(x, w.dequantize(x.dtype))  # inductor fuses the dequantization into its consumer
    elif torch.is_grad_enabled() and x.requires_grad:
        y = _Linear.apply(x, _Frozen(w))
    else:
        y = _eager_matvec(x, w)
        y = _product(x, w) if y is None else y
    return y if bias is None else y + bias


def _linear(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    if isinstance(bias, QuantizedTensor):
        bias = bias.dequantize()
    if not isinstance(weight, QuantizedTensor):  # (the input or bias was the quantized one)
        with torch._C.DisableTorchFunctionSubclass():
            return F.linear(input, weight, bias)
    return linear(input, weight, bias)


def _embedding(
    input: Tensor, weight: Tensor, padding_idx: Any = None, max_norm: Any = None, *args: Any, **kwargs: Any
) -> Tensor:
    if max_norm is not None:
        raise ValueError("max_norm renormalises the embedding in place: not possible on a quantized weight")
    return weight.rows(input)


# --------------------------------------------------------------------------------------------
# Moving rows: what checkpoints' converters do (fuse gate and up, split q/k/v, permute rows)
# --------------------------------------------------------------------------------------------
def _slice_rows(w: QuantizedTensor, start: int, stop: int) -> QuantizedTensor:
    parts, at = [], 0
    for p in w.parts:
        lo, hi = max(start - at, 0), min(stop - at, p.rows)
        if lo < hi:
            parts.append(p.map(lambda t, lo=lo, hi=hi: t[lo:hi]))
        at += p.rows
    return _packed(w._with(parts))


def _cat(tensors: Sequence[Tensor], dim: int = 0, **kwargs: Any) -> Tensor:
    rows = dim in (0, -2) and all(isinstance(t, QuantizedTensor) for t in tensors)
    if rows and len({t.shape[1] for t in tensors}) == 1 and len({t.dtype for t in tensors}) == 1:
        parts: list[Part] = []
        # The blocks' fields are data, not activations: autocast's type promotion must not touch them
        # (on the CPU it refuses float16 scales outright).
        with torch.autocast(tensors[0].device.type, enabled=False):
            for t in tensors:
                for p in t.parts:  # neighbours of one format become one part (one dequantization per tile)
                    if parts and parts[-1].format == p.format:
                        last = parts[-1].fields
                        parts[-1] = Part(p.format, {k: torch.cat([last[k], v]) for k, v in p.fields.items()})
                    else:
                        parts.append(p)
        return _packed(tensors[0]._with(parts))
    dense = [t.dequantize() if isinstance(t, QuantizedTensor) else t for t in tensors]
    return torch.cat(dense, dim, **kwargs)


def _split_sizes(w: QuantizedTensor, sizes: int | Sequence[int], dim: int = 0) -> tuple[Tensor, ...]:
    if dim not in (0, -2):
        return torch.split(w.dequantize(), sizes, dim)
    n = w.shape[0]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - i) for i in range(0, n, sizes)]
    out, at = [], 0
    for s in sizes:
        out.append(_slice_rows(w, at, at + s))
        at += s
    return tuple(out)


def _chunk(w: QuantizedTensor, chunks: int, dim: int = 0) -> tuple[Tensor, ...]:
    if dim not in (0, -2):
        return torch.chunk(w.dequantize(), chunks, dim)
    return _split_sizes(w, math.ceil(w.shape[0] / chunks), 0)


def _getitem(w: QuantizedTensor, index: Any) -> Tensor:
    if isinstance(index, tuple) and len(index) >= 1 and all(i == slice(None) for i in index[1:]):
        index = index[0]
    if isinstance(index, slice) and index.step in (None, 1):
        start, stop, _ = index.indices(w.shape[0])
        return _slice_rows(w, start, max(start, stop))
    if isinstance(index, Tensor) and index.dim() == 1 and not index.is_floating_point() and index.dtype != torch.bool:
        return _index_select(w, 0, index)
    if isinstance(index, int) and not isinstance(index, bool):  # one row: (in,), not the whole matrix
        if not -w.shape[0] <= index < w.shape[0]:
            raise IndexError(f"index {index} is out of range for a weight of {w.shape[0]} rows")
        return w.rows(torch.tensor([index % w.shape[0]], device=w.device))[0]
    with torch._C.DisableTorchFunctionSubclass():
        return w.dequantize()[index]


def _index_select(w: QuantizedTensor, dim: int, index: Tensor) -> Tensor:
    if dim not in (0, -2) or len(w.parts) != 1:
        return torch.index_select(w.dequantize(), dim, index)
    return _packed(w._with([w.parts[0].map(lambda t: t.index_select(0, index.to(t.device)))]))


def _to(w: QuantizedTensor, *args: Any, **kwargs: Any) -> Tensor:
    """``.to(device)`` moves the blocks; ``.to(dtype)`` changes the dtype it computes in."""
    kwargs.pop("non_blocking", None), kwargs.pop("copy", None), kwargs.pop("memory_format", None)
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, (str, torch.device, int)) and not isinstance(a, bool):  # (a bool: non_blocking)
            device = a
        elif isinstance(a, Tensor):
            device, dtype = a.device, a.dtype
    if dtype is not None and not dtype.is_floating_point:
        raise TypeError(f"a quantized weight computes in a floating-point dtype, got {dtype}")
    if device is not None and torch.device(device) in (w.device, torch.device(w.device.type)):
        device = None  # already there
    if device is None and (dtype is None or dtype == w.dtype):
        return w
    parts = w.parts if device is None else [p.map(lambda t: t.to(device)) for p in w.parts]
    return _packed(w._with(parts, dtype))  # (into a dtype of INT4_DTYPES: repacked for the int4 kernel)


def _detach(w: QuantizedTensor) -> QuantizedTensor:
    return w._with(w.parts, int4=w.int4)


def _clone(w: QuantizedTensor, *args: Any, **kwargs: Any) -> QuantizedTensor:
    int4 = None if w.int4 is None else Int4Pack(w.int4.weight.clone(), w.int4.scales_and_zeros.clone())
    return w._with([p.map(lambda t: t.clone()) for p in w.parts], int4=int4)


_FUNCTIONS: dict[Any, Callable[..., Any]] = {
    F.linear: _linear,
    F.embedding: _embedding,
    torch.cat: _cat,
    torch.concat: _cat,
    torch.split: lambda t, s, dim=0: _split_sizes(t, s, dim),
    Tensor.split: lambda t, s, dim=0: _split_sizes(t, s, dim),
    torch.chunk: _chunk,
    Tensor.chunk: _chunk,
    Tensor.__getitem__: _getitem,
    torch.index_select: lambda t, dim, index: _index_select(t, dim, index),
    Tensor.index_select: lambda t, dim, index: _index_select(t, dim, index),
    Tensor.to: _to,
    Tensor.cpu: lambda t, *a, **k: _to(t, "cpu"),
    Tensor.cuda: lambda t, device=None, *a, **k: _to(
        t, torch.device("cuda", device) if isinstance(device, int) else (device or "cuda")
    ),
    Tensor.float: lambda t, *a, **k: _to(t, torch.float32),
    Tensor.detach: _detach,
    Tensor.clone: _clone,
    Tensor.contiguous: lambda t, *a, **k: t,
    Tensor.__repr__: lambda t, *a, **k: t.__repr__(),
}

_aten = torch.ops.aten
_ATEN: dict[Any, Callable[..., Any]] = {
    _aten.detach.default: _detach,
    _aten.alias.default: _detach,
    _aten.clone.default: _clone,
    _aten._to_copy.default: lambda t, dtype=None, device=None, **k: _to(t, dtype=dtype, device=device),
    _aten.slice.Tensor: lambda t, dim=0, start=None, end=None, step=1: (
        _slice_rows(t, *slice(start, end).indices(t.shape[0])[:2])
        if dim in (0, -2) and step == 1
        else _aten.slice.Tensor(t.dequantize(), dim, start, end, step)
    ),
    _aten.cat.default: lambda tensors, dim=0: _cat(tensors, dim),
    _aten.split_with_sizes.default: lambda t, sizes, dim=0: _split_sizes(t, sizes, dim),
    _aten.split.Tensor: lambda t, size, dim=0: _split_sizes(t, size, dim),
    _aten.index_select.default: _index_select,
}
