"""Tokenizers for training and generation: ``byte`` (the default), ``char``, ``gpt2`` and ``hf``.

All of them share one small interface (:class:`Tokenizer`): ``encode(text) -> list[int]``,
``decode(ids) -> str``, ``vocab_size``, ``eot_id`` and ``to_dict()``, plain JSON that
:func:`tokenizer_from_dict` turns back into the same tokenizer, so a checkpoint carries its tokenizer.

* ``byte``: the 256 byte values of UTF-8; lossless, no files: the default of ``attnlab train``.
* ``char``: one id per distinct character of the training text (nanoGPT's Shakespeare example).
* ``gpt2``: GPT-2's byte-pair encoding through ``tiktoken``, as the tutorials use it; offline, from a
  directory holding ``encoder.json`` and ``vocab.bpe`` (``bpe_dir``, ``--bpe-dir``, ``$ATTNLAB_GPT2_BPE_DIR``).
* ``hf``: any Hugging Face ``tokenizer.json`` (Llama, Mistral, ...) through the ``tokenizers`` library.

Example::

    >>> tok = get_tokenizer("byte")
    >>> tok.encode("hé")
    [104, 195, 169]
    >>> tok.decode([104, 195, 169])
    'hé'
"""

from __future__ import annotations

import codecs
import contextlib
import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnlab.checks import is_int
from attnlab.errors import UserError
from attnlab.files import atomic_write_bytes, iter_text_chunks, open_regular, read_json, sha256_file
from attnlab.gguf_vocab import bytes_to_unicode, gguf_tokenizer, is_gguf_file

__all__ = [
    "GPT2_BPE_ENV",
    "HF_TOKENIZER_FILE",
    "TOKENIZER_NAMES",
    "ByteTokenizer",
    "CharTokenizer",
    "GPT2Tokenizer",
    "HFTokenizer",
    "StreamDecoder",
    "Tokenizer",
    "TokenizerLoadError",
    "bos_prefix",
    "get_tokenizer",
    "prompt_tokens",
    "tokenizer_from_dict",
    "tokenizer_to_dict",
]

TOKENIZER_NAMES = ("byte", "char", "gpt2", "hf")
# The copy of an hf tokenizer's JSON inside a checkpoint or merged model (tokenizer.json there is
# attnlab's description of the tokenizer, not Hugging Face's file).
HF_TOKENIZER_FILE = "hf_tokenizer.json"
GPT2_BPE_ENV = "ATTNLAB_GPT2_BPE_DIR"

# GPT-2's pre-tokenisation regex and special token, exactly as tiktoken defines the "gpt2" encoding
# (tiktoken_ext/openai_public.py). Repeated here so the encoding can be built without the network.
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_EOT = "<|endoftext|>"
GPT2_EOT_ID = 50256
GPT2_VOCAB_SIZE = 50257
# SHA-256 of the official files (the hashes tiktoken itself checks after downloading them).
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


class TokenizerLoadError(UserError, ValueError):
    """A tokenizer could not be loaded (e.g. GPT-2's BPE files are neither downloadable nor given).

    A :class:`attnlab.errors.UserError` (the CLI prints its one-line message) and a ``ValueError``.
    """


def _ids_to_list(ids: Sequence[int] | Tensor | np.ndarray, vocab_size: int) -> list[int]:
    """Flatten-free conversion of a 1-D id sequence to Python ints, with a range check."""
    if isinstance(ids, (Tensor, np.ndarray)):
        if ids.ndim != 1:
            raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
        if isinstance(ids, Tensor) and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
            raise TypeError(f"ids must hold integers, got dtype {ids.dtype}")
        if isinstance(ids, np.ndarray) and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"ids must hold integers, got dtype {ids.dtype}")
        out = ids.tolist()
    elif isinstance(ids, (str, bytes)):
        raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__}")
    else:
        out = list(ids)
        for i in out:
            if not is_int(i):  # int(65.9) would pass as 'A'
                raise TypeError(f"ids must be ints, got {i!r}")
        out = [int(i) for i in out]
    if out and (min(out) < 0 or max(out) >= vocab_size):
        bad = min(out) if min(out) < 0 else max(out)
        raise ValueError(f"ids must lie in [0, {vocab_size}), got {bad}")
    return out


def _check_text(text: object) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return text


_SURROGATE = re.compile("[\ud800-\udfff]")


