"""Training sparse autoencoders and transcoders on a model's activations (``attnlab sae train``).

The pipeline, one *cycle* at a time::

    tokens (memory-mapped cache of --data)  ->  windows at seeded random starts  ->  model forward with
    a hook that keeps the activation(s)  ->  a buffer of ``buffer_rows`` rows (bounded: the corpus is
    never in memory)  ->  shuffled by a seeded permutation  ->  ``buffer_rows // batch_rows`` steps

Everything a cycle does is a function of ``(seed, cycle)``, so a run stopped at step ``s`` and
resumed rebuilds its cycle's buffer and continues at the very batch it would have trained on:
``N`` steps straight and ``N/2 + resume + N/2`` give the same weights.

The losses (Gao et al. 2024, as sparsify writes them): the reconstruction error over the batch's
variance about its mean (the fraction of variance unexplained, ``FVU``); TopK and BatchTopK add the
auxiliary loss ``AuxK``: the ``d_in / 2`` strongest *dead* latents (not active for
``dead_tokens`` tokens) fit what the live ones leave, so dead latents get gradients and come back;
JumpReLU adds an L0 penalty with straight-through gradients for its thresholds (Rajamanoharan et
al. 2024). Decoder rows are kept at unit norm (autoencoders) and their gradient's component along
the row removed, as sparsify does.

Checkpoints are the trainer's: a step directory assembled under a temporary name, renamed, and
``latest.json`` switched atomically (:mod:`attnlab.training.checkpoint`); the directory is locked
while a run writes (:mod:`attnlab.training.rundir`). The finished SAE is saved in SAELens's format
in ``DIR/sae`` (a TopK transcoder, which SAELens has no class for, in sparsify's). ``DIR/metrics.jsonl``
holds the training curve: every 10 steps, the mean of their loss, explained variance, L0 and dead
fraction, with the step, the tokens trained on and the seconds since the run (re)started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from attnlab.checks import is_int, is_real
from attnlab.files import atomic_write_bytes, atomic_write_json, fsync_dir, read_json, sha256_file
from attnlab.interpret.hooks import HookPoint, eval_mode, hook_names, hooks
from attnlab.interpret.sae import SAE, SAEConfig, cfg_dict, hook_width
from attnlab.quantized import stored_tensors
from attnlab.training.checkpoint import (
    CHECKPOINT_NAME,
    CHECKPOINTS_DIR,
    OPTIMIZER_NAME,
    SELF_HASH,
    begin_save,
    commit_save,
    find_checkpoint,
    has_checkpoint,
    metadata_digest,
    recover_latest,
    remove_save_debris,
)
from attnlab.training.rundir import RunLock, check_run_directory
from attnlab.training.trainer import METRICS_NAME, MetricsLog, StopFlag

__all__ = ["SAETrainConfig", "SAETrainResult", "SAETrainer", "train_sae"]

FORMAT = "attnlab-sae-checkpoint"
WEIGHTS = "model.safetensors"  # names the checkpoint machinery owns (it prunes only its own files)
CONFIG = "config.json"


@dataclass
class SAETrainConfig:
    """How to train. Sizes count activation rows (one per token position)."""

    hook: str
    hook_out: str | None = None  # a transcoder's output hook
    architecture: str = "topk"  # topk, batchtopk, jumprelu
    width: int | None = None  # latents; default 16 x the hook's width
    k: int = 32
    skip: bool = False  # a transcoder's skip connection
    tokens: int = 1_000_000  # activation rows to train on
    batch_rows: int = 1024
    buffer_rows: int = 32768  # the shuffled buffer (bounded memory: rows x width x 4 bytes)
    context: int = 128  # tokens per window the model reads
    model_batch: int = 8  # windows per model forward
    # Rows whose norm is above this many times their forward's median are left out (0 keeps them
    # all): some models' residual streams hold rare "massive activations" (Sun et al. 2024), a few
    # rows of norm ~100x the rest; under a squared error they would hold most of the variance and
    # take the SAE's capacity from the typical tokens a user wants explained.
    outlier_ratio: float = 10.0
    lr: float | None = None  # default: sparsify's 2e-4 / sqrt(width / 2**14)
    auxk_alpha: float = 1 / 32
    dead_tokens: int = 250_000  # a latent not active for this many rows is dead (within a default run's 1M)
    l0_coefficient: float = 1e-3  # JumpReLU's sparsity penalty
    jumprelu_bandwidth: float = 0.05
    threshold_lr: float = 0.01  # BatchTopK's running threshold
    seed: int = 0
    save_every: int = 500  # steps between checkpoints
    keep: int = 2

    def __post_init__(self) -> None:
        if self.architecture not in ("topk", "batchtopk", "jumprelu"):
            raise ValueError(f"architecture (--arch) must be topk, batchtopk or jumprelu, got {self.architecture!r}")
        positive = ("k", "tokens", "batch_rows", "buffer_rows", "context", "model_batch", "save_every", "keep")
        for name in (*positive, "dead_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        least = 1 if self.architecture == "jumprelu" else self.k  # (JumpReLU has no k)
        if self.width is not None and (not isinstance(self.width, int) or self.width < least):
            raise ValueError(f"width must be an int >= {'1' if least == 1 else f'k={self.k}'}, got {self.width!r}")
        if self.buffer_rows < self.batch_rows:
            raise ValueError(f"buffer_rows ({self.buffer_rows}) must be at least batch_rows ({self.batch_rows})")
        if self.context < 2:
            raise ValueError(f"context must be at least 2 tokens, got {self.context}")
        if isinstance(self.outlier_ratio, bool) or not isinstance(self.outlier_ratio, (int, float)):
            raise TypeError(f"outlier_ratio must be a number, got {type(self.outlier_ratio).__name__}")
        if not (self.outlier_ratio == 0 or 1 < self.outlier_ratio < math.inf):
            raise ValueError(
                f"outlier_ratio must be 0 (keep every row) or a finite number above 1, got {self.outlier_ratio}"
            )
        if not is_int(self.seed):
            raise TypeError(f"seed must be an int, got {type(self.seed).__name__}")
        if self.seed < 0:
            raise ValueError(f"seed must be at least 0, got {self.seed}")
        # (name, the least it may be, whether that least is allowed): a NaN or a wrong sign would train
        # a whole run into a result that cannot be loaded, or fail deep inside the optimizer
        for name, least, closed in (
            ("lr", 0.0, False),
            ("auxk_alpha", 0.0, True),
            ("l0_coefficient", 0.0, True),
            ("jumprelu_bandwidth", 0.0, False),
            ("threshold_lr", 0.0, False),
        ):
            v = getattr(self, name)
            if v is None and name == "lr":
                continue
            if not is_real(v):
                raise TypeError(f"{name} must be a number, got {type(v).__name__}")
            if not (math.isfinite(v) and (v >= least if closed else v > least)):
                raise ValueError(f"{name} must be a finite number {'>=' if closed else '>'} {least:g}, got {v!r}")
        if self.skip and self.hook_out is None:
            raise ValueError("a skip connection is a transcoder's: give the output hook (--hook-out)")

    @property
    def steps_per_cycle(self) -> int:
        return self.buffer_rows // self.batch_rows

    @property
    def max_steps(self) -> int:
        return max(1, self.tokens // self.batch_rows)


@dataclass
class SAETrainResult:
    sae: SAE
    steps: int
    explained_variance: float
    l0: float
    dead_fraction: float
    out: Path
    history: list[dict[str, float]]


# ---------------------------------------------------------------------------------------------
# JumpReLU's straight-through estimators (Rajamanoharan et al. 2024, as SAELens writes them)
# ---------------------------------------------------------------------------------------------
def _rectangle(x: Tensor) -> Tensor:
    return ((x > -0.5) & (x < 0.5)).to(x.dtype)


class _JumpReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return x * (x > threshold).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        x_grad = (x > threshold).to(x.dtype) * grad
        t_grad = (-(threshold / bw) * _rectangle((x - threshold) / bw) * grad).sum(0)
        return x_grad, t_grad, None


class _Step(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return (x > threshold).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None]:
        x, threshold = ctx.saved_tensors
        bw = ctx.bandwidth
        return None, (-(1.0 / bw) * _rectangle((x - threshold) / bw) * grad).sum(0), None


# ---------------------------------------------------------------------------------------------
# Activations: a bounded, shuffled buffer, rebuilt exactly from (seed, cycle)
# ---------------------------------------------------------------------------------------------
def _decode_rows(sae: SAE, values: Tensor, indices: Tensor, x: Tensor) -> Tensor:
    """A TopK SAE's reconstruction from its ``k`` kept latents of each row, ``values, indices (n, k)``:
    the sum of ``values * W_dec[indices]`` (an embedding bag: ``k`` rows of ``W_dec`` per row rather
    than a matmul with ``d_sae`` mostly zero latents, forward and backward), plus ``b_dec`` and a
    transcoder's skip connection. The same as ``sae.decode(z, x)`` for the SAEs training makes (no
    run-time normalization, no decoder-norm rescaling)."""
    out = F.embedding_bag(indices, sae.W_dec, per_sample_weights=values, mode="sum") + sae.b_dec  # (n, d_out)
    if sae.cfg.skip:
        out = out + x @ sae.W_skip.T
    return out


def _encoder_input(sae: SAE, x: Tensor) -> Tensor:
    """What the encoder multiplies: ``x`` less ``b_dec`` where the SAE subtracts it (as
    ``sae.pre_activations`` does for the SAEs training makes: no run-time normalization)."""
    x = x.to(sae.dtype)
    return x - sae.b_dec if sae.cfg.apply_b_dec_to_input else x


class _EncodeRows(torch.autograd.Function):
    """``values (n, k)``, the pre-activations of the latents ``indices (n, k)`` (computed without
    gradients from the dense ``x @ W_enc``), given the gradients of ``xin . W_enc[:, j] + b_enc[j]``
    for those ``k`` latents alone: ``W_enc``'s is a sparse ``(d_sae, n) @ (n, d_in)`` product with
    ``n k`` entries rather than a dense ``(d_in, n) @ (n, d_sae)`` matmul of mostly zero gradients,
    and the input's (``b_dec``'s, through the encoder) a sum of ``k`` encoder columns per row rather
    than an ``(n, d_sae) @ (d_sae, d_in)`` matmul."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, xin: Tensor, w_enc: Tensor, b_enc: Tensor, indices: Tensor) -> Tensor:
        ctx.save_for_backward(xin, w_enc, indices)
        return values.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor | None, Tensor | None, Tensor | None, None]:
        xin, w_enc, indices = ctx.saved_tensors
        (n, k), d_sae = indices.shape, w_enc.shape[1]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[1]:  # sum_i grad[r, i] * W_enc[:, indices[r, i]]
            grad_x = F.embedding_bag(indices, w_enc.T.contiguous(), per_sample_weights=grad, mode="sum")
        if ctx.needs_input_grad[2]:
            if xin.device.type in ("cpu", "cuda"):
                rows = torch.arange(n, device=indices.device).repeat_interleave(k)
                where = torch.stack([indices.reshape(-1), rows])  # in range by construction: no checks
                g = torch.sparse_coo_tensor(where, grad.reshape(-1), (d_sae, n), check_invariants=False)
                grad_w = torch.sparse.mm(g, xin).T.contiguous()  # (d_in, d_sae)
            else:  # (no sparse matmul elsewhere) the same sum, its n k terms written out
                terms = (grad.unsqueeze(-1) * xin.unsqueeze(1)).reshape(n * k, -1)  # (n k, d_in)
                grad_w = xin.new_zeros(d_sae, xin.shape[-1]).index_add_(0, indices.reshape(-1), terms).T.contiguous()
        if ctx.needs_input_grad[3]:
            grad_b = torch.zeros(d_sae, dtype=grad.dtype, device=grad.device).index_add_(
                0, indices.reshape(-1), grad.reshape(-1)
            )
        return None, grad_x, grad_w, grad_b, None


