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
        dict(
            head_dim=8,
            sliding_window=5,
            query_pre_attn_scalar=12,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=4.0,
        ),
        dict(attn_softcap=1.0, logit_softcap=4.0, window=5, window_layers=[0, 2], post_norms=True),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=8,
            num_hidden_layers=3,
            sliding_window=5,
            query_pre_attn_scalar=8,
            attn_logit_softcapping=2.0,  # (read and never applied by transformers' Gemma 3: nor by attnlab)
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
        dict(
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            sliding_window=6,
            pad_token_id=0,
        ),
        dict(rotary_fraction=0.5, window=6),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}, dict(qk_norm="full", pre_norms=False, post_norms=True)),
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(sliding_window=5, pad_token_id=0, eos_token_id=1, bos_token_id=2),
        dict(qk_norm="full", post_norms=True, window=5, window_layers=[0, 1, 2], rope_local_theta=500000.0),
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            num_key_value_heads=None,
            rms_norm_eps=None,
            layer_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        ),
        dict(norm="layernorm", bias=True, qkv_bias=True, parallel_residual=True, rotary_fraction=0.25),
    ),
    "gpt_neox_serial": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            num_key_value_heads=None,
            rms_norm_eps=None,
            use_parallel_residual=False,
            hidden_act="gelu_new",
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        ),
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
    name, _, ours = pair
    want = CASES[name][3]
    assert {k: getattr(ours.config, k) for k in want} == want


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    idx = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(idx).logits
        got = ours(idx)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert want.std() > 0.3  # varied distributions: the check has teeth
    with torch.no_grad():  # left padding: each row's logits are its own
        mask = torch.ones_like(idx)
        mask[1, :7] = 0
        alone = hf(idx[1:2, 7:]).logits
        torch.testing.assert_close(ours(idx, attention_mask=mask)[1, 7:], alone[0], atol=1e-4, rtol=1e-4)
    # the same from a bare state dict with the dict of its config.json
    again = GPT.from_hf(hf.state_dict(), hf_config=hf.config.to_dict())
    torch.testing.assert_close(again(idx), got)


