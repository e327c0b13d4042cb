"""Generation: greedy vs a naive loop, KV cache vs no cache, sliding window, padding, sampling, eos."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.generation import sample_next_token
from attnlab.model import GPT, GPTConfig

V, C = 41, 12
MODEL_CFG = GPTConfig(vocab_size=V, context_length=C, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0, qkv_bias=True)


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(1)
    m = GPT(MODEL_CFG).eval()
    # Larger weights than GPT-2's init give peaked, varied next-token distributions (no greedy ties).
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(8)
    return m


def naive_greedy(model: GPT, idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """nanoGPT's loop: crop to the context, full forward, argmax, append."""
    logits_all = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(idx[:, -C:])[:, -1]  # (B, V)
            logits_all.append(logits)
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx, torch.stack(logits_all, 1) if logits_all else torch.empty(idx.shape[0], 0, V)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 20), n=st.integers(0, 20), B=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_cached_and_uncached_greedy_match_naive_loop(model, T, n, B, seed):
    # Covers prompts longer than the context and generation past it (T + n up to 40 > C = 12).
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    want, want_logits = naive_greedy(model, idx, n)
    for use_cache in (True, False):
        got, logits = model.generate(idx, n, temperature=0, use_cache=use_cache, return_logits=True)
        assert got.shape == (B, T + n)
        assert torch.equal(got, want)
        torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)


def test_cache_feeds_one_token_per_step_until_the_window_is_full(model):
    lengths = []
    hook = model.tok_emb.register_forward_hook(lambda mod, inp, out: lengths.append(inp[0].shape[1]))
    try:
        model.generate(torch.zeros(1, 4, dtype=torch.long), 6, temperature=0)
        assert lengths == [4, 1, 1, 1, 1, 1]  # prefill once, then single tokens: no re-running
        lengths.clear()
        model.generate(torch.zeros(1, 4, dtype=torch.long), 11, temperature=0)
        # The 12th token still fits the context; past it each step re-fills the cache from the last 12
        # (absolute positions: every cached key is stale once the window slides).
        assert lengths == [4, 1, 1, 1, 1, 1, 1, 1, 1, 12, 12]
        lengths.clear()
        model.generate(torch.zeros(1, 4, dtype=torch.long), 3, temperature=0, use_cache=False)
        assert lengths == [4, 5, 6]
    finally:
        hook.remove()


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(1, 15), min_size=2, max_size=4), n=st.integers(1, 12), seed=st.integers(0, 999))
def test_left_padded_batch_equals_prompts_one_at_a_time(model, lengths, n, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (1, L), generator=g) for L in lengths]
    T = max(lengths)
    batch = torch.cat([torch.cat([torch.full((1, T - p.shape[1]), 7), p], 1) for p in prompts])
    mask = torch.stack([torch.arange(T) >= T - p.shape[1] for p in prompts])
    for use_cache in (True, False):
        out = model.generate(batch, n, temperature=0, attention_mask=mask, use_cache=use_cache)
        for row, p in enumerate(prompts):
            alone = model.generate(p, n, temperature=0, use_cache=use_cache)[0]
            assert torch.equal(out[row, T - p.shape[1] :], alone)