def _encode_rows(sae: SAE, x: Tensor, indices: Tensor, values: Tensor) -> Tensor:
    """``values``, the pre-activations of the latents ``indices`` (the dense matmul's, bit for bit),
    with the gradients of the encoder restricted to them (:class:`_EncodeRows`)."""
    return _EncodeRows.apply(values, _encoder_input(sae, x), sae.W_enc, sae.b_enc, indices)


def _dead_pre_activations(sae: SAE, x: Tensor, dead_idx: Tensor) -> Tensor:
    """The pre-activations ``(n, n_dead)`` of the latents ``dead_idx`` alone, with gradients (AuxK's)."""
    return _encoder_input(sae, x) @ sae.W_enc[:, dead_idx] + sae.b_enc[dead_idx]


class _Interrupted(BaseException):
    """SIGINT / SIGTERM during a buffer fill: the fill is abandoned (a cycle's buffer is rebuilt from
    ``(seed, cycle)`` anyway). A BaseException, like KeyboardInterrupt, so no ``except Exception`` keeps it."""


@contextlib.contextmanager
def _signals_stop_at_once(stop: StopFlag | None) -> Any:
    """While the buffer fills (minutes of model forwards on a big buffer), SIGINT / SIGTERM stop it
    at once rather than after the fill and a step: noted in ``stop`` (as its handler would), then
    :class:`_Interrupted` raised. Nothing without a ``stop`` (a fill outside :meth:`SAETrainer.fit`)."""
    if stop is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    if stop.signum is not None:
        raise _Interrupted

    def handler(signum: int, frame: Any) -> None:
        stop.signum = signum
        raise _Interrupted

    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class _Reached(Exception):
    """Raised at the last hook point the buffer reads: the rest of the forward pass is skipped."""


