"""Arrays for the inspector page, stored compactly: binary, optionally quantized, lower triangles.

A 512-token prompt through 12 layers x 12 heads has 37.7M attention weights; as decimal JSON that is
hundreds of megabytes. The page instead holds each array as little-endian binary:

* ``f32`` (exact float32), ``i32``, or quantized ``u16`` / ``u8`` for values in [0, 1]
  (``value = q / 65535`` or ``q / 255``: at most half a step off, 7.6e-6 or 2.0e-3);
* a causal ``(T, T)`` matrix as its lower triangle only, row by row (``T (T + 1) / 2`` numbers).

In JSON an array is ``{"dtype", "shape", "tri", "b64"}`` (inline base64), or, in an offline page,
``{"dtype", "shape", "tri", "ref": [offset, nbytes]}`` into one deflate-compressed blob of all arrays
(``data["blob"]``), which the page inflates once with the browser's ``DecompressionStream``.
:func:`unpack` reverses both (tests read pages back with it).
"""

from __future__ import annotations

import base64
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

try:  # ISA-L's deflate (python-isal, in the viz and serve extras): the same format as zlib's, several
    # times faster at level 1 on a page's arrays and no larger.
    from isal import isal_zlib as _zlib
except ImportError:  # zlib, as the standard library has it
    _zlib = zlib

__all__ = ["DTYPES", "Packed", "deflate", "pack", "to_json", "unpack"]

DTYPES = {"f32": np.float32, "i32": np.int32, "u16": np.uint16, "u8": np.uint8}
QMAX = {"u16": 65535, "u8": 255}
ALIGN = 8  # every array starts at a multiple of 8 bytes in the blob (typed arrays need alignment)


@dataclass
class Packed:
    """One array ready for the page: ``data`` little-endian bytes of ``dtype``."""

    dtype: str
    shape: tuple[int, ...]
    tri: bool
    data: bytes

    def header(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "tri": self.tri}


