"""attnlab.interpret.retrace: the attention of a prompt that begins like one traced before, computed by
running only its new tokens over the kept keys and values, against a fresh ``trace`` of the whole
prompt (the reference), for every family of positions and masks, and for random sequences of edits
(hypothesis): typing, deleting, pasting in the middle.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.interpret import KeptTrace, retrace, shared_prefix, trace
from attnlab.model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread_module")  # one torch thread (conftest.py)

V, C = 40, 64
SMALL = dict(vocab_size=V, context_length=C, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0)
LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2)
FAMILIES = {
    "gpt2": {},  # learned positions, no mask but causality
    "llama": LLAMA,  # RoPE, grouped-query attention
    "mistral-window": {**LLAMA, "window": 5, "sinks": 1},  # a sliding window shorter than the prompts
    "alibi": {"pos": "alibi"},  # an additive float bias
    "nope": {"pos": "none", "qk_norm": True},
    "gemma2": {
        **LLAMA,
        "attn_softcap": 20.0,
        "window": 6,
        "window_layers": [0],
        "post_norms": True,
        "embed_scale": 5.0,
        "attn_scale": 0.3,
    },
    "neox": {**LLAMA, "rotary_fraction": 0.5, "parallel_residual": True, "n_kv_heads": None},
}


def sharp(family: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> GPT:
    """A small model of ``family`` whose attention is far from uniform (so a wrong row shows)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**SMALL, **FAMILIES[family])).eval()
    with torch.no_grad():
        for block in model.trf_blocks:
            block.att.W_query.weight.normal_(0, 0.6)
            block.att.W_key.weight.normal_(0, 0.6)
    return model.to(dtype)


MODELS = {name: sharp(name) for name in FAMILIES}


