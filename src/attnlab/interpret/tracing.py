"""One forward pass, recorded: what every attention layer of a GPT computed.

:func:`trace` runs the model with functions on its hook points (:mod:`attnlab.interpret.hooks`, the
one way attnlab reads activations): each layer's ``hook_pattern`` gives the weights the model applied
to its values, and how it attended (``hook.call``: the mask, causality, scale, soft cap). Nothing
here computes a softmax. The tutorials' intermediate steps (``q @ k.T``, scaled, masked) are
recomposed from the recorded queries and keys with that mask, so they describe exactly what was
computed, whatever positions or biases produced them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.attention import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)
from attnlab.checks import check_float_tensor
from attnlab.functional import attention_scores, causal_mask, combine_masks, simple_self_attention, softcap_score_mod
from attnlab.interpret.hooks import (
    AttentionCall,
    HookPoint,
    attention_hooks,
    attention_layers,
    eval_mode,
    hook_names,
    hooks,
)

__all__ = [
    "STEP_NAMES",
    "AttentionRecord",
    "Trace",
    "attention_layers",
    "attention_rows",
    "observe_attention_rows",
    "record_module",
    "rows_of",
    "stop_before_head",
    "trace",
]

# The tutorials' names for the steps of one head, in order ("A simple self-attention mechanism",
# "Implement the Self-Attention Mechanism in PyTorch").
STEP_NAMES = {
    "scores": "attn_scores = queries @ keys.T",
    "scaled": "attn_scores / keys.shape[-1]**0.5",
    "capped": "attn_scores = cap * torch.tanh(attn_scores / cap)",  # only a soft-capped layer (Gemma 2)
    "masked": "attn_scores.masked_fill(mask.bool(), -torch.inf)",
    "weights": "attn_weights = torch.softmax(masked, dim=-1)",
    "head_outputs": "context_vec = attn_weights @ values",
}


def full_mask(call: AttentionCall, n: int, S: int, device: torch.device) -> Tensor | None:
    """The mask of ``call`` besides plain causality: its own, with its sliding window's (if any) folded in,
    broadcastable to ``(B, H, n, S)``."""
    if call.window is None:
        return call.mask
    return combine_masks(call.mask, causal_mask(n, S, window=call.window, sinks=call.sinks, device=device))


@contextlib.contextmanager
def attention_rows(model: nn.Module) -> Iterator[dict[int, tuple[Tensor, Tensor | None, Tensor | None]]]:
    """A reading of one pass's last query (:data:`attnlab.decoding.Reading`): inside it, a pass of
    ``model`` fills the dict it yields with ``{layer: (row (b, H, S), q_positions, k_positions)}`` from
    each layer's ``hook_pattern`` (the positions as :class:`~attnlab.interpret.hooks.AttentionCall` tells
    them). :func:`rows_of` lays them out. Serve's generation stream reads each token so, and a compiled
    decoding step compiles these hook functions with it (``stream(..., reading=attention_rows)``)."""
    got: dict[int, tuple] = {}
    fns = {f"blocks.{i}.attn.hook_pattern": functools.partial(_keep_row, got, i) for i in range(len(model.trf_blocks))}
    with hooks(model, fns):
        yield got


def _keep_row(got: dict, layer: int, pattern: Tensor, hook: HookPoint) -> None:
    got[layer] = (pattern[:, :, -1], hook.call.q_positions, hook.call.k_positions)  # (b, H, S), (1|b, n), (1|b, S)


def rows_of(
    model: nn.Module, read: dict[int, tuple[Tensor, Tensor | None, Tensor | None]]
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(weights (L, b, H, S), q_positions, k_positions)``: the rows :func:`attention_rows` read of a pass,
    in the model's dtype, with the query's and keys' positions of layer 0 (None without). A decoding
    step over cache slots (:class:`~attnlab.attention.SlotCache`) attends over every slot, the later ones
    masked: its rows end at the query's own slot.

    Layers that attend over different keys (a model with windows of several sizes, such as Gemma 3's,
    once the text is longer than a window) have their rows laid on the keys of the layer with the most,
    by position: a key that layer holds and another does not (outside its window) gets weight 0 there,
    and the positions handed are that layer's. Without positions that is a ``ValueError``."""
    layers = attention_layers(model)
    if sorted(read) != list(range(len(layers))):
        raise ValueError(f"rows_of needs every layer to attend once a pass, got layers {sorted(read)} of {len(layers)}")
    rows, q_pos, k_pos = ([read[i][j] for i in range(len(layers))] for j in range(3))
    for i, (row, q, k) in enumerate(zip(rows, q_pos, k_pos, strict=True)):
        if q is not None and k is not None and k.shape[0] == 1 and row.shape[-1] > int(q[0, -1]) + 1:
            S = int(q[0, -1]) + 1  # slots after the query's: empty (a slot cache's slot j holds position j)
            if torch.equal(k[0, :S], torch.arange(S, device=k.device)):
                rows[i], k_pos[i] = row[..., :S], k[:, :S]
    # Layers of several windows or sinks may hold their keys in other slots even where they hold as many
    # (a prompt's pass with sinks: the global layer's slots start with them): their positions decide.
    several = len({(att.window, att.sinks) for att in layers}) > 1
    first = k_pos[0]
    if len({r.shape[-1] for r in rows}) == 1 and (
        not several or first is None or all(torch.equal(k, first) for k in k_pos[1:])
    ):
        return torch.stack(rows), q_pos[0], first  # (L, b, H, S)
    # The layer that holds the most keys (a global one: every other layer's are among them)
    wide = max(range(len(rows)), key=lambda i: (rows[i].shape[-1], _held(k_pos[i])))
    return _rows_on_keys(rows, k_pos, k_pos[wide]), q_pos[wide], k_pos[wide]


