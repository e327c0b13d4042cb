"""The inspector's cheaper computations held to the plain ones: the logit lens by chunks of positions
with its candidates searched in bfloat16, the next-token section by chunks, a trace without logits.

References are float64 (the lens through the model's own final norm and unembedding, in float64) or
the full computation the chunked one replaces."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import hardware
from attnlab.interpret import analysis, inspector, inspector_data, logit_lens, next_token_probabilities, trace
from attnlab.interpret.analysis import LENS_CANDIDATES
from attnlab.interpret.codec import to_json, unpack
from attnlab.interpret.inspector import TEMPERATURES
from attnlab.model import GPT, GPTConfig


def llama_like(vocab: int = 700, seed: int = 0, **overrides) -> GPT:
    """A small RoPE/RMSNorm/SwiGLU model with grouped keys (as SmolLM2) and a vocabulary much larger
    than the lens's candidates, so the bfloat16 search decides which tokens are scored exactly."""
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=vocab,
        context_length=64,
        emb_dim=48,
        n_heads=6,
        n_kv_heads=2,
        n_layers=3,
        drop_rate=0.0,
        pos="rope",
        norm="rmsnorm",
        mlp="swiglu",
        ff_dim=96,
        bias=False,
        tie_embeddings=True,
        **overrides,
    )
    model = GPT(cfg).eval()
    with torch.no_grad():  # logits with a realistic spread: peaked at some positions, flat at others
        model.tok_emb.weight.mul_(4.0)
    return model


def lens_reference(model: GPT, tr, k: int):
    """The logit lens in float64, the whole vocabulary at once: ``(probs (L+1, B, T, V), final (B, T))``
    (the logits soft-capped as the model's, ``cap * tanh(logits / cap)``, where it caps them)."""
    m64 = GPT(model.config).eval().double()
    m64.load_state_dict(model.state_dict())
    cap = model.config.logit_softcap
    with torch.no_grad():
        logits = [m64.out_head(m64.final_norm(r.double())) for r in tr.residual]
        rows = [torch.softmax(z if cap is None else cap * torch.tanh(z / cap), -1) for z in logits]
    return torch.stack(rows), tr.logits.argmax(-1)


def check_lens(lens, probs64, final, k, atol, rtol):
    top = torch.topk(probs64, k, dim=-1)
    # The probabilities of the ids chosen, and the k largest probabilities: equal to the reference's
    # (a near tie may order two ids either way; their probabilities must still be right).
    torch.testing.assert_close(lens.probs.double(), probs64.gather(-1, lens.tokens), atol=atol, rtol=rtol)
    torch.testing.assert_close(lens.probs.double(), top.values, atol=atol, rtol=rtol)
    want_final = probs64.gather(-1, final[None, ..., None].expand(probs64.shape[0], -1, -1, 1)).squeeze(-1)
    torch.testing.assert_close(lens.final_token_probs.double(), want_final, atol=atol, rtol=rtol)
    clear = (top.values[..., k - 1] - probs64.topk(k + 1, dim=-1).values[..., k]) > 1e-6  # no near tie
    assert torch.equal(lens.tokens[clear], top.indices[clear])


