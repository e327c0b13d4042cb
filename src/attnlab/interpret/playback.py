"""Generation, recorded token by token: each new token's attention over the cache and the candidates
it was drawn from.

:func:`trace_generation` *is* :func:`attnlab.generation.generate` (the same call, the same KV cache,
the same sampling and generator) with the attention layers observed, so it produces exactly the
tokens ``model.generate`` produces; the candidates' probabilities come from
:meth:`attnlab.generation.SamplingConfig.probabilities`, the one filter generation samples through.
Given the prompt's trace (``prefix=``, as the inspector page has one), it skips the prompt's pass:
the trace's keys and values fill the KV cache and its last position gives the first token's logits
(the same numbers the prefill computes), then the same decoding steps run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from attnlab.checks import positive_int
from attnlab.generation import SamplingConfig, generate, resume
from attnlab.interpret.tracing import Trace, observe_attention_rows

__all__ = ["GenerationStep", "GenerationTrace", "top_candidates", "top_ids", "trace_generation"]


@dataclass
class GenerationStep:
    """One new token of a :class:`GenerationTrace` (batch ``B``, ``L`` layers, ``H`` heads, ``S`` keys).

    Attributes:
        token: ``(B,)`` the token chosen.
        position: the index of the new token in :attr:`GenerationTrace.tokens`.
        key_start: the index of the first key the step attended to (0 until the window slides).
        key_index: ``(B, S)`` the index in :attr:`GenerationTrace.tokens` of each key (slot) the
            step attended to, -1 for none (padding, an empty slot): ``key_start .. position - 1`` in
            order, unless a cache keeps its keys in another order (a rolling cache).
        weights: ``(L, B, H, S)`` the attention of the query that produced the token (the previous
            token's) over those keys.
        candidates: ``(B, k)`` the most likely tokens after temperature/top-k/top-p (:func:`top_candidates`:
            those the filter leaves out, at probability zero, by how close they came), and
        probs: ``(B, k)`` their probabilities (zero outside the filter; one-hot when greedy).
        token_prob: ``(B,)`` the probability of the chosen token.
    """

    token: Tensor
    position: int
    key_start: int
    key_index: Tensor
    weights: Tensor
    candidates: Tensor
    probs: Tensor
    token_prob: Tensor


@dataclass
class GenerationTrace:
    """Tokens ``(B, T + new)`` (the prompt's included), the sampling settings, and one
    :class:`GenerationStep` per new token."""

    tokens: Tensor
    prompt_length: int
    sampling: SamplingConfig
    steps: list[GenerationStep]

    @property
    def new_tokens(self) -> Tensor:
        return self.tokens[:, self.prompt_length :]


def trace_generation(
    model: nn.Module,
    idx: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    attention_mask: Tensor | None = None,
    use_cache: bool = True,
    candidates: int = 10,
    prefix: Trace | None = None,
) -> GenerationTrace:
    """Generate like :func:`attnlab.generation.generate` (same arguments, same tokens for the same
    ``generator``) and record, for each new token, its attention rows and its top ``candidates``.

    ``prefix``: a :func:`~attnlab.interpret.trace` of ``idx`` with ``stages=True``. Its keys and values
    seed the KV cache, so the prompt is not run again (for a long prompt that pass is most of the
    time). Used when the cache holds the prompt and the new tokens without sliding (else, and
    with an ``attention_mask`` or ``use_cache=False``, the prompt runs as usual)."""
    candidates = positive_int("candidates", candidates)
    if isinstance(idx, Tensor) and idx.dim() == 1:
        idx = idx.unsqueeze(0)
    sampling = SamplingConfig(temperature, top_k, top_p, eos_id)
    if prefix is not None and not isinstance(prefix, Trace):
        raise TypeError(f"prefix must be a Trace of idx (attnlab.interpret.trace), got {type(prefix).__name__}")
    caches = _seeded_caches(model, prefix, idx, max_new_tokens) if attention_mask is None and use_cache else None
    # Per pass: the newest query's rows in every layer (L, B, H, S), and how far before it each key is
    passes: list[tuple[Tensor, Tensor | None]] = []

    def on_rows(weights: Tensor, q_positions: Tensor | None, k_positions: Tensor | None) -> None:
        passes.append((weights.float(), key_offsets(q_positions, k_positions)))

    with observe_attention_rows(model, on_rows):
        if caches is not None:  # (only for at least one new token: see _seeded_caches; resume checks it)
            tokens, logits = resume(
                model, idx, caches, _prefill_logits(model, prefix), max_new_tokens, sampling, generator
            )
        else:
            tokens, logits = generate(
                model,
                idx,
                max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos_id=eos_id,
                use_cache=use_cache,
                generator=generator,
                attention_mask=attention_mask,
                return_logits=True,
            )  # (B, T + new), (B, new, V)
    T, new = idx.shape[1], logits.shape[1]
    if caches is not None:  # the prompt's pass is the trace's: its last query's rows, keys in order
        passes.insert(0, (prefix.weights[:, :, :, -1].float().clone(), None))  # (L, B, H, S)
    elif use_cache and new and model.config.relative and model.config.context_length < T:
        # A prompt longer than the context fills the cache in passes of `context_length` tokens (see
        # generation's prefill): the first token's rows are the last of them.
        del passes[: -(-T // model.config.context_length) - 1]
    if len(passes) != new:
        raise RuntimeError(f"expected {new} passes of the model, one a token, saw {len(passes)}")
    # Which tokens are real (a model without positions tells its keys by their place alone: padding by this)
    real = None if attention_mask is None else F.pad(attention_mask.bool(), (0, tokens.shape[1] - T), value=True)
    steps = []
    for s, (weights, offsets) in enumerate(passes):
        probs = sampling.probabilities(logits[:, s])  # (B, V)
        ids, top_probs = top_candidates(logits[:, s], probs, candidates)
        token = tokens[:, T + s]
        S = weights.shape[-1]
        keys = key_index(offsets, T + s, S, tokens.shape[0], tokens.device)  # (B, S)
        if offsets is None and real is not None:
            keys = torch.where(real.gather(1, keys.clamp(min=0)) & (keys >= 0), keys, -1)
        steps.append(
            GenerationStep(
                token=token,
                position=T + s,
                key_start=T + s - S,
                key_index=keys,
                weights=weights,
                candidates=ids,
                probs=top_probs,
                token_prob=probs.gather(-1, token[:, None]).squeeze(-1),
            )
        )
    return GenerationTrace(tokens, T, sampling, steps)


def top_candidates(logits: Tensor, probs: Tensor | None, k: int) -> tuple[Tensor, Tensor | None]:
    """The ``k`` likeliest next tokens ``(B, k)`` of ``logits (B, V)`` and their probabilities ``(B, k)``
    under ``probs (B, V)``, the distribution the token was drawn from (None: the ids alone). Ordered by
    logit, which orders them as the probabilities do (the softmax keeps the logits' order, and top-k
    and top-p keep the best logits) and orders the tokens those leave at probability zero, greedy's all
    but one, by how close they came: the runners-up, not whichever zeros a top-k of the probabilities
    returned."""
    ids = top_ids(logits, min(k, logits.shape[-1]))  # (B, k)
    return ids, None if probs is None else probs.gather(-1, ids)


def top_ids(x: Tensor, k: int, block: int = 64) -> Tensor:
    """``torch.topk(x, k, dim=-1).indices`` of ``x (B, V)``, the largest first: the same values, ties
    taken in any order. A vocabulary's logits are searched in blocks of ``block``: the ``k`` largest lie
    in the ``k`` blocks of the largest maxima (a block with one of them has a maximum at least the
    ``k``-th largest value; fewer than ``k`` blocks have one above it), so only those are ranked: far
    fewer entries than ``torch.topk`` goes through (this runs once a token in serve's stream)."""
    B, V = x.shape
    n = V // block
    if V % block or n < 16 or k > n:  # (GPT-2's 50,257: topk)
        return torch.topk(x, k, dim=-1).indices
    blocks = x.view(B, n, block)
    best = torch.topk(blocks.amax(-1), k, dim=-1).indices  # (B, k): the blocks of the k largest maxima
    ranked = torch.topk(blocks.gather(1, best[..., None].expand(B, k, block)).view(B, k * block), k, dim=-1).indices
    return best.gather(1, ranked // block) * block + ranked % block  # (B, k)


def _seeded_caches(model: nn.Module, prefix: Trace | None, idx: Tensor, new: int) -> list | None:
    """KV caches holding the prompt's keys and values from ``prefix``, or None where they cannot stand
    in for the prompt's pass (no prefix or another prompt, no stages, padding, or a cache that would
    slide or wrap before the last new token)."""
    if prefix is None or not prefix.has_stages or prefix.attention_mask is not None or prefix.logits is None:
        return None
    if not isinstance(idx, Tensor) or prefix.idx.shape != idx.shape or not torch.equal(prefix.idx, idx):
        return None
    if not isinstance(new, int) or new < 1 or not hasattr(model, "new_kv_caches"):
        return None
    B, T = idx.shape
    if not model.config.relative and T + new > model.config.context_length:
        return None  # GPT-2: the window slides and generation re-encodes
    with torch.no_grad():
        caches = model.new_kv_caches(B, T + new)
        if any(c.max_length < T + new for c in caches):  # a ring shorter than the text: it wraps
            return None
        at = torch.arange(T, device=idx.device)[None]  # (1, T)
        for layer, cache in enumerate(caches):
            cache.update(prefix.k[layer], prefix.v[layer], at)
    return caches


def _prefill_logits(model: nn.Module, prefix: Trace) -> Tensor:
    """The prefill's logits ``(B, V)`` from ``prefix``: its last position's stream through the final
    norm, the head and a soft cap (:meth:`attnlab.GPT.unembed`: the numbers the prompt's pass computes)."""
    with torch.inference_mode():
        return model.unembed(prefix.residual[-1][:, -1:])[:, -1]  # (B, V)


def key_index(offsets: Tensor | None, position: int, S: int, rows: int, device: torch.device) -> Tensor:
    """``(rows, S)``: the index of the token in each of the ``S`` keys the query at ``position`` attended
    to (-1: none, such as a left-padded row's padding), from :func:`key_offsets`. Without offsets the
    keys are in order and end at the query: ``position - S .. position - 1`` (a caller that knows its
    keys hold every token so far, unpadded, may pass None for that case: serve's stream does)."""
    if offsets is None:
        return torch.arange(position - S, position, device=device).expand(rows, S)
    return torch.where(offsets >= 0, position - 1 - offsets, -1).expand(rows, S)


def key_offsets(q_positions: Tensor | None, k_positions: Tensor | None) -> Tensor | None:
    """``(1 or B, S)``: how many tokens before the newest query each key is, from the positions a
    module with positions records (queries ``(1 or B, n)``, keys ``(1 or B, S)``; -1: padding or an
    empty slot); None without positions."""
    if q_positions is None or k_positions is None:
        return None
    return torch.where(k_positions >= 0, q_positions[:, -1:] - k_positions, -1)
