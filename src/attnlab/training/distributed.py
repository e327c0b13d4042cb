"""Training under ``torchrun``: this process's rank, the process group, per-rank seeds.

``torchrun --nproc_per_node=N`` starts N copies of the program with ``RANK``, ``WORLD_SIZE`` and
``LOCAL_RANK`` in their environment; without them the trainer is one process and nothing here
touches ``torch.distributed``.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DistEnv", "no_sync", "rank_seed", "settle", "start_process_group"]


@dataclass(frozen=True)
class DistEnv:
    """This process's place among torchrun's processes (rank 0 of 1 when not under torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  # which GPU of its machine the process takes

    @classmethod
    def from_environ(cls) -> DistEnv:
        """torchrun's environment (RANK / WORLD_SIZE / LOCAL_RANK); one process when absent."""
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            return cls()
        return cls(
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        )

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def start_process_group(device: torch.device) -> bool:
    """Join torchrun's process group (NCCL on CUDA, Gloo on CPU) unless this process already has
    one; True when this call created it (and its caller must destroy it)."""
    if torch.distributed.is_initialized():
        return False
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # torch._dynamo before the group: imported after it (DDP imports it), it keeps a reference to
    # the group (torch 2.13), so destroy_process_group cannot free it and Gloo's worker threads live
    # on; one of them may then drop a collective's last tensor while the interpreter shuts down,
    # which aborts the process ("terminate called without an active exception", 1 run in 10).
    importlib.import_module("torch._dynamo")
    torch.distributed.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return True


def settle(device: torch.device) -> None:
    """Wait for every process (a barrier), and on Gloo (CPU) then for this process's collective
    threads to let go of the last collective's tensors: the end of a run.

    Gloo's threads (torch 2.13) release a finished collective's tensors just after its caller has
    returned, and releasing a tensor Python also holds takes the GIL: a thread that does so while the
    interpreter shuts down aborts the process ("terminate called without an active exception"; 1
    two-process FSDP run in 30, where the sharded model keeps the group and its threads alive to the
    end). ``barrier()`` would not do: it keeps the collectives before it until its thread lets go of
    it, and nothing tells when that is."""
    t = torch.zeros(1, device=device)
    torch.distributed.all_reduce(t)
    if device.type != "cpu":  # (NCCL's watchdog keeps a collective's tensors as long as it likes)
        return
    deadline = time.monotonic() + 5.0
    while t._use_count() > 1 and time.monotonic() < deadline:  # the thread's references to t
        time.sleep(1e-4)  # lets the GIL go: the thread needs it to let go of t


def no_sync(model: torch.nn.Module) -> Any:
    """DDP's ``no_sync()`` context (no gradient all-reduce in it), through a torch.compile wrapper."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP module
    return inner.no_sync()


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of ``rank``'s own dropout stream from ``step`` on: every rank draws its own masks.
    Wraps around at 2**64 (torch's seed range), so any valid ``--seed`` works on any rank."""
    return (seed + 1_000_003 * rank + step) % 2**64
