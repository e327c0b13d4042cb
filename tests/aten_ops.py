"""A record of the aten operators a block of code runs, for the tests that check which ones run."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class AtenOps(TorchDispatchMode):
    """The aten operators a block of code runs on the thread that enters it (by name; a dispatch mode
    is its thread's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))
