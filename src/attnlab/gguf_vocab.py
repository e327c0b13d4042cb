"""The tokenizer a GGUF file stores, rebuilt as a ``tokenizers.Tokenizer``.

A GGUF file carries no ``tokenizer.json``: llama.cpp's converter writes the tokenizer as metadata
under ``tokenizer.ggml.*``. Two kinds of vocabulary are read here, by ``tokenizer.ggml.model``:

* ``"gpt2"``, byte-level BPE (GPT-2, Llama 3, SmolLM, Qwen, OLMo 2): the tokens spelled in GPT-2's
  printable byte alphabet, the merges, and the name of llama.cpp's pre-tokenizer
  (``tokenizer.ggml.pre``), which says how the text is cut before the merges.
* ``"llama"``, SentencePiece BPE (Llama 1/2, TinyLlama, Mistral v0.1-v0.3, Gemma 1-3, Phi-3): the
  tokens with ``▁`` for a space, a score per token (the higher, the earlier its two halves merge),
  a type per token (normal, unknown, control, user-defined, unused, byte), the 256 byte tokens
  ``<0x00>`` ... ``<0xFF>`` that spell any text outside the vocabulary byte by byte (SentencePiece's
  byte fallback), and ``add_space_prefix``: whether a ``▁`` goes before the text.

A SentencePiece vocabulary is rebuilt the way llama.cpp tokenizes it: a space becomes ``▁``, a
``▁`` is put before the text and again after each special token (llama.cpp's ``is_prev_special``,
which is also what the ``tokenizer.json`` of Llama 2 and Mistral does, with a ``Prepend``
normalizer), the merges run in score order, and bytes outside the vocabulary fall back to the byte
tokens. Gemma's files differ in two ways, as transformers handles them: their scores do not give
the merge order (the file's order does), and their runs of spaces are stored with real spaces.

Metadata that disagrees with itself (scores or types of another length than the tokens, missing
byte tokens, special ids outside the vocabulary, a token listed twice) is one ``ValueError`` that
names the key, what it should hold and what it holds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from attnlab.checks import is_bool, is_int
from attnlab.files import GGUF_MAGIC, open_gguf

__all__ = ["gguf_tokenizer", "is_gguf_file"]

# llama.cpp's pre-tokenizers (tokenizer.ggml.pre) for byte-level BPE vocabularies, as `tokenizers`
# pre-tokenizers: the text is cut as the vocabulary's merges were learned. "smollm" cuts digits one
# by one before GPT-2's regex, as SmolLM's own tokenizer.json does (llama.cpp's llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2/2.5/3: digits one by one
_GGUF_PRE = {
    "gpt2": "gpt2",
    "gpt-2": "gpt2",  # GPT-2's own name in llama.cpp
    "olmo": "gpt2",  # GPT-NeoX's vocabulary (Pythia, OLMo 1): GPT-2's cut
    "smollm": "digits+gpt2",
    "llama-bpe": _LLAMA3_SPLIT,
    "llama3": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,  # cl100k (OLMo 2): Llama 3's cut
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
# Architectures whose SentencePiece files are laid out as Gemma's (merge order = file order, runs of
# spaces stored as spaces, no space before the text unless the file says so).
_GEMMA = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})
# The special ids a file may name; each must be a token of the vocabulary.
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id", "eom_token_id")
_KEYS = ("pre", "tokens", "token_type", "merges", "scores", "add_space_prefix", "add_bos_token", "add_eos_token")
_KEYS += _SPECIAL_IDS
_SPACE = "▁"  # U+2581, SentencePiece's visible space


def is_gguf_file(p: Path) -> bool:
    """Whether ``p`` is a GGUF file: by its suffix, else by its first four bytes."""
    if p.suffix.lower() == ".gguf":
        return True
    try:
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_tokenizer(source: str | os.PathLike[str] | Any) -> tuple[Any, int | None, int | None]:
    """``(tokenizers.Tokenizer, eot_id, bos_id)`` of the tokenizer a GGUF file stores (``source``:
    its path, or a ``gguf.GGUFReader`` open on it).

    * Byte-level BPE (``tokenizer.ggml.model == "gpt2"``): the vocabulary and merges, llama.cpp's
      pre-tokenizer (``tokenizer.ggml.pre``), as transformers builds it.
    * SentencePiece BPE (``"llama"``): the tokens, merges in score order (Gemma: in the file's
      order), byte fallback, a ``▁`` before the text and after each special token when
      ``tokenizer.ggml.add_space_prefix`` says so (default: yes, but not for Gemma), as llama.cpp
      tokenizes. A post-processor adds BOS/EOS as ``add_bos_token``/``add_eos_token`` say (for
      ``encode(text, add_special_tokens=True)``; attnlab's own encode adds nothing).

    In both, the tokens marked control (``<|im_end|>``, ``<s>``) are special tokens and those marked
    user-defined are added tokens: either is matched whole in the text. ``eot_id`` is
    ``tokenizer.ggml.eos_token_id``; ``bos_id`` is ``tokenizer.ggml.bos_token_id`` when
    ``add_bos_token`` says prompts start with it (a SentencePiece file that does not say: yes, as
    llama.cpp assumes). Metadata that does not read or disagrees with itself is a ValueError."""
    reader = open_gguf(source) if isinstance(source, (str, os.PathLike)) else source
    p = Path(getattr(reader, "path", "GGUF file"))
    try:
        fields = reader.fields
        value = lambda key, default=None: fields[key].contents() if key in fields else default
        kind = value("tokenizer.ggml.model")
        meta = {key: value(f"tokenizer.ggml.{key}") for key in _KEYS}
        meta["architecture"] = value("general.architecture")
    except (ValueError, IndexError, KeyError, TypeError, UnicodeDecodeError, OverflowError) as e:
        raise ValueError(f"{p}: its tokenizer metadata does not read ({type(e).__name__}: {e})") from None
    tokens = meta["tokens"]
    if kind is None or tokens is None:
        raise ValueError(f"{p} stores no tokenizer (no tokenizer.ggml.model / tokenizer.ggml.tokens)")
    if kind not in ("gpt2", "llama"):
        raise ValueError(
            f"{p}: GGUF tokenizers of type {kind!r} are not supported yet "
            "(byte-level BPE, 'gpt2', and SentencePiece BPE, 'llama', are)"
        )
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"{p}: tokenizer.ggml.tokens must be a list of strings")
    types = meta["token_type"]
    if types is not None and _disagrees(types, len(tokens), "iu"):
        got = _what(types, len(tokens), "integers")
        raise ValueError(
            f"{p}: tokenizer.ggml.token_type must hold {len(tokens)} token types (one per token), got {got}"
        )
    for key in ("add_bos_token", "add_eos_token", "add_space_prefix"):
        if meta[key] is not None and not is_bool(meta[key]):
            raise ValueError(f"{p}: tokenizer.ggml.{key} must be true or false, got {meta[key]!r}")
    if kind == "gpt2":
        return _byte_level(p, tokens, types or [1] * len(tokens), meta)
    return _sentencepiece(p, tokens, types or [1] * len(tokens), meta)


def _disagrees(values: Any, n: int, kinds: str) -> bool:
    """Whether ``values`` (a list read from the metadata) is not ``n`` numbers of the NumPy kinds
    ``kinds`` ("iu": integers, "iuf": numbers), NaN included: checked as one array rather than item
    by item (a vocabulary has up to 262,144 entries)."""
    if not isinstance(values, list) or len(values) != n:
        return True
    try:
        array = np.asarray(values)
    except (ValueError, TypeError):
        return True
    return array.dtype.kind not in kinds or (array.dtype.kind == "f" and bool(np.isnan(array).any()))


def _what(values: Any, n: int, kind: str) -> str:
    """What a list that :func:`_disagrees` holds, for the message."""
    if not isinstance(values, list):
        return repr(values)[:40]
    return f"{len(values)}" if len(values) != n else f"{n}, not all of them {kind}"


def _check_ids(p: Path, meta: dict[str, Any], keys: tuple[str, ...], n: int) -> None:
    for k in keys:
        if meta[k] is not None and not (is_int(meta[k]) and 0 <= meta[k] < n):
            raise ValueError(f"{p}: tokenizer.ggml.{k} must be a token id in [0, {n}), got {meta[k]!r}")


# ----------------------------------------------------------------------------------------------
# Byte-level BPE ("gpt2")
# ----------------------------------------------------------------------------------------------
def _byte_level(p: Path, tokens: list[str], types: list[int], meta: dict[str, Any]) -> tuple[Any, Any, Any]:
    import tokenizers
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

    pre, merges = "gpt2" if meta["pre"] is None else meta["pre"], meta["merges"]
    if not isinstance(pre, str) or pre not in _GGUF_PRE:
        raise ValueError(f"{p}: llama.cpp pre-tokenizer {pre!r} is not supported yet ({', '.join(_GGUF_PRE)} are)")
    if not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1 for m in merges):
        raise ValueError(f"{p}: tokenizer.ggml.merges must be a list of 'a b' pairs")
    _check_ids(p, meta, _SPECIAL_IDS, len(tokens))
    # A byte-level vocabulary spells bytes with GPT-2's printable alphabet; a token with any other
    # character is respelled byte by byte (what transformers does too). Control and user-defined
    # tokens are the exception: llama.cpp's converter writes them as raw text ("<｜User｜>", "  "),
    # matched whole before the byte-level split, so they keep their text and their id.
    alphabet = bytes_to_unicode()
    allowed = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, (t, k) in enumerate(zip(tokens, types, strict=True)):
        raw = k in (_CONTROL, _USER_DEFINED) or set(t) <= allowed
        vocab.setdefault(t if raw else "".join(alphabet[b] for b in t.encode("utf-8")), i)
    try:
        tok = tokenizers.Tokenizer(
            models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], fuse_unk=False, dropout=None)
        )
    except Exception as exc:  # the library raises a bare Exception for merges of unknown tokens
        raise ValueError(f"{p}: its tokenizer does not build ({exc})") from None
    split = _GGUF_PRE[pre]
    if split == "gpt2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    elif split == "digits+gpt2":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    control = [t for t, k in zip(tokens, types, strict=True) if k == _CONTROL]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED])
    bos = meta["bos_token_id"] if meta["add_bos_token"] else None
    return tok, meta["eos_token_id"], bos


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


# ----------------------------------------------------------------------------------------------
# SentencePiece BPE ("llama")
# ----------------------------------------------------------------------------------------------
def _sentencepiece(p: Path, tokens: list[str], types: list[int], meta: dict[str, Any]) -> tuple[Any, Any, Any]:
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    n, gemma = len(tokens), meta["architecture"] in _GEMMA
    scores = meta["scores"]
    if scores is None and not gemma:
        raise ValueError(f"{p}: tokenizer.ggml.scores is missing: a SentencePiece vocabulary merges in score order")
    if scores is not None and _disagrees(scores, n, "iuf"):
        got = _what(scores, n, "numbers (NaN is not)")
        raise ValueError(f"{p}: tokenizer.ggml.scores must hold {n} numbers (one score per token), got {got}")
    _check_ids(p, meta, _SPECIAL_IDS, n)
    # Text outside the vocabulary is spelled with the byte tokens (llama.cpp looks them up by name):
    # without all 256, some text could not be encoded at all.
    missing = sorted(set(_BYTE_NAMES) - set(tokens))
    if missing:
        raise ValueError(
            f"{p}: tokenizer.ggml.tokens must hold the 256 byte tokens <0x00> ... <0xFF> of a SentencePiece "
            f"vocabulary (its spelling of text outside the vocabulary), got {256 - len(missing)}: "
            f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} missing"
        )
    if gemma:
        # Gemma's converter stores its runs of spaces with real spaces, where the text's spaces are
        # "▁" by the time they are merged; its scores are not its merge order, its file order is.
        spelled = [_SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        ranks: list[float] = [-float(i) for i in range(n)]
    else:
        spelled, ranks = tokens, scores
    vocab: dict[str, int] = {}
    for i, t in enumerate(spelled):
        if vocab.setdefault(t, i) != i:
            raise ValueError(f"{p}: tokenizer.ggml.tokens must list each token once, got {tokens[i]!r} twice")
    unk = meta["unknown_token_id"]
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_by_score(spelled, ranks, vocab),
            unk_token=None if unk is None else spelled[unk],
            fuse_unk=True,
            byte_fallback=True,
            dropout=None,
        )
    )
    prefix = meta["add_space_prefix"] if meta["add_space_prefix"] is not None else not gemma
    # A normalizer (not a pre-tokenizer) puts the "▁" first: it runs on each stretch of text between
    # special tokens, so a "▁" also follows each special token, as in llama.cpp.
    norm = [normalizers.Prepend(_SPACE)] if prefix else []
    tok.normalizer = normalizers.Sequence([*norm, normalizers.Replace(" ", _SPACE)])
    # decoding undoes it: "▁" back to spaces, byte tokens back to bytes, the first space dropped
    strip = [decoders.Strip(" ", 1, 0)] if prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    # Special tokens: the control and unknown ones, and those the metadata names (BOS, EOS, ...).
    named = {meta[k] for k in _SPECIAL_IDS if meta[k] is not None}
    special = {tokens[i] for i, k in enumerate(types) if k in (_UNKNOWN, _CONTROL) or i in named}
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in tokens if t in special])
    # User-defined tokens (Phi-3's <|placeholder1|>, Gemma's "\n\n") are matched whole, as llama.cpp
    # does; Gemma's respelled runs of spaces are reached by merges instead.
    user = [t for t, s, k in zip(tokens, spelled, types, strict=True) if k == _USER_DEFINED and s == t]
    tok.add_tokens([AddedToken(t, normalized=False) for t in user if t not in special])
    bos, eos = meta["bos_token_id"], meta["eos_token_id"]
    said_bos = meta["add_bos_token"]
    add_bos = bos is not None and (said_bos is None or bool(said_bos))  # unsaid: yes, as llama.cpp assumes
    add_eos = eos is not None and bool(meta["add_eos_token"])
    if add_bos or add_eos:
        # What encode(text, add_special_tokens=True) adds (transformers' tokenizer(text) does the same).
        # The template names the tokens by identifiers of its own: it splits a name at its colons, and
        # a file's "<s:bos>" would not parse.
        first = lambda segment: [f"BOS:{segment}"] if add_bos else []
        last = lambda segment: [f"EOS:{segment}"] if add_eos else []
        named_ids = (("BOS", bos if add_bos else None), ("EOS", eos if add_eos else None))
        tok.post_processor = processors.TemplateProcessing(
            single=[*first(0), "$A:0", *last(0)],
            pair=[*first(0), "$A:0", *last(0), *first(1), "$B:1", *last(1)],
            special_tokens=[{"id": n, "ids": [i], "tokens": [tokens[i]]} for n, i in named_ids if i is not None],
        )
    return tok, eos, bos if add_bos else None


_BYTE_NAMES = tuple(f"<0x{b:02X}>" for b in range(256))


def _merges_by_score(tokens: list[str], scores: list[float], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: each token that splits into two tokens of
    the vocabulary is a merge of them, ranked by the token's score (higher first), then by the
    longer left piece, then the longer right one (the order transformers gives them, so that the
    rare ties break alike); splits of one token in the order of their pieces' ids."""
    merges: list[tuple[str, str, float]] = []
    for token, score in zip(tokens, scores, strict=True):
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        pairs.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges += [(left, right, score) for left, right in pairs]
    merges.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))  # stable: ties keep the file's order
    return [(left, right) for left, right, _ in merges]
