"""Chat fine-tuning data: conversations rendered with the model's chat template, the loss on the
assistant's tokens only.

A ``.jsonl`` file holds one conversation per line::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}

Each conversation is rendered with the model's own chat template (:class:`attnlab.formats.chat.ChatTemplate`,
the format it was instruction-tuned on). Which tokens are the assistant's is read off the template
itself, prefix by prefix: for the assistant message ``i``, ``render(messages[:i], add_generation_prompt=True)``
is everything up to where the model starts to answer, and ``render(messages[:i + 1])`` ends where its
turn ends; what lies between (the answer and its end-of-turn marker, so the model learns to stop; not
the separator the template writes after that marker, as transformers' assistant mask) is trained on,
the rest is context. A conversation that opens with the assistant's answer (where the render of no
messages differs, e.g. SmolLM2's default system prompt) finds the answer by its content instead.
The whole render is then tokenized at once, as transformers' ``apply_chat_template`` does, and a
token holding text of an answer is the assistant's. The conversations are packed one after another
into one token stream, with a mask beside it; :class:`MaskedWindowBatches` draws training windows from it as
:class:`attnlab.data.RandomWindowBatches` does, with ``-100`` (ignored by the loss) as the target of
every token that is not the assistant's, and only windows holding at least one assistant token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnlab.data import RandomWindowBatches, check_text_file
from attnlab.files import first_line, read_json
from attnlab.formats.chat import TURN_ENDS, ChatTemplate, read_chat_template
from attnlab.tokenizers import Tokenizer

__all__ = [
    "ROLES",
    "MaskedWindowBatches",
    "encode_conversation",
    "encode_conversations",
    "is_chat_file",
    "read_conversations",
    "template_from_hf_dir",
]

ROLES = ("system", "user", "assistant")
IGNORE = -100  # the loss's ignore_index


def is_chat_file(path: str | None) -> bool:
    return path is not None and str(path).lower().endswith(".jsonl")


def read_conversations(path: str | Path) -> list[list[dict[str, str]]]:
    """The conversations of a ``.jsonl`` file; ValueError naming the file and line for a line that is
    not JSON, has no ``messages`` list, or a message whose role is not one of :data:`ROLES` or whose
    content is not a string; and for a conversation without an assistant message (nothing to learn)."""
    p = check_text_file(path)
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"{where} is not a JSON object ({first_line(exc)[:80]})") from None
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            raise ValueError(f'{where} has no "messages" list; each line must be {{"messages": [...]}}')
        for i, m in enumerate(messages):
            role = m.get("role") if isinstance(m, dict) else None
            if role not in ROLES:
                raise ValueError(f"{where}: messages[{i}] has role {role!r}; expected one of {', '.join(ROLES)}")
            if not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: messages[{i}] has no string 'content'")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"{where} has no assistant message: nothing to train on")
        out.append([{"role": m["role"], "content": m["content"]} for m in messages])
    if not out:
        raise ValueError(f"{p} holds no conversations")
    return out


_CONTENT = "\ue000attnlab: the answer\ue001"  # (private-use characters: no conversation holds them)


def _segments(template: ChatTemplate, messages: Sequence[dict[str, str]]) -> list[tuple[str, bool]]:
    """The rendered conversation as (text, is the assistant's) pieces, found by rendering prefixes."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = template.render(messages[:i], add_generation_prompt=True)
        through = template.render(messages[: i + 1], add_generation_prompt=False)
        if not (before.startswith(done) and through.startswith(before)):
            before = _before_the_answer(template, messages, i, through)  # (a template that renders [] apart)
        if before is None or not before.startswith(done):
            raise ValueError(
                f"{template.name} does not render a conversation prefix by prefix (message {i}): "
                "the assistant's tokens cannot be told apart"
            )
        answer = through[len(before) :]
        answer = answer[: _turn_end(answer, m["content"], template)]  # (what the template writes after it: context)
        pieces += [(before[len(done) :], False), (answer, True)]
        done = before + answer
    full = template.render(messages, add_generation_prompt=False)
    if not full.startswith(done):
        raise ValueError(f"{template.name} does not render a conversation prefix by prefix")
    pieces.append((full[len(done) :], False))
    return [(text, mine) for text, mine in pieces if text]


def _before_the_answer(template: ChatTemplate, messages: Sequence[dict[str, str]], i: int, through: str) -> str | None:
    """The render up to where assistant message ``i``'s content starts, found by rendering a marker in
    its place: for a template whose render of no messages is not the start of one with messages (SmolLM2's
    adds its default system prompt only to a conversation), where message ``i`` opens it. None when the
    template does not write the content as it is."""
    marked = template.render([*messages[:i], {**messages[i], "content": _CONTENT}], add_generation_prompt=False)
    k = marked.find(_CONTENT)
    if k < 0 or marked[:k] != through[:k] or not through[k:].startswith(messages[i]["content"]):
        return None
    return through[:k]


def _turn_end(answer: str, content: str, template: ChatTemplate) -> int:
    """Where the assistant's turn ends in ``answer`` (its render, from where the answer starts): just
    after the first end-of-turn token (the template's ``eos_token`` or one of
    :data:`~attnlab.formats.chat.TURN_ENDS`) after its ``content``, else at its end. What follows (the
    separator before the next turn; Phi-3's templates end a conversation with an end-of-text too) is
    not the model's to learn."""
    start = answer.find(content) + len(content) if content and content in answer else 0
    ends = [k + len(t) for t in (template.eos_token, *TURN_ENDS) if t and (k := answer.find(t, start)) >= 0]
    return min(ends, default=len(answer))


def encode_conversation(
    template: ChatTemplate, tokenizer: Tokenizer, messages: Sequence[dict[str, str]]
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and, for each, whether it is the assistant's.

    The whole render is tokenized at once, as ``apply_chat_template`` does: pieces tokenized apart
    differ where one token spans two of them (a newline of the template's and the answer's) and where
    the tokenizer starts each text with a word boundary (SentencePiece's ``▁``). A token that holds
    text of the answer and of the context around it is the answer's."""
    segments = _segments(template, messages)
    full = "".join(text for text, _ in segments)
    ids = [int(i) for i in tokenizer.encode(full)]
    mask = [False] * len(ids)
    at = 0
    for text, mine in segments:
        start, at = at, at + len(text)
        if mine:
            first, stop = _tokens_within(tokenizer, full[:start], ids), _tokens_within(tokenizer, full[:at], ids, True)
            mask[first:stop] = [True] * max(0, stop - first)
    return ids, mask


def _tokens_within(tokenizer: Tokenizer, prefix: str, ids: list[int], straddling: bool = False) -> int:
    """How many of ``ids`` (the whole text's tokens) lie within ``prefix``, the text's start: those its
    own tokens share with them. A token there that holds text on both sides of the cut counts in
    with ``straddling``."""
    own = tokenizer.encode(prefix) if prefix else []
    n = next((k for k, (x, y) in enumerate(zip(own, ids, strict=False)) if int(x) != y), min(len(own), len(ids)))
    return min(n + 1, len(ids)) if straddling and n < len(own) else n


def encode_conversations(
    template: ChatTemplate, tokenizer: Tokenizer, conversations: Sequence[Sequence[dict[str, str]]]
) -> tuple[np.ndarray, np.ndarray]:
    """All conversations packed into one stream: int64 ids ``(N,)`` and a bool mask ``(N,)``."""
    ids: list[int] = []
    mask: list[bool] = []
    for k, messages in enumerate(conversations):
        try:
            a, b = encode_conversation(template, tokenizer, messages)
        except ValueError as e:
            raise ValueError(f"conversation {k + 1}: {e}") from None
        ids += a
        mask += b
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)


def template_from_hf_dir(directory: str | Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face model directory with the special tokens its
    ``tokenizer_config.json`` names, or None when it has none."""
    d = Path(directory)
    source = read_chat_template(d) if d.is_dir() else None
    if source is None:
        return None
    tokens: dict[str, str] = {}
    try:
        cfg = read_json(d / "tokenizer_config.json", "tokenizer config")
    except (OSError, ValueError):
        cfg = {}
    for key in ("bos_token", "eos_token"):
        value = cfg.get(key) if isinstance(cfg, dict) else None
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[key] = value
    return ChatTemplate(source, name=f"the chat template of {d}", **tokens)


def template_to_dict(template: ChatTemplate) -> dict[str, Any]:
    """What a checkpoint records, so a resumed run renders its data exactly as before."""
    return {"source": template.source, "bos_token": template.bos_token, "eos_token": template.eos_token}


def template_from_dict(d: Any) -> ChatTemplate:
    if not isinstance(d, dict) or not all(isinstance(d.get(k), str) for k in ("source", "bos_token", "eos_token")):
        raise ValueError("the checkpoint's chat_template entry must hold source, bos_token and eos_token strings")
    return ChatTemplate(
        d["source"], bos_token=d["bos_token"], eos_token=d["eos_token"], name="the checkpoint's chat template"
    )


class MaskedWindowBatches(RandomWindowBatches):
    """:class:`~attnlab.data.RandomWindowBatches` over a packed chat stream: the targets of tokens
    that are not the assistant's are ``-100``, and window starts are drawn (as a pure function of
    ``(seed, step)``) among the windows whose targets hold at least one assistant token."""

    def __init__(self, tokens: np.ndarray, mask: np.ndarray, **kwargs: Any) -> None:
        super().__init__(tokens, **kwargs)
        if len(mask) != len(self.tokens):
            raise ValueError(f"mask has {len(mask)} entries for {len(self.tokens)} tokens")
        self.mask = np.asarray(mask, dtype=bool)
        T = self.context_length
        counts = np.concatenate([[0], np.cumsum(self.mask)])  # counts[i] = assistant tokens before i
        starts = np.arange(len(self.tokens) - T)  # every window of T + 1 tokens
        self._starts = starts[counts[starts + T + 1] - counts[starts + 1] > 0]  # targets are [s+1, s+T]
        if len(self._starts) == 0:
            raise ValueError("no window of the chat data holds an assistant token; use a longer --context-length")

    def global_starts(self, step: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(step)])
        return self._starts[rng.integers(0, len(self._starts), size=self.global_batch_size, dtype=np.int64)]

    def _gather(self, starts: np.ndarray) -> tuple[Tensor, Tensor]:
        x, y = super()._gather(starts)  # (B, T) each
        keep = torch.from_numpy(self.mask[starts[:, None] + self._offsets[1:]])  # (B, T): the targets' mask
        return x, y.masked_fill(~keep, IGNORE)
