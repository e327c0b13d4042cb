"""Training data: built-in corpus, text loading, token cache, sliding windows and random batches."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

import attnlab.data as data_mod
from attnlab.data import (
    RandomWindowBatches,
    TokenWindowDataset,
    builtin_corpus,
    create_dataloader,
    iter_text_chunks,
    load_text,
    tokenize_to_cache,
    train_val_split,
)
from attnlab.tokenizers import ByteTokenizer, CharTokenizer, Tokenizer
from shared_data import SHARED_DATA

SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"


# The tutorials' dataset and loader (attention-review notebook), verbatim; my_batch's hard-wired
# tiktoken.get_encoding("gpt2") is pointed at the local BPE files by the test that calls it.
class MyData(Dataset):
    # Init function, called when the dataset is created
    # dataset = MyData(text, tokenizer, context_length=4, stride=1)
    def __init__(self, text, tokenizer, context_length, stride=1):
        self.input_ids = []
        self.target_ids = []
        token_ids = tokenizer.encode(text)
        for i in range(0, len(token_ids) - context_length, stride):
            self.input_ids.append(torch.tensor(token_ids[i : i + context_length]))
            self.target_ids.append(torch.tensor(token_ids[i + 1 : i + context_length + 1]))

    # Length function
    # len(dataset)
    def __len__(self):
        return len(self.input_ids)

    # Get item function
    # dataset[idx]
    def __getitem__(self, idx):
        return self.input_ids[idx], self.target_ids[idx]


# Dataloader
def my_batch(text, batch_size, context_length, stride, shuffle=True, drop_last=True, num_workers=0):
    tokenizer = tiktoken.get_encoding("gpt2")

    # Create the dataset object
    dataset = MyData(text, tokenizer, context_length, stride)

    # Use the DataLoader library to create a dataloader that batches the data
    dataloader = DataLoader(
        dataset, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, num_workers=num_workers
    )

    return dataloader


class ListTokenizer:
    """Toy tokenizer for MyData: the 'text' already is the list of ids."""

    def encode(self, ids):
        return list(ids)


# ---------------------------------------------------------------------------------------------- text
def test_builtin_corpus_is_pydoc_topics_in_sorted_order():
    from pydoc_data.topics import topics

    text = builtin_corpus()
    assert isinstance(text, str) and len(text) > 100_000
    assert text is builtin_corpus()  # computed once
    # Every topic is in it, in sorted key order, whatever the dict order.
    pos = 0
    for key in sorted(topics):
        pos = text.index(topics[key], pos) + len(topics[key])  # ValueError if missing or out of order
    assert pos == len(text)
    assert text.startswith(topics[min(topics)])
    assert load_text(None) == text


def test_load_text_keeps_bytes_exactly(tmp_path):
    text = "line one\r\nline two\n\ttab, naïve, 中文, 🙂\n"
    f = tmp_path / "t.txt"
    f.write_bytes(text.encode("utf-8"))
    assert load_text(f) == text  # no newline translation: matches the byte-level cache
    assert load_text(str(f)) == text


def test_load_text_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
        load_text(tmp_path / "missing.txt")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"abc\xffdef")
    with pytest.raises(ValueError, match=r"latin1\.txt is not UTF-8 text \(invalid byte at offset 3\)"):
        load_text(bad)
    with pytest.raises(ValueError, match="directory"):
        load_text(tmp_path)


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 5, 1 << 20])
def test_iter_text_chunks_never_splits_characters(tmp_path, chunk_bytes):
    text = "aé中🙂\n" * 20
    f = tmp_path / "t.txt"
    f.write_bytes(text.encode("utf-8"))
    assert "".join(iter_text_chunks(f, chunk_bytes=chunk_bytes)) == text
    # An invalid byte after a block edge is reported at its true offset.
    raw = text.encode("utf-8")
    f.write_bytes(raw + b"xy\xc3(")  # \xc3 starts a 2-byte sequence, '(' cannot continue it
    with pytest.raises(ValueError, match=f"offset {len(raw) + 2}"):
        "".join(iter_text_chunks(f, chunk_bytes=chunk_bytes))


# ---------------------------------------------------------------------------------------------- cache
def test_cache_byte_tokens_are_the_file_bytes(tmp_path):
    text = "hello, naïve 中文 🙂\n" * 300
    f = tmp_path / "corpus.txt"
    f.write_bytes(text.encode("utf-8"))
    tokens = tokenize_to_cache(f, ByteTokenizer(), cache_dir=tmp_path / "cache", chunk_bytes=100)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert tokens.tolist() == list(text.encode("utf-8"))
    with pytest.raises(ValueError):  # read-only: training never writes into the corpus
        tokens[0] = 1


def test_cache_builtin_corpus(tmp_path):
    tokens = tokenize_to_cache(None, ByteTokenizer(), cache_dir=tmp_path)
    assert tokens.dtype == np.uint16
    assert tokens.tobytes() == np.frombuffer(builtin_corpus().encode("utf-8"), np.uint8).astype(np.uint16).tobytes()
    assert list(tmp_path.iterdir()) == []  # the small built-in corpus is not cached


@pytest.mark.parametrize("chunk_bytes, workers", [(512, 1), (1 << 20, 3)])
def test_cache_gpt2_chunked_equals_whole_text(tmp_path, gpt2, chunk_bytes, workers):
    if not SHAKESPEARE.is_file():
        pytest.skip(f"{SHAKESPEARE} not found")
    f = tmp_path / "shakespeare.txt"
    f.write_bytes(SHAKESPEARE.read_bytes()[:150_000] + b"\r\n\r\n  <|endoftext|>  \n\n\nend")
    whole = gpt2.encode(f.read_bytes().decode("utf-8"))
    # Small chunks force hundreds of cuts, threads split a chunk into pieces: the ids must not change.
    tokens = tokenize_to_cache(f, gpt2, cache_dir=tmp_path / "cache", chunk_bytes=chunk_bytes, workers=workers)
    assert tokens.dtype == np.uint16
    assert tokens.tolist() == whole


@settings(max_examples=25, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab \n\t\r'é中🙂!1")), max_size=300), st.integers(1, 40))
def test_cache_char_chunked_equals_encode(tmp_path_factory, text, chunk_bytes):
    d = tmp_path_factory.mktemp("c")
    f = d / "t.txt"
    f.write_bytes(text.encode("utf-8"))
    tok = CharTokenizer.from_text(text + "a")
    tokens = tokenize_to_cache(f, tok, cache_dir=d / "cache", chunk_bytes=chunk_bytes)
    assert np.asarray(tokens).tolist() == tok.encode(text)


def _count_writes(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = data_mod._write_token_file

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(data_mod, "_write_token_file", counting)
    return calls


def test_cache_is_reused_and_invalidated_by_content(tmp_path, monkeypatch):
    calls = _count_writes(monkeypatch)
    f = tmp_path / "corpus.txt"
    f.write_bytes(b"abcdef" * 100)
    cache = tmp_path / "cache"
    tok = CharTokenizer.from_text("abcdefxyz")
    first = tokenize_to_cache(f, tok, cache_dir=cache)
    again = tokenize_to_cache(f, tok, cache_dir=cache)
    assert len(calls) == 1  # second call mapped the existing file instead of tokenizing
    assert again.tolist() == first.tolist() == tok.encode("abcdef" * 100)

    # Same size and same timestamps, different content: still detected (keyed by content hash).
    st_ = f.stat()
    f.write_bytes(b"xyzdef" * 100)
    os.utime(f, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    changed = tokenize_to_cache(f, tok, cache_dir=cache)
    assert len(calls) == 2
    assert changed.tolist() == tok.encode("xyzdef" * 100)

    # Another tokenizer gets its own cache file.
    tokenize_to_cache(f, ByteTokenizer(), cache_dir=cache)
    assert len(calls) == 3
    assert len(list(cache.glob("*.bin"))) == 3
    assert len(list(cache.glob("*.json"))) == 3


@pytest.mark.parametrize("cut", [0, 100, 598])  # (even lengths of 2-byte ids: read as the whole text, before)
def test_a_cache_file_cut_short_is_built_again(tmp_path, monkeypatch, cut):
    calls = _count_writes(monkeypatch)
    f = tmp_path / "corpus.txt"
    f.write_bytes(b"abcdef" * 100)
    tok = CharTokenizer.from_text("abcdefxyz" + "".join(chr(0x4E00 + i) for i in range(300)))  # (uint16 ids)
    tokenize_to_cache(f, tok, cache_dir=tmp_path / "cache")
    (entry,) = (tmp_path / "cache").glob("*.bin")
    os.truncate(entry, cut)
    assert tokenize_to_cache(f, tok, cache_dir=tmp_path / "cache").tolist() == tok.encode("abcdef" * 100)
    assert len(calls) == 2


def test_cache_interrupted_write_leaves_nothing_to_trust(tmp_path, monkeypatch):
    f = tmp_path / "corpus.txt"
    f.write_bytes(b"abc def\n" * 1000)
    cache = tmp_path / "cache"

    class Exploding(CharTokenizer):
        n = 0

        def encode_array(self, text):
            Exploding.n += 1
            if Exploding.n == 3:
                raise KeyboardInterrupt  # e.g. Ctrl-C halfway through a big file
            return super().encode_array(text)

    tok = Exploding(" \nabcdef")
    with pytest.raises(KeyboardInterrupt):
        tokenize_to_cache(f, tok, cache_dir=cache, chunk_bytes=64)
    assert list(cache.glob("*.bin")) == [] and list(cache.glob("*.tmp")) == []
    # The next run builds the cache from scratch and gets every token.
    tokens = tokenize_to_cache(f, tok, cache_dir=cache, chunk_bytes=64)
    assert tokens.tolist() == CharTokenizer(" \nabcdef").encode("abc def\n" * 1000)


class _SlowChars(CharTokenizer):
    def encode_array(self, text):
        time.sleep(0.05)  # keep the first builder busy while the second process arrives
        return super().encode_array(text)


def _build_in_child(f, cache, log, out):
    real = data_mod._write_token_file

    def logged(*args, **kwargs):
        with open(log, "a") as fh:
            fh.write("build\n")
        return real(*args, **kwargs)

    data_mod._write_token_file = logged
    tokens = tokenize_to_cache(f, _SlowChars("ab\n"), cache_dir=cache, chunk_bytes=256)
    np.save(out, np.asarray(tokens))


def _build_in_processes(tmp_path: Path, n: int) -> tuple[Path, Path]:
    """``n`` forked processes ask for the same cold cache of one corpus at once (as the ranks of one
    torchrun do); each succeeds and writes its tokens to ``out{i}.npy``. Returns (corpus, build log)."""
    f = tmp_path / "corpus.txt"
    f.write_bytes(b"ab\nba\n" * 400)
    log = tmp_path / "builds.log"
    ctx = multiprocessing.get_context("fork")
    procs = [
        ctx.Process(target=_build_in_child, args=(f, tmp_path / "cache", log, tmp_path / f"out{i}.npy"))
        for i in range(n)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return f, log


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork() to start processes quickly")
def test_cache_concurrent_processes_build_once(tmp_path):
    # Like the ranks of one torchrun: two processes ask for the same cold cache at the same time.
    _, log = _build_in_processes(tmp_path, 2)
    assert log.read_text().count("build") == 1  # the other process waited and reused the file
    expected = CharTokenizer("ab\n").encode("ab\nba\n" * 400)
    for i in range(2):
        assert np.load(tmp_path / f"out{i}.npy").tolist() == expected
    assert list((tmp_path / "cache").glob("*.lock")) == []  # the lock file goes once the entry is built


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork() to start processes quickly")
def test_cache_lock_files_do_not_pile_up_and_still_exclude(tmp_path):
    """Lock files are removed by their holder, yet processes that waited on a removed one never
    build at the same time (they re-lock the current file): four processes, one build, no .lock left;
    a failed build leaves no lock file either."""
    f, log = _build_in_processes(tmp_path, 4)
    assert log.read_text().count("build") == 1
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".bin", ".json"]
    for _ in range(3):  # cached: nothing is locked, nothing is left
        tokenize_to_cache(f, _SlowChars("ab\n"), cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"'b' .* is not in the char tokenizer's vocabulary"):
        tokenize_to_cache(f, CharTokenizer("a\n"), cache_dir=tmp_path / "cache")  # 'b' is unknown
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".bin", ".json"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo() (POSIX)")
def test_cache_refuses_a_data_path_that_is_no_regular_file(tmp_path):
    """A FIFO as --data would block the hash forever, /dev/zero would never end: refused at once."""
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        tokenize_to_cache(fifo, ByteTokenizer(), cache_dir=tmp_path / "c")
    if os.path.exists("/dev/zero"):
        link = tmp_path / "zero.txt"
        link.symlink_to("/dev/zero")
        with pytest.raises(ValueError, match="not a regular file"):
            tokenize_to_cache(link, ByteTokenizer(), cache_dir=tmp_path / "c")


def test_cache_removes_temp_files_of_a_killed_build(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_bytes(b"abc")
    cache = tmp_path / "cache"
    tokenize_to_cache(f, ByteTokenizer(), cache_dir=cache)
    (final,) = cache.glob("*.bin")
    final.unlink()  # as if the build had been SIGKILLed before its rename, leaving its temp file
    stale = cache / f".{final.name}.k1ll3d.tmp"
    stale.write_bytes(b"\0" * 5)
    assert tokenize_to_cache(f, ByteTokenizer(), cache_dir=cache).tolist() == list(b"abc")
    assert not stale.exists()


def test_cache_refuses_a_file_that_changes_while_tokenized(tmp_path, monkeypatch):
    f = tmp_path / "corpus.txt"
    f.write_bytes(b"abc" * 100)
    # The key was computed from other content than the pass that tokenizes reads.
    monkeypatch.setattr(data_mod, "sha256_file", lambda p: "0" * 64)
    with pytest.raises(ValueError, match="changed while it was being tokenized"):
        tokenize_to_cache(f, ByteTokenizer(), cache_dir=tmp_path / "c")
    assert [p.name for p in (tmp_path / "c").iterdir() if not p.name.endswith(".lock")] == []


def test_cache_empty_file_and_errors(tmp_path):
    f = tmp_path / "empty.txt"
    f.write_bytes(b"")
    tokens = tokenize_to_cache(f, ByteTokenizer(), cache_dir=tmp_path / "c")
    assert len(tokens) == 0
    with pytest.raises(FileNotFoundError, match=r"nope\.txt"):
        tokenize_to_cache(tmp_path / "nope.txt", ByteTokenizer(), cache_dir=tmp_path / "c")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\xff")
    with pytest.raises(ValueError, match="not UTF-8"):
        tokenize_to_cache(bad, ByteTokenizer(), cache_dir=tmp_path / "c")
    with pytest.raises(TypeError, match="Tokenizer"):
        tokenize_to_cache(f, tiktoken, cache_dir=tmp_path / "c")


def test_cache_dir_default_and_fallback(tmp_path, monkeypatch):
    f = tmp_path / "t.txt"
    f.write_bytes(b"hello")
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(tmp_path / "env-cache"))
    tokenize_to_cache(f, ByteTokenizer())
    assert len(list((tmp_path / "env-cache").glob("t.txt.byte.*.bin"))) == 1
    # A default location that cannot be created (a file is in the way) falls back to the temp dir.
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"")
    monkeypatch.setenv("ATTNLAB_CACHE_DIR", str(blocker / "sub"))
    monkeypatch.setattr(data_mod.tempfile, "tempdir", str(tmp_path / "tmp"))
    assert tokenize_to_cache(f, ByteTokenizer()).tolist() == list(b"hello")
    assert len(list((tmp_path / "tmp").glob("attnlab-cache-*/t.txt.byte.*.bin"))) == 1
    # An explicit cache_dir that cannot be created is one clear error.
    with pytest.raises(ValueError, match="cannot write the token cache"):
        tokenize_to_cache(f, ByteTokenizer(), cache_dir=blocker / "sub")


def test_cache_char_unknown_character_names_file_and_position(tmp_path):
    f = tmp_path / "corpus.txt"
    f.write_text("ab\n" * 100 + "abz", encoding="utf-8")
    tok = CharTokenizer.from_text("ab\n")
    with pytest.raises(ValueError, match=r"corpus\.txt: character 'z' \(U\+007A\) at character 302 "):
        tokenize_to_cache(f, tok, cache_dir=tmp_path / "c", chunk_bytes=16)


def test_cache_uint32_for_big_vocabularies(tmp_path):
    class Big(Tokenizer):
        name, vocab_size = "big", 70_000

        def encode_array(self, text):
            return np.array([69_999 - ord(c) for c in text], dtype=np.int64)

        def to_dict(self):
            return {"name": "big"}

    f = tmp_path / "t.txt"
    f.write_bytes(b"abc")
    tokens = tokenize_to_cache(f, Big(), cache_dir=tmp_path / "c")
    assert tokens.dtype == np.uint32 and tokens.tolist() == [69_999 - 97, 69_999 - 98, 69_999 - 99]


# ---------------------------------------------------------------------------------------------- windows
@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 255), max_size=60), st.integers(1, 12), st.integers(1, 12))
def test_windows_equal_tutorial_mydata(ids, context_length, stride):
    ref = MyData(ids, ListTokenizer(), context_length, stride)
    ours = TokenWindowDataset(torch.tensor(ids, dtype=torch.long), context_length, stride)
    ours_np = TokenWindowDataset(np.array(ids, dtype=np.uint16), context_length, stride)
    assert len(ours) == len(ours_np) == len(ref)
    for i in range(len(ref)):
        for got in (ours[i], ours_np[i]):
            assert got[0].dtype == got[1].dtype == torch.int64
            assert torch.equal(got[0], ref[i][0]) and torch.equal(got[1], ref[i][1])


def test_windows_with_byte_tokenizer_equal_mydata():
    text = "Your journey starts with one step. Ünïcödé too."
    tok = ByteTokenizer()
    ref = MyData(text, tok, 8, 3)
    ours = TokenWindowDataset(tok.encode(text), 8, 3)
    assert len(ours) == len(ref) > 0
    assert all(torch.equal(ours[i][0], ref[i][0]) and torch.equal(ours[i][1], ref[i][1]) for i in range(len(ref)))
    assert torch.equal(ours[-1][0], ref[len(ref) - 1][0])
    with pytest.raises(IndexError):
        ours[len(ref)]


def test_windows_are_views_of_one_tensor():
    tokens = torch.arange(100)
    ds = TokenWindowDataset(tokens, 10, 5)
    x, y = ds[3]
    assert x.untyped_storage().data_ptr() == tokens.untyped_storage().data_ptr()
    assert torch.equal(x, torch.arange(15, 25)) and torch.equal(y, torch.arange(16, 26))


def test_window_errors():
    with pytest.raises(ValueError, match="context_length"):
        TokenWindowDataset(torch.arange(10), 0, 1)
    with pytest.raises(ValueError, match="stride"):
        TokenWindowDataset(torch.arange(10), 4, 0)
    with pytest.raises(ValueError, match="1-D"):
        TokenWindowDataset(torch.zeros(2, 5, dtype=torch.long), 2, 1)
    with pytest.raises(TypeError, match="integer"):
        TokenWindowDataset(torch.zeros(10), 2, 1)
    with pytest.raises(TypeError, match="not uint64"):
        TokenWindowDataset(np.array([1, 2**63 + 5, 3], dtype=np.uint64), 1, 1)
    # Lists were converted with torch.tensor(..., dtype=long): floats truncated, nesting flattened.
    for bad, what in (([1, 2.7, 3], "2.7 at index 1"), ([[1, 2], [3, 4]], r"\[1, 2\] at index 0"), ([4, -1], "-1")):
        with pytest.raises(TypeError, match=f"flat list of non-negative int ids, got {what}"):
            TokenWindowDataset(bad, 1, 1)


def test_create_dataloader_equals_tutorial_my_batch(gpt2, monkeypatch):
    # my_batch calls tiktoken.get_encoding("gpt2"); give it the locally built GPT-2 encoding.
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: gpt2.encoding)
    text = "This is a very useless sentence that talks about itself."
    torch.manual_seed(0)
    ref = list(my_batch(text, 2, 4, 1))
    torch.manual_seed(0)
    ours = list(create_dataloader(text, 2, 4, 1, tokenizer=gpt2))
    # The tutorial prints three batches of 2 x 4 ids for this sentence.
    assert len(ours) == len(ref) == 3
    for (x, y), (rx, ry) in zip(ours, ref, strict=True):
        assert x.shape == (2, 4) and torch.equal(x, rx) and torch.equal(y, ry)


def test_create_dataloader_defaults_and_errors():
    text = builtin_corpus()[:5000]
    loader = create_dataloader(text, shuffle=False)  # byte tokenizer, 4 x 256, stride 128
    x, y = next(iter(loader))
    assert x.shape == (4, 256) and x.dtype == torch.int64
    expected = torch.tensor(list(text.encode("utf-8")[: 4 * 128 + 256 + 1]))
    assert torch.equal(x[1], expected[128:384]) and torch.equal(y[1], expected[129:385])
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = [b[0] for b in create_dataloader(text, 2, 16, 16, generator=g1)]
    b = [b[0] for b in create_dataloader(text, 2, 16, 16, generator=g2)]
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    tokens = torch.arange(50)
    assert len(create_dataloader(tokens, 2, 4, 4, drop_last=False)) == 6  # 12 windows
    with pytest.raises(ValueError, match="tokenizer is only used"):
        create_dataloader(tokens, tokenizer="byte")
    with pytest.raises(ValueError, match="batch_size"):
        create_dataloader(tokens, 0, 4, 4)
    # No window, or no full batch, used to be an empty loader (a training loop that does nothing)
    # or torch's "num_samples should be a positive integer".
    for shuffle in (True, False):
        with pytest.raises(ValueError, match=r"has 5 tokens, but a window needs context_length \+ 1 = 9"):
            create_dataloader("hello", batch_size=2, context_length=8, shuffle=shuffle)
    with pytest.raises(ValueError, match="gives 12 windows, fewer than batch_size=13"):
        create_dataloader(tokens, 13, 4, 4)
    assert len(create_dataloader(tokens, 13, 4, 4, drop_last=False)) == 1


def test_train_val_split_is_contiguous_views(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(b"x" * 1000)
    tokens = tokenize_to_cache(f, ByteTokenizer(), cache_dir=tmp_path / "c")
    train, val = train_val_split(tokens, 0.1)
    assert len(train) == 900 and len(val) == 100
    assert np.shares_memory(train, tokens) and np.shares_memory(val, tokens)
    t = torch.arange(10)
    tr, va = train_val_split(t, 0.25)
    assert torch.equal(torch.cat([tr, va]), t) and len(va) == 2  # round(2.5) == 2
    assert len(train_val_split(t, 0)[1]) == 0
    for bad in (1.0, -0.1, "0.1", True):
        with pytest.raises(ValueError, match="val_fraction"):
            train_val_split(t, bad)


# ---------------------------------------------------------------------------------------------- batches
def test_random_batches_are_a_pure_function_of_seed_and_step():
    tokens = torch.arange(1000) % 251
    a = RandomWindowBatches(tokens, 4, 16, seed=1)
    for step in range(3):
        a.batch(step)
    b = RandomWindowBatches(tokens, 4, 16, seed=1)  # a "resumed" run that starts at step 3
    assert all(torch.equal(p, q) for p, q in zip(a.batch(3), b.batch(3), strict=True))
    assert not torch.equal(a.batch(3)[0], a.batch(4)[0])
    assert not torch.equal(a.batch(3)[0], RandomWindowBatches(tokens, 4, 16, seed=2).batch(3)[0])


def test_random_batches_rows_are_shifted_windows_in_range():
    n, t = 40, 8
    tokens = np.arange(n, dtype=np.uint16)  # token value == position, so rows reveal their start
    rb = RandomWindowBatches(tokens, 64, t, seed=0)
    starts_seen = set()
    for step in range(5):
        x, y = rb.batch(step)
        assert x.shape == y.shape == (64, t) and x.dtype == y.dtype == torch.int64
        starts = x[:, 0]
        assert torch.equal(x, starts[:, None] + torch.arange(t)) and torch.equal(y, x + 1)
        assert int(y.max()) <= n - 1  # the last target is the last token, never past it
        starts_seen.update(starts.tolist())
        assert torch.equal(starts, torch.from_numpy(rb.global_starts(step)))
    assert starts_seen == set(range(n - t))  # every valid start is reachable


@pytest.mark.parametrize("world_size, accum", [(2, 1), (3, 1), (2, 2), (1, 3)])
def test_random_batches_rank_shards_union_is_the_global_batch(world_size, accum):
    tokens = np.random.default_rng(0).integers(0, 50257, size=5000).astype(np.uint16)
    b = 3
    single = RandomWindowBatches(tokens, b * world_size * accum, 12, seed=5)
    shards = [
        RandomWindowBatches(tokens, b, 12, seed=5, rank=r, world_size=world_size, grad_accum_steps=accum)
        for r in range(world_size)
    ]
    for step in (0, 7):
        ref_x, ref_y = single.batch(step)
        parts = [shards[r].batch(step, micro_step=m) for m in range(accum) for r in range(world_size)]
        assert torch.equal(torch.cat([p[0] for p in parts]), ref_x)
        assert torch.equal(torch.cat([p[1] for p in parts]), ref_y)
        assert torch.equal(shards[0].global_batch(step)[0], ref_x)


def test_random_batches_same_from_memmap_and_tensor(tmp_path):
    f = tmp_path / "t.txt"
    f.write_bytes(builtin_corpus()[:20_000].encode("utf-8"))
    mm = tokenize_to_cache(f, ByteTokenizer(), cache_dir=tmp_path / "c")
    as_tensor = torch.from_numpy(np.asarray(mm, dtype=np.int64))
    p = RandomWindowBatches(mm, 4, 32, seed=3).batch(2)
    q = RandomWindowBatches(as_tensor, 4, 32, seed=3).batch(2, device="cpu")
    assert torch.equal(p[0], q[0]) and torch.equal(p[1], q[1])


def test_random_batches_errors():
    t = torch.arange(20)
    with pytest.raises(ValueError, match="context_length \\+ 1 = 21"):
        RandomWindowBatches(t, 2, 20, seed=0)
    assert RandomWindowBatches(t, 2, 19, seed=0).batch(0)[0][:, 0].tolist() == [0, 0]  # one window only
    with pytest.raises(ValueError, match="rank"):
        RandomWindowBatches(t, 2, 4, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seed"):
        RandomWindowBatches(t, 2, 4, seed=-1)
    with pytest.raises(ValueError, match="step"):
        RandomWindowBatches(t, 2, 4, seed=0).batch(-1)
    with pytest.raises(ValueError, match="micro_step"):
        RandomWindowBatches(t, 2, 4, seed=0, grad_accum_steps=2).batch(0, micro_step=2)


@pytest.mark.parametrize("workers", [2.7, True, -1, "x"])
def test_tokenize_to_cache_names_a_bad_workers(tmp_path, workers):
    # Regression: 2.7, True and -1 were taken (int() of them), "x" failed inside int().
    f = tmp_path / "t.txt"
    f.write_text("some text")
    with pytest.raises(ValueError, match="workers must be a positive int"):
        tokenize_to_cache(f, ByteTokenizer(), cache_dir=tmp_path / "cache", workers=workers)
