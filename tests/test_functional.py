"""attnlab.functional against explicit float64 loops, torch's own kernel, and its own two backends."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.attention import MultiHeadAttention
from attnlab.functional import (
    attention_scores,
    causal_mask,
    heads_matmul,
    padding_mask,
    positions_mask,
    scaled_dot_product_attention,
    simple_self_attention,
)

BACKENDS = ["reference", "fused"]
FAST = settings(max_examples=25, deadline=None)


def sdpa(*args, backend="auto", **kwargs):
    return scaled_dot_product_attention(*args, backend=backend, **kwargs)


def rand(*shape, seed=0, dtype=torch.float32, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(requires_grad)


def allowed_bottom_right(L: int, S: int) -> torch.Tensor:
    """Query i of L may see key j iff j <= i + S - L, written out element by element."""
    return torch.tensor([[j <= i + S - L for j in range(S)] for i in range(L)])


# =============================================================================================
# The tutorial's loops (float64) vs matrix form vs attnlab
# =============================================================================================
def test_simple_self_attention_vs_loops_and_matrix_form(ref):
    x = rand(6, 3, seed=1, dtype=torch.float64)
    # Explicit loops, as in the tutorial: dot products, softmax by hand, weighted sums.
    n = x.shape[0]
    scores = [[sum(float(x[i, e]) * float(x[j, e]) for e in range(3)) for j in range(n)] for i in range(n)]
    weights = [[math.exp(s) / sum(math.exp(t) for t in row) for s in row] for row in scores]
    context = [[sum(weights[i][j] * float(x[j, e]) for j in range(n)) for e in range(3)] for i in range(n)]
    loop_scores, loop_weights, loop_context = (torch.tensor(t, dtype=torch.float64) for t in (scores, weights, context))
    # Matrix form
    matrix_weights = torch.softmax(x @ x.T, dim=-1)
    torch.testing.assert_close(matrix_weights, loop_weights)
    torch.testing.assert_close(matrix_weights @ x, loop_context)
    # attnlab
    out, w = simple_self_attention(x, return_weights=True)
    torch.testing.assert_close(w, loop_weights)
    torch.testing.assert_close(out, loop_context)
    torch.testing.assert_close(attention_scores(x, x, scale=1.0), loop_scores)
    # simple attention is sdpa with q = k = v = x and scale 1 (the generic loop agrees too)
    torch.testing.assert_close(ref.loop_attention(x, x, x, scale=1.0)[0], loop_context)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "case", ["plain", "causal", "causal_L<S", "causal_L>S", "bool_mask", "float_mask", "mask+causal", "scale"]
)
def test_vs_float64_loops(ref, backend, case):
    B, H, L, S, E, Ev = 2, 2, 4, 4, 3, 5
    if case == "causal_L<S":
        L, S = 3, 6
    if case == "causal_L>S":
        L, S = 6, 3
    q, k, v = rand(B, H, L, E, seed=1), rand(B, H, S, E, seed=2), rand(B, H, S, Ev, seed=3)
    kwargs, allowed, bias, scale = {}, None, None, None
    if case.startswith("causal") or case == "mask+causal":
        kwargs["is_causal"] = True
        allowed = allowed_bottom_right(L, S)
    if case in ("bool_mask", "mask+causal"):
        m = rand(B, 1, L, S, seed=4) > -0.3  # broadcast over heads
        kwargs["attn_mask"] = m
        allowed = m if allowed is None else allowed & m
    if case == "float_mask":
        bias = rand(L, S, seed=5)
        bias[0, 1] = float("-inf")
        kwargs["attn_mask"] = bias
    if case == "scale":
        scale = kwargs["scale"] = 0.37
    expected, expected_w = ref.loop_attention_nd(q, k, v, allowed=allowed, bias=bias, scale=scale)
    out = sdpa(q, k, v, backend=backend, **kwargs)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    if backend == "reference":
        _, w = sdpa(q, k, v, return_weights=True, **kwargs)
        torch.testing.assert_close(w.double(), expected_w, atol=1e-6, rtol=1e-5)
        if allowed is not None:
            assert (w[~allowed.expand_as(w)] == 0).all()  # masked weights are exactly zero


def test_attention_scores_vs_loops():
    q, k = rand(2, 4, 3, seed=1), rand(2, 6, 3, seed=2)
    scores = attention_scores(q, k, is_causal=True)
    for b in range(2):
        for i in range(4):
            for j in range(6):
                dot = sum(float(q[b, i, e]) * float(k[b, j, e]) for e in range(3)) / math.sqrt(3)
                if j <= i + 2:
                    assert scores[b, i, j].item() == pytest.approx(dot, abs=1e-6)
                else:
                    assert scores[b, i, j].item() == float("-inf")


def test_causal_mask_is_bottom_right():
    for L, S in [(1, 1), (3, 3), (2, 5), (5, 2), (4, 7), (0, 3)]:
        assert torch.equal(causal_mask(L, S), allowed_bottom_right(L, S).reshape(L, S))
    assert torch.equal(causal_mask(4), torch.ones(4, 4).tril().bool())


def test_padding_mask():
    right = padding_mask([3, 1, 0], 4)
    left = padding_mask(torch.tensor([3, 1, 0]), 4, left=True)
    for b, n in enumerate([3, 1, 0]):
        assert right[b].tolist() == [j < n for j in range(4)]
        assert left[b].tolist() == [j >= 4 - n for j in range(4)]
    assert padding_mask([2, 3]).shape == (2, 3)
    with pytest.raises(ValueError, match="max_len"):
        padding_mask([5], 3)
    with pytest.raises(ValueError, match="lengths"):
        padding_mask([-1, 2])
    with pytest.raises(ValueError, match="lengths"):
        padding_mask([[1, 2]])
    for bad, match in [(None, "got None"), (["a"], r"got \['a'\]")]:
        with pytest.raises(ValueError, match=f"lengths must .*{match}"):
            padding_mask(bad)
    assert padding_mask([], 3).shape == (0, 3)  # no sequences (an empty list, float32 to torch)
    with pytest.raises(ValueError, match="q_len"):
        causal_mask(-1)


# =============================================================================================
# fused vs reference, and vs torch.nn.functional.scaled_dot_product_attention
# =============================================================================================
def _cases():
    """(q, k, v, kwargs) covering masks, causal L != S, GQA, float masks, empty rows."""
    q4, k4, v4 = rand(2, 4, 5, 8, seed=1), rand(2, 4, 7, 8, seed=2), rand(2, 4, 7, 6, seed=3)
    kq, kk, kv = rand(2, 4, 5, 8, seed=4), rand(2, 2, 5, 8, seed=5), rand(2, 2, 5, 8, seed=6)
    bool_mask = rand(2, 1, 5, 7, seed=7) > 0.0
    bool_mask[0, 0, 1] = False  # an empty row
    float_mask = rand(5, 7, seed=8)
    float_mask[2] = float("-inf")  # an empty row
    return {
        "plain": (q4, k4, v4, {}),
        "bool_mask_empty_rows": (q4, k4, v4, {"attn_mask": bool_mask}),
        "float_mask_empty_rows": (q4, k4, v4, {"attn_mask": float_mask}),
        "causal_L<S": (q4, k4, v4, {"is_causal": True}),
        "causal_L>S": (k4, q4, v4[:, :, :5], {"is_causal": True}),
        "causal+mask": (q4, k4, v4, {"is_causal": True, "attn_mask": bool_mask}),
        "causal+float_mask": (q4, k4, v4, {"is_causal": True, "attn_mask": float_mask}),
        "gqa": (kq, kk, kv, {"enable_gqa": True}),
        "gqa_causal_mask": (kq, kk, kv, {"enable_gqa": True, "is_causal": True, "attn_mask": bool_mask[..., :5]}),
        "3d_causal": (q4[0], k4[0], v4[0], {"is_causal": True}),
        "2d": (q4[0, 0], k4[0, 0], v4[0, 0], {"attn_mask": bool_mask[0, 0]}),
        "scale": (q4, k4, v4, {"scale": 2.5}),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_fused_matches_reference(name):
    q, k, v, kwargs = _cases()[name]
    fused = sdpa(q, k, v, backend="fused", **kwargs)
    reference = sdpa(q, k, v, backend="reference", **kwargs)
    auto = sdpa(q, k, v, **kwargs)
    assert fused.shape == reference.shape
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(auto, reference, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(fused).all()


@pytest.mark.parametrize("name", ["plain", "scale", "gqa", "3d_causal", "2d", "float_mask_finite", "bool_no_empty"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_torch_where_semantics_agree(name, backend):
    """Without empty rows, and with is_causal only for L == S, attnlab is torch's function."""
    cases = _cases()
    if name == "float_mask_finite":
        q, k, v, _ = cases["plain"]
        kwargs = {"attn_mask": rand(5, 7, seed=9)}
    elif name == "bool_no_empty":
        q, k, v, _ = cases["plain"]
        m = rand(2, 4, 5, 7, seed=10) > 0.0
        m[..., 0] = True
        kwargs = {"attn_mask": m}
    elif name == "3d_causal":
        q, k, v, kwargs = cases[name]
        k, v = k[:, :5], v[:, :5]  # L == S: torch's top-left causal equals bottom-right
    else:
        q, k, v, kwargs = cases[name]
    expected = F.scaled_dot_product_attention(q, k, v, **kwargs)
    torch.testing.assert_close(sdpa(q, k, v, backend=backend, **kwargs), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_plus_mask_is_both_masks(backend):
    q, k, v, _ = _cases()["plain"]
    m = rand(2, 4, 5, 7, seed=11) > -0.5
    m[..., 0] = True  # every row keeps a key (torch would give NaN otherwise)
    both = m & causal_mask(5, 7)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=both)
    torch.testing.assert_close(sdpa(q, k, v, attn_mask=m, is_causal=True, backend=backend), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_L_less_than_S_is_bottom_right_not_top_left(backend):
    q, k, v = rand(1, 2, 4, seed=1), rand(1, 5, 4, seed=2), rand(1, 5, 3, seed=3)
    out = sdpa(q, k, v, is_causal=True, backend=backend)
    # the last query sees every key: it equals unmasked attention for that query
    torch.testing.assert_close(out[:, -1], sdpa(q[:, -1:], k, v)[:, 0])
    # torch's top-left is_causal gives something else here
    assert not torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-3)


