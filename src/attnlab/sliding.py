"""Sliding-window causal attention in O(T * W) time and O(T) memory on the CPU.

Query ``p`` sees keys ``p - W < j <= p`` (Mistral's window ``W``), plus, with ``sinks = n``, the first
``n`` keys (StreamingLLM's attention sinks). A dense ``(T, T)`` mask would make torch's fused kernel
do T^2 work for T * W useful scores. Here the queries are cut into blocks of ``Bq`` rows, and each
block attends, in one fused call, to the band of keys it can see::

    rows [0, H0)                  : causal attention over keys [0, H0)    (the window cannot bite yet)
    block i, rows [r0, r0 + Bq)   : keys [r0 - m*Bq, r0 + Bq), a (Bq, (m+1)*Bq) band mask
    the last rows (< Bq of them)  : the same, with a shorter band
    sinks                         : rows [W, T) against keys [0, n), merged by log-sum-exp

The key bands of consecutive blocks overlap; they are strided *views* of the key tensor (no copy),
and the backward pass adds the overlapping gradients back chunk by chunk. The work is about
``T * (W + Bq)`` scores instead of the ``T^2 / 2`` of full causal attention.

The fused calls are torch's CPU flash-attention kernel and its backward
(``aten::_scaled_dot_product_flash_attention_for_cpu``), which return the log-sum-exp that merging
the sink part needs and accept the strided views. :func:`available` says whether this torch has them.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["BLOCKS_PER_CALL", "available", "block_size", "key_chunk", "sliding_window_attention"]

# Query blocks per kernel call: fewer, larger calls pay each call's fixed cost fewer times; groups
# bound the temporary buffers of very long sequences.
BLOCKS_PER_CALL = 32

try:
    _OPS = (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    )
except (AttributeError, RuntimeError):  # pragma: no cover - older or trimmed torch builds
    _OPS = None


def available() -> bool:
    """Whether this torch has the CPU flash-attention kernels the fast path calls."""
    return _OPS is not None


def block_size(window: int) -> int:
    """Query rows per block of the forward pass: a quarter of the window (a block's band is then
    1.25 W keys), at least 32. (Larger blocks compute more masked-out scores in their wider bands;
    much smaller ones call the kernel more often.)"""
    return max(window // 4, 32)


def key_chunk(window: int) -> int:
    """Keys per chunk of the backward pass: half the window, at least 32 (its query windows are then
    1.5 W long; the kernel is about as fast as with smaller chunks, with fewer windows to add up)."""
    return max(window // 2, 32)


@functools.lru_cache(maxsize=16)
def _band_mask(rows: int, keys: int, first_key: int, window: int, dtype: torch.dtype, device) -> Tensor:
    """Float mask ``(rows, keys)``: 0 where query ``r`` (position ``r``) may see key ``c`` (position
    ``first_key + c``), i.e. ``0 <= r - (first_key + c) < window``, else ``-inf``. Cached: a training
    run asks for the same few masks every step (callers never write into them)."""
    r = torch.arange(rows, device=device)[:, None]
    c = torch.arange(keys, device=device)[None, :] + first_key
    visible = (c <= r) & (r - c < window)
    return torch.zeros(rows, keys, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))


def _view(t: Tensor, b: int, start: int, n_blocks: int, step: int, rows: int) -> Tensor:
    """``t (B, H, T, E)``, batch row ``b``: ``n_blocks`` windows of ``rows`` positions starting at
    ``start``, ``start + step``, ...; a ``(n_blocks, H, rows, E)`` view (windows may overlap)."""
    sB, sH, sT, sE = t.stride()
    offset = t.storage_offset() + b * sB + start * sT
    return t.as_strided((n_blocks, t.shape[1], rows, t.shape[3]), (step * sT, sH, sT, sE), offset)


class _Plan:
    """Where the head, the full blocks and the tail of ``T`` query rows lie for window ``W``."""

    def __init__(self, T: int, window: int, sinks: int) -> None:
        self.W = window
        self.Bq = block_size(window)
        self.m = -(-(window - 1) // self.Bq)  # key chunks before a block's own: ceil((W - 1) / Bq)
        self.H0 = min(T, self.m * self.Bq)  # head rows: attend over their own prefix
        self.nf = (T - self.H0) // self.Bq  # full blocks
        self.tail = self.H0 + self.nf * self.Bq  # first row of the tail
        self.Lt = T - self.tail  # tail rows (< Bq)
        self.n = min(sinks, max(T - window, 0))  # sinks that some row sees outside its window


def _groups(count: int) -> list[tuple[int, int]]:
    """``(first, how many)`` of each kernel call over ``count`` blocks (see :data:`BLOCKS_PER_CALL`)."""
    return [(i, min(BLOCKS_PER_CALL, count - i)) for i in range(0, count, BLOCKS_PER_CALL)]


class _SlidingWindow(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int, scale: float) -> Tensor:
        fwd = _OPS[0]
        B, H, T, _ = q.shape
        p = _Plan(T, window, sinks)
        # The output (and the gradients) in the inputs' own memory order: a module's (B, T, H, E)
        # projections then get a free transpose(1, 2).reshape(), and autograd stores the gradients
        # of contiguous leaves without copying them into their layout.
        out = torch.empty_like(q)  # (B, H, T, E)
        # (is_causal masks before it scales: for a scale <= 0, NaN or +inf where the mask's -inf was)
        head_mask = _band_mask(p.H0, p.H0, 0, window, q.dtype, q.device) if window < p.H0 or scale <= 0 else None
        band = _band_mask(p.Bq, (p.m + 1) * p.Bq, -p.m * p.Bq, window, q.dtype, q.device)  # (Bq, (m+1) Bq)
        tail = _band_mask(p.Lt, window - 1 + p.Lt, 1 - window, window, q.dtype, q.device) if p.Lt else None
        # The kernel's log-sum-exp has its own dtype (float32 for half-precision inputs).
        lse = q.new_empty(B, H, T, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        for b in range(B):
            if p.H0:  # (0 when W = 1: every block is then its own band)
                o, lse_b = fwd(*(t[b : b + 1, :, : p.H0] for t in (q, k, v)), 0.0, head_mask is None,
                               attn_mask=head_mask, scale=scale)  # fmt: skip
                out[b, :, : p.H0], lse[b, :, : p.H0] = o[0], lse_b[0]
            for i, n in _groups(p.nf):  # blocks i .. i + n - 1
                r0, r1 = p.H0 + i * p.Bq, p.H0 + (i + n) * p.Bq  # their rows
                qb = _view(q, b, r0, n, p.Bq, p.Bq)  # (n, H, Bq, E)
                kb, vb = (_view(t, b, i * p.Bq, n, p.Bq, (p.m + 1) * p.Bq) for t in (k, v))  # (n, H, (m+1) Bq, E)
                o, lse_b = fwd(qb, kb, vb, 0.0, False, attn_mask=band, scale=scale)
                # (one strided copy each: a reshape of the transposed block would copy first)
                out[b, :, r0:r1].unflatten(1, (n, p.Bq)).copy_(o.transpose(0, 1))
                lse[b, :, r0:r1].unflatten(1, (n, p.Bq)).copy_(lse_b.transpose(0, 1))
            if p.Lt:
                start = p.tail - window + 1
                o, lse_b = fwd(q[b : b + 1, :, p.tail :], k[b : b + 1, :, start:], v[b : b + 1, :, start:],
                               0.0, False, attn_mask=tail, scale=scale)  # fmt: skip
                out[b, :, p.tail :], lse[b, :, p.tail :] = o[0], lse_b[0]
        sink_mask = None
        if p.n:
            # Rows p >= W also see keys c < n with p - c >= W (the window already covers the others);
            # every such row sees key 0, so no row of this part is empty.
            sink_mask = _band_mask(T - window, p.n, 0, T, q.dtype, q.device)  # row r = p - W sees c <= r
            o_s, lse_s = fwd(q[:, :, window:], k[:, :, : p.n], v[:, :, : p.n], 0.0, False,
                             attn_mask=sink_mask, scale=scale)  # fmt: skip
            lse_w = lse[:, :, window:]
            merged = torch.logaddexp(lse_w, lse_s)  # (B, H, T - W)
            rows = out[:, :, window:]
            rows.copy_(rows * (lse_w - merged).exp()[..., None] + o_s * (lse_s - merged).exp()[..., None])
            lse_w.copy_(merged)
        ctx.save_for_backward(q, k, v, out, lse, sink_mask)
        ctx.plan, ctx.scale = p, scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        # Key-major: each chunk of Bq keys takes the gradient from the window of queries that see
        # it (rows [c Bq, c Bq + (m+1) Bq)), so key and value gradients come out whole, and only the
        # query gradient is added up over overlapping windows. (The kernel is also faster with the
        # long side on the queries.) Each call gets the *final* output and log-sum-exp: its share of
        # the softmax is then exactly its probabilities, whatever else a row attended to.
        bwd = _OPS[1]
        q, k, v, out, lse, sink_mask = ctx.saved_tensors
        p, scale = ctx.plan, ctx.scale
        B, H, T, _ = q.shape
        if grad.stride(-1) != 1:  # the kernel reads any layout with contiguous features
            grad = grad.contiguous()
        Bk = key_chunk(p.W)
        m = -(-(p.W - 1) // Bk)  # key chunks a query's window reaches back
        Lq = (m + 1) * Bk  # queries that may see one key chunk
        nk = max(0, (T - Lq) // Bk + 1)  # key chunks whose whole query window fits
        rest = nk * Bk  # keys from here on are seen only by queries from here on
        window_mask = _band_mask(Lq, Bk, 0, p.W, q.dtype, q.device)  # (Lq, Bk): query r' sees key c'
        rest_mask = _band_mask(T - rest, T - rest, 0, p.W, q.dtype, q.device)
        gq, gk, gv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)  # (B, H, T, E), as the inputs
        first = min(BLOCKS_PER_CALL, nk) * Bk  # rows the first call's windows reach first: written, not added
        gq[:, :, first:] = 0
        for b in range(B):
            for i, n in _groups(nk):  # key chunks i .. i + n - 1
                r0 = i * Bk
                lse_w = lse[b].as_strided((n, H, Lq), (Bk, lse.stride(1), 1), lse[b].storage_offset() + r0)
                dq, dk, dv = bwd(
                    _view(grad, b, r0, n, Bk, Lq),
                    _view(q, b, r0, n, Bk, Lq),
                    _view(k, b, r0, n, Bk, Bk),
                    _view(v, b, r0, n, Bk, Bk),
                    _view(out, b, r0, n, Bk, Lq),
                    lse_w.contiguous(),
                    0.0,
                    False,
                    attn_mask=window_mask,
                    scale=scale,
                )
                gk[b, :, r0 : r0 + n * Bk].unflatten(1, (n, Bk)).copy_(dk.transpose(0, 1))
                gv[b, :, r0 : r0 + n * Bk].unflatten(1, (n, Bk)).copy_(dv.transpose(0, 1))
                chunks = dq.unflatten(2, (m + 1, Bk))  # (n, H, m+1, Bk, E): window c holds rows c .. c+m
                for j in range(m + 1):
                    at = r0 + j * Bk
                    dest = gq[b, :, at : at + n * Bk].unflatten(1, (n, Bk))  # (H, n, Bk, E)
                    if i == 0 and j == 0:
                        dest.copy_(chunks[:, :, 0].transpose(0, 1))  # rows no window reached before
                    else:
                        dest += chunks[:, :, j].transpose(0, 1)
            if rest < T:
                g = bwd(*(t[b : b + 1, :, rest:] for t in (grad, q, k, v, out, lse)), 0.0, False, attn_mask=rest_mask,
                        scale=scale)  # fmt: skip
                gq[b, :, rest:] += g[0][0]
                gk[b, :, rest:] = g[1][0]
                gv[b, :, rest:] = g[2][0]
        if sink_mask is not None:
            n, W = p.n, p.W
            g = bwd(grad[:, :, W:], q[:, :, W:], k[:, :, :n], v[:, :, :n], out[:, :, W:], lse[:, :, W:], 0.0, False,
                    attn_mask=sink_mask, scale=scale)  # fmt: skip
            gq[:, :, W:] += g[0]
            gk[:, :, :n] += g[1]
            gv[:, :, :n] += g[2]
        return gq, gk, gv, None, None, None


def sliding_window_attention(
    q: Tensor, k: Tensor, v: Tensor, window: int, sinks: int = 0, scale: float = 1.0
) -> Tensor:
    """Causal attention of ``q, k, v (B, H, T, E)`` (same heads: expand grouped keys first) where
    query ``p`` sees keys ``p - window < j <= p`` and the first ``sinks`` keys; ``(B, H, T, E)``.

    CPU only (see :func:`available`); no dropout. Equal to a dense masked attention up to float
    rounding, forward and backward.
    """
    # The kernel reads a row's E values as one run: a last dimension of another stride (x[..., ::2], an
    # expanded one) gave wrong values, and read memory past the tensor.
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _SlidingWindow.apply(q, k, v, int(window), int(sinks), float(scale))
