"""Attention since GPT-2, functional core: RoPE, ALiBi, sliding windows and sinks, score/mask modifiers.

References: float64 loops (conftest), complex-number rotations written out, the ALiBi paper's slope
recipe, Hugging Face's Llama rotary embedding and BLOOM ALiBi tensor, torch's own flex_attention,
and dense masks built element by element.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import sliding
from attnlab.functional import (
    attention_scores,
    causal_mask,
    positions_mask,
    scaled_dot_product_attention,
    softcap_score_mod,
)
from attnlab.positions import (
    alibi_bias,
    alibi_score_mod,
    alibi_slopes,
    apply_rope,
    rope_cos_sin,
    rope_inv_freq,
)

FAST = settings(max_examples=25, deadline=None)


def rand(*shape, seed=0, dtype=torch.float64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


def window_allowed(L: int, S: int, window: int | None, sinks: int = 0) -> torch.Tensor:
    """Bottom-right causal with a window, element by element: query i sits at position i + S - L."""
    rows = []
    for i in range(L):
        p = i + S - L
        rows.append([j <= p and (window is None or p - j < window or j < sinks) for j in range(S)])
    return torch.tensor(rows, dtype=torch.bool).reshape(L, S)


# =============================================================================================
# RoPE
# =============================================================================================
def rope_by_complex_numbers(x: torch.Tensor, positions: list[int], theta: float) -> torch.Tensor:
    """Pair feature i with feature i + d/2 as the complex number a + ib and multiply by e^{i p theta^(-2i/d)}."""
    d = x.shape[-1]
    out = torch.empty_like(x, dtype=torch.float64)
    for t, p in enumerate(positions):
        for i in range(d // 2):
            z = complex(float(x[t, i]), float(x[t, i + d // 2])) * complex(
                math.cos(p * theta ** (-2 * i / d)), math.sin(p * theta ** (-2 * i / d))
            )
            out[t, i], out[t, i + d // 2] = z.real, z.imag
    return out


def test_rope_is_a_rotation_of_feature_pairs():
    x = rand(5, 8)
    positions = [0, 1, 7, 100, 3]
    cos, sin = rope_cos_sin(torch.tensor(positions), 8, theta=10000.0, dtype=torch.float64)
    rotated = apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated, rope_by_complex_numbers(x, positions, 10000.0), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))  # rotations keep lengths
    torch.testing.assert_close(rotated[0], x[0])  # position 0: no rotation


@FAST
@given(
    m=st.integers(0, 4096),
    n=st.integers(0, 4096),
    shift=st.integers(-4096, 4096),
    seed=st.integers(0, 2**16),
    half=st.sampled_from([1, 2, 4, 16, 32]),
    theta=st.sampled_from([100.0, 10000.0, 500000.0]),
)
def test_rope_scores_depend_only_on_relative_position(m, n, shift, seed, half, theta):
    """q at m and k at n score exactly as q at m + s and k at n + s (float64, any shift)."""
    shift = max(shift, -min(m, n))  # positions stay >= 0
    q, k = rand(1, 2 * half, seed=seed), rand(1, 2 * half, seed=seed + 1)

    def score(pq: int, pk: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([pq]), 2 * half, theta, dtype=torch.float64)
        ck, sk = rope_cos_sin(torch.tensor([pk]), 2 * half, theta, dtype=torch.float64)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    # float32 angles (as Hugging Face computes them) lose ~1e-4 rad at positions ~8000
    assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=2e-3 * 2 * half)


def test_rope_cos_sin_match_hugging_face_llama(hf_rope):
    """Default, linear, Llama 3.1 and YaRN scaling give the cosines and sines of transformers' Llama (YaRN's
    scaled by its attention factor: by default, from DeepSeek's two mscales, or given)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    positions = torch.tensor([[0, 1, 5, 131071, 40000]])
    for scaling in (
        None,
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 16.0,
            "beta_slow": 2.0,
            "truncate": False,
        },
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
        },
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 65536, "attention_factor": 1.3},
    ):
        params = (
            {"rope_type": "default", "rope_theta": 500000.0} if scaling is None else {**scaling, "rope_theta": 500000.0}
        )
        cfg = LlamaConfig(
            hidden_size=128, num_attention_heads=2, rope_parameters=params, max_position_embeddings=131072
        )
        rot = LlamaRotaryEmbedding(cfg)
        want_cos, want_sin = rot(torch.zeros(1, dtype=torch.float32), positions)
        cos, sin = rope_cos_sin(positions, 64, 500000.0, scaling=scaling)
        torch.testing.assert_close(cos, want_cos, atol=0, rtol=0)
        torch.testing.assert_close(sin, want_sin, atol=0, rtol=0)