def test_sampling_reproducible_with_generator_and_cache_independent(model):
    idx = torch.randint(0, V, (2, 5))
    kw = dict(temperature=0.9, top_k=10, top_p=0.95)
    a = model.generate(idx, 15, generator=torch.Generator().manual_seed(3), **kw)
    b = model.generate(idx, 15, generator=torch.Generator().manual_seed(3), **kw)
    c = model.generate(idx, 15, generator=torch.Generator().manual_seed(3), use_cache=False, **kw)
    assert torch.equal(a, b) and torch.equal(a, c)
    d = model.generate(idx, 15, generator=torch.Generator().manual_seed(4), **kw)
    assert not torch.equal(a, d)


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    idx = torch.randint(0, V, (2, 5))
    greedy = model.generate(idx, 10, temperature=0)
    assert torch.equal(model.generate(idx, 10, top_k=1), greedy)
    assert torch.equal(model.generate(idx, 10, top_p=1e-6), greedy)


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 12), p=st.floats(0.05, 1.0), temp=st.floats(0.3, 2.0), seed=st.integers(0, 999))
def test_sample_next_token_support_matches_explicit_filter(k, p, temp, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 12, generator=g, dtype=torch.float64).float() * 3
    # Explicit allowed set: the top k, then the smallest prefix (by probability) reaching p.
    probs = torch.softmax(logits[0].double() / temp, -1)
    order = probs.argsort(descending=True).tolist()[:k]
    kept = probs[order] / probs[order].sum()
    allowed, total = set(), 0.0
    for tok, q in zip(order, kept.tolist(), strict=True):
        if total >= p - 1e-9 and allowed:
            break
        allowed.add(tok)
        total += q
    draws = {int(sample_next_token(logits, temperature=temp, top_k=k, top_p=p, generator=g)[0]) for _ in range(200)}
    assert draws <= allowed
    if len(allowed) == 1:
        assert draws == allowed


def _filtered_distribution(logits: torch.Tensor, temp: float, k: int | None, p: float | None) -> torch.Tensor:
    """The distribution top-k / top-p / temperature sampling draws from, in float64, by hand."""
    probs = torch.softmax(logits.double() / temp, -1)  # (V,)
    order = probs.argsort(descending=True).tolist()[: k or len(probs)]
    kept = probs[order] / probs[order].sum()  # renormalised over the top k
    out, total = torch.zeros_like(probs), 0.0
    for tok, q in zip(order, kept.tolist(), strict=True):
        if p is not None and total >= p:  # the tokens before it already reach p
            break
        out[tok] = q
        total += q
    return out / out.sum()


