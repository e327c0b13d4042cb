"""Training a :class:`~attnlab.GPT` on text: the loop behind ``attnlab train``.

One optimizer step, nanoGPT-style::

    lr = lr_at(step)                                   # linear warm-up, then cosine decay to min_lr
    n = count of targets y != -100 over all micro-steps (all-reduced over the processes)
    for micro in range(grad_accum):                    # gradient accumulation
        x, y = batches.batch(step, micro)              # (b, T) each: this rank's rows of the global batch
        loss = cross_entropy(model(x), y) * n_micro * world_size / n  # bf16 autocast where available
        loss.backward()                                # DDP all-reduces (averages) on the last micro-step only
    clip_grad_norm_(params, grad_clip); opt.step()     # Muon + AdamW (MuonAdamW), or AdamW alone

The loss is the mean over every counted target of the global batch (on chat data only the
assistant's count), so neither grad_accum nor the number of processes changes the objective.

Exact resume. Batch ``step`` is a pure function of ``(seed, step)`` (see
:class:`~attnlab.data.RandomWindowBatches`), and a checkpoint carries the weights, the optimizer
state and every RNG state (dropout draws from torch's CPU, CUDA or MPS generator), so on the same
device a run resumed from step ``k`` computes bit-for-bit the losses of a run that never stopped.
Which settings a resumed run takes from its checkpoint: see :mod:`attnlab.training.config`.

Distributed. Under ``torchrun`` the model is wrapped in ``DistributedDataParallel`` (NCCL on CUDA,
Gloo on CPU). ``batch_size`` is the *global* batch: each of the ``N`` processes computes its share,
``batch_size / (N * grad_accum)`` rows per micro-step, so N processes follow the trajectory of one
(up to float rounding) and a checkpoint written by N resumes on any M. Rank 0 alone prints and writes.

Files: see :mod:`attnlab.training.checkpoint`; ``metrics.jsonl`` has one JSON object per step:
``step`` (steps done), ``loss`` (averaged over the global batch), ``lr``, ``tokens_per_s``,
``grad_norm``, and ``val_loss`` on evaluation steps.
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
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnlab import data, hardware  # data: the module: its functions are looked up when called (tests replace some)
from attnlab.checks import is_int, is_real, resolve_device
from attnlab.errors import UserError
from attnlab.files import atomic_open, first_line, import_safetensors, open_regular, sha256_file
from attnlab.generation import SamplingConfig
from attnlab.model import GPT, GPTConfig, lm_loss
from attnlab.quantized import compile_from_now, is_quantized
from attnlab.tokenizers import StreamDecoder, Tokenizer, get_tokenizer, tokenizer_from_dict
from attnlab.training import chat_data, fsdp
from attnlab.training.checkpoint import (
    CHECKPOINTS_DIR,
    OPTIMIZER_DIR,
    OPTIMIZER_NAME,
    Checkpoint,
    check_optimizer_state,
    find_checkpoint,
    get_rng_state,
    has_checkpoint,
    load_checkpoint,
    read_latest,
    read_metadata,
    recover_latest,
    remove_save_debris,
    save_checkpoint,
    set_rng_state,
)
from attnlab.training.config import (
    DEFAULT_MAX_TIME,
    PLAN_STEPS,
    TrainConfig,
    absolute_path,
    default_lr,
    lr_at,
    model_path,
)
from attnlab.training.distributed import DistEnv, no_sync, rank_seed, settle, start_process_group
from attnlab.training.finetune import finetune_config, finetune_lr
from attnlab.training.lora import LoRASettings, apply_lora
from attnlab.training.memory import GiB, available_memory, estimate_training_memory, fsdp_processes_needed
from attnlab.training.optim import MuonAdamW, muon_param_groups
from attnlab.training.rundir import RunLock, check_run_directory

__all__ = ["SAMPLE_SETTINGS", "StopFlag", "TrainResult", "Trainer", "train"]

METRICS_NAME = "metrics.jsonl"
# The shortest windows a fine-tuning run without --context-length shrinks to, to fit a short text.
MIN_FIT_CONTEXT = 32

# How the sample printed after training is drawn.
SAMPLE_SETTINGS = SamplingConfig(temperature=0.8, top_k=40)


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


# -- Pieces ----------------------------------------------------------------------------------
class MetricsLog:
    """``metrics.jsonl``, one JSON line per step; every line flushed and fsynced as written.

    On resume from step ``k`` the lines past ``k`` (written after the checkpoint) and any torn last
    line are dropped, so the file reads like one run; the old file is streamed, lines longer than
    :attr:`MAX_LINE` (no line attnlab writes) dropped unread."""

    MAX_LINE = 1 << 16

    def __init__(self, path: Path, keep_up_to: int | None) -> None:
        with atomic_open(path, "w") as new:
            if keep_up_to is not None and os.path.lexists(path):
                with open_regular(path, "metrics log") as old:
                    for line in _bounded_lines(old, self.MAX_LINE):
                        try:
                            rec = json.loads(line)
                        except (ValueError, RecursionError):
                            continue
                        if isinstance(rec, dict) and is_int(rec.get("step")) and 0 < rec["step"] <= keep_up_to:
                            new.write(line + "\n")
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def append(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


class StopFlag:
    """SIGINT / SIGTERM ask training to stop after the current step (and save); a second SIGINT
    aborts at once (the previous checkpoint stays valid: saves are atomic)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def _bounded_lines(f: Any, limit: int) -> Iterable[str]:
    """The complete lines of binary file ``f`` (UTF-8, undecodable bytes replaced), without their
    newline; a line longer than ``limit`` bytes is skipped without holding it in memory, and so is
    a last line without a newline (torn by a kill)."""
    while True:
        line = f.readline(limit + 1)
        if not line:
            return
        if not line.endswith(b"\n"):
            if len(line) > limit:  # too long: skip to the end of this line
                while (rest := f.readline(limit + 1)) and not rest.endswith(b"\n"):
                    pass
            continue
        yield line[:-1].decode("utf-8", errors="replace")


