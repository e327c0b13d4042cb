"""Training checkpoints that survive faults: atomic files, a consistent set, an atomic ``latest`` pointer.

Layout of a training directory ``DIR`` (``attnlab train --out DIR``)::

    DIR/latest.json                      {"step": 200, "path": "checkpoints/step-00000200", ...}
    DIR/checkpoints/step-00000200/
        model.safetensors                weights (tied weights stored once)      } what GPT.save()
        config.json                      the GPTConfig                           } writes: GPT.load() reads it
        optimizer.pt                     AdamW state: tensors and numbers only, loaded with weights_only=True
        checkpoint.json                  step, tokenizer, training settings, RNG states, data position,
                                         the size + SHA-256 of each file above, and its own SHA-256
    DIR/metrics.jsonl                    one JSON object per optimizer step (written by the trainer)

How a save stays consistent. Every file is written to a temporary name, fsynced and renamed; the
whole step directory is first assembled under a temporary name (``.tmp-step-...``), fsynced, and
renamed into ``checkpoints/``; only then is ``latest.json`` replaced (atomically) to point at it;
only after that are older step directories removed. A SIGKILL or power cut at any instant therefore
leaves ``latest.json`` naming a complete checkpoint: the previous one or the new one, never a mix.

How a load stays honest. Nothing is trusted before it is checked; a failure is a ``ValueError`` /
``FileNotFoundError`` naming the file and the entry. Every entry of ``checkpoint.json`` is checked for
type and range, and its ``metadata_sha256`` (the SHA-256 of its own canonical JSON; absent in format
version 1) refuses a flipped bit or a hand edit. Every file a reader needs must match its recorded
size and SHA-256 before it is parsed; ``config.json`` must match the recorded configuration,
:data:`attnlab.checks.MODEL_LIMITS` and the weights' layer count before a module is built; the
optimizer state must fit the model (:func:`check_optimizer_state`) before ``load_state_dict``, so a
crafted state never reaches a kernel that would read out of bounds.

Nothing here unpickles: weights are safetensors, metadata is JSON, and the optimizer state goes
through ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import io
import json
import os
import random
import re
import shutil
import struct
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from attnlab.checks import finite_real, is_bool, is_int, is_real, positive_int
from attnlab.files import (
    atomic_write_bytes,
    atomic_write_json,
    current_umask,
    first_line,
    fsync_dir,
    open_regular,
    read_json,
    sha256_file,
)
from attnlab.model import CONFIG_NAME, GPT, WEIGHTS_NAME, GPTConfig
from attnlab.tokenizers import HF_TOKENIZER_FILE, Tokenizer, tokenizer_to_dict
from attnlab.training.lora import (
    ADAPTERS_NAME,
    LoRASettings,
    adapter_state,
    apply_lora,
    base_weights,
    has_lora,
    load_adapter_state,
    merge_lora,
)
from attnlab.training.optim import MuonAdamW

__all__ = [
    "CHECKPOINTS_DIR",
    "CHECKPOINT_NAME",
    "LATEST_NAME",
    "OPTIMIZER_NAME",
    "STEP_DIR",
    "Checkpoint",
    "check_optimizer_state",
    "find_checkpoint",
    "get_rng_state",
    "has_checkpoint",
    "load_checkpoint",
    "metadata_digest",
    "read_latest",
    "read_metadata",
    "save_checkpoint",
    "set_rng_state",
]

LATEST_NAME = "latest.json"
CHECKPOINT_NAME = "checkpoint.json"
OPTIMIZER_NAME = "optimizer.pt"
OPTIMIZER_DIR = "optimizer"  # a sharded run's optimizer state (attnlab.training.fsdp)
# What torch.distributed.checkpoint writes in a directory: one file per process (and writer), the metadata.
_DCP_FILE = re.compile(r"__\d+_\d+\.distcp|\.metadata(?:\.tmp)?")
CHECKPOINTS_DIR = "checkpoints"
FORMAT = "attnlab-checkpoint"
# 1: the first format; 2: checkpoint.json carries its own SHA-256 (SELF_HASH). Both are read.
VERSION = 2
SELF_HASH = "metadata_sha256"
FILE_NAMES = (WEIGHTS_NAME, CONFIG_NAME, OPTIMIZER_NAME, ADAPTERS_NAME, HF_TOKENIZER_FILE)  # what a step dir may list
METADATA_MAX_BYTES = 16 << 20  # checkpoint.json is ~40 KB per process (its RNG states)
INT64_MAX = 2**63 - 1
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _sha256_hex(value: Any) -> bool:
    return isinstance(value, str) and _HEX64.fullmatch(value) is not None


def _describe(value: Any) -> str:
    """A short description of a value for an error message (never its whole content)."""
    if isinstance(value, (dict, list, tuple)):
        return f"{type(value).__name__} of {len(value)} entries"
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# -- RNG states as JSON ----------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8).clone()


def _mps_available() -> bool:
    return torch.backends.mps.is_available()


def get_rng_state() -> dict[str, Any]:
    """Every random state a training step may touch, as plain JSON: torch's CPU, CUDA (one per device,
    if CUDA is up) and MPS generators (base64 of their bytes), NumPy's global one and ``random``'s."""
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
    available); a bad state (:func:`check_rng_state`) is a ValueError naming the generator."""
    check_rng_state(state, "rng state")
    setters = {"torch": lambda s: torch.set_rng_state(_unb64(s)), "numpy": _set_numpy, "python": _set_python}
    if state.get("cuda") and torch.cuda.is_available():
        setters["cuda"] = _set_cuda
    if state.get("mps") and _mps_available():
        setters["mps"] = lambda s: torch.mps.set_rng_state(_unb64(s))
    for name, apply in setters.items():
        try:
            apply(state[name])
        except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
            raise ValueError(f"rng state: the {name!r} generator refused its saved state ({first_line(exc)})") from None


