"""The head of "Self attention for a single individual head", as a module.

The tutorial builds its head from three ``nn.Linear(C, head_size, bias=False)`` layers created in
the order key, query, value (attnlab's classes create query, key, value), so under its
``torch.manual_seed(1337)`` only this order gives its weights. Its cells do not scale the scores
yet; it then explains why the paper divides them by ``sqrt(head_size)``. :class:`Head` scales by
default, as the paper does; ``scale=1.0`` reproduces the tutorial's cells::

    torch.manual_seed(1337)
    x = torch.randn(4, 8, 32)                       # B, T, C
    head = Head(32, 16, scale=1.0)                  # its key, query and value layers
    out, wei = head(x, return_weights=True)         # (4, 8, 16), (4, 8, 8)
"""

from __future__ import annotations

import torch.nn as nn
from torch import Tensor

from attnlab.checks import check_bool, check_module_input, finite_real, positive_int
from attnlab.functional import scaled_dot_product_attention

__all__ = ["Head"]


class Head(nn.Module):
    """One head of self-attention: ``softmax(mask(q k^T) * scale) v``.

    Args:
        n_embd: width of the tokens' embeddings (the tutorial's ``C``, 32).
        head_size: width of keys, queries, values and the output (16).
        scale: multiplier of the scores; default ``head_size ** -0.5`` (the paper's); the
            tutorial's cells use none (``scale=1.0``).
        causal: mask the future (a decoder block, the tutorial's ``tril``); ``False`` lets every
            token see every token (an encoder block: the tutorial's "delete this line").
    Parameters (in creation order): ``key``, ``query``, ``value``, each ``nn.Linear(n_embd,
    head_size, bias=False)``.
    Shapes: ``x (T, n_embd)`` or ``(B, T, n_embd)`` -> ``(..., T, head_size)``; with
    ``return_weights=True`` also the ``(..., T, T)`` weights (the tutorial's ``wei``).
    """

    def __init__(self, n_embd: int, head_size: int, *, scale: float | None = None, causal: bool = True) -> None:
        super().__init__()
        self.n_embd = positive_int("n_embd", n_embd)
        self.head_size = positive_int("head_size", head_size)
        if scale is not None and not finite_real(scale):
            raise ValueError(f"scale must be a finite number or None, got {scale!r}")
        self.scale = None if scale is None else float(scale)
        self.causal = check_bool("causal", causal)
        self.key = nn.Linear(n_embd, head_size, bias=False)
        self.query = nn.Linear(n_embd, head_size, bias=False)
        self.value = nn.Linear(n_embd, head_size, bias=False)

    def forward(self, x: Tensor, *, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        check_module_input("x", x, self.n_embd, self.key.weight)
        k = self.key(x)  # (..., T, hs): what each token contains
        q = self.query(x)  # (..., T, hs): what each token looks for
        v = self.value(x)  # (..., T, hs): what each token hands over
        return scaled_dot_product_attention(
            q, k, v, is_causal=self.causal, scale=self.scale, return_weights=return_weights
        )
