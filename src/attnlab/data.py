"""Training data: the built-in corpus, text loading, token caches, windows and batches.

From text to batches: :func:`builtin_corpus` (the Python documentation every CPython ships, so
``attnlab train`` works offline), :func:`load_text`, :func:`tokenize_to_cache` (a file tokenized once
into a memory-mapped token file: a multi-GB corpus never sits in RAM as Python ints),
:class:`TokenWindowDataset` / :func:`create_dataloader` (the tutorials' ``MyData`` / ``my_batch``
windows, as views over one token array), :func:`train_val_split` and :class:`RandomWindowBatches`
(the trainer's: batch ``step`` is a pure function of ``(seed, step)``, so resuming is exact).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from attnlab.checks import is_int, is_real, non_negative_int, positive_int
from attnlab.files import atomic_open, atomic_write_json, check_text_file, iter_decoded, iter_text_chunks, sha256_file
from attnlab.tokenizers import ByteTokenizer, CharTokenizer, Tokenizer, as_tokenizer, encode_to_tensor

__all__ = [
    "RandomWindowBatches",
    "TokenWindowDataset",
    "builtin_corpus",
    "create_dataloader",
    "default_cache_dir",
    "iter_text_chunks",
    "load_text",
    "token_dtype",
    "tokenize_to_cache",
    "train_val_split",
]

Tokens = Tensor | np.ndarray  # a 1-D integer token sequence (np.memmap is an np.ndarray)

CACHE_ENV = "ATTNLAB_CACHE_DIR"
_CACHE_FORMAT = 1  # bump when the cache file layout or the chunking rules change


# -- Text --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def builtin_corpus() -> str:
    """The Python documentation topics shipped with CPython, as one text (about 0.5 MB).

    ``pydoc_data.topics.topics`` (the text behind ``help("assert")`` etc.) joined in sorted key
    order with a blank line between topics, so it is the same string on every run. Its exact
    content follows the Python version.
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:  # pragma: no cover - some stripped-down Pythons drop pydoc_data
        raise ValueError(
            "this Python has no pydoc_data module, so the built-in corpus is unavailable; pass --data FILE"
        ) from None
    return "\n".join(topics[key] for key in sorted(topics))


def load_text(path: str | os.PathLike[str] | None) -> str:
    """The text of a UTF-8 file, or the built-in corpus when ``path`` is None.

    Decoded as-is (no newline translation), so the text matches the token cache. FileNotFoundError
    or ValueError (a directory, not UTF-8: names the file and the offset) otherwise.
    """
    if path is None:
        return builtin_corpus()
    p = check_text_file(path)
    try:
        return p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{p} is not UTF-8 text (invalid byte at offset {exc.start})") from None


