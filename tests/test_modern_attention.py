"""MultiHeadAttention since GPT-2: rope, alibi, window, sinks, qk_norm, and the rolling KV cache.

The reference is a float64 loop per head that recomputes everything from the weights at explicit
positions: projections, RMSNorm by its formula, RoPE as complex-number rotations, ALiBi's bias, and
which keys each query may see. A cache (plain or rolling, fed in any chunks) must give what this
reference gives over the whole sequence.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.attention import KVCache, MultiHeadAttention
from attnlab.functional import causal_mask
from attnlab.interpret import attention_hooks
from attnlab.positions import alibi_slopes


def rand(*shape, seed=0, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def make(seed=0, **kw) -> MultiHeadAttention:
    torch.manual_seed(seed)
    opts = dict(d_in=8, d_out=8, context_length=16, num_heads=4, qkv_bias=True)
    m = MultiHeadAttention(**{**opts, **kw}).double().eval()
    if m.qk_norm:  # gains away from 1, so that a missing gain would show
        with torch.no_grad():
            m.q_norm.weight.copy_(rand(m.head_dim, seed=seed + 7) + 1)
            m.k_norm.weight.copy_(rand(m.head_dim, seed=seed + 8) + 1)
    return m


def rotate(x: list[float], p: int, theta: float) -> list[float]:
    """RoPE of one head vector as complex numbers: feature i and i + d/2 form a + ib, turned by p theta^(-2i/d)."""
    d = len(x)
    out = [0.0] * d
    for i in range(d // 2):
        angle = p * theta ** (-2 * i / d)
        z = complex(x[i], x[i + d // 2]) * complex(math.cos(angle), math.sin(angle))
        out[i], out[i + d // 2] = z.real, z.imag
    return out


def reference(m: MultiHeadAttention, x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """One sequence ``x (T, d_in)`` at ``positions`` (-1 = padding), float64 loops; ``(T, d_out)``."""
    H, Hkv, hd = m.num_heads, m.num_kv_heads, m.head_dim
    x = x.detach().double()

    def proj(lin):
        w = lin.weight.detach().double()
        return x @ w.T + (lin.bias.detach().double() if lin.bias is not None else 0)

    q, k, v = proj(m.W_query), proj(m.W_key), proj(m.W_value)
    slopes = alibi_slopes(H).double().tolist()
    heads = []
    for h in range(H):
        g = h // (H // Hkv)

        def head(t, idx, norm):
            rows = [[float(t[i, idx * hd + e]) for e in range(hd)] for i in range(len(positions))]
            if norm is not None:
                gain = norm.weight.detach().double().tolist()
                eps = norm.eps
                rows = [
                    [a / math.sqrt(sum(b * b for b in r) / hd + eps) * gn for a, gn in zip(r, gain, strict=True)]
                    for r in rows
                ]
            return rows

        qh, kh = head(q, h, m.q_norm), head(k, g, m.k_norm)
        vh = v[:, g * hd : (g + 1) * hd]
        if m.rope:
            qh = [rotate(r, max(p, 0), m.rope_theta) for r, p in zip(qh, positions, strict=True)]
            kh = [rotate(r, max(p, 0), m.rope_theta) for r, p in zip(kh, positions, strict=True)]
        out = torch.zeros(len(positions), hd, dtype=torch.float64)
        for i, pi in enumerate(positions):
            scores = {}
            for j, pj in enumerate(positions):
                if pi < 0 or pj < 0 or pj > pi:
                    continue
                if m.window is not None and not (pi - pj < m.window or pj < m.sinks):
                    continue
                s = sum(a * b for a, b in zip(qh[i], kh[j], strict=True)) / math.sqrt(hd)
                if m.alibi:
                    s -= slopes[h] * (pi - pj)
                scores[j] = s
            if scores:
                top = max(scores.values())
                z = sum(math.exp(s - top) for s in scores.values())
                for j, s in scores.items():
                    out[i] += math.exp(s - top) / z * vh[j]
        heads.append(out)
    w = m.out_proj.weight.detach().double()
    bias = m.out_proj.bias.detach().double() if m.out_proj.bias is not None else 0
    return torch.cat(heads, dim=1) @ w.T + bias


VARIANTS = {
    "rope": dict(rope=True),
    "rope_theta": dict(rope=True, rope_theta=37.0),
    "alibi": dict(alibi=True),
    "window": dict(window=3),
    "window_sinks": dict(window=3, sinks=2),
    "rope_window_sinks_gqa": dict(rope=True, window=4, sinks=1, num_kv_heads=2),
    "alibi_window": dict(alibi=True, window=5),
    "qk_norm": dict(qk_norm=True),
    "rope_qk_norm_gqa": dict(rope=True, qk_norm=True, num_kv_heads=1),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_forward_equals_the_float64_loop_reference(name):
    m = make(1, **VARIANTS[name])
    x = rand(2, 11, 8, seed=2)
    out = m(x)
    for b in range(2):
        torch.testing.assert_close(out[b], reference(m, x[b], list(range(11))))
    unbatched = m(x[0])
    torch.testing.assert_close(unbatched, out[0])


@pytest.mark.parametrize("name", ["rope", "window_sinks", "rope_window_sinks_gqa", "alibi_window"])
def test_explicit_positions_are_used(name):
    m = make(3, **VARIANTS[name])
    x = rand(1, 6, 8, seed=4)
    positions = torch.tensor([5, 6, 7, 8, 9, 10])
    torch.testing.assert_close(m(x, positions=positions)[0], reference(m, x[0], positions.tolist()))


def test_long_windowed_sequences_take_the_band_path_and_train():
    """T >= 4 W: the band-blocked kernel; equal to the dense reference, gradients included."""
    m = make(5, rope=True, window=4, sinks=1, num_kv_heads=2, dropout=0.0)
    m.train()
    x = rand(2, 40, 8, seed=6).requires_grad_(True)  # longer than context_length=16: windows slide
    out = m(x)
    torch.testing.assert_close(out[1], reference(m, x[1].detach(), list(range(40))))
    out.square().sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    dense = make(5, rope=True, window=4, sinks=1, num_kv_heads=2)
    dense.train()
    dense.load_state_dict(m.state_dict())
    mask = causal_mask(40, window=4, sinks=1)
    dense(x, attn_mask=mask).square().sum().backward()  # the same mask applied twice: the dense path
    for a, p in zip(grads, dense.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad)


# =============================================================================================
# Caches: plain and rolling, any chunks, == the reference over the whole sequence
# =============================================================================================
def feed(m, x, cache, cuts, **kw):
    bounds = [0, *cuts, x.shape[1]]
    with torch.no_grad():
        return torch.cat([m(x[:, a:b], kv_cache=cache, **kw) for a, b in itertools.pairwise(bounds)], 1)


@settings(max_examples=20, deadline=None)
@given(
    name=st.sampled_from(list(VARIANTS)),
    T=st.integers(1, 14),
    cuts=st.lists(st.integers(1, 13), max_size=4),
    seed=st.integers(0, 2**10),
)
def test_plain_cache_in_chunks_equals_the_whole_sequence(name, T, cuts, seed):
    m = make(seed, **VARIANTS[name])
    x = rand(1, T, 8, seed=seed + 1)
    got = feed(m, x, m.new_kv_cache(1), sorted({c for c in cuts if c < T}))
    torch.testing.assert_close(got[0], reference(m, x[0], list(range(T))))


@settings(max_examples=25, deadline=None)
@given(
    variant=st.sampled_from(["window", "window_sinks", "rope_window_sinks_gqa", "alibi_window"]),
    T=st.integers(1, 30),
    chunks=st.lists(st.integers(1, 9), min_size=1, max_size=12),
    extra=st.integers(0, 3),
    seed=st.integers(0, 2**10),
)
def test_rolling_cache_equals_recomputing_the_visible_keys(variant, T, chunks, extra, seed):
    """A ring of window + sinks (+ extra) slots, fed in any chunks past its size, gives what the
    reference gives recomputing every visible key at its original position."""
    m = make(seed, **VARIANTS[variant])
    cache = m.new_kv_cache(1, max_length=m.window + m.sinks + extra, rolling=True)
    assert cache.max_length == m.window + m.sinks + extra
    cuts, at = [], 0
    for c in chunks:
        at += c
        if at < T:
            cuts.append(at)
    x = rand(1, T, 8, seed=seed + 1)
    got = feed(m, x, cache, cuts)
    torch.testing.assert_close(got[0], reference(m, x[0], list(range(T))))
    assert cache.keys.shape[2] == m.window + m.sinks + extra  # memory does not grow
    assert cache.seen == T


@pytest.mark.parametrize("cuts", [list(range(1, 20)), [3, 7, 12], [9]])
def test_rope_rolling_cache_without_window_keeps_the_latest_tokens(cuts):
    """A RoPE module (no window) with a rolling cache of C slots attends to the last C tokens (plus
    sinks): StreamingLLM; each step, or chunk, equals the reference with that window."""
    m = make(9, rope=True)
    cache = m.new_kv_cache(1, max_length=6, rolling=True, sinks=2)
    x = rand(1, 20, 8, seed=10)
    got = feed(m, x, cache, cuts)
    windowed = make(9, rope=True, window=4, sinks=2)
    windowed.load_state_dict(m.state_dict())
    torch.testing.assert_close(got[0], reference(windowed, x[0], list(range(20))))


@pytest.mark.parametrize(
    "name,rolling",
    [(n, r) for n in ("rope", "window_sinks", "rope_window_sinks_gqa", "alibi_window") for r in (False, True)]
    + [("qk_norm", False)],  # (a module without positions has no rolling cache)
)
def test_left_padded_rows_equal_rows_alone(name, rolling):
    """key_mask: padding takes no position, so each row gives what it gives alone, step by step,
    through a rolling cache too (sinks are each row's first real tokens)."""
    m = make(11, **VARIANTS[name])
    lengths, T = [9, 5, 2], 9
    x = rand(3, T, 8, seed=12)
    key_mask = torch.tensor([[j >= T - n for j in range(T)] for n in lengths])
    cap = m.window + m.sinks if m.window else T  # no window: a ring as long as the rows (none is cut)
    cache = m.new_kv_cache(3, max_length=cap, rolling=rolling) if rolling else m.new_kv_cache(3)
    with torch.no_grad():
        outs = [m(x[:, :3], kv_cache=cache, key_mask=key_mask[:, :3])]
        outs += [m(x[:, t : t + 1], kv_cache=cache, key_mask=key_mask[:, : t + 1]) for t in range(3, T)]
    got = torch.cat(outs, 1)
    for r, n in enumerate(lengths):
        alone = reference(m, x[r, T - n :], list(range(n)))
        torch.testing.assert_close(got[r, T - n :], alone)
    whole = m(x, key_mask=key_mask)  # and without a cache
    for r, n in enumerate(lengths):
        torch.testing.assert_close(whole[r, T - n :], got[r, T - n :])


def test_rolling_cache_layout_and_memory():
    cache = KVCache(1, 5, 1, 2, rolling=True, sinks=2)
    pos = lambda t: torch.tensor([[t]])
    for t in range(9):
        cache.update(torch.full((1, 1, 1, 2), float(t)), torch.zeros(1, 1, 1, 2), pos(t))
    # slots 0, 1: the sinks; slots 2..4: a ring of the latest three, token t in slot 2 + (t - 2) % 3
    assert cache.positions.tolist() == [[0, 1, 8, 6, 7]]
    assert cache.keys[0, 0, :, 0].tolist() == [0.0, 1.0, 8.0, 6.0, 7.0]
    cache.update(torch.full((1, 1, 1, 2), 9.0), torch.zeros(1, 1, 1, 2), pos(9))  # overwrites the oldest, 6
    assert cache.positions.tolist() == [[0, 1, 8, 9, 7]]
    assert (cache.length, cache.seen, cache.max_length) == (5, 10, 5)
    cache.reset()
    assert (cache.length, cache.seen) == (0, 0) and cache.positions.eq(-1).all()


# =============================================================================================
# What the hooks of the attention steps are told
# =============================================================================================
@pytest.mark.parametrize(
    "name,cache",
    [
        (n, c)
        for n in (
            "rope",
            "alibi",
            "window_sinks",
            "rope_window_sinks_gqa",
            "alibi_window",
            "rope_qk_norm_gqa",
            "qk_norm",
        )
        for c in (None, "plain", "rolling")
        if not (n == "qk_norm" and c == "rolling")
    ],
)
def test_attention_record_holds_what_the_scores_saw(name, cache):
    """At the hook points: q and k after QK-norm and rotation (``rot_q``, ``rot_k``), and the pass's
    mask with everything besides plain causality (``hook.call``) recompute the weights (``pattern``) and
    the head outputs (``z``)."""
    m = make(13, **VARIANTS[name])
    x = rand(2, 7, 8, seed=14)
    key_mask = torch.tensor([[True] * 7, [False] * 2 + [True] * 5])
    records = []
    kv = None
    if cache == "plain":
        kv = m.new_kv_cache(2)
    elif cache == "rolling":
        kv = m.new_kv_cache(2, max_length=(m.window or 4) + m.sinks, rolling=True)

    def keep(step):
        def fn(t, hook):
            if step == "v":  # (the first of them a pass reaches)
                records.append({})
            if step == "pattern":  # (its positions, as the keys, may be views of the cache: copies kept)
                records[-1]["call"] = dataclasses.replace(
                    hook.call,
                    **{
                        p: getattr(hook.call, p).clone()
                        for p in ("q_positions", "k_positions")
                        if getattr(hook.call, p) is not None
                    },
                )
            records[-1][step] = (t.transpose(1, 2) if step != "pattern" else t).clone()  # (b, H, n, ·)
            if step == "pattern" and kv is not None and not m.has_positions:  # the cached values too
                records[-1]["v"] = kv.values[:, :, : t.shape[-1]].clone()  # (hook_v has the new tokens' only)

        return fn

    with torch.no_grad(), attention_hooks([m], {s: keep(s) for s in ("rot_q", "rot_k", "v", "pattern", "z")}):
        m(x[:, :4], kv_cache=kv, key_mask=key_mask[:, :4])
        if kv is not None:
            m(x[:, 4:], kv_cache=kv, key_mask=key_mask)
    for rec in records:
        call = rec["call"]
        n, S = rec["rot_q"].shape[2], rec["rot_k"].shape[2]
        k = rec["rot_k"].repeat_interleave(m.num_heads // m.num_kv_heads, 1)
        v = rec["v"]  # (b, Hkv, S, hd)
        if m.has_positions:  # each key's value from its token, by the key's position (left padding shifts them)
            with torch.no_grad():
                v_tokens = m.W_value(x).view(2, 7, m.num_kv_heads, m.head_dim).transpose(1, 2)  # (b, Hkv, 7, hd)
            pads = (~key_mask).sum(-1, keepdim=True)  # (b, 1)
            at = torch.where(call.k_positions >= 0, call.k_positions + pads, 0)  # (b, S): the keys' tokens
            v = v_tokens.gather(2, at[:, None, :, None].expand(-1, m.num_kv_heads, -1, m.head_dim))
        v = v.repeat_interleave(m.num_heads // m.num_kv_heads, 1)
        scores = rec["rot_q"] @ k.transpose(-1, -2) * call.scale
        if call.is_causal:
            scores = scores.masked_fill(~causal_mask(n, S, window=call.window, sinks=call.sinks), float("-inf"))
        elif call.window is not None:
            raise AssertionError("a window without causality")
        mask = call.mask
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        empty = torch.isinf(scores).all(-1, keepdim=True)
        weights = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
        torch.testing.assert_close(weights, rec["pattern"])
        torch.testing.assert_close(weights @ v, rec["z"])
        if m.has_positions:
            assert call.q_positions.shape[-1] == n and call.k_positions.shape[-1] == S
    records = [SimpleNamespace(q=r["rot_q"]) for r in records]
    raw = (x[:, :4] @ m.W_query.weight.T + m.W_query.bias).view(2, 4, m.num_heads, m.head_dim).transpose(1, 2)
    if m.qk_norm:  # unit RMS times the gain
        raw = raw / raw.square().mean(-1, keepdim=True).add(m.q_norm.eps).sqrt() * m.q_norm.weight
    if m.rope:  # a rotation: norms kept, the vectors themselves turned (but at position 0)
        torch.testing.assert_close(records[0].q.norm(dim=-1), raw.norm(dim=-1))
        torch.testing.assert_close(records[0].q[:, :, [0, 2]][[0, 1], :, [0, 1]], raw[:, :, [0, 2]][[0, 1], :, [0, 1]])
        assert not torch.allclose(records[0].q[:, :, 1:], raw[:, :, 1:])
    else:
        torch.testing.assert_close(records[0].q, raw)


# =============================================================================================
# Bad options
# =============================================================================================
@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(d_out=12, num_heads=4, rope=True), ValueError, "head_dim must be even"),
        (dict(rope=True, alibi=True), ValueError, "choose one"),
        (dict(rope=1), TypeError, "rope must be a bool"),
        (dict(rope=True, rope_theta=1.0), ValueError, "rope_theta"),
        (dict(rope=True, rope_scaling={"rope_type": "ntk"}), ValueError, "rope_scaling type"),
        (dict(window=0), ValueError, "window must be a positive int"),
        (dict(window=2.5), ValueError, "window must be a positive int"),
        (dict(sinks=2), ValueError, "set window"),
        (dict(window=3, sinks=-1), ValueError, "sinks must be a non-negative int"),
        (dict(window=3, causal=False), ValueError, "causal=True"),
        (dict(qk_norm="yes"), TypeError, "qk_norm must be a bool"),
        (dict(qk_norm=True, norm_eps=0.0), ValueError, "norm_eps"),
    ],
)
def test_bad_options_are_clear_errors(kwargs, error, match):
    opts = dict(d_in=8, d_out=8, context_length=16, num_heads=4)
    with pytest.raises(error, match=match):
        MultiHeadAttention(**{**opts, **kwargs})


