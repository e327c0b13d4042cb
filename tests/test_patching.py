"""Activation, path and attribution patching and direct logit attribution, held to a float64 forward
pass written here (explicit attention, no hooks), on small GPTs."""

from __future__ import annotations

import copy
import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.interpret import (
    SITES,
    act_name,
    activation_patching,
    attribution_patching,
    direct_logit_attribution,
    hooks,
    logit_diff,
    normalized_logit_diff,
    path_patching,
    run_with_cache,
)
from attnlab.model import GPT, GPTConfig
from test_fast_decode import BASE, FAMILIES, make

A, B = 3, 5  # the two answer tokens of the tests' metric


def reference(model, idx, edit=None):
    """Logits of a learned-position GPT in float64, step by step; ``edit(step, layer, t)`` may
    return a replacement of each step (TransformerLens's shapes)."""
    m = model if model.dtype == torch.float64 else copy.deepcopy(model).double()
    e = edit or (lambda step, layer, t: None)

    def at(step, layer, t):
        out = e(step, layer, t)
        return t if out is None else out

    T = idx.shape[1]
    x = m.tok_emb(idx) + m.pos_emb(torch.arange(T))  # (1, T, d)
    for i, blk in enumerate(m.trf_blocks):
        att = blk.att
        H, hd = att.num_heads, att.head_dim
        x = at("resid_pre", i, x)
        h = blk.norm1(x)
        q, k, v = (
            at(s, i, w(h).view(1, T, H, hd)) for s, w in (("q", att.W_query), ("k", att.W_key), ("v", att.W_value))
        )
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
        pattern = at("pattern", i, scores.softmax(-1))  # (1, H, T, T)
        z = at("z", i, torch.einsum("bhqk,bkhd->bqhd", pattern, v))  # (1, T, H, hd)
        attn_out = at("attn_out", i, att.out_proj(z.reshape(1, T, H * hd)))
        x = at("resid_mid", i, x + attn_out)
        w_in, act, w_out = blk.ff.layers  # (GELU's MLP)
        post = at("post", i, act(w_in(blk.norm2(x))))  # (1, T, d_mlp): the neurons
        mlp = at("mlp_out", i, w_out(post))
        x = at("resid_post", i, x + mlp)
    return m.out_head(m.final_norm(x))


def ref_metric(logits):
    return float((logits[0, -1, A] - logits[0, -1, B]).detach())


def ref_cache(model, idx):
    cache = {}

    def keep(step, layer, t):
        cache[step, layer] = t.detach().clone()

    reference(model, idx, keep)
    return cache


def patch_shape(kind, T, H, D):
    """One layer's results of a site of ``kind``, TransformerLens's shapes (``D``: the MLP's neurons)."""
    return {
        "pos": (T,),
        "head": (H,),
        "pos_head": (T, H),
        "dest_src": (H, T, T),
        "neuron": (D,),
        "pos_neuron": (T, D),
    }[kind]


def patch_indices(kind, T, H, D):
    """Every index of one layer's results, in C order (a pattern's every weight, above its diagonal too)."""
    return [tuple(int(i) for i in index) for index in torch.ones(patch_shape(kind, T, H, D)).nonzero()]


def naive_patching(model, clean, corrupted, site):
    """One full float64 forward per patch, as TransformerLens does."""
    step, kind = SITES[site]
    model = copy.deepcopy(model).double()
    cache = ref_cache(model, clean)
    L = model.config.n_layers
    T = clean.shape[1]
    H, D = model.trf_blocks[0].att.num_heads, model.config.hidden_dim
    indices = patch_indices(kind, T, H, D)
    out = []
    for layer in range(L):
        row = []
        for index in indices:

            def edit(s, i, t, layer=layer, index=index):
                if s != step or i != layer:
                    return None
                t = t.clone()
                src = cache[s, i]
                if kind == "dest_src":  # (h, p, s): head h's weight of query p on key s (every key)
                    t[0, index[0], index[1], index[2]] = src[0, index[0], index[1], index[2]]
                elif step == "pattern" and kind == "pos_head":  # (p, h): head h's weights of query p
                    t[0, index[1], index[0]] = src[0, index[1], index[0]]
                elif kind == "pos" or step == "pattern":
                    t[0, index[0]] = src[0, index[0]]
                elif kind in ("head", "neuron"):
                    t[0, :, index[0]] = src[0, :, index[0]]
                else:
                    t[0, index[0], index[1]] = src[0, index[0], index[1]]
                return t

            row.append(ref_metric(reference(model, corrupted, edit)))
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).reshape(L, *patch_shape(kind, T, H, D))


