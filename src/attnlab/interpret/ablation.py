"""Removing heads: what the model does without them."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.interpret.hooks import attention_layers, eval_mode

__all__ = ["AblationEffect", "ablate", "ablation_effect", "parse_heads"]

MODES = ("zero", "mean")


def parse_heads(heads: object, n_layers: int, n_heads: int) -> list[tuple[int, int]]:
    """``heads`` as a sorted list of distinct ``(layer, head)`` pairs, checked against the model.
    Accepts pairs, or strings ``"L.H"`` (one, or comma-separated)."""
    if isinstance(heads, str):
        heads = [part for part in heads.split(",") if part.strip()]
    if isinstance(heads, tuple) and len(heads) == 2 and all(isinstance(h, int) for h in heads):
        heads = [heads]
    out = set()
    for item in heads if isinstance(heads, Iterable) else [heads]:
        pair = item
        if isinstance(item, str):
            try:
                pair = tuple(int(p) for p in item.strip().split("."))
            except ValueError:
                pair = None
        ok = (
            isinstance(pair, (tuple, list))
            and len(pair) == 2
            and all(isinstance(p, int) and not isinstance(p, bool) for p in pair)
        )
        if not ok:
            raise ValueError(f"heads must be (layer, head) pairs or 'L.H' strings, got {item!r}")
        layer, head = pair
        if not 0 <= layer < n_layers or not 0 <= head < n_heads:
            raise ValueError(
                f"head {layer}.{head} does not exist: the model has layers 0..{n_layers - 1} and heads 0..{n_heads - 1}"
            )
        out.add((layer, head))
    if not out:
        raise ValueError("heads must name at least one (layer, head)")
    return sorted(out)


@contextlib.contextmanager
def ablate(
    model: nn.Module, heads: object, *, mode: str = "zero", reference: Tensor | None = None
) -> Iterator[list[tuple[int, int]]]:
    """Inside the block, the given heads' outputs are removed before the output projection.

    Args:
        model: an attnlab GPT.
        heads: ``(layer, head)`` pairs (or ``"L.H"`` strings).
        mode: ``"zero"`` replaces a head's output (``weights @ v``) with zeros: the same as zeroing
            its columns of the output projection. ``"mean"`` replaces it with its mean over the
            tokens of ``reference`` (token ids ``(B, T)``), or, without one, over the tokens of each
            call (so a one-token decoding step is left unchanged: give a reference to generate).
    Yields the checked list of heads. Hooks are removed on exit, even after an error.
    """
    layers = attention_layers(model)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    pairs = parse_heads(heads, len(layers), layers[0].num_heads)
    by_layer: dict[int, list[int]] = {}
    for layer, head in pairs:
        by_layer.setdefault(layer, []).append(head)
    means: dict[int, Tensor] = {}
    if mode == "mean" and reference is not None:
        means = _head_output_means(model, layers, reference, list(by_layer))

    def make_hook(layer: int, heads_here: list[int]):
        hd = layers[layer].head_dim

        def hook(module: nn.Module, args: tuple) -> tuple:
            x = args[0].clone()  # (B, T, H * hd): the concatenated head outputs
            for h in heads_here:
                sl = slice(h * hd, (h + 1) * hd)
                if mode == "zero":
                    x[..., sl] = 0.0
                elif layer in means:
                    x[..., sl] = means[layer][sl].to(x.dtype)
                else:
                    x[..., sl] = x[..., sl].mean(dim=tuple(range(x.dim() - 1)), keepdim=True)
            return (x, *args[1:])

        return hook

    handles = [layers[i].out_proj.register_forward_pre_hook(make_hook(i, hs)) for i, hs in by_layer.items()]
    try:
        yield pairs
    finally:
        for h in handles:
            h.remove()


def _head_output_means(
    model: nn.Module, layers: list[nn.Module], reference: Tensor, which: list[int]
) -> dict[int, Tensor]:
    """The mean of each layer's concatenated head outputs ``(H * hd,)`` over ``reference``'s tokens."""
    sums: dict[int, Tensor] = {}
    handles = []
    for i in which:

        def hook(module: nn.Module, args: tuple, i: int = i) -> None:
            sums[i] = args[0].flatten(0, -2).mean(dim=0)  # (B, T, H * hd) -> (H * hd,)

        handles.append(layers[i].out_proj.register_forward_pre_hook(hook))
    try:
        with eval_mode(model), torch.no_grad():
            model(reference if reference.dim() == 2 else reference.unsqueeze(0))
    finally:
        for h in handles:
            h.remove()
    return sums


@dataclass
class AblationEffect:
    """What removing some heads changed (see :func:`ablation_effect`).

    Attributes:
        heads: the ``(layer, head)`` pairs removed; mode: ``"zero"`` or ``"mean"``.
        loss_before, loss_after: mean next-token loss (nats) on the sequence, or None for one token.
        logits_before, logits_after: ``(B, V)`` the logits at the last position.
        kl: ``(B,)`` KL(before || after) of the next-token distributions at the last position.
    """

    heads: list[tuple[int, int]]
    mode: str
    loss_before: float | None
    loss_after: float | None
    logits_before: Tensor
    logits_after: Tensor
    kl: Tensor

    @property
    def loss_change(self) -> float | None:
        return None if self.loss_before is None else self.loss_after - self.loss_before

    def top(self, k: int = 5, *, after: bool = False, row: int = 0) -> list[tuple[int, float]]:
        """The ``k`` most likely next tokens ``[(id, probability)]`` before (or ``after``) the ablation."""
        p = torch.softmax((self.logits_after if after else self.logits_before)[row].float(), dim=-1)
        top = torch.topk(p, min(k, p.shape[-1]))
        return list(zip(top.indices.tolist(), top.values.tolist(), strict=True))


def ablation_effect(model: nn.Module, idx: Tensor, heads: object, *, mode: str = "zero") -> AblationEffect:
    """Run ``idx (B, T)`` with and without the given heads: the change in the loss (next-token
    cross-entropy over the sequence) and in the next-token distribution at the last position."""
    attention_layers(model)
    if isinstance(idx, Tensor) and idx.dim() == 1:
        idx = idx.unsqueeze(0)
    if hasattr(model, "check_idx"):
        idx = model.check_idx(idx)

    def run() -> tuple[float | None, Tensor]:
        logits = model(idx).float()  # (B, T, V)
        loss = None
        if idx.shape[1] >= 2:
            loss = float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten()))
        return loss, logits[:, -1]

    with eval_mode(model), torch.no_grad():
        loss_before, before = run()
        with ablate(model, heads, mode=mode, reference=idx) as pairs:
            loss_after, after = run()
    logp, logq = torch.log_softmax(before, -1), torch.log_softmax(after, -1)
    kl = (logp.exp() * (logp - logq)).sum(-1)  # (B,)
    return AblationEffect(pairs, mode, loss_before, loss_after, before, after, kl)