@pytest.fixture(scope="module")
def hf_rope():
    pytest.importorskip("transformers")


def test_rope_bad_options_are_value_errors():
    with pytest.raises(ValueError, match="head_dim must be even"):
        rope_inv_freq(7)
    with pytest.raises(ValueError, match="theta"):
        rope_inv_freq(8, theta=0.5)
    with pytest.raises(ValueError, match="rope_scaling type"):
        rope_inv_freq(8, scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="'yarn' needs a positive int 'original_max_position_embeddings'"):
        rope_inv_freq(8, scaling={"rope_type": "yarn", "factor": 2.0})
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match="'beta_fast' must be a positive number or None"):
        rope_inv_freq(8, scaling=yarn | {"beta_fast": -1.0})
    with pytest.raises(ValueError, match="'truncate' must be a bool"):
        rope_inv_freq(8, scaling=yarn | {"truncate": "yes"})
    with pytest.raises(ValueError, match="factor"):
        rope_inv_freq(8, scaling={"rope_type": "linear"})
    with pytest.raises(TypeError, match="integer"):
        rope_cos_sin(torch.tensor([0.5]), 8)


# =============================================================================================
# ALiBi
# =============================================================================================
def paper_slopes(n: int) -> list[float]:
    """The ALiBi repository's get_slopes, as published."""

    def get_slopes_power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest) + paper_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 12, 16, 20, 25, 64])
def test_alibi_slopes_follow_the_paper(n):
    torch.testing.assert_close(alibi_slopes(n), torch.tensor(paper_slopes(n), dtype=torch.float32))
    if n == 8:
        assert alibi_slopes(8).tolist() == [2.0**-i for i in range(1, 9)]


def test_alibi_bias_matches_bloom_up_to_a_per_row_constant():
    """BLOOM adds slope * j (softmax ignores a per-row constant); ours is -slope * (i - j): the same
    causal attention weights for any scores."""
    pytest.importorskip("transformers")
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    H, T = 6, 9
    bloom = build_alibi_tensor(torch.ones(1, T), H, torch.float32).view(H, 1, T)  # (H, 1, T): slope * j
    ours = alibi_bias(alibi_slopes(H), torch.arange(T), torch.arange(T))  # (H, T, T)
    scores = rand(H, T, T, dtype=torch.float32)
    hidden = ~causal_mask(T)
    torch.testing.assert_close(
        torch.softmax((scores + ours).masked_fill(hidden, float("-inf")), -1),
        torch.softmax((scores + bloom).masked_fill(hidden, float("-inf")), -1),
    )
    assert not torch.allclose(ours, bloom.expand_as(ours))  # not the same tensor: the same weights


@pytest.mark.parametrize("backend", ["reference", "fused", "flex", "auto"])
def test_alibi_through_score_mod_equals_the_explicit_bias(backend, ref):
    B, H, L, S, E = 2, 4, 5, 9, 8
    q, k, v = rand(B, H, L, E, seed=1), rand(B, H, S, E, seed=2), rand(B, H, S, E, seed=3)
    slopes = alibi_slopes(H).double()
    bias = alibi_bias(slopes, torch.arange(S - L, S), torch.arange(S))  # (H, L, S)
    want, _ = ref.loop_attention_nd(q, k, v, window_allowed(L, S, None), bias.expand(B, H, L, S))
    got = scaled_dot_product_attention(
        q, k, v, is_causal=True, score_mod=alibi_score_mod(slopes, S - L), backend=backend
    )
    torch.testing.assert_close(got, want)
    explicit = scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=True, backend="fused")
    torch.testing.assert_close(explicit, want)