@contextlib.contextmanager
def observe_attention_rows(
    model: nn.Module, callback: Callable[[Tensor, Tensor | None, Tensor | None], None]
) -> Iterator[list[MultiHeadAttention]]:
    """Call ``callback(weights, q_positions, k_positions)`` once per pass of ``model`` inside the block,
    after its last layer: :func:`rows_of` what :func:`attention_rows` reads of each pass (what
    :func:`~attnlab.interpret.trace_generation` shows of each token). The positions may be views of a
    cache, valid until the next pass; ``weights`` is the callback's to keep."""
    layers = attention_layers(model)
    got: dict[int, tuple] = {}

    def keep(pattern: Tensor, hook: HookPoint) -> None:
        layer = hook.layer()
        if layer == 0:  # a new pass
            got.clear()
        _keep_row(got, layer, pattern.detach(), hook)
        if layer == len(layers) - 1:
            callback(*rows_of(model, got))

    with hooks(model, {f"blocks.{i}.attn.hook_pattern": keep for i in range(len(layers))}):
        yield layers


def _held(positions: Tensor | None) -> int:
    """How many keys a pass's positions ``(1 or b, S)`` name (-1: an empty slot or padding)."""
    return 0 if positions is None else int((positions >= 0).sum())


def _rows_on_keys(rows: list[Tensor], positions: list[Tensor | None], keys: Tensor | None) -> Tensor:
    """Each layer's row ``(b, H, S_i)`` laid on the keys at positions ``keys (1 or b, S)`` (-1: none), by its
    keys' ``positions``: ``(L, b, H, S)``, 0 where a layer holds no such key."""
    if keys is None or any(p is None for p in positions):
        sizes = [row.shape[-1] for row in rows]
        raise ValueError(
            f"observe_attention_rows: this pass's layers attended over {sizes} keys (windows of several "
            "sizes) and tell no key positions to lay them on one another: use hooks on hook_pattern"
        )
    b, H, S = rows[0].shape[0], rows[0].shape[1], keys.shape[-1]
    keys = keys.expand(b, S)
    top = int(keys.max()) + 1
    # column_of[row, p]: the column of position p among `keys` (S: none, a column dropped below)
    column_of = torch.full((b, top + 1), S, dtype=torch.long, device=keys.device)
    at = torch.arange(S, device=keys.device).expand(b, S)
    column_of.scatter_(1, torch.where(keys >= 0, keys, top), torch.where(keys >= 0, at, S))
    column_of[:, top] = S
    out = rows[0].new_zeros(len(rows), b, H, S + 1)  # (L, b, H, S + 1)
    for i, (row, at) in enumerate(zip(rows, positions, strict=True)):
        pos = at.expand(b, row.shape[-1])  # (b, S_i)
        cols = column_of.gather(1, torch.where((pos >= 0) & (pos < top), pos, top))  # (b, S_i)
        out[i].scatter_(-1, cols[:, None].expand(b, H, -1), row)
    return out[..., :S]


