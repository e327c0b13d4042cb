"""Sparse autoencoders and transcoders: load, save, run, splice into a model and measure.

A sparse autoencoder (SAE) rewrites an activation ``x (..., d_in)`` of a hook point as a sparse
combination of ``d_sae`` learned directions (its latents)::

    pre = (x - b_dec) @ W_enc + b_enc          # (..., d_sae)   b_dec subtracted only if apply_b_dec_to_input
    z   = act(pre)                             # (..., d_sae)   mostly zeros: the latent activations
    x^  = z @ W_dec + b_dec                    # (..., d_out)   the reconstruction

A transcoder is the same map from one hook point to another (an MLP's input to its output), so
``d_out`` may differ from ``d_in``, ``b_dec`` is never subtracted from the input, and a skip
connection ``x @ W_skip.T`` (``W_skip (d_out, d_in)``) may be added to the output.

The activations ``act``, one function each below:

* ``standard``: ReLU;
* ``topk``: keep the k largest pre-activations of each row (then ReLU);
* ``batchtopk``: keep the ``k * rows`` largest of the whole batch while training; at inference a
  JumpReLU with the threshold learned while training (as SAELens saves it);
* ``jumprelu``: ``pre`` where ``pre > threshold`` (per latent), else 0;
* ``gated``: a gate ``x @ W_enc + b_gate > 0`` times ``relu(x @ (W_enc * exp(r_mag)) + b_mag)``.

Files: SAELens's directory (``cfg.json`` + ``sae_weights.safetensors``), EleutherAI sparsify's
(``cfg.json`` + ``sae.safetensors``), Gemma Scope's ``params.npz`` (read only) and a Hugging Face
Hub repository holding one of them. The parameter names and shapes are SAELens's, so a SAELens file
maps one to one; sparsify's ``encoder.weight (d_sae, d_in)`` is ``W_enc.T``.

:func:`splice` runs the model with the SAE's reconstruction in place of the activation (the
error term ``x - x^`` kept, so the model's output is unchanged unless a latent is edited), and
:func:`evaluate_sae` gives SAELens's measures: L0, explained variance about the mean, dead latents,
the cross-entropy loss recovered and the KL divergence with the reconstruction spliced in.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import zipfile
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from attnlab.checks import check_device, check_float_dtype
from attnlab.files import (
    atomic_write_bytes,
    atomic_write_json,
    first_line,
    import_safetensors,
    open_regular,
    read_json,
)
from attnlab.hardware import as_float64
from attnlab.interpret.hooks import HookPoint, added_points, eval_mode, hook_names, hooks

__all__ = [
    "ARCHITECTURES",
    "SAE",
    "SAEConfig",
    "SAEEvaluation",
    "batchtopk",
    "evaluate_sae",
    "jumprelu",
    "sae_point",
    "splice",
    "steer",
    "topk",
]

ARCHITECTURES = ("standard", "topk", "batchtopk", "jumprelu", "gated")
NORMALIZATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")
SAELENS_CFG, SAELENS_WEIGHTS = "cfg.json", "sae_weights.safetensors"
SPARSIFY_WEIGHTS = "sae.safetensors"
GEMMA_SCOPE_PARAMS = "params.npz"
# SAELens reads a cfg.json without this version as a pre-6.0 file and rewrites its keys; ours are 6.x keys.
SAELENS_FORMAT_VERSION = "6.0.0"
# SAELens's architecture names of transcoders -> (activation, skip connection).
_SAELENS_TRANSCODERS = {
    "transcoder": ("standard", False),
    "skip_transcoder": ("standard", True),
    "jumprelu_transcoder": ("jumprelu", False),
    "jumprelu_skip_transcoder": ("jumprelu", True),
}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_RESIDUAL_STEPS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")


# ---------------------------------------------------------------------------------------------
# The activation functions
# ---------------------------------------------------------------------------------------------
def topk(pre: Tensor, k: int) -> Tensor:
    """Keep the ``k`` largest entries of each row of ``pre (..., d_sae)``, ReLU'd; zeros elsewhere."""
    values, indices = pre.topk(k, dim=-1, sorted=False)  # (..., k)
    return torch.zeros_like(pre).scatter(-1, indices, values.relu())


def batchtopk(pre: Tensor, k: int) -> Tensor:
    """Keep the ``k * rows`` largest ReLU'd entries of the whole batch ``pre (..., d_sae)``: on
    average ``k`` per row, more on rows that need more (BatchTopK, Bussmann et al. 2024)."""
    acts = pre.relu()
    flat = acts.reshape(-1)  # (rows * d_sae,)
    rows = flat.numel() // pre.shape[-1]
    values, indices = flat.topk(min(k * rows, flat.numel()), sorted=False)
    return torch.zeros_like(flat).scatter(0, indices, values).view_as(pre)


def jumprelu(pre: Tensor, threshold: Tensor) -> Tensor:
    """``pre`` where it exceeds its latent's ``threshold (d_sae,)``, else 0 (JumpReLU, Rajamanoharan
    et al. 2024). The ReLU is SAELens's: a negative threshold still never lets a negative value through."""
    return pre.relu() * (pre > threshold).to(pre.dtype)


# ---------------------------------------------------------------------------------------------
# The configuration
# ---------------------------------------------------------------------------------------------
@dataclass
class SAEConfig:
    """What an SAE is: its widths, activation and where it reads and writes.

    Attributes:
        d_in: the width of the input activation.
        d_sae: the number of latents.
        architecture: one of :data:`ARCHITECTURES`.
        k: latents kept per row (``topk``, ``batchtopk``).
        d_out: a transcoder's output width (set for every transcoder); None for an autoencoder.
        hook_name: the hook point read (TransformerLens's name, as :func:`attnlab.interpret.hook_names`).
        hook_name_out: a transcoder's output hook point (None for an autoencoder).
        skip: a transcoder's linear skip connection ``W_skip (d_out, d_in)``.
        apply_b_dec_to_input: subtract ``b_dec`` from the input before encoding (SAELens's and
            sparsify's autoencoders do; transcoders and Gemma Scope do not).
        normalize_activations: SAELens's run-time normalization of the input: ``none``,
            ``expected_average_only_in`` (a constant folded into the weights: nothing at run time),
            ``constant_norm_rescale`` or ``layer_norm``.
        rescale_acts_by_decoder_norm: SAELens's TopK option: latents ranked and decoded as if the
            decoder rows had unit norm (the pre-activations times the rows' norms, the latents divided
            by them before decoding). Other architectures take it too; SAELens has it only for TopK,
            so :meth:`SAE.save` folds the norms into the weights for them, as SAELens saves a BatchTopK SAE.
        model_name: the model the SAE was trained on (informational).
    """

    d_in: int
    d_sae: int
    architecture: str = "topk"
    k: int | None = None
    d_out: int | None = None
    hook_name: str | None = None
    hook_name_out: str | None = None
    skip: bool = False
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    rescale_acts_by_decoder_norm: bool = False
    model_name: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("d_in", "d_sae"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"SAE config: {name} must be a positive int, got {v!r}")
        if self.d_out is not None and (not _is_int(self.d_out) or self.d_out < 1):
            raise ValueError(f"SAE config: d_out must be a positive int or None, got {self.d_out!r}")
        for name in ("skip", "apply_b_dec_to_input", "rescale_acts_by_decoder_norm"):
            if not isinstance(v := getattr(self, name), bool):  # ("no" is truthy: the option on, silently)
                raise ValueError(f"SAE config: {name} must be True or False, got {v!r}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"SAE config: unknown architecture {self.architecture!r}; attnlab runs {', '.join(ARCHITECTURES)}"
            )
        if self.architecture in ("topk", "batchtopk") and (not _is_int(self.k) or not 1 <= self.k <= self.d_sae):
            raise ValueError(
                f"SAE config: a {self.architecture} SAE needs k, an int in 1..d_sae={self.d_sae}, got {self.k!r}"
            )
        if self.normalize_activations not in NORMALIZATIONS:
            raise ValueError(
                f"SAE config: normalize_activations must be one of {', '.join(NORMALIZATIONS)}, "
                f"got {self.normalize_activations!r}"
            )
        if self.transcoder and self.apply_b_dec_to_input:
            raise ValueError("SAE config: a transcoder cannot subtract b_dec (of width d_out) from its input")
        if self.skip and not self.transcoder:
            raise ValueError("SAE config: a skip connection belongs to a transcoder (give hook_name_out or d_out)")
        for name in ("hook_name", "hook_name_out", "model_name"):
            if not isinstance(v := getattr(self, name), (str, type(None))):
                raise ValueError(f"SAE config: {name} must be a string or None, got {v!r}")

    @property
    def transcoder(self) -> bool:
        """Whether it maps one hook point to another (an output hook or an output width of its own)."""
        return self.hook_name_out is not None or self.d_out is not None

    @property
    def width_out(self) -> int:
        return self.d_in if self.d_out is None else self.d_out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------