# =============================================================================================
# Sliding windows and sinks
# =============================================================================================
@pytest.mark.parametrize("L,S", [(1, 1), (4, 4), (3, 9), (9, 9), (1, 12), (6, 2)])
@pytest.mark.parametrize("window,sinks", [(None, 0), (1, 0), (3, 0), (3, 2), (5, 1), (20, 3)])
def test_causal_mask_window_and_sinks_element_by_element(L, S, window, sinks):
    assert torch.equal(causal_mask(L, S, window=window, sinks=sinks), window_allowed(L, S, window, sinks))


def test_positions_mask_follows_explicit_positions():
    q = torch.tensor([[5, 6, 7], [-1, 0, 1]])  # row 1: a padded query first
    k = torch.tensor([[4, 0, 7, 6, 5, 1], [-1, -1, 0, 1, 2, -1]])  # rotated slots, empty slots
    got = positions_mask(q, k, window=2, sinks=1)
    want = torch.tensor(
        [
            [[[i >= 0 and j >= 0 and j <= i and (i - j < 2 or j < 1) for j in kr] for i in qr]]
            for qr, kr in zip(q.tolist(), k.tolist(), strict=True)
        ]
    ).squeeze(1)
    assert torch.equal(got, want)
    assert torch.equal(positions_mask(torch.arange(4), torch.arange(4)), causal_mask(4))
    assert torch.equal(positions_mask(q[:1], k), positions_mask(q[:1].expand(2, -1), k))  # a batch of 1 broadcasts
    for bad, error, match in [
        (([0, 1], k), TypeError, "q_positions must be an integer tensor of positions.*got list"),
        ((q.float(), k), TypeError, "q_positions must be an integer tensor.*got torch.float32"),
        ((q, k[None]), ValueError, r"k_positions must have shape \(L,\) or \(B, L\), got \(1, 2, 6\)"),
        ((q, torch.cat([k, k])), ValueError, "must have the same batch"),
    ]:
        with pytest.raises(error, match=match):
            positions_mask(*bad)


@pytest.mark.parametrize("backend", ["reference", "fused", "flex"])
@pytest.mark.parametrize("L,S,window,sinks", [(6, 6, 2, 0), (6, 6, 3, 1), (2, 8, 3, 2), (1, 8, 4, 0), (8, 8, 8, 0)])
def test_window_equals_loops_with_a_dense_mask(backend, L, S, window, sinks, ref):
    q, k, v = rand(2, 4, L, 8, seed=4), rand(2, 2, S, 8, seed=5), rand(2, 2, S, 8, seed=6)
    allowed = window_allowed(L, S, window, sinks)
    want, want_w = ref.loop_attention_nd(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), allowed)
    got = scaled_dot_product_attention(
        q, k, v, is_causal=True, window=window, sinks=sinks, enable_gqa=True, backend=backend
    )
    torch.testing.assert_close(got, want)
    if backend == "reference":
        _, w = scaled_dot_product_attention(
            q, k, v, is_causal=True, window=window, sinks=sinks, enable_gqa=True, return_weights=True
        )
        torch.testing.assert_close(w, want_w)
        scores = attention_scores(q, k, is_causal=True, window=window, sinks=sinks, enable_gqa=True)
        assert torch.equal(torch.isfinite(scores), allowed.expand_as(scores))


@settings(max_examples=30, deadline=None)
@given(
    T=st.integers(4, 160),
    window=st.integers(1, 40),
    sinks=st.integers(0, 6),
    B=st.integers(1, 2),
    gqa=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sliding_fast_path_equals_the_dense_mask_forward_and_backward(T, window, sinks, B, gqa, seed):
    """The band-blocked path (taken for T >= 4 W on the CPU) == fused attention with the dense mask."""
    Hkv = 1 if gqa else 3
    q = rand(B, 3, T, 8, seed=seed, requires_grad=True)
    k, v = (rand(B, Hkv, T, 8, seed=seed + i, requires_grad=True) for i in (1, 2))
    kw = dict(is_causal=True, window=window, sinks=sinks, enable_gqa=gqa)
    got = scaled_dot_product_attention(q, k, v, **kw)
    mask = window_allowed(T, T, window, sinks)
    want = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, backend="reference")
    torch.testing.assert_close(got, want)
    g = rand(*got.shape, seed=seed + 3)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("T,W,sinks", [(700, 160, 3), (1531, 300, 0), (2048, 512, 1)])
