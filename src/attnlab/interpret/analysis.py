"""Reading a trace: attention rollout, the logit lens, head roles and next-token probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
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


LENS_CHUNK = 128  # positions per step of the lens: a few (128, V) blocks of logits at a time (25 MB each)
LENS_CANDIDATES = 64  # tokens per position the fast search hands to the exact re-ranking


def lens_logits(model: nn.Module, residual: Tensor) -> Tensor:
    """The final norm and the unembedding applied to a residual stream ``(..., d)``: ``(..., V)``."""
    with torch.no_grad():
        return model.out_head(model.final_norm(residual))


def logit_lens(
    model: nn.Module, trace: Trace, *, k: int = 5, chunk: int = LENS_CHUNK, search_dtype: torch.dtype | None = None
) -> LogitLens:
    """The final norm and unembedding of ``model`` applied to the residual stream of every layer
    (``trace`` needs ``stages=True``); the last row equals the model's own logits' top-k.

    Computed by chunks of ``chunk`` positions: at most ``(chunk, V)`` logits exist at a time, never
    ``(L, T, V)``. By default everything is computed in the model's dtype, exactly. With
    ``search_dtype`` narrower than the model's (``torch.bfloat16``), the vocabulary is searched in it
    for the :data:`LENS_CANDIDATES` likeliest tokens of each position, which are then scored again
    exactly; the softmax's normaliser adds the exact terms of those candidates to the searched terms of
    the rest of the vocabulary. The top-k ids are then the model's own and their probabilities within
    0.1% (relative) of the exact ones (about 1e-4 on SmolLM2). On a 2-core AVX512-BF16 CPU that search
    took as long as the exact lens (its two bfloat16 products, the candidates' gathering and re-scoring
    cost what float32 saves), hence not the default; it may pay where bfloat16 is much faster.
    """
    attention_layers(model)
    _check_trace(trace, "logit_lens")
    trace._need_stages("logit_lens")
    if trace.logits is None:
        raise ValueError("logit_lens needs a trace with logits: trace(model, idx, stages=True, logits=True)")
    k = positive_int("k", k)
    chunk = positive_int("chunk", chunk)
    head = model.out_head
    if not isinstance(head, nn.Linear):
        raise TypeError(f"logit_lens needs model.out_head to be an nn.Linear, got {type(head).__name__}")
    W, bias = head.weight, head.bias  # (V, d), (V,) or None
    V = W.shape[0]
    k = min(k, V)
    n_cand = min(V, max(LENS_CANDIDATES, k))
    search = W.dtype if search_dtype is None else search_dtype
    W_search = W if search == W.dtype else W.to(search)  # (V, d): one copy for all chunks
    final = trace.logits.argmax(dim=-1)  # (B, T): the token the model finally ranks first
    L, (B, T) = trace.n_layers, final.shape
    tokens = torch.empty(L + 1, B, T, k, dtype=torch.long, device=W.device)
    probs = torch.empty(L + 1, B, T, k, dtype=torch.float32, device=W.device)
    final_probs = torch.empty(L + 1, B, T, dtype=torch.float32, device=W.device)
    with torch.no_grad():
        for layer in range(L + 1):
            for b in range(B):
                for s in range(0, T, chunk):
                    e = min(T, s + chunk)
                    f = final[b, s:e, None]  # (c, 1)
                    if layer == L:  # after the last block the lens is the model's own head: its logits are here
                        ids, vals, fval, lse = _exact_rows(trace.logits[b, s:e].float(), f, k)
                    else:
                        h = model.final_norm(trace.residual[layer, b, s:e])  # (c, d)
                        ids, vals, fval, lse = _lens_rows(h, W, bias, W_search, f, k, n_cand)
                    tokens[layer, b, s:e] = ids
                    probs[layer, b, s:e] = (vals.float() - lse).exp()
                    final_probs[layer, b, s:e] = (fval.float() - lse).exp().squeeze(-1)
    return LogitLens(tokens, probs, final_probs)


def _logsumexp(x: Tensor, at: Tensor) -> Tensor:
    """``(..., 1)`` float32 ``logsumexp`` of the last dim through ``log_softmax`` (one fused kernel on CPU,
    several times faster there than ``torch.logsumexp``): ``lse = x_i - log_softmax(x)_i`` at ``at (..., 1)``,
    the index of the largest ``x`` (where the difference loses no precision)."""
    x = x.float()
    return x.gather(-1, at) - torch.log_softmax(x, dim=-1).gather(-1, at)


def _exact_rows(logits: Tensor, final: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Exact ``logits (c, V)``: the top-``k`` ids and logits ``(c, k)``, the logit of ``final (c, 1)``
    and the normaliser ``lse (c, 1)``."""
    top = torch.topk(logits, k, dim=-1)
    return top.indices, top.values, logits.gather(-1, final), _logsumexp(logits, top.indices[:, :1])


