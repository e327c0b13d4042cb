"""The explicit attention path (``backend="reference"`` / ``return_weights=True``) works in place on its
own score tensor where it can, and without gradients zeroes the softmax's NaN rows in place: held here
to a float64 loop, to the same call with gradients, and to NaN scores."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.functional import scaled_dot_product_attention

FAST = settings(max_examples=25, deadline=None)


def rand(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def loop_reference(q, k, v, allowed, bias, scale):
    """float64, one query row at a time: weights (B, H, L, S) and outputs (B, H, L, E)."""
    B, H, L, _ = q.shape
    S = k.shape[-2]
    w = torch.zeros(B, H, L, S, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(L):
                keys = [j for j in range(S) if allowed[b, h, i, j]]
                if not keys:
                    continue  # nothing to attend: zero weights
                s = [float(q[b, h, i].double() @ k[b, h, j].double()) * scale + float(bias[b, h, i, j]) for j in keys]
                m = max(s)
                e = [math.exp(x - m) for x in s]
                for j, x in zip(keys, e, strict=True):
                    w[b, h, i, j] = x / sum(e)
    return w, w @ v.double()


@FAST
@given(
    L=st.integers(1, 6),
    S=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    kind=st.sampled_from(["bool", "float", "causal+bool"]),
    grad=st.booleans(),
)
def test_explicit_path_equals_a_float64_loop_with_and_without_gradients(L, S, seed, kind, grad):
    q, k, v = rand(2, 3, L, 4, seed=seed), rand(2, 3, S, 4, seed=seed + 1), rand(2, 3, S, 2, seed=seed + 2)
    allowed = rand(2, 3, L, S, seed=seed + 3) > 0
    allowed[:, :, seed % L] = False  # an empty row in every head
    bias = torch.zeros(2, 3, L, S)
    if kind == "float":
        bias = rand(2, 3, L, S, seed=seed + 4)
        mask = bias.masked_fill(~allowed, float("-inf"))
    else:
        mask = allowed
    causal = kind == "causal+bool"
    if causal:  # bottom-right aligned: query i sees keys j <= i + S - L
        allowed = allowed & (torch.arange(S)[None, :] <= torch.arange(L)[:, None] + S - L)
    if grad:
        q.requires_grad_(True)
    out, w = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, return_weights=True)
    want_w, want_out = loop_reference(q.detach(), k, v, allowed, bias, 1 / 2.0)
    torch.testing.assert_close(w.double(), want_w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.double(), want_out, atol=1e-6, rtol=1e-5)
    # The other path (with gradients / without) gives the same weights bit for bit.
    with torch.set_grad_enabled(not grad):
        other = scaled_dot_product_attention(
            q.detach().requires_grad_(not grad), k, v, attn_mask=mask, is_causal=causal, return_weights=True
        )[1]
    assert torch.equal(w.detach(), other.detach())
    if grad:
        (out * rand(*out.shape, seed=seed + 5)).sum().backward()
        assert torch.isfinite(q.grad).all()


def test_nan_scores_are_not_taken_for_an_empty_row():
    # A NaN query gives NaN scores: NaN weights, as torch's softmax gives, not the zeros of a row
    # with nothing to attend (whose scores are all -inf), with gradients or without.
    q, k, v = rand(1, 1, 3, 4, seed=1), rand(1, 1, 4, 4, seed=2), rand(1, 1, 4, 2, seed=3)
    q[0, 0, 1] = float("nan")
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[2] = False  # row 2: nothing to attend
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            _, w = scaled_dot_product_attention(
                q.clone().requires_grad_(grad), k, v, attn_mask=mask, return_weights=True
            )
        assert w[0, 0, 1].isnan().all() and (w[0, 0, 2] == 0).all() and torch.isfinite(w[0, 0, 0]).all()
