"""Hook points with TransformerLens's names: read or replace any activation of a forward pass.

Every block, attention layer and MLP of an attnlab GPT has a ``hook`` attribute, ``None`` unless
:func:`hooks` is active (then the model runs its named steps through it; otherwise nothing is
called, at no cost). The names and shapes are TransformerLens's (``B`` batch,
``T`` tokens, ``S`` keys, ``d`` width, ``H`` query heads, ``Hkv`` key/value heads, ``hd`` head width,
``dm`` the MLP's hidden width)::

    hook_embed                       (B, T, d)     the token embedding (Gemma's times its sqrt(d) scale)
    hook_pos_embed                   (T, d)        the learned position embedding (GPT-2 only)
    blocks.{l}.hook_resid_pre        (B, T, d)     the stream entering block l
    blocks.{l}.ln1.hook_scale        (B, T, 1)     the attention's norm: sqrt(var + eps) (RMSNorm: of x^2)
    blocks.{l}.ln1.hook_normalized   (B, T, d)     the norm's output (its gain, and bias, applied)
    blocks.{l}.attn.hook_q           (B, T, H, hd) queries, before RoPE and a per-head QK-norm (OLMo 2's: after)
    blocks.{l}.attn.hook_k, hook_v   (B, S, Hkv, hd)
    blocks.{l}.attn.hook_rot_q       (B, T, H, hd) after RoPE (RoPE models only)
    blocks.{l}.attn.hook_rot_k       (B, S, Hkv, hd)
    blocks.{l}.attn.hook_attn_scores (B, H, T, S)  scaled, masked (-inf) scores
    blocks.{l}.attn.hook_pattern     (B, H, T, S)  the softmax of the scores
    blocks.{l}.attn.hook_z           (B, T, H, hd) pattern @ v: each head's output before out_proj
    blocks.{l}.attn.hook_result      (B, T, H, d)  each head's share of out_proj's output (no bias)
    blocks.{l}.ln1_post.hook_*       (B, T, 1), (B, T, d)  the norm after attention (Gemma 2/3, OLMo 2)
    blocks.{l}.hook_attn_out         (B, T, d)     the attention output added to the stream
    blocks.{l}.hook_resid_mid        (B, T, d)     (not in a parallel block: its MLP reads resid_pre)
    blocks.{l}.ln2.hook_scale        (B, T, 1)     the MLP's norm (with a parallel residual: of resid_pre)
    blocks.{l}.ln2.hook_normalized   (B, T, d)
    blocks.{l}.mlp.hook_pre          (B, T, dm)    the MLP's pre-activation (a gated MLP's gate, x W_gate)
    blocks.{l}.mlp.hook_pre_linear   (B, T, dm)    a gated MLP's other half, x W_up (gated MLPs only)
    blocks.{l}.mlp.hook_post         (B, T, dm)    its neurons: what the output projection reads
    blocks.{l}.ln2_post.hook_*       (B, T, 1), (B, T, d)  the norm after the MLP (Gemma 2/3, OLMo 2)
    blocks.{l}.hook_mlp_out          (B, T, d)
    blocks.{l}.hook_resid_post       (B, T, d)
    ln_final.hook_scale              (B, T, 1)
    ln_final.hook_normalized         (B, T, d)     the final norm's output (its gain applied)

A hook function is called as ``fn(activation, hook)`` (``hook.name``, ``hook.layer()``, as in TransformerLens)
and returns None (keep) or a tensor of the same shape (replace). While any of a layer's ``rot_q`` to ``z`` is
hooked, that layer computes its softmax explicitly (the fused kernel never forms the pattern), and while its
``result`` is, its output projection head by head; each agrees with the fused path to rounding. A norm's
``hook_scale`` is its divisor, one number a position; while it is hooked the norm is computed step by step,
``(x - mean) / scale * weight + bias`` (LayerNorm) or ``x / scale * gain`` (RMSNorm), so that a replaced scale
(TransformerLens's "frozen LayerNorm scale") is what divides, whether a function returns it or edits the given
one in place (TransformerLens's idiom); a function that leaves it as it was leaves the norm's own output.
``hook_normalized`` is the norm's output, the gain (and bias) applied, for every norm: what TransformerLens's
HookedTransformer took for LayerNorm before version 4 (TransformerLens 4 hooks ``(x - mean) / scale``, before
the gain; see docs/from-transformerlens.md). While a split input (``hook_q_input``, ...) is hooked, the
``ln1`` points see each head's copy, as TransformerLens's do: ``(B, T, H, ·)`` for the queries, then
``(B, T, Hkv, ·)`` for the keys and for the values. With a KV cache, ``k``/``v`` hold only the new tokens' keys and
values; ``rot_k``, ``attn_scores`` and ``pattern`` cover all ``S`` keys, the cached ones included.

Points of a spliced module: while an SAE or transcoder is spliced at a hook point
(:func:`attnlab.interpret.splice`), its own points follow that point, named as SAELens names them::

    {hook}.hook_sae_input        (B, T, d_in)   what the SAE reads
    {hook}.hook_sae_acts_pre     (B, T, d_sae)  pre-activations
    {hook}.hook_sae_acts_post    (B, T, d_sae)  the latents
    {hook}.hook_sae_recons       (B, T, d_out)  the reconstruction
    {hook}.hook_sae_error        (B, T, d_out)  the error term x - x^
    {hook}.hook_sae_output       (B, T, d_out)  what replaces the activation (recons + error)

:func:`hook_names`, :func:`hooks` and :func:`run_with_cache` take them like any other point while
the splice lasts (:func:`added_points`: the module that owns the points runs the functions set on them).
"""

