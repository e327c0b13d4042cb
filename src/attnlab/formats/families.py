"""Hugging Face model families: one table of weight names, one dispatch by ``model_type``.

Every family is a set of :class:`~attnlab.GPTConfig` switches on the same :class:`~attnlab.GPT`
(no copy of the model), and a row of :data:`FAMILIES` saying where each attnlab tensor comes from:

============  ==============  ============================================================================
family        model_type      what it switches on
============  ==============  ============================================================================
GPT-2         gpt2            learned positions, LayerNorm, a GELU MLP, biases; ``Conv1D`` weights
                              (stored transposed) and a fused ``c_attn`` (split here)
Llama         llama           RoPE, RMSNorm, SwiGLU, grouped heads; biases when ``attention_bias``
Mistral       mistral         Llama's, with a sliding ``window``
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
OLMo 3        olmo3           OLMo 2's, plus sliding-window layers, three in four (``window_layers``),
                              the full layers' RoPE scaling (``rope_local_theta`` for the window's)
GPT-NeoX      gpt_neox        Pythia's: LayerNorm with biases, biases everywhere, partial rotary
                              (``rotary_fraction``), parallel residual (``parallel_residual``),
                              fused per-head ``query_key_value`` (split here)
============  ==============  ============================================================================

A source in a row is a Hugging Face name, a tuple of names stacked along the rows (gate, then up:
attnlab runs them as one matmul), a :class:`Conv1D` (a weight stored ``(in, out)``, GPT-2's) or a
:class:`Split` (one part of a fused query/key/value tensor): a family's fixes are kinds of source,
so reading (:func:`to_attnlab`) and writing (:func:`to_hf_state_dict`) are one loop for every family.
llama.cpp names attnlab's tensors the same way in every architecture (:data:`GGUF_NAMES`), so
:func:`gguf_tensors` derives a GGUF file's names from the same rows.

GPT-2 is a row here, but its bare state dicts record no config: :mod:`attnlab.formats.hf` reads the
sizes from the tensors and calls :func:`convert`. Like the other modules of :mod:`attnlab.formats`
this holds formats only: ``GPT.from_hf`` builds the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnlab.checks import is_int
from attnlab.positions import rope_scaling_type
from attnlab.quantized import stored_tensors

if TYPE_CHECKING:  # the model sits above this module
    from attnlab.model import GPT, GPTConfig

__all__ = [
    "FAMILIES",
    "GGUF_NAMES",
    "LLAMA_FAMILY",
    "MODEL_TYPES",
    "Conv1D",
    "Split",
    "check_exportable",
    "config_fields",
    "convert",
    "export",
    "gguf_tensors",
    "to_attnlab",
    "to_hf_state_dict",
]


@dataclass(frozen=True)
class Conv1D:
    """A weight stored as a ``Conv1D``'s ``(in, out)`` (GPT-2's), the transpose of ``nn.Linear``'s."""

    name: str


@dataclass(frozen=True)
class Split:
    """Part ``part`` (``"q"``, ``"k"`` or ``"v"``) of a fused query/key/value tensor ``name``.

    ``per_head=False``: all queries, then all keys, then all values (GPT-2's ``c_attn``, Phi-3's
    ``qkv_proj``); ``per_head=True``: for each head its query, key and value in turn (GPT-NeoX's
    ``query_key_value``).
    """

    name: str | Conv1D
    part: str
    per_head: bool = False


# A source: one HF tensor (its name), several stacked along dim 0 (gate then up), a Conv1D or a Split.
Source = str | tuple[str, ...] | Conv1D | Split

# Llama's layer names (Mistral, Qwen 2/3, Gemma, OLMo 2 share them).
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
_QKV = (("W_query", "q"), ("W_key", "k"), ("W_value", "v"))


