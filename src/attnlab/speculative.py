"""Speculative decoding, exact: guess several tokens cheaply, check them all with one forward.

A decoding step of a small model on a CPU costs about the same for one new token as for five (the
time goes to reading the weights and per-operation overhead). So feed the last chosen token and ``k``
guesses through the model in one forward over the KV cache, and keep the guesses up to the first one
greedy decoding would not have chosen, plus the model's own choice there: 1 to ``k + 1`` tokens a
round, exactly greedy decoding's (each kept guess is the argmax of the logits at its position).

The guesses (drafts) come from

* **prompt lookup** (``prompt_lookup=k``): the last few tokens (up to 3) are looked up earlier in the
  context, and the ``k`` tokens that followed their latest occurrence are the guess. It pays where
  the output repeats its input (summaries, quotes, edits, code); on free text it finds few guesses
  and costs more than plain decoding.
* **a draft model** (``draft_model=m``): a smaller :class:`attnlab.GPT` of the same vocabulary,
  decoding ``k`` tokens greedily on its own KV cache. It pays only when it is much faster than the
  model and often agrees with it (a model's own first layers, untrained as a draft, rarely do).

``python benchmarks/generate.py --model smollm2 --speculative K`` measures both against plain greedy
decoding and transformers' prompt lookup.

A rejected guess's keys and values were written into the caches: rolling back is setting the caches'
length back (the next forward overwrites the slots). Rounds without a guess run the fast decoding
step (:mod:`attnlab.decoding`). Greedy only: sampling (``temperature > 0``) would need the rejection
sampling of Leviathan et al. to keep the model's distribution, which this module does not do; it
refuses it with a ValueError. One prompt at a time (batch 1), and the whole text must fit the caches
without wrapping (``prompt + new <= context_length``, or the window of a model with one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from attnlab.checks import check_model_logits, positive_int
from attnlab.decoding import FastDecoder, dropout_off, greedy_tokens, supported
from attnlab.positions import rope_scaling_type

__all__ = ["SpeculativeStats", "check_speculative", "lookup_draft", "speculative_decode"]


@dataclass
class SpeculativeStats:
    """What a speculative generation did: ``rounds`` forwards of the model after the prefill,
    ``drafted`` tokens guessed, ``accepted`` of them kept (``accepted / drafted``: the acceptance rate)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0


def lookup_draft(seq: list[int], k: int, ngram: int = 3) -> list[int]:
    """Prompt lookup: the up to ``k`` tokens that followed the latest earlier occurrence of the last
    ``n`` tokens of ``seq`` (``n = ngram, ..., 1``: the longest tail found wins); ``[]`` if none.

    >>> lookup_draft([5, 6, 7, 8, 5, 6], 3)
    [7, 8, 5]
    """
    T = len(seq)
    for n in range(min(ngram, T - 1), 0, -1):
        tail = seq[-n:]
        for start in range(T - n - 1, -1, -1):  # latest first: the most recent context is the likeliest
            if seq[start : start + n] == tail:
                return seq[start + n : start + n + k]
    return []


def check_speculative(model: Any, idx: Tensor, max_new_tokens: int, k: object, draft_model: Any, **settings) -> None:
    """ValueError/TypeError unless speculative decoding of ``idx`` by ``max_new_tokens`` tokens with
    ``k`` guesses a round applies: greedy, batch 1, a cache, no padding, a text that fits the caches
    without wrapping, a draft model (if any) of the same vocabulary on the same device.
    ``settings``: the other arguments of :func:`attnlab.generation.generate` that matter here."""
    positive_int("the number of tokens drafted a round", k)
    if settings.get("temperature") != 0:
        raise ValueError(
            f"speculative decoding here is greedy only (exact output without rejection sampling): pass "
            f"temperature=0, got temperature={settings.get('temperature')!r}"
        )
    if idx.shape[0] != 1:
        raise ValueError(f"speculative decoding takes one prompt (batch 1), got a batch of {idx.shape[0]}")
    if settings.get("attention_mask") is not None or not settings.get("use_cache", True):
        raise ValueError("speculative decoding needs the KV cache (use_cache=True) and no attention_mask")
    if settings.get("compile"):
        raise ValueError("speculative decoding runs the fast step uncompiled: pass compile=False")
    cfg = model.config
    if rope_scaling_type(cfg.rope_scaling) == "longrope":
        turn = cfg.rope_scaling["original_max_position_embeddings"]
        if idx.shape[1] <= turn < idx.shape[1] + max_new_tokens:  # (plain decoding makes the cache again there)
            raise ValueError(
                f"speculative decoding cannot cross LongRoPE's turn to its long factors at {turn} tokens: the "
                f"prompt ({idx.shape[1]}) and the new tokens ({max_new_tokens}) must stay on one side of it"
            )
    limit, span = _span(cfg)
    if idx.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"speculative decoding needs the prompt and the new tokens within the model's {span} ({limit} "
            f"tokens), got {idx.shape[1]} + {max_new_tokens}"
        )
    if draft_model is not None:
        if not hasattr(draft_model, "decode_logits") or not hasattr(draft_model, "config"):
            raise TypeError(f"draft_model must be an attnlab GPT, got {type(draft_model).__name__}")
        if draft_model.config.vocab_size != cfg.vocab_size:
            raise ValueError(
                f"draft_model must share the model's vocabulary ({cfg.vocab_size} tokens), "
                f"got {draft_model.config.vocab_size}"
            )
        if draft_model.device != model.device:
            raise ValueError(f"draft_model is on {draft_model.device}, the model on {model.device}: move it")
        dlimit, dspan = _span(draft_model.config)
        if idx.shape[1] + max_new_tokens > dlimit:
            raise ValueError(
                f"the draft_model's {dspan} ({dlimit} tokens) must hold the prompt and the new tokens, got "
                f"{idx.shape[1]} + {max_new_tokens}"
            )