def _reject_surrogates(text: str) -> None:
    """UTF-8 has no lone surrogates (a Python str may): refuse them rather than encode a guess."""
    if m := _SURROGATE.search(text):
        raise ValueError(f"text contains a character that is not valid in UTF-8 at index {m.start()}: {m.group()!r}")


def _json_fingerprint(obj: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


class Tokenizer:
    """Common interface of attnlab's tokenizers."""

    name: str = ""  # one of TOKENIZER_NAMES
    vocab_size: int = 0  # every id is in [0, vocab_size)
    eot_id: int | None = None  # the end-of-text token's id, if the tokenizer has one

    def encode(self, text: str) -> list[int]:
        """Text -> list of ids."""
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """Text -> 1-D integer numpy array of ids (the fast path used to build token caches)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int] | Tensor | np.ndarray) -> str:
        """Ids (a list, 1-D tensor or 1-D array) -> text."""
        raise NotImplementedError

    def decode_bytes(self, ids: Sequence[int] | Tensor | np.ndarray) -> bytes:
        """Ids -> the UTF-8 bytes they stand for; ``decode`` is these bytes decoded with
        ``errors="replace"``. (A token may hold part of a character, so bytes are what a stream
        of tokens can be cut into.)"""
        return self.decode(ids).encode("utf-8", "surrogatepass")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able description that :func:`tokenizer_from_dict` rebuilds this tokenizer from."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """Hex digest identifying the mapping text -> ids (two tokenizers with equal fingerprints
        encode every text identically). Keys the token cache."""
        return _json_fingerprint(self.to_dict())

    def split_point(self, text: str) -> int:
        """An index ``i`` such that ``encode(text[:i]) + encode(text[i:] + more) ==
        encode(text + more)`` for every continuation ``more``: where a stream of text may be cut
        into independently encoded chunks; ``0``: no safe cut is known yet. Byte and char cut anywhere.
        """
        return len(text)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"

    def __eq__(self, other: object) -> bool:  # the same mapping text -> ids
        return isinstance(other, Tokenizer) and self.fingerprint() == other.fingerprint()

    def __hash__(self) -> int:
        return hash(self.fingerprint())


class ByteTokenizer(Tokenizer):
    """The 256 byte values of UTF-8: lossless for any text, no vocabulary file.

    ``decode`` replaces byte sequences that are not valid UTF-8 (a model may generate them) with
    U+FFFD instead of failing.
    """

    name = "byte"
    vocab_size = 256

    def encode_array(self, text: str) -> np.ndarray:
        # surrogatepass would smuggle lone surrogates through; strict makes them a clear error.
        try:
            data = _check_text(text).encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"text contains a character that is not valid in UTF-8 at index {exc.start}: {text[exc.start]!r}"
            ) from None
        return np.frombuffer(data, dtype=np.uint8).copy()

    def decode(self, ids: Sequence[int] | Tensor | np.ndarray) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int] | Tensor | np.ndarray) -> bytes:
        return bytes(_ids_to_list(ids, 256))

    def to_dict(self) -> dict[str, Any]:
        return {"name": "byte"}


class CharTokenizer(Tokenizer):
    """One id per character, ids in sorted character order (``chars[i]`` has id ``i``).

    Build it from the training text with :meth:`from_text` (or :meth:`from_file` for files too big
    to hold twice). Encoding a character outside the vocabulary raises ``ValueError`` naming it.
    """

    name = "char"

    def __init__(self, chars: Iterable[str]):
        chars = list(chars)
        for c in chars:
            if not isinstance(c, str) or len(c) != 1:
                raise ValueError(f"chars must be single characters, got {c!r}")
        if len(set(chars)) != len(chars):
            raise ValueError("chars must not contain duplicates")
        if not chars:
            raise ValueError("chars must not be empty (the text has no characters)")
        self.chars = "".join(sorted(chars))
        self.vocab_size = len(self.chars)
        # Vectorised lookup: a dense code point -> id table (-1 = unknown) maps a whole text in
        # numpy. At most 0x110000 entries (4.4 MB), usually a few hundred.
        self._table = np.full(max(map(ord, self.chars)) + 1, -1, dtype=np.int32)
        self._table[[ord(c) for c in self.chars]] = np.arange(self.vocab_size, dtype=np.int32)

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """Vocabulary = the sorted distinct characters of ``text``."""
        return cls(set(_check_text(text)))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], chunk_bytes: int = 1 << 24) -> CharTokenizer:
        """Vocabulary of a UTF-8 file, read in chunks (the file is never in memory whole)."""
        seen: set[str] = set()
        for chunk in iter_text_chunks(path, chunk_bytes=chunk_bytes):
            seen.update(chunk)
        return cls(seen)

    def _lookup(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """(ids, unknown mask) of every character of ``text``; unknown ids are garbage."""
        # surrogatepass: a lone surrogate (possible in a Python str) is just another code point.
        cps = np.frombuffer(_check_text(text).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)  # (N,)
        ids = self._table[np.minimum(cps, len(self._table) - 1)]  # (N,) int32
        # A code point past the table's end was clipped onto its last entry: mark it unknown too.
        return ids, (ids < 0) | (cps >= len(self._table))

    def first_unknown(self, text: str) -> int | None:
        """Index of the first character of ``text`` outside the vocabulary, or None."""
        _, unknown = self._lookup(text)
        return int(np.argmax(unknown)) if unknown.any() else None

    def unknown_message(self, char: str, where: str) -> str:
        return (
            f"character {char!r} (U+{ord(char):04X}) {where} is not in the char tokenizer's "
            f"vocabulary of {self.vocab_size} characters (it was built from other text)"
        )

    def encode_array(self, text: str) -> np.ndarray:
        ids, unknown = self._lookup(text)
        if unknown.any():
            i = int(np.argmax(unknown))
            raise ValueError(self.unknown_message(text[i], f"at index {i}"))
        return ids.astype(np.int64)

    def decode(self, ids: Sequence[int] | Tensor | np.ndarray) -> str:
        return "".join(self.chars[i] for i in _ids_to_list(ids, self.vocab_size))

    def to_dict(self) -> dict[str, Any]:
        return {"name": "char", "chars": self.chars}


# -- GPT-2 BPE ---------------------------------------------------------------------------------
_GPT2_CACHE: dict[tuple[str, str, str], Any] = {}

# Where a GPT-2 text stream may be cut: after a non-space character and before whitespace. No
# pre-token of GPT2_PAT_STR spans such a boundary (tokens holding whitespace hold only whitespace,
# apart from a *leading* space), and the left part ends in the same pre-token whether or not text
# follows. Python's \S (not str.isspace) is stricter than the Unicode White_Space that tiktoken's
# \s uses, so every cut found here is also a cut for tiktoken. Line ends are preferred.
_GPT2_CUTS = (re.compile(r"\S(?=\n)"), re.compile(r"\S(?=[ \t\r\n])"))
_NON_SPACE = re.compile(r"\S")


def _import_tiktoken() -> Any:
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        raise TokenizerLoadError(
            "the gpt2 tokenizer needs the tiktoken package: pip install 'attnlab[train]'"
        ) from None
    return tiktoken


def _load_gpt2_from_dir(bpe_dir: Path) -> tuple[Any, str, str]:
    """Build tiktoken's "gpt2" Encoding from a local encoder.json + vocab.bpe."""
    tiktoken = _import_tiktoken()

    if not bpe_dir.exists():
        raise FileNotFoundError(f"GPT-2 BPE directory not found: {bpe_dir}")
    if not bpe_dir.is_dir():
        raise ValueError(f"bpe_dir must be a directory containing encoder.json and vocab.bpe, got file {bpe_dir}")
    vocab_bpe, encoder_json = bpe_dir / "vocab.bpe", bpe_dir / "encoder.json"
    for f in (vocab_bpe, encoder_json):
        if not f.is_file():
            raise FileNotFoundError(f"GPT-2 BPE file not found: {f} (bpe_dir needs encoder.json and vocab.bpe)")
    bpe_hash, enc_hash = sha256_file(vocab_bpe), sha256_file(encoder_json)
    key = (str(bpe_dir.resolve()), bpe_hash, enc_hash)
    if key in _GPT2_CACHE:
        return _GPT2_CACHE[key], bpe_hash, enc_hash
    try:
        # Passing the files' own hashes makes tiktoken's on-disk blob cache (keyed by path only)
        # re-read a file that changed instead of returning a stale copy.
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(vocab_bpe),
            encoder_json_file=str(encoder_json),
            vocab_bpe_hash=bpe_hash,
            encoder_json_hash=enc_hash,
        )
        enc = tiktoken.Encoding(
            name="gpt2",
            pat_str=GPT2_PAT_STR,
            mergeable_ranks=ranks,
            special_tokens={GPT2_EOT: GPT2_EOT_ID},
            explicit_n_vocab=GPT2_VOCAB_SIZE,
        )
    except (AssertionError, KeyError, ValueError, UnicodeDecodeError, AttributeError, TypeError) as exc:
        # (AttributeError, TypeError: valid JSON of another shape, e.g. an encoder.json holding a list)
        raise ValueError(
            f"{bpe_dir} does not hold a valid GPT-2 encoder.json + vocab.bpe pair ({type(exc).__name__})"
        ) from None
    _GPT2_CACHE[key] = enc
    return enc, bpe_hash, enc_hash


