"""attnlab: the self-attention of modern language models, to learn from, measure and build on.

The classes keep the names, signatures and printed numbers of the tutorials ("A simple
self-attention mechanism" and its companions); underneath they run on torch's fused kernels and
handle masks, KV caches and bad input correctly.

The names below are imported on first use (PEP 562), so ``import attnlab`` and the command line's
``--help`` do not pay for importing torch, and the CLI can hold Ctrl-C back while torch loads.
"""

import importlib as _importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the submodule that defines it ("functional" is the submodule itself)
_EXPORTS = {
    "CausalAttention": "attention",
    "KVCache": "attention",
    "MultiHeadAttention": "attention",
    "MultiHeadAttentionWrapper": "attention",
    "SelfAttention_v1": "attention",
    "SelfAttention_v2": "attention",
    "attention_scores": "functional",
    "causal_mask": "functional",
    "padding_mask": "functional",
    "scaled_dot_product_attention": "functional",
    "simple_self_attention": "functional",
    "functional": "functional",
    "GPT": "model",
    "GPTConfig": "model",
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'attnlab' has no attribute {name!r}")
    module = _importlib.import_module(f".{_EXPORTS[name]}", __name__)
    value = module if name == _EXPORTS[name] else getattr(module, name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # what IDEs and type checkers see
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
