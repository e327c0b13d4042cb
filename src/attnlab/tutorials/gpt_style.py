"""The classes of "Implementing GPT-Style Attention: A Step-by-Step Guide with PyTorch", exactly.

How they differ from attnlab's main classes (:mod:`attnlab.attention`), and so why code from the
guide needs these to give the guide's model and numbers:

* :class:`SelfAttention` and :class:`MultiHeadAttention` use ``nn.Linear(d_in, d_out)`` with its
  default bias: attnlab's ``qkv_bias=True``.
* :class:`MultiHeadAttention` takes ``(d_in, d_out, num_heads, context_length, dropout)``:
  ``num_heads`` third, ``dropout`` required.
* :class:`CausalAttention` creates its key projection, ``W_keys`` (with an s), *before* ``W_query``,
  and defaults to ``dropout=0.1``: under the same seed attnlab's ``CausalAttention`` puts the guide's
  key weights into its query projection, and evaluates without dropout.

Each class runs on attnlab's fused attention and accepts ``(n, d_in)`` or ``(b, n, d_in)``.
"""

from __future__ import annotations

import torch.nn as nn
from torch import Tensor

from attnlab.attention import MultiHeadAttention as _MultiHeadAttention
from attnlab.attention import SelfAttention_v2
from attnlab.checks import check_length, check_module_input, positive_int, probability
from attnlab.functional import scaled_dot_product_attention

__all__ = ["CausalAttention", "MultiHeadAttention", "SelfAttention"]


class SelfAttention(SelfAttention_v2):
    """The guide's ``SelfAttention(d_in, d_out)``: biased query/key/value projections.

    Shapes: ``x (n, d_in)`` or ``(b, n, d_in)`` -> ``(..., n, d_out)``.
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out, qkv_bias=True)


class CausalAttention(nn.Module):
    """The guide's ``CausalAttention``: ``W_keys`` created first, ``dropout=0.1`` by default.

    Args:
        d_in, d_out: input and output widths.
        context_length: the longest input accepted.
        dropout: dropout on the attention weights in training mode; default 0.1 (call ``.eval()``,
            or pass 0.0, for deterministic outputs).
        qkv_bias: bias in the three projections.
    Parameters (in creation order): ``W_keys``, ``W_query``, ``W_value``. The guide's state dicts
    load (their ``mask`` buffer is dropped: the mask is built on the fly).
    Shapes: ``x (n, d_in)`` or ``(b, n, d_in)`` -> ``(..., n, d_out)``.
    """

    def __init__(
        self, d_in: int, d_out: int, context_length: int, dropout: float = 0.1, qkv_bias: bool = False
    ) -> None:
        super().__init__()
        self.d_in = positive_int("d_in", d_in)
        self.d_out = positive_int("d_out", d_out)
        self.context_length = positive_int("context_length", context_length)
        # The guide's order: keys first. Under its seed, the same weights as its class.
        self.W_keys = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.dropout = nn.Dropout(probability("dropout", dropout))
        self.register_load_state_dict_pre_hook(self._drop_mask)

    @staticmethod
    def _drop_mask(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        state_dict.pop(prefix + "mask", None)

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        check_module_input("x", x, self.d_in, self.W_query.weight)
        check_length(x.shape[-2], self.context_length)
        keys = self.W_keys(x)  # (..., n, d_out)
        queries = self.W_query(x)  # (..., n, d_out)
        values = self.W_value(x)  # (..., n, d_out)
        p = self.dropout.p if self.training else 0.0
        return scaled_dot_product_attention(
            queries, keys, values, dropout_p=p, is_causal=True, return_weights=return_weights
        )


class MultiHeadAttention(_MultiHeadAttention):
    """The guide's ``MultiHeadAttention(d_in, d_out, num_heads, context_length, dropout)``.

    attnlab's :class:`attnlab.attention.MultiHeadAttention` with the guide's argument order and its
    biased query/key/value projections (``qkv_bias=True``); parameters are created in the same
    order (``W_query``, ``W_key``, ``W_value``, ``out_proj``), so the guide's seeds give its weights.
    Everything else (masks, KV cache, ``return_weights``) is attnlab's.
    """

    def __init__(self, d_in: int, d_out: int, num_heads: int, context_length: int, dropout: float) -> None:
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias=True)
