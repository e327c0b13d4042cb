"""GGUF files (llama.cpp, Ollama, LM Studio): metadata, tensors, tokenizer and chat template.

A GGUF file is one header of typed key/value metadata (``llama.block_count``,
``tokenizer.ggml.tokens``, ``tokenizer.chat_template``, ...), a table of tensors (llama.cpp names,
shapes, quantization types) and the tensors' bytes. This module reads it with the ``gguf`` package's
memory-mapped :class:`gguf.GGUFReader` and turns it into what a Hugging Face directory holds:

* the metadata into a ``config.json``-style dict (``model_type``, ``hidden_size``,
  ``num_attention_heads``, ``rope_theta``, ...), through one data-driven table per llama.cpp
  architecture (:data:`ARCHITECTURES`);
* the tensors into Hugging Face names (``blk.3.attn_q.weight`` -> ``layers.3.self_attn.q_proj.weight``),
  one at a time, dequantized by ``gguf.quants.dequantize``, with what llama.cpp's converter changed
  put back, so the result is exactly the Hugging Face checkpoint it came from:

  * Llama (``llama``): the converter permutes the rows of the query and key projections (it pairs
    RoPE's rotated halves as neighbours, ``(x0, x1), (x2, x3), ...``, where Hugging Face rotates
    ``x[:hd/2]`` with ``x[hd/2:]``). The other families rotate halves in llama.cpp too (its
    "NEOX" RoPE) and are stored unpermuted.
  * Gemma 1/2/3: every norm weight is stored as ``1 + w`` (llama.cpp multiplies by it); ``1`` is
    subtracted. The file records neither Gemma's query scale (llama.cpp: the head size, but width /
    heads for the 27B models, recognised by their layer count, as llama.cpp does) nor Gemma 1/2's
    RoPE base (10,000) nor, for Gemma 3, the window pattern (five window layers in six) unless
    ``attention.sliding_window_pattern`` says otherwise; ``rope.freq_base_swa`` is Gemma 3's local base.
  * Phi-3: ``attn_qkv`` and ``ffn_up`` are Hugging Face's fused ``qkv_proj`` and ``gate_up_proj``
    as they are; ``rope.dimension_count`` gives the partial rotary fraction.
  * GPT-NeoX: the converter reorders the per-head fused ``query_key_value`` (``q0 k0 v0 q1 ...``)
    as all queries, all keys, all values: put back per head.

From there the Hugging Face mapping (:func:`attnlab.formats.families.to_attnlab`, whose table also
gives the llama.cpp tensor names) makes the attnlab model, so a new family needs only a row of
metadata keys here. The tokenizer stored in the file is built by
:class:`attnlab.tokenizers.HFTokenizer` (it reads ``.gguf`` paths too).

====================  ==============================  ==========================================
llama.cpp             Hugging Face ``model_type``     refused (a clear ValueError)
====================  ==============================  ==========================================
llama                 llama
qwen2, qwen3          qwen2, qwen3
gemma, gemma2         gemma, gemma2
gemma3                gemma3_text
phi3                  phi3
olmo2                 olmo2, olmo3 (with a window)    OLMo 3's RoPE scaling other than YaRN
gptneox               gpt_neox
====================  ==============================  ==========================================

    model = GPT.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")      # float32 on the CPU

Every defect of a file (bad magic or version, a truncated header, tensor data past the end, an
unknown quantization type, shapes that disagree with the metadata, sizes out of range) is one
``ValueError`` naming the file, never a traceback from deep inside numpy or a silently wrong model.
"""

from __future__ import annotations

import gc
import math
import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import numpy as np
import torch
from torch import Tensor

from attnlab.checks import finite_real, is_int
from attnlab.files import GGUF_MAGIC, open_gguf
from attnlab.formats import families
from attnlab.gguf_vocab import is_gguf_file
from attnlab.positions import llama3_scaling_from_factors, rope_scaling_type
from attnlab.quantized import FORMATS, QuantizedTensor, is_quantized

__all__ = [
    "ARCHITECTURES",
    "GGUF_MAGIC",
    "GGUFHeader",
    "GGUFModel",
    "is_gguf",
    "read_gguf",
    "read_gguf_config",
    "read_gguf_header",
    "read_gguf_metadata",
]