from __future__ import annotations

import contextlib
import difflib
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from attnlab.attention import MultiHeadAttention, OffsetRMSNorm
from attnlab.functional import attention_scores, heads_matmul

__all__ = [
    "ActivationCache",
    "AddedPoints",
    "AttentionCall",
    "HookPoint",
    "act_name",
    "activation_at",
    "added_points",
    "attention_hooks",
    "attention_layers",
    "eval_mode",
    "hook_names",
    "hooks",
    "run_with_cache",
]

BLOCK_STEPS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
# TransformerLens's split inputs: a copy of the residual per head, (B, T, H, d) (keys' and values'
# (B, T, Hkv, d)), each head projecting its own (H times the work while hooked). attn_in: every head's
# one copy, where keys and values have as many heads as queries.
SPLIT_STEPS = ("attn_in", "q_input", "k_input", "v_input")
ATTN_STEPS = ("q", "k", "v", "rot_q", "rot_k", "attn_scores", "pattern", "z", "result")
# The steps the fused kernel never forms: hooked, the attention is computed step by step (_Sites.attend);
# with q, k, v or result alone hooked it keeps the fused kernel.
_STEPWISE = ("rot_q", "rot_k", "attn_scores", "pattern", "z")
MLP_STEPS = ("pre", "pre_linear", "post")
NORM_STEPS = ("scale", "normalized")
# A block's norms by TransformerLens's names, in the order a pass reaches them, and the block's attributes.
BLOCK_NORMS = (("ln1", "norm1"), ("ln1_post", "post_norm1"), ("ln2", "norm2"), ("ln2_post", "post_norm2"))
# (a spliced SAE's points carry a suffix after the point they follow: ".hook_sae_acts_post")
_NAME = re.compile(r"blocks\.(\d+)\.(attn\.|mlp\.|ln1\.|ln1_post\.|ln2\.|ln2_post\.)?hook_(\w+)(\.hook_\w+)?$")


@dataclass(frozen=True)
class AttentionCall:
    """How one pass of one attention layer attends: what the hooks of its ``rot_q``, ``rot_k``,
    ``attn_scores``, ``pattern`` and ``z`` are told as ``hook.call`` (the tensors alone do not say it).

    Attributes:
        mask: the mask applied besides causality and the window, bool (True = may attend) or an
            additive float bias (ALiBi's, ``-inf`` where masked), broadcastable to ``(B, H, T, S)``; or None.
        is_causal: whether the causal mask (aligned bottom-right) applied; scale: the multiplier of ``q k^T``.
        window, sinks: a sliding window of ``window`` keys and ``sinks`` first keys always seen, or None, 0.
        softcap: ``cap`` of ``cap * tanh(scores / cap)`` on the scaled scores before any mask (Gemma 2), or None.
        q_positions: ``(1 or B, T)`` the queries' positions, k_positions: ``(1 or B, S)`` the keys' (a
            rolling cache holds them out of order; -1: an empty slot or padding), for a layer with
            positions (RoPE, ALiBi, a window); else None. They may be views of a cache: copy to keep.
    """

    mask: Tensor | None
    is_causal: bool
    scale: float
    window: int | None = None
    sinks: int = 0
    softcap: float | None = None
    q_positions: Tensor | None = None
    k_positions: Tensor | None = None