# =============================================================================================
# Gradients
# =============================================================================================
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mask_kind", ["bool", "float", "causal_L<S"])
def test_gradcheck_float64_with_a_fully_masked_row(backend, mask_kind):
    q = rand(2, 3, 2, seed=1, dtype=torch.float64, requires_grad=True)
    k = rand(2, 4, 2, seed=2, dtype=torch.float64, requires_grad=True)
    v = rand(2, 4, 2, seed=3, dtype=torch.float64, requires_grad=True)
    kwargs = {}
    if mask_kind == "bool":
        m = rand(2, 3, 4, seed=4) > 0.0
        m[:, 0] = True
        m[1, 1] = False  # fully masked row
        kwargs["attn_mask"] = m
    elif mask_kind == "float":
        m = rand(3, 4, seed=5, dtype=torch.float64)
        m[2] = float("-inf")  # fully masked row
        kwargs["attn_mask"] = m
    else:
        # causal (L=3 < S=4) with a key mask that hides the two keys the first query may see
        m = torch.ones(2, 1, 4, dtype=torch.bool)
        m[0, 0, :2] = False
        kwargs.update(attn_mask=m, is_causal=True)
    fn = lambda q, k, v: sdpa(q, k, v, backend=backend, **kwargs)
    assert (fn(q, k, v)[0 if mask_kind != "bool" else 1] == 0).any()  # the empty row is there
    torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_gqa_float64():
    q = rand(1, 2, 2, 2, seed=1, dtype=torch.float64, requires_grad=True)
    k = rand(1, 1, 3, 2, seed=2, dtype=torch.float64, requires_grad=True)
    v = rand(1, 1, 3, 2, seed=3, dtype=torch.float64, requires_grad=True)
    for backend in BACKENDS:
        torch.autograd.gradcheck(
            lambda q, k, v, b=backend: sdpa(q, k, v, enable_gqa=True, is_causal=True, backend=b), (q, k, v)
        )