# -- Token cache -------------------------------------------------------------------------------
def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding ids ``< vocab_size``: uint16 up to 65536 ids, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def default_cache_dir() -> Path:
    """``$ATTNLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/attnlab``, else ``~/.cache/attnlab``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "attnlab"


def _writable_cache_dir(cache_dir: str | os.PathLike[str] | None) -> Path:
    """The cache directory, created; the default falls back to the temp dir when ~ is read-only
    (CI sandboxes, containers), an explicit one that cannot be written is a clear error."""
    candidates = [Path(cache_dir).expanduser()] if cache_dir is not None else [default_cache_dir()]
    if cache_dir is None:
        uid = os.getuid() if hasattr(os, "getuid") else "user"
        candidates.append(Path(tempfile.gettempdir()) / f"attnlab-cache-{uid}")
    for d in candidates:
        with contextlib.suppress(OSError):
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
    raise ValueError(f"cannot write the token cache in {candidates[0]}; set {CACHE_ENV} to a writable directory")


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[bool]:
    """Exclusive advisory lock, so that concurrent ranks tokenize a file once and the others wait.
    Yields whether the lock is real: without fcntl (Windows) each process builds its own copy,
    which os.replace keeps correct. The holder removes the lock file when done (else they pile up):
    safe, since a process that gets the lock checks its file is still the one at ``lock_path`` (same
    inode), else locks the new one, and whoever gets it looks for the finished entry first."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover
        yield False
        return
    while True:
        fh = open(lock_path, "a+b")  # noqa: SIM115 - closed below
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
            try:
                same = os.fstat(fh.fileno()).st_ino == os.stat(lock_path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # its holder removed it while we waited: lock the current one
                continue
            try:
                yield True
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(lock_path)  # still holding it: nobody else can be inside
            return
        finally:
            fh.close()  # releases the flock


def _whole(final: Path, dtype: np.dtype) -> bool:
    """Whether the cache entry ``final`` holds as many tokens as its sidecar says it was written with
    (a file cut short, by hand or by a full disk, is built again rather than read as the whole text)."""
    try:
        meta = json.loads(final.with_suffix(".json").read_text(encoding="utf-8"))
        return final.is_file() and final.stat().st_size == meta["num_tokens"] * dtype.itemsize
    except (OSError, ValueError, KeyError, TypeError):  # (no sidecar: a build killed before it, rebuilt)
        return False


def _open_tokens(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap cannot map an empty file
    return np.memmap(path, dtype=dtype, mode="r")


def _iter_token_arrays(
    p: Path, tokenizer: Tokenizer, chunk_bytes: int, on_raw: Any = None, workers: int = 1
) -> Iterator[np.ndarray]:
    """Stream the file's tokens chunk by chunk, cutting the text only where
    ``tokenizer.split_point`` says the encoding is unaffected."""
    if isinstance(tokenizer, ByteTokenizer):
        # The ids are the file's bytes; decoding only validates UTF-8.
        for _, raw in iter_decoded(p, chunk_bytes, on_raw):
            if raw:
                yield np.frombuffer(raw, dtype=np.uint8)
        return
    # BPE is the slow one; tiktoken releases the GIL, so threads encode pieces in parallel.
    parallel = workers > 1 and type(tokenizer).split_point is not Tokenizer.split_point
    with ThreadPoolExecutor(workers) if parallel else contextlib.nullcontext() as pool:
        pending, offset = "", 0  # offset: characters of the file before `pending`
        for text, _ in iter_decoded(p, chunk_bytes, on_raw):
            pending += text
            cut = tokenizer.split_point(pending)
            if cut > 0:
                yield _encode_chunk(p, tokenizer, pending[:cut], offset, pool, workers)
                pending, offset = pending[cut:], offset + cut
        if pending:
            yield _encode_chunk(p, tokenizer, pending, offset, pool, workers)


def _encode_chunk(p: Path, tokenizer: Tokenizer, text: str, offset: int, pool: Any, workers: int) -> np.ndarray:
    """``tokenizer.encode_array(text)``, split into ``workers`` pieces at safe cuts when a pool is given;
    ``text`` starts at character ``offset`` of the file ``p``."""
    if isinstance(tokenizer, CharTokenizer):
        # Name the file and the character's position in it, not in this chunk.
        i = tokenizer.first_unknown(text)
        if i is not None:
            raise ValueError(f"{p}: " + tokenizer.unknown_message(text[i], f"at character {offset + i}"))
    if pool is None or len(text) < 1 << 16:
        return tokenizer.encode_array(text)
    pieces, start = [], 0
    for k in range(1, workers):
        target = len(text) * k // workers
        if target <= start:
            continue
        cut = tokenizer.split_point(text[start:target])
        if cut > 0:
            pieces.append(text[start : start + cut])
            start += cut
    pieces.append(text[start:])
    return np.concatenate(list(pool.map(tokenizer.encode_array, pieces)))


def tokenize_to_cache(
    path: str | os.PathLike[str] | None,
    tokenizer: Tokenizer,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    chunk_bytes: int = 1 << 22,
    progress: bool = False,
    workers: int | None = None,
    content_hash: str | None = None,
) -> np.ndarray:
    """All tokens of a UTF-8 file as a read-only 1-D memory-mapped array, built once and reused.

    The cache file is named by the SHA-256 of the file's content (edits are always seen, whatever the
    timestamps say) and the tokenizer's fingerprint; it is written atomically (:func:`atomic_open`),
    and concurrent processes (the ranks of one ``torchrun``) take a file lock and tokenize once.

    Args:
        path: UTF-8 text file; ``None`` encodes the built-in corpus in memory (a plain array).
        cache_dir: where cache files go (default :func:`default_cache_dir`).
        chunk_bytes: bytes of text read and tokenized at a time; ``progress``: a tqdm bar meanwhile.
        workers: threads encoding pieces of a chunk (GPT-2 BPE only; default: this process's CPUs).
        content_hash: the file's SHA-256 (hex) when the caller already has it (read once, not twice).

    Returns ``np.memmap`` (``np.ndarray`` for the built-in corpus) of dtype :func:`token_dtype`.
    """
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be an attnlab Tokenizer, got {type(tokenizer).__name__}")
    positive_int("chunk_bytes", chunk_bytes)
    if workers is not None:
        positive_int("workers", workers)
    dtype = token_dtype(tokenizer.vocab_size)
    if path is None:
        return np.asarray(tokenizer.encode_array(builtin_corpus()), dtype=dtype)
    p = check_text_file(path)

    content_hash = content_hash or sha256_file(p)
    key = hashlib.sha256(
        json.dumps([_CACHE_FORMAT, tokenizer.fingerprint(), content_hash, dtype.str]).encode()
    ).hexdigest()[:24]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", p.name)[:48]
    cdir = _writable_cache_dir(cache_dir)
    final = cdir / f"{stem}.{tokenizer.name}.{key}.{dtype.name}.bin"

    if _whole(final, dtype):
        return _open_tokens(final, dtype)
    with _file_lock(cdir / f"{final.name}.lock") as locked:
        # Another process may have built it while we waited for the lock.
        if _whole(final, dtype):
            return _open_tokens(final, dtype)
        # Temp files of a build that was killed (SIGKILL skips our cleanup); nobody else is
        # writing this entry while we hold its lock.
        for stale in cdir.glob(f".{final.name}.*.tmp") if locked else ():
            with contextlib.suppress(OSError):
                stale.unlink()
        if workers is None:
            workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        n_tokens = _write_token_file(p, tokenizer, final, chunk_bytes, progress, max(1, int(workers)), content_hash)
        meta = {
            "source": str(p.resolve()),
            "source_sha256": content_hash,
            "source_bytes": p.stat().st_size,
            "tokenizer": tokenizer.to_dict(),
            "dtype": dtype.name,
            "num_tokens": n_tokens,
            "format": _CACHE_FORMAT,
        }
        # The sidecar is for people browsing the cache, and says how many tokens the .bin must hold.
        atomic_write_json(final.with_suffix(".json"), meta)
    return _open_tokens(final, dtype)


def _write_token_file(
    p: Path, tokenizer: Tokenizer, dest: Path, chunk_bytes: int, progress: bool, workers: int, expected_sha256: str
) -> int:
    """Tokenize ``p`` into ``dest`` (ids of :func:`token_dtype`); returns the number of tokens."""
    dtype = token_dtype(tokenizer.vocab_size)
    # Hash what we actually tokenize: a file edited between the cache-key hash and this pass
    # must not be stored under the old content's key.
    hasher = hashlib.sha256()
    bar = None
    if progress:
        with contextlib.suppress(ImportError):  # (no tqdm: no bar)
            from tqdm.auto import tqdm

            bar = tqdm(total=p.stat().st_size, unit="B", unit_scale=True, desc=f"tokenizing {p.name}")

    def on_raw(raw: bytes) -> None:
        hasher.update(raw)
        if bar is not None:
            bar.update(len(raw))

    n = 0
    try:
        with atomic_open(dest, "wb") as f:
            for ids in _iter_token_arrays(p, tokenizer, chunk_bytes, on_raw, workers):
                if ids.size and int(ids.max()) >= tokenizer.vocab_size:  # pragma: no cover - defensive
                    raise ValueError(f"tokenizer produced id {int(ids.max())} >= vocab_size {tokenizer.vocab_size}")
                f.write(np.ascontiguousarray(ids, dtype=dtype).tobytes())
                n += int(ids.size)
            if hasher.hexdigest() != expected_sha256:  # raising here keeps the old file (if any)
                raise ValueError(f"{p} changed while it was being tokenized; run again once it is complete")
    finally:
        if bar is not None:
            bar.close()
    return n


# -- Windows and batches -----------------------------------------------------------------------
def _as_token_sequence(tokens: Any, name: str = "tokens") -> Tokens:
    """Accept a 1-D integer tensor / ndarray (incl. memmap) or a list of ints; keep arrays as-is
    (no copy) so memory-mapped tokens stay on disk."""
    if isinstance(tokens, (Tensor, np.ndarray)) and tokens.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tokens.shape)}")
    if isinstance(tokens, Tensor):
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer ids, got dtype {tokens.dtype}")
        return tokens
    if isinstance(tokens, np.ndarray):
        if not np.issubdtype(tokens.dtype, np.integer) or tokens.dtype == np.uint64:
            # uint64 ids past 2**63 would wrap to negative int64 ones when read as tensors.
            raise TypeError(f"{name} must hold integer ids of at most 63 bits (not uint64), got dtype {tokens.dtype}")
        return tokens
    if isinstance(tokens, (list, tuple)):
        for i, t in enumerate(tokens):
            if not is_int(t) or t < 0:
                raise TypeError(f"{name} must be a flat list of non-negative int ids, got {t!r} at index {i}")
        return torch.tensor(tokens, dtype=torch.long).reshape(-1)
    raise TypeError(f"{name} must be a 1-D tensor, numpy array or list of ints, got {type(tokens).__name__}")


