"""The classes of "A simple self-attention mechanism": attnlab's own (:mod:`attnlab.attention`).

attnlab's classes were written for this tutorial: its names, argument order
(``MultiHeadAttention(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False)``),
parameter names and creation order, so its seeds give its numbers. They add a default
``dropout=0.0`` (the tutorial always passes it) and accept ``(n, d_in)`` as well as
``(b, n, d_in)`` inputs.
"""

from attnlab.attention import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)

__all__ = [
    "CausalAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttention_v1",
    "SelfAttention_v2",
]
