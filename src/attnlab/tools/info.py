"""``attnlab info``: versions, devices and which fused attention kernels torch offers here, a model's
description (its name, shapes, switches and parameters), and the KV-cache memory of a model's shapes
(MHA vs GQA vs a sliding window)."""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from attnlab.checks import positive_int
from attnlab.formats.families import MODEL_TYPES, config_fields
from attnlab.formats.gguf import GGUFHeader, is_gguf, read_gguf_header
from attnlab.formats.hf import gpt2_config_fields, is_local_path, read_pretrained_config
from attnlab.model import CONFIG_NAME, GPT, GPTConfig


def available_sdpa_kernels(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """The ``F.scaled_dot_product_attention`` backends that run here for a small causal call.

    Whether a kernel is *enabled* (``torch.backends.cuda.flash_sdp_enabled()``) says nothing about
    whether this build, device and dtype support it; so each backend is simply tried, alone, on a
    ``(1, 2, 8, 64)`` input.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 8, 64, device=device, dtype=dtype)  # (B, H, T, hd)
    found = []
    for name, backend in SDPBackend.__members__.items():  # a pybind11 enum: not iterable itself
        if name == "ERROR":
            continue
        try:
            with warnings.catch_warnings(), sdpa_kernel(backend):
                warnings.simplefilter("ignore")  # torch warns why each refused kernel cannot run
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
        except RuntimeError:
            continue
        found.append(name.lower())
    return found


# --------------------------------------------------------------------------------------------
# KV-cache memory: MHA vs GQA vs a sliding window
# --------------------------------------------------------------------------------------------
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
DEFAULT_WINDOW = 4096  # Mistral 7B's (and Gemma 2's) window, when the model has none of its own


def kv_cache_bytes(
    *, n_layers: int, n_kv_heads: int, head_dim: int, tokens: int, batch: int = 1, bytes_per_elem: int = 2
) -> int:
    """Bytes of a KV cache: a key and a value (2) of ``n_kv_heads * head_dim`` numbers per token,
    layer and sequence. LLMs-from-scratch's formula: batch x tokens x head_dim x n_layers x 2 (K, V)
    x bytes x n_kv_heads."""
    return 2 * batch * tokens * n_kv_heads * head_dim * bytes_per_elem * n_layers


@dataclass(frozen=True)
class KVRow:
    """One line of :func:`kv_memory_rows`: the cache of one way of attending."""

    label: str
    kv_heads: int
    tokens: int  # cached per sequence and layer
    per_token: int  # bytes per token and layer (its key and value)
    per_layer: int  # bytes per layer, all sequences of the batch
    total: int  # bytes, all layers


def _group_kv_heads(n_heads: int) -> int:
    """Key/value heads of a GQA variant of an MHA model: groups of 4 query heads (Llama 3's ratio),
    or the largest group below that divides the heads."""
    return next(n_heads // g for g in (4, 3, 2, 1) if n_heads % g == 0)


def kv_memory_rows(
    config: GPTConfig,
    *,
    context: int | None = None,
    batch: int = 1,
    dtype: str = "bf16",
    kv_heads: int | None = None,
    window: int | None = None,
) -> list[KVRow]:
    """The KV cache of ``config``'s shapes for MHA, GQA, and each with a sliding window.

    Args:
        config: the model's shapes (layers, heads, head width, its own key/value heads and window).
        context: tokens per sequence (default: the config's ``context_length``).
        batch: sequences; dtype: of the cached numbers (a key of :data:`DTYPE_BYTES`).
        kv_heads: key/value heads of the GQA line (default: the config's when it groups its heads,
            else groups of 4); window: of the window lines (default: the config's, else 4096).
    Returns:
        Four :class:`KVRow`: MHA, GQA, MHA + window, GQA + window (a window holds at most
        ``window + sinks`` tokens).
    """
    context = config.context_length if context is None else positive_int("context", context)
    positive_int("batch", batch)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    H, hd, L, size = config.n_heads, config.head_dim, config.n_layers, DTYPE_BYTES[dtype]
    if kv_heads is None:
        kv_heads = config.kv_heads if config.kv_heads < H else _group_kv_heads(H)
    elif positive_int("kv_heads", kv_heads) > H or H % kv_heads:
        raise ValueError(f"kv_heads must divide the {H} query heads, got {kv_heads}")
    window = (config.window or DEFAULT_WINDOW) if window is None else positive_int("window", window)
    held = min(context, window + config.sinks)

    # A model whose window_layers slide the window (Gemma 2/3) keeps the whole context in the others.
    windowed = L if config.window_layers is None else len(config.window_layers)
    which = "" if windowed == L else f" on {windowed} of {L} layers"

    def row(label: str, heads: int, tokens: int, n_windowed: int = L) -> KVRow:
        """``tokens`` slots on ``n_windowed`` layers, the whole context on the others."""

        def cache(n: int, b: int = batch) -> int:  # one layer's keys and values
            return kv_cache_bytes(n_layers=1, n_kv_heads=heads, head_dim=hd, tokens=n, batch=b, bytes_per_elem=size)

        total = cache(tokens) * n_windowed + cache(context) * (L - n_windowed)
        return KVRow(label, heads, tokens, cache(1, 1), cache(tokens), total)

    group = H // kv_heads
    return [
        row("MHA", H, context),
        row(f"GQA (groups of {group})", kv_heads, context),
        row(f"MHA + window {window}{which}", H, held, windowed),
        row(f"GQA + window {window}{which}", kv_heads, held, windowed),
    ]


def format_bytes(n: int) -> str:
    """Decimal units, as LLMs-from-scratch prints them: ``17.18 GB``."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def format_kv_memory(name: str, config: GPTConfig, rows: list[KVRow], *, batch: int, dtype: str) -> str:
    """The table ``attnlab info --kv-memory`` prints (80 columns; wider where a row's label is long)."""
    w = max(22, 2 + max(len(r.label) for r in rows))  # the labels' column
    lines = [
        f"KV cache of {name}: {config.n_layers} layers, {config.n_heads} heads of {config.head_dim}",
        f"{rows[0].tokens:,} tokens x batch {batch}, {dtype} ({DTYPE_BYTES[dtype]} bytes per number)",
        "bytes = 2 (K, V) x batch x tokens x kv_heads x head_dim x bytes/number x layers",
        "",
        f"{'':<{w}}{'K/V heads':>10}{'tokens':>10}{'per token':>12}{'per layer':>12}{'total':>12}",
    ]
    for r in rows:
        lines.append(
            f"{r.label:<{w}}{r.kv_heads:>10}{r.tokens:>10,}{format_bytes(r.per_token):>12}"
            f"{format_bytes(r.per_layer):>12}{format_bytes(r.total):>12}"
        )
    lines.append("")
    lines.append("per token: one token's key and value, one layer; per layer: the whole batch")
    if config.window is None and rows[2].label.endswith(f" {DEFAULT_WINDOW}"):
        lines.append(f"(window: {DEFAULT_WINDOW}, Mistral 7B's; this model has none of its own: --window W)")
    return "\n".join(lines)


class ModelSource(NamedTuple):
    """What :func:`config_of` returns: the model's shapes, its name as pages and ``serve`` give it (a GGUF
    file's from its metadata, a directory's from its config, a Hub id as given), and a GGUF file's
    header (None for any other source)."""

    config: GPTConfig
    name: str
    gguf: GGUFHeader | None = None


def config_of(source: str) -> ModelSource:
    """``(GPTConfig, name, GGUF header)`` of a model: a GGUF file (its header only), a directory with a
    ``config.json`` (attnlab's, or a Hugging Face one of a family attnlab reads), a training run, or a
    Hub repository id (its config.json only, from the cache when offline). A local path is never sent
    to the Hub: a missing one is "no such file or directory"."""
    from attnlab.tools.loading import directory_name, gguf_name, load_model

    path = Path(source).expanduser()
    if path.is_dir() and not (path / CONFIG_NAME).is_file():
        return ModelSource(load_model(path, what="--model").model.config, directory_name(path))
    if not path.is_dir() and is_local_path(source):
        if not path.exists():
            raise FileNotFoundError(f"--model {source}: no such file or directory")
        if not is_gguf(path):
            raise ValueError(
                f"--model {source}: a file that is not a GGUF file; give a GGUF file or a model's directory"
            )
        header = read_gguf_header(path)
        name = gguf_name(header.metadata, header.quantization, path)
        return ModelSource(GPTConfig(**config_fields(header.config)), name, header)
    cfg = read_pretrained_config(source)
    model_type = cfg.get("model_type")
    name = directory_name(path) if path.is_dir() else source
    if model_type is None:  # attnlab's own config.json (GPT.save)
        return ModelSource(GPTConfig.from_dict(cfg), name)
    if model_type == "gpt2":
        return ModelSource(GPTConfig(**gpt2_config_fields(cfg)), name)
    if model_type in MODEL_TYPES:
        return ModelSource(GPTConfig(**config_fields(cfg)), name)
    raise ValueError(f"{source}: a {model_type!r} model; attnlab reads the configs of gpt2, {', '.join(MODEL_TYPES)}")


# --------------------------------------------------------------------------------------------
# A model's description
# --------------------------------------------------------------------------------------------
SHAPES = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers")  # (the description's first line)


def describe_model(source: str | None = None, *, preset: str | None = None) -> str:
    """``attnlab info --model``'s (``--preset``'s) lines: the model's name (:func:`config_of`'s); its
    parameters (counted on the meta device: nothing is allocated, so an 8B model's count costs nothing)
    and shapes; the ``GPTConfig`` switches that differ from its defaults (a family is such a set of
    switches); for a GGUF file, its size and its tensors' types (from its header: no tensor is read)."""
    config, name, header = (GPTConfig.preset(preset), preset, None) if preset is not None else config_of(source)
    with torch.device("meta"):
        params = GPT(config).num_parameters()
    kv = f" ({config.kv_heads} key/value heads)" if config.kv_heads != config.n_heads else ""
    lines = [
        f"{params:,} parameters: {config.n_layers} layers, width {config.emb_dim}, {config.n_heads} heads of "
        f"{config.head_dim}{kv}, vocabulary {config.vocab_size:,}, context {config.context_length:,}",
    ]
    default = GPTConfig()
    switches = [
        f"{f.name}={_value(getattr(config, f.name))}"
        for f in dataclasses.fields(GPTConfig)
        if f.name not in SHAPES and getattr(config, f.name) != getattr(default, f.name)
    ]
    lines.append("GPTConfig switches (beside its defaults): " + (", ".join(switches) or "none"))
    if header is not None:  # a GGUF file
        size = format_bytes(Path(source).expanduser().stat().st_size)
        listed = ", ".join(f"{t} x {n}" for t, n in Counter(header.quantization).most_common())
        lines.append(f"file: {size}, tensors {listed} (kept in their types when loaded)")
    return "\n".join([name, *lines])


def _value(v: object) -> str:
    return f"{v:g}" if isinstance(v, float) else repr(v)