@pytest.mark.parametrize("search", [None, torch.bfloat16, torch.float32])
def test_the_lens_of_a_soft_capped_model_caps_every_row(search):
    """Gemma 2's logit soft cap: every layer's row capped as the model's own logits (the last row), the
    exact lens whatever the search asked for."""
    model = llama_like(logit_softcap=3.0)
    idx = torch.randint(0, 700, (2, 11), generator=torch.Generator().manual_seed(4))
    tr = trace(model, idx, stages=True)
    probs64, final = lens_reference(model, tr, 5)
    check_lens(logit_lens(model, tr, k=5, search_dtype=search), probs64, final, 5, atol=1e-6, rtol=1e-5)
    rows = analysis.lens_logits(model, tr.residual[-1])  # (B, T, V): the model's own logits
    torch.testing.assert_close(rows, tr.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("search", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("chunk", [1, 5, 32])
def test_chunked_lens_equals_the_float64_lens_of_the_whole_vocabulary(search, chunk):
    model = llama_like()
    idx = torch.randint(0, 700, (2, 23), generator=torch.Generator().manual_seed(1))
    tr = trace(model, idx, stages=True)
    lens = logit_lens(model, tr, k=5, chunk=chunk, search_dtype=search)
    assert lens.tokens.shape == lens.probs.shape == (4, 2, 23, 5) and lens.final_token_probs.shape == (4, 2, 23)
    probs64, final = lens_reference(model, tr, 5)
    assert model.config.vocab_size > LENS_CANDIDATES  # the search leaves most of the vocabulary out
    # A bfloat16 search gets the normaliser's terms outside the candidates slightly wrong: within 0.1%.
    check_lens(lens, probs64, final, 5, atol=1e-6, rtol=1e-3 if search == torch.bfloat16 else 1e-5)


@settings(max_examples=10, deadline=None)
@given(k=st.integers(1, 12), chunk=st.integers(1, 40), seed=st.integers(0, 3))
def test_lens_does_not_depend_on_the_chunk(k, chunk, seed):
    model = llama_like(vocab=300, seed=seed)
    idx = torch.randint(0, 300, (1, 17), generator=torch.Generator().manual_seed(seed))
    tr = trace(model, idx, stages=True)
    whole = logit_lens(model, tr, k=k, chunk=10_000, search_dtype=torch.float32)
    got = logit_lens(model, tr, k=k, chunk=chunk, search_dtype=torch.bfloat16)
    torch.testing.assert_close(got.probs, whole.probs, atol=1e-6, rtol=1e-3)
    torch.testing.assert_close(got.final_token_probs, whole.final_token_probs, atol=1e-6, rtol=1e-3)


@settings(max_examples=10, deadline=None)
@given(data=st.data(), search=st.sampled_from([torch.bfloat16, torch.float32]))
def test_lens_of_a_window_of_positions_is_that_slice_of_the_whole_lens(data, search):
    model = llama_like(vocab=300)
    idx = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(2))
    tr = trace(model, idx, stages=True)
    start = data.draw(st.integers(0, 18))
    stop = data.draw(st.integers(start + 1, 19))
    chunk = data.draw(st.integers(1, 8))
    whole = logit_lens(model, tr, k=3, search_dtype=search)
    got = logit_lens(model, tr, k=3, chunk=chunk, search_dtype=search, positions=(start, stop))
    assert got.tokens.shape == (4, 2, stop - start, 3)
    torch.testing.assert_close(got.probs, whole.probs[:, :, start:stop], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got.final_token_probs, whole.final_token_probs[:, :, start:stop], atol=1e-6, rtol=1e-5)
    # the ids where no near tie could order two of them either way
    gap = whole.probs[..., :-1] - whole.probs[..., 1:]
    clear = (gap > 1e-5).all(-1)[:, :, start:stop]
    assert torch.equal(got.tokens[clear], whole.tokens[:, :, start:stop][clear])


def test_lens_chunks_span_layers_so_a_window_reads_the_unembedding_once_per_chunk(monkeypatch):
    # A window of a few positions (the page's dozen) is one product over all layers' streams, not one
    # per layer: each product reads the whole (V, d) unembedding, which is what a window costs.
    model = llama_like(vocab=300)
    idx = torch.randint(0, 300, (2, 19), generator=torch.Generator().manual_seed(3))
    tr = trace(model, idx, stages=True)
    calls = []
    rows = analysis._Search.rows
    monkeypatch.setattr(analysis._Search, "rows", lambda self, h, *a: calls.append(len(h)) or rows(self, h, *a))
    whole = logit_lens(model, tr, k=3, search_dtype=torch.bfloat16)
    got = logit_lens(model, tr, k=3, search_dtype=torch.bfloat16, positions=(5, 9))
    assert calls[-1:] == [3 * 2 * 4]  # 3 layers x 2 rows x 4 positions: one search
    torch.testing.assert_close(got.probs, whole.probs[:, :, 5:9], atol=1e-6, rtol=1e-5)
    calls.clear()
    logit_lens(model, tr, k=3, search_dtype=torch.bfloat16, positions=(5, 9), chunk=10)
    assert calls == [10, 10, 4]


def test_inspector_lens_window_holds_the_page_positions_it_names():
    model = llama_like(vocab=300)
    tr = trace(model, torch.randint(0, 300, (1, 15), generator=torch.Generator().manual_seed(3)), stages=True)
    whole = inspector_data(tr, sections={"lens"})["lens"]
    part = inspector_data(tr, sections={"lens"}, lens_window=(4, 11))["lens"]
    assert whole["start"] == 0 and part["start"] == 4
    w, p = (unpack(to_json({"x": d["probs"]}))["x"] for d in (whole, part))
    assert p.shape == (4, 7, 5)
    torch.testing.assert_close(p, w[:, 4:11], atol=1e-6, rtol=1e-5)
    for bad in [(0, 16), (5, 5), (-1, 3), (1.0, 3), "0:3"]:
        with pytest.raises(ValueError, match="lens_window"):
            inspector_data(tr, sections={"lens"}, lens_window=bad)


def test_lens_checks_its_arguments():
    model = llama_like(vocab=100)
    tr = trace(model, torch.arange(6)[None], stages=True)
    with pytest.raises(ValueError, match="chunk"):
        logit_lens(model, tr, chunk=0)
    for bad in [(0, 7), (3, 2), (True, 4), [1]]:
        with pytest.raises(ValueError, match="positions"):
            logit_lens(model, tr, positions=bad)
    light = trace(model, torch.arange(6)[None], stages=True, logits=False)
    with pytest.raises(ValueError, match="logits"):
        logit_lens(model, light)


def test_next_section_by_chunks_equals_the_library_distribution(monkeypatch):
    model = llama_like(vocab=200)
    idx = torch.randint(0, 200, (1, 11), generator=torch.Generator().manual_seed(2))
    tr = trace(model, idx, stages=True)
    monkeypatch.setattr(inspector, "NEXT_CHUNK", 4)  # 11 positions: chunks of 4, 4 and 3
    nxt = inspector_data(tr, sections={"next"}, next_k=7)["next"]
    ids = torch.frombuffer(bytearray(nxt["ids"].data), dtype=torch.int32).reshape(11, 7).long()
    probs = torch.frombuffer(bytearray(nxt["probs"].data), dtype=torch.float32).reshape(len(TEMPERATURES), 11, 7)
    assert torch.equal(ids, torch.topk(tr.logits[0], 7, dim=-1).indices)
    for i, t in enumerate(TEMPERATURES):
        want = next_token_probabilities(tr.logits[0], temperature=t).gather(-1, ids)
        torch.testing.assert_close(probs[i], want, atol=1e-9, rtol=1e-5)  # exp(log_softmax): float32 rounding


@settings(max_examples=40, deadline=None)
@given(spread=st.floats(1.0, 1e4), n=st.integers(1, 3000), seed=st.integers(0, 2**16), spend=st.booleans())
def test_logsumexp_at_equals_float64_logsumexp_for_any_spread(spread, n, seed, spend):
    # Spreads past ~87 make most exp(x - max) float32 denormals, which logsumexp_at lifts to the floor:
    # the result must still be float64's to float32 rounding.
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(seed)) * spread
    want = torch.logsumexp(x.double(), -1, keepdim=True)
    got = analysis.logsumexp_at(x.clone(), x.argmax(-1, keepdim=True), spend=spend)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-6)