@dataclass
class Trace:
    """What :func:`trace` recorded. ``L`` layers, batch ``B``, ``H`` query heads (``Hkv`` key/value
    heads), ``T`` tokens (``S = T`` keys), head width ``hd``, residual width ``d``.

    Always:
        idx: ``(B, T)`` the token ids; attention_mask: ``(B, T)`` bool (True = real token) or None.
        weights: ``(L, B, H, T, S)`` the attention weights each layer applied (float32).
        logits: ``(B, T, V)`` the model's output (None from ``trace(..., logits=False)``).
        scale, is_causal: per layer, the multiplier of ``q k^T`` and whether causal masking applied.
        masks: per layer, the mask the layer applied besides causality (bool, True = may attend, or
            an additive float bias), broadcastable to ``(B, H, T, S)``; or None.
        softcaps: per layer, the cap of ``cap * tanh(scores / cap)`` applied to the scaled scores
            before the mask (Gemma 2), or None.
    With ``stages=True`` (else None):
        q: ``(L, B, H, T, hd)``; k, v: ``(L, B, Hkv, S, hd)`` (after any rotation the layer applies);
        head_outputs: ``(L, B, H, T, hd)`` = ``weights @ v`` per head;
        attn_output: ``(L, B, T, d)`` the attention output added to the stream (``hook_attn_out``:
            the output projection of the concatenated heads, then a post-attention norm where the
            family has one);
        residual: ``(L + 1, B, T, d)`` the stream entering each block, then the stream after the
            last block (before the final norm).
    The scores of the tutorials' steps are computed on demand from ``q``, ``k`` and the masks:
    :attr:`scores`, :attr:`scaled`, :attr:`masked`, or :meth:`steps` for one layer.
    """

    idx: Tensor
    weights: Tensor
    logits: Tensor | None
    scale: list[float]
    is_causal: list[bool]
    masks: list[Tensor | None]
    attention_mask: Tensor | None = None
    softcaps: list[float | None] | None = None
    q: Tensor | None = None
    k: Tensor | None = None
    v: Tensor | None = None
    head_outputs: Tensor | None = None
    attn_output: Tensor | None = None
    residual: Tensor | None = None
    model: nn.Module | None = field(default=None, repr=False, compare=False)
    tokenizer: object | None = field(default=None, repr=False, compare=False)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    # Sizes ---------------------------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return self.weights.shape[0]

    @property
    def n_heads(self) -> int:
        return self.weights.shape[2]

    @property
    def has_stages(self) -> bool:
        return self.q is not None

    def _need_stages(self, what: str) -> None:
        if not self.has_stages:
            raise ValueError(f"{what} needs a trace with the stages: trace(model, idx, stages=True)")

    # The tutorials' steps --------------------------------------------------------------------------
    def steps(self, layer: int) -> dict[str, Tensor]:
        """The steps of layer ``layer`` for all heads, each ``(B, H, T, S)`` (``head_outputs``:
        ``(B, H, T, hd)``): ``scores = q @ k^T``, ``scaled = scores * scale``, for a soft-capped
        layer ``capped = cap * tanh(scaled / cap)``, ``masked`` (``-inf`` where masked, or the
        layer's additive bias added), ``weights`` and ``head_outputs``.

        ``softmax(masked) == weights`` and ``weights @ v == head_outputs`` (rows with no key to
        attend, e.g. padding, have all ``-inf`` scores and zero weights)."""
        self._need_stages("Trace.steps")
        n = self.n_layers
        if not isinstance(layer, int) or isinstance(layer, bool) or not -n <= layer < n:
            raise ValueError(f"layer must be an int in [-{n}, {n}), got {layer!r}")
        layer %= n
        q, k = self.q[layer], self.k[layer]  # (B, H, T, hd), (B, Hkv, S, hd)
        gqa, scale = k.shape[1] != q.shape[1], self.scale[layer]
        scores = attention_scores(q, k, scale=1.0, enable_gqa=gqa)  # (B, H, T, S): q @ k^T
        cap = None if self.softcaps is None else self.softcaps[layer]
        mod = None if cap is None else softcap_score_mod(cap)
        masked = attention_scores(q, k, self.masks[layer], self.is_causal[layer], scale, enable_gqa=gqa, score_mod=mod)
        steps = {"scores": scores, "scaled": scores * scale}
        if cap is not None:
            steps["capped"] = cap * torch.tanh(steps["scaled"] / cap)
        return steps | {"masked": masked, "weights": self.weights[layer], "head_outputs": self.head_outputs[layer]}

    def _stacked(self, name: str) -> Tensor:
        if name not in self._cache:
            self._cache[name] = torch.stack([self.steps(i)[name] for i in range(self.n_layers)])
        return self._cache[name]

    @property
    def scores(self) -> Tensor:
        """``(L, B, H, T, S)`` ``q @ k^T`` (computed on first use from the recorded queries and keys)."""
        return self._stacked("scores")

    @property
    def scaled(self) -> Tensor:
        """``(L, B, H, T, S)`` the scores times each layer's scale."""
        return self._stacked("scaled")

    @property
    def masked(self) -> Tensor:
        """``(L, B, H, T, S)`` the scaled scores with ``-inf`` where masked (plus any additive bias)."""
        return self._stacked("masked")

    def real_tokens(self) -> Tensor:
        """``(B, T)`` bool: True at real (not padding) tokens."""
        if self.attention_mask is None:
            return torch.ones(self.idx.shape, dtype=torch.bool, device=self.idx.device)
        return self.attention_mask

    def _repr_html_(self) -> str:
        """The inspector page, inline in Jupyter: an iframe holding the whole offline page (the same
        file ``attnlab viz --out page.html`` writes). Token labels come from ``tokenizer`` when the
        trace has one."""
        from attnlab import interpret  # the package: the page sits above the trace (rollout, lens, ...)

        return interpret.notebook_html(interpret.inspector_data(self))