# =============================================================================================
# Properties
# =============================================================================================
dims = st.integers(1, 5)


@FAST
@given(b=st.integers(1, 2), L=dims, S=dims, E=dims, seed=st.integers(0, 2**16), p=st.floats(0.0, 1.0))
def test_weights_rows_sum_to_one_where_a_key_is_visible(b, L, S, E, seed, p):
    q, k, v = rand(b, L, E, seed=seed), rand(b, S, E, seed=seed + 1), rand(b, S, 2, seed=seed + 2)
    mask = rand(b, L, S, seed=seed + 3) < p * 3 - 1.5  # from nothing visible to everything visible
    _, w = sdpa(q, k, v, attn_mask=mask, is_causal=bool(seed % 2), return_weights=True)
    visible = mask & causal_mask(L, S) if seed % 2 else mask
    has_key = visible.any(-1)
    sums = w.sum(-1)
    torch.testing.assert_close(sums[has_key], torch.ones_like(sums[has_key]))
    assert (w[~has_key] == 0).all()
    assert (w >= 0).all() and (w[~visible] == 0).all()


@FAST
@given(L=st.integers(2, 6), E=dims, seed=st.integers(0, 2**16), backend=st.sampled_from(BACKENDS))
def test_causal_output_at_i_ignores_later_tokens(L, E, seed, backend):
    q, k, v = rand(1, L, E, seed=seed), rand(1, L, E, seed=seed + 1), rand(1, L, 3, seed=seed + 2)
    i = seed % (L - 1)  # change every token after i
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[:, i + 1 :] += rand(*t[:, i + 1 :].shape, seed=seed + 3) * 3
    out = sdpa(q, k, v, is_causal=True, backend=backend)
    out2 = sdpa(q2, k2, v2, is_causal=True, backend=backend)
    torch.testing.assert_close(out[:, : i + 1], out2[:, : i + 1])
    assert not torch.allclose(out[:, i + 1 :], out2[:, i + 1 :])