@dataclass(frozen=True)
class Architecture:
    """How one llama.cpp architecture's metadata and tensors read as a Hugging Face model.

    Attributes:
        model_type: the Hugging Face ``model_type`` it becomes; its row of
            :data:`attnlab.formats.families.FAMILIES` names the tensors (:func:`~attnlab.formats.families.gguf_tensors`:
            a tensor not there is refused, never silently dropped).
        config: ``{config.json key: GGUF key}``; ``{arch}`` in a GGUF key is the architecture's name.
        permuted: the llama.cpp tensors whose rows the converter permuted for its RoPE layout (only
            Llama's: the other families rotate halves, as Hugging Face does, and are stored as is).
        defaults: ``config.json`` values the converter does not write (llama.cpp's own defaults).
        extra: the rest of the config that is not a plain key (window layers, RoPE parts, ...):
            ``extra(cfg, meta, arch_name) -> cfg``.
        norm_shift: what the converter added to every norm weight (Gemma's ``(1 + w)`` gains are
            stored as ``1 + w``: subtracted here, so the state dict is Hugging Face's).
        partial_rotary: ``rope.dimension_count`` may be less than the head size (the fraction of
            each head that rotates: Phi-3, GPT-NeoX); elsewhere it must be the whole head.
        qkv_per_head: the converter reordered a per-head fused query/key/value tensor (GPT-NeoX's
            ``q0 k0 v0 q1 k1 v1 ...``) as all queries, all keys, all values: put back here.
    """

    model_type: str
    config: dict[str, str]
    permuted: tuple[str, ...] = ()
    defaults: dict[str, Any] = field(default_factory=dict)
    extra: Callable[[dict[str, Any], dict[str, Any], str], dict[str, Any]] | None = None
    partial_rotary: bool = False
    norm_shift: float = 0.0
    qkv_per_head: bool = False


_SIZES = {
    "max_position_embeddings": "{arch}.context_length",
    "hidden_size": "{arch}.embedding_length",
    "num_hidden_layers": "{arch}.block_count",
    "intermediate_size": "{arch}.feed_forward_length",
    "num_attention_heads": "{arch}.attention.head_count",
}
_LLAMA_CONFIG = _SIZES | {
    "num_key_value_heads": "{arch}.attention.head_count_kv",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon",
    "rope_theta": "{arch}.rope.freq_base",
    "head_dim": "{arch}.attention.key_length",
    "vocab_size": "{arch}.vocab_size",
}
_NEOX_CONFIG = _SIZES | {
    "layer_norm_eps": "{arch}.attention.layer_norm_epsilon",
    "use_parallel_residual": "{arch}.use_parallel_residual",
    "rotary_emb_base": "{arch}.rope.freq_base",
    "vocab_size": "{arch}.vocab_size",
}
_GEMMA = {"rope_theta": 10_000.0, "hidden_activation": "gelu_pytorch_tanh"}
_SOFTCAP = {
    "attn_logit_softcapping": "{arch}.attn_logit_softcapping",
    "final_logit_softcapping": "{arch}.final_logit_softcapping",
    "sliding_window": "{arch}.attention.sliding_window",
}


def _layer_types(meta: dict[str, Any], arch_name: str, n_layers: int, pattern: int) -> list[str]:
    """``layer_types``: which layers slide, as llama.cpp decides: ``attention.sliding_window_pattern`` per
    layer (an array of booleans) or as a period ``n`` (the last layer of every ``n`` is global), else ``pattern``."""
    key = f"{arch_name}.attention.sliding_window_pattern"
    given = meta.get(key, pattern)
    if isinstance(given, list):
        if len(given) != n_layers or not all(isinstance(b, bool) for b in given):
            raise ValueError(f"{key} must be {n_layers} booleans, got {given!r}")
    elif not is_int(given) or given < 0:
        raise ValueError(f"{key} must be a non-negative integer or an array of booleans, got {given!r}")
    else:
        given = [given == 0 or i % given < given - 1 for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in given]


def _attention_scale(cfg: dict[str, Any], big: int) -> int:
    """Gemma 2/3's ``query_pre_attn_scalar``, which the file does not record: llama.cpp scales by
    the head size, except for the 27B models (``big`` layers), by width / heads."""
    width_per_head = cfg["hidden_size"] // cfg["num_attention_heads"]
    return width_per_head if cfg["num_hidden_layers"] == big else cfg.get("head_dim", width_per_head)