@pytest.fixture
def pair():
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 37, (1, 7), generator=g)
    corrupted = clean.clone()
    corrupted[0, 2] = (clean[0, 2] + 11) % 37
    corrupted[0, 4] = (clean[0, 4] + 5) % 37
    return clean, corrupted


def test_reference_is_the_model(make_gpt, pair):
    model = make_gpt()
    torch.testing.assert_close(reference(model, pair[0]).float(), model(pair[0]), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("site", sorted(SITES))
def test_activation_patching_matches_naive_float64_loop(make_gpt, pair, site):
    model = make_gpt()
    got = activation_patching(model, *pair, logit_diff(A, B), site)
    want = naive_patching(model, *pair, site)
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_patching_small_batches_and_a_plain_metric(make_gpt, pair):
    """Rows split across runs, and a metric without ``rows``/``last_only``: the same numbers."""
    model = make_gpt()
    want = activation_patching(model, *pair, logit_diff(A, B), "head_out_by_pos")
    got = activation_patching(model, *pair, lambda lg: lg[0, -1, A] - lg[0, -1, B], "head_out_by_pos", max_tokens=10)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("site", "per_layer"), [("pattern_dest_src", 4 * 28), ("resid_pre", 7)])
def test_progress_counts_the_patched_runs_up_to_their_total(make_gpt, pair, site, per_layer):
    """``progress(done, total)`` before the first batched pass and after each: ``done`` grows from 0 to
    ``total``, the patched runs (a pattern's weights on or below the diagonal: 4 heads x 28 of 7 x 7),
    and the results are the same."""
    model = make_gpt()
    calls = []
    got = activation_patching(
        model, *pair, logit_diff(A, B), site, max_tokens=21, layers=[1], progress=lambda *c: calls.append(c)
    )
    assert len(calls) > 2 and calls[0] == (0, per_layer) and calls[-1] == (per_layer, per_layer)
    assert [t for _, t in calls] == [per_layer] * len(calls)
    assert all(a < b for (a, _), (b, _) in itertools.pairwise(calls))
    torch.testing.assert_close(got, activation_patching(model, *pair, logit_diff(A, B), site)[1:])


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [{}, dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2), dict(pos="alibi", qk_norm=True)],
    ids=["gpt2", "llama-gqa", "alibi-qknorm"],
)
def test_clean_into_clean_changes_nothing(make_gpt, pair, overrides):
    model = make_gpt(**overrides)
    clean = pair[0]
    value = logit_diff(A, B)(model(clean)).item()
    for site in SITES:
        got = activation_patching(model, clean, clean, logit_diff(A, B), site)
        torch.testing.assert_close(got, torch.full_like(got, value), rtol=1e-4, atol=1e-5)