@pytest.mark.slow
def test_greedy_tokens_equal_and_the_cache_changes_nothing(pair):
    _, hf, ours = pair
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

    _, hf, ours = pair
    idx = torch.randint(0, V, (1, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = torch.stack(hf(idx, output_attentions=True).attentions)  # (L, B, H, T, T)
    got = trace(ours, idx, stages=True)
    torch.testing.assert_close(got.weights, want, atol=1e-5, rtol=1e-5)
    for layer in range(got.n_layers):  # the tutorials' steps recompose what was applied
        steps = got.steps(layer)
        torch.testing.assert_close(torch.softmax(steps["masked"], dim=-1), steps["weights"], atol=1e-5, rtol=1e-5)


def test_export_loads_back_into_transformers(pair):
    _, hf, ours = pair
    sd = families.to_hf_state_dict(ours, hf.config.model_type)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}  # (tied: transformers ties it itself)
    for k, v in sd.items():
        assert torch.equal(hf.state_dict()[k], v), k


def test_an_exact_gelu_gemma_exports_and_reads_back(tmp_path):
    """Gemma's switches with the exact (erf) GELU: the export names it ``gelu_python`` (Gemma 1 reads
    "gelu" as the tanh one), which transformers' GemmaForCausalLM runs as the erf GELU, and which the
    reader takes back as ``activation="gelu"``. It used to be refused ("no name for the exact one")."""
    import json

    from safetensors.torch import load_file

    sizes = {**COMMON, **CASES["gemma"][2]}
    fields = families.config_fields(transformers.GemmaConfig(**sizes).to_dict())
    torch.manual_seed(3)
    ours = GPT(fields | dict(activation="gelu")).eval()
    with torch.no_grad():  # larger than the init: the GELU's inputs reach where tanh and erf part
        for p in ours.parameters():
            p.add_(0.5 * torch.randn_like(p))
    sd = families.to_hf_state_dict(ours, "gemma")
    act = families._as_config_json(ours.config, "gemma")["hidden_act"]  # the activation the export's config says
    hf = transformers.GemmaForCausalLM(transformers.GemmaConfig(**sizes, hidden_act=act)).eval()
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    x = torch.linspace(-4, 4, 101)
    torch.testing.assert_close(hf.model.layers[0].mlp.act_fn(x), torch.nn.functional.gelu(x))  # erf, not tanh
    idx = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, want = ours(idx), hf(idx).logits
    # Other orders of float32 sums (BLAS's kernels differ by CPU class) move the logits by some 1e-5 of the
    # largest; the tanh GELU moves them by more than 1e-3 of it (asserted next: ten times this tolerance).
    largest = float(want.abs().max())
    torch.testing.assert_close(got, want, atol=1e-4 * largest, rtol=0)
    tanh = transformers.GemmaForCausalLM(transformers.GemmaConfig(**sizes)).eval()  # Gemma's default activation
    tanh.load_state_dict(sd, strict=False)
    with torch.no_grad():
        assert (tanh(idx).logits - got).abs().max() > 1e-3 * largest  # the comparison tells the two GELUs apart

    hf.save_pretrained(tmp_path)  # round trip: the directory's config.json and weights back into attnlab
    config_json = json.loads((tmp_path / "config.json").read_text())
    assert config_json["hidden_act"] == act
    for back in (
        GPT.from_hf(transformers.GemmaForCausalLM.from_pretrained(tmp_path)),
        GPT.from_hf(load_file(tmp_path / "model.safetensors"), hf_config=config_json),
    ):
        assert back.config == ours.config
        with torch.no_grad():
            torch.testing.assert_close(back(idx), got, atol=1e-5, rtol=1e-5)


def word_tokenizer(directory, vocab_size: int) -> None:
    """A word-level tokenizer.json of ``vocab_size`` ids (w0, w1, ...), split on spaces."""
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")
    tok.save(str(directory / "tokenizer.json"))


@pytest.mark.slow
def test_model_dir_reads_a_save_pretrained_directory(pair, tmp_path):
    """`--model DIR` (tools.loading.load_pretrained) on what save_pretrained writes."""
    from attnlab.tools.info import config_of
    from attnlab.tools.loading import load_pretrained

    _, hf, ours = pair
    hf.save_pretrained(tmp_path)
    word_tokenizer(tmp_path, V)
    loaded = load_pretrained(str(tmp_path))
    assert loaded.model.config == ours.config
    assert config_of(str(tmp_path))[0] == ours.config  # attnlab info --model DIR
    ids = loaded.tokenizer.encode("w3 w14 w15 w9 w26 w5")
    assert ids == [3, 14, 15, 9, 26, 5]
    idx = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)


def test_a_soft_capped_head_shows_its_cap_step():
    """The inspector's steps of a Gemma 2 head carry the cap; tracing recomposes the capped scores."""
    from attnlab.interpret import STEP_NAMES, inspector_data, trace

    ours = GPT.from_hf(build("gemma2", seed=1))
    idx = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(6))
    t = trace(ours, idx, stages=True)
    steps = t.steps(0)
    assert list(steps) == ["scores", "scaled", "capped", "masked", "weights", "head_outputs"]
    torch.testing.assert_close(steps["capped"], 1.0 * torch.tanh(steps["scaled"] / 1.0))
    assert steps["capped"].abs().max() < 1.0 < steps["scaled"].abs().max()  # the cap bit
    assert "cap * torch.tanh" in STEP_NAMES["capped"]
    page = inspector_data(t, steps="0.1")
    head = page["steps"]["heads"][0]
    assert head["softcap"] == 1.0 and "capped" in page["steps"]["names"]


def test_a_config_json_without_the_new_switches_still_loads(tmp_path):
    import json

    model = GPT(GPTConfig.preset("modern", n_layers=1, emb_dim=32, n_heads=2, vocab_size=V))
    model.save(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    new = {
        "head_size",
        "attn_scale",
        "attn_softcap",
        "logit_softcap",
        "embed_scale",
        "norm_offset",
        "window_layers",
        "rope_local_theta",
        "pre_norms",
        "post_norms",
        "rotary_fraction",
        "parallel_residual",
    }
    assert new <= set(cfg)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k not in new}))
    again = GPT.load(tmp_path)
    assert again.config == model.config
    idx = torch.randint(0, V, (1, 7))
    torch.testing.assert_close(again(idx), model(idx))