@dataclass(frozen=True)
class HookPoint:
    """What a hook function is told about where it runs (TransformerLens's ``hook`` argument): its
    ``name``, and at the attention steps after the projections how the pass attends (``call``)."""

    name: str
    call: AttentionCall | None = None

    def layer(self) -> int | None:
        m = _NAME.match(self.name)
        return int(m.group(1)) if m else None


# TransformerLens's get_act_name's other names for steps
_TL_ALIASES = {"attn": "pattern", "attn_logits": "attn_scores", "query": "q", "key": "k", "value": "v"}
_TL_ALIASES |= {"mlp_pre": "pre", "mlp_post": "post"}


def act_name(step: str, layer: int | None = None, layer_type: str | None = None) -> str:
    """The full hook name of a step: ``act_name("pattern", 3) == "blocks.3.attn.hook_pattern"``
    (TransformerLens's ``utils.get_act_name``); ``"embed"``, ``"pos_embed"`` need no layer, nor do
    ``"scale"`` and ``"normalized"`` of the final norm; a block's norm is named by ``layer_type``
    (``act_name("scale", 3, "ln2") == "blocks.3.ln2.hook_scale"``). TransformerLens's other spellings
    are read as it reads them: a full name alone is returned as it is, ``"pattern3"``, ``"k6a"`` and
    ``"scale4ln1"`` carry their layer (and norm), and ``"attn"``, ``"attn_logits"``, ``"query"``,
    ``"key"``, ``"value"``, ``"mlp_pre"``, ``"mlp_post"`` are ``pattern``, ``attn_scores``, ``q``, ``k``,
    ``v``, ``pre``, ``post``."""
    if not isinstance(step, str):
        raise TypeError(f"act_name's step must be a str, got {type(step).__name__}")
    if ("." in step or step.startswith("hook_")) and layer is None and layer_type is None:
        return step  # a full name already (TransformerLens returns it too)
    if layer is None and (compact := re.fullmatch(r"([a-z_]+?)(\d+)([a-z]\w*)?", step)):
        step, layer, layer_type = compact[1], int(compact[2]), compact[3]
        layer_type = None if layer_type in ("a", "m", "b", "attn", "mlp") else layer_type  # (the step says it)
    step = _TL_ALIASES.get(step, step)
    step = step.removeprefix("hook_")
    if step in ("embed", "pos_embed"):
        return f"hook_{step}"
    if step == "ln_final" or (step in NORM_STEPS and layer is None):
        return f"ln_final.hook_{'normalized' if step == 'ln_final' else step}"
    if not isinstance(layer, int) or isinstance(layer, bool):
        raise ValueError(f"act_name({step!r}) needs an int layer, got {layer!r}")
    if step in NORM_STEPS:
        norms = [n for n, _ in BLOCK_NORMS]
        if layer_type not in norms:
            raise ValueError(
                f"act_name({step!r}, {layer}) needs a layer_type, one of {', '.join(norms)}; got {layer_type!r}"
            )
        return f"blocks.{layer}.{layer_type}.hook_{step}"
    if step in ATTN_STEPS:
        return f"blocks.{layer}.attn.hook_{step}"
    if step in MLP_STEPS:
        return f"blocks.{layer}.mlp.hook_{step}"
    if step in BLOCK_STEPS + SPLIT_STEPS:
        return f"blocks.{layer}.hook_{step}"
    steps = ", ".join(BLOCK_STEPS + SPLIT_STEPS + ATTN_STEPS + MLP_STEPS + NORM_STEPS)
    raise ValueError(f"unknown step {step!r}; steps are {steps}, embed, pos_embed")


def attention_layers(model: nn.Module) -> list[MultiHeadAttention]:
    """The attention module of each block of a GPT-style model, in order.

    The model must have ``trf_blocks`` whose ``att`` is a :class:`~attnlab.attention.MultiHeadAttention`,
    a ``final_norm`` and an ``out_head`` (what :class:`attnlab.GPT` has)."""
    blocks = getattr(model, "trf_blocks", None)
    if not isinstance(model, nn.Module) or blocks is None:
        raise TypeError(
            "model must be an attnlab GPT (a module with trf_blocks, final_norm and out_head), "
            f"got {type(model).__name__}"
        )
    layers = [getattr(b, "att", None) for b in blocks]
    if not layers or not all(isinstance(a, MultiHeadAttention) for a in layers):
        raise TypeError("model's trf_blocks must each hold an attnlab MultiHeadAttention as .att")
    for name in ("final_norm", "out_head"):
        if not isinstance(getattr(model, name, None), nn.Module):
            raise TypeError(f"model must have a {name} module, as attnlab's GPT does")
    return layers


