"""Files a user may have downloaded, made hostile: each is one clear error naming it, before memory or
time goes (found by a sweep that crafted them; each test failed before its fix)."""

from __future__ import annotations

import io
import os
import zipfile

import numpy as np
import pytest

from attnlab.interpret.sae import SAE
from attnlab.tools.loading import load_pretrained
from attnlab.training.chat_data import read_conversations


def test_an_npz_declaring_a_huge_array_is_refused_before_numpy_allocates_it(tmp_path):
    # A 300-byte member whose .npy header declares (10^6, 10^6) float32: numpy allocated 3.6 TiB (a traceback).
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**6)})
    path = tmp_path / "params.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("W_enc.npy", header.getvalue())
    with pytest.raises(ValueError, match=r"is not a readable \.npz file"):
        SAE.load(path)


def test_chat_data_that_is_not_utf8_names_its_file(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_bytes(b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    with pytest.raises(ValueError, match=r"chats\.jsonl is not UTF-8 text \(invalid continuation byte at byte 46\)"):
        read_conversations(path)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_model_directorys_config_planted_as_dev_zero_is_refused_not_read(tmp_path):
    # A symlink to /dev/zero was read until memory ran out; a FIFO hung.
    (tmp_path / "config.json").symlink_to("/dev/zero")
    with pytest.raises((ValueError, FileNotFoundError), match="config"):
        load_pretrained(tmp_path)


def test_a_gguf_pre_tokenizer_that_is_not_text_is_one_value_error(tmp_path):
    from gguf_files import write_gguf

    path = write_gguf(tmp_path / "pre.gguf", meta={"tokenizer.ggml.pre": ["smollm", "x"]})
    with pytest.raises(ValueError, match="pre-tokenizer"):  # (once: TypeError, unhashable type: 'list')
        load_pretrained(path)
