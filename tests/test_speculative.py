"""Speculative decoding (:mod:`attnlab.speculative`) against plain greedy decoding, the reference.

Small models built from configs, in float64 (the verification forward of several tokens and the
single steps of plain decoding then agree to rounding: no greedy token can flip on a near tie): the
tokens and the logits of ``generate(prompt_lookup=k)`` / ``generate(draft_model=m)`` must equal those
of ``generate(fast=False)``, token for token, with guesses actually kept (the stats say so) and
rejected ones rolled back.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import speculative
from attnlab.model import GPT, GPTConfig

V = 37
BASE = dict(vocab_size=V, context_length=64, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0)
LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)
FAMILIES = {
    "gpt2": dict(qkv_bias=True),  # learned positions: plain caches
    "llama-gqa": dict(LLAMA, n_kv_heads=2),  # relative positions: ring caches that never wrap here
    "gpt2-window": dict(qkv_bias=True, window=60),
    "alibi": dict(pos="alibi", norm="rmsnorm"),  # the fast step does not cover it: eager single steps
}


def make(overrides: dict, seed: int = 0, **cfg) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**BASE, **overrides, **cfg})).double().eval()
    with torch.no_grad():  # larger than the init: peaked next-token distributions
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3)
    return model


def repetitive(T: int, seed: int) -> torch.Tensor:
    """A prompt that repeats a random phrase: prompt lookup finds matches in it."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, V, (max(2, T // 3),), generator=g)
    return phrase.repeat(4)[:T][None]  # (1, T)


def assert_same(ref, got) -> None:
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_lookup_equals_greedy(family):
    model = make(FAMILIES[family])
    idx = repetitive(20, seed=1)
    ref = model.generate(idx, 30, temperature=0, fast=False, return_logits=True)
    for k in (1, 3, 8):
        got = model.generate(idx, 30, temperature=0, prompt_lookup=k, return_logits=True)
        assert_same(ref, got)
    ids, logits, stats = speculative.speculative_decode(model, idx, 30, k=3, return_logits=True)
    assert_same(ref, (ids, logits))
    assert stats.accepted > 0 and stats.rounds < 29  # guesses were kept: fewer forwards than tokens
    assert stats.drafted >= stats.accepted


@pytest.mark.parametrize("family", ["gpt2", "llama-gqa"])
def test_a_draft_model_equals_greedy(family):
    model = make(FAMILIES[family])
    small = make(
        FAMILIES[family],
        seed=5,
        n_layers=1,
        emb_dim=16,
        n_heads=2,
        **({"n_kv_heads": 1} if "n_kv_heads" in FAMILIES[family] else {}),
    )
    idx = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(2))
    ref = model.generate(idx, 25, temperature=0, fast=False, return_logits=True)
    for k in (1, 4):
        assert_same(ref, model.generate(idx, 25, temperature=0, draft_model=small, draft_tokens=k, return_logits=True))
    # The model as its own draft: every guess is kept, so each round adds k + 1 tokens.
    ids, logits, stats = speculative.speculative_decode(model, idx, 25, k=4, draft_model=model, return_logits=True)
    assert_same(ref, (ids, logits))
    # 25 = 1 (the prefill) + 4 rounds of 4 guesses + 1, and a last round of the 3 guesses still wanted + 1
    assert stats.accepted == stats.drafted == 19 and stats.rounds == 5


def test_the_eager_path_and_a_hook_give_the_same_tokens():
    """fast=False (every forward eager) and a model with a forward hook (the fast step stands aside)."""
    model = make(FAMILIES["llama-gqa"])
    idx = repetitive(15, seed=3)
    ref = model.generate(idx, 20, temperature=0, fast=False)
    assert torch.equal(model.generate(idx, 20, temperature=0, prompt_lookup=4, fast=False), ref)
    calls = []
    handle = model.trf_blocks[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        assert torch.equal(model.generate(idx, 20, temperature=0, prompt_lookup=4), ref)
    finally:
        handle.remove()
    assert calls  # the hook saw the forwards


@settings(max_examples=20, deadline=None)
@given(T=st.integers(1, 20), n=st.integers(0, 24), k=st.integers(1, 6), seed=st.integers(0, 2**16), eos=st.booleans())
def test_any_prompt_length_and_stop_id(T, n, k, seed, eos):
    model = _hyp_model()
    idx = (
        repetitive(T, seed) if seed % 2 else torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(seed))
    )
    stop = int(idx[0, -1]) if eos else None  # a token the text is likely to produce again
    ref = model.generate(idx, n, temperature=0, eos_id=stop, fast=False, return_logits=True)
    got = model.generate(idx, n, temperature=0, eos_id=stop, prompt_lookup=k, return_logits=True)
    assert_same(ref, got)


_HYP = {}


def _hyp_model() -> GPT:
    if "m" not in _HYP:
        _HYP["m"] = make(FAMILIES["llama-gqa"], seed=7)
    return _HYP["m"]