class GPT2Tokenizer(Tokenizer):
    """GPT-2's byte-pair encoding (50257 ids, ``<|endoftext|>`` = 50256) through tiktoken.

    ``bpe_dir``: a directory with GPT-2's ``encoder.json`` and ``vocab.bpe``; default
    ``$ATTNLAB_GPT2_BPE_DIR``, else ``tiktoken.get_encoding("gpt2")`` (downloaded once; when that
    fails, a :class:`TokenizerLoadError` saying what to do). ``encode`` takes the literal text
    ``<|endoftext|>`` for the end-of-text token (a document separator in many corpora) instead of
    refusing it as ``tiktoken`` does; ``decode`` maps it back, so round trips hold.
    """

    name = "gpt2"
    vocab_size = GPT2_VOCAB_SIZE
    eot_id = GPT2_EOT_ID

    def __init__(self, bpe_dir: str | os.PathLike[str] | None = None):
        if bpe_dir is None and os.environ.get(GPT2_BPE_ENV):
            bpe_dir = os.environ[GPT2_BPE_ENV]
        self.bpe_dir: Path | None = Path(bpe_dir).expanduser() if bpe_dir is not None else None
        if self.bpe_dir is not None:
            self._enc, self._bpe_hash, self._enc_hash = _load_gpt2_from_dir(self.bpe_dir)
        else:
            tiktoken = _import_tiktoken()
            try:
                self._enc = tiktoken.get_encoding("gpt2")
            except Exception as exc:  # requests/urllib/ssl errors: network-specific types vary
                raise TokenizerLoadError(
                    f"could not download the GPT-2 BPE files (offline? {type(exc).__name__}); "
                    f"pass --bpe-dir DIR (in Python: tokenizer=get_tokenizer('gpt2', bpe_dir=DIR)) or set "
                    f"{GPT2_BPE_ENV}=DIR, where DIR contains GPT-2's encoder.json and vocab.bpe"
                ) from None
            # tiktoken verified the downloaded files against these hashes.
            self._bpe_hash, self._enc_hash = GPT2_VOCAB_BPE_SHA256, GPT2_ENCODER_JSON_SHA256
        if self._enc.n_vocab != GPT2_VOCAB_SIZE:  # pragma: no cover - guards a foreign encoding
            raise ValueError(f"GPT-2 encoding must have {GPT2_VOCAB_SIZE} ids, got {self._enc.n_vocab}")

    @property
    def is_official(self) -> bool:
        """True when the BPE files are byte-identical to OpenAI's published GPT-2 files."""
        return (self._bpe_hash, self._enc_hash) == (GPT2_VOCAB_BPE_SHA256, GPT2_ENCODER_JSON_SHA256)

    @property
    def encoding(self) -> Any:
        """The underlying ``tiktoken.Encoding``."""
        return self._enc

    # tiktoken would encode a lone surrogate as U+FFFD, so decode(encode(text)) != text: refuse it,
    # as the byte tokenizer does.
    def encode(self, text: str) -> list[int]:
        _reject_surrogates(_check_text(text))
        return self._enc.encode(text, allowed_special="all")

    def encode_array(self, text: str) -> np.ndarray:
        _reject_surrogates(_check_text(text))
        return self._enc.encode_to_numpy(text, allowed_special="all")

    def decode(self, ids: Sequence[int] | Tensor | np.ndarray) -> str:
        return self._enc.decode(_ids_to_list(ids, self.vocab_size), errors="replace")

    def decode_bytes(self, ids: Sequence[int] | Tensor | np.ndarray) -> bytes:
        return self._enc.decode_bytes(_ids_to_list(ids, self.vocab_size))

    def split_point(self, text: str) -> int:
        for pattern in _GPT2_CUTS:
            # Look at a growing tail: the last cut is almost always near the end of the text.
            window = 1 << 12
            while True:
                start = max(0, len(text) - window)
                if ends := [m.end() for m in pattern.finditer(text, start)]:
                    return ends[-1]
                if start == 0:
                    break
                window *= 16
        return 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": "gpt2",
            "bpe_dir": str(self.bpe_dir.resolve()) if self.bpe_dir is not None else None,
            "vocab_bpe_sha256": self._bpe_hash,
            "encoder_json_sha256": self._enc_hash,
        }

    def fingerprint(self) -> str:
        # Where the files live does not change the encoding; their content does.
        return _json_fingerprint({"name": "gpt2", "vocab_bpe": self._bpe_hash, "encoder_json": self._enc_hash})

    def __repr__(self) -> str:
        where = f"bpe_dir={str(self.bpe_dir)!r}" if self.bpe_dir is not None else "tiktoken"
        return f"GPT2Tokenizer({where})"