class TokenWindowDataset(Dataset):
    """The sliding windows of the tutorials' ``MyData``, as views over one token sequence.

    Item ``i`` is ``(tokens[s : s + context_length], tokens[s + 1 : s + context_length + 1])`` with
    ``s = i * stride``, for ``s`` in ``range(0, len(tokens) - context_length, stride)``: ``MyData``'s
    windows, but nothing is copied up front (an int64 tensor yields views, a memmap is read window by
    window). ``tokens``: a 1-D integer tensor, numpy array / memmap, or list of ints; ``stride <
    context_length`` overlaps windows. Items: two int64 tensors of shape ``(context_length,)``.
    """

    def __init__(self, tokens: Tokens | Sequence[int], context_length: int, stride: int = 1):
        self.tokens = _as_token_sequence(tokens)
        self.context_length = positive_int("context_length", context_length)
        self.stride = positive_int("stride", stride)
        self._starts = range(0, len(self.tokens) - self.context_length, self.stride)

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, idx: int) -> tuple[Tensor, Tensor]:
        s = self._starts[idx]  # range indexing: negative indices and IndexError for free
        chunk = self.tokens[s : s + self.context_length + 1]  # (T+1,)
        # An int64 tensor's window is a view of it (long() copies nothing); an array's is read here.
        chunk = chunk.long() if isinstance(chunk, Tensor) else torch.from_numpy(np.asarray(chunk, dtype=np.int64))
        return chunk[:-1], chunk[1:]  # (T,), (T,) shifted by one

    def __repr__(self) -> str:
        return (
            f"TokenWindowDataset(num_tokens={len(self.tokens)}, context_length={self.context_length}, "
            f"stride={self.stride}, windows={len(self)})"
        )