@dataclass(frozen=True)
class Family:
    """One family's row: config switches and tensor sources.

    Attributes:
        fields: ``config.json`` dict -> the :class:`~attnlab.GPTConfig` fields (see :func:`config_fields`).
        layer: attnlab name inside ``trf_blocks.i`` -> HF source inside ``{blocks}i``. A bias the
            config switches off (``qkv_bias``, ``bias``) is neither read nor written.
        outer: attnlab names outside the blocks -> HF sources (``out_head`` is added when untied).
        head: the HF names of the untied output head (GPT-NeoX: ``lm_head`` in what transformers 5
            writes, ``embed_out`` in the published files); export writes the first.
        prefix: what HF puts before the names above (stripped when present).
        blocks: HF's name of the blocks, before the layer index.
        check: ``(model config, model_type)`` -> refuse a model the layout cannot hold; by default
            the family's reader must give back the model's switches (:func:`check_exportable`).
        zero_biases: the layout always has every bias: a model without them writes zeros (which is
            what their absence computes).
    """

    fields: Callable[[dict[str, Any]], dict[str, Any]]
    layer: dict[str, Source]
    outer: dict[str, Source]
    head: tuple[str, ...] = ("lm_head.weight",)
    prefix: str = "model."
    blocks: str = "layers."
    check: Callable[[Any, str], None] | None = None
    zero_biases: bool = False


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


def _rope(params: Mapping[str, Any] | None, theta: float) -> tuple[float, dict[str, Any] | None, float | None]:
    """``(base, scaling or None, partial rotary factor or None)`` of one ``rope_parameters`` dict."""
    params = dict(params or {})
    theta = float(params.pop("rope_theta", theta))
    fraction = params.pop("partial_rotary_factor", None)
    return (
        theta,
        (None if rope_scaling_type(params) == "default" else params),
        None if fraction is None else float(fraction),
    )


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


def _llama_like(cfg: dict[str, Any], act: str = "silu") -> dict[str, Any]:
    """The fields every family reads the same way (Llama's names); ``act="silu"`` checks ``hidden_act``."""
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    got = cfg.get("hidden_act") or act
    if act == "silu" and got != "silu":
        raise ValueError(f"this family's gated MLP is silu-gated (SwiGLU); the config's hidden_act is {got!r}")
    params = cfg.get("rope_parameters")
    if params is None and (cfg.get("rope_scaling") or "rope_theta" in cfg):
        params = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 10000.0)}
    theta, scaling, fraction = _rope(params, 10000.0)
    if fraction is None:  # (rope_parameters' own, where it has one, as transformers reads it)
        fraction = float(cfg.get("partial_rotary_factor", 1.0))
    if rope_scaling_type(scaling) == "longrope":
        # Phi-3 keeps the original context beside the config's, and its attention factor follows from the two
        original = scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if scaling.get("factor") is None and scaling.get("attention_factor") is None and is_int(original):
            scaling["factor"] = cfg.get("max_position_embeddings", 2048) / original
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