def trace(
    model: nn.Module,
    idx: Tensor,
    *,
    stages: bool = False,
    attention_mask: Tensor | None = None,
    tokenizer: object | None = None,
    logits: bool = True,
) -> Trace:
    """Run ``model`` once on ``idx`` and record what each attention layer computed.

    Args:
        model: an attnlab :class:`~attnlab.GPT` (any module with ``trf_blocks`` of attnlab attention).
        idx: ``(B, T)`` or ``(T,)`` token ids (``T <= context_length``).
        stages: also record queries, keys, values, head outputs, the attention outputs, the
            residual stream (see :class:`Trace`); the scores follow from them on demand.
        attention_mask: ``(B, T)`` bool or 0/1, True = real token (left padding, as generation).
        tokenizer: kept with the trace to label tokens when it is displayed (Jupyter).
        logits: compute the model's output; False stops the pass after the last block (no final norm,
            no unembedding: a fifth of a small model's work, for a view that shows attention only) and
            leaves ``Trace.logits`` None.
    Returns:
        A :class:`Trace`. The pass runs in eval mode without gradients; the model's training mode
        and hooks are as they were afterwards, even after an error.
    """
    attention_layers(model)  # (a TypeError for anything but a GPT-style model)
    if isinstance(idx, Tensor) and idx.dim() == 1:
        idx = idx.unsqueeze(0)  # (1, T)
    if hasattr(model, "check_idx"):
        idx = model.check_idx(idx)
    if attention_mask is not None and hasattr(model, "check_attention_mask"):
        attention_mask = model.check_attention_mask(attention_mask, *idx.shape, idx.device)
    if not isinstance(stages, bool):
        raise TypeError(f"stages must be a bool, got {stages!r}")
    rec, out_logits = _TraceRecorder(model, stages), None
    stop = contextlib.nullcontext() if logits else stop_before_head(model)  # (then out_logits stays None)
    with eval_mode(model), torch.no_grad(), hooks(model, rec.fns), stop:
        out_logits = model(idx, attention_mask=attention_mask) if attention_mask is not None else model(idx)
    missing = [i for i, c in enumerate(rec.calls) if c is None]
    if missing:
        raise RuntimeError(f"layers {missing} reported no attention during the forward pass")

    calls, T = rec.calls, idx.shape[1]
    masks = [full_mask(c, T, T, idx.device) for c in calls]
    out = Trace(
        idx=idx,
        weights=rec.buffers["weights"],  # (L, B, H, T, S) float32
        logits=None if out_logits is None else out_logits.detach(),
        scale=[float(c.scale) for c in calls],
        is_causal=[bool(c.is_causal) for c in calls],
        masks=[None if m is None else m.detach() for m in masks],
        attention_mask=attention_mask,
        softcaps=[c.softcap for c in calls],
        model=model,
        tokenizer=tokenizer,
    )
    if stages:
        for name in ("q", "k", "v", "head_outputs", "attn_output", "residual"):
            setattr(out, name, rec.buffers[name])  # (L, B, H, T, hd), ..., (L, B, T, d), (L + 1, B, T, d)
    return out