# -- Hugging Face tokenizer.json ---------------------------------------------------------------
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizer.json`` (Llama, Mistral, Qwen, ...) through the ``tokenizers`` library.

    Args:
        path: the ``tokenizer.json`` file, or a model directory holding it, or a GGUF file (its
            stored tokenizer, byte-level BPE or SentencePiece, built by
            :func:`attnlab.gguf_vocab.gguf_tokenizer`).
        reader: for a GGUF file, its open ``gguf.GGUFReader`` if there is one (the header is then
            not parsed again).
        eot_id / bos_id: the end-of-text and beginning-of-text ids; default: as the model's files
            say (:meth:`_read_special_ids`).

    ``encode`` turns text into ids and nothing else (no beginning-of-text token, so that chunks of a
    corpus encode independently); a prompt for a model trained with one starts with ``bos_id``
    (:meth:`encode_prompt`). ``decode`` keeps special tokens as text, so nothing is lost.
    """

    name = "hf"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        eot_id: int | None = None,
        bos_id: int | None = None,
        reader: Any = None,
        find_special: bool = True,
    ) -> None:
        try:
            import tokenizers
        except ImportError:
            raise TokenizerLoadError(
                "the hf tokenizer needs the 'tokenizers' package: pip install 'attnlab[hf]'"
            ) from None
        p = Path(path).expanduser()
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(f"{p} not found: the hf tokenizer reads a tokenizer.json or a GGUF file")
        if is_gguf_file(p):
            self._tok, found_eot, found_bos = gguf_tokenizer(p if reader is None else reader)
            # the tokenizer's own serialization: what it does, not the model weights around it
            self._json_bytes = self._tok.to_str().encode()
        else:
            with open_regular(p, "tokenizer.json") as f:
                self._json_bytes = f.read()  # kept: a checkpoint stores a copy (save_json), not a reference
            try:
                self._tok = tokenizers.Tokenizer.from_str(self._json_bytes.decode("utf-8"))
            except Exception as exc:  # the library raises a bare Exception for malformed files
                raise ValueError(f"{p} is not a Hugging Face tokenizer.json ({exc})") from None
        self.sha256 = hashlib.sha256(self._json_bytes).hexdigest()
        self.path = p.resolve()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # Byte-fallback tokens (<0x41>): a run of them decodes as a whole (invalid UTF-8 turns every
        # byte of the run into U+FFFD), so streamed text must wait for the run to end.
        self.byte_tokens = frozenset(i for t, i in self._tok.get_vocab().items() if _BYTE_TOKEN.fullmatch(t))
        if not is_gguf_file(p):
            found_eot, found_bos = self._read_special_ids(p.parent) if find_special else (None, None)
        self.eot_id = found_eot if eot_id is None else self._check_id("eot_id", eot_id)
        self.bos_id = found_bos if bos_id is None else self._check_id("bos_id", bos_id)

    def _check_id(self, name: str, value: object) -> int:
        if not is_int(value) or not 0 <= value < self.vocab_size:
            raise ValueError(f"{name} must be a token id in [0, {self.vocab_size}), got {value!r}")
        return int(value)

    def _read_special_ids(self, directory: Path) -> tuple[int | None, int | None]:
        """(end-of-text id, beginning-of-text id) as the model's files say."""
        # BOS: what the tokenizer's post-processor puts before a text (what Hugging Face's
        # tokenizer(prompt) adds), e.g. Llama's <s> or <|begin_of_text|>.
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        bos = full[0] if len(full) == len(plain) + 1 and full[1:] == plain else None
        # EOS: tokenizer_config.json's eos_token, else config.json's / generation_config.json's eos_token_id.
        text = self._json(directory / "tokenizer_config.json").get("eos_token")
        text = text.get("content") if isinstance(text, dict) else text  # a string or an AddedToken dict
        eot = self._tok.token_to_id(text) if isinstance(text, str) else None
        for name in ("generation_config.json", "config.json"):
            ids = self._json(directory / name).get("eos_token_id")
            ids = ids[0] if isinstance(ids, list) and ids else ids
            if eot is None and is_int(ids) and 0 <= ids < self.vocab_size:
                eot = int(ids)
        return eot, bos

    @staticmethod
    def _json(path: Path) -> dict[str, Any]:
        with contextlib.suppress(OSError, ValueError):  # (read_json: a FIFO or /dev/zero is refused, not read)
            data = read_json(path, path.name)
            return data if isinstance(data, dict) else {}
        return {}

    def encode(self, text: str) -> list[int]:
        _reject_surrogates(_check_text(text))
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self.encode(text), dtype=np.int64)

    def encode_prompt(self, text: str) -> list[int]:
        """``encode(text)`` after ``bos_id`` when the model expects one (as Hugging Face's tokenizer does)."""
        return bos_prefix(self) + self.encode(text)

    def decode(self, ids: Sequence[int] | Tensor | np.ndarray) -> str:
        return self._tok.decode(_ids_to_list(ids, self.vocab_size), skip_special_tokens=False)

    def decode_bytes(self, ids: Sequence[int] | Tensor | np.ndarray) -> bytes:
        """The bytes ``ids`` stand for, also where a token holds part of a character (which ``decode``
        shows as U+FFFD): a byte-level BPE vocabulary's tokens are bytes written in GPT-2's alphabet, a
        SentencePiece byte-fallback token (``<0xE6>``) is its byte; else the decoded text's UTF-8."""
        ids = _ids_to_list(ids, self.vocab_size)
        tokens = [self._tok.id_to_token(i) or "" for i in ids]
        if type(self._tok.decoder).__name__ == "ByteLevel":
            byte_of = _byte_of_char()
            if all(c in byte_of for t in tokens for c in t):
                return bytes(byte_of[c] for t in tokens for c in t)
        if len(tokens) == 1 and (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", tokens[0])):
            return bytes([int(m[1], 16)])
        return super().decode_bytes(ids)

    def special_tokens(self) -> dict[int, str]:
        """The special tokens' ids and texts (control tokens, matched whole in any text)."""
        return {i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def split_point(self, text: str) -> int:
        # GPT-2's cuts (after a non-space, before whitespace), each confirmed by encoding the text
        # around it both ways: a tokenizer.json may normalize, or put "▁" before, the start of every
        # text, so what is safe depends on the file. 0 when no near cut checks out.
        # The text after a cut is checked up to past the whitespace that follows it: Llama 3's and
        # Qwen2's `\s*[\r\n]+` reaches across a run of spaces of any length to the next newline.
        tail = max(0, len(text) - (1 << 16))
        for pattern in _GPT2_CUTS:
            cuts = [m.end() for m in pattern.finditer(text, tail) if m.end() <= len(text) - 32]
            for cut in reversed(cuts[-3:]):
                after = _NON_SPACE.search(text, cut)
                if after is None:  # (only whitespace follows: what comes next decides)
                    continue
                a, b = max(0, cut - 256), min(len(text), max(cut + 256, after.start() + 32))
                if self.encode(text[a:cut]) + self.encode(text[cut:b]) == self.encode(text[a:b]):
                    return cut
        return 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": "hf",
            "path": str(self.path),
            "sha256": self.sha256,
            "eot_id": self.eot_id,
            "bos_id": self.bos_id,
        }

    def save_json(self, directory: str | os.PathLike[str], name: str = HF_TOKENIZER_FILE) -> dict[str, Any]:
        """Write this tokenizer's JSON (the ``tokenizer.json`` it was read from, byte for byte, or the
        ``tokenizers`` serialization of a GGUF's tokenizer) atomically as ``directory/name``; return
        :meth:`to_dict` with ``path`` that name, relative to ``directory`` (so that a checkpoint holding
        both does not depend on where the base model was)."""
        atomic_write_bytes(Path(directory) / name, self._json_bytes)
        return self.to_dict() | {"path": name}

    def fingerprint(self) -> str:
        return _json_fingerprint({"name": "hf", "sha256": self.sha256})

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


# -- Factory and (de)serialisation -------------------------------------------------------------
def get_tokenizer(
    name: str,
    *,
    text: str | None = None,
    bpe_dir: str | os.PathLike[str] | None = None,
    path: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """Tokenizer by name: ``"byte"``, ``"char"``, ``"gpt2"`` or ``"hf"``.

    ``char`` builds its vocabulary from ``text`` or from the UTF-8 file ``path``; ``gpt2`` reads
    ``bpe_dir`` (see :class:`GPT2Tokenizer`), ``hf`` the ``tokenizer.json`` ``path`` (or its directory).
    """
    if not isinstance(name, str) or name not in TOKENIZER_NAMES:
        raise ValueError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZER_NAMES)}")
    if name == "byte":
        return ByteTokenizer()
    if name == "char":
        if text is not None:
            return CharTokenizer.from_text(text)
        if path is not None:
            return CharTokenizer.from_file(path)
        raise ValueError("the char tokenizer builds its vocabulary from the training text: pass text= or path=")
    if name == "hf":
        if path is None:
            raise ValueError(
                "the hf tokenizer reads a Hugging Face tokenizer.json: pass path= (the file or its directory)"
            )
        return HFTokenizer(path)
    return GPT2Tokenizer(bpe_dir=bpe_dir)


