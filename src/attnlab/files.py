"""Files: atomic writes (nothing attnlab writes is ever seen half-written), and reading JSON and UTF-8 text.

Every file goes to a temporary file in the destination's directory, is flushed and fsynced, then
renamed over the destination with ``os.replace`` (atomic on POSIX and Windows), and the directory
is fsynced so the rename itself survives a power cut. A crash or SIGKILL at any moment leaves
either the old file or the new one, never a mixture (and, after a SIGKILL, a ``.NAME.*.tmp`` file
that :func:`remove_temp_files` clears).

Reading: attnlab reads only *regular* files (a FIFO would block forever, ``/dev/zero`` would fill
the memory), opened without blocking and checked with ``fstat`` before the first byte is read, and
small files (JSON) only up to a size cap.
"""

from __future__ import annotations

import codecs
import contextlib
import glob
import hashlib
import json
import os
import stat
import struct
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
    "first_line",
    "fsync_dir",
    "import_safetensors",
    "iter_decoded",
    "iter_text_chunks",
    "open_gguf",
    "open_regular",
    "read_json",
    "remove_temp_files",
    "safe_write",
    "sha256_file",
]

JSON_MAX_BYTES = 64 << 20  # read_json's default cap: attnlab's JSON files are kilobytes (a char vocabulary, RNG states)


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
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temporary file beside ``path`` for a writer that takes a file name (safetensors' ``save_file``):
    it is fsynced and replaces ``path`` when the ``with`` block ends without error; if it raises,
    ``path`` keeps its content and the temporary file goes."""
    path = Path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: the directory {path.parent} does not exist")
    try:
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from None
    os.close(fd)
    tmp = Path(name)
    try:
        os.chmod(tmp, 0o666 & ~current_umask())  # what a plain open() would give
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)  # (fsync is the file's, whichever descriptor asks)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename is None and e.errno is not None:  # (a full disk: name the file)
            raise OSError(e.errno, f"{e.strerror} while writing {path} (it is as it was)") from None
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file that replaces ``path`` when the ``with`` block ends without error; if it
    raises, ``path`` keeps its content and the temporary file goes. ``mode``: ``"wb"`` or ``"w"`` (UTF-8)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"mode must be 'wb' or 'w', got {mode!r}")
    with atomic_path(path) as tmp, open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
        yield f


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


def remove_temp_files(path: str | os.PathLike[str]) -> list[Path]:
    """Remove the temporary files (``.NAME.*.tmp``) :func:`atomic_open` left for ``path`` when its process
    was killed mid-write; returns those removed. Only while no other process may be writing ``path``
    (e.g. holding a lock on its directory): a file being written looks the same as an abandoned one."""
    path = Path(path)
    removed = []
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        with contextlib.suppress(OSError):
            if tmp.is_file() and not tmp.is_symlink():
                tmp.unlink()
                removed.append(tmp)
    return removed


def open_regular(path: str | os.PathLike[str], what: str = "file") -> IO[bytes]:
    """Open ``path`` for binary reading if it is a regular file (after symlinks); a FIFO, a device,
    a socket or a directory is a ValueError naming it (``what``), before anything is read.

    The file is opened with ``O_NONBLOCK`` (opening a FIFO would otherwise wait for a writer) and
    checked with ``fstat`` on the open descriptor (no window between the check and the read).
    """
    path = Path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise ValueError(f"{what} {path} is a directory, not a file") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
            raise ValueError(f"{what} {path} is {kind}; attnlab reads only regular files")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # a regular file never blocks; normal reads from here on
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def sha256_file(path: str | os.PathLike[str], *, block_size: int = 1 << 22, what: str = "file") -> str:
    """Hex SHA-256 of a regular file's content, read in blocks (a multi-GB file never sits in memory)."""
    h = hashlib.sha256()
    with open_regular(path, what) as f:
        for block in iter(lambda: f.read(block_size), b""):
            h.update(block)
    return h.hexdigest()


def read_json(path: str | os.PathLike[str], what: str = "file", *, max_bytes: int = JSON_MAX_BYTES) -> Any:
    """Parse a UTF-8 JSON file of at most ``max_bytes`` bytes; a missing, oversized, truncated or
    corrupt one, or one that is no regular file, is an error naming it (``what``)."""
    path = Path(path)
    with open_regular(path, what) as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"{what} {path} is larger than {max_bytes:,} bytes: not a file attnlab wrote")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, or an integer too long to convert
        raise ValueError(f"{what} {path} is truncated or corrupt (not valid JSON: {first_line(e)})") from None
    except RecursionError:  # [[[[...]]]] nested deeper than the parser's stack
        raise ValueError(f"{what} {path} is corrupt (JSON nested too deeply)") from None


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when it has none), for a one-line error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def safe_write(stream: IO[str], text: str) -> None:
    """Write ``text`` to a text stream; characters its encoding cannot represent (an ASCII-only
    terminal, ``PYTHONIOENCODING=ascii``) become backslash escapes instead of an exception."""
    try:
        stream.write(text)
    except UnicodeEncodeError:
        encoding = getattr(stream, "encoding", None) or "ascii"
        stream.write(text.encode(encoding, "backslashreplace").decode(encoding, "replace"))


