"""Hostile model files: every defect of a GGUF file or a Hugging Face model directory ends in one
``ValueError`` (``FileNotFoundError`` for a missing file) from the library, and in one line on
stderr with exit status 2 from ``attnlab generate --model``: never a traceback, never a silently
wrong model.

One table per format: each row makes a defective copy of a small valid model (a tiny transformers
Llama, written as llama.cpp's converter writes GGUF files, or saved by ``save_pretrained``) and
names a fragment the message must contain. The untouched copies load and generate, so every row
fails for its own defect.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from attnlab import GPT  # noqa: E402
from attnlab.cli import main  # noqa: E402
from attnlab.tools.loading import load_pretrained  # noqa: E402
from gguf_files import MERGES, SPECIALS, tiny_llama, tokens, write_gguf  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module")
def hf_model():
    return tiny_llama(seed=3)


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory, hf_model) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf", hf_model)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory, hf_model, good_gguf) -> Path:
    """The same model as a Hugging Face directory: ``save_pretrained`` and the tokenizer transformers
    builds from the GGUF file."""
    d = tmp_path_factory.mktemp("hf") / "model"
    hf_model.save_pretrained(d)
    tok = transformers.AutoTokenizer.from_pretrained(str(good_gguf.parent), gguf_file=good_gguf.name)
    tok.save_pretrained(d)
    return d


def run_cli(capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["generate", *args, "--prompt", "the a", "--max-new-tokens", "2", "--temperature", "0"])
    out, err = capsys.readouterr()
    return code, err if code else out


# ---------------------------------------------------------------------------------------------
# GGUF files
# ---------------------------------------------------------------------------------------------
def _bytes(edit: Callable[[bytearray], bytes | bytearray]) -> Callable[[Path, Path], None]:
    def make(good: Path, path: Path) -> None:
        path.write_bytes(bytes(edit(bytearray(good.read_bytes()))))

    return make


def _set(data: bytearray, offset: int, fmt: str, value: int) -> bytearray:
    data[offset : offset + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return data


def _tensor_type_offset(data: bytearray, name: str) -> int:
    """Where the GGML type of tensor ``name`` sits in its tensor-info record (name, n_dims, dims, type)."""
    at = data.index(name.encode()) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return at + 4 + 8 * n_dims


def _write(meta=None, tensors=None) -> Callable[[Path, Path], None]:
    def make(good: Path, path: Path) -> None:
        write_gguf(path, tiny_llama(seed=3), meta=meta, tensors=tensors)

    return make


def _drop(name: str):
    return lambda arrays: {k: v for k, v in arrays.items() if k != name}


def _poison(name: str, value: float):
    """The arrays with one number of tensor ``name`` set to ``value`` (a NaN or an infinity)."""

    def edit(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        a = arrays[name].copy()
        a.flat[5] = value
        return arrays | {name: a}

    return edit


GGUF_ROWS = {
    "empty file": (_bytes(lambda d: b""), "not a GGUF file"),
    "bad magic": (_bytes(lambda d: b"GGUX" + d[4:]), "not a GGUF file"),
    "a safetensors file named .gguf": (_bytes(lambda d: struct.pack("<Q", 2) + b"{}"), "not a GGUF file"),
    "bad version": (_bytes(lambda d: _set(d, 4, "<I", 99)), "version 99"),
    "header only": (_bytes(lambda d: d[:24]), "truncated or corrupt"),
    "truncated in the metadata": (_bytes(lambda d: d[:3000]), "header runs past the end of the file (3,000 bytes"),
    "truncated in the tensor data": (_bytes(lambda d: d[:-1000]), "past the end of the file"),
    "absurd metadata count": (_bytes(lambda d: _set(d, 16, "<Q", 1 << 40)), "truncated or corrupt"),
    "unknown quantization type": (
        _bytes(lambda d: _set(d, _tensor_type_offset(d, "blk.0.attn_q.weight"), "<I", 250)),
        "unknown quantization type",
    ),
    "shapes disagree with the metadata": (
        _write(meta={"llama.embedding_length": 64, "llama.rope.dimension_count": 16}),
        "must have shape",
    ),
    "tensor of the wrong shape": (
        _write(tensors=lambda a: a | {"blk.1.attn_k.weight": np.zeros((32, 32), np.float32)}),
        "must have shape",
    ),
    "heads do not divide the width": (_write(meta={"llama.attention.head_count": 6}), "not divisible"),
    "kv heads do not divide the heads": (_write(meta={"llama.attention.head_count_kv": 3}), "key/value heads"),
    "zero heads": (_write(meta={"llama.attention.head_count": 0}), "head_count must be a positive integer"),
    "more layers than tensors": (_write(meta={"llama.block_count": 3}), "the config says 3 layers"),
    "absurd layer count": (_write(meta={"llama.block_count": (1 << 31) - 1}), "the config says 2147483647 layers"),
    "RoPE factors not of Llama 3's scaling": (
        _write(tensors=lambda a: a | {"rope_freqs.weight": np.array([1, 3, 1, 2], np.float32)}),
        "'rope_freqs.weight': RoPE frequency factors do not follow Llama 3's scaling",
    ),
    "RoPE factors beside another scaling": (
        _write(
            meta={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
            tensors=lambda a: a | {"rope_freqs.weight": np.ones(4, np.float32)},
        ),
        "'rope_freqs.weight' must be float32 and the file's only RoPE scaling",
    ),
    "RoPE factors of the wrong length": (
        _write(tensors=lambda a: a | {"rope_freqs.weight": np.ones(3, np.float32)}),
        "'rope_freqs.weight': RoPE frequency factors must be 4 positive numbers",
    ),
    "fewer layers than tensors": (_write(meta={"llama.block_count": 1}), "unexpected tensor 'blk.1."),
    "negative norm epsilon": (_write(meta={"llama.attention.layer_norm_rms_epsilon": -1e-5}), "positive number"),
    "NaN norm epsilon": (_write(meta={"llama.attention.layer_norm_rms_epsilon": float("nan")}), "positive number"),
    "zero RoPE base": (_write(meta={"llama.rope.freq_base": 0.0}), "positive number"),
    "zero context": (_write(meta={"llama.context_length": 0}), "positive integer"),
    "width as a string": (_write(meta={"llama.embedding_length": "32"}), "positive integer"),
    "no feed-forward size": (_write(meta={"llama.feed_forward_length": None}), "lacks llama.feed_forward_length"),
    "partial rotary": (_write(meta={"llama.rope.dimension_count": 4}), "rope.dimension_count"),
    "unsupported RoPE scaling": (
        _write(meta={"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0}),
        "RoPE scaling 'longrope' (factor 2.0) is not supported yet",
    ),
    "YaRN without its factor": (_write(meta={"llama.rope.scaling.type": "yarn"}), "RoPE scaling 'yarn' (factor None)"),
    "YaRN without its original context": (
        _write(meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}),
        "YaRN scaling needs a positive integer llama.rope.scaling.original_context_length",
    ),
    "YaRN with DeepSeek's log multiplier": (
        _write(
            meta={
                "llama.rope.scaling.type": "yarn",
                "llama.rope.scaling.factor": 4.0,
                "llama.rope.scaling.original_context_length": 16,
                "llama.rope.scaling.yarn_log_multiplier": 0.1,
            }
        ),
        "llama.rope.scaling.yarn_log_multiplier is not supported yet",
    ),
    "a Llama file labelled qwen2": (_write(meta={"general.architecture": "qwen2"}), "lacks qwen2.embedding_length"),
    "unknown architecture": (_write(meta={"general.architecture": "bert"}), "'bert' is not supported yet"),
    "no architecture": (
        _bytes(lambda d: d.replace(b"general.architecture", b"general.architectxre")),
        "no general.architecture",
    ),
    "a missing tensor": (_write(tensors=_drop("blk.1.ffn_down.weight")), "'layers.1.mlp.down_proj.weight' is missing"),
    # (loaded silently before: every logit came out NaN)
    "a NaN in a weight": (
        _write(tensors=_poison("blk.1.attn_k.weight", float("nan"))),
        "'layers.1.self_attn.k_proj.weight' holds NaN or infinite values",
    ),
    "an infinity in a norm": (
        _write(tensors=_poison("output_norm.weight", float("inf"))),
        "'norm.weight' holds NaN or infinite values",
    ),
    "an unknown tensor": (
        _write(tensors=lambda a: a | {"blk.0.attn_sinks.weight": np.zeros(4, np.float32)}),
        "unexpected tensor 'blk.0.attn_sinks.weight'",
    ),
    "fewer tokens than the vocabulary": (
        _write(
            meta={
                "tokenizer.ggml.tokens": tokens()[:-1],
                "tokenizer.ggml.token_type": [3, 3, 3] + [1] * 259,
                "tokenizer.ggml.merges": MERGES[:-1],
            }
        ),
        "its tokenizer has 262 tokens, its model 263",
    ),
    "token types do not match the tokens": (_write(meta={"tokenizer.ggml.token_type": [1, 1]}), "token types"),
    "a SentencePiece tokenizer without scores": (
        _write(meta={"tokenizer.ggml.model": "llama"}),
        "tokenizer.ggml.scores is missing",
    ),
    "an unknown tokenizer kind": (_write(meta={"tokenizer.ggml.model": "t5"}), "'t5' are not supported yet"),
    "unknown pre-tokenizer": (_write(meta={"tokenizer.ggml.pre": "mystery"}), "'mystery' is not supported yet"),
    "merge of unknown tokens": (_write(meta={"tokenizer.ggml.merges": [*MERGES, "zz qq"]}), "does not build"),
    "end-of-text id out of range": (_write(meta={"tokenizer.ggml.eos_token_id": 9999}), "eos_token_id"),
    # (these were dropped silently: only bos and eos were checked in a byte-level file)
    "end-of-turn id out of range": (_write(meta={"tokenizer.ggml.eot_token_id": 9999}), "eot_token_id"),
    "end-of-message id out of range": (_write(meta={"tokenizer.ggml.eom_token_id": -1}), "eom_token_id"),
    "padding id out of range": (_write(meta={"tokenizer.ggml.padding_token_id": 263}), "padding_token_id"),
    "no tokenizer": (_write(meta={"tokenizer.ggml.model": None}), "stores no tokenizer"),
    "chat template that does not compile": (_write(meta={"tokenizer.chat_template": "{% for %}"}), "does not compile"),
}


# rows whose defect is in the tokenizer or the chat template: GPT.from_gguf (the model alone) loads them
MODEL_IS_FINE = {
    "fewer tokens than the vocabulary",
    "token types do not match the tokens",
    "a SentencePiece tokenizer without scores",
    "an unknown tokenizer kind",
    "unknown pre-tokenizer",
    "merge of unknown tokens",
    "end-of-text id out of range",
    "end-of-turn id out of range",
    "end-of-message id out of range",
    "padding id out of range",
    "no tokenizer",
    "chat template that does not compile",
}


@pytest.mark.slow
def test_the_good_gguf_loads_and_generates(good_gguf, capsys):
    code, out = run_cli(capsys, "--model", str(good_gguf))
    assert code == 0 and out.startswith("the a")
    assert load_pretrained(str(good_gguf)).tokenizer.encode("".join(SPECIALS)) == [0, 1, 2]


@pytest.mark.slow
@pytest.mark.parametrize("row", GGUF_ROWS, ids=list(GGUF_ROWS))
def test_hostile_gguf(row, good_gguf, tmp_path, capsys):
    make, fragment = GGUF_ROWS[row]
    path = tmp_path / "model.gguf"
    make(good_gguf, path)
    with pytest.raises(ValueError) as info:
        load_pretrained(str(path))
    assert fragment in str(info.value) and str(path) in str(info.value), str(info.value)
    assert "dtype" not in str(info.value)  # (numpy's words for reading past the end)
    if row not in MODEL_IS_FINE:
        with pytest.raises(ValueError):  # the model alone, through the library's own entry point
            GPT.from_gguf(path)
    code, err = run_cli(capsys, "--model", str(path))
    assert code == 2 and err.count("\n") == 1 and err.startswith("attnlab generate: error: --model "), err
    assert fragment in err


@pytest.mark.parametrize("qtype", ["Q8_0", "F16"])
def test_a_quantized_weight_with_a_nan_is_refused(qtype, tmp_path):
    path = write_gguf(
        tmp_path / "nan.gguf", tiny_llama(seed=3), qtype=qtype, tensors=_poison("blk.0.ffn_up.weight", np.nan)
    )
    with pytest.raises(ValueError, match=r"'layers\.0\.mlp\.up_proj\.weight' holds NaN or infinite values"):
        GPT.from_gguf(path)


def test_gguf_without_the_suffix_is_recognised_by_its_magic(good_gguf, tmp_path, capsys):
    path = tmp_path / "model.bin"
    shutil.copy(good_gguf, path)
    code, out = run_cli(capsys, "--model", str(path))
    assert code == 0 and out.startswith("the a")


def test_missing_gguf_is_one_line(tmp_path, capsys):
    code, err = run_cli(capsys, "--model", str(tmp_path / "nothing.gguf"))
    assert code == 2 and err.count("\n") == 1 and "no such GGUF file" in err


# ---------------------------------------------------------------------------------------------
# Hugging Face directories
# ---------------------------------------------------------------------------------------------
def _config(**changes) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(cfg | changes))

    return edit


def _weights(edit: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def make(d: Path) -> None:
        p = d / "model.safetensors"
        p.write_bytes(edit(p.read_bytes()))

    return make


def _tokenizer_with_more_tokens(d: Path) -> None:
    tok = json.loads((d / "tokenizer.json").read_text())
    start = max(t["id"] for t in tok["added_tokens"]) + 1
    tok["added_tokens"] += [
        {"id": start + 300 + i, "content": f"<extra{i}>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i in range(3)
    ]  # fmt: skip
    (d / "tokenizer.json").write_text(json.dumps(tok))


def _safetensors_poisoned(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(d / "model.safetensors")
    state["model.layers.0.self_attn.v_proj.weight"][0, 3] = float("-inf")
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})


HF_ROWS = {
    "truncated safetensors": (_weights(lambda b: b[: len(b) // 2]), "safetensors"),
    "safetensors header length past the end": (_weights(lambda b: struct.pack("<Q", 1 << 40) + b[8:]), "safetensors"),
    "safetensors header not JSON": (_weights(lambda b: b[:8] + b"\xff" * 16 + b[24:]), "safetensors"),
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{nope"), "config.json"),
    "config.json a list": (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json"),
    "zero heads": (_config(num_attention_heads=0), "num_attention_heads"),
    "heads do not divide the width": (_config(num_attention_heads=6, head_dim=None), "hidden_size"),
    "kv heads do not divide the heads": (_config(num_key_value_heads=3), "num_key_value_heads"),
    "width as a string": (_config(hidden_size="32"), "hidden_size"),
    "negative vocabulary": (_config(vocab_size=-1), "vocab_size"),
    "more layers than weights": (_config(num_hidden_layers=3), "3 layers"),
    "negative norm epsilon": (_config(rms_norm_eps=-1.0), "eps"),
    "no heads": (_config(num_attention_heads=None), "num_attention_heads"),
    "tokenizer larger than the vocabulary": (_tokenizer_with_more_tokens, "more than the model's vocab_size"),
    "tokenizer.json corrupt": (lambda d: (d / "tokenizer.json").write_text("{]"), "tokenizer"),
    "an infinity in a weight": (_safetensors_poisoned, "'layers.0.self_attn.v_proj.weight' holds NaN or infinite"),
}


def test_the_good_directory_loads_and_generates(good_dir, capsys):
    code, out = run_cli(capsys, "--model", str(good_dir))
    assert code == 0 and out.startswith("the a")


@pytest.mark.parametrize("row", HF_ROWS, ids=list(HF_ROWS))
def test_hostile_hf_directory(row, good_dir, tmp_path, capsys):
    edit, fragment = HF_ROWS[row]
    d = tmp_path / "model"
    shutil.copytree(good_dir, d)
    edit(d)
    with pytest.raises(ValueError) as info:
        load_pretrained(str(d))
    assert fragment in str(info.value), str(info.value)
    code, err = run_cli(capsys, "--model", str(d))
    assert code == 2 and err.count("\n") == 1 and err.startswith("attnlab generate: error:"), err
    assert fragment in err