@FAST
@given(n=st.integers(2, 6), E=dims, seed=st.integers(0, 2**16), backend=st.sampled_from(BACKENDS))
def test_without_mask_permuting_tokens_permutes_outputs(n, E, seed, backend):
    x, k, v = rand(2, n, E, seed=seed), rand(2, n, E, seed=seed + 1), rand(2, n, 3, seed=seed + 2)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    out = sdpa(x, k, v, backend=backend)
    # permuting queries permutes outputs; permuting keys and values together changes nothing
    torch.testing.assert_close(sdpa(x[:, perm], k, v, backend=backend), out[:, perm])
    torch.testing.assert_close(sdpa(x, k[:, perm], v[:, perm], backend=backend), out)
    s, w = simple_self_attention(x, return_weights=True)
    s2, w2 = simple_self_attention(x[:, perm], return_weights=True)
    torch.testing.assert_close(s2, s[:, perm])
    torch.testing.assert_close(w2, w[:, perm][:, :, perm])


@FAST
@given(b=st.integers(2, 4), L=dims, S=dims, seed=st.integers(0, 2**16), backend=st.sampled_from(BACKENDS))
def test_batch_items_are_independent(b, L, S, seed, backend):
    q, k, v = rand(b, 2, L, 4, seed=seed), rand(b, 2, S, 4, seed=seed + 1), rand(b, 2, S, 3, seed=seed + 2)
    mask = rand(b, 1, L, S, seed=seed + 3) > 0
    out = sdpa(q, k, v, attn_mask=mask, is_causal=True, backend=backend)
    for i in range(b):
        alone = sdpa(q[i : i + 1], k[i : i + 1], v[i : i + 1], attn_mask=mask[i : i + 1], is_causal=True)
        torch.testing.assert_close(out[i : i + 1], alone, atol=1e-6, rtol=1e-5)


