"""Fast decoding: each new token through the model's own modules, on caches written at fixed slots.

A decoding step feeds one token per row. :class:`FastDecoder` runs it as the model's own forward
(:meth:`attnlab.GPT.decode_logits`, without the argument checks of ``model(idx)``). Uncompiled (the
default) that is the eager forward on the generation's KV caches. Compiled, it runs over
:class:`attnlab.attention.SlotCache` views of them: the new key and value go to the slot of their
token's index, and attention reads every slot under a mask made from the slots' positions (uncompiled,
that is slower than the plain forward: it attends over every slot). Every step then has the same shapes,
so ``torch.compile`` traces the forward once and each later token runs inductor's code (gpt-fast's
design): one graph for the whole step, the norms, RoPE and the cache writes fused into loops around the
matmuls of torch's own kernels (oneDNN, MKL, cuBLAS).
On CUDA the compiled step is also captured in a CUDA graph (``mode="reduce-overhead"``): a small
model's step is hundreds of short kernels whose launches, not the reads of the weights, take its time.
On the CPU the code that calls the step's kernels is C++ as well (inductor's ``cpp_wrapper``), for
the same reason and one more (see :func:`_compiled_step`).

Nothing here is a second copy of a transformer block: a family switch of :class:`attnlab.GPTConfig`
or a new module is decoded fast as soon as the model's forward computes it.

Eager is the reference. The compiled step computes what ``model.decode_logits`` computes on the same
caches (attention over more slots, all but the filled ones masked, so equal up to the order of sums), and
generation uses it only where that holds (:func:`supported` once per generation,
:meth:`FastDecoder.fits` each step): not while a hook is set (hooks read or replace the eager
forward's activations), not with padding masks, LoRA parametrizations or in training mode, and not
past a rolling cache's last slot (where the ring starts to wrap, the eager forward keeps decoding).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from attnlab import hardware
from attnlab.attention import SlotCache
from attnlab.checks import autocast_on, check_model_logits

__all__ = ["DecodePlan", "FastDecoder", "Reading", "Route", "greedy_tokens", "plan", "supported"]


@contextlib.contextmanager
def dropout_off(*models: nn.Module | None) -> Iterator[None]:
    """No dropout while decoding: the modules of ``models`` in training mode switched off, and back on
    after (not ``model.train()``, which would also put a submodule left in eval mode back in training)."""
    training = [m for model in models if model is not None for m in model.modules() if m.training]
    for m in training:
        m.training = False
    try:
        yield
    finally:
        for m in training:
            m.training = True


def greedy_tokens(logits: Tensor, checked: bool = False) -> Tensor:
    """``logits (..., V)``' argmax over the last dimension, the first of ties (``max(dim=-1).indices``,
    whose CPU kernel is vectorized where ``argmax``'s is not). ``checked``: first checked as
    :func:`attnlab.checks.check_model_logits` checks them (ValueError), from the same maxima: NaN
    propagates into a row's maximum and +inf is it, so one pass over the logits serves both."""
    best = logits.max(dim=-1)
    if checked:
        check_model_logits(best.values[..., None])
    return best.indices


# --------------------------------------------------------------------------------------------
# When the fast step computes what the eager forward does
# --------------------------------------------------------------------------------------------
def _hook_dicts(modules: Any) -> list[dict]:
    """Each module's forward hook and pre-hook dicts (``register_forward_hook`` adds to these dicts, it
    does not replace them, so a list made once sees the hooks set later)."""
    return [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]


