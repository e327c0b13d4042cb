"""What a training run is: :class:`TrainConfig` (the ``attnlab train`` flags, checked), the rules
for resuming a run, and the learning-rate schedule.

Resuming (``resume=True`` with a checkpoint in ``out``): the settings the caller did not set are
taken from the checkpoint's; the ones in :attr:`TrainConfig.FIXED_ON_RESUME` (model, data,
tokenizer, seed, ...) must not differ from it. This holds for the CLI and the Python API alike.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnlab.checks import finite_real, is_bool, is_int, is_real
from attnlab.hardware import PRECISIONS
from attnlab.model import GPTConfig

__all__ = [
    "DEFAULT_MAX_TIME",
    "INT_LIMIT",
    "OPTIMIZERS",
    "PLAN_STEPS",
    "PRECISIONS",
    "SEED_LIMIT",
    "TINY_LR",
    "TrainConfig",
    "absolute_path",
    "canonical_preset",
    "default_lr",
    "lr_at",
    "model_path",
]

SEED_LIMIT = 2**64  # torch.manual_seed takes seeds below it
INT_LIMIT = 2**63 - 1  # counts pass through int64 tensors and NumPy arrays


def _path_like(value: Any) -> bool:
    """A non-empty path: ``""`` would mean the working directory, never what someone meant."""
    return isinstance(value, (str, os.PathLike)) and str(value) != ""


def _flag(name: str) -> str:
    """The ``attnlab train`` flag of a :class:`TrainConfig` field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


