"""attnlab.attention: MultiHeadAttention and friends against torch.nn.MultiheadAttention, explicit
float64 loops and their own full-sequence results; properties; bad input."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import (
    CausalAttention,
    KVCache,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    causal_mask,
)

FAST = settings(max_examples=25, deadline=None)


def rand(*shape, seed=0, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


def mha(d_in=8, d_out=8, context_length=16, num_heads=2, seed=0, **kwargs) -> MultiHeadAttention:
    torch.manual_seed(seed)
    m = MultiHeadAttention(d_in, d_out, context_length, 0.0, num_heads, **kwargs)
    if kwargs.get("qkv_bias"):  # nn.Linear biases are small; make them matter
        for lin in (m.W_query, m.W_key, m.W_value):
            nn.init.normal_(lin.bias)
    return m


def torch_mha(m: MultiHeadAttention, bias: bool) -> nn.MultiheadAttention:
    """torch.nn.MultiheadAttention holding a copy of ``m``'s weights."""
    cross = m.kv_dim != m.d_in
    t = nn.MultiheadAttention(
        m.d_out,
        m.num_heads,
        bias=bias,
        batch_first=True,
        kdim=m.kv_dim if cross else None,
        vdim=m.kv_dim if cross else None,
    )
    with torch.no_grad():
        if cross:
            t.q_proj_weight.copy_(m.W_query.weight)
            t.k_proj_weight.copy_(m.W_key.weight)
            t.v_proj_weight.copy_(m.W_value.weight)
        else:
            t.in_proj_weight.copy_(torch.cat([m.W_query.weight, m.W_key.weight, m.W_value.weight]))
        if bias:
            t.in_proj_bias.copy_(torch.cat([m.W_query.bias, m.W_key.bias, m.W_value.bias]))
            t.out_proj.bias.copy_(m.out_proj.bias)
        t.out_proj.weight.copy_(m.out_proj.weight)
    return t.eval()


def loop_mha(ref, m: MultiHeadAttention, x, context=None, allowed=None) -> torch.Tensor:
    """MultiHeadAttention by hand in float64: projections, one explicit-loop attention per head."""
    x = x.double()
    kv_in = x if context is None else context.double()

    def lin(layer, t):
        out = t @ layer.weight.double().T
        return out if layer.bias is None else out + layer.bias.double()

    q, k, v = lin(m.W_query, x), lin(m.W_key, kv_in), lin(m.W_value, kv_in)
    b, n, _ = x.shape
    S = kv_in.shape[1]
    hd, group = m.head_dim, m.num_heads // m.num_kv_heads
    out = torch.zeros(b, n, m.d_out, dtype=torch.float64)
    for bi in range(b):
        for h in range(m.num_heads):
            kh = h // group  # grouped-query: query head h reads key/value head h // group
            mask = None if allowed is None else allowed.expand(b, m.num_heads, n, S)[bi, h]
            o, _ = ref.loop_attention(
                q[bi, :, h * hd : (h + 1) * hd],
                k[bi, :, kh * hd : (kh + 1) * hd],
                v[bi, :, kh * hd : (kh + 1) * hd],
                allowed=mask,
            )
            out[bi, :, h * hd : (h + 1) * hd] = o
    return lin(m.out_proj, out)


