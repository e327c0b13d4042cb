"""One forward pass, recorded: what every attention layer of a GPT computed.

:func:`trace` sets each layer's :attr:`~attnlab.attention.MultiHeadAttention.observer`: every
``attend()`` call reports an :class:`~attnlab.attention.AttentionRecord`, whose ``weights`` come
from the library's own ``return_weights`` path. Nothing here computes a softmax: the weights are the
ones the model applied to its values. The tutorials' intermediate steps (``q @ k.T``, scaled,
masked) are recomposed from the record's own fields (``q``, ``k``, ``mask``, ``is_causal``,
``scale``), so they describe exactly what was computed, whatever positions or biases produced them.

The residual stream comes from forward pre-hooks on the blocks and on the final norm.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.attention import (
    AttentionRecord,
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    wants_cache_copies,
    wants_last_query,
)
from attnlab.checks import check_bool, check_float_tensor
from attnlab.functional import attention_scores, simple_self_attention, softcap_score_mod

__all__ = [
    "STEP_NAMES",
    "Trace",
    "attention_layers",
    "observe_attention",
    "observe_attention_rows",
    "record_module",
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


STAGES = ("q", "k", "v", "head_outputs")  # the fields of a record trace(stages=True) keeps for every layer


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


@contextlib.contextmanager
def observe_attention(
    model: nn.Module,
    callback: Callable[[int, AttentionRecord], None],
    *,
    copy_cache: bool = True,
    last_query: bool = False,
) -> Iterator[list[MultiHeadAttention]]:
    """Call ``callback(layer, record)`` for every ``attend()`` of every layer inside the block.

    An observer already set on a layer is kept: it is called too, and restored on exit.

    A layer with a rolling KV cache (RoPE models decoding) writes each new key over an old slot, so its
    records hold copies of the cache's keys, values and key positions, safe to keep. ``copy_cache=False``
    is for a callback that reads those at once or not at all: the record then holds views of the cache,
    valid until the cache is written again (the next token's step). The copies grow with the context,
    and after a long prompt they are a noticeable part of each token's time (``attnlab serve``'s
    generation stream reads the weights at once and needs none). Where an observer set before asks
    for copies (any observer without ``copy_cache = False``), they are made.

    ``last_query=True``: the records' ``weights`` are those of each pass's last query only, ``(b, H, 1,
    S)``, for a callback that reads no other row: a prompt's pass then attends by the fused kernels and
    works that row out apart, instead of every layer's whole ``(n, S)`` matrix (much faster for a long
    prompt). Only where every observer of the layer asks for it."""
    copy_cache, last_query = check_bool("copy_cache", copy_cache), check_bool("last_query", last_query)
    layers = attention_layers(model)
    previous = [a.observer for a in layers]

    def make(i: int, before: Callable | None) -> Callable[[MultiHeadAttention, AttentionRecord], None]:
        def observe(module: MultiHeadAttention, record: AttentionRecord) -> None:
            callback(i, record)
            if before is not None:
                before(module, record)

        observe.copy_cache = copy_cache or (before is not None and wants_cache_copies(before))  # type: ignore[attr-defined]
        observe.last_query = last_query and (before is None or wants_last_query(before))  # type: ignore[attr-defined]
        return observe

    # (`observer` is a plain attribute, never a parameter, buffer or submodule: set past nn.Module's
    # __setattr__, whose checks would run for every layer twice a token in serve's stream)
    try:
        for i, (att, before) in enumerate(zip(layers, previous, strict=True)):
            object.__setattr__(att, "observer", make(i, before))
        yield layers
    finally:
        for att, before in zip(layers, previous, strict=True):
            object.__setattr__(att, "observer", before)


@contextlib.contextmanager
def observe_attention_rows(
    model: nn.Module, callback: Callable[[Tensor, Tensor | None, Tensor | None], None]
) -> Iterator[list[MultiHeadAttention]]:
    """Call ``callback(weights, q_positions, k_positions)`` once per pass of ``model`` inside the block,
    after its last layer: ``weights (L, b, H, S)`` the attention weights of the pass's last query in
    every layer (in the model's dtype), and the query's and keys' positions of layer 0's record (see
    :class:`~attnlab.attention.AttentionRecord`; None without). What a generation's stream shows of
    each token (``attnlab serve``), for less than :func:`observe_attention` with ``last_query=True``
    (one call a token, not one per layer). The positions may be views of a cache, valid until the next
    pass; ``weights`` is the callback's to keep.

    Layers that attend over different keys (a model with windows of several sizes, such as Gemma 3's,
    once the text is longer than a window) have their rows laid on the keys of the layer with the most,
    by position: a key that layer holds and another does not (outside its window) gets weight 0 there,
    and the positions handed are that layer's. Without positions that is a ``ValueError``.

    Observers already set are kept and called too (with records of every query, if they ask for them);
    then each layer builds its record and the rows are stacked from them."""
    layers = attention_layers(model)
    L = len(layers)
    rows: list[Tensor] = []
    records: list[AttentionRecord] = []
    # Layers of several windows or sinks may hold their keys in other slots even where they hold as many
    # (a prompt's pass with sinks: the global layer's slots start with them): their positions decide.
    several = len({(att.window, att.sinks) for att in layers}) > 1

    def keep(layer: int, record: AttentionRecord) -> None:
        if layer == 0:  # a new pass
            rows.clear()
            records.clear()
        rows.append(record.weights[:, :, -1])  # (b, H, S): the pass's last query
        records.append(record)
        if layer == L - 1:
            if len(rows) != L:
                raise ValueError(
                    f"observe_attention_rows needs every layer to attend once a pass, got {len(rows)} of {L}"
                )
            first = records[0].k_positions
            if len({r.shape[-1] for r in rows}) == 1 and (
                not several or first is None or all(torch.equal(r.k_positions, first) for r in records[1:])
            ):
                callback(torch.stack(rows), records[0].q_positions, first)  # (L, b, H, S)
                return
            # The layer that holds the most keys (a global one: every other layer's are among them)
            wide = max(records, key=lambda r: (r.weights.shape[-1], _held(r.k_positions)))
            callback(_rows_on_keys(rows, records, wide.k_positions), wide.q_positions, wide.k_positions)

    if any(att.observer is not None for att in layers):  # they get their records: the rows from those
        with observe_attention(model, keep, copy_cache=False, last_query=True) as observed:
            yield observed
        return
    # One small object a layer, set past nn.Module's __setattr__: serve's stream sets and removes one
    # per layer at every token.
    try:
        for i, att in enumerate(layers):
            object.__setattr__(att, "observer", _RowsObserver(i, keep))
        yield layers
    finally:
        for att in layers:
            object.__setattr__(att, "observer", None)


def _held(positions: Tensor | None) -> int:
    """How many keys a record's positions ``(1 or b, S)`` name (-1: an empty slot or padding)."""
    return 0 if positions is None else int((positions >= 0).sum())


def _rows_on_keys(rows: list[Tensor], records: list[AttentionRecord], keys: Tensor | None) -> Tensor:
    """Each layer's row ``(b, H, S_i)`` laid on the keys at positions ``keys (1 or b, S)`` (-1: none), by its
    record's key positions: ``(L, b, H, S)``, 0 where a layer holds no such key."""
    if keys is None or any(r.k_positions is None for r in records):
        sizes = [row.shape[-1] for row in rows]
        raise ValueError(
            f"observe_attention_rows: this pass's layers attended over {sizes} keys (windows of several "
            "sizes) and record no key positions to lay them on one another: use observe_attention"
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
    for i, (row, record) in enumerate(zip(rows, records, strict=True)):
        pos = record.k_positions.expand(b, row.shape[-1])  # (b, S_i)
        cols = column_of.gather(1, torch.where((pos >= 0) & (pos < top), pos, top))  # (b, S_i)
        out[i].scatter_(-1, cols[:, None].expand(b, H, -1), row)
    return out[..., :S]


class _RowsObserver:
    """Layer ``layer``'s attention observer under :func:`observe_attention_rows`: its records go to
    ``keep(layer, record)``."""

    __slots__ = ("keep", "layer")
    copy_cache = False  # (read at once: views of a rolling cache will do)
    last_query = True

    def __init__(self, layer: int, keep: Callable[[int, AttentionRecord], None]) -> None:
        self.layer, self.keep = layer, keep

    def __call__(self, module: MultiHeadAttention, record: AttentionRecord) -> None:
        self.keep(self.layer, record)


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
        attn_output: ``(L, B, T, d)`` the output projection of the concatenated heads;
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
        layer = _index("layer", layer, self.n_layers)
        q, k = self.q[layer], self.k[layer]  # (B, H, T, hd), (B, Hkv, S, hd)
        gqa = k.shape[1] != q.shape[1]
        scores = attention_scores(q, k, scale=1.0, enable_gqa=gqa)  # (B, H, T, S): q @ k^T
        scaled = scores * self.scale[layer]
        cap = None if self.softcaps is None else self.softcaps[layer]
        mod = None if cap is None else softcap_score_mod(cap)
        masked = attention_scores(
            q,
            k,
            self.masks[layer],
            is_causal=self.is_causal[layer],
            scale=self.scale[layer],
            enable_gqa=gqa,
            score_mod=mod,
        )
        steps = {"scores": scores, "scaled": scaled}
        if cap is not None:
            steps["capped"] = cap * torch.tanh(scaled / cap)
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


def _index(name: str, i: object, n: int) -> int:
    if not isinstance(i, int) or isinstance(i, bool) or not -n <= i < n:
        raise ValueError(f"{name} must be an int in [-{n}, {n}), got {i!r}")
    return i % n


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
        A :class:`Trace`. The pass runs in eval mode without gradients; the model's training mode,
        observers and hooks are as they were afterwards, even after an error.
    """
    layers = attention_layers(model)
    if isinstance(idx, Tensor) and idx.dim() == 1:
        idx = idx.unsqueeze(0)  # (1, T)
    if hasattr(model, "check_idx"):
        idx = model.check_idx(idx)
    if attention_mask is not None and hasattr(model, "check_attention_mask"):
        attention_mask = model.check_attention_mask(attention_mask, *idx.shape)
    if not isinstance(stages, bool):
        raise TypeError(f"stages must be a bool, got {stages!r}")
    rec = _TraceRecorder(len(layers), stages)
    out_logits = _traced_forward(model, layers, idx, attention_mask, rec, logits)
    missing = [i for i, r in enumerate(rec.records) if r is None]
    if missing:
        raise RuntimeError(f"layers {missing} reported no attention during the forward pass")

    records = rec.records
    out = Trace(
        idx=idx,
        weights=rec.weights,  # (L, B, H, T, S) float32
        logits=None if out_logits is None else out_logits.detach(),
        scale=[float(r.scale) for r in records],
        is_causal=[bool(r.is_causal) for r in records],
        masks=[None if r.mask is None else r.mask.detach() for r in records],
        attention_mask=attention_mask,
        softcaps=[r.softcap for r in records],
        model=model,
        tokenizer=tokenizer,
    )
    if stages:
        out.q, out.k, out.v, out.head_outputs = (rec.buffers[name] for name in STAGES)
        out.attn_output = torch.stack(rec.attn_out)  # (L, B, T, d)
        out.residual = torch.stack(rec.residual)  # (L + 1, B, T, d)
    return out


class _TraceRecorder:
    """What :func:`trace` keeps of one pass, layer by layer: each layer's record (its big tensors
    dropped), the weights, and with ``stages`` the stages, the attention outputs and the residual stream.

    The weights go straight into one ``(L, B, H, T, S)`` float32 tensor as each layer reports them:
    stacking them at the end would hold every layer's weights twice (the trace's largest tensor).
    """

    def __init__(self, n_layers: int, stages: bool):
        self.n_layers, self.stages = n_layers, stages
        self.records: list[AttentionRecord | None] = [None] * n_layers
        self.weights: Tensor | None = None
        self.buffers: dict[str, Tensor] = {}
        self.residual: list[Tensor | None] = [None] * (n_layers + 1)
        self.attn_out: list[Tensor | None] = [None] * n_layers

    def on_record(self, i: int, record: AttentionRecord) -> None:
        if self.records[i] is not None:
            raise RuntimeError(f"layer {i} attended twice in one forward pass; trace expects one call per layer")
        w = record.weights.detach()
        if self.weights is None:
            self.weights = torch.empty((self.n_layers, *w.shape), dtype=torch.float32, device=w.device)
        self.weights[i].copy_(w)
        kept = {"weights": None}  # the other observers keep theirs
        if self.stages:  # likewise the stages: one (L, ...) tensor each, filled layer by layer
            for name in STAGES:
                t = getattr(record, name).detach()
                if name not in self.buffers:
                    self.buffers[name] = torch.empty((self.n_layers, *t.shape), dtype=t.dtype, device=t.device)
                self.buffers[name][i].copy_(t)
                kept[name] = None
        self.records[i] = dataclasses.replace(record, **kept)

    def block_input(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            self.residual[i] = args[0].detach()

        return hook

    def out_proj_output(self, i: int) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Tensor) -> None:
            self.attn_out[i] = output.detach()

        return hook


def _traced_forward(
    model: nn.Module,
    layers: list[MultiHeadAttention],
    idx: Tensor,
    attention_mask: Tensor | None,
    rec: _TraceRecorder,
    logits: bool,
) -> Tensor | None:
    """``model``'s forward in eval mode without gradients, ``rec`` observing it; the model's logits
    (None with ``logits=False``). Training mode and hooks are restored afterwards, even after an error."""
    handles = []
    was_training = model.training
    try:
        if rec.stages:
            for i, block in enumerate(model.trf_blocks):
                handles.append(block.register_forward_pre_hook(rec.block_input(i)))
                handles.append(layers[i].out_proj.register_forward_hook(rec.out_proj_output(i)))
            handles.append(model.final_norm.register_forward_pre_hook(rec.block_input(rec.n_layers)))
        model.eval()
        stop = contextlib.nullcontext() if logits else stop_before_head(model)
        with torch.no_grad(), observe_attention(model, rec.on_record), stop:
            return model(idx, attention_mask=attention_mask) if attention_mask is not None else model(idx)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()


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
def record_module(module: nn.Module | Callable, x: Tensor) -> AttentionRecord:
    """What one of the tutorials' attention modules computes on ``x (n, d_in)`` (or ``(b, n, d_in)``).

    ``module`` is a :class:`~attnlab.MultiHeadAttention` (its observer reports the record), a
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
            got: list[AttentionRecord] = []
            previous = module.observer
            module.observer = lambda m, r: got.append(r)
            try:
                module(xb)
            finally:
                module.observer = previous
            return got[0]
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
        training = module.training
        module.eval()
        try:
            out, w = module(xb, return_weights=True)  # (b, n, d_out), (b, n, n)
        finally:
            module.train(training)
        causal = isinstance(module, CausalAttention)
        scale = 1.0 / k.shape[-1] ** 0.5
        one = lambda t: t.unsqueeze(1)  # (b, n, e) -> (b, 1, n, e): one head
        return AttentionRecord(one(q), one(k), one(v), None, causal, scale, one(w), one(out))
