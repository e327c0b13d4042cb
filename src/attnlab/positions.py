"""How attention learns where tokens are, after GPT-2: rotary embeddings (RoPE) and ALiBi.

GPT-2 adds a learned vector per *absolute* position to each token before the first layer. Models since
then put relative positions into attention itself:

* **RoPE** (Su et al. 2021; Llama, Mistral, Qwen, nanochat) rotates each query and key, pair of
  features by pair of features, by an angle proportional to its position. A rotation keeps lengths,
  and ``rot(q, m) . rot(k, n)`` depends only on ``m - n``: the scores see relative positions.
* **ALiBi** (Press et al. 2022; BLOOM, MPT) adds ``-slope_h * (i - j)`` to the score of query ``i`` and
  key ``j``: a per-head linear penalty on distance, with no parameters.

Positions are always explicit (a tensor of integers), so a KV cache, a left-padded batch or a window
that has slid past the start computes exactly the angles and biases a full forward pass would.

The rotation pairs feature ``i`` with feature ``i + head_dim/2`` (the "rotate half" layout of Hugging
Face's Llama and GPT-NeoX), so Llama-family weights load without permutation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from attnlab.checks import finite_real, is_int, positive_int

__all__ = [
    "ROPE_SCALINGS",
    "alibi_bias",
    "alibi_score_mod",
    "alibi_slopes",
    "apply_rope",
    "check_rope_scaling",
    "llama3_scaling_from_factors",
    "rope_attention_factor",
    "rope_cos_sin",
    "rope_inv_freq",
    "rope_scaling_type",
]

# rope_scaling["rope_type"] values understood (Hugging Face's names): "default" (none), "linear"
# (positions divided by `factor`), "llama3" (Llama 3.1's frequency-dependent stretching) and "yarn"
# (YaRN: slow pairs interpolated, fast ones kept, a ramp between, and the angles' cos/sin scaled) and
# "longrope" (Phi-3's LongRoPE: a divisor per pair, one set for short sequences and one for long).
ROPE_SCALINGS = ("default", "linear", "llama3", "yarn", "longrope")


# --------------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------------
def rope_scaling_type(scaling: Mapping[str, Any] | None) -> str:
    """The ``rope_type`` of a rope_scaling dict (older configs: ``type``), ``"default"`` for None."""
    return "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))


def check_rope_scaling(scaling: object) -> dict[str, Any] | None:
    """``scaling`` as a plain dict (or None), or a ValueError naming what is wrong with it."""
    if scaling is None:
        return None
    if not isinstance(scaling, Mapping):
        raise ValueError(f"rope_scaling must be a dict like {{'rope_type': 'llama3', ...}} or None, got {scaling!r}")
    scaling = dict(scaling)
    kind = rope_scaling_type(scaling)
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling type must be one of {', '.join(ROPE_SCALINGS)}, got {kind!r}")
    need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
    for key in need.get(kind, ()):
        if not finite_real(scaling.get(key)) or scaling[key] <= 0:
            raise ValueError(f"rope_scaling {kind!r} needs a positive number {key!r}, got {scaling.get(key)!r}")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            v = scaling.get(key)
            if not isinstance(v, (list, tuple)) or not v or not all(finite_real(x) and x > 0 for x in v):
                raise ValueError(f"rope_scaling 'longrope' needs {key!r}: a list of positive numbers, got {v!r}")
        if len(scaling["short_factor"]) != len(scaling["long_factor"]):
            raise ValueError("rope_scaling 'longrope' needs 'short_factor' and 'long_factor' of one length")
    yarn_optional = ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim")
    for key in {"yarn": yarn_optional, "longrope": ("factor", "attention_factor")}.get(kind, ()):  # None or > 0
        if scaling.get(key) is not None and (not finite_real(scaling[key]) or scaling[key] <= 0):
            raise ValueError(f"rope_scaling {kind!r} {key!r} must be a positive number or None, got {scaling[key]!r}")
    if kind == "yarn" and not isinstance(scaling.get("truncate", True), bool):
        raise ValueError(f"rope_scaling 'yarn' 'truncate' must be a bool, got {scaling['truncate']!r}")
    original = scaling.get("original_max_position_embeddings")
    if kind in ("llama3", "yarn", "longrope") and (not is_int(original) or original < 1):
        raise ValueError(
            f"rope_scaling {kind!r} needs a positive int 'original_max_position_embeddings', got {original!r}"
        )
    if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ValueError("rope_scaling 'llama3' needs high_freq_factor > low_freq_factor")
    return scaling


def rope_inv_freq(
    head_dim: int,
    theta: float = 10000.0,
    scaling: Mapping[str, Any] | None = None,
    *,
    device: torch.device | str | None = None,
    long: bool = False,
) -> Tensor:
    """The rotation speed of each feature pair, ``theta ** (-2i / head_dim)``: ``(head_dim / 2,)`` float32.

    Pair 0 turns by one radian per position, the last pair by about ``1/theta``: fast pairs resolve
    nearby tokens, slow ones far-apart tokens. ``scaling`` stretches them for longer contexts
    (``{"rope_type": "linear", "factor": f}``, Llama 3.1's ``"llama3"``, ``"yarn"`` or ``"longrope"``,
    whose divisors are its ``long_factor`` with ``long``, else its ``short_factor``).
    """
    _check_rope_args(head_dim, theta)
    return _inv_freq(head_dim, theta, check_rope_scaling(scaling), device, long)


def _check_rope_args(head_dim: int, theta: float) -> None:
    positive_int("head_dim", head_dim)
    if head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of features: head_dim must be even, got {head_dim}")
    if not finite_real(theta) or theta <= 1:
        raise ValueError(f"rope theta must be a number > 1, got {theta!r}")


def _inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, device: torch.device | str | None, long: bool
) -> Tensor:
    """:func:`rope_inv_freq` of arguments already checked (``scaling``: by :func:`check_rope_scaling`)."""
    # As Hugging Face computes it (int64 arange, then float), so the angles agree to the last bit.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim  # (hd/2,)
    wavelength_over_2pi = float(theta) ** exponent  # (hd/2,)
    inv_freq = 1.0 / wavelength_over_2pi  # (hd/2,)
    kind = rope_scaling_type(scaling)
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: wavelengths longer than the original context / low_freq_factor are slowed by
        # `factor`, shorter than original / high_freq_factor kept, the band between interpolated.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        original = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        slowed = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        mid = (1 - smooth) * slowed / factor + smooth * slowed
        is_mid = (wavelen >= original / high) & (wavelen <= original / low)
        inv_freq = torch.where(is_mid, mid, slowed)
    elif kind == "yarn":
        # YaRN: pairs that turn fewer than beta_slow times over the original context are interpolated
        # (slowed by `factor`), more than beta_fast times kept, with a linear ramp over the pairs between.
        factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

        def pair_turning(turns: float) -> float:  # the (fractional) pair that turns `turns` times over it
            return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

        lo, hi = pair_turning(scaling.get("beta_fast") or 32), pair_turning(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        hi = hi + 0.001 if lo == hi else hi  # (a ramp of one pair: no division by zero)
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - lo) / (hi - lo)).clamp(0, 1)
        kept = 1 - ramp  # (hd/2,) 1: kept as it is, 0: interpolated
        inv_freq = 1.0 / (factor * wavelength_over_2pi) * (1 - kept) + inv_freq * kept
    elif kind == "longrope":
        divisors = scaling["long_factor" if long else "short_factor"]
        if len(divisors) != head_dim // 2:
            raise ValueError(
                f"rope_scaling 'longrope' needs {head_dim // 2} factors (one per pair), got {len(divisors)}"
            )
        inv_freq = 1.0 / (torch.tensor(divisors, dtype=torch.float32, device=device) * wavelength_over_2pi)
    return inv_freq


def rope_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """What ``scaling`` multiplies RoPE's cosines and sines by: YaRN's ``attention_factor`` (by default
    ``0.1 ln(factor) + 1``, or the ratio of two such terms with DeepSeek's ``mscale``, ``mscale_all_dim``),
    LongRoPE's (by default ``sqrt(1 + ln(factor) / ln(original))``), 1 for the others. Both the query and
    the key are scaled, so the scores by its square."""
    return _attention_factor(check_rope_scaling(scaling))


def _attention_factor(scaling: dict[str, Any] | None) -> float:
    """:func:`rope_attention_factor` of a ``scaling`` already checked."""
    kind = rope_scaling_type(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "longrope":  # LongRoPE's default: sqrt(1 + ln(factor) / ln(original context))
        factor, original = scaling.get("factor") or 1.0, scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))

    def mscale(factor: float, m: float = 1.0) -> float:  # the YaRN paper's eq. 21
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def llama3_scaling_from_factors(factors: Tensor, head_dim: int, theta: float) -> dict[str, Any] | None:
    """The ``"llama3"`` rope_scaling whose rotation speeds are ``rope_inv_freq(head_dim, theta) / factors``.

    llama.cpp's converter stores Llama 3.1's scaling (Llama 3.2's too) as those per-pair divisors, the
    tensor ``rope_freqs.weight``, not as its four parameters; this reads the parameters back, so the
    model gets the Hugging Face config it came from. Between the kept and the slowed pairs, a pair of
    wavelength ``w`` is divided by ``1 / ((1 - s) / factor + s)`` with ``s = (original / w - low) /
    (high - low)``: ``s`` is linear in ``1 / w``, so two interpolated pairs fix the line, and every
    ``(low, high, original)`` on it gives the same speeds; the one returned has the integer ``original``
    nearest ``low = 1`` (every published Llama 3 config's, which comes back as it was).

    Args:
        factors: ``(head_dim / 2,)`` the divisors, one per feature pair.
    Returns:
        The rope_scaling dict, or None where every factor is 1 (no scaling).
    Raises:
        ValueError: the factors are not of that shape (or too few pairs are interpolated to tell).
    """
    f = torch.as_tensor(factors, dtype=torch.float64).flatten()  # (hd/2,)
    if f.numel() != head_dim // 2 or not bool(torch.isfinite(f).all()) or bool((f <= 0).any()):
        raise ValueError(
            f"RoPE frequency factors must be {head_dim // 2} positive numbers (one per pair), got {f.tolist()}"
        )
    if bool(((f - 1).abs() <= 1e-6).all()):
        return None
    speeds = rope_inv_freq(head_dim, theta).double()  # (hd/2,) unscaled
    wavelen = 2 * math.pi / speeds  # (hd/2,) increasing
    factor = float(f.max())
    kept, slowed = (f - 1).abs() <= 1e-6, (f - factor).abs() <= 1e-6 * factor
    mid = ~(kept | slowed)
    order = torch.where(kept, 0, torch.where(mid, 1, 2))  # kept, then interpolated, then slowed pairs
    if factor <= 1 or bool((order.diff() < 0).any()) or int(mid.sum()) < 2:
        raise ValueError(
            "RoPE frequency factors do not follow Llama 3's scaling (pairs kept, then interpolated, then slowed "
            f"by one factor, at least two interpolated), got {[round(v, 6) for v in f.tolist()]}"
        )
    s = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)  # (n,) the interpolation weights
    x = 1 / wavelen[mid]
    slope = float(((x - x.mean()) * (s - s.mean())).sum() / ((x - x.mean()) ** 2).sum())  # least squares
    intercept = float(s.mean() - slope * x.mean())  # s = slope / w + intercept, intercept = -low / (high - low)
    if intercept < 0 and slope > 0:
        want = speeds / f  # (hd/2,)
        # On the line: original = slope (high - low), low = -intercept (high - low). The integer original
        # nearest low = 1's names one point of it (low = 1 itself where the config had it).
        original = max(1, round(-slope / intercept))
        low = -intercept * original / slope
        high = low + original / slope
        for lo, hi in ((round(low, 4), round(high, 4)), (low, high)):  # the config's round numbers, if the same
            scaling = {"rope_type": "llama3", "factor": round(factor, 6), "low_freq_factor": lo,
                       "high_freq_factor": hi, "original_max_position_embeddings": original}  # fmt: skip
            # (to 1e-4: a pair just inside the band's edge amplifies the float32 rounding of the divisors)
            if torch.allclose(rope_inv_freq(head_dim, theta, scaling).double(), want, rtol=1e-4, atol=0):
                return scaling
    raise ValueError(f"RoPE frequency factors do not follow Llama 3's scaling, got {[round(v, 6) for v in f.tolist()]}")


def rope_cos_sin(
    positions: Tensor,
    head_dim: int,
    theta: float = 10000.0,
    *,
    scaling: Mapping[str, Any] | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Cosines and sines of the rotation angles ``position * inv_freq``, each ``(..., T, head_dim)``.

    Args:
        positions: ``(T,)`` or ``(B, T)`` integer positions (any values: a cache past the context,
            a left-padded row).
        head_dim, theta, scaling: see :func:`rope_inv_freq`.
        dtype: of the result (default float32); the angles are always computed in float32.
    Returns:
        ``(cos, sin)``, each ``(..., T, head_dim)``: the ``head_dim / 2`` angles twice, once per half
        (times :func:`rope_attention_factor` where ``scaling`` is YaRN or LongRoPE).
    """
    if not isinstance(positions, Tensor) or positions.is_floating_point() or positions.dtype == torch.bool:
        raise TypeError(f"positions must be an integer tensor, got {getattr(positions, 'dtype', type(positions))}")
    _check_rope_args(head_dim, theta)
    scaling = check_rope_scaling(scaling)  # (once: the helpers below take it as it is)
    inv_freq = _inv_freq(head_dim, theta, scaling, positions.device, long=False)  # (hd/2,)
    angles = positions.float()[..., None] * inv_freq  # (..., T, hd/2)
    if rope_scaling_type(scaling) == "longrope" and positions.numel():
        # LongRoPE's long divisors once the sequence is longer than the original context, as transformers
        # decides it: by the largest position of this call (a cached step past it turns long, its keys not)
        long_freq = _inv_freq(head_dim, theta, scaling, positions.device, long=True)  # (hd/2,)
        long = positions.max() + 1 > scaling["original_max_position_embeddings"]  # () bool
        angles = torch.where(long, positions.float()[..., None] * long_freq, angles)
    angles = torch.cat([angles, angles], dim=-1)  # (..., T, hd)
    cos, sin = angles.cos(), angles.sin()
    if (a := _attention_factor(scaling)) != 1.0:
        cos, sin = cos * a, sin * a
    return (cos, sin) if dtype is None else (cos.to(dtype), sin.to(dtype))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x (..., T, head_dim)`` by the angles of :func:`rope_cos_sin`.

    Feature ``i`` and feature ``i + head_dim/2`` form a pair ``(a, b)`` that becomes
    ``(a cos - b sin, b cos + a sin)``: a 2-D rotation, so ``x``'s norm is unchanged. ``cos`` and
    ``sin`` broadcast against ``x``: ``(T, hd)`` for every batch row and head, ``(B, 1, T, hd)`` per row.
    """
    half = x.shape[-1] // 2
    swapped = x.roll(half, dims=-1)  # (..., T, hd): [b, a] for x = [a, b]
    signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # small: (..., T, hd) without heads
    return torch.addcmul(x * cos, swapped, signed_sin)  # [a cos - b sin, b cos + a sin]: 3 passes over x


# --------------------------------------------------------------------------------------------
# ALiBi
# --------------------------------------------------------------------------------------------
def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi's per-head slopes ``(n_heads,)`` float32: the geometric sequence ``2^(-8/n), 2^(-16/n), ...``.

    For a head count that is not a power of two, the paper's recipe: the slopes of the nearest
    smaller power of two, then every other slope of the next power of two.
    """
    n = positive_int("n_heads", n_heads)

    def power_of_two(m: int) -> list[float]:
        start = 2.0 ** (-8.0 / m)
        return [start ** (i + 1) for i in range(m)]

    m = 1 << (n.bit_length() - 1)  # largest power of two <= n
    slopes = power_of_two(m) + power_of_two(2 * m)[0::2][: n - m]
    return torch.tensor(slopes, dtype=torch.float32)


@functools.lru_cache(maxsize=32)
def alibi_slopes_on(n_heads: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """:func:`alibi_slopes` on ``device`` in ``dtype``, made once: copied to an accelerator at every
    layer's call, they would make each layer wait for the copy."""
    with torch.inference_mode(False):  # (a normal tensor, whatever mode the first call ran in)
        return alibi_slopes(n_heads).to(device=device, dtype=dtype)


def alibi_bias(slopes: Tensor, q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """ALiBi's additive bias ``-slope_h * |i - j|`` for queries at ``q_positions`` and keys at ``k_positions``.

    Args:
        slopes: ``(H,)`` (see :func:`alibi_slopes`).
        q_positions: ``(L,)`` or ``(B, L)``; k_positions: ``(S,)`` or ``(B, S)`` integer positions.
    Returns:
        ``(H, L, S)``, or ``(B, H, L, S)`` for per-row positions, in ``slopes``' dtype. In causal
        attention ``j <= i``, so this is the paper's ``-slope * (i - j)``; masking is left to the mask.
    """
    distance = (q_positions[..., :, None] - k_positions[..., None, :]).abs()  # (..., L, S)
    distance = distance.unsqueeze(-3).to(slopes.dtype)  # (..., 1, L, S)
    return -slopes[:, None, None] * distance  # (..., H, L, S)


def alibi_score_mod(slopes: Tensor, q_offset: int = 0) -> Callable[..., Tensor]:
    """ALiBi as a ``score_mod`` for :func:`attnlab.functional.scaled_dot_product_attention` (or
    ``torch.nn.attention.flex_attention``): ``score - slope[h] * |q_idx + q_offset - kv_idx|``.

    ``q_offset`` is the position of the first query (``S - L`` when decoding after ``S - L`` cached keys).
    """

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score - slopes[h] * (q_idx + q_offset - kv_idx).abs()

    return score_mod