# =============================================================================================
# References
# =============================================================================================
@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("mode", ["causal", "padding", "causal+padding", "bidirectional"])
def test_vs_torch_multihead_attention(qkv_bias, mode):
    m = mha(d_in=12, d_out=12, num_heads=3, qkv_bias=qkv_bias, out_bias=qkv_bias, causal="causal" in mode)
    t = torch_mha(m, bias=qkv_bias)
    x = rand(3, 6, 12, seed=1)
    lengths = torch.tensor([6, 4, 2])
    key_mask = torch.arange(6)[None, :] < lengths[:, None]  # (3, 6) True = real token
    kw_ours, kw_torch = {}, {}
    if "causal" in mode:
        kw_torch["attn_mask"] = ~causal_mask(6)  # torch: True = may NOT attend
    if "padding" in mode:
        kw_ours["key_mask"] = key_mask
        kw_torch["key_padding_mask"] = ~key_mask  # torch: True = ignore (the opposite polarity)
    out, w = m(x, return_weights=True, **kw_ours)
    expected, expected_w = t(x, x, x, need_weights=True, average_attn_weights=False, **kw_torch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, expected_w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(m(x, **kw_ours), out, atol=1e-6, rtol=1e-5)  # fused path too


@pytest.mark.parametrize("bias", [False, True])
def test_cross_attention_vs_torch_multihead_attention(bias):
    # causal=True is ignored in cross-attention: the context is never causally masked
    m = mha(d_in=8, d_out=8, num_heads=2, kv_dim=5, causal=True, qkv_bias=bias, out_bias=bias)
    t = torch_mha(m, bias=bias)
    x, ctx = rand(2, 3, 8, seed=1), rand(2, 7, 5, seed=2)
    key_mask = torch.ones(2, 7, dtype=torch.bool)
    key_mask[1, 4:] = False
    expected, expected_w = t(x, ctx, ctx, key_padding_mask=~key_mask, average_attn_weights=False)
    out, w = m(x, ctx, key_mask=key_mask, return_weights=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, expected_w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(m(x, ctx, key_mask=key_mask), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["causal", "bidirectional", "gqa", "cross", "mask"])
def test_vs_float64_loops(ref, kind):
    kwargs = {"causal": kind != "bidirectional"}
    if kind == "gqa":
        kwargs["num_kv_heads"] = 2
    if kind == "cross":
        kwargs["kv_dim"] = 3
    m = mha(d_in=6, d_out=12, num_heads=4, qkv_bias=True, **kwargs)
    x = rand(2, 5, 6, seed=1)
    context = rand(2, 7, 3, seed=2) if kind == "cross" else None
    attn_mask, allowed = None, None
    if kind in ("causal", "gqa", "mask"):
        allowed = causal_mask(5)
    if kind == "mask":
        attn_mask = rand(2, 4, 5, 5, seed=3) > -0.5
        allowed = allowed & attn_mask
    expected = loop_mha(ref, m, x, context, allowed)
    torch.testing.assert_close(m(x, context, attn_mask=attn_mask).double(), expected, atol=1e-5, rtol=1e-5)


def test_single_head_modules_vs_float64_loops(ref):
    x = rand(2, 5, 3, seed=1)
    torch.manual_seed(0)
    v1 = SelfAttention_v1(3, 4)
    for b in range(2):
        expected, _ = ref.loop_attention(x[b] @ v1.W_query, x[b] @ v1.W_key, x[b] @ v1.W_value)
        torch.testing.assert_close(v1(x)[b].double(), expected, atol=1e-6, rtol=1e-5)
    v2, ca = SelfAttention_v2(3, 4, qkv_bias=True), CausalAttention(3, 4, 5, qkv_bias=True)
    for module, allowed in ((v2, None), (ca, causal_mask(5))):
        for b in range(2):
            q, k, v = module.W_query(x[b]), module.W_key(x[b]), module.W_value(x[b])
            expected, _ = ref.loop_attention(q, k, v, allowed=allowed)
            torch.testing.assert_close(module(x)[b].double(), expected, atol=1e-6, rtol=1e-5)


def test_wrapper_equals_its_heads_one_by_one():
    torch.manual_seed(0)
    w = MultiHeadAttentionWrapper(4, 3, 6, 0.0, num_heads=3, qkv_bias=True)
    x = rand(2, 6, 4, seed=1)
    expected = torch.cat([head(x) for head in w.heads], dim=-1)
    out, weights = w(x, return_weights=True)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w(x), expected, atol=1e-6, rtol=1e-5)
    assert weights.shape == (2, 3, 6, 6)
    for h, head in enumerate(w.heads):
        torch.testing.assert_close(weights[:, h], head(x, return_weights=True)[1])


def test_gradcheck_multi_head_attention_float64():
    m = mha(d_in=4, d_out=4, num_heads=2, qkv_bias=True, num_kv_heads=1).double()
    x = rand(1, 3, 4, seed=1, dtype=torch.float64, requires_grad=True)
    key_mask = torch.tensor([[False, True, True]])  # query 0 sees nothing (causal): a masked row
    torch.autograd.gradcheck(lambda x: m(x, key_mask=key_mask), (x,))
    torch.autograd.gradcheck(lambda x: m(x, key_mask=key_mask, return_weights=True)[0], (x,))
    ctx = rand(1, 2, 4, seed=2, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, c: m(x, c), (x, ctx))


def test_parameter_gradients_flow():
    m = mha(qkv_bias=True)
    m(rand(2, 5, 8, seed=1)).square().sum().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


# =============================================================================================
# Properties
# =============================================================================================
@FAST
@given(n=st.integers(2, 7), seed=st.integers(0, 2**16), causal=st.booleans())
def test_future_tokens_matter_only_without_causality(n, seed, causal):
    m = mha(causal=causal, seed=seed % 7)
    x = rand(1, n, 8, seed=seed)
    i = seed % (n - 1)
    x2 = x.clone()
    x2[:, i + 1 :] = rand(1, n - i - 1, 8, seed=seed + 1)
    out, out2 = m(x), m(x2)
    if causal:
        torch.testing.assert_close(out[:, : i + 1], out2[:, : i + 1])
    else:  # bidirectional: every position sees the changed tokens
        assert not torch.allclose(out[:, : i + 1], out2[:, : i + 1], atol=1e-6)
    _, w = m(x, return_weights=True)
    upper = ~causal_mask(n)
    assert bool((w[..., upper] == 0).all()) == causal


@FAST
@given(n=st.integers(2, 7), seed=st.integers(0, 2**16))
def test_bidirectional_permutation_equivariance(n, seed):
    m = mha(causal=False, seed=seed % 5, num_kv_heads=1)
    x = rand(2, n, 8, seed=seed)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(m(x[:, perm]), m(x)[:, perm], atol=1e-6, rtol=1e-5)


@FAST
@given(b=st.integers(2, 3), n=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_batch_items_independent(b, n, seed):
    m = mha(seed=seed % 5)
    x = rand(b, n, 8, seed=seed)
    key_mask = rand(b, n, seed=seed + 1) > -0.5
    out = m(x, key_mask=key_mask)
    for i in range(b):
        torch.testing.assert_close(out[i], m(x[i], key_mask=key_mask[i]), atol=1e-6, rtol=1e-5)


@FAST
@given(
    n=st.integers(1, 10),
    cuts=st.lists(st.integers(1, 9), max_size=5),
    num_kv_heads=st.sampled_from([1, 2, 4]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
@torch.no_grad()  # a KV cache is for inference
def test_kv_cache_chunks_equal_full_sequence(n, cuts, num_kv_heads, causal, seed):
    m = mha(d_in=8, d_out=8, num_heads=4, num_kv_heads=num_kv_heads, causal=causal, seed=seed % 5, qkv_bias=True)
    x = rand(2, n, 8, seed=seed)
    bounds = sorted({0, n, *(c for c in cuts if c < n)})
    cache = m.new_kv_cache(batch_size=2, max_length=12)
    chunks = [m(x[:, a:b], kv_cache=cache) for a, b in itertools.pairwise(bounds)]
    assert cache.length == n
    if causal:
        expected = m(x)
        torch.testing.assert_close(torch.cat(chunks, dim=1), expected, atol=1e-5, rtol=1e-5)
    else:
        # a bidirectional chunk sees the cached past and itself: the last chunk sees everything
        last = bounds[-2]
        torch.testing.assert_close(chunks[-1], m(x)[:, last:], atol=1e-5, rtol=1e-5)
    cache.reset()
    assert cache.length == 0
    torch.testing.assert_close(m(x, kv_cache=cache), m(x), atol=1e-5, rtol=1e-5)  # one chunk: the full result


@torch.no_grad()  # a KV cache is for inference
def test_kv_cache_one_token_at_a_time_with_key_mask():
    m = mha(num_heads=2)
    x = rand(2, 6, 8, seed=1)
    key_mask = torch.ones(2, 6, dtype=torch.bool)
    key_mask[1, :2] = False  # left padding of item 1
    cache = m.new_kv_cache(2)
    steps = [m(x[:, t : t + 1], kv_cache=cache, key_mask=key_mask[:, : t + 1]) for t in range(6)]
    expected = m(x, key_mask=key_mask)
    torch.testing.assert_close(torch.cat(steps, 1), expected, atol=1e-5, rtol=1e-5)
    # a padded query with no key gets zeros before out_proj: exactly out_proj's bias
    torch.testing.assert_close(expected[1, :2], m.out_proj.bias.expand(2, 8))


@FAST
@given(n=st.integers(1, 5), S=st.integers(1, 6), kv_dim=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_cross_attention_vs_manual(n, S, kv_dim, seed):
    m = mha(d_in=4, d_out=6, num_heads=3, kv_dim=kv_dim, seed=seed % 5)
    x, ctx = rand(2, n, 4, seed=seed), rand(2, S, kv_dim, seed=seed + 1)
    q = m.W_query(x).view(2, n, 3, 2).transpose(1, 2)  # (b, H, n, hd)
    k = m.W_key(ctx).view(2, S, 3, 2).transpose(1, 2)  # (b, H, S, hd)
    v = m.W_value(ctx).view(2, S, 3, 2).transpose(1, 2)  # (b, H, S, hd)
    w = torch.softmax(q @ k.transpose(-2, -1) / 2**0.5, dim=-1)  # no causal mask in cross-attention
    expected = m.out_proj((w @ v).transpose(1, 2).reshape(2, n, 6))
    out, weights = m(x, ctx, return_weights=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, w, atol=1e-6, rtol=1e-5)


@FAST
@given(
    b=st.integers(1, 3),
    n=st.integers(1, 6),
    num_kv_heads=st.sampled_from([1, 2]),
    past=st.integers(0, 4),
    unbatched=st.booleans(),
)
@torch.no_grad()  # a KV cache is for inference
def test_return_weights_shapes(b, n, num_kv_heads, past, unbatched):
    m = mha(num_heads=2, num_kv_heads=num_kv_heads)
    cache = m.new_kv_cache(1 if unbatched else b)
    if past:
        m(rand(1 if unbatched else b, past, 8), kv_cache=cache)
    x = rand(n, 8) if unbatched else rand(b, n, 8)
    out, w = m(x, kv_cache=cache, return_weights=True)
    assert out.shape == (*x.shape[:-1], 8)
    assert w.shape == ((2, n, past + n) if unbatched else (b, 2, n, past + n))
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))  # causal: every row sees a key


@FAST
@given(b=st.integers(1, 3), n=st.integers(1, 6), seed=st.integers(0, 2**16), causal=st.booleans())
def test_key_mask_equals_the_equivalent_attn_mask(b, n, seed, causal):
    m = mha(causal=causal, seed=seed % 3)
    x = rand(b, n, 8, seed=seed)
    key_mask = rand(b, n, seed=seed + 1) > 0
    extra = rand(b, 2, n, n, seed=seed + 2) > -1  # combined with another bool mask
    as_attn = key_mask[:, None, None, :]
    out_k, w_k = m(x, key_mask=key_mask, return_weights=True)
    out_a, w_a = m(x, attn_mask=as_attn, return_weights=True)
    torch.testing.assert_close(out_k, out_a)
    torch.testing.assert_close(w_k, w_a)
    torch.testing.assert_close(m(x, key_mask=key_mask), out_a, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(m(x, attn_mask=extra, key_mask=key_mask), m(x, attn_mask=extra & as_attn))
    # a float attn_mask with -inf at the padded keys is the same thing
    float_mask = torch.zeros(b, 1, 1, n).masked_fill(~as_attn, float("-inf"))
    torch.testing.assert_close(m(x, attn_mask=float_mask), out_a, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(m(x, attn_mask=torch.zeros(n, n), key_mask=key_mask), out_a, atol=1e-6, rtol=1e-5)


def test_unbatched_input_takes_the_same_masks():
    m = mha(num_heads=2)
    x = rand(5, 8, seed=1)
    mask = rand(2, 5, 5, seed=2) > 0  # (H, n, S)
    key_mask = torch.tensor([True, True, False, True, True])
    expected, w = m(x[None], attn_mask=mask, key_mask=key_mask[None], return_weights=True)
    for attn_mask in (mask, mask[None]):
        out, w1 = m(x, attn_mask=attn_mask, key_mask=key_mask, return_weights=True)
        torch.testing.assert_close(out, expected[0])
        torch.testing.assert_close(w1, w[0])


def test_fully_masked_rows_finite_gradients():
    m = mha(qkv_bias=True)
    x = rand(2, 4, 8, seed=1, requires_grad=True)
    key_mask = torch.tensor([[True] * 4, [False] * 4])  # item 1 has no key at all
    for return_weights in (False, True):
        out = m(x, key_mask=key_mask, return_weights=return_weights)
        out = out[0] if return_weights else out
        torch.testing.assert_close(out[1], m.out_proj.bias.expand(4, 8))
        x.grad = None
        out.square().sum().backward()
        assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all()
        for p in m.parameters():
            assert torch.isfinite(p.grad).all()


# =============================================================================================
# Dtypes and devices
# =============================================================================================
def test_autocast_bfloat16():
    m = mha(qkv_bias=True)
    x = rand(2, 5, 8, seed=1)
    expected = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x)
        cache = m.new_kv_cache(2)  # float32 buffers, bf16 projections
        with torch.no_grad():  # a KV cache is for inference
            stepped = torch.cat([m(x[:, :3], kv_cache=cache), m(x[:, 3:], kv_cache=cache)], 1)
        masked = m(x, attn_mask=torch.zeros(5, 5))  # float32 mask
        ctx_m = mha(kv_dim=3)
        cross = ctx_m(x, rand(2, 4, 3))
    assert out.dtype == stepped.dtype == masked.dtype == cross.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(stepped.float(), expected, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(masked.float(), expected, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_module_follows_its_dtype(dtype):
    m = mha().to(dtype)
    x = rand(2, 5, 8).to(dtype)
    out, w = m(x, return_weights=True)
    assert out.dtype == w.dtype == dtype
    assert m.new_kv_cache(2).keys.dtype == dtype


def test_meta_device_construction_and_shapes():
    with torch.device("meta"):
        m = MultiHeadAttention(d_in=768, d_out=768, context_length=1024, num_heads=12, num_kv_heads=4)
        ca = CausalAttention(768, 64, 1024)
    assert m.W_query.weight.device.type == "meta" and ca.W_key.weight.is_meta
    x = torch.empty(2, 1024, 768, device="meta")
    assert m(x).shape == (2, 1024, 768) and m(x).is_meta
    assert ca(x).shape == (2, 1024, 64)
    assert m.new_kv_cache(2).keys.is_meta
    m2 = m.to_empty(device="cpu")
    assert m2.W_query.weight.device.type == "cpu"


@torch.no_grad()  # a KV cache is for inference
def test_kv_cache_buffers_and_api():
    m = mha(num_heads=4, num_kv_heads=2)
    cache = m.new_kv_cache(3, max_length=5)
    assert isinstance(cache, KVCache)
    assert cache.keys.shape == cache.values.shape == (3, 2, 5, 2)
    assert cache.max_length == 5 and cache.length == 0
    m(rand(3, 2, 8), kv_cache=cache)
    assert cache.length == 2
    k, v = cache.append(torch.ones(3, 2, 1, 2), torch.zeros(3, 2, 1, 2))
    assert k.shape == v.shape == (3, 2, 3, 2) and cache.length == 3
    assert (k[:, :, 2] == 1).all() and (v[:, :, 2] == 0).all()


def test_state_dict_is_weights_only():
    for module in (mha(qkv_bias=True), CausalAttention(3, 2, 6), MultiHeadAttentionWrapper(3, 2, 6, num_heads=2)):
        assert set(module.state_dict()) == {name for name, _ in module.named_parameters()}
        assert not list(module.buffers())


def test_defaults_dropout_zero_and_keyword_form():
    assert CausalAttention(3, 2, 6).dropout.p == 0.0
    assert MultiHeadAttention(4, 4, 6, num_heads=2).dropout.p == 0.0
    assert MultiHeadAttentionWrapper(3, 2, 6, num_heads=2).num_heads == 2
    m = MultiHeadAttention(d_in=4, d_out=6, num_heads=3, context_length=5, dropout=0.1)
    assert (m.num_heads, m.context_length, m.dropout.p) == (3, 5, 0.1)
    assert "num_heads=3" in repr(m)


def test_dropout_in_training_only():
    m = MultiHeadAttention(8, 8, 16, 0.5, 2)
    x = rand(2, 6, 8, seed=1)
    m.eval()
    torch.testing.assert_close(m(x), m(x))
    _, w_eval = m(x, return_weights=True)
    m.train()
    torch.manual_seed(0)
    _, w_train = m(x, return_weights=True)
    torch.manual_seed(0)
    torch.testing.assert_close(w_train, nn.Dropout(0.5)(w_eval))
    assert not torch.allclose(m(x), m(x))


@pytest.mark.parametrize("cls", [MultiHeadAttentionWrapper, CausalAttention])
def test_tutorial_modules_dropout_like_nn_dropout(cls):
    torch.manual_seed(0)
    m = cls(4, 3, 6, 0.5, num_heads=2) if cls is MultiHeadAttentionWrapper else cls(4, 3, 6, 0.5)
    x = rand(2, 6, 4, seed=1)
    _, w_eval = m.eval()(x, return_weights=True)
    torch.testing.assert_close(m(x), m(x))
    m.train()
    torch.manual_seed(1)
    _, w_train = m(x, return_weights=True)
    torch.manual_seed(1)
    torch.testing.assert_close(w_train, nn.Dropout(0.5)(w_eval))
    torch.manual_seed(2)
    fused = m(x)  # the fused kernel draws its own mask, but it does drop
    assert not torch.allclose(fused, m.eval()(x))


# =============================================================================================
# Bad input
# =============================================================================================
@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda: MultiHeadAttention(8, 9, 16, 0.0, 2), ValueError, r"d_out must be divisible by num_heads.*d_out=9"),
        (lambda: MultiHeadAttention(8, 8, 16, 0.0, 4, num_kv_heads=3), ValueError, "num_kv_heads=3"),
        (lambda: MultiHeadAttention(8, 8, 16, 1.0, 2), ValueError, r"dropout must be a float in \[0, 1\)"),
        (lambda: MultiHeadAttention(8, 8, 16, -0.1, 2), ValueError, "dropout"),
        (lambda: MultiHeadAttention(8, 8, 16, 0.0), TypeError, "missing required argument 'num_heads'"),
        (lambda: MultiHeadAttention(8, 8, 16, 0.0, 0), ValueError, "num_heads must be a positive int"),
        (lambda: MultiHeadAttention(0, 8, 16, 0.0, 2), ValueError, "d_in must be a positive int"),
        (lambda: MultiHeadAttention(8, 8, 0, 0.0, 2), ValueError, "context_length"),
        (lambda: MultiHeadAttention(8, 8, 16, 0.0, 2, kv_dim=0), ValueError, "kv_dim"),
        (lambda: CausalAttention(3, 2, 6, 1.5), ValueError, "dropout"),
        (lambda: CausalAttention(3, 2.0, 6), ValueError, "d_out"),
        (lambda: MultiHeadAttentionWrapper(3, 2, 6, 0.0), TypeError, "num_heads"),
        (lambda: MultiHeadAttentionWrapper(3, 2, 6, 7, 2), ValueError, "dropout.*keyword"),
        (lambda: SelfAttention_v1(3, -1), ValueError, "d_out"),
        (lambda: KVCache(0, 4, 1, 2), ValueError, "batch_size"),
        (lambda: MultiHeadAttention(8, 8, 16, 0.0, 2, causal="no"), TypeError, "causal must be a bool, got 'no'"),
    ],
)
def test_bad_construction_names_the_argument(build, error, match):
    with pytest.raises(error, match=match):
        build()


M = MultiHeadAttention(8, 8, 6, 0.0, 2)
MX = MultiHeadAttention(8, 8, 6, 0.0, 2, kv_dim=3)
X = rand(2, 4, 8)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: M(rand(8)), ValueError, "x must have at least 2 dimensions"),
        (lambda: M(rand(1, 2, 4, 8)), ValueError, r"x must have shape \(n, d_in\) or \(b, n, d_in\)"),
        (lambda: M(rand(2, 4, 7)), ValueError, "x must have last dimension d_in=8"),
        (lambda: M(torch.ones(2, 4, 8, dtype=torch.long)), TypeError, "x must be a floating-point"),
        (lambda: M(X.double()), TypeError, "x has dtype torch.float64"),
        (lambda: M(rand(2, 7, 8)), ValueError, "7 tokens, more than context_length=6"),
        (lambda: M(X, attn_mask=torch.ones(3, 3, dtype=torch.bool)), ValueError, r"attn_mask of shape \(3, 3\)"),
        (lambda: M(X, attn_mask=torch.ones(4, 4, dtype=torch.long)), TypeError, "attn_mask must be a bool"),
        (lambda: M(X, attn_mask=torch.zeros(4, 4, dtype=torch.float64)), TypeError, "attn_mask"),
        (lambda: M(X, attn_mask=torch.ones(3, 2, 4, 4, dtype=torch.bool)), ValueError, "attn_mask"),
        (lambda: M(X, key_mask=torch.ones(2, 4)), TypeError, "key_mask must be a bool"),
        (lambda: M(X, key_mask=torch.ones(2, 5, dtype=torch.bool)), ValueError, r"key_mask must have shape.*\(2, 4\)"),
        (
            lambda: M(X, attn_mask=torch.ones(3, 3, dtype=torch.bool), key_mask=torch.ones(2, 4, dtype=torch.bool)),
            ValueError,
            "attn_mask of shape",
        ),
        (lambda: M(X, kv_cache="cache"), TypeError, "kv_cache must be"),
        (lambda: M(X, kv_cache=M.new_kv_cache(3)), ValueError, "kv_cache holds"),
        (lambda: MX(X), ValueError, "kv_dim=3"),
        (lambda: MX(X, rand(2, 5, 4)), ValueError, "context must have last dimension d_in=3"),
        (lambda: MX(X, rand(3, 5, 3)), ValueError, "context has batch size 3"),
        (lambda: MX(X, rand(2, 5, 3).double()), TypeError, "context has dtype"),
        (lambda: MX(X, rand(2, 5, 3), kv_cache=MX.new_kv_cache(2)), ValueError, "kv_cache is for self-attention"),
        (lambda: CausalAttention(8, 2, 3)(X), ValueError, "more than context_length=3"),
        (lambda: MultiHeadAttentionWrapper(8, 2, 3, num_heads=2)(X), ValueError, "context_length=3"),
        (lambda: SelfAttention_v2(8, 2)(X.long()), TypeError, "x must be a floating-point"),
        (lambda: SelfAttention_v1(8, 2)(rand(2, 4, 5)), ValueError, "d_in=8"),
    ],
)
def test_bad_forward_input_names_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