def same_as_fresh(kept: KeptTrace, model: GPT, idx: torch.Tensor, atol: float = 2e-6) -> None:
    """``kept.trace`` is what ``trace(model, idx, stages=False, logits=False)`` records."""
    fresh = trace(model, idx, stages=False, logits=False)
    got = kept.trace
    assert torch.equal(got.idx, fresh.idx)
    assert got.logits is None and not got.has_stages
    torch.testing.assert_close(got.weights, fresh.weights, rtol=1e-5, atol=atol)
    assert got.weights.dtype == torch.float32
    assert got.scale == fresh.scale and got.is_causal == fresh.is_causal and got.softcaps == fresh.softcaps
    T = idx.shape[-1]
    lower = torch.tril(torch.ones(T, T, dtype=torch.bool))  # what causal attention reads of a mask
    for a, b in zip(got.masks, fresh.masks, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype
            shape = torch.broadcast_shapes(a.shape, b.shape)
            a, b = a.expand(shape), b.expand(shape)
            torch.testing.assert_close(a[..., lower], b[..., lower], rtol=0, atol=0)
    # The kept keys and values are those of a pass over the whole prompt: the next edit starts from them.
    assert [c.seen for c in kept.caches] == [T] * len(kept.caches)


def ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_an_edit_runs_only_the_new_tokens_and_equals_a_fresh_trace(family):
    model = MODELS[family]
    first = ids(20, 1)
    edited = torch.cat([first[:, :14], ids(9, 2)], dim=1)  # 6 tokens replaced by 9 others
    kept = retrace(model, first)
    assert kept.reused == 0
    same_as_fresh(kept, model, first)
    queries = []
    handle = model.trf_blocks[0].register_forward_pre_hook(lambda m, a: queries.append(a[0].shape[1]))
    try:
        again = retrace(model, edited, kept)
    finally:
        handle.remove()
    assert again.reused == shared_prefix(first, edited) == 14
    assert queries == [9]  # one pass, over the 9 new tokens only
    same_as_fresh(again, model, edited)
    same_as_fresh(kept, model, first)  # the kept trace is left as it was


@pytest.mark.parametrize("family", ["gpt2", "mistral-window", "alibi"])
def test_a_deletion_back_to_a_prefix_runs_nothing(family):
    model = MODELS[family]
    full = ids(18, 3)
    kept = retrace(model, full)
    calls = []
    handle = model.trf_blocks[0].register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        cut = retrace(model, full[:, :11], kept)
    finally:
        handle.remove()
    assert calls == [] and cut.reused == 11
    same_as_fresh(cut, model, full[:, :11])
    same_as_fresh(
        retrace(model, torch.cat([full[:, :11], ids(4, 4)], 1), cut), model, torch.cat([full[:, :11], ids(4, 4)], 1)
    )


@pytest.mark.parametrize("family", ["llama", "alibi"])
def test_float64_models_agree_to_the_last_float32_bit(family):
    """In float64 the only difference left is rounding to the float32 of the weights tensor."""
    model = sharp(family, torch.float64)
    a = ids(24, 5)
    b = torch.cat([a[:, :20], ids(3, 6)], dim=1)
    same_as_fresh(retrace(model, b, retrace(model, a)), model, b, atol=1e-7)


edits = st.lists(
    st.tuples(
        st.sampled_from(["type", "delete", "replace", "paste"]),
        st.integers(1, 6),
        st.integers(0, 10_000),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(list(FAMILIES)), start=st.integers(1, 20), steps=edits, seed=st.integers(0, 1000))
def test_random_edit_sequences_equal_fresh_traces(family, start, steps, seed):
    """Typing (tokens appended), deleting (tokens removed at the end), replacing the last tokens, and
    pasting in the middle (the shared prefix ends there), each retraced from the previous result."""
    model = MODELS[family]
    cur = ids(start, seed)
    kept = retrace(model, cur)
    for kind, n, s in steps:
        T = cur.shape[1]
        if kind == "type":
            cur = torch.cat([cur, ids(n, s)], dim=1)
        elif kind == "delete":
            cur = cur[:, : max(1, T - n)]
        elif kind == "replace":
            cur = torch.cat([cur[:, : max(0, T - n)], ids(n, s)], dim=1)
        else:
            at = s % T
            cur = torch.cat([cur[:, :at], ids(n, s), cur[:, at:]], dim=1)
        cur = cur[:, :C]
        expected_reuse = shared_prefix(kept.trace.idx, cur)
        kept = retrace(model, cur, kept)
        assert kept.reused == expected_reuse
        same_as_fresh(kept, model, cur)


def test_batches_share_the_prefix_every_row_shares():
    model = MODELS["llama"]
    a = torch.cat([ids(12, 7), ids(12, 8)])  # (2, 12)
    b = a.clone()
    b[1, 9] = (b[1, 9] + 1) % V  # row 1 differs from position 9
    b = torch.cat([b, torch.cat([ids(3, 9), ids(3, 10)])], dim=1)  # (2, 15)
    kept = retrace(model, b, retrace(model, a))
    assert kept.reused == 9
    same_as_fresh(kept, model, b)
    assert shared_prefix(a, b[:1]) == 0  # another batch size shares nothing


def test_training_mode_and_hooks_are_restored():
    model = MODELS["gpt2"]
    model.train()
    try:
        kept = retrace(model, ids(8, 11))
        retrace(model, ids(10, 12), kept)
        assert model.training
        assert all(b.hook is None and b.att.hook is None for b in model.trf_blocks)
    finally:
        model.eval()


def test_bad_arguments_are_named():
    model = MODELS["gpt2"]
    kept = retrace(model, ids(6, 13))
    with pytest.raises(TypeError, match="kept must be a KeptTrace"):
        retrace(model, ids(6, 13), kept.trace)
    with pytest.raises(ValueError, match="another model"):
        retrace(MODELS["llama"], ids(6, 13), kept)
    with pytest.raises(TypeError, match="trf_blocks"):
        retrace(torch.nn.Linear(2, 2), ids(6, 13))
    with pytest.raises(ValueError, match="context_length"):
        retrace(model, torch.zeros(1, C + 1, dtype=torch.long), kept)


@pytest.mark.slow
def test_smollm2_typing_equals_fresh_traces(smollm2_gguf):
    """The real model (30 layers, grouped-query RoPE attention): a 120-token prompt typed on, a word at
    a time, then a word deleted, each retraced from the last and compared with a fresh trace."""
    from attnlab.tools.loading import load_pretrained

    loaded = load_pretrained(str(smollm2_gguf), dtype=torch.float32)
    text = "I had always thought Jack Gisburn rather a cheap genius--though a good fellow enough--so it was no"
    base = text * 2
    typed = [base, base + " great", base + " great surprise", base + " great surprise to me", base + " great surprise"]
    kept = None
    for prompt in typed:
        idx = torch.tensor([loaded.tokenizer.encode(prompt)])
        reused = 0 if kept is None else shared_prefix(kept.trace.idx, idx)
        kept = retrace(loaded.model, idx, kept)
        assert kept.reused == reused
        same_as_fresh(kept, loaded.model, idx, atol=1e-5)
