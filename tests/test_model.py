"""GPTConfig and GPT: sizes, validation, a float64 reference forward, loss, optimizer, save/load."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import attnlab.model
from attnlab.attention import KVCache
from attnlab.model import GPT, GPTConfig, lm_loss

SMALL = dict(vocab_size=37, context_length=16, emb_dim=24, n_heads=4, n_layers=2, drop_rate=0.0)  # = make_gpt's


# --------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------
def test_gpt2_small_has_hf_parameter_count():
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt2-small"))
    assert model.num_parameters() == 124_439_808  # the figure Hugging Face's GPT-2 reports


@pytest.mark.parametrize("name", ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_presets_match_hf_gpt2_parameter_counts(name):
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    cfg = GPTConfig.preset(name)
    hf_cfg = transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.context_length,
        n_embd=cfg.emb_dim,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
    )
    with torch.device("meta"):
        ours = GPT(cfg)
        theirs = transformers.GPT2LMHeadModel(hf_cfg)
    assert ours.num_parameters() == sum(p.numel() for p in theirs.parameters())
    assert all(p.is_meta for p in ours.parameters())


def test_gpt2_presets_follow_published_sizes():
    # "Implementing GPT-Style Attention" quotes 12 heads / 768 (smallest) and 25 heads / 1600 (largest).
    small, xl = GPTConfig.preset("gpt2-small"), GPTConfig.preset("gpt2-xl")
    assert (small.n_heads, small.emb_dim, small.qkv_bias) == (12, 768, True)
    assert (xl.n_heads, xl.emb_dim, xl.n_layers) == (25, 1600, 48)
    assert GPTConfig.preset("gpt2") == small
    assert GPTConfig.preset("gpt2-small", context_length=256).context_length == 256


def test_tiny_preset_is_small_byte_model():
    cfg = GPTConfig.preset("tiny")
    assert cfg.vocab_size == 256 and cfg.context_length == 64
    n = GPT(cfg).num_parameters()
    assert 1_000_000 <= n <= 2_000_000


def test_xl_on_meta_device_allocates_nothing_and_runs_shapes():
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt2-xl"))
        logits = model(torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, 50257) and logits.is_meta
    assert model.num_parameters() == 1_557_611_200


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(emb_dim=30, n_heads=4), "emb_dim must be divisible by n_heads"),
        (dict(n_heads=4, n_kv_heads=3), "n_heads must be divisible by n_kv_heads"),
        (dict(n_layers=0), "n_layers must be a positive int"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(context_length=2.5), "context_length"),
        (dict(drop_rate=1.0), "drop_rate"),
        (dict(drop_rate=-0.1), "drop_rate"),
        (dict(ff_dim=0), "ff_dim"),
        (dict(ln_eps=0.0), "ln_eps"),
    ],
)
def test_inconsistent_configs_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**SMALL, **overrides})


def test_config_dict_roundtrip_and_errors():
    cfg = GPTConfig(**SMALL, n_kv_heads=2, tie_embeddings=False)
    d = json.loads(json.dumps(cfg.to_dict()))
    assert GPTConfig.from_dict(d) == cfg
    with pytest.raises(ValueError, match="unknown GPTConfig field"):
        GPTConfig.from_dict({**d, "emb_dims": 3})
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        GPTConfig.preset("gpt5")
    with pytest.raises(TypeError, match="unknown GPTConfig field"):
        GPTConfig.preset("tiny", heads=3)
    with pytest.raises(TypeError, match="qkv_bias must be a bool"):
        GPTConfig(**SMALL, qkv_bias=1)


# --------------------------------------------------------------------------------------------
# Forward against an explicit float64 reference
# --------------------------------------------------------------------------------------------
def reference_logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """GPT-2 forward written out with explicit per-head loops in float64 from the model's parameters."""
    cfg = model.config
    p = {k: v.detach().double() for k, v in model.state_dict().items()}
    B, T = idx.shape
    H, hd, Hkv = cfg.n_heads, cfg.head_dim, cfg.kv_heads

    def ln(x, pre):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        y = (x - mu) / torch.sqrt(var + cfg.ln_eps) * p[pre + ".weight"]
        return y + p[pre + ".bias"] if pre + ".bias" in p else y

    def lin(x, pre):
        y = x @ p[pre + ".weight"].T
        return y + p[pre + ".bias"] if pre + ".bias" in p else y

    def gelu_tanh(x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))

    x = p["tok_emb.weight"][idx] + p["pos_emb.weight"][torch.arange(T)]  # (B, T, C)
    for i in range(cfg.n_layers):
        pre = f"trf_blocks.{i}."
        h = ln(x, pre + "norm1")
        q, k, v = lin(h, pre + "att.W_query"), lin(h, pre + "att.W_key"), lin(h, pre + "att.W_value")
        heads = []
        for head in range(H):
            kvh = head // (H // Hkv)
            qh = q[..., head * hd : (head + 1) * hd]
            kh, vh = k[..., kvh * hd : (kvh + 1) * hd], v[..., kvh * hd : (kvh + 1) * hd]
            out = torch.zeros(B, T, hd, dtype=torch.float64)
            for t in range(T):
                scores = (qh[:, t : t + 1] @ kh[:, : t + 1].transpose(1, 2)) / math.sqrt(hd)  # (B, 1, t+1)
                out[:, t] = (torch.softmax(scores, -1) @ vh[:, : t + 1])[:, 0]
            heads.append(out)
        x = x + lin(torch.cat(heads, -1), pre + "att.out_proj")
        x = x + lin(gelu_tanh(lin(ln(x, pre + "norm2"), pre + "ff.layers.0")), pre + "ff.layers.2")
    x = ln(x, "final_norm")
    w = p["tok_emb.weight"] if cfg.tie_embeddings else p["out_head.weight"]
    return x @ w.T


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(qkv_bias=True), dict(n_kv_heads=2), dict(tie_embeddings=False, bias=False), dict(ff_dim=40)],
)
def test_forward_matches_float64_reference(overrides, make_gpt):
    model = make_gpt(**overrides)
    idx = torch.randint(0, SMALL["vocab_size"], (2, 11))
    got = model(idx)
    assert got.shape == (2, 11, SMALL["vocab_size"])
    torch.testing.assert_close(got.double(), reference_logits(model, idx), atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(2, 16), cut=st.integers(1, 15), seed=st.integers(0, 2**16))
