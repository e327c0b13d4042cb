"""Causal tracing: activation patching, path patching and attribution patching.

Run the *corrupted* prompt with one activation taken from the *clean* run and measure what the
metric becomes (TransformerLens's ``patching`` module: raw metric values, not normalized). Sites::

    resid_pre, resid_mid, resid_post, attn_out, mlp_out   (L, T)     one position at a time
    head_out (hook_z, every position)                     (L, H)
    head_out_by_pos                                       (L, T, H)
    pattern, q                                            (L, H)     one head, every position
    k, v                                                  (L, Hkv)   one key/value head (GQA: fewer)
    pattern_by_pos, q_by_pos                              (L, T, H)  one head at one (query) position
    k_by_pos, v_by_pos                                    (L, T, Hkv)
    pattern_dest_src                                      (L, H, T, T)  one weight: head, query, key

Patching layer ``l`` leaves everything below it as in the corrupted run, so each patched run starts
from the corrupted residual at layer ``l`` (cached once), and all patched runs go through the model
as the rows of one batch that grows block by block: a row patched at layer ``l`` joins at block ``l``.
A metric that reads only the last position (``metric.last_only``, as :func:`logit_diff`
does) gets ``(R, 1, V)`` logits: the vocabulary matmul of the other positions is skipped.

A spliced SAE's point (:func:`attnlab.interpret.splice`) is a site too, by its full hook name: its
latents (``...hook_sae_acts_post``, ``...hook_sae_acts_pre``) are patched one latent at one position
(result ``(T, d_sae)``), its input, reconstruction, error and output one position at a time (``(T,)``).

A metric is a callable on logits ``(1, T, V)`` returning a scalar. It may also have ``rows(logits
(R, T, V)) -> (R,)``, one value per row (then it is called once per batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.checks import is_int, is_real
from attnlab.hardware import as_float64
from attnlab.interpret.hooks import HookPoint, act_name, attention_layers, eval_mode, hook_names, hooks, run_with_cache

__all__ = [
    "SITES",
    "LogitDiff",
    "activation_patching",
    "attribution_patching",
    "logit_diff",
    "normalized_logit_diff",
    "path_patching",
]

# site -> (hook step, what one patch covers): "pos" one position, "head" one head at every
# position, "pos_head" one head at one position, "dest_src" one head's weight of one query on one key.
SITES = {
    "resid_pre": ("resid_pre", "pos"),
    "resid_mid": ("resid_mid", "pos"),
    "resid_post": ("resid_post", "pos"),
    "attn_out": ("attn_out", "pos"),
    "mlp_out": ("mlp_out", "pos"),
    "head_out": ("z", "head"),
    "head_out_by_pos": ("z", "pos_head"),
    "pattern": ("pattern", "head"),
    "q": ("q", "head"),
    "k": ("k", "head"),
    "v": ("v", "head"),
    "pattern_by_pos": ("pattern", "pos_head"),  # one head's row of weights at one query position
    "q_by_pos": ("q", "pos_head"),
    "k_by_pos": ("k", "pos_head"),
    "v_by_pos": ("v", "pos_head"),
    "pattern_dest_src": ("pattern", "dest_src"),  # TransformerLens's ..._pattern_dest_src_pos, (L, H, T, S)
    "neuron": ("post", "neuron"),  # one MLP neuron (mlp.hook_post) at every position, (L, d_mlp)
    "neuron_by_pos": ("post", "pos_neuron"),  # one neuron at one position, (L, T, d_mlp)
}


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LogitDiff:
    """``logits[:, -1, a] - logits[:, -1, b]`` (averaged over the batch), optionally normalized:
    ``(value - corrupted) / (clean - corrupted)`` (0 = the corrupted run, 1 = the clean one)."""

    a: int
    b: int
    clean: float | None = None
    corrupted: float | None = None
    last_only = True  # reads only the last position: patching skips the vocabulary matmul elsewhere

    def rows(self, logits: Tensor) -> Tensor:
        """``(R,)``: the metric of each row of ``logits (R, T, V)``."""
        V = logits.shape[-1]
        if max(self.a, self.b) >= V:
            raise ValueError(
                f"logit_diff's tokens a={self.a}, b={self.b} must be ids in the model's vocabulary [0, {V})"
            )
        d = logits[:, -1, self.a] - logits[:, -1, self.b]  # (R,)
        if self.clean is None:
            return d
        return (d - self.corrupted) / (self.clean - self.corrupted)

    def __call__(self, logits: Tensor) -> Tensor:
        return self.rows(logits).mean()


def check_token(name: str, t: object, vocab: int | None) -> int:
    if isinstance(t, Tensor) and t.numel() == 1 and not t.is_floating_point():
        t = int(t)
    if not is_int(t) or t < 0 or (vocab is not None and t >= vocab):
        raise ValueError(f"{name} must be one token id in [0, {vocab or 'vocab_size'}), got {t!r}")
    return int(t)


def logit_diff(a: int, b: int) -> LogitDiff:
    """The logit of token ``a`` minus that of token ``b`` at the last position."""
    return LogitDiff(*_two_tokens(a, b))


def _two_tokens(a: object, b: object) -> tuple[int, int]:
    a, b = check_token("a", a, None), check_token("b", b, None)
    if a == b:
        raise ValueError(f"a and b must be two tokens, got {a} twice (its logit minus itself is always 0)")
    return a, b


def normalized_logit_diff(a: int, b: int, clean: float, corrupted: float) -> LogitDiff:
    """:func:`logit_diff` rescaled so that the corrupted run's value is 0 and the clean run's is 1."""
    for name, value in (("clean", clean), ("corrupted", corrupted)):
        if not is_real(value) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite logit difference, got {value!r}")
    clean, corrupted = float(clean), float(corrupted)
    if clean == corrupted:
        raise ValueError(f"clean and corrupted logit differences must differ to normalize, both are {clean}")
    return LogitDiff(*_two_tokens(a, b), clean, corrupted)


def _metric_rows(metric: Callable, logits: Tensor) -> Tensor:
    """``(R,)`` float64: ``metric`` on each row of ``logits (R, T', V)``."""
    rows = getattr(metric, "rows", None)
    if rows is not None:
        out = rows(logits)
        if not isinstance(out, Tensor) or out.shape != logits.shape[:1]:
            raise ValueError(f"metric.rows must return one value per row, shape ({logits.shape[0]},)")
        return as_float64(out.detach())
    return torch.stack([metric_scalar(metric(logits[i : i + 1])) for i in range(logits.shape[0])])


def metric_with_gradient(metric: Callable, logits: Tensor) -> Tensor:
    """``metric(logits)`` as a scalar tensor in the graph, or a ValueError: not one float, not finite,
    or not computed from the logits (attribution needs its gradient). Shared by patching and circuits."""
    value = metric(logits)
    number = float(metric_scalar(value))  # a clear ValueError for anything but one float
    if not math.isfinite(number):
        raise ValueError(f"metric must return a finite value, got {number} {on_logits(logits)}")
    if not isinstance(value, Tensor) or not value.requires_grad:
        raise ValueError("metric must return a tensor computed from the logits (attribution needs its gradient)")
    return value.reshape(())


def finite_metric(values: Tensor, logits: Tensor, where: str) -> Tensor:
    """``values``, a metric's, or a ValueError where one is not finite (a NaN would fill the result
    silently), saying ``where`` and whether the logits were. Shared by patching and circuits."""
    if not bool(torch.isfinite(values).all()):
        bad = values[~torch.isfinite(values)].flatten()[0].item()
        raise ValueError(f"metric must return a finite value, got {bad} {where} {on_logits(logits)}")
    return values


def on_logits(logits: Tensor) -> str:
    """Where a metric's value that is not finite came from: the logits, or the metric itself."""
    finite = bool(torch.isfinite(logits).all())
    return "(the logits are finite: the metric made it)" if finite else "(the model's logits are not finite)"


def metric_scalar(value: object) -> Tensor:
    """A metric's value as a float64 scalar tensor, detached (a float or a one-element float tensor);
    a ValueError naming what came for anything else. Shared by patching and circuits."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64)
    if not isinstance(value, Tensor) or value.numel() != 1 or not (value.is_floating_point() or value.is_complex()):
        got = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"metric must return a scalar (a float or a one-element float tensor), got {got}")
    return as_float64(value.detach().reshape(()))


# --------------------------------------------------------------------------------------------
# Inputs and the tail of the model
# --------------------------------------------------------------------------------------------
def _check_metric(metric: object, progress: object = None) -> None:
    if not callable(metric):
        raise TypeError(f"metric must be a function of the logits (e.g. logit_diff(a, b)), got {type(metric).__name__}")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress must be a function (done, total) or None, got {type(progress).__name__}")


def _check_pair(model: nn.Module, clean: object, corrupted: object) -> tuple[Tensor, Tensor]:
    out = []
    for name, idx in (("clean", clean), ("corrupted", corrupted)):
        if isinstance(idx, Tensor) and idx.dim() == 1:
            idx = idx.unsqueeze(0)
        if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.shape[0] != 1:
            got = f"shape {tuple(idx.shape)}" if isinstance(idx, Tensor) else type(idx).__name__
            raise ValueError(f"{name} must be the token ids of one prompt, (T,) or (1, T), got {got}")
        out.append(model.check_idx(idx) if hasattr(model, "check_idx") else idx)
    if out[0].shape != out[1].shape:
        raise ValueError(
            f"clean and corrupted must have the same number of tokens (patching pairs positions), "
            f"got {out[0].shape[1]} and {out[1].shape[1]}"
        )
    return out[0], out[1]


def _check_site(site: object) -> tuple[str, str]:
    if site not in SITES:
        raise ValueError(f"site must be one of {', '.join(SITES)}, got {site!r}")
    return SITES[site]


# The points of a spliced SAE whose patches are one latent at one position (the others: one position).
_LATENT_POINTS = (".hook_sae_acts_pre", ".hook_sae_acts_post")


def _spliced_site(model: nn.Module, site: object) -> tuple[str, int, str] | None:
    """A spliced SAE's hook point as a site: ``(name, the layer whose block computes it, kind)``,
    kind ``"pos_head"`` (one latent at one position) or ``"pos"``; None for the named sites."""
    if not isinstance(site, str) or site in SITES or ".hook_sae_" not in site:
        return None
    layer = HookPoint(site).layer()
    if site not in hook_names(model) or layer is None:
        raise ValueError(
            f"site {site!r} is not a point of an SAE spliced into this model in a block "
            "(splice(model, sae) first; see hook_names(model))"
        )
    return site, layer, "pos_head" if site.endswith(_LATENT_POINTS) else "pos"


def _check_tail(model: nn.Module, logits: Tensor, x: Tensor, last_only: bool) -> None:
    """The blocks, the final norm and the head run from the corrupted run's first residual ``x (1, T, d)``
    must reproduce its ``logits``: a model whose forward does more (a subclass, another family's switch
    the reruns do not know) would get wrong numbers. A ValueError: the model is what the caller chose
    (the command line reports it in one line)."""
    ropes = model.rope_angles(torch.arange(x.shape[1], device=x.device)[None], x.dtype)  # keyed by block.local_rope
    for block in model.trf_blocks:
        x = block(x, rope=ropes.get(block.local_rope))  # (1, T, d)
    mine = model.unembed(x[:, -1:] if last_only else x)  # (1, T or 1, V): the final norm, head and soft cap
    theirs = logits[:, -1:] if last_only else logits
    # (a wrong rerun is off by the logits' own size; bfloat16 rounds each step to 2^-8 of it)
    tol = max(1e-3, 2 * torch.finfo(logits.dtype).eps)
    if not torch.allclose(mine, theirs, rtol=tol, atol=tol * float(theirs.abs().max()) + 1e-5):
        raise ValueError(
            f"patching could not rerun this model ({type(model).__name__}) from a cached residual: its forward "
            "does more than its blocks, final norm and output head; this model is not supported by "
            "activation_patching"
        )


def _layout(
    model: nn.Module, step: str, kind: str, T: int, width: int | None = None
) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """The patch indices of one layer (in the order of its results, C order) and the shape of one
    layer's results; ``width``: a spliced SAE's latents, which take the heads' place. A pattern's weights
    above the diagonal are 0 in both runs (a key after its query): patching one changes nothing, so they
    are not indices (their results are the corrupted run's)."""
    att = attention_layers(model)[0]
    H = width or (att.num_kv_heads if step in ("k", "v") else att.num_heads)
    if kind == "pos":
        return [(p,) for p in range(T)], (T,)
    if kind in ("neuron", "pos_neuron"):
        H = model.config.hidden_dim  # (the neurons take the heads' place)
        kind = "head" if kind == "neuron" else "pos_head"
    if kind == "head":
        return [(h,) for h in range(H)], (H,)
    if kind == "dest_src":
        return [(h, p, s) for h in range(H) for p in range(T) for s in range(p + 1)], (H, T, T)
    return [(p, h) for p in range(T) for h in range(H)], (T, H)


def _patch_rows(act: Tensor, clean: Tensor, step: str, kind: str, index: Tensor) -> Tensor:
    """``act (N, ...)`` whose last ``R`` rows each take ``clean (1, ...)`` at their own ``index[r]``."""
    act = act.clone()
    rows = torch.arange(act.shape[0] - index.shape[0], act.shape[0], device=act.device)  # (R,)
    if kind == "pos":
        act[rows, index[:, 0]] = clean[0, index[:, 0]]  # (R, ...) at one position each
    elif kind == "head" and step == "pattern":
        act[rows, index[:, 0]] = clean[0, index[:, 0]]  # (R, T, S): one head's pattern
    elif kind in ("head", "neuron"):  # (R, T, hd) or a neuron's (R, T): every position
        act[rows, :, index[:, 0]] = clean[0][:, index[:, 0]].transpose(0, 1)
    elif kind == "dest_src":  # (head h, query p, key s): one weight
        h, p, s = index.unbind(1)
        act[rows, h, p, s] = clean[0, h, p, s]
    elif step == "pattern":  # (position p, head h): head h's weights of query p, (R, S)
        act[rows, index[:, 1], index[:, 0]] = clean[0, index[:, 1], index[:, 0]]
    else:
        act[rows, index[:, 0], index[:, 1]] = clean[0, index[:, 0], index[:, 1]]  # (R, hd)
    return act


def _staggered(
    model: nn.Module,
    starts: list[Tensor],
    names: list[str],
    sources: list[Tensor],
    step: str,
    kind: str,
    index: Tensor,
    last_only: bool,
    layers: list[int],
) -> Tensor:
    """The logits of ``len(layers) * R`` patched runs in one pass: the rows patched at layer ``l`` join
    the batch at block ``l`` (from the corrupted stream ``starts[l] (1, T, d)``), so every block runs
    once, on every row that has reached it. Row ``i * R + r`` is patched at layer ``layers[i]`` (in
    increasing order) at ``index[r]``; the blocks below ``layers[0]`` do not run."""
    R, T = index.shape[0], starts[0].shape[1]
    ropes = model.rope_angles(torch.arange(T, device=index.device)[None], starts[0].dtype)  # as GPT.decode_logits
    x = starts[0][:0].expand(0, T, -1)  # (0, T, d)
    for layer in range(layers[0], len(model.trf_blocks)):
        block = model.trf_blocks[layer]
        rope = ropes.get(block.local_rope)  # this layer's RoPE base (Gemma 3: window and global layers differ)
        if layer not in layers:  # no rows join here: nothing to patch
            x = block(x, rope=rope)
            continue
        x = torch.cat([x, starts[layer].expand(R, -1, -1)])  # (N + R, T, d): this layer's rows join

        def patch(act: Tensor, hook: HookPoint, source: Tensor = sources[layer]) -> Tensor:
            return _patch_rows(act, source, step, kind, index)

        with hooks(model, {names[layer]: patch}):
            x = block(x, rope=rope)  # (N + R, T, d)
    if last_only:
        x = x[:, -1:]  # (len(layers) * R, 1, d)
    return model.unembed(x)  # (len(layers) * R, T or 1, V): the final norm, the head and Gemma 2's soft cap


# --------------------------------------------------------------------------------------------
# Activation patching
# --------------------------------------------------------------------------------------------
def activation_patching(
    model: nn.Module,
    clean: Tensor,
    corrupted: Tensor,
    metric: Callable[[Tensor], Tensor],
    site: str = "resid_pre",
    *,
    max_tokens: int = 16384,
    layers: Sequence[int] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Tensor:
    """The metric of the corrupted run with one clean activation patched in, for every index of ``site``.

    Args:
        model: an attnlab GPT. clean, corrupted: ``(T,)`` or ``(1, T)`` token ids of equal length.
        metric: logits ``(1, T, V)`` -> scalar (see the module's notes for ``rows``/``last_only``).
        site: see :data:`SITES`; the result's shape is the site's (``(L, T)``, ``(L, H)``, ...). Or a
            spliced SAE's point by its full name: ``(T, d_sae)`` at its latents, else ``(T,)`` (``layers`` unused).
        max_tokens: at most this many tokens (rows x T) in one batched pass (memory).
        layers: patch these layers only (distinct, any order; default all): the result has one row
            per layer, in increasing order, equal to those rows of the whole result. A server runs
            a site in a few such calls, to take other requests in between.
        progress: called as ``progress(done, total)`` with the patched runs done so far and their total,
            before the first batched pass and after each (a pattern's single weights take minutes: a bar).
    Returns:
        float32 tensor of raw metric values (on the CPU).
    """
    clean, corrupted = _check_pair(model, clean, corrupted)
    _check_metric(metric, progress)
    if not is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int (tokens in one batched pass), got {max_tokens!r}")
    L, T = len(attention_layers(model)), clean.shape[1]
    spliced = _spliced_site(model, site)
    if spliced is None:
        step, kind = _check_site(site)
        chosen = _check_layers(layers, L)
        names = [act_name(step, i) for i in range(L)]
    else:  # every patched run starts from the corrupted stream entering the block that computes the point
        step, layer, kind = spliced
        chosen, names = [layer], [step] * L
    starts = [act_name("resid_pre", i) for i in range(L)]
    last_only = bool(getattr(metric, "last_only", False))
    with eval_mode(model), torch.no_grad():
        _, clean_cache = run_with_cache(model, clean, names)
        logits, corr_cache = run_with_cache(model, corrupted, sorted({*names, *starts}))
        # The corrupted run's metric: the value of an index not patched (and a metric that returns no
        # scalar fails here, before the long part).
        value = finite_metric(metric_scalar(metric(logits)), logits, "on the corrupted run")
        _check_tail(model, logits, corr_cache[starts[0]], last_only)
        sources = [clean_cache[n] for n in names]
        resid = [corr_cache[n] for n in starts]
        width = None if spliced is None else sources[0].shape[-1]  # an SAE's latents, in the heads' place
        indices, shape = _layout(model, step, kind, T, width)
        # (on the CPU by name: under torch.set_default_device these would follow it)
        places = torch.arange(math.prod(shape), device="cpu").reshape(shape)
        where = places[tuple(torch.tensor(indices, device="cpu").T)]  # (N,) their places
        out = torch.full((len(chosen), math.prod(shape)), float(value), dtype=torch.float64, device="cpu")
        per_pass = max(1, int(max_tokens) // (T * len(chosen)))  # patches of each layer per staggered pass
        if progress is not None:
            progress(0, len(chosen) * len(indices))
        for lo in range(0, len(indices), per_pass):
            index = torch.tensor(indices[lo : lo + per_pass], device=clean.device)  # (R, 1, 2 or 3)
            patched = _staggered(model, resid, names, sources, step, kind, index, last_only, chosen)
            # (to the CPU: indices write into a CPU tensor from the CPU only)
            values = finite_metric(_metric_rows(metric, patched), patched, "on a patched run").cpu()
            out[:, where[lo : lo + index.shape[0]]] = values.reshape(len(chosen), -1)
            if progress is not None:
                progress(len(chosen) * (lo + index.shape[0]), len(chosen) * len(indices))
    out = out.reshape(len(chosen), *shape).float()
    return out if spliced is None else out[0]


def _check_layers(layers: object, L: int) -> list[int]:
    if layers is None:
        return list(range(L))
    chosen = list(layers) if isinstance(layers, (list, tuple, range)) else None
    ok = chosen is not None and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < L for i in chosen)
    if not ok or not chosen or len(set(chosen)) != len(chosen):
        raise ValueError(f"layers must be distinct layer indices in [0, {L}), at least one, got {layers!r}")
    return sorted(chosen)


# --------------------------------------------------------------------------------------------
# Path patching
# --------------------------------------------------------------------------------------------
def path_patching(
    model: nn.Module,
    clean: Tensor,
    corrupted: Tensor,
    metric: Callable[[Tensor], Tensor],
    senders: Sequence[tuple[int, int]],
    receivers: Sequence[tuple[int, int, str]],
) -> float:
    """The metric when only the path *senders -> receivers' inputs* carries the clean run.

    1. Run the corrupted prompt with the senders' outputs (``hook_z``) from the clean run and every
       other head frozen at its corrupted output (MLPs recompute, as in Wang et al.'s IOI study);
       record the receivers' inputs (``hook_q``/``hook_k``/``hook_v`` of head ``h``; for ``k`` and
       ``v`` ``h`` is a key/value head).
    2. Run the corrupted prompt with only those receiver inputs replaced; return the metric.

    senders: ``(layer, head)`` pairs; receivers: ``(layer, head, "q" | "k" | "v")``, in later layers.
    """
    clean, corrupted = _check_pair(model, clean, corrupted)
    _check_metric(metric)
    layers = attention_layers(model)
    L, H = len(layers), layers[0].num_heads
    senders = [_head(f"senders[{i}]", s, L, H) for i, s in enumerate(senders)]
    if not senders:
        raise ValueError("senders must name at least one (layer, head)")
    checked = []
    for i, r in enumerate(receivers):
        if not (isinstance(r, (tuple, list)) and len(r) == 3 and r[2] in ("q", "k", "v")):
            raise ValueError(f"receivers[{i}] must be (layer, head, 'q' | 'k' | 'v'), got {r!r}")
        n = H if r[2] == "q" else layers[0].num_kv_heads
        layer, head = _head(f"receivers[{i}]", r[:2], L, n)
        if layer <= min(s[0] for s in senders):
            raise ValueError(
                f"receivers[{i}] is in layer {layer}, not after any sender (senders' first layer: "
                f"{min(s[0] for s in senders)})"
            )
        checked.append((layer, head, r[2]))
    if not checked:
        raise ValueError("receivers must name at least one (layer, head, 'q' | 'k' | 'v')")
    z_names = [act_name("z", i) for i in range(L)]
    with eval_mode(model), torch.no_grad():
        _, clean_cache = run_with_cache(model, clean, z_names)
        _, corr_cache = run_with_cache(model, corrupted, z_names)

        def freeze(layer: int) -> Callable:
            def fn(z: Tensor, hook: HookPoint) -> Tensor:
                z = corr_cache[z_names[layer]].clone()  # (1, T, H, hd): every head as corrupted...
                for sl, sh in senders:
                    if sl == layer:
                        z[:, :, sh] = clean_cache[z_names[layer]][:, :, sh]  # ...but the senders, clean
                return z

            return fn

        recorded: dict[str, Tensor] = {}

        def record(x: Tensor, hook: HookPoint) -> None:
            recorded[hook.name] = x

        wanted = {act_name(kind, layer) for layer, _, kind in checked}
        step1 = {**{z_names[i]: freeze(i) for i in range(L)}, **dict.fromkeys(wanted, record)}
        with hooks(model, step1):
            model(corrupted)

        def receive(x: Tensor, hook: HookPoint) -> Tensor:
            x = x.clone()
            for layer, head, kind in checked:
                if hook.name == act_name(kind, layer):
                    x[:, :, head] = recorded[hook.name][:, :, head]
            return x

        with hooks(model, dict.fromkeys(wanted, receive)):
            logits = model(corrupted)
            value = finite_metric(metric_scalar(metric(logits)), logits, "on the path-patched run")
    return float(value)


def _head(name: str, pair: object, L: int, H: int) -> tuple[int, int]:
    ok = (
        isinstance(pair, (tuple, list))
        and len(pair) == 2
        and all(isinstance(p, int) and not isinstance(p, bool) for p in pair)
    )
    if not ok or not (0 <= pair[0] < L and 0 <= pair[1] < H):
        raise ValueError(f"{name} must be a (layer, head) with layer in [0, {L}) and head in [0, {H}), got {pair!r}")
    return int(pair[0]), int(pair[1])


# --------------------------------------------------------------------------------------------
# Attribution patching
# --------------------------------------------------------------------------------------------
def attribution_patching(
    model: nn.Module, clean: Tensor, corrupted: Tensor, metric: Callable[[Tensor], Tensor], site: str = "resid_pre"
) -> Tensor:
    """The first-order estimate ``(a_clean - a_corrupted) . d metric / d a`` of each patch's effect.

    The same sites and shapes as :func:`activation_patching`, from one clean forward and one
    corrupted forward and backward. It estimates the *change* of the metric (activation patching's
    value minus the corrupted run's metric); exact where the metric is linear in the activation.
    """
    clean, corrupted = _check_pair(model, clean, corrupted)
    _check_metric(metric)
    spliced = _spliced_site(model, site)
    if spliced is None:
        step, kind = _check_site(site)
        L = len(attention_layers(model))
        names = [act_name(step, i) for i in range(L)]
    else:
        names, step, kind = [spliced[0]], spliced[0], spliced[2]
    acts: dict[str, Tensor] = {}

    def leaf(x: Tensor, hook: HookPoint) -> Tensor:
        return x.detach().requires_grad_(True)  # the graph starts here: no gradient for the weights

    def keep(x: Tensor, hook: HookPoint) -> None:
        acts[hook.name] = x

    with eval_mode(model):
        with torch.no_grad():
            _, clean_cache = run_with_cache(model, clean, names)
        with torch.enable_grad(), hooks(model, {"hook_embed": leaf, **dict.fromkeys(names, keep)}):
            value = metric_with_gradient(metric, model(corrupted))
            grads = torch.autograd.grad(value, [acts[n] for n in names], allow_unused=True)
    out = []
    for n, g in zip(names, grads, strict=True):
        a = acts[n].detach()
        g = torch.zeros_like(a) if g is None else g
        prod = as_float64(((clean_cache[n] - a) * g)[0])  # (T, d) | (T, H, hd) | (H, T, S) | (T, d_mlp)
        if kind == "dest_src":
            out.append(prod)  # (H, T, S): one weight each
        elif kind == "pos":
            out.append(prod.flatten(1).sum(1))  # (T,)
        elif kind == "head" and step == "pattern":
            out.append(prod.sum((1, 2)))  # (H,)
        elif kind == "head":
            out.append(prod.sum((0, 2)))  # (H,)
        elif kind == "neuron":
            out.append(prod.sum(0))  # (d_mlp,)
        elif kind == "pos_neuron":
            out.append(prod)  # (T, d_mlp)
        elif step == "pattern":
            out.append(prod.sum(2).T)  # (H, T, S) -> (T, H): one head's row at one query position
        else:
            out.append(prod if spliced is not None else prod.sum(2))  # (T, d_sae) at an SAE's latents, else (T, H)
    return (out[0] if spliced is not None else torch.stack(out)).float()