class SAE(nn.Module):
    """A sparse autoencoder or transcoder (see the module docstring for the formulas).

    Parameters (SAELens's names): ``W_enc (d_in, d_sae)``, ``b_enc (d_sae,)``, ``W_dec (d_sae,
    d_out)``, ``b_dec (d_out,)``; ``threshold (d_sae,)`` for ``jumprelu`` (a buffer learned from the
    batches for ``batchtopk``); ``b_gate``, ``r_mag``, ``b_mag (d_sae,)`` in place of ``b_enc`` for
    ``gated``; ``W_skip (d_out, d_in)`` for a transcoder with a skip connection.

    ``sae(x)`` is the reconstruction ``(..., d_out)``; :meth:`encode` gives the latents ``(...,
    d_sae)``, :meth:`decode` maps them back. Dtype and device are the parameters' (``sae.to(...)``);
    inputs are cast to the SAE's dtype and the output comes back in the input's.
    """

    def __init__(self, cfg: SAEConfig, *, dtype: torch.dtype | None = None, device: Any = None) -> None:
        super().__init__()
        if not isinstance(cfg, SAEConfig):
            raise TypeError(f"SAE(cfg): cfg must be an SAEConfig, got {type(cfg).__name__}")
        check_float_dtype("SAE(dtype)", dtype)
        self.cfg = cfg
        d_in, d_sae, d_out = cfg.d_in, cfg.d_sae, cfg.width_out
        kw = {"dtype": dtype or torch.float32, "device": check_device("SAE(device)", device)}
        # Encoder rows start as the decoder's (the transpose), decoder rows with unit norm: the
        # usual start of a TopK SAE (Gao et al. 2024), so the first reconstruction is not noise.
        w_dec = torch.randn(d_sae, d_out, **kw)
        w_dec = w_dec / w_dec.norm(dim=-1, keepdim=True)
        w_enc = w_dec.T.clone() if d_out == d_in else torch.randn(d_in, d_sae, **kw) / math.sqrt(d_in)
        self.W_enc = nn.Parameter(w_enc)  # (d_in, d_sae)
        self.W_dec = nn.Parameter(w_dec)  # (d_sae, d_out)
        self.b_dec = nn.Parameter(torch.zeros(d_out, **kw))  # (d_out,)
        if cfg.architecture == "gated":
            self.b_gate = nn.Parameter(torch.zeros(d_sae, **kw))
            self.r_mag = nn.Parameter(torch.zeros(d_sae, **kw))
            self.b_mag = nn.Parameter(torch.zeros(d_sae, **kw))
        else:
            self.b_enc = nn.Parameter(torch.zeros(d_sae, **kw))  # (d_sae,)
        if cfg.architecture == "jumprelu":
            self.threshold = nn.Parameter(torch.zeros(d_sae, **kw))
        elif cfg.architecture == "batchtopk":
            # Learned from the batches (a running mean of the smallest kept activation), not by gradient.
            self.register_buffer("threshold", torch.zeros(d_sae, **kw))
        if cfg.skip:
            self.W_skip = nn.Parameter(torch.zeros(d_out, d_in, **kw))  # (d_out, d_in)

    # -- running ------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    def _normalize_in(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """SAELens's run-time normalization of the input, and what undoes it on the output."""
        how = self.cfg.normalize_activations
        if how == "constant_norm_rescale":
            norm = x.norm(dim=-1, keepdim=True)  # (..., 1)
            zero = norm == 0  # (a zero row reconstructs as zero, not as 0 * inf = NaN)
            coeff = math.sqrt(self.cfg.d_in) / norm.masked_fill(zero, 1)
            return x * coeff, ((1 / coeff).masked_fill(zero, 0), torch.zeros_like(coeff))
        if how == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)  # (..., 1)
            x = x - mu
            std = x.std(dim=-1, keepdim=True)
            return x / (std + 1e-5), (std, mu)
        return x, None

    def pre_activations(self, x: Tensor) -> Tensor:
        """The encoder's output before the activation: ``x (..., d_in)`` -> ``(..., d_sae)``."""
        x = self._check_input(x).to(self.dtype)
        x, _ = self._normalize_in(x)
        if self.cfg.apply_b_dec_to_input:
            x = x - self.b_dec
        if self.cfg.architecture == "gated":
            # The magnitude path: rescaling it is the whole rescaling (a positive scale keeps the gate's sign).
            pre = x @ (self.W_enc * self.r_mag.exp()) + self.b_mag
        else:
            pre = x @ self.W_enc + self.b_enc  # (..., d_sae)
        if self.cfg.rescale_acts_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        return pre

    def activation(self, pre: Tensor, x: Tensor | None = None) -> Tensor:
        """The latents from the pre-activations (``x``: the input, which only ``gated`` needs)."""
        arch = self.cfg.architecture
        if arch == "standard":
            return pre.relu()
        if arch == "topk":
            return topk(pre, self.cfg.k)
        if arch == "batchtopk":
            return batchtopk(pre, self.cfg.k) if self.training else jumprelu(pre, self.threshold)
        if arch == "jumprelu":
            return jumprelu(pre, self.threshold)
        # gated: the gate shares W_enc with the magnitude path but has a bias of its own
        assert x is not None, "a gated SAE's activation needs the input"
        xin, _ = self._normalize_in(self._check_input(x).to(self.dtype))
        if self.cfg.apply_b_dec_to_input:
            xin = xin - self.b_dec
        gate = (xin @ self.W_enc + self.b_gate > 0).to(pre.dtype)  # (..., d_sae)
        return gate * pre.relu()

    def encode(self, x: Tensor) -> Tensor:
        """The latent activations ``(..., d_sae)`` of ``x (..., d_in)`` (mostly zeros)."""
        return self.activation(self.pre_activations(x), x)

    def decode(self, z: Tensor, x: Tensor | None = None) -> Tensor:
        """The reconstruction ``(..., d_out)`` from latents ``z (..., d_sae)``.

        ``x`` (the input the latents came from) is needed to undo a run-time normalization and to
        add a transcoder's skip connection; without it neither is applied.
        """
        if not isinstance(z, Tensor) or z.shape[-1:] != (self.cfg.d_sae,):
            got = tuple(z.shape) if isinstance(z, Tensor) else type(z).__name__
            raise ValueError(f"SAE.decode: z must be a tensor (..., d_sae={self.cfg.d_sae}), got {got}")
        if x is not None and (not isinstance(x, Tensor) or x.shape != (*z.shape[:-1], self.cfg.d_in)):
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"SAE.decode: x must be the input the latents came from, {(*z.shape[:-1], self.cfg.d_in)}, got {got}"
            )
        z = z.to(self.dtype)
        if self.cfg.rescale_acts_by_decoder_norm:
            z = z / self.W_dec.norm(dim=-1)
        out = z @ self.W_dec + self.b_dec  # (..., d_out)
        if x is not None:
            xin = x.to(self.dtype)
            # SAELens's transcoders do not undo the input's normalization (the output is another hook's).
            if not self.cfg.transcoder:
                _, undo = self._normalize_in(xin)
                if undo is not None:
                    out = out * undo[0] + undo[1]
            if self.cfg.skip:
                out = out + xin @ self.W_skip.T  # (..., d_out)
        return out

    def latent_writes(self, z: Tensor, latents: Sequence[int], x: Tensor | None = None) -> Tensor:
        """Each of ``latents``' own term of :meth:`decode`'s output, ``(..., n, d_out)`` from ``z (...,
        d_sae)``: ``z_j W_dec[j]`` (unit-norm rows under ``rescale_acts_by_decoder_norm``; times the
        scale a run-time normalization of ``x`` undoes). ``decode(z, x)`` is their sum over all latents
        plus what no latent writes (the bias, the normalization's shift, a skip connection)."""
        chosen = list(latents)
        if not all(_is_int(j) and 0 <= j < self.cfg.d_sae for j in chosen):
            raise ValueError(f"latents must be latent indices in [0, {self.cfg.d_sae}), got {chosen[:8]!r}")
        if not isinstance(z, Tensor) or z.shape[-1] != self.cfg.d_sae:
            got = f"shape {tuple(z.shape)}" if isinstance(z, Tensor) else type(z).__name__
            raise ValueError(f"z must be latents (..., d_sae={self.cfg.d_sae}), got {got}")
        idx = torch.as_tensor(chosen, dtype=torch.long, device=self.W_dec.device)
        w = self.W_dec[idx]  # (n, d_out)
        if self.cfg.rescale_acts_by_decoder_norm:
            w = w / w.norm(dim=-1, keepdim=True)
        out = z.to(self.dtype)[..., idx, None] * w  # (..., n, d_out)
        if x is not None and not self.cfg.transcoder:
            _, undo = self._normalize_in(x.to(self.dtype))
            if undo is not None:
                out = out * undo[0][..., None]  # (..., 1, 1)
        return out

    def forward(self, x: Tensor) -> Tensor:
        """The reconstruction ``(..., d_out)`` of ``x (..., d_in)``, in ``x``'s dtype."""
        return self.decode(self.encode(x), x).to(x.dtype)

    def encode_decode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(latents (..., d_sae), reconstruction (..., d_out))`` in one pass."""
        z = self.encode(x)
        return z, self.decode(z, x).to(x.dtype)

    def _check_input(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) or x.dim() < 1 or x.shape[-1] != self.cfg.d_in:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"SAE: the input must be a tensor (..., d_in={self.cfg.d_in}), got {got}")
        if not x.is_floating_point():
            raise TypeError(f"SAE: the input must be floating point, got {x.dtype}")
        return x

    # -- training helpers -----------------------------------------------------------------------
    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Give every decoder row unit norm (TopK SAEs are trained with it; see Gao et al. 2024)."""
        self.W_dec.div_(self.W_dec.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(self.dtype).eps))

    @torch.no_grad()
    def remove_parallel_gradient(self) -> None:
        """Remove from ``W_dec``'s gradient its component along each row (a unit-norm row can then
        only turn), as sparsify and SAELens do before each step."""
        if self.W_dec.grad is not None:
            parallel = (self.W_dec.grad * self.W_dec).sum(dim=-1, keepdim=True)  # (d_sae, 1)
            self.W_dec.grad.sub_(parallel * self.W_dec)

    # -- checks ---------------------------------------------------------------------------------
    def check_model(self, model: nn.Module) -> None:
        """ValueError unless the SAE's hook point(s) exist on ``model`` with the SAE's widths."""
        if self.cfg.transcoder and self.cfg.hook_name_out is None:
            raise ValueError(
                "the transcoder names no output hook point (cfg.hook_name_out): give it "
                "(SAE.load(..., hook_name_out=...), --hook-out)"
            )
        known = hook_names(model)
        for name, width, what in (
            (self.cfg.hook_name, self.cfg.d_in, "d_in"),
            (self.cfg.hook_name_out, self.cfg.width_out, "d_out"),
        ):
            if name is None:
                if what == "d_in":
                    raise ValueError("the SAE names no hook point (cfg.hook_name); give hook_name=")
                continue
            if name not in known:
                raise ValueError(f"the SAE's hook {name!r} is not a hook point of this model (see hook_names(model))")
            model_width = hook_width(model, name)
            if model_width != width:
                raise ValueError(f"the SAE's {what}={width} does not match the model's width {model_width} at {name}")
        hook_in, hook_out = self.cfg.hook_name, self.cfg.hook_name_out
        if hook_out is not None and known.index(hook_out) < known.index(hook_in):
            raise ValueError(
                f"the transcoder's output hook {hook_out!r} comes before its input hook {hook_in!r} in the "
                "model's forward pass: it cannot write what it has not read yet"
            )

    # -- files ----------------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        subfolder: str | None = None,
        hook_name: str | None = None,
        hook_name_out: str | None = None,
        dtype: torch.dtype | None = None,
        device: Any = None,
        revision: str | None = None,
    ) -> SAE:
        """Read an SAE from SAELens's, sparsify's or Gemma Scope's files, or from the Hub.

        Args:
            path: a directory holding ``cfg.json`` + ``sae_weights.safetensors`` (SAELens),
                ``cfg.json`` + ``sae.safetensors`` (sparsify) or ``params.npz`` (Gemma Scope), the
                ``params.npz`` file itself, or a Hugging Face Hub repository id ``owner/name``.
            subfolder: the folder inside ``path`` (or the Hub repository) that holds the SAE (a
                sparsify hookpoint such as ``layers.6``, a Gemma Scope ``layer_20/width_16k/...``).
            hook_name: the hook point, where the files do not name it (sparsify, Gemma Scope) or
                to override it.
            hook_name_out: a transcoder's output hook point, likewise (an autoencoder refuses it).
            dtype, device: cast and move the weights (default: as stored, on the CPU).

        Raises ValueError naming the file for an unknown architecture, shapes that disagree with
        the configuration, or weights that are not finite; FileNotFoundError when nothing is there.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"SAE.load: path must be a str or os.PathLike, got {type(path).__name__}")
        p = Path(path).expanduser()
        if not p.exists() and isinstance(path, str) and _HUB_ID.fullmatch(path):
            try:
                p = _download(path, subfolder, revision)
            except ImportError:
                raise
            except Exception as exc:  # the Hub's errors are many (offline, no such repository, no access)
                raise FileNotFoundError(
                    f"SAE not found: there is no local directory {path}, and as a Hub id: {first_line(exc)}"
                ) from None
        elif subfolder is not None:
            p = p / subfolder
        sae = _load_local(p, hook_name, hook_name_out)
        if dtype is not None or device is not None:
            sae = sae.to(dtype=dtype or sae.dtype, device=device)
        return sae.eval()

    def save(self, directory: str | os.PathLike[str], *, format: str = "saelens") -> Path:
        """Write the SAE into ``directory`` (created if needed), each file atomically.

        ``format="saelens"``: ``cfg.json`` + ``sae_weights.safetensors``, which SAELens's
        ``SAE.load_from_disk`` reads (a ``batchtopk`` SAE is saved as the JumpReLU it runs as at
        inference, as SAELens does; ``rescale_acts_by_decoder_norm`` is folded into the weights but
        for TopK). ``format="sparsify"``: ``cfg.json`` + ``sae.safetensors`` (TopK only, as sparsify
        has no other). The other format's weights file, if the directory holds one, is removed.
        Returns the directory.
        """
        if format not in ("saelens", "sparsify"):
            raise ValueError(f"SAE.save: format must be 'saelens' or 'sparsify', got {format!r}")
        d = Path(directory).expanduser()
        if d.exists() and not d.is_dir():
            raise ValueError(f"SAE.save: {d} exists and is not a directory")
        d.mkdir(parents=True, exist_ok=True)
        cfg, tensors, weights_name = (_to_saelens if format == "saelens" else _to_sparsify)(self)
        st = import_safetensors()
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        atomic_write_bytes(d / weights_name, st.torch.save(tensors))
        atomic_write_json(d / SAELENS_CFG, cfg)
        # The other format's weights, from an earlier save, would be stale beside this cfg.json (the
        # loader goes by cfg.json meanwhile).
        (d / (SPARSIFY_WEIGHTS if weights_name == SAELENS_WEIGHTS else SAELENS_WEIGHTS)).unlink(missing_ok=True)
        return d

    def extra_repr(self) -> str:
        c = self.cfg
        kind = "transcoder" if c.transcoder else "autoencoder"
        k = f", k={c.k}" if c.k is not None else ""
        return f"{c.architecture} {kind}: d_in={c.d_in}, d_sae={c.d_sae}, d_out={c.width_out}{k}, hook={c.hook_name}"


def hook_width(model: nn.Module, name: str) -> int:
    """The last dimension of the activation at hook ``name``: the residual width for every
    ``(B, T, d)`` hook point, the MLP's hidden width for its ``(B, T, dm)`` ones (``mlp.hook_post``).
    Per-head hook points (``attn.hook_q`` ...) are refused: an SAE there would need SAELens's
    reshaping of heads, which attnlab does not do."""
    cfg = getattr(model, "config", None)
    step = name.rsplit("hook_", 1)[-1]
    if cfg is not None and ".mlp." in name:
        return int(cfg.hidden_dim)
    if step in (*_RESIDUAL_STEPS, "embed", "normalized") and ".attn." not in name and cfg is not None:
        return int(cfg.emb_dim)
    raise ValueError(
        f"SAEs attach to hook points of (B, T, d) or the MLP's (B, T, dm) activations, not per-head ones: {name!r}"
    )


# ---------------------------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------------------------
def _download(repo_id: str, subfolder: str | None, revision: str | None) -> Path:
    """Fetch the SAE's files from the Hugging Face Hub (only its folder) into the local cache."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ImportError("loading an SAE from the Hub needs huggingface_hub: pip install huggingface_hub") from None
    patterns = [f"{subfolder.strip('/')}/*"] if subfolder else None
    root = Path(snapshot_download(repo_id, allow_patterns=patterns, revision=revision))
    return root / subfolder if subfolder else root