class StreamDecoder:
    """Turns tokens into text increments that join to exactly ``tokenizer.decode(all tokens)``.

    A multi-byte character may arrive as several tokens, whose first part decoded alone would print
    as U+FFFD: so the tokens' bytes go through an incremental UTF-8 decoder, which holds back an
    incomplete character until its last byte comes (invalid bytes are replaced as in one decode)::

        dec = StreamDecoder(tokenizer)
        for tok in model.stream(idx, 100):
            print(dec.push(int(tok[0])), end="", flush=True)
        print(dec.flush())
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []  # (hf) the tokens so far, and how much of their text was returned
        self._done = 0

    def push(self, token: int) -> str:
        """Add one token id; return the text that is now complete ('' while a character is split)."""
        if isinstance(self.tok, CharTokenizer):  # one whole character per token (lone surrogates too)
            return self.tok.decode([token])
        if isinstance(self.tok, HFTokenizer):
            # A tokenizer.json's decoder may join tokens (strip the first space, merge byte
            # fallbacks): decode all tokens and return what is new, unless it ends mid-character.
            self._ids.append(token)
            if token in self.tok.byte_tokens:
                return ""  # a byte run is decoded whole: wait for its end
            return self._new_text(final=False)
        return self._utf8.decode(self.tok.decode_bytes([token]))

    def flush(self) -> str:
        """The text of the bytes still held back (at the end of a stream)."""
        if isinstance(self.tok, HFTokenizer):
            return self._new_text(final=True)
        return self._utf8.decode(b"", final=True)

    def _new_text(self, final: bool) -> str:
        """(hf) The text of all tokens so far past what was returned; '' while it ends mid-character."""
        text = self.tok.decode(self._ids)
        if not final and text.endswith("\ufffd"):
            return ""
        new, self._done = text[self._done :], len(text)
        return new


def tokenizer_to_dict(tokenizer: Tokenizer, directory: str | os.PathLike[str]) -> dict[str, Any]:
    """``tokenizer.to_dict()`` for a description stored in ``directory``: an :class:`HFTokenizer`
    writes its JSON there (:meth:`HFTokenizer.save_json`) and is described by that file's name, so
    the directory does not depend on where the base model was; read back with
    ``tokenizer_from_dict(d, base_dir=directory)``."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.save_json(directory)
    return tokenizer.to_dict()


