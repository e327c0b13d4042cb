"""GPT since GPT-2: the GPTConfig switches, the modern preset, and generation that rolls its cache.

References: a GPT whose config.json predates the switches (same numbers), the model's own full
forward over the whole sequence (what a rolling cache must reproduce: every key recomputed at its
original position), rows generated alone (for left-padded batches), and the receptive field of a
sliding window (tokens beyond it cannot matter).
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.model import GPT, GPTConfig

V, C = 29, 8
BASE = dict(vocab_size=V, context_length=C, emb_dim=16, n_heads=4, n_layers=2, drop_rate=0.0)
VARIANTS = {
    "rope": dict(pos="rope"),
    "alibi": dict(pos="alibi"),
    "nope": dict(pos="none"),
    "rope_window": dict(pos="rope", window=3),
    "rope_window_sinks": dict(pos="rope", window=3, sinks=2),
    "rope_sinks": dict(pos="rope", sinks=1),
    "llama_gqa": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2, tie_embeddings=False),
    "modern": dict(pos="rope", norm="rmsnorm", mlp="relu2", qk_norm=True, bias=False, tie_embeddings=False),
    "alibi_window_gqa": dict(pos="alibi", window=4, n_kv_heads=1),
    "learned_window": dict(window=3),
    "learned_window_sinks": dict(window=4, sinks=1),
}


def make(name: str, seed: int = 0, scale: float = 6.0) -> GPT:
    torch.manual_seed(seed)
    m = GPT(GPTConfig(**{**BASE, **VARIANTS[name]})).eval()
    with torch.no_grad():  # larger weights: peaked, varied distributions (no greedy ties)
        for p in m.parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    return m


# =============================================================================================
# Configuration
# =============================================================================================
def test_defaults_are_gpt2_and_old_configs_load_identically(tmp_path, make_gpt):
    old = make_gpt(3)
    new_keys = {"pos", "rope_theta", "rope_scaling", "norm", "mlp", "window", "sinks", "qk_norm"}
    d = old.config.to_dict()
    assert new_keys <= set(d)
    assert {k: d[k] for k in new_keys} == {
        "pos": "learned",
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "norm": "layernorm",
        "mlp": "gelu",
        "window": None,
        "sinks": 0,
        "qk_norm": False,
    }
    old.save(tmp_path)
    cfg_path = tmp_path / "config.json"
    written = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({k: v for k, v in written.items() if k not in new_keys}))  # a pre-issue file
    loaded = GPT.load(tmp_path)
    idx = torch.randint(0, 37, (2, 9))
    assert torch.equal(loaded(idx), old(idx))
    assert sorted(loaded.state_dict()) == sorted(old.state_dict())  # pos_emb and all, as before


@pytest.mark.parametrize("name", ["gpt2-small", "gpt2-medium", "tiny"])
def test_presets_keep_their_parameter_counts(name):
    cfg = GPTConfig.preset(name)
    with torch.device("meta"):
        n = GPT(cfg).num_parameters()
    c, qkv_bias = cfg.emb_dim, 3 * cfg.emb_dim if cfg.qkv_bias else 0
    block = 4 * c * c + qkv_bias + c + 2 * 2 * c + 8 * c * c + 4 * c + c  # attention, 2 LayerNorms, MLP
    assert n == cfg.vocab_size * c + cfg.context_length * c + cfg.n_layers * block + 2 * c
    if name == "gpt2-small":
        assert n == 124_439_808  # Hugging Face's GPT2LMHeadModel


def test_modern_preset_is_nanochat_style_and_trains_on_cpu():
    cfg = GPTConfig.preset("modern")
    assert (cfg.pos, cfg.norm, cfg.mlp, cfg.qk_norm, cfg.bias, cfg.tie_embeddings) == (
        "rope",
        "rmsnorm",
        "relu2",
        True,
        False,
        False,
    )
    torch.manual_seed(0)
    model = GPT(cfg)
    assert model.pos_emb is None and "pos_emb.weight" not in model.state_dict()
    # Parameters: embeddings and head untied, per block 4 C^2 (attention) + 8 C^2 (MLP), QK-norm gains, norms.
    C = cfg.emb_dim
    per_block = 4 * C * C + 8 * C * C + 2 * cfg.head_dim + 2 * C
    assert model.num_parameters() == 2 * cfg.vocab_size * C + cfg.n_layers * per_block + C
    text = torch.tensor(list(b"to be or not to be, that is the question. " * 40))
    opt = model.configure_optimizer(lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(20):
        starts = torch.randint(0, len(text) - 33, (4,), generator=torch.Generator().manual_seed(step))
        batch = torch.stack([text[s : s + 33] for s in starts])
        loss = model.loss(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert max(losses[-3:]) < 0.35 * losses[0]  # from ln(256) = 5.5 nats to the text's few characters


@pytest.mark.parametrize("name", list(VARIANTS))
def test_save_load_roundtrip_of_every_variant(tmp_path, name):
    m = make(name, seed=4)
    m.save(tmp_path)
    loaded = GPT.load(tmp_path)
    assert loaded.config == m.config
    idx = torch.randint(0, V, (2, C))
    torch.testing.assert_close(loaded(idx), m(idx))


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(pos="relative"), ValueError, "pos must be one of 'learned', 'rope', 'alibi', 'none'"),
        (dict(norm="batchnorm"), ValueError, "norm must be one of"),
        (dict(mlp="swish"), ValueError, "mlp must be one of"),
        (dict(window=0), ValueError, "window must be a positive int"),
        (dict(window=2.5), ValueError, "window must be a positive int"),
        (dict(sinks=-1), ValueError, "sinks must be a non-negative int"),
        (dict(sinks=2), ValueError, "set window"),
        (dict(pos="rope", window=3, sinks=3), ValueError, "less than the window"),
        (dict(pos="rope", emb_dim=12, n_heads=4), ValueError, "must be even"),
        (dict(pos="rope", rope_theta=0.0), ValueError, "rope_theta"),
        (dict(pos="rope", rope_scaling={"rope_type": "dynamic"}), ValueError, "rope_scaling type"),
        (dict(qk_norm=1), TypeError, "qk_norm must be a bool"),
    ],
)
def test_bad_options_are_clear_errors(overrides, error, match):
    with pytest.raises(error, match=match):
        GPTConfig(**{**BASE, **overrides})


def test_gpt2_export_refuses_what_gpt2_does_not_have():
    from attnlab.formats.hf import to_hf_gpt2_state_dict

    with pytest.raises(ValueError, match="GPT-2 has learned positions"):
        to_hf_gpt2_state_dict(make("rope"))


# =============================================================================================
# Forward: relative positions take any length; a window bounds what matters
# =============================================================================================
@pytest.mark.parametrize("name", ["rope_window", "alibi_window_gqa", "rope"])
def test_tokens_beyond_the_receptive_field_do_not_matter(name):
    """n_layers windows of W reach back n_layers * (W - 1) tokens: logits there are those of the
    cropped sequence at its original positions, and sequences may be longer than the context."""
    m = make(name, seed=5)
    W = m.config.attention_window
    reach = m.config.n_layers * (W - 1)
    idx = torch.randint(0, V, (2, 5 * C), generator=torch.Generator().manual_seed(6))
    full = m(idx)  # (2, 5C, V): longer than context_length
    t = 5 * C - 1
    start = t - reach
    cropped = m(idx[:, start:], position_ids=torch.arange(start, 5 * C))
    torch.testing.assert_close(cropped[:, -1], full[:, t], atol=1e-4, rtol=1e-4)
    changed = idx.clone()
    changed[:, : start - 1] = (changed[:, : start - 1] + 1) % V  # everything out of reach changes
    torch.testing.assert_close(m(changed)[:, t], full[:, t], atol=1e-4, rtol=1e-4)
    changed[:, start] = (changed[:, start] + 1) % V  # the farthest token in reach does matter
    assert not torch.allclose(m(changed)[:, t], full[:, t])


def test_learned_positions_still_limit_the_length(make_gpt):
    with pytest.raises(ValueError, match="more than context_length"):
        make("learned_window")(torch.zeros(1, C + 1, dtype=torch.long))


# =============================================================================================
# Generation: rolling caches == the whole sequence recomputed; flat memory; padding
# =============================================================================================
def naive(model: GPT, idx: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding by the model's full forward over the whole sequence (GPT-2: the last C tokens)."""
    logits_all = []
    with torch.no_grad():
        for _ in range(n):
            window = idx if model.config.relative else idx[:, -C:]
            logits = model(window)[:, -1]
            logits_all.append(logits)
            idx = torch.cat([idx, logits.argmax(-1, keepdim=True)], dim=1)
    return idx, torch.stack(logits_all, 1)


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(list(VARIANTS)),
    T=st.integers(1, 20),
    n=st.integers(1, 24),
    B=st.integers(1, 2),
    seed=st.integers(0, 2**10),
)
@pytest.mark.slow
def test_cached_and_uncached_generation_equal_the_whole_sequence(name, T, n, B, seed):
    """Prompts longer than the context, generation past it: cached (rolling) == uncached == the
    model's forward over everything (every key at its original position)."""
    m = make(name, seed=seed % 7)
    idx = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))
    want, want_logits = naive(m, idx, n)
    for use_cache in (True, False):
        got, logits = m.generate(idx, n, temperature=0, use_cache=use_cache, return_logits=True)
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["rope_window_sinks", "rope", "alibi_window_gqa", "learned_window"])
def test_rolling_cache_memory_is_flat_and_nothing_is_re_encoded(name):
    m = make(name, seed=8)
    cfg = m.config
    caches = m.new_kv_caches(1)
    ring = cfg.attention_window + cfg.sinks
    assert all(c.max_length == ring and c.rolling for c in caches)
    fed = []
    hook = m.tok_emb.register_forward_hook(lambda mod, inp, out: fed.append(inp[0].shape[1]))
    try:
        m.generate(torch.zeros(1, 3, dtype=torch.long), 6 * C, temperature=0)
    finally:
        hook.remove()
    if cfg.relative:
        assert fed == [3] + [1] * (6 * C - 1)  # prefill once, then one token per step, forever
    else:  # learned positions: re-encode once the context is full, as GPT-2
        assert fed[: C - 1] == [3] + [1] * (C - 3) + [C]  # one token a step up to the context, then C again


