"""Hugging Face Llama-family interoperability: Llama and Mistral weights in and out.

A Llama block is attnlab's :class:`~attnlab.model.TransformerBlock` with ``pos="rope"``,
``norm="rmsnorm"``, ``mlp="swiglu"`` and no biases; Mistral adds a sliding ``window``. Hugging
Face already stores RoPE in the "rotate half" layout :mod:`attnlab.positions` uses, and its
projections are ``nn.Linear`` like attnlab's, so the mapping is one name per tensor, except for
the MLP, whose gate and up projections attnlab runs as one matmul::

    model.embed_tokens                        -> tok_emb
    model.layers.i.input_layernorm            -> trf_blocks.i.norm1
    model.layers.i.self_attn.q|k|v_proj       -> trf_blocks.i.att.W_query | W_key | W_value
    model.layers.i.self_attn.o_proj           -> trf_blocks.i.att.out_proj
    model.layers.i.post_attention_layernorm   -> trf_blocks.i.norm2
    model.layers.i.mlp.gate_proj, up_proj     -> trf_blocks.i.ff.layers.0   (stacked: gate, then up)
    model.layers.i.mlp.down_proj              -> trf_blocks.i.ff.layers.2
    model.norm, lm_head                       -> final_norm, out_head (or tied to tok_emb)

Like :mod:`attnlab.formats.hf`, this module holds formats only; :class:`attnlab.GPT` builds itself from
them (``GPT.from_hf_llama``, ``GPT.from_pretrained``, ``model.to_hf_llama_state_dict()``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnlab.checks import is_int
from attnlab.formats.hf import FAMILY_SWITCHES_OFF, import_transformers, read_pretrained

if TYPE_CHECKING:  # the model sits above this module
    from attnlab.model import GPT, GPTConfig

__all__ = [
    "LLAMA_FAMILY",
    "config_fields",
    "llama_to_attnlab",
    "read_pretrained_llama",
    "to_hf_llama",
    "to_hf_llama_config",
    "to_hf_llama_state_dict",
]

# model_type values read as a Llama block (Mistral: a Llama with a sliding window).
LLAMA_FAMILY = ("llama", "mistral")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_ATTENTION_NAMES = (("W_query", "q_proj"), ("W_key", "k_proj"), ("W_value", "v_proj"), ("out_proj", "o_proj"))


def _config_dict(hf_config: Any) -> dict[str, Any]:
    if hf_config is None:
        raise ValueError(
            "a Llama state dict does not record heads, RoPE base or norm epsilon: pass hf_config= (its "
            "LlamaConfig / MistralConfig or the dict of its config.json)"
        )
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"hf_config must be a transformers config or a dict, got {type(hf_config).__name__}")


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE's base and scaling from either layout: transformers 5's ``rope_parameters`` or the
    ``rope_theta`` / ``rope_scaling`` keys of older config.json files."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = params or dict(cfg.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, (None if kind == "default" else scaling)


def config_fields(cfg: dict[str, Any], drop_rate: float = 0.0) -> dict[str, Any]:
    """:class:`~attnlab.GPTConfig` fields of a Llama-family ``config.json`` (as a dict)."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in LLAMA_FAMILY:
        raise ValueError(f"expected a Llama-family model ({', '.join(LLAMA_FAMILY)}), got model_type={model_type!r}")
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if not is_int(cfg.get(key)) or not 0 < cfg[key] <= 1 << 31:
            raise ValueError(f"config {key} must be a positive integer, got {cfg.get(key)!r}")
    kv = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if not is_int(kv) or kv <= 0 or cfg["num_attention_heads"] % kv:
        raise ValueError(
            f"config num_key_value_heads={kv!r} must divide num_attention_heads={cfg['num_attention_heads']}"
        )
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"config rms_norm_eps must be a small positive number, got {eps!r}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"attnlab's SwiGLU is silu-gated; this model's hidden_act is {act!r}")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    if not cfg.get("head_dim") and hidden % heads:
        raise ValueError(
            f"config hidden_size={hidden} is not divisible by num_attention_heads={heads}, and no head_dim is given"
        )
    head_dim = cfg.get("head_dim") or hidden // heads  # (Mistral Nemo: 32 heads of 128 in a width of 5120)
    attention_bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ValueError("attnlab's GPT has one bias switch for the output projection and the MLP (bias=...)")
    if cfg.get("pretraining_tp", 1) != 1:
        raise ValueError("pretraining_tp != 1 (a tensor-parallel split of the weights) is not supported")
    theta, scaling = _rope(cfg)
    return dict(
        vocab_size=cfg["vocab_size"],
        context_length=cfg.get("max_position_embeddings", 2048),
        emb_dim=hidden,
        n_heads=heads,
        n_layers=cfg["num_hidden_layers"],
        drop_rate=drop_rate,
        qkv_bias=attention_bias,
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bias=attention_bias,
        ff_dim=cfg["intermediate_size"],
        ln_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        pos="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        norm="rmsnorm",
        mlp="swiglu",
        window=cfg.get("sliding_window") if model_type == "mistral" else None,
        head_size=None if head_dim * heads == hidden else head_dim,
    )


