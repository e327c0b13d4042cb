"""Generation, recorded token by token: each new token's attention over the cache and the candidates
it was drawn from.

:func:`trace_generation` *is* :func:`attnlab.generation.generate` (the same call, the same KV cache,
the same sampling and generator) with the attention layers observed, so it produces exactly the
tokens ``model.generate`` produces; the candidates' probabilities come from
:meth:`attnlab.generation.SamplingConfig.probabilities`, the one filter generation samples through.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.attention import AttentionRecord
from attnlab.checks import positive_int
from attnlab.generation import SamplingConfig, generate
from attnlab.interpret.tracing import observe_attention

__all__ = ["GenerationStep", "GenerationTrace", "trace_generation"]


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
        candidates: ``(B, k)`` the most likely tokens after temperature/top-k/top-p, and
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
) -> GenerationTrace:
    """Generate like :func:`attnlab.generation.generate` (same arguments, same tokens for the same
    ``generator``) and record, for each new token, its attention rows and its top ``candidates``."""
    candidates = positive_int("candidates", candidates)
    if isinstance(idx, Tensor) and idx.dim() == 1:
        idx = idx.unsqueeze(0)
    sampling = SamplingConfig(temperature, top_k, top_p, eos_id)
    calls: list[tuple[int, Tensor]] = []
    offsets: list[Tensor | None] = []  # per pass: how far before the newest query each key is
    n_layers = len(model.trf_blocks)

    def on_record(layer: int, record: AttentionRecord) -> None:
        calls.append((layer, record.weights[:, :, -1].float().clone()))  # (B, H, S): the newest query's row
        if layer == 0:
            offsets.append(_key_offsets(record))

    with observe_attention(model, on_record):
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
    if len(calls) != new * n_layers or any(layer != i % n_layers for i, (layer, _) in enumerate(calls)):
        raise RuntimeError(f"expected {new} passes over {n_layers} layers, saw {len(calls)} attention calls")
    steps = []
    for s in range(new):
        weights = torch.stack([w for _, w in calls[s * n_layers : (s + 1) * n_layers]])  # (L, B, H, S)
        probs = sampling.probabilities(logits[:, s])  # (B, V)
        top = torch.topk(probs, min(candidates, probs.shape[-1]), dim=-1)
        token = tokens[:, T + s]
        S = weights.shape[-1]
        if offsets[s] is None:  # keys in order, ending at the query: indices key_start .. T + s - 1
            key_index = torch.arange(T + s - S, T + s, device=tokens.device).expand(tokens.shape[0], S)
        else:
            key_index = torch.where(offsets[s] >= 0, T + s - 1 - offsets[s], -1).expand(tokens.shape[0], S)
        steps.append(
            GenerationStep(
                token=token,
                position=T + s,
                key_start=T + s - S,
                key_index=key_index,
                weights=weights,
                candidates=top.indices,
                probs=top.values,
                token_prob=probs.gather(-1, token[:, None]).squeeze(-1),
            )
        )
    return GenerationTrace(tokens, T, sampling, steps)


def _key_offsets(record: AttentionRecord) -> Tensor | None:
    """``(1 or B, S)``: how many tokens before the newest query each key is, from the positions a
    module with positions records (-1: padding or an empty slot); None without positions."""
    if record.q_positions is None or record.k_positions is None:
        return None
    q = record.q_positions[:, -1:]  # (1 or B, 1)
    k = record.k_positions  # (1 or B, S)
    return torch.where(k >= 0, q - k, -1)