def _qwen(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2 (q, k, v biased; o_proj and MLP not) and Qwen3 (QK-norm, no biases)."""
    qwen3 = cfg.get("model_type") == "qwen3"
    if qwen3:
        _no_bias(cfg, "Qwen3")
    fields = _llama_like(cfg)
    n = fields["n_layers"]
    sliding = [bool(cfg.get("use_sliding_window")) and i >= cfg.get("max_window_layers", n) for i in range(n)]
    return fields | (dict(qk_norm=True) if qwen3 else dict(qkv_bias=True)) | _window_layers(cfg, n, sliding)


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


def _rope_by_layer_type(
    cfg: dict[str, Any], theta: float, local_theta: float | None
) -> tuple[float, dict[str, Any] | None, float]:
    """``(base, scaling or None, the window layers' base)`` of a family whose full and sliding-window layers
    have RoPE of their own (``theta``, ``local_theta``: the defaults; None: the full layers' base). The
    window layers' RoPE is never scaled."""
    params = cfg.get("rope_parameters")
    if params is not None and "full_attention" in params:  # transformers 5: one dict per layer type
        theta, scaling, _ = _rope(params["full_attention"], theta)
        local_theta, local_scaling, _ = _rope(params.get("sliding_attention"), local_theta or theta)
    else:  # older config.json files: rope_theta (+ rope_scaling) globally, rope_local_base_freq locally
        legacy = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", theta)}
        theta, scaling, _ = _rope(legacy, theta)
        local_theta, local_scaling = float(cfg.get("rope_local_base_freq", local_theta or theta)), None
    if local_scaling is not None:
        raise ValueError(f"rope scaling of the sliding-window layers ({local_scaling}) is not supported")
    return theta, scaling, local_theta


def _gemma3(cfg: dict[str, Any]) -> dict[str, Any]:
    theta, scaling, local_theta = _rope_by_layer_type(cfg, 1_000_000.0, 10_000.0)
    # Gemma 3 keeps Gemma 2's final soft-cap but not its attention one: transformers' Gemma 3 reads
    # attn_logit_softcapping from the config and never applies it (QK-norm bounds the scores instead).
    plain = {**cfg, "rope_parameters": None, "rope_scaling": None, "rope_theta": theta, "attn_logit_softcapping": None}
    fields = _gemma2(plain) | dict(rope_theta=theta, rope_scaling=scaling, qk_norm=True)
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


def _olmo3(cfg: dict[str, Any]) -> dict[str, Any]:
    theta, scaling, local_theta = _rope_by_layer_type(cfg, 500_000.0, None)
    fields = _olmo2({**cfg, "rope_parameters": None, "rope_scaling": None, "rope_theta": theta})
    fields |= _window_layers(cfg, fields["n_layers"], [(i + 1) % 4 != 0 for i in range(fields["n_layers"])])
    fields |= dict(rope_theta=theta, rope_scaling=scaling)
    if fields.get("window_layers"):
        fields["rope_local_theta"] = local_theta
    return fields


def _gpt_neox(cfg: dict[str, Any]) -> dict[str, Any]:
    act = cfg.get("hidden_act", "gelu")
    if act not in _GELUS:
        raise ValueError(f"attnlab's GPT-NeoX MLP is a GELU one; the config's hidden_act is {act!r}")
    if not cfg.get("attention_bias", True):
        raise ValueError("attention_bias=False in a GPT-NeoX config: attnlab has one bias switch for it and the MLP")
    params = cfg.get("rope_parameters")
    if params is None:  # older config.json: rotary_pct, rotary_emb_base, rope_scaling
        params = {
            **(cfg.get("rope_scaling") or {}),
            "rope_theta": cfg.get("rotary_emb_base", 10000.0),
            "partial_rotary_factor": cfg.get("rotary_pct", 0.25),
        }
    # Llama's sizes and rotary positions, with Pythia's biases, LayerNorms, GELU MLP and parallel residual.
    return _llama_like({**cfg, "rope_parameters": params}, act=act) | dict(
        n_kv_heads=None,
        qkv_bias=True,
        bias=True,
        ln_eps=float(cfg.get("layer_norm_eps", 1e-5)),
        activation=_GELUS[act],
        norm="layernorm",
        mlp="gelu",
        parallel_residual=bool(cfg.get("use_parallel_residual", True)),
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
        activation=_GELUS.get(cfg.get("activation_function", "gelu_new"), "gelu_tanh"),
        # as GPT.from_pretrained reads them (an untied head is a matrix of its own in the count)
        tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        drop_rate=float(cfg.get("resid_pdrop", 0.1)),
    )


def _llama(cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama and Mistral (a Llama with a sliding window): biases on every projection or none."""
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if not is_int(cfg.get(key)) or not 0 < cfg[key] <= 1 << 31:
            raise ValueError(f"config {key} must be a positive integer, got {cfg.get(key)!r}")
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    kv = cfg.get("num_key_value_heads") or heads
    if not is_int(kv) or kv <= 0 or heads % kv:
        raise ValueError(f"config num_key_value_heads={kv!r} must divide num_attention_heads={heads}")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ValueError(f"config rms_norm_eps must be a small positive number, got {eps!r}")
    if not cfg.get("head_dim") and hidden % heads:
        raise ValueError(
            f"config hidden_size={hidden} is not divisible by num_attention_heads={heads}, and no head_dim is given"
        )
    bias = bool(cfg.get("attention_bias", False))
    if bias != bool(cfg.get("mlp_bias", False)):
        raise ValueError("attnlab's GPT has one bias switch for the output projection and the MLP (bias=...)")
    if cfg.get("pretraining_tp", 1) != 1:
        raise ValueError("pretraining_tp != 1 (a tensor-parallel split of the weights) is not supported")
    fields = _llama_like(cfg) | dict(qkv_bias=bias, bias=bias)
    return fields | (_window_layers(cfg, fields["n_layers"], None) if cfg.get("model_type") == "mistral" else {})


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------
_GPT2_LAYER: dict[str, Source] = {
    "norm1.weight": "ln_1.weight",
    "norm1.bias": "ln_1.bias",
    **{f"att.{m}.weight": Split(Conv1D("attn.c_attn.weight"), p) for m, p in _QKV},
    **{f"att.{m}.bias": Split("attn.c_attn.bias", p) for m, p in _QKV},
    "att.out_proj.weight": Conv1D("attn.c_proj.weight"),
    "att.out_proj.bias": "attn.c_proj.bias",
    "norm2.weight": "ln_2.weight",
    "norm2.bias": "ln_2.bias",
    "ff.layers.0.weight": Conv1D("mlp.c_fc.weight"),
    "ff.layers.0.bias": "mlp.c_fc.bias",
    "ff.layers.2.weight": Conv1D("mlp.c_proj.weight"),
    "ff.layers.2.bias": "mlp.c_proj.bias",
}
_LLAMA_LAYER: dict[str, Source] = {
    **_PRE_NORMS,
    **_ATTENTION,
    **_QKV_BIAS,
    "att.out_proj.bias": "self_attn.o_proj.bias",
    **_GATED_MLP,
    "ff.layers.0.bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
    "ff.layers.2.bias": "mlp.down_proj.bias",
}
_NEOX_LAYER: dict[str, Source] = {
    "norm1.weight": "input_layernorm.weight",
    "norm1.bias": "input_layernorm.bias",
    **{
        f"att.{m}.{p}": Split(f"attention.query_key_value.{p}", s, per_head=True)
        for m, s in _QKV
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
    **{f"att.{m}.weight": Split("self_attn.qkv_proj.weight", p) for m, p in _QKV},
    "att.out_proj.weight": "self_attn.o_proj.weight",
    "ff.layers.0.weight": "mlp.gate_up_proj.weight",  # gate rows, then up rows: attnlab's layout already
    "ff.layers.2.weight": "mlp.down_proj.weight",
}

# The GPTConfig switches of the families after Llama, as they are when off: neither GPT-2's nor
# Llama's layout can hold a model that turns one on.
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


def _check_gpt2(cfg: GPTConfig, model_type: str) -> None:
    if cfg.kv_heads != cfg.n_heads:
        raise ValueError(
            f"GPT-2 has no grouped-query attention: this model has n_kv_heads={cfg.n_kv_heads} != n_heads={cfg.n_heads}"
        )
    gpt2 = {"pos": "learned", "norm": "layernorm", "mlp": "gelu", "window": None, "qk_norm": False}
    # (a head_size of emb_dim / n_heads is GPT-2's own: only another one is refused)
    own_heads = cfg.head_size in (None, cfg.emb_dim // cfg.n_heads) and cfg.emb_dim % cfg.n_heads == 0
    gpt2 |= {k: v for k, v in FAMILY_SWITCHES_OFF.items() if k != "head_size" or not own_heads}
    other = {k: getattr(cfg, k) for k, v in gpt2.items() if getattr(cfg, k, v) != v}
    if other:
        raise ValueError(
            f"GPT-2 has learned positions, LayerNorm, a GELU MLP and full attention; this model has {other}"
        )


def _check_llama(cfg: GPTConfig, model_type: str) -> None:
    llama = {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "sinks": 0, "qk_norm": False}
    llama |= {k: v for k, v in FAMILY_SWITCHES_OFF.items() if k != "head_size"}  # (Llama's config has head_dim)
    other = {k: getattr(cfg, k) for k, v in llama.items() if getattr(cfg, k, v) != v}
    if cfg.qkv_bias != cfg.bias:
        other["qkv_bias, bias"] = (cfg.qkv_bias, cfg.bias)
    if other:
        raise ValueError(
            f"model_type={model_type!r}: a Llama block has RoPE, RMSNorm, a SwiGLU MLP, no sinks or QK-norm, and "
            f"one bias switch; this model has {other}"
        )


_GEMMA2 = {**_SANDWICH_NORMS, **_ATTENTION, **_GATED_MLP}
_OLMO2_LAYER = {
    **_ATTENTION,
    **_QK_NORM,
    "post_norm1.weight": "post_attention_layernorm.weight",
    **_GATED_MLP,
    "post_norm2.weight": "post_feedforward_layernorm.weight",
}
FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        gpt2_config_fields,
        _GPT2_LAYER,
        {"tok_emb.weight": "wte.weight", "pos_emb.weight": "wpe.weight"}
        | {f"final_norm.{p}": f"ln_f.{p}" for p in ("weight", "bias")},
        prefix="transformer.",
        blocks="h.",
        check=_check_gpt2,
        zero_biases=True,
    ),
    "llama": Family(_llama, _LLAMA_LAYER, _LLAMA_OUTER, check=_check_llama),
    "mistral": Family(_llama, _LLAMA_LAYER, _LLAMA_OUTER, check=_check_llama),
    "qwen2": Family(_qwen, {**_PRE_NORMS, **_ATTENTION, **_QKV_BIAS, **_GATED_MLP}, _LLAMA_OUTER),
    "qwen3": Family(_qwen, {**_PRE_NORMS, **_ATTENTION, **_QK_NORM, **_GATED_MLP}, _LLAMA_OUTER),
    "gemma": Family(_gemma, {**_PRE_NORMS, **_ATTENTION, **_GATED_MLP}, _LLAMA_OUTER),
    "gemma2": Family(_gemma2, _GEMMA2, _LLAMA_OUTER),
    "gemma3_text": Family(_gemma3, {**_GEMMA2, **_QK_NORM}, _LLAMA_OUTER),
    "phi3": Family(_phi3, _PHI3_LAYER, _LLAMA_OUTER),
    "olmo2": Family(_olmo2, _OLMO2_LAYER, _LLAMA_OUTER),
    "olmo3": Family(_olmo3, _OLMO2_LAYER, _LLAMA_OUTER),
    "gpt_neox": Family(
        _gpt_neox,
        _NEOX_LAYER,
        {"tok_emb.weight": "embed_in.weight"}
        | {f"final_norm.{p}": f"final_layer_norm.{p}" for p in ("weight", "bias")},
        head=("lm_head.weight", "embed_out.weight"),
        prefix="gpt_neox.",
    ),
}
# model_type values read as a Llama block (Mistral: a Llama with a sliding window).
LLAMA_FAMILY = ("llama", "mistral")
# Every model_type GPT.from_hf reads through to_attnlab (GPT-2: through attnlab.formats.hf).
MODEL_TYPES = tuple(t for t in FAMILIES if t != "gpt2")
_GPT2 = (
    "GPT-2 (model_type='gpt2') has a module of its own: attnlab.formats.hf (GPT.from_hf_gpt2 / GPT.from_hf "
    "to read it, to_hf_gpt2_state_dict / to_hf_gpt2 to write it), since a bare GPT-2 state dict records no config"
)

# llama.cpp's names of attnlab's tensors, the same in every architecture (``blk.i.`` for ``trf_blocks.i.``;
# a gate and up pair stacked by a row is ffn_gate and ffn_up, a fused query/key/value tensor attn_qkv).
GGUF_NAMES = {
    "tok_emb": "token_embd",
    "final_norm": "output_norm",
    "out_head": "output",
    "norm1": "attn_norm",
    "post_norm1": "post_attention_norm",
    "norm2": "ffn_norm",
    "post_norm2": "post_ffw_norm",
    "att.W_query": "attn_q",
    "att.W_key": "attn_k",
    "att.W_value": "attn_v",
    "att.out_proj": "attn_output",
    "att.q_norm": "attn_q_norm",
    "att.k_norm": "attn_k_norm",
    "ff.layers.0": "ffn_up",
    "ff.layers.2": "ffn_down",
}


def gguf_tensors(model_type: str) -> dict[str, str]:
    """``{llama.cpp tensor name: Hugging Face name}`` of family ``model_type`` (``{i}``: the layer), from
    its row of :data:`FAMILIES` and :data:`GGUF_NAMES`."""
    family, out = FAMILIES[model_type], {}
    rows = [("", "", family.outer | {"out_head.weight": family.head[0]})]
    for gguf_where, where, table in [*rows, ("blk.{i}.", family.blocks + "{i}.", family.layer)]:
        for name, src in table.items():
            module, kind = name.rsplit(".", 1)
            theirs = GGUF_NAMES[module]
            if isinstance(src, Split):
                theirs, src = "attn_qkv", src.name
            if isinstance(src, tuple):  # the gate and up projections
                out[f"{gguf_where}ffn_gate.{kind}"] = where + src[0]
                src = src[1]
            out[f"{gguf_where}{theirs}.{kind}"] = where + (src.name if isinstance(src, Conv1D) else src)
    return out


def config_fields(cfg: Mapping[str, Any], drop_rate: float = 0.0) -> dict[str, Any]:
    """:class:`~attnlab.GPTConfig` fields of a ``config.json`` (as a dict) of any family in :data:`MODEL_TYPES`."""
    cfg = dict(cfg)
    model_type = cfg.get("model_type")
    if model_type == "gpt2":
        raise ValueError(_GPT2)
    if model_type not in MODEL_TYPES:
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
    """The shape of each tensor name (inside a block or outside) a GPT with fields ``f`` has; the rest: ``(C,)``."""
    C, V = f["emb_dim"], f["vocab_size"]
    F = f.get("ff_dim") or 4 * C
    hd = f.get("head_size") or C // f["n_heads"]
    q, kv = f["n_heads"] * hd, (f.get("n_kv_heads") or f["n_heads"]) * hd
    gated = 2 if f.get("mlp") in ("swiglu", "geglu") else 1
    full = f.get("qk_norm") == "full"
    return {
        "tok_emb.weight": (V, C),
        "pos_emb.weight": (f["context_length"], C),
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


def _has(name: str, f: dict[str, Any]) -> bool:
    """Whether a model of fields ``f`` has tensor ``name``: a bias only when switched on."""
    if not name.endswith(".bias"):
        return True
    return bool(f.get("qkv_bias", False) if name.split(".")[-2] in dict(_QKV) else f.get("bias", True))


def _source_names(src: Source) -> list[str]:
    """The Hugging Face names ``src`` reads."""
    if isinstance(src, str):
        return [src]
    return list(src) if isinstance(src, tuple) else [src.name]


def _read(take: Callable[[str, tuple[int, ...]], Tensor], src: Source, want: tuple[int, ...], f: dict) -> Tensor:
    """The attnlab tensor (of shape ``want``) that ``src`` names; ``take(name, shape)`` gives a Hugging
    Face tensor, checked against the shape it must have."""
    if isinstance(src, str):
        return take(src, want)
    if isinstance(src, Conv1D):
        return take(src.name, want[::-1]).t()
    if isinstance(src, tuple):
        return torch.cat([take(s, (want[0] // len(src), *want[1:])) for s in src])
    H, hd = f["n_heads"], f.get("head_size") or f["emb_dim"] // f["n_heads"]
    sizes, rest = [H * hd, *2 * [(f.get("n_kv_heads") or H) * hd]], want[1:]
    fused, i = _read(take, src.name, (sum(sizes), *rest), f), "qkv".index(src.part)
    if src.per_head:  # (H, 3, hd, ...): each head's q, k, v rows in turn
        return fused.view(H, 3, hd, *rest)[:, i].reshape(H * hd, *rest)
    return fused.split(sizes)[i]


def _check_finite(t: Tensor, what: str) -> None:
    """Refuse a weight holding NaN or infinite values: every logit would be NaN, far from the cause.
    Read in chunks, so that checking a large matrix holds no full-size mask beside it."""
    for part in stored_tensors(t):
        chunks = part.reshape(-1).split(1 << 24) if part.is_floating_point() and part.device.type != "meta" else ()
        if not all(bool(c.isfinite().all()) for c in chunks):
            raise ValueError(f"{what} holds NaN or infinite values: the file is damaged")


def convert(
    state: dict[str, Tensor], fields: dict[str, Any], model_type: str, *, copy: bool = True
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(fields, attnlab state dict)`` of ``state`` (Hugging Face names, the family's prefix optional)
    read through family ``model_type``'s row, every tensor's shape checked against ``fields``.

    With ``copy=False`` the tensors are *moved*: ``state`` is emptied, and each layer's tensors are
    dropped once converted, so a caller that owns them (the GGUF reader) never holds two copies."""
    family = FAMILIES[model_type]
    for k, v in state.items():
        if not isinstance(v, Tensor):
            raise TypeError(f"state dict entry {k!r} is a {type(v).__name__}, not a tensor")
    hf = {k.removeprefix(family.prefix): v for k, v in state.items()}
    if not copy:
        state.clear()
    layer = re.compile(rf"^{re.escape(family.blocks)}(\d+)\.")
    layers = {int(m.group(1)) for k in hf if (m := layer.match(k))}
    # (counted first: a hostile file's count may be 2**31, far too many to make a set of)
    if len(layers) != fields["n_layers"] or any(i >= fields["n_layers"] for i in layers):
        raise ValueError(
            f"the config says {fields['n_layers']} layers, the weights have layers {sorted(layers)[:8]}"
            f"{'...' if len(layers) > 8 else ''}"
        )
    head = next((h for h in family.head if h in hf), None)
    fields["tie_embeddings"] = fields["tie_embeddings"] or head is None
    f, shapes = fields | {"model_type": model_type}, _expected_shapes(fields)
    groups = [("", "", family.outer | ({} if fields["tie_embeddings"] else {"out_head.weight": head}))]
    groups += [(f"{family.blocks}{i}.", f"trf_blocks.{i}.", family.layer) for i in range(fields["n_layers"])]
    new, used = {}, set()
    for where, ours, table in groups:

        def take(name: str, want: tuple[int, ...], where: str = where) -> Tensor:
            name = where + name
            if name not in hf:
                raise ValueError(f"not a {model_type} state dict: {name!r} is missing")
            if (got := tuple(hf[name].shape)) != tuple(want):
                raise ValueError(f"{model_type} weight {name!r} must have shape {tuple(want)}, got {got}")
            _check_finite(hf[name], f"{model_type} weight {name!r}")
            used.add(name)
            return hf[name]

        for name, src in table.items():
            if _has(name, f):
                new[ours + name] = _read(take, src, shapes.get(name, (fields["emb_dim"],)), f)
            elif stray := [where + s for s in _source_names(src) if where + s in hf]:
                raise ValueError(  # (never dropped: the model would compute something else)
                    f"the {model_type} weights have {stray[0]!r}, a bias the config switches off "
                    "(attention_bias / mlp_bias)"
                )
        if not copy:  # this layer's Hugging Face tensors are now attnlab's (or unused): drop them
            for k in used:
                del hf[k]
            used.clear()
    return fields, {k: (v.detach().clone() if copy else v.detach()).contiguous() for k, v in new.items()}


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
        copy: copy every tensor (the default: the result shares no memory with the input). With
            False the tensors of a state dict are *moved* (see :func:`convert`).
    """
    if hasattr(model_or_state_dict, "state_dict") and callable(model_or_state_dict.state_dict):
        state = dict(model_or_state_dict.state_dict())
        hf_config = getattr(model_or_state_dict, "config", None) if hf_config is None else hf_config
    elif isinstance(model_or_state_dict, Mapping):
        state = dict(model_or_state_dict)
        if not copy and isinstance(model_or_state_dict, dict):
            model_or_state_dict.clear()
    else:
        raise TypeError(f"expected a Hugging Face model or its state dict, got {type(model_or_state_dict).__name__}")
    if hf_config is None:
        raise ValueError("a state dict does not record heads, RoPE base or norms: pass hf_config= (its config.json)")
    cfg = _config_dict(hf_config)
    fields = config_fields(cfg, drop_rate)
    return convert(state, fields, cfg["model_type"], copy=copy)


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
        act = "gelu_python"  # Gemma 1 reads "gelu" as the tanh approximation: the exact GELU's other name (_GELUS)
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


def _check_family(config: GPTConfig, model_type: str) -> None:
    """Refuse exporting a model of ``config`` as ``model_type`` unless that family's reader, given a config.json
    that says all of the model's settings, gives back the model's switches (:data:`FAMILIES` is the
    one table both ways)."""
    kind = type(config)
    have, probe, why = _switches(config, kind), _as_config_json(config, model_type), ""
    try:
        want = _switches(config_fields(probe), kind)
    except ValueError as e:  # the reader refuses the model's activation or biases: compare with the family's own
        why, refused = f" ({e})", ("hidden_act", "hidden_activation", "attention_bias")
        want = _switches(config_fields({k: v for k, v in probe.items() if k not in refused}), kind)
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


def check_exportable(model: GPT, model_type: str) -> GPTConfig:
    """``model``'s config, if family ``model_type``'s layout can hold the model; else a ValueError
    naming the switches that differ."""
    # Duck-typed: this module sits below attnlab.model, so it cannot name the class.
    cfg = getattr(model, "config", None)
    if not isinstance(model, torch.nn.Module) or not hasattr(cfg, "kv_heads"):
        raise TypeError(f"expected an attnlab GPT, got {type(model).__name__}")
    (FAMILIES[model_type].check or _check_family)(cfg, model_type)
    return cfg


def export(model: GPT, model_type: str) -> dict[str, Tensor]:
    """``model``'s weights under family ``model_type``'s Hugging Face names (the inverse of :func:`convert`)."""
    cfg, family = check_exportable(model, model_type), FAMILIES[model_type]
    if getattr(model, "lora_settings", None) is not None:  # (its weights are W's parts: "not a llama model")
        raise ValueError(
            "model has LoRA adapters: export its base inside attnlab.training.lora.base_weights(model) (the "
            "adapters: save_peft_adapter), or merge them in first (merge_lora)"
        )
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out: dict[str, Tensor] = {}
    pieces: dict[str, dict[str, Tensor]] = {}  # fused tensors, gathered part by part

    def write(src: Source, t: Tensor, where: str) -> None:
        if isinstance(src, str):
            out[where + src] = t
        elif isinstance(src, Conv1D):
            out[where + src.name] = t.t()
        elif isinstance(src, tuple):
            for s, part in zip(src, t.chunk(len(src)), strict=True):
                out[where + s] = part
        else:
            got = pieces.setdefault(where + str(src.name), {})
            got[src.part] = t
            if len(got) < 3:
                return
            q, k, v = (got[p] for p in "qkv")
            if src.per_head:  # back to each head's q, k, v rows in turn
                fused = torch.stack([p.reshape(cfg.n_heads, cfg.head_dim, *p.shape[1:]) for p in (q, k, v)], dim=1)
                write(src.name, fused.reshape(-1, *q.shape[1:]), where)
            else:
                write(src.name, torch.cat([q, k, v]), where)

    rows = [("", "", family.outer)]
    rows += [(f"{family.blocks}{i}.", f"trf_blocks.{i}.", family.layer) for i in range(cfg.n_layers)]
    for where, ours, table in rows:
        for name, src in table.items():
            if ours + name in sd:
                write(src, sd[ours + name], family.prefix + where)
            elif not name.endswith(".bias"):
                raise ValueError(f"this model has no {ours + name!r}: it is not a {model_type} model")
            elif family.zero_biases:  # a bias switched off: zeros compute what its absence does
                weight = sd[ours + name.removesuffix(".bias") + ".weight"]
                write(src, weight.new_zeros(weight.shape[0]), family.prefix + where)
    out[family.head[0]] = sd["tok_emb.weight"] if cfg.tie_embeddings else sd["out_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state_dict(model: GPT, model_type: str) -> dict[str, Tensor]:
    """``model``'s weights under the names of the Hugging Face family ``model_type`` (the inverse
    of :func:`to_attnlab`). The model's switches must be that family's (e.g. a model read from one):
    anything else is a ValueError naming the switches that differ."""
    if model_type == "gpt2":
        raise ValueError(_GPT2)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {', '.join(MODEL_TYPES)} (or gpt2), got {model_type!r}")
    return export(model, model_type)
