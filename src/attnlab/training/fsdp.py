"""Sharded training (``torchrun ... -m attnlab train --fsdp``): PyTorch's FSDP2 and distributed checkpoint.

DDP keeps a whole copy of the weights, gradients and AdamW moments on every process (16 bytes per
parameter in float32); FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps ``1/N`` of each on each of
N processes, and gathers one transformer block's weights just before that block runs (forward and
backward), freeing them after. Each block is its own unit, and so is the root (embeddings, final norm,
output head), so at most one block's full weights exist at a time beyond the shards. Gradients are
reduce-scattered (averaged) into the shards, so N sharded processes follow the trajectory of one
process on the same global batch, as with DDP. Where the device has bf16 matmuls (see
:func:`~attnlab.training.trainer.autocast_dtype`) the gathered weights compute in bf16 and gradients
are reduced in float32 (``MixedPrecisionPolicy``); the shards themselves stay float32.

A checkpoint of a sharded run (:func:`save_sharded`) is the usual attnlab step directory::

    model.safetensors, config.json    the full weights, gathered to rank 0 (what generate, viz... read)
    optimizer/                        AdamW's state, one file per process, by torch.distributed.checkpoint
    checkpoint.json                   as always: settings, RNG states of every process, the SHA-256 of
                                      every file above (the optimizer's shards included), its own SHA-256

assembled in a temporary directory that all processes write into, then renamed and published by the
atomic ``latest.json`` switch of :mod:`attnlab.training.checkpoint`: a process killed at any instant
leaves ``latest.json`` naming the previous complete checkpoint. The optimizer state is stored by
parameter name, not position, and distributed checkpoint reshards it on load, so a sharded checkpoint
resumes with any number of processes, sharded or not (:func:`load_optimizer`), and a run started with
``--fsdp`` resumes the ``optimizer.pt`` of an unsharded one (:func:`load_full_optimizer_state`).

Only the metadata file of distributed checkpoint is a pickle: it is read by :class:`SafeReader`,
whose unpickler builds nothing but distributed checkpoint's own metadata classes, after its SHA-256
was checked against ``checkpoint.json``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab.files import first_line
from attnlab.training.checkpoint import OPTIMIZER_DIR, begin_save, commit_save, write_step_dir

__all__ = ["OPTIMIZER_DIR", "SafeReader", "load_full_optimizer_state", "load_optimizer", "save_sharded", "shard"]


def shard(model: nn.Module, *, param_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` each transformer block, then the root (in place); returns the model.
    ``param_dtype``: the dtype the gathered weights compute in (None: their own), gradients reduced in float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs: dict[str, Any] = {"mp_policy": mp} if mp is not None else {}
    for block in model.trf_blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def save_sharded(
    out: Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    metadata: dict[str, Any],
    keep: int,
    tokenizer: Any = None,
) -> Path | None:
    """Write a checkpoint of a sharded run (every process calls it; rank 0 returns the step directory)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    from attnlab.model import GPT

    rank = dist.get_rank()
    # Collectives, on every process: the full weights gathered to rank 0's CPU, the sharded optimizer.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    optim = get_optimizer_state_dict(model, optimizer)
    plan = [begin_save(out, step) if rank == 0 else None]
    dist.broadcast_object_list(plan, src=0)  # the temporary directory all processes write into
    final, tmp = plan[0]
    if tmp is None:  # this step is already saved
        return final if rank == 0 else None
    try:
        dcp.save({"optimizer": optim}, checkpoint_id=str(tmp / OPTIMIZER_DIR))
        if rank != 0:
            return None
        with torch.device("meta"):
            plain = GPT(model.config)
        plain.load_state_dict(full, assign=True)
        if plain.config.tie_embeddings:
            plain.out_head.weight = plain.tok_emb.weight
        files = sorted(f"{OPTIMIZER_DIR}/{p.name}" for p in (tmp / OPTIMIZER_DIR).iterdir())
        write_step_dir(tmp, step, plain, None, metadata, extra_files=files, tokenizer=tokenizer)
    except BaseException:
        if rank == 0:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_save(out, tmp, final, step, keep)


class SafeReader:
    """torch.distributed.checkpoint's ``FileSystemReader`` whose metadata unpickler only builds the
    metadata's own classes (and torch's sizes and dtypes): a crafted ``.metadata`` cannot run code."""

    def __new__(cls, path: str | Path) -> Any:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import StorageMeta

        class _Reader(FileSystemReader):
            def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
                with open(Path(self.path) / ".metadata", "rb") as f:
                    metadata = _MetadataUnpickler(io.BytesIO(f.read(64 << 20))).load()
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                return metadata

        return _Reader(str(path))


class _MetadataUnpickler(pickle.Unpickler):
    _TORCH = frozenset({"Size", "strided", "contiguous_format", "preserve_format"})

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("torch.distributed.checkpoint."):  # its metadata records: dataclasses and enums only
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        if module == "torch" and (name in self._TORCH or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        safe = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}
        safe |= {("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath")}
        if (module, name) in safe | {("torch.serialization", "_get_layout")}:  # a layout by its name
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"distributed checkpoint metadata may not build {module}.{name}")


def load_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """Load the optimizer state a sharded run saved in ``directory`` into ``optimizer`` (of ``model``,
    sharded over any number of processes, or not at all): distributed checkpoint reshards it. The
    groups keep ``optimizer``'s own settings (weight decay, betas, ...): a resumed run uses its
    configuration's, as :func:`~attnlab.training.checkpoint.check_optimizer_state` has it for an
    unsharded checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    own = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    state = {"optimizer": get_optimizer_state_dict(model, optimizer)}  # the layout to fill
    try:
        dcp.load(state, storage_reader=SafeReader(directory))
    except (pickle.UnpicklingError, RuntimeError, ValueError, KeyError, AssertionError) as exc:
        raise ValueError(f"optimizer state {directory} does not fit this model: {first_line(exc)[:300]}") from None
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
    for group, settings in zip(optimizer.param_groups, own, strict=True):
        group.update(settings)  # (the file's groups were the saving run's settings)


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an unsharded run's ``optimizer.state_dict()`` (parameters by position, already checked by
    :func:`~attnlab.training.checkpoint.check_optimizer_state`) into the optimizer of the sharded ``model``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    # position in the param groups (as torch numbers them) -> parameter name
    fqn = dict(enumerate(names[id(p)] for group in optimizer.param_groups for p in group["params"]))
    by_name = {
        "state": {fqn[int(i)]: s for i, s in state["state"].items()},
        "param_groups": [{**g, "params": [fqn[int(i)] for i in g["params"]]} for g in state["param_groups"]],
    }
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Any:
    """FSDP2's counterpart of DDP's ``no_sync()``: no reduce-scatter of the gradients inside."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