def _span(cfg: Any) -> tuple[int, str]:
    """How many tokens a text may span in a model of ``cfg`` with its caches never wrapping, and what
    bounds it: the attention window (a sliding window, or relative positions) or the context."""
    if cfg.window is not None or cfg.relative:
        return cfg.attention_window, "window"
    return cfg.context_length, "context"


class _Cached:
    """A model and its KV caches for one text: feed tokens, read logits, roll back."""

    def __init__(self, model: Any, n: int, fast: bool) -> None:
        self.model = model
        self.caches = model.new_kv_caches(1, n)
        self.decoder = FastDecoder(model, self.caches) if fast and supported(model, self.caches, None) else None

    @property
    def seen(self) -> int:
        return self.caches[0].seen

    def feed(self, ids: list[int], every: bool) -> Tensor:
        """Feed ``ids`` after the cached tokens: logits ``(n, V)`` of each (``every``) or ``(1, V)`` of the last."""
        if len(ids) == 1 and self.seen > 0 and self.decoder is not None and self.decoder.fits():
            return self.decoder.step(torch.tensor(ids, device=self.model.device))  # (1, V): the fast step
        x = torch.tensor([ids], device=self.model.device)  # (1, n)
        return self.model.decode_logits(x, None, self.caches, last_only=not every)[0]  # (n | 1, V)

    def rollback(self, n: int) -> None:
        """Forget the cached tokens after the first ``n``: the next feed overwrites their slots (attention
        reads the first ``length`` slots only, their positions included; the caches never wrap here)."""
        for c in self.caches:
            c.length = c.seen = n


def _argmax(logits: Tensor) -> list[int]:
    check_model_logits(logits)
    return greedy_tokens(logits).tolist()


def speculative_decode(
    model: Any,
    idx: Tensor,
    max_new_tokens: int,
    *,
    k: int,
    draft_model: Any = None,
    stop_ids: tuple[int, ...] = (),
    fast: bool = True,
    return_logits: bool = False,
) -> tuple[Tensor, Tensor | None, SpeculativeStats]:
    """Greedy continuation of ``idx (1, T)`` by up to ``max_new_tokens`` tokens, ``k`` guessed a round by
    prompt lookup or by ``draft_model``; the same tokens as greedy :func:`attnlab.generation.generate`.

    Arguments are checked by :func:`check_speculative` (through ``generate``). A token of ``stop_ids``
    ends the text (it is kept); ``fast``: single-token rounds on the fast decoding step. Returns
    ``(ids (1, T + new), logits (1, new, V) float32 (with return_logits) or None, stats)``.
    """
    T = idx.shape[1]
    seq = idx[0].tolist()
    n = T + max_new_tokens  # never more is fed: the last token chosen is not
    target = _Cached(model, n, fast)
    draft = None if draft_model is None else _Cached(draft_model, n, fast)
    new: list[int] = []
    rows: list[Tensor] = []
    stats = SpeculativeStats()
    stop = set(stop_ids)

    def emit(tokens: list[int], logits: Tensor) -> bool:
        """Take ``tokens`` (their logits ``(len, V)``) up to the limit or a stop id; True when done."""
        for i, t in enumerate(tokens):
            new.append(t)
            if return_logits:
                rows.append(logits[i].float())
            if t in stop or len(new) == max_new_tokens:
                return True
        return False

    with dropout_off(model, draft_model), torch.inference_mode():
        done = max_new_tokens == 0
        if not done:
            logits = target.feed(seq, every=False)  # (1, V): the prefill
            done = emit(_argmax(logits), logits)
        while not done:
            # Guesses: at most what is still wanted after the token the round chooses itself.
            room = max_new_tokens - len(new) - 1
            ctx = seq + new
            guess = _draft(draft, ctx, min(k, room)) if draft is not None else lookup_draft(ctx, min(k, room))
            before = target.seen  # the text but its last token is cached
            logits = target.feed(ctx[before:] + guess, every=True)[-(len(guess) + 1) :]  # (1 + g, V)
            choice = _argmax(logits)
            ok = 0
            while ok < len(guess) and guess[ok] == choice[ok]:
                ok += 1
            stats.rounds += 1
            stats.drafted += len(guess)
            stats.accepted += ok
            target.rollback(len(ctx) + ok)  # the last token and the kept guesses stay cached
            done = emit(choice[: ok + 1], logits)
    ids = torch.cat([idx.long(), torch.tensor([new], dtype=torch.long, device=idx.device).view(1, -1)], dim=1)
    out = None
    if return_logits:  # (1, new, V)
        out = torch.stack(rows)[None] if rows else torch.empty(1, 0, model.config.vocab_size, device=idx.device)
    return ids, out, stats


def _draft(draft: _Cached, ctx: list[int], k: int) -> list[int]:
    """``k`` greedy tokens of the draft model after ``ctx``; its cache keeps ``ctx`` and all but the
    last guess (rolled back to what the model kept by the next call)."""
    if k <= 0:
        return []
    draft.rollback(min(draft.seen, len(ctx) - 1))  # what of its cache is still the text (at least one to feed)
    guess = _argmax(draft.feed(ctx[draft.seen :], every=False))[-1:]
    while len(guess) < k:
        guess += _argmax(draft.feed(guess[-1:], every=False))[-1:]
    return guess