class _TraceRecorder:
    """What :func:`trace` keeps of one pass, layer by layer, from the hook points: how each layer
    attended, the weights, and with ``stages`` the queries, keys, values, head outputs, the attention
    outputs and the residual stream.

    Each of them goes straight into one ``(L, ...)`` tensor as each layer reaches its hook: stacking
    them at the end would hold them twice (the weights are the trace's largest tensor).
    """

    def __init__(self, model: nn.Module, stages: bool):
        self.n_layers, self.stages = len(model.trf_blocks), stages
        self.calls: list[AttentionCall | None] = [None] * self.n_layers
        self.buffers: dict[str, Tensor] = {}
        names, L = set(hook_names(model)), self.n_layers
        self.fns: dict[str, Callable] = {f"blocks.{i}.attn.hook_pattern": self._pattern for i in range(L)}
        if not stages:
            return
        for i in range(L):
            for step in ("q", "k"):  # as the scores see them: after RoPE or QK-norm
                rot = f"blocks.{i}.attn.hook_rot_{step}"
                self.fns[rot if rot in names else f"blocks.{i}.attn.hook_{step}"] = self._keeper(step, heads=True)
            self.fns[f"blocks.{i}.attn.hook_v"] = self._keeper("v", heads=True)
            self.fns[f"blocks.{i}.attn.hook_z"] = self._keeper("head_outputs", heads=True)
            self.fns[f"blocks.{i}.hook_attn_out"] = self._keeper("attn_output")
            self.fns[f"blocks.{i}.hook_resid_pre"] = self._keeper("residual")
        self.fns[f"blocks.{L - 1}.hook_resid_post"] = self._keeper("residual", at=L)

    def _put(self, name: str, i: int, x: Tensor, rows: int) -> None:
        if name not in self.buffers:
            dtype = torch.float32 if name == "weights" else x.dtype
            self.buffers[name] = torch.empty((rows, *x.shape), dtype=dtype, device=x.device)
        self.buffers[name][i].copy_(x.detach())

    def _pattern(self, pattern: Tensor, hook: HookPoint) -> None:
        i = hook.layer()
        if self.calls[i] is not None:
            raise RuntimeError(f"layer {i} attended twice in one forward pass; trace expects one call per layer")
        self.calls[i] = hook.call
        self._put("weights", i, pattern, self.n_layers)  # (B, H, T, S)

    def _keeper(self, name: str, heads: bool = False, at: int | None = None) -> Callable:
        rows = self.n_layers + 1 if name == "residual" else self.n_layers

        def keep(x: Tensor, hook: HookPoint) -> None:
            # The hooks see heads as TransformerLens does, (B, T, H, hd); a trace holds (B, H, T, hd).
            self._put(name, hook.layer() if at is None else at, x.transpose(1, 2) if heads else x, rows)

        return keep


class _Stopped(Exception):
    """Raised by :func:`_stop` to end a traced pass after the last block."""


def _stop(module: nn.Module, args: tuple) -> None:
    raise _Stopped


@contextlib.contextmanager
def stop_before_head(model: nn.Module) -> Iterator[None]:
    """Within it, a forward pass of ``model`` ends after its last block, before the final norm and the
    unembedding (the attention needs neither): the call raises, and that ends the ``with`` block
    quietly, so the call's result is never assigned. Hooks on the final norm registered before it
    still run."""
    handle = model.final_norm.register_forward_pre_hook(_stop)
    try:
        yield
    except _Stopped:
        pass
    finally:
        handle.remove()