def test_bad_forward_arguments_and_caches():
    m = make(0, rope=True, window=3)
    plain = make(0)
    x = rand(2, 4, 8)
    with pytest.raises(ValueError, match=r"positions must have shape"):
        m(x, positions=torch.arange(3))
    with pytest.raises(TypeError, match="positions must be an integer tensor"):
        m(x, positions=torch.zeros(4))
    with pytest.raises(ValueError, match="only matter"):
        plain(x, positions=torch.arange(4))
    with pytest.raises(ValueError, match="rolling kv_cache"):
        plain(x, kv_cache=plain.new_kv_cache(2, rolling=True, max_length=8))
    with pytest.raises(ValueError, match="attn_mask cannot follow"):
        m(x, kv_cache=m.new_kv_cache(2, rolling=True), attn_mask=torch.ones(4, 4, dtype=torch.bool))
    cross = make(0, kv_dim=8, rope=True)
    with pytest.raises(ValueError, match="not cross-attention"):
        cross(x, rand(2, 3, 8))
    with pytest.raises(ValueError, match="pass rolling=True"):
        KVCache(1, 4, 1, 2, sinks=1)
    with pytest.raises(ValueError, match="less than max_length"):
        KVCache(1, 4, 1, 2, rolling=True, sinks=4)
    with pytest.raises(ValueError, match="overwrite keys a window of 3"):
        m(x, kv_cache=KVCache(2, 3, 4, 2, rolling=True, sinks=1, dtype=torch.float64))
    with pytest.raises(ValueError, match="use update"):
        KVCache(1, 4, 1, 2, rolling=True).append(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))


@pytest.mark.parametrize("qk_norm", [True, "full"])
def test_qk_norm_under_bfloat16_autocast_is_quiet_and_follows_float32(make_gpt, qk_norm):
    """Under autocast a projection's bfloat16 output meets QK-norm's float32 gain: normalized in float32
    (torch's fused kernel warned every step and took its slow path); the logits follow the float32
    model's to bfloat16's precision."""
    import warnings

    model = make_gpt(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, qk_norm=qk_norm)
    with torch.no_grad():
        for block in model.trf_blocks:
            block.att.q_norm.weight.uniform_(0.5, 1.5)  # (a gain of 1 would hide a dropped gain)
    idx = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(idx)
    want = model(idx)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=0.05 * float(want.detach().abs().max()), rtol=0)
