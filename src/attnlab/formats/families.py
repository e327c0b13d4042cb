"""Hugging Face model families after Llama: one table per family, one dispatch by ``model_type``.

Every family is a set of :class:`~attnlab.GPTConfig` switches on the same :class:`~attnlab.GPT`
(no copy of the model), and a table saying where each attnlab tensor comes from:

============  ==============  ============================================================================
family        model_type      what it switches on (beyond Llama's RoPE, RMSNorm, SwiGLU, grouped heads)
============  ==============  ============================================================================
Qwen2/2.5     qwen2           biases on the query, key and value projections (``qkv_bias``)
Qwen3         qwen3           QK-norm per head (``qk_norm``), ``head_size`` apart from the width
Gemma         gemma           GeGLU (``mlp="geglu"``), embeddings times sqrt(width) (``embed_scale``),
                              ``(1 + w)`` RMSNorm gains (``norm_offset=1``), tied embeddings
Gemma 2       gemma2          Gemma's, plus attention and final-logit soft-capping (``attn_softcap``,
                              ``logit_softcap``), sliding-window and global layers alternating
                              (``window_layers``), sandwich norms (``post_norms``), ``attn_scale``
Gemma 3       gemma3_text     Gemma 2's without the caps, plus QK-norm, a RoPE base of the window
                              layers' own (``rope_local_theta``), five window layers in six
Phi-3         phi3            fused ``qkv_proj`` and ``gate_up_proj`` (split here), partial rotary
OLMo 2        olmo2           norms after each sublayer only (``pre_norms=False, post_norms=True``),
                              QK-norm over the whole width (``qk_norm="full"``)
GPT-NeoX      gpt_neox        Pythia's: LayerNorm with biases, biases everywhere, partial rotary
                              (``rotary_fraction``), parallel residual (``parallel_residual``),
                              fused per-head ``query_key_value`` (split here)
============  ==============  ============================================================================

Llama and Mistral go through :mod:`attnlab.formats.hf_llama`. :func:`to_attnlab` takes a
transformers model, or a state dict with HF names and the dict of its ``config.json`` (what a GGUF
reader produces too), and returns ``(GPTConfig fields, attnlab state dict)``; :func:`to_hf_state_dict`
goes back. Like the other modules of :mod:`attnlab.formats` this holds formats only:
``GPT.from_hf`` builds the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnlab.formats import hf_llama

if TYPE_CHECKING:  # the model sits above this module
    from attnlab.model import GPT

__all__ = ["FAMILIES", "MODEL_TYPES", "Split", "config_fields", "to_attnlab", "to_hf_state_dict"]


@dataclass(frozen=True)
class Split:
    """Part ``part`` (``"q"``, ``"k"`` or ``"v"``) of a fused query/key/value tensor ``name``.

    ``per_head=False``: all queries, then all keys, then all values (Phi-3's ``qkv_proj``);
    ``per_head=True``: for each head its query, key and value in turn (GPT-NeoX's ``query_key_value``).
    """

    name: str
    part: str
    per_head: bool = False


# A source: one HF tensor (its name), several stacked along dim 0 (gate then up), or a Split.
Source = str | tuple[str, ...] | Split

# Llama's layer names (Qwen 2/3, Gemma share them).
_ATTENTION = {
    "att.W_query.weight": "self_attn.q_proj.weight",
    "att.W_key.weight": "self_attn.k_proj.weight",
    "att.W_value.weight": "self_attn.v_proj.weight",
    "att.out_proj.weight": "self_attn.o_proj.weight",
}
_QKV_BIAS = {
    "att.W_query.bias": "self_attn.q_proj.bias",
    "att.W_key.bias": "self_attn.k_proj.bias",
    "att.W_value.bias": "self_attn.v_proj.bias",
}
_QK_NORM = {"att.q_norm.weight": "self_attn.q_norm.weight", "att.k_norm.weight": "self_attn.k_norm.weight"}
_GATED_MLP = {
    "ff.layers.0.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "ff.layers.2.weight": "mlp.down_proj.weight",
}
_PRE_NORMS = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight"}
_SANDWICH_NORMS = {
    "norm1.weight": "input_layernorm.weight",
    "post_norm1.weight": "post_attention_layernorm.weight",
    "norm2.weight": "pre_feedforward_layernorm.weight",
    "post_norm2.weight": "post_feedforward_layernorm.weight",
}
_LLAMA_OUTER = {"tok_emb.weight": "embed_tokens.weight", "final_norm.weight": "norm.weight"}


@dataclass(frozen=True)
class Family:
    """One family's table: config switches and tensor sources.

    Attributes:
        fields: ``config.json`` dict -> the switches that differ from Llama's (see :func:`config_fields`).
        layer: attnlab name inside ``trf_blocks.i`` -> HF source inside ``layers.i``.
        outer: attnlab names outside the blocks -> HF names (``out_head`` is added when untied).
        head: the HF names of the untied output head (GPT-NeoX: ``lm_head`` in what transformers 5
            writes, ``embed_out`` in the published files); export writes the first.
        prefix: what HF puts before the names above (stripped when present).
    """

    fields: Callable[[dict[str, Any]], dict[str, Any]]
    layer: dict[str, Source]
    outer: dict[str, str]
    head: tuple[str, ...] = ("lm_head.weight",)
    prefix: str = "model."


# --------------------------------------------------------------------------------------------
# config.json -> GPTConfig fields
# --------------------------------------------------------------------------------------------
# transformers' ACT2FN names -> GPTConfig.activation. "gelu_python" is ACT2FN's other exact (erf) GELU:
# the one name of it a Gemma 1 config can hold, since Gemma 1 reads "gelu" as the tanh approximation.
_GELUS = {
    "gelu": "gelu",
    "gelu_python": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
}


def _rope(params: Mapping[str, Any] | None, theta: float) -> tuple[float, dict[str, Any] | None, float]:
    """``(base, scaling or None, partial rotary factor)`` of one ``rope_parameters`` dict."""
    params = dict(params or {})
    theta = float(params.pop("rope_theta", theta))
    fraction = float(params.pop("partial_rotary_factor", 1.0))
    kind = params.get("rope_type", params.get("type", "default"))
    return theta, (None if kind == "default" else params), fraction


def _window_layers(cfg: dict[str, Any], n_layers: int, derived: list[bool] | None) -> dict[str, Any]:
    """``window`` and ``window_layers`` from ``layer_types`` (transformers 5) or the family's rule."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ValueError(f"layer_types must name 'sliding_attention' or 'full_attention' per layer, got {types}")
        sliding = [t == "sliding_attention" for t in types]
    else:
        sliding = derived if derived is not None else [window is not None] * n_layers
    if window is None or not any(sliding):
        return dict(window=None)
    if all(sliding):
        return dict(window=int(window))
    return dict(window=int(window), window_layers=[i for i, s in enumerate(sliding) if s])


def _llama_like(cfg: dict[str, Any], act_key: str = "hidden_act", act: str = "silu") -> dict[str, Any]:
    """The fields every family reads the same way (Llama's names)."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    got = cfg.get(act_key) or act
    if act == "silu" and got != "silu":
        raise ValueError(f"this family's gated MLP is silu-gated (SwiGLU); the config's {act_key} is {got!r}")
    params = cfg.get("rope_parameters")
    if params is None and (cfg.get("rope_scaling") or "rope_theta" in cfg):
        params = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 10000.0)}
    theta, scaling, fraction = _rope(params, 10000.0)
    fraction = float(cfg.get("partial_rotary_factor", fraction))
    return dict(
        vocab_size=cfg["vocab_size"],
        context_length=cfg.get("max_position_embeddings", 2048),
        emb_dim=hidden,
        n_heads=heads,
        n_layers=cfg["num_hidden_layers"],
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=False,
        bias=False,
        ff_dim=cfg["intermediate_size"],
        ln_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        pos="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_fraction=fraction,
        norm="rmsnorm",
        mlp="swiglu",
        head_size=None if head_dim * heads == hidden else head_dim,
    )


def _no_bias(cfg: dict[str, Any], family: str) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise ValueError(f"{key}=True in a {family} config: attnlab maps {family} without those biases")


def _qwen2(cfg: dict[str, Any]) -> dict[str, Any]:
    fields = _llama_like(cfg)
    n = fields["n_layers"]
    sliding = [bool(cfg.get("use_sliding_window")) and i >= cfg.get("max_window_layers", n) for i in range(n)]
    return fields | dict(qkv_bias=True) | _window_layers(cfg, n, sliding)  # q, k, v biased; o_proj and MLP not


def _qwen3(cfg: dict[str, Any]) -> dict[str, Any]:
    _no_bias(cfg, "Qwen3")
    fields = _llama_like(cfg)
    n = fields["n_layers"]
    sliding = [bool(cfg.get("use_sliding_window")) and i >= cfg.get("max_window_layers", n) for i in range(n)]
    return fields | dict(qk_norm=True) | _window_layers(cfg, n, sliding)


def _gemma(cfg: dict[str, Any]) -> dict[str, Any]:
    _no_bias(cfg, "Gemma")
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if cfg.get("model_type") == "gemma" and act == "gelu":
        act = "gelu_pytorch_tanh"  # Gemma 1's configs say "gelu" and mean the tanh approximation (as transformers)
    if act not in _GELUS:
        raise ValueError(f"Gemma's MLP is GELU-gated; the config's activation is {act!r}")
    return _llama_like(cfg, act="gelu") | dict(
        mlp="geglu",
        activation=_GELUS[act],
        embed_scale=cfg["hidden_size"] ** 0.5,
        norm_offset=1.0,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
    )


def _gemma2(cfg: dict[str, Any]) -> dict[str, Any]:
    fields = _gemma(cfg)
    n, head_dim = fields["n_layers"], fields.get("head_size") or cfg["hidden_size"] // fields["n_heads"]
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True: attnlab's GPT is causal")
    pattern = cfg.get("sliding_window_pattern", 6 if cfg.get("model_type") == "gemma3_text" else 2)
    fields |= _window_layers(cfg, n, [bool((i + 1) % pattern) for i in range(n)])
    return fields | dict(
        attn_scale=cfg.get("query_pre_attn_scalar", head_dim) ** -0.5,  # as transformers: not always head_dim's
        attn_softcap=cfg.get("attn_logit_softcapping"),
        logit_softcap=cfg.get("final_logit_softcapping"),
        post_norms=True,
    )


def _gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    params = cfg.get("rope_parameters")
    if params is not None and "full_attention" in params:  # transformers 5: one dict per layer type
        theta, scaling, _ = _rope(params["full_attention"], 1_000_000.0)
        local_theta, local_scaling, _ = _rope(params.get("sliding_attention"), 10_000.0)
    else:  # older config.json files: rope_theta (+ rope_scaling) globally, rope_local_base_freq locally
        theta, scaling, _ = _rope({**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e6)}, 1e6)
        local_theta, local_scaling = float(cfg.get("rope_local_base_freq", 10_000.0)), None
    if local_scaling is not None:
        raise ValueError(f"rope scaling of the sliding-window layers ({local_scaling}) is not supported")
    fields = _gemma2({**cfg, "rope_parameters": None, "rope_scaling": None, "rope_theta": theta})
    fields |= dict(rope_theta=theta, rope_scaling=scaling, qk_norm=True)
    if fields.get("window_layers"):
        fields["rope_local_theta"] = local_theta
    elif fields["window"] is not None and local_theta != theta:  # every layer slides: all are local
        fields |= dict(rope_theta=local_theta, rope_scaling=None)
    return fields


def _phi3(cfg: dict[str, Any]) -> dict[str, Any]:
    fields = _llama_like(cfg)
    if cfg.get("attention_bias"):
        raise ValueError("attention_bias=True in a Phi-3 config: attnlab maps Phi-3 without biases")
    return fields | _window_layers(cfg, fields["n_layers"], None)


def _olmo2(cfg: dict[str, Any]) -> dict[str, Any]:
    _no_bias(cfg, "OLMo 2")
    return _llama_like(cfg) | dict(qk_norm="full", pre_norms=False, post_norms=True)


def _gpt_neox(cfg: dict[str, Any]) -> dict[str, Any]:
    act = cfg.get("hidden_act", "gelu")
    if act not in _GELUS:
        raise ValueError(f"attnlab's GPT-NeoX MLP is a GELU one; the config's hidden_act is {act!r}")
    if not cfg.get("attention_bias", True):
        raise ValueError("attention_bias=False in a GPT-NeoX config: attnlab has one bias switch for it and the MLP")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    params = cfg.get("rope_parameters")
    if params is None:  # older config.json: rotary_pct, rotary_emb_base, rope_scaling
        params = {
            **(cfg.get("rope_scaling") or {}),
            "rope_theta": cfg.get("rotary_emb_base", 10000.0),
            "partial_rotary_factor": cfg.get("rotary_pct", 0.25),
        }
    theta, scaling, fraction = _rope(params, 10000.0)
    return dict(
        vocab_size=cfg["vocab_size"],
        context_length=cfg.get("max_position_embeddings", 2048),
        emb_dim=hidden,
        n_heads=heads,
        n_layers=cfg["num_hidden_layers"],
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True,
        bias=True,
        ff_dim=cfg["intermediate_size"],
        ln_eps=float(cfg.get("layer_norm_eps", 1e-5)),
        activation=_GELUS[act],
        pos="rope",
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_fraction=fraction,
        norm="layernorm",
        mlp="gelu",
        parallel_residual=bool(cfg.get("use_parallel_residual", True)),
    )


# --------------------------------------------------------------------------------------------
# The tables
# --------------------------------------------------------------------------------------------
_NEOX_LAYER: dict[str, Source] = {
    "norm1.weight": "input_layernorm.weight",
    "norm1.bias": "input_layernorm.bias",
    **{
        f"att.{m}.{p}": Split(f"attention.query_key_value.{p}", s, per_head=True)
        for m, s in (("W_query", "q"), ("W_key", "k"), ("W_value", "v"))
        for p in ("weight", "bias")
    },
    "att.out_proj.weight": "attention.dense.weight",
    "att.out_proj.bias": "attention.dense.bias",
    "norm2.weight": "post_attention_layernorm.weight",
    "norm2.bias": "post_attention_layernorm.bias",
    "ff.layers.0.weight": "mlp.dense_h_to_4h.weight",
    "ff.layers.0.bias": "mlp.dense_h_to_4h.bias",
    "ff.layers.2.weight": "mlp.dense_4h_to_h.weight",
    "ff.layers.2.bias": "mlp.dense_4h_to_h.bias",
}
_PHI3_LAYER: dict[str, Source] = {
    **_PRE_NORMS,
    "att.W_query.weight": Split("self_attn.qkv_proj.weight", "q"),
    "att.W_key.weight": Split("self_attn.qkv_proj.weight", "k"),
    "att.W_value.weight": Split("self_attn.qkv_proj.weight", "v"),
    "att.out_proj.weight": "self_attn.o_proj.weight",
    "ff.layers.0.weight": "mlp.gate_up_proj.weight",  # gate rows, then up rows: attnlab's layout already
    "ff.layers.2.weight": "mlp.down_proj.weight",
}

FAMILIES: dict[str, Family] = {
    "qwen2": Family(_qwen2, {**_PRE_NORMS, **_ATTENTION, **_QKV_BIAS, **_GATED_MLP}, _LLAMA_OUTER),
    "qwen3": Family(_qwen3, {**_PRE_NORMS, **_ATTENTION, **_QK_NORM, **_GATED_MLP}, _LLAMA_OUTER),
    "gemma": Family(_gemma, {**_PRE_NORMS, **_ATTENTION, **_GATED_MLP}, _LLAMA_OUTER),
    "gemma2": Family(_gemma2, {**_SANDWICH_NORMS, **_ATTENTION, **_GATED_MLP}, _LLAMA_OUTER),
    "gemma3_text": Family(_gemma3, {**_SANDWICH_NORMS, **_ATTENTION, **_QK_NORM, **_GATED_MLP}, _LLAMA_OUTER),
    "phi3": Family(_phi3, _PHI3_LAYER, _LLAMA_OUTER),
    "olmo2": Family(
        _olmo2,
        {
            **_ATTENTION,
            **_QK_NORM,
            "post_norm1.weight": "post_attention_layernorm.weight",
            **_GATED_MLP,
            "post_norm2.weight": "post_feedforward_layernorm.weight",
        },
        _LLAMA_OUTER,
    ),
    "gpt_neox": Family(
        _gpt_neox,
        _NEOX_LAYER,
        {
            "tok_emb.weight": "embed_in.weight",
            "final_norm.weight": "final_layer_norm.weight",
            "final_norm.bias": "final_layer_norm.bias",
        },
        head=("lm_head.weight", "embed_out.weight"),
        prefix="gpt_neox.",
    ),
}
# Every model_type GPT.from_hf reads besides GPT-2 (Llama and Mistral: attnlab.formats.hf_llama).
MODEL_TYPES = (*hf_llama.LLAMA_FAMILY, *FAMILIES)
_LAYER = re.compile(r"^layers\.(\d+)\.")
_GPT2 = (
    "GPT-2 (model_type='gpt2') has a module of its own: attnlab.formats.hf (GPT.from_hf_gpt2 / GPT.from_hf "
    "to read it, to_hf_gpt2_state_dict / to_hf_gpt2 to write it); this module holds the families after Llama"
)


def config_fields(cfg: Mapping[str, Any], drop_rate: float = 0.0) -> dict[str, Any]:
    """:class:`~attnlab.GPTConfig` fields of a ``config.json`` (as a dict) of any family in :data:`MODEL_TYPES`."""
    cfg = dict(cfg)
    model_type = cfg.get("model_type")
    if model_type in hf_llama.LLAMA_FAMILY:
        return hf_llama.config_fields(cfg, drop_rate)
    if model_type == "gpt2":
        raise ValueError(_GPT2)
    if model_type not in FAMILIES:
        raise ValueError(f"attnlab reads the model types {', '.join(MODEL_TYPES)} (and gpt2), got {model_type!r}")
    try:
        return FAMILIES[model_type].fields(cfg) | dict(drop_rate=drop_rate)
    except KeyError as e:
        raise ValueError(f"a {model_type} config.json needs {e.args[0]!r}") from None


def _config_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"hf_config must be a transformers config or the dict of a config.json, got {hf_config!r}")


def _expected_shapes(f: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor name (inside a block or outside) a GPT with fields ``f`` has."""
    C, V, F = f["emb_dim"], f["vocab_size"], f["ff_dim"]
    hd = f.get("head_size") or C // f["n_heads"]
    q, kv = f["n_heads"] * hd, (f.get("n_kv_heads") or f["n_heads"]) * hd
    gated = 2 if f["mlp"] in ("swiglu", "geglu") else 1
    full = f.get("qk_norm") == "full"
    return {
        "tok_emb.weight": (V, C),
        "out_head.weight": (V, C),
        "att.W_query.weight": (q, C),
        "att.W_key.weight": (kv, C),
        "att.W_value.weight": (kv, C),
        "att.out_proj.weight": (C, q),
        "att.W_query.bias": (q,),
        "att.W_key.bias": (kv,),
        "att.W_value.bias": (kv,),
        "att.q_norm.weight": (q,) if full else (hd,),
        "att.k_norm.weight": (kv,) if full else (hd,),
        "ff.layers.0.weight": (gated * F, C),
        "ff.layers.0.bias": (gated * F,),
        "ff.layers.2.weight": (C, F),
    }


def _read(state: Mapping[str, Tensor], where: str, source: Source, f: dict[str, Any]) -> tuple[Tensor, str]:
    """The tensor ``source`` names (under ``where``), and how to name it in an error."""

    def get(name: str) -> Tensor:
        if where + name not in state:
            raise ValueError(f"not a {f['model_type']} state dict: {where + name!r} is missing")
        return state[where + name]

    if isinstance(source, str):
        return get(source), where + source
    if isinstance(source, tuple):
        return torch.cat([get(s) for s in source]), " + ".join(where + s for s in source)
    fused = get(source.name)
    hd = f.get("head_size") or f["emb_dim"] // f["n_heads"]
    H, Hkv = f["n_heads"], f.get("n_kv_heads") or f["n_heads"]
    name = f"{where}{source.name} ({source.part})"
    if source.per_head:  # (H, 3, hd, ...) : each head's q, k, v rows in turn
        if fused.shape[0] != 3 * H * hd:
            raise ValueError(f"{where + source.name} must have {3 * H * hd} rows, got {tuple(fused.shape)}")
        part = fused.view(H, 3, hd, *fused.shape[1:])[:, "qkv".index(source.part)]
        return part.reshape(H * hd, *fused.shape[1:]), name
    sizes = [H * hd, Hkv * hd, Hkv * hd]
    if fused.shape[0] != sum(sizes):
        raise ValueError(f"{where + source.name} must have {sum(sizes)} rows (q, k, v), got {tuple(fused.shape)}")
    return fused.split(sizes)["qkv".index(source.part)], name


def to_attnlab(
    model_or_state_dict: Any, *, hf_config: Any = None, drop_rate: float = 0.0, copy: bool = True
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(GPTConfig fields, attnlab state dict)`` of a Hugging Face model of any family in :data:`MODEL_TYPES`.

    Args:
        model_or_state_dict: a transformers ``...ForCausalLM`` (or its base model), or a state dict
            with Hugging Face's names (with or without the ``model.`` / ``gpt_neox.`` prefix).
        hf_config: its config (a transformers config or the dict of ``config.json``); read from the
            model when one is given. Its ``model_type`` picks the family.
        drop_rate: dropout for training the converted model.
        copy: copy every tensor (the default: the result shares no memory with the input); False
            when the input is thrown away anyway (a GGUF file's tensors), to halve the peak memory.
    """
    if hasattr(model_or_state_dict, "state_dict") and callable(model_or_state_dict.state_dict):
        state = dict(model_or_state_dict.state_dict())
        hf_config = getattr(model_or_state_dict, "config", None) if hf_config is None else hf_config
    elif isinstance(model_or_state_dict, Mapping):
        state = dict(model_or_state_dict)
    else:
        raise TypeError(f"expected a Hugging Face model or its state dict, got {type(model_or_state_dict).__name__}")
    if hf_config is None:
        raise ValueError("a state dict does not record heads, RoPE base or norms: pass hf_config= (its config.json)")
    cfg = _config_dict(hf_config)
    model_type = cfg.get("model_type")
    if model_type in hf_llama.LLAMA_FAMILY:
        return hf_llama.llama_to_attnlab(state, hf_config=cfg, drop_rate=drop_rate)
    fields = config_fields(cfg, drop_rate)
    family = FAMILIES[model_type]
    for k, v in state.items():
        if not isinstance(v, Tensor):
            raise TypeError(f"state dict entry {k!r} is a {type(v).__name__}, not a tensor")
    state = {k.removeprefix(family.prefix): v for k, v in state.items()}
    layers = {int(m.group(1)) for k in state if (m := _LAYER.match(k))}
    if layers != set(range(fields["n_layers"])):
        raise ValueError(
            f"the config says {fields['n_layers']} layers, the weights have layers {sorted(layers)[:8]}"
            f"{'...' if len(layers) > 8 else ''}"
        )
    head = next((h for h in family.head if h in state), None)
    fields["tie_embeddings"] = fields["tie_embeddings"] or head is None
    shapes = _expected_shapes(fields | {"model_type": model_type})
    C = fields["emb_dim"]
    sources = [(name, src, "") for name, src in family.outer.items()]
    if not fields["tie_embeddings"]:
        sources.append(("out_head.weight", head, ""))
    for i in range(fields["n_layers"]):
        sources += [(f"trf_blocks.{i}.{name}", src, f"layers.{i}.") for name, src in family.layer.items()]
    new = {}
    for name, src, where in sources:
        tensor, hf_name = _read(state, where, src, fields | {"model_type": model_type})
        want = shapes.get(name.split(".", 2)[-1] if where else name, (C,))
        if tuple(tensor.shape) != want:
            raise ValueError(f"{model_type} weight {hf_name!r} must have shape {want}, got {tuple(tensor.shape)}")
        new[name] = tensor
    if copy:
        return fields, {k: v.detach().clone().contiguous() for k, v in new.items()}
    return fields, {k: v.detach().contiguous() for k, v in new.items()}


# The GPTConfig switches that make a family's computation (not its sizes, nor its RoPE base).
_SWITCHES = (
    "pos",
    "norm",
    "mlp",
    "activation",
    "bias",
    "qkv_bias",
    "qk_norm",
    "sinks",
    "norm_offset",
    "embed_scale",
    "attn_scale",
    "attn_softcap",
    "logit_softcap",
    "window",
    "window_layers",
    "rope_local_theta",
    "pre_norms",
    "post_norms",
    "rotary_fraction",
    "parallel_residual",
    "head_dim",
)
_GELU_NAMES = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}


def _as_config_json(cfg: Any, model_type: str) -> dict[str, Any]:
    """The ``config.json`` a ``model_type`` checkpoint of ``cfg`` would have, in every spelling the
    family readers know: what a family cannot hold, its reader (:data:`FAMILIES`) leaves out."""
    window = cfg.window if cfg.window is not None and cfg.window < cfg.context_length else None
    sliding = None
    if window is not None:
        layers = set(range(cfg.n_layers) if cfg.window_layers is None else cfg.window_layers)
        sliding = ["sliding_attention" if i in layers else "full_attention" for i in range(cfg.n_layers)]
    act = "silu" if cfg.mlp == "swiglu" else _GELU_NAMES.get(cfg.activation, cfg.activation)
    if model_type == "gemma" and act == "gelu":
        # Gemma 1 reads "gelu" as the tanh approximation (GemmaConfig rewrites it, and so does _gemma);
        # GemmaMLP runs ACT2FN[hidden_act] (hidden_activation before transformers 5), where
        # "gelu_python" is the exact erf GELU.
        act = "gelu_python"
    theta = cfg.rope_theta
    return dict(
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.emb_dim,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        num_hidden_layers=cfg.n_layers,
        intermediate_size=cfg.ff_dim,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.context_length,
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act=act,
        hidden_activation=act,
        attention_bias=cfg.bias,
        rope_theta=theta,
        rope_scaling=cfg.rope_scaling,
        rope_local_base_freq=cfg.rope_local_theta if cfg.rope_local_theta is not None else theta,
        partial_rotary_factor=cfg.rotary_fraction,
        rotary_pct=cfg.rotary_fraction,
        rotary_emb_base=theta,
        use_parallel_residual=cfg.parallel_residual,
        sliding_window=window,
        use_sliding_window=window is not None,
        layer_types=sliding,
        query_pre_attn_scalar=cfg.head_dim if cfg.attn_scale is None else cfg.attn_scale**-2,
        attn_logit_softcapping=cfg.attn_softcap,
        final_logit_softcapping=cfg.logit_softcap,
    )


def _switches(fields: dict[str, Any] | Any, config_class: type) -> dict[str, Any]:
    """The :data:`_SWITCHES` of a GPTConfig or its ``fields`` (built as ``config_class``: this module sits
    below attnlab.model, so it does not import the class), defaults spelled out (so equal means the same
    model)."""
    cfg = config_class(**fields) if isinstance(fields, dict) else fields
    out = {k: getattr(cfg, k) for k in _SWITCHES}
    out["qk_norm"] = "head" if out["qk_norm"] is True else out["qk_norm"]
    out["attn_scale"] = float(cfg.head_dim**-0.5 if cfg.attn_scale is None else cfg.attn_scale)
    out["embed_scale"] = float(1.0 if cfg.embed_scale is None else cfg.embed_scale)
    if cfg.window is None or cfg.window >= cfg.context_length:
        out["window"] = None
    if cfg.mlp not in ("gelu", "geglu"):
        out["activation"] = None  # (unused)
    return out


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) > 1e-6 * max(abs(a), abs(b), 1.0)
    return a != b


def _check_family(model: GPT, model_type: str) -> None:
    """Refuse exporting ``model`` as ``model_type`` unless that family's reader, given a config.json
    that says all of the model's settings, gives back the model's switches (:data:`FAMILIES` is the
    one table both ways)."""
    kind = type(model.config)
    have, probe, why = _switches(model.config, kind), _as_config_json(model.config, model_type), ""
    try:
        want = _switches(config_fields(probe), kind)
    except ValueError as e:  # the reader refuses the model's activation or biases: compare with the family's own
        why = f" ({e})"
        want = _switches(
            config_fields(
                {k: v for k, v in probe.items() if k not in ("hidden_act", "hidden_activation", "attention_bias")}
            ),
            kind,
        )
        want["activation"] = have["activation"] if want["mlp"] == have["mlp"] else want["activation"]
    diff = [k for k in _SWITCHES if _differs(have[k], want[k])]
    if diff:
        needs = ", ".join(f"{k}={want[k]!r}" for k in diff)
        has = ", ".join(f"{k}={have[k]!r}" for k in diff)
        raise ValueError(
            f"model_type={model_type!r} needs {needs}{why}; this model has {has}: export it under its own family"
        )
    if why:  # the reader refused the probe on a setting that is not a switch of its own: say only why
        raise ValueError(f"model_type={model_type!r} cannot hold this model{why}: export it under its own family")


def to_hf_state_dict(model: GPT, model_type: str) -> dict[str, Tensor]:
    """``model``'s weights under the names of the Hugging Face family ``model_type`` (the inverse
    of :func:`to_attnlab`). The model's switches must be that family's (e.g. a model read from one):
    anything else is a ValueError naming the switches that differ."""
    if model_type == "gpt2":
        raise ValueError(_GPT2)
    if model_type in hf_llama.LLAMA_FAMILY:
        try:
            return hf_llama.to_hf_llama_state_dict(model)
        except ValueError as e:
            raise ValueError(f"model_type={model_type!r}: {e}") from None
    if model_type not in FAMILIES:
        raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)} (or gpt2), got {model_type!r}")
    _check_family(model, model_type)
    family, cfg = FAMILIES[model_type], model.config
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out: dict[str, Tensor] = {}
    pieces: dict[str, dict[str, Tensor]] = {}  # fused tensors, gathered part by part
    sources = [(name, src, "") for name, src in family.outer.items()]
    for i in range(cfg.n_layers):
        sources += [(f"trf_blocks.{i}.{name}", src, f"layers.{i}.") for name, src in family.layer.items()]
    for name, src, where in sources:
        if name not in sd:
            raise ValueError(f"this model has no {name!r}: it is not a {model_type} model")
        t = sd[name]
        if isinstance(src, str):
            out[family.prefix + where + src] = t
        elif isinstance(src, tuple):
            for s, part in zip(src, t.chunk(len(src)), strict=True):
                out[family.prefix + where + s] = part
        else:
            pieces.setdefault(family.prefix + where + src.name, {})[src.part] = t
            if len(pieces[family.prefix + where + src.name]) == 3:
                q, k, v = (pieces[family.prefix + where + src.name][p] for p in "qkv")
                if src.per_head:
                    H = cfg.n_heads
                    fused = torch.stack([p.reshape(H, cfg.head_dim, *p.shape[1:]) for p in (q, k, v)], dim=1)
                    out[family.prefix + where + src.name] = fused.reshape(-1, *q.shape[1:])
                else:
                    out[family.prefix + where + src.name] = torch.cat([q, k, v])
    out[family.head[0]] = sd["tok_emb.weight"] if cfg.tie_embeddings else sd["out_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}