# --------------------------------------------------------------------------------------------
# The tutorials' modules: one record per head group, on the library's own return_weights path
# --------------------------------------------------------------------------------------------
@dataclass
class AttentionRecord:
    """What one of the tutorials' attention modules computed on one input (:func:`record_module`).

    Attributes:
        q: ``(b, H, n, hd)`` queries; k, v: ``(b, Hkv, S, hd)`` keys and values, q and k as the scores see
            them (after QK-norm and the RoPE rotation).
        mask: the mask applied besides causality (bool, True = may attend, or an additive float bias),
            broadcastable to ``(b, H, n, S)``, or None; is_causal: whether the causal mask applied.
        scale: the multiplier of ``q k^T``; weights: ``(b, H, n, S)`` the weights applied to ``v``;
        head_outputs: ``(b, H, n, hd)`` ``weights @ v`` per head, before any output projection;
        softcap: ``cap`` of ``cap * tanh(scores / cap)`` on the scaled scores (Gemma 2), or None.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None
    is_causal: bool
    scale: float
    weights: Tensor
    head_outputs: Tensor
    softcap: float | None = None


def _record_attention(module: MultiHeadAttention, x: Tensor) -> AttentionRecord:
    """One :class:`~attnlab.MultiHeadAttention` call on ``x (b, n, d_in)``, read at its hook points."""
    got: dict[str, tuple[Tensor, HookPoint]] = {}
    keep = {
        step: lambda t, hook, step=step: got.__setitem__(step, (t, hook))
        for step in ("rot_q", "rot_k", "v", "pattern", "z")
    }
    with eval_mode(module), attention_hooks([module], keep):
        module(x)
    heads = {step: t.transpose(1, 2) for step, (t, _) in got.items() if step != "pattern"}  # (b, H or Hkv, ·, hd)
    call = got["pattern"][1].call
    mask = full_mask(call, x.shape[1], heads["rot_k"].shape[2], x.device)
    return AttentionRecord(
        heads["rot_q"], heads["rot_k"], heads["v"], mask, call.is_causal, call.scale, got["pattern"][0],
        heads["z"], call.softcap,
    )  # fmt: skip


def record_module(module: nn.Module | Callable, x: Tensor) -> AttentionRecord:
    """What one of the tutorials' attention modules computes on ``x (n, d_in)`` (or ``(b, n, d_in)``).

    ``module`` is a :class:`~attnlab.MultiHeadAttention` (read at its hook points), a
    :class:`~attnlab.CausalAttention`, :class:`~attnlab.SelfAttention_v2`,
    :class:`~attnlab.SelfAttention_v1`, :class:`~attnlab.MultiHeadAttentionWrapper`, or
    :func:`attnlab.functional.simple_self_attention` (queries, keys and values are ``x`` itself,
    scale 1: the tutorials' first, parameter-free step). The weights come from each module's
    ``return_weights=True`` path; queries, keys and values from its own projections. Shapes of the
    record: batched, ``(b, H, n, ·)``; an unbatched ``x`` gets ``b = 1``.
    """
    check_float_tensor("x", x, 2)
    xb = x if x.dim() == 3 else x.unsqueeze(0)  # (b, n, d_in)
    with torch.no_grad():
        if module is simple_self_attention:
            out, w = simple_self_attention(xb, return_weights=True)  # (b, n, d), (b, n, n)
            h = xb.unsqueeze(1)  # (b, 1, n, d)
            return AttentionRecord(h, h, h, None, False, 1.0, w.unsqueeze(1), out.unsqueeze(1))
        if isinstance(module, MultiHeadAttention):
            return _record_attention(module, xb)
        if isinstance(module, MultiHeadAttentionWrapper):
            heads = [record_module(h, xb) for h in module.heads]
            cat = [torch.cat([getattr(r, name) for r in heads], dim=1) for name in ("q", "k", "v")]
            w = torch.cat([r.weights for r in heads], dim=1)
            ho = torch.cat([r.head_outputs for r in heads], dim=1)
            return AttentionRecord(*cat, None, True, heads[0].scale, w, ho)
        if isinstance(module, SelfAttention_v1):
            q, k, v = xb @ module.W_query, xb @ module.W_key, xb @ module.W_value
        elif isinstance(module, (SelfAttention_v2, CausalAttention)):
            q, k, v = module.W_query(xb), module.W_key(xb), module.W_value(xb)
        else:
            raise TypeError(
                "module must be one of the tutorials' attention modules (MultiHeadAttention, "
                "MultiHeadAttentionWrapper, CausalAttention, SelfAttention_v2, SelfAttention_v1) or "
                f"simple_self_attention, got {type(module).__name__}"
            )
        with eval_mode(module):
            out, w = module(xb, return_weights=True)  # (b, n, d_out), (b, n, n)
        causal = isinstance(module, CausalAttention)
        scale = 1.0 / k.shape[-1] ** 0.5
        one = lambda t: t.unsqueeze(1)  # (b, n, e) -> (b, 1, n, e): one head
        return AttentionRecord(one(q), one(k), one(v), None, causal, scale, one(w), one(out))
