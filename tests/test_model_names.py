"""A model's name, not its path: what pages, ``serve``'s title and the command line call a model
(its GGUF metadata: ``general.name``, the size label, the quantization; a directory: its config)."""

from __future__ import annotations

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