@pytest.mark.parametrize(
    ("temp", "k", "p"),
    [(0.5, None, None), (2.0, None, None), (1.5, 3, None), (1.0, None, 0.7), (0.7, 5, 0.8), (1.3, 6, 0.9)],
)
def test_sampled_frequencies_follow_the_filtered_softmax(temp, k, p):
    """Not just the support: each allowed token comes up as often as the filtered, renormalised
    softmax says (20,000 draws; the tolerance is about 4 standard deviations)."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    want = _filtered_distribution(logits, temp, k, p)
    n = 20_000
    g = torch.Generator().manual_seed(1234)
    draws = sample_next_token(logits.expand(n, -1), temperature=temp, top_k=k, top_p=p, generator=g)  # (n,)
    freq = torch.bincount(draws, minlength=len(logits)).double() / n
    assert set(draws.tolist()) == set(want.nonzero().flatten().tolist())  # every allowed token, nothing else
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)


def test_sampling_frequencies_follow_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_next_token(logits, generator=g) for _ in range(4000)]).flatten()
    freq = torch.bincount(draws, minlength=4).double() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[0].double(), -1), atol=0.03, rtol=0)


def test_eos_stops_rows_and_fills_them(model):
    """Each row follows greedy decoding up to its first eos, then holds eos; generation ends as
    soon as every row has stopped, and runs to max_new_tokens while one has not."""
    cands = torch.randint(0, V, (64, 4), generator=torch.Generator().manual_seed(0))
    greedy = model.generate(cands, 8, temperature=0)[:, 4:]  # (64, 8) new tokens
    eos = int(greedy[0, 2])  # candidate 0 emits it by its 3rd new token
    first = {r: int((greedy[r] == eos).nonzero()[0]) for r in range(64) if (greedy[r] == eos).any()}
    never = [r for r in range(64) if r not in first]
    late = max((r for r in first if first[r] < 7), key=first.get)  # stops, but before the last token
    assert first[late] > first[0] and never, "the seeded candidates no longer cover the cases"

    def check(rows: list[int]) -> torch.Tensor:
        out = model.generate(cands[rows], 8, temperature=0, eos_id=eos)[:, 4:]
        for got, r in zip(out, rows, strict=True):
            stop = first.get(r, 8)
            assert torch.equal(got[: stop + 1], greedy[r, : stop + 1]) and torch.all(got[stop:] == eos)
        return out

    assert check([0, late]).shape[1] == first[late] + 1  # everybody stopped: ends at the last stop
    assert check([0, never[0]]).shape[1] == 8  # one row never stops: all 8 new tokens


def test_stream_yields_the_generate_tokens_and_checks_eagerly(model):
    idx = torch.randint(0, V, (2, 3))
    steps = list(model.stream(idx, 7, temperature=0))
    assert all(s.shape == (2,) for s in steps)
    assert torch.equal(torch.stack(steps, 1), model.generate(idx, 7, temperature=0)[:, 3:])
    with pytest.raises(ValueError, match="temperature"):
        model.stream(idx, 3, temperature=-1)  # raised at the call, before any next()


def test_generate_restores_training_mode_and_makes_no_graph(model):
    """Each module's mode as it was (a block left in eval mode inside a model in training mode stays
    so), none training meanwhile: a model with dropout generates the tokens of its eval mode."""
    model.train()
    model.trf_blocks[0].eval()
    modes = [m.training for m in model.modules()]
    try:
        out = model.generate(torch.zeros(1, 2, dtype=torch.long), 3)
        assert [m.training for m in model.modules()] == modes and not out.requires_grad
    finally:
        model.eval()
    torch.manual_seed(0)
    dropped = GPT(GPTConfig(**{**model.config.to_dict(), "drop_rate": 0.5}))  # (in training mode)
    idx = torch.randint(0, V, (2, 4))
    got = dropped.generate(idx, 6, temperature=0)
    assert dropped.training and torch.equal(got, dropped.eval().generate(idx, 6, temperature=0))


def test_zero_new_tokens_returns_prompt(model):
    idx = torch.randint(0, V, (2, 3))
    assert torch.equal(model.generate(idx, 0), idx)


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(eos_id=V), ValueError, "eos_id"),
        (dict(idx=torch.zeros(3, dtype=torch.long)), ValueError, r"shape \(batch, tokens\)"),
        (dict(idx=torch.zeros(1, 3)), TypeError, "integer token ids"),
        (dict(idx=torch.full((1, 3), V)), ValueError, "idx values"),
        (dict(attention_mask=torch.tensor([[1, 1, 0]])), ValueError, "left padding"),
        (dict(attention_mask=torch.tensor([[0, 0, 0]])), ValueError, "no real token"),
        (dict(attention_mask=torch.ones(1, 4)), ValueError, "attention_mask must have shape"),
        (dict(use_cache="no"), TypeError, "use_cache must be a bool, got 'no'"),  # (bool('no') is True)
    ],
)
def test_bad_generate_arguments(model, kwargs, err, match):
    args = dict(idx=torch.zeros(1, 3, dtype=torch.long), max_new_tokens=2)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        model.generate(args.pop("idx"), args.pop("max_new_tokens"), **args)


@pytest.mark.parametrize(
    ("logits", "kwargs", "match"),
    [
        (torch.randn(2, 10), dict(top_k=0), "top_k"),
        (torch.randn(2, 10), dict(top_k=-1), "top_k"),
        (torch.randn(2, 10), dict(top_p=0.0), "top_p"),
        (torch.randn(2, 10), dict(temperature=-1.0), "temperature"),
        (
            torch.randn(10),
            {},
            r"logits must have shape \(B, V\) with V >= 1; for one row use logits\[None\]; got \(10,\)",
        ),
        (torch.zeros(2, 0), {}, r"with V >= 1.*got \(2, 0\)"),
        (torch.tensor([[0.0, 1.0], [float("-inf"), float("-inf")]]), {}, "a finite value in every row"),
        (torch.tensor([[0.0, float("inf")]]), {}, "must be finite or -inf"),
        (torch.tensor([[0.0, float("nan")]]), {}, "must be finite or -inf"),
    ],
)
def test_bad_sample_next_token_arguments(logits, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sample_next_token(logits, **kwargs)
    with pytest.raises(TypeError, match="logits must be a float tensor"):
        sample_next_token(torch.randint(0, 5, (2, 10)))


def test_tiny_temperature_is_greedy_not_nan(model):
    # logits / 1e-40 overflowed float32 to inf and the softmax to NaN.
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 5
    for t in (1e-40, 1e-30, 1e-6):
        assert torch.equal(sample_next_token(logits, temperature=t), logits.argmax(-1))
    idx = torch.randint(0, V, (2, 3))
    torch.testing.assert_close(model.generate(idx, 4, temperature=1e-40), model.generate(idx, 4, temperature=0))


@pytest.mark.parametrize("fast", [False, True])
def test_a_nan_weight_stops_generation_instead_of_giving_tokens(model, fast):
    """A broken query weight makes every query NaN: the attention passes the NaN on (torch's CPU kernel
    alone would have made those rows zeros) and generation refuses the NaN logits."""
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.trf_blocks[0].att.W_query.weight[0, 0] = float("nan")
    idx = torch.randint(0, V, (1, 5))
    assert broken(idx).isnan().all()
    with pytest.raises(ValueError, match="logits hold NaN"):
        broken.generate(idx, 3, temperature=0, fast=fast)


@pytest.mark.parametrize("overrides", [dict(n_kv_heads=2), dict(n_kv_heads=1, qkv_bias=False, bias=False)])
def test_grouped_query_models_cache_and_pad_correctly(overrides):
    torch.manual_seed(2)
    m = GPT(GPTConfig(vocab_size=V, context_length=C, emb_dim=32, n_heads=4, n_layers=2, **overrides)).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(8)
    idx = torch.randint(0, V, (2, 5))
    want, want_logits = naive_greedy(m, idx, 14)
    got, logits = m.generate(idx, 14, temperature=0, return_logits=True)
    assert torch.equal(got, want)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), idx[1:, :2]], 1)  # row 1's first 2 tokens, left-padded
    both = torch.cat([idx[:1], padded])
    mask = torch.tensor([[True] * 5, [False] * 3 + [True] * 2])
    out = m.generate(both, 6, temperature=0, attention_mask=mask)
    assert torch.equal(out[1, 3:], m.generate(idx[1:, :2], 6, temperature=0)[0])


@settings(max_examples=60, deadline=None)
@given(
    shape=st.sampled_from([(1, 7), (3, 49), (2, 2, 300), (5,)]),
    levels=st.integers(1, 6),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    seed=st.integers(0, 2**16),
)
def test_greedy_tokens_are_argmax_the_first_of_ties(shape, levels, dtype, seed):
    """decoding.greedy_tokens (greedy decoding's token, by max(dim).indices) is torch.argmax of the last
    dimension, ties included (few distinct values: many ties), any dtype and batch shape; and the
    first index holding the maximum, by a loop."""
    from attnlab.decoding import greedy_tokens

    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, shape, generator=g).to(dtype) - 0.5
    got = greedy_tokens(logits)
    assert got.dtype == torch.long and torch.equal(got, logits.argmax(dim=-1))
    rows = logits.reshape(-1, shape[-1]).tolist()
    first = [max(range(len(r)), key=lambda j, r=r: (r[j], -j)) for r in rows]
    assert got.reshape(-1).tolist() == first


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # learned positions (GPT-2's branch of decode_logits)
        dict(pos="rope", norm="rmsnorm", mlp="swiglu", n_kv_heads=2, bias=False, qkv_bias=False),
        dict(pos="rope", parallel_residual=True),
    ],
)
def test_last_only_prefill_runs_the_last_mlp_on_the_last_position(overrides):
    """decode_logits(last_only=True), a prefill: the last position's logits of the full forward (float64),
    the same keys and values in the caches, and the last block's MLP fed that position alone (its
    forward, wrapped, sees one row a prompt); with an attnlab hook on that block, or a torch hook in it,
    every position as before."""
    torch.manual_seed(3)
    cfg = GPTConfig(vocab_size=V, context_length=16, emb_dim=32, n_heads=4, n_layers=3, drop_rate=0.0, **overrides)
    m = GPT(cfg).double().eval()
    idx = torch.randint(0, V, (2, 9))
    seen: list[tuple[int, ...]] = []
    ff = m.trf_blocks[-1].ff
    forward = ff.forward  # wrapped, not hooked: a torch hook turns last_only off (below)
    ff.forward = lambda x: (seen.append(tuple(x.shape)), forward(x))[1]
    with torch.no_grad():
        want = m(idx)[:, -1:]  # (B, 1, V)
        full_caches, caches = m.new_kv_caches(2, 16), m.new_kv_caches(2, 16)
        m.decode_logits(idx, None, full_caches)
        seen.clear()
        got = m.decode_logits(idx, None, caches, last_only=True)
        assert seen == [(2, 1, 32)]
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        for a, b in zip(caches, full_caches, strict=True):
            assert a.seen == b.seen == 9
            assert torch.equal(a.keys[:, :, :9], b.keys[:, :, :9])
            assert torch.equal(a.values[:, :, :9], b.values[:, :, :9])
        seen.clear()
        m.trf_blocks[-1].hook = lambda name, x: x  # an attnlab hook reads every position
        try:
            torch.testing.assert_close(m.decode_logits(idx, None, m.new_kv_caches(2, 16), last_only=True), want)
        finally:
            m.trf_blocks[-1].hook = None
        assert seen == [(2, 9, 32)]
        for module in (m.trf_blocks[-1], ff):  # a torch hook on the block or inside it: every position too
            hooked: list[tuple[int, ...]] = []
            handle = module.register_forward_hook(lambda mod, args, out, hooked=hooked: hooked.append(out.shape))
            try:
                seen.clear()
                torch.testing.assert_close(m.decode_logits(idx, None, m.new_kv_caches(2, 16), last_only=True), want)
                assert seen == [(2, 9, 32)] and hooked == [(2, 9, 32)]
                seen.clear()
                m.generate(idx, 1, temperature=0)  # the prefill of a generation likewise
                assert seen == [(2, 9, 32)]
            finally:
                handle.remove()


def test_the_top_p_nucleus_is_the_exact_one():
    # The smallest set of most probable tokens whose mass reaches top_p, counted exactly: float32's
    # running sum put the cut one token off in some rows (16 of 50 flat tokens kept for 0.3, not 15).
    from attnlab.generation import SamplingConfig

    transformers = pytest.importorskip("transformers")
    flat = torch.zeros(1, 50)
    assert int((SamplingConfig(top_p=0.3).probabilities(flat) > 0).sum()) == 15
    g = torch.Generator().manual_seed(0)
    for logits in (torch.randn(400, 64, generator=g) * 3, torch.randn(400, 3000, generator=g) * 4):
        for top_p in (0.5, 0.9, 0.95, 0.99):
            kept = (SamplingConfig(top_p=top_p).probabilities(logits) > 0).sum(-1)  # (rows,)
            probs = torch.softmax(logits.double(), -1).sort(-1, descending=True).values
            exact = ((probs.cumsum(-1) - probs) < top_p).sum(-1)  # tokens before which the mass is short of top_p
            assert torch.equal(kept, exact), (top_p, (kept != exact).nonzero()[:3].tolist())
    warper = transformers.TopPLogitsWarper(top_p=0.99)  # (its own float32 sum agrees on this row)
    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(715)) * 3
    want = int(torch.isfinite(warper(None, row.clone())).sum())
    assert int((SamplingConfig(top_p=0.99).probabilities(row) > 0).sum()) == want == 24


def test_float64_logits_past_float32s_range_and_huge_temperatures():
    from attnlab.generation import SamplingConfig

    big = torch.tensor([[1e39, 0.0, -1.0]], dtype=torch.float64)  # (NaN probabilities, then multinomial's error)
    assert torch.equal(SamplingConfig().probabilities(big), torch.tensor([[1.0, 0.0, 0.0]]))
    assert int(sample_next_token(big, temperature=1.0)[0]) == 0
    with pytest.raises(ValueError, match=r"temperature must be a float in \[0, 3.4e38\]"):
        SamplingConfig(temperature=1e39)  # (divided by inf: uniform, or NaN beside an -inf)
    hot = SamplingConfig(temperature=1e38, top_k=1).probabilities(torch.tensor([[1.0, 2.0, 3.0]]))
    assert torch.equal(hot, torch.tensor([[0.0, 0.0, 1.0]]))
