"""The classes of the attention-review exercises ("Concept Questions" / "Attention Review").

Their argument orders and defaults, their parameter creation order (so the same seeds give the
same weights), with the exercises' bugs fixed (``attnlab explain --tutorial review`` shows each):
the causal mask is cut to the input's length (the exercises' fails for inputs shorter than
``context_length``) and each head scales by its own width (the exercises' ``CausalAttention``
reads a global ``d_out``).

* :class:`SelfAttentionV2` (In [2]): biased projections (``nn.Linear``'s default).
* :class:`CausalAttention` (Exercise 3): attnlab's own, which has the same signature and defaults,
  ``(d_in, d_out, context_length, dropout=0.0, qkv_bias=False)``.
* :class:`MultiHeadAttention` (Exercise 5): ``num_heads`` heads of width ``d_out // num_heads``,
  concatenated, **no output projection**. attnlab's :class:`attnlab.attention.MultiHeadAttention`
  has one (and ``num_heads`` fifth), so it is a different model; the equivalent among attnlab's
  main classes is ``MultiHeadAttentionWrapper(d_in, d_out // num_heads, context_length, dropout,
  num_heads)``, which this class matches weight for weight.
* :class:`MultiHeadAttentionOneModule` (Exercise 6): attnlab's ``MultiHeadAttention`` with
  ``num_heads`` third; its output layer is ``out_proj`` (also readable as ``projection``, and the
  exercise's ``projection.*`` state-dict keys load).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.attention import CausalAttention, SelfAttention_v2
from attnlab.attention import MultiHeadAttention as _MultiHeadAttention
from attnlab.checks import check_length, check_module_input, positive_int
from attnlab.functional import scaled_dot_product_attention

__all__ = ["CausalAttention", "MultiHeadAttention", "MultiHeadAttentionOneModule", "SelfAttentionV2"]


class SelfAttentionV2(SelfAttention_v2):
    """The exercises' ``SelfAttentionV2(d_in, d_out)``: biased projections, no mask.

    Shapes: ``x (n, d_in)`` or ``(b, n, d_in)`` -> ``(..., n, d_out)``.
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out, qkv_bias=True)


class MultiHeadAttention(nn.Module):
    """Exercise 5's ``MultiHeadAttention(d_in, d_out, num_heads, context_length, dropout=0.0, qkv_bias=False)``.

    ``num_heads`` causal heads (:class:`CausalAttention`, ``d_in -> d_out // num_heads`` each),
    created head by head as the exercise does; their outputs are concatenated to ``d_out``. There
    is no output projection. ``d_out`` must be divisible by ``num_heads`` (the exercise assumes it:
    its output would otherwise be narrower than ``d_out``).

    Shapes: ``x (n, d_in)`` or ``(b, n, d_in)`` -> ``(..., n, d_out)``; with ``return_weights=True``
    also ``(..., num_heads, n, n)`` weights.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        num_heads: int,
        context_length: int,
        dropout: float = 0.0,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__()
        self.d_in = positive_int("d_in", d_in)
        self.d_out = positive_int("d_out", d_out)
        self.num_heads = positive_int("num_heads", num_heads)
        if d_out % num_heads:
            raise ValueError(f"d_out must be divisible by num_heads, got d_out={d_out} and num_heads={num_heads}")
        self.d_head = d_out // num_heads
        self.context_length = positive_int("context_length", context_length)
        self.heads = nn.ModuleList(
            [CausalAttention(d_in, self.d_head, context_length, dropout, qkv_bias) for _ in range(num_heads)]
        )

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        check_module_input("x", x, self.d_in, self.heads[0].W_query.weight)
        check_length(x.shape[-2], self.context_length)
        # Heads first, (H, ..., n, d_head): dropout draws its masks head after head, as the exercise's loop does.
        q, k, v = (
            torch.stack([getattr(head, name)(x) for head in self.heads]) for name in ("W_query", "W_key", "W_value")
        )  # each (H, ..., n, d_head)
        p = self.heads[0].dropout.p if self.training else 0.0
        out = scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, return_weights=return_weights)
        out, weights = out if return_weights else (out, None)
        out = out.movedim(0, -2).flatten(-2)  # (..., n, H * d_head): the heads side by side
        return (out, weights.movedim(0, -3)) if return_weights else out  # weights (..., H, n, n)


class MultiHeadAttentionOneModule(_MultiHeadAttention):
    """Exercise 6's ``MultiHeadAttentionOneModule``, ``(d_in, d_out, num_heads, context_length, dropout=0.0, ...)``.

    attnlab's :class:`attnlab.attention.MultiHeadAttention` (same parameters, same creation order)
    with the exercise's argument order. ``d_head`` is ``head_dim``; ``projection`` is ``out_proj``.
    """

    def __init__(
        self,
        d_in: int,
        d_out: int,
        num_heads: int,
        context_length: int,
        dropout: float = 0.0,
        qkv_bias: bool = False,
    ) -> None:
        super().__init__(d_in, d_out, context_length, dropout, num_heads, qkv_bias)
        self.d_head = self.head_dim
        self.register_load_state_dict_pre_hook(self._rename_projection)

    @property
    def projection(self) -> nn.Linear:
        """The output layer, under the exercise's name (attnlab's ``out_proj``)."""
        return self.out_proj

    @staticmethod
    def _rename_projection(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        for key in [k for k in state_dict if k.startswith(prefix + "projection.")]:
            state_dict[prefix + "out_proj." + key[len(prefix + "projection.") :]] = state_dict.pop(key)