@torch.no_grad()  # a KV cache is for inference
def test_kv_cache_overflow():
    m = mha(context_length=8)
    cache = m.new_kv_cache(2, max_length=5)
    m(rand(2, 3, 8), kv_cache=cache)
    with pytest.raises(ValueError, match=r"kv_cache is full: it holds 3 of max_length=5 tokens and 3 more"):
        m(rand(2, 3, 8), kv_cache=cache)
    assert cache.length == 3  # the failed call left the cache as it was
    m(rand(2, 2, 8), kv_cache=cache)
    with pytest.raises(ValueError, match="kv_cache is full"):
        m(rand(2, 1, 8), kv_cache=cache)
    with pytest.raises(ValueError, match="kv_cache"):
        cache.append(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))


@torch.no_grad()
@pytest.mark.parametrize(
    ("masks", "error", "match"),
    [
        ({"key_mask": torch.ones(2, 2, dtype=torch.bool)}, ValueError, r"key_mask must have shape.*\(2, 5\)"),
        ({"key_mask": torch.ones(2, 5)}, TypeError, "key_mask must be a bool"),
        ({"attn_mask": torch.ones(2, 2, dtype=torch.bool)}, ValueError, r"attn_mask of shape \(2, 2\)"),
        ({"attn_mask": torch.zeros(2, 5, dtype=torch.float64)}, TypeError, "float attn_mask must have"),
        ({"attn_mask": torch.ones(2, 5, dtype=torch.bool, device="meta")}, ValueError, "attn_mask is on meta"),
    ],
)
def test_bad_mask_leaves_the_kv_cache_untouched(masks, error, match):
    # Regression: the cache used to advance (and its buffers change) before the masks were checked.
    m = mha()
    cache = m.new_kv_cache(2, max_length=8)
    m(rand(2, 3, 8), kv_cache=cache)
    keys, values = cache.keys.clone(), cache.values.clone()
    with pytest.raises(error, match=match):
        m(rand(2, 2, 8, seed=1), kv_cache=cache, **masks)  # 3 cached + 2 new: S = 5
    assert cache.length == 3
    assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)
    # the right masks cover past + new keys
    m(rand(2, 2, 8, seed=1), kv_cache=cache, key_mask=torch.ones(2, 5, dtype=torch.bool))
    assert cache.length == 5