# Every switch at once, from scratch: what a user may train (not a published family).
EVERYTHING = dict(
    vocab_size=V,
    context_length=32,
    emb_dim=24,
    n_heads=4,
    n_kv_heads=2,
    n_layers=3,
    drop_rate=0.0,
    bias=False,
    pos="rope",
    norm="rmsnorm",
    mlp="geglu",
    activation="gelu_tanh",
    head_size=8,
    attn_scale=0.3,
    attn_softcap=5.0,
    logit_softcap=7.0,
    embed_scale=2.0,
    norm_offset=1.0,
    window=4,
    sinks=1,
    window_layers=[0, 2],
    rope_local_theta=50.0,
    post_norms=True,
    rotary_fraction=0.5,
    qk_norm="full",
    tie_embeddings=False,
)


@pytest.mark.slow
def test_every_switch_at_once_trains_saves_and_caches(tmp_path):
    torch.manual_seed(0)
    model = GPT(EVERYTHING)
    idx = torch.randint(0, V, (2, 12))
    loss = model.loss(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():  # larger weights: the caps and windows bite
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    model.eval()
    model.save(tmp_path)
    again = GPT.load(tmp_path)
    assert again.config == model.config and again.config.to_dict() == EVERYTHING | again.config.to_dict()
    torch.testing.assert_close(again(idx), model(idx))
    caches = model.new_kv_caches(2)
    assert [c.max_length for c in caches] == [4 + 1, 32 + 1, 4 + 1]  # each layer its own window (+ sink)
    cached, logits = model.generate(idx[:, :3], 20, temperature=0, return_logits=True)
    uncached, logits_u = model.generate(idx[:, :3], 20, temperature=0, use_cache=False, return_logits=True)
    assert torch.equal(cached, uncached)
    torch.testing.assert_close(logits, logits_u, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "overrides,error,match",
    [
        (dict(attn_softcap=0.0), ValueError, "attn_softcap must be a positive number"),
        (dict(logit_softcap=float("inf")), ValueError, "logit_softcap must be a positive number"),
        (dict(norm="layernorm"), ValueError, "norm_offset=1 offsets RMSNorm gains"),
        (dict(window_layers=[0, 3]), ValueError, r"window_layers must be distinct layer indices in \[0, n_layers=3\)"),
        (dict(window_layers=[0, 0]), ValueError, "distinct"),
        (dict(window_layers="0,2"), TypeError, "window_layers must be a list"),
        (dict(window=None, sinks=0), ValueError, "window_layers says which layers slide a window: set window"),
        (dict(window_layers=None), ValueError, "rope_local_theta is the RoPE base of the window_layers"),
        (dict(rotary_fraction=0.2), ValueError, "must be even"),
        (dict(rotary_fraction=1.5), ValueError, r"rotary_fraction must be a number in \(0, 1\]"),
        (dict(pre_norms=False, post_norms=False), ValueError, "a block needs one of them"),
        (dict(parallel_residual=True), ValueError, "parallel_residual with post_norms"),
        (dict(qk_norm="whole"), TypeError, "qk_norm must be a bool, 'head' or 'full'"),
        (dict(head_size=0), ValueError, "head_size"),
        (dict(post_norms="yes"), TypeError, "post_norms must be a bool"),
    ],
)
def test_bad_switches_are_clear_errors(overrides, error, match):
    with pytest.raises(error, match=match):
        GPTConfig(**{**EVERYTHING, **overrides})


def test_bad_family_configs_are_clear_errors():
    hf = build("qwen3", seed=0)
    cfg = hf.config.to_dict()
    with pytest.raises(ValueError, match="attention_bias=True in a Qwen3 config"):
        GPT.from_hf(hf.state_dict(), hf_config={**cfg, "attention_bias": True})
    with pytest.raises(ValueError, match="silu-gated"):
        GPT.from_hf(hf.state_dict(), hf_config={**cfg, "hidden_act": "relu"})
    with pytest.raises(ValueError, match="rope_scaling type must be one of"):
        GPT.from_hf(hf.state_dict(), hf_config={**cfg, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="needs 'num_hidden_layers'"):
        GPT.from_hf(hf.state_dict(), hf_config={k: v for k, v in cfg.items() if k != "num_hidden_layers"})
    with pytest.raises(ValueError, match="pass hf_config"):
        GPT.from_hf(hf.state_dict(), hf_config=None) if False else families.to_attnlab(hf.state_dict())
    sd = dict(hf.state_dict())
    sd["model.layers.1.self_attn.q_norm.weight"] = sd["model.layers.1.self_attn.q_norm.weight"][:3]
    with pytest.raises(ValueError, match=r"'layers\.1\.self_attn\.q_norm\.weight' must have shape \(16,\)"):
        GPT.from_hf(sd, hf_config=cfg)
    del sd["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"'layers\.0\.mlp\.up_proj\.weight' is missing"):
        GPT.from_hf(sd, hf_config=cfg)
    with pytest.raises(ValueError, match="the config says 5 layers"):
        GPT.from_hf(hf.state_dict(), hf_config={**cfg, "num_hidden_layers": 5, "layer_types": None})
    with pytest.raises(ValueError, match="attnlab reads the model types gpt2, llama"):
        GPT.from_hf(hf.state_dict(), hf_config={**cfg, "model_type": "mamba"})
    neox = build("gpt_neox", seed=0)
    sd = dict(neox.state_dict())
    sd["gpt_neox.layers.0.attention.query_key_value.weight"] = sd["gpt_neox.layers.0.attention.query_key_value.weight"][
        :9
    ]
    with pytest.raises(ValueError, match=r"query_key_value\.weight. must have shape \(96, 32\)"):
        GPT.from_hf(sd, hf_config=neox.config)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo2", "gpt_neox"])
def test_published_sizes_have_transformers_shapes(name):
    """transformers' default config of each family (a published model's sizes: Gemma 2's head_dim 256
    beside a width of 2304, Gemma 3's five window layers in six, ...), built on the meta device: every
    tensor converts, and attnlab's model has the same number of parameters."""
    cfg_cls, model_cls = CASES[name][:2]
    config = getattr(transformers, cfg_cls)()
    with torch.device("meta"):
        hf = getattr(transformers, model_cls)(config)
    ours = GPT.from_hf(hf)
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert ours.trf_blocks[0].att.head_dim == head_dim


def test_llama_with_a_head_dim_of_its_own_and_its_export():
    """Mistral Nemo's layout (head_dim * heads != width) through hf_llama, both ways."""
    from attnlab.formats.hf_llama import to_hf_llama

    cfg = {k: v for k, v in COMMON.items()} | dict(head_dim=12)
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    ours = GPT.from_hf(hf)
    assert ours.config.head_size == 12 and ours.trf_blocks[0].att.W_query.weight.shape == (48, 32)
    idx = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(to_hf_llama(ours)(idx).logits, hf(idx).logits, atol=1e-4, rtol=1e-4)


def test_exports_refuse_what_their_layouts_cannot_hold():
    from attnlab.formats.hf import to_hf_gpt2_state_dict
    from attnlab.formats.hf_llama import to_hf_llama_state_dict

    llama = dict(vocab_size=V, emb_dim=16, n_heads=2, n_layers=1, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    with pytest.raises(ValueError, match="attn_softcap"):
        to_hf_llama_state_dict(GPT(llama | dict(attn_softcap=5.0)))
    with pytest.raises(ValueError, match="post_norms"):
        to_hf_llama_state_dict(GPT(llama | dict(post_norms=True)))
    with pytest.raises(ValueError, match="parallel_residual"):
        to_hf_gpt2_state_dict(GPT(dict(vocab_size=V, emb_dim=16, n_heads=2, n_layers=1, parallel_residual=True)))
    # heads wider than emb_dim / n_heads: GPT-2's c_attn cannot hold them (the check once never fired)
    with pytest.raises(ValueError, match="head_size"):
        to_hf_gpt2_state_dict(GPT(dict(vocab_size=V, emb_dim=16, n_heads=2, n_layers=1, head_size=16)))
    to_hf_gpt2_state_dict(GPT(dict(vocab_size=V, emb_dim=16, n_heads=2, n_layers=1, head_size=8)))  # (its own)


@pytest.mark.slow
def test_generate_cli_reads_a_gemma2_directory(tmp_path, capsys):
    """`attnlab generate --model DIR` on a Gemma 2 (soft caps, alternating windows): transformers' greedy tokens."""
    from attnlab.cli import main
    from attnlab.tokenizers import HFTokenizer

    hf = build("gemma2", seed=7)
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(tmp_path)
    word_tokenizer(tmp_path, V)
    tok = HFTokenizer(tmp_path / "tokenizer.json")
    prompt = "w3 w14 w15 w9"
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, do_sample=False, pad_token_id=0)
    want = out[0, ids.shape[1] :].tolist()
    argv = ["generate", "--model", str(tmp_path), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "9"]
    assert main([*argv, "--device", "cpu"]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(want) + "\n"


# config.json as the published files write it (the keys before transformers 5's rope_parameters and
# layer_types), small sizes: (config class, model class, the dict)
OLD_STYLE = {
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=False, sliding_window=131072, max_window_layers=2, rope_theta=1000000.0),
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=8,
            sliding_window=5,
            query_pre_attn_scalar=12,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=4.0,
            rope_theta=10000.0,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=8,
            num_hidden_layers=7,
            sliding_window=5,
            sliding_window_pattern=6,
            query_pre_attn_scalar=8,
            rope_theta=100000.0,
            rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(rope_theta=10000.0, partial_rotary_factor=0.5, sliding_window=6, pad_token_id=0),
    ),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(num_key_value_heads=None, rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True),
    ),
}


@pytest.mark.parametrize("model_type", list(OLD_STYLE))
def test_published_config_json_keys(model_type):
    cfg_cls, model_cls, extra = OLD_STYLE[model_type]
    old = {k: v for k, v in {**COMMON, **extra}.items() if v is not None} | {"model_type": model_type}
    if model_type == "gpt_neox":
        old = {k: v for k, v in old.items() if k not in ("num_key_value_heads", "rms_norm_eps")}
    torch.manual_seed(8)
    hf = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**old)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.5 * torch.randn_like(p))
    ours = GPT.from_hf(hf.state_dict(), hf_config=old)  # the old-style dict, not transformers' reading of it
    assert ours.config == GPT.from_hf(hf).config
    idx = torch.randint(0, V, (1, 19), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)


