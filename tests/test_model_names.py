"""A model's name, not its path: what pages, ``serve``'s title and the command line call a model
(its GGUF metadata: ``general.name``, the size label, the quantization; a directory: its config)."""

from __future__ import annotations

import io
import json
import os
from collections import Counter

import pytest

from attnlab.tools.loading import load_gguf, load_pretrained
from gguf_files import write_gguf

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'attnlab[gguf]')")


def _matrix_types(path) -> Counter:
    """The types of the file's tensors, read with the gguf package itself."""
    reader = gguf.GGUFReader(path)
    return Counter(t.tensor_type.name for t in reader.tensors if t.tensor_type.name != "F32")


@pytest.mark.parametrize("qtype", ["Q8_0", "F16"])
@pytest.mark.parametrize(
    "meta,want",
    [
        ({"general.name": "Tiny Llama Chat", "general.size_label": "1.1B"}, "Tiny Llama Chat · 1.1B"),
        ({"general.name": "Tiny Llama 1.1B Chat", "general.size_label": "1.1B"}, "Tiny Llama 1.1B Chat"),
        ({"general.name": None, "general.size_label": None}, "stem"),
    ],
)
def test_a_gguf_model_is_named_by_its_metadata(tmp_path, meta, want, qtype):
    (tmp_path / "deep").mkdir()
    path = write_gguf(tmp_path / "deep" / "model-file.gguf", qtype=qtype, meta=meta)
    name = load_gguf(path).metadata["name"]
    dominant = _matrix_types(path).most_common(1)[0][0]
    want = "model-file" if want == "stem" else want
    assert name == f"{want} · {dominant}"
    assert str(tmp_path) not in name and os.sep not in name


@pytest.mark.slow
def test_the_real_models_name(smollm2_gguf):
    reader = gguf.GGUFReader(smollm2_gguf)
    general = reader.fields["general.name"]
    title = bytes(general.parts[general.data[0]]).decode()
    name = load_gguf(smollm2_gguf).metadata["name"]
    assert name.startswith(title) and name.endswith(_matrix_types(smollm2_gguf).most_common(1)[0][0])
    assert str(smollm2_gguf.parent) not in name


@pytest.mark.slow
def test_a_hugging_face_directory_is_named_by_its_config(smollm2_hf_dir):
    config = json.loads((smollm2_hf_dir / "config.json").read_text())
    name = load_pretrained(str(smollm2_hf_dir)).metadata["name"]
    assert config["model_type"] in name and str(smollm2_hf_dir.parent) not in name


def test_the_commands_name_a_gguf_model_by_its_metadata(tmp_path, capsys, monkeypatch):
    """eval's header, chat's greeting, a fine-tuning run's log and an SAE's cfg.json give the model's
    name, never the file's path."""
    from attnlab.cli import main

    deep = tmp_path / "some" / "deep" / "folder"
    deep.mkdir(parents=True)
    path = write_gguf(deep / "model-file.gguf", qtype="Q8_0", meta={"general.name": "Tiny Named"})
    name = load_gguf(path).metadata["name"]
    data = tmp_path / "text.txt"
    data.write_text("the cat sat on the mat and the dog sat on the log. " * 40, encoding="utf-8")

    def ran(argv: list[str]) -> str:
        capsys.readouterr()
        assert main(argv) == 0
        out, err = capsys.readouterr()
        assert str(deep) not in out + err
        return out + err

    assert ran(["eval", "--model", str(path), "--data", str(data), "--context-length", "16"]).startswith(f"{name} on ")
    run = ["train", "--init-from", str(path), "--data", str(data), "--max-steps", "1", "--batch-size", "2"]
    log = ran([*run, "--context-length", "16", "--out", str(tmp_path / "run"), "--no-progress"])
    assert f"{name} (fine-tuned)" in log
    sae = ["sae", "train", "--model", str(path), "--hook", "blocks.0.hook_resid_post", "--width", "64", "--k", "4"]
    small = ["--tokens", "64", "--batch-rows", "32", "--buffer-rows", "64", "--context", "16", "--no-progress"]
    ran([*sae, *small, "--out", str(tmp_path / "sae")])
    assert json.loads((tmp_path / "sae" / "sae" / "cfg.json").read_text())["metadata"]["model_name"] == name

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    def no_more(prompt: str = "") -> str:
        raise EOFError

    monkeypatch.setattr("sys.stdin", Terminal(""))
    monkeypatch.setattr("builtins.input", no_more)
    assert f"Chatting with {name} " in ran(["chat", "--model", str(path)])
