"""Reading a trace: attention rollout, the logit lens, head roles and next-token probabilities."""

from __future__ import annotations

import threading
import weakref
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from attnlab import hardware
from attnlab.checks import is_int, position_window, positive_int
from attnlab.generation import SamplingConfig
from attnlab.interpret import codec
from attnlab.interpret.hooks import attention_layers, eval_mode
from attnlab.interpret.tracing import Trace
from attnlab.interpret.tracing import trace as run_trace
from attnlab.quantized import is_quantized, stored_tensors

__all__ = [
    "HEAD_KINDS",
    "AnswerRank",
    "LogitLens",
    "answer_ranks",
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
    a = fuse(w, dim=2).float()  # (L, B, T, T), a fresh tensor: the steps below work in place
    a.diagonal(dim1=-2, dim2=-1).add_(1.0)  # the residual path: + I
    a.div_(a.sum(dim=-1, keepdim=True))  # rows sum to 1
    # A causal model's weights are lower triangles, and so are their products: the trace says so for a
    # causal pass (a mask of its own may make them so too: then the values tell).
    causal = all(trace.is_causal) or not bool(torch.triu(a, diagonal=1).any())
    out = a[0]
    for layer in a[1:]:
        out = _tril_matmul(layer, out) if causal else layer @ out  # (B, T, T)
    return out


def _tril_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` for lower-triangular ``a, b (..., T, T)``, skipping the zero upper-right blocks: in
    halves, ``[[A1, 0], [B1, C1]] @ [[A2, 0], [B2, C2]] = [[A1 A2, 0], [B1 A2 + C1 B2, C1 C2]]``, the
    diagonal blocks recursively (a third of the multiplications of a dense product)."""
    T = a.shape[-1]
    if T <= 160:
        return a @ b
    h = T // 2
    out = torch.empty_like(a)
    out[..., :h, h:] = 0
    out[..., :h, :h] = _tril_matmul(a[..., :h, :h], b[..., :h, :h])
    out[..., h:, h:] = _tril_matmul(a[..., h:, h:], b[..., h:, h:])
    lower = a[..., h:, h:] @ b[..., h:, :h]  # (..., T - h, h)
    if lower.dim() == 3:  # the second product added in place
        lower.baddbmm_(a[..., h:, :h], b[..., :h, :h])
    else:
        lower += a[..., h:, :h] @ b[..., :h, :h]
    out[..., h:, :h] = lower
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


# Streams (layer, position) per step of the lens: a (512, V) block of logits. Each chunk reads the
# unembedding once, so larger chunks read it fewer times, at the cost of a larger block of logits.
LENS_CHUNK = 512
# Rows of the search's (c, V) logits per pass over them (the float32 copy, the block maxima, the softmax):
# a few MB, small enough to stay in the CPU's caches from one pass to the next.
LENS_SUB = 64
LENS_FINAL_CHUNK = 128  # positions per step of the lens's last row (the model's own logits, from the trace)
LENS_CANDIDATES = 128  # tokens per position the fast search hands to the exact scoring
LENS_SPLIT = 16  # dims of h whose bfloat16 rounding the fast search carries in extra columns
LENS_MIN_VOCAB = 4096  # the fast search pays only for a large vocabulary (SmolLM2: 49152, GPT-2: 50257)


def lens_logits(model: nn.Module, residual: Tensor) -> Tensor:
    """The final norm and the unembedding applied to a residual stream ``(..., d)``: ``(..., V)``, soft-capped
    as the model's own logits are where it caps them (Gemma 2's ``logit_softcap``): :meth:`attnlab.GPT.unembed`."""
    with torch.no_grad():
        return model.unembed(residual)


def _softcap(model: nn.Module) -> float | None:
    return getattr(getattr(model, "config", None), "logit_softcap", None)


def _capped(model: nn.Module, logits: Tensor) -> Tensor:
    """``cap * tanh(logits / cap)`` (in place) for a model with ``config.logit_softcap``, else ``logits``."""
    cap = _softcap(model)
    return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)


def logit_lens(
    model: nn.Module,
    trace: Trace,
    *,
    k: int = 5,
    chunk: int = LENS_CHUNK,
    search_dtype: torch.dtype | None = None,
    positions: tuple[int, int] | None = None,
) -> LogitLens:
    """The final norm and unembedding of ``model`` applied to the residual stream of every layer
    (``trace`` needs ``stages=True``); the last row equals the model's own logits' top-k.
    ``positions=(start, stop)``: only those positions (the result's ``T`` is ``stop - start``).

    Computed by chunks of ``chunk`` streams (a layer's stream at one position; a chunk spans layers):
    at most ``(chunk, V)`` logits exist at a time, never ``(L, T, V)``. The ``L x T x V x d`` product
    is the lens's cost, so where bfloat16 is native (:func:`attnlab.hardware.bf16_native`), the model
    is float32, the vocabulary large (``>= LENS_MIN_VOCAB``) and the head has no bias, the vocabulary
    is searched by one bfloat16 product (``search_dtype=None``, the default); ``search_dtype=torch.float32``
    (the model's dtype) forces the exact lens everywhere, ``torch.bfloat16`` the search everywhere:

    * The search runs against the *centred* unembedding ``W - mean(W)`` (softmax ignores the
      per-position constant ``h . mean(W)``; without it, rounding ``h`` shifts all logits alike along
      the direction the rows share), with the bfloat16 rounding of ``h``'s :data:`LENS_SPLIT` largest
      dimensions (the stream's outliers) carried in extra columns.
    * Its :data:`LENS_CANDIDATES` best tokens and the final token are scored again exactly; the
      top-k ids come from those exact scores and are *verified*: the k-th exact logit must exceed the
      best token left out by more than the product's rounding bound (``3u |h| max|w_j|`` and the
      output's rounding, ``u = 2^-8``). A position that fails (rare) is recomputed exactly.
      The top-k ids are thus the exact lens's (up to exact ties), their logits exact.
    * The normaliser adds the candidates' exact terms to the searched terms of the rest, corrected for
      the noise's bias (``E exp(l + e) = exp(l) exp(var(e) / 2)``, the variance measured on the
      candidates). Its error is the probabilities' relative error, a small fraction of a percent.

    The centred bfloat16 unembedding is made once per head and kept while the head lives; each call
    checks it against a CRC-32 of the weight's bytes, so an edit to the weight, even through ``.data``,
    is never served from a stale copy.

    A model whose logits are soft-capped (Gemma 2's ``logit_softcap``) has every row capped as its own
    logits are, and the exact lens (the search's centring does not commute with the cap).
    """
    k, chunk = _check_lens_args(model, trace, k, chunk, search_dtype)
    W = model.out_head.weight  # (V, d)
    k = min(k, W.shape[0])
    n_cand = min(W.shape[0], max(LENS_CANDIDATES, k))
    fast = _searches(model, search_dtype, n_cand)
    start, stop = position_window("positions", positions, trace.logits.shape[1])
    final = trace.logits[:, start:stop].argmax(dim=-1)  # (B, T): the token the model finally ranks first
    L, (B, T) = trace.n_layers, final.shape
    lens = LogitLens(
        tokens=torch.empty(L + 1, B, T, k, dtype=torch.long, device=W.device),
        probs=torch.empty(L + 1, B, T, k, dtype=torch.float32, device=W.device),
        final_token_probs=torch.empty(L + 1, B, T, dtype=torch.float32, device=W.device),
    )
    with torch.no_grad():
        _lens_of_layers(lens, model, trace, final, start, stop, chunk, n_cand if fast else None)
        _lens_of_output(lens, trace, final, start, chunk)
    return lens


def _check_lens_args(
    model: nn.Module, trace: Trace, k: int, chunk: int, search_dtype: torch.dtype | None
) -> tuple[int, int]:
    """:func:`logit_lens`'s arguments checked; ``k`` and ``chunk`` as ints."""
    layers = attention_layers(model)
    _check_trace(trace, "logit_lens")
    trace._need_stages("logit_lens")
    if trace.logits is None:
        raise ValueError("logit_lens needs a trace with logits: trace(model, idx, stages=True, logits=True)")
    k = positive_int("k", k)
    chunk = positive_int("chunk", chunk)
    head = model.out_head
    if not isinstance(head, nn.Linear):
        raise TypeError(f"logit_lens needs model.out_head to be an nn.Linear, got {type(head).__name__}")
    # A trace of another model: as many layers, the same width and vocabulary (else wrong rows, silently)
    d, V = head.weight.shape[1], head.weight.shape[0]
    got = (trace.n_layers, trace.residual.shape[-1], trace.logits.shape[-1])
    if got != (len(layers), d, V):
        raise ValueError(
            f"trace is of another model: {got[0]} layers, width {got[1]}, vocabulary {got[2]}; this model has "
            f"{len(layers)}, {d}, {V}"
        )
    if search_dtype not in (None, torch.float32, torch.float64, torch.bfloat16, head.weight.dtype):
        raise ValueError(f"search_dtype must be None, the model's dtype or torch.bfloat16, got {search_dtype}")
    return k, chunk


def _searches(model: nn.Module, search_dtype: torch.dtype | None, n_cand: int) -> bool:
    """Whether :func:`logit_lens` searches the vocabulary in bfloat16 (``n_cand`` candidates a position)
    rather than computing the exact lens: see its docstring."""
    W, bias = model.out_head.weight, model.out_head.bias  # (V, d), (V,) or None
    V = W.shape[0]
    if search_dtype is None:
        fast = W.dtype == torch.float32 and bias is None and V >= LENS_MIN_VOCAB and hardware.bf16_native(W.device)
    else:
        fast = search_dtype == torch.bfloat16 and W.dtype != torch.bfloat16 and bias is None and n_cand < V
    # A soft cap (Gemma 2) bends every logit: the search's centred logits (each position's constant left
    # out) would no longer be the capped ones less a constant, so such a model's lens is the exact one.
    return fast and _softcap(model) is None


def _put(lens: LogitLens, rows: slice, ids: Tensor, vals: Tensor, fval: Tensor, lse: Tensor) -> None:
    """Rows ``rows`` of the lens's ``(L + 1) * B * T`` (layer, row, position) triples, in that order: the
    top-k ids, their logits ``vals`` and the final token's ``fval``, made probabilities by ``lse``."""
    k = lens.tokens.shape[-1]
    lens.tokens.view(-1, k)[rows] = ids
    lens.probs.view(-1, k)[rows] = (vals.float() - lse).exp()
    lens.final_token_probs.view(-1)[rows] = (fval.float() - lse).exp().squeeze(-1)


def _lens_of_layers(
    lens: LogitLens,
    model: nn.Module,
    trace: Trace,
    final: Tensor,
    start: int,
    stop: int,
    chunk: int,
    n_cand: int | None,
) -> None:
    """The lens's rows ``0..L-1`` (the stream entering each block), searched in bfloat16 over ``n_cand``
    candidates a position, or (None) exact."""
    head = model.out_head
    W, bias = head.weight, head.bias
    L, (B, T), k = trace.n_layers, final.shape, lens.tokens.shape[-1]
    # By chunks of `chunk` (layer, row, position) triples across layers: a window of a few positions
    # reads the unembedding once or twice, not once per layer.
    n = L * B * T
    search = _Search(model, trace, W, min(chunk, n)) if n_cand is not None and n else None  # buffers for a chunk
    residual = trace.residual[:L, :, start:stop]  # (L, B, T, d), a view
    for s in range(0, n, chunk):
        r = torch.arange(s, min(n, s + chunk), device=W.device)  # (c,) flat (layer, row, position)
        layer, b, t = r // (B * T), r // T % B, r % T
        h = model.final_norm(residual[layer, b, t])  # (c, d)
        f = final[b, t, None]  # (c, 1)
        if search is None:
            logits = _capped(model, hardware.linear(h, W, bias).float())  # (c, V)
            _put(lens, slice(s, s + len(r)), *_exact_rows(logits, f, k, spend=True))
        else:
            _put(lens, slice(s, s + len(r)), *search.rows(h, W, f, k, n_cand))


def _lens_of_output(lens: LogitLens, trace: Trace, final: Tensor, start: int, chunk: int) -> None:
    """The lens's last row: after the last block the lens is the model's own head, whose logits are in
    the trace. No product here, so a small step: each takes two (step, V) float32 temporaries."""
    L, (B, T), k = trace.n_layers, final.shape, lens.tokens.shape[-1]
    n = L * B * T  # the rows before
    step = min(chunk, LENS_FINAL_CHUNK)
    for b in range(B):
        for s in range(0, T, step):
            e = min(T, s + step)
            logits = trace.logits[b, start + s : start + e].float()  # (c, V)
            _put(lens, slice(n + b * T + s, n + b * T + e), *_exact_rows(logits, final[b, s:e, None], k))


# How far below a row's largest logit :func:`logsumexp_at` lifts the rest. exp(x - max) under -87 is a
# float32 denormal, which CPUs compute far slower than a normal number, and a softmax at a cold
# temperature has thousands of them. A lifted term is at most e^-80 of the largest, so a vocabulary of
# them moves the sum by less than 1e-29 of itself, far below float32's rounding.
LSE_FLOOR = 80.0


def logsumexp_at(x: Tensor, at: Tensor, *, spend: bool = False) -> Tensor:
    """``(..., 1)`` float32 ``logsumexp`` of the last dim through ``log_softmax`` (one fused kernel on CPU,
    several times faster there than ``torch.logsumexp``): ``lse = x_i - log_softmax(x)_i`` at ``at (..., 1)``,
    the index of the largest ``x`` (where the difference loses no precision). Terms more than
    :data:`LSE_FLOOR` below the largest count as that far below (no denormals). ``spend=True``: a float32
    ``x`` is overwritten instead of copied (no second ``(c, V)`` tensor)."""
    x = x.float()
    top = x.gather(-1, at)  # (..., 1)
    lifted = torch.maximum(x, top - LSE_FLOOR, out=x if spend else None)
    return top - torch.log_softmax(lifted, dim=-1, out=lifted).gather(-1, at)


def _exact_rows(logits: Tensor, final: Tensor, k: int, *, spend: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Exact ``logits (c, V)``: the top-``k`` ids and logits ``(c, k)``, the logit of ``final (c, 1)``
    and the normaliser ``lse (c, 1)``; ``spend=True`` overwrites ``logits`` (see :func:`logsumexp_at`)."""
    top = torch.topk(logits, k, dim=-1)
    fval = logits.gather(-1, final)
    return top.indices, top.values, fval, logsumexp_at(logits, top.indices[:, :1], spend=spend)


# Vocabulary entries per block of the search's two-level top-n: it selects among V / 32 block maxima, then
# among the 32 n entries of the n best blocks (larger blocks lengthen the second level, smaller the first).
LENS_BLOCK = 32


class _Search:
    """The fast search's unembedding and its buffers, for one :func:`logit_lens` call.

    ``weight (V, d + m)`` bfloat16 is ``W_c = W - mean(W)`` with the columns of ``h``'s ``m`` largest
    dimensions repeated (they multiply the rounding of ``h`` there); ``row_norm`` is ``max_j |W_c[j]|``.
    They come from :func:`_centred_unembedding` (made once per head while its weight stays the same).
    The ``(c, V)`` bfloat16 logits (``c``: streams per chunk) and the ``(LENS_SUB, V)`` float32 copy of a
    few of their rows live in buffers allocated once: a fresh one per chunk would cost its page faults."""

    def __init__(self, model: nn.Module, trace: Trace, W: Tensor, c: int) -> None:
        big = torch.stack([model.final_norm(r).abs().amax((0, 1)) for r in trace.residual[:-1]]).amax(0)  # (d,)
        self.dims = torch.topk(big, min(LENS_SPLIT, big.numel())).indices  # (m,)
        self.weight, self.mean, self.row_norm = _centred_unembedding(model.out_head, W, self.dims)
        V = W.shape[0]
        Vp = -(-V // LENS_BLOCK) * LENS_BLOCK  # padded to whole blocks with -inf (nothing, to a softmax)
        self.narrow = torch.empty(c, V, dtype=torch.bfloat16, device=W.device)  # (c, V) the product
        self.wide = torch.full((min(c, LENS_SUB), Vp), float("-inf"), dtype=torch.float32, device=W.device)  # (sub, Vp)

    def rows(self, h: Tensor, W: Tensor, final: Tensor, k: int, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The lens of ``h (c, d)`` (through the final norm) as :func:`_exact_rows` returns it, the
        logits centred (``h . mean`` left out of all of them, the normaliser included)."""
        c, V = h.shape[0], W.shape[0]
        hb = h.to(torch.bfloat16)
        lo = (h - hb.to(h.dtype))[:, self.dims].to(torch.bfloat16)  # (c, m): what rounding lost there
        narrow = torch.mm(torch.cat([hb, lo], dim=1), self.weight.t(), out=self.narrow[:c])  # (c, V) centred
        # The n best in two steps: the n blocks with the largest maxima hold a top-n set (a block with
        # one of them has a maximum at least the n-th value), then the n best of those blocks' entries.
        nb_all = self.wide.shape[1] // LENS_BLOCK
        nb = min(n, nb_all)
        top_blocks = torch.empty(c, nb, dtype=torch.long, device=h.device)  # (c, nb) and their indices
        inside = torch.empty(c, nb * LENS_BLOCK, dtype=torch.float32, device=h.device)  # (c, nb * 32) their entries
        best_values = torch.empty(c, n, dtype=torch.float32, device=h.device)  # (c, n) the n best, in no order
        best_cols = torch.empty(c, n, dtype=torch.long, device=h.device)  # (c, n) their columns of `inside`
        lse_all = torch.empty(c, 1, dtype=torch.float32, device=h.device)  # (c, 1) the normaliser of all V
        # Every pass over the (c, V) logits by `sub` rows at a time, which stay in the caches (see LENS_SUB).
        sub = self.wide.shape[0]
        for s in range(0, c, sub):
            e = min(c, s + sub)
            x = self.wide[: e - s]  # (r, Vp), -inf past V
            x[:, :V].copy_(narrow[s:e])
            blocks = x.view(e - s, nb_all, LENS_BLOCK)  # (r, nb_all, 32)
            block_max = blocks.amax(-1)  # (r, nb_all)
            top_blocks[s:e] = torch.topk(block_max, nb, dim=-1, sorted=False).indices
            r = torch.arange(e - s, device=h.device)  # (r,)
            rows = top_blocks[s:e] + r[:, None] * nb_all  # (r, nb), the flat view's
            torch.index_select(blocks.view(-1, LENS_BLOCK), 0, rows.view(-1), out=inside[s:e].view(-1, LENS_BLOCK))
            # (a top-n of those entries here, while they are in the caches; unsorted: the exact scoring
            # below ranks them)
            torch.topk(inside[s:e], n, dim=-1, sorted=False, out=(best_values[s:e], best_cols[s:e]))
            # The normaliser at each row's largest entry (x is spent: its log-softmax in place).
            first = best_cols[s:e].gather(1, best_values[s:e].argmax(-1, keepdim=True))  # (r, 1) its column of `inside`
            at = top_blocks[s:e].gather(1, first // LENS_BLOCK) * LENS_BLOCK + first % LENS_BLOCK  # (r, 1) of x
            lse_all[s:e] = logsumexp_at(x, at, spend=True)
        best_ids = top_blocks.gather(1, best_cols // LENS_BLOCK) * LENS_BLOCK + best_cols % LENS_BLOCK  # (c, n)
        cand = torch.cat([best_ids, final], dim=-1)  # (c, n + 1)
        searched = narrow.gather(-1, cand).float()  # (c, n + 1), the float32 copy's values
        off = h @ self.mean  # (c,): the constant the centring leaves out
        # Nearby positions share most candidates: one product with the distinct rows is cheaper than
        # gathering (c, n + 1, d) weights.
        uniq, where = torch.unique(cand, return_inverse=True)  # (u,), (c, n + 1)
        exact = hardware.linear(h, W.index_select(0, uniq)).gather(-1, where).float() - off[:, None].float()  # (c, n+1)
        top = torch.topk(exact[:, :-1], k, dim=-1)
        nth = best_values.amin(-1)  # (c,) the n-th best searched value
        # Verified: every token left out scores at most nth searched, so at most that plus
        # the rounding bound exactly (h and W_c rounded: 2u per product term + u for the split's
        # remainder, |sum h_i w_i| <= |h| |w|; the float32 accumulation; the bfloat16 output: u |value|).
        u = 2.0**-8
        d = self.weight.shape[1]
        bound = (3 * u + 3 * u * u + d * 2.0**-23) * h.norm(dim=-1) * self.row_norm + 2 * u * nth.abs()
        ok = top.values[:, -1] > nth + bound  # (c,)
        # The normaliser: the exact terms of the candidates, the searched terms of the rest.
        dup = (cand[:, :-1] == final).any(-1, keepdim=True)  # (c, 1): the final token among the candidates
        m = torch.maximum(lse_all, exact.amax(-1, keepdim=True))  # a common scale: no exp overflows
        last = (~dup).float()
        s_terms, e_terms = (searched - m).exp(), (exact - m).exp()
        rest = (lse_all - m).exp() - s_terms[:, :-1].sum(-1, keepdim=True) - s_terms[:, -1:] * last
        # The searched logits are off by small errors e, and E[exp(l + e)] = exp(l + var(e) / 2): a bias
        # of the sum, not noise. The candidates, scored both ways, measure var(e) for the row.
        rest = rest * (-(searched - exact).var(-1, keepdim=True) / 2).exp()
        total = rest.clamp_min(0) + e_terms[:, :-1].sum(-1, keepdim=True) + e_terms[:, -1:] * last
        ids, vals, fval, lse = cand.gather(-1, top.indices), top.values, exact[:, -1:], m + total.log()
        if not bool(ok.all()):  # the bound does not hold: these positions exactly
            bad = (~ok).nonzero().squeeze(-1)
            logits = hardware.linear(h[bad], W).float() - off[bad, None].float()
            ids[bad], vals[bad], fval[bad], lse[bad] = _exact_rows(logits, final[bad], k, spend=True)
        return ids, vals, fval, lse


# The centred bfloat16 unembedding of each head the lens has searched, kept while the head lives:
# making it (a pass over the whole V x d weight) costs more than the search of a few positions.
_CENTRED: weakref.WeakKeyDictionary[nn.Module, _Centred] = weakref.WeakKeyDictionary()
_CENTRED_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Centred:
    key: tuple  # what the weight was when these were made: see _weight_key
    dims: Tensor  # (m,) the dimensions whose columns are repeated
    weight: Tensor  # (V, d + m) bfloat16
    mean: Tensor  # (d,)
    row_norm: float


def _weight_key(W: Tensor) -> tuple | None:
    """What the cache checks before it serves the centred copy of ``W``: its storage, shape, dtype and
    a CRC-32 of its bytes (in pieces, on as many threads as torch uses: zlib lets go of the GIL), far
    cheaper than remaking the copy. The bytes, not the version counter: an edit through ``.data``
    (``W.data[...] = 0``) bumps none. A CRC catches every change to one element (a burst of at most 32
    bits), and a change to many with probability ``1 - 2^-32`` per piece. None (nothing cached) off the
    CPU or for a strided weight: a GPU makes the copy in about the time it would take to check it."""
    if W.device.type != "cpu" or not (is_quantized(W) or W.is_contiguous()):
        return None
    # A quantized weight's bytes are its blocks' (read as they are: dequantizing would make the copy)
    tensors = stored_tensors(W)
    key = [tensors[0].data_ptr(), tuple(W.shape), W.dtype]
    for t in tensors:
        pieces = codec.split(t.contiguous().reshape(-1).view(torch.uint8).numpy(), torch.get_num_threads())
        key += [len(pieces[0]), *codec.on_threads(zlib.crc32, pieces)]
    return tuple(key)


def _centred_unembedding(head: nn.Module, W: Tensor, dims: Tensor) -> tuple[Tensor, Tensor, float]:
    """``(weight (V, d + m) bfloat16, mean (d,), row_norm)`` of :class:`_Search` for ``head``'s weight
    ``W``, from the cache when ``W`` is what it was (:func:`_weight_key`); only the ``m`` repeated
    columns are remade when ``dims`` differ."""
    key = _weight_key(W)
    with _CENTRED_LOCK:
        hit = _CENTRED.get(head) if key is not None else None
    if hit is not None and hit.key == key:
        if not torch.equal(hit.dims, dims):  # the same rounded values, other columns repeated
            d = W.shape[1]
            weight = torch.cat([hit.weight[:, :d], hit.weight[:, dims]], dim=1)  # (V, d + m)
            hit = _Centred(key, dims, weight, hit.mean, hit.row_norm)
            with _CENTRED_LOCK:
                _CENTRED[head] = hit
        return hit.weight, hit.mean, hit.row_norm
    (V, d), m = W.shape, len(dims)

    def rows(s: int) -> Tensor:  # (8192, d) dense: a quantized weight's blocks dequantized a slice at a time
        # (by its own method: a generic op on the weight type would import torch's DTensor, a second)
        return W[s : s + 8192].dequantize() if is_quantized(W) else W[s : s + 8192]

    wide = hardware.float64_device(W.device)  # (the CPU for MPS, which has no float64)
    mean = (sum(rows(s).to(wide).sum(0, dtype=torch.float64) for s in range(0, V, 8192)) / V).to(W.device, W.dtype)
    weight = torch.empty(V, d + m, dtype=torch.bfloat16, device=W.device)  # (V, d + m)
    row_norm = 0.0
    for s in range(0, V, 8192):  # by blocks of rows: no float32 copy of the whole unembedding
        centred = rows(s) - mean  # (8192, d)
        weight[s : s + 8192, :d] = centred
        weight[s : s + 8192, d:] = centred[:, dims]
        row_norm = max(row_norm, float(centred.norm(dim=-1).amax()))
    if key is not None:
        with _CENTRED_LOCK:
            _CENTRED[head] = _Centred(key, dims, weight, mean, row_norm)
    return weight, mean, row_norm


# --------------------------------------------------------------------------------------------
# Next-token probabilities
# --------------------------------------------------------------------------------------------
def next_token_probabilities(
    logits: Tensor | Trace, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
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


@dataclass(frozen=True)
class AnswerRank:
    """How a model ranks one token of an answer after the prompt and the answer's tokens before it.

    ``position`` is the prompt-and-answer position whose logits predict ``token``; ``rank`` counts the
    tokens with a larger logit (0: the model's first choice); ``top``: ``(token, logit, probability)``
    of the model's ``top_k`` first choices there, best first."""

    token: int
    position: int
    rank: int
    logit: float
    probability: float
    top: tuple[tuple[int, float, float], ...]

    def describe(self, decode: Callable[[int], str]) -> str:
        """TransformerLens's ``utils.test_prompt`` lines for this token, ``decode`` naming tokens."""
        answer = f"Logit: {self.logit:5.2f} Prob: {self.probability:6.2%} Token: |{decode(self.token)}|"
        lines = [f"Rank: {self.rank:<8d} {answer}"]
        for i, (tok, logit, prob) in enumerate(self.top):
            lines.append(f"Top {i}th token. Logit: {logit:5.2f} Prob: {prob:6.2%} Token: |{decode(tok)}|")
        return "\n".join(lines)


def answer_ranks(
    model: nn.Module, prompt: Tensor | Sequence[int], answer: Tensor | Sequence[int], *, top_k: int = 10
) -> list[AnswerRank]:
    """TransformerLens's ``utils.test_prompt`` as numbers: the answer's tokens appended to the prompt,
    one forward, and at each answer token its rank, logit and probability, with the ``top_k`` first
    choices there (:meth:`AnswerRank.describe` prints them as TransformerLens does).

    ``prompt (T,)`` and ``answer (A,)``: token ids (or ``(1, T)``, ``(1, A)``; or lists of ints, as
    ``tokenizer.encode`` gives them); ``T + A`` at most the model's context. Returns one
    :class:`AnswerRank` per answer token, in order.
    """
    positive_int("top_k", top_k)
    ids = []
    for name, t in (("prompt", prompt), ("answer", answer)):
        if isinstance(t, (list, tuple)) and all(is_int(i) for i in t):
            t = torch.tensor(t, dtype=torch.long, device=next(model.parameters()).device)
        if not isinstance(t, Tensor) or t.dim() not in (1, 2) or (t.dim() == 2 and t.shape[0] != 1):
            got = f"shape {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be the token ids of one sequence, (n,) or (1, n), got {got}")
        if t.numel() == 0:
            raise ValueError(f"{name} must hold at least one token, got none")
        ids.append(t.reshape(-1))
    idx = torch.cat(ids)[None]  # (1, T + A)
    with eval_mode(model), torch.no_grad():  # (no dropout: the model's own ranking)
        logits = model(model.check_idx(idx) if hasattr(model, "check_idx") else idx)[0]  # (T + A, V)
    rows = []
    for i, token in enumerate(ids[1].tolist()):
        at = ids[0].numel() - 1 + i  # (the logits after position `at` predict token `at + 1`)
        row = hardware.as_float64(logits[at])  # (V,)
        probs = row.softmax(-1)
        best = row.topk(min(top_k, row.numel()))
        top = zip(best.indices.tolist(), best.values.tolist(), probs[best.indices].tolist(), strict=True)
        rank = int((row > row[token]).sum())
        rows.append(AnswerRank(token, at, rank, float(row[token]), float(probs[token]), tuple(top)))
    return rows


# --------------------------------------------------------------------------------------------
# Head roles
# --------------------------------------------------------------------------------------------
def repeated_tokens(vocab_size: int, context_length: int, *, seed: int = 0, batch: int = 2) -> Tensor:
    """``(batch, 2n)`` rows of ``n`` random distinct tokens repeated twice, ``n = min(context // 2,
    vocab, 64)``: on them an induction head's target is known (the token after the first copy)."""
    batch = positive_int("batch", batch)
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
        # The mean over the queries with a target of the weight each head gives its targets: a sum over
        # the few (query, key) pairs that count, gathered (no (L, B, H, T, S) product: such temporaries
        # would cost more than the rest of the head roles' work).
        b, t, s = targets.to(w.device).nonzero(as_tuple=True)  # (n,) x3
        out[kind] = w[:, b, :, t, s].sum(0) / valid.sum()  # (n, L, H) -> (L, H)
    return out