def create_dataloader(
    text_or_tokens: str | Tokens | Sequence[int],
    batch_size: int = 4,
    context_length: int = 256,
    stride: int = 128,
    shuffle: bool = True,
    drop_last: bool = True,
    num_workers: int = 0,
    tokenizer: Tokenizer | str | Any | None = None,
    generator: torch.Generator | None = None,
) -> DataLoader:
    """The tutorials' ``my_batch``: a DataLoader of ``(inputs, targets)`` sliding windows.

    ``my_batch``'s arguments, where ``text_or_tokens`` may also be token ids, plus ``tokenizer`` for
    text: an attnlab Tokenizer, a name or any object with ``encode`` (``tiktoken.get_encoding("gpt2")``);
    default ``"byte"``, which works offline (``"gpt2"`` gives the tutorial's ids), and ``generator``
    for the shuffle order.

    Batches: two int64 tensors of shape ``(batch_size, context_length)``.
    """
    if isinstance(text_or_tokens, str):
        tokens: Tokens = encode_to_tensor(as_tokenizer(tokenizer), text_or_tokens)
    else:
        if tokenizer is not None:
            raise ValueError("tokenizer is only used when text_or_tokens is a str; these are already tokens")
        tokens = _as_token_sequence(text_or_tokens, "text_or_tokens")
    dataset = TokenWindowDataset(tokens, context_length, stride)
    batch_size = positive_int("batch_size", batch_size)
    # An empty loader would make a training loop silently do nothing; say why there is no batch.
    if len(dataset) == 0:
        raise ValueError(
            f"text_or_tokens has {len(dataset.tokens)} tokens, but a window needs context_length + 1 = "
            f"{dataset.context_length + 1} (inputs and their next-token targets); use more text or a shorter "
            "context_length"
        )
    if drop_last and len(dataset) < batch_size:
        raise ValueError(
            f"text_or_tokens gives {len(dataset)} windows, fewer than batch_size={batch_size}, and drop_last=True "
            "drops that partial batch, leaving none; lower batch_size or stride, or pass drop_last=False"
        )
    num_workers = non_negative_int("num_workers", num_workers)
    kw = dict(shuffle=shuffle, drop_last=drop_last, num_workers=num_workers, generator=generator)
    return DataLoader(dataset, batch_size=batch_size, **kw)


def train_val_split(tokens: Tokens | Sequence[int], val_fraction: float = 0.1) -> tuple[Tokens, Tokens]:
    """Split a token sequence into ``(train, val)``: the first ``1 - val_fraction`` and the rest.

    Contiguous (no window straddles the two parts' boundary during training) and made of views,
    so a memmap stays on disk. ``len(val) = round(len(tokens) * val_fraction)``.
    """
    tokens = _as_token_sequence(tokens)
    if not is_real(val_fraction) or not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be a number in [0, 1), got {val_fraction!r}")
    n_train = len(tokens) - round(len(tokens) * float(val_fraction))
    return tokens[:n_train], tokens[n_train:]