def test_causal_future_tokens_do_not_change_past_logits(T, cut, seed, make_gpt):
    cut = min(cut, T - 1)
    model = make_gpt()
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, SMALL["vocab_size"], (1, T), generator=g)
    b = a.clone()
    b[:, cut:] = torch.randint(0, SMALL["vocab_size"], (1, T - cut), generator=g)
    torch.testing.assert_close(model(a)[:, :cut], model(b)[:, :cut], atol=1e-6, rtol=1e-6)


def test_left_padding_mask_gives_unpadded_logits(make_gpt):
    model = make_gpt()
    prompt = torch.randint(0, SMALL["vocab_size"], (1, 6))
    padded = torch.cat([torch.full((1, 3), 5), prompt], dim=1)
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1]])
    torch.testing.assert_close(model(padded, attention_mask=mask)[:, 3:], model(prompt), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("idx", "err", "match"),
    [
        (torch.zeros(2, 4), TypeError, "idx must hold integer token ids"),
        (torch.zeros(4, dtype=torch.long), ValueError, r"idx must have shape \(batch, tokens\)"),
        (torch.zeros(1, 17, dtype=torch.long), ValueError, "more than context_length=16"),
        (torch.full((1, 3), 37), ValueError, r"idx values must be in \[0, vocab_size=37\)"),
        (torch.full((1, 3), -1), ValueError, "got min -1"),
        ([[1, 2]], TypeError, "idx must be a torch.Tensor"),
    ],
)
def test_bad_idx_raises(idx, err, match, make_gpt):
    with pytest.raises(err, match=match):
        make_gpt()(idx)