def test_next_section_at_a_cold_temperature_equals_float64(monkeypatch):
    # Logits a hundred apart: at the page's coldest temperatures nearly every term of the softmax is
    # below float32's normal range, and the probabilities shown must still be the float64 ones.
    logits = torch.randn(9, 500, generator=torch.Generator().manual_seed(4)) * 100
    monkeypatch.setattr(inspector, "NEXT_CHUNK", 4)
    nxt = inspector._next_section(logits, 6)
    ids = torch.frombuffer(bytearray(nxt["ids"].data), dtype=torch.int32).reshape(9, 6).long()
    probs = torch.frombuffer(bytearray(nxt["probs"].data), dtype=torch.float32).reshape(len(TEMPERATURES), 9, 6)
    for i, t in enumerate(TEMPERATURES):
        want = torch.softmax(logits.double() / t, -1).gather(-1, ids)
        torch.testing.assert_close(probs[i].double(), want, atol=1e-44, rtol=1e-5)


def test_trace_without_logits_records_the_same_attention():
    model = llama_like(vocab=120)
    idx = torch.randint(0, 120, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False  # left padding
    full = trace(model, idx, stages=True, attention_mask=mask)
    light = trace(model, idx, attention_mask=mask, logits=False)
    assert light.logits is None and not light.has_stages
    torch.testing.assert_close(light.weights, full.weights, atol=0, rtol=0)
    staged = trace(model, idx, stages=True, attention_mask=mask, logits=False)
    torch.testing.assert_close(staged.residual, full.residual, atol=0, rtol=0)  # the stream after the last block too
    data = inspector_data(light, sections={"layers", "rollout"}, roles=False)
    assert len(data["layers"]) == 3 and data["rollout"] is not None
    with pytest.raises(ValueError, match="logits"):
        inspector_data(light, sections={"next"})
    with pytest.raises(ValueError, match="logits"):
        next_token_probabilities(light)
    assert model.training is False and all(b.hook is None and b.att.hook is None for b in model.trf_blocks)


def test_lens_search_falls_back_to_the_exact_lens_where_its_bound_fails(monkeypatch):
    # As many candidates as ids kept: the k-th exact logit never clears the best token left out by the
    # rounding bound, so every position is recomputed exactly: the float32 lens, bit for bit.
    model = llama_like()
    idx = torch.randint(0, 700, (1, 19), generator=torch.Generator().manual_seed(4))
    tr = trace(model, idx, stages=True)
    exact = logit_lens(model, tr, k=5, search_dtype=torch.float32)
    monkeypatch.setattr(analysis, "LENS_CANDIDATES", 5)
    got = logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    assert torch.equal(got.tokens, exact.tokens)
    torch.testing.assert_close(got.probs, exact.probs, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(got.final_token_probs, exact.final_token_probs, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_lens_default_searches_in_bfloat16_only_where_it_is_native(monkeypatch, native):
    model = llama_like()
    tr = trace(model, torch.randint(0, 700, (1, 9), generator=torch.Generator().manual_seed(5)), stages=True)
    monkeypatch.setattr(hardware, "bf16_native", lambda device="cpu": native)
    monkeypatch.setattr(analysis, "LENS_MIN_VOCAB", 100)  # a vocabulary of 700 counts as large
    got = logit_lens(model, tr)
    want = logit_lens(model, tr, search_dtype=torch.bfloat16 if native else torch.float32)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.probs, want.probs)
    monkeypatch.setattr(analysis, "LENS_MIN_VOCAB", 10_000)  # a small vocabulary: always exact
    small = logit_lens(model, tr)
    assert torch.equal(small.probs, logit_lens(model, tr, search_dtype=torch.float32).probs)
    with pytest.raises(ValueError, match="search_dtype"):
        logit_lens(model, tr, search_dtype=torch.int8)


@pytest.mark.slow
def test_smollm2_lens_equals_the_float64_lens(smollm2_gguf):
    from attnlab.tools.loading import load

    loaded = load(None, str(smollm2_gguf))
    model = loaded.model
    ids = loaded.tokenizer.encode(
        "The logit lens reads what each layer of the model would predict, if it stopped there."
    )
    tr = trace(model, torch.tensor([ids]), stages=True)
    W = model.out_head.weight.double()
    with torch.no_grad():
        rows = [torch.softmax(model.final_norm(r).double() @ W.T, -1) for r in tr.residual[:-1]]
        rows.append(torch.softmax(tr.logits.double(), -1))
    for search, rtol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-3)):  # exact, the bfloat16 search
        lens = logit_lens(model, tr, k=5, search_dtype=search)
        check_lens(lens, torch.stack(rows), tr.logits.argmax(-1), 5, atol=1e-5, rtol=rtol)
    # A longer text (the story's flat and peaked rows alike): the search against the exact float32
    # lens. The probabilities' relative error is the normaliser's: at most 0.2%, the bound logit_lens's docstring gives.
    text = " ".join(["The logit lens reads what each layer would predict, if it stopped there."] * 4)
    text += " It was a quiet evening in the small town; the painter had not touched a brush in years."
    tr = trace(model, torch.tensor([loaded.tokenizer.encode(text)]), stages=True)
    exact = logit_lens(model, tr, k=5, search_dtype=torch.float32)
    fast = logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    assert torch.equal(fast.tokens, exact.tokens)
    torch.testing.assert_close(fast.probs, exact.probs, atol=1e-6, rtol=2e-3)
    torch.testing.assert_close(fast.final_token_probs, exact.final_token_probs, atol=1e-6, rtol=2e-3)
