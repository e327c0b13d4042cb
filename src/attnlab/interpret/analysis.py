"""Reading a trace: attention rollout, the logit lens, head roles and next-token probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.checks import positive_int
from attnlab.generation import SamplingConfig
from attnlab.interpret.tracing import Trace, attention_layers
from attnlab.interpret.tracing import trace as run_trace

__all__ = [
    "HEAD_KINDS",
    "LogitLens",
    "head_scores",
    "logit_lens",
    "next_token_probabilities",
    "repeated_tokens",
    "rollout",
]

HEAD_KINDS = ("previous-token", "first-token", "self", "duplicate-token", "induction")
FUSIONS = ("mean", "max", "min")


def _check_trace(trace_: object, what: str) -> Trace:
    if not isinstance(trace_, Trace):
        raise TypeError(f"{what} needs a Trace (from attnlab.interpret.trace()), got {type(trace_).__name__}")
    return trace_


# --------------------------------------------------------------------------------------------
# Attention rollout
# --------------------------------------------------------------------------------------------
def rollout(trace: Trace, *, head_fusion: str = "mean") -> Tensor:
    """Attention rollout (Abnar & Zuidema, 2020) of a trace: ``(B, T, T)`` float32.

    Per layer the heads' weights are fused (``mean``, ``max`` or ``min`` over heads), the identity
    is added for the residual connection and each row is renormalised to sum to 1; the layers'
    matrices are multiplied, the top layer on the left. Row ``i``: how much each input position
    flows into position ``i`` at the top of the model.
    """
    _check_trace(trace, "rollout")
    if head_fusion not in FUSIONS:
        raise ValueError(f"head_fusion must be one of {', '.join(FUSIONS)}, got {head_fusion!r}")
    w = trace.weights  # (L, B, H, T, S)
    T, S = w.shape[-2:]
    if T != S:
        raise ValueError(f"rollout needs as many keys as queries (a pass without a cache), got T={T}, S={S}")
    fuse = {"mean": torch.mean, "max": torch.amax, "min": torch.amin}[head_fusion]
    fused = fuse(w, dim=2)  # (L, B, T, T)
    a = fused.float() + torch.eye(T, dtype=torch.float32, device=w.device)  # the residual path
    a = a / a.sum(dim=-1, keepdim=True)  # (L, B, T, T), rows sum to 1
    out = a[0]
    for layer in a[1:]:
        out = layer @ out  # (B, T, T)
    return out


# --------------------------------------------------------------------------------------------
# The logit lens
# --------------------------------------------------------------------------------------------
@dataclass
class LogitLens:
    """What the model would predict from the residual stream of each layer (nostalgebraist, 2020).

    Attributes:
        tokens: ``(L + 1, B, T, k)`` the top-k token ids at each layer and position (row ``l < L``:
            the stream entering block ``l``; row ``L``: after the last block = the model's output).
        probs: ``(L + 1, B, T, k)`` their probabilities (softmax of the lens logits).
        final_token_probs: ``(L + 1, B, T)`` the probability each layer gives the token the model
            finally ranks first.
    """

    tokens: Tensor
    probs: Tensor
    final_token_probs: Tensor


def lens_logits(model: nn.Module, residual: Tensor) -> Tensor:
    """The final norm and the unembedding applied to a residual stream ``(..., d)``: ``(..., V)``."""
    with torch.no_grad():
        return model.out_head(model.final_norm(residual))


def logit_lens(model: nn.Module, trace: Trace, *, k: int = 5) -> LogitLens:
    """The final norm and unembedding of ``model`` applied to the residual stream of every layer
    (``trace`` needs ``stages=True``); the last row equals the model's own logits' top-k."""
    attention_layers(model)
    _check_trace(trace, "logit_lens")
    trace._need_stages("logit_lens")
    k = positive_int("k", k)
    final = trace.logits.argmax(dim=-1, keepdim=True)  # (B, T, 1)
    tokens, probs, final_probs = [], [], []
    L = trace.n_layers
    for layer, stream in enumerate(trace.residual):  # (B, T, d) per layer: one (B, T, V) at a time
        # After the last block the lens is the model's own head: its logits are in the trace.
        logits = (trace.logits if layer == L else lens_logits(model, stream)).float()  # (B, T, V)
        # softmax(x)_i = exp(x_i - logsumexp(x)): top-k of the logits, without a (B, T, V) softmax.
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (B, T, 1)
        top = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
        tokens.append(top.indices)
        probs.append((top.values - lse).exp())
        final_probs.append((logits.gather(-1, final) - lse).exp().squeeze(-1))
    return LogitLens(torch.stack(tokens), torch.stack(probs), torch.stack(final_probs))


# --------------------------------------------------------------------------------------------
# Next-token probabilities
# --------------------------------------------------------------------------------------------
def next_token_probabilities(
    logits: Tensor | Trace,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:
    """The distribution generation would draw the next token from, at every position.

    ``logits (..., V)`` (or a trace's) through :meth:`attnlab.generation.SamplingConfig.probabilities`
    (the one implementation generation uses: temperature, then top-k, then the top-p nucleus;
    ``temperature=0`` is greedy, one-hot). Returns ``(..., V)`` float32.
    """
    if isinstance(logits, Trace):
        logits = logits.logits
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError(f"logits must be a float tensor (..., V) or a Trace, got {type(logits).__name__}")
    sampling = SamplingConfig(temperature, top_k, top_p)
    flat = logits.reshape(-1, logits.shape[-1])  # (N, V)
    return sampling.probabilities(flat).reshape(logits.shape)


# --------------------------------------------------------------------------------------------
# Head roles
# --------------------------------------------------------------------------------------------
def repeated_tokens(vocab_size: int, context_length: int, *, seed: int = 0, batch: int = 2) -> Tensor:
    """``(batch, 2n)`` rows of ``n`` random distinct tokens repeated twice, ``n = min(context // 2,
    vocab, 64)``: on them an induction head's target is known (the token after the first copy)."""
    n = min(context_length // 2, vocab_size, 64)
    if n < 2:
        raise ValueError(
            f"a repeated random sequence needs context_length >= 4 and vocab_size >= 2, got "
            f"{context_length} and {vocab_size}"
        )
    g = torch.Generator().manual_seed(int(seed))
    half = torch.stack([torch.randperm(vocab_size, generator=g)[:n] for _ in range(batch)])  # (batch, n)
    return torch.cat([half, half], dim=1)  # (batch, 2n)


def role_targets(idx: Tensor, real: Tensor, kind: str) -> tuple[Tensor, Tensor]:
    """``(targets (B, T, T) bool, valid (B, T) bool)``: for each query, the keys a head of ``kind``
    attends to, and whether the query has any (padding and positions without one do not count)."""
    B, T = idx.shape
    targets = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        pos = torch.nonzero(real[b].cpu()).flatten().tolist()  # real positions, in order
        ids = idx[b].cpu().tolist()
        for r, i in enumerate(pos):
            if kind == "previous-token" and r >= 1:
                targets[b, i, pos[r - 1]] = True
            elif kind == "first-token" and r >= 1:
                targets[b, i, pos[0]] = True
            elif kind == "self" and r >= 1:
                targets[b, i, i] = True
            elif kind == "duplicate-token":
                for j in pos[:r]:
                    if ids[j] == ids[i]:
                        targets[b, i, j] = True
            elif kind == "induction":
                for s in range(r - 1):  # pos[s] an earlier copy whose successor comes before i
                    if ids[pos[s]] == ids[i] and pos[s + 1] < i:
                        targets[b, i, pos[s + 1]] = True
    return targets, targets.any(dim=-1)


def head_scores(model: nn.Module, kind: str, *, trace: Trace | None = None, seed: int = 0) -> Tensor:
    """How much each head plays a role: ``(L, H)`` in [0, 1], the mean attention each head's queries
    give the role's target keys.

    Kinds: ``previous-token`` (key ``i - 1``), ``first-token`` (the first token), ``self`` (key
    ``i``): first queries excluded, where every head trivially attends to itself;
    ``duplicate-token`` (earlier occurrences of the same token); ``induction`` (the token after an
    earlier occurrence of the current token: what makes ``... A B ... A`` predict ``B``).

    Without ``trace``, the model is traced on :func:`repeated_tokens` (``seed``), where the last two
    are defined for every query of the second copy. With ``trace``, its tokens and padding decide the
    targets, and queries without a target do not count.
    """
    if kind not in HEAD_KINDS:
        raise ValueError(f"kind must be one of {', '.join(HEAD_KINDS)}, got {kind!r}")
    return all_head_scores(model, trace=trace, seed=seed, kinds=(kind,))[kind]


def all_head_scores(
    model: nn.Module, *, trace: Trace | None = None, seed: int = 0, kinds: tuple[str, ...] = HEAD_KINDS
) -> dict[str, Tensor]:
    """:func:`head_scores` for several kinds on one trace: ``{kind: (L, H)}``."""
    layers = attention_layers(model)
    if trace is None:
        cfg = getattr(model, "config", None)
        if cfg is None:
            raise ValueError("head_scores without a trace needs model.config (vocab_size, context_length)")
        device = next(model.parameters()).device
        idx = repeated_tokens(cfg.vocab_size, cfg.context_length, seed=seed).to(device)
        trace = run_trace(model, idx)
    _check_trace(trace, "head_scores")
    if trace.n_layers != len(layers):
        raise ValueError(f"trace has {trace.n_layers} layers but model has {len(layers)}")
    w = trace.weights  # (L, B, H, T, S)
    if w.shape[-1] != w.shape[-2]:
        raise ValueError("head_scores needs a trace of a pass without a cache (as many keys as queries)")
    out = {}
    for kind in kinds:
        targets, valid = role_targets(trace.idx, trace.real_tokens(), kind)  # (B, T, T), (B, T)
        if not bool(valid.any()):
            raise ValueError(
                f"no query of the trace has a {kind} target (no repeated token?); "
                "call head_scores without trace= to use a repeated random sequence"
            )
        on_target = (w * targets.to(w.device)[None, :, None]).sum(-1)  # (L, B, H, T)
        valid = valid.to(w.device)[None, :, None].float()  # (1, B, 1, T)
        out[kind] = (on_target * valid).sum(dim=(1, 3)) / (valid.sum(dim=(1, 3)))  # (L, H)
    return out
