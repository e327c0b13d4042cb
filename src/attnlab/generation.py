"""Autoregressive generation for :class:`attnlab.GPT`: sampling, KV cache, sliding window, batches.

How the cache works. Each layer owns a preallocated :class:`~attnlab.attention.KVCache`. The prompt
is fed once ("prefill"); then each new token is fed alone: its query attends over the cached keys
and values and its own are written into the next slot, so a step costs O(T) work, not O(T^2).

Past the context window. GPT-2 adds an *absolute* position embedding to every token, so when the
window slides by one token every cached key and value is stale: a cache that just dropped its oldest
slot would silently change the model. So once the cache is full attnlab re-fills it from the last
``context_length`` tokens (what the uncached path runs anyway): cached and uncached generation stay
identical. Models with relative positions (RoPE, ALiBi, none) attend over a sliding ``window``
(default ``context_length``) at the tokens' original positions, so their cache is a ring of ``window
(+ sinks)`` slots: the prompt is fed once (in chunks of ``context_length``), then each step writes
over the oldest slot; nothing is re-encoded, and memory and time per token stay flat. Without a
cache the model runs over the whole sequence each step (the window slides inside it).

Batches of different lengths. Left-pad the prompts and pass ``attention_mask (B, T)`` (True / 1 =
real token). Padding is never attended to and each row's positions count only its real tokens, so a
padded row computes the logits it would alone (and, greedy, the same tokens; sampling draws the rows
from one random stream, so a row's draws depend on the batch, as in transformers); except under
LongRoPE (Phi-3), whose turn to its long factors follows the batch's longest row, as transformers' does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnlab.checks import check_bool, check_model_logits, finite_real, has_a_token, is_int, is_real, positive_int
from attnlab.decoding import FastDecoder, Reading, dropout_off, greedy_tokens, supported
from attnlab.positions import rope_scaling_type
from attnlab.speculative import check_speculative, speculative_decode

if TYPE_CHECKING:  # generation sits below the model: GPT's generate and stream are these functions
    from attnlab.model import GPT

__all__ = [
    "SamplingConfig",
    "cache_length",
    "check_logits",
    "generate",
    "next_tokens",
    "resume",
    "sample_next_token",
    "stream",
]


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the logits: one set of settings, checked once.

    Attributes:
        temperature: softmax temperature; ``0`` is greedy (argmax).
        top_k: sample only among the ``top_k`` most likely tokens.
        top_p: nucleus sampling: only among the most likely tokens whose probability reaches ``top_p``.
        eos_id: a token id that ends a row (checked against the vocabulary when generating), or
            several (a chat model's end-of-turn and end-of-text tokens): a tuple, any of which ends it.
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_id: int | tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not finite_real(self.temperature) or not 0 <= self.temperature <= torch.finfo(torch.float32).max:
            # (past float32's largest, the logits would be divided by inf: uniform, or NaN beside an -inf)
            raise ValueError(
                f"temperature must be a float in [0, 3.4e38] (0 = greedy; float32's range), got {self.temperature!r}"
            )
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k <= 0):
            raise ValueError(f"top_k must be a positive int or None, got {self.top_k!r}")
        if self.top_p is not None and (not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be a float in (0, 1] or None, got {self.top_p!r}")
        if isinstance(self.eos_id, (list, tuple)):  # several stop ids: kept as a tuple (hashable, frozen)
            object.__setattr__(self, "eos_id", tuple(self.eos_id))
        no_ids = self.eos_id is not None and not self.stop_ids  # an empty tuple
        if no_ids or not all(is_int(i) and i >= 0 for i in self.stop_ids):
            raise ValueError(
                f"eos_id must be a token id (an int >= 0), a non-empty tuple of them, or None, got {self.eos_id!r}"
            )

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a row: ``eos_id`` as a tuple (empty when None)."""
        if self.eos_id is None:
            return ()
        return self.eos_id if isinstance(self.eos_id, tuple) else (self.eos_id,)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def filter(self, logits: Tensor) -> Tensor:
        """``logits (B, V)`` as sampling sees them: float32, divided by the temperature, ``-inf``
        outside the top-k and the top-p nucleus. Not for ``temperature=0`` (see :meth:`probabilities`)."""
        # Subtract each row's maximum first: then dividing by a tiny temperature sends the other logits
        # towards -inf, never the best one to +inf (which would make the softmax NaN).
        if logits.dtype == torch.float64:  # (float64 logits can lie past float32's range: shifted first)
            logits = logits - logits.amax(dim=-1, keepdim=True)
        logits = logits.float()  # (B, V)
        logits = logits - logits.amax(dim=-1, keepdim=True)  # (B, V), max 0
        if self.temperature >= torch.finfo(torch.float32).tiny:
            logits = logits / self.temperature
        else:  # float32 cannot hold the temperature (it would divide by 0): below the max is -inf
            logits = logits.masked_fill(logits < 0, float("-inf"))
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
            # Summed in float64 (MPS has none: float32 there): float32's sum of thousands of probabilities
            # puts the cut one token off in some rows (transformers' in others).
            exact = torch.float32 if logits.device.type == "mps" else torch.float64
            probs = torch.softmax(sorted_logits.to(exact), dim=-1)
            # Drop a token when the tokens *before* it already reach top_p (the first always stays).
            drop = (probs.cumsum(dim=-1) - probs) >= self.top_p  # (B, V)
            drop[:, 0] = False  # even where float32 rounds a tiny top_p to 0
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return logits

    def probabilities(self, logits: Tensor) -> Tensor:
        """The distribution a token is drawn from, ``(B, V)`` float32; one-hot on the argmax when greedy."""
        if self.greedy:
            return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, greedy_tokens(logits)[..., None], 1.0)
        return torch.softmax(self.filter(logits), dim=-1)  # (B, V)

    def sample(self, logits: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One token per row of ``logits (B, V)`` (checked by the caller); ``(B,)`` int64."""
        if self.greedy:
            return greedy_tokens(logits)  # (B,)
        return torch.multinomial(self.probabilities(logits), 1, generator=generator).squeeze(-1)  # (B,)


def sample_next_token(
    logits: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Pick one token per row from ``logits (B, V)``; returns ``(B,)`` int64.

    ``temperature=0`` is greedy (argmax). Otherwise the logits are divided by ``temperature``,
    restricted to the ``top_k`` most likely tokens and/or to the smallest set whose probability
    reaches ``top_p`` (nucleus sampling), and sampled with ``generator`` (see :class:`SamplingConfig`).
    Every row needs at least one finite logit.
    """
    if not isinstance(logits, Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, Tensor) else type(logits).__name__
        raise TypeError(f"logits must be a float tensor (B, V), got {got}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(
            f"logits must have shape (B, V) with V >= 1; for one row use logits[None]; got {tuple(logits.shape)}"
        )
    sampling = SamplingConfig(temperature, top_k, top_p)
    check_logits(logits)
    return sampling.sample(logits, generator)


def check_logits(logits: Tensor) -> None:
    """ValueError unless every row of ``logits (B, V)`` has a finite value and none is NaN or +inf
    (one host sync): otherwise there is no distribution to draw from."""
    if not has_a_token(logits):
        raise ValueError("logits must be finite or -inf, with a finite value in every row: there is no token to pick")


def next_tokens(
    logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None, stop: Tensor | None, finished: Tensor
) -> Tensor:
    """A generation's next token of each row, ``(B,)``, drawn from the model's ``logits (B, V)``:
    checked (NaN or +inf: ValueError, one host sync), sampled, and a row already ``finished`` (it
    produced one of the ``stop`` ids) kept at the first stop id; ``finished (B,)`` is updated in place."""
    if sampling.greedy:  # (checked from the argmax's own maxima: one pass)
        nxt = greedy_tokens(logits, checked=True)  # (B,)
    else:
        check_model_logits(logits)
        nxt = sampling.sample(logits, generator)  # (B,)
    if stop is not None:
        nxt = nxt.masked_fill(finished, stop[0])  # finished rows keep emitting (the first) eos
        finished |= torch.isin(nxt, stop)
    return nxt


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------
def _check_args(
    model: GPT,
    idx: object,
    max_new_tokens: object,
    sampling: SamplingConfig,
    attention_mask: object,
    generator: object = None,
):
    V = model.config.vocab_size
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    # Prompts may be longer than the context: generation slides the window over them.
    model.check_idx(idx, limit_length=False)
    if generator is not None and sampling.temperature > 0 and generator.device.type != idx.device.type:
        raise ValueError(
            f"generator must be on the model's device ({idx.device.type}), got a generator on {generator.device}: "
            f"torch.Generator(device={str(idx.device.type)!r})"
        )
    if idx.shape[0] == 0:
        raise ValueError(f"idx must hold at least one prompt, got shape {tuple(idx.shape)}")
    if not is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if any(i >= V for i in sampling.stop_ids):
        raise ValueError(f"eos_id must be a token id in [0, {V}), a tuple of them, or None, got {sampling.eos_id!r}")
    if attention_mask is None:
        return None
    mask = model.check_attention_mask(attention_mask, *idx.shape, idx.device)
    if not mask.any(dim=1).all():
        raise ValueError("attention_mask has a row with no real token; every prompt needs at least one")
    # Left padding only: once a row's real tokens start they continue to the end.
    if (mask[:, 1:] < mask[:, :-1]).any():
        raise ValueError(
            "attention_mask must describe left padding (padding first, then the prompt); "
            "pad prompts on the left for batched generation"
        )
    return mask


# --------------------------------------------------------------------------------------------
# The decoding loop
# --------------------------------------------------------------------------------------------
_CHUNK = 1024  # the token buffer of _steps grows by at least this many tokens at a time


def cache_length(model: GPT, prompt_length: int, max_new_tokens: int, compile: bool = False) -> int:
    """The ``max_length`` of the KV caches a generation of ``model`` makes (``model.new_kv_caches``):
    what the prompt and the new tokens need; with ``compile``, rounded up to a multiple of 256 slots
    (the compiled step's shapes, shared by generations of similar lengths: a server compiles ahead
    for the lengths it expects)."""
    n = prompt_length + max_new_tokens
    if compile:
        n = -(-n // 256) * 256
    return n if model.config.relative else min(model.config.context_length, n)


def _steps(
    model: GPT,
    idx: Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig,
    use_cache: bool,
    generator: torch.Generator | None,
    mask: Tensor | None,
    fast: bool = True,
    compile: bool = False,
    seeded: tuple[list, Tensor] | None = None,
    reading: Reading | None = None,
) -> Iterator[tuple[Tensor, Tensor, Any]]:
    """Yield ``(token (B,), logits (B, V), read)`` per step: a prefill of the prompt, then one decoding
    step a token (:func:`_stepper`, chosen once); ``read``: what ``reading`` read of the pass that gave
    the logits (:data:`attnlab.decoding.Reading`; None without).

    ``seeded``: ``(caches, logits (B, V))``, KV caches already holding ``idx`` and the logits after its
    last token (a trace's, :func:`attnlab.interpret.trace_generation`): the prompt is not run again.

    The tokens (and the mask) live in a buffer ``out`` that grows by chunks as tokens come, never
    sized by ``max_new_tokens`` (``stream`` may be asked for 10**10 tokens and stopped early).
    """
    B, T = idx.shape
    stop = torch.tensor(sampling.stop_ids, dtype=torch.long, device=idx.device) if sampling.stop_ids else None
    out = torch.empty(B, T + min(max_new_tokens, _CHUNK), dtype=torch.long, device=idx.device)  # (B, T + chunk)
    out[:, :T] = idx
    full_mask = None if mask is None else torch.cat([mask, mask.new_ones(B, out.shape[1] - T)], dim=1)  # (B, T + chunk)
    caches, first = seeded if seeded is not None else (None, None)
    if seeded is None and use_cache:  # sized by what this call needs (a rolling cache: at most window + sinks)
        caches = model.new_kv_caches(B, cache_length(model, T, max_new_tokens, compile))
    finished = torch.zeros(B, dtype=torch.bool, device=idx.device)

    with dropout_off(model):
        decoder = FastDecoder(model, caches, compile=compile) if fast and supported(model, caches, mask) else None
        prefill, decode = _stepper(model, caches, decoder, reading)
        for step in range(max_new_tokens):
            cur = T + step  # tokens in `out` so far
            if cur == out.shape[1]:  # full: grow by a chunk, at least doubling, never past T + max_new_tokens
                more = min(max_new_tokens - step, max(_CHUNK, out.shape[1]))
                out = torch.cat([out, out.new_empty(B, more)], dim=1)
                if full_mask is not None:
                    full_mask = torch.cat([full_mask, full_mask.new_ones(B, more)], dim=1)
            with torch.inference_mode():
                m = None if full_mask is None else full_mask[:, :cur]
                if step == 0:
                    logits, read = (first, None) if first is not None else prefill(out[:, :cur], m)  # (B, V)
                else:
                    logits, read = decode(out[:, :cur], m)  # (B, V)
                nxt = next_tokens(logits, sampling, generator, stop, finished)  # (B,)
                out[:, cur] = nxt
            yield nxt.clone(), logits, read
            if stop is not None and bool(finished.all()):
                return


def _stepper(model: GPT, caches: list | None, decoder: FastDecoder | None, reading: Reading | None = None):
    """``(prefill, decode)``: each maps the tokens so far ``seq (B, t)`` and their mask ``(B, t)`` (or
    None) to the logits after the last one, ``(B, V)``, and what ``reading`` read of the pass that gave
    them (None without); ``prefill`` reads the prompt, ``decode`` the newest token of each later step.

    * No cache: every step runs the window (a model with relative positions slides it inside the
      forward; GPT-2 runs the last ``context_length`` tokens).
    * Relative positions: the prompt in chunks of the context into the ring; each step the newest token,
      on the fast decoder where it fits (:meth:`FastDecoder.fits`), else the eager forward.
    * GPT-2 (absolute positions): the window's tokens, again each time the context is full (the cached
      keys hold the old positions); else the newest token, fast where it fits.

    With ``reading``, a prompt's last token runs as a pass of its own, read, after the other tokens
    (unread): what a reading of the last query wants, without every query of the prompt read.
    """
    C, relative = model.config.context_length, model.config.relative
    scaling = model.config.rope_scaling
    # LongRoPE turns long once the sequence passes its original context: the cached keys, rotated short,
    # are made again (as transformers' Phi-3 does), so the tokens are those of a forward over all of them.
    turns_long = scaling["original_max_position_embeddings"] if rope_scaling_type(scaling) == "longrope" else None

    def forward(seq: Tensor, m: Tensor | None, kv: list | None, last_only: bool = False, read: bool = True):
        if reading is None or not read:
            return model.decode_logits(seq, m, kv, last_only=last_only)[:, -1], None
        with reading(model) as got:
            logits = model.decode_logits(seq, m, kv, last_only=last_only)[:, -1]
        return logits, got

    if caches is None:
        if relative:
            return (lambda seq, m: forward(seq, m, None, last_only=True),) * 2
        return (lambda seq, m: forward(seq[:, -C:], None if m is None else m[:, -C:], None, last_only=True),) * 2

    def refill(seq: Tensor, m: Tensor | None) -> tuple[Tensor, Any]:  # (the window anew: caches emptied first)
        for c in caches:
            c.reset()
        start = 0 if relative else max(0, seq.shape[1] - C)
        out = None
        for s in range(start, seq.shape[1], C):  # (relative: chunks of the context; GPT-2: one window)
            e = min(seq.shape[1], s + C)
            # The last token apart, except where LongRoPE turns long within the pass: the tokens before it
            # would be rotated short (a pass takes its factors from its last position), not as one forward.
            long_turn = turns_long is not None and e > turns_long
            if reading is not None and m is None and e == seq.shape[1] and e - s > 1 and not long_turn:
                forward(seq[:, s : e - 1], None, caches, last_only=True, read=False)
                s = e - 1
            out = forward(seq[:, s:e], None if m is None else m[:, start:e], caches, last_only=True)
        return out  # (B, V), read

    def newest(seq: Tensor, m: Tensor | None) -> tuple[Tensor, Any]:
        if not relative and caches[0].seen >= C:  # GPT-2's context is full: the window anew
            return refill(seq, m)
        if turns_long is not None and seq.shape[1] > turns_long >= caches[0].seen:  # (see turns_long)
            return refill(seq, m)
        if decoder is not None and decoder.fits():
            got = decoder.step(seq[:, -1], reading)  # (B, V), or with what reading read
            return (got, None) if reading is None else got
        if m is not None and not relative:  # (GPT-2: the mask's columns are the window's, the cached tokens')
            m = m[:, seq.shape[1] - 1 - caches[0].seen :]
        return forward(seq[:, -1:], m, caches)  # (B, V), read

    return refill, newest


def stream(
    model: GPT,
    idx: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | tuple[int, ...] | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    attention_mask: Tensor | None = None,
    fast: bool = True,
    compile: bool = False,
    with_logits: bool = False,
    reading: Reading | None = None,
) -> Iterator[Tensor] | Iterator[tuple[Tensor, Tensor]] | Iterator[tuple[Tensor, Tensor, Any]]:
    """Like :func:`generate`, but yields each new token batch ``(B,)`` (int64) as soon as it is sampled::

        dec = attnlab.tokenizers.StreamDecoder(tokenizer)  # whole characters, even across tokens
        for tok in model.stream(idx, 100, temperature=0.8, top_k=40):
            print(dec.push(int(tok[0])), end="", flush=True)
        print(dec.flush())

    Arguments as :func:`generate`; ``with_logits``: yield ``(token (B,), logits (B, V))``, the logits
    each token was drawn from (what a live view shows beside it). They are checked when ``stream`` is
    called, not at the first ``next()``. A hook set between two tokens applies from the next one.
    ``reading``: yield ``(token, logits, read)``, ``read`` what ``reading`` read of the pass that gave
    the logits (:data:`attnlab.decoding.Reading`; a compiled step compiles it with the step: serve's
    stream reads each token's attention so, :func:`attnlab.interpret.attention_rows`).
    The model is in eval mode while the iterator runs: its training mode comes back
    when the iterator is exhausted or closed (``it.close()``, or the iterator is garbage-collected),
    so close one you stop reading early before training again.
    """
    sampling = SamplingConfig(temperature, top_k, top_p, eos_id)
    mask = _check_args(model, idx, max_new_tokens, sampling, attention_mask, generator)
    fast, compile = check_bool("fast", fast), check_bool("compile", compile)
    with_logits, use_cache = check_bool("with_logits", with_logits), check_bool("use_cache", use_cache)
    steps = _steps(model, idx, max_new_tokens, sampling, use_cache, generator, mask, fast, compile, reading=reading)
    if reading is not None:
        return steps
    return ((tok, logits) for tok, logits, _ in steps) if with_logits else (tok for tok, _, _ in steps)


def generate(
    model: GPT,
    idx: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | tuple[int, ...] | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    attention_mask: Tensor | None = None,
    return_logits: bool = False,
    fast: bool = True,
    compile: bool = False,
    prompt_lookup: int | None = None,
    draft_model: GPT | None = None,
    draft_tokens: int = 4,
) -> Tensor | tuple[Tensor, Tensor]:
    """Continue the prompts ``idx (B, T)`` by up to ``max_new_tokens`` tokens.

    Args:
        model: a :class:`~attnlab.GPT` (as ``model.generate(...)`` this is the model itself).
        idx: ``(B, T)`` int64 prompt token ids; ``T`` may exceed ``context_length`` (the model
            then sees the last ``context_length`` tokens, and the window slides as text grows).
        max_new_tokens: how many tokens to add.
        temperature, top_k, top_p, eos_id: how tokens are chosen (see :class:`SamplingConfig`):
            ``temperature=0`` is greedy; ``top_k`` / ``top_p`` restrict sampling; a row stops when
            it emits ``eos_id`` or, for a tuple, any of them (later positions of that row are filled
            with the first), and generation ends early once every row has stopped.
        use_cache: use per-layer KV caches (same tokens, much faster); ``False`` re-runs the window
            each step.
        generator: a ``torch.Generator`` for reproducible sampling.
        attention_mask: ``(B, T)`` bool or 0/1 for left-padded prompts (True = real token).
        return_logits: also return the logits each token was chosen from, ``(B, new, V)``.
        fast: run the decoding steps on :class:`attnlab.decoding.FastDecoder` where it applies (the
            model's own forward without its per-call checks, on caches written at fixed slots);
            ``False``: the eager forward with its checks for every step (the reference).
        compile: with ``fast``, run each decoding step compiled by ``torch.compile``: faster per token,
            but the first step compiles (seconds to a minute; once per process, model and shape).
        prompt_lookup: speculative decoding (:mod:`attnlab.speculative`) with this many tokens guessed a
            step from the context (where the last tokens occurred before), all checked by one forward:
            the same tokens, fewer forwards where the text repeats the prompt. Greedy, one prompt.
        draft_model: speculative decoding with this smaller GPT of the same vocabulary guessing
            ``draft_tokens`` tokens a step. Greedy, one prompt.

    Returns:
        ``(B, T + new)`` int64 token ids (prompt included), ``new <= max_new_tokens``;
        or ``(ids, logits)`` with ``return_logits=True``.
    """
    sampling = SamplingConfig(temperature, top_k, top_p, eos_id)
    mask = _check_args(model, idx, max_new_tokens, sampling, attention_mask, generator)
    fast, compile, use_cache = (
        check_bool(name, v) for name, v in (("fast", fast), ("compile", compile), ("use_cache", use_cache))
    )
    return_logits = check_bool("return_logits", return_logits)  # (before either way of decoding)
    positive_int("draft_tokens", draft_tokens)  # (checked with or without a draft model)
    if prompt_lookup is not None or draft_model is not None:
        if prompt_lookup is not None and draft_model is not None:
            raise ValueError("pass prompt_lookup or draft_model, not both: each is a way of guessing tokens")
        k = draft_tokens if prompt_lookup is None else positive_int("prompt_lookup", prompt_lookup)
        settings = dict(temperature=temperature, attention_mask=attention_mask, use_cache=use_cache, compile=compile)
        check_speculative(model, idx, max_new_tokens, k, draft_model, **settings)
        guess = dict(k=k, draft_model=draft_model, stop_ids=sampling.stop_ids, fast=fast, return_logits=return_logits)
        ids, logits, _ = speculative_decode(model, idx, max_new_tokens, **guess)
        return (ids, logits) if return_logits else ids
    steps = _steps(model, idx, max_new_tokens, sampling, use_cache, generator, mask, fast, compile)
    return _collect(steps, model, idx, return_logits)


def resume(
    model: GPT,
    idx: Tensor,
    caches: list,
    logits: Tensor,
    max_new_tokens: int,
    sampling: SamplingConfig,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`generate` from KV ``caches`` that already hold the prompt ``idx (B, T)`` (seeded from a
    trace's keys and values, as :func:`attnlab.interpret.trace_generation` does), ``logits (B, V)``
    being the model's output after its last token: the decoding steps alone, no prefill. The caches
    must hold the prompt and the new tokens without sliding or wrapping. Returns ``(ids (B, T + new),
    logits (B, new, V))``, as ``generate(..., return_logits=True)``."""
    _check_args(model, idx, max_new_tokens, sampling, None, generator)
    if len(caches) != len(model.trf_blocks) or any(c.seen != idx.shape[1] for c in caches):
        raise ValueError(f"caches must be one per layer, each holding the prompt's {idx.shape[1]} tokens")
    want = (idx.shape[0], model.config.vocab_size)
    if tuple(logits.shape) != want:
        raise ValueError(f"logits must have shape (B, V) = {want}, got {tuple(logits.shape)}")
    steps = _steps(model, idx, max_new_tokens, sampling, True, generator, None, seeded=(caches, logits))
    return _collect(steps, model, idx, True)


def _collect(steps: Iterator[tuple[Tensor, Tensor]], model: GPT, idx: Tensor, return_logits: bool):
    """The tokens ``(B, T + new)`` of a generation's ``steps`` after the prompt ``idx``, and with
    ``return_logits`` the logits ``(B, new, V)`` (float32)."""
    new_tokens, all_logits = [], []
    for token, logits, _ in steps:
        new_tokens.append(token)  # (B,)
        if return_logits:
            all_logits.append(logits.float())
    ids = torch.cat([idx.long(), torch.stack(new_tokens, dim=1)], dim=1) if new_tokens else idx.long()
    if not return_logits:
        return ids
    V = model.config.vocab_size
    logits = torch.stack(all_logits, dim=1) if all_logits else torch.empty(idx.shape[0], 0, V, device=idx.device)
    return ids, logits  # (B, T + new), (B, new, V)