def test_sliding_fast_path_with_its_own_block_sizes(T, W, sinks):
    """Windows wide enough that the forward's query blocks (W/4) and the backward's key chunks (W/2)
    differ, odd lengths, sinks: the same numbers as the dense mask."""
    q, k, v = (rand(1, 2, T, 8, seed=50 + i, requires_grad=True) for i in range(3))
    got = scaled_dot_product_attention(q, k, v, is_causal=True, window=W, sinks=sinks)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    mask = (j <= i) & ((i - j < W) | (j < sinks))
    want = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(got, want)
    g = rand(*got.shape, seed=54)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("per_call", [1, 3])
def test_sliding_fast_path_in_groups_of_blocks(per_call, monkeypatch):
    """Several kernel calls (groups of query blocks) compute the same, forward and backward."""
    monkeypatch.setattr(sliding, "BLOCKS_PER_CALL", per_call)
    T, W = 300, 16  # blocks of 32 rows: a head of 32, 8 blocks, a tail of 12 rows
    q, k, v = (rand(2, 3, T, 8, seed=40 + i, requires_grad=True) for i in range(3))
    got = scaled_dot_product_attention(q, k, v, is_causal=True, window=W, sinks=1)
    want = scaled_dot_product_attention(q, k, v, attn_mask=window_allowed(T, T, W, 1), backend="reference")
    torch.testing.assert_close(got, want)
    g = rand(*got.shape, seed=44)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("layout", ["q every other column", "v expanded along E", "k transposed from (E, T)"])
def test_sliding_fast_path_takes_inputs_of_any_strides(layout):
    # The band kernel reads a row's E values as one run: q[..., ::2] gave wrong values, and an
    # expanded v read memory past the tensor.
    T, W, E = 64, 8, 4
    q, k, v = (rand(1, 2, T, E, seed=50 + i) for i in range(3))
    if layout == "q every other column":
        q = rand(1, 2, T, 2 * E, seed=53)[..., ::2]
    elif layout == "v expanded along E":
        v = rand(1, 2, T, 1, seed=54).expand(1, 2, T, E)
    else:
        k = rand(1, 2, E, T, seed=55).transpose(-1, -2)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    assert sliding.available() and 4 * W <= T  # (the band path runs)
    got = scaled_dot_product_attention(q, k, v, is_causal=True, window=W)
    want = scaled_dot_product_attention(q, k, v, attn_mask=window_allowed(T, T, W, 0), backend="reference")
    torch.testing.assert_close(got, want)
    g = rand(*got.shape, seed=56)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("scale", [0.0, -0.5])
@pytest.mark.parametrize("window", [None, 8, 33])
@pytest.mark.parametrize("backend", ["auto", "fused"])
def test_causal_attention_with_a_scale_of_zero_or_below_is_not_nan(scale, window, backend):
    # torch's CPU kernel masks before it scales, so its is_causal turned the mask into NaN or +inf
    # (the band path's first block too, when the window covers it).
    T = 140
    q, k, v = (rand(2, 2, T, 4, seed=60 + i) for i in range(3))
    got = scaled_dot_product_attention(q, k, v, is_causal=True, window=window, scale=scale, backend=backend)
    want = scaled_dot_product_attention(q, k, v, is_causal=True, window=window, scale=scale, backend="reference")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want)


def test_sliding_fast_path_is_taken_and_linear_in_memory(monkeypatch):
    """At T = 16 W the band path runs (no (T, T) mask is ever built) and float32 agrees with float64."""
    calls = []
    real = sliding.sliding_window_attention
    monkeypatch.setattr(sliding, "sliding_window_attention", lambda *a: calls.append(a[3]) or real(*a))
    monkeypatch.setattr("attnlab.functional.causal_mask", lambda *a, **k: pytest.fail("a dense causal mask was built"))
    T, W = 512, 32
    q, k, v = (rand(1, 2, T, 16, seed=i, dtype=torch.float32, requires_grad=True) for i in range(3))
    out = scaled_dot_product_attention(q, k, v, is_causal=True, window=W, sinks=2)
    assert calls == [W]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    mask = (j <= i) & ((i - j < W) | (j < 2))
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