def _unhooked(hook_dicts: list[dict], sites: list[nn.Module]) -> bool:
    """No forward (pre-)hook, global or in ``hook_dicts``, no attnlab hook (:mod:`attnlab.interpret.hooks`)
    on the ``sites`` (the blocks, their attention layers and MLPs): each of them wants the eager
    forward's values (a compiled step would break its graph at every call of theirs)."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return False
    if any(hook_dicts):
        return False
    return all(m.hook is None for m in sites)


def supported(model: nn.Module, caches: list[Any] | None, key_mask: Tensor | None) -> bool:
    """Whether :class:`FastDecoder` may run ``model``'s decoding steps over these caches: an
    :class:`attnlab.GPT` in eval mode outside autocast, unmodified by parametrizations (LoRA), with one
    cache per layer and no padding mask. Checked once per generation; hooks, which may come and go,
    are checked each step (:meth:`FastDecoder.fits`)."""
    if caches is None or key_mask is not None or model.training or not hasattr(model, "trf_blocks"):
        return False
    if len(caches) != len(model.trf_blocks) or autocast_on(model.device):
        return False
    return not any(parametrize.is_parametrized(m) for m in model.modules())


# What a step may read of the model as it runs: ``reading(model)`` is a context manager (one made by
# ``contextlib.contextmanager``) under which the step's forward runs, and what it yields (a dict the
# hook functions it sets fill, say) is handed back with the logits. attnlab.interpret's readers set
# functions on the hook points; inside a compiled step they are compiled with it.
Reading = Callable[[nn.Module], AbstractContextManager]


# --------------------------------------------------------------------------------------------
# The plan: how a generation's steps run, decided once
# --------------------------------------------------------------------------------------------
class Route(enum.Enum):
    """How :class:`FastDecoder` runs a step of the model's forward."""

    EAGER = "eager"  # the forward as it is: no compilation, the default
    COMPILED = "compiled"  # one graph compiled by torch.compile (inductor's loops around torch's matmuls)
    CUDA_GRAPH = "cuda-graph"  # compiled, and replayed as a CUDA graph (mode="reduce-overhead")


@dataclass(frozen=True)
class DecodePlan:
    """What a generation's decoding steps are: their route, the rows (batch) each feeds, and the slots
    each step's attention reads (the caches' length: every step the same shapes)."""

    route: Route
    rows: int
    slots: int

    def describe(self) -> str:
        return f"{self.route.value} step, {self.rows} row{'s' * (self.rows != 1)} over {self.slots} cache slots"


def plan(model: nn.Module, caches: list[Any], compile: bool = False) -> DecodePlan:
    """The :class:`DecodePlan` of decoding ``model`` over ``caches`` (``compile``: the compiled route)."""
    keys = caches[0].keys  # (B, Hkv, M, hd)
    route = Route.EAGER
    if compile:
        route = Route.CUDA_GRAPH if keys.is_cuda else Route.COMPILED
    return DecodePlan(route, keys.shape[0], min(c.max_length for c in caches))


def _forward_step(
    model: nn.Module, token: Tensor, at: Tensor | None, caches: list[Any], reading: Reading | None = None
) -> tuple[Tensor, Any]:
    """The logits ``(B, V)`` after ``token (B, 1)`` at position ``at (1, 1)`` (None: after the cached
    tokens): the model's own forward; and what ``reading`` read of the step (None without)."""
    if reading is None:
        return model.decode_logits(token, None, caches, position_ids=at)[:, -1], None
    with reading(model) as read:  # (inside the compiled step: its hook functions are traced with it)
        logits = model.decode_logits(token, None, caches, position_ids=at)[:, -1]
    return logits, read


# One compiled function for every decoder of a route (and device kind): Dynamo keeps its graphs by the
# models and shapes it has seen (its guards), so a second generation of the same model and shapes
# compiles nothing.
_COMPILED: dict[tuple[Route, str], Any] = {}


def _compiled_step(route: Route, device: torch.device) -> Any:
    key = (route, device.type)
    if key not in _COMPILED:
        # (torch.compile takes a mode or options: the CUDA graphs' mode, or the options of the CPU's code)
        if route is Route.CUDA_GRAPH:
            _COMPILED[key] = torch.compile(_forward_step, mode="reduce-overhead", dynamic=False)
        else:
            # On the CPU, the code that calls the step's kernels is C++ too (inductor's ``cpp_wrapper``):
            # its Python wrapper makes a Python object of each of the step's hundreds of buffers and
            # views and a frame of a thousand locals, whose memory CPython maps in afresh (page faults)
            # on the steps where they cross the boundary of its arenas or frame stack, by how deep the
            # caller's stack is: up to a third of a step's time where page faults are dear (a VM). The
            # wrapper is built apart from the kernels, at gcc's -O1: a deep model's wrapper is one
            # function of thousands of lines, which -O3 takes minutes over.
            cpp = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True} if device.type == "cpu" else {}
            options = hardware.compile_options() | cpp
            _COMPILED[key] = torch.compile(_forward_step, dynamic=False, options=options)
    return _COMPILED[key]


