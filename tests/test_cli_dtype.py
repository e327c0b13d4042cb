"""``--dtype`` in every command that reads a model: a GGUF file's quantized matrices stay quantized
without it, become dense float32 (or another dtype) with it; with ``--checkpoint`` it is one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("gguf")

from attnlab.cli import generate as generate_command
from attnlab.cli import main
from attnlab.model import GPT, GPTConfig
from attnlab.quantized import is_quantized
from attnlab.tokenizers import CharTokenizer
from attnlab.tools import loading
from test_quantized import write_quantized_gguf

# Each command that reads a model, with what it needs besides --model to reach the loading.
COMMANDS = {
    "inspect": ["--prompt", "ab"],
    "viz": ["--prompt", "ab"],
    "patch": ["--clean", "ab", "--corrupted", "ac", "--answers", "a", "b"],
    "circuit": ["--clean", "ab", "--corrupted", "ac", "--answers", "a", "b"],
    "serve": [],
    "eval": ["--data", "DATA"],
    "generate": ["--prompt", "ab"],
}


class Loaded(Exception):
    """Raised by the recording loader: the command stops once its model is read."""


@pytest.fixture(scope="module")
def q4_0_file(tmp_path_factory):
    return write_quantized_gguf(tmp_path_factory.mktemp("dtype") / "tiny.Q4_0.gguf", "Q4_0")


def argv(command: str, tmp_path, *source: str) -> list[str]:
    data = tmp_path / "data.txt"
    data.write_text("abc abc abc\n")
    return [command, *source, *(str(data) if a == "DATA" else a for a in COMMANDS[command])]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_dtype_makes_a_gguf_files_quantized_matrices_dense(command, q4_0_file, tmp_path, monkeypatch):
    if command == "serve":
        pytest.importorskip("fastapi")
    models = []

    def recording(load):
        def read(*args, **kwargs):
            models.append(load(*args, **kwargs).model)
            raise Loaded

        return read

    # `generate` imports `load` by name, so it is patched there too. Its module is imported above, not by
    # the patch: imported after `loading.load` was patched, it would hold the recording loader as its own,
    # and the undo would put that back, for every later test in the process.
    original = loading.load
    monkeypatch.setattr(loading, "load", recording(original))
    monkeypatch.setattr(generate_command, "load", recording(original))
    for dtype in (None, "float32", "bfloat16"):
        with pytest.raises(Loaded):
            main(argv(command, tmp_path, "--model", str(q4_0_file), *(["--dtype", dtype] if dtype else [])))
    quantized, dense, half = models
    assert any(is_quantized(p) for p in quantized.parameters())
    assert not any(is_quantized(p) for p in dense.parameters()) and dense.dtype == torch.float32
    assert not any(is_quantized(p) for p in half.parameters()) and half.dtype == torch.bfloat16


@pytest.mark.parametrize("command", list(COMMANDS))
def test_dtype_with_a_checkpoint_is_one_line(command, tmp_path, capsys):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8, context_length=8, emb_dim=8, n_heads=2, n_layers=1, drop_rate=0.0))
    d = model.save(tmp_path / "ckpt")
    (d / "tokenizer.json").write_text(json.dumps(CharTokenizer("abcdefgh").to_dict()))
    if command == "serve":
        pytest.importorskip("fastapi")
    assert main(argv(command, tmp_path, "--checkpoint", str(d), "--dtype", "float32")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dtype goes with --model" in err[0]