def tokenizer_from_dict(
    d: dict[str, Any], *, bpe_dir: str | os.PathLike[str] | None = None, base_dir: str | os.PathLike[str] | None = None
) -> Tokenizer:
    """Rebuild a tokenizer from :meth:`Tokenizer.to_dict` output (e.g. read from a checkpoint).

    An ``hf`` tokenizer's relative ``path`` (:func:`tokenizer_to_dict`) is relative to ``base_dir``.
    ``gpt2``'s BPE files are looked up in ``bpe_dir``, else the recorded directory, else as
    :class:`GPT2Tokenizer` does; the files found must have the recorded content (by hash).
    """
    if not isinstance(d, dict) or "name" not in d:
        raise ValueError(f"tokenizer description must be a dict with a 'name' key, got {d!r:.80}")
    name = d["name"]
    if name == "byte":
        return ByteTokenizer()
    if name == "char":
        chars = d.get("chars")
        if not isinstance(chars, str) or not chars:
            raise ValueError("char tokenizer description needs a non-empty 'chars' string")
        return CharTokenizer(chars)
    if name == "gpt2":
        recorded = d.get("bpe_dir")
        if bpe_dir is None and recorded and Path(recorded).is_dir():
            bpe_dir = recorded
        try:
            tok = GPT2Tokenizer(bpe_dir=bpe_dir)
        except TokenizerLoadError as exc:
            if bpe_dir is None and recorded:  # say why the files were not where training found them
                raise TokenizerLoadError(
                    f"the BPE directory recorded at training, {recorded}, is gone; {exc}"
                ) from None
            raise
        want = (d.get("vocab_bpe_sha256"), d.get("encoder_json_sha256"))
        have = (tok._bpe_hash, tok._enc_hash)
        if None not in want and want != have:
            raise ValueError(f"the GPT-2 BPE files found ({tok!r}) differ from the ones this tokenizer was saved with")
        return tok
    if name == "hf":
        path = d.get("path")
        if not isinstance(path, str):
            raise ValueError("hf tokenizer description needs the 'path' of its tokenizer.json")
        relative = not Path(path).expanduser().is_absolute()
        if relative:  # a copy inside the checkpoint (HFTokenizer.save_json): its own special ids are recorded
            if base_dir is None:
                raise ValueError(f"hf tokenizer path {path!r} is relative: the directory it is relative to is needed")
            if ".." in Path(path).parts:
                raise ValueError(f"hf tokenizer path {path!r} must name a file inside {base_dir}")
            path = str(Path(base_dir) / path)
        tok = HFTokenizer(path, eot_id=d.get("eot_id"), bos_id=d.get("bos_id"), find_special=not relative)
        if d.get("sha256") not in (None, tok.sha256):
            raise ValueError(f"{path} differs from the tokenizer.json this tokenizer was saved with (SHA-256)")
        return tok
    raise ValueError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZER_NAMES)}")


