"""Direct logit attribution: how much each head and MLP writes the answer straight into the logits.

The residual stream before the final norm is a sum: the embeddings, each head's output through
``out_proj``, each ``out_proj`` bias, each MLP's output. With the final norm's scale frozen at its
value on this prompt (TransformerLens's ``apply_ln`` on the accumulated/decomposed residual), the
final norm is linear, so the logit difference of two answers splits exactly into one term per part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.attention import OffsetRMSNorm
from attnlab.hardware import as_float64
from attnlab.interpret.hooks import act_name, attention_layers, run_with_cache
from attnlab.interpret.patching import check_token

__all__ = ["LogitAttribution", "direct_logit_attribution"]


@dataclass
class LogitAttribution:
    """Each part's share of ``logit[a] - logit[b]`` at the last position (float64).

    heads: ``(L, H)``; mlps: ``(L,)``; embeddings: the embeddings' (token and position) term;
    rest: the biases (``out_proj``'s, through the norm after attention where a model has one, the
    final norm's, the output head's); total: the model's own logit difference (before the soft cap of
    a model that caps its logits, Gemma 2: the cap is not linear). ``heads.sum() + mlps.sum() +
    embeddings + rest == total`` up to rounding."""

    heads: Tensor
    mlps: Tensor
    embeddings: Tensor
    rest: Tensor
    total: Tensor

    def parts_sum(self) -> Tensor:
        return self.heads.sum() + self.mlps.sum() + self.embeddings + self.rest


@torch.no_grad()
def direct_logit_attribution(model: nn.Module, idx: Tensor, answers: tuple[int, int]) -> LogitAttribution:
    """Split the logit difference ``answers[0] - answers[1]`` at the last token of ``idx`` ((T,) or
    (1, T)) over the model's parts, through the final norm with its scale frozen (and a norm after
    each attention, Gemma 2/3's and OLMo 2's, frozen likewise: a head's write is its share of that
    norm's input, scaled as the whole)."""
    layers = attention_layers(model)
    if isinstance(idx, Tensor) and idx.dim() == 1:
        idx = idx.unsqueeze(0)
    if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.shape[0] != 1:
        raise ValueError(f"idx must be the token ids of one prompt, (T,) or (1, T), got {getattr(idx, 'shape', idx)}")
    if not (isinstance(answers, (tuple, list)) and len(answers) == 2):
        raise ValueError(f"answers must be two token ids (a, b), got {answers!r}")
    V = model.out_head.weight.shape[0]
    a, b = (check_token(f"answers[{i}]", t, V) for i, t in enumerate(answers))
    if a == b:
        raise ValueError(f"answers must be two tokens, got {a} twice (its logit minus itself is always 0)")
    L = len(layers)
    names = [act_name("resid_pre", 0), act_name("resid_post", L - 1)]
    names += [act_name(s, i) for i in range(L) for s in ("z", "mlp_out", "attn_out")]
    logits, cache = run_with_cache(model, idx, names)
    f64 = lambda t: as_float64(t[0, -1])  # (on the CPU for MPS, which has no float64)
    final = f64(cache[names[1]])  # (d,)
    direction = as_float64(model.out_head.weight[a] - model.out_head.weight[b])  # (d,)
    dtype = cache[names[1]].dtype  # (an RMSNorm without eps takes its input dtype's)
    norm, norm_bias = _frozen_norm(model.final_norm, final, dtype, "the final norm")

    def through(c: Tensor) -> Tensor:  # the frozen final norm's linear part, then the answer direction
        return norm(c) @ direction

    bias = norm_bias @ direction
    if model.out_head.bias is not None:
        bias = bias + as_float64(model.out_head.bias[a] - model.out_head.bias[b])
    embeddings = f64(cache[names[0]])
    parts = embeddings.clone()
    heads, mlps, rest = [], [], torch.as_tensor(bias, dtype=torch.float64)
    # The checks below find a family whose stream is not this sum, not the rounding of a half-precision
    # model's cached activations: a layer's within its dtype's eps, the stream's (rounded at every add)
    # within twice that (bfloat16 on SmolLM2: 0.3 and 0.8 of those).
    tol = max(1e-4, torch.finfo(dtype).eps)
    for i, (att, block) in enumerate(zip(layers, model.trf_blocks, strict=True)):
        z = f64(cache[act_name("z", i)])  # (H, hd)
        W = as_float64(att.out_proj.weight).T.reshape(att.num_heads, att.head_dim, -1)  # (H, hd, d)
        per_head = torch.einsum("hk,hkd->hd", z, W)  # (H, d): each head's output through out_proj
        o_bias = torch.zeros_like(final) if att.out_proj.bias is None else as_float64(att.out_proj.bias)  # (d,)
        post = getattr(block, "post_norm1", None)
        if post is not None:  # a norm after attention (Gemma 2/3, OLMo 2): frozen at its input here
            post, post_bias = _frozen_norm(post, per_head.sum(0) + o_bias, dtype, f"layer {i}'s norm after attention")
            per_head, o_bias = post(per_head), post(o_bias) + post_bias  # (H, d), (d,): the writes into the stream
        heads.append(through(per_head))
        mlp = f64(cache[act_name("mlp_out", i)])  # (d,): after the MLP's own norm, if any (its write)
        mlps.append(through(mlp))
        parts = parts + per_head.sum(0) + mlp + o_bias
        rest = rest + through(o_bias)
        attn_out = f64(cache[act_name("attn_out", i)])
        if not torch.allclose(per_head.sum(0) + o_bias, attn_out, atol=tol * (1 + attn_out.abs().max().item())):
            raise RuntimeError(f"layer {i}'s attention output is not the sum of its heads through out_proj")
    if not torch.allclose(parts, final, atol=max(1e-3, 2 * tol) * (1 + final.abs().max().item())):
        raise RuntimeError(
            "the residual stream is not the sum of embeddings, heads and MLPs for this model family: "
            "direct logit attribution does not apply"
        )
    if getattr(model.config, "logit_softcap", None) is None:
        total = as_float64(logits[0, -1, a] - logits[0, -1, b])
    else:  # the parts add up to the logits before the cap (cap * tanh(x / cap) is not linear)
        uncapped = model.out_head(model.final_norm(cache[names[1]][:, -1]))[0]  # (V,)
        total = as_float64(uncapped[a] - uncapped[b])
    return LogitAttribution(
        heads=torch.stack(heads), mlps=torch.stack(mlps), embeddings=through(embeddings), rest=rest, total=total
    )


