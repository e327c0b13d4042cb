"""Hugging Face Llama-family interoperability: Llama and Mistral weights in and out.

A Llama block is attnlab's :class:`~attnlab.model.TransformerBlock` with ``pos="rope"``,
``norm="rmsnorm"``, ``mlp="swiglu"`` and no biases (or biases on every projection); Mistral adds a
sliding ``window``. Hugging Face already stores RoPE in the "rotate half" layout :mod:`attnlab.positions`
uses, and its projections are ``nn.Linear`` like attnlab's, so the mapping (their row of
:data:`attnlab.formats.families.FAMILIES`) is one name per tensor, except for the MLP, whose gate and
up projections attnlab runs as one matmul::

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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import Tensor

from attnlab.formats import families
from attnlab.formats.families import LLAMA_FAMILY
from attnlab.formats.hf import import_transformers

if TYPE_CHECKING:  # the model sits above this module
    from attnlab.model import GPT

__all__ = ["LLAMA_FAMILY", "llama_to_attnlab", "to_hf_llama", "to_hf_llama_config", "to_hf_llama_state_dict"]


def _llama_config(hf_config: Any) -> dict[str, Any]:
    if hf_config is None:
        raise ValueError(
            "a Llama state dict does not record heads, RoPE base or norm epsilon: pass hf_config= (its "
            "LlamaConfig / MistralConfig or the dict of its config.json)"
        )
    if not isinstance(hf_config, Mapping) and not hasattr(hf_config, "to_dict"):
        raise TypeError(f"hf_config must be a transformers config or a dict, got {type(hf_config).__name__}")
    cfg = dict(hf_config) if isinstance(hf_config, Mapping) else hf_config.to_dict()
    model_type = cfg.setdefault("model_type", "llama")
    if model_type not in LLAMA_FAMILY:
        raise ValueError(f"expected a Llama-family model ({', '.join(LLAMA_FAMILY)}), got model_type={model_type!r}")
    return cfg


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
        copy: copy every tensor (the default); with False a state dict's tensors are *moved*
            (see :func:`attnlab.formats.families.convert`).
    """
    if hf_config is None:
        hf_config = getattr(model_or_state_dict, "config", None)
    return families.to_attnlab(model_or_state_dict, hf_config=_llama_config(hf_config), drop_rate=drop_rate, copy=copy)


def to_hf_llama_state_dict(model: GPT) -> dict[str, Tensor]:
    """A state dict for ``transformers.LlamaForCausalLM`` (``MistralForCausalLM`` with a window),
    config from :func:`to_hf_llama_config`."""
    return families.export(model, "llama")


def to_hf_llama_config(model: GPT) -> Any:
    """The ``transformers.LlamaConfig`` (``MistralConfig`` when the model has a window) matching ``model``."""
    cfg = families.check_exportable(model, "llama")
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
