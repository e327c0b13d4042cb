"""Phi-3's LongRoPE (``rope_type: "longrope"``): one divisor per feature pair for short sequences and
another for sequences longer than the original context, and the cosines and sines scaled by
``sqrt(1 + ln(factor) / ln(original))``. The reference is transformers' Phi-3 built from a config (its
rotary embedding, its logits and its greedy tokens), on both sides of the original context; and a
GGUF file written as llama.cpp's converter writes one (``rope_factors_short/long`` and metadata)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attnlab import GPT
from attnlab.positions import rope_attention_factor, rope_cos_sin

transformers = pytest.importorskip("transformers")

ORIGINAL, CONTEXT, V = 16, 64, 67


def factors(seed: int = 0) -> tuple[list[float], list[float]]:
    """``(short, long)`` divisors of the 8 pairs of a head of 16: short near 1, long up to 8."""
    g = torch.Generator().manual_seed(seed)
    return (1 + 0.5 * torch.rand(8, generator=g)).tolist(), (1 + 7 * torch.rand(8, generator=g)).tolist()


def phi3_config(vocab: int = V):
    short, long = factors()
    return transformers.Phi3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=CONTEXT, original_max_position_embeddings=ORIGINAL,
        rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long}, pad_token_id=0,
        tie_word_embeddings=False,
    )  # fmt: skip


def phi3(seed: int = 1, vocab: int = V):
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(phi3_config(vocab))
    with torch.no_grad():  # weights larger than the init: peaked, varied next-token distributions
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p)) if "norm" in name else p.mul_(6)
    return model.eval()


def test_cos_sin_equal_transformers_below_and_past_the_original_context():
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rotary = Phi3RotaryEmbedding(phi3_config())
    short, long = factors()
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
               "original_max_position_embeddings": ORIGINAL, "factor": CONTEXT / ORIGINAL}  # fmt: skip
    for positions in (torch.arange(ORIGINAL)[None], torch.arange(40)[None], torch.tensor([[20]]), torch.tensor([[3]])):
        want_cos, want_sin = rotary(torch.zeros(1), positions)
        cos, sin = rope_cos_sin(positions, 16, 10000.0, scaling=scaling)
        torch.testing.assert_close(cos, want_cos, atol=0, rtol=0)
        torch.testing.assert_close(sin, want_sin, atol=0, rtol=0)
    assert rope_attention_factor(scaling) == pytest.approx((1 + np.log(4) / np.log(ORIGINAL)) ** 0.5)
    # the long divisors past the original context: the two sides differ
    at_20 = torch.tensor([[20]])
    same = {**scaling, "long_factor": short}
    assert not torch.allclose(rope_cos_sin(at_20, 16, scaling=scaling)[0], rope_cos_sin(at_20, 16, scaling=same)[0])


@pytest.mark.parametrize("T", [12, 40], ids=["short", "long"])
def test_logits_equal_transformers_phi3_on_both_sides(T):
    hf = phi3()
    ours = GPT.from_hf(hf)
    assert ours.config.rope_scaling["rope_type"] == "longrope"
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(idx).logits
        torch.testing.assert_close(ours(idx), want, atol=1e-4, rtol=1e-4)
    assert want.std() > 0.3


def test_greedy_tokens_across_the_original_context_equal_transformers():
    """Generation from 10 tokens to 30 crosses the original context of 16: each step's rotation turns
    long once its position passes it (the cached keys stay as they were), as transformers' does."""
    hf = phi3()
    ours = GPT.from_hf(hf)
    prompt = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(3))
    want = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    for fast in (True, False):
        assert torch.equal(ours.generate(prompt, 20, temperature=0, fast=fast), want)


@pytest.mark.parametrize("T", [15, 16, 17])
def test_a_stream_reading_each_token_gives_generates_tokens_across_the_original_context(T):
    # With a reading (serve's generation), the prompt's last token ran as a pass of its own, the ones
    # before it rotated short: past the original context, other tokens than generate's.
    from attnlab.generation import stream
    from attnlab.interpret.tracing import attention_rows

    ours = GPT.from_hf(phi3())
    prompt = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(T))
    want = ours.generate(prompt, 8, temperature=0)[:, T:]
    got = torch.stack([t for t, _, _ in stream(ours, prompt, 8, temperature=0, reading=attention_rows)], 1)
    assert torch.equal(got, want)


def test_speculative_decoding_across_the_original_context_is_refused_and_exact_on_either_side():
    # Its cache was never made again at the turn (plain decoding's is): other tokens than greedy.
    ours = GPT.from_hf(phi3())
    for T, new in ((4, 10), (20, 12)):  # below the turn, and past it: exact
        prompt = torch.randint(0, V, (1, T), generator=torch.Generator().manual_seed(T))
        want = ours.generate(prompt, new, temperature=0)
        assert torch.equal(ours.generate(prompt, new, temperature=0, prompt_lookup=3), want)
    prompt = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(3))
    with pytest.raises(ValueError, match=f"cannot cross LongRoPE's turn to its long factors at {ORIGINAL} tokens"):
        ours.generate(prompt, 20, temperature=0, prompt_lookup=3)


@pytest.mark.slow
def test_compiled_greedy_tokens_across_the_original_context_equal_transformers():
    """The same through the compiled step (torch.compile over the model's forward: the long/short choice
    is a select on the step's position, inside the graph)."""
    hf = phi3()
    prompt = torch.randint(0, V, (1, 10), generator=torch.Generator().manual_seed(3))
    want = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(GPT.from_hf(hf).generate(prompt, 20, temperature=0, compile=True), want)


def test_bad_longrope_options_are_value_errors():
    base = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": ORIGINAL}  # fmt: skip
    for bad, match in (
        ({"short_factor": None}, "'short_factor': a list of positive numbers"),
        ({"long_factor": [1.0, -2.0]}, "'long_factor': a list of positive numbers"),
        ({"long_factor": [2.0] * 7}, "of one length"),
        ({"original_max_position_embeddings": None}, "'original_max_position_embeddings'"),
        ({"attention_factor": 0.0}, "'attention_factor' must be a positive number"),
    ):
        with pytest.raises(ValueError, match=match):
            rope_cos_sin(torch.arange(4), 16, scaling=base | bad)
    with pytest.raises(ValueError, match="needs 4 factors"):
        rope_cos_sin(torch.arange(4), 8, scaling=base)


def test_a_phi3_gguf_file_with_longrope_factors_computes_transformers_model(tmp_path):
    """The tiny Phi-3 written as llama.cpp's converter writes a LongRoPE one (the two divisor tensors, the
    original context and the attention factor in its metadata): its config read back, its logits on both
    sides of the original context and its greedy tokens across it are transformers'."""
    pytest.importorskip("gguf")
    from gguf_files import VOCAB, write_family_gguf

    hf = phi3(vocab=VOCAB)  # (the vocabulary of the file's tiny tokenizer)
    short, long = (np.array(f, np.float32) for f in factors())
    extra = {"rope_factors_short.weight": short, "rope_factors_long.weight": long}
    meta = {"phi3.rope.scaling.attn_factor": float((1 + np.log(CONTEXT / ORIGINAL) / np.log(ORIGINAL)) ** 0.5)}
    path = write_family_gguf(tmp_path / "phi3.gguf", hf, meta=meta, tensors=lambda a: a | extra)
    ours = GPT.from_gguf(path, dtype=torch.float32)
    assert ours.config.rope_scaling["rope_type"] == "longrope"
    for T in (12, 40):
        idx = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(3))
    want = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, 20, temperature=0), want)
