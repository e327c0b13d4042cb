"""LoRA (Hu et al. 2021): fine-tune a frozen model through low-rank updates of its weight matrices.

A target linear layer's weight ``W (out, in)`` is used as ``W + (alpha / r) * B @ A`` with
``A (r, in)`` random and ``B (out, r)`` zero at the start, so the adapted model starts as the base
model and only ``r * (in + out)`` numbers per matrix train. The update is a
``torch.nn.utils.parametrize`` parametrization of the ``weight`` itself, not a second branch in the
forward pass: every way the model reads the weight (attention's fused Q/K/V matmul reads
``W_query.weight`` directly) sees the adapted one, and :func:`merge_lora` writing
``W + (alpha / r) B A`` into a plain layer gives the same function by construction.

Targets name the matrices of each transformer block:

    q, k, v, o     attention's W_query, W_key, W_value, out_proj
    up, down       the MLP's first (with SwiGLU: gate and up together) and second linear layer

(rasbt's LLMs-from-scratch, chapter 7 appendix E, adapts the same layers; no LoRA dropout here.)
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from attnlab.checks import finite_real, is_int
from attnlab.files import atomic_path, atomic_write_json, import_safetensors
from attnlab.formats import families
from attnlab.quantized import is_quantized

__all__ = [
    "ADAPTERS_NAME",
    "TARGETS",
    "LoRA",
    "LoRASettings",
    "LowRankUpdated",
    "adapter_state",
    "apply_lora",
    "base_weights",
    "has_lora",
    "load_adapter_state",
    "merge_lora",
    "parse_targets",
    "peft_adapter",
    "save_peft_adapter",
]

ADAPTERS_NAME = "adapters.safetensors"  # beside the base weights in a checkpoint
TARGETS = {"q": "att.W_query", "k": "att.W_key", "v": "att.W_value", "o": "att.out_proj", "up": "ff.layers.0",
           "down": "ff.layers.2"}  # fmt: skip
DEFAULT_TARGETS = ("q", "k", "v", "o")
MAX_RANK = 4096


class LoRA(nn.Module):
    """The parametrization ``W -> W + scale * B @ A`` of one ``(out, in)`` weight."""

    def __init__(self, out_features: int, in_features: int, rank: int, alpha: float, *, like: Tensor) -> None:
        super().__init__()
        self.scale = alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, in_features, device=like.device, dtype=like.dtype))  # (r, in)
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank, device=like.device, dtype=like.dtype))  # (out, r)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's init, as the paper's code does

    def forward(self, W: Tensor) -> Tensor:
        if is_quantized(W):  # a frozen quantized base: the update beside it, never a dense (out, in) copy
            return LowRankUpdated(W, self.lora_A, self.lora_B, self.scale)
        return W + self.scale * (self.lora_B @ self.lora_A)  # (out, in)


class LowRankUpdated(Tensor):
    """``W + scale * B @ A`` for a quantized ``W`` (:class:`attnlab.quantized.QuantizedTensor`), kept as
    its three factors: ``F.linear(x, w)`` is ``x W^T`` from ``W``'s blocks plus ``scale * (x A^T) B^T``.

    The dense sum would be a float32 ``(out, in)`` matrix per adapted layer, kept by autograd for the
    backward pass; here autograd keeps ``x`` and the rank-``r`` product, and ``W``'s own product keeps
    its blocks (its tiled backward). Any other use of the weight computes the dense sum."""

    owns_linear = True  # attnlab.hardware.linear hands F.linear to it

    @staticmethod
    def __new__(cls, base: Tensor, A: Tensor, B: Tensor, scale: float) -> LowRankUpdated:
        return Tensor._make_wrapper_subclass(cls, base.shape, dtype=base.dtype, device=base.device)

    def __init__(self, base: Tensor, A: Tensor, B: Tensor, scale: float) -> None:
        self.base, self.A, self.B, self.scale = base, A, B, scale  # (out, in), (r, in), (out, r)

    def dense(self) -> Tensor:
        return self.base.dequantize() + self.scale * (self.B @ self.A)  # (out, in)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and isinstance(args[1], LowRankUpdated) and not isinstance(args[0], LowRankUpdated):
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            return F.linear(x, w.base, bias) + w.scale * F.linear(F.linear(x, w.A), w.B)  # (..., out)
        with torch._C.DisableTorchFunctionSubclass():  # (anything else: on the dense sum, __torch_dispatch__)
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = torch.utils._pytree.tree_map_only(LowRankUpdated, lambda t: t.dense(), (args, kwargs or {}))
        return func(*args, **kwargs)


class LoRASettings(dict):
    """``{"rank": r, "alpha": a, "targets": [...]}``, checked (what a checkpoint records)."""

    @classmethod
    def make(cls, rank: Any, alpha: Any = None, targets: Any = None) -> LoRASettings:
        if not is_int(rank) or not 1 <= rank <= MAX_RANK:
            raise ValueError(f"--lora-rank must be an integer in [1, {MAX_RANK}], got {rank!r}")
        alpha = 2 * rank if alpha is None else alpha
        if not finite_real(alpha) or alpha <= 0:
            raise ValueError(f"--lora-alpha must be a positive number, got {alpha!r}")
        return cls(rank=int(rank), alpha=float(alpha), targets=parse_targets(targets))


def parse_targets(targets: str | Sequence[str] | None) -> list[str]:
    """``"q,v"`` or ``["q", "v"]`` -> ``["q", "v"]``; ValueError naming ``--lora-targets`` for an unknown one."""
    if targets is None:
        return list(DEFAULT_TARGETS)
    names = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    unknown = [t for t in names if t not in TARGETS]
    if not names or unknown or len(set(names)) != len(names):
        raise ValueError(
            f"--lora-targets must be distinct names among {', '.join(TARGETS)} (comma-separated), got {targets!r}"
        )
    return names


def _target_modules(model: nn.Module, targets: Sequence[str]) -> Iterator[tuple[str, nn.Linear]]:
    for i, block in enumerate(model.trf_blocks):
        for t in targets:
            module = block.get_submodule(TARGETS[t])
            if not isinstance(module, nn.Linear):
                raise ValueError(f"--lora-targets {t}: block {i}'s {TARGETS[t]} is no linear layer")
            yield f"trf_blocks.{i}.{TARGETS[t]}", module


def apply_lora(model: nn.Module, settings: LoRASettings) -> int:
    """Freeze every parameter of ``model`` (an :class:`attnlab.GPT`) and adapt its target weights
    in place; returns the number of parameters that train (the adapters')."""
    if not isinstance(model, nn.Module) or not hasattr(model, "trf_blocks"):
        raise TypeError(f"model must be an attnlab GPT, got {type(model).__name__}")
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters")
    if not isinstance(settings, dict):
        raise TypeError(f"settings must be LoRASettings.make(rank, alpha, targets), got {type(settings).__name__}")
    # (checked again: a dict, or LoRASettings built without make, of a rank 0 or no targets)
    settings = LoRASettings.make(settings.get("rank"), settings.get("alpha"), settings.get("targets"))
    modules = list(_target_modules(model, settings["targets"]))
    smallest = min(min(m.weight.shape) for _, m in modules)
    if settings["rank"] > smallest:  # a rank past a matrix's smaller side adds parameters, not expressiveness
        raise ValueError(
            f"--lora-rank must be in [1, {smallest}] for this model (the smallest side of the adapted matrices), "
            f"got {settings['rank']}"
        )
    model.requires_grad_(False)
    n = 0
    for _, module in modules:
        out_f, in_f = module.weight.shape
        lora = LoRA(out_f, in_f, settings["rank"], settings["alpha"], like=module.weight)
        parametrize.register_parametrization(module, "weight", lora)
        n += lora.lora_A.numel() + lora.lora_B.numel()
    model.lora_settings = settings  # what a checkpoint records
    return n


def has_lora(model: nn.Module) -> bool:
    return getattr(model, "lora_settings", None) is not None


def _adapted(model: nn.Module) -> Iterator[tuple[str, nn.Module, LoRA]]:
    for name, module in _target_modules(model, model.lora_settings["targets"]):
        yield name, module, module.parametrizations.weight[0]


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters as ``{"trf_blocks.0.att.W_query.lora_A": (r, in), ...}`` (CPU, contiguous)."""
    out = {}
    for name, _, lora in _adapted(model):
        out[f"{name}.lora_A"] = lora.lora_A.detach().contiguous().cpu()
        out[f"{name}.lora_B"] = lora.lora_B.detach().contiguous().cpu()
    return out


def load_adapter_state(model: nn.Module, state: dict[str, Tensor], *, where: str = "adapters") -> None:
    """Copy :func:`adapter_state`'s tensors into ``model``'s adapters; ValueError naming ``where`` on
    any missing, extra or misshapen entry."""
    own = {}
    for name, _, lora in _adapted(model):
        own[f"{name}.lora_A"], own[f"{name}.lora_B"] = lora.lora_A, lora.lora_B
    if set(state) != set(own):
        missing, extra = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        raise ValueError(f"{where} does not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for k, p in own.items():
            if state[k].shape != p.shape or not state[k].is_floating_point():
                raise ValueError(f"{where}: {k} has shape {tuple(state[k].shape)}, expected {tuple(p.shape)}")
            p.copy_(state[k])


@contextlib.contextmanager
def base_weights(model: nn.Module) -> Iterator[nn.Module]:
    """The model with its adapters taken off (its base weights as plain parameters, as
    :meth:`GPT.save` writes them), put back on exit."""
    settings = getattr(model, "lora_settings", None)
    taken = []
    try:
        for _, module, lora in list(_adapted(model)) if settings is not None else []:
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            taken.append((module, lora))
        model.lora_settings = None
        yield model
    finally:
        for module, lora in taken:
            parametrize.register_parametrization(module, "weight", lora)
            module.parametrizations.weight.original.requires_grad_(False)
        model.lora_settings = settings


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Write ``W + scale * B A`` into each adapted layer's plain weight (in place) and drop the
    adapters: a plain model computing the adapted function. Every parameter trains again."""
    if has_lora(model):
        for _, module, lora in list(_adapted(model)):
            W = module.parametrizations.weight.original
            if not is_quantized(W):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
                continue
            merged = lora(W).dense().detach()  # (out, in): a quantized base merges into a dense weight
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
            module.weight = nn.Parameter(merged)
        model.lora_settings = None
    model.requires_grad_(True)
    return model


# --------------------------------------------------------------------------------------------
# PEFT's layout: the adapters for the Hugging Face model of the same weights
# --------------------------------------------------------------------------------------------
def peft_adapter(model: nn.Module, model_type: str) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``model``'s adapters as a PEFT LoRA adapter of the Hugging Face model of family ``model_type``
    (the one :func:`attnlab.formats.families.to_hf_state_dict` writes; ``"gpt2"`` too):
    ``(adapter_config.json's dict, adapter_model.safetensors' tensors)``.

    One PEFT adapter per Hugging Face matrix, computing the same update. Where that matrix holds several
    of attnlab's, the update is rewritten for it: Llama's ``gate_proj`` and ``up_proj`` (attnlab's one
    gated-MLP matrix) each take their rows of ``B`` with the shared ``A``; a fused query/key/value matrix
    (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``, GPT-NeoX's ``query_key_value``) takes the adapted parts'
    ``A`` stacked and their ``B`` on the block diagonal: rank ``r`` per part, with PEFT's
    ``rank_pattern`` and ``alpha_pattern`` keeping the scale ``alpha / r``."""
    if not isinstance(model, nn.Module) or not hasattr(model, "trf_blocks"):
        raise TypeError(f"model must be an attnlab GPT with LoRA adapters, got {type(model).__name__}")
    if not has_lora(model):
        raise ValueError("model has no LoRA adapters (apply_lora adds them)")
    if not isinstance(model_type, str) or model_type not in families.FAMILIES:
        raise ValueError(f"model_type must be one of {', '.join(families.FAMILIES)}, got {model_type!r}")
    cfg, family = families.check_exportable(model, model_type), families.FAMILIES[model_type]
    rank, alpha = model.lora_settings["rank"], model.lora_settings["alpha"]
    tensors: dict[str, Tensor] = {}
    modules: dict[str, int] = {}  # the adapted modules (inside a block) -> how many rank-r parts they stack
    fused: dict[tuple[str, str, bool], dict[str, tuple[Tensor, Tensor]]] = {}  # (where, module, per head) -> parts

    def add(where: str, module: str, A: Tensor, B: Tensor) -> None:
        # (copies: gate and up share one A, and safetensors writes no tensors that share memory)
        tensors[f"base_model.model.{where}{module}.lora_A.weight"] = A.clone()  # (parts * r, in)
        tensors[f"base_model.model.{where}{module}.lora_B.weight"] = B.clone()  # (out, parts * r)
        modules[module] = A.shape[0] // rank

    for name, _, lora in _adapted(model):
        layer, inner = name.removeprefix("trf_blocks.").split(".", 1)
        where, src = f"{family.prefix}{family.blocks}{layer}.", family.layer[inner + ".weight"]
        A, B = lora.lora_A.detach().float().cpu(), lora.lora_B.detach().float().cpu()  # (r, in), (out, r)
        if isinstance(src, families.Split):  # q, k or v of a fused matrix: gathered, written below
            fused.setdefault((where, _module(src.name), src.per_head), {})[src.part] = (A, B)
        else:  # one matrix, or several stacked along the rows (gate then up): each its rows of B
            names = src if isinstance(src, tuple) else (src,)
            for n, b in zip(names, B.chunk(len(names)), strict=True):
                add(where, _module(n), A, b)
    sizes = {"q": cfg.n_heads * cfg.head_dim, "k": cfg.kv_heads * cfg.head_dim, "v": cfg.kv_heads * cfg.head_dim}
    for (where, module, per_head), parts in fused.items():
        adapted = [p for p in "qkv" if p in parts]
        B = torch.zeros(sum(sizes.values()), len(adapted) * rank)  # (q + k + v rows, parts * r)
        rows = dict(zip("qkv", B.split(list(sizes.values())), strict=True))
        for j, p in enumerate(adapted):
            rows[p][:, j * rank : (j + 1) * rank] = parts[p][1]
        if per_head:  # each head's q, k, v rows in turn, as the matrix stores them
            B = torch.stack([rows[p].view(cfg.n_heads, cfg.head_dim, -1) for p in "qkv"], dim=1).flatten(0, 2)
        add(where, module, torch.cat([parts[p][0] for p in adapted]), B)
    stacked = {m: n for m, n in modules.items() if n != 1}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted(modules),
        "rank_pattern": {m: n * rank for m, n in stacked.items()},
        "alpha_pattern": {m: n * alpha for m, n in stacked.items()},
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": model_type == "gpt2",  # (GPT-2's Conv1D stores its weights transposed)
        "inference_mode": True,
    }
    return config, tensors


def _module(src: str | families.Conv1D) -> str:
    """The Hugging Face module (inside a block) that a weight's source names."""
    return (src.name if isinstance(src, families.Conv1D) else src).removesuffix(".weight")


def save_peft_adapter(model: nn.Module, model_type: str, directory: str | os.PathLike[str]) -> Path:
    """Write :func:`peft_adapter` into ``directory`` (made if needed) as ``adapter_config.json`` and
    ``adapter_model.safetensors``, each atomically: ``peft.PeftModel.from_pretrained(hf_model,
    directory)`` then computes what ``model`` does. Returns the directory."""
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise TypeError(f"directory must be a directory's path (str or os.PathLike), got {directory!r}")
    config, tensors = peft_adapter(model, model_type)
    out = Path(directory).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ValueError(f"directory {str(out)!r} is a file, or lies under one: name a directory") from None
    with atomic_path(out / "adapter_model.safetensors") as tmp:
        import_safetensors().torch.save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_json(out / "adapter_config.json", config)
    return out