# =============================================================================================
# score_mod / mask_mod with flex_attention's signatures
# =============================================================================================
def soft_cap(score, b, h, q_idx, kv_idx):
    return 3.0 * torch.tanh(score / 3.0)


def document_mask(docs: torch.Tensor):
    def mask_mod(b, h, q_idx, kv_idx):
        return docs[b, q_idx] == docs[b, kv_idx]

    return mask_mod


def per_head_relative_bias(table: torch.Tensor, offset: int):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, (q_idx + offset - kv_idx).clamp(0, table.shape[1] - 1)]

    return score_mod


@pytest.mark.parametrize("backend", ["reference", "fused", "flex", "auto"])
def test_mask_mod_equals_an_explicit_mask_and_flex_attention(backend, ref):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, L, E = 2, 2, 7, 8
    q, k, v = rand(B, H, L, E, seed=7), rand(B, H, L, E, seed=8), rand(B, H, L, E, seed=9)
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 2]])
    mod = document_mask(docs)
    allowed = torch.stack([torch.tensor([[bool(d[i] == d[j]) for j in range(L)] for i in range(L)]) for d in docs])
    allowed = allowed[:, None] & causal_mask(L)  # (B, 1, L, L)
    want, _ = ref.loop_attention_nd(q, k, v, allowed)
    got = scaled_dot_product_attention(q, k, v, is_causal=True, mask_mod=mod, backend=backend)
    torch.testing.assert_close(got, want)
    block = create_block_mask(lambda b, h, qi, ki: mod(b, h, qi, ki) & (qi >= ki), B, H, L, L, device="cpu")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*without torch.compile.*")  # unfused on the CPU: fine here
        flex = flex_attention(q, k, v, block_mask=block)
    torch.testing.assert_close(got, flex)


@pytest.mark.parametrize("backend", ["reference", "fused", "flex", "auto"])
def test_additive_score_mod_equals_an_explicit_bias(backend, ref):
    B, H, L, S, E = 1, 3, 4, 6, 8
    q, k, v = rand(B, H, L, E, seed=10), rand(B, H, S, E, seed=11), rand(B, H, S, E, seed=12)
    table = rand(H, 5, seed=13)
    mod = per_head_relative_bias(table, S - L)
    bias = torch.tensor(
        [[[float(table[h, min(max(i + S - L - j, 0), 4)]) for j in range(S)] for i in range(L)] for h in range(H)]
    )
    want, _ = ref.loop_attention_nd(q, k, v, window_allowed(L, S, None), bias.expand(B, H, L, S))
    torch.testing.assert_close(
        scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=mod, backend=backend), want
    )


def test_a_mod_that_is_the_identity_on_small_scores_is_not_taken_for_a_bias():
    # A hard cap at 40 agrees with "add nothing" at every fixed probe; the scores here reach 340.
    q, k, v = rand(1, 1, 4, 8, seed=17) * 10, rand(1, 1, 4, 8, seed=18) * 10, rand(1, 1, 4, 8, seed=19)
    scores = q @ k.transpose(-1, -2)
    assert scores.abs().max() > 100
    want = torch.softmax(scores.clamp(-40, 40), -1) @ v
    got = scaled_dot_product_attention(q, k, v, score_mod=lambda s, b, h, i, j: s.clamp(-40, 40), scale=1.0)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["reference", "flex", "auto"])
def test_soft_capping_is_not_additive_and_runs_exactly_where_it_can(backend, ref):
    q, k, v = rand(1, 2, 5, 4, seed=14) * 4, rand(1, 2, 5, 4, seed=15) * 4, rand(1, 2, 5, 4, seed=16)
    scores = 3.0 * torch.tanh((q @ k.transpose(-1, -2)) / 2.0 / 3.0)
    want = torch.softmax(scores.masked_fill(~causal_mask(5), float("-inf")), -1) @ v
    got = scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=soft_cap, backend=backend)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="not additive"):
        scaled_dot_product_attention(q, k, v, score_mod=soft_cap, backend="fused")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_soft_capping_is_found_not_additive_in_half_precision(dtype):
    # Regression: the additivity probe ran in the inputs' dtype, whose rounding hid the cap: in
    # bfloat16 and float16 the fused kernel ran without it (the same output as no cap at all).
    q, k, v = (rand(1, 2, 6, 8, seed=s) * 12 for s in (21, 22, 23))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    cap = softcap_score_mod(50.0)
    want = scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=cap, backend="reference")
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=cap), want)
    assert not torch.equal(want, scaled_dot_product_attention(q, k, v, is_causal=True))
    with pytest.raises(ValueError, match="not additive"):
        scaled_dot_product_attention(q, k, v, score_mod=cap, backend="fused")


