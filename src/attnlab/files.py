"""Files: atomic writes (nothing attnlab writes is ever seen half-written), and reading JSON and UTF-8 text.

Every file goes to a temporary file in the destination's directory, is flushed and fsynced, then
renamed over the destination with ``os.replace`` (atomic on POSIX and Windows), and the directory
is fsynced so the rename itself survives a power cut. A crash or SIGKILL at any moment leaves
either the old file or the new one, never a mixture.
"""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "atomic_open",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "check_text_file",
    "current_umask",
    "fsync_dir",
    "import_safetensors",
    "iter_decoded",
    "iter_text_chunks",
    "read_json",
    "sha256_file",
]


def current_umask() -> int:
    """The process umask (``tempfile`` ignores it: ``mkstemp``/``mkdtemp`` make 0600/0700)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """fsync a directory so a rename inside it is durable (a no-op where that is unsupported)."""
    with contextlib.suppress(OSError):  # not every platform or filesystem can fsync a directory
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file that replaces ``path`` when the ``with`` block ends without error.

    If the block raises (or the process dies), ``path`` keeps its previous content and the
    temporary file is removed. ``mode`` is ``"wb"`` or ``"w"`` (text is UTF-8).
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"mode must be 'wb' or 'w', got {mode!r}")
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: the directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.chmod(tmp, 0o666 & ~current_umask())  # what a plain open() would give
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, indent: int | None = 2) -> None:
    """Write ``obj`` as JSON (with a final newline) to ``path`` atomically."""
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


def sha256_file(path: str | os.PathLike[str], *, block_size: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's content, read in blocks (a multi-GB file never sits in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(block_size), b""):
            h.update(block)
    return h.hexdigest()


def read_json(path: str | os.PathLike[str], what: str = "file") -> Any:
    """Parse a UTF-8 JSON file; a missing, truncated or corrupt one is an error naming it (``what``)."""
    path = Path(path)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path} is truncated or corrupt (not valid JSON: {e})") from None


def import_safetensors() -> Any:
    """The ``safetensors`` package, imported on first use: it is an extra, not a core dependency."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        raise ImportError("saving/loading GPT weights needs safetensors: pip install 'attnlab[train]'") from None
    return safetensors


def check_text_file(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path, or FileNotFoundError / ValueError naming it when it is no file."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data file not found: {p}")
    if p.is_dir():
        raise ValueError(f"data path is a directory, expected a UTF-8 text file: {p}")
    return p


def iter_text_chunks(path: str | os.PathLike[str], chunk_bytes: int = 1 << 24) -> Iterator[str]:
    """Decode a UTF-8 file in pieces of about ``chunk_bytes`` bytes (multi-byte characters are
    never split). Raises like :func:`load_text`."""
    for text, _ in iter_decoded(check_text_file(path), chunk_bytes):
        yield text


def iter_decoded(
    p: Path, chunk_bytes: int, on_raw: Callable[[bytes], None] | None = None
) -> Iterator[tuple[str, bytes]]:
    """Yield ``(text, raw)`` pieces of a UTF-8 file: ``raw`` is the block just read, ``text`` what it
    completed (a multi-byte character cut by the block end is held back until the next block)."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0  # bytes read before this block
    with open(p, "rb") as f:
        while True:
            raw = f.read(chunk_bytes)
            final = not raw
            held = len(decoder.getstate()[0])  # bytes of an unfinished character from the last block
            try:
                text = decoder.decode(raw, final=final)
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{p} is not UTF-8 text (invalid byte at offset {offset - held + exc.start})"
                ) from None
            offset += len(raw)
            if on_raw is not None:
                on_raw(raw)
            if text or raw:
                yield text, raw
            if final:
                return
