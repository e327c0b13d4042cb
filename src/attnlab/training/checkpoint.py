"""Training checkpoints that survive faults: atomic files, a consistent set, an atomic ``latest`` pointer.

Layout of a training directory ``DIR`` (``attnlab train --out DIR``)::

    DIR/latest.json                      {"step": 200, "path": "checkpoints/step-00000200", ...}
    DIR/checkpoints/step-00000200/
        model.safetensors                weights (tied weights stored once)      } what GPT.save()
        config.json                      the GPTConfig                           } writes: GPT.load() reads it
        optimizer.pt                     AdamW state: tensors and numbers only, loaded with weights_only=True
        checkpoint.json                  step, tokenizer, training settings, RNG states, data position,
                                         and the size + SHA-256 of each file above
    DIR/metrics.jsonl                    one JSON object per optimizer step (written by the trainer)

How a save stays consistent. Every file is written to a temporary name, fsynced and renamed; the
whole step directory is first assembled under a temporary name (``.tmp-step-...``), fsynced, and
renamed into ``checkpoints/``; only then is ``latest.json`` replaced (atomically) to point at it;
only after that are older step directories removed. A SIGKILL or power cut at any instant therefore
leaves ``latest.json`` naming a complete checkpoint: the previous one or the new one, never a mix.
The recorded SHA-256 of every file turns a truncated or bit-rotted file into a clear error naming
it, instead of a half-loaded model.

Nothing here unpickles: weights are safetensors, metadata is JSON, and the optimizer state goes
through ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import base64
import io
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnlab.checks import is_int
from attnlab.files import atomic_write_bytes, atomic_write_json, current_umask, fsync_dir, read_json, sha256_file

__all__ = [
    "CHECKPOINT_NAME",
    "LATEST_NAME",
    "OPTIMIZER_NAME",
    "Checkpoint",
    "find_checkpoint",
    "get_rng_state",
    "has_checkpoint",
    "load_checkpoint",
    "read_latest",
    "read_metadata",
    "save_checkpoint",
    "set_rng_state",
]

LATEST_NAME = "latest.json"
CHECKPOINT_NAME = "checkpoint.json"
OPTIMIZER_NAME = "optimizer.pt"
CHECKPOINTS_DIR = "checkpoints"
FORMAT = "attnlab-checkpoint"
VERSION = 1


# --------------------------------------------------------------------------------------------
# RNG states as JSON
# --------------------------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return mps is not None and mps.is_available() and hasattr(torch, "mps")


def get_rng_state() -> dict[str, Any]:
    """Every random state a training step may touch, as plain JSON: torch's CPU generator
    (base64 of its byte state), the CUDA generators (one per visible device, if CUDA is up),
    the Apple-GPU (MPS) generator where there is one, NumPy's legacy global generator and
    Python's ``random``."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "cuda": None,
        "mps": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    if _mps_available():  # dropout on an MPS model draws from this generator, not the CPU one
        state["mps"] = _b64(torch.mps.get_rng_state())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned (CUDA / MPS states only where that device is
    available)."""
    torch.set_rng_state(_unb64(state["torch"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if state.get("cuda") and torch.cuda.is_available():
        cuda_states = [_unb64(s) for s in state["cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
    if state.get("mps") and _mps_available():
        torch.mps.set_rng_state(_unb64(state["mps"]))


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------
def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


_STEP_DIR = re.compile(r"step-(\d+)")


def _step_of(p: Path) -> int | None:
    """The step of a ``step-N`` directory (None for anything else)."""
    m = _STEP_DIR.fullmatch(p.name)
    return int(m.group(1)) if m and p.is_dir() else None


def save_checkpoint(
    out_dir: str | os.PathLike[str],
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    metadata: dict[str, Any],
    keep: int = 2,
) -> Path:
    """Write a complete checkpoint for ``step`` into ``out_dir`` and point ``latest.json`` at it.

    Args:
        out_dir: the training directory (created if needed).
        step: number of optimizer steps taken so far.
        model: an :class:`attnlab.GPT` (not wrapped in DDP / torch.compile: pass the inner module).
        optimizer: its optimizer (state saved with ``torch.save``; only tensors and numbers).
        metadata: JSON-serialisable extras recorded in ``checkpoint.json`` (tokenizer, training
            settings, RNG states, data position, ...). ``step`` and the file list are added.
        keep: how many step directories to keep (the newest; at least 1).

    Returns the new step directory. Saving a step that ``latest.json`` already names is a no-op
    (the state at a given step is the same state).
    """
    if not is_int(keep) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    if not is_int(step) or step < 0:  # as load_checkpoint demands
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    step, keep = int(step), int(keep)  # e.g. numpy integers
    out = Path(out_dir)
    ckpts = out / CHECKPOINTS_DIR
    ckpts.mkdir(parents=True, exist_ok=True)
    name = step_dirname(step)
    final = ckpts / name
    latest = read_latest(out) if (out / LATEST_NAME).is_file() else None
    if latest is not None and latest.get("path") == f"{CHECKPOINTS_DIR}/{name}" and final.is_dir():
        return final

    # 1. Assemble the step directory under a temporary name; every file fsynced.
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=ckpts))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700: give it a plain mkdir's permissions
    try:
        _write_step_dir(tmp, step, model, optimizer, metadata)
        # 2. Move it into place. A directory of that name can only be debris of a run killed
        #    between this rename and the pointer switch (latest.json does not name it): replace it.
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(ckpts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # 3. The commit point: switch the pointer.
    atomic_write_json(out / LATEST_NAME, {"format": FORMAT, "step": step, "path": f"{CHECKPOINTS_DIR}/{name}"})
    # 4. Only now forget old checkpoints and debris.
    _prune_step_dirs(ckpts, final, step, keep)
    return final


def _write_step_dir(
    d: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, metadata: dict[str, Any]
) -> None:
    """The files of a checkpoint in ``d``, each written atomically, ``checkpoint.json`` (with their
    sizes and hashes) last; ``d`` itself fsynced."""
    model.save(d)  # model.safetensors + config.json
    files = ["model.safetensors", "config.json"]
    if optimizer is not None:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        atomic_write_bytes(d / OPTIMIZER_NAME, buf.getvalue())
        files.append(OPTIMIZER_NAME)
    meta = dict(metadata)
    meta.update(
        format=FORMAT,
        version=VERSION,
        step=step,
        files={f: {"bytes": (d / f).stat().st_size, "sha256": sha256_file(d / f)} for f in files},
    )
    atomic_write_json(d / CHECKPOINT_NAME, meta)
    fsync_dir(d)


def _prune_step_dirs(ckpts: Path, final: Path, step: int, keep: int) -> None:
    """Remove from ``ckpts`` every step directory but ``final`` and the newest ``keep - 1`` before
    it, and the debris of interrupted saves.

    A step directory at or past ``step`` that ``latest.json`` does not name was renamed into place
    by a run killed before its pointer switch (or a run this one resumed before): it is not part of
    this run's history. The older ones are ordered by step number (not by name: names may be wider
    than 8 digits or hand-made).
    """
    older: list[tuple[int, Path]] = []
    for p in ckpts.iterdir():
        s = _step_of(p)
        if s is None or p == final:
            continue
        if s >= step:
            shutil.rmtree(p, ignore_errors=True)
        else:
            older.append((s, p))
    older.sort()
    for _, old in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    for debris in ckpts.glob(".tmp-step-*"):
        shutil.rmtree(debris, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """A checkpoint read back by :func:`load_checkpoint`."""

    path: Path  # the step directory
    step: int
    model: Any  # attnlab.GPT
    metadata: dict[str, Any]  # checkpoint.json
    optimizer_state: dict[str, Any] | None


def read_latest(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint pointer ``latest.json`` of the training directory ``out_dir`` (its ``step``
    and the ``path`` of the step directory); ValueError naming the file when it is corrupt."""
    p = Path(out_dir) / LATEST_NAME
    latest = read_json(p, "checkpoint pointer")
    if not isinstance(latest, dict) or not isinstance(latest.get("path"), str):
        raise ValueError(f"checkpoint pointer {p} is corrupt (no 'path' entry)")
    return latest


