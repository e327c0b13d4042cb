"""Will a training run fit in memory? A lower bound of what it needs, against what the device has.

A run that cannot fit should say so in one line before it starts, naming the flags that size it,
rather than die minutes later in the allocator (or take the machine down with it). The estimate is
deliberately a *lower bound*, so that a refusal is certain and a run that might fit is never
refused; what it counts, per process, for AdamW training of a GPT:

* parameters: 16 bytes each, in float32: the weight, its gradient and AdamW's two moments
  (``exp_avg``, ``exp_avg_sq``). ``P`` counts the matrices: the token embedding (and an untied
  output head), the position table of learned positions, and per layer the query and output
  projections (``d*d`` each), the key and value projections (``d * kv_dim`` each, smaller with
  grouped-query attention) and the MLP's two matrices (three for SwiGLU) of ``d*ff``; biases and
  norms, a fraction of a percent, are left out;
* activations that autograd keeps for the backward pass, for one micro-batch of ``n = b*T``
  tokens: at least ``6*d + 2*ff`` values per token and layer (the attention block's input, its
  query/key/value and output, the MLP's hidden layer before and after the GELU; the fused
  attention kernels keep no ``T x T`` matrix), 4 bytes each in float32 or 2 under CUDA's bf16
  autocast;
* the logits and their gradient: ``n*V`` values each, float32 for the loss (plus the bf16 logits
  under autocast), i.e. ``(act_bytes + 4) * n * V`` bytes.

What is available: on the CPU, ``MemAvailable`` of ``/proc/meminfo`` (or psutil's ``available``),
lowered to what a cgroup (a container's memory limit) still allows; on CUDA, the free memory
``torch.cuda.mem_get_info`` reports. Elsewhere (MPS) nothing is checked.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from attnlab.model import GPTConfig

__all__ = ["MemoryEstimate", "available_memory", "estimate_training_memory", "fsdp_processes_needed"]

GiB = 1 << 30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a training process needs at least (see the module docstring for the formula)."""

    parameters: int  # P, as counted by the formula
    states: int  # 16 * P: weights, gradients, AdamW moments
    activations: int  # kept for backward, per micro-batch
    logits: int  # logits and their gradient, per micro-batch

    @property
    def total(self) -> int:
        return self.states + self.activations + self.logits


def estimate_training_memory(
    config: GPTConfig, micro_batch: int, *, act_bytes: int = 4, lora: bool = False, shards: int = 1
) -> MemoryEstimate:
    """A lower bound of the memory one process needs to train ``config`` on ``micro_batch`` rows of
    ``config.context_length`` tokens per micro-step; ``act_bytes`` is 4 (float32) or 2 (bf16 autocast).
    ``lora``: the weights are frozen (4 bytes each; the adapters are left out). ``shards``: FSDP over
    that many processes, each holding its share of the weights, gradients and AdamW moments (one
    layer's weights are gathered at a time, left out)."""
    d, ff, L, V, T = config.emb_dim, config.hidden_dim, config.n_layers, config.vocab_size, config.context_length
    kv_dim = config.kv_heads * config.head_dim
    embeddings = V * d * (1 if config.tie_embeddings else 2) + (
        T * d if getattr(config, "pos", "learned") == "learned" else 0
    )
    mlp = (3 if config.mlp == "swiglu" else 2) * d * ff
    P = embeddings + L * (2 * d * d + 2 * d * kv_dim + mlp)
    n = micro_batch * T
    return MemoryEstimate(
        parameters=P,
        states=(4 if lora else 16) * P // shards,
        activations=n * L * (6 * d + 2 * ff) * act_bytes,
        logits=(act_bytes + 4) * n * V,
    )


def fsdp_processes_needed(config: GPTConfig, micro_batch: int, have: int, *, act_bytes: int = 4) -> int | None:
    """The fewest processes (a power of two, at most 1024) over which ``--fsdp`` shards a run that
    fits ``have`` bytes per device by :func:`estimate_training_memory`; None when even 1024 shards
    do not (the activations alone are too large: lower the batch or the context instead)."""
    for n in (1 << k for k in range(11)):  # 1, 2, 4, ..., 1024
        if estimate_training_memory(config, micro_batch, act_bytes=act_bytes, shards=n).total <= have:
            return n
    return None


def available_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can still get (None where that is not known)."""
    if device.type == "cuda":
        try:
            free, _ = torch.cuda.mem_get_info(device)
        except RuntimeError:
            return None
        return int(free)
    if device.type != "cpu":
        return None
    candidates = [_meminfo_available(), _cgroup_available()]
    if candidates[0] is None:
        with contextlib.suppress(ImportError):
            import psutil

            candidates[0] = int(psutil.virtual_memory().available)
    known = [c for c in candidates if c is not None]
    return min(known) if known else None


def _meminfo_available() -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    return None


def _cgroup_available() -> int | None:
    """What this process's cgroup (a container's limit) still allows: its limit minus its usage."""
    pairs = [
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # cgroup v2
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),  # v1
    ]
    for limit_path, usage_path in pairs:
        with contextlib.suppress(OSError, ValueError):
            limit = Path(limit_path).read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:  # no limit
                return None
            return max(0, int(limit) - int(Path(usage_path).read_text().strip()))
    return None
