"""Atomic writes: the old file survives any failure, no temp file is left, permissions are normal."""

import json
import os
import stat

import pytest

from attnlab.files import atomic_open, atomic_path, atomic_write_bytes, atomic_write_json, atomic_write_text


def test_writes_replace_the_file_and_leave_nothing_behind(tmp_path):
    target = tmp_path / "out.json"
    atomic_write_json(target, {"x": [1, 2]})
    assert json.loads(target.read_text()) == {"x": [1, 2]}
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    atomic_write_text(target, "tëxt")
    assert target.read_text(encoding="utf-8") == "tëxt"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "out.html"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_open(target, "w") as f:
        f.write("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.html"]


def test_a_writer_by_file_name_replaces_the_file_or_leaves_it(tmp_path):
    # GPT.save hands safetensors' save_file a name: it writes from the tensors' memory, where
    # building the file's bytes first held a second (and third) copy of the model.
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="killed"), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("killed")
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp != target
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_new_files_get_the_umask_permissions_not_0600(tmp_path):
    umask = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o644


def test_missing_directory_and_bad_mode_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        atomic_write_text(tmp_path / "missing" / "x.txt", "x")
    with pytest.raises(ValueError, match="mode"), atomic_open(tmp_path / "x", "a"):
        pass


def test_read_json_names_the_file_when_missing_or_corrupt(tmp_path):
    from attnlab.files import read_json

    good = tmp_path / "a.json"
    atomic_write_json(good, {"k": 1})
    assert read_json(good) == {"k": 1}
    with pytest.raises(FileNotFoundError, match=r"model config not found: .*missing\.json"):
        read_json(tmp_path / "missing.json", "model config")
    (tmp_path / "bad.json").write_bytes(b'{"k": ')
    with pytest.raises(ValueError, match=r"bad\.json is truncated or corrupt \(not valid JSON"):
        read_json(tmp_path / "bad.json")


# ---------------------------------------------------------------------------------------------
# Reading: regular files only, bounded
# ---------------------------------------------------------------------------------------------
def _within(seconds, fn):
    """fn() in a daemon thread; AssertionError when it blocks past ``seconds``."""
    import threading

    out, errors = [], []

    def target():
        try:
            out.append(fn())
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked"
    if errors:
        raise errors[0]
    return out[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo() (POSIX)")
def test_readers_refuse_fifos_and_devices_without_blocking(tmp_path):
    from attnlab.files import check_text_file, open_regular, read_json, sha256_file

    fifo = tmp_path / "latest.json"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    for path, kind in ((fifo, "a FIFO"), (zero, "not a regular file")):
        for fn in (
            lambda p=path: read_json(p, "pointer"),
            lambda p=path: sha256_file(p),
            lambda p=path: open_regular(p),
        ):
            with pytest.raises(ValueError, match=kind):
                _within(10, fn)
        with pytest.raises(ValueError, match="not a regular file"):
            check_text_file(path)
    with pytest.raises(ValueError, match="is a directory"):
        read_json(tmp_path, "pointer")


def test_read_json_is_bounded_and_names_the_file(tmp_path):
    from attnlab.files import read_json

    big = tmp_path / "big.json"
    big.write_text('"' + "x" * 2000 + '"')
    assert read_json(big, max_bytes=4000) == "x" * 2000
    with pytest.raises(ValueError, match=r"big\.json is larger than 1,000 bytes"):
        read_json(big, max_bytes=1000)
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"deep\.json is corrupt \(JSON nested too deeply\)"):
        read_json(deep)
    long_int = tmp_path / "int.json"
    long_int.write_text("9" * 10_000)  # past Python's int-from-string digit limit
    with pytest.raises(ValueError, match=r"int\.json is truncated or corrupt"):
        read_json(long_int)
    not_utf8 = tmp_path / "latin.json"
    not_utf8.write_bytes(b'"\xe9"')
    with pytest.raises(ValueError, match=r"latin\.json is truncated or corrupt"):
        read_json(not_utf8)


def test_remove_temp_files_takes_only_the_atomic_writes_leftovers(tmp_path):
    from attnlab.files import remove_temp_files

    target = tmp_path / "latest.json"
    target.write_text("{}")
    left = [tmp_path / ".latest.json.k1ll3d.tmp", tmp_path / ".latest.json.x.tmp"]
    for p in left:
        p.write_text("torn")
    keep = [tmp_path / "latest.json.tmp", tmp_path / ".metrics.jsonl.x.tmp", tmp_path / ".latest.json.x.tmpx"]
    for p in keep:
        p.write_text("not ours to remove")
    assert sorted(remove_temp_files(target)) == sorted(left)
    assert all(p.exists() for p in [target, *keep]) and not any(p.exists() for p in left)


def test_safe_write_escapes_what_the_stream_cannot_encode():
    import io

    from attnlab.files import safe_write

    raw = io.BytesIO()
    ascii_out = io.TextIOWrapper(raw, encoding="ascii")
    safe_write(ascii_out, "café → ok\n")
    ascii_out.flush()
    assert raw.getvalue() == b"caf\\xe9 \\u2192 ok\n"
    utf8 = io.StringIO()
    safe_write(utf8, "café → ok")
    assert utf8.getvalue() == "café → ok"


def test_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    # A full disk raised a bare "[Errno 28] No space left on device" from every writer.
    import errno

    from attnlab.files import atomic_write_bytes

    target = tmp_path / "weights.bin"
    target.write_bytes(b"old")
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=r"No space left on device while writing .*weights\.bin \(it is as it was\)"):
        atomic_write_bytes(target, b"new")
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["weights.bin"]