def test_long_prompt_is_prefilled_in_context_chunks():
    m = make("rope_window_sinks", seed=9)
    fed = []
    hook = m.tok_emb.register_forward_hook(lambda mod, inp, out: fed.append(inp[0].shape[1]))
    try:
        m.generate(torch.zeros(1, 2 * C + 3, dtype=torch.long), 2, temperature=0)
    finally:
        hook.remove()
    assert fed == [C, C, 3, 1]


@pytest.mark.parametrize("name", ["rope_window_sinks", "llama_gqa", "alibi_window_gqa", "modern", "learned_window"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_left_padded_batch_equals_prompts_one_at_a_time(name, use_cache):
    m = make(name, seed=10)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [2, 7], [1, 8, 2, 8]]
    T = max(map(len, prompts))
    idx = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    batch = m.generate(idx, 3 * C, temperature=0, attention_mask=mask, use_cache=use_cache)
    for r, p in enumerate(prompts):
        alone = m.generate(torch.tensor([p]), 3 * C, temperature=0, use_cache=use_cache)
        assert batch[r, T:].tolist() == alone[0, len(p) :].tolist()


def test_rolling_cache_shorter_than_the_window_may_fill_but_not_wrap():
    m = make("rope_window", seed=11)
    caches = m.new_kv_caches(1, max_length=2)  # window 3: two slots are not enough to roll
    with torch.no_grad():
        m(torch.zeros(1, 2, dtype=torch.long), kv_caches=caches)
        with pytest.raises(ValueError, match="overwrite keys a window of 3"):
            m(torch.zeros(1, 1, dtype=torch.long), kv_caches=caches)
