"""Hugging Face GPT-2 interoperability: weights in and out, and the published checkpoints.

GPT-2's original code (and Hugging Face's ``GPT2LMHeadModel``) stores every projection as a
``Conv1D``: a ``(in, out)`` weight used as ``x @ W + b``, the transpose of ``nn.Linear``'s
``(out, in)``. Its attention has one ``c_attn`` projection producing queries, keys and values
side by side; attnlab keeps the tutorials' ``W_query`` / ``W_key`` / ``W_value``, so ``c_attn`` is
split in three. The mapping, per block ``i``::

    h.i.ln_1            -> trf_blocks.i.norm1
    h.i.attn.c_attn     -> trf_blocks.i.att.W_query | W_key | W_value   (transposed, split)
    h.i.attn.c_proj     -> trf_blocks.i.att.out_proj                    (transposed)
    h.i.ln_2            -> trf_blocks.i.norm2
    h.i.mlp.c_fc        -> trf_blocks.i.ff.layers.0                     (transposed)
    h.i.mlp.c_proj      -> trf_blocks.i.ff.layers.2                     (transposed)
    wte, wpe, ln_f      -> tok_emb, pos_emb, final_norm;   lm_head -> out_head (or tied)

This module holds the formats only (weight names and layouts, the configuration mapping, the Hub
download); :class:`attnlab.GPT` builds itself from them (``GPT.from_hf_gpt2``,
``GPT.from_pretrained``, ``model.to_hf_gpt2_state_dict()``), so the model imports this module and
never the other way round. ``transformers`` is optional: nothing here imports it unless a function
needs a Hugging Face object; ``GPT.from_pretrained`` needs only ``huggingface_hub`` (and safetensors).
"""

from __future__ import annotations

import json
import os
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnlab.files import import_safetensors

if TYPE_CHECKING:  # the model sits above this module
    from attnlab.model import GPT, GPTConfig

__all__ = [
    "PRETRAINED",
    "gpt2_config_fields",
    "gpt2_to_attnlab",
    "import_transformers",
    "is_local_path",
    "read_pretrained",
    "read_pretrained_config",
    "read_pretrained_file",
    "read_pretrained_gpt2",
    "to_hf_gpt2",
    "to_hf_gpt2_config",
    "to_hf_gpt2_state_dict",
]

# attnlab names -> Hugging Face Hub repositories of OpenAI's GPT-2 weights.
PRETRAINED = {
    "gpt2": "openai-community/gpt2",
    "gpt2-small": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}
_LAYER = re.compile(r"^h\.(\d+)\.")


# --------------------------------------------------------------------------------------------
# Hugging Face -> attnlab
# --------------------------------------------------------------------------------------------
def _split_hf_input(obj: Any) -> tuple[dict[str, Tensor], Any]:
    """``(state dict without the 'transformer.' prefix, HF config or None)``."""
    hf_config = getattr(obj, "config", None)
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        state = obj.state_dict()
    elif isinstance(obj, Mapping):
        state = dict(obj)
        hf_config = None
    else:
        raise TypeError(
            f"expected a Hugging Face GPT2LMHeadModel / GPT2Model or its state dict, got {type(obj).__name__}"
        )
    out = {}
    for k, v in state.items():
        if not isinstance(v, Tensor):
            raise TypeError(f"state dict entry {k!r} is a {type(v).__name__}, not a tensor")
        out[k.removeprefix("transformer.")] = v
    return out, hf_config


