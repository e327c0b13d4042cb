"""The model families after Llama, against transformers itself (no download).

For each family (Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 text, Phi-3, OLMo 2, GPT-NeoX/Pythia) a
transformers model is built from a small config under a seed, with weights made larger than the
init (peaked next-token distributions): attnlab's logits must match within 1e-4 (float32), greedy
tokens must equal ``generate``'s, the KV cache must change nothing, the attention weights traced
by :mod:`attnlab.interpret` must equal transformers' eager ``output_attentions``, and
``--model DIR`` must read the ``save_pretrained`` directory.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.formats import families
from attnlab.model import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

V = 67
COMMON = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
# name -> (config class, model class, config overrides, the GPTConfig switches it must turn on)
CASES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, dict(qkv_bias=True, bias=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16), dict(qk_norm=True, head_size=16)),
    "gemma": (
        "GemmaConfig",
        "GemmaForCausalLM",
        dict(head_dim=12, tie_word_embeddings=True),
        dict(mlp="geglu", norm_offset=1.0, head_size=12, tie_embeddings=True),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(head_dim=8, sliding_window=5, query_pre_attn_scalar=12, attn_logit_softcapping=3.0,
             final_logit_softcapping=4.0),
        dict(attn_softcap=3.0, logit_softcap=4.0, window=5, window_layers=[0, 2], post_norms=True),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=8,
            num_hidden_layers=3,
            sliding_window=5,
            query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
        ),
        dict(qk_norm=True, window_layers=[0, 1], rope_local_theta=100.0, rope_theta=100000.0),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
             sliding_window=6, pad_token_id=0),
        dict(rotary_fraction=0.5, window=6),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, dict(qk_norm="full", pre_norms=False, post_norms=True)),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(num_key_value_heads=None, rms_norm_eps=None, layer_norm_eps=1e-5,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
        dict(norm="layernorm", bias=True, qkv_bias=True, parallel_residual=True, rotary_fraction=0.25),
    ),
    "gpt_neox_serial": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(num_key_value_heads=None, rms_norm_eps=None, use_parallel_residual=False, hidden_act="gelu_new",
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
        dict(parallel_residual=False, activation="gelu_tanh"),
    ),
}


def build(name: str, seed: int = 0, **overrides) -> torch.nn.Module:
    cfg_cls, model_cls, extra, _ = CASES[name]
    cfg = {k: v for k, v in {**COMMON, **extra, **overrides}.items() if v is not None}
    config = getattr(transformers, cfg_cls)(**cfg)
    config._attn_implementation = "eager"  # the attention weights of output_attentions
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config)
    with torch.no_grad():  # weights larger than the init: peaked, varied next-token distributions
        for pname, p in model.named_parameters():
            if "norm" in pname and pname.endswith("weight"):
                p.copy_((0.3 if "gemma" in name else 1) * torch.randn_like(p) * 0.3 + (0 if "gemma" in name else 1))
            elif "norm" in pname:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.mul_(6)
    return model.eval()


@pytest.fixture(scope="module", params=list(CASES))
def pair(request):
    hf = build(request.param, seed=1)
    return request.param, hf, GPT.from_hf(hf)


def test_the_family_switches_are_on(pair):
    name, hf, ours = pair
    want = CASES[name][3]
    assert {k: getattr(ours.config, k) for k in want} == want


def test_logits_match_transformers(pair):
    name, hf, ours = pair
    idx = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(idx).logits
        got = ours(idx)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert want.std() > 0.3  # varied distributions: the check has teeth
    # the same from a bare state dict with the dict of its config.json
    again = GPT.from_hf(hf.state_dict(), hf_config=hf.config.to_dict())
    torch.testing.assert_close(again(idx), got)


def test_greedy_tokens_equal_and_the_cache_changes_nothing(pair):
    name, hf, ours = pair
    prompt = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(4))
    n = 12  # past the windows of 5 and 6: the caches roll
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        mask = torch.ones_like(prompt)  # (a prompt holding the pad id must not read as padding)
        want = hf.generate(prompt, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)
    cached, logits = ours.generate(prompt, n, temperature=0, return_logits=True)
    uncached, logits_u = ours.generate(prompt, n, temperature=0, use_cache=False, return_logits=True)
    assert torch.equal(cached, want)
    assert torch.equal(uncached, want)
    torch.testing.assert_close(logits, logits_u, atol=1e-4, rtol=1e-4)


def test_traced_weights_equal_output_attentions(pair):
    from attnlab.interpret import trace

    name, hf, ours = pair
    idx = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = torch.stack(hf(idx, output_attentions=True).attentions)  # (L, B, H, T, T)
    got = trace(ours, idx, stages=True)
    torch.testing.assert_close(got.weights, want, atol=1e-5, rtol=1e-5)
    for layer in range(got.n_layers):  # the tutorials' steps recompose what was applied
        steps = got.steps(layer)
        torch.testing.assert_close(torch.softmax(steps["masked"], dim=-1), steps["weights"], atol=1e-5, rtol=1e-5)