def _load_local(p: Path, hook_name: str | None, hook_name_out: str | None = None) -> SAE:
    if not p.exists():
        raise FileNotFoundError(f"SAE not found: {p} (a directory with cfg.json, a params.npz, or a Hub id owner/name)")
    if p.is_file():
        if p.name.endswith(".npz"):
            return _load_gemma_scope(p, hook_name, hook_name_out)
        raise ValueError(f"SAE file {p}: expected a directory (cfg.json + weights) or a Gemma Scope params.npz")
    if (p / GEMMA_SCOPE_PARAMS).exists() and not (p / SAELENS_CFG).exists():
        return _load_gemma_scope(p / GEMMA_SCOPE_PARAMS, hook_name, hook_name_out)
    if not (p / SAELENS_CFG).exists():
        raise FileNotFoundError(
            f"no SAE in {p}: expected {SAELENS_CFG} with {SAELENS_WEIGHTS} (SAELens) or {SPARSIFY_WEIGHTS} "
            f"(sparsify), or {GEMMA_SCOPE_PARAMS} (Gemma Scope)"
        )
    raw = read_json(p / SAELENS_CFG, "SAE config")
    if not isinstance(raw, dict):
        raise ValueError(f"SAE config {p / SAELENS_CFG} must be a JSON object, got {type(raw).__name__}")
    # With both formats' weights present, cfg.json says which it belongs to: SAELens's names d_sae,
    # sparsify's num_latents.
    saelens = (p / SAELENS_WEIGHTS).exists() and ("d_sae" in raw or not (p / SPARSIFY_WEIGHTS).exists())
    if saelens:
        cfg, names = _cfg_from_saelens(raw, p / SAELENS_CFG)
        tensors = _saelens_tensors(_read_safetensors(p / SAELENS_WEIGHTS), cfg, p / SAELENS_WEIGHTS)
        dtype = _saelens_dtype(raw.get("dtype"), p / SAELENS_CFG)
    elif (p / SPARSIFY_WEIGHTS).exists():
        cfg, names = _cfg_from_sparsify(raw, p / SAELENS_CFG, p.name)
        tensors = _read_safetensors(p / SPARSIFY_WEIGHTS)
        tensors = {names.get(k, k): v for k, v in tensors.items()}
        if "W_enc" in tensors:
            tensors["W_enc"] = tensors["W_enc"].T.contiguous()  # sparsify stores encoder.weight (d_sae, d_in)
        names, dtype = {}, None
    else:
        raise FileNotFoundError(
            f"SAE config {p / SAELENS_CFG} has no weights beside it ({SAELENS_WEIGHTS} or {SPARSIFY_WEIGHTS})"
        )
    tensors = {names.get(k, k): v for k, v in tensors.items()}
    return _build(_with_hooks(cfg, hook_name, hook_name_out, files_say=True), tensors, p, dtype)