def import_safetensors() -> Any:
    """The ``safetensors`` package, imported on first use: it is an extra, not a core dependency."""
    try:
        import safetensors
        import safetensors.torch
    except ImportError:
        raise ImportError("saving/loading GPT weights needs safetensors: pip install 'attnlab[train]'") from None
    return safetensors


def check_text_file(path: str | os.PathLike[str]) -> Path:
    """``path`` as a Path, or FileNotFoundError / ValueError naming it when it is no regular file
    (a FIFO or a device would block or never end: the text is read more than once)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data file not found: {p}")
    if p.is_dir():
        raise ValueError(f"data path is a directory, expected a UTF-8 text file: {p}")
    if not p.is_file():
        raise ValueError(f"data path {p} is not a regular file (a FIFO or a device?); expected a UTF-8 text file")
    return p


def iter_text_chunks(path: str | os.PathLike[str], chunk_bytes: int = 1 << 24) -> Iterator[str]:
    """Decode a UTF-8 file in pieces of about ``chunk_bytes`` bytes (multi-byte characters are
    never split). Raises like :func:`load_text`."""
    yield from (text for text, _ in iter_decoded(check_text_file(path), chunk_bytes))


def iter_decoded(
    p: Path, chunk_bytes: int, on_raw: Callable[[bytes], None] | None = None
) -> Iterator[tuple[str, bytes]]:
    """Yield ``(text, raw)`` pieces of a UTF-8 file: ``raw`` is the block just read, ``text`` what it
    completed (a multi-byte character cut by the block end is held back until the next block)."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0  # bytes read before this block
    with open_regular(p, "data file") as f:
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


GGUF_MAGIC = b"GGUF"


