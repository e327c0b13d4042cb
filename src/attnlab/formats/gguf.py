"""GGUF files (llama.cpp, Ollama, LM Studio): metadata, tensors, tokenizer and chat template.

A GGUF file is one header of typed key/value metadata (``llama.block_count``,
``tokenizer.ggml.tokens``, ``tokenizer.chat_template``, ...), a table of tensors (llama.cpp names,
shapes, quantization types) and the tensors' bytes. This module reads it with the ``gguf`` package's
memory-mapped :class:`gguf.GGUFReader` and turns it into what a Hugging Face directory holds:

* the metadata into a ``config.json``-style dict (``model_type``, ``hidden_size``,
  ``num_attention_heads``, ``rope_theta``, ...), through one data-driven table per llama.cpp
  architecture (:data:`ARCHITECTURES`);
* the tensors into Hugging Face names (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``),
  one at a time, dequantized by ``gguf.quants.dequantize``. llama.cpp's converter permutes the rows
  of a Llama's query and key projections (it pairs RoPE's rotated halves as neighbours,
  ``(x0, x1), (x2, x3), ...``, where Hugging Face rotates ``x[:hd/2]`` with ``x[hd/2:]``); the
  permutation is undone here, so the result is exactly the Hugging Face checkpoint it came from.

From there the Hugging Face mapping that already exists (:func:`attnlab.formats.hf_llama.llama_to_attnlab`)
makes the attnlab model, so a new family needs only a table row here. The tokenizer stored in the
file is built by :class:`attnlab.tokenizers.HFTokenizer` (it reads ``.gguf`` paths too).

    model = GPT.from_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")      # float32 on the CPU

Every defect of a file (bad magic or version, a truncated header, tensor data past the end, an
unknown quantization type, shapes that disagree with the metadata, sizes out of range) is one
``ValueError`` naming the file, never a traceback from deep inside numpy or a silently wrong model.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import Tensor

from attnlab.checks import is_int
from attnlab.files import GGUF_MAGIC, open_gguf
from attnlab.formats import hf_llama

__all__ = [
    "ARCHITECTURES",
    "GGUF_MAGIC",
    "GGUFModel",
    "is_gguf",
    "read_gguf",
    "read_gguf_metadata",
]


@dataclass(frozen=True)
class Architecture:
    """How one llama.cpp architecture's metadata and tensors read as a Hugging Face model.

    Attributes:
        model_type: the Hugging Face ``model_type`` it becomes.
        config: ``{config.json key: GGUF key}``; ``{arch}`` in a GGUF key is the architecture's name.
        tensors: ``{llama.cpp tensor name: Hugging Face name}``; ``{i}`` is the layer.
        permuted: the llama.cpp tensors whose rows the converter permuted for its RoPE layout.
        supported: whether attnlab reads it (checked by a test against transformers); a table row
            that is not yet is refused with a clear message instead of being loaded untested.
    """

    model_type: str
    config: dict[str, str]
    tensors: dict[str, str]
    permuted: tuple[str, ...] = ()
    supported: bool = False


_LLAMA_CONFIG = {
    "max_position_embeddings": "{arch}.context_length",
    "hidden_size": "{arch}.embedding_length",
    "num_hidden_layers": "{arch}.block_count",
    "intermediate_size": "{arch}.feed_forward_length",
    "num_attention_heads": "{arch}.attention.head_count",
    "num_key_value_heads": "{arch}.attention.head_count_kv",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon",
    "rope_theta": "{arch}.rope.freq_base",
    "head_dim": "{arch}.attention.key_length",
    "vocab_size": "{arch}.vocab_size",
}
_LLAMA_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.bias": "model.layers.{i}.self_attn.o_proj.bias",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_QK_NORM = {
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
}

_SOFTCAP = {
    "attn_logit_softcapping": "{arch}.attn_logit_softcapping",
    "final_logit_softcapping": "{arch}.final_logit_softcapping",
    "sliding_window": "{arch}.attention.sliding_window",
}

# One row per llama.cpp architecture (``general.architecture``). Only "llama" is checked against
# transformers so far; the other rows record the names for the families to come and are refused.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", _LLAMA_CONFIG, _LLAMA_TENSORS, permuted=("attn_q", "attn_k"), supported=True),
    "qwen2": Architecture("qwen2", _LLAMA_CONFIG, _LLAMA_TENSORS),
    "qwen3": Architecture("qwen3", _LLAMA_CONFIG, _LLAMA_TENSORS | _QK_NORM),
    "gemma": Architecture("gemma", _LLAMA_CONFIG, _LLAMA_TENSORS),
    "gemma2": Architecture("gemma2", _LLAMA_CONFIG | _SOFTCAP, _LLAMA_TENSORS),
    "gemma3": Architecture("gemma3_text", _LLAMA_CONFIG, _LLAMA_TENSORS | _QK_NORM),
    "phi3": Architecture("phi3", _LLAMA_CONFIG, _LLAMA_TENSORS),
    "olmo2": Architecture("olmo2", _LLAMA_CONFIG, _LLAMA_TENSORS | _QK_NORM),
    "gptneox": Architecture("gpt_neox", _LLAMA_CONFIG, _LLAMA_TENSORS),
}
SUPPORTED = tuple(name for name, a in ARCHITECTURES.items() if a.supported)
# Tensors some files carry that change the model in ways attnlab does not read yet: refused by name.
_REFUSED_TENSORS = {"rope_freqs.weight": "RoPE frequency factors (Llama 3.1 scaling)"}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a GGUF file: ends in ``.gguf`` or starts with the bytes ``GGUF``."""
    p = Path(path).expanduser()
    if p.suffix.lower() == ".gguf":
        return True
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


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
    cfg: dict[str, Any] = {"model_type": arch.model_type}
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
    for k, v in cfg.items():
        if k in ("model_type",):
            continue
        if k in ("rms_norm_eps", "rope_theta"):
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{arch.config[k].format(arch=arch_name)} must be a positive number, got {v!r}")
            cfg[k] = float(v)
        elif not is_int(v) or not 0 < v <= 1 << 31:
            raise ValueError(f"{arch.config[k].format(arch=arch_name)} must be a positive integer, got {v!r}")
    heads, kv = cfg["num_attention_heads"], cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    if heads % kv:
        raise ValueError(f"{heads} attention heads do not split into {kv} key/value heads (head_count_kv)")
    if cfg["hidden_size"] % heads and "head_dim" not in cfg:
        raise ValueError(f"embedding_length={cfg['hidden_size']} is not divisible by head_count={heads}")
    rot = meta.get(f"{arch_name}.rope.dimension_count")
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // heads)
    if rot is not None and rot != head_dim:
        raise ValueError(f"rope.dimension_count={rot!r}: attnlab's {arch_name} rotates whole heads of {head_dim}")
    kind = meta.get(f"{arch_name}.rope.scaling.type", "none")
    if kind not in ("none", None):
        factor = meta.get(f"{arch_name}.rope.scaling.factor")
        if kind != "linear" or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"RoPE scaling {kind!r} (factor {factor!r}) is not supported yet (linear is)")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    cfg["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
    cfg["hidden_act"] = "silu"
    return cfg


def _hf_name(arch: Architecture, name: str, n_layers: int) -> str | None:
    """The Hugging Face name of llama.cpp tensor ``name`` (None: not one of this architecture's)."""
    m = _LAYER_TENSOR.fullmatch(name)
    if m is None:
        return arch.tensors.get(name)
    layer = int(m.group(1))
    hf_name = arch.tensors.get("blk.{i}." + m.group(2))
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


def read_gguf(path: str | os.PathLike[str], *, dtype: torch.dtype = torch.float32) -> GGUFModel:
    """Read a GGUF file: its config and attnlab state dict (see the module docstring).

    Args:
        path: the ``.gguf`` file.
        dtype: the floating-point dtype of the state dict (each tensor is converted as it is
            dequantized, so a bfloat16 load never holds a float32 copy of the model).

    Raises ``ValueError`` naming the file for any defect (see the module docstring), and for an
    architecture attnlab does not read yet.
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    p = Path(path).expanduser()
    reader = open_gguf(p)
    try:
        return _read(p, reader, dtype)
    except ValueError as e:
        if str(e).startswith(str(p)):
            raise
        raise ValueError(f"{p}: {e}") from None


def _read(p: Path, reader: Any, dtype: torch.dtype) -> GGUFModel:
    meta = read_gguf_metadata(reader)
    name = meta.get("general.architecture")
    if not isinstance(name, str):
        raise ValueError("no general.architecture in its metadata")
    arch = ARCHITECTURES.get(name)
    if arch is None or not arch.supported:
        raise ValueError(
            f"GGUF architecture {name!r} is not supported yet (attnlab reads {', '.join(SUPPORTED)} from GGUF files)"
        )
    cfg = _config(name, arch, meta, reader)
    n_layers = cfg["num_hidden_layers"]
    tensors = {}
    for t in reader.tensors:
        if t.name in _REFUSED_TENSORS:
            raise ValueError(f"tensor {t.name!r} ({_REFUSED_TENSORS[t.name]}) is not supported yet")
        hf_name = _hf_name(arch, t.name, n_layers)
        if hf_name is None:
            raise ValueError(f"unexpected tensor {t.name!r} for a {name} model of {n_layers} layers")
        tensors[hf_name] = t
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    state = {}
    with open(p, "rb") as file:
        for k, t in tensors.items():
            state[k] = _convert(t, dtype, file, arch, heads, kv_heads)
            gate = k.replace(".mlp.up_proj.", ".mlp.gate_proj.")
            if gate != k and gate in state and state[gate].shape == state[k].shape:
                # One block for the pair attnlab runs as one matmul: the mapping's concatenation
                # then frees one block of that size, which the next layer's reuses (two freed
                # half-size blocks are holes the allocator cannot use: 1.4x the model, not 1.05x).
                fused = torch.cat([state[gate], state[k]])
                state[gate], state[k] = fused.chunk(2)
    fields, state = hf_llama.llama_to_attnlab(state, hf_config=cfg, copy=False)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return GGUFModel(p, name, cfg, fields, state, meta, counts, reader)


def _convert(t: Any, dtype: torch.dtype, file: BinaryIO, arch: Architecture, heads: int, kv_heads: int) -> Tensor:
    """One tensor of the file, dequantized, and unpermuted where llama.cpp's converter permuted it."""
    w = dequantize(t, dtype, file)
    kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
    if kind in arch.permuted:
        n = heads if kind == "attn_q" else kv_heads
        if w.shape[0] % (2 * n):
            raise ValueError(f"tensor {t.name!r} has {w.shape[0]} rows, not a whole number of {n} heads")
        w = _unpermute(w, n)
    return w
