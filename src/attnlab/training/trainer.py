"""Training a :class:`~attnlab.GPT` on text: the loop behind ``attnlab train``.

One optimizer step, nanoGPT-style::

    lr = lr_at(step)                                   # linear warm-up, then cosine decay to min_lr
    for micro in range(grad_accum):                    # gradient accumulation
        x, y = batches.batch(step, micro)              # (b, T) each: this rank's rows of the global batch
        loss = cross_entropy(model(x), y) / grad_accum # bf16 autocast on CUDA
        loss.backward()                                # DDP all-reduces on the last micro-step only
    clip_grad_norm_(params, grad_clip); adamw.step()   # AdamW with decay / no-decay groups

Exact resume. Batch ``step`` is a pure function of ``(seed, step)`` (see
:class:`~attnlab.data.RandomWindowBatches`), and a checkpoint carries the weights, the optimizer
state and every RNG state (dropout draws from torch's CPU, CUDA or MPS generator), so on the same
device a run resumed from step ``k`` computes bit-for-bit the losses of a run that never stopped.

Resuming (``resume=True`` with a checkpoint in ``out``): the settings the caller did not set are
taken from the checkpoint's; the ones in :attr:`TrainConfig.FIXED_ON_RESUME` (model, data,
tokenizer, seed, ...) must not differ from it. This holds for the CLI and the Python API alike.

Distributed. Under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` in the environment) the
model is wrapped in ``DistributedDataParallel`` (NCCL on CUDA, Gloo on CPU). ``batch_size`` is the
*global* batch: each of the ``N`` processes computes ``batch_size / (N * grad_accum)`` rows per
micro-step, its own share of the same global batch, so N processes follow the trajectory of one
process (up to float rounding) and a checkpoint written by N processes resumes on any M. Rank 0
alone prints, writes ``metrics.jsonl`` and writes checkpoints.

Files in the output directory: see :mod:`attnlab.training.checkpoint`; ``metrics.jsonl`` has one JSON object
per optimizer step: ``step`` (steps done), ``loss`` (training loss of that step, averaged over the
global batch), ``lr``, ``tokens_per_s``, ``grad_norm``, and ``val_loss`` on evaluation steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnlab.checks import resolve_device
from attnlab.data import builtin_corpus, check_text_file
from attnlab.files import atomic_write_text, sha256_file
from attnlab.model import GPT, GPTConfig, lm_loss
from attnlab.tokenizers import StreamDecoder
from attnlab.training.checkpoint import (
    _read_latest,
    get_rng_state,
    has_checkpoint,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
    set_rng_state,
)

__all__ = ["TrainConfig", "TrainResult", "Trainer", "default_lr", "lr_at", "train"]

METRICS_NAME = "metrics.jsonl"


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    """Everything ``attnlab train`` needs (the CLI flags, one field each).

    The defaults are tuned so that ``attnlab train`` with no flags trains the ``tiny`` preset on
    the built-in corpus in under four minutes on a 2-core CPU (see the README for the figures).
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
    lr: float | None = None  # None: see default_lr()
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = no clipping
    val_fraction: float = 0.1
    eval_every: int = 200
    eval_batches: int = 20
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    seed: int = 1337
    out: str = "runs/attnlab"
    resume: bool = False
    device: str = "auto"
    compile: bool = False
    sample_tokens: int = 200
    sample_prompt: str = "The "
    progress: bool = True

    # Settings a resumed run must keep (they define the model, its data or its batch sequence).
    FIXED_ON_RESUME = ("data", "tokenizer", "preset", "context_length", "dropout", "seed", "val_fraction")

    def validate(self) -> None:
        """ValueError naming the flag for any setting out of range (before any work is done)."""

        def pos_int(name: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")

        for name in ("batch_size", "grad_accum", "max_steps", "eval_every", "eval_batches", "checkpoint_every"):
            pos_int(name)
        pos_int("keep_checkpoints")
        if self.context_length is not None:
            pos_int("context_length")
        for name in ("warmup_steps", "sample_tokens", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a non-negative integer, got {v!r}")
        if self.lr is not None and not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a positive number, got {self.lr!r}")
        for name in ("weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a non-negative number, got {v!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.dropout is not None and not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout!r}")
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction!r}")
        if self.tokenizer not in ("byte", "char", "gpt2"):
            raise ValueError(f"unknown tokenizer {self.tokenizer!r}; choose one of: byte, char, gpt2")
        canonical_preset(self.preset)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

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
        are always this run's.
        """
        given = self.explicit_fields() if given is None else set(given)
        old = TrainConfig.from_dict(saved)
        for name in self.FIXED_ON_RESUME:
            if name in given and not _same_setting(name, getattr(self, name), getattr(old, name)):
                raise ValueError(
                    f"--{name.replace('_', '-')} {getattr(self, name)!r} differs from "
                    f"{_shown(name, getattr(old, name))} of {source}; a resumed run keeps it (start a new --out "
                    "to change it)"
                )
        keep = given | {"out", "resume"}
        names = {f.name for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: getattr(old, k) for k in names if k in saved and k not in keep})


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
    return a == b


def _shown(name: str, value: Any) -> str:
    return "the built-in corpus" if name == "data" and value is None else f"the {value!r}"


def absolute_path(path: str | None) -> str | None:
    """``path`` made absolute (``~`` expanded, symlinks resolved), so that a checkpoint names the
    same file whatever directory a resumed run, ``generate`` or ``viz`` is started from."""
    return str(Path(path).expanduser().resolve()) if path else path


@dataclass
class TrainResult:
    """What :func:`train` returns."""

    step: int  # optimizer steps done
    val_loss: float | None  # the last validation loss
    out: Path
    checkpoint: Path | None  # the step directory of the last checkpoint
    interrupted: int | None = None  # the signal that stopped training early, if any
    sample: str | None = None
    sample_prompt: str | None = None  # the prompt of the sample (see Trainer.sample_prompt)
    history: list[dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------------------------
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


def default_lr(emb_dim: int) -> float:
    """Peak learning rate used when --lr is not given: the tuned value for small models, else
    the GPT-3 paper's (Brown et al. 2020, table 2.1) for the nearest GPT-2 width."""
    if emb_dim <= 256:
        return TINY_LR
    for width, lr in ((768, 6e-4), (1024, 3e-4), (1280, 2.5e-4)):
        if emb_dim <= width:
            return lr
    return 2e-4


@dataclass
class _Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _dist_from_env() -> _Dist:
    """torchrun's environment (RANK / WORLD_SIZE / LOCAL_RANK); one process when absent."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return _Dist()
    return _Dist(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


class _MetricsLog:
    """``metrics.jsonl``, one JSON line per step; every line flushed and fsynced as written.

    On resume from step ``k`` the lines past ``k`` (written after the checkpoint by the run that
    was interrupted) and any torn last line are dropped, so the file reads like one run.
    """

    def __init__(self, path: Path, keep_up_to: int | None) -> None:
        self.path = path
        kept: list[str] = []
        if keep_up_to is not None and path.is_file():
            for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= keep_up_to:
                    kept.append(line)
        atomic_write_text(path, "".join(x + "\n" for x in kept))
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def append(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


class _StopFlag:
    """SIGINT / SIGTERM ask training to stop after the current step (and save); a second SIGINT
    aborts at once (the previous checkpoint stays valid: saves are atomic)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> _StopFlag:
        if _is_main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------
class Trainer:
    """Builds data, model and optimizer from a :class:`TrainConfig` (or a checkpoint) and trains.

    Usage::

        result = Trainer(TrainConfig(max_steps=100, out="runs/x")).fit()
    """

    def __init__(self, config: TrainConfig, *, log: Any = None, given: Iterable[str] | None = None) -> None:
        """``given``: names of the settings the caller set (the CLI passes the flags given). On
        resume, every other setting comes from the checkpoint; None means "those that differ
        from :class:`TrainConfig`'s defaults" (so a default value cannot override a checkpoint's)."""
        config.validate()
        self.dist = _dist_from_env()
        self._log = log if log is not None else (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.out = Path(config.out).expanduser()
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {self.out} exists and is not a directory")
        if config.resume and has_checkpoint(self.out):
            # Before anything is built: the device, model, data and seed are the checkpoint's.
            meta = read_metadata(self.out)
            saved = meta.get("train_config", {})
            if not isinstance(saved, dict):
                raise ValueError(f"the checkpoint in {self.out} has no valid 'train_config' entry")
            config = config.resumed(saved, given, source=f"the checkpoint in {self.out}")
            config.validate()
        # After resumed(): a checkpoint from before paths were recorded absolute gets them too.
        config = dataclasses.replace(config, data=absolute_path(config.data), bpe_dir=absolute_path(config.bpe_dir))
        self.cfg = config
        self.device = resolve_device(config.device, self.dist.local_rank)
        self._owns_process_group = False
        try:
            self._setup()
        except BaseException:
            # Errors after init_process_group (a bad file, a batch size that does not divide)
            # must not leave the group behind (torchrun would hang on the other ranks' exit).
            self.close()
            raise

    def close(self) -> None:
        """Destroy the process group this trainer created (a no-op otherwise)."""
        if self._owns_process_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self._owns_process_group = False

    # -- logging -------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        if self.dist.is_main:
            self._log(msg)

    # -- setup -----------------------------------------------------------------------------------
    def _setup(self) -> None:
        from attnlab.data import RandomWindowBatches, tokenize_to_cache, train_val_split
        from attnlab.tokenizers import get_tokenizer, tokenizer_from_dict

        cfg, d = self.cfg, self.dist
        if d.enabled and not torch.distributed.is_initialized():
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            torch.distributed.init_process_group(backend=backend)
            self._owns_process_group = True
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

        ckpt = None
        if cfg.resume and has_checkpoint(self.out):
            ckpt = load_checkpoint(self.out, device=self.device)
        elif cfg.resume:
            self.log(f"--resume: no checkpoint in {self.out} yet, starting a new run")
        elif has_checkpoint(self.out):
            step = _read_latest(self.out).get("step", "?")  # a corrupt pointer: an error naming it
            raise ValueError(
                f"{self.out} already holds a checkpoint (step {step}); pass --resume to continue it, "
                "or choose another --out (or delete it) to start over"
            )

        # Tokenizer: a resumed run decodes/encodes exactly as it did before.
        if ckpt is not None:
            tok = tokenizer_from_dict(ckpt.metadata["tokenizer"], bpe_dir=cfg.bpe_dir)
        elif cfg.tokenizer == "char":
            tok = get_tokenizer("char", text=None if cfg.data else builtin_corpus(), path=cfg.data)
        else:
            tok = get_tokenizer(cfg.tokenizer, bpe_dir=cfg.bpe_dir)
        self.tokenizer = tok
        # What the text was, so a resumed run can tell that it sees the same text.
        if cfg.data is None:
            self.data_sha256 = hashlib.sha256(builtin_corpus().encode("utf-8")).hexdigest()
        else:
            self.data_sha256 = sha256_file(check_text_file(cfg.data))
        saved_sha256 = ckpt.metadata.get("data", {}).get("sha256") if ckpt is not None else None
        if saved_sha256 is not None and saved_sha256 != self.data_sha256:
            sums = f"SHA-256 {saved_sha256[:12]}... then, {self.data_sha256[:12]}... now"
            if cfg.data:
                why = f"the data file {cfg.data} has changed since the checkpoint in {self.out} was written ({sums})"
                fix = "restore it, or start a new --out"
            else:  # pydoc_data.topics differs between Python releases
                why = f"the built-in corpus (this Python's documentation) differs from the checkpoint's ({sums})"
                fix = f"resume with the Python {self.out} was trained with, or start a new --out"
            raise ValueError(f"{why}; a resumed run must see the same text: {fix}")
        tokens = tokenize_to_cache(cfg.data, tok, content_hash=self.data_sha256 if cfg.data else None)
        train_tokens, val_tokens = train_val_split(tokens, cfg.val_fraction)

        # Model: built on every rank from the same seed (DDP also broadcasts rank 0's weights).
        torch.manual_seed(cfg.seed)
        if ckpt is not None:
            model = ckpt.model
            model_cfg = model.config
        else:
            overrides: dict[str, Any] = {"vocab_size": tok.vocab_size}
            if cfg.context_length is not None:
                overrides["context_length"] = cfg.context_length
            if cfg.dropout is not None:
                overrides["drop_rate"] = cfg.dropout
            model_cfg = GPTConfig.preset(cfg.preset, **overrides)
            model = GPT(model_cfg)
        model.to(self.device)
        self.model_config = model_cfg
        # Settle the preset-dependent defaults, so the checkpoint records what was used.
        cfg = self.cfg = dataclasses.replace(
            cfg,
            context_length=model_cfg.context_length,
            dropout=model_cfg.drop_rate,
            lr=cfg.lr if cfg.lr is not None else default_lr(model_cfg.emb_dim),
        )
        self.raw_model = model
        T = model_cfg.context_length

        # Batches: each rank's share of each global batch.
        per_rank, rem = divmod(cfg.batch_size, d.world_size * cfg.grad_accum)
        if rem or per_rank == 0:
            raise ValueError(
                f"--batch-size {cfg.batch_size} (global) must be a multiple of processes x --grad-accum = "
                f"{d.world_size} x {cfg.grad_accum}"
            )
        for name, part in (("training", train_tokens), ("validation", val_tokens)):
            if len(part) < T + 1:
                raise ValueError(
                    f"the {name} split has {len(part)} tokens, fewer than context length + 1 = {T + 1}; "
                    "use a longer text or a smaller --context-length"
                )
        common = dict(batch_size=per_rank, context_length=T, rank=d.rank, world_size=d.world_size)
        self.train_batches = RandomWindowBatches(train_tokens, seed=cfg.seed, grad_accum_steps=cfg.grad_accum, **common)
        self.val_batches = RandomWindowBatches(val_tokens, seed=cfg.seed + 1, grad_accum_steps=cfg.grad_accum, **common)
        self.tokens_per_step = cfg.batch_size * T

        self.optimizer = model.configure_optimizer(
            weight_decay=cfg.weight_decay, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2)
        )
        self.step = 0
        if ckpt is not None:
            if ckpt.optimizer_state is not None:
                self.optimizer.load_state_dict(ckpt.optimizer_state)
            self.step = ckpt.step
            self._restore_rng(ckpt.metadata)
        elif d.enabled and d.rank > 0:
            # Each rank draws its own dropout masks.
            torch.manual_seed(cfg.seed + 1_000_003 * d.rank)
        saved_val = ckpt.metadata.get("val_loss") if ckpt is not None else None
        self.last_val_loss: float | None = saved_val if isinstance(saved_val, (int, float)) else None
        self.resumed_from = ckpt.path if ckpt is not None else None

        self.model: torch.nn.Module = model
        if d.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if cfg.compile:
            self.model = torch.compile(self.model)
        use_bf16 = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.autocast = (
            (lambda: torch.autocast(device_type="cuda", dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
        )

    def _restore_rng(self, meta: dict[str, Any]) -> None:
        states = meta.get("rng") or []
        d = self.dist
        if len(states) == d.world_size:
            set_rng_state(states[d.rank])
        else:
            # Other processes count: the dropout streams cannot continue as they were (data and
            # optimizer do). Rank 0 continues the old rank 0's; the others start new streams.
            if d.rank == 0 and states:
                set_rng_state(states[0])
            else:
                torch.manual_seed(self.cfg.seed + 1_000_003 * d.rank + self.step)
            self.log(
                f"note: the checkpoint was written by {len(states)} process(es), this run has {d.world_size}: "
                "data order and optimizer continue exactly, dropout randomness does not"
            )

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self) -> Path | None:
        """Write a checkpoint of the current step (rank 0 writes; all ranks must call it)."""
        rng = get_rng_state()
        if self.dist.enabled:
            gathered: list[Any] = [None] * self.dist.world_size
            torch.distributed.all_gather_object(gathered, rng)
        else:
            gathered = [rng]
        if not self.dist.is_main:
            return None
        meta = {
            "tokenizer": self.tokenizer.to_dict(),
            "model_config": self.model_config.to_dict(),
            "train_config": self.cfg.to_dict(),
            "world_size": self.dist.world_size,
            "rng": gathered,
            "data": {
                "sampler": "RandomWindowBatches",
                "next_step": self.step,
                "seed": self.cfg.seed,
                "global_batch_size": self.cfg.batch_size,
                "context_length": self.model_config.context_length,
                "source": self.cfg.data,
                "sha256": self.data_sha256,
            },
            "val_loss": self.last_val_loss,
            "torch_version": torch.__version__,
        }
        return save_checkpoint(
            self.out,
            step=self.step,
            model=self.raw_model,
            optimizer=self.optimizer,
            metadata=meta,
            keep=self.cfg.keep_checkpoints,
        )

    # -- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss (nats per token) over ``eval_batches`` fixed global batches."""
        model = self.raw_model
        was_training = model.training
        model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        count = 0
        for i in range(self.cfg.eval_batches):
            for m in range(self.cfg.grad_accum):
                x, y = self.val_batches.batch(i, m, device=self.device)  # (b, T) each
                with self.autocast():
                    logits = model(x)  # (b, T, V)
                total += lm_loss(logits, y)
                count += 1
        if self.dist.enabled:
            torch.distributed.all_reduce(total)
            count *= self.dist.world_size
        model.train(was_training)
        return total.item() / count

    # -- the loop --------------------------------------------------------------------------------
    def _train_step(self) -> tuple[float, float, float]:
        """One optimizer step; returns (loss averaged over the global batch, lr, grad norm)."""
        cfg = self.cfg
        lr = lr_at(
            self.step, lr=cfg.lr, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(cfg.grad_accum):
            x, y = self.train_batches.batch(self.step, micro, device=self.device)  # (b, T) each
            last = micro == cfg.grad_accum - 1
            # DDP: all-reduce the gradients once, on the last micro-step.
            sync = contextlib.nullcontext() if last or not self.dist.enabled else _no_sync(self.model)
            with sync:
                with self.autocast():
                    logits = self.model(x)  # (b, T, V)
                loss = lm_loss(logits, y) / cfg.grad_accum
                loss.backward()
            loss_sum += loss.detach()
        # With --grad-clip 0 the norm is still measured for the metrics (an infinite threshold
        # scales the gradients by exactly 1).
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.dist.enabled:
            torch.distributed.all_reduce(loss_sum)
            loss_sum /= self.dist.world_size
        return loss_sum.item(), lr, float(grad_norm)

    def _should_stop(self, flag: _StopFlag) -> int | None:
        """The signal that asked to stop, agreed on by all ranks (max over them), or None."""
        signum = flag.signum or 0
        if self.dist.enabled:
            t = torch.tensor([signum], device=self.device if self.device.type == "cuda" else "cpu")
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            signum = int(t.item())
        return signum or None

    def fit(self, *, sample: bool = True) -> TrainResult:
        """Train to ``max_steps`` (or until SIGINT/SIGTERM); checkpoint, evaluate, and (with
        ``sample`` and ``sample_tokens > 0``) generate a sample, returned in the result."""
        cfg, d = self.cfg, self.dist
        if d.is_main:
            try:
                self.out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise OSError(f"cannot create the --out directory {self.out}: {exc.strerror}") from None
            self.metrics = _MetricsLog(self.out / METRICS_NAME, keep_up_to=self.step)
        n_params = self.raw_model.num_parameters()
        what = f"resuming {self.resumed_from} at step {self.step}" if self.resumed_from else "new run"
        self.log(
            f"attnlab train: {what}; GPT {cfg.preset} {n_params / 1e6:.2f}M parameters, "
            f"context {self.model_config.context_length}, tokenizer {self.tokenizer.name} "
            f"(vocab {self.tokenizer.vocab_size}), data {cfg.data or 'built-in corpus (Python docs)'} "
            f"({len(self.train_batches.tokens):,} train / {len(self.val_batches.tokens):,} val tokens), "
            f"batch {cfg.batch_size} x {self.model_config.context_length} tokens ({self.train_batches.batch_size} "
            f"per process x {cfg.grad_accum} micro-step(s)), {d.world_size} process(es) "
            f"on {self.device}, out {self.out}"
        )
        if self.step >= cfg.max_steps:
            self.log(
                f"already at step {self.step}, at or past --max-steps {cfg.max_steps}: nothing to train "
                "(raise --max-steps to continue)"
            )
        bar = None
        if d.is_main and cfg.progress and self.step < cfg.max_steps:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                self.log("note: no progress bar (the tqdm package is not installed: pip install tqdm)")
            else:
                bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)
        write = bar.write if bar is not None else self.log
        interrupted: int | None = None
        ckpt_path: Path | None = self.resumed_from
        history: list[dict[str, Any]] = []
        self.raw_model.train()
        try:
            with _StopFlag() as flag:
                while self.step < cfg.max_steps:
                    t0 = time.perf_counter()
                    loss, lr, gnorm = self._train_step()
                    dt = time.perf_counter() - t0
                    self.step += 1
                    if not math.isfinite(loss):
                        raise FloatingPointError(
                            f"the training loss became {loss} at step {self.step}; try a smaller --lr"
                        )
                    rec: dict[str, Any] = {
                        "step": self.step,
                        "loss": loss,
                        "lr": lr,
                        "tokens_per_s": self.tokens_per_step / dt,
                        "grad_norm": gnorm,
                    }
                    if self.step % cfg.eval_every == 0 or self.step == cfg.max_steps:
                        self.last_val_loss = rec["val_loss"] = self.evaluate()
                        write(f"step {self.step}: train loss {loss:.4f}, val loss {rec['val_loss']:.4f}")
                    history.append(rec)
                    if d.is_main:
                        self.metrics.append(rec)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
                    interrupted = self._should_stop(flag)
                    if self.step % cfg.checkpoint_every == 0 or self.step == cfg.max_steps or interrupted:
                        ckpt_path = self.save() or ckpt_path
                    if interrupted:
                        write(
                            f"stopped by {signal.Signals(interrupted).name} at step {self.step}; "
                            f"checkpoint saved, continue with --resume --out {self.out}"
                        )
                        break
        finally:
            if bar is not None:
                bar.close()
            if d.is_main:
                self.metrics.close()
        text = prompt = None
        if sample and not interrupted and d.is_main and cfg.sample_tokens > 0:
            prompt = self.sample_prompt(cfg.sample_prompt)
            text = self.sample(prompt, cfg.sample_tokens)
        if d.enabled:
            torch.distributed.barrier()
        return TrainResult(
            step=self.step,
            val_loss=self.last_val_loss,
            out=self.out,
            checkpoint=ckpt_path,
            interrupted=interrupted,
            sample=text,
            sample_prompt=prompt,
            history=history,
        )

    def sample_prompt(self, prompt: str) -> str:
        """``prompt`` if the tokenizer can encode it, else the first token of the validation text
        that is text of its own (a char vocabulary may lack the default prompt's letters; a byte
        may be part of a character), so a sample always runs."""
        try:
            if self.tokenizer.encode(prompt):
                return prompt
        except (ValueError, KeyError):
            pass
        for token in self.val_batches.tokens[:1024].tolist():
            text = self.tokenizer.decode([token])
            if self.tokenizer.encode(text) == [token]:
                return text
        raise ValueError(f"the tokenizer cannot encode the sample prompt {prompt!r}; pass one it can")

    @torch.no_grad()
    def sample(
        self,
        prompt: str,
        n: int,
        temperature: float = 0.8,
        top_k: int | None = 40,
        *,
        on_text: Callable[[str], None] | None = None,
    ) -> str:
        """Continue ``prompt`` by ``n`` tokens (seeded: the same text for the same checkpoint).

        Returns the prompt and its continuation; ``on_text`` also receives the continuation piece
        by piece as it is generated (whole characters only). ``prompt`` must encode to at least one
        token (see :meth:`sample_prompt`).
        """
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise ValueError(f"the sample prompt {prompt!r} encodes to no tokens")
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, P)
        gen = torch.Generator(device=self.device).manual_seed(self.cfg.seed)
        decoder = StreamDecoder(self.tokenizer)
        for token in self.raw_model.stream(idx, n, temperature=temperature, top_k=top_k, generator=gen):  # (1,)
            ids.append(int(token[0]))
            if on_text is not None and (piece := decoder.push(ids[-1])):
                on_text(piece)
        if on_text is not None and (piece := decoder.flush()):
            on_text(piece)
        return self.tokenizer.decode(ids)


def _no_sync(model: torch.nn.Module) -> Any:
    inner = getattr(model, "_orig_mod", model)  # torch.compile wraps the DDP module
    return inner.no_sync()


def train(config: TrainConfig | None = None, **overrides: Any) -> TrainResult:
    """Train with ``config`` (default :class:`TrainConfig`), fields overridden by keyword.

    >>> result = train(max_steps=20, out="runs/demo", progress=False)  # doctest: +SKIP

    On ``resume=True`` the settings not given come from the checkpoint: with ``config`` those
    equal to the defaults, without it those not passed by keyword.
    """
    cfg = dataclasses.replace(config or TrainConfig(), **overrides)
    given = None if config is not None else set(overrides)
    trainer = None
    try:
        trainer = Trainer(cfg, given=given)
        return trainer.fit()
    finally:
        if trainer is not None:
            trainer.close()