@torch.no_grad()
def test_kv_cache_of_another_dtype_or_device_is_refused_before_use():
    # Regression: a mismatched cache failed later with an error naming something else.
    m = mha()
    x = rand(2, 3, 8)
    wrong_dtype = m.new_kv_cache(2, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"kv_cache has dtype torch.float64 but the module's weights are torch.float32"):
        m(x, kv_cache=wrong_dtype)
    wrong_device = m.new_kv_cache(2, device="meta")
    with pytest.raises(ValueError, match="kv_cache is on meta but x is on cpu"):
        m(x, kv_cache=wrong_device)
    assert wrong_dtype.length == wrong_device.length == 0
    # under autocast a cache in the autocast dtype is fine (the projections come out in it)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = m.new_kv_cache(2, dtype=torch.bfloat16)
        out = m(x, kv_cache=bf16)
    assert bf16.length == 3
    torch.testing.assert_close(out.float(), m(x), atol=5e-2, rtol=5e-2)


def test_kv_cache_refuses_autograd():
    # The buffers are overwritten in place: backpropagating through them would fail or be wrong.
    m = mha()
    cache = m.new_kv_cache(2)
    with pytest.raises(RuntimeError, match=r"kv_cache is for inference only.*torch.no_grad\(\)"):
        m(rand(2, 3, 8), kv_cache=cache)
    assert cache.length == 0
    with pytest.raises(RuntimeError, match="kv_cache is for inference only"):
        cache.append(rand(2, 2, 1, 4, requires_grad=True), rand(2, 2, 1, 4))
    with torch.inference_mode():
        m(rand(2, 3, 8), kv_cache=cache)
    assert cache.length == 3
    # a module without trainable parameters and an input without grad needs no no_grad()
    m.requires_grad_(False)
    m(rand(2, 1, 8), kv_cache=cache)
    assert cache.length == 4