def test_an_additive_score_mod_holding_bfloat16_is_found_additive():
    # Its scores are bfloat16 (the slopes are): within bfloat16's rounding of additive, it runs as a bias
    # on the fused kernel (a float32 tolerance once refused it there, and sent auto to the slow path).
    q, k, v = (rand(1, 4, 6, 8, seed=s).to(torch.bfloat16) for s in (27, 28, 29))
    mod = alibi_score_mod(alibi_slopes(4).to(torch.bfloat16))
    want = scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=mod, backend="reference")
    got = scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=mod, backend="fused")
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kw", [dict(backend="reference"), dict(return_weights=True), {}])
def test_a_score_mod_giving_nan_is_an_error_on_every_path(kw):
    q, k, v = rand(1, 2, 4, 8, seed=24), rand(1, 2, 4, 8, seed=25), rand(1, 2, 4, 8, seed=26)
    with pytest.raises(ValueError, match="score_mod returned NaN"):
        scaled_dot_product_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * float("nan"), **kw)


@FAST
@given(
    L=st.integers(1, 9),
    S=st.integers(1, 9),
    window=st.one_of(st.none(), st.integers(1, 9)),
    seed=st.integers(0, 2**16),
    gqa=st.booleans(),
)
@pytest.mark.slow
def test_every_backend_agrees_on_mods_windows_and_masks(L, S, window, seed, gqa):
    """reference (exact mods), fused (mods as masks), flex (torch's flex_attention): same numbers,
    fully masked rows included."""
    H, Hkv = 4, 2 if gqa else 4
    q, k, v = rand(2, H, L, 8, seed=seed), rand(2, Hkv, S, 8, seed=seed + 1), rand(2, Hkv, S, 8, seed=seed + 2)
    pad = rand(2, 1, 1, S, seed=seed + 3) > -0.5  # bool attn_mask (some keys padded)
    kw = dict(
        attn_mask=pad,
        is_causal=True,
        window=window,
        enable_gqa=gqa,
        mask_mod=lambda b, h, qi, ki: (ki + h) % 5 != 0,
        score_mod=alibi_score_mod(alibi_slopes(H).double(), S - L),
    )
    outs = [scaled_dot_product_attention(q, k, v, backend=b, **kw) for b in ("reference", "fused", "flex")]
    torch.testing.assert_close(outs[1], outs[0])
    torch.testing.assert_close(outs[2], outs[0])


def test_mods_gradients_match_on_reference_and_fused():
    q, k, v = (rand(1, 2, 6, 4, seed=20 + i, requires_grad=True) for i in range(3))
    kw = dict(
        is_causal=True, score_mod=alibi_score_mod(alibi_slopes(2).double()), mask_mod=lambda b, h, qi, ki: ki != 1
    )
    grads = []
    for backend in ("reference", "fused"):
        out = scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


# =============================================================================================
# Bad options
# =============================================================================================
Q = rand(1, 2, 3, 4)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(is_causal=True, window=0), ValueError, "window must be a positive int"),
        (dict(is_causal=True, window=-2), ValueError, "window must be a positive int"),
        (dict(is_causal=True, window=2.0), ValueError, "window must be a positive int"),
        (dict(is_causal=True, window=True), ValueError, "window must be a positive int"),
        (dict(window=2), ValueError, "is_causal=True"),
        (dict(is_causal=True, sinks=1), ValueError, "set window"),
        (dict(is_causal=True, window=2, sinks=-1), ValueError, "sinks must be a non-negative int"),
        (dict(score_mod="alibi"), TypeError, "score_mod must be a function"),
        (dict(mask_mod=3), TypeError, "mask_mod must be a function"),
        (dict(mask_mod=lambda b, h, q, k: q >= k, backend="flex", dropout_p=0.1), ValueError, "no dropout"),
        (dict(backend="flexible"), ValueError, "backend must be one of"),
        (dict(return_weights=True, backend="flex"), ValueError, "reference backend"),
        (dict(mask_mod=lambda b, h, q, k: (q >= k).float()), TypeError, "bool tensor"),
        (dict(score_mod=lambda s, b, h, q, k: s * float("nan"), backend="fused"), ValueError, "NaN"),
    ],
)
def test_bad_options_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        scaled_dot_product_attention(Q, Q, Q, **kwargs)


