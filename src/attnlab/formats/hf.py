"""Hugging Face GPT-2 interoperability: weights in and out, and the published checkpoints.

GPT-2's original code (and Hugging Face's ``GPT2LMHeadModel``) stores every projection as a
``Conv1D``: a ``(in, out)`` weight used as ``x @ W + b``, the transpose of ``nn.Linear``'s, and its
attention has one ``c_attn`` projection producing queries, keys and values side by side. Both are
kinds of source in GPT-2's row of :data:`attnlab.formats.families.FAMILIES`, the table every
family's weights go through. What is GPT-2's own is here: a bare GPT-2 state dict records no
config, so its sizes are read from the tensors (and the head count, if not given, assumed).

:class:`attnlab.GPT` builds itself from what this returns (``GPT.from_hf_gpt2``, ``GPT.from_pretrained``,
``model.to_hf_gpt2_state_dict()``), so the model imports this module and never the other way round.
``transformers`` is optional: nothing here imports it unless a function needs a Hugging Face object.
The files (a local directory or the Hub) are :mod:`attnlab.formats.hub`'s.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Mapping
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from attnlab.formats import families
from attnlab.formats.families import gpt2_config_fields
from attnlab.formats.hub import PRETRAINED, is_local_path, read_pretrained, read_pretrained_config, read_pretrained_file

if TYPE_CHECKING:  # the model sits above this module
    from attnlab.model import GPT

__all__ = [
    "PRETRAINED",
    "gpt2_config_fields",
    "gpt2_to_attnlab",
    "import_transformers",
    "is_local_path",
    "read_pretrained",
    "read_pretrained_config",
    "read_pretrained_file",
    "to_hf_gpt2",
    "to_hf_gpt2_config",
    "to_hf_gpt2_state_dict",
]

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


def gpt2_to_attnlab(
    model_or_state_dict: Any, *, n_heads: int | None = None, drop_rate: float | None = None, hf_config: Any = None
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
    return families.convert(state, _config_from_hf(state, hf_config, n_heads, drop_rate), "gpt2")


# --------------------------------------------------------------------------------------------
# attnlab -> Hugging Face
# --------------------------------------------------------------------------------------------
def to_hf_gpt2_state_dict(model: GPT) -> dict[str, Tensor]:
    """A state dict for ``transformers.GPT2LMHeadModel`` (config from :func:`to_hf_gpt2_config`).

    Biases a configuration switched off (``qkv_bias=False``, ``bias=False``) are exported as zeros,
    which is exactly what their absence computes.
    """
    return families.export(model, "gpt2")


def to_hf_gpt2_config(model: GPT) -> Any:
    """The ``transformers.GPT2Config`` matching ``model`` (needs ``transformers``)."""
    cfg = families.check_exportable(model, "gpt2")
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