def hook_names(model: nn.Module) -> list[str]:
    """Every hook name of ``model``, in the order a forward pass reaches them (a spliced SAE's
    points right after the point they replace)."""
    layers = attention_layers(model)
    names = ["hook_embed"] + (["hook_pos_embed"] if getattr(model, "pos_emb", None) is not None else [])
    present = {prefix for prefix, _ in _norms(model)}  # a block's norms that exist ("blocks.0.ln1.", ...)
    for i, (block, att) in enumerate(zip(model.trf_blocks, layers, strict=True)):
        rotates = att.rope or att.qk_norm is True  # (q, k change after their hooks: RoPE, a per-head QK-norm)
        steps = [s for s in ATTN_STEPS if rotates or not s.startswith("rot_")]
        mlp_steps = [s for s in MLP_STEPS if block.ff.gated or s != "pre_linear"]
        prefixes = {n: f"blocks.{i}.{n}." for n, _ in BLOCK_NORMS}
        norm = {n: [f"{p}hook_{s}" for s in NORM_STEPS] if p in present else [] for n, p in prefixes.items()}
        names.append(f"blocks.{i}.hook_resid_pre")
        names += [f"blocks.{i}.hook_{s}" for s in SPLIT_STEPS if s != "attn_in" or att.num_kv_heads == att.num_heads]
        names += norm["ln1"] + [f"blocks.{i}.attn.hook_{s}" for s in steps] + norm["ln1_post"]
        names.append(f"blocks.{i}.hook_attn_out")
        if not getattr(block, "parallel_residual", False):  # (a parallel block adds both sublayers at once)
            names.append(f"blocks.{i}.hook_resid_mid")
        names += norm["ln2"] + [f"blocks.{i}.mlp.hook_{s}" for s in mlp_steps] + norm["ln2_post"]
        names += [f"blocks.{i}.hook_{s}" for s in ("mlp_out", "resid_post")]
    names += [f"ln_final.hook_{s}" for s in NORM_STEPS]
    for group in _ADDED.get(model, []):
        at = names.index(group.after) + 1
        names[at:at] = list(group.names)
    return names


class AddedPoints:
    """Hook points that a module spliced into ``model`` runs itself (an SAE's latents, say): their
    ``names`` follow the point ``after`` in :func:`hook_names`, and ``fns[name]`` lists the functions
    :func:`hooks` has set on each, which the owner applies with :meth:`run` as it computes the value."""

    def __init__(self, after: str, names: Sequence[str]) -> None:
        self.after, self.names = after, tuple(names)
        self.fns: dict[str, list[Callable]] = {n: [] for n in self.names}

    def run(self, name: str, x: Tensor) -> Tensor:
        """``x`` through the functions set on ``name`` (each may keep it or return a same-shaped tensor)."""
        return _apply(self.fns[name], x, HookPoint(name))


# model -> the points spliced into it now (weak: a model that is dropped takes its entry with it)
_ADDED: weakref.WeakKeyDictionary[nn.Module, list[AddedPoints]] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def added_points(model: nn.Module, after: str, names: Sequence[str]) -> Iterator[AddedPoints]:
    """Inside the block, ``names`` are hook points of ``model`` (after ``after``, an existing point),
    which :func:`hook_names`, :func:`hooks` and :func:`run_with_cache` accept; the caller computes
    their values and calls ``points.run(name, x)`` at each. A ValueError if a name is taken."""
    known = hook_names(model)
    if after not in known:
        raise ValueError(f"added_points: {after!r} is not a hook point of this model (see hook_names(model))")
    taken = sorted(set(names) & set(known))
    if taken or len(set(names)) != len(names):
        raise ValueError(
            f"added_points: {', '.join(taken) or 'a repeated name'} is already a hook point "
            "(one SAE spliced at a point at a time)"
        )
    group = AddedPoints(after, names)
    _ADDED.setdefault(model, []).append(group)
    try:
        yield group
    finally:
        groups = _ADDED.get(model, [])
        if group in groups:
            groups.remove(group)
        if not groups:
            _ADDED.pop(model, None)