# Families whose blocks are the same computation: exporting one as the other is right.
SAME_BLOCKS = {("llama", "mistral"), ("llama", "phi3"), ("olmo2", "olmo3")}  # (the second without its windows)


@pytest.mark.parametrize("name", ["llama", *CASES])
def test_export_under_another_family_is_refused(name):
    """A model exported under a family whose switches differ from its config's must not pass silently
    (it used to: a Llama model loaded into Gemma with every key matched and other logits)."""
    llama = name == "llama"
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval() if llama else build(name)
    ours = GPT.from_hf(hf)
    own = hf.config.model_type
    assert families.to_hf_state_dict(ours, own)  # its own family still exports
    for target in families.MODEL_TYPES:
        if target == own or (own, target) in SAME_BLOCKS:
            continue
        with pytest.raises(ValueError, match=f"model_type={target!r}"):
            families.to_hf_state_dict(ours, target)


def test_gpt2_is_sent_where_it_is_handled():
    ours = GPT(dict(vocab_size=V, emb_dim=16, n_heads=2, n_layers=1))
    with pytest.raises(ValueError, match="to_hf_gpt2_state_dict") as err:
        families.to_hf_state_dict(ours, "gpt2")
    assert "got 'gpt2'" not in str(err.value)
    with pytest.raises(ValueError, match="from_hf_gpt2"):
        families.to_attnlab({}, hf_config={"model_type": "gpt2"})