@FAST
@given(L=dims, S=dims, seed=st.integers(0, 2**16), backend=st.sampled_from(BACKENDS), float_mask=st.booleans())
def test_fully_masked_rows_give_zeros_and_finite_gradients(L, S, seed, backend, float_mask):
    q = rand(2, L, 3, seed=seed, requires_grad=True)
    k = rand(2, S, 3, seed=seed + 1, requires_grad=True)
    v = rand(2, S, 2, seed=seed + 2, requires_grad=True)
    mask = rand(2, L, S, seed=seed + 3) > 0
    mask[:, seed % L] = False  # at least one empty row per item
    attn_mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) if float_mask else mask
    out = sdpa(q, k, v, attn_mask=attn_mask, backend=backend)
    empty = ~mask.any(-1)  # (2, L)
    assert (out[empty] == 0).all()
    assert torch.isfinite(out).all()
    (out * rand(*out.shape, seed=seed + 4)).sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[empty] == 0).all()  # an empty row's query has no influence


@FAST
@given(L=dims, S=dims, seed=st.integers(0, 2**16), backend=st.sampled_from(BACKENDS))
def test_bottom_right_alignment(L, S, seed, backend):
    q, k, v = rand(L, 4, seed=seed), rand(S, 4, seed=seed + 1), rand(S, 3, seed=seed + 2)
    out = sdpa(q, k, v, is_causal=True, backend=backend)
    _, w = sdpa(q, k, v, is_causal=True, return_weights=True)
    for i in range(L):
        visible = [j for j in range(S) if j <= i + S - L]
        assert (w[i, [j for j in range(S) if j not in visible]] == 0).all()
        if visible:
            assert (w[i, visible] > 0).all()
            torch.testing.assert_close(out[i], sdpa(q[i : i + 1], k[visible], v[visible])[0])
        else:
            assert (out[i] == 0).all()