def test_whole_residual_at_layer_0_restores_clean_exactly(make_gpt, pair):
    model = make_gpt(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    clean, corrupted = pair
    with torch.no_grad():
        _, cache = run_with_cache(model, clean, ["blocks.0.hook_resid_pre"])
        with hooks(model, {"blocks.0.hook_resid_pre": lambda x, h: cache[h.name]}):
            got = logit_diff(A, B)(model(corrupted))
        assert got == logit_diff(A, B)(model(clean))
    # and patching every position of layer 0 one by one brackets it: the last position's patch
    # restores exactly the clean last-position residual
    one_by_one = activation_patching(model, clean, corrupted, logit_diff(A, B), "resid_post")
    torch.testing.assert_close(one_by_one[-1, -1], got, rtol=1e-5, atol=1e-6)


# Families whose forward the float64 loop above does not write out, from a config as
# attnlab.formats.families builds them. Gemma 2: alternating window layers, attention and logit
# soft-capping (the cap far below the logits' range here, 2 against up to ~1.8, so it bends them);
# Gemma 3: the window layers rotate with a RoPE base of their own (rope_local_theta).
GEMMA2 = dict(FAMILIES["gemma"], post_norms=True, window=6, window_layers=[0, 2], attn_softcap=50.0, logit_softcap=2.0)
REFERENCE_FAMILIES = {
    "gpt2": FAMILIES["gpt2"],
    "llama-gqa": FAMILIES["llama-gqa"],
    "gemma2": GEMMA2,
    "gemma3": FAMILIES["gemma3"],
}
# What each Gemma family's model has that a patching rerun must reproduce (the config without it
# builds the same weights: neither field has parameters).
FEATURE = {"gemma2": {"logit_softcap": None}, "gemma3": {"rope_local_theta": None}}


@pytest.fixture
def long_pair():
    """``(1, 10)`` clean and corrupted ids for test_fast_decode's models: longer than their window (6)."""
    g = torch.Generator().manual_seed(2)
    clean = torch.randint(0, BASE["vocab_size"], (1, 10), generator=g)
    corrupted = clean.clone()
    corrupted[0, 1] = (clean[0, 1] + 17) % BASE["vocab_size"]
    corrupted[0, 6] = (clean[0, 6] + 29) % BASE["vocab_size"]
    return clean, corrupted


def hooked_patching(model, clean, corrupted, site, every=1):
    """One full forward of ``model`` per patch, the clean activation put in by a hook on the model's
    own forward (``model(idx)``: every family's switches, none written out here). ``(L, ...)`` float64,
    the site's shape (as :func:`naive_patching`); with ``every=k``, only every k-th index (the others NaN)."""
    step, kind = SITES[site]
    L, T = model.config.n_layers, clean.shape[1]
    att = model.trf_blocks[0].att
    H = att.num_kv_heads if step in ("k", "v") else att.num_heads
    D = model.config.hidden_dim
    indices = patch_indices(kind, T, H, D)
    names = [act_name(step, i) for i in range(L)]
    with torch.no_grad():
        _, cache = run_with_cache(model, clean, names)
    out = []
    for name in names:
        for n, index in enumerate(indices):
            if n % every:
                out.append(math.nan)
                continue

            def patch(t, hook, src=cache[name], index=index):
                t = t.clone()
                if kind == "dest_src":  # (h, p, s): head h's weight of query p on key s (every key)
                    t[0, index[0], index[1], index[2]] = src[0, index[0], index[1], index[2]]
                elif step == "pattern" and kind == "pos_head":  # (p, h): head h's weights of query p, (S,)
                    t[0, index[1], index[0]] = src[0, index[1], index[0]]
                elif kind == "pos" or step == "pattern":
                    t[0, index[0]] = src[0, index[0]]  # (T, d) at one position, or one head's (T, S) pattern
                elif kind in ("head", "neuron"):
                    t[0, :, index[0]] = src[0, :, index[0]]  # (T, hd) or (T,): one head (neuron), every position
                else:
                    t[0, index[0], index[1]] = src[0, index[0], index[1]]
                return t

            with torch.no_grad(), hooks(model, {name: patch}):
                out.append(ref_metric(model(corrupted)))
    return torch.tensor(out, dtype=torch.float64).reshape(L, *patch_shape(kind, T, H, D))


@pytest.mark.slow
@pytest.mark.parametrize("family", list(REFERENCE_FAMILIES))
def test_activation_patching_matches_hooked_forwards_of_each_family(family, long_pair):
    """Patching reruns the blocks from a cached residual: each layer must get its own RoPE angles
    (Gemma 3) and the logits the model's soft cap (Gemma 2), as ``model(idx)`` does."""
    model = make(REFERENCE_FAMILIES[family])  # float64: the two computations agree to rounding
    for site in SITES:
        # A pattern's single weights: 1,200 patches. Gemma 3's (a window, zeros outside it) every 5th.
        if site == "pattern_dest_src" and family != "gemma3":
            continue
        got = activation_patching(model, *long_pair, logit_diff(A, B), site)
        # (the neurons: 576 patches, a neuron at each position 5,760: every 7th and every 29th of each layer)
        every = {"pattern_dest_src": 5, "neuron": 7, "neuron_by_pos": 29}.get(site, 1)
        want = hooked_patching(model, *long_pair, site, every=every)
        assert got.shape == want.shape, site
        got = got.double().where(~want.isnan(), math.nan)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True, msg=site)
    if family in FEATURE:  # the family's switch moves the numbers: a rerun without it could not pass
        plain = make({**REFERENCE_FAMILIES[family], **FEATURE[family]})
        moved = hooked_patching(plain, *long_pair, "resid_pre") - hooked_patching(model, *long_pair, "resid_pre")
        assert moved.abs().max() > 0.05