def has_checkpoint(out_dir: str | os.PathLike[str]) -> bool:
    """Whether ``out_dir`` holds a checkpoint pointer (``latest.json``)."""
    return (Path(out_dir) / LATEST_NAME).is_file()


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The step directory meant by ``path``: a training directory (follows ``latest.json``) or a
    step directory itself (holding ``checkpoint.json``)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p}")
    if not p.is_dir():
        raise ValueError(
            f"checkpoint must be a directory (a training --out directory or a step directory), got file {p}"
        )
    if (p / CHECKPOINT_NAME).exists():
        return p
    if (p / LATEST_NAME).exists():
        pointer = read_latest(p)["path"]
        # attnlab only ever writes a relative "checkpoints/step-N" here; an absolute path or ".."
        # is a hand-edited or tampered pointer. (The string is checked, not the resolved path:
        # checkpoints/ may well be a symlink to another disk.)
        if Path(pointer).is_absolute() or ".." in Path(pointer).parts:
            raise ValueError(f"checkpoint pointer {p / LATEST_NAME} names {pointer!r}, outside {p}")
        target = (p / pointer).resolve()
        if not (target / CHECKPOINT_NAME).exists():
            raise ValueError(f"checkpoint pointer {p / LATEST_NAME} names {target}, which holds no {CHECKPOINT_NAME}")
        return target
    raise FileNotFoundError(f"no checkpoint in {p} (expected {LATEST_NAME} or {CHECKPOINT_NAME})")


