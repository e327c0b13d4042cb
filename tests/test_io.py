"""Atomic writes: the old file survives any failure, no temp file is left, permissions are normal."""

import json
import os
import stat

import pytest

from attnlab.files import atomic_open, atomic_write_bytes, atomic_write_json, atomic_write_text


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