@pytest.mark.parametrize("family", list(REFERENCE_FAMILIES))
def test_the_reruns_clean_logits_are_the_models(family, long_pair):
    """Clean patched into clean: every rerun's whole logits ``(1, T, V)`` (a plain metric sees every
    position) equal ``model(clean)``."""
    model = make(REFERENCE_FAMILIES[family])
    clean = long_pair[0]
    seen = []

    def keep(logits):  # no rows/last_only: called on each rerun's (1, T, V) logits
        seen.append(logits.detach().clone())
        return logits[0, -1, A] - logits[0, -1, B]

    activation_patching(model, clean, clean, keep, "resid_pre", layers=[0, 2])
    with torch.no_grad():
        want = model(clean)
    assert len(seen) == 1 + 2 * clean.shape[1]  # the corrupted (= clean) run, then 2 layers x T positions
    for logits in seen:
        torch.testing.assert_close(logits, want, rtol=1e-10, atol=1e-10)


class ShiftedLogits(GPT):
    """A model family whose forward does more than its blocks, final norm and head (a bias on the
    logits), which patching's reruns cannot know."""

    def decode_logits(self, *args, **kwargs):
        return super().decode_logits(*args, **kwargs) + 1.0


def test_a_model_the_reruns_cannot_reproduce_is_a_value_error(long_pair):
    model = make(FAMILIES["llama-gqa"])
    odd = ShiftedLogits(model.config).double().eval()
    odd.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match="not supported by activation_patching"):
        activation_patching(odd, *long_pair, logit_diff(A, B), "resid_pre")


def test_normalized_metric(make_gpt, pair):
    model = make_gpt()
    clean, corrupted = pair
    lc, lx = (logit_diff(A, B)(model(t)).item() for t in pair)
    raw = activation_patching(model, clean, corrupted, logit_diff(A, B), "resid_pre")
    norm = activation_patching(model, clean, corrupted, normalized_logit_diff(A, B, lc, lx), "resid_pre")
    torch.testing.assert_close(norm, (raw - lx) / (lc - lx), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="must differ"):
        normalized_logit_diff(A, B, 1.0, 1.0)


def test_path_patching_matches_hand_written_reference(make_gpt, pair):
    model = make_gpt(n_layers=3)
    clean, corrupted = pair
    senders, receivers = [(0, 1), (1, 3)], [(1, 0, "q"), (2, 2, "k"), (2, 1, "v")]
    cc, cx = ref_cache(model, clean), ref_cache(model, corrupted)

    def step1(s, i, t):
        if s == "z":  # every head as corrupted, the senders clean
            z = cx["z", i].clone()
            for sl, sh in senders:
                if sl == i:
                    z[:, :, sh] = cc["z", i][:, :, sh]
            return z
        return None

    seen = {}
    reference(model, corrupted, lambda s, i, t: seen.__setitem__((s, i), t.detach().clone()) or step1(s, i, t))

    def step2(s, i, t):
        out = None
        for rl, rh, rk in receivers:
            if (rk, rl) == (s, i):
                out = t.clone() if out is None else out
                out[:, :, rh] = seen[s, i][:, :, rh]
        return out

    want = ref_metric(reference(model, corrupted, step2))
    got = path_patching(model, clean, corrupted, logit_diff(A, B), senders=senders, receivers=receivers)
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    assert abs(got - ref_metric(reference(model, corrupted))) > 10 * abs(got - want)  # the path matters
    with pytest.raises(ValueError, match="receivers\\[0\\] is in layer 0"):
        path_patching(model, clean, corrupted, logit_diff(A, B), senders=[(0, 1)], receivers=[(0, 1, "q")])
    with pytest.raises(ValueError, match="receivers\\[0\\] must be"):
        path_patching(model, clean, corrupted, logit_diff(A, B), senders=[(0, 1)], receivers=[(1, 1, "z")])