# transformers' GPT2Config.activation_function -> GPTConfig.activation
_HF_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _warn_caller(message: str) -> None:
    """A UserWarning attributed to the first caller outside attnlab (GPT.from_hf_gpt2 or the
    function itself may be the entry point, so a fixed stacklevel would point into attnlab)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def _config_from_hf(
    state: dict[str, Tensor], hf_config: Any, n_heads: int | None, drop_rate: float | None
) -> dict[str, Any]:
    """The :class:`~attnlab.GPTConfig` fields of a GPT-2 state dict (and its Hugging Face config)."""
    for key in ("wte.weight", "wpe.weight", "ln_f.weight"):
        if key not in state:
            raise ValueError(f"not a GPT-2 state dict: {key!r} (or 'transformer.{key}') is missing")
    vocab_size, emb_dim = state["wte.weight"].shape
    context_length = state["wpe.weight"].shape[0]
    layers = {int(m.group(1)) for k in state if (m := _LAYER.match(k))}
    if not layers or layers != set(range(len(layers))):
        raise ValueError(f"not a GPT-2 state dict: transformer blocks h.0 ... h.N expected, found {sorted(layers)}")
    ff_dim = state["h.0.mlp.c_fc.weight"].shape[1]
    ln_eps = 1e-5
    activation = "gelu_tanh"
    if hf_config is not None:
        if getattr(hf_config, "model_type", "gpt2") != "gpt2":
            raise ValueError(f"expected a GPT-2 model, got model_type={hf_config.model_type!r}")
        act = getattr(hf_config, "activation_function", "gelu_new")
        if act not in _HF_ACTIVATIONS:
            raise ValueError(f"attnlab's GPT supports activation_function {sorted(_HF_ACTIVATIONS)}, got {act!r}")
        activation = _HF_ACTIVATIONS[act]
        if not getattr(hf_config, "scale_attn_weights", True) or getattr(
            hf_config, "scale_attn_by_inverse_layer_idx", False
        ):
            raise ValueError("only GPT-2's standard 1/sqrt(head_dim) attention scaling is supported")
        # The tensors decide the sizes; a config that says otherwise belongs to another model.
        found = {"vocab_size": vocab_size, "n_embd": emb_dim, "n_positions": context_length, "n_layer": len(layers)}
        for name, size in found.items():
            said = getattr(hf_config, name, None)
            if said is not None and said != size:
                raise ValueError(f"hf_config says {name}={said}, but the weights have {size}: they are not one model's")
        n_heads = getattr(hf_config, "n_head", None) if n_heads is None else n_heads
        ln_eps = float(getattr(hf_config, "layer_norm_epsilon", 1e-5))
        if drop_rate is None:
            drop_rate = float(getattr(hf_config, "resid_pdrop", 0.1))
            rates = {k: getattr(hf_config, k, drop_rate) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
            if len(set(rates.values())) > 1:
                _warn_caller(
                    f"attnlab's GPT has one dropout rate; the Hugging Face config has {rates}, so "
                    f"drop_rate={drop_rate} (resid_pdrop) is used everywhere; pass drop_rate=... to choose"
                )
    if n_heads is None:
        # A bare state dict does not record the head count; every published GPT-2 uses 64-wide heads.
        if emb_dim % 64:
            raise ValueError(
                f"cannot infer n_heads from a state dict with emb_dim={emb_dim} (not a multiple of GPT-2's "
                f"head width 64); pass n_heads=..."
            )
        n_heads = emb_dim // 64
        _warn_caller(
            f"a bare state dict does not record the head count: assuming n_heads={n_heads} (64-wide heads, as in "
            "every published GPT-2); pass n_heads=... or hf_config=... if this model differs, or its logits will be "
            "wrong"
        )
    lm_head = state.get("lm_head.weight")
    tied = (
        lm_head is None
        or lm_head.data_ptr() == state["wte.weight"].data_ptr()
        or torch.equal(lm_head, state["wte.weight"])
    )
    return dict(
        vocab_size=vocab_size,
        context_length=context_length,
        emb_dim=emb_dim,
        n_heads=n_heads,
        n_layers=len(layers),
        drop_rate=0.1 if drop_rate is None else drop_rate,
        qkv_bias=True,
        tie_embeddings=bool(tied),
        ff_dim=None if ff_dim == 4 * emb_dim else ff_dim,
        ln_eps=ln_eps,
        activation=activation,
    )


def gpt2_config_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """:class:`~attnlab.GPTConfig` sizes of a GPT-2 ``config.json`` (as a dict): enough to build the
    model's shapes (e.g. on the meta device) or size its KV cache, without the weights."""
    if cfg.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"expected a GPT-2 config, got model_type={cfg.get('model_type')!r}")
    return dict(
        vocab_size=cfg.get("vocab_size", 50257),
        context_length=cfg.get("n_positions", 1024),
        emb_dim=cfg.get("n_embd", 768),
        n_heads=cfg.get("n_head", 12),
        n_layers=cfg.get("n_layer", 12),
        qkv_bias=True,
        ff_dim=cfg.get("n_inner"),
        ln_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        activation=_HF_ACTIVATIONS.get(cfg.get("activation_function", "gelu_new"), "gelu_tanh"),
    )