_SAELENS_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _saelens_dtype(value: Any, where: Path) -> torch.dtype | None:
    """cfg.json's ``dtype``, which SAELens casts the weights to on load (a file saved after ``.half()``
    says float32 over float16 tensors); None where it names none."""
    if value is None:
        return None
    name = value.removeprefix("torch.") if isinstance(value, str) else None
    if name not in _SAELENS_DTYPES:
        raise ValueError(f"{where}: dtype must be one of {', '.join(_SAELENS_DTYPES)}, got {value!r}")
    return _SAELENS_DTYPES[name]


def _with_hooks(cfg: SAEConfig, hook_name: str | None, hook_name_out: str | None, files_say: bool = False) -> SAEConfig:
    """``cfg`` with the hook points :meth:`SAE.load` was given in place of the files' own; ``files_say``:
    the files tell a transcoder from an autoencoder (SAELens's and sparsify's configs; a Gemma Scope
    ``.npz`` of equal widths does not)."""
    for name, value in (("hook_name", hook_name), ("hook_name_out", hook_name_out)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"SAE.load: {name} must be a string, got {type(value).__name__}")
    if hook_name_out is not None and (cfg.apply_b_dec_to_input or (files_say and not cfg.transcoder)):
        raise ValueError(
            f"SAE.load: hook_name_out={hook_name_out!r} is a transcoder's output hook, but this SAE is an "
            "autoencoder (its config names no output width, or it subtracts b_dec from its input)"
        )
    return replace(cfg, hook_name=hook_name or cfg.hook_name, hook_name_out=hook_name_out or cfg.hook_name_out)


