"""``attnlab.generation.resume``: generate's decoding steps from caches that already hold the prompt.

Against :func:`attnlab.generation.generate` on the same model: caches filled by the prompt's pass and
its last logits give the same tokens and logits (greedy and sampled with the same generator).
"""

from __future__ import annotations

import pytest
import torch

from attnlab.generation import SamplingConfig, generate, resume
from attnlab.model import GPT, GPTConfig


def model_and_prompt(**overrides):
    torch.manual_seed(0)
    cfg = dict(vocab_size=53, context_length=32, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0)
    model = GPT(GPTConfig(**{**cfg, **overrides})).double().eval()
    return model, torch.randint(0, 53, (2, 6), generator=torch.Generator().manual_seed(1))


def prefilled(model, idx, new):
    caches = model.new_kv_caches(idx.shape[0], idx.shape[1] + new)
    with torch.inference_mode():
        logits = model.decode_logits(idx, None, caches, last_only=True)[:, -1]  # (B, V)
    return caches, logits


@pytest.mark.parametrize("overrides", [{}, dict(pos="rope", norm="rmsnorm", mlp="swiglu", n_kv_heads=2)])
@pytest.mark.parametrize("sampling", [SamplingConfig(0.0), SamplingConfig(0.9, top_k=20)])
def test_resume_equals_generate(overrides, sampling):
    model, idx = model_and_prompt(**overrides)
    kw = dict(temperature=sampling.temperature, top_k=sampling.top_k)
    want = generate(model, idx, 9, return_logits=True, generator=torch.Generator().manual_seed(3), **kw)
    caches, first = prefilled(model, idx, 9)
    got = resume(model, idx, caches, first, 9, sampling, torch.Generator().manual_seed(3))
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-10)


def test_resume_checks_its_caches_and_logits():
    model, idx = model_and_prompt()
    caches, first = prefilled(model, idx, 4)
    with pytest.raises(ValueError, match="caches"):
        resume(model, idx[:, :-1], caches, first, 4, SamplingConfig(0.0))
    with pytest.raises(ValueError, match="logits"):
        resume(model, idx, caches, first[:1], 4, SamplingConfig(0.0))