class _ArrayParts:
    """The parts of a GGUF array field as ``gguf.ReaderField.parts`` lists them (the field's header
    parts, then each element's: a number, or a string's length and bytes), each made when it is
    asked for, and the field's contents decoded from the file's bytes.

    ``buf``: the file's bytes (uint8, memory-mapped); ``head``: the header parts; ``offset``: where
    the ``n`` elements start; ``dtype``: the numbers' NumPy type, or None for strings."""

    def __init__(self, buf: Any, head: list[Any], offset: int, n: int, dtype: Any) -> None:
        import numpy as np

        self.head, self.n, self.buf = head, n, buf
        if dtype is not None:
            self.values = self.starts = None
            self.end = offset + n * np.dtype(dtype).itemsize
            if self.end > len(buf):
                raise ValueError(f"an array of {n:,} numbers runs past the end of the file")
            self.values = buf[offset : self.end].view(dtype)  # (n,)
            return
        if offset + 8 * n > len(buf):  # (each string takes at least its 8-byte length)
            raise ValueError(f"an array of {n:,} strings runs past the end of the file")
        view, size = memoryview(buf), len(buf)
        self.starts, self.lengths = np.empty(n, np.int64), np.empty(n, np.int64)  # (n,), (n,): bytes
        for i in range(n):
            if offset + 8 > size:
                raise ValueError(f"string {i} of an array of {n:,} runs past the end of the file")
            (length,) = struct.unpack_from("=Q", view, offset)
            self.starts[i], self.lengths[i] = offset + 8, length
            offset += 8 + length
        if offset > size:
            raise ValueError(f"the last string of an array of {n:,} runs past the end of the file")
        self.end, self.values = offset, None

    def data_indices(self) -> range:
        """``ReaderField.data``: the index in these parts of each element's value."""
        h = len(self.head)
        return range(h, h + self.n) if self.values is not None else range(h + 1, h + 1 + 2 * self.n, 2)

    def __len__(self) -> int:
        return len(self.head) + self.n * (1 if self.values is not None else 2)

    def __getitem__(self, i: int) -> Any:
        import numpy as np

        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"part {i} of {len(self)}")
        if i < len(self.head):
            return self.head[i]
        k = i - len(self.head)
        if self.values is not None:
            return self.values[k : k + 1]
        e, part = divmod(k, 2)
        s = int(self.starts[e])
        return self.buf[s - 8 : s].view(np.uint64) if part == 0 else self.buf[s : s + int(self.lengths[e])]

    def contents(self, index_or_slice: int | slice) -> Any:
        """What ``ReaderField.contents`` gives: the element or the list of elements asked for."""
        if self.values is not None:
            return self.values[index_or_slice].tolist()
        text = lambda e: str(self.buf[self.starts[e] : self.starts[e] + self.lengths[e]].tobytes(), encoding="utf-8")
        which = range(self.n)[index_or_slice]
        return text(which) if isinstance(which, int) else [text(e) for e in which]


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """A ``gguf.GGUFReader`` on the GGUF file ``path`` (memory-mapped, read-only), or one
    ``FileNotFoundError`` / ``ValueError`` naming the file and what is wrong with it (not a GGUF
    file, a version the package does not read, a truncated header, tensor data past the end of the
    file, an unknown quantization type, ...)."""
    try:
        import gguf
        import numpy as np
    except ImportError:
        raise ImportError("reading GGUF files needs the 'gguf' package: pip install 'attnlab[gguf]'") from None

    class ArrayField(gguf.ReaderField):  # its parts are an _ArrayParts, which decodes the contents itself
        __slots__ = ()

        def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
            return self.parts.contents(index_or_slice)

    class Reader(gguf.GGUFReader):
        # A plain ndarray view of the mapping reads the same bytes without np.memmap's bookkeeping
        # on each of the many small slices the reader takes.
        @property
        def data(self) -> Any:
            return self._data

        @data.setter
        def data(self, value: Any) -> None:
            self._data = value.view(np.ndarray)

        def _build_fields(self, offs: int, count: int) -> int:
            # gguf's reader keeps two NumPy views per string of an array and one per number: a
            # vocabulary's tokens, scores, types and merges took hundreds of MB (Llama 3's 128,256
            # tokens and 280,147 merges: 285 MB). An array field here holds its offsets instead.
            if self.byte_order != "I":
                return super()._build_fields(offs, count)
            for _ in range(count):
                start = offs
                klen, kdata = self._get_str(offs)
                offs += 8 + int(klen[0])
                kind = self._get(offs, np.uint32)
                offs += 4
                head = [klen, kdata, kind]
                name = str(bytes(kdata), encoding="utf-8")
                item = self._get(offs, np.uint32) if kind[0] == gguf.GGUFValueType.ARRAY else None
                if item is None or item[0] == gguf.GGUFValueType.ARRAY:  # a value, or an array of arrays
                    size, parts, idxs, types = self._get_field_parts(offs, kind[0])
                    self._push_field(gguf.ReaderField(start, name, head + parts, [i + 3 for i in idxs], types), True)
                    offs += size
                    continue
                n = self._get(offs + 4, np.uint64)
                sub = gguf.GGUFValueType(item[0])
                parts = _ArrayParts(self.data, [*head, item, n], offs + 12, int(n[0]), self.gguf_scalar_to_np.get(sub))
                types = [gguf.GGUFValueType.ARRAY] + ([sub] if int(n[0]) else [])
                self._push_field(ArrayField(start, name, parts, parts.data_indices(), types), True)
                offs = parts.end
            return offs

    p = Path(path).expanduser()
    if not p.is_file():  # is_file: a regular file (or a link to one), never a FIFO or a device
        raise FileNotFoundError(f"{p}: no such GGUF file")
    with open(p, "rb") as f:
        head = f.read(8)
    if head[:4] != GGUF_MAGIC:
        raise ValueError(f"{p} is not a GGUF file (it starts with {head[:4]!r}, not {GGUF_MAGIC!r})")
    if len(head) < 8:
        raise ValueError(f"{p} is truncated: {len(head)} bytes, shorter than a GGUF header")
    version = struct.unpack("<I", head[4:8])[0]
    if version not in gguf.READER_SUPPORTED_VERSIONS:
        supported = ", ".join(map(str, gguf.READER_SUPPORTED_VERSIONS))
        raise ValueError(f"{p} is GGUF version {version}; the gguf package reads versions {supported}")
    try:
        reader = Reader(str(p))
    except ValueError as e:  # the reader's own: alignment, duplicates, types, data past the end
        text = str(e)
        if "cannot reshape array" in text:
            text = "tensor data runs past the end of the file (truncated?)"
        elif "GGMLQuantizationType" in text:
            text = f"a tensor has an unknown quantization type ({text})"
        elif "larger dtype" in text or "array of" in text:  # numpy's words, or _ArrayParts', for a header cut short
            text = f"its header runs past the end of the file ({p.stat().st_size:,} bytes: truncated?)"
        elif not any(m in text for m in ("alignment", "uplicate", "GGUFValueType", "field type")):
            text = f"truncated or corrupt ({text})"  # numpy's, on a header cut short
        raise ValueError(f"{p} is not a readable GGUF file: {text}") from None
    except (
        IndexError,
        KeyError,
        TypeError,
        OverflowError,
        UnicodeDecodeError,
        MemoryError,
        RecursionError,
        struct.error,
    ) as e:
        # numpy reads past the end of a truncated header as empty arrays, and indexing them fails
        raise ValueError(f"{p} is truncated or corrupt (its header does not parse: {type(e).__name__})") from None
    reader.path = p
    return reader