def _frozen_norm(
    norm: nn.Module, x: Tensor, dtype: torch.dtype, what: str
) -> tuple[Callable[[Tensor], Tensor], Tensor]:
    """``norm``'s linear part with its scale frozen at its input ``x (d,)`` (float64), and its bias:
    ``(f, bias (d,))``, ``norm(x) == f(x) + bias``; ``f`` maps ``(..., d) -> (..., d)``. A LayerNorm, an
    RMSNorm or an :class:`~attnlab.attention.OffsetRMSNorm` (gain ``offset + weight``)."""
    weight = getattr(norm, "weight", None)
    gain = torch.ones_like(x) if weight is None else as_float64(weight)
    if isinstance(norm, OffsetRMSNorm):
        gain = gain + norm.offset
    if isinstance(norm, (nn.RMSNorm, OffsetRMSNorm)):
        eps = norm.eps if norm.eps is not None else torch.finfo(dtype).eps
        scale = (x.square().mean() + eps).sqrt()
        return (lambda c: gain * c / scale), torch.zeros_like(x)
    if isinstance(norm, nn.LayerNorm):
        scale = (x.var(unbiased=False) + norm.eps).sqrt()
        bias = torch.zeros_like(x) if norm.bias is None else as_float64(norm.bias)
        return (lambda c: gain * (c - c.mean(-1, keepdim=True)) / scale), bias
    raise TypeError(f"direct_logit_attribution needs {what} to be a LayerNorm or an RMSNorm, got {type(norm).__name__}")
