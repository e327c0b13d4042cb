"""How well a model predicts a text: mean next-token loss, perplexity and bits per byte.

The text is scored in windows of ``context_length`` tokens that start every ``stride`` tokens (Hugging
Face's "perplexity of fixed-length models" recipe): each window scores only the tokens the previous
windows did not, with the window's earlier tokens as context; every token but the first is scored
once. ``stride == context_length`` gives disjoint windows (fast); a smaller stride gives every
scored token more context (slower, lower loss)::

    tokens  t0 t1 t2 t3 t4 t5 t6 t7 ...        T = 4, stride = 2
    reads   [t0 t1 t2 t3]                       scores t1 t2 t3 t4
    reads         [t2 t3 t4 t5]                 scores t5 t6
    reads               [t4 t5 t6 t7]           scores t7 t8

Bits per byte divides the summed loss (in bits) by the UTF-8 bytes of the text: unlike loss per token
it compares models with different tokenizers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from attnlab.checks import is_int
from attnlab.hardware import as_float64, float64_device
from attnlab.model import GPT

__all__ = ["EvalResult", "evaluate_tokens", "windows"]


@dataclass(frozen=True)
class EvalResult:
    """What :func:`evaluate_tokens` measured."""

    loss: float  # mean next-token cross-entropy, nats per scored token
    tokens: int  # tokens scored
    nll: float  # summed cross-entropy, nats
    bytes: int | None = None  # UTF-8 bytes of the text (for bits per byte)

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)

    @property
    def bits_per_byte(self) -> float | None:
        return None if not self.bytes else self.nll / math.log(2) / self.bytes


def windows(n_tokens: int, context_length: int, stride: int) -> list[tuple[int, int, int]]:
    """The ``(begin, end, scored)`` windows over ``n_tokens`` tokens: the model reads
    ``tokens[begin:end - 1]`` (at most ``context_length`` tokens) and the last ``scored`` tokens of
    ``tokens[begin:end]`` are its targets. Every token but the first is scored exactly once."""
    for name, v in (("context_length", context_length), ("stride", stride)):
        if not is_int(v) or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    if stride > context_length:
        raise ValueError(f"--stride {stride} is larger than --context-length {context_length}: tokens would be skipped")
    if n_tokens < 2:
        raise ValueError(f"the text has {n_tokens} token(s); at least 2 are needed to score one")
    out, prev_end = [], 1  # token 0 has no context: it is never a target
    end = min(context_length + 1, n_tokens)
    while True:
        out.append((max(0, end - context_length - 1), end, end - prev_end))
        if end == n_tokens:
            return out
        prev_end, end = end, min(end + stride, n_tokens)


@torch.no_grad()
def evaluate_tokens(
    model: GPT,
    tokens: Sequence[int] | torch.Tensor,
    *,
    context_length: int,
    stride: int | None = None,
    n_bytes: int | None = None,
    on_window: Callable[[int], None] | None = None,
) -> EvalResult:
    """Score ``tokens`` with ``model`` in the windows of :func:`windows` (``stride`` defaults to
    ``context_length``); the loss is summed in float64 over the scored tokens. ``on_window`` is
    called with the tokens each window scored (a progress bar). ``model`` is put in eval mode."""
    ids = tokens if torch.is_tensor(tokens) else torch.as_tensor(np.asarray(tokens))
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"tokens must be a 1-D sequence of token ids, got {ids.dtype} of shape {tuple(ids.shape)}")
    ids, V = ids.long(), model.config.vocab_size  # (N,) (a token cache's uint16 has no min or max in torch)
    if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) < V):
        raise ValueError(f"tokens must be ids in [0, {V}), got values in [{int(ids.min())}, {int(ids.max())}]")
    if n_bytes is not None and (not is_int(n_bytes) or n_bytes < 0):
        raise ValueError(f"n_bytes must be None or a non-negative int (the text's UTF-8 bytes), got {n_bytes!r}")
    stride = context_length if stride is None else stride
    model.eval()
    device = model.device
    total = torch.zeros((), dtype=torch.float64, device=float64_device(device))  # (the CPU for MPS)
    count = 0
    for begin, end, scored in windows(len(ids), context_length, stride):
        x = ids[begin:end].to(device)[None]  # (1, W + 1)
        logits = model(x[:, :-1])[0, -scored:].float()  # (scored, V): the last W positions predict the scored tokens
        targets = x[0, -scored:]  # (scored,)
        total += as_float64(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += scored
        if on_window is not None:
            on_window(scored)
    nll = total.item()
    return EvalResult(loss=nll / count, tokens=count, nll=nll, bytes=n_bytes)
