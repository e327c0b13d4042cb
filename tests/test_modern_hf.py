"""Llama-family interop and the hf tokenizer, against Hugging Face itself.

transformers' LlamaForCausalLM and MistralForCausalLM are built from small configs (no download):
attnlab's logits must match within 1e-4, greedy tokens must equal ``generate``'s, the cache must
change nothing. ``from_pretrained`` reads save_pretrained directories (sharded too) and a Hugging
Face cache offline; the hf tokenizer is checked against transformers' PreTrainedTokenizerFast.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.model import GPT
from attnlab.tokenizers import HFTokenizer, StreamDecoder, get_tokenizer, tokenizer_from_dict

transformers = pytest.importorskip("transformers")
hf_tokenizers = pytest.importorskip("tokenizers")

V = 61


def llama(seed: int = 0, mistral: bool = False, **overrides) -> torch.nn.Module:
    cfg = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=56,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    if mistral:
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**cfg))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    with torch.no_grad():  # weights larger than the init: peaked, varied next-token distributions
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.mul_(6)
    return model.eval()


CASES = {
    "llama_gqa": dict(),
    "llama_mha_tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "llama_bias": dict(attention_bias=True, mlp_bias=True),
    "llama3_scaling": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "yarn_scaling": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "mistral_window": dict(mistral=True, sliding_window=5),
    "mistral_no_window": dict(mistral=True, sliding_window=None, num_key_value_heads=1),
}


def build(name: str, seed: int = 0):
    kw = dict(CASES[name])
    return llama(seed, mistral=kw.pop("mistral", False), **kw)


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_hugging_face(name):
    hf = build(name, seed=1)
    ours = GPT.from_hf_llama(hf)
    assert ours.config.pos == "rope" and ours.config.mlp == "swiglu" and ours.config.norm == "rmsnorm"
    idx = torch.randint(0, V, (3, 23), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(idx).logits
        torch.testing.assert_close(ours(idx), want, atol=1e-4, rtol=1e-4)
        # left padding: each row's logits are its own
        mask = torch.ones_like(idx)
        mask[1, :7] = 0
        got = ours(idx, attention_mask=mask)
        alone = hf(idx[1:2, 7:]).logits
        torch.testing.assert_close(got[1, 7:], alone[0], atol=1e-4, rtol=1e-4)
    # the same through from_hf's dispatch, and from a bare state dict with its config
    torch.testing.assert_close(GPT.from_hf(hf)(idx), ours(idx))
    torch.testing.assert_close(GPT.from_hf(hf.state_dict(), hf_config=hf.config.to_dict())(idx), ours(idx))


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_window", "llama_mha_tied"])
def test_greedy_tokens_equal_generate_and_the_cache_changes_nothing(name):
    hf = build(name, seed=3)
    ours = GPT.from_hf_llama(hf)
    prompt = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(4))
    n = 30  # past Mistral's window of 5: its cache rolls
    hf.generation_config.eos_token_id = None  # no end-of-text: every row runs n tokens, nothing suppressed
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)
        hf_uncached = hf.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(want, hf_uncached)
    cached, logits = ours.generate(prompt, n, temperature=0, return_logits=True)
    uncached, logits_u = ours.generate(prompt, n, temperature=0, use_cache=False, return_logits=True)
    assert torch.equal(cached, want)
    assert torch.equal(uncached, want)
    torch.testing.assert_close(logits, logits_u, atol=1e-4, rtol=1e-4)
    if ours.config.window is not None:
        assert all(c.max_length == ours.config.window for c in ours.new_kv_caches(2))


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_window", "llama_bias", "llama_mha_tied", "llama3_scaling"])
def test_export_loads_into_transformers(name):
    from attnlab.formats.hf_llama import to_hf_llama

    ours = GPT.from_hf_llama(build(name, seed=5))
    back = to_hf_llama(ours)
    assert back.config.model_type == ("mistral" if name.startswith("mistral") else "llama")
    idx = torch.randint(0, V, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(back(idx).logits, ours(idx), atol=1e-4, rtol=1e-4)
    sd = ours.to_hf_llama_state_dict()
    assert set(sd) == set(back.state_dict()) | ({"lm_head.weight"} if ours.config.tie_embeddings else set())


def test_bad_llama_inputs_are_clear_errors():
    from attnlab.formats.hf_llama import to_hf_llama_state_dict

    hf = build("llama_gqa")
    with pytest.raises(ValueError, match="hidden_act"):
        GPT.from_hf_llama(hf.state_dict(), hf_config={**hf.config.to_dict(), "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="pass hf_config"):
        GPT.from_hf_llama(hf.state_dict())
    with pytest.raises(ValueError, match="Llama-family"):
        GPT.from_hf_llama(hf.state_dict(), hf_config={**hf.config.to_dict(), "model_type": "qwen3"})
    sd = dict(hf.state_dict())
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:, :5]
    with pytest.raises(ValueError, match=r"must have shape \(56, 32\)"):
        GPT.from_hf_llama(sd, hf_config=hf.config)
    del sd["model.norm.weight"]
    with pytest.raises(ValueError, match=r"'norm\.weight' is missing"):
        GPT.from_hf_llama(sd, hf_config=hf.config)
    with pytest.raises(ValueError, match="one bias switch"):
        GPT.from_hf_llama(hf.state_dict(), hf_config={**hf.config.to_dict(), "attention_bias": True})
    with pytest.raises(ValueError, match="a Llama block has RoPE"):
        to_hf_llama_state_dict(GPT.from_hf_llama(hf).__class__({"vocab_size": 5, "emb_dim": 8, "n_heads": 2}))


# =============================================================================================
# from_pretrained: local directories (sharded safetensors) and the Hugging Face cache
# =============================================================================================
def test_from_pretrained_reads_a_sharded_save_pretrained_directory(tmp_path):
    hf = build("mistral_window", seed=6)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours = GPT.from_pretrained(str(tmp_path))
    idx = torch.randint(0, V, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)
    assert ours.config.window == 5


def test_from_pretrained_reads_the_hugging_face_cache_offline(tmp_path, monkeypatch):
    """A hub cache laid out as huggingface_hub writes it (refs/main -> snapshots/<commit>/...), offline."""
    from huggingface_hub import constants

    hf = build("llama_gqa", seed=7)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / commit
    hf.save_pretrained(snapshot, max_shard_size="20KB")
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    ours = GPT.from_pretrained("acme/tiny-llama", cache_dir=tmp_path / "hub", dtype=torch.float64)
    assert ours.dtype == torch.float64
    idx = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx).float(), hf(idx).logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(FileNotFoundError, match="acme/absent"):
        GPT.from_pretrained("acme/absent", cache_dir=tmp_path / "hub")


def test_from_pretrained_refuses_other_architectures(tmp_path):
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    transformers.BertModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'bert' model"):
        GPT.from_pretrained(str(tmp_path))


# =============================================================================================
# The hf tokenizer
# =============================================================================================
TEXT = (
    "I had always thought Jack Gisburn rather a cheap genius--though a good fellow enough--so it "
    "was no great surprise to me to hear that, in the height of his glory, he had dropped his painting. "
) * 3


def byte_level_tokenizer(path):
    """A Llama 3-like tokenizer: byte-level BPE, <s> put before every text by the post-processor."""
    tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE())
    tok.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf_tokenizers.decoders.ByteLevel()
    trainer = hf_tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=hf_tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.post_processor = hf_tokenizers.processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}, "bos_token": "<s>"}))
    return path / "tokenizer.json"


def sentencepiece_like_tokenizer(path):
    """A Llama 2 / Mistral-like tokenizer: Metaspace, byte fallback, a decoder that strips the first space."""
    tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE(byte_fallback=True))
    tok.pre_tokenizer = hf_tokenizers.pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = hf_tokenizers.decoders.Sequence(
        [
            hf_tokenizers.decoders.Replace("▁", " "),
            hf_tokenizers.decoders.ByteFallback(),
            hf_tokenizers.decoders.Fuse(),
            hf_tokenizers.decoders.Strip(" ", 1, 0),
        ]
    )
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator([TEXT], hf_tokenizers.trainers.BpeTrainer(vocab_size=420, special_tokens=special))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    return path / "tokenizer.json"


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return byte_level_tokenizer(root / "bytes"), sentencepiece_like_tokenizer(root / "spm")


SAMPLES = ["", "Jack Gisburn", "héllo wörld 😀 — ok", "  two  spaces\nand lines\n", "<s> is text"]


@pytest.mark.parametrize("which", [0, 1])
def test_hf_tokenizer_encodes_as_transformers_and_round_trips(tokenizer_files, which):
    path = tokenizer_files[which]
    tok = HFTokenizer(path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    assert tok.vocab_size == len(fast)
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == fast.encode(text, add_special_tokens=False)
        assert tok.encode_array(text).tolist() == ids
        assert tok.decode(ids) == fast.decode(ids)
        # (a SentencePiece-style decoder strips the space it prepends, and a leading one with it)
        assert tok.decode(ids) == (text if which == 0 or not text.startswith(" ") else text[1:])
    assert tok.eot_id == (tok._tok.token_to_id("</s>") if which == 0 else 2)
    if which == 0:  # the post-processor's <s>: what transformers' tokenizer(text) adds
        assert tok.bos_id == tok._tok.token_to_id("<s>")
        assert tok.encode_prompt("Jack") == fast("Jack")["input_ids"]
    else:
        assert tok.bos_id is None and tok.encode_prompt("Jack") == tok.encode("Jack")
    assert get_tokenizer("hf", path=path.parent) == tok


def test_hf_tokenizer_description_round_trips_and_checks_the_file(tokenizer_files, tmp_path):
    src = tokenizer_files[0]
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes(src.read_bytes())
    tok = HFTokenizer(copy, eot_id=3)
    d = tok.to_dict()
    assert d["name"] == "hf" and json.loads(json.dumps(d)) == d
    again = tokenizer_from_dict(d)
    assert again == tok and again.eot_id == 3 and again.fingerprint() == tok.fingerprint()
    data = json.loads(copy.read_text())
    data["added_tokens"][0]["content"] = "<S>"
    copy.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"differs from the tokenizer\.json"):
        tokenizer_from_dict(d)
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        HFTokenizer(tmp_path / "nowhere")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"not a Hugging Face tokenizer\.json"):
        HFTokenizer(tmp_path / "bad")
    with pytest.raises(ValueError, match="eot_id must be a token id"):
        HFTokenizer(src, eot_id=10**6)
    with pytest.raises(ValueError, match="pass path="):
        get_tokenizer("hf")


@settings(max_examples=40, deadline=None)
@given(which=st.sampled_from([0, 1]), text=st.text(max_size=40), ids=st.lists(st.integers(0, 10**6), max_size=30))
def test_stream_decoder_joins_to_decode(tokenizer_files, which, text, ids):
    """Encoded text (multi-byte characters split over byte tokens) and arbitrary id sequences alike."""
    tok = HFTokenizer(tokenizer_files[which])
    for seq in (tok.encode(text), [i % tok.vocab_size for i in ids]):
        dec = StreamDecoder(tok)
        pieces = [dec.push(i) for i in seq]
        pieces.append(dec.flush())
        assert "".join(pieces) == tok.decode(seq)


@pytest.mark.parametrize(
    "preset,hf_cls,hf_cfg",
    [
        ("llama2-7b", "LlamaForCausalLM", dict(model_type="llama")),
        ("llama3-8b", "LlamaForCausalLM", dict(model_type="llama", num_key_value_heads=8)),
        ("mistral-7b", "MistralForCausalLM", dict(model_type="mistral", num_key_value_heads=8, sliding_window=4096)),
    ],
)
def test_llama_family_presets_have_the_published_shapes(preset, hf_cls, hf_cfg):
    """Built on the meta device: the same parameter tensors as transformers' model of the config
    that to_hf_llama_config writes (and the published totals: 6.74B, 8.03B, 7.24B)."""
    from attnlab.formats.hf_llama import to_hf_llama_config
    from attnlab.model import GPTConfig

    with torch.device("meta"):
        ours = GPT(GPTConfig.preset(preset))
        hf_config = to_hf_llama_config(ours)
        assert {k: getattr(hf_config, k) for k in hf_cfg} == hf_cfg
        theirs = getattr(transformers, hf_cls)(hf_config)
    shapes = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    exported = {k: tuple(v.shape) for k, v in ours.to_hf_llama_state_dict().items()}
    assert exported == shapes
    n = ours.num_parameters()
    assert n == sum(p.numel() for p in theirs.parameters())
    assert round(n / 1e9, 2) == {"llama2-7b": 6.74, "llama3-8b": 8.03, "mistral-7b": 7.24}[preset]


def test_generate_cli_reads_a_llama_directory(tmp_path, tokenizer_files, capsys):
    """`attnlab generate --model DIR`: the model's weights and tokenizer.json, BOS first, greedy tokens
    as transformers' generate, stopping at the end-of-text token."""
    from attnlab.cli import main

    src = tokenizer_files[0].parent  # byte-level BPE, <s> added by its post-processor, </s> the eos
    tok = HFTokenizer(src / "tokenizer.json")
    hf = llama(8, vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eot_id)
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((src / name).read_bytes())
    prompt = "Jack Gisburn"
    ids = torch.tensor([tok.encode_prompt(prompt)])
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tok.eot_id)[0, ids.shape[1] :].tolist()
    if tok.eot_id in want:
        want = want[: want.index(tok.eot_id)]
    argv = ["generate", "--model", str(tmp_path), "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "12"]
    assert main([*argv, "--device", "cpu"]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(want) + "\n"
    with pytest.raises(SystemExit) as exc:  # one source or the other
        main([*argv, "--checkpoint", str(tmp_path)])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("native", [False, True])
def test_bf16_weights_load_in_bf16_only_where_the_device_has_it_natively(
    tmp_path, tokenizer_files, native, monkeypatch
):
    """load_pretrained's default dtype is attnlab.hardware's answer: an AVX2 CPU gets float32."""
    from attnlab import hardware
    from attnlab.tools.loading import load_pretrained

    src = tokenizer_files[0].parent
    tok = HFTokenizer(src / "tokenizer.json")
    llama(3, vocab_size=tok.vocab_size).to(torch.bfloat16).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    monkeypatch.setattr(hardware, "bf16_native", lambda device="cpu": native)
    assert load_pretrained(str(tmp_path)).model.dtype == (torch.bfloat16 if native else torch.float32)
    assert load_pretrained(str(tmp_path), dtype=torch.float32).model.dtype == torch.float32