@FAST
@given(
    Hq=st.sampled_from([2, 4, 6]),
    L=dims,
    S=dims,
    seed=st.integers(0, 2**16),
    backend=st.sampled_from(BACKENDS),
)
def test_gqa_equals_repeated_kv_heads(Hq, L, S, seed, backend):
    Hkv = 2
    q, k, v = rand(1, Hq, L, 4, seed=seed), rand(1, Hkv, S, 4, seed=seed + 1), rand(1, Hkv, S, 4, seed=seed + 2)
    out = sdpa(q, k, v, enable_gqa=True, is_causal=True, backend=backend)
    g = Hq // Hkv
    expected = sdpa(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True, backend="reference")
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    Hkv=st.integers(1, 3),
    g=st.integers(1, 4),
    n=st.integers(1, 5),
    k=st.integers(1, 6),
    m=st.integers(1, 5),
    batch=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_heads_matmul_pairs_each_query_head_with_its_groups_head(Hkv, g, n, k, m, batch, seed):
    lead = (2,) * batch
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*lead, Hkv * g, n, k, generator=gen, dtype=torch.float64)  # (..., H, n, k)
    b = torch.randn(*lead, Hkv, k, m, generator=gen, dtype=torch.float64)  # (..., Hkv, k, m)
    want = a @ b.repeat_interleave(g, dim=-3)  # head h with head h // g
    torch.testing.assert_close(heads_matmul(a, b), want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(heads_matmul(a.transpose(-2, -1).transpose(-2, -1), b), want)  # (a view)


# =============================================================================================
# Dropout
# =============================================================================================
def test_dropout_scales_kept_weights_like_nn_dropout():
    L = S = 64
    q, k = rand(L, 8, seed=1), rand(S, 8, seed=2)
    eye = torch.eye(S)  # with V = I the output rows are the applied weights
    _, w = sdpa(q, k, eye, return_weights=True)
    for backend in BACKENDS:
        torch.manual_seed(0)
        out = sdpa(q, k, eye, dropout_p=0.25, backend=backend)
        kept = out != 0
        torch.testing.assert_close(out[kept], w[kept] / 0.75)
        frac = kept.float().mean().item()
        assert 0.65 < frac < 0.85, frac
    # the reference path calls F.dropout: exactly nn.Dropout's mask under the same seed
    torch.manual_seed(3)
    _, dropped = sdpa(q, k, eye, dropout_p=0.25, return_weights=True)
    torch.manual_seed(3)
    torch.testing.assert_close(dropped, torch.nn.Dropout(0.25)(w))


# =============================================================================================
# Bad input
# =============================================================================================
Q, K, V = rand(2, 3, 4), rand(2, 5, 4), rand(2, 5, 6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"query": Q.long()}, TypeError, "query must be a floating-point"),
        ({"key": K.int()}, TypeError, "key must be a floating-point"),
        ({"value": [1.0]}, TypeError, "value must be a torch.Tensor"),
        ({"query": rand(4)}, ValueError, "query must have at least 2 dimensions"),
        ({"key": K.double()}, TypeError, "query and key must have the same dtype"),
        ({"value": V.half()}, TypeError, "query and value must have the same dtype"),
        ({"key": rand(2, 5, 3)}, ValueError, "query and key must have the same last dimension"),
        ({"value": rand(2, 4, 6)}, ValueError, "key and value must have the same number of positions"),
        ({"value": rand(3, 5, 6)}, ValueError, r"key \(2, 5, 4\) and value \(3, 5, 6\) have batch dimensions"),
        ({"key": rand(3, 5, 4), "value": rand(3, 5, 6)}, ValueError, "batch dimensions"),
        ({"attn_mask": torch.ones(3, 4, dtype=torch.bool)}, ValueError, r"attn_mask of shape \(3, 4\)"),
        ({"attn_mask": torch.ones(3, 2, 3, 5, dtype=torch.bool)}, ValueError, "attn_mask of shape"),
        ({"attn_mask": torch.ones(3, 5, dtype=torch.int64)}, TypeError, "attn_mask must be a bool"),
        ({"attn_mask": torch.zeros(3, 5, dtype=torch.float64)}, TypeError, "float attn_mask must have"),
        ({"attn_mask": [[True]]}, TypeError, "attn_mask must be a torch.Tensor"),
        ({"dropout_p": 1.0}, ValueError, "dropout_p"),
        ({"dropout_p": -0.1}, ValueError, "dropout_p"),
        ({"dropout_p": True}, ValueError, "dropout_p"),
        ({"scale": float("inf")}, ValueError, "scale"),
        ({"scale": float("nan")}, ValueError, "scale"),
        ({"scale": "0.5"}, ValueError, "scale"),
        ({"attn_mask": torch.full((3, 5), float("nan"))}, ValueError, "must not hold NaN or \\+inf"),
        ({"attn_mask": torch.zeros(3, 5).index_fill(1, torch.tensor([2]), float("inf"))}, ValueError, "3 such"),
        ({"is_causal": 1}, TypeError, "is_causal"),
        ({"backend": "flash"}, ValueError, "backend"),
        ({"backend": "fused", "return_weights": True}, ValueError, "return_weights"),
        ({"return_weights": "yes"}, TypeError, "return_weights must be a bool, got 'yes'"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
    args = {"query": Q, "key": K, "value": V, **kwargs}
    with pytest.raises(error, match=match):
        scaled_dot_product_attention(**args)


def test_bad_gqa_heads_and_scores_input():
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        sdpa(rand(1, 3, 2, 4), rand(1, 2, 2, 4), rand(1, 2, 2, 4), enable_gqa=True)
    with pytest.raises(ValueError, match="multiple of the key/value heads"):
        sdpa(rand(1, 3, 2, 4), rand(1, 0, 2, 4), rand(1, 0, 2, 4), enable_gqa=True)
    with pytest.raises(ValueError, match="enable_gqa"):
        sdpa(rand(1, 4, 2, 4), rand(1, 2, 2, 4), rand(1, 2, 2, 4))
    with pytest.raises(TypeError, match="x must be a floating-point"):
        simple_self_attention(torch.ones(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="x must have at least 2"):
        simple_self_attention(torch.ones(3))
    with pytest.raises(ValueError, match="attn_mask"):
        attention_scores(Q, K, attn_mask=torch.ones(2, 2, dtype=torch.bool))


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_gqa_with_a_headless_key_is_a_value_error(backend):
    # Regression: a 2-D key has no dim -3 to group; this used to be an IndexError from key.shape[-3].
    q, k, v = rand(2, 3, 4), rand(5, 4), rand(5, 6)
    with pytest.raises(ValueError, match=r"enable_gqa=True key needs a heads dimension.*\(5, 4\)"):
        sdpa(q, k, v, enable_gqa=True, backend=backend)
    with pytest.raises(ValueError, match="key needs a heads dimension"):
        attention_scores(q, k, enable_gqa=True)
    # without enable_gqa the same shapes broadcast, as before
    torch.testing.assert_close(sdpa(q, k, v, backend=backend), sdpa(q, k.expand(2, 5, 4), v.expand(2, 5, 6)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_mask_helpers_name_a_device_the_machine_lacks():
    # Regression: torch's own AssertionError about its build came from deep inside torch.ones.
    with pytest.raises(ValueError, match="device='cuda': CUDA is not available"):
        causal_mask(3, device="cuda")
    with pytest.raises(ValueError, match="device='cuda': CUDA is not available"):
        padding_mask([1, 2], device="cuda")
    with pytest.raises(ValueError, match="device='gpu' is not a device name"):
        causal_mask(3, device="gpu")


def test_combine_masks_and_heads_matmul_check_their_input():
    from attnlab.functional import combine_masks

    keep = torch.tensor([[True, False], [True, True]])
    with pytest.raises(TypeError, match=r"a must be None or a bool or floating-point mask tensor, got torch\.int64"):
        combine_masks(keep.long(), keep)
    with pytest.raises(TypeError, match="b must be None or a bool or floating-point mask tensor, got list"):
        combine_masks(keep, [[True]])
    additive = combine_masks(torch.zeros(2, 2), keep)
    assert torch.equal(additive == float("-inf"), ~keep)
    assert torch.equal(combine_masks(keep, keep.T), keep & keep.T)
    with pytest.raises(ValueError, match="b's 4 heads must divide a's 6 heads"):
        heads_matmul(rand(1, 6, 2, 3), rand(1, 4, 3, 2))


@pytest.mark.parametrize("max_len", [-1, 2.0, "4", True])
def test_padding_mask_rejects_a_bad_max_len(max_len):
    # Regression: max_len was used unchecked (-1 passed the length check for empty lengths, a float
    # or a str failed inside torch.arange).
    none = torch.zeros(0, dtype=torch.long)
    with pytest.raises(ValueError, match=r"max_len must be a non-negative int or None, got"):
        padding_mask(none, max_len)
    with pytest.raises(ValueError, match="max_len must be a non-negative int"):
        padding_mask([1, 2], max_len)
    assert padding_mask(none, 0).shape == (0, 0)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize(
    "mask",
    [
        torch.tensor([True, False, True, True, False]),  # (S,)
        torch.tensor(True),  # ()
        torch.tensor([0.0, -1.5, float("-inf"), 2.0, 0.5]),  # (S,) float
        torch.tensor(-0.5),  # () float
    ],
    ids=["bool-S", "bool-scalar", "float-S", "float-scalar"],
)
def test_low_rank_masks_broadcast_as_in_torch(backend, mask):
    """A (S,) or scalar mask broadcasts to (..., L, S) on every path (torch's own kernels need the
    (L, S) dimensions spelled out, so the reference gets the mask expanded)."""
    q, k, v = rand(2, 3, 4, 8, seed=1), rand(2, 3, 5, 8, seed=2), rand(2, 3, 5, 8, seed=3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(4, 5))
    torch.testing.assert_close(sdpa(q, k, v, attn_mask=mask, backend=backend), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", [0.0, -0.7, 3.0])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_any_finite_scale_matches_torch(scale, backend):
    q, k, v = rand(2, 4, 8, seed=4), rand(2, 6, 8, seed=5), rand(2, 6, 8, seed=6)
    want = F.scaled_dot_product_attention(q, k, v, scale=scale)
    torch.testing.assert_close(sdpa(q, k, v, scale=scale, backend=backend), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize(
    ("k_shape", "v_shape", "gqa"),
    [
        ((2, 3, 5, 8), (1, 3, 5, 6), False),  # value broadcast over the batch
        ((1, 3, 5, 8), (2, 3, 5, 6), False),  # key broadcast over the batch
        ((2, 2, 5, 8), (1, 2, 5, 6), True),  # grouped heads, value broadcast over the batch
        ((2, 2, 5, 8), (2, 2, 5, 6), "query"),  # grouped heads, the query broadcast over the batch
    ],
)
def test_key_and_value_batches_broadcast_as_in_torch(backend, k_shape, v_shape, gqa):
    hq = 4 if gqa else 3
    q_batch = 1 if gqa == "query" else 2
    gqa = bool(gqa)
    q, k, v = rand(q_batch, hq, 5, 8, seed=7), rand(*k_shape, seed=8), rand(*v_shape, seed=9)  # L == S: one causal mask
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    got = sdpa(q, k, v, is_causal=True, enable_gqa=gqa, backend=backend)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
@pytest.mark.parametrize(
    "kw",
    [{}, {"is_causal": True}, {"attn_mask": "padding"}, {"window": 2, "is_causal": True}],
    ids=["plain", "causal", "mask", "window"],
)
def test_a_nan_query_gives_a_nan_row_as_the_softmax_does(backend, kw):
    """A NaN in a query makes every score of its row NaN, and so its weights and output: torch's CPU
    kernel alone would return zeros there (a broken weight giving finite, wrong outputs). The other
    rows equal the float64 reference's."""
    q, k, v = rand(2, 3, 12, 8, seed=1), rand(2, 3, 12, 8, seed=2), rand(2, 3, 12, 8, seed=3)
    q[1, 2, 5, 4] = float("nan")
    if kw.get("attn_mask") == "padding":
        kw = {"attn_mask": torch.arange(12) < 10}  # (S,): the last two keys are padding
    got = sdpa(q, k, v, backend=backend, **kw)
    want = sdpa(q.double(), k.double(), v.double(), backend="reference", **kw)
    assert got.isnan().any(-1).nonzero().tolist() == [[1, 2, 5]] == want.isnan().any(-1).nonzero().tolist()
    torch.testing.assert_close(got.nan_to_num(7.0), want.float().nan_to_num(7.0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "call",
    [
        lambda: simple_self_attention(torch.randn(3, 4), return_weights="no"),
        lambda: padding_mask([1], max_len=3, left="no"),
        lambda: positions_mask(torch.tensor([0, 1]), torch.tensor([0, 1]), causal="no"),
        lambda: MultiHeadAttention(4, 6, 10, num_heads=2)(torch.randn(3, 4), return_weights="no"),
    ],
    ids=["simple_self_attention", "padding_mask", "positions_mask", "MultiHeadAttention"],
)
def test_a_truthy_string_is_not_a_flag(call):
    # ("no" is truthy: it returned weights, padded on the left, masked causally)
    with pytest.raises(TypeError, match=r"must be a bool, got 'no'"):
        call()


def test_masks_that_do_not_fit_together_are_named():
    # (torch's "size of tensor a (2) must match" and "Tensor on device meta is not on the expected device")
    from attnlab.functional import combine_masks

    with pytest.raises(ValueError, match=r"a \(2,\) and b \(3,\) must broadcast to one shape"):
        combine_masks(torch.ones(2, dtype=torch.bool), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="q_positions and k_positions must be on one device, got cpu and meta"):
        positions_mask(torch.tensor([0, 1]), torch.tensor([0, 1], device="meta"))