def _gemma2_extra(cfg: dict[str, Any], meta: dict[str, Any], arch_name: str) -> dict[str, Any]:
    cfg.setdefault("sliding_window", 4096)  # llama.cpp's default for Gemma 2
    cfg["layer_types"] = _layer_types(meta, arch_name, cfg["num_hidden_layers"], 2)
    cfg["query_pre_attn_scalar"] = _attention_scale(cfg, big=46)
    return cfg


def _gemma3_extra(cfg: dict[str, Any], meta: dict[str, Any], arch_name: str) -> dict[str, Any]:
    n = cfg["num_hidden_layers"]
    if cfg.get("sliding_window"):
        cfg["layer_types"] = _layer_types(meta, arch_name, n, 6)
    else:
        cfg["layer_types"] = ["full_attention"] * n
        cfg.pop("sliding_window", None)
    cfg["query_pre_attn_scalar"] = _attention_scale(cfg, big=62)
    local = meta.get(f"{arch_name}.rope.freq_base_swa", 10_000.0)  # llama.cpp's default local base
    if not isinstance(local, (int, float)) or not math.isfinite(local) or local <= 0:
        raise ValueError(f"{arch_name}.rope.freq_base_swa must be a positive number, got {local!r}")
    full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta", 1_000_000.0)}
    full |= cfg.pop("rope_scaling", None) or {}  # linear scaling: the global layers only, as llama.cpp
    cfg["rope_parameters"] = {
        "full_attention": full,
        "sliding_attention": {"rope_type": "default", "rope_theta": float(local)},
    }
    return cfg


def _phi3_extra(cfg: dict[str, Any], meta: dict[str, Any], arch_name: str) -> dict[str, Any]:
    if not cfg.get("sliding_window"):  # the converter writes 0 for "none"
        cfg.pop("sliding_window", None)
    return cfg


