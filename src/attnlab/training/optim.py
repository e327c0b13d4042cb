"""Muon for the transformer's weight matrices, AdamW for everything else, as one optimizer.

Muon (Keller Jordan et al. 2024, the optimizer of the modded-nanogpt speedruns) takes a 2-D weight's
momentum-averaged gradient and replaces it by the nearest semi-orthogonal matrix (every singular
value set to one) before the step: all directions of the matrix move at the same rate, instead of
the few directions that dominate the raw gradient. The orthogonalisation is five iterations of a
quintic Newton-Schulz polynomial. It needs the singular values only near one, not exactly there, so
it runs in bfloat16 where the hardware multiplies bf16 natively (as ``torch.optim.Muon`` always does),
else in float32 (:func:`attnlab.hardware.fast_dtype`; the trainer passes ``--precision``'s dtype).

Muon is defined for matrices only, so embeddings, the output head and the gains and biases
(LayerNorm, bias vectors) keep AdamW: :func:`muon_param_groups` makes the split.

The update of a Muon matrix ``W`` (rows x cols), with momentum ``mu`` and Nesterov's look-ahead,
is what ``torch.optim.Muon`` does (same names, same scale):

    buf = mu * buf + (1 - mu) * grad
    O   = NewtonSchulz(grad + mu * (buf - grad))        # ~ U V^T of the SVD U S V^T
    W  *= 1 - lr * weight_decay
    W  -= lr * max(1, rows / cols) ** 0.5 * O

``torch.optim.Muon`` refuses non-matrix parameters, and a checkpoint holds one optimizer state,
hence this one class with a ``use_muon`` flag per param group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from attnlab import hardware

__all__ = ["MuonAdamW", "muon_param_groups", "newton_schulz"]

# The quintic's coefficients, tuned to push singular values in (0, 1] towards 1 fastest.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(G: Tensor, steps: int = 5, eps: float = 1e-7, *, dtype: torch.dtype | None = None) -> Tensor:
    """An approximation of ``U @ V.T`` for ``G = U S V.T`` (shape and dtype of ``G``), computed in
    ``dtype`` (default: bfloat16 where ``G``'s device has it natively, else float32)."""
    a, b, c = NS_COEFFICIENTS
    X = G.to(hardware.fast_dtype(G.device) if dtype is None else dtype)
    tall = G.size(0) > G.size(1)
    if tall:  # iterate on the smaller Gram matrix
        X = X.T
    X = X / X.norm().clamp(min=eps)  # singular values into [0, 1]
    for _ in range(steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)  # b A + c A^2
        X = torch.addmm(X, B, X, beta=a)  # a X + B X
    return (X.T if tall else X).to(G.dtype)


def muon_param_groups(model: torch.nn.Module, *, lr: float, muon_lr: float, weight_decay: float) -> list[dict]:
    """Muon on the 2-D weights inside the transformer blocks (``model.trf_blocks``), with
    ``weight_decay``; AdamW on the rest (embeddings, head, gains, biases) without decay."""
    blocks = getattr(model, "trf_blocks", None)
    if not isinstance(blocks, torch.nn.Module):
        raise TypeError(f"model must have a .trf_blocks module to split for Muon, got {type(model).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    in_blocks = {id(p) for p in blocks.parameters()}
    muon = [p for p in params if p.dim() == 2 and id(p) in in_blocks]
    muon_ids = {id(p) for p in muon}
    rest = [p for p in params if id(p) not in muon_ids]
    return [
        {"params": muon, "use_muon": True, "lr": float(muon_lr), "weight_decay": float(weight_decay)},
        {"params": rest, "use_muon": False, "lr": float(lr), "weight_decay": 0.0},
    ]


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the param groups with ``use_muon=True``, AdamW (decoupled decay, bias-corrected
    moments) on the others. Every group's ``lr`` is its own, and ``initial_lr`` keeps its peak:
    a schedule sets ``lr = initial_lr * factor`` (as the trainer does, and torch's LR schedulers).

    ``ns_dtype`` is the dtype of the Newton-Schulz iterations (default: bfloat16 where the
    parameter's device has it natively, else float32); it is a setting of the run, not state.

    State per parameter: ``step`` (a float scalar tensor, as torch's Adam keeps it) and
    ``momentum_buffer`` (Muon) or ``exp_avg`` and ``exp_avg_sq`` (AdamW).
    """

    def __init__(
        self,
        params: Iterable[dict[str, Any]],
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        momentum: float = 0.95,
        ns_steps: int = 5,
        ns_dtype: torch.dtype | None = None,
    ) -> None:
        if ns_dtype is not None and not (isinstance(ns_dtype, torch.dtype) and ns_dtype.is_floating_point):
            raise TypeError(f"ns_dtype must be a floating torch.dtype or None, got {ns_dtype!r}")
        self.ns_dtype = ns_dtype
        groups = list(params)
        for i, g in enumerate(groups):
            if not isinstance(g, dict) or "use_muon" not in g or "lr" not in g:
                raise ValueError(f"params[{i}] must be a dict with 'params', 'use_muon' and 'lr', got {g!r:.80}")
            if g["use_muon"] and any(p.dim() != 2 for p in g["params"]):
                raise ValueError(f"params[{i}] is a Muon group, so every parameter must be 2-D")
            g.setdefault("initial_lr", g["lr"])
        defaults = {"betas": betas, "eps": eps, "momentum": momentum, "ns_steps": ns_steps, "weight_decay": 0.0}
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None if closure is None else closure()
        for g in self.param_groups:
            lr, wd = g["lr"], g["weight_decay"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    if g["use_muon"]:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    else:
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                if g["use_muon"]:
                    self._muon(p, state, lr, wd, g["momentum"], g["ns_steps"], self.ns_dtype)
                else:
                    self._adamw(p, state, lr, wd, g["betas"], g["eps"])
        return loss

    @staticmethod
    def _muon(
        p: Tensor, state: dict, lr: float, wd: float, momentum: float, ns_steps: int, ns_dtype: torch.dtype | None
    ) -> None:
        buf = state["momentum_buffer"]
        buf.lerp_(p.grad, 1 - momentum)
        update = newton_schulz(p.grad.lerp(buf, momentum), ns_steps, dtype=ns_dtype)  # Nesterov: look one step ahead
        step = _step_size(lr * max(1.0, p.size(0) / p.size(1)) ** 0.5, p)
        p.mul_(1 - lr * wd)
        p.add_(update, alpha=-step)

    @staticmethod
    def _adamw(p: Tensor, state: dict, lr: float, wd: float, betas: tuple[float, float], eps: float) -> None:
        beta1, beta2 = betas
        t = float(state["step"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(p.grad, 1 - beta1)
        v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        denom = (v / (1 - beta2**t)).sqrt_().add_(eps)
        p.mul_(1 - lr * wd)
        p.addcdiv_(m, denom, value=-_step_size(lr / (1 - beta1**t), p))


def _step_size(step: float, p: Tensor) -> float:
    """``step``, if the parameter's dtype can hold it; else FloatingPointError (torch would raise
    a RuntimeError deep in the kernel: an lr of 1e300 is a setting, not a bug)."""
    if not abs(step) <= torch.finfo(p.dtype).max:
        raise FloatingPointError(f"a step of {step:g} overflows {p.dtype}; try a smaller --lr or --muon-lr")
    return step
