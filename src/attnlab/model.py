"""A GPT on attnlab's :class:`~attnlab.attention.MultiHeadAttention`: the GPT-2 architecture.

The tutorials end at GPT-2's attention sizes ("Implementing GPT-Style Attention") and at a toy
language model, ``BadLM_V2`` (the attention-review exercises). This module is the real model they
lead to, with the tutorials' configuration names (``vocab_size``, ``context_length``, ``emb_dim``,
``n_heads``, ``n_layers``, ``drop_rate``, ``qkv_bias``)::

    tok_emb(idx) + pos_emb(positions)            # (B, T, emb_dim)
    -> dropout
    -> n_layers x TransformerBlock:              # pre-LayerNorm, residual around each half
           x = x + drop(att(norm1(x)))           #   attnlab MultiHeadAttention, causal
           x = x + drop(ff(norm2(x)))            #   Linear 4x -> GELU (tanh, as GPT-2) -> Linear
    -> final_norm -> out_head                    # (B, T, vocab_size), out_head tied to tok_emb

With ``qkv_bias=True`` and the ``gpt2-*`` presets the parameters are exactly GPT-2's (``gpt2-small``
has 124,439,808 of them, as Hugging Face's ``GPT2LMHeadModel``); :mod:`attnlab.formats.hf` converts weights
both ways. Generation (with a KV cache) lives in :mod:`attnlab.generation`.

Since GPT-2 (the ``GPTConfig`` switches, all off by default; the ``modern`` preset turns them on):
positions inside attention instead of a learned table (``pos="rope"``, ``"alibi"`` or ``"none"``: then
any sequence length, and generation rolls the KV cache instead of re-encoding), RMSNorm, SwiGLU or
ReLU^2 MLPs, QK-norm, grouped-query attention, sliding windows with attention sinks, untied embeddings.
With ``pos="rope"``, ``norm="rmsnorm"``, ``mlp="swiglu"`` and no biases the blocks are Llama's (and,
with a window, Mistral's): :mod:`attnlab.formats.hf_llama` converts their weights.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from attnlab import generation
from attnlab.attention import KVCache, Linear, MultiHeadAttention, OffsetRMSNorm, rms_norm
from attnlab.checks import (
    can_read_values,
    check_device,
    check_float_dtype,
    check_model_size,
    finite_real,
    is_int,
    is_real,
    non_negative_int,
    positive_int,
)
from attnlab.files import atomic_path, atomic_write_json, import_safetensors, read_json
from attnlab.formats import families, hf, hf_llama
from attnlab.positions import check_rope_scaling
from attnlab.quantized import from_safetensors, is_quantized, to_safetensors

__all__ = ["CONFIG_NAME", "GPT", "WEIGHTS_NAME", "FeedForward", "GPTConfig", "TransformerBlock", "lm_loss"]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


# GPTConfig.activation -> nn.GELU's `approximate` argument
_ACTIVATIONS = {"gelu_tanh": "tanh", "gelu": "none"}
POSITIONS = ("learned", "rope", "alibi", "none")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu", "geglu", "relu2")


def _id_ranges(*pairs: tuple[Tensor, int | None]) -> list[int]:
    """Statistics of each ``(ids, ignore_index)`` pair with a single host sync.

    ``[min, max]`` for a pair without ``ignore_index``, ``[min, max, n_scored]`` for one with it:
    entries equal to ``ignore_index`` count as 0 (a valid id), so they can neither fail the range
    check nor hide a bad id, and ``n_scored`` counts the others. Every tensor must be non-empty.
    """
    stats: list[Tensor] = []
    for ids, ignore in pairs:
        if ignore is None:
            stats += torch.aminmax(ids)  # one reduction per tensor
        else:
            scored = ids != ignore
            stats += [*torch.aminmax(torch.where(scored, ids, 0)), scored.sum()]
    return torch.stack([t.long() for t in stats]).tolist()  # the one sync


def _check_targets_range(lo: int, hi: int, n_scored: int, vocab_size: int, ignore_index: int) -> None:
    if lo < 0 or hi >= vocab_size:
        raise ValueError(
            f"targets values must be in [0, vocab_size={vocab_size}) or equal ignore_index={ignore_index}, "
            f"got min {lo}, max {hi} (ignored entries counted as 0)"
        )
    if n_scored == 0:
        raise ValueError(
            f"targets has no entry to score: every one equals ignore_index={ignore_index}, so the mean loss "
            "would be 0/0 = NaN; leave such a batch out"
        )


def lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean next-token cross-entropy in nats per token, computed in float32.

    Args:
        logits: ``(..., V)``, e.g. ``(B, T, V)``; any float dtype (bf16 under autocast is upcast,
            so the loss and its gradient are not rounded to 8 bits of mantissa).
        targets: ``(...)`` integer ids matching ``logits.shape[:-1]``; entries equal to
            ``ignore_index`` (default -100, as ``F.cross_entropy``) do not count; every other entry
            must be in ``[0, V)``, and at least one entry must count. That is checked (one host
            sync), so a bad id is a ValueError rather than a CUDA device assert that poisons the
            process, and a batch with nothing to score is a ValueError rather than a NaN loss.
    Returns:
        A float32 scalar.
    """
    _check_loss_args(logits, targets, ignore_index)
    if can_read_values(targets):
        _check_targets_range(*_id_ranges((targets, ignore_index)), logits.shape[-1], ignore_index)
    return _lm_loss(logits, targets, ignore_index)


def _check_loss_args(logits: object, targets: object, ignore_index: object) -> None:
    if not isinstance(logits, Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise TypeError(
            f"logits must be a float tensor (..., V), got {getattr(logits, 'dtype', type(logits).__name__)}"
        )
    _check_targets_and_ignore_index(targets, ignore_index)
    if targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"targets must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if targets.device != logits.device:
        raise ValueError(f"targets is on {targets.device} but logits are on {logits.device}")
    if targets.numel() == 0:
        raise ValueError(f"targets is empty (shape {tuple(targets.shape)}): the mean loss of no tokens is 0/0 = NaN")


def _check_targets_and_ignore_index(targets: object, ignore_index: object) -> None:
    """TypeError unless ``targets`` is an integer tensor and ``ignore_index`` an int."""
    if not isinstance(targets, Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"targets must be an integer tensor of token ids, got {getattr(targets, 'dtype', type(targets).__name__)}"
        )
    if not is_int(ignore_index):
        raise TypeError(f"ignore_index must be an int, got {ignore_index!r}")


def _lm_loss(logits: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    """:func:`lm_loss` on checked arguments."""
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),  # (N, V) float32 even under bf16 autocast
        targets.reshape(-1).long(),  # (N,)
        ignore_index=ignore_index,
    )


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------
# GPT-2's published sizes (Radford et al. 2019; Hugging Face's gpt2, gpt2-medium, gpt2-large, gpt2-xl).
_GPT2_SIZES = {
    "gpt2-small": dict(emb_dim=768, n_layers=12, n_heads=12),
    "gpt2-medium": dict(emb_dim=1024, n_layers=24, n_heads=16),
    "gpt2-large": dict(emb_dim=1280, n_layers=36, n_heads=20),
    "gpt2-xl": dict(emb_dim=1600, n_layers=48, n_heads=25),
}
# Llama-family sizes (the published configs), for shapes and KV-cache sizes: build them on the meta
# device, or load the weights with GPT.from_pretrained.
_LLAMA_SIZES = {
    "llama2-7b": dict(vocab_size=32000, context_length=4096, ff_dim=11008, n_kv_heads=None, rope_theta=10000.0),
    "llama3-8b": dict(vocab_size=128256, context_length=8192, ff_dim=14336, n_kv_heads=8, rope_theta=500000.0),
    "mistral-7b": dict(
        vocab_size=32000, context_length=32768, ff_dim=14336, n_kv_heads=8, rope_theta=10000.0, window=4096
    ),
}
_ALIASES = {"gpt2": "gpt2-small", "124m": "gpt2-small", "355m": "gpt2-medium", "774m": "gpt2-large", "1558m": "gpt2-xl"}