def test_attribution_is_exact_where_the_metric_is_linear(make_gpt, pair):
    """Without a final norm the logits are linear in the last layer's outputs: the first-order
    estimate is the patch's effect."""
    model = make_gpt()
    model.final_norm = nn.Identity()
    clean, corrupted = pair
    base = logit_diff(A, B)(model(corrupted)).item()
    sites = ("head_out", "head_out_by_pos", "attn_out", "mlp_out", "resid_post", "pattern_by_pos", "pattern_dest_src")
    for site in sites:
        act = activation_patching(model, clean, corrupted, logit_diff(A, B), site)[-1] - base
        est = attribution_patching(model, clean, corrupted, logit_diff(A, B), site)[-1]
        torch.testing.assert_close(est, act, rtol=1e-4, atol=1e-5)


def test_attribution_has_activation_patchings_shape_at_every_site(make_gpt, pair):
    """Every site's estimate has the axes of its patches (7 positions and 4 heads: a (T, H) result
    transposed would have another shape)."""
    model = make_gpt()
    clean, corrupted = pair
    for site in SITES:
        act = activation_patching(model, clean, corrupted, logit_diff(A, B), site)
        est = attribution_patching(model, clean, corrupted, logit_diff(A, B), site)
        assert est.shape == act.shape, site


@pytest.mark.parametrize("site", ["neuron", "neuron_by_pos"])
def test_attribution_of_the_last_layers_neurons_is_exact(make_gpt, pair, site):
    """The same for the MLP's neurons, whose effects are small in the test model (about 1e-5): in
    float64, to a tolerance relative to them."""
    model = make_gpt().double()
    model.final_norm = nn.Identity()
    clean, corrupted = pair
    base = logit_diff(A, B)(model(corrupted)).item()
    act = activation_patching(model, clean, corrupted, logit_diff(A, B), site)[-1].double() - base
    est = attribution_patching(model, clean, corrupted, logit_diff(A, B), site)[-1].double()
    assert est.shape == act.shape and act.abs().max() > 0
    torch.testing.assert_close(est, act, rtol=0, atol=2e-3 * float(act.abs().max()))


def correlation(a, b):
    return float(torch.corrcoef(torch.stack([a.flatten().double(), b.flatten().double()]))[0, 1])


@pytest.mark.slow
def test_attribution_agrees_with_activation_patching(make_gpt):
    """A small perturbation (one token, a nearby embedding): estimates close to the patches' effects."""
    model = make_gpt(n_layers=3)
    clean = torch.randint(0, 37, (1, 8), generator=torch.Generator().manual_seed(3))
    corrupted = clean.clone()
    corrupted[0, 3] = 36
    with torch.no_grad():
        model.tok_emb.weight[36] = model.tok_emb.weight[clean[0, 3]] + 0.01 * torch.randn(model.config.emb_dim)
    base = logit_diff(A, B)(model(corrupted)).item()
    for site in ("resid_pre", "head_out", "mlp_out"):
        act = activation_patching(model, clean, corrupted, logit_diff(A, B), site) - base
        est = attribution_patching(model, clean, corrupted, logit_diff(A, B), site)
        assert est.shape == act.shape
        assert correlation(est, act) > 0.98, site
        torch.testing.assert_close(est, act, rtol=0.1, atol=0.1 * float(act.abs().max()))


@pytest.mark.parametrize(
    "overrides",
    [dict(qkv_bias=True), dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2)],
    ids=["gpt2-biases", "llama-gqa"],
)
def test_direct_logit_attribution_sums_to_the_logit_difference(make_gpt, pair, overrides):
    model = make_gpt(n_layers=3, **overrides)
    idx = pair[0]
    dla = direct_logit_attribution(model, idx, answers=(A, B))
    L, H = 3, model.config.n_heads
    assert dla.heads.shape == (L, H) and dla.mlps.shape == (L,)
    torch.testing.assert_close(dla.total, torch.tensor(ref_metric(model(idx)), dtype=torch.float64))
    torch.testing.assert_close(dla.parts_sum(), dla.total, rtol=1e-5, atol=1e-5)
    # each head against a float64 computation here: its output through out_proj, the final norm
    # with the scale of the whole stream, the unembedding difference
    with torch.no_grad():
        _, cache = run_with_cache(model, idx)
        m = copy.deepcopy(model).double()
        final = cache["resid_post", L - 1][0, -1].double()
        direction = m.out_head.weight[A] - m.out_head.weight[B]
        norm = m.final_norm
        for layer in range(L):
            att = m.trf_blocks[layer].att
            z = cache["z", layer][0, -1].double()  # (H, hd)
            for h in range(H):
                zh = torch.zeros_like(z)
                zh[h] = z[h]
                write = F.linear(zh.reshape(-1), att.out_proj.weight)  # no bias
                if isinstance(norm, nn.LayerNorm):
                    c = (write - write.mean()) / (final.var(unbiased=False) + norm.eps).sqrt() * norm.weight
                else:
                    c = write / (final.square().mean() + norm.eps).sqrt() * norm.weight
                assert float(dla.heads[layer, h]) == pytest.approx(float(c @ direction), rel=1e-6, abs=1e-8)