def _saelens_tensors(tensors: dict[str, Tensor], cfg: SAEConfig, where: Path) -> dict[str, Tensor]:
    """Older SAELens files' tensors as SAELens's loaders convert them: a ``scaling_factor`` of ones
    dropped, a JumpReLU's ``log_threshold`` made its ``threshold``."""
    scaling = tensors.pop("scaling_factor", None)
    if scaling is not None and not (scaling.is_floating_point() and torch.allclose(scaling, torch.ones_like(scaling))):
        raise ValueError(
            f"SAE weights in {where}: a scaling_factor that is not all ones (SAELens's fine-tuning scaling "
            "factor, which SAELens 6 no longer reads) is not supported"
        )
    if cfg.architecture == "jumprelu" and "log_threshold" in tensors:
        tensors["threshold"] = tensors.pop("log_threshold").exp()
    return tensors


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    st = import_safetensors()
    with open_regular(path, "SAE weights") as f:
        data = f.read()
    try:
        return dict(st.torch.load(data))
    except Exception as exc:  # safetensors raises its own error type for a damaged header
        raise ValueError(f"SAE weights {path} are not a readable safetensors file ({exc})") from None


NPZ_MAX_ARRAY_BYTES = 16 << 30  # one array of a Gemma Scope .npz (its largest SAEs' W_enc are a few GB)


def _load_gemma_scope(path: Path, hook_name: str | None, hook_name_out: str | None = None) -> SAE:
    """Gemma Scope's ``params.npz``: ``W_enc (d_in, d_sae)``, ``W_dec (d_sae, d_in)``, ``b_enc``,
    ``b_dec``, ``threshold``; a JumpReLU SAE that does not subtract ``b_dec`` from its input."""
    import numpy as np

    with open_regular(path, "SAE params") as f:
        try:
            data = io.BytesIO(f.read())
            # Each array's size as the archive says it, before numpy allocates what a header declares.
            with zipfile.ZipFile(data) as z:
                big = [i.filename for i in z.infolist() if i.file_size > NPZ_MAX_ARRAY_BYTES]
            if big:
                raise ValueError(f"{big[0]} is larger than {NPZ_MAX_ARRAY_BYTES >> 30} GiB")
            with np.load(data, allow_pickle=False) as npz:
                tensors = {k: torch.from_numpy(np.ascontiguousarray(npz[k])) for k in npz.files}
        except (ValueError, OSError, EOFError, MemoryError, zipfile.BadZipFile, zlib.error) as exc:
            raise ValueError(f"SAE params {path} is not a readable .npz file ({first_line(exc)})") from None
    for key in ("W_enc", "W_dec", "b_enc", "b_dec", "threshold"):
        if key not in tensors:
            raise ValueError(
                f"SAE params {path} has no {key!r} (a Gemma Scope file holds W_enc, W_dec, b_enc, b_dec, threshold)"
            )
    w_enc = tensors["W_enc"]
    if w_enc.dim() != 2:
        raise ValueError(f"SAE params {path}: W_enc must be (d_in, d_sae), got shape {tuple(w_enc.shape)}")
    d_in, d_sae = w_enc.shape
    d_out = tensors["W_dec"].shape[-1] if tensors["W_dec"].dim() == 2 else None
    transcoder = d_out is not None and d_out != d_in
    cfg = SAEConfig(
        d_in=int(d_in),
        d_sae=int(d_sae),
        architecture="jumprelu",
        d_out=int(d_out) if transcoder else None,
        apply_b_dec_to_input=False,
    )
    return _build(_with_hooks(cfg, hook_name, hook_name_out), tensors, path)


def _get(raw: dict[str, Any], key: str, default: Any = None) -> Any:
    """A key of a SAELens cfg: at the top level (files before 6.0) or in its ``metadata``."""
    if key in raw:
        return raw[key]
    meta = raw.get("metadata")
    return meta.get(key, default) if isinstance(meta, dict) else default