def _check_metadata(meta: Any, where: Path) -> dict[str, Any]:
    """The structure of ``checkpoint.json``: a hand-edited or foreign file gives a ValueError
    naming it and the bad entry, never a TypeError from deep inside the loader."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{where} is not an attnlab checkpoint (format entry missing)")
    version = meta.get("version")
    if not is_int(version) or version < 1:
        raise ValueError(f"{where}: 'version' must be a positive integer, got {version!r}")
    if version > VERSION:
        raise ValueError(f"{where} has format version {version}; this attnlab reads <= {VERSION}")
    step = meta.get("step")
    if not is_int(step) or step < 0:
        raise ValueError(f"{where}: 'step' must be a non-negative integer, got {step!r}")
    files = meta.get("files")
    if not isinstance(files, dict):
        raise ValueError(f"{where}: 'files' must be an object of file name -> {{bytes, sha256}}, got {files!r}")
    for name, info in files.items():
        # Only plain names inside the step directory: a recorded '../x' must not make us read
        # (or hash) files elsewhere.
        if not name or name == "." or "/" in name or "\\" in name or ".." in name:
            raise ValueError(f"{where}: file name {name!r} in 'files' must be a plain name inside the step directory")
        if not isinstance(info, dict) or not is_int(info.get("bytes")) or not isinstance(info.get("sha256"), str):
            raise ValueError(f"{where}: files[{name!r}] must be {{'bytes': int, 'sha256': str}}, got {info!r}")
    return meta


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``checkpoint.json`` of the checkpoint meant by ``path`` (see :func:`find_checkpoint`);
    its structure is checked, the files it lists are not (see :func:`load_checkpoint`)."""
    d = find_checkpoint(path)
    return _check_metadata(read_json(d / CHECKPOINT_NAME, "checkpoint metadata"), d / CHECKPOINT_NAME)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    load_optimizer: bool = True,
) -> Checkpoint:
    """Read and verify a checkpoint: ``path`` is a training directory or a step directory.

    Every file is checked against the size and SHA-256 recorded in ``checkpoint.json`` before it
    is parsed, so a truncated or corrupt file is reported by name (``ValueError``) rather than
    half-loaded. The model is built from ``config.json`` and put on ``device``.
    """
    from attnlab.model import GPT

    d = find_checkpoint(path)
    meta = _check_metadata(read_json(d / CHECKPOINT_NAME, "checkpoint metadata"), d / CHECKPOINT_NAME)
    for name, info in meta["files"].items():
        f = d / name
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint file missing: {f}")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise ValueError(f"checkpoint file {f} is truncated or corrupt ({size} bytes, expected {info['bytes']})")
        if sha256_file(f) != info["sha256"]:
            raise ValueError(f"checkpoint file {f} is corrupt (SHA-256 differs from the one recorded at save time)")
    model = GPT.load(d, device=device)
    opt_state = None
    if load_optimizer and OPTIMIZER_NAME in meta["files"]:
        try:
            opt_state = torch.load(d / OPTIMIZER_NAME, map_location=device or "cpu", weights_only=True)
        except Exception as exc:  # a file that passed the hash check but is not a state dict
            raise ValueError(
                f"checkpoint file {d / OPTIMIZER_NAME} is not a loadable optimizer state ({exc})"
            ) from None
    return Checkpoint(path=d, step=meta["step"], model=model, metadata=meta, optimizer_state=opt_state)