class RandomWindowBatches:
    """Random training windows where batch ``step`` is a pure function of ``(seed, step)``.

    Each step draws a *global* batch of ``world_size * grad_accum_steps * batch_size`` window
    starts, uniformly from every position that has ``context_length + 1`` tokens after it
    (nanoGPT-style sampling with replacement). Rank ``r`` in micro-step ``m`` takes rows
    ``[(m * world_size + r) * batch_size, ... + batch_size)``. So resuming at ``step`` reproduces the
    batches of an uninterrupted run exactly (no sampler state), and N processes see the same global
    batch as M, so a checkpoint from N resumes with any M.
    ``tokens`` (a 1-D tensor, array or memmap) is read only at the sampled windows; ``batch_size``
    is the rows per rank per micro-step.
    """

    def __init__(
        self,
        tokens: Tokens | Sequence[int],
        batch_size: int,
        context_length: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        grad_accum_steps: int = 1,
    ):
        self.tokens = _as_token_sequence(tokens)
        self.batch_size = positive_int("batch_size", batch_size)
        self.context_length = positive_int("context_length", context_length)
        self.world_size = positive_int("world_size", world_size)
        self.grad_accum_steps = positive_int("grad_accum_steps", grad_accum_steps)
        if not is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, world_size={self.world_size}), got {rank!r}")
        self.rank = int(rank)
        self.seed = non_negative_int("seed", seed)
        if len(self.tokens) < self.context_length + 1:
            raise ValueError(
                f"need at least context_length + 1 = {self.context_length + 1} tokens, got {len(self.tokens)}"
            )
        self._offsets = np.arange(self.context_length + 1)  # (T+1,)

    @property
    def global_batch_size(self) -> int:
        """Rows per optimizer step over all ranks and micro-steps."""
        return self.world_size * self.grad_accum_steps * self.batch_size

    def global_starts(self, step: int) -> np.ndarray:
        """Window starts of the whole global batch of ``step``: int64 array ``(global_batch_size,)``."""
        non_negative_int("step", step)
        # SeedSequence mixes (seed, step) into an independent stream per step; same on every platform.
        rng = np.random.default_rng([self.seed, int(step)])
        high = len(self.tokens) - self.context_length  # exclusive: start + T + 1 <= len(tokens)
        return rng.integers(0, high, size=self.global_batch_size, dtype=np.int64)

    def _gather(self, starts: np.ndarray) -> tuple[Tensor, Tensor]:
        idx = starts[:, None] + self._offsets  # (B, T+1)
        if isinstance(self.tokens, Tensor):
            rows = self.tokens[torch.from_numpy(idx).to(self.tokens.device)].long()  # (B, T+1)
        else:
            rows = torch.from_numpy(np.asarray(self.tokens[idx], dtype=np.int64))  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]  # (B, T), (B, T)

    def batch(self, step: int, micro_step: int = 0, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
        """This rank's ``(x, y)`` for ``step`` (and ``micro_step``): int64 ``(batch_size, context_length)``,
        ``y`` is ``x`` shifted by one token. Moved to ``device`` when given."""
        if not is_int(micro_step):
            raise ValueError(f"micro_step must be an int, got {micro_step!r}")
        if not 0 <= micro_step < self.grad_accum_steps:
            raise ValueError(f"micro_step must be in [0, grad_accum_steps={self.grad_accum_steps}), got {micro_step}")
        first = (int(micro_step) * self.world_size + self.rank) * self.batch_size
        x, y = self._gather(self.global_starts(step)[first : first + self.batch_size])
        if device is not None:
            device = torch.device(device)
            pin = device.type == "cuda" and x.device.type == "cpu"  # pinned memory: the copy overlaps with compute
            x, y = ((t.pin_memory() if pin else t).to(device, non_blocking=pin) for t in (x, y))
        return x, y

    def global_batch(self, step: int) -> tuple[Tensor, Tensor]:
        """All ``global_batch_size`` rows of ``step`` (what one process with the whole batch sees)."""
        return self._gather(self.global_starts(step))

    def __repr__(self) -> str:
        return (
            f"RandomWindowBatches(num_tokens={len(self.tokens)}, batch_size={self.batch_size}, "
            f"context_length={self.context_length}, seed={self.seed}, rank={self.rank}, "
            f"world_size={self.world_size}, grad_accum_steps={self.grad_accum_steps})"
        )
