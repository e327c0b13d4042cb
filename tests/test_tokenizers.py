"""Tokenizers: byte (lossless UTF-8), char (vocabulary from the text) and GPT-2 BPE (tiktoken, offline)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.cli import UserError
from attnlab.tokenizers import (
    GPT2_BPE_ENV,
    ByteTokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    StreamDecoder,
    TokenizerLoadError,
    get_tokenizer,
    tokenizer_from_dict,
)
from shared_data import GPT2_BPE_DIR, SHARED_DATA

# Tests of GPT-2's BPE take the `gpt2` fixture (conftest.py), which skips without the files.


# ---------------------------------------------------------------------------------------------- byte
@settings(max_examples=50, deadline=None)
@given(st.text())
def test_byte_round_trip_and_ids_are_utf8(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # reference: Python's own UTF-8 codec
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.long)) == text
    assert tok.decode(np.array(ids, dtype=np.uint16)) == text


def test_byte_decode_invalid_utf8_is_replaced_not_raised():
    tok = ByteTokenizer()
    # 0xC3 starts a 2-byte sequence; alone it is invalid -> U+FFFD.
    assert tok.decode([104, 0xC3]) == "h\ufffd"
    assert tok.decode([0xFF, 105]) == "\ufffdi"


def test_byte_decode_rejects_out_of_range_and_2d():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match=r"\[0, 256\).*256"):
        tok.decode([1, 256])
    with pytest.raises(ValueError, match="1-D"):
        tok.decode(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        tok.decode(torch.zeros(3))
    # int() used to truncate: [65.9, 66.2] decoded as "AB"; bools passed as 0/1.
    for bad in ([65.9, 66.2], [True, 66], torch.tensor([True, False])):
        with pytest.raises(TypeError, match=r"ints|integer"):
            tok.decode(bad)


@pytest.mark.parametrize("make", [ByteTokenizer, lambda: CharTokenizer.from_text("abc")])
@pytest.mark.parametrize("text", [b"abc", None, ["a"]])
def test_encode_refuses_what_is_not_a_str(make, text):
    tok = make()
    for encode in (tok.encode, tok.encode_array):
        with pytest.raises(TypeError, match=f"text must be a str, got {type(text).__name__}"):
            encode(text)


def test_byte_to_dict_round_trip():
    tok = ByteTokenizer()
    d = json.loads(json.dumps(tok.to_dict()))
    assert tokenizer_from_dict(d) == tok
    assert tok.vocab_size == 256 and tok.eot_id is None and tok.name == "byte"


# ---------------------------------------------------------------------------------------------- char
def test_char_vocab_is_sorted_unique_chars():
    text = "hello world!"
    tok = CharTokenizer.from_text(text)
    expected = sorted(set(text))
    assert list(tok.chars) == expected
    assert tok.vocab_size == len(expected)
    assert tok.encode("hello") == [expected.index(c) for c in "hello"]
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=1), st.data())
def test_char_round_trip_and_reference_ids(text, data):
    tok = CharTokenizer.from_text(text)
    vocab = sorted(set(text))
    assert tok.encode(text) == [vocab.index(c) for c in text]
    assert tok.decode(tok.encode(text)) == text
    # Any text over the same alphabet works, and the dict round trip keeps the mapping.
    other = data.draw(st.text(alphabet=vocab, max_size=30))
    again = tokenizer_from_dict(json.loads(json.dumps(tok.to_dict())))
    assert again.encode(other) == tok.encode(other)


def test_char_unknown_character_is_named():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match=r"'z' \(U\+007A\) at index 2"):
        tok.encode("abz")  # above every known code point
    with pytest.raises(ValueError, match=r"'b' \(U\+0062\) at index 1"):
        CharTokenizer.from_text("az").encode("ab")  # between known code points


def test_char_rejects_bad_input():
    with pytest.raises(ValueError, match="empty"):
        CharTokenizer.from_text("")
    with pytest.raises(TypeError, match="text must be a str"):
        CharTokenizer.from_text(b"abc")
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        CharTokenizer.from_text("abc").decode([3])


def test_char_from_file_matches_from_text(tmp_path):
    text = "naïve 中文 text\r\nwith é and emoji 🙂\n" * 50
    f = tmp_path / "t.txt"
    f.write_bytes(text.encode("utf-8"))
    # A tiny chunk size cuts multi-byte characters at block edges; the vocabulary must not care.
    assert CharTokenizer.from_file(f, chunk_bytes=7).chars == CharTokenizer.from_text(text).chars
    assert get_tokenizer("char", path=f).chars == CharTokenizer.from_text(text).chars


# ---------------------------------------------------------------------------------------------- gpt2
def test_gpt2_known_ids_and_round_trip(gpt2):
    # GPT-2's published ids for this prompt (the GPT-2 paper's repo / HF tokenizer give the same).
    assert gpt2.encode("Hello, I am") == [15496, 11, 314, 716]
    assert gpt2.decode([15496, 11, 314, 716]) == "Hello, I am"
    assert gpt2.vocab_size == 50257 and gpt2.eot_id == 50256 and gpt2.name == "gpt2"
    assert gpt2.is_official
    assert gpt2.encode("<|endoftext|>") == [50256]
    assert gpt2.decode(torch.tensor([50256])) == "<|endoftext|>"
    verdict = SHARED_DATA / "the-verdict.txt"
    if verdict.is_file():
        text = verdict.read_text(encoding="utf-8")
        ids = gpt2.encode(text)
        assert gpt2.decode(ids) == text
        assert gpt2.encode_array(text).tolist() == ids


@settings(max_examples=40, deadline=None)
@given(st.text())
def test_gpt2_round_trip(gpt2, text):
    assert gpt2.decode(gpt2.encode(text)) == text


def test_gpt2_refuses_lone_surrogates_like_the_byte_tokenizer(gpt2):
    # tiktoken encodes "\ud800" as U+FFFD: a round trip that silently changes the text.
    for tok in (gpt2, ByteTokenizer()):
        for encode in (tok.encode, tok.encode_array):
            with pytest.raises(ValueError, match="not valid in UTF-8 at index 2"):
                encode("ab\ud800c")
        with pytest.raises(TypeError, match="text must be a str"):
            tok.encode(b"abc")


# Whitespace of every kind that Python and tiktoken's regex might classify differently.
_WS = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "\x0b", "\x0c", "\x1c", "\x85", "\xa0", "\u2028", "\u3000"]
_WORDS = ["a", "The", "'s", "'ll", "12", "3.5", "!!", "é", "中文", "🙂", "<|endoftext|>", "x'", "--"]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(_WS + _WORDS), max_size=40))
def test_gpt2_split_point_is_a_safe_cut(gpt2, parts):
    # The token cache encodes big files chunk by chunk, cutting where split_point says. For every
    # prefix of the text (a chunk as read so far), encoding the two sides of its cut separately
    # must give exactly the ids of encoding the whole text at once (a cut after "a \n\n" would not).
    text = "".join(parts)
    whole = gpt2.encode(text)
    for k in range(len(text) + 1):
        cut = gpt2.split_point(text[:k])
        assert 0 <= cut <= k
        assert gpt2.encode(text[:cut]) + gpt2.encode(text[cut:]) == whole


def test_gpt2_to_dict_round_trip_and_env_var(gpt2, monkeypatch):
    d = json.loads(json.dumps(gpt2.to_dict()))
    assert d["name"] == "gpt2" and Path(d["bpe_dir"]) == GPT2_BPE_DIR.resolve()
    again = tokenizer_from_dict(d)
    assert again == gpt2 and again.encode("Hello, I am") == [15496, 11, 314, 716]
    # The environment variable stands in for bpe_dir (and for a recorded dir that moved away).
    monkeypatch.setenv(GPT2_BPE_ENV, str(GPT2_BPE_DIR))
    assert get_tokenizer("gpt2").encode("Hello, I am") == [15496, 11, 314, 716]
    moved = dict(d, bpe_dir="/nonexistent/gpt2")
    assert tokenizer_from_dict(moved) == gpt2
    # Files with other content than the recorded ones are refused.
    with pytest.raises(ValueError, match="differ"):
        tokenizer_from_dict(dict(d, vocab_bpe_sha256="0" * 64))


def test_gpt2_offline_without_files_is_one_clear_sentence(monkeypatch):
    import requests
    import tiktoken

    def offline(name):
        raise requests.exceptions.ConnectionError("Max retries exceeded with url: /gpt-2/encodings/main/vocab.bpe")

    monkeypatch.delenv(GPT2_BPE_ENV, raising=False)
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(TokenizerLoadError) as info:
        get_tokenizer("gpt2")
    exc = info.value
    assert isinstance(exc, UserError) and isinstance(exc, ValueError)  # the CLI prints it as one line
    msg = str(exc)
    assert "\n" not in msg and "--bpe-dir" in msg and "encoder.json" in msg and "vocab.bpe" in msg
    assert "Max retries" not in msg  # no network details dumped on the user
    # The Python advice is one that works: create_dataloader takes a tokenizer, not bpe_dir=
    assert "tokenizer=get_tokenizer('gpt2', bpe_dir=DIR)" in msg and "bpe_dir= in Python" not in msg
    assert exc.__cause__ is None and exc.__suppress_context__  # no chained network traceback


def test_gpt2_bpe_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        GPT2Tokenizer(bpe_dir=tmp_path / "nope")
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\n")
    with pytest.raises(FileNotFoundError, match=r"encoder\.json"):
        GPT2Tokenizer(bpe_dir=tmp_path)
    (tmp_path / "encoder.json").write_text('{"a": 0}')
    with pytest.raises(ValueError, match="valid GPT-2"):
        GPT2Tokenizer(bpe_dir=tmp_path)
    for other in ("[]", '"text"', "3"):  # valid JSON of another shape (once a traceback)
        (tmp_path / "encoder.json").write_text(other)
        with pytest.raises(ValueError, match="valid GPT-2"):
            GPT2Tokenizer(bpe_dir=tmp_path)


# ---------------------------------------------------------------------------------------------- factory
def test_get_tokenizer_names_and_errors():
    assert isinstance(get_tokenizer("byte"), ByteTokenizer)
    assert get_tokenizer("char", text="ba").chars == "ab"
    with pytest.raises(ValueError, match="byte, char, gpt2"):
        get_tokenizer("sentencepiece")
    with pytest.raises(ValueError, match="text="):
        get_tokenizer("char")
    with pytest.raises(ValueError, match="unknown tokenizer"):
        tokenizer_from_dict({"name": "wordpiece"})
    with pytest.raises(ValueError, match="'name'"):
        tokenizer_from_dict({})


@settings(max_examples=40, deadline=None)
@given(st.text(min_size=1, max_size=30))
def test_stream_decoder_never_splits_a_character(text: str) -> None:
    tok = get_tokenizer("byte")
    try:
        ids = tok.encode(text)
    except ValueError:  # lone surrogates are not UTF-8
        return
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_stream_decoder_gpt2_pieces(gpt2) -> None:
    tok = get_tokenizer("gpt2", bpe_dir=gpt2.bpe_dir)
    text = "Attention, s'il vous plaît: 注意 😀 is all you need."
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in tok.encode(text)] + [dec.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=40))
def test_stream_decoder_joins_to_the_one_shot_decode_even_for_invalid_utf8(ids: list[int]) -> None:
    # Byte soup (what an untrained byte model emits): the stream must still say what decode() says.
    tok = ByteTokenizer()
    dec = StreamDecoder(tok)
    assert "".join([dec.push(i) for i in ids] + [dec.flush()]) == tok.decode(ids)