def _lens_rows(
    h: Tensor, W: Tensor, bias: Tensor | None, W_search: Tensor, final: Tensor, k: int, n_cand: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The lens of ``h (c, d)`` (already through the final norm): the top-``k`` ids and their exact
    logits ``(c, k)``, the exact logit of ``final (c, 1)`` and the normaliser ``lse (c, 1)`` (float32).

    ``W_search`` scores the whole vocabulary (maybe in a narrower dtype); the ``n_cand`` best and the
    final token are scored again with ``W`` exactly; the normaliser is ``log(sum over candidates of
    exp(exact) + sum over the rest of exp(searched))``."""
    if W_search.dtype == h.dtype:  # the model's own dtype: the logits are exact, nothing to re-score
        return _exact_rows(F.linear(h, W, bias).float(), final, k)
    else:
        # h in two narrow parts, h = hi + lo: rounding h alone would shift every logit alike along the
        # direction the unembedding's rows share (+0.02 on SmolLM2, 1% of the normaliser). Both parts
        # go through one product; what remains is each logit's own small rounding, which averages out.
        hi = h.to(W_search.dtype)
        lo = (h - hi.to(h.dtype)).to(W_search.dtype)
        both = F.linear(torch.cat([hi, lo]), W_search).float()  # (2c, V)
        c = h.shape[0]
        approx = both[:c] + both[c:]
        if bias is not None:
            approx = approx + bias.float()
    best = torch.topk(approx, n_cand, dim=-1).indices  # (c, n), the largest first
    cand = torch.cat([best, final], dim=-1)  # (c, n + 1)
    exact = torch.einsum("cd,cnd->cn", h, W[cand])  # (c, n + 1): each candidate's logit, exactly
    if bias is not None:
        exact = exact + bias[cand]
    exact = exact.float()
    # The final token may be a candidate already: count it once (its copy at the end is not summed).
    dup = (cand[:, :-1] == final).any(-1, keepdim=True)  # (c, 1)
    lse_all = _logsumexp(approx, best[:, :1])  # (c, 1)
    m = torch.maximum(lse_all, exact.amax(-1, keepdim=True))  # a common scale: no exp overflows
    searched = (approx.gather(-1, cand) - m).exp()  # (c, n + 1): the searched terms the exact ones replace
    exact_terms = (exact - m).exp()
    last = (~dup).float()
    rest = (lse_all - m).exp() - searched[:, :-1].sum(-1, keepdim=True) - searched[:, -1:] * last
    # The searched logits are off by small random errors d, and E[exp(l + d)] = exp(l + var(d) / 2): a
    # bias of the sum, not noise. The candidates, scored both ways, measure var(d) for the row.
    var = (approx.gather(-1, cand) - exact).var(-1, keepdim=True)  # (c, 1); 0 when exact
    rest = rest * (-var / 2).exp()
    total = rest.clamp_min(0) + exact_terms[:, :-1].sum(-1, keepdim=True) + exact_terms[:, -1:] * last
    lse = m + total.log()  # (c, 1)
    top = torch.topk(exact[:, :-1], k, dim=-1)
    return cand.gather(-1, top.indices), top.values, exact[:, -1:], lse


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
        if logits.logits is None:
            raise ValueError("next_token_probabilities needs a trace with logits: trace(..., logits=True)")
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
        trace = run_trace(model, idx, logits=False)  # the attention is all the scores read
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