def pack(t: Tensor, dtype: str = "f32", *, tri: bool = False) -> Packed:
    """``t`` as a :class:`Packed` array; ``tri`` keeps the lower triangle of the last two (equal) dims.

    ``u8``/``u16`` need values in [0, 1] (attention weights, probabilities)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    t = t.detach()
    shape = tuple(t.shape)
    if tri:
        if t.dim() < 2 or t.shape[-1] != t.shape[-2]:
            raise ValueError(f"tri packing needs square matrices in the last two dims, got {shape}")
        rows, cols = torch.tril_indices(t.shape[-1], t.shape[-1], device=t.device)
        t = t[..., rows, cols]  # (..., T (T + 1) / 2), row by row
    if dtype in QMAX:  # in place on a copy of its own (a fresh tensor each step costs page faults)
        q = t.float() if tri or t.dtype != torch.float32 else t.float().clone()
        t = q.clamp_(0.0, 1.0).mul_(QMAX[dtype]).round_().to(torch.uint8 if dtype == "u8" else torch.int32)
    little = np.dtype(DTYPES[dtype]).newbyteorder("<")
    arr = t.cpu().numpy().astype(DTYPES[dtype], copy=False).astype(little, copy=False)
    return Packed(dtype, shape, tri, arr.tobytes())


def _walk(obj: Any, fn) -> Any:
    if isinstance(obj, Packed):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_walk(v, fn) for v in obj]
    return obj


def to_json(data: dict[str, Any], *, blob: bool = False, level: int = 1) -> dict[str, Any]:
    """``data`` with every :class:`Packed` array made JSON: inline base64, or (``blob=True``) references
    into one deflate-compressed blob stored as ``data["blob"]``."""
    if not blob:
        return _walk(data, lambda p: {**p.header(), "b64": base64.b64encode(p.data).decode("ascii")})
    chunks: list[bytes] = []
    offset = 0

    def ref(p: Packed) -> dict[str, Any]:
        nonlocal offset
        start = offset
        pad = -len(p.data) % ALIGN
        chunks.append(p.data + b"\0" * pad)
        offset += len(p.data) + pad
        return {**p.header(), "ref": [start, len(p.data)]}

    out = _walk(data, ref)
    raw = b"".join(chunks)
    out["blob"] = {
        "encoding": "deflate",
        "nbytes": len(raw),
        "b64": base64.b64encode(deflate(raw, level)).decode("ascii"),
    }
    return out


def split(raw: bytes | memoryview, parts: int) -> list[memoryview]:
    """``raw`` in ``parts`` pieces of equal size (the last one shorter), views without copies."""
    view = memoryview(raw)
    size = max(1, -(-len(view) // max(1, parts)))
    return [view[i : i + size] for i in range(0, len(view), size)] or [view]


def on_threads(fn: Any, items: Any) -> list:
    """``[fn(item) for item in items]``, each call on a thread of its own (one item: here), for
    functions that let go of the GIL (zlib's and ISA-L's)."""
    items = list(items)
    if len(items) <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def deflate(raw: bytes, level: int = 1, parts: int | None = None, *, library: Any = None) -> bytes:
    """``zlib.compress(raw, level)``'s format (a zlib stream, what the page's ``DecompressionStream
    ("deflate")`` reads), compressed in ``parts`` pieces on as many threads (default: torch's thread
    count), as pigz does: each piece a raw deflate segment ending on a byte boundary (a sync flush),
    the last one final, between the zlib header and the Adler-32 of the whole. The compressor lets go
    of the GIL, so the pieces run at once; each starts with an empty window (a few bytes more).

    ``library``: a module with zlib's API, default ISA-L's (``isal.isal_zlib``, whose levels stop at 3:
    a higher one is its 3) where it is installed, else ``zlib``."""
    z = _zlib if library is None else library
    level = min(level, getattr(z, "ISAL_BEST_COMPRESSION", level))
    parts = max(1, torch.get_num_threads() if parts is None else parts)
    if parts == 1 or len(raw) < (1 << 20):
        return z.compress(raw, level)
    pieces = split(raw, parts)

    def segment(i: int) -> bytes:
        c = z.compressobj(level, zlib.DEFLATED, -15)  # raw deflate: no header, no checksum
        return c.compress(pieces[i]) + c.flush(zlib.Z_FINISH if i == len(pieces) - 1 else zlib.Z_SYNC_FLUSH)

    body = on_threads(segment, range(len(pieces)))
    header = zlib.compress(b"", min(level, 9))[:2]  # CMF and FLG (FLEVEL only informs)
    return header + b"".join(body) + z.adler32(raw).to_bytes(4, "big")


def _tensor(header: dict[str, Any], raw: bytes) -> Tensor:
    dtype, shape = header["dtype"], tuple(header["shape"])
    arr = np.frombuffer(raw, dtype=np.dtype(DTYPES[dtype]).newbyteorder("<")).astype(DTYPES[dtype])
    t = torch.from_numpy(arr.copy())
    if dtype in QMAX:
        t = t.float() / QMAX[dtype]
    if header.get("tri"):
        n = shape[-1]
        full = torch.zeros(*shape[:-2], n * n, dtype=t.dtype)
        rows, cols = torch.tril_indices(n, n)
        full[..., rows * n + cols] = t.reshape(*shape[:-2], -1)
        return full.reshape(shape)
    return t.reshape(shape)


def unpack(data: dict[str, Any]) -> dict[str, Any]:
    """The JSON of :func:`to_json` with every array back as a tensor (quantized ones as float32)."""
    blob = data.get("blob")
    raw = zlib.decompress(base64.b64decode(blob["b64"])) if blob else b""

    def walk(obj: Any) -> Any:
        if isinstance(obj, dict) and "dtype" in obj and ("b64" in obj or "ref" in obj):
            if "b64" in obj:
                return _tensor(obj, base64.b64decode(obj["b64"]))
            start, n = obj["ref"]
            return _tensor(obj, raw[start : start + n])
        if isinstance(obj, dict):
            return {k: walk(v) for k, v in obj.items() if k != "blob"}
        if isinstance(obj, list):
            return [walk(v) for v in obj]
        return obj

    return walk(data)
