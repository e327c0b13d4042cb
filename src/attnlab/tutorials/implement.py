"""The attention of "Implement the Self-Attention Mechanism in PyTorch", as modules.

The tutorial writes no classes: it builds ``W_q``, ``W_k``, ``W_v`` with ``torch.rand(d, d_in)``
(queries and keys 24 wide, values 28 wide, for 16-wide word embeddings), computes
``queries = (W_q @ x.T).T`` and so on, and for three heads stacks the matrices into
``(n_heads, d, d_in)`` tensors applied with ``torch.bmm``. attnlab's classes have one width for
queries, keys and values and ``nn.Linear``'s ``(d_out, d_in)`` layout with its own initialisation,
so they cannot hold these weights; these modules can. Parameters are created in the tutorial's
order with its ``torch.rand``, so right after its embedding layer, under its
``torch.manual_seed(42)``, they hold its numbers::

    torch.manual_seed(42)
    embedding_layer = torch.nn.Embedding(8, 16)
    embedded_sentence = embedding_layer(sentence_ints).detach()       # (8, 16)
    attention = SelfAttention(d_in=16, d_q=24, d_k=24, d_v=28)        # the tutorial's W_q, W_k, W_v
    heads = MultiHeadSelfAttention(d_in=16, d_q=24, d_k=24, d_v=28, num_heads=3)   # its multihead_W_*

The forward pass normalises each query's row (softmax over the keys), where the tutorial's
``F.softmax(..., dim=0)`` normalises columns (``attnlab explain --lesson softmax-dim`` shows why
that is a bug); ``return_weights=True`` returns the weights.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.checks import check_module_input, positive_int
from attnlab.functional import scaled_dot_product_attention

__all__ = ["MultiHeadSelfAttention", "SelfAttention"]


def _widths(d_in: object, d_q: object, d_k: object, d_v: object) -> tuple[int, int, int, int]:
    d_in, d_q, d_k, d_v = (
        positive_int(name, v) for name, v in (("d_in", d_in), ("d_q", d_q), ("d_k", d_k), ("d_v", d_v))
    )
    if d_k != d_q:
        # The tutorial: "Since Queries and Keys vector are multiplied afterward, their dimensions MUST be equal."
        raise ValueError(f"d_k must equal d_q (queries and keys are multiplied together), got d_q={d_q} and d_k={d_k}")
    return d_in, d_q, d_k, d_v


class SelfAttention(nn.Module):
    """Single-head self-attention with separate query/key and value widths.

    Args:
        d_in: width of the input embeddings (the tutorial's ``dim_word_embedding``, 16).
        d_q, d_k: width of queries and keys (24); they must be equal.
        d_v: width of the values and of the output (28).
    Parameters:
        ``W_q (d_q, d_in)``, ``W_k (d_k, d_in)``, ``W_v (d_v, d_in)``, ``torch.rand``, in this order.
    Shapes:
        ``x (n, d_in)`` or ``(b, n, d_in)`` -> ``(..., n, d_v)``; with ``return_weights=True``
        also the ``(..., n, n)`` weights (each row sums to 1). Scale ``1/sqrt(d_k)``, no mask.
    """

    def __init__(self, d_in: int, d_q: int, d_k: int, d_v: int) -> None:
        super().__init__()
        self.d_in, self.d_q, self.d_k, self.d_v = _widths(d_in, d_q, d_k, d_v)
        self.W_q = nn.Parameter(torch.rand(d_q, d_in))
        self.W_k = nn.Parameter(torch.rand(d_k, d_in))
        self.W_v = nn.Parameter(torch.rand(d_v, d_in))

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        check_module_input("x", x, self.d_in, self.W_q)
        queries = x @ self.W_q.T  # (..., n, d_q): the tutorial's (W_q @ x.T).T
        keys = x @ self.W_k.T  # (..., n, d_k)
        values = x @ self.W_v.T  # (..., n, d_v)
        return scaled_dot_product_attention(queries, keys, values, return_weights=return_weights)


class MultiHeadSelfAttention(nn.Module):
    """``num_heads`` heads of :class:`SelfAttention`, as the tutorial stacks them.

    Args:
        d_in, d_q, d_k, d_v: as for :class:`SelfAttention`, for every head.
        num_heads: number of heads (the tutorial's ``n_heads``, 3).
    Parameters:
        ``W_q (num_heads, d_q, d_in)``, ``W_k (num_heads, d_k, d_in)``, ``W_v (num_heads, d_v, d_in)``,
        ``torch.rand``, in this order (the tutorial's ``multihead_W_query``, ``_key``, ``_value``).
    Shapes:
        ``x (n, d_in)`` or ``(b, n, d_in)`` -> ``(..., num_heads, n, d_v)``: one context matrix per
        head, as the tutorial's ``multihead_context_z`` (it stops there: no concatenation and no
        output projection); with ``return_weights=True`` also ``(..., num_heads, n, n)`` weights.
    """

    def __init__(self, d_in: int, d_q: int, d_k: int, d_v: int, num_heads: int) -> None:
        super().__init__()
        self.d_in, self.d_q, self.d_k, self.d_v = _widths(d_in, d_q, d_k, d_v)
        self.num_heads = positive_int("num_heads", num_heads)
        self.W_q = nn.Parameter(torch.rand(num_heads, d_q, d_in))
        self.W_k = nn.Parameter(torch.rand(num_heads, d_k, d_in))
        self.W_v = nn.Parameter(torch.rand(num_heads, d_v, d_in))

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        check_module_input("x", x, self.d_in, self.W_q)
        x = x.unsqueeze(-3)  # (..., 1, n, d_in): one copy for every head (the tutorial's .repeat)
        queries = x @ self.W_q.transpose(-2, -1)  # (..., H, n, d_q)
        keys = x @ self.W_k.transpose(-2, -1)  # (..., H, n, d_k)
        values = x @ self.W_v.transpose(-2, -1)  # (..., H, n, d_v)
        return scaled_dot_product_attention(queries, keys, values, return_weights=return_weights)