def test_bad_attention_mask_raises(make_gpt):
    model = make_gpt()
    idx = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        model(idx, attention_mask=torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(TypeError, match="attention_mask must be bool"):
        model(idx, attention_mask=torch.ones(2, 4))


def test_dropout_only_in_training_mode(make_gpt):
    model = make_gpt(drop_rate=0.5)
    idx = torch.randint(0, 37, (2, 8))
    torch.testing.assert_close(model(idx), model(idx))
    model.train()
    assert not torch.allclose(model(idx), model(idx))


# --------------------------------------------------------------------------------------------
# Initialisation, loss, optimizer
# --------------------------------------------------------------------------------------------
def test_gpt2_initialisation_and_tying(make_gpt):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, context_length=64, emb_dim=256, n_heads=4, n_layers=8)
    model = GPT(cfg)
    assert model.out_head.weight is model.tok_emb.weight
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 1e-3
    resid = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert abs(model.trf_blocks[0].att.out_proj.weight.std().item() - resid) < 5e-4
    assert abs(model.trf_blocks[0].ff.layers[2].weight.std().item() - resid) < 5e-4
    assert abs(model.trf_blocks[0].att.W_query.weight.std().item() - 0.02) < 1e-3
    assert torch.all(model.trf_blocks[0].att.out_proj.bias == 0)
    untied = GPT(GPTConfig(**SMALL, tie_embeddings=False))
    assert untied.out_head.weight is not untied.tok_emb.weight
    assert untied.num_parameters() == make_gpt().num_parameters() + 37 * 24