class _Sites:
    """The hook functions of one block or one attention layer; the model calls ``sites(step, x)``
    at each named step (and, for attention, :meth:`attend` in place of the fused kernel)."""

    def __init__(self, prefix: str, fns: dict[str, list[Callable]]) -> None:
        self.prefix, self.fns = prefix, fns
        self.stepwise = any(s in fns for s in _STEPWISE)  # (then the attention runs :meth:`attend`)
        self.split = any(s in fns for s in SPLIT_STEPS)  # (a block's: the heads' split inputs)

    def __call__(self, step: str, x: Tensor, call: AttentionCall | None = None) -> Tensor:
        fns = self.fns.get(step)
        return x if fns is None else _apply(fns, x, HookPoint(f"{self.prefix}hook_{step}", call))

    def _heads(self, step: str, x: Tensor, call: AttentionCall) -> Tensor:
        """A ``(b, H, n, hd)`` tensor through the hook of ``step``, which sees ``(b, n, H, hd)``."""
        return x if step not in self.fns else self(step, x.transpose(1, 2), call).transpose(1, 2)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        *,
        enable_gqa: bool = False,
        window: int | None = None,
        sinks: int = 0,
        score_mod: Any = None,
        mask_mod: Any = None,
        return_weights: bool = False,
        backend: str = "auto",
        q_positions: Tensor | None = None,
        k_positions: Tensor | None = None,
        softcap: float | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """:func:`attnlab.functional.attend` step by step (for :attr:`stepwise` sites): ``q (b, H, n, hd)``,
        ``k, v (b, Hkv, S, hd)``; the positions and the soft cap are told to the hooks (:class:`AttentionCall`)."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        call = AttentionCall(attn_mask, is_causal, scale, window, sinks, softcap, q_positions, k_positions)
        q, k = self._heads("rot_q", q, call), self._heads("rot_k", k, call)
        mods = dict(enable_gqa=enable_gqa, window=window, sinks=sinks, score_mod=score_mod, mask_mod=mask_mod)
        # (b, H, n, S), soft-capped where the model caps, -inf where masked
        scores = attention_scores(q, k, attn_mask, is_causal, scale, **mods)
        scores = self("attn_scores", scores, call)
        pattern = torch.softmax(scores, dim=-1)  # (b, H, n, S)
        # A row with no key (padding): zero weights; in place unless the softmax's backward needs its output.
        # Only a mask, a score_mod or a hook on the scores can leave a row so (the causal mask keeps each
        # query's own key; the positions are only told to the hooks, the model folds any mask of them into
        # attn_mask): without one, no pass.
        masked = attn_mask is not None or mask_mod is not None or score_mod is not None or "attn_scores" in self.fns
        if masked or q.shape[-2] > k.shape[-2]:
            pattern = pattern.nan_to_num(0.0) if pattern.requires_grad else pattern.nan_to_num_(0.0)
        pattern = self("pattern", pattern, call)  # (b, H, n, S)
        dropped = F.dropout(pattern, dropout_p) if dropout_p > 0 else pattern
        z = self._heads("z", heads_matmul(dropped, v), call)  # (b, H, n, hd), each group's heads on its v
        return (z, pattern) if return_weights else z


def _apply(fns: list[Callable], x: Tensor, point: HookPoint) -> Tensor:
    """``x`` through each of ``fns`` in turn: each returns None (keep) or a tensor of ``x``'s shape,
    dtype and device (replace): the model computes on with it, so anything else would fail deep inside
    (or, an integer tensor, give NaN)."""
    for fn in fns:
        out = fn(x, point)
        if out is None:
            continue
        if not isinstance(out, Tensor) or (out.shape, out.dtype, out.device) != (x.shape, x.dtype, x.device):
            got = type(out).__name__
            if isinstance(out, Tensor):
                got = f"shape {tuple(out.shape)}, {out.dtype} on {out.device}"
            raise ValueError(
                f"the hook on {point.name} must return None or a tensor of shape {tuple(x.shape)}, "
                f"{x.dtype} on {x.device} (as it was given), got {got}"
            )
        x = out
    return x


def _check_fns(model: nn.Module, fns: object) -> dict[str, list[Callable]]:
    if not isinstance(fns, Mapping):
        raise TypeError(f"hooks must be a dict {{hook name: function}}, got {type(fns).__name__}")
    known = set(hook_names(model))
    out: dict[str, list[Callable]] = {}
    for name, fn in fns.items():
        if name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else " (see attnlab.interpret.hook_names(model))"
            if str(name).endswith("hook_resid_mid") and str(name).replace("mid", "pre") in known:  # (a parallel block)
                hint = (
                    ": this model's blocks are parallel (attention and MLP both read the block's input), "
                    "so no block has a resid_mid"
                )
            raise ValueError(f"unknown hook name {name!r}{hint}")
        listed = list(fn) if isinstance(fn, Sequence) else [fn]
        if not listed or not all(callable(f) for f in listed):
            raise TypeError(f"the hook on {name} must be a function fn(activation, hook) or a list of them")
        out[name] = listed
    return out


@contextlib.contextmanager
def hooks(model: nn.Module, fns: Mapping[str, Callable | Sequence[Callable]]) -> Iterator[nn.Module]:
    """Inside the block, ``fns[name](activation, hook)`` runs at each named hook point of ``model``.

    A function returns None (the activation is kept) or a same-shaped tensor (it replaces it); it
    may keep a reference, call ``retain_grad()``, or build on it with gradients (grad mode is the
    caller's). Blocks nest (an inner block's functions run after the outer ones'). On exit, also
    after an error, the model is as it was. Unknown names are a ValueError that suggests close ones.
    """
    checked = _check_fns(model, fns)
    layers = attention_layers(model)
    sites = [(b, a, b.ff) for b, a in zip(model.trf_blocks, layers, strict=True)]  # each block's three owners
    previous = [tuple(m.hook for m in owners) for owners in sites]
    handles = []
    norm_fns: list[tuple[nn.Module, dict[str, list[Callable]], dict[str, list[Callable]]]] = []
    # A spliced module's points: their functions go on its own lists (it runs them), put back on exit.
    added = {n: g for g in _ADDED.get(model, []) for n in g.names if n in checked}
    before_added = {n: g.fns[n] for n, g in added.items()}

    def module_hook(name: str) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
            return _apply(checked[name], output, HookPoint(name))

        return hook

    try:
        for n, g in added.items():
            g.fns[n] = before_added[n] + checked[n]  # a new list: the one put back on exit stays as it was
        by_owner: dict[str, dict[str, list]] = {}  # a point's name is its owner's prefix, then hook_{step}
        for n, f in checked.items():
            prefix, _, step = n.rpartition("hook_")
            by_owner.setdefault(prefix, {})[step] = f
        for i, owners in enumerate(sites):
            for owner, prefix in zip(owners, (f"blocks.{i}.", f"blocks.{i}.attn.", f"blocks.{i}.mlp."), strict=True):
                # (a spliced module's points have prefixes of their own: no block's owner takes them)
                owner.hook = _merged(owner.hook, prefix, by_owner.get(prefix, {}))
        for name, module in (("hook_embed", "tok_emb"), ("hook_pos_embed", "pos_emb")):
            if name in checked:
                handles.append(getattr(model, module).register_forward_hook(module_hook(name)))
        for prefix, norm in _norms(model):
            steps = {s: checked.get(f"{prefix}hook_{s}", []) for s in NORM_STEPS}
            if any(steps.values()):
                fns = _norm_fns(norm, prefix)
                for step, listed in steps.items():  # (new lists: a running pass keeps the ones it read)
                    fns[step] = fns[step] + listed
                norm_fns.append((norm, fns, steps))
        yield model
    finally:
        for h in handles:
            h.remove()
        for norm, fns, steps in reversed(norm_fns):
            for step, listed in steps.items():
                fns[step] = fns[step][: len(fns[step]) - len(listed)]
            if not any(fns.values()):  # (no block sets functions on this norm any more)
                _NORM_HOOKS.pop(norm)[1].remove()
        for n, g in added.items():
            g.fns[n] = before_added[n]
        for owners, before in zip(sites, previous, strict=True):
            for owner, hook in zip(owners, before, strict=True):
                owner.hook = hook


def _norms(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(point prefix, norm module)`` of each block's norms (TransformerLens's names), then the final norm."""
    blocks = [(f"blocks.{i}.{n}.", getattr(b, a)) for i, b in enumerate(model.trf_blocks) for n, a in BLOCK_NORMS]
    return [(p, m) for p, m in blocks if m is not None] + [("ln_final.", model.final_norm)]


# norm module -> (the functions set on its points, {step: [fn]}; the handle of the one forward hook that
# runs them). One hook a norm, however many blocks of :func:`hooks` nest: a second forward hook would
# recompute the norm from its input, undoing a replaced scale of the first.
_NORM_HOOKS: weakref.WeakKeyDictionary[nn.Module, tuple[dict[str, list[Callable]], Any]] = weakref.WeakKeyDictionary()


def _norm_fns(norm: nn.Module, prefix: str) -> dict[str, list[Callable]]:
    """The lists of functions ``norm``'s forward hook runs, the hook registered if it was not."""
    if norm not in _NORM_HOOKS:
        fns: dict[str, list[Callable]] = {s: [] for s in NORM_STEPS}

        def hook(norm: nn.Module, args: tuple, output: Tensor) -> Tensor:
            scale, normalized = fns["scale"], fns["normalized"]
            if scale:
                on_scale = lambda s: _apply(scale, s, HookPoint(f"{prefix}hook_scale"))
                output = _norm_steps(norm, args[0], on_scale, output)
            return _apply(normalized, output, HookPoint(f"{prefix}hook_normalized")) if normalized else output

        _NORM_HOOKS[norm] = (fns, norm.register_forward_hook(hook))
    return _NORM_HOOKS[norm][0]


def _norm_steps(norm: nn.Module, x: Tensor, on_scale: Callable[[Tensor], Tensor], output: Tensor) -> Tensor:
    """``norm(x)`` with its scale through ``on_scale``: ``x (..., d)``, the scale ``(..., 1)``, for
    ``nn.LayerNorm`` (``sqrt(var + eps)``, then ``(x - mean) / scale * weight + bias``), ``nn.RMSNorm`` and
    :class:`~attnlab.attention.OffsetRMSNorm` (``sqrt(mean(x^2) + eps)``, then ``x / scale * gain``), in
    float32 for lower precisions. Where ``on_scale`` returns the tensor it was given, unchanged, ``output``
    (the module's own result) is returned as it is; a scale edited in place divides, as a returned one does."""
    h = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    layer_norm = isinstance(norm, nn.LayerNorm)
    if layer_norm:
        h = h - h.mean(-1, keepdim=True)
    elif not isinstance(norm, (nn.RMSNorm, OffsetRMSNorm)):
        kinds = "nn.LayerNorm, nn.RMSNorm or OffsetRMSNorm"
        raise TypeError(f"a norm's scale is hooked on {kinds}, got {type(norm).__name__}")
    eps = torch.finfo(h.dtype).eps if norm.eps is None else norm.eps
    given = (h.pow(2).mean(-1, keepdim=True) + eps).sqrt()  # (..., 1)
    before = given.clone()  # (one number a position: what tells an edit in place)
    scale = on_scale(given)
    if scale is given and torch.equal(given, before):
        return output
    y = h / scale.to(h.dtype)  # (..., d)
    if isinstance(norm, OffsetRMSNorm):
        y = y * (norm.offset + norm.weight.to(y.dtype))
    elif norm.weight is not None:
        y = y * norm.weight.to(y.dtype)
    if layer_norm and norm.bias is not None:
        y = y + norm.bias.to(y.dtype)
    return y.to(x.dtype)


def _merged(before: _Sites | None, prefix: str, steps: dict[str, list[Callable]]) -> _Sites | None:
    """The sites of a module: the functions set before, then ``steps``'s (None: nothing to call)."""
    if before is None and not steps:
        return None
    old = {} if before is None else before.fns
    return _Sites(prefix, {s: old.get(s, []) + steps.get(s, []) for s in {*old, *steps}})


@contextlib.contextmanager
def attention_hooks(modules: Sequence[MultiHeadAttention], fns: Mapping[str, Callable]) -> Iterator[None]:
    """Inside the block, ``fns[step](activation, hook)`` runs at the attention steps of each of
    ``modules`` (``"q"``, ``"k"``, ``"v"``, ``"rot_q"``, ``"rot_k"``, ``"attn_scores"``, ``"pattern"``,
    ``"z"``; hook names ``hook_{step}``): the hook points of attention modules that are not a GPT's
    layers, such as a tutorial's :class:`~attnlab.MultiHeadAttention` on its own. ``rot_q`` and ``rot_k``
    are the queries and keys as the scores see them, in every module. Functions set before run first;
    on exit the modules are as they were."""
    unknown = sorted(set(fns) - set(ATTN_STEPS))
    if unknown:
        raise ValueError(f"unknown attention steps {unknown}; steps are {', '.join(ATTN_STEPS)}")
    steps = {step: [fn] for step, fn in fns.items()}
    previous = [m.hook for m in modules]
    try:
        for m in modules:
            m.hook = _merged(m.hook, "", steps)
        yield
    finally:
        for m, before in zip(modules, previous, strict=True):
            m.hook = before


class ActivationCache(dict):
    """What :func:`run_with_cache` recorded: ``{hook name: tensor}``. Also indexed as
    TransformerLens's cache is: ``cache["pattern", 3]`` is ``cache["blocks.3.attn.hook_pattern"]``, and
    ``cache["pattern", -1]`` the last layer's (``n_layers``: the model's, where known)."""

    n_layers: int | None = None

    def __getitem__(self, key: object) -> Tensor:
        if isinstance(key, tuple):
            if len(key) > 1 and isinstance(key[1], int) and key[1] < 0 and self.n_layers is not None:
                key = (key[0], key[1] + self.n_layers, *key[2:])
            key = act_name(*key)
        elif isinstance(key, str) and key not in self and not key.startswith(("blocks.", "hook_", "ln_final")):
            key = act_name(key)
        try:
            return super().__getitem__(key)
        except KeyError:
            raise KeyError(f"{key!r} was not cached; cached: {', '.join(list(self)[:6])}...") from None


class _Reached(Exception):
    """Raised by :func:`activation_at`'s hook: the rest of the forward pass is not needed."""


def activation_at(model: nn.Module, name: str, idx: Tensor) -> Tensor:
    """The activation at hook point ``name`` for ``idx (B, T)``, the layers after it not run."""
    seen: dict[str, Tensor] = {}

    def stop(x: Tensor, hook: HookPoint) -> None:
        seen["x"] = x
        raise _Reached

    with contextlib.suppress(_Reached), hooks(model, {name: stop}):
        model(idx)
    return seen["x"]


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block; its own mode back after it, even after an error."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def run_with_cache(
    model: nn.Module,
    idx: Tensor,
    names: Sequence[str] | Callable[[str], bool] | None = None,
    *,
    attention_mask: Tensor | None = None,
    grad: bool = False,
) -> tuple[Tensor, ActivationCache]:
    """Run ``model`` on ``idx (B, T)`` (or ``(T,)``) and keep the activations at ``names``.

    Args:
        names: hook names, a filter ``name -> bool`` (TransformerLens's ``names_filter``), or None: all
            but the heads' split inputs (``hook_attn_in``, ``hook_q_input``, ...: a copy of the residual
            per head, and H times the projections' work; name them, or let a filter take them).
        attention_mask: ``(B, T)`` True = real token, as :meth:`attnlab.GPT.forward` takes it.
        grad: run with gradients (the cached tensors then stay in the graph); default: no_grad, detached.
    Returns:
        ``(logits (B, T, V), cache)``; the model runs in eval mode and is left in its own mode.
    """
    known = hook_names(model)
    if names is None:
        wanted = [n for n in known if not n.endswith(tuple(f"hook_{s}" for s in SPLIT_STEPS))]
    elif callable(names):
        wanted = [n for n in known if names(n)]
    elif isinstance(names, str):
        wanted = [names]
    else:
        wanted = list(names)
    if isinstance(idx, Tensor) and idx.dim() == 1:
        idx = idx.unsqueeze(0)  # (1, T)
    cache = ActivationCache()

    def keep(x: Tensor, hook: HookPoint) -> Tensor | None:
        if grad and not x.requires_grad and x.is_floating_point() and torch.is_grad_enabled():
            # Made from frozen weights only (a quantized or frozen embedding): a leaf of its own,
            # so that gradients reach it and what is computed from it.
            x = x.detach().requires_grad_()
            cache[hook.name] = x
            return x
        cache[hook.name] = x if grad else x.detach()
        return None

    grad_mode = torch.set_grad_enabled(grad and torch.is_grad_enabled())
    with eval_mode(model), grad_mode, hooks(model, dict.fromkeys(wanted, keep)):
        logits = model(idx) if attention_mask is None else model(idx, attention_mask=attention_mask)
    out = ActivationCache({n: cache[n] for n in known if n in cache})
    out.n_layers = len(model.trf_blocks)
    return logits, out