def test_tutorial_state_dict_with_mask_buffers_loads_through_the_public_hook():
    # The tutorials' classes register a causal `mask` buffer; attnlab's hold weights only.
    torch.manual_seed(0)
    src = mha(qkv_bias=True)
    state = {**src.state_dict(), "mask": torch.triu(torch.ones(16, 16), diagonal=1)}
    dst = mha(seed=1, qkv_bias=True)
    dst.load_state_dict(state)  # strict: the mask entry is dropped, nothing else is unexpected
    x = rand(2, 4, 8)
    torch.testing.assert_close(dst(x), src(x))
    # nested: the hook gets the module's prefix
    outer = nn.Sequential(mha(seed=2, qkv_bias=True))
    outer.load_state_dict({f"0.{k}": v for k, v in state.items()})
    torch.testing.assert_close(outer(x), src(x))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        dst.load_state_dict({**state, "other": torch.zeros(1)})


@pytest.mark.parametrize(
    ("k", "v", "error", "match"),
    [
        (torch.zeros(1, 4, 2), torch.zeros(1, 4, 2), ValueError, r"k must be a \(batch, kv_heads, tokens, head_dim\)"),
        (torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 3, 2), ValueError, "k and v must have the same shape"),
        (torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 3), ValueError, "k and v must have the same shape"),
        (torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2, dtype=torch.float64), TypeError, "v is torch.float64"),
        (torch.zeros(1, 1, 2, 2, dtype=torch.float64),) * 2 + (TypeError, "k is torch.float64"),
        (torch.zeros(2, 1, 2, 2), torch.zeros(2, 1, 2, 2), ValueError, r"holds \(batch, kv_heads, head_dim\)"),
    ],
)
def test_kv_cache_append_checks_k_and_v_and_leaves_the_cache_as_it_was(k, v, error, match):
    cache = KVCache(1, 4, 1, 2)
    cache.append(torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    before = (cache.keys.clone(), cache.values.clone(), cache.length)
    with pytest.raises(error, match=match):
        cache.append(k, v)
    assert torch.equal(cache.keys, before[0]) and torch.equal(cache.values, before[1]) and cache.length == before[2]


def test_a_float_mask_is_read_once_per_forward(monkeypatch):
    """The NaN/+inf check of a float mask costs a pass and a host sync: the module checks the
    user's mask once, not again inside the functional call."""
    import attnlab.checks as checks

    calls = []
    real = checks.can_read_values
    monkeypatch.setattr(checks, "can_read_values", lambda t: calls.append(t.shape) or real(t))
    m = MultiHeadAttention(8, 8, 6, 0.0, 2, causal=False)
    m(rand(2, 4, 8), attn_mask=torch.zeros(4, 4))
    assert len(calls) == 1
    with pytest.raises(ValueError, match="NaN"):
        m(rand(2, 4, 8), attn_mask=torch.full((4, 4), float("nan")))