def test_loss_is_mean_cross_entropy_with_ignore_index(make_gpt):
    model = make_gpt()
    idx = torch.randint(0, 37, (3, 9))
    targets = torch.randint(0, 37, (3, 9))
    targets[0, :4] = -100
    logits = model(idx).double()
    logp = torch.log_softmax(logits, -1)
    keep = targets != -100
    expected = -logp[keep, targets[keep]].mean()
    torch.testing.assert_close(model.loss(idx, targets).double(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="targets must have the shape of idx"):
        model.loss(idx, targets[:, :-1])
    with pytest.raises(TypeError, match="targets must be an integer tensor"):
        model.loss(idx, targets.float())


def test_configure_optimizer_groups_and_training_reduces_loss(make_gpt):
    model = make_gpt(qkv_bias=True)
    opt = model.configure_optimizer(weight_decay=0.1, lr=1e-2, betas=(0.9, 0.95))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert ids == {id(p) for p in model.parameters()} and len(ids) == len(decay["params"]) + len(no_decay["params"])
    model.train()
    data = torch.arange(16).remainder(37).unsqueeze(0).repeat(4, 1)  # a sequence to memorise
    first = None
    for _ in range(40):
        loss = model.loss(data[:, :-1], data[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first
    with pytest.raises(ValueError, match="weight_decay"):
        model.configure_optimizer(weight_decay=-1)


def test_fused_adamw_is_the_cpu_default_and_follows_the_loop_implementation(make_gpt):
    # The fused kernel must take the same steps as torch's reference for-loop AdamW. (No key bias:
    # its gradient is zero up to rounding, which Adam's normalisation turns into +-lr steps.)
    fused_model = make_gpt()
    loop_model = make_gpt()
    loop_model.load_state_dict(fused_model.state_dict())
    fused = fused_model.configure_optimizer(weight_decay=0.1, lr=1e-2)
    loop = loop_model.configure_optimizer(weight_decay=0.1, lr=1e-2, fused=False)
    assert fused.defaults["fused"] is True
    assert not loop.defaults.get("fused") and not loop.defaults.get("foreach")
    data = torch.randint(0, 37, (4, 17))
    for _ in range(5):
        for model, opt in ((fused_model, fused), (loop_model, loop)):
            opt.zero_grad()
            model.loss(data[:, :-1], data[:, 1:]).backward()
            opt.step()
    for (name, a), b in zip(fused_model.state_dict().items(), loop_model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert not torch.equal(fused_model.tok_emb.weight, make_gpt().tok_emb.weight)  # it trained


# --------------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [True, False])
def test_save_load_roundtrip(tmp_path, tie, make_gpt):
    from safetensors.torch import load_file

    model = make_gpt(tie_embeddings=tie, n_kv_heads=2)
    model.save(tmp_path / "ckpt")
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == ["config.json", "model.safetensors"]  # no temp files left behind
    stored = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert ("out_head.weight" in stored) == (not tie)  # tied weights stored once
    loaded = GPT.load(tmp_path / "ckpt")
    assert loaded.config == model.config
    assert (loaded.out_head.weight is loaded.tok_emb.weight) == tie
    idx = torch.randint(0, 37, (2, 7))
    torch.testing.assert_close(loaded.eval()(idx), model(idx), atol=0, rtol=0)
    assert GPT.load(tmp_path / "ckpt", dtype=torch.float64).dtype == torch.float64


def test_load_errors_are_clear(tmp_path, make_gpt):
    with pytest.raises(FileNotFoundError, match=r"config\.json not found"):
        GPT.load(tmp_path)
    make_gpt().save(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        GPT.load(tmp_path)
    make_gpt().save(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, "emb_dim": 32}))
    with pytest.raises(ValueError, match="does not match"):
        GPT.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        GPT.load(tmp_path)


@pytest.mark.parametrize("odd_dtype", [torch.int64, torch.float64])
def test_load_refuses_weights_of_mixed_or_integer_dtype(tmp_path, odd_dtype, make_gpt):
    from safetensors.torch import load_file, save_file

    make_gpt().save(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["final_norm.weight"] = state["final_norm.weight"].to(odd_dtype)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"most are torch.float32, but not \['final_norm.weight \({odd_dtype}\)'\]"):
        GPT.load(tmp_path)


def test_fused_qkv_cache_follows_weight_updates(make_gpt):
    # Without grad the attention layers reuse their concatenated Q/K/V weight; it must never go stale.
    model = make_gpt(qkv_bias=True)
    idx = torch.randint(0, 37, (2, 6))
    with torch.no_grad():
        model(idx)  # fills the cache
        model.trf_blocks[0].att.W_key.weight.add_(0.5)  # in place, as an optimizer step does
        model.trf_blocks[1].att.W_value.bias.mul_(3.0)
        cached = model(idx)
    torch.testing.assert_close(cached, model(idx), atol=0, rtol=0)  # grad-enabled path: a fresh concatenation
    other = make_gpt(seed=5, qkv_bias=True)
    with torch.no_grad():
        model.load_state_dict(other.state_dict())
        torch.testing.assert_close(model(idx), other(idx), atol=0, rtol=0)
        torch.testing.assert_close(model.double()(idx), other.double()(idx), atol=0, rtol=0)


def test_position_ids_are_checked_and_used(make_gpt):
    model = make_gpt()
    idx = torch.randint(0, 37, (1, 4))
    torch.testing.assert_close(model(idx, position_ids=torch.arange(4)), model(idx), atol=0, rtol=0)
    torch.testing.assert_close(model(idx, position_ids=torch.arange(4).expand(1, 4)), model(idx), atol=0, rtol=0)
    assert not torch.allclose(model(idx, position_ids=torch.arange(3, 7)), model(idx))
    with pytest.raises(ValueError, match="position_ids must be in"):
        model(idx, position_ids=torch.arange(14, 18))
    with pytest.raises(ValueError, match="position_ids must have shape"):
        model(idx, position_ids=torch.arange(5))


# --------------------------------------------------------------------------------------------
# Regressions
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("bad", "ignore_index", "match"),
    [
        (37, -100, r"targets values must be in \[0, vocab_size=37\) or equal ignore_index=-100, got min .*, max 37"),
        (-1, -100, "got min -1"),
        (-100, -1, "ignore_index=-1, got min -100"),
    ],
)
def test_loss_range_checks_targets(bad, ignore_index, match, make_gpt):
    # Regression: out-of-range targets reached F.cross_entropy unchecked (a device assert on CUDA).
    model = make_gpt()
    idx = torch.randint(0, 37, (2, 5))
    targets = torch.randint(0, 37, (2, 5))
    targets[1, 2] = bad
    with pytest.raises(ValueError, match=match):
        model.loss(idx, targets, ignore_index=ignore_index)
    # the ignored value may be anything, and only it is exempt
    targets[1, 2] = ignore_index
    assert torch.isfinite(model.loss(idx, targets, ignore_index=ignore_index))
    with pytest.raises(ValueError, match="idx values must be in"):
        model.loss(torch.full((2, 5), 37), targets, ignore_index=ignore_index)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        model.loss(idx, targets, ignore_index=None)


def test_loss_with_nothing_to_score_is_an_error_not_nan(make_gpt):
    model = make_gpt()
    idx = torch.randint(0, 37, (2, 5))
    with pytest.raises(ValueError, match="no entry to score: every one equals ignore_index=-100"):
        model.loss(idx, torch.full_like(idx, -100))
    with pytest.raises(ValueError, match="no entry to score"):
        lm_loss(torch.randn(2, 3, 5), torch.full((2, 3), -100))
    with pytest.raises(ValueError, match="targets is empty"):
        lm_loss(torch.randn(0, 5), torch.zeros(0, dtype=torch.long))
    one = torch.full_like(idx, -100)
    one[1, 3] = 7  # a single scored entry is enough
    assert torch.isfinite(model.loss(idx, one))


def test_lm_loss_is_float32_mean_cross_entropy(make_gpt):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=g).bfloat16()
    targets = torch.randint(0, 11, (3, 4), generator=g)
    targets[0, 1] = targets[2, 3] = -100
    keep = targets != -100
    logp = torch.log_softmax(logits.double(), -1)
    expected = -logp[keep, targets[keep]].mean()
    got = lm_loss(logits, targets)
    assert got.dtype == torch.float32 and got.shape == ()
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    t1 = targets.masked_fill(~keep, -1)  # the same entries ignored through another ignore_index
    torch.testing.assert_close(lm_loss(logits, t1, ignore_index=-1), got, atol=0, rtol=0)
    torch.testing.assert_close(lm_loss(logits.flatten(0, 1), t1.flatten(), -1), got, atol=0, rtol=0)
    model = make_gpt()
    idx = torch.randint(0, 37, (2, 6))
    t = torch.randint(0, 37, (2, 6))
    torch.testing.assert_close(model.loss(idx, t), lm_loss(model(idx), t), atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"targets must have shape logits.shape\[:-1\]"):
        lm_loss(logits, targets[:, :-1])
    with pytest.raises(TypeError, match="targets must be an integer tensor"):
        lm_loss(logits, targets.float())
    with pytest.raises(TypeError, match="logits must be a float tensor"):
        lm_loss(targets, targets)
    # the trainer calls lm_loss directly: it range-checks the targets itself
    with pytest.raises(ValueError, match=r"targets values must be in \[0, vocab_size=11\).*max 11"):
        lm_loss(logits, targets.index_put((torch.tensor(1), torch.tensor(2)), torch.tensor(11)))
    with pytest.raises(ValueError, match="ignore_index=7, got min -100"):
        lm_loss(logits, targets, ignore_index=7)  # -100 is no longer the ignored value


@torch.no_grad()
def test_kv_caches_elements_are_type_checked(make_gpt):
    # Regression: a list of the right length but holding non-caches died with an AttributeError.
    model = make_gpt()
    idx = torch.randint(0, 37, (1, 3))
    with pytest.raises(TypeError, match=r"kv_caches\[0\] must be an attnlab KVCache.*got NoneType"):
        model(idx, kv_caches=[None, None])
    caches = model.new_kv_caches(1)
    with pytest.raises(TypeError, match=r"kv_caches\[1\] must be an attnlab KVCache.*got dict"):
        model(idx, kv_caches=[caches[0], {}])
    assert caches[0].length == 0
    model(idx, kv_caches=caches)
    caches[1].reset()
    with pytest.raises(ValueError, match=r"kv_caches hold different numbers of tokens \[3, 0\]"):
        model(idx, kv_caches=caches)
    assert all(isinstance(c, KVCache) for c in caches)


def test_model_module_exports_only_its_own_names():
    assert "atomic_write_bytes" not in attnlab.model.__all__
    assert "lm_loss" in attnlab.model.__all__
    assert all(hasattr(attnlab.model, name) for name in attnlab.model.__all__)


def test_state_keys_check_builds_the_state_dict_once(monkeypatch, make_gpt):
    model = make_gpt()
    state = model.state_dict()
    calls = []
    original = GPT.state_dict

    def counting(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "state_dict", counting)
    state.pop("out_head.weight", None)
    assert model._check_state_keys(state) == ([], [])
    assert len(calls) == 1


def test_save_and_load_without_safetensors_say_what_to_install(tmp_path, monkeypatch, make_gpt):
    # safetensors is an extra: the core (torch + numpy) imports and runs without it.
    import sys

    make_gpt().save(tmp_path)
    monkeypatch.setitem(sys.modules, "safetensors", None)  # makes `import safetensors` raise ImportError
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    msg = r"saving/loading GPT weights needs safetensors: pip install 'attnlab\[train\]'"
    with pytest.raises(ImportError, match=msg):
        make_gpt().save(tmp_path / "again")
    with pytest.raises(ImportError, match=msg):
        GPT.load(tmp_path)
    assert not (tmp_path / "again").exists()


def test_activation_selects_the_gelu_and_is_validated():
    x = torch.randn(5, 16)
    tanh = GPT(GPTConfig(vocab_size=7, context_length=4, emb_dim=16, n_heads=2, n_layers=1))
    exact = GPT(GPTConfig(vocab_size=7, context_length=4, emb_dim=16, n_heads=2, n_layers=1, activation="gelu"))
    assert GPTConfig.preset("tiny").activation == "gelu"  # our own preset: the fast exact GELU on CPU
    assert GPTConfig.preset("gpt2-small").activation == "gelu_tanh"  # GPT-2's, to reproduce its logits
    torch.testing.assert_close(tanh.trf_blocks[0].ff.layers[1](x), torch.nn.functional.gelu(x, approximate="tanh"))
    torch.testing.assert_close(exact.trf_blocks[0].ff.layers[1](x), torch.nn.functional.gelu(x))
    for bad in ("relu", ["gelu"]):  # (a list was an 'unhashable type' TypeError)
        with pytest.raises(ValueError, match="activation must be one of"):
            GPTConfig(vocab_size=7, context_length=4, emb_dim=16, n_heads=2, n_layers=1, activation=bad)


# The meta device stands in for an accelerator: a forward and decoding steps there must not build a
# tensor on the CPU and copy it over (on CUDA each such copy makes the step wait).
class _CpuTensorOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" for t in tensors) and any(t.device.type == "cpu" and t.dim() for t in tensors):
            self.seen.append(str(func))
        return out


@pytest.mark.parametrize(
    "switches",
    [
        dict(pos="alibi", window=8),
        dict(),
        dict(preset="modern", n_kv_heads=2, window=8, window_layers=[0], rope_local_theta=1e4, attn_softcap=50.0),
        dict(pos="rope", rotary_fraction=0.25, parallel_residual=True),
    ],
    ids=["alibi", "learned", "modern", "neox"],
)
def test_a_model_on_an_accelerator_copies_nothing_from_the_cpu_per_step(switches):
    switches = dict(switches)
    preset = switches.pop("preset", "tiny")
    cfg = GPTConfig.preset(preset, vocab_size=64, context_length=32, emb_dim=32, n_heads=4, n_layers=2, **switches)
    with torch.device("meta"):
        model = GPT(cfg).eval()
    idx = torch.zeros(1, 8, dtype=torch.long, device="meta")
    caches = model.new_kv_caches(1, 32)
    with torch.no_grad():
        model.decode_logits(idx, None, caches)  # (the first call builds what later calls reuse)
        log = _CpuTensorOps()
        with log:
            model(idx)
            for _ in range(3):
                model.decode_logits(idx[:, :1], None, caches)
    assert log.seen == [], f"ops with a CPU tensor: {sorted(set(log.seen))}"


def test_weights_removed_while_they_are_read_are_file_not_found(tmp_path, monkeypatch):
    # A training run pruning its old step while `generate --checkpoint` read it gave safetensors'
    # RuntimeError, and the command line a traceback.
    import os

    import safetensors

    GPT(GPTConfig(**SMALL)).save(tmp_path)

    opened = safetensors.safe_open
    for error in (RuntimeError, None):  # (None: safe_open's own, on the file once removed)

        def pruned(path, *args, error=error, **kwargs):
            os.remove(path)
            if error is None:
                return opened(path, *args, **kwargs)
            raise error(f"unable to open file <{path}> in read-only mode: No such file or directory (os error 2)")

        monkeypatch.setattr(safetensors, "safe_open", pruned)
        with pytest.raises(FileNotFoundError, match=r"model\.safetensors was removed while it was being read"):
            GPT.load(tmp_path)
        GPT(GPTConfig(**SMALL)).save(tmp_path)


@pytest.mark.parametrize("dtype", ["bfloat16", torch.int64, 16])
def test_a_dtype_that_is_not_a_floating_torch_dtype_is_named(tmp_path, dtype):
    # from_pretrained gave torch's "to() received an invalid combination of arguments"
    GPT(GPTConfig(**SMALL)).save(tmp_path)
    for load in (GPT.load, GPT.from_pretrained):
        with pytest.raises(TypeError, match=r"dtype must be None or a floating-point"):
            load(tmp_path, dtype=dtype)