def test_mods_need_four_dimensional_inputs_and_flex_on_cpu_no_gradients():
    x = rand(3, 4)
    with pytest.raises(ValueError, match=r"\(B, H, L, E\)"):
        scaled_dot_product_attention(x, x, x, mask_mod=lambda b, h, q, k: q >= k)
    qg = rand(1, 1, 3, 4, requires_grad=True)
    with pytest.raises(ValueError, match="no backward"):
        scaled_dot_product_attention(qg, qg, qg, backend="flex")
    with torch.no_grad():
        scaled_dot_product_attention(qg, qg, qg, backend="flex")
    with pytest.raises(ValueError, match="window must be a positive int"):
        causal_mask(3, window=0)


# =============================================================================================
# CUDA: the compiled flex_attention path (backend="auto" sends mods and windows there)
# =============================================================================================
@pytest.mark.cuda
@pytest.mark.parametrize(
    "kw",
    [
        dict(is_causal=True, window=64, sinks=4),
        dict(is_causal=True, mask_mod=lambda b, h, qi, ki: (qi // 32) == (ki // 32)),
        dict(is_causal=True, score_mod=lambda s, b, h, qi, ki: 10.0 * torch.tanh(s / 10.0)),
        dict(is_causal=True, window=48, score_mod="alibi"),
    ],
)
def test_flex_on_cuda_equals_the_reference_forward_and_backward(kw):
    """On a GPU, auto hands these to torch.compile(flex_attention); the reference path on the same
    inputs (float64 on the CPU) must agree, gradients included."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4 if i == 0 else 2, 200, 64, generator=g) for i in range(3))
    dev = [t.cuda().requires_grad_(True) for t in (q, k, v)]
    ref = [t.double().requires_grad_(True) for t in (q, k, v)]
    kw, cpu_kw = dict(kw), dict(kw)
    if kw.get("score_mod") == "alibi":  # the slopes live where the scores are
        kw["score_mod"] = alibi_score_mod(alibi_slopes(4).cuda())
        cpu_kw["score_mod"] = alibi_score_mod(alibi_slopes(4).double())
    got = scaled_dot_product_attention(*dev, enable_gqa=True, **kw)
    want = scaled_dot_product_attention(*ref, enable_gqa=True, backend="reference", **cpu_kw)
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-3, rtol=2e-3)
    dy = torch.randn(want.shape, generator=g)
    grads = torch.autograd.grad(got, dev, dy.cuda())
    want_grads = torch.autograd.grad(want, ref, dy.double())
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a.double().cpu(), b, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("cap", [float("nan"), 0.0, -5.0, float("inf"), "50"])
def test_a_softcap_that_is_not_a_positive_number_is_named(cap):
    # (NaN gave all-NaN weights that skipped the finite check, 0 uniform weights, "50" a str division)
    with pytest.raises(ValueError, match="cap must be a positive finite number"):
        softcap_score_mod(cap)


def test_float16_weights_do_not_overflow_where_the_scaled_scores_fit():
    # Q K^T = 102,400 overflows float16 (65,504); the scaled scores (12,800) fit, and the fused output
    # was finite while the weights of the same call were NaN.
    q = torch.full((1, 1, 2, 64), 40.0, dtype=torch.float16)
    k, v = q.clone(), torch.randn(1, 1, 2, 64).half()
    out, weights = scaled_dot_product_attention(q, k, v, return_weights=True, backend="reference")
    ref_out, ref_weights = (
        t.half() for t in scaled_dot_product_attention(q.float(), k.float(), v.float(), return_weights=True)
    )
    torch.testing.assert_close(weights, ref_weights)
    torch.testing.assert_close(out, ref_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(attention_scores(q, k), attention_scores(q.float(), k.float()).half())