class ActivationBuffer:
    """Rows of activations from ``model`` at ``hook`` (and ``hook_out``), one buffer per cycle.

    Each cycle reads windows of ``context`` tokens at random starts (a generator seeded by
    ``(seed, cycle)``), keeps every position but the first (a window's first token sees no context:
    an outlier the SAE should not spend latents on) and every row within ``outlier_ratio`` times its
    forward's median norm, reads more windows while rows are short, and shuffles the rows with the
    same generator.
    """

    def __init__(self, model: nn.Module, tokens: np.ndarray, cfg: SAETrainConfig) -> None:
        if len(tokens) < cfg.context + 1:
            raise ValueError(f"--data has {len(tokens)} tokens, fewer than one window of --context {cfg.context}")
        self.model, self.tokens, self.cfg = model, tokens, cfg
        self.device = next(model.parameters()).device
        self.cycle: int | None = None
        self.x: Tensor | None = None  # (buffer_rows, d_in)
        self.y: Tensor | None = None  # (buffer_rows, d_out) for a transcoder
        self.stop: StopFlag | None = None  # set by SAETrainer.fit: a signal stops a fill at once
        self.left_out = 0  # rows over the outlier ratio in the last fill

    def _typical(self, x: Tensor) -> Tensor:
        """(rows, d) -> (rows,) bool: True where the row's norm is within the outlier ratio."""
        norms = x.norm(dim=-1)
        if not self.cfg.outlier_ratio:
            return torch.ones_like(norms, dtype=torch.bool)
        return norms <= self.cfg.outlier_ratio * norms.median()

    @torch.no_grad()
    def fill(self, cycle: int) -> None:
        cfg = self.cfg
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + cycle)
        last_start = len(self.tokens) - cfg.context + 1
        starts = torch.randint(0, last_start, (-(-cfg.buffer_rows // (cfg.context - 1)),), generator=g).tolist()
        xs, ys = [], []
        seen: dict[str, Tensor] = {}
        kept = read = 0

        order = hook_names(self.model)
        last = max((cfg.hook, cfg.hook_out or cfg.hook), key=order.index)  # the pass stops after it

        def keep(x: Tensor, hook: HookPoint) -> None:
            seen[hook.name] = x[:, 1:].reshape(-1, x.shape[-1]).float()  # (b * (T-1), d)
            if hook.name == last:
                raise _Reached  # the layers after the hook (and the vocabulary's matmul) are not needed

        names = {cfg.hook: keep, **({cfg.hook_out: keep} if cfg.hook_out else {})}
        with eval_mode(self.model), hooks(self.model, names), _signals_stop_at_once(self.stop):
            while kept < cfg.buffer_rows:
                if read == len(starts):  # rows were left out: read more windows
                    starts += torch.randint(0, last_start, (cfg.model_batch,), generator=g).tolist()
                batch = np.stack([self.tokens[s : s + cfg.context] for s in starts[read : read + cfg.model_batch]])
                read += len(batch)
                with contextlib.suppress(_Reached):
                    self.model(torch.from_numpy(batch.astype(np.int64)).to(self.device))
                for name in names:
                    bad = (~torch.isfinite(seen[name])).any(-1)  # (rows,)
                    if bad.any():  # (they would make the median, or the loss, NaN)
                        start = starts[read - len(batch) + int(bad.nonzero()[0]) // (cfg.context - 1)]
                        raise ValueError(
                            f"the model's activations at {name} hold NaN or infinite values (in the window "
                            f"at token {start} of --data); an SAE cannot be trained on them"
                        )
                typical = self._typical(seen[cfg.hook])
                if cfg.hook_out:
                    typical &= self._typical(seen[cfg.hook_out])
                    ys.append(seen[cfg.hook_out][typical])
                xs.append(seen[cfg.hook][typical])
                kept += int(typical.sum())
        self.left_out = read * (cfg.context - 1) - kept
        order = torch.randperm(kept, generator=g)[: cfg.buffer_rows].to(self.device)
        self.x = torch.cat(xs)[order]
        self.y = torch.cat(ys)[order] if cfg.hook_out else None
        self.cycle = cycle

    def batch(self, step: int) -> tuple[Tensor, Tensor]:
        """The rows of optimizer step ``step``: ``(x (batch_rows, d_in), target (batch_rows, d_out))``."""
        cfg = self.cfg
        cycle, i = divmod(step, cfg.steps_per_cycle)
        if self.cycle != cycle:
            self.fill(cycle)
        rows = slice(i * cfg.batch_rows, (i + 1) * cfg.batch_rows)
        x = self.x[rows]
        return x, (self.y[rows] if self.y is not None else x)


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------
class SAETrainer:
    """Train an SAE or transcoder on ``model``'s activations over ``tokens`` into ``out``.

    Resumes from ``out`` when it holds a run (the same settings, data and model are required: the
    run's own are read back and a differing one is a ValueError). A loss that is not finite stops
    training with a FloatingPointError before its step, the last checkpoint kept.
    """

    def __init__(
        self,
        model: nn.Module,
        tokens: np.ndarray,
        cfg: SAETrainConfig,
        out: str | Path,
        *,
        model_name: str | None = None,
        progress: bool = True,
        write: Callable[[str], None] = print,
    ) -> None:
        self.model, self.cfg, self.out = model, cfg, Path(out)
        self.write, self.progress = write, progress
        known = hook_names(model)
        for flag, name in (("--hook", cfg.hook), ("--hook-out", cfg.hook_out)):
            if name is not None and name not in known:
                raise ValueError(f"{flag} {name!r} is not a hook point of this model (e.g. blocks.0.hook_resid_post)")
        if cfg.hook_out is not None and known.index(cfg.hook_out) < known.index(cfg.hook):
            raise ValueError(
                f"--hook-out {cfg.hook_out!r} comes before --hook {cfg.hook!r} in the model's forward pass: "
                "a transcoder cannot write what it has not read yet"
            )
        longest = getattr(getattr(model, "config", None), "context_length", None)
        if longest is not None and cfg.context > longest:
            raise ValueError(
                f"context (--context) {cfg.context} is longer than the model's context of {longest} tokens"
            )
        d_in = hook_width(model, cfg.hook)
        d_out = hook_width(model, cfg.hook_out) if cfg.hook_out else None
        if cfg.architecture == "topk" and d_out is not None and d_out != d_in:  # (known before training, not after)
            raise ValueError(
                f"a TopK transcoder from --hook (width {d_in}) to --hook-out (width {d_out}) could not be saved: "
                "SAELens has no TopK transcoder and sparsify's keep the width; use --arch batchtopk or jumprelu "
                "(saved as SAELens's JumpReLU transcoder), or an output hook of width " + str(d_in)
            )
        width = cfg.width or 16 * d_in
        if cfg.k > width and cfg.architecture != "jumprelu":
            raise ValueError(f"--k {cfg.k} is more than the SAE's {width} latents")
        device = next(model.parameters()).device
        sae_cfg = SAEConfig(
            d_in=d_in,
            d_sae=width,
            architecture=cfg.architecture,
            k=cfg.k if cfg.architecture != "jumprelu" else None,
            d_out=d_out,
            hook_name=cfg.hook,
            hook_name_out=cfg.hook_out,
            skip=cfg.skip,
            apply_b_dec_to_input=cfg.hook_out is None,
            model_name=model_name,
        )
        torch.manual_seed(cfg.seed)
        self.sae = SAE(sae_cfg, device=device).train()
        if sae_cfg.transcoder:
            with torch.no_grad():
                self.sae.W_dec.zero_()  # a transcoder starts from no output (sparsify's initialization)
        if cfg.architecture == "jumprelu":
            with torch.no_grad():
                self.sae.threshold.fill_(0.001)
        self.lr = cfg.lr if cfg.lr is not None else 2e-4 / math.sqrt(width / 2**14)
        self.optimizer = torch.optim.Adam(self.sae.parameters(), lr=self.lr, eps=6.25e-10, fused=True)
        self.since_fired = torch.zeros(width, dtype=torch.long, device=device)  # rows since each latent fired
        self.step = 0
        self.buffer = ActivationBuffer(model, tokens, cfg)
        self.lock = RunLock(self.out)
        self.stopped: int | None = None  # the signal that stopped fit() (it then raises KeyboardInterrupt)
        self.tokens = tokens
        self._identity: dict[str, Any] | None = None

    # -- checkpoints ---------------------------------------------------------------------------
    def _settings(self) -> dict[str, Any]:
        # What a resumed run must share; how often it saves and how far it goes may change.
        # The model's dtype too: activations of a bfloat16 model differ from a float32 model's.
        dtype = next((str(p.dtype) for p in self.model.parameters() if p.is_floating_point()), None)
        k = None if self.cfg.architecture == "jumprelu" else self.cfg.k  # (JumpReLU has none)
        return {
            **dataclasses.asdict(self.cfg),
            "save_every": None,
            "keep": None,
            "tokens": None,
            "k": k,
            "model_dtype": dtype,
        }

    def identity(self) -> dict[str, Any]:
        """What a resumed run must read and run as the run did: the data (its tokens) and the model (its
        weights), by SHA-256 (computed once, when a checkpoint is read or written)."""
        if self._identity is None:
            data, model = hashlib.sha256(), hashlib.sha256()
            flat = np.asarray(self.tokens).reshape(-1)
            for i in range(0, len(flat), 1 << 22):  # as int64 values: the same tokens in any dtype
                data.update(np.ascontiguousarray(flat[i : i + (1 << 22)], dtype="<i8"))
            for name, t in sorted(self.model.state_dict().items()):
                if not isinstance(t, Tensor):
                    continue
                model.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
                # A matrix kept in a file's blocks is hashed as its blocks (its float32 values would be
                # dequantized first: minutes and GBs for an 8B model).
                for r in stored_tensors(t):
                    model.update(r.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            self._identity = {"tokens_in_data": len(flat), "data_sha256": data.hexdigest()}
            self._identity["model_sha256"] = model.hexdigest()
        return self._identity

    @staticmethod
    def _checked(d: Path) -> dict[str, Any]:
        """The step directory ``d``'s ``checkpoint.json``, once it and every file it lists are whole."""
        meta = read_json(d / CHECKPOINT_NAME, "SAE checkpoint", max_bytes=1 << 20)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{d / CHECKPOINT_NAME} is not an attnlab SAE checkpoint (an attnlab train run?)")
        if meta.get(SELF_HASH) != metadata_digest(meta):
            raise ValueError(f"{d / CHECKPOINT_NAME} is damaged or edited (its own SHA-256 does not match)")
        # The self-hash has no key: the entries are checked as if written by anyone. Only this
        # checkpoint's own plain file names (a '../x' must not be read), each listed with its hash.
        files, own = meta.get("files"), {WEIGHTS, CONFIG, OPTIMIZER_NAME}
        if (
            not isinstance(files, dict)
            or set(files) != own
            or not all(isinstance(i, dict) and isinstance(i.get("sha256"), str) for i in files.values())
            or not isinstance(meta.get("settings"), dict)
            or not is_int(meta.get("step"))
            or meta["step"] < 0
        ):
            raise ValueError(f"{d / CHECKPOINT_NAME} is not a well-formed SAE checkpoint (files, settings, step)")
        for name, info in files.items():
            if sha256_file(d / name, what="SAE checkpoint file") != info["sha256"]:  # (regular files only)
                raise ValueError(f"{d / name} does not match the SHA-256 its checkpoint recorded")
        return meta

    def resume(self) -> bool:
        """Load the latest checkpoint of ``out`` if there is one; True when it did."""
        if not has_checkpoint(self.out):
            return False
        d = find_checkpoint(self.out)
        meta = self._checked(d)
        if meta["settings"] != json.loads(json.dumps(self._settings())):
            theirs, ours = meta["settings"], json.loads(json.dumps(self._settings()))
            diff = sorted(k for k in ours if theirs.get(k) != ours[k])
            raise ValueError(f"--out {self.out} holds a run with other settings ({', '.join(diff)}); use another --out")
        ours = self.identity()
        for key, flag, what in (
            ("tokens_in_data", "--data", "its tokens"),
            ("data_sha256", "--data", "its tokens"),
            ("model_sha256", "--model", "its weights"),
        ):
            if key in meta and meta[key] != ours[key]:  # (checkpoints before the SHA-256s hold the count only)
                raise ValueError(
                    f"{flag} is not the one the run in --out {self.out} trained on ({what} differ); a resumed "
                    "run keeps its data and model: use another --out"
                )
        from safetensors.torch import load as st_load

        state = st_load((d / WEIGHTS).read_bytes())
        self.sae.load_state_dict({k: v.to(self.sae.W_enc.device) for k, v in state.items()})
        saved = torch.load(io.BytesIO((d / OPTIMIZER_NAME).read_bytes()), weights_only=True, map_location="cpu")
        self.optimizer.load_state_dict(saved["optimizer"])
        self.since_fired.copy_(saved["since_fired"])
        self.step = int(meta["step"])
        return True

    def save(self) -> Path:
        final, tmp = begin_save(self.out, self.step)
        if tmp is None:
            return final
        try:
            from safetensors.torch import save as st_save

            state = {k: v.detach().cpu().contiguous() for k, v in self.sae.state_dict().items()}
            atomic_write_bytes(tmp / WEIGHTS, st_save(state))
            atomic_write_json(tmp / CONFIG, cfg_dict(self.sae.cfg))
            buf = io.BytesIO()
            torch.save({"optimizer": self.optimizer.state_dict(), "since_fired": self.since_fired.cpu()}, buf)
            atomic_write_bytes(tmp / OPTIMIZER_NAME, buf.getvalue())
            files = [WEIGHTS, CONFIG, OPTIMIZER_NAME]
            meta = {
                "format": FORMAT,
                "step": self.step,
                "settings": self._settings(),
                **self.identity(),
                "files": {f: {"bytes": (tmp / f).stat().st_size, "sha256": sha256_file(tmp / f)} for f in files},
            }
            meta = json.loads(json.dumps(meta))
            meta[SELF_HASH] = metadata_digest(meta)
            atomic_write_json(tmp / CHECKPOINT_NAME, meta)
            fsync_dir(tmp)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return commit_save(self.out, tmp, final, self.step, self.cfg.keep)

    # -- one step ------------------------------------------------------------------------------
    def train_step(self) -> dict[str, float]:
        cfg, sae = self.cfg, self.sae
        x, y = self.buffer.batch(self.step)
        sparse = cfg.architecture == "topk"  # k latents per row: decoded as a sum of k rows, not a matmul
        dead = self.since_fired >= cfg.dead_tokens
        n_dead = int(dead.sum())
        if sparse:
            with torch.no_grad():
                pre = sae.pre_activations(x)  # (n, d_sae): only to choose the latents
                values, indices = pre.topk(cfg.k, dim=-1, sorted=False)  # (n, k) each
            values = _encode_rows(sae, x, indices, values).relu()  # the same values, with gradients
            out = _decode_rows(sae, values, indices, x)  # (n, d_out)
        else:
            pre = sae.pre_activations(x)  # (n, d_sae)
            if cfg.architecture == "jumprelu":
                z = _JumpReLU.apply(pre.relu(), sae.threshold, cfg.jumprelu_bandwidth)
            else:
                z = sae.activation(pre, x)
            out = sae.decode(z, x)  # (n, d_out)
        err = y - out
        total_var = (y - y.mean(0)).pow(2).sum()
        fvu = err.pow(2).sum() / total_var
        loss = fvu
        if cfg.architecture != "jumprelu" and n_dead > 0 and cfg.auxk_alpha > 0:
            # AuxK: the strongest dead latents reconstruct what the live ones missed (Gao et al. 2024, B.1).
            k_aux = min(y.shape[-1] // 2, n_dead)
            scale = min(n_dead / (y.shape[-1] // 2), 1.0)
            if sparse:  # the dead latents' pre-activations alone, with gradients: (n, n_dead)
                dead_idx = dead.nonzero().squeeze(-1)
                aux_pre = _dead_pre_activations(sae, x, dead_idx)
                aux_values, aux_local = aux_pre.topk(k_aux, dim=-1, sorted=False)
                aux_indices = dead_idx[aux_local]
            else:
                aux_pre = torch.where(dead, pre, torch.full_like(pre, -torch.inf))
                aux_values, aux_indices = aux_pre.topk(k_aux, dim=-1, sorted=False)
            # no bias: it fits the residual
            e_hat = F.embedding_bag(aux_indices, sae.W_dec, per_sample_weights=aux_values.relu(), mode="sum")
            auxk = scale * (e_hat - err.detach()).pow(2).sum() / total_var
            loss = loss + cfg.auxk_alpha * auxk
        if cfg.architecture == "jumprelu":
            l0 = _Step.apply(pre.relu(), sae.threshold, cfg.jumprelu_bandwidth).sum(-1).mean()
            loss = loss + cfg.l0_coefficient * l0
        # (one read from the device for both: the loss, and how far the rows vary against their size)
        loss_value, spread = torch.stack([loss.detach(), total_var / y.pow(2).sum()]).tolist()
        if not spread > 1e-10:  # (every row the same: FVU divides by rounding noise, or by 0)
            name = cfg.hook_out or cfg.hook
            raise ValueError(
                f"the activations at {name} do not vary over a batch of {y.shape[0]} rows (every row the same, "
                "up to rounding): an SAE has nothing to learn from them (a constant token stream?)"
            )
        if not math.isfinite(loss_value):  # before the step: the weights (and the checkpoints) stay good
            raise FloatingPointError(
                f"the SAE's training loss became {loss_value} at step {self.step + 1}; the last "
                "checkpoint is kept (try a smaller --lr)"
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if not sae.cfg.transcoder:
            sae.remove_parallel_gradient()
        self.optimizer.step()
        with torch.no_grad():
            if not sae.cfg.transcoder:
                sae.normalize_decoder()
            if sparse:
                fired = torch.zeros(sae.cfg.d_sae, dtype=torch.bool, device=x.device)
                fired[indices[values > 0]] = True
            else:
                fired = (z != 0).any(0)
            self.since_fired += x.shape[0]
            self.since_fired[fired] = 0
            if cfg.architecture == "batchtopk" and (z > 0).any():
                # The inference threshold: a running mean of the smallest activation BatchTopK kept (SAELens's).
                smallest = z[z > 0].min()
                sae.threshold.mul_(1 - cfg.threshold_lr).add_(cfg.threshold_lr * smallest)
            if cfg.architecture == "jumprelu":
                sae.threshold.clamp_(min=0)
        self.step += 1
        return {
            "loss": loss_value,
            "explained_variance": 1.0 - float(fvu.detach()),
            "l0": float(((values if sparse else z) != 0).sum(-1).float().mean()),
            "dead_fraction": float(dead.float().mean()),
        }

    # -- the loop ------------------------------------------------------------------------------
    def fit(self) -> SAETrainResult:
        check_run_directory(self.out, resume=True)  # (a run in --out is always resumed)
        self.lock.acquire()
        remove_save_debris(self.out / CHECKPOINTS_DIR)  # (a killed save's)
        metrics: MetricsLog | None = None
        try:
            if (taken := recover_latest(self.out, lambda d: self._checked(d)["step"])) is not None:
                self.write(f"{taken.name}'s save was stopped before latest.json was written; resuming from it")
            resumed = self.resume()
            cfg = self.cfg
            if resumed:
                self.write(f"resuming {self.out} at step {self.step} of {cfg.max_steps}")
            if cfg.dead_tokens >= cfg.tokens:
                auxk = ", and AuxK never runs" if cfg.architecture != "jumprelu" else ""
                self.write(
                    f"note: --dead-tokens {cfg.dead_tokens:,} is not below --tokens {cfg.tokens:,}: no latent can "
                    f"count as dead in this run{auxk}"
                )
            bar = self._bar()
            history: list[dict[str, float]] = []
            window: list[dict[str, float]] = []
            t0, rows = time.perf_counter(), 0
            # One line per summary (every 10 steps): the training curve, kept across a resume up to its step.
            metrics = MetricsLog(self.out / METRICS_NAME, keep_up_to=self.step)
            with StopFlag() as stop:  # SIGINT / SIGTERM: finish the step (a buffer fill: stop it), save, stop
                self.buffer.stop = stop
                while self.step < cfg.max_steps and stop.signum is None:
                    try:
                        window.append(self.train_step())
                    except _Interrupted:  # in the fill, before the step changed anything
                        break
                    rows += cfg.batch_rows
                    if self.step % cfg.save_every == 0:
                        self.save()
                    # On a grid of 10 steps, so a resumed run's lines fall where the straight run's do.
                    if self.step % 10 == 0 or self.step == cfg.max_steps:
                        seconds = time.perf_counter() - t0
                        history.append(self._summary(window, rows / max(seconds, 1e-9)))
                        window = []
                        tokens = self.step * cfg.batch_rows
                        metrics.append(
                            {
                                "step": self.step,
                                "tokens": tokens,
                                "seconds": seconds,
                                **history[-1],
                                "rows_left_out": self.buffer.left_out,  # by the outlier ratio, this buffer
                            }
                        )
                        if bar is not None:
                            bar.set_postfix(self._postfix(history[-1]), refresh=False)
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.close()
            if stop.signum is not None:
                self.stopped = stop.signum
                if self.step == 0:
                    self.write("stopped before the first step: nothing to save")
                else:
                    self.save()
                    sae_dir = self._save_sae()  # usable as it stands: a run stopped early is still an SAE
                    self.write(
                        f"stopped at step {self.step}: checkpoint saved, the SAE so far in {sae_dir}; "
                        "the same command resumes"
                    )
                raise KeyboardInterrupt
            last = history[-1] if history else None
            self.save()
            sae_dir = self._save_sae()
            final = last or self._measure_last()
            self.write(
                f"final: explained variance {final['explained_variance']:.4f}, L0 {final['l0']:.1f}, "
                f"dead latents {round(final['dead_fraction'] * self.sae.cfg.d_sae)}/{self.sae.cfg.d_sae} "
                f"({final['dead_fraction']:.1%}) after {self.step} steps; SAE in {sae_dir}"
            )
            return SAETrainResult(
                self.sae, self.step, final["explained_variance"], final["l0"], final["dead_fraction"], self.out, history
            )
        finally:
            if metrics is not None:
                metrics.close()
            self.buffer.stop = None
            self.lock.release()

    def _save_sae(self) -> Path:
        """The SAE as it stands, in ``DIR/sae`` (SAELens's format; a TopK transcoder, which SAELens has no
        class for, in sparsify's); the module is left in eval mode."""
        self.sae.eval()
        topk_transcoder = self.sae.cfg.transcoder and self.cfg.architecture == "topk"
        return self.sae.save(self.out / "sae", format="sparsify" if topk_transcoder else "saelens")

    @staticmethod
    def _summary(window: list[dict[str, float]], tokens_per_s: float) -> dict[str, float]:
        """The mean of the last steps' figures (a single batch's are noisy)."""
        out = {k: sum(w[k] for w in window) / len(window) for k in window[0]}
        out["tokens_per_s"] = tokens_per_s
        return out

    @staticmethod
    def _postfix(m: dict[str, float]) -> dict[str, str]:
        return {
            "tok/s": f"{m['tokens_per_s']:.0f}",
            "loss": f"{m['loss']:.4f}",
            "EV": f"{m['explained_variance']:.3f}",
            "L0": f"{m['l0']:.1f}",
            "dead": f"{m['dead_fraction']:.1%}",
        }

    @torch.no_grad()
    def _measure_last(self) -> dict[str, float]:
        """The figures of the last batch, measured without a step (a run resumed when already done)."""
        x, y = self.buffer.batch(max(self.step - 1, 0))
        was = self.sae.training
        self.sae.train()
        z = self.sae.encode(x)
        out = self.sae.decode(z, x)
        self.sae.train(was)
        fvu = float((y - out).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
        dead = float((self.since_fired >= self.cfg.dead_tokens).float().mean())
        return {"explained_variance": 1 - fvu, "l0": float((z != 0).sum(-1).float().mean()), "dead_fraction": dead}

    def _bar(self) -> Any:
        if not self.progress or self.step >= self.cfg.max_steps:
            return None
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return None
        return tqdm(total=self.cfg.max_steps, initial=self.step, desc="sae", unit="step", dynamic_ncols=True)


def train_sae(
    model: nn.Module,
    ids: np.ndarray,
    out: str | Path,
    *,
    progress: bool = False,
    write: Callable[[str], None] = print,
    model_name: str | None = None,
    **settings: Any,
) -> SAETrainResult:
    """Train (or resume) an SAE on ``model``'s activations over the token ``ids`` (1-D) into ``out``;
    ``settings`` are :class:`SAETrainConfig`'s fields (``tokens``: how many activations to train on)."""
    cfg = SAETrainConfig(**settings)
    return SAETrainer(model, ids, cfg, out, progress=progress, write=write, model_name=model_name).fit()