def _fields_from_hf(state: dict[str, Tensor], cfg: dict[str, Any], drop_rate: float) -> dict[str, Any]:
    """:func:`config_fields`, checked against the tensors (their layers; a missing head means tied)."""
    fields = config_fields(cfg, drop_rate)
    layers = {int(m.group(1)) for k in state if (m := _LAYER.match(k))}
    if not layers or layers != set(range(len(layers))):
        raise ValueError(f"not a Llama state dict: layers.0 ... layers.N expected, found {sorted(layers)}")
    if len(layers) != fields["n_layers"]:
        raise ValueError(f"the config says {fields['n_layers']} layers, the weights have {len(layers)}")
    fields["tie_embeddings"] = fields["tie_embeddings"] or "lm_head.weight" not in state
    return fields


def llama_to_attnlab(
    model_or_state_dict: Any, *, hf_config: Any = None, drop_rate: float = 0.0, copy: bool = True
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(GPTConfig fields, attnlab state dict)`` of a Hugging Face Llama or Mistral.

    Args:
        model_or_state_dict: a ``transformers.LlamaForCausalLM`` / ``MistralForCausalLM`` (or their
            base models), or a state dict of one (keys with or without the ``model.`` prefix).
        hf_config: its config (a transformers config or the dict of config.json); read from the
            model when one is given.
        drop_rate: dropout for training the converted model.
        copy: copy every tensor (the default: the result shares no memory with the source). With
            False the tensors of a state dict are *moved*: the dict is emptied and each tensor
            dropped as it is converted, so a caller that owns them (the GGUF reader) never holds
            two copies of the model.
    """
    if hasattr(model_or_state_dict, "state_dict") and callable(model_or_state_dict.state_dict):
        state = model_or_state_dict.state_dict()
        hf_config = getattr(model_or_state_dict, "config", None) if hf_config is None else hf_config
    elif isinstance(model_or_state_dict, Mapping):
        state = dict(model_or_state_dict)
        if not copy and isinstance(model_or_state_dict, dict):
            model_or_state_dict.clear()
    else:
        raise TypeError(
            f"expected a Hugging Face Llama/Mistral model or its state dict, got {type(model_or_state_dict)}"
        )
    state = {k.removeprefix("model."): v for k, v in state.items()}
    for k, v in state.items():
        if not isinstance(v, Tensor):
            raise TypeError(f"state dict entry {k!r} is a {type(v).__name__}, not a tensor")
    fields = _fields_from_hf(state, _config_dict(hf_config), drop_rate)
    C, V, F = fields["emb_dim"], fields["vocab_size"], fields["ff_dim"]
    hd = fields["head_size"] or C // fields["n_heads"]
    q, kv = fields["n_heads"] * hd, fields["n_kv_heads"] * hd
    shapes = {
        "self_attn.q_proj.weight": (q, C),
        "self_attn.k_proj.weight": (kv, C),
        "self_attn.v_proj.weight": (kv, C),
        "self_attn.o_proj.weight": (C, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "mlp.gate_proj.weight": (F, C),
        "mlp.up_proj.weight": (F, C),
        "mlp.down_proj.weight": (C, F),
        "mlp.gate_proj.bias": (F,),
        "mlp.up_proj.bias": (F,),
    }

    def t(key: str) -> Tensor:
        if key not in state:
            raise ValueError(f"not a Llama state dict: {key!r} is missing")
        want = {"embed_tokens.weight": (V, C), "lm_head.weight": (V, C)}.get(key) or shapes.get(
            key.split(".", 2)[-1] if key.startswith("layers.") else key, (C,)
        )
        if tuple(state[key].shape) != want:
            raise ValueError(f"Llama weight {key!r} must have shape {want}, got {tuple(state[key].shape)}")
        return state[key] if copy else state.pop(key)

    new = {"tok_emb.weight": t("embed_tokens.weight"), "final_norm.weight": t("norm.weight")}
    for i in range(fields["n_layers"]):
        h, b = f"layers.{i}.", f"trf_blocks.{i}."
        new |= {
            b + "norm1.weight": t(h + "input_layernorm.weight"),
            b + "att.W_query.weight": t(h + "self_attn.q_proj.weight"),
            b + "att.W_key.weight": t(h + "self_attn.k_proj.weight"),
            b + "att.W_value.weight": t(h + "self_attn.v_proj.weight"),
            b + "att.out_proj.weight": t(h + "self_attn.o_proj.weight"),
            b + "norm2.weight": t(h + "post_attention_layernorm.weight"),
            b + "ff.layers.0.weight": torch.cat([t(h + "mlp.gate_proj.weight"), t(h + "mlp.up_proj.weight")]),
            b + "ff.layers.2.weight": t(h + "mlp.down_proj.weight"),
        }
        if fields["qkv_bias"]:
            for ours, theirs in (
                ("W_query", "q_proj"),
                ("W_key", "k_proj"),
                ("W_value", "v_proj"),
                ("out_proj", "o_proj"),
            ):
                new[b + f"att.{ours}.bias"] = t(h + f"self_attn.{theirs}.bias")
            new[b + "ff.layers.0.bias"] = torch.cat([t(h + "mlp.gate_proj.bias"), t(h + "mlp.up_proj.bias")])
            new[b + "ff.layers.2.bias"] = t(h + "mlp.down_proj.bias")
    if not fields["tie_embeddings"]:
        new["out_head.weight"] = t("lm_head.weight")
    if not copy:
        return fields, {k: v.detach().contiguous() for k, v in new.items()}
    return fields, {k: v.detach().clone().contiguous() for k, v in new.items()}


# --------------------------------------------------------------------------------------------
# attnlab -> Hugging Face
# --------------------------------------------------------------------------------------------
def _check_exportable(model: GPT) -> GPTConfig:
    cfg = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(cfg, "kv_heads"):
        raise TypeError(f"expected an attnlab GPT, got {type(model).__name__}")
    llama = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "sinks": 0, "qk_norm": False}
    llama |= {k: v for k, v in FAMILY_SWITCHES_OFF.items() if k != "head_size"}  # (Llama's config has head_dim)
    other = {k: getattr(cfg, k) for k, v in llama.items() if getattr(cfg, k, v) != v}
    if cfg.qkv_bias != cfg.bias:
        other["qkv_bias, bias"] = (cfg.qkv_bias, cfg.bias)
    if other:
        raise ValueError(
            f"a Llama block has RoPE, RMSNorm, a SwiGLU MLP, no sinks or QK-norm, and one bias switch; this model has "
            f"{other}"
        )
    return cfg


def to_hf_llama_state_dict(model: GPT) -> dict[str, Tensor]:
    """A state dict for ``transformers.LlamaForCausalLM`` (``MistralForCausalLM`` with a window),
    config from :func:`to_hf_llama_config`."""
    cfg = _check_exportable(model)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {"model.embed_tokens.weight": sd["tok_emb.weight"], "model.norm.weight": sd["final_norm.weight"]}
    for i in range(cfg.n_layers):
        h, b = f"model.layers.{i}.", f"trf_blocks.{i}."
        gate, up = sd[b + "ff.layers.0.weight"].chunk(2, dim=0)
        out |= {
            h + "input_layernorm.weight": sd[b + "norm1.weight"],
            h + "self_attn.q_proj.weight": sd[b + "att.W_query.weight"],
            h + "self_attn.k_proj.weight": sd[b + "att.W_key.weight"],
            h + "self_attn.v_proj.weight": sd[b + "att.W_value.weight"],
            h + "self_attn.o_proj.weight": sd[b + "att.out_proj.weight"],
            h + "post_attention_layernorm.weight": sd[b + "norm2.weight"],
            h + "mlp.gate_proj.weight": gate,
            h + "mlp.up_proj.weight": up,
            h + "mlp.down_proj.weight": sd[b + "ff.layers.2.weight"],
        }
        if cfg.bias:
            for ours, theirs in (
                ("W_query", "q_proj"),
                ("W_key", "k_proj"),
                ("W_value", "v_proj"),
                ("out_proj", "o_proj"),
            ):
                out[h + f"self_attn.{theirs}.bias"] = sd[b + f"att.{ours}.bias"]
            gate_b, up_b = sd[b + "ff.layers.0.bias"].chunk(2)
            out |= {h + "mlp.gate_proj.bias": gate_b, h + "mlp.up_proj.bias": up_b}
            out[h + "mlp.down_proj.bias"] = sd[b + "ff.layers.2.bias"]
    out["lm_head.weight"] = sd["tok_emb.weight"] if cfg.tie_embeddings else sd["out_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_llama_config(model: GPT) -> Any:
    """The ``transformers.LlamaConfig`` (``MistralConfig`` when the model has a window) matching ``model``."""
    cfg = _check_exportable(model)
    transformers = import_transformers()
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    common = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.emb_dim,
        intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.context_length,
        rms_norm_eps=cfg.ln_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        rope_parameters=rope,
        attention_dropout=cfg.drop_rate,
        head_dim=cfg.head_dim,
    )
    if cfg.window is not None:
        return transformers.MistralConfig(**common, sliding_window=cfg.window)
    return transformers.LlamaConfig(**common, attention_bias=cfg.bias, mlp_bias=cfg.bias)


def to_hf_llama(model: GPT) -> Any:
    """A ``transformers.LlamaForCausalLM`` / ``MistralForCausalLM`` with ``model``'s weights (eval mode)."""
    transformers = import_transformers()
    hf_cfg = to_hf_llama_config(model)
    cls = transformers.MistralForCausalLM if hf_cfg.model_type == "mistral" else transformers.LlamaForCausalLM
    hf = cls(hf_cfg)
    hf.load_state_dict(to_hf_llama_state_dict(model), strict=not model.config.tie_embeddings)
    if model.config.tie_embeddings:
        hf.tie_weights()
    return hf.to(device=model.device, dtype=model.dtype).eval()


def read_pretrained_llama(
    name: str, *, cache_dir: Any = None, revision: str | None = None
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(config.json, state dict)`` of a Llama-family model: a local directory or a Hub repository
    (the Hugging Face cache when offline), single or sharded safetensors."""
    cfg, state = read_pretrained(name, cache_dir=cache_dir, revision=revision)
    if cfg.get("model_type") not in LLAMA_FAMILY:
        raise ValueError(f"{name!r} is not a Llama-family model (model_type={cfg.get('model_type')!r})")
    return cfg, state