@dataclass
class GPTConfig:
    """Sizes and switches of a :class:`GPT` (the tutorials' names).

    Attributes:
        vocab_size: number of token ids (GPT-2's BPE: 50257; bytes: 256).
        context_length: the longest sequence the model sees (size of the position embedding).
        emb_dim: width of the residual stream (``d_in = d_out`` of every attention layer).
        n_heads: attention heads per layer; ``emb_dim`` must be divisible by it.
        n_layers: number of transformer blocks.
        drop_rate: dropout on the embeddings, the attention weights and each residual branch.
        qkv_bias: bias in the query/key/value projections (GPT-2 has one).
        n_kv_heads: key/value heads for grouped-query attention (default ``n_heads``: plain MHA).
        tie_embeddings: the output head shares the token embedding matrix (as GPT-2).
        bias: bias in the attention output projection, the MLP and the LayerNorms (as GPT-2).
        ff_dim: hidden width of the MLP (default ``4 * emb_dim``).
        ln_eps: LayerNorm epsilon (GPT-2: 1e-5).
        activation: the MLP's GELU: ``"gelu_tanh"`` (GPT-2's tanh approximation, needed to
            reproduce its logits) or ``"gelu"`` (exact, erf-based; faster on CPU, so ``tiny`` uses it).

    Since GPT-2 (defaults: GPT-2's choices):
        pos: where positions come from: ``"learned"`` (GPT-2's table added to the embeddings),
            ``"rope"`` (rotary, in attention), ``"alibi"`` (a distance penalty on the scores) or
            ``"none"`` (causality alone; NoPE). Anything but ``learned`` is relative: the model
            takes sequences of any length and attends over a sliding ``window``.
        rope_theta: RoPE's base (Llama 2: 10000, Llama 3: 500000); rope_scaling: a Hugging Face
            ``rope_scaling`` dict (``linear``, ``llama3``) or None.
        norm: ``"layernorm"`` (GPT-2) or ``"rmsnorm"`` (Llama: no mean, no bias).
        mlp: ``"gelu"`` (GPT-2's, with ``activation``), ``"swiglu"`` (Llama: ``silu(x W1) * (x W3)``,
            ``ff_dim`` wide) or ``"relu2"`` (``relu(x W1)^2``: nanochat, modded-nanogpt).
        window: sliding-window attention: each token sees itself and ``window - 1`` tokens before
            it (Mistral). Default: ``context_length`` for relative positions, none for learned.
        sinks: the first ``sinks`` tokens stay visible beside the window (StreamingLLM's attention sinks).
        qk_norm: RMSNorm on each query and key head before the scores (``True`` or ``"head"``), or
            ``"full"``: one RMSNorm over all the queries (keys) of a token before the split into heads.

    Model families after Llama (defaults: off; :mod:`attnlab.formats.families` sets them):
        head_size: width of each head (Hugging Face's ``head_dim``; default ``emb_dim // n_heads``).
            Gemma and Qwen 3 decouple it: the projections are ``n_heads * head_size`` wide.
        attn_scale: multiplier of ``q k^T`` (default ``1 / sqrt(head_size)``; Gemma 2/3:
            ``query_pre_attn_scalar ** -0.5``).
        attn_softcap: soft-cap the attention scores, ``cap * tanh(scores / cap)`` (Gemma 2: 50).
        logit_softcap: soft-cap the output logits the same way (Gemma 2: 30).
        embed_scale: multiply the token embeddings by this (Gemma: ``sqrt(emb_dim)``).
        norm_offset: RMSNorm gains are ``norm_offset + weight`` (Gemma: 1, weights start at 0).
        window_layers: the layers that use ``window``; the others attend globally (over
            ``context_length``). Gemma 2: every other layer, Gemma 3: five of every six. None: all.
        rope_local_theta: RoPE base of the ``window_layers``, which then get no ``rope_scaling``
            (Gemma 3: 10000 locally, ``rope_theta`` = 1e6 with its scaling globally).
        pre_norms: normalise the input of each sublayer (GPT-2, Llama; OLMo 2 has none).
        post_norms: normalise the output of each sublayer before adding it to the stream
            (Gemma 2/3 with ``pre_norms``: "sandwich" norms; OLMo 2 alone).
        rotary_fraction: with ``pos="rope"``, the fraction of each head's features that rotate
            (GPT-NeoX/Pythia: 0.25; Phi-4-mini: 0.75).
        parallel_residual: attention and MLP both read the block's input and are added together,
            ``x + att(norm1(x)) + ff(norm2(x))`` (GPT-NeoX, GPT-J).
    """

    vocab_size: int = 50257
    context_length: int = 1024
    emb_dim: int = 768
    n_heads: int = 12
    n_layers: int = 12
    drop_rate: float = 0.1
    qkv_bias: bool = False
    n_kv_heads: int | None = None
    tie_embeddings: bool = True
    bias: bool = True
    ff_dim: int | None = None
    ln_eps: float = 1e-5
    activation: str = "gelu_tanh"
    pos: str = "learned"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    norm: str = "layernorm"
    mlp: str = "gelu"
    window: int | None = None
    sinks: int = 0
    qk_norm: bool | str = False
    head_size: int | None = None
    attn_scale: float | None = None
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    embed_scale: float | None = None
    norm_offset: float = 0.0
    window_layers: list[int] | None = None
    rope_local_theta: float | None = None
    pre_norms: bool = True
    post_norms: bool = False
    rotary_fraction: float = 1.0
    parallel_residual: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers"):
            positive_int(name, getattr(self, name))
        for name in ("n_kv_heads", "ff_dim", "head_size"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        d = self.drop_rate
        if not is_real(d) or not 0.0 <= d < 1.0:
            raise ValueError(f"drop_rate must be a float in [0, 1), got {d!r}")
        self.drop_rate = float(d)
        for name in ("qkv_bias", "tie_embeddings", "bias", "pre_norms", "post_norms", "parallel_residual"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        eps = self.ln_eps
        if not is_real(eps) or not 0.0 < eps < 1.0:
            raise ValueError(f"ln_eps must be a small positive float, got {eps!r}")
        self.ln_eps = float(eps)
        if not isinstance(self.activation, str) or self.activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {self.activation!r}")
        if self.head_size is None and self.emb_dim % self.n_heads != 0:
            raise ValueError(
                f"emb_dim must be divisible by n_heads, got emb_dim={self.emb_dim} and n_heads={self.n_heads}"
            )
        if self.n_heads % self.kv_heads != 0:
            raise ValueError(
                f"n_heads must be divisible by n_kv_heads, got n_heads={self.n_heads} and n_kv_heads={self.n_kv_heads}"
            )
        for name, allowed in (("pos", POSITIONS), ("norm", NORMS), ("mlp", MLPS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {getattr(self, name)!r}")
        if not is_real(self.rotary_fraction) or not 0 < self.rotary_fraction <= 1:
            raise ValueError(f"rotary_fraction must be a number in (0, 1], got {self.rotary_fraction!r}")
        self.rotary_fraction = float(self.rotary_fraction)
        if self.pos == "rope" and (self.rope_dim % 2 or self.rope_dim == 0):
            raise ValueError(
                f"pos='rope' rotates pairs of features: the rotated width head_dim * rotary_fraction = "
                f"{self.head_dim} * {self.rotary_fraction:g} = {self.head_dim * self.rotary_fraction:g} must be even "
                "(and positive)"
            )
        if self.rotary_fraction != 1 and self.pos != "rope":
            raise ValueError(f"rotary_fraction={self.rotary_fraction:g} is a share of RoPE: it needs pos='rope'")
        if not finite_real(self.rope_theta) or self.rope_theta <= 1:
            raise ValueError(f"rope_theta must be a number > 1, got {self.rope_theta!r}")
        self.rope_theta = float(self.rope_theta)
        self.rope_scaling = check_rope_scaling(self.rope_scaling)
        if self.window is not None:
            positive_int("window", self.window)
        self.sinks = non_negative_int("sinks", self.sinks)
        if self.sinks and self.window is None and self.pos == "learned":
            raise ValueError(
                "sinks keep the first tokens visible beside a sliding window: set window (or use relative positions, "
                "whose window is context_length)"
            )
        if self.sinks >= self.attention_window:
            raise ValueError(f"sinks={self.sinks} must be less than the window ({self.attention_window})")
        if self.qk_norm == "head":
            self.qk_norm = True  # "head" is another name for True (per-head norms)
        if not (isinstance(self.qk_norm, bool) or self.qk_norm == "full"):
            raise TypeError(f"qk_norm must be a bool, 'head' or 'full', got {self.qk_norm!r}")
        self._check_families()
        # Past sane sizes (a hand-edited config.json with n_layers: 1000000) is an error here, before
        # anything is built: not minutes of building modules, or terabytes of weights.
        check_model_size(
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            emb_dim=self.emb_dim,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            ff_dim=self.hidden_dim,
        )

    def _check_families(self) -> None:
        """The switches of the families after Llama (see the class docstring)."""
        for name in ("attn_scale", "attn_softcap", "logit_softcap", "embed_scale"):
            value = getattr(self, name)
            if value is not None:
                if not finite_real(value) or value <= 0:
                    raise ValueError(f"{name} must be a positive number or None, got {value!r}")
                setattr(self, name, float(value))
        if not finite_real(self.norm_offset):
            raise ValueError(f"norm_offset must be a number (Gemma: 1.0), got {self.norm_offset!r}")
        self.norm_offset = float(self.norm_offset)
        if self.norm_offset and self.norm != "rmsnorm":
            raise ValueError(f"norm_offset={self.norm_offset:g} offsets RMSNorm gains: it needs norm='rmsnorm'")
        if not (self.pre_norms or self.post_norms):
            raise ValueError("pre_norms and post_norms are both False: a block needs one of them")
        if self.parallel_residual and self.post_norms:
            raise ValueError("parallel_residual with post_norms is no published block: choose one")
        if self.window_layers is not None:
            layers = self.window_layers
            if not isinstance(layers, (list, tuple)) or not all(is_int(i) for i in layers):
                raise TypeError(f"window_layers must be a list of layer indices or None, got {layers!r}")
            if any(not 0 <= i < self.n_layers for i in layers) or len(set(layers)) != len(layers):
                raise ValueError(
                    f"window_layers must be distinct layer indices in [0, n_layers={self.n_layers}), got {layers!r}"
                )
            if self.window is None or not self.relative:
                raise ValueError(
                    "window_layers says which layers slide a window: set window, with relative positions (pos='rope', "
                    "'alibi' or 'none')"
                )
            self.window_layers = sorted(int(i) for i in layers)
        if self.rope_local_theta is not None:
            if not finite_real(self.rope_local_theta) or self.rope_local_theta <= 1:
                raise ValueError(f"rope_local_theta must be a number > 1 or None, got {self.rope_local_theta!r}")
            if self.pos != "rope" or self.window_layers is None:
                raise ValueError("rope_local_theta is the RoPE base of the window_layers: it needs pos='rope' and them")
            self.rope_local_theta = float(self.rope_local_theta)

    # Derived sizes --------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        """Width of each head: ``head_size``, else ``emb_dim // n_heads``."""
        return self.emb_dim // self.n_heads if self.head_size is None else self.head_size

    @property
    def rope_dim(self) -> int:
        """Features of each head that RoPE rotates (``head_dim * rotary_fraction``)."""
        return int(self.head_dim * self.rotary_fraction)

    def is_window_layer(self, i: int) -> bool:
        """Whether layer ``i`` attends over ``window`` (all layers unless ``window_layers`` says)."""
        return self.window_layers is None or i in self.window_layers

    @property
    def kv_heads(self) -> int:
        """Key/value heads actually used (``n_kv_heads`` or ``n_heads``)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        """MLP hidden width actually used (``ff_dim`` or ``4 * emb_dim``)."""
        return 4 * self.emb_dim if self.ff_dim is None else self.ff_dim

    @property
    def relative(self) -> bool:
        """Positions inside attention (RoPE, ALiBi, none): no position table, no longest sequence."""
        return self.pos != "learned"

    @property
    def attention_window(self) -> int:
        """Tokens a query sees at most: ``window``, else ``context_length``."""
        return self.context_length if self.window is None else self.window

    # Presets and (de)serialisation ----------------------------------------------------------
    @classmethod
    def presets(cls) -> list[str]:
        """Names accepted by :meth:`preset`."""
        return ["tiny", "modern", *_GPT2_SIZES, *_LLAMA_SIZES]

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPTConfig:
        """A named configuration, optionally with some fields overridden.

        ``gpt2-small`` (alias ``gpt2``), ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``: GPT-2's
        published sizes (vocabulary 50257, context 1024, ``qkv_bias=True``, dropout 0.1).
        ``tiny``: a 1.66M-parameter byte-level model (vocabulary 256, context 64, 2 layers of
        width 256 with 4 heads of size 64, no dropout, exact GELU) that learns visibly in minutes on a CPU.
        ``modern``: ``tiny``'s sizes with what came after GPT-2, as nanochat combines it: rotary
        positions, RMSNorm, a ReLU^2 MLP, QK-norm, untied embeddings, no biases.
        ``llama2-7b``, ``llama3-8b``, ``mistral-7b``: those models' published shapes (32 layers of
        width 4096; Llama 3 and Mistral with 8 key/value heads, Mistral with a 4096-token window),
        e.g. to size a KV cache (``attnlab info --kv-memory``) or count parameters on the meta device.

        >>> GPTConfig.preset("gpt2-small", context_length=256).context_length
        256
        """
        if not isinstance(name, str):
            raise TypeError(f"preset name must be a str, got {type(name).__name__}")
        key = _ALIASES.get(name.lower(), name.lower())
        tiny: dict[str, Any] = dict(
            vocab_size=256, context_length=64, emb_dim=256, n_heads=4, n_layers=2, drop_rate=0.0
        )
        if key == "tiny":
            base = dict(tiny, activation="gelu")
        elif key == "modern":  # tiny's sizes; the activation is the MLP's own (relu2)
            base = dict(tiny, bias=False, pos="rope", norm="rmsnorm", mlp="relu2", qk_norm=True, tie_embeddings=False)
        elif key in _LLAMA_SIZES:  # 32 layers of width 4096: RoPE, RMSNorm, SwiGLU, no biases
            base = dict(emb_dim=4096, n_heads=32, n_layers=32, drop_rate=0.0, bias=False, tie_embeddings=False)
            base.update(pos="rope", norm="rmsnorm", mlp="swiglu", **_LLAMA_SIZES[key])
        elif key in _GPT2_SIZES:
            base = dict(vocab_size=50257, context_length=1024, drop_rate=0.1, qkv_bias=True, **_GPT2_SIZES[key])
        else:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(cls.presets())} (or 'gpt2')")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"unknown GPTConfig field(s) {unknown}; fields are {sorted(fields)}")
        base.update(overrides)
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (what ``config.json`` holds)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error (a typo must not pass silently)."""
        if not isinstance(d, dict):
            raise TypeError(f"config must be a dict, got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; fields are {sorted(fields)}")
        return cls(**d)


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------
class FeedForward(nn.Module):
    """The MLP of a block: ``Linear(emb, hidden) -> activation -> Linear(hidden, emb)``.

    ``cfg.mlp="gelu"``: GPT-2's, with the GELU of ``cfg.activation`` (by default the tanh approximation
    GPT-2 was trained with, which reproduces its logits). ``"relu2"``: ``relu(x)^2`` (nanochat,
    modded-nanogpt): cheaper than GELU and as good at small scale. ``"swiglu"``: Llama's gated unit
    ``silu(x W_gate) * (x W_up)``, gate and up from one matmul (``2 * hidden`` outputs, gate first).
    ``"geglu"``: Gemma's ``gelu(x W_gate) * (x W_up)``, the GELU of ``cfg.activation``.
    Shapes: ``(..., emb_dim) -> (..., emb_dim)``.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.gated = gated = cfg.mlp in ("swiglu", "geglu")
        if cfg.mlp == "gelu":
            act: nn.Module = nn.GELU(approximate=_ACTIVATIONS[cfg.activation])
        elif cfg.mlp == "geglu":
            act = GeGLU(_ACTIVATIONS[cfg.activation])
        else:
            act = SwiGLU() if gated else ReLUSquared()
        self.layers = nn.Sequential(
            Linear(cfg.emb_dim, (2 if gated else 1) * cfg.hidden_dim, bias=cfg.bias),
            act,
            Linear(cfg.hidden_dim, cfg.emb_dim, bias=cfg.bias),
        )
        self.hook: Any = None  # set by attnlab.interpret.hooks for the length of a hooked pass

    def forward(self, x: Tensor) -> Tensor:
        hook = self.hook  # attnlab.interpret.hooks: hook(name, x) reads or replaces x (None: no cost)
        if hook is None:
            return self.layers(x)
        w_in, act, w_out = self.layers
        h = w_in(x)  # (..., hidden), gated: (..., 2 * hidden) = [gate | up]
        if self.gated:
            gate, up = h.chunk(2, dim=-1)  # (..., hidden) each
            post = act.combine(hook("pre", gate), hook("pre_linear", up))
        else:
            post = act(hook("pre", h))
        return w_out(hook("post", post))  # (..., hidden) -> (..., emb_dim)


class ReLUSquared(nn.Module):
    """``relu(x)^2``."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x).square()


class SwiGLU(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` (the last dimension split in two halves)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.combine(*x.chunk(2, dim=-1))

    def combine(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up


class GeGLU(nn.Module):
    """``gelu(gate) * up`` for ``x = [gate | up]`` (``approximate``: nn.GELU's argument)."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return self.combine(*x.chunk(2, dim=-1))

    def combine(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.gelu(gate, approximate=self.approximate) * up


class TokenEmbedding(nn.Embedding):
    """The token embedding times ``scale`` where a family has one (Gemma: ``sqrt(emb_dim)``, rounded to the
    weights' dtype as its reference does): what this module returns is what the residual stream starts
    from, so ``hook_embed`` (its output) is that too, as in TransformerLens."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, idx: Tensor) -> Tensor:
        x = super().forward(idx)  # (B, T, C)
        return x if self.scale is None else x * torch.tensor(self.scale, dtype=x.dtype)


def _torch_hooked(module: nn.Module) -> bool:
    """Whether a torch forward hook or pre-hook is set on ``module``, a module inside it, or globally."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


def _norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return rms_norm(cfg.emb_dim, cfg.ln_eps, cfg.norm_offset)
    return nn.LayerNorm(cfg.emb_dim, eps=cfg.ln_eps, bias=cfg.bias)


class _ParametersOnMeta(torch.overrides.TorchFunctionMode):
    """Modules made inside take no memory for their parameters: ``torch.empty`` (how ``nn.Linear``,
    ``nn.Embedding`` and the norms make theirs) gives meta tensors and ``torch.nn.init``'s functions do
    nothing, for a model whose state dict is then assigned. Everything else runs as it would: unlike
    ``with torch.device("meta")``, this does not import torch's compiler into a process that only loads."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor")
        if func is torch.empty:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: ``x + att(norm1(x))`` then ``x + ff(norm2(x))``.

    Normalising *before* each sublayer (GPT-2's choice) keeps the residual stream an identity
    path, which is what lets deep stacks train without warm-up tricks. Variants (``GPTConfig``):
    ``post_norms`` normalise each sublayer's output before it joins the stream
    (``x + post_norm1(att(norm1(x)))``: Gemma 2/3's sandwich; without ``pre_norms``, OLMo 2's
    ``x + post_norm1(att(x))``); ``parallel_residual`` adds both sublayers of the block's input at
    once (GPT-NeoX). ``layer`` is the block's index (``window_layers`` picks the sliding ones).
    """

    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        # Relative positions attend over a sliding window (context_length by default), so a
        # sequence may be longer than the context; learned positions only with an explicit one.
        window = cfg.attention_window if cfg.relative else cfg.window
        if not cfg.is_window_layer(layer):
            window = cfg.context_length  # a global layer of a mixed stack (relative positions)
        # Gemma 3: the window layers rotate with a RoPE base of their own.
        self.local_rope = local_rope = cfg.rope_local_theta is not None and cfg.is_window_layer(layer)
        self.norm1 = _norm(cfg) if cfg.pre_norms else None
        self.att = MultiHeadAttention(
            d_in=cfg.emb_dim,
            d_out=cfg.emb_dim,
            context_length=cfg.context_length,
            dropout=cfg.drop_rate,
            num_heads=cfg.n_heads,
            qkv_bias=cfg.qkv_bias,
            num_kv_heads=cfg.n_kv_heads,
            out_bias=cfg.bias,
            rope=cfg.pos == "rope",
            rope_theta=cfg.rope_local_theta if local_rope else cfg.rope_theta,
            rope_scaling=None if local_rope else cfg.rope_scaling,
            alibi=cfg.pos == "alibi",
            window=window,
            sinks=cfg.sinks,
            qk_norm=cfg.qk_norm,
            norm_eps=cfg.ln_eps,
            norm_offset=cfg.norm_offset,
            head_dim=cfg.head_size,
            scale=cfg.attn_scale,
            softcap=cfg.attn_softcap,
            rope_dim=cfg.rope_dim if cfg.pos == "rope" else None,
        )
        self.post_norm1 = _norm(cfg) if cfg.post_norms else None
        self.norm2 = _norm(cfg) if cfg.pre_norms else None
        self.ff = FeedForward(cfg)
        self.post_norm2 = _norm(cfg) if cfg.post_norms else None
        self.parallel_residual = cfg.parallel_residual
        self.drop_shortcut = nn.Dropout(cfg.drop_rate)
        self.hook: Any = None  # set by attnlab.interpret.hooks for the length of a hooked pass

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        kv_cache: KVCache | None = None,
        positions: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """``x (B, T, C)``; ``mask`` bool, broadcastable to ``(B, H, T, S)`` (the GPT builds it once);
        ``positions``/``rope``: see :meth:`MultiHeadAttention.attend`. ``last_only``: the last position's
        output alone, ``(B, 1, C)`` (a prefill's last block: its other positions' outputs are read by no
        one, while their keys and values still go to ``kv_cache``); the MLP then runs on that position
        only. Ignored while a hook is set, attnlab's on the block or its MLP, or a torch forward
        (pre-)hook on the block or a module inside it (a hook reads every position, as it would
        without the flag)."""
        hook = self.hook  # attnlab.interpret.hooks: hook(name, x) reads or replaces x (None: no cost)
        if hook is not None:
            x = hook("resid_pre", x)
        if getattr(hook, "split", False):  # a head's own input hooked (interpret.hooks): each head projects its copy
            heads = self._split_inputs(x, hook)
            att = self.att.attend(None, mask=mask, kv_cache=kv_cache, positions=positions, rope=rope, heads=heads)
        else:
            h = x if self.norm1 is None else self.norm1(x)
            att = self.att.attend(h, mask=mask, kv_cache=kv_cache, positions=positions, rope=rope)  # (B, T, C)
        if last_only and hook is None and self.ff.hook is None and not _torch_hooked(self):
            x, att = x[:, -1:], att[:, -1:]  # (B, 1, C)
        if self.post_norm1 is not None:
            att = self.post_norm1(att)
        att = self.drop_shortcut(att)
        if hook is not None:
            att = hook("attn_out", att)
        if self.parallel_residual:  # the MLP reads the block's input too, not x + att
            h, x = x, x + att  # (B, T, C) each
        else:
            x = x + att  # (B, T, C)
            if hook is not None:
                x = hook("resid_mid", x)
            h = x
        ff = self.ff(h if self.norm2 is None else self.norm2(h))
        if self.post_norm2 is not None:
            ff = self.post_norm2(ff)
        mlp = self.drop_shortcut(ff)
        if hook is not None:
            mlp = hook("mlp_out", mlp)
        x = x + mlp  # (B, T, C)
        if hook is not None:
            x = hook("resid_post", x)
        return x

    def _split_inputs(self, x: Tensor, hook: Any) -> tuple[Tensor, Tensor, Tensor]:
        """TransformerLens's split inputs: a copy of ``x (B, T, C)`` per head through the hooks of
        ``attn_in`` (where keys and values have as many heads as queries), then ``q_input`` ``(B, T, H, C)``,
        ``k_input`` and ``v_input`` ``(B, T, Hkv, C)``; each normalized by ``norm1``."""
        H, Hkv = self.att.num_heads, self.att.num_kv_heads

        def copies(n: int) -> Tensor:
            return x.unsqueeze(2).repeat(1, 1, n, 1)  # (B, T, n, C): a tensor of its own, for in-place hooks

        a = hook("attn_in", copies(H)) if Hkv == H else None
        q, k, v = (copies(H), copies(Hkv), copies(Hkv)) if a is None else (a, a.clone(), a.clone())
        q, k, v = hook("q_input", q), hook("k_input", k), hook("v_input", v)
        return (q, k, v) if self.norm1 is None else (self.norm1(q), self.norm1(k), self.norm1(v))


# --------------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------------
class GPT(nn.Module):
    """GPT-2-style decoder-only language model on attnlab attention.

    Args:
        config: a :class:`GPTConfig` (or a dict of its fields).

    ``model(idx)`` maps token ids ``idx (B, T)`` (int64, ``T <= context_length`` with learned
    positions; any ``T`` with relative ones, whose window slides) to logits
    ``(B, T, vocab_size)``; :meth:`loss` gives the mean next-token cross-entropy;
    :meth:`generate` / :meth:`stream` sample continuations with a KV cache.

    Building under ``with torch.device("meta"):`` allocates no memory, which is how to inspect
    a large preset (``GPT(GPTConfig.preset("gpt2-xl")).num_parameters()``).
    """

    def __init__(self, config: GPTConfig | dict[str, Any]) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = GPTConfig.from_dict(config)
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig or dict, got {type(config).__name__}")
        self.config = cfg = config
        self.tok_emb = TokenEmbedding(cfg.vocab_size, cfg.emb_dim, cfg.embed_scale)
        # Sized by context_length: one vector per *position*, not per token id (the tutorials'
        # BadLM_V2 sized it by vocab_size; see examples/badlm_v2.py). Relative positions need none.
        self.pos_emb = nn.Embedding(cfg.context_length, cfg.emb_dim) if cfg.pos == "learned" else None
        self.drop_emb = nn.Dropout(cfg.drop_rate)
        self.trf_blocks = nn.ModuleList([TransformerBlock(cfg, i) for i in range(cfg.n_layers)])
        # A layer whose RoPE angles the others share: {local_rope: layer} (two entries for Gemma 3).
        self.rope_sources = {b.local_rope: i for i, b in reversed(list(enumerate(self.trf_blocks)))}
        self.final_norm = _norm(cfg)
        self.out_head = Linear(cfg.emb_dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.out_head.weight = self.tok_emb.weight
        self.reset_parameters()

    # Initialisation ---------------------------------------------------------------------------
    def reset_parameters(self) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases, unit LayerNorms; the residual
        projections (attention ``out_proj``, MLP output) get N(0, 0.02 / sqrt(2 * n_layers)) so
        the residual stream's variance does not grow with depth."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, (nn.LayerNorm, nn.RMSNorm, OffsetRMSNorm)):
                module.reset_parameters()  # unit gains, zero biases
        std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for block in self.trf_blocks:
            nn.init.normal_(block.att.out_proj.weight, mean=0.0, std=std)
            nn.init.normal_(block.ff.layers[2].weight, mean=0.0, std=std)

    # Introspection ------------------------------------------------------------------------------
    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (tied weights counted once). ``exclude_embeddings`` leaves out
        the position embedding and, when untied, the token embedding (as in the scaling-law papers)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= 0 if self.pos_emb is None else self.pos_emb.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.tok_emb.weight.numel()
        return n

    @property
    def device(self) -> torch.device:
        return self.tok_emb.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_emb.weight.dtype

    def new_kv_caches(self, batch_size: int, max_length: int | None = None) -> list[KVCache]:
        """One preallocated :class:`~attnlab.attention.KVCache` per layer.

        GPT-2 (learned positions, no window): plain caches of ``max_length`` slots (default
        ``context_length``; more is pointless: positions stop at the context). With a window or
        relative positions: rolling caches of ``min(max_length, window + sinks)`` slots (``max_length``
        default: no limit), which is all the window ever needs, however long generation runs.
        """
        cfg = self.config
        if max_length is not None:
            positive_int("max_length", max_length)
        if not cfg.relative and max_length is not None and max_length > cfg.context_length:
            raise ValueError(f"max_length must be <= context_length={cfg.context_length}, got {max_length}")
        if not cfg.relative and cfg.window is None:
            n = cfg.context_length if max_length is None else max_length
            return [block.att.new_kv_cache(batch_size, n) for block in self.trf_blocks]
        caches = []
        for block in self.trf_blocks:
            ring = block.att.window + cfg.sinks  # (window_layers: each layer's own window)
            n = ring if max_length is None else min(max_length, ring)
            sinks = cfg.sinks if cfg.sinks < n else 0  # (a cache too short to ever wrap needs no pinned slots)
            caches.append(block.att.new_kv_cache(batch_size, n, rolling=True, sinks=sinks))
        return caches

    # Forward ------------------------------------------------------------------------------------
    def check_idx(self, idx: object, past: int = 0, *, values: bool = True, limit_length: bool = True) -> Tensor:
        """Type, shape, device and (``values``) id range of ``idx``; with ``limit_length`` also that
        ``past + T`` fits the context (generation slides its window instead)."""
        if not isinstance(idx, Tensor):
            raise TypeError(f"idx must be a torch.Tensor of token ids, got {type(idx).__name__}")
        if idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"idx must hold integer token ids (torch.long), got dtype {idx.dtype}; use idx.long()")
        if idx.dim() != 2:
            raise ValueError(
                f"idx must have shape (batch, tokens), got {tuple(idx.shape)}; for one sequence use idx.unsqueeze(0)"
            )
        T = idx.shape[1]
        if T == 0:
            raise ValueError("idx must contain at least one token, got shape " + str(tuple(idx.shape)))
        C = self.config.context_length
        if limit_length and not self.config.relative and past + T > C:
            raise ValueError(
                f"idx has {past + T} tokens{' (with the cache)' if past else ''}, more than context_length={C}; "
                f"crop it to the last {C} tokens (idx[:, -{C}:]) or use generate(), which slides the window"
            )
        if idx.device != self.device and self.device.type != "meta":
            raise ValueError(f"idx is on {idx.device} but the model is on {self.device}; use idx.to(model.device)")
        # On CUDA an id out of range is a device assert that poisons the context. The check costs a
        # host sync, so CUDA training skips it here: loss() checks idx and targets in one sync.
        if values and not (idx.is_cuda and self.training):
            self._check_id_values(idx)
        return idx

    def _check_id_values(self, idx: Tensor, targets: Tensor | None = None, ignore_index: int = -100) -> None:
        """Range-check ``idx`` (and ``targets``, except ``ignore_index`` entries) with one host sync."""
        if not can_read_values(idx):
            return
        V = self.config.vocab_size
        pairs = [(idx, None)] if targets is None else [(idx, None), (targets, ignore_index)]
        lo, hi, *t_range = _id_ranges(*pairs)
        if lo < 0 or hi >= V:
            raise ValueError(f"idx values must be in [0, vocab_size={V}), got min {lo}, max {hi}")
        if t_range:
            _check_targets_range(*t_range, V, ignore_index)

    def forward(
        self,
        idx: Tensor,
        *,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        kv_caches: list[KVCache] | None = None,
    ) -> Tensor:
        """Logits ``(B, T, vocab_size)`` for token ids ``idx (B, T)``.

        Args:
            idx: ``(B, T)`` int64 token ids.
            attention_mask: optional ``(B, S)`` bool (True = real token) or 0/1 int mask over every
                key the layers attend to: ``S = T`` without a cache, ``S = past + T`` with one.
                Padded positions are never attended to. Used for left-padded batches.
            position_ids: optional ``(B, T)`` or ``(T,)`` positions; by default ``past, ..., past+T-1``
                or, with ``attention_mask``, each row's count of real tokens before it (so a
                left-padded row gets the positions it would have alone).
            kv_caches: one :class:`KVCache` per layer (see :meth:`new_kv_caches`); the new keys and
                values are appended and attention covers all cached tokens.
        """
        idx, key_mask = self._check_forward(idx, attention_mask, position_ids, kv_caches)
        return self.decode_logits(idx, key_mask, kv_caches, position_ids=position_ids)

    def _check_forward(
        self, idx: object, attention_mask: object, position_ids: object, kv_caches: object
    ) -> tuple[Tensor, Tensor | None]:
        """:meth:`forward`'s arguments checked: ``(idx, key_mask (B, S) bool or None)``."""
        past = 0
        if kv_caches is not None:
            if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) != len(self.trf_blocks):
                raise ValueError(f"kv_caches must be a list of {len(self.trf_blocks)} KVCache objects (one per layer)")
            for i, c in enumerate(kv_caches):
                if not isinstance(c, KVCache):
                    raise TypeError(
                        f"kv_caches[{i}] must be an attnlab KVCache (see GPT.new_kv_caches), got {type(c).__name__}"
                    )
            past = kv_caches[0].seen
            if any(c.seen != past for c in kv_caches):
                raise ValueError(
                    f"kv_caches hold different numbers of tokens {[c.seen for c in kv_caches]}; "
                    f"reset() them all or make new ones with new_kv_caches()"
                )
        idx = self.check_idx(idx, past)
        B, T = idx.shape
        for cache, block in zip(kv_caches or (), self.trf_blocks, strict=False):
            cache.check_usable(B, idx.device, block.att)
        key_mask = (
            None if attention_mask is None else self.check_attention_mask(attention_mask, B, past + T, idx.device)
        )
        if position_ids is not None:
            if not isinstance(position_ids, Tensor) or position_ids.dtype not in (torch.int64, torch.int32):
                raise TypeError("position_ids must be an integer tensor")
            if position_ids.shape not in ((T,), (B, T)):
                raise ValueError(f"position_ids must have shape {(T,)} or {(B, T)}, got {tuple(position_ids.shape)}")
            if self.config.relative:
                if position_ids.numel() and int(position_ids.min()) < 0:
                    raise ValueError("position_ids must be >= 0")
            elif position_ids.numel() and not (
                0 <= int(position_ids.min()) <= int(position_ids.max()) < self.config.context_length
            ):
                raise ValueError(f"position_ids must be in [0, context_length={self.config.context_length})")
        return idx, key_mask

    def decode_logits(
        self,
        idx: Tensor,
        key_mask: Tensor | None = None,
        kv_caches: list[KVCache] | None = None,
        *,
        position_ids: Tensor | None = None,
        last_only: bool = False,
    ) -> Tensor:
        """:meth:`forward` on inputs the caller has checked (generation calls this once per token).

        ``key_mask`` is ``(B, S)`` bool (see :meth:`check_attention_mask`). ``last_only`` computes the
        logits of the last position only, ``(B, 1, V)``: all that sampling needs, and it spares the
        ``(T, emb) x (emb, vocab)`` head matmul of a prefill, and the last block's MLP on the other positions.
        """
        cfg = self.config
        B, T = idx.shape
        # (read only where needed: a compiled decoding step passes positions and reads no Python count)
        past = 0 if kv_caches is None or position_ids is not None else kv_caches[0].seen
        mask, ropes = None, {}
        if not (cfg.relative or cfg.window is not None):  # GPT-2: positions only in the embedding table
            if position_ids is None:
                if key_mask is not None:
                    # Count real tokens to the left: padding does not advance the position.
                    position_ids = (key_mask.long().cumsum(-1) - 1).clamp_(min=0)[:, past:]  # (B, T)
                else:
                    position_ids = torch.arange(past, past + T, device=idx.device)  # (T,)
            mask = None if key_mask is None else key_mask[:, None, None, :]  # (B, 1, 1, S): padding never attended
            x = self.tok_emb(idx) + self.pos_emb(position_ids)  # (B, T, C)
            # (slot caches, attention.SlotCache: the positions say which slots the new tokens fill)
            positions = position_ids.reshape(-1, T) if kv_caches is not None and kv_caches[0].static else None
        else:
            # Attention at explicit positions: None means past, past + 1, ... (the fast paths); padding
            # takes no position (-1) and each real token counts the real tokens before it.
            positions = None if position_ids is None else position_ids.reshape(-1, T)  # (1 or B, T)
            if key_mask is not None:
                counts = key_mask.long().cumsum(-1)[:, -T:] - 1  # (B, T)
                positions = (counts if positions is None else positions.expand(B, T)).masked_fill(~key_mask[:, -T:], -1)
            at = torch.arange(past, past + T, device=idx.device)[None] if positions is None else positions  # (1|B, T)
            x = self.tok_emb(idx)  # (B, T, C), times Gemma's embed_scale
            if cfg.pos == "learned":
                x = x + self.pos_emb(at.clamp(min=0))
            ropes = self.rope_angles(at, x.dtype)  # once for every layer (Gemma 3: two bases)
        x = self.drop_emb(x)
        last = len(self.trf_blocks) - 1  # with last_only, the block whose MLP runs on the last position alone
        for i, block in enumerate(self.trf_blocks):
            cache = None if kv_caches is None else kv_caches[i]
            rope = ropes.get(block.local_rope)
            x = block(x, mask=mask, kv_cache=cache, positions=positions, rope=rope, last_only=last_only and i == last)
        if last_only:
            x = x[:, -1:]  # (B, 1, C) (the last block's output already, unless a hook kept every position)
        return self.unembed(x)  # (B, T or 1, vocab_size)

    def rope_angles(self, at: Tensor, dtype: torch.dtype) -> dict[bool, tuple[Tensor, Tensor]]:
        """RoPE's cosines and sines at positions ``at (1 or B, T)``, ``(1 or B, 1, T, rope_dim)`` each, keyed
        by :attr:`TransformerBlock.local_rope`: block ``b`` takes ``ropes.get(b.local_rope)``. One entry, or
        two for Gemma 3, whose window layers rotate with a RoPE base of their own; empty without RoPE.
        Computed once for every layer (:meth:`decode_logits`, and the reruns of activation patching)."""
        if self.config.pos != "rope":
            return {}
        return {k: self.trf_blocks[i].att.rope_cos_sin(at, dtype) for k, i in self.rope_sources.items()}

    def unembed(self, x: Tensor) -> Tensor:
        """Logits ``(B, T, vocab_size)`` of the last block's output ``x (B, T, C)``: the final norm, the
        output head and, with ``logit_softcap`` (Gemma 2), ``cap * tanh(logits / cap)``; how
        :meth:`decode_logits` ends (and the reruns of activation patching, from a cached residual)."""
        logits = self.out_head(self.final_norm(x))  # (B, T, vocab_size)
        cap = self.config.logit_softcap
        if cap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = cap * torch.tanh(logits / cap)
        return logits

    @staticmethod
    def check_attention_mask(mask: object, B: int, S: int, device: torch.device | None = None) -> Tensor:
        """``attention_mask`` checked (a ``(B, S)`` bool or 0/1 tensor) as bool, on ``device`` (the
        tokens'; a mask made on another device follows them, as the tokens decide where the model runs)."""
        if not isinstance(mask, Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.shape != (B, S):
            raise ValueError(f"attention_mask must have shape (batch, keys) = {(B, S)}, got {tuple(mask.shape)}")
        if mask.dtype != torch.bool:
            if mask.is_floating_point() or mask.is_complex():
                raise TypeError(f"attention_mask must be bool or 0/1 integers, got dtype {mask.dtype}")
            if ((mask != 0) & (mask != 1)).any():  # (a 7 or a -3 is no answer to "is this a real token?")
                raise ValueError("attention_mask must be bool or 0/1 integers, got other integers")
            mask = mask != 0
        return mask if device is None else mask.to(device)

    def loss(
        self, idx: Tensor, targets: Tensor, *, ignore_index: int = -100, attention_mask: Tensor | None = None
    ) -> Tensor:
        """Mean next-token cross-entropy (nats per token) of ``targets (B, T)`` given ``idx (B, T)``.

        ``targets`` are usually ``idx`` shifted left by one; entries equal to ``ignore_index``
        (default -100, as ``F.cross_entropy``) do not count; every other entry must be in
        ``[0, vocab_size)`` and at least one must count (checked, so a bad id is a ValueError, not
        a CUDA device assert, and nothing to score is a ValueError, not a NaN loss).
        """
        _check_targets_and_ignore_index(targets, ignore_index)
        idx = self.check_idx(idx, values=False)  # type, shape, device
        if targets.shape != idx.shape:
            raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, got {tuple(targets.shape)}")
        if targets.device != idx.device:
            raise ValueError(f"targets is on {targets.device} but idx is on {idx.device}")
        self._check_id_values(idx, targets, ignore_index)  # idx and targets together: one host sync
        logits = self(idx, attention_mask=attention_mask)  # (B, T, V)
        return _lm_loss(logits, targets, ignore_index)  # lm_loss without re-checking (and re-syncing)

    # Training helpers ---------------------------------------------------------------------------
    def optimizer_groups(self, weight_decay: float) -> list[dict[str, Any]]:
        """nanoGPT's split: every parameter with ``dim >= 2`` (matmul weights, embeddings) is
        decayed; biases and LayerNorm parameters are not."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return [{"params": decay, "weight_decay": float(weight_decay)}, {"params": no_decay, "weight_decay": 0.0}]

    def configure_optimizer(
        self,
        weight_decay: float = 0.1,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        *,
        fused: bool | None = None,
    ) -> torch.optim.AdamW:
        """AdamW with decay / no-decay groups (see :meth:`optimizer_groups`).

        ``fused`` defaults to True on CUDA and the CPU (one kernel for all parameters instead of a
        Python loop of small ones), False elsewhere.
        """
        if not is_real(weight_decay) or weight_decay < 0:
            raise ValueError(f"weight_decay must be a non-negative float, got {weight_decay!r}")
        if not is_real(lr) or not lr > 0:
            raise ValueError(f"lr must be a positive float, got {lr!r}")
        if fused is None:
            fused = self.device.type in ("cuda", "cpu")
        kwargs: dict[str, Any] = {"fused": True} if fused else {}
        return torch.optim.AdamW(self.optimizer_groups(weight_decay), lr=lr, betas=betas, eps=eps, **kwargs)

    # Generation -----------------------------------------------------------------------------------
    # The functions of attnlab.generation, as methods: one parameter list, one docstring.
    generate = generation.generate
    stream = generation.stream

    # Hugging Face interop (the weight layouts live in attnlab.formats.hf) ------------------------------
    @classmethod
    def from_hf_gpt2(
        cls,
        model_or_state_dict: Any,
        *,
        n_heads: int | None = None,
        drop_rate: float | None = None,
        hf_config: Any = None,
    ) -> GPT:
        """Build a GPT holding the weights of a Hugging Face GPT-2.

        Args:
            model_or_state_dict: a ``transformers.GPT2LMHeadModel`` or ``GPT2Model``, or a state dict of
                one (keys with or without the ``transformer.`` prefix, e.g. a hub ``model.safetensors``).
            n_heads: heads per layer. Read from the model's config; a bare state dict does not record
                it, so it defaults to ``emb_dim // 64`` (true of every published GPT-2).
            drop_rate: dropout for training the converted model (default: the HF config's, or 0.1).
            hf_config: for a bare state dict, its ``GPT2Config`` or the dict of its ``config.json``
                (gives ``n_head``, ``layer_norm_epsilon``, ...).

        Returns:
            A ``GPT`` in eval mode, with the source's dtype and device, whose logits equal the source's.
        """
        fields, state = hf.gpt2_to_attnlab(
            model_or_state_dict, n_heads=n_heads, drop_rate=drop_rate, hf_config=hf_config
        )
        return cls._from_state(GPTConfig(**fields), state)

    def to_hf_gpt2_state_dict(self) -> dict[str, Tensor]:
        """A state dict that ``transformers.GPT2LMHeadModel.load_state_dict`` accepts (config from
        :func:`attnlab.formats.hf.to_hf_gpt2_config`)."""
        return hf.to_hf_gpt2_state_dict(self)

    @classmethod
    def from_hf_llama(cls, model_or_state_dict: Any, *, hf_config: Any = None, drop_rate: float = 0.0) -> GPT:
        """Build a GPT holding the weights of a Hugging Face Llama or Mistral (see :mod:`attnlab.formats.hf_llama`).

        Args:
            model_or_state_dict: a ``transformers.LlamaForCausalLM`` / ``MistralForCausalLM``, or its
                state dict (then ``hf_config`` is needed: heads, RoPE base, norm epsilon).
            hf_config: its config, or the dict of its ``config.json``.
            drop_rate: dropout for training the converted model.

        Returns:
            A ``GPT`` in eval mode, with the source's dtype and device: RoPE, RMSNorm, SwiGLU, grouped
            query heads and (Mistral) a sliding window, whose logits equal the source's.
        """
        fields, state = hf_llama.llama_to_attnlab(model_or_state_dict, hf_config=hf_config, drop_rate=drop_rate)
        return cls._from_state(GPTConfig(**fields), state)

    def to_hf_llama_state_dict(self) -> dict[str, Tensor]:
        """A state dict that ``transformers.LlamaForCausalLM`` (``MistralForCausalLM`` with a window)
        loads (config from :func:`attnlab.formats.hf_llama.to_hf_llama_config`)."""
        return hf_llama.to_hf_llama_state_dict(self)

    @classmethod
    def from_hf(cls, model_or_state_dict: Any, *, hf_config: Any = None, **kwargs: Any) -> GPT:
        """A GPT holding the weights of a Hugging Face model of any family attnlab reads: GPT-2
        (:meth:`from_hf_gpt2`), Llama, Mistral, Qwen2/2.5, Qwen3, Gemma, Gemma 2, Gemma 3 (text),
        Phi-3, OLMo 2, GPT-NeoX/Pythia (:mod:`attnlab.formats.families`), whichever the model (or
        ``hf_config``'s ``model_type``, or the state dict's names) is.

        Args:
            model_or_state_dict: a transformers model, or a state dict with Hugging Face's names.
            hf_config: its config (a transformers config or the dict of ``config.json``).
            kwargs: ``drop_rate`` (and, for GPT-2, :meth:`from_hf_gpt2`'s options).

        Returns:
            A ``GPT`` in eval mode, with the source's dtype and device, whose logits equal the source's.
        """
        cfg = hf_config if hf_config is not None else getattr(model_or_state_dict, "config", None)
        model_type = cfg.get("model_type") if isinstance(cfg, dict) else getattr(cfg, "model_type", None)
        if model_type is None and isinstance(model_or_state_dict, dict):
            llama_keys = any(k.removeprefix("model.").startswith("embed_tokens") for k in model_or_state_dict)
            model_type = "llama" if llama_keys else "gpt2"
        if model_type in families.MODEL_TYPES:
            fields, state = families.to_attnlab(model_or_state_dict, hf_config=hf_config, **kwargs)
            return cls._from_state(GPTConfig(**fields), state)
        if model_type not in (None, "gpt2"):
            raise ValueError(
                f"attnlab reads the model types gpt2, {', '.join(families.MODEL_TYPES)}; got {model_type!r}"
            )
        return cls.from_hf_gpt2(model_or_state_dict, hf_config=hf_config, **kwargs)

    @classmethod
    def from_gguf(
        cls,
        path: str | os.PathLike[str] | Any,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> GPT:
        """Load a GGUF file (llama.cpp, Ollama, LM Studio) of the architectures llama, qwen2, qwen3,
        gemma, gemma2, gemma3, phi3, olmo2 or gptneox, in any of the quantization types the ``gguf``
        package dequantizes (see :mod:`attnlab.formats.gguf`).

        By default (``dtype=None``) every matrix stays as the file stores it (``Q4_K``, ``Q8_0``,
        ``F16``, ...): an :class:`attnlab.quantized.QuantizedTensor`, frozen, that computes in float32
        with the same numbers the dequantized model has, in about the file's size of memory.
        ``dtype=torch.float32`` (or another floating-point dtype) gives a dense model of that dtype.

        ``path`` is the file, or what :func:`attnlab.formats.gguf.read_gguf` returned for it. The
        file is converted one tensor at a time. Raises ``ValueError`` naming the file when it is
        truncated, corrupt or not supported."""
        from attnlab.formats.gguf import GGUFModel, read_gguf

        if not isinstance(path, (str, os.PathLike, GGUFModel)):
            raise TypeError(f"path must be a GGUF file's path (str or os.PathLike), got {type(path).__name__}")
        device = check_device("device", device)  # (before the file is read)
        read = path if isinstance(path, GGUFModel) else read_gguf(path, dtype=dtype, keep_reader=False)
        return cls._from_state(GPTConfig(**read.fields), read.state).to(device=device)

    @classmethod
    def _from_state(cls, config: GPTConfig, state: dict[str, Tensor]) -> GPT:
        with _ParametersOnMeta():
            model = cls(config)
        model.load_state_dict(state, strict=not config.tie_embeddings, assign=True)
        if config.tie_embeddings:
            model.out_head.weight = model.tok_emb.weight
        model._freeze_quantized()
        return model.eval()

    def dequantize_(self) -> GPT:
        """Every weight kept in a file's blocks made a dense parameter of its compute dtype, trainable, in
        place (tied weights stay tied); returns the model."""
        for module in self.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                if is_quantized(p):
                    setattr(module, name, nn.Parameter(p.dequantize()))
        if self.config.tie_embeddings:
            self.out_head.weight = self.tok_emb.weight
        return self

    def _freeze_quantized(self) -> None:
        for p in self.parameters():
            if is_quantized(p):  # a weight kept in a file's blocks is frozen (LoRA adapts it)
                p.requires_grad_(False)

    @classmethod
    def from_pretrained(
        cls,
        name: str | os.PathLike[str] = "gpt2",
        *,
        cache_dir: str | os.PathLike[str] | None = None,
        revision: str | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> GPT:
        """Load OpenAI's GPT-2 weights, or a model of another family :meth:`from_hf` reads (Llama,
        Mistral, Qwen, Gemma, Phi-3, OLMo 2, GPT-NeoX/Pythia).

        Args:
            name: ``gpt2`` (= ``gpt2-small``), ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl`` (always the
                published models: a local directory of such a name is ``./gpt2``), another Hub repository
                id (e.g. ``distilgpt2``, ``meta-llama/Llama-3.2-1B``), a local directory with ``config.json``
                and safetensors weights (``model.safetensors`` or the shards of ``model.safetensors.index.json``,
                as ``save_pretrained`` writes), or a GGUF file (read by :meth:`from_gguf`: dense in ``dtype``,
                or its matrices kept quantized without one). A local path is never sent to the Hub: a
                missing one is a ``FileNotFoundError`` saying so; a ``pathlib.Path`` is always a local path.
            cache_dir, revision: passed to ``huggingface_hub`` (default cache: ``~/.cache/huggingface``,
                or ``$HF_HOME``); set ``HF_HUB_OFFLINE=1`` to use only the cache.
            device, dtype: where to put the model (default: the weights' own dtype, often bfloat16
                for Llama-family models).

        Weights are read from safetensors (nothing is unpickled). When the weights are neither in the
        cache nor downloadable, raises ``FileNotFoundError`` with one sentence saying what to do.
        The tokenizer of a Llama-family model is its ``tokenizer.json``
        (:class:`attnlab.tokenizers.HFTokenizer`).
        """
        from attnlab.formats.gguf import is_gguf

        device = check_device("device", device)  # (before anything is read or downloaded)
        check_float_dtype("dtype", dtype)
        if isinstance(name, os.PathLike):  # a path: never a Hub id, nor a published GPT-2's name
            path = Path(name).expanduser()
            if not path.exists():
                raise FileNotFoundError(f"{path}: no such file or directory (a model directory or a GGUF file)")
            name = str(path.resolve())
        if isinstance(name, str) and name.lower() not in hf.PRETRAINED and is_gguf(name):
            if not Path(name).expanduser().is_file():
                raise FileNotFoundError(f"{name}: no such file (a GGUF file)")
            return cls.from_gguf(name, dtype=dtype, device=device)
        hf_config, state = hf.read_pretrained(name, cache_dir=cache_dir, revision=revision)
        model_type = hf_config.get("model_type", "gpt2")
        if model_type in families.MODEL_TYPES:
            model = cls.from_hf(state, hf_config=hf_config)
        elif model_type == "gpt2":
            model = cls.from_hf_gpt2(state, hf_config=hf_config)
        else:
            raise ValueError(
                f"{name!r} is a {model_type!r} model; attnlab reads the model types gpt2, "
                f"{', '.join(families.MODEL_TYPES)}"
            )
        return model.to(device=device, dtype=dtype)

    # Saving and loading -------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created if needed).

        Each file is written to a temporary file in the same directory, fsynced and renamed over
        the old one, so a crash leaves either the old or the new file, never a torn one. Tied
        weights are stored once. Quantized weights (a GGUF file's blocks) stay in their blocks
        (:func:`attnlab.quantized.to_safetensors`): the file is about the GGUF file's size, and
        :meth:`load` gives back the same weights. Returns the directory.
        """
        save_file = import_safetensors().torch.save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        if self.config.tie_embeddings:
            state.pop("out_head.weight", None)
        tensors, layout = to_safetensors({k: v if is_quantized(v) else v.detach() for k, v in state.items()})
        tensors = {k: v.contiguous().cpu() for k, v in tensors.items()}
        with atomic_path(d / WEIGHTS_NAME) as tmp:  # (written from the tensors' memory: no copy of the model)
            save_file(tensors, tmp, metadata={"format": "pt", "attnlab": "GPT", **layout})
        atomic_write_json(d / CONFIG_NAME, self.config.to_dict())
        return d

    @classmethod
    def load(
        cls,
        directory: str | os.PathLike[str],
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> GPT:
        """Load a model written by :meth:`save` (safetensors + JSON only: nothing is unpickled)."""
        device = check_device("device", device)
        check_float_dtype("dtype", dtype)
        safetensors = import_safetensors()
        SafetensorError, safe_open = safetensors.SafetensorError, safetensors.safe_open

        d = Path(directory)
        cfg_path, w_path = d / CONFIG_NAME, d / WEIGHTS_NAME
        for p in (cfg_path, w_path):
            if not p.is_file():
                raise FileNotFoundError(f"{p} not found: not a directory written by GPT.save()")
        try:  # a config.json of [1], null or {"n_layers": "x"} is a file error, not a TypeError
            config = GPTConfig.from_dict(read_json(cfg_path, "model config"))
        except TypeError as e:
            raise ValueError(f"{cfg_path} is not a GPT configuration ({e})") from None
        try:
            with safe_open(str(w_path), framework="pt") as f:
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
                metadata = f.metadata()
            state = from_safetensors(tensors, metadata, str(w_path))
        except (SafetensorError, OSError, RuntimeError) as e:  # (RuntimeError: safetensors' own, for some)
            if not w_path.is_file():  # removed since it was found (a run pruning an old step)
                raise FileNotFoundError(f"{w_path} was removed while it was being read") from None
            if isinstance(e, RuntimeError):
                raise
            raise ValueError(f"{w_path} is not a readable safetensors file ({e})") from None
        with torch.device("meta"):
            model = cls(config)
        if config.tie_embeddings:
            state.pop("out_head.weight", None)
        missing, unexpected = model._check_state_keys(state)
        if missing or unexpected:
            raise ValueError(f"{w_path} does not match {cfg_path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
        dense = {k: t for k, t in state.items() if not is_quantized(t)}
        common = max({t.dtype for t in dense.values()}, key=[t.dtype for t in dense.values()].count)
        odd = [f"{k} ({t.dtype})" for k, t in sorted(dense.items()) if t.dtype != common or not t.is_floating_point()]
        if odd or not common.is_floating_point:
            raise ValueError(
                f"{w_path} must hold tensors of one floating-point dtype, as GPT.save() writes; "
                f"most are {common}, but not {odd[:5] or 'floating point'}"
            )
        model.load_state_dict(state, strict=False, assign=True)
        if config.tie_embeddings:
            model.out_head.weight = model.tok_emb.weight
        model._freeze_quantized()
        return model.to(device=device, dtype=dtype)

    def _check_state_keys(self, state: dict[str, Tensor]) -> tuple[list[str], list[str]]:
        own = self.state_dict()  # once: building it walks every module
        expected = set(own)
        if self.config.tie_embeddings:
            expected.discard("out_head.weight")
        missing = sorted(expected - set(state))
        unexpected = sorted(set(state) - expected)
        for k in sorted(expected & set(state)):
            want = tuple(own[k].shape)
            if tuple(state[k].shape) != want:
                unexpected.append(f"{k} (shape {tuple(state[k].shape)}, expected {want})")
        return missing, unexpected