def gpt2_to_attnlab(
    model_or_state_dict: Any,
    *,
    n_heads: int | None = None,
    drop_rate: float | None = None,
    hf_config: Any = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(GPTConfig fields, attnlab state dict)`` of a Hugging Face GPT-2; the arguments are those of
    :meth:`attnlab.GPT.from_hf_gpt2`, which builds the model from what this returns.

    Returns:
        The configuration fields and a state dict of own, contiguous tensors (the source keeps its
        storage); the output head is left out when it is tied to the token embedding.
    """
    state, own_config = _split_hf_input(model_or_state_dict)
    if hf_config is None:
        hf_config = own_config
    elif isinstance(hf_config, Mapping):
        hf_config = SimpleNamespace(**dict(hf_config))
    cfg = _config_from_hf(state, hf_config, n_heads, drop_rate)
    C = cfg["emb_dim"]

    F = cfg["ff_dim"] or 4 * C
    V, P = cfg["vocab_size"], cfg["context_length"]
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C), "lm_head.weight": (V, C)}
    shapes |= {"attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,), "attn.c_proj.weight": (C, C)}
    shapes |= {"mlp.c_fc.weight": (C, F), "mlp.c_fc.bias": (F,), "mlp.c_proj.weight": (F, C)}

    def t(key: str) -> Tensor:
        if key not in state:
            raise ValueError(f"not a GPT-2 state dict: {key!r} is missing")
        want = shapes.get(key.split(".", 2)[-1] if key.startswith("h.") else key, (C,))  # the rest: (C,) vectors
        if tuple(state[key].shape) != want:
            raise ValueError(f"GPT-2 weight {key!r} must have shape {want}, got {tuple(state[key].shape)}")
        return state[key]

    new: dict[str, Tensor] = {
        "tok_emb.weight": t("wte.weight"),
        "pos_emb.weight": t("wpe.weight"),
        "final_norm.weight": t("ln_f.weight"),
        "final_norm.bias": t("ln_f.bias"),
    }
    for i in range(cfg["n_layers"]):
        h, b = f"h.{i}.", f"trf_blocks.{i}."
        q, k, v = t(h + "attn.c_attn.weight").t().split(C, dim=0)  # Conv1D (C, 3C) -> 3 x Linear (C, C)
        qb, kb, vb = t(h + "attn.c_attn.bias").split(C, dim=0)
        new.update(
            {
                b + "norm1.weight": t(h + "ln_1.weight"),
                b + "norm1.bias": t(h + "ln_1.bias"),
                b + "att.W_query.weight": q,
                b + "att.W_key.weight": k,
                b + "att.W_value.weight": v,
                b + "att.W_query.bias": qb,
                b + "att.W_key.bias": kb,
                b + "att.W_value.bias": vb,
                b + "att.out_proj.weight": t(h + "attn.c_proj.weight").t(),
                b + "att.out_proj.bias": t(h + "attn.c_proj.bias"),
                b + "norm2.weight": t(h + "ln_2.weight"),
                b + "norm2.bias": t(h + "ln_2.bias"),
                b + "ff.layers.0.weight": t(h + "mlp.c_fc.weight").t(),
                b + "ff.layers.0.bias": t(h + "mlp.c_fc.bias"),
                b + "ff.layers.2.weight": t(h + "mlp.c_proj.weight").t(),
                b + "ff.layers.2.bias": t(h + "mlp.c_proj.bias"),
            }
        )
    if not cfg["tie_embeddings"]:
        new["out_head.weight"] = t("lm_head.weight")
    # Own, contiguous copies: the source model must not share (or be changed through) our storage.
    return cfg, {k: v.detach().clone().contiguous() for k, v in new.items()}


# --------------------------------------------------------------------------------------------
# attnlab -> Hugging Face
# --------------------------------------------------------------------------------------------
# The GPTConfig switches of the families after Llama (attnlab.formats.families), as they are when
# off: neither GPT-2's nor Llama's layout can hold a model that turns one on.
FAMILY_SWITCHES_OFF = {
    "head_size": None,
    "attn_scale": None,
    "attn_softcap": None,
    "logit_softcap": None,
    "embed_scale": None,
    "norm_offset": 0.0,
    "window_layers": None,
    "rope_local_theta": None,
    "pre_norms": True,
    "post_norms": False,
    "rotary_fraction": 1.0,
    "parallel_residual": False,
}


def _check_exportable(model: GPT) -> GPTConfig:
    # Duck-typed: this module sits below attnlab.model, so it cannot name the class.
    cfg = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(cfg, "kv_heads"):
        raise TypeError(f"expected an attnlab GPT, got {type(model).__name__}")
    if cfg.kv_heads != cfg.n_heads:
        raise ValueError(
            f"GPT-2 has no grouped-query attention: this model has n_kv_heads={cfg.n_kv_heads} != n_heads={cfg.n_heads}"
        )
    gpt2 = {"pos": "learned", "norm": "layernorm", "mlp": "gelu", "window": None, "qk_norm": False}
    gpt2 |= {k: v for k, v in FAMILY_SWITCHES_OFF.items() if k != "head_size" or cfg.head_size != cfg.head_dim}
    other = {k: getattr(cfg, k) for k, v in gpt2.items() if getattr(cfg, k, v) != v}
    if other:
        raise ValueError(
            f"GPT-2 has learned positions, LayerNorm, a GELU MLP and full attention; this model has {other}"
        )
    return cfg


def to_hf_gpt2_state_dict(model: GPT) -> dict[str, Tensor]:
    """A state dict for ``transformers.GPT2LMHeadModel`` (config from :func:`to_hf_gpt2_config`).

    Biases a configuration switched off (``qkv_bias=False``, ``bias=False``) are exported as zeros,
    which is exactly what their absence computes.
    """
    cfg = _check_exportable(model)
    sd = {k: v.detach() for k, v in model.state_dict().items()}

    def bias(key: str, n: int) -> Tensor:
        ref = sd["tok_emb.weight"]
        return sd[key] if key in sd else torch.zeros(n, dtype=ref.dtype, device=ref.device)

    C = cfg.emb_dim
    out = {
        "transformer.wte.weight": sd["tok_emb.weight"],
        "transformer.wpe.weight": sd["pos_emb.weight"],
        "transformer.ln_f.weight": sd["final_norm.weight"],
        "transformer.ln_f.bias": bias("final_norm.bias", C),
    }
    for i in range(cfg.n_layers):
        h, b = f"transformer.h.{i}.", f"trf_blocks.{i}."
        qkv = torch.cat([sd[b + f"att.{n}.weight"] for n in ("W_query", "W_key", "W_value")])  # (3C, C)
        qkv_b = torch.cat([bias(b + f"att.{n}.bias", C) for n in ("W_query", "W_key", "W_value")])  # (3C,)
        out.update(
            {
                h + "ln_1.weight": sd[b + "norm1.weight"],
                h + "ln_1.bias": bias(b + "norm1.bias", C),
                h + "attn.c_attn.weight": qkv.t(),
                h + "attn.c_attn.bias": qkv_b,
                h + "attn.c_proj.weight": sd[b + "att.out_proj.weight"].t(),
                h + "attn.c_proj.bias": bias(b + "att.out_proj.bias", C),
                h + "ln_2.weight": sd[b + "norm2.weight"],
                h + "ln_2.bias": bias(b + "norm2.bias", C),
                h + "mlp.c_fc.weight": sd[b + "ff.layers.0.weight"].t(),
                h + "mlp.c_fc.bias": bias(b + "ff.layers.0.bias", cfg.hidden_dim),
                h + "mlp.c_proj.weight": sd[b + "ff.layers.2.weight"].t(),
                h + "mlp.c_proj.bias": bias(b + "ff.layers.2.bias", C),
            }
        )
    out["lm_head.weight"] = sd["tok_emb.weight"] if cfg.tie_embeddings else sd["out_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_gpt2_config(model: GPT) -> Any:
    """The ``transformers.GPT2Config`` matching ``model`` (needs ``transformers``)."""
    cfg = _check_exportable(model)
    transformers = import_transformers()
    return transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.context_length,
        n_embd=cfg.emb_dim,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=None if cfg.ff_dim is None else cfg.ff_dim,
        activation_function="gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
        resid_pdrop=cfg.drop_rate,
        embd_pdrop=cfg.drop_rate,
        attn_pdrop=cfg.drop_rate,
        layer_norm_epsilon=cfg.ln_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=min(50256, cfg.vocab_size - 1),
        eos_token_id=min(50256, cfg.vocab_size - 1),
    )


def to_hf_gpt2(model: GPT) -> Any:
    """A ``transformers.GPT2LMHeadModel`` with ``model``'s weights (eval mode, same dtype/device)."""
    transformers = import_transformers()
    hf = transformers.GPT2LMHeadModel(to_hf_gpt2_config(model))
    hf.load_state_dict(to_hf_gpt2_state_dict(model))
    return hf.to(device=model.device, dtype=model.dtype).eval()


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "this needs the 'transformers' package: pip install 'attnlab[hf]' (or pip install transformers)"
        ) from None
    return transformers