def test_bias_tensors_the_config_switches_off_are_refused():
    # transformers drops them with a warning; attnlab's model would then compute something else.
    cfg = dict(COMMON, attention_bias=True, mlp_bias=True)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    assert GPT.from_hf(hf).config.qkv_bias  # read with its own config: biases on
    with pytest.raises(ValueError, match=r"'layers\.0\.self_attn\.q_proj\.bias', a bias the config switches off"):
        GPT.from_hf(hf.state_dict(), hf_config=dict(COMMON, model_type="llama"))


def test_the_rotary_fraction_of_rope_parameters_comes_first(tmp_path):
    # transformers 5 saves GPTNeoXConfig(partial_rotary_factor=0.5) with rope_parameters' own 0.25
    # beside it, and rotates by rope_parameters'.
    cfg = transformers.GPTNeoXConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        partial_rotary_factor=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.GPTNeoXForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = GPT.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.config.rope_dim == hf.gpt_neox.layers[0].attention.rotary_ndims
    idx = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)


def test_from_pretrained_takes_a_path_and_never_sends_it_to_the_hub(tmp_path):
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON)).eval()
    hf.save_pretrained(tmp_path / "gpt2")  # (a folder named like a published model: still the folder)
    assert GPT.from_pretrained(tmp_path / "gpt2").config.vocab_size == COMMON["vocab_size"]
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        GPT.from_pretrained(tmp_path / "owner" / "name")  # (a Hub id's shape, but a path)