def _cfg_from_saelens(raw: dict[str, Any], where: Path) -> tuple[SAEConfig, dict[str, str]]:
    """SAELens's ``cfg.json`` (6.x, or the flat files before it) as an :class:`SAEConfig`, read as
    SAELens's loaders read it (``handle_pre_6_0_config`` for the old keys)."""
    for key, types, what in (
        ("architecture", str, "a string"),
        ("normalize_activations", (str, bool, type(None)), "a string"),
        ("apply_b_dec_to_input", bool, "true or false"),
        ("rescale_acts_by_decoder_norm", bool, "true or false"),
    ):
        if key in raw and not isinstance(raw[key], types):
            raise ValueError(f"SAE config {where}: {key} must be {what}, got {raw[key]!r}")
    arch = raw.get("architecture", "standard")
    if arch == "standard" and raw.get("activation_fn_str", raw.get("activation_fn")) == "topk":
        arch = "topk"  # files before 6.0: a TopK SAE said so in its activation function
    skip = False
    d_out = None
    if arch in _SAELENS_TRANSCODERS:
        arch, skip = _SAELENS_TRANSCODERS[arch]
        d_out = raw.get("d_out")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"SAE config {where}: unknown architecture {arch!r}; attnlab reads "
            f"{', '.join(ARCHITECTURES)} and SAELens's transcoders"
        )
    k = raw.get("k")
    if k is None and isinstance(raw.get("activation_fn_kwargs"), dict):
        k = raw["activation_fn_kwargs"].get("k")
    norm = raw.get("normalize_activations", "none")
    if not isinstance(norm, str):
        norm = "expected_average_only_in" if norm else "none"
    hook = _get(raw, "hook_name", _get(raw, "hook_point"))
    version = re.match(r"\d+", str(_get(raw, "sae_lens_version") or ""))
    # SAELens reshapes a pre-6.0 file's hook_z activations per head unless the file says otherwise.
    per_head = "hook_z" if not (version and int(version[0]) >= 6) and "hook_z" in str(hook) else "none"
    if raw.get("reshape_activations", per_head) not in ("none", None):
        raise ValueError(
            f"SAE config {where}: reshape_activations={raw.get('reshape_activations', per_head)!r} "
            "(per-head SAEs) is not supported"
        )
    # SAELens's TopK and BatchTopK SAEs have the option; its other classes ignore the key.
    rescale = arch in ("topk", "batchtopk") and raw.get("rescale_acts_by_decoder_norm", False)
    for key in ("hook_head_index", "hook_point_head_index"):  # (the second: files before 6.0)
        if _get(raw, key) is not None:
            raise ValueError(f"SAE config {where}: an SAE on one head ({key}) is not supported")
    try:
        cfg = SAEConfig(
            d_in=raw.get("d_in"),
            d_sae=raw.get("d_sae"),
            architecture=arch,
            k=k if arch in ("topk", "batchtopk") else None,
            d_out=d_out,
            hook_name=hook,
            hook_name_out=_get(raw, "hook_name_out"),
            skip=skip,
            apply_b_dec_to_input=raw.get("apply_b_dec_to_input", d_out is None),
            normalize_activations=norm,
            rescale_acts_by_decoder_norm=rescale,
            model_name=_get(raw, "model_name"),
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    # SAELens's BatchTopK training state keeps its threshold as one number.
    return cfg, {"topk_threshold": "threshold"}


def _cfg_from_sparsify(raw: dict[str, Any], where: Path, folder: str) -> tuple[SAEConfig, dict[str, str]]:
    """sparsify's ``cfg.json`` (its SparseCoderConfig plus ``d_in``) as an :class:`SAEConfig`."""
    if raw.get("activation", "topk") != "topk":
        raise ValueError(
            f"SAE config {where}: sparsify activation {raw.get('activation')!r} is not supported (topk only)"
        )
    d_in = raw.get("d_in")
    num = raw.get("num_latents") or 0
    if not num and _is_int(d_in) and _is_int(raw.get("expansion_factor", 32)):
        num = d_in * raw.get("expansion_factor", 32)
    flags = {k: raw.get(k, False) for k in ("transcode", "skip_connection")}
    for k, v in flags.items():
        if not isinstance(v, bool):  # (bool("false") is True: a string would invert the meaning)
            raise ValueError(f"SAE config {where}: {k} must be true or false, got {v!r}")
    transcode = flags["transcode"]
    hook = raw.get("hookpoint") or raw.get("hook_name")
    try:
        cfg = SAEConfig(
            d_in=d_in,
            d_sae=num,
            architecture="topk",
            k=raw.get("k", 32),
            hook_name=hook,
            hook_name_out=raw.get("hook_name_out"),
            d_out=d_in if transcode else None,
            skip=flags["skip_connection"],
            apply_b_dec_to_input=not transcode,
        )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return cfg, {"encoder.weight": "W_enc", "encoder.bias": "b_enc"}


def _build(cfg: SAEConfig, tensors: Mapping[str, Tensor], where: Path, dtype: torch.dtype | None = None) -> SAE:
    """An SAE from checked tensors: each present, of the configured shape, finite; in ``dtype``
    (default: the tensors' own where they share one, else float32)."""
    dtypes = {t.dtype for t in tensors.values()}
    if dtype is None:
        dtype = next(iter(dtypes)) if len(dtypes) == 1 and next(iter(dtypes)).is_floating_point else torch.float32
    sae = SAE(cfg, dtype=dtype, device="meta")
    expected = {n: tuple(t.shape) for n, t in [*sae.named_parameters(), *sae.named_buffers()]}
    state: dict[str, Tensor] = {}
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(
                f"SAE weights in {where} have no {name!r} (a {cfg.architecture} SAE needs {', '.join(expected)})"
            )
        t = tensors[name]
        if name == "threshold" and t.numel() == 1:
            t = t.reshape(()).expand(shape)  # one threshold for every latent (BatchTopK)
        if tuple(t.shape) != shape:
            raise ValueError(
                f"SAE weights in {where}: {name} has shape {tuple(t.shape)}, but the config (d_in={cfg.d_in}, "
                f"d_sae={cfg.d_sae}, d_out={cfg.width_out}) needs {shape}"
            )
        if not t.is_floating_point():
            raise ValueError(f"SAE weights in {where}: {name} must be floating point, got {t.dtype}")
        if not torch.isfinite(t).all():
            raise ValueError(f"SAE weights in {where}: {name} holds NaN or infinite values")
        state[name] = t.to(dtype).contiguous()
    unknown = sorted(set(tensors) - set(expected))
    if unknown:
        raise ValueError(
            f"SAE weights in {where} hold tensors a {cfg.architecture} SAE does not have: {', '.join(unknown)}"
        )
    sae.load_state_dict(state, assign=True)
    return sae


# ---------------------------------------------------------------------------------------------
# Writing files
# ---------------------------------------------------------------------------------------------
def _to_saelens(sae: SAE) -> tuple[dict[str, Any], dict[str, Tensor], str]:
    c = sae.cfg
    arch = c.architecture
    tensors = dict(sae.state_dict())
    if c.rescale_acts_by_decoder_norm and arch != "topk":
        # SAELens reads the option for TopK alone: for the others the norms go into the weights (as
        # SAELens saves a BatchTopK SAE), which computes the same: the pre-activations scaled by the
        # norms, decoded by unit rows. A threshold compares the scaled pre-activations already.
        norms = sae.W_dec.detach().norm(dim=-1)  # (d_sae,)
        tensors["W_enc"], tensors["W_dec"] = sae.W_enc * norms, sae.W_dec / norms[:, None]
        for name in ("b_enc", "b_gate", "b_mag"):
            if name in tensors:
                tensors[name] = tensors[name] * norms
    if arch == "batchtopk":
        arch = "jumprelu"  # what SAELens saves a BatchTopK SAE as: its inference form
    if c.transcoder:
        if arch not in ("standard", "jumprelu"):
            raise ValueError(
                f"SAELens has no {c.architecture} transcoder (only ReLU and JumpReLU ones); save with format='sparsify'"
            )
        arch = {("standard", False): "transcoder", ("standard", True): "skip_transcoder"}.get(
            (arch, c.skip), "jumprelu_skip_transcoder" if c.skip else "jumprelu_transcoder"
        )
    metadata = {
        "sae_lens_version": SAELENS_FORMAT_VERSION,
        "hook_name": c.hook_name,
        "hook_name_out": c.hook_name_out,
        "model_name": c.model_name,
        "written_by": "attnlab",
        **c.extra,
    }
    cfg = {
        "architecture": arch,
        "d_in": c.d_in,
        "d_sae": c.d_sae,
        "dtype": str(sae.dtype).removeprefix("torch."),
        "device": "cpu",
        "apply_b_dec_to_input": c.apply_b_dec_to_input,
        "normalize_activations": c.normalize_activations,
        "reshape_activations": "none",
        "metadata": {k: v for k, v in metadata.items() if v is not None},
    }
    if arch == "topk":
        cfg.update(k=c.k, rescale_acts_by_decoder_norm=c.rescale_acts_by_decoder_norm)
    if c.transcoder:
        cfg["d_out"] = c.width_out
    return cfg, tensors, SAELENS_WEIGHTS


def _to_sparsify(sae: SAE) -> tuple[dict[str, Any], dict[str, Tensor], str]:
    c = sae.cfg
    if c.architecture != "topk" or c.rescale_acts_by_decoder_norm or c.normalize_activations != "none":
        raise ValueError(
            f"sparsify's format holds plain TopK SAEs only, not a {c.architecture} one; save with format='saelens'"
        )
    if c.transcoder and c.width_out != c.d_in:
        raise ValueError(f"sparsify's transcoders have d_out = d_in; this one maps {c.d_in} to {c.width_out}")
    if c.apply_b_dec_to_input == c.transcoder:
        raise ValueError(
            "sparsify subtracts b_dec from an autoencoder's input and never from a transcoder's; "
            "this SAE does otherwise"
        )
    tensors = {"encoder.weight": sae.W_enc.T, "encoder.bias": sae.b_enc, "W_dec": sae.W_dec, "b_dec": sae.b_dec}
    if c.skip:
        tensors["W_skip"] = sae.W_skip
    cfg = {
        "activation": "topk",
        "expansion_factor": max(1, c.d_sae // c.d_in),
        "normalize_decoder": True,
        "num_latents": c.d_sae,
        "k": c.k,
        "multi_topk": False,
        "skip_connection": c.skip,
        "transcode": c.transcoder,
        "d_in": c.d_in,
    }
    # Extra keys sparsify drops when it reads the file (from_dict(drop_extra_fields=True)).
    cfg.update({k: v for k, v in (("hookpoint", c.hook_name), ("hook_name_out", c.hook_name_out)) if v is not None})
    return cfg, tensors, SPARSIFY_WEIGHTS


# ---------------------------------------------------------------------------------------------
# Splicing into a model
# ---------------------------------------------------------------------------------------------
SAE_POINTS = (
    "hook_sae_input",
    "hook_sae_acts_pre",
    "hook_sae_acts_post",
    "hook_sae_recons",
    "hook_sae_error",
    "hook_sae_output",
)


def sae_point(sae: SAE, point: str) -> str:
    """The full hook name of one of ``sae``'s points while spliced: ``sae_point(sae, "acts_post")`` is
    ``"blocks.3.hook_resid_post.hook_sae_acts_post"`` for an SAE on ``blocks.3.hook_resid_post``
    (a transcoder's points follow its output hook)."""
    short = point if point.startswith("hook_sae_") else f"hook_sae_{point}"
    if short not in SAE_POINTS:
        raise ValueError(f"sae_point: point must be one of {', '.join(SAE_POINTS)}, got {point!r}")
    return f"{sae.cfg.hook_name_out or sae.cfg.hook_name}.{short}"


def check_sae(sae: object, where: str) -> SAE:
    """``sae``, or a TypeError naming ``where`` unless it is an attnlab :class:`SAE`."""
    if not isinstance(sae, SAE):
        raise TypeError(f"{where}: sae must be an attnlab SAE, got {type(sae).__name__}")
    return sae


@contextlib.contextmanager
def splice(
    model: nn.Module,
    sae: SAE,
    *,
    keep_error: bool = True,
    fns: Mapping[str, Callable | Sequence[Callable]] | None = None,
    cache: dict[str, Tensor] | None = None,
) -> Iterator[dict[str, Tensor]]:
    """Inside the block, ``model`` runs with ``sae`` at its hook point: the activation there is
    replaced by the SAE's reconstruction plus (``keep_error``) the error term ``x - x^``.

    With the error kept, the model computes what it did (to rounding) until a latent is edited,
    which is what makes the latents usable as a circuit's nodes. While the splice lasts, the SAE's
    points are hook points of the model, named as SAELens names them (see
    :mod:`attnlab.interpret.hooks`): :func:`~attnlab.interpret.hook_names` lists them, and
    :func:`~attnlab.interpret.hooks`, :func:`~attnlab.interpret.run_with_cache` and the patching
    functions take them::

        {hook}.hook_sae_input       (B, T, d_in)   what the SAE reads
        {hook}.hook_sae_acts_pre    (B, T, d_sae)  pre-activations
        {hook}.hook_sae_acts_post   (B, T, d_sae)  latents (edit them to steer or ablate features)
        {hook}.hook_sae_recons      (B, T, d_out)  the reconstruction from the (edited) latents
        {hook}.hook_sae_error       (B, T, d_out)  x - x^ of the unedited SAE (keep_error only)
        {hook}.hook_sae_output      (B, T, d_out)  what replaces the activation

    ``fns`` sets functions on them for the whole splice (by full name or by the last part). The
    error is computed without gradient, as SAELens does: it is a node of its own, so gradients reach
    what lies before the SAE only through its latents. For a transcoder, the input hook is read and
    the output hook (``hook_name_out``) replaced. Yields a dict that holds, after each forward pass,
    those tensors by full name (detached), or fills ``cache`` if given.
    """
    check_sae(sae, "splice")
    sae.check_model(model)
    base = sae.cfg.hook_name_out or sae.cfg.hook_name
    shorts = [p for p in SAE_POINTS if keep_error or p != "hook_sae_error"]
    given: dict[str, list[Callable]] = {}
    for name, fn in (fns or {}).items():
        short = name.removeprefix(f"{base}.")
        if short not in shorts:
            raise ValueError(
                f"splice: unknown SAE hook {name!r}; the SAE's points are {', '.join(f'{base}.{p}' for p in shorts)}"
            )
        listed = list(fn) if isinstance(fn, Sequence) else [fn]
        if not all(callable(f) for f in listed):
            raise TypeError(f"splice: the hook on {name} must be a function fn(activation, hook) or a list of them")
        given[f"{base}.{short}"] = given.get(f"{base}.{short}", []) + listed
    out = {} if cache is None else cache
    seen: dict[str, Tensor] = {}

    def read_input(x: Tensor, hook: HookPoint) -> None:
        seen["input"] = x

    with added_points(model, base, [f"{base}.{p}" for p in shorts]) as points:
        points.fns.update(given)

        def run(point: str, x: Tensor) -> Tensor:
            y = points.run(f"{base}.{point}", x)
            out[f"{base}.{point}"] = y.detach()
            return y

        def replace_output(x: Tensor, hook: HookPoint) -> Tensor:
            x_read = seen.pop("input") if sae.cfg.transcoder else x
            x_in = run("hook_sae_input", x_read)
            pre0 = sae.pre_activations(x_in)  # (B, T, d_sae)
            pre = run("hook_sae_acts_pre", pre0)
            z0 = sae.activation(pre, x_in)
            z = run("hook_sae_acts_post", z0)
            recons0 = sae.decode(z, x_in).to(x.dtype)  # (B, T, d_out)
            recons = run("hook_sae_recons", recons0)
            if not keep_error:
                return run("hook_sae_output", recons)
            # The error of the SAE as it is, not as the hooks edited it (SAELens's): recomputed only
            # when a hook changed something on the way.
            with torch.no_grad():
                unedited = x_in is x_read and pre is pre0 and z is z0 and recons is recons0
                clean = recons0 if unedited else sae(x_read).to(x.dtype)
                error = (x - clean).detach()  # (B, T, d_out)
            if torch.is_grad_enabled() and x.requires_grad:
                error.requires_grad_(True)  # a leaf: attribution reads the metric's gradient at the error node
            error = run("hook_sae_error", error)
            return run("hook_sae_output", recons + error)

        table: dict[str, list[Callable]] = {base: [replace_output]}
        if sae.cfg.transcoder:
            table.setdefault(sae.cfg.hook_name, []).insert(0, read_input)
        with hooks(model, table):
            yield out


@contextlib.contextmanager
def steer(model: nn.Module, sae: SAE, latent: int, strength: float) -> Iterator[Tensor]:
    """Inside the block, ``strength * W_dec[latent]`` is added to the activation at the SAE's hook
    point (a transcoder's output hook) at every position, generated tokens included: a latent's
    direction pushed into the model while it runs (steering). Built on :func:`attnlab.interpret.hooks`;
    blocks nest, so several latents may be steered at once. Yields the added direction ``(d_out,)``,
    in the SAE's dtype."""
    check_sae(sae, "steer")
    if not _is_int(latent) or not 0 <= latent < sae.cfg.d_sae:
        raise ValueError(f"steer: latent must be an int in [0, {sae.cfg.d_sae}), got {latent!r}")
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength):
        raise ValueError(f"steer: strength must be a finite number, got {strength!r}")
    sae.check_model(model)
    with torch.no_grad():
        direction = float(strength) * sae.W_dec[latent].detach()  # (d_out,)

    def add(x: Tensor, hook: HookPoint) -> Tensor:
        return x + direction.to(device=x.device, dtype=x.dtype)  # (B, T, d_out)

    with hooks(model, {sae.cfg.hook_name_out or sae.cfg.hook_name: add}):
        yield direction


# ---------------------------------------------------------------------------------------------
# Measures
# ---------------------------------------------------------------------------------------------
@dataclass
class SAEEvaluation:
    """What :func:`evaluate_sae` measured (SAELens's names in brackets).

    Attributes:
        l0: mean number of active latents per token [l0].
        explained_variance: ``1 - E|x - x^|^2 / E|x - E x|^2`` over all tokens [explained_variance,
            after SAELens's PR #665: about the mean, not about zero].
        dead_fraction: fraction of latents never active on these tokens.
        ce_clean, ce_spliced, ce_zero_ablated: next-token cross-entropy (nats) of the model as it
            is, with the reconstruction in place of the activation, and with the activation zeroed
            [ce_loss_without_sae, ce_loss_with_sae, ce_loss_with_ablation].
        ce_loss_recovered: ``(ce_zero_ablated - ce_spliced) / (ce_zero_ablated - ce_clean)`` [ce_loss_score].
        kl_spliced, kl_zero_ablated: mean ``KL(clean || spliced)`` and ``KL(clean || zero-ablated)``
            of the next-token distributions [kl_div_with_sae, kl_div_with_ablation].
        kl_recovered: ``(kl_zero_ablated - kl_spliced) / kl_zero_ablated`` [kl_div_score].
        tokens: how many token positions were measured.
        density: ``(d_sae,)`` fraction of tokens on which each latent is active.
    """

    l0: float
    explained_variance: float
    dead_fraction: float
    ce_clean: float
    ce_spliced: float
    ce_zero_ablated: float
    ce_loss_recovered: float
    kl_spliced: float
    kl_zero_ablated: float
    kl_recovered: float
    tokens: int
    density: Tensor = field(repr=False)

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.pop("density")
        return d


def _kl_per_token(log_clean: Tensor, log_new: Tensor) -> Tensor:
    """``KL(p_clean || p_new)`` per position ``(B, T)``, summed over the vocabulary, of two runs'
    log-probabilities ``(B, T, V)``."""
    return F.kl_div(log_new, log_clean, reduction="none", log_target=True).sum(-1)


def _ce_per_token(log_probs: Tensor, idx: Tensor) -> Tensor:
    """Next-token cross-entropy ``(B, T-1)`` of log-probabilities ``(B, T, V)``: position t predicts token t+1."""
    return F.nll_loss(log_probs[:, :-1].transpose(1, 2), idx[:, 1:], reduction="none")


@torch.no_grad()
def _eval_tokens(tokens: object, batch_size: object) -> Tensor:
    """``tokens`` as ``(N, T)`` after :func:`evaluate_sae`'s checks of them and of ``batch_size``."""
    if not isinstance(tokens, Tensor) or tokens.dtype not in (torch.int32, torch.int64) or tokens.dim() not in (1, 2):
        got = (
            f"{tokens.dtype} tensor of shape {tuple(tokens.shape)}"
            if isinstance(tokens, Tensor)
            else type(tokens).__name__
        )
        raise ValueError(f"evaluate_sae: tokens must be an integer tensor (N, T) or (T,), got {got}")
    if tokens.dim() == 1:
        tokens = tokens.unsqueeze(0)
    if tokens.shape[1] < 2:
        raise ValueError(f"evaluate_sae: tokens need at least 2 positions (a next-token loss), got {tokens.shape[1]}")
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"evaluate_sae: batch_size must be a positive int, got {batch_size!r}")
    return tokens


