"""Hugging Face GPT-2 interop, against GPT2LMHeadModel built from a small random config (no download)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from attnlab.model import GPT, GPTConfig

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install 'attnlab[hf]')")
transformers.logging.set_verbosity_error()

V, CTX = 67, 24


def hf_model(seed: int = 0, scale: float = 15.0, **overrides) -> transformers.GPT2LMHeadModel:
    """A random GPT2LMHeadModel; weights scaled up so next-token choices are varied and tie-free."""
    torch.manual_seed(seed)
    kwargs = dict(vocab_size=V, n_positions=CTX, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    kwargs.update(overrides)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or "bias" in name:
                p.add_(torch.randn_like(p) * 0.02 * scale)
    return model


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_gpt2lmheadmodel(tie):
    hf = hf_model(tie_word_embeddings=tie)
    if not tie:
        with torch.no_grad():
            hf.lm_head.weight.normal_(0, 0.1)
    ours = GPT.from_hf_gpt2(hf)
    assert ours.config.tie_embeddings == tie
    assert ours.num_parameters() == sum(p.numel() for p in hf.parameters())
    idx = torch.randint(0, V, (3, CTX))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)


def test_from_state_dict_with_and_without_prefix():
    hf = hf_model(n_embd=128, n_head=2)  # a bare state dict would assume 64-wide heads: 2 heads
    idx = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        want = hf(idx).logits
    legacy = dict(hf.state_dict())  # older checkpoints (the hub's gpt2 files) also hold the causal-mask buffers
    legacy["transformer.h.0.attn.bias"] = torch.ones(1, 1, CTX, CTX, dtype=torch.bool).tril()
    legacy["transformer.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    with pytest.warns(UserWarning, match="assuming n_heads=2"):
        full = GPT.from_hf_gpt2(legacy)
    with pytest.warns(UserWarning, match="assuming n_heads=2"):
        base = GPT.from_hf_gpt2(hf.transformer.state_dict())  # GPT2Model keys, no lm_head: tied
    assert full.config.n_heads == 2 and base.config.tie_embeddings
    for model in (full, base):
        torch.testing.assert_close(model(idx), want, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="pass n_heads"):
        GPT.from_hf_gpt2(hf_model(n_embd=40, n_head=4).state_dict())
    assert GPT.from_hf_gpt2(hf_model(n_embd=40, n_head=4).state_dict(), n_heads=4).config.n_heads == 4


def test_greedy_generation_matches_hf_generate():
    hf = hf_model(seed=1)
    ours = GPT.from_hf_gpt2(hf)
    idx = torch.randint(1, V, (2, 6))
    with torch.no_grad():
        want = hf.generate(
            idx,
            attention_mask=torch.ones_like(idx),
            max_new_tokens=15,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    assert len(set(want[0, 6:].tolist())) > 3  # a non-degenerate continuation
    for use_cache in (True, False):
        assert torch.equal(ours.generate(idx, 15, temperature=0, use_cache=use_cache), want)


def test_left_padded_batch_matches_hf_generate():
    hf = hf_model(seed=2)
    ours = GPT.from_hf_gpt2(hf)
    idx = torch.randint(1, V, (3, 8))
    mask = torch.ones_like(idx)
    mask[1, :3] = 0
    mask[2, :6] = 0
    idx = idx.masked_fill(mask == 0, 0)
    with torch.no_grad():
        want = hf.generate(
            idx, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None
        )
    assert torch.equal(ours.generate(idx, 10, temperature=0, attention_mask=mask), want)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(qkv_bias=True),
        dict(qkv_bias=False, bias=False),
        dict(tie_embeddings=False, ff_dim=48),
        dict(ln_eps=1e-6),
        dict(activation="gelu"),
    ],
)
def test_export_loads_into_gpt2lmheadmodel(overrides):
    from attnlab.formats.hf import to_hf_gpt2, to_hf_gpt2_config

    torch.manual_seed(0)
    ours = GPT(GPTConfig(vocab_size=V, context_length=CTX, emb_dim=32, n_heads=4, n_layers=2, **overrides)).eval()
    hf = transformers.GPT2LMHeadModel(to_hf_gpt2_config(ours)).eval()
    result = hf.load_state_dict(ours.to_hf_gpt2_state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    idx = torch.randint(0, V, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(to_hf_gpt2(ours)(idx).logits, ours(idx), atol=1e-4, rtol=1e-4)
    back = GPT.from_hf_gpt2(hf)  # round trip (biases switched off come back as zero biases)
    torch.testing.assert_close(back(idx), ours(idx), atol=1e-5, rtol=1e-5)


def test_export_refuses_grouped_query_attention():
    ours = GPT(GPTConfig(vocab_size=V, context_length=CTX, emb_dim=32, n_heads=4, n_layers=1, n_kv_heads=2))
    with pytest.raises(ValueError, match="no grouped-query attention"):
        ours.to_hf_gpt2_state_dict()


def test_rejects_non_gpt2_input():
    with pytest.raises(TypeError, match="GPT2LMHeadModel"):
        GPT.from_hf_gpt2(42)
    with pytest.raises(ValueError, match="not a GPT-2 state dict"):
        GPT.from_hf_gpt2({"weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="gelu_new"):
        GPT.from_hf_gpt2(hf_model(activation_function="relu"))


def test_rejects_weights_that_do_not_fit_and_warns_on_dropout():
    hf = hf_model()
    state = dict(hf.state_dict())
    C = hf.config.n_embd
    state["transformer.h.0.attn.c_attn.weight"] = torch.zeros(C, C)  # (C, C) instead of (C, 3C)
    want = rf"'h.0.attn.c_attn.weight' must have shape \({C}, {3 * C}\), got \({C}, {C}\)"
    with pytest.raises(ValueError, match=want):
        GPT.from_hf_gpt2(state, n_heads=hf.config.n_head)
    with pytest.raises(ValueError, match=f"hf_config says n_embd={C + 8}, but the weights have {C}"):
        GPT.from_hf_gpt2(hf.state_dict(), hf_config={"n_head": hf.config.n_head, "n_embd": C + 8})
    with pytest.raises(ValueError, match="n_positions=7, but the weights have"):
        GPT.from_hf_gpt2(hf.state_dict(), hf_config={"n_head": hf.config.n_head, "n_positions": 7})
    mixed = hf_model(resid_pdrop=0.3, attn_pdrop=0.5, embd_pdrop=0.0)
    with pytest.warns(UserWarning, match="one dropout rate"):
        assert GPT.from_hf_gpt2(mixed).config.drop_rate == 0.3
    assert GPT.from_hf_gpt2(mixed, drop_rate=0.2).config.drop_rate == 0.2  # chosen: no warning needed


def test_from_pretrained_reads_hub_files_through_huggingface_hub(tmp_path, monkeypatch):
    """The real loading path, with the hub download pointed at files written by save_pretrained."""
    import huggingface_hub

    hf = hf_model(seed=3, layer_norm_epsilon=1e-6)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    calls = []

    def fake_download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename))
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    ours = GPT.from_pretrained("gpt2-medium")
    assert calls == [
        ("openai-community/gpt2-medium", "config.json"),
        ("openai-community/gpt2-medium", "model.safetensors"),
    ]
    assert ours.config.ln_eps == 1e-6
    idx = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)
    # A local directory works without the hub at all.
    torch.testing.assert_close(GPT.from_pretrained(str(tmp_path))(idx), ours(idx))


@pytest.mark.slow
def test_from_pretrained_offline_gives_one_clear_sentence(tmp_path):
    code = (
        "from attnlab.model import GPT\n"
        "try:\n    GPT.from_pretrained('gpt2')\n"
        "except FileNotFoundError as e:\n    print('ERR', e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": str(tmp_path / "hub")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stdout.splitlines() if line.startswith("ERR")]
    assert len(lines) == 1, out.stdout + out.stderr
    msg = lines[0]
    assert "openai-community/gpt2" in msg and "connect to the internet" in msg and "\n" not in msg


def test_a_gpt2_folder_in_the_working_directory_does_not_hijack_the_preset(tmp_path, monkeypatch):
    """Regression: from_pretrained("gpt2") used to load ./gpt2 when such a folder existed."""
    import huggingface_hub

    hub, local = hf_model(seed=4), hf_model(seed=5)
    hub.save_pretrained(tmp_path / "hub", safe_serialization=True)
    local.save_pretrained(tmp_path / "gpt2", safe_serialization=True)  # a ./gpt2 folder
    calls = []

    def fake_download(repo_id, filename, **kwargs):
        calls.append(repo_id)
        return str(tmp_path / "hub" / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.chdir(tmp_path)
    idx = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        for name in ("gpt2", "GPT2"):
            ours = GPT.from_pretrained(name)
            torch.testing.assert_close(ours(idx), hub(idx).logits, atol=1e-4, rtol=1e-4)
        assert calls == ["openai-community/gpt2"] * 4  # config.json + model.safetensors, twice
        # A path spelling of the folder loads the folder, without the hub.
        torch.testing.assert_close(GPT.from_pretrained("./gpt2")(idx), local(idx).logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(
            GPT.from_pretrained(str(tmp_path / "gpt2"))(idx), local(idx).logits, atol=1e-4, rtol=1e-4
        )
    assert len(calls) == 4


def test_a_hugging_face_folder_named_like_a_gguf_file_loads_as_a_folder(tmp_path):
    """A directory whose name ends in .gguf is a Hugging Face folder (it was refused as "no such file")."""
    model = hf_model(seed=6)
    model.save_pretrained(tmp_path / "odd.gguf", safe_serialization=True)
    idx = torch.randint(0, V, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(
            GPT.from_pretrained(str(tmp_path / "odd.gguf"))(idx), model(idx).logits, atol=1e-4, rtol=1e-4
        )


def test_the_command_line_loads_a_folder_named_like_a_gguf_file_as_a_folder(tmp_path, gpt2):
    """load_pretrained (every command's --model): a directory whose name ends in .gguf is a Hugging Face folder
    (it was read as a GGUF file)."""
    from attnlab.tools.loading import load_pretrained
    from shared_data import GPT2_BPE_DIR

    model = hf_model(seed=7, vocab_size=50257)  # (GPT-2's tokenizer: its vocabulary)
    model.save_pretrained(tmp_path / "odd.gguf", safe_serialization=True)
    loaded = load_pretrained(str(tmp_path / "odd.gguf"), dtype=torch.float32, bpe_dir=GPT2_BPE_DIR)
    idx = torch.randint(0, 50257, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(idx), model(idx).logits, atol=1e-4, rtol=1e-4)


def test_a_name_neither_on_the_hub_nor_a_local_folder_says_both(tmp_path, monkeypatch):
    """'models/foo' is a Hub id and a relative path alike: offline, and no such folder, the one error says
    that neither holds a model (a known name like 'gpt2' says only the Hub part)."""
    import huggingface_hub

    def offline(repo_id, filename, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no local folder 'models/foo' here either.*local directory"):
        GPT.from_pretrained("models/foo")
    with pytest.raises(FileNotFoundError) as known:
        GPT.from_pretrained("gpt2")
    assert "local folder" not in str(known.value) and "could not get the weights" in str(known.value)


@pytest.mark.parametrize("resolves", [False, True])
def test_without_a_network_the_hub_is_not_tried_six_times(monkeypatch, resolves):
    # huggingface_hub retries a request that cannot connect for 23 s, a warning a try, before it reads
    # its cache: where the Hub's name does not even resolve, only the cache is read.
    import socket

    import huggingface_hub

    from attnlab.formats import hub

    calls = []

    def download(repo_id, filename, **kwargs):
        calls.append(kwargs.get("local_files_only", False))
        raise OSError("not in the cache")

    def getaddrinfo(host, port, *args, **kwargs):
        if not resolves:
            raise socket.gaierror(-2, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    hub._hub_unresolvable.cache_clear()
    try:
        with pytest.raises(FileNotFoundError, match="no network" if not resolves else "OSError"):
            GPT.from_pretrained("gpt2")
    finally:
        hub._hub_unresolvable.cache_clear()
    assert calls == [not resolves]