def as_tokenizer(tokenizer: Tokenizer | str | Any | None, default: str = "byte") -> Any:
    """A :class:`Tokenizer`, a tokenizer name, ``None`` (-> ``default``) or any object with an
    ``encode(text)`` method (e.g. a ``tiktoken.Encoding``) -> an object with ``encode``."""
    if tokenizer is None:
        tokenizer = default
    if isinstance(tokenizer, str):
        if tokenizer == "char":
            raise ValueError("pass a CharTokenizer instance (it needs the text to build its vocabulary)")
        return get_tokenizer(tokenizer)
    if not callable(getattr(tokenizer, "encode", None)):
        raise TypeError(
            f"tokenizer must be a Tokenizer, a name or have an encode() method, got {type(tokenizer).__name__}"
        )
    return tokenizer


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's alphabet read back: each printable character of a byte-level token -> its byte."""
    return {c: b for b, c in bytes_to_unicode().items()}


def bos_prefix(tokenizer: object) -> list[int]:
    """``[bos_id]`` where the model expects every prompt to start with it, else ``[]``: a Hugging Face or
    GGUF tokenizer's ``bos_id``, set from the model's files (``add_bos_token``: Llama 2, Mistral, Gemma's
    files). A model reads its prompts after it, so every command that feeds a prompt adds it."""
    bos = getattr(tokenizer, "bos_id", None)
    return [] if bos is None else [int(bos)]


def prompt_tokens(tokenizer: object, text: str) -> list[int]:
    """The ids a model reads for the prompt ``text``: :func:`bos_prefix` then the text's ids (none if
    the text has none: a BOS alone is no prompt)."""
    ids = [int(i) for i in tokenizer.encode(text)]
    return bos_prefix(tokenizer) + ids if ids else []


def encode_to_tensor(tokenizer: Tokenizer, text: str) -> Tensor:
    """``tokenizer.encode(text)`` as a 1-D int64 tensor, without a Python list for our tokenizers."""
    if isinstance(tokenizer, Tokenizer):
        return torch.from_numpy(np.asarray(tokenizer.encode_array(text), dtype=np.int64))
    return torch.tensor(tokenizer.encode(text), dtype=torch.long)
