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
import hashlib
import io
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._io import atomic_write_bytes, atomic_write_json, current_umask, fsync_dir

__all__ = [
    "CHECKPOINT_NAME",
    "LATEST_NAME",
    "OPTIMIZER_NAME",
    "Checkpoint",
    "find_checkpoint",
    "get_rng_state",
    "has_checkpoint",
    "load_checkpoint",
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# RNG states as JSON
# --------------------------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def get_rng_state() -> dict[str, Any]:
    """Every random state a training step may touch, as plain JSON: torch's CPU generator
    (base64 of its byte state), the CUDA generators (one per visible device, if CUDA is up),
    NumPy's legacy global generator and Python's ``random``."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
        "cuda": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned (CUDA states only where CUDA is available)."""
    torch.set_rng_state(_unb64(state["torch"]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if state.get("cuda") and torch.cuda.is_available():
        cuda_states = [_unb64(s) for s in state["cuda"]]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


# --------------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------------
def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


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
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    out = Path(out_dir)
    ckpts = out / CHECKPOINTS_DIR
    ckpts.mkdir(parents=True, exist_ok=True)
    name = step_dirname(step)
    final = ckpts / name
    latest = _read_latest(out) if (out / LATEST_NAME).is_file() else None
    if latest is not None and latest.get("path") == f"{CHECKPOINTS_DIR}/{name}" and final.is_dir():
        return final

    # 1. Assemble the step directory under a temporary name; every file fsynced.
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=ckpts))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700: give it a plain mkdir's permissions
    try:
        model.save(tmp)  # model.safetensors + config.json, each written atomically
        files = ["model.safetensors", "config.json"]
        if optimizer is not None:
            buf = io.BytesIO()
            torch.save(optimizer.state_dict(), buf)
            atomic_write_bytes(tmp / OPTIMIZER_NAME, buf.getvalue())
            files.append(OPTIMIZER_NAME)
        meta = dict(metadata)
        meta.update(
            format=FORMAT,
            version=VERSION,
            step=int(step),
            files={f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in files},
        )
        atomic_write_json(tmp / CHECKPOINT_NAME, meta)
        fsync_dir(tmp)
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
    atomic_write_json(out / LATEST_NAME, {"format": FORMAT, "step": int(step), "path": f"{CHECKPOINTS_DIR}/{name}"})
    # 4. Only now forget old checkpoints (and debris of interrupted saves).
    steps = sorted(p for p in ckpts.iterdir() if p.is_dir() and p.name.startswith("step-") and p != final)
    for old in steps[: max(0, len(steps) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    for debris in ckpts.glob(".tmp-step-*"):
        shutil.rmtree(debris, ignore_errors=True)
    return final


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


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {path}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{what} {path} is truncated or corrupt (not valid JSON)") from None


def _read_latest(out: Path) -> dict[str, Any]:
    p = out / LATEST_NAME
    latest = _read_json(p, "checkpoint pointer")
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
        target = (p / _read_latest(p)["path"]).resolve()
        if not (target / CHECKPOINT_NAME).exists():
            raise ValueError(f"checkpoint pointer {p / LATEST_NAME} names {target}, which holds no {CHECKPOINT_NAME}")
        return target
    raise FileNotFoundError(f"no checkpoint in {p} (expected {LATEST_NAME} or {CHECKPOINT_NAME})")


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``checkpoint.json`` of the checkpoint meant by ``path`` (see :func:`find_checkpoint`), unverified."""
    d = find_checkpoint(path)
    meta = _read_json(d / CHECKPOINT_NAME, "checkpoint metadata")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{d / CHECKPOINT_NAME} is not an attnlab checkpoint (format entry missing)")
    return meta


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
    from .model import GPT

    d = find_checkpoint(path)
    meta = _read_json(d / CHECKPOINT_NAME, "checkpoint metadata")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("files"), dict):
        raise ValueError(f"{d / CHECKPOINT_NAME} is not an attnlab checkpoint (format entry missing)")
    if meta.get("version", 0) > VERSION:
        raise ValueError(f"{d / CHECKPOINT_NAME} has format version {meta['version']}; this attnlab reads <= {VERSION}")
    for name, info in meta["files"].items():
        f = d / name
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint file missing: {f}")
        size = f.stat().st_size
        if size != info.get("bytes"):
            raise ValueError(
                f"checkpoint file {f} is truncated or corrupt ({size} bytes, expected {info.get('bytes')})"
            )
        if _sha256(f) != info.get("sha256"):
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
    return Checkpoint(path=d, step=int(meta["step"]), model=model, metadata=meta, optimizer_state=opt_state)