@pytest.mark.parametrize("family", ["gemma", "olmo2", "gemma2", "gemma3"])
def test_direct_logit_attribution_of_norms_after_sublayers_offset_gains_and_a_soft_cap(family):
    """Gemma's (1 + w) norms, a norm after each sublayer (OLMo 2, Gemma 2/3: a head's write is its share
    of that norm's input, scaled as the whole) and Gemma 2's logit soft cap (the parts add up to the
    logit difference before the cap): each head against a float64 computation here, written out."""
    cfg = {**FAMILIES, "gemma2": GEMMA2}[family]
    model = make(cfg)  # float64
    idx = torch.randint(0, BASE["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(5))
    dla = direct_logit_attribution(model, idx, answers=(A, B))
    uncapped = GPT(GPTConfig(**{**model.config.to_dict(), "logit_softcap": None})).double().eval()
    uncapped.load_state_dict(model.state_dict())
    with torch.no_grad():
        want_total = logit_diff(A, B)(uncapped(idx))
        _, cache = run_with_cache(model, idx)
    torch.testing.assert_close(dla.total, torch.as_tensor(want_total, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(dla.parts_sum(), dla.total, rtol=1e-7, atol=1e-7)

    def rms_gain(norm, x):  # the norm's gain over its scale at input x
        offset = getattr(norm, "offset", 0.0)
        return (norm.weight + offset) / (x.square().mean() + norm.eps).sqrt()

    L, H = len(model.trf_blocks), model.config.n_heads
    final = cache["resid_post", L - 1][0, -1]
    direction = model.out_head.weight[A] - model.out_head.weight[B]
    for layer, block in enumerate(model.trf_blocks):
        att = block.att
        z = cache["z", layer][0, -1]  # (H, hd)
        whole = F.linear(z.reshape(-1), att.out_proj.weight, att.out_proj.bias)  # the heads' sum, the bias
        for h in range(H):
            zh = torch.zeros_like(z)
            zh[h] = z[h]
            write = F.linear(zh.reshape(-1), att.out_proj.weight)  # (d,) no bias
            if block.post_norm1 is not None:
                write = write * rms_gain(block.post_norm1, whole)
            want = (write * rms_gain(model.final_norm, final)) @ direction
            assert float(dla.heads[layer, h]) == pytest.approx(float(want.detach()), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_are_attributed_and_patched_as_their_float32_twins(dtype):
    """A bfloat16 model (what load_pretrained gives where bfloat16 is native): the checks that a family's
    stream is the sum direct logit attribution takes, and that patching's reruns reproduce the model,
    once held it to float32's rounding and refused it; its results are its float32 twin's to its own."""
    cfg = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2)
    wide = make(cfg, seed=3, dtype=torch.float32)
    half = copy.deepcopy(wide).to(dtype)
    wide.load_state_dict({k: v.to(torch.float32) for k, v in half.state_dict().items()})  # the same numbers
    clean = torch.randint(0, BASE["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(4))
    corrupted = clean.clone()
    corrupted[0, 3] = (clean[0, 3] + 7) % BASE["vocab_size"]
    got, want = (direct_logit_attribution(m, clean, answers=(A, B)) for m in (half, wide))
    scale = float(want.heads.abs().max())
    torch.testing.assert_close(got.heads, want.heads, rtol=0.05, atol=0.05 * scale)
    metric = logit_diff(A, B)
    got, want = (activation_patching(m, clean, corrupted, metric, "head_out").double() for m in (half, wide))
    torch.testing.assert_close(got, want, rtol=0.1, atol=0.1 * float(want.abs().max()))
    # and a stream that is not the attributed sum is still refused in half precision (a residual
    # multiplier no hook sees: a block adding half its input again)
    half.trf_blocks[1].register_forward_hook(lambda module, args, out: out + 0.5 * args[0])
    with pytest.raises(RuntimeError, match="not the sum of embeddings, heads and MLPs"):
        direct_logit_attribution(half, clean, answers=(A, B))


def test_bad_input_is_named(make_gpt, pair):
    model = make_gpt()
    clean, corrupted = pair
    with pytest.raises(ValueError, match="same number of tokens"):
        activation_patching(model, clean, corrupted[:, :5], logit_diff(A, B))
    with pytest.raises(ValueError, match="site must be one of"):
        activation_patching(model, clean, corrupted, logit_diff(A, B), site="heads")
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match=f"max_tokens must be a positive int .*, got {bad}"):
            activation_patching(model, clean, corrupted, logit_diff(A, B), max_tokens=bad)
    with pytest.raises(ValueError, match="site must be one of"):
        attribution_patching(model, clean, corrupted, logit_diff(A, B), site="resid")
    with pytest.raises(ValueError, match="metric must return a scalar"):
        activation_patching(model, clean, corrupted, lambda lg: lg[0, -1], "resid_pre")
    with pytest.raises(ValueError, match="metric must return a scalar"):
        attribution_patching(model, clean, corrupted, lambda lg: lg[0, -1], "resid_pre")
    # A metric of no gradient, or not finite: an AttributeError, a RuntimeError or a result all NaN, before.
    for metric, message in (
        (lambda lg: 1.0, "computed from the logits"),
        (lambda lg: lg[0, -1, 3].detach(), "computed"),
    ):
        with pytest.raises(ValueError, match=message):
            attribution_patching(model, clean, corrupted, metric, "resid_pre")
    for call in (  # (None's "'NoneType' object is not callable", 3's "'int' object is not callable", before)
        lambda: activation_patching(model, clean, corrupted, None, "resid_pre"),
        lambda: attribution_patching(model, clean, corrupted, None, "resid_pre"),
        lambda: path_patching(model, clean, corrupted, None, senders=[(0, 0)], receivers=[(1, 0, "q")]),
    ):
        with pytest.raises(TypeError, match=r"metric must be a function of the logits .*, got NoneType"):
            call()
    with pytest.raises(TypeError, match=r"progress must be a function \(done, total\) or None, got int"):
        activation_patching(model, clean, corrupted, logit_diff(A, B), "resid_pre", progress=3)
    nan = lambda lg: lg[0, -1, A] * float("nan")
    for call in (
        lambda: activation_patching(model, clean, corrupted, nan, "resid_pre"),
        lambda: attribution_patching(model, clean, corrupted, nan, "resid_pre"),
        lambda: path_patching(model, clean, corrupted, nan, senders=[(0, 0)], receivers=[(1, 0, "q")]),
    ):
        with pytest.raises(ValueError, match=r"metric must return a finite value, got nan .*the metric made it"):
            call()
    with pytest.raises(ValueError, match="answers\\[1\\] must be one token id"):
        direct_logit_attribution(model, clean, answers=(1, 99))
    with pytest.raises(ValueError, match="answers must be two token ids"):
        direct_logit_attribution(model, clean, answers=(1, 2, 3))
    with pytest.raises(ValueError, match="answers must be two tokens, got 1 twice"):  # (all zeros before)
        direct_logit_attribution(model, clean, answers=(1, 1))
    with pytest.raises(ValueError, match="a must be one token id"):
        logit_diff("Mary", B)
    assert logit_diff(np.int64(A), B) == logit_diff(A, B)  # NumPy's ints are ints
    for run in (activation_patching, attribution_patching):  # a token past the model's 37
        with pytest.raises(ValueError, match=r"a=40, b=.* must be ids in the model's vocabulary \[0, 37\)"):
            run(model, clean, corrupted, logit_diff(40, B), "resid_pre")
    with pytest.raises(ValueError, match="clean must be a finite logit difference, got nan"):
        normalized_logit_diff(A, B, float("nan"), 1.0)
    with pytest.raises(ValueError, match="clean must be the token ids of one prompt"):
        activation_patching(model, torch.cat([clean, clean]), corrupted, logit_diff(A, B))