def _cloned(x: Any) -> Any:
    """``x`` with each tensor in it (in tuples, lists and dicts) cloned."""
    if isinstance(x, Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _cloned(v) for k, v in x.items()}
    return type(x)(_cloned(v) for v in x) if isinstance(x, (tuple, list)) else x


# --------------------------------------------------------------------------------------------
# The decoder
# --------------------------------------------------------------------------------------------
class FastDecoder:
    """Decoding steps of ``model`` over its KV ``caches``: one token per row per step.

    Args:
        model: an :class:`attnlab.GPT` for which :func:`supported` holds.
        caches: its per-layer caches, already holding the prompt (the prefill runs the eager forward).
        compile: run the step compiled by ``torch.compile`` (:class:`Route`); the first step compiles,
            once per process, model and cache shape (a server compiles ahead: :meth:`precompile`).

    The caches' ``seen`` and ``length`` count the steps as the eager forward would, so a generation may
    switch between the fast step and the eager forward at any token (a hook set between two tokens).
    """

    def __init__(self, model: nn.Module, caches: list[Any], *, compile: bool = False) -> None:
        self.model, self.caches = model, caches
        self.plan = plan(model, caches, compile)
        # Uncompiled, the step is the eager forward on the caches as they are (attention over the filled
        # slots, no mask); compiled, the slot views give every step the same shapes.
        eager = self.plan.route is Route.EAGER
        self.slot_caches = caches if eager else [SlotCache(c) for c in caches]
        self.run = _forward_step if eager else _compiled_step(self.plan.route, caches[0].keys.device)
        if self.plan.route is Route.CUDA_GRAPH:  # (a CUDA graph writes the caches in place: fixed addresses)
            for c in caches:
                for t in (c.keys, c.values, c.positions):
                    torch._dynamo.mark_static_address(t)
        # Hooks may come and go: checked each step, as C-level scans of lists made here.
        self.hook_dicts = _hook_dicts(model.modules())
        self.sites = [m for block in model.trf_blocks for m in (block, block.att, block.ff)]

    def fits(self) -> bool:
        """Whether the next step may run fast: no hook set, and a free slot in every cache
        (past it a rolling cache wraps, and only the eager forward's ring logic places the token)."""
        return self.caches[0].seen < self.plan.slots and _unhooked(self.hook_dicts, self.sites)

    def step(self, token: Tensor, reading: Reading | None = None) -> Tensor | tuple[Tensor, Any]:
        """The logits ``(B, V)`` after the tokens ``token (B,)`` (each row's newest), which the caches
        take in their next slot; with ``reading``, ``(logits, what it read)`` (see :data:`Reading`:
        compiled with the step, once per reading function)."""
        at = self.caches[0].seen
        position = None  # (eager: the caches count the position)
        if self.plan.route is not Route.EAGER:
            position = torch.full((1, 1), at, dtype=torch.long, device=token.device)  # (1, 1)
        # (B, 1), a fresh copy: a column of the tokens so far has that buffer's strides, which the compiled
        # step's guards would see change with the prompt's length
        token = token.reshape(-1, 1).clone(memory_format=torch.contiguous_format)
        if self.plan.route is Route.CUDA_GRAPH:  # (each step a new replay: the last one's outputs are read)
            torch.compiler.cudagraph_mark_step_begin()
        logits, read = self.run(self.model, token, position, self.slot_caches, reading)  # (B, V)
        if self.plan.route is Route.CUDA_GRAPH:  # (the graph's output buffers are overwritten by the next replay)
            logits, read = _cloned((logits, read))
        for c in self.caches:  # (the slot written: what KVCache.update counts)
            c.seen = c.length = at + 1
        return logits if reading is None else (logits, read)

    def precompile(self, reading: Reading | None = None) -> None:
        """Compile the step now (with ``reading``), on these caches (scratch ones: their first slot is
        overwritten), so a server's first request does not wait for it."""
        if self.plan.route is Route.EAGER:
            return
        with torch.inference_mode():
            saved = [(c.seen, c.length) for c in self.caches]
            for c in self.caches:
                c.seen = c.length = 0
            token = torch.zeros(self.plan.rows, dtype=torch.long, device=self.caches[0].keys.device)
            self.step(token, reading)
            for c, (seen, length) in zip(self.caches, saved, strict=True):
                c.seen, c.length = seen, length
                c.positions[:, length:].fill_(-1)