# --------------------------------------------------------------------------------------------
# Published weights
# --------------------------------------------------------------------------------------------
def read_pretrained_gpt2(
    name: str = "gpt2",
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    revision: str | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(config.json as a dict, state dict)`` of a published GPT-2 (see :meth:`attnlab.GPT.from_pretrained`
    for ``name``), a Hub repository or a local directory; safetensors only, nothing is unpickled."""
    hf_cfg, state = read_pretrained(name, cache_dir=cache_dir, revision=revision)
    if hf_cfg.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{name!r} is not a GPT-2 model (model_type={hf_cfg.get('model_type')!r})")
    return hf_cfg, state


WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def read_pretrained_config(
    name: str, *, cache_dir: str | os.PathLike[str] | None = None, revision: str | None = None
) -> dict[str, Any]:
    """The ``config.json`` of ``name`` (a local directory, a known GPT-2 name or a Hub repository), as a dict."""
    local = _local_dir(name)
    if local is None and is_local_path(name):  # a path, not a Hub id: never sent to the Hub
        what = "a file, not a model directory" if Path(name).expanduser().exists() else "no such file or directory"
        raise FileNotFoundError(f"{name}: {what} (a Hugging Face model directory, or a Hub id such as owner/name)")
    path = local / "config.json" if local is not None else _download(_repo(name), "config.json", cache_dir, revision)
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} not found: a model directory needs config.json and safetensors weights")
    try:
        cfg = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable JSON config ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return cfg


def read_pretrained(
    name: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    revision: str | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(config.json as a dict, state dict)`` of a Hugging Face model: a local directory (what
    ``save_pretrained`` writes) or a Hub repository, read from the cache when offline.

    The weights are ``model.safetensors`` or shards listed in ``model.safetensors.index.json``
    (the layout of large models); safetensors only, nothing is unpickled. A name in
    :data:`PRETRAINED` always means that published model, even if a folder of that name exists.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a model name or directory like 'gpt2', got {name!r}")
    cfg = read_pretrained_config(name, cache_dir=cache_dir, revision=revision)
    local = _local_dir(name)
    if local is not None:
        if (local / WEIGHTS).is_file():
            files = [local / WEIGHTS]
        elif (local / WEIGHTS_INDEX).is_file():
            files = [local / f for f in _shards(local / WEIGHTS_INDEX)]
        else:
            raise FileNotFoundError(f"{local} holds neither {WEIGHTS} nor {WEIGHTS_INDEX} (safetensors weights)")
    else:
        repo = _repo(name)
        try:
            files = [Path(_download(repo, WEIGHTS, cache_dir, revision, quiet=True))]
        except FileNotFoundError:
            index = Path(_download(repo, WEIGHTS_INDEX, cache_dir, revision))
            files = [Path(_download(repo, f, cache_dir, revision)) for f in _shards(index)]
    safetensors = import_safetensors()
    state: dict[str, Tensor] = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found: the weights' index lists it")
        try:
            state.update(safetensors.torch.load_file(str(f)))
        except safetensors.SafetensorError as e:  # truncated, corrupt header, ...: not a ValueError
            raise ValueError(f"{f} is not a readable safetensors file ({e})") from None
    return cfg, state


def read_pretrained_file(
    name: str, filename: str, *, cache_dir: str | os.PathLike[str] | None = None, revision: str | None = None
) -> Path | None:
    """The path of ``filename`` in a model directory or Hub repository (the cache when offline), or
    None when the model has no such file (e.g. an optional ``tokenizer_config.json``)."""
    local = _local_dir(name)
    if local is not None:
        path = local / filename
        return path if path.is_file() else None
    try:
        return Path(_download(_repo(name), filename, cache_dir, revision, quiet=True))
    except FileNotFoundError:
        return None


# What huggingface_hub accepts as a repository id: a name or "owner/name" of letters, digits, "-", "_" and
# "." (and neither "--" nor ".."). Anything else can only be a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?")


def is_local_path(name: str) -> bool:
    """Whether ``name`` can only be a local path, never a Hub repository id: an absolute path, one
    starting with ``.`` or ``~``, one of more than two parts, a ``.gguf`` file name, ... Such a name is
    never sent to the Hugging Face Hub: when nothing is there, the answer is "no such file or directory"."""
    if name.lower() in PRETRAINED:
        return False
    return (
        _HUB_ID.fullmatch(name) is None
        or ".." in name
        or "--" in name
        or name.lower().endswith(".gguf")
        or Path(name).expanduser().exists()
    )


def _local_dir(name: str) -> Path | None:
    local = Path(name).expanduser()
    # A known model name always means that model: a ./gpt2 folder in the working directory must
    # not silently stand in for from_pretrained("gpt2").
    return local if name.lower() not in PRETRAINED and local.is_dir() else None


def _repo(name: str) -> str:
    return PRETRAINED.get(name.lower(), name)


def _shards(index: Path) -> list[str]:
    """The shard files ``model.safetensors.index.json`` lists (plain file names beside it)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a safetensors index with a 'weight_map' ({type(e).__name__})") from None
    files = sorted(set(weight_map.values()))
    for f in files:
        if not isinstance(f, str) or Path(f).name != f or not f.endswith(".safetensors"):
            raise ValueError(f"{index} lists {f!r}: shards must be .safetensors files beside the index")
    return files


def _download(
    repo_id: str,
    filename: str,
    cache_dir: str | os.PathLike[str] | None,
    revision: str | None,
    *,
    quiet: bool = False,
) -> str:
    """One file of a Hub repository, through ``huggingface_hub`` (its cache first when offline).
    ``quiet``: a missing file is a bare FileNotFoundError (the caller tries another layout)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ImportError(
            "GPT.from_pretrained needs the 'huggingface_hub' package: pip install 'attnlab[hf]'"
        ) from None
    try:
        return hf_hub_download(repo_id, filename, cache_dir=cache_dir, revision=revision)
    except Exception as e:  # offline, no such repository, HTTP errors: all end in the same advice
        if quiet:
            raise FileNotFoundError(filename) from None
        # (an id is also a relative path, 'models/foo': say that no such folder is here either)
        path_like = "/" in repo_id and repo_id not in PRETRAINED.values()
        local = f" (there is no local folder {repo_id!r} here either)" if path_like else ""
        raise FileNotFoundError(
            f"could not get the weights of {repo_id!r} ({filename}) from the Hugging Face Hub or its local cache "
            f"({type(e).__name__}){local}; connect to the internet once so they are downloaded into the cache "
            f"(~/.cache/huggingface, or $HF_HOME), or pass a local directory holding config.json and "
            f"model.safetensors"
        ) from None