@torch.no_grad()
def evaluate_sae(
    model: nn.Module,
    sae: SAE,
    tokens: Tensor,
    *,
    batch_size: int = 8,
    ignore_tokens: Sequence[int] = (),
    progress: Callable[[int], None] | None = None,
) -> SAEEvaluation:
    """SAELens's evaluation of ``sae`` on ``model`` over ``tokens (N, T)`` (or ``(T,)``); ``progress``
    is called with the tokens measured so far after each batch (a progress bar).

    Every measure is taken over the token positions whose token is not in ``ignore_tokens``
    (SAELens leaves out the tokenizer's special tokens: pass ``bos``/``eos`` ids here for the same
    figures); the CE loss covers positions ``0..T-2`` (each predicts the next token), the KL all
    ``T``. The clean, spliced and zero-ablated runs see the same batches; the splice replaces only
    kept positions. Runs in eval mode and no_grad; ``model`` is left in its own mode.
    """
    tokens = _eval_tokens(tokens, batch_size)  # (N, T)
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a callable or None, got {type(progress).__name__}")
    check_sae(sae, "evaluate_sae").check_model(model)
    hook_in = sae.cfg.hook_name
    hook_out = sae.cfg.hook_name_out or hook_in
    device = next(model.parameters()).device
    sums = {"l0": 0.0, "sq_res": 0.0, "sq_norm": 0.0, "n": 0, "ce": [], "kl": []}
    sum_x: Tensor | None = None
    active = torch.zeros(sae.cfg.d_sae, dtype=torch.float64, device="cpu")  # (on the CPU by name, whatever
    ignore = torch.tensor(list(ignore_tokens), dtype=torch.long, device="cpu")  # torch.set_default_device says)
    with eval_mode(model), eval_mode(sae):
        for start in range(0, tokens.shape[0], batch_size):
            idx = tokens[start : start + batch_size].to(device=device, dtype=torch.long)  # (b, T)
            keep = ~torch.isin(idx, ignore.to(device))  # (b, T) positions measured
            seen: dict[str, Tensor] = {}

            def grab(x: Tensor, hook: HookPoint, seen: dict[str, Tensor] = seen) -> None:
                seen[hook.name] = x

            with hooks(model, {hook_in: grab, **({hook_out: grab} if hook_out != hook_in else {})}):
                log_clean = F.log_softmax(model(idx).float(), dim=-1)  # (b, T, V)
            x_in, target = seen[hook_in], seen[hook_out]

            def spliced(x: Tensor, hook: HookPoint, x_in: Tensor = x_in, keep: Tensor = keep) -> Tensor:
                recons = sae(x_in).to(x.dtype)
                return torch.where(keep[..., None], recons, x)

            # Each run's logits are reduced to its losses before the next run: one (b, T, V) at a time
            # beside the clean run's (the three at once, with their log-softmax copies, took 2 GB for
            # SmolLM2's 49,152 tokens at the default batch).
            ce_keep = keep[:, :-1]
            ce, kl = [_ce_per_token(log_clean, idx)[ce_keep].cpu().double()], []
            for fn in (spliced, lambda x, hook: torch.zeros_like(x)):
                with hooks(model, {hook_out: fn}):
                    log_new = F.log_softmax(model(idx).float(), dim=-1)  # (b, T, V)
                ce.append(_ce_per_token(log_new, idx)[ce_keep].cpu().double())
                kl.append(_kl_per_token(log_clean, log_new)[keep].cpu().double())
                del log_new
            del log_clean
            z, recons = sae.encode_decode(x_in)  # (b, T, d_sae), (b, T, d_out)
            z, recons, tgt = z[keep], as_float64(recons[keep]), as_float64(target[keep])  # rows kept
            sums["l0"] += float((z != 0).sum())
            sums["sq_res"] += float((tgt - recons).pow(2).sum())
            sums["sq_norm"] += float(tgt.pow(2).sum())
            sums["n"] += tgt.shape[0]
            sum_x = tgt.sum(0).cpu() if sum_x is None else sum_x + tgt.sum(0).cpu()
            active += (z != 0).sum(0).cpu().double()
            sums["ce"].append(torch.stack(ce))
            sums["kl"].append(torch.stack(kl))
            if progress is not None:
                progress(min(start + batch_size, tokens.shape[0]) * tokens.shape[1])
    n = sums["n"]
    if n == 0:
        raise ValueError("evaluate_sae: every position was an ignored token; nothing to measure")
    mean_sq = sums["sq_norm"] / n
    total_var = mean_sq - float((sum_x / n).pow(2).sum())
    mse = sums["sq_res"] / n
    flat = 1e-10 * mean_sq  # (relative to the rows' size: the same verdict at every scale of the activations)
    ev = (1.0 if mse <= flat else 0.0) if total_var <= flat else 1.0 - mse / total_var
    ce = torch.cat(sums["ce"], dim=1).mean(dim=1)  # (3,)
    kl = torch.cat(sums["kl"], dim=1).mean(dim=1)  # (2,)
    ce_clean, ce_sae, ce_abl = (float(v) for v in ce)
    density = active / n
    return SAEEvaluation(
        l0=sums["l0"] / n,
        explained_variance=ev,
        dead_fraction=float((active == 0).double().mean()),
        ce_clean=ce_clean,
        ce_spliced=ce_sae,
        ce_zero_ablated=ce_abl,
        ce_loss_recovered=(ce_abl - ce_sae) / (ce_abl - ce_clean) if ce_abl != ce_clean else float("nan"),
        kl_spliced=float(kl[0]),
        kl_zero_ablated=float(kl[1]),
        kl_recovered=float((kl[1] - kl[0]) / kl[1]) if float(kl[1]) != 0 else float("nan"),
        tokens=n,
        density=density.float(),
    )


def cfg_dict(cfg: SAEConfig) -> dict[str, Any]:
    """``cfg`` as plain JSON (what a training checkpoint records)."""
    return json.loads(json.dumps(asdict(cfg)))
