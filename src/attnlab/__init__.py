"""attnlab: the self-attention of modern language models, to learn from, measure and build on.

The classes keep the names, signatures and printed numbers of the tutorials ("A simple
self-attention mechanism" and its companions); underneath they run on torch's fused kernels and
handle masks, KV caches and bad input correctly.
"""

from . import functional
from .attention import (
    CausalAttention,
    KVCache,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)
from .functional import (
    attention_scores,
    causal_mask,
    padding_mask,
    scaled_dot_product_attention,
    simple_self_attention,
)
from .model import GPT, GPTConfig

__version__ = "0.1.0"

__all__ = [
    "GPT",
    "CausalAttention",
    "GPTConfig",
    "KVCache",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "__version__",
    "attention_scores",
    "causal_mask",
    "functional",
    "padding_mask",
    "scaled_dot_product_attention",
    "simple_self_attention",
]