def _out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's refusal (torch on CPU or CUDA, NumPy, Python)."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in ("can't allocate memory", "out of memory"))


IGNORE_INDEX = chat_data.IGNORE  # targets that do not count in the loss (chat data: not the assistant's)


def _counted(y: torch.Tensor) -> torch.Tensor:
    """The number of targets of ``y`` that count in the loss, a float32 scalar on ``y``'s device (no host sync)."""
    return (y != IGNORE_INDEX).sum().float()


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype the forward pass autocasts to (None: float32 throughout): ``--precision``'s dtype
    (:func:`attnlab.hardware.training_dtype`: ``auto`` is bf16 where the device has native bf16)."""
    dtype = hardware.training_dtype(precision, device)
    return None if dtype == torch.float32 else dtype


# -- The trainer -----------------------------------------------------------------------------
class Trainer:
    """Builds data, model and optimizer from a :class:`TrainConfig` (or a checkpoint) and trains.

    Usage::

        result = Trainer(TrainConfig(max_steps=100, out="runs/x")).fit()
    """

    def __init__(
        self, config: TrainConfig, *, log: Any = None, given: Iterable[str] | None = None, init: Any = None
    ) -> None:
        """``given``: names of the settings the caller set (the CLI passes the flags given). On
        resume, every other setting comes from the checkpoint; None means "those that differ
        from :class:`TrainConfig`'s defaults" (so a default value cannot override a checkpoint's).
        ``init``: with ``config.init_from``, the pretrained model a new run starts from, as
        :func:`attnlab.tools.loading.load` returns it (``.model``, ``.tokenizer``)."""
        if not isinstance(config, TrainConfig):
            raise TypeError(f"config must be a TrainConfig, got {type(config).__name__}")
        config.validate()
        self._init = init
        self.dist = DistEnv.from_environ()
        if config.fsdp and "RANK" not in os.environ:
            raise ValueError(
                "--fsdp shards the model over torchrun's processes: run torchrun ... -m attnlab train --fsdp"
            )
        self._log = log if log is not None else (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.out = Path(config.out).expanduser()
        self._owns_process_group = False
        # The directory is this run's before anything in it is read: rank 0 writes, so rank 0
        # checks that it may and holds the lock on it while the run may write.
        self._lock = RunLock(self.out)
        resolve_device(config.device, self.dist.local_rank)  # a bad --device is refused before --out is made
        import_safetensors()  # (what a checkpoint is written with: missing, a run would stop at its first save)
        if self.dist.is_main:
            check_run_directory(self.out, resume=config.resume)
            self._lock.acquire()
            remove_save_debris(self.out / CHECKPOINTS_DIR)  # (a killed save's, as large as the model)
        try:
            self.cfg = self._run_config(config, given)
            self.device = resolve_device(self.cfg.device, self.dist.local_rank)
            self._setup()
        except BaseException as exc:
            # Errors after init_process_group (a bad file, a batch size that does not divide)
            # must not leave the group behind (torchrun would hang on the other ranks' exit).
            self.close()
            if _out_of_memory(exc):
                raise self._memory_error(exc) from None
            raise

    def _run_config(self, config: TrainConfig, given: Iterable[str] | None) -> TrainConfig:
        """``config`` as this run uses it: on resume, merged with the checkpoint's settings
        (:meth:`TrainConfig.resumed`)."""
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {self.out} exists and is not a directory")
        self._saved_meta: dict[str, Any] | None = None
        self._fit_context = False
        # (every rank: each finds the same step directory, and writes the same pointer if it is first)
        if config.resume and (taken := recover_latest(self.out)) is not None:
            self.log(f"--resume: {taken.name}'s save was stopped before latest.json was written; resuming from it")
        if config.resume and has_checkpoint(self.out):
            # Before anything is built: the device, model, data and seed are the checkpoint's.
            # read_metadata checked every entry (and the file's own hash); resuming needs them all.
            meta = read_metadata(self.out)
            where = f"the checkpoint in {self.out}"
            missing = [k for k in ("tokenizer", "model_config", "train_config", "rng", "data") if k not in meta]
            if missing:
                raise ValueError(f"{where} cannot be resumed: its checkpoint.json has no {', '.join(missing)} entry")
            if not any(f == OPTIMIZER_NAME or f.startswith(OPTIMIZER_DIR + "/") for f in meta["files"]):
                raise ValueError(
                    f"{where} records no optimizer state ({OPTIMIZER_NAME}); resuming would restart AdamW "
                    "from zero, which is not the run it continues: start a new --out from its weights instead"
                )
            self._saved_meta = meta
            config = config.resumed(meta["train_config"], given, source=where)
            config.validate()
        elif config.init_from:
            self._fit_context = config.context_length is None  # the default windows may shrink to fit the data
            config = finetune_config(config, self._init, config.explicit_fields() if given is None else set(given))
        # Python numbers for NumPy ones; absolute paths (after resumed(): a checkpoint may hold relative ones).
        paths = {"data": absolute_path(config.data), "bpe_dir": absolute_path(config.bpe_dir)}
        paths["init_from"] = model_path(config.init_from)
        config = TrainConfig.from_dict(config.to_dict() | paths)
        bare = given is not None and not {"max_steps", "max_time"} & set(given) and config.init_from is None
        if bare and self._saved_meta is None:
            config.max_time = DEFAULT_MAX_TIME  # the bare run: 800 steps, fewer where they do not fit
        return config

    def close(self) -> None:
        """Release the lock on ``out`` and destroy the process group this trainer created (after
        dropping the DDP wrapper, which holds the group: so its Gloo threads end here, while Python
        runs; see :func:`~attnlab.training.distributed.start_process_group`)."""
        self._lock.release()
        if hasattr(self, "raw_model"):
            self.model = self.raw_model
        if self._owns_process_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        self._owns_process_group = False

    def _memory_error(self, exc: BaseException) -> UserError:
        """The allocator's refusal as one line naming the flags that size a run."""
        return UserError(
            f"ran out of memory on {getattr(self, 'device', 'the device')} ({first_line(exc)[:200]}); lower "
            "--batch-size (or raise --grad-accum), --context-length, or choose a smaller --preset"
        )

    def log(self, msg: str) -> None:
        if self.dist.is_main:
            self._log(msg)

    # -- setup -----------------------------------------------------------------------------------
    def _setup(self) -> None:
        """Build everything the loop needs, in this order (a resumed run from its checkpoint)."""
        self._init_distributed()
        self.tokenizer = self._build_tokenizer(self._saved_meta)
        model_config = self._model_config()
        self._check_memory(model_config)  # before anything large is allocated
        ckpt = self._load_resume_checkpoint()
        self.data_sha256 = self._data_sha256()
        self._verify_data(ckpt)
        train_tokens, val_tokens = self._load_tokens()
        if self._fit_context:
            self._fit_default_context(train_tokens, val_tokens)
        self._build_model(ckpt, model_config)  # also settles cfg's preset-dependent defaults
        self._build_batches(train_tokens, val_tokens)
        if self.cfg.fsdp:  # before the optimizer: fully_shard replaces the parameters by their shards
            fsdp.shard(self.raw_model, param_dtype=autocast_dtype(self.cfg.precision, self.device))
        self.optimizer = self._build_optimizer()
        self._restore_state(ckpt)
        self._wrap_model()

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """AdamW on everything (nanoGPT's groups), or Muon on the blocks' matrices with AdamW on the
        rest (:mod:`attnlab.training.optim`)."""
        cfg = self.cfg
        betas = (cfg.beta1, cfg.beta2)
        if cfg.optimizer == "muon":
            groups = muon_param_groups(self.raw_model, lr=cfg.lr, muon_lr=cfg.muon_lr, weight_decay=cfg.weight_decay)
            return MuonAdamW(groups, betas=betas, ns_dtype=hardware.training_dtype(cfg.precision, self.device))
        return self.raw_model.configure_optimizer(weight_decay=cfg.weight_decay, lr=cfg.lr, betas=betas)

    def _init_distributed(self) -> None:
        """Under torchrun, join the process group; on CUDA, allow TF32 matmuls."""
        if self.dist.enabled or self.cfg.fsdp:
            self._owns_process_group = start_process_group(self.device)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

    def _load_resume_checkpoint(self) -> Checkpoint | None:
        """The checkpoint to continue (``--resume`` with one in ``out``), else None; refuses to
        start a new run over an existing checkpoint."""
        if self.cfg.resume and has_checkpoint(self.out):
            return load_checkpoint(self.out, device=self.device)
        if self.cfg.resume:
            self.log(f"--resume: no checkpoint in {self.out} yet, starting a new run")
        elif has_checkpoint(self.out):
            step = read_latest(self.out).get("step", "?")  # a corrupt pointer: an error naming it
            raise ValueError(
                f"{self.out} already holds a checkpoint (step {step}); pass --resume to continue it, "
                "or choose another --out (or delete it) to start over"
            )
        return None

    def _build_tokenizer(self, meta: dict[str, Any] | None) -> Tokenizer:
        """A resumed run decodes/encodes exactly as it did before."""
        cfg = self.cfg
        if meta is not None:
            # an hf tokenizer's JSON is in the step directory (a relative path); older runs recorded it absolute
            return tokenizer_from_dict(meta["tokenizer"], bpe_dir=cfg.bpe_dir, base_dir=find_checkpoint(self.out))
        if cfg.init_from:
            return self._init.tokenizer
        if cfg.tokenizer == "char":
            return get_tokenizer("char", text=None if cfg.data else data.builtin_corpus(), path=cfg.data)
        return get_tokenizer(cfg.tokenizer, bpe_dir=cfg.bpe_dir)

    def _data_sha256(self) -> str:
        """What the text is, so a resumed run can tell that it sees the same text."""
        if self.cfg.data is None:
            return hashlib.sha256(data.builtin_corpus().encode("utf-8")).hexdigest()
        return sha256_file(data.check_text_file(self.cfg.data))

    def _verify_data(self, ckpt: Checkpoint | None) -> None:
        """A resumed run must train on the text its checkpoint recorded (when it recorded one)."""
        saved = ckpt.metadata.get("data", {}).get("sha256") if ckpt is not None else None
        if saved is None or saved == self.data_sha256:
            return
        sums = f"SHA-256 {saved[:12]}... then, {self.data_sha256[:12]}... now"
        if self.cfg.data:
            why = f"the data file {self.cfg.data} has changed since the checkpoint in {self.out} was written ({sums})"
            fix = "restore it, or start a new --out"
        else:  # pydoc_data.topics differs between Python releases
            why = f"the built-in corpus (this Python's documentation) differs from the checkpoint's ({sums})"
            fix = f"resume with the Python {self.out} was trained with, or start a new --out"
        raise ValueError(f"{why}; a resumed run must see the same text: {fix}")

    def _load_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The text as token ids (cached on disk), split into training and validation tokens; a
        ``.jsonl`` file of conversations, rendered with the chat template (:mod:`attnlab.training.chat_data`)."""
        cfg = self.cfg
        self.chat_template, self._chat_masks = None, None
        if chat_data.is_chat_file(cfg.data):
            return self._load_chat()
        tokens = data.tokenize_to_cache(cfg.data, self.tokenizer, content_hash=self.data_sha256 if cfg.data else None)
        return data.train_val_split(tokens, cfg.val_fraction)

    def _load_chat(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The conversations as one token stream and the assistant mask, split as text is."""
        saved = (self._saved_meta or {}).get("chat_template")
        if saved is not None:
            self.chat_template = chat_data.template_from_dict(saved)
        else:
            self.chat_template = getattr(self._init, "chat_template", None)
        if self.chat_template is None:
            raise ValueError(
                f"--data {self.cfg.data} holds conversations (.jsonl): they need --init-from a model with a chat "
                "template (an instruct model's tokenizer_config.json or chat_template.jinja)"
            )
        conversations = chat_data.read_conversations(self.cfg.data)
        try:
            ids, mask = chat_data.encode_conversations(self.chat_template, self.tokenizer, conversations)
        except ValueError as e:
            raise ValueError(f"{self.cfg.data}: {e}") from None
        n_train = len(ids) - round(len(ids) * self.cfg.val_fraction)
        self._chat_masks = (mask[:n_train], mask[n_train:])
        return torch.from_numpy(ids[:n_train]), torch.from_numpy(ids[n_train:])

    def _model_config(self) -> GPTConfig:
        """The configuration of the model this run trains: the checkpoint's, or the preset's with
        the tokenizer's vocabulary and the flags' context length and dropout."""
        cfg = self.cfg
        if self._saved_meta is not None:
            return GPTConfig.from_dict(self._saved_meta["model_config"])
        if cfg.init_from:
            return self._init.model.config
        overrides: dict[str, Any] = {"vocab_size": self.tokenizer.vocab_size}
        if cfg.context_length is not None:
            overrides["context_length"] = cfg.context_length
        if cfg.dropout is not None:
            overrides["drop_rate"] = cfg.dropout
        try:
            return GPTConfig.preset(cfg.preset, **overrides)
        except (TypeError, ValueError) as exc:  # e.g. a --context-length past the sane limits
            raise ValueError(f"--preset {cfg.preset} with these settings: {exc}") from None

    def _per_rank_batch(self) -> int:
        """Rows of each micro-step on this process: the global batch split over processes and micro-steps."""
        cfg, d = self.cfg, self.dist
        per_rank, rem = divmod(cfg.batch_size, d.world_size * cfg.grad_accum)
        if rem or per_rank == 0:
            raise ValueError(
                f"--batch-size {cfg.batch_size} (global) must be a multiple of processes x --grad-accum = "
                f"{d.world_size} x {cfg.grad_accum}"
            )
        return per_rank

    def _check_memory(self, config: GPTConfig) -> None:
        """Refuse, with the estimate and the flags, a run that cannot fit in the device's memory (see
        :mod:`attnlab.training.memory`: a lower bound, so a run that might fit always starts)."""
        b = self._per_rank_batch()
        act_bytes = 2 if autocast_dtype(self.cfg.precision, self.device) is not None else 4  # bf16 activations
        if self.cfg.init_from:  # a pretrained model trains on windows of --context-length tokens
            config = dataclasses.replace(config, context_length=self.cfg.context_length)
        shards = self.dist.world_size if self.cfg.fsdp else 1
        need = estimate_training_memory(config, b, act_bytes=act_bytes, lora=self.cfg.lora_rank > 0, shards=shards)
        have = available_memory(self.device)
        if have is None or need.total <= have:
            return
        per = "4 bytes (frozen weights)" if self.cfg.lora_rank else "16 bytes (weights, gradients, AdamW)"
        per += f" / {shards} processes" if shards > 1 else ""
        fix = "lower --batch-size (or raise --grad-accum), --context-length, or choose a smaller --preset"
        n = None if self.cfg.lora_rank else fsdp_processes_needed(config, b, have, act_bytes=act_bytes)
        if n is not None and n > shards:  # the weights and optimizer state are what does not fit: shard them
            fix += (
                f"; or shard it over {n} devices like this one: torchrun --nproc_per_node={n} -m attnlab train --fsdp"
            )
        raise ValueError(
            f"this run needs at least {need.total / GiB:.1f} GiB on {self.device} but {have / GiB:.1f} GiB are "
            f"available: {need.parameters / 1e6:,.0f}M parameters x {per} = "
            f"{need.states / GiB:.1f} GiB, activations and logits of {b} x {config.context_length} tokens per "
            f"micro-step = {(need.activations + need.logits) / GiB:.1f} GiB; {fix}"
        )

    def _build_model(self, ckpt: Checkpoint | None, config: GPTConfig) -> None:
        """``raw_model`` on the device (the checkpoint's, or new from ``config``), ``model_config``,
        and ``cfg`` with the preset-dependent defaults settled, so the checkpoint records what was used."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
        if ckpt is not None:
            model = ckpt.model  # with its adapters, for a LoRA run (on its base's blocks where it had them)
        elif cfg.init_from:
            model = self._init.model.float()
            if cfg.lora_rank:
                apply_lora(model, LoRASettings.make(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets))
            elif any(is_quantized(p) for p in model.parameters()):  # (frozen: most of it would not train)
                raise ValueError(
                    "init's model keeps weights in a GGUF file's blocks, which are frozen: to train every "
                    "weight load it dense (GPT.from_gguf(path, dtype=torch.float32)), or train LoRA beside them"
                )
        else:
            model = GPT(config)
        self.raw_model = model.to(self.device)
        if any(is_quantized(p) for p in model.parameters()):
            compile_from_now()  # every step's products alike, whenever the clock would switch them
        self.model_config = model_cfg = model.config
        self.cfg = dataclasses.replace(
            cfg,
            context_length=cfg.context_length if cfg.init_from else model_cfg.context_length,
            dropout=model_cfg.drop_rate,
            lr=cfg.lr if cfg.lr is not None else finetune_lr(cfg) or default_lr(model_cfg.emb_dim),
        )

    def _fit_default_context(self, train_tokens: torch.Tensor, val_tokens: torch.Tensor) -> None:
        """A fine-tuning run not given ``--context-length`` trains on windows its data holds: where a
        split is shorter than the default windows, the longest power of two that fits (with a note)."""
        T = self.cfg.context_length
        name, n = min((("training", len(train_tokens)), ("validation", len(val_tokens))), key=lambda p: p[1])
        if n >= T + 1 or n - 1 < MIN_FIT_CONTEXT:  # it fits, or nothing sensible does (_build_batches says so)
            return
        fit = 1 << ((n - 1).bit_length() - 1)  # the largest power of two <= n - 1
        self.cfg = dataclasses.replace(self.cfg, context_length=fit)
        self.log(
            f"note: the {name} split has {n} tokens, fewer than the default context length + 1 = {T + 1}: "
            f"training on windows of {fit} tokens (--context-length sets them)"
        )

    def _build_batches(self, train_tokens: torch.Tensor, val_tokens: torch.Tensor) -> None:
        """This rank's share of each global batch, for training and validation."""
        cfg, d, T = self.cfg, self.dist, self.cfg.context_length
        per_rank = self._per_rank_batch()
        for name, part in (("training", train_tokens), ("validation", val_tokens)):
            if len(part) < T + 1:
                raise ValueError(
                    f"the {name} split has {len(part)} tokens, fewer than context length + 1 = {T + 1}; "
                    "use a longer text or a smaller --context-length"
                )
        common = dict(batch_size=per_rank, context_length=T, rank=d.rank, world_size=d.world_size)
        common.update(grad_accum_steps=cfg.grad_accum)
        if self._chat_masks is None:
            self.train_batches = data.RandomWindowBatches(train_tokens, seed=cfg.seed, **common)
            self.val_batches = data.RandomWindowBatches(val_tokens, seed=cfg.seed + 1, **common)
        else:  # the loss on the assistant's tokens only
            train_mask, val_mask = self._chat_masks
            self.train_batches = chat_data.MaskedWindowBatches(train_tokens, train_mask, seed=cfg.seed, **common)
            self.val_batches = chat_data.MaskedWindowBatches(val_tokens, val_mask, seed=cfg.seed + 1, **common)
        self.tokens_per_step = cfg.batch_size * T

    def _restore_state(self, ckpt: Checkpoint | None) -> None:
        """``step``, the optimizer state, the RNG states and the last validation loss: the
        checkpoint's, or those of a new run."""
        self.step = 0
        self.last_val_loss: float | None = None
        self.resumed_from = ckpt.path if ckpt is not None else None
        if ckpt is None:
            if self.dist.enabled and self.dist.rank > 0:  # each rank draws its own dropout masks
                torch.manual_seed(rank_seed(self.cfg.seed, self.dist.rank))
            return
        # Checked against this model's parameters first: load_state_dict would take a crafted
        # state whose tensors the fused kernel then reads out of bounds.
        if ckpt.optimizer_dir is not None:  # a sharded run's, resharded for this run (see attnlab.training.fsdp)
            fsdp.load_optimizer(self.raw_model, self.optimizer, ckpt.optimizer_dir)
        else:
            where = ckpt.path / OPTIMIZER_NAME
            state = check_optimizer_state(ckpt.optimizer_state, self.optimizer, step=ckpt.step, where=where)
            if self.cfg.fsdp:
                fsdp.load_full_optimizer_state(self.raw_model, self.optimizer, state)
            else:
                self.optimizer.load_state_dict(state)
        self.step = ckpt.step
        self._restore_rng(ckpt.metadata)
        saved_val = ckpt.metadata.get("val_loss")
        self.last_val_loss = float(saved_val) if is_real(saved_val) else None

    def _restore_rng(self, meta: dict[str, Any]) -> None:
        states = meta["rng"]  # checked: one generator state per process that wrote the checkpoint
        d = self.dist
        if len(states) == d.world_size:
            set_rng_state(states[d.rank])
            return
        # Other processes count: the dropout streams cannot continue as they were (data and
        # optimizer do). Rank 0 continues the old rank 0's; the others start new streams.
        if d.rank == 0 and states:
            set_rng_state(states[0])
        else:
            torch.manual_seed(rank_seed(self.cfg.seed, d.rank, self.step))
        self.log(
            f"note: the checkpoint was written by {len(states)} process(es), this run has {d.world_size}: "
            "data order and optimizer continue exactly, dropout randomness does not"
        )

    def _wrap_model(self) -> None:
        """``model``: ``raw_model`` in DDP (under torchrun) and torch.compile (``--compile``);
        ``autocast``: the forward pass in bf16 where :func:`autocast_dtype` says so."""
        self.model: torch.nn.Module = self.raw_model
        if self.cfg.fsdp:  # sharded in _setup; its mixed-precision policy computes in bf16 where autocast would
            self.autocast = contextlib.nullcontext
            return
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(self.raw_model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if self.cfg.compile:
            self.model = torch.compile(self.model, options=hardware.compile_options())
        dtype, device_type = autocast_dtype(self.cfg.precision, self.device), self.device.type
        self.autocast = (
            (lambda: torch.autocast(device_type=device_type, dtype=dtype)) if dtype else contextlib.nullcontext
        )

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self) -> Path | None:
        """Write a checkpoint of the current step (rank 0 writes; all ranks must call it)."""
        rng = get_rng_state()
        gathered: list[Any] = [rng] * self.dist.world_size  # under torchrun, each process's own once gathered
        if self.dist.enabled:
            torch.distributed.all_gather_object(gathered, rng)
        if not self.dist.is_main and not self.cfg.fsdp:
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
                "context_length": self.cfg.context_length,
                "source": self.cfg.data,
                "sha256": self.data_sha256,
            },
            "val_loss": self.last_val_loss,
            "torch_version": torch.__version__,
        }
        meta.update(self.chat_metadata())
        write = fsdp.save_sharded if self.cfg.fsdp else save_checkpoint  # fsdp: every process writes its shards
        kw = dict(model=self.raw_model, optimizer=self.optimizer, metadata=meta, tokenizer=self.tokenizer)
        return write(self.out, step=self.step, keep=self.cfg.keep_checkpoints, **kw)

    def chat_metadata(self) -> dict[str, Any]:
        """What a chat needs of this run, where known: ``chat_template`` (the run's, else the resumed
        checkpoint's, else the ``--init-from`` model's) and ``stop_ids`` (the init model's, else the checkpoint's)."""
        saved = self._saved_meta or {}
        out: dict[str, Any] = {}
        init_template = getattr(self._init, "chat_template", None)
        if self.chat_template is not None:
            out["chat_template"] = chat_data.template_to_dict(self.chat_template)
        elif saved.get("chat_template") is not None:
            out["chat_template"] = saved["chat_template"]
        elif init_template is not None:
            out["chat_template"] = chat_data.template_to_dict(init_template)
        stops = tuple(getattr(self._init, "stop_ids", None) or ()) or tuple(saved.get("stop_ids") or ())
        if stops:
            out["stop_ids"] = [int(i) for i in stops]
        return out

    # -- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss (nats per counted token) over ``eval_batches`` fixed global batches."""
        model = self.raw_model
        was_training = model.training
        model.eval()
        # Every counted target weighs the same: a batch's mean times its count (chat data's batches
        # count different numbers of assistant tokens), summed, over the total count.
        wide = hardware.float64_device(self.device)  # (the CPU for MPS, which has no float64)
        total = torch.zeros((), dtype=torch.float64, device=wide)
        count = torch.zeros((), dtype=torch.float64, device=wide)
        for i in range(self.cfg.eval_batches):
            for m in range(self.cfg.grad_accum):
                x, y = self.val_batches.batch(i, m, device=self.device)  # (b, T) each
                with self.autocast():
                    logits = model(x)  # (b, T, V)
                n = hardware.as_float64(_counted(y))
                total += hardware.as_float64(lm_loss(logits, y, ignore_index=IGNORE_INDEX)) * n
                count += n
        if self.dist.enabled:
            torch.distributed.all_reduce(total)
            torch.distributed.all_reduce(count)
        model.train(was_training)
        return (total / count).item()

    # -- the loop --------------------------------------------------------------------------------
    def _train_step(self) -> tuple[float, float, float]:
        """One optimizer step; returns (loss averaged over the global batch, lr, grad norm)."""
        cfg = self.cfg
        scale = lr_at(
            self.step, lr=1.0, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio
        )
        lr = cfg.lr * scale
        for group in self.optimizer.param_groups:  # each group's peak lr (Muon's own), scheduled
            group["lr"] = group.get("initial_lr", cfg.lr) * scale
        loss_sum = torch.zeros((), device=self.device)
        batches = [self.train_batches.batch(self.step, m, device=self.device) for m in range(cfg.grad_accum)]
        # Each micro-batch's mean weighs its count of targets over the global count (chat data counts
        # differ); the gradient all-reduce averages over the processes, hence the factor world_size.
        counts = [_counted(y) for _, y in batches]
        total = torch.stack(counts).sum()
        if self.dist.enabled:
            torch.distributed.all_reduce(total)
        for micro, (x, y) in enumerate(batches):
            last = micro == cfg.grad_accum - 1
            # All-reduce (DDP) or reduce-scatter (FSDP2) the gradients once, on the last micro-step.
            if last or not self.dist.enabled:
                sync = contextlib.nullcontext()
            elif self.cfg.fsdp:  # (an FSDP2 model has no DDP's no_sync)
                sync = fsdp.no_gradient_sync(self.raw_model)
            else:
                sync = no_sync(self.model)
            with sync:
                with self.autocast():
                    logits = self.model(x)  # (b, T, V)
                loss = lm_loss(logits, y, ignore_index=IGNORE_INDEX) * (counts[micro] * self.dist.world_size / total)
                loss.backward()
            loss_sum += loss.detach()
        # With --grad-clip 0 the norm is still measured for the metrics (an infinite threshold
        # scales the gradients by exactly 1).
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), max_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP: a DTensor
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.dist.enabled:
            torch.distributed.all_reduce(loss_sum)
            loss_sum /= self.dist.world_size
        return loss_sum.item(), lr, float(grad_norm)

    def _agreed(self, value: int, op: str) -> int:
        """``value`` all-reduced with ``ReduceOp.<op>`` over the processes (itself without torchrun)."""
        if not self.dist.enabled:
            return value
        t = torch.tensor([value], device=self.device if self.device.type == "cuda" else "cpu")
        torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op))
        return int(t.item())

    def fit(self, *, sample: bool = True) -> TrainResult:
        """Train to ``max_steps`` (or until SIGINT/SIGTERM); checkpoint, evaluate, and (with
        ``sample`` and ``sample_tokens > 0``) generate a sample, returned in the result."""
        cfg, d = self.cfg, self.dist
        if d.is_main:
            self._lock.acquire()  # held since __init__, unless a previous fit() ended
        try:
            interrupted, ckpt_path, history = self._fit_loop()
        except BaseException as exc:
            if _out_of_memory(exc):
                raise self._memory_error(exc) from None
            raise
        finally:
            self._lock.release()  # nothing more to write: another run may take the directory
        text = prompt = None
        if sample and not interrupted and d.is_main and cfg.sample_tokens > 0 and not cfg.fsdp:
            prompt = self.sample_prompt(cfg.sample_prompt)
            text = self.sample(prompt, cfg.sample_tokens)
        if d.enabled:
            settle(self.device)
        return TrainResult(self.step, self.last_val_loss, self.out, ckpt_path, interrupted, text, prompt, history)

    def _fit_loop(self) -> tuple[int | None, Path | None, list[dict[str, Any]]]:
        """The training loop of :meth:`fit`: (the signal that stopped it, the last checkpoint, the metrics)."""
        cfg, d = self.cfg, self.dist
        if d.is_main:
            self.metrics = MetricsLog(self.out / METRICS_NAME, keep_up_to=self.step)
        self._log_start()
        bar = self._progress_bar()
        write = bar.write if bar is not None else self.log
        interrupted: int | None = None
        ckpt_path: Path | None = self.resumed_from
        history: list[dict[str, Any]] = []
        self.raw_model.train()
        try:
            with StopFlag() as flag:
                while self.step < cfg.max_steps:
                    rec = self._step(write)
                    history.append(rec)
                    if len(history) == PLAN_STEPS and cfg.max_time is not None:
                        self._plan_steps(history, write)
                        if bar is not None:
                            bar.total = cfg.max_steps
                            bar.refresh()
                    if d.is_main:
                        self.metrics.append(rec)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:,.0f}", refresh=False)
                    interrupted = self._agreed(flag.signum or 0, "MAX") or None  # the signal, agreed by all ranks
                    if self.step % cfg.checkpoint_every == 0 or self.step == cfg.max_steps or interrupted:
                        if not self._weights_finite():  # a checkpoint of them would be the one resumed from
                            raise FloatingPointError(
                                f"the weights became NaN or infinite at step {self.step} (its update); no "
                                "checkpoint of them was written; try a smaller --lr"
                            )
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
        return interrupted, ckpt_path, history

    def _step(self, write: Callable[[str], None]) -> dict[str, Any]:
        """Train one step, and evaluate on evaluation steps; returns the step's metrics record."""
        t0 = time.perf_counter()
        loss, lr, gnorm = self._train_step()
        dt = time.perf_counter() - t0
        self.step += 1
        if not math.isfinite(loss):
            raise FloatingPointError(f"the training loss became {loss} at step {self.step}; try a smaller --lr")
        rec: dict[str, Any] = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "tokens_per_s": self.tokens_per_step / dt,
            "grad_norm": gnorm,
        }
        if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.max_steps:
            val_loss = self.evaluate()
            if not math.isfinite(val_loss):  # (the update after a finite training loss can still break them)
                raise FloatingPointError(
                    f"the validation loss became {val_loss} at step {self.step}: its update left the weights "
                    "not finite; try a smaller --lr"
                )
            self.last_val_loss = rec["val_loss"] = val_loss
            write(f"step {self.step}: train loss {loss:.4f}, val loss {rec['val_loss']:.4f}")
        return rec

    def _weights_finite(self) -> bool:
        """Whether every trained weight is finite, on every rank (the frozen ones cannot have changed)."""
        local = [getattr(p, "_local_tensor", p) for p in self.raw_model.parameters() if p.requires_grad]
        ok = bool(torch.stack([t.isfinite().all() for t in local]).all()) if local else True  # (one sync)
        return bool(self._agreed(int(ok), "MIN"))

    def _plan_steps(self, history: list[dict[str, Any]], write: Callable[[str], None]) -> None:
        """``--max-time``: lower ``max_steps`` to the steps that fit the budget at the median step time
        so far (the first two steps left out), agreed on by all ranks. It runs inside the warm-up, so
        the learning rates taken are the planned run's; checkpoints record the planned ``max_steps``."""
        cfg = self.cfg
        seconds = [self.tokens_per_step / r["tokens_per_s"] for r in history]  # each step's own time
        per_step = sorted(seconds[2:])[(len(seconds) - 2) // 2]
        spent = sum(seconds)
        fit = self._agreed(self.step + max(1, int((cfg.max_time - spent) / per_step)), "MIN")
        if fit < cfg.max_steps:
            load, cores = (os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0), os.cpu_count() or 1
            busy = ""
            if torch.get_num_threads() > 1 and load > cores:  # (threads waiting on each other: often far slower)
                busy = f"; this machine is busy (load {load:.1f} on {cores} cores): fewer --threads are often faster"
            write(
                f"planned {fit} steps: {cfg.max_steps} do not fit in {cfg.max_time:g} s of training at "
                f"{per_step * 1e3:.0f} ms per step (the median of steps {self.step - len(history) + 3}-{self.step}; "
                f"--max-steps or --max-time sets the length){busy}"
            )
            cfg.max_steps = fit

    def _log_start(self) -> None:
        """One line on what this run is; a note when there is nothing left to train."""
        cfg, n_params, T = self.cfg, self.raw_model.num_parameters(), self.cfg.context_length
        what = f"resuming {self.resumed_from} at step {self.step}" if self.resumed_from else "new run"
        self.log(f"recipe: {self.recipe()}")
        n_train = sum(p.numel() for p in self.raw_model.parameters() if p.requires_grad)
        # the model by its name, as the other commands give it (a resumed run: its file or directory's)
        base = cfg.init_from and (getattr(self._init, "metadata", {}).get("name") or Path(cfg.init_from).name)
        model = f"{base} (fine-tuned)" if cfg.init_from else f"GPT {cfg.preset}"
        model += f" {n_params / 1e6:.2f}M parameters"
        if n_train != n_params:
            lora = LoRASettings.make(cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
            model += (
                f" with LoRA rank {lora['rank']} alpha {lora['alpha']:g} on {','.join(lora['targets'])}: "
                f"{n_train:,} of {n_params:,} parameters train ({100 * n_train / n_params:.2f}%)"
            )
        self.log(
            f"attnlab train: {what}; {model}, "
            f"context {T}, tokenizer {self.tokenizer.name} "
            f"(vocab {self.tokenizer.vocab_size}), data {cfg.data or 'built-in corpus (Python docs)'} "
            f"({len(self.train_batches.tokens):,} train / {len(self.val_batches.tokens):,} val tokens), "
            f"batch {cfg.batch_size} x {T} tokens ({self.train_batches.batch_size} "
            f"per process x {cfg.grad_accum} micro-step(s)), {self.dist.world_size} process(es) "
            f"on {self.device}, out {self.out}"
        )
        if self.step >= cfg.max_steps:
            self.log(
                f"already at step {self.step}, at or past --max-steps {cfg.max_steps}: nothing to train "
                "(raise --max-steps to continue)"
            )

    def recipe(self) -> str:
        """The optimizer and the compute dtype this run uses, and why that dtype, e.g. "Muon +
        AdamW, float32: this CPU has no native bf16 (AVX2)"."""
        cfg = self.cfg
        optimizer = "Muon (blocks' matrices) + AdamW" if cfg.optimizer == "muon" else "AdamW"
        dtype = hardware.training_dtype(cfg.precision, self.device)
        how = "bf16 autocast" + (" and bf16 Newton-Schulz" if cfg.optimizer == "muon" else "")
        how = how if dtype == torch.bfloat16 else "float32"
        why = f"--precision {cfg.precision}" if cfg.precision != "auto" else hardware.describe(self.device).why
        if dtype == torch.bfloat16 and not hardware.bf16_native(self.device):
            why += " (this device has no native bf16: emulated, often 10-20x slower than fp32; auto picks fp32 here)"
        return f"{optimizer}, {how}: {why}"

    def _progress_bar(self) -> Any:
        """A tqdm bar on rank 0 with ``--progress`` and steps to go; None otherwise, or without tqdm."""
        if not (self.dist.is_main and self.cfg.progress and self.step < self.cfg.max_steps):
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self.log("note: no progress bar (the tqdm package is not installed: pip install tqdm)")
            return None
        return tqdm(total=self.cfg.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True)

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
        sampling: SamplingConfig = SAMPLE_SETTINGS,
        *,
        on_text: Callable[[str], None] | None = None,
    ) -> str:
        """Continue ``prompt`` by ``n`` tokens drawn as ``sampling`` says (seeded: the same text
        for the same checkpoint).

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
        for token in self.raw_model.stream(idx, n, **dataclasses.asdict(sampling), generator=gen):  # (1,)
            ids.append(int(token[0]))
            if on_text is not None and (piece := decoder.push(ids[-1])):
                on_text(piece)
        if on_text is not None and (piece := decoder.flush()):
            on_text(piece)
        return self.tokenizer.decode(ids)


def train(config: TrainConfig | None = None, **overrides: Any) -> TrainResult:
    """Train with ``config`` (default :class:`TrainConfig`), fields overridden by keyword.

    >>> result = train(max_steps=20, out="runs/demo", progress=False)  # doctest: +SKIP

    On ``resume=True`` the settings not given come from the checkpoint: with ``config`` those
    equal to the defaults, without it those not passed by keyword.
    """
    cfg = dataclasses.replace(config or TrainConfig(), **overrides)
    given = None if config is not None else set(overrides)
    trainer = Trainer(cfg, given=given)  # one that fails closes itself
    try:
        return trainer.fit()
    finally:
        trainer.close()