def _set_numpy(s: list[Any]) -> None:
    name, keys, pos, has_gauss, cached = s
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))


def _set_python(s: list[Any]) -> None:
    version, internal, gauss_next = s
    random.setstate((version, tuple(internal), gauss_next))


def _set_cuda(s: list[str]) -> None:
    cuda_states = [_unb64(x) for x in s]
    if len(cuda_states) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda_states)


@functools.cache
def _torch_state_bytes() -> int:
    return torch.get_rng_state().numel()  # 5056 bytes: mt19937 and its extras


def _b64_bytes(value: Any) -> int | None:
    """The length of what base64 ``value`` decodes to; None when it is no base64 string."""
    if not isinstance(value, str) or len(value) > 1 << 20:
        return None
    try:
        return len(base64.b64decode(value, validate=True))
    except (binascii.Error, ValueError):
        return None


def _uint32_list(value: Any, n: int) -> bool:
    return isinstance(value, list) and len(value) == n and all(is_int(x) and 0 <= x < 2**32 for x in value)


def check_rng_state(state: Any, where: str) -> None:
    """ValueError naming ``where`` unless ``state`` has the shape :func:`get_rng_state` gives: a
    base64 torch state of the CPU generator's size, NumPy's ``MT19937`` tuple (624 words, a position,
    a cached Gaussian), Python's version-3 state (625 words), and base64 CUDA / MPS states or None."""
    if not isinstance(state, dict):
        raise ValueError(f"{where} must be an object of generator states, got {_describe(state)}")
    unknown = sorted(set(state) - {"torch", "numpy", "python", "cuda", "mps"})
    if unknown:
        raise ValueError(f"{where} has unknown generator(s) {unknown}")
    for name in ("torch", "numpy", "python"):
        if name not in state:
            raise ValueError(f"{where} has no {name!r} generator state")
    if _b64_bytes(state["torch"]) != _torch_state_bytes():
        raise ValueError(
            f"{where}: 'torch' must be the base64 of the CPU generator's {_torch_state_bytes()}-byte state, "
            f"got {_describe(state['torch'])}"
        )
    np_state = state["numpy"]
    if not (
        isinstance(np_state, list)
        and len(np_state) == 5
        and np_state[0] == "MT19937"
        and _uint32_list(np_state[1], 624)
        and is_int(np_state[2])
        and 0 <= np_state[2] <= 624
        and is_int(np_state[3])
        and np_state[3] in (0, 1)
        and finite_real(np_state[4])
    ):
        raise ValueError(
            f"{where}: 'numpy' must be ['MT19937', 624 words, position, has_gauss, cached], got {_describe(np_state)}"
        )
    py_state = state["python"]
    if not (
        isinstance(py_state, list)
        and len(py_state) == 3
        and py_state[0] == 3
        and _uint32_list(py_state[1], 625)
        and 1 <= py_state[1][-1] <= 624
        and (py_state[2] is None or finite_real(py_state[2]))
    ):
        raise ValueError(f"{where}: 'python' must be [3, 625 words, gauss or null], got {_describe(py_state)}")
    cuda = state.get("cuda")
    if cuda is not None and not (
        isinstance(cuda, list) and len(cuda) <= 1024 and all(_b64_bytes(s) is not None for s in cuda)
    ):
        raise ValueError(f"{where}: 'cuda' must be null or a list of base64 states, got {_describe(cuda)}")
    mps = state.get("mps")
    if mps is not None and _b64_bytes(mps) is None:
        raise ValueError(f"{where}: 'mps' must be null or a base64 state, got {_describe(mps)}")


# -- Saving ----------------------------------------------------------------------------------
def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


STEP_DIR = re.compile(r"step-(\d+)")  # a step directory's name (step_dirname)
# What attnlab itself puts in a step directory: its files, and their temporary files (atomic_open).
_NAMES = "|".join(re.escape(name) for name in (*FILE_NAMES, CHECKPOINT_NAME))
_OWN_FILE = re.compile(rf"(?:{_NAMES})|\.(?:{_NAMES})\..+\.tmp")


def _sharded_optimizer_file(name: str) -> bool:
    """``optimizer/<file>``: a file torch.distributed.checkpoint wrote for a sharded run."""
    head, _, tail = name.partition("/")
    return head == OPTIMIZER_DIR and _DCP_FILE.fullmatch(tail) is not None


def _written_by_attnlab(d: Path) -> bool:
    """Whether every entry of the step directory ``d`` is a file attnlab writes there, so that
    removing ``d`` removes nothing else (attnlab never deletes what it cannot prove it wrote)."""
    try:
        entries = list(d.iterdir())
    except OSError:
        return False
    return all(
        (e.is_file() and not e.is_symlink() and _OWN_FILE.fullmatch(e.name))
        or (e.name == OPTIMIZER_DIR and e.is_dir() and not e.is_symlink() and _all_dcp_files(e))
        for e in entries
    )


def _all_dcp_files(d: Path) -> bool:
    try:
        return all(e.is_file() and not e.is_symlink() and _DCP_FILE.fullmatch(e.name) for e in d.iterdir())
    except OSError:
        return False