def _olmo2_extra(cfg: dict[str, Any], meta: dict[str, Any], arch_name: str) -> dict[str, Any]:
    window = meta.get(f"{arch_name}.attention.sliding_window")
    if not window:
        return cfg
    # OLMo 3: llama.cpp's converter writes it as olmo2 with a window, which its loader gives to three
    # layers in four (the fourth attends to everything), as transformers' Olmo3Config does by default
    if not is_int(window) or window < 1:
        raise ValueError(f"{arch_name}.attention.sliding_window must be a positive integer, got {window!r}")
    # (or as the file's ``sliding_window_pattern`` says, one boolean a layer, which newer converters write)
    types = _layer_types(meta, arch_name, cfg["num_hidden_layers"], 4)
    # Its YaRN (OLMo 3's long context) scales the full layers only; the window layers keep plain RoPE of
    # the same base, as in llama.cpp's olmo2 graph and transformers' Olmo3 model
    kind = rope_scaling_type(cfg.get("rope_scaling"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"RoPE scaling {kind!r} in an olmo2 file with a sliding window (OLMo 3) is not supported yet")
    return cfg | {"model_type": "olmo3", "sliding_window": int(window), "layer_types": types}


# One row per llama.cpp architecture (``general.architecture``), each checked against transformers
# by tests/test_gguf.py (llama) and tests/test_gguf_families.py (the others).
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", _LLAMA_CONFIG, permuted=("attn_q", "attn_k")),
    "qwen2": Architecture("qwen2", _LLAMA_CONFIG),
    "qwen3": Architecture("qwen3", _LLAMA_CONFIG),
    "gemma": Architecture("gemma", _LLAMA_CONFIG, defaults=_GEMMA, norm_shift=1.0),
    "gemma2": Architecture("gemma2", _LLAMA_CONFIG | _SOFTCAP, defaults=_GEMMA, extra=_gemma2_extra, norm_shift=1.0),
    "gemma3": Architecture(
        "gemma3_text",
        _LLAMA_CONFIG | _SOFTCAP,
        defaults={"hidden_activation": "gelu_pytorch_tanh"},
        extra=_gemma3_extra,
        norm_shift=1.0,
    ),
    "phi3": Architecture(  # attn_qkv and ffn_up are HF's fused qkv_proj and gate_up_proj as they are
        "phi3",
        _LLAMA_CONFIG | {"sliding_window": "{arch}.attention.sliding_window"},
        extra=_phi3_extra,
        partial_rotary=True,
    ),
    "olmo2": Architecture("olmo2", _LLAMA_CONFIG, extra=_olmo2_extra),
    "gptneox": Architecture(
        "gpt_neox",
        _NEOX_CONFIG,
        defaults={"rotary_emb_base": 10_000.0, "hidden_act": "gelu", "layer_norm_eps": 1e-5},
        partial_rotary=True,
        qkv_per_head=True,
    ),
}
# What each architecture's Hugging Face family names its tensors: {llama.cpp name: HF name}.
_TENSORS = {name: families.gguf_tensors(arch.model_type) for name, arch in ARCHITECTURES.items()}
SUPPORTED = tuple(ARCHITECTURES)
# RoPE scalings llama.cpp stores as tensors, read into the config (of these architectures) instead of weights
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's divisors (llama)
LONGROPE = ("rope_factors_short.weight", "rope_factors_long.weight")  # Phi-3's LongRoPE divisors (phi3)
_READ_INTO_CONFIG = {"llama": (ROPE_FREQS,), "phi3": LONGROPE}
# Tensors some files carry that change the model in ways attnlab does not read yet: refused by name.
_REFUSED_TENSORS = {
    ROPE_FREQS: "RoPE frequency factors (read for llama files only)",
    LONGROPE[0]: "LongRoPE factors (read for phi3 files only)",
    LONGROPE[1]: "LongRoPE factors (read for phi3 files only)",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
_FLOATS = ("rms_norm_eps", "layer_norm_eps", "rope_theta", "rotary_emb_base", "attn_logit_softcapping",
           "final_logit_softcapping")  # fmt: skip


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a GGUF file: ends in ``.gguf`` or starts with the bytes ``GGUF``. A directory
    never does, however it is named (a Hugging Face model's folder called ``*.gguf`` is read as a folder)."""
    p = Path(path).expanduser()
    return not p.is_dir() and (p.suffix.lower() == ".gguf" or (p.is_file() and is_gguf_file(p)))


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise ImportError("reading GGUF files needs the 'gguf' package: pip install 'attnlab[gguf]'") from None
    return gguf


def read_gguf_metadata(reader: Any, *, skip_arrays: bool = True) -> dict[str, Any]:
    """The file's metadata as ``{key: value}`` (strings decoded, one-element arrays unwrapped).

    With ``skip_arrays`` the arrays of more than 64 elements (the tokenizer's 50,000 tokens and
    merges) are left out; read them with ``reader.fields[key].contents()`` when needed."""
    gguf = _import_gguf()
    out: dict[str, Any] = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY and skip_arrays and len(f.data) > 64:
            continue
        try:
            out[key] = f.contents()
        except (UnicodeDecodeError, IndexError, ValueError) as e:
            raise ValueError(f"metadata {key!r} does not decode ({type(e).__name__})") from None
    return out


@dataclass
class GGUFModel:
    """What :func:`read_gguf` returns.

    Attributes:
        path: the file.
        architecture: ``general.architecture`` (llama.cpp's name, e.g. ``llama``).
        config: the Hugging Face ``config.json`` it amounts to.
        fields: the :class:`~attnlab.GPTConfig` fields.
        state: the attnlab state dict (dtype as asked).
        metadata: the file's scalar metadata (see :func:`read_gguf_metadata`).
        quantization: ``{GGML type name: tensor count}``, e.g. ``{"Q4_1": 210, "F32": 61}``.
        reader: the open ``gguf.GGUFReader`` (its tokenizer metadata, without parsing the header again).
    """

    path: Path
    architecture: str
    config: dict[str, Any]
    fields: dict[str, Any]
    state: dict[str, Tensor] = field(repr=False)
    metadata: dict[str, Any] = field(repr=False)
    quantization: dict[str, int] = field(default_factory=dict)
    reader: Any = field(default=None, repr=False)


def _config(arch_name: str, arch: Architecture, meta: dict[str, Any], reader: Any) -> dict[str, Any]:
    """The ``config.json`` dict of the metadata, each value checked for type and range."""
    cfg: dict[str, Any] = {"model_type": arch.model_type, "hidden_act": "silu", **arch.defaults}
    for hf_key, gguf_key in arch.config.items():
        key = gguf_key.format(arch=arch_name)
        if key in meta:
            cfg[hf_key] = meta[key]
    if "vocab_size" not in cfg and "tokenizer.ggml.tokens" in reader.fields:
        cfg["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    required = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [arch.config.get(k, k).format(arch=arch_name) for k in required if k not in cfg]
    if missing:
        raise ValueError(f"its metadata lacks {', '.join(missing)}")
    for k, gguf_key in arch.config.items():
        if k not in cfg:
            continue
        v, name = cfg[k], gguf_key.format(arch=arch_name)
        if k in _FLOATS:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
            cfg[k] = float(v)
        elif k == "use_parallel_residual":
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be a boolean, got {v!r}")
        elif not is_int(v) or not 0 <= v <= 1 << 31 or (v == 0 and k != "sliding_window"):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    heads, kv = cfg["num_attention_heads"], cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    if heads % kv:
        raise ValueError(f"{heads} attention heads do not split into {kv} key/value heads (head_count_kv)")
    if cfg["hidden_size"] % heads and "head_dim" not in cfg:
        raise ValueError(f"embedding_length={cfg['hidden_size']} is not divisible by head_count={heads}")
    rot = meta.get(f"{arch_name}.rope.dimension_count")
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // heads)
    if arch.partial_rotary:  # the fraction of each head that rotates
        rot = head_dim if rot is None else rot
        if not is_int(rot) or not 0 < rot <= head_dim or rot % 2:
            raise ValueError(f"rope.dimension_count must be an even integer up to the head size {head_dim}, got {rot}")
        cfg["rotary_pct" if arch.model_type == "gpt_neox" else "partial_rotary_factor"] = rot / head_dim
    elif rot is not None and rot != head_dim:
        raise ValueError(f"rope.dimension_count={rot!r}: attnlab's {arch_name} rotates whole heads of {head_dim}")
    kind = meta.get(f"{arch_name}.rope.scaling.type", "none")
    longrope = {t.name: t for t in reader.tensors if t.name in LONGROPE}
    if longrope and arch.model_type == "phi3":
        cfg["rope_scaling"] = _longrope(longrope, meta, arch_name, cfg)
    elif kind not in ("none", None):
        cfg["rope_scaling"] = _rope_scaling(kind, meta, arch_name)
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None and arch.model_type == "llama":  # Llama 3.1 and 3.2: their scaling as divisors
        if "rope_scaling" in cfg or freqs.tensor_type.name != "F32":
            raise ValueError(f"tensor {ROPE_FREQS!r} must be float32 and the file's only RoPE scaling")
        try:
            divisors = torch.from_numpy(np.array(freqs.data))  # (head_dim / 2,)
            scaling = llama3_scaling_from_factors(divisors, head_dim, cfg.get("rope_theta", 10_000.0))
        except ValueError as e:
            raise ValueError(f"tensor {ROPE_FREQS!r}: {e}") from None
        if scaling is not None:
            cfg["rope_scaling"] = scaling
    cfg["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    if arch.model_type == "llama":  # llama.cpp uses a Llama's biases where the file has them
        names = {re.sub(r"^blk\.\d+\.", "blk.{i}.", t.name) for t in reader.tensors}
        cfg["attention_bias"] = any(f"blk.{{i}}.attn_{p}.bias" in names for p in ("q", "k", "v", "output"))
        cfg["mlp_bias"] = any(f"blk.{{i}}.ffn_{p}.bias" in names for p in ("gate", "up", "down"))
    return arch.extra(cfg, meta, arch_name) if arch.extra is not None else cfg


def _rope_scaling(kind: str, meta: dict[str, Any], arch_name: str) -> dict[str, Any]:
    """The Hugging Face ``rope_scaling`` of a file's ``rope.scaling.*`` metadata: linear, or YaRN (its
    factor, original context and ramp's bounds; llama.cpp computes YaRN as transformers does)."""
    key = f"{arch_name}.rope.scaling.{{}}".format
    factor, original = meta.get(key("factor")), meta.get(key("original_context_length"))
    if kind not in ("linear", "yarn") or not finite_real(factor) or factor <= 0:
        raise ValueError(f"RoPE scaling {kind!r} (factor {factor!r}) is not supported yet (linear and yarn are)")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    # DeepSeek's log multiplier and the factors llama.cpp's options override: not read yet, so refused
    other = [n for n in ("yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor") if key(n) in meta]
    if other:
        raise ValueError(f"YaRN scaling with {', '.join(key(n) for n in other)} is not supported yet")
    if not is_int(original) or original < 1:
        raise ValueError(f"YaRN scaling needs a positive integer {key('original_context_length')}, got {original!r}")
    scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    # (attn_factor: the converter's copy of the config's attention_factor, OLMo 3's for one)
    named = (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"), ("attn_factor", "attention_factor"))
    for name, hf_name in named:
        if key(name) in meta:
            scaling[hf_name] = meta[key(name)]
    return scaling


def _longrope(tensors: dict[str, Any], meta: dict[str, Any], arch_name: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's LongRoPE ``rope_scaling`` from its two divisor tensors and ``rope.scaling.*`` metadata."""
    key = f"{arch_name}.rope.scaling.{{}}".format
    if set(tensors) != set(LONGROPE) or any(t.tensor_type.name != "F32" for t in tensors.values()):
        raise ValueError(f"LongRoPE needs both {LONGROPE[0]!r} and {LONGROPE[1]!r}, float32")
    kind, original = meta.get(key("type"), "longrope"), meta.get(key("original_context_length"))
    if kind != "longrope" or not is_int(original) or original < 1:
        raise ValueError(f"LongRoPE needs a positive integer {key('original_context_length')} (and no other scaling)")
    short, long = (np.array(tensors[name].data, dtype=np.float64).tolist() for name in LONGROPE)
    scaling = {"rope_type": "longrope", "short_factor": short, "long_factor": long,
               "original_max_position_embeddings": int(original),
               "factor": cfg.get("max_position_embeddings", original) / original}  # fmt: skip
    if key("attn_factor") in meta:  # (the converter's, which is transformers' default from the factor)
        scaling["attention_factor"] = meta[key("attn_factor")]
    return scaling


def _hf_name(arch_name: str, name: str, n_layers: int) -> str | None:
    """The Hugging Face name of llama.cpp tensor ``name`` (None: not one of this architecture's)."""
    m, tensors = _LAYER_TENSOR.fullmatch(name), _TENSORS[arch_name]
    if m is None:
        return tensors.get(name)
    layer = int(m.group(1))
    hf_name = tensors.get("blk.{i}." + m.group(2))
    return None if hf_name is None or layer >= n_layers else hf_name.format(i=layer)


def _unpermute(w: Tensor, n_head: int) -> Tensor:
    """Undo llama.cpp's row permutation of a query/key projection (weights ``(n_head*hd, C)`` or a
    bias ``(n_head*hd,)``): its rows go per head as ``(hd/2, 2)`` pairs, Hugging Face's as ``(2, hd/2)``."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def dequantize(tensor: Any, dtype: torch.dtype = torch.float32, file: BinaryIO | None = None) -> Tensor:
    """One of the reader's tensors as a torch tensor of Hugging Face's shape (llama.cpp lists
    dimensions fastest first), dequantized by ``gguf.quants.dequantize``.

    With ``file`` (the GGUF file, open for reading) the tensor's bytes are read from it rather than
    through the reader's memory map: pages of a map stay resident, and would count in the process's
    memory as the whole file is converted, while a read buffer is freed tensor by tensor."""
    gguf = _import_gguf()
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    raw = tensor.data
    if file is not None:
        file.seek(tensor.data_offset)
        raw = np.fromfile(file, dtype=raw.dtype, count=raw.size).reshape(raw.shape)
    try:
        array: np.ndarray = gguf.quants.dequantize(raw, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"tensor {tensor.name!r} is quantized as {tensor.tensor_type.name}, which the gguf package "
            f"cannot dequantize"
        ) from None
    if not array.flags.writeable:  # F32 comes back as a view of the read-only map, the others as new arrays
        array = array.copy()
    return torch.from_numpy(array.reshape(shape)).to(dtype)


def read_gguf(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    keep_reader: bool = True,
    before_weights: Callable[[Any], None] | None = None,
) -> GGUFModel:
    """Read a GGUF file: its config and attnlab state dict (see the module docstring).

    Args:
        path: the ``.gguf`` file.
        dtype: None (the default) keeps every matrix stored in blocks or half precision as it is in
            the file, an :class:`attnlab.quantized.QuantizedTensor` that computes in float32 (the
            vectors and float32 matrices are plain float32 tensors); a floating-point dtype
            dequantizes every tensor into a dense one of that dtype (each tensor is converted as it
            is dequantized, so a bfloat16 load never holds a float32 copy of the model).
        keep_reader: keep the ``gguf.GGUFReader`` in the result (its tokenizer metadata); False
            releases it before the tensors are read (``reader`` is then None), which spares the
            memory of its parsed header while the weights load.
        before_weights: called with the ``gguf.GGUFReader`` once the header is checked, before any
            tensor is read: what needs the parsed header (the file's tokenizer) is built from it
            there, and with ``keep_reader=False`` the header is gone before the weights load.

    Raises ``ValueError`` naming the file for any defect (see the module docstring), and for an
    architecture attnlab does not read yet.
    """
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise TypeError(f"dtype must be None (quantized) or a floating-point torch.dtype, got {dtype!r}")
    p = Path(path).expanduser()
    try:
        return _read(p, open_gguf(p), dtype, keep_reader, before_weights)  # (no reference here: _read lets it go)
    except ValueError as e:
        if str(e).startswith(str(p)):
            raise
        raise ValueError(f"{p}: {e}") from None


class GGUFHeader(NamedTuple):
    """What :func:`read_gguf_header` returns: the file's scalar metadata (see :func:`read_gguf_metadata`),
    the Hugging Face ``config.json`` dict it amounts to, and ``{GGML type name: tensor count}``."""

    metadata: dict[str, Any]
    config: dict[str, Any]
    quantization: dict[str, int]


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The GGUF file ``path``'s header, parsed once: no tensor is read. Raises as :func:`read_gguf` does."""
    p = Path(path).expanduser()
    reader = open_gguf(p)
    try:
        meta, _, _, cfg = _architecture(reader)
    except ValueError as e:
        if str(e).startswith(str(p)):
            raise
        raise ValueError(f"{p}: {e}") from None
    return GGUFHeader(meta, cfg, _tensor_types(reader))


def read_gguf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict the GGUF file ``path`` amounts to, from its metadata
    alone (no tensor is read). Raises as :func:`read_gguf` does."""
    return read_gguf_header(path).config


def _tensor_types(reader: Any) -> dict[str, int]:
    """``{GGML type name: tensor count}`` of the file ``reader`` reads, e.g. ``{"Q4_1": 210, "F32": 61}``."""
    return dict(Counter(t.tensor_type.name for t in reader.tensors))


def _architecture(reader: Any) -> tuple[dict[str, Any], str, Architecture, dict[str, Any]]:
    """``(metadata, llama.cpp's architecture name, its Architecture, the config.json dict)``."""
    meta = read_gguf_metadata(reader)
    name = meta.get("general.architecture")
    if not isinstance(name, str):
        raise ValueError("no general.architecture in its metadata")
    arch = ARCHITECTURES.get(name)
    if arch is None:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported yet (attnlab reads {', '.join(SUPPORTED)} from GGUF files)"
        )
    return meta, name, arch, _config(name, arch, meta, reader)


def _read(
    p: Path,
    reader: Any,
    dtype: torch.dtype | None,
    keep_reader: bool = True,
    before_weights: Callable[[Any], None] | None = None,
) -> GGUFModel:
    meta, name, arch, cfg = _architecture(reader)
    if before_weights is not None:
        before_weights(reader)
        _release_freed_memory()  # (what it built from the header and let go, before the weights come)
    n_layers = cfg["num_hidden_layers"]
    tensors = {}
    for t in reader.tensors:
        if t.name in _READ_INTO_CONFIG.get(arch.model_type, ()):
            continue  # (the config's rope_scaling: see _config)
        if t.name in _REFUSED_TENSORS:
            raise ValueError(f"tensor {t.name!r} ({_REFUSED_TENSORS[t.name]}) is not supported yet")
        hf_name = _hf_name(name, t.name, n_layers)
        if hf_name is None:
            raise ValueError(f"unexpected tensor {t.name!r} for a {name} model of {n_layers} layers")
        tensors[hf_name] = t if keep_reader else t._replace(field=None)
    counts = _tensor_types(reader)
    if not keep_reader:
        # The reader's parse of the header (a Python object per token of the tokenizer: tens of MB
        # for a 50,000-token vocabulary) is not needed for the weights: let it go before they load.
        reader = None
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    state = {}
    with open(p, "rb") as file:
        for k, t in tensors.items():
            state[k] = _convert(t, dtype, file, arch, heads, kv_heads)
            gate = k.replace(".mlp.up_proj.", ".mlp.gate_proj.")
            dense = not (is_quantized(state[k]) or is_quantized(state.get(gate)))
            if dense and gate != k and gate in state and state[gate].shape == state[k].shape:
                # One block for the pair attnlab runs as one matmul: the mapping's concatenation
                # then frees one block of that size, which the next layer's reuses (two freed
                # half-size blocks would be holes the allocator cannot reuse for a whole one).
                fused = torch.cat([state[gate], state[k]])
                state[gate], state[k] = fused.chunk(2)
    fields, state = families.to_attnlab(state, hf_config=cfg, copy=False)
    # The header's parse and the read buffers are freed, but the heap keeps their pages for later
    # allocations: give them back, so that the model's memory is about its weights.
    _release_freed_memory()
    return GGUFModel(p, name, cfg, fields, state, meta, counts, reader)


def _release_freed_memory() -> None:
    """glibc's ``malloc_trim(0)``: the heap's free pages returned to the system (a no-op elsewhere)."""
    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    # The process's own symbols (libc is loaded already): ctypes.util.find_library would run ldconfig
    # in a subprocess on every load.
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # (None with a libc other than glibc)
    if trim is not None:
        trim(0)


def quantized(tensor: Any, file: BinaryIO | None = None) -> QuantizedTensor | None:
    """One of the reader's matrices as a :class:`~attnlab.quantized.QuantizedTensor` of Hugging
    Face's shape ``(out, in)``, its blocks as the file has them (read from ``file`` as
    :func:`dequantize` does), or None where it is not a matrix in one of the formats attnlab computes
    with (a vector, a float32 matrix, an ``IQ`` format: those are dequantized)."""
    name = tensor.tensor_type.name
    if name not in FORMATS or len(tensor.shape) != 2:
        return None
    shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # llama.cpp lists dimensions fastest first
    raw = tensor.data
    if file is not None:
        file.seek(tensor.data_offset)
        raw = np.fromfile(file, dtype=np.uint8, count=int(tensor.n_bytes))
        if raw.size != tensor.n_bytes:
            raise ValueError(f"tensor {tensor.name!r} is cut short: {raw.size} of its {tensor.n_bytes} bytes")
    return QuantizedTensor.from_blocks(name, np.asarray(raw).view(np.uint8).reshape(shape[0], -1), shape)


def _convert(
    t: Any, dtype: torch.dtype | None, file: BinaryIO, arch: Architecture, heads: int, kv_heads: int
) -> Tensor:
    """One tensor of the file, dequantized (or kept in its blocks where ``dtype`` is None), and put back
    as Hugging Face has it where llama.cpp's converter changed it (Llama's permuted q/k rows, Gemma's
    shifted norms, NeoX's fused q/k/v). The permutations move whole rows, which a quantized matrix
    does by moving its rows of blocks."""
    w = quantized(t, file) if dtype is None else None
    if w is None:
        w = dequantize(t, dtype or torch.float32, file)
    kind = t.name.split(".")[2] if t.name.startswith("blk.") else t.name.split(".")[0]
    if kind in arch.permuted:
        n = heads if kind == "attn_q" else kv_heads
        if w.shape[0] % (2 * n):
            raise ValueError(f"tensor {t.name!r} has {w.shape[0]} rows, not a whole number of {n} heads")
        w = w[_unpermute(torch.arange(w.shape[0]), n)] if is_quantized(w) else _unpermute(w, n)
    if arch.norm_shift and kind.endswith("norm"):
        w = w - arch.norm_shift  # the converter stored Gemma's gains as 1 + w
    if arch.qkv_per_head and kind == "attn_qkv":
        if w.shape[0] % (3 * heads):
            raise ValueError(f"tensor {t.name!r} has {w.shape[0]} rows, not q, k and v for {heads} heads")
        # (3, H, hd, ...) -> (H, 3, hd, ...): each head's query, key and value rows in turn
        order = torch.arange(w.shape[0]).reshape(3, heads, -1).transpose(0, 1).reshape(-1)
        w = w[order] if is_quantized(w) else w[order].contiguous()
    return w