@dataclass
class TrainConfig:
    """Everything ``attnlab train`` needs (the CLI flags, one field each).

    The defaults are tuned so that ``attnlab train`` with no flags trains the ``tiny`` preset on
    the built-in corpus in a few minutes even on a small CPU (see the README for the figures).
    """

    data: str | None = None  # UTF-8 text file; None = the built-in corpus (pydoc_data.topics)
    tokenizer: str = "byte"  # byte | char | gpt2
    bpe_dir: str | None = None  # gpt2: directory with encoder.json + vocab.bpe
    preset: str = "tiny"
    context_length: int | None = None  # None: 64 for tiny (tuned), else the preset's
    dropout: float | None = None  # None = the preset's drop_rate
    batch_size: int = 32  # global rows per optimizer step (over all processes and micro-steps)
    grad_accum: int = 1
    max_steps: int = 800
    # Seconds of training steps to plan for: after PLAN_STEPS steps, max_steps is lowered to the
    # steps that fit at the measured rate (a bare `attnlab train` gets DEFAULT_MAX_TIME).
    max_time: float | None = None
    optimizer: str = "muon"  # adamw | muon (Muon on the blocks' matrices, AdamW on the rest)
    lr: float | None = None  # None: see default_lr(); with muon, the lr of the AdamW part
    muon_lr: float = 0.02  # peak lr of Muon's matrices (optimizer muon)
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1  # AdamW's on matrices and embeddings; with muon, on Muon's matrices
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = no clipping
    val_fraction: float = 0.1
    eval_every: int = 200
    eval_batches: int = 20
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 1337  # in [0, 2**64)
    out: str = "runs/attnlab"
    resume: bool = False
    device: str = "auto"
    precision: str = "auto"  # auto | fp32 | bf16: every compute dtype of a step (attnlab.hardware.training_dtype)
    compile: bool = False
    sample_tokens: int = 200
    sample_prompt: str = "The "
    progress: bool = True
    # Fine-tuning (see attnlab.training.lora) and sharding (attnlab.training.fsdp).
    init_from: str | None = None  # the pretrained model it starts from (the caller loads it: Trainer(init=...))
    lora_rank: int = 0  # 0: every parameter trains; r > 0: LoRA adapters of rank r, the base frozen
    lora_alpha: float | None = None  # None: 2 * lora_rank
    lora_targets: str | None = None  # None: q,k,v,o
    fsdp: bool = False  # under torchrun: FSDP2 (fully_shard) instead of DDP

    # Settings a resumed run must keep (they define the model, its data or its batch sequence).
    FIXED_ON_RESUME = ("data", "tokenizer", "preset", "context_length", "dropout", "seed", "val_fraction", "optimizer")
    FIXED_ON_RESUME += ("init_from", "lora_rank", "lora_alpha", "lora_targets")

    def validate(self) -> None:
        """ValueError naming the flag for any setting of the wrong type or out of range (before any
        work is done). Every field is checked: settings also come from a checkpoint's JSON."""
        positive = ["batch_size", "grad_accum", "max_steps", "eval_every", "eval_batches", "checkpoint_every"]
        positive += ["keep_checkpoints"] + (["context_length"] if self.context_length is not None else [])
        for name in positive:
            if not is_int(v := getattr(self, name)) or not 1 <= v <= INT_LIMIT:
                raise ValueError(f"{_flag(name)} must be a positive integer, got {v!r}")
        for name in ("warmup_steps", "sample_tokens", "seed"):
            if not is_int(v := getattr(self, name)) or v < 0:
                raise ValueError(f"{_flag(name)} must be a non-negative integer, got {v!r}")
        if self.seed >= SEED_LIMIT:
            raise ValueError(f"--seed must be below 2**64, got {self.seed!r}")
        for name, limit in (("warmup_steps", INT_LIMIT), ("sample_tokens", 2**31 - 1)):  # as generate's limit
            if getattr(self, name) > limit:
                raise ValueError(f"{_flag(name)} must be at most {limit:,}, got {getattr(self, name)!r}")
        if self.max_time is not None and not (finite_real(self.max_time) and self.max_time > 0):
            raise ValueError(f"--max-time must be a positive number of seconds, got {self.max_time!r}")
        if self.lr is not None and not (finite_real(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a positive number, got {self.lr!r}")
        if not (finite_real(self.muon_lr) and self.muon_lr > 0):
            raise ValueError(f"--muon-lr must be a positive number, got {self.muon_lr!r}")
        for name, choices in (("optimizer", OPTIMIZERS), ("precision", PRECISIONS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{_flag(name)} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        for name in ("weight_decay", "grad_clip"):
            if not (finite_real(v := getattr(self, name)) and v >= 0):
                raise ValueError(f"{_flag(name)} must be a non-negative number, got {v!r}")
        for name in ("beta1", "beta2"):
            if not (is_real(v := getattr(self, name)) and 0 <= v < 1):
                raise ValueError(f"{name} must be in [0, 1), got {v!r}")
        if not (is_real(self.min_lr_ratio) and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.dropout is not None and not (is_real(self.dropout) and 0 <= self.dropout < 1):
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout!r}")
        if not (is_real(self.val_fraction) and 0 < self.val_fraction < 1):
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if self.tokenizer not in ("byte", "char", "gpt2", "hf") or (self.tokenizer == "hf" and not self.init_from):
            raise ValueError(f"unknown tokenizer {self.tokenizer!r}; choose one of: byte, char, gpt2")
        if self.init_from is not None and not _path_like(self.init_from):
            raise ValueError(f"--init-from must name a model, got {self.init_from!r}")
        if not is_int(self.lora_rank) or self.lora_rank < 0:
            raise ValueError(f"--lora-rank must be a positive integer (0: no adapters), got {self.lora_rank!r}")
        if self.lora_rank:
            from attnlab.training.lora import LoRASettings

            if not self.init_from and not self.resume:  # (a resumed run takes --init-from from its checkpoint)
                raise ValueError("--lora-rank needs --init-from: LoRA adapts a pretrained model")
            if self.fsdp:
                raise ValueError("--lora-rank with --fsdp is not supported: LoRA's frozen base fits where DDP does")
            LoRASettings.make(self.lora_rank, self.lora_alpha, self.lora_targets)
        elif self.lora_alpha is not None or self.lora_targets is not None:
            raise ValueError("--lora-alpha and --lora-targets go with --lora-rank")
        for name in ("data", "bpe_dir"):
            if (v := getattr(self, name)) is not None and not _path_like(v):
                raise ValueError(f"{_flag(name)} must be a path (or None), got {v!r}")
        if not _path_like(self.out):
            raise ValueError(f"--out must be a directory path, got {self.out!r}")
        for name in ("device", "sample_prompt", "preset"):
            if not isinstance(v := getattr(self, name), str):
                raise ValueError(f"{_flag(name)} must be a string, got {v!r}")
        if self.fsdp and self.optimizer == "muon":
            raise ValueError("--fsdp trains with --optimizer adamw (Muon orthogonalises whole matrices, not shards)")
        for name in ("resume", "compile", "progress", "fsdp"):
            if not is_bool(v := getattr(self, name)):
                raise ValueError(f"{_flag(name)} must be True or False, got {v!r}")
        canonical_preset(self.preset)

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values (NumPy scalars, which :meth:`validate` accepts, become Python's)."""
        return {k: v.item() if isinstance(v, np.generic) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def explicit_fields(self) -> set[str]:
        """Names of the settings that differ from the defaults (what a caller evidently set)."""
        default = TrainConfig()
        return {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    def resumed(
        self, saved: dict[str, Any], given: Iterable[str] | None = None, *, source: str = "the checkpoint"
    ) -> TrainConfig:
        """This run's settings when it continues a checkpoint whose settings were ``saved``.

        ``given`` names the settings the caller set (default: :meth:`explicit_fields`); they are
        kept, every other one comes from ``saved``. A setting in :attr:`FIXED_ON_RESUME` that was
        given and differs from the saved one is a ValueError naming it. ``out`` and ``resume``
        and ``fsdp`` are always this run's.
        """
        given = self.explicit_fields() if given is None else set(given)
        # Runs from before --optimizer and --precision trained with AdamW, in bf16 on CUDA and in
        # float32 elsewhere: they continue so.
        saved = {"optimizer": "adamw", "precision": "auto" if torch.cuda.is_available() else "fp32", **saved}
        old = TrainConfig.from_dict(saved)
        for name in self.FIXED_ON_RESUME:
            if name in given and not _same_setting(name, getattr(self, name), getattr(old, name)):
                raise ValueError(
                    f"{_flag(name)} {getattr(self, name)!r} differs from "
                    f"{_shown(name, getattr(old, name))} of {source}; a resumed run keeps it (start a new --out "
                    "to change it)"
                )
        keep = given | {"out", "resume", "fsdp"}  # sharded or not: how this run is started
        if "max_steps" in given:  # N steps asked for: the saved run's time plan would cut them again
            keep |= {"max_time"}
        return dataclasses.replace(self, **{k: v for k, v in vars(old).items() if k in saved and k not in keep})


def canonical_preset(name: Any) -> str:
    """The preset ``name`` means, as listed by :meth:`GPTConfig.presets` (case and the aliases
    such as ``gpt2`` normalised); ValueError naming ``--preset`` for an unknown one."""
    try:
        config = GPTConfig.preset(name)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--preset: {exc}") from None
    return next(p for p in GPTConfig.presets() if GPTConfig.preset(p) == config)


def _same_setting(name: str, a: Any, b: Any) -> bool:
    if name == "preset":
        try:
            return canonical_preset(a) == canonical_preset(b)
        except ValueError:
            return a == b
    if name == "data":
        return absolute_path(a) == absolute_path(b)
    if name == "init_from":  # a local model by its absolute path, a Hub name as it is
        return model_path(a) == model_path(b)
    return a == b


def _shown(name: str, value: Any) -> str:
    return "the built-in corpus" if name == "data" and value is None else f"the {value!r}"


def model_path(name: str | None) -> str | None:
    """``--init-from``: an existing local path made absolute (as :func:`absolute_path`), a Hub name kept."""
    return absolute_path(name) if name and Path(name).expanduser().exists() else name


def absolute_path(path: str | None) -> str | None:
    """``path`` made absolute (``~`` expanded, symlinks resolved), so that a checkpoint names the
    same file whatever directory a resumed run, ``generate`` or ``viz`` is started from."""
    return str(Path(path).expanduser().resolve()) if path else path


# -- Learning rate ---------------------------------------------------------------------------
def lr_at(step: int, *, lr: float, warmup_steps: int, max_steps: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up from ``lr / warmup_steps``
    to ``lr`` over ``warmup_steps`` steps, then a half cosine down to ``lr * min_lr_ratio`` at
    ``max_steps``."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    min_lr = lr * min_lr_ratio
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


# Peak lr of the tiny preset, tuned on the built-in corpus (swept 1e-3 to 6e-3 at 800 steps: 2e-3 best).
TINY_LR = 2e-3
OPTIMIZERS = ("adamw", "muon")
# The bare `attnlab train`: its 800 steps, or as many as fit in this many seconds of steps, so the
# whole run stays a few minutes even on the slowest class of CPU (one without native bf16).
DEFAULT_MAX_TIME = 180.0
PLAN_STEPS = 20  # --max-time plans after this many steps, inside the warm-up (see Trainer._plan_steps)


def default_lr(emb_dim: int) -> float:
    """Peak learning rate used when --lr is not given: the tuned value for small models, else
    the GPT-3 paper's (Brown et al. 2020, table 2.1) for the nearest GPT-2 width."""
    if emb_dim <= 256:
        return TINY_LR
    for width, lr in ((768, 6e-4), (1024, 3e-4), (1280, 2.5e-4)):
        if emb_dim <= width:
            return lr
    return 2e-4