def test_lookup_draft_takes_the_latest_longest_match():
    seq = [1, 2, 3, 9, 1, 2, 4, 7, 2]
    assert speculative.lookup_draft(seq, 2) == [4, 7]  # tail [2]: latest earlier occurrence at index 5
    assert speculative.lookup_draft([*seq, 4], 3) == [7, 2, 4]  # tail [2, 4] found
    assert speculative.lookup_draft([1, 2, 3], 4) == []  # nothing repeats
    assert speculative.lookup_draft([5], 4) == []
    # Against brute force: whatever it returns follows an earlier occurrence of the tail.
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        s = torch.randint(0, 4, (int(torch.randint(1, 15, (1,), generator=g)),), generator=g).tolist()
        d = speculative.lookup_draft(s, 3)
        if d:
            assert any(
                s[i : i + n] == s[-n:] and s[i + n : i + n + len(d)] == d for n in (1, 2, 3) for i in range(len(s) - n)
            )
        else:
            assert s[-1] not in s[:-1]  # a guess exists whenever the last token occurred before


def test_training_mode_comes_back():
    model = make(FAMILIES["gpt2"]).train()
    draft = make(FAMILIES["gpt2"], seed=1).train()
    model.generate(repetitive(10, 0), 5, temperature=0, draft_model=draft)
    assert model.training and draft.training
    # A submodule left in eval mode stays so (model.train() after the run once put it back in training).
    model.trf_blocks[0].eval()
    for kw in (dict(draft_model=draft), dict(prompt_lookup=2)):
        model.generate(repetitive(10, 0), 5, temperature=0, **kw)
        assert model.training and not model.trf_blocks[0].training and not model.trf_blocks[0].att.training


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        (dict(temperature=0.7, prompt_lookup=3), ValueError, "temperature=0"),
        (dict(temperature=0, prompt_lookup=0), ValueError, "prompt_lookup must be a positive int"),
        (dict(temperature=0, prompt_lookup=True), ValueError, "prompt_lookup must be a positive int"),
        (dict(temperature=0, draft_tokens=-2), ValueError, "draft_tokens must be a positive int"),  # (no draft model)
        (dict(temperature=0, generator="seed"), TypeError, "generator must be a torch.Generator or None, got str"),
        (dict(attention_mask=torch.tensor([[0, 7, 1, 1]])), ValueError, "attention_mask must be bool or 0/1"),
        (dict(temperature=0, prompt_lookup=2, use_cache=False), ValueError, "use_cache"),
        (dict(temperature=0, prompt_lookup=2, compile=True), ValueError, "compile=False"),
        (dict(temperature=0, prompt_lookup=2, draft_model="small"), ValueError, "not both"),
        (dict(temperature=0, prompt_lookup=2, return_logits="yes"), TypeError, "return_logits must be a bool"),
        (dict(temperature=0, draft_model="small"), TypeError, "draft_model must be an attnlab GPT"),
        (dict(temperature=0, draft_model=make(FAMILIES["gpt2"], vocab_size=V + 1)), ValueError, "vocabulary"),
        (
            dict(temperature=0, draft_model=make(FAMILIES["gpt2"], context_length=16)),
            ValueError,
            r"draft_model.s context \(16 tokens\) must hold the prompt and the new tokens, got 4 \+ 20",
        ),
    ],
)
def test_bad_arguments(kw, error, match):
    model = make(FAMILIES["gpt2"])
    with pytest.raises(error, match=match):
        model.generate(torch.zeros(1, 4, dtype=torch.long), 20, **kw)


def test_batches_and_long_texts_are_refused():
    model = make(FAMILIES["gpt2"])
    with pytest.raises(ValueError, match="batch 1"):
        model.generate(torch.zeros(2, 4, dtype=torch.long), 5, temperature=0, prompt_lookup=2)
    with pytest.raises(ValueError, match=r"context \(64 tokens\), got 60 \+ 5"):
        model.generate(torch.zeros(1, 60, dtype=torch.long), 5, temperature=0, prompt_lookup=2)
    windowed = make(FAMILIES["llama-gqa"], window=16)
    with pytest.raises(ValueError, match=r"window \(16 tokens\)"):
        windowed.generate(torch.zeros(1, 10, dtype=torch.long), 7, temperature=0, prompt_lookup=2)


@pytest.mark.slow
def test_smollm2_prompt_lookup_equals_greedy(smollm2_gguf):
    """The real model in float32 on a text that repeats its prompt: the same tokens as greedy decoding."""
    from attnlab.tools.loading import load_pretrained

    loaded = load_pretrained(str(smollm2_gguf), dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    text = "The cat sat on the mat. The dog sat on the log. The cat sat on the"
    idx = torch.tensor([tok.encode(text)])
    ref = model.generate(idx, 24, temperature=0)
    ids, _, stats = speculative.speculative_decode(model, idx, 24, k=5)
    assert torch.equal(ids, ref)
    assert torch.equal(model.generate(idx, 24, temperature=0, prompt_lookup=5), ref)
    assert stats.accepted > 0
