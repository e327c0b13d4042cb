"""Shared references for the attnlab tests: the tutorials' explicit for-loops, in float64.

The loops below are written the way "A simple self-attention mechanism" first computes attention
(a double loop of dot products, a softmax by hand, a weighted sum), with no matrix product and no
``torch.softmax``, so they share no code path with what they check.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import Tensor


def loop_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of one head by explicit loops, in float64.

    Args:
        q: ``(L, E)``, k: ``(S, E)``, v: ``(S, Ev)``.
        allowed: ``(L, S)`` bool, True = may attend (None: all).
        bias: ``(L, S)`` float added to the scores (``-inf`` excludes the key).
        scale: default ``1/sqrt(E)``.
    Returns:
        ``(out (L, Ev), weights (L, S))``; a query with no key gets zero weights and output.
    """
    q, k, v = (t.detach().to(torch.float64) for t in (q, k, v))
    L, E = q.shape
    S = k.shape[0]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    weights = torch.zeros(L, S, dtype=torch.float64)
    for i in range(L):
        scores = {}
        for j in range(S):
            if allowed is not None and not bool(allowed[i, j]):
                continue
            s = sum(float(q[i, e]) * float(k[j, e]) for e in range(E)) * scale
            if bias is not None:
                s += float(bias[i, j])
            if s != -math.inf:
                scores[j] = s
        if not scores:
            continue
        top = max(scores.values())
        denom = sum(math.exp(s - top) for s in scores.values())
        for j, s in scores.items():
            weights[i, j] = math.exp(s - top) / denom
    out = torch.zeros(L, v.shape[1], dtype=torch.float64)
    for i in range(L):
        for j in range(S):
            out[i] += weights[i, j] * v[j]
    return out, weights


def loop_attention_nd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`loop_attention` over the leading (batch, head) dimensions, which must already match
    (masks may broadcast). ``q (..., L, E)``, ``k (..., S, E)``, ``v (..., S, Ev)``."""
    lead = q.shape[:-2]
    L, S = q.shape[-2], k.shape[-2]
    if allowed is not None:
        allowed = allowed.expand(*lead, L, S)
    if bias is not None:
        bias = bias.expand(*lead, L, S)
    outs = torch.zeros(*lead, L, v.shape[-1], dtype=torch.float64)
    weights = torch.zeros(*lead, L, S, dtype=torch.float64)
    for idx in itertools.product(*map(range, lead)):
        o, w = loop_attention(
            q[idx],
            k[idx],
            v[idx],
            None if allowed is None else allowed[idx],
            None if bias is None else bias[idx],
            scale,
        )
        outs[idx], weights[idx] = o, w
    return outs, weights


class _References:
    loop_attention = staticmethod(loop_attention)
    loop_attention_nd = staticmethod(loop_attention_nd)


@pytest.fixture(scope="session")
def ref() -> _References:
    """The explicit-loop references (session-scoped, so hypothesis tests may use it)."""
    return _References()


@pytest.fixture(scope="session")
def gpt2():
    """tiktoken's GPT-2 BPE built offline from the shared data; skips when the files are absent."""
    from attnlab.tokenizers import GPT2Tokenizer
    from shared_data import GPT2_BPE_DIR, gpt2_bpe_missing

    missing = gpt2_bpe_missing()
    if missing:
        pytest.skip(missing)
    return GPT2Tokenizer(bpe_dir=GPT2_BPE_DIR)