def metadata_digest(meta: dict[str, Any]) -> str:
    """SHA-256 (hex) of ``meta``'s canonical JSON without its own ``metadata_sha256`` entry: keys
    sorted, no spaces, ASCII. What version-2 ``checkpoint.json`` files record about themselves."""
    body = {k: v for k, v in meta.items() if k != SELF_HASH}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def save_checkpoint(
    out_dir: str | os.PathLike[str],
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    metadata: dict[str, Any],
    keep: int = 2,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write a complete checkpoint for ``step`` into ``out_dir`` and point ``latest.json`` at it.

    ``model`` is an :class:`attnlab.GPT` (the inner module, not its DDP / torch.compile wrapper);
    ``metadata``: JSON-serialisable extras for ``checkpoint.json`` (settings, RNG states, data
    position, ...), to which the step, the file list and the SHA-256s are added; ``keep``: how many
    step directories to keep (the newest); ``tokenizer``: recorded by :func:`tokenizer_to_dict` (a
    Hugging Face tokenizer's JSON is copied in, so the checkpoint stands alone).

    Returns the new step directory. Saving the step ``latest.json`` names is a no-op; only step
    directories holding nothing but attnlab's own files are ever removed or replaced.
    """
    keep = positive_int("keep", keep)
    if not is_int(step) or step < 0 or step > INT64_MAX:  # as load_checkpoint demands
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    step = int(step)  # e.g. a numpy integer
    out = Path(out_dir)
    final, tmp = begin_save(out, step)
    if tmp is None:
        return final
    try:
        write_step_dir(tmp, step, model, optimizer, metadata, tokenizer=tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit_save(out, tmp, final, step, keep)


def begin_save(out: Path, step: int) -> tuple[Path, Path | None]:
    """(the step directory, a new temporary directory to assemble it in), or (the step directory,
    None) when ``latest.json`` already names it."""
    ckpts = out / CHECKPOINTS_DIR
    ckpts.mkdir(parents=True, exist_ok=True)
    name = step_dirname(step)
    final = ckpts / name
    latest = read_latest(out) if has_checkpoint(out) else None
    if latest is not None and latest.get("path") == f"{CHECKPOINTS_DIR}/{name}" and final.is_dir():
        return final, None
    ours = final.is_dir() and not final.is_symlink() and _written_by_attnlab(final)
    if (final.exists() or final.is_symlink()) and not ours:
        raise ValueError(f"{final} exists and holds files attnlab did not write; move it away to save step {step}")
    # 1. Assemble the step directory under a temporary name; every file fsynced.
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=ckpts))
    os.chmod(tmp, 0o777 & ~current_umask())  # mkdtemp makes it 0700: give it a plain mkdir's permissions
    return final, tmp


def commit_save(out: Path, tmp: Path, final: Path, step: int, keep: int) -> Path:
    """Publish the assembled ``tmp`` as ``final``: rename, switch ``latest.json``, prune."""
    ckpts = final.parent
    try:
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
    atomic_write_json(out / LATEST_NAME, {"format": FORMAT, "step": step, "path": f"{CHECKPOINTS_DIR}/{final.name}"})
    # 4. Only now forget old checkpoints and debris.
    _prune_step_dirs(ckpts, final, step, keep)
    return final


def write_step_dir(
    d: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    metadata: dict[str, Any],
    *,
    extra_files: list[str] | tuple[str, ...] = (),
    tokenizer: Tokenizer | None = None,
) -> None:
    """The files of a checkpoint in ``d``, each written atomically, ``checkpoint.json`` (with their
    sizes and hashes, and its own) last; ``d`` itself fsynced. ``tokenizer``: see :func:`save_checkpoint`."""
    with base_weights(model):  # a LoRA model: the frozen base here, its adapters beside it
        model.save(d)  # model.safetensors + config.json
    files = [WEIGHTS_NAME, CONFIG_NAME, *extra_files]  # extra: a sharded optimizer state, already written
    metadata = {k: v for k, v in metadata.items() if k != SELF_HASH}  # a copy: the caller's stays as it was
    if tokenizer is not None:
        metadata["tokenizer"] = tokenizer_to_dict(tokenizer, d)
        if metadata["tokenizer"].get("path") == HF_TOKENIZER_FILE:
            files.append(HF_TOKENIZER_FILE)
    if has_lora(model):
        from safetensors.torch import save as st_save

        atomic_write_bytes(d / ADAPTERS_NAME, st_save(adapter_state(model), metadata={"format": "pt"}))
        files.append(ADAPTERS_NAME)
        metadata["lora"] = dict(model.lora_settings)
    if optimizer is not None:
        buf = io.BytesIO()
        torch.save(optimizer.state_dict(), buf)
        atomic_write_bytes(d / OPTIMIZER_NAME, buf.getvalue())
        files.append(OPTIMIZER_NAME)
    metadata.update(
        format=FORMAT,
        version=VERSION,
        step=step,
        files={f: {"bytes": (d / f).stat().st_size, "sha256": sha256_file(d / f)} for f in files},
    )
    # Hash what a reader will parse: the JSON round trip turns tuples into lists, int keys into strings.
    meta = json.loads(json.dumps(metadata))
    meta[SELF_HASH] = metadata_digest(meta)
    atomic_write_json(d / CHECKPOINT_NAME, meta)
    fsync_dir(d)


def _prune_step_dirs(ckpts: Path, final: Path, step: int, keep: int) -> None:
    """Remove from ``ckpts`` every step directory but ``final`` and the newest ``keep - 1`` before
    it (by step number: names may be hand-made), and the debris of interrupted saves, unless it holds
    anything attnlab did not write. One at or past ``step`` is not this run's history (a run killed
    before its pointer switch left it)."""
    older: list[tuple[int, Path]] = []
    for p in ckpts.iterdir():
        m = STEP_DIR.fullmatch(p.name)
        if not m or not p.is_dir() or p.is_symlink() or p == final or not _written_by_attnlab(p):
            continue
        if int(m.group(1)) >= step:
            shutil.rmtree(p, ignore_errors=True)
        else:
            older.append((int(m.group(1)), p))
    older.sort()
    for _, old in older[: max(0, len(older) - (keep - 1))]:
        shutil.rmtree(old, ignore_errors=True)
    remove_save_debris(ckpts)


def remove_save_debris(ckpts: Path) -> None:
    """Remove the step directories that interrupted saves left in ``ckpts`` (``.tmp-step-*``), unless one
    holds anything attnlab did not write. Only while no other process may be saving there (the run lock)."""
    for debris in ckpts.glob(".tmp-step-*"):
        if debris.is_dir() and not debris.is_symlink() and _written_by_attnlab(debris):
            shutil.rmtree(debris, ignore_errors=True)


# -- Loading ---------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """A checkpoint read back by :func:`load_checkpoint`."""

    path: Path  # the step directory
    step: int
    model: Any  # attnlab.GPT
    metadata: dict[str, Any]  # checkpoint.json
    optimizer_state: dict[str, Any] | None
    optimizer_dir: Path | None = None  # a sharded run's optimizer state (verified), for attnlab.training.fsdp


def has_checkpoint(out_dir: str | os.PathLike[str]) -> bool:
    """Whether ``out_dir`` holds a checkpoint pointer (``latest.json``; anything of that name counts,
    so that a damaged one is reported rather than taken for a fresh directory)."""
    return os.path.lexists(Path(out_dir) / LATEST_NAME)


def recover_latest(out_dir: str | os.PathLike[str], verify: Callable[[Path], int] | None = None) -> Path | None:
    """A run's only step directory, once every file it lists is whole, made its checkpoint again by
    writing the ``latest.json`` its save was stopped before (a kill between the step directory's
    rename and the pointer's write); None where there is a pointer, or not exactly one such directory.
    ``verify(step directory)`` checks its files and returns its step (default: a training run's
    checkpoint, as :func:`load_checkpoint` checks it). The caller holds the run's lock."""
    out = Path(out_dir)
    steps = sorted((out / CHECKPOINTS_DIR).glob("step-*")) if (out / CHECKPOINTS_DIR).is_dir() else []
    if os.path.lexists(out / LATEST_NAME) or len(steps) != 1:
        return None
    step = (verify or _verified_step)(steps[0])
    atomic_write_json(out / LATEST_NAME, {"format": FORMAT, "step": step, "path": f"{CHECKPOINTS_DIR}/{steps[0].name}"})
    return steps[0]


def _verified_step(d: Path) -> int:
    d, meta = _read_checked(d)
    for name, info in meta["files"].items():
        _verify_file(d, name, info)
    return meta["step"]


def read_latest(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint pointer ``latest.json`` of the training directory ``out_dir`` (its ``step``
    and the ``path`` of the step directory); ValueError naming the file when it is corrupt."""
    p = Path(out_dir) / LATEST_NAME
    latest = read_json(p, "checkpoint pointer", max_bytes=1 << 16)
    if not isinstance(latest, dict) or not isinstance(latest.get("path"), str):
        raise ValueError(f"checkpoint pointer {p} is corrupt (no 'path' entry)")
    if "format" in latest and latest["format"] != FORMAT:
        raise ValueError(f"checkpoint pointer {p} is corrupt ('format' is {_describe(latest['format'])})")
    step = latest.get("step")
    if not is_int(step) or not 0 <= step <= INT64_MAX:
        raise ValueError(f"checkpoint pointer {p} is corrupt ('step' must be a non-negative integer, got {step!r})")
    return latest


def find_checkpoint(path: str | os.PathLike[str]) -> Path:
    """The step directory meant by ``path``: a training directory (follows ``latest.json``) or a
    step directory itself (holding ``checkpoint.json``)."""
    return _find(path)[0]


def _find(path: str | os.PathLike[str]) -> tuple[Path, int | None]:
    """(:func:`find_checkpoint`, the step ``latest.json`` names, or None for a step directory): the
    pointer read once, so a run switching it meanwhile is not taken for a damaged checkpoint."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"checkpoint not found: {p}")
    if not p.is_dir():
        raise ValueError(
            f"checkpoint must be a directory (a training --out directory or a step directory), got file {p}"
        )
    if os.path.lexists(p / CHECKPOINT_NAME):
        return p, None
    if has_checkpoint(p):
        latest = read_latest(p)
        pointer = latest["path"]
        # attnlab only writes a relative "checkpoints/step-N": an absolute path or ".." is tampering.
        # (The string is checked, not the resolved path: checkpoints/ may be a link to another disk.)
        if Path(pointer).is_absolute() or ".." in Path(pointer).parts:
            raise ValueError(f"checkpoint pointer {p / LATEST_NAME} names {pointer!r}, outside {p}")
        target = (p / pointer).resolve()
        if not (target / CHECKPOINT_NAME).exists():
            raise ValueError(f"checkpoint pointer {p / LATEST_NAME} names {target}, which holds no {CHECKPOINT_NAME}")
        return target, int(latest["step"])
    raise FileNotFoundError(f"no checkpoint in {p} (expected {LATEST_NAME} or {CHECKPOINT_NAME})")


# -- the schema of checkpoint.json ----------------------------------------------------------------
def _check_metadata(meta: Any, where: Path, *, latest_step: int | None = None) -> dict[str, Any]:
    """The whole of ``checkpoint.json``, checked: a hand-edited, damaged or foreign file gives a
    ValueError naming it and the bad entry. First every entry the trainer writes (where present), then,
    from format version 2, the file's own SHA-256 (which refuses an edit that keeps entries plausible)."""
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{where} is not an attnlab checkpoint (format entry missing)")
    version = meta.get("version")
    if not is_int(version) or version < 1:
        raise ValueError(f"{where}: 'version' must be a positive integer, got {version!r}")
    if version > VERSION:
        raise ValueError(f"{where} has format version {version}; this attnlab reads <= {VERSION}")
    step = meta.get("step")
    if not is_int(step) or not 0 <= step <= INT64_MAX:
        raise ValueError(f"{where}: 'step' must be a non-negative integer, got {step!r}")
    _check_files(meta.get("files"), where)
    for name, check in _ENTRY_CHECKS.items():
        if name in meta:
            try:
                check(meta[name], meta)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{where}: {name!r}: {first_line(exc)}") from None
    digest = meta.get(SELF_HASH)
    if version >= 2 or digest is not None:
        if not _sha256_hex(digest):
            raise ValueError(f"{where}: '{SELF_HASH}' must be a SHA-256 (64 hex digits), got {_describe(digest)}")
        if digest != metadata_digest(meta):
            raise ValueError(
                f"{where} is corrupt or was edited: its content does not match its own SHA-256 ('{SELF_HASH}')"
            )
    if latest_step is not None and latest_step != step:
        raise ValueError(f"{where} holds step {step}, but {LATEST_NAME} says step {latest_step}")
    return meta


def _check_files(files: Any, where: Path) -> None:
    if not isinstance(files, dict):
        raise ValueError(f"{where}: 'files' must be an object of file name -> {{bytes, sha256}}, got {files!r}")
    for name, info in files.items():
        # Only attnlab's own plain names inside the step directory: a recorded '../x' must not
        # make us read (or hash) files elsewhere.
        if name not in FILE_NAMES and not _sharded_optimizer_file(name):
            raise ValueError(
                f"{where}: file name {name!r} in 'files' is not one of the step directory's files "
                f"({', '.join(FILE_NAMES)})"
            )
        if (
            not isinstance(info, dict)
            or set(info) != {"bytes", "sha256"}
            or not is_int(info["bytes"])
            or not 0 <= info["bytes"] <= INT64_MAX
            or not _sha256_hex(info["sha256"])
        ):
            raise ValueError(
                f"{where}: files[{name!r}] must be {{'bytes': int, 'sha256': 64 hex digits}}, got {info!r}"
            )
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        if name not in files:
            raise ValueError(f"{where}: 'files' does not list {name} (every checkpoint has it)")


def _check_tokenizer(tok: Any, meta: dict[str, Any]) -> None:
    if not isinstance(tok, dict) or not isinstance(tok.get("name"), str):
        raise ValueError(f"must be an object with a tokenizer 'name', got {_describe(tok)}")
    name = tok["name"]
    keys = {
        "byte": {"name"},
        "char": {"name", "chars"},
        "gpt2": {"name", "bpe_dir", "vocab_bpe_sha256", "encoder_json_sha256"},
        "hf": {"name", "path", "sha256", "eot_id", "bos_id"},  # a pretrained model's tokenizer.json
    }
    if name not in keys:
        raise ValueError(f"unknown tokenizer {name!r} (byte, char, gpt2 or hf)")
    if not set(tok) <= keys[name]:
        raise ValueError(f"unknown entries {sorted(set(tok) - keys[name])} for the {name} tokenizer")
    if name == "char":
        chars = tok.get("chars")
        if not isinstance(chars, str) or not chars or len(set(chars)) != len(chars):
            raise ValueError("'chars' must be a non-empty string of distinct characters")
    if name == "gpt2":
        if tok.get("bpe_dir") is not None and not isinstance(tok["bpe_dir"], str):
            raise ValueError(f"'bpe_dir' must be a path or null, got {_describe(tok['bpe_dir'])}")
        for key in ("vocab_bpe_sha256", "encoder_json_sha256"):
            if tok.get(key) is not None and not _sha256_hex(tok[key]):
                raise ValueError(f"{key!r} must be a SHA-256 or null, got {_describe(tok[key])}")
    if name == "hf":
        if not isinstance(tok.get("path"), str) or not _sha256_hex(tok.get("sha256")):
            raise ValueError("the hf tokenizer needs the 'path' and 'sha256' of its tokenizer.json")
        for key in ("eot_id", "bos_id"):
            if tok.get(key) is not None and not (is_int(tok[key]) and tok[key] >= 0):
                raise ValueError(f"{key!r} must be a token id or null, got {_describe(tok[key])}")
        return  # its vocabulary is the file's: checked against the model when the file is read
    vocab = {"byte": 256, "gpt2": 50257}.get(name, len(tok.get("chars") or ""))
    model_vocab = meta.get("model_config", {}).get("vocab_size") if isinstance(meta.get("model_config"), dict) else None
    if is_int(model_vocab) and model_vocab != vocab:
        raise ValueError(f"the {name} tokenizer has {vocab} token ids but model_config's vocab_size is {model_vocab}")


def model_config_from(d: Any, what: str) -> GPTConfig:
    """A :class:`GPTConfig` from a JSON object, its sizes checked against
    :data:`~attnlab.checks.MODEL_LIMITS` (by ``GPTConfig`` itself) before anything would be built;
    ValueError naming ``what``."""
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be an object of GPTConfig fields, got {_describe(d)}")
    try:
        return GPTConfig.from_dict(d)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what}: {first_line(exc)}") from None


def _check_train_config(d: Any, meta: dict[str, Any]) -> None:
    from attnlab.training.config import TrainConfig  # config imports the model, as this module does

    if not isinstance(d, dict):
        raise ValueError(f"must be an object of training settings, got {_describe(d)}")
    TrainConfig.from_dict(d).validate()
    model = meta.get("model_config")
    T = d.get("context_length")
    # A pretrained model (init_from) trains on windows shorter than its context.
    if isinstance(model, dict) and T is not None and model.get("context_length") != T and not d.get("init_from"):
        raise ValueError(f"context_length {T!r} differs from model_config's {model.get('context_length')!r}")


def _check_rng(states: Any, meta: dict[str, Any]) -> None:
    if not isinstance(states, list) or not 1 <= len(states) <= 1 << 20:
        raise ValueError(f"must be a list of one generator state per process, got {_describe(states)}")
    n = meta.get("world_size")
    if is_int(n) and n != len(states):
        raise ValueError(f"holds {len(states)} process states but 'world_size' is {n}")
    for i, state in enumerate(states):
        check_rng_state(state, f"process {i}")


def _check_data(d: Any, meta: dict[str, Any]) -> None:
    if not isinstance(d, dict):
        raise ValueError(f"must be an object (sampler, next_step, seed, ...), got {_describe(d)}")
    checks = {
        "sampler": lambda v: v == "RandomWindowBatches",
        "next_step": lambda v: v == meta.get("step"),
        "seed": lambda v: is_int(v) and 0 <= v < 2**64,
        "global_batch_size": lambda v: is_int(v) and 1 <= v <= INT64_MAX,
        "context_length": lambda v: is_int(v) and 1 <= v <= INT64_MAX,
        "source": lambda v: v is None or isinstance(v, str),
        "sha256": lambda v: v is None or _sha256_hex(v),
    }
    for key, ok in checks.items():
        if key in d and not ok(d[key]):
            want = f"the checkpoint's step ({meta.get('step')})" if key == "next_step" else "a valid value"
            raise ValueError(f"{key!r} must be {want}, got {_describe(d[key])}")
    unknown = sorted(set(d) - set(checks))
    if unknown:
        raise ValueError(f"unknown entries {unknown}")
    tc, model = meta.get("train_config"), meta.get("model_config")
    pairs = [("seed", tc, "seed"), ("global_batch_size", tc, "batch_size"), ("context_length", model, "context_length")]
    if isinstance(tc, dict) and tc.get("init_from"):  # windows shorter than the model's context
        pairs = [*pairs[:2], ("context_length", tc, "context_length")]
    for key, other, other_key in pairs:
        if key in d and isinstance(other, dict) and other_key in other and other[other_key] != d[key]:
            raise ValueError(f"{key!r} is {d[key]!r} but the checkpoint's {other_key} is {other[other_key]!r}")


def _expect(ok: Callable[[Any], bool], want: str) -> Callable[[Any, dict[str, Any]], None]:
    """The check of an entry that needs nothing but ``ok(value)``; ``want`` says what it must be."""

    def check(v: Any, meta: dict[str, Any]) -> None:
        if not ok(v):
            raise ValueError(f"must be {want}, got {_describe(v)}")

    return check


def _check_stop_ids(v: Any, meta: dict[str, Any]) -> None:
    """The ids a chat or a generation stops at (a fine-tuned instruct model's end-of-turn / end-of-text)."""
    model = meta.get("model_config")
    vocab = model.get("vocab_size") if isinstance(model, dict) else None
    limit = vocab if is_int(vocab) and vocab > 0 else INT64_MAX
    if not isinstance(v, list) or len(v) > 64 or not all(is_int(i) and 0 <= i < limit for i in v):
        raise ValueError(f"must be a list of token ids in [0, {limit}), got {_describe(v)}")


def _check_lora(v: Any, meta: dict[str, Any]) -> None:
    if not isinstance(v, dict) or set(v) != {"rank", "alpha", "targets"}:
        raise ValueError(f"must be an object of rank, alpha and targets, got {_describe(v)}")
    LoRASettings.make(**v)


_ENTRY_CHECKS = {
    "tokenizer": _check_tokenizer,
    "model_config": lambda d, meta: model_config_from(d, "the model configuration"),
    "train_config": _check_train_config,
    "world_size": _expect(lambda n: is_int(n) and 1 <= n <= 1 << 20, "a positive number of processes"),
    "rng": _check_rng,
    "data": _check_data,
    "val_loss": _expect(lambda v: v is None or finite_real(v), "a finite number or null"),
    "torch_version": _expect(lambda v: isinstance(v, str) and len(v) <= 200, "a version string"),
    "lora": _check_lora,
    "stop_ids": _check_stop_ids,
}


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """``checkpoint.json`` of the checkpoint meant by ``path`` (:func:`find_checkpoint`), its schema
    and its own SHA-256 checked (not the files it lists: :func:`load_checkpoint`)."""
    return _read_checked(path)[1]


def _read_checked(path: str | os.PathLike[str]) -> tuple[Path, dict[str, Any]]:
    """(the step directory meant by ``path``, its ``checkpoint.json`` checked whole; for a training
    directory, against the step ``latest.json`` names)."""
    d, latest = _find(path)
    meta = read_json(d / CHECKPOINT_NAME, "checkpoint metadata", max_bytes=METADATA_MAX_BYTES)
    return d, _check_metadata(meta, d / CHECKPOINT_NAME, latest_step=latest)


def _verify_file(d: Path, name: str, info: dict[str, Any]) -> Path:
    """``d / name``, a regular file of the recorded size and SHA-256; an error naming it otherwise."""
    f = d / name
    if not f.is_file():
        what = "is not a regular file" if os.path.lexists(f) else "missing"
        raise (FileNotFoundError if what == "missing" else ValueError)(f"checkpoint file {what}: {f}")
    size = f.stat().st_size
    if size != info["bytes"]:
        raise ValueError(f"checkpoint file {f} is truncated or corrupt ({size} bytes, expected {info['bytes']})")
    if sha256_file(f, what="checkpoint file") != info["sha256"]:
        raise ValueError(f"checkpoint file {f} is corrupt (SHA-256 differs from the one recorded at save time)")
    return f


def _safetensors_layers(path: Path) -> int | None:
    """How many transformer blocks a GPT weights file holds, from its JSON header alone (None when
    the header cannot be read: safetensors' own loader then reports the file)."""
    try:
        with open_regular(path, "checkpoint file") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(100 << 20, path.stat().st_size - 8):
                return None
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    layers = {int(m.group(1)) for k in header if (m := re.match(r"trf_blocks\.(\d+)\.", k))}
    return max(layers) + 1 if layers else 0


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    load_optimizer: bool = True,
    merge_adapters: bool = False,
) -> Checkpoint:
    """Read and verify a checkpoint (see the module docstring): ``path`` is a training directory or a
    step directory; the model is put on ``device``. With ``load_optimizer=False`` (generation,
    visualisation) ``optimizer.pt`` is neither read nor hashed; otherwise it is loaded with
    ``weights_only=True`` (:func:`check_optimizer_state` checks it against a model).

    A LoRA run's checkpoint (a ``lora`` entry, ``adapters.safetensors``) gives the base model with
    its adapters (:mod:`attnlab.training.lora`), or with ``merge_adapters`` a plain model with them
    merged into its weights (what generation and the inspector read).
    """
    d, meta = _read_checked(path)
    where = d / CHECKPOINT_NAME
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        _verify_file(d, name, meta["files"][name])
    config = model_config_from(read_json(d / CONFIG_NAME, "model config", max_bytes=1 << 20), f"{d / CONFIG_NAME}")
    if "model_config" in meta and config != GPTConfig.from_dict(meta["model_config"]):
        raise ValueError(f"{d / CONFIG_NAME} differs from the model configuration recorded in {where}")
    layers = _safetensors_layers(d / WEIGHTS_NAME)
    if layers is not None and layers != config.n_layers:
        raise ValueError(f"{d / CONFIG_NAME} describes {config.n_layers} layers but {d / WEIGHTS_NAME} holds {layers}")
    model = GPT.load(d, device=device)
    if "lora" in meta:
        if ADAPTERS_NAME not in meta["files"]:
            raise ValueError(f"{where} records LoRA settings but no {ADAPTERS_NAME}")
        from safetensors.torch import load_file

        f = _verify_file(d, ADAPTERS_NAME, meta["files"][ADAPTERS_NAME])
        apply_lora(model, LoRASettings.make(**meta["lora"]))
        load_adapter_state(model, load_file(str(f)), where=str(f))
        if merge_adapters:
            merge_lora(model)
    opt_state = None
    if load_optimizer and OPTIMIZER_NAME in meta["files"]:
        f = _verify_file(d, OPTIMIZER_NAME, meta["files"][OPTIMIZER_NAME])
        # AdamW keeps two tensors of each parameter's size (three with amsgrad): a file much larger
        # than that is not an optimizer state of this model, and is not loaded into memory.
        limit = 4 * sum(p.numel() * p.element_size() for p in model.parameters()) + (16 << 20)
        if f.stat().st_size > limit:
            raise ValueError(
                f"checkpoint file {f} is {f.stat().st_size:,} bytes, too large for this model's optimizer state"
            )
        opt_state = _load_tensors(f, device)
    opt_dir = None
    sharded = [name for name in meta["files"] if _sharded_optimizer_file(name)]
    if load_optimizer and sharded:
        for name in sharded:
            _verify_file(d, name, meta["files"][name])
        opt_dir = d / OPTIMIZER_DIR
    return Checkpoint(
        path=d, step=meta["step"], model=model, metadata=meta, optimizer_state=opt_state, optimizer_dir=opt_dir
    )


def _load_tensors(f: Path, device: torch.device | str | None) -> Any:
    """``torch.load(f, weights_only=True)``: plain containers, numbers and tensors, never a pickled
    object; anything else is one line saying so (torch's own refusal is many lines long, and advises
    ``weights_only=False``, which attnlab never does)."""
    try:
        # (torch warns about a raw pickle before refusing it: the refusal below is the one line)
        with open_regular(f, "checkpoint file") as fh, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(fh, map_location=device or "cpu", weights_only=True)
    except Exception as exc:  # an unpickling error, a torn zip archive, ...
        raise ValueError(
            f"checkpoint file {f} is not a plain tensor checkpoint (torch.load with weights_only=True refused it: "
            f"{type(exc).__name__}); attnlab never unpickles objects"
        ) from None


# -- the optimizer state against the model -------------------------------------------------------
_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
_MUON_STATE = ("step", "momentum_buffer")  # MuonAdamW's Muon groups


def check_optimizer_state(
    state: Any, optimizer: torch.optim.Optimizer, *, step: int, where: str | os.PathLike[str] = OPTIMIZER_NAME
) -> dict[str, Any]:
    """A saved Adam/AdamW/:class:`MuonAdamW` ``state`` checked against ``optimizer`` (built for this model), returned in
    the form to pass to ``optimizer.load_state_dict``; ValueError naming ``where`` on any mismatch.

    ``load_state_dict`` itself checks little: a crafted ``exp_avg`` of shape ``(1,)`` loads, then the
    fused kernel reads past its end. So the param groups must have this optimizer's layout, and every
    parameter (none before the first step) one state with exactly Adam's or Muon's entries, of its
    shape and dtype, finite (second moments non-negative), with a float ``step`` counter equal to
    ``step``. The result keeps ``optimizer``'s own group settings (lr, betas, ...): a resumed run uses
    its configuration's, not the file's.
    """
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, MuonAdamW)):
        raise TypeError(f"optimizer must be torch.optim.Adam, AdamW or MuonAdamW, got {type(optimizer).__name__}")

    def bad(msg: str) -> ValueError:
        return ValueError(f"optimizer state {where} does not fit this model: {msg}")

    if not isinstance(state, dict) or set(state) != {"state", "param_groups"}:
        raise bad(f"expected a dict of 'state' and 'param_groups', got {_describe(state)}")
    mine = optimizer.state_dict()["param_groups"]
    groups = state["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(mine):
        raise bad(f"expected {len(mine)} param groups, got {_describe(groups)}")
    params: dict[Any, Tensor] = {}
    names_of: dict[Any, tuple[str, ...]] = {}  # the state entries each parameter must have
    adam_names = _ADAM_STATE + (("max_exp_avg_sq",) if optimizer.defaults.get("amsgrad") else ())
    loadable_groups = []
    for i, (saved, own, live) in enumerate(zip(groups, mine, optimizer.param_groups, strict=True)):
        if not isinstance(saved, dict) or not isinstance(saved.get("params"), list):
            raise bad(f"param group {i} is {_describe(saved)}, not a group of parameter ids")
        ids = saved["params"]
        if len(ids) != len(own["params"]) or not all(is_int(x) for x in ids):
            raise bad(f"param group {i} has {len(ids)} parameter ids, this model {len(own['params'])}")
        if set(saved) != set(own):
            raise bad(f"param group {i} has the settings {sorted(saved)}, expected {sorted(own)}")
        for key, value in saved.items():
            if key != "params" and not _setting_like(value, own[key]):
                raise bad(f"param group {i}: {key} is {_describe(value)}")
        params.update(zip(ids, live["params"], strict=True))
        names_of.update(dict.fromkeys(ids, _MUON_STATE if own.get("use_muon") else adam_names))
        loadable_groups.append({**own, "params": list(ids)})
    if len(params) != sum(len(g["params"]) for g in mine):
        raise bad("parameter ids repeat")
    per_param = state["state"]
    if not isinstance(per_param, dict):
        raise bad(f"'state' is {_describe(per_param)}, not a dict of per-parameter states")
    want = len(params) if step > 0 else 0  # a fresh optimizer holds no state
    if len(per_param) != want:
        raise bad(f"it holds the state of {len(per_param)} parameters, after step {step} there are {want}")
    for pid, s in per_param.items():
        if not is_int(pid) or pid not in params:
            raise bad(f"a state for parameter {pid!r}, which no param group lists")
        p, names = params[pid], names_of[pid]
        if not isinstance(s, dict) or set(s) != set(names):
            got = sorted(s) if isinstance(s, dict) else _describe(s)
            raise bad(f"the state of parameter {pid} has {got}, expected {sorted(names)}")
        for name in names[1:]:
            t = s[name]
            if not isinstance(t, Tensor) or t.layout != torch.strided or t.shape != p.shape or t.dtype != p.dtype:
                raise bad(
                    f"{name} of parameter {pid} is {_describe(t)}, expected shape {tuple(p.shape)} and dtype {p.dtype}"
                )
            if not bool(torch.isfinite(t).all()) or (name.endswith("_sq") and bool((t < 0).any())):
                raise bad(f"{name} of parameter {pid} holds non-finite or negative values")
        counter = s["step"]
        if not isinstance(counter, Tensor) or counter.shape != () or not counter.is_floating_point():
            raise bad(f"the step counter of parameter {pid} is {_describe(counter)}, expected a float scalar")
        if float(counter) != step:
            raise bad(f"the step counter of parameter {pid} is {float(counter)}, but the checkpoint is at step {step}")
    return {"state": per_param, "param_groups": loadable_groups}


def _setting_like(value: Any, own: Any) -> bool:
    """A saved param-group setting of the same kind as this optimizer's (a flag, a finite number, a
    pair of finite numbers), so loading it cannot smuggle in an object."""
    if own is None or is_bool(own):
        return value is None or is_bool(value)
    if is_real(own):
        return finite_real(value)
    if isinstance(own, (tuple, list)):
        return isinstance(value, (tuple, list)) and len(value) == len(own) and all(finite_real(v) for v in value)
    return False
