"""The inspector's data: one JSON-ready dict per page, computed by :mod:`attnlab.interpret`.

:func:`inspector_data` turns a :class:`~attnlab.interpret.Trace` (and optionally a
:class:`~attnlab.interpret.GenerationTrace`) into what the page draws; :func:`records_data` does
the same for the tutorials' modules (the six-word example), :func:`maps_data` for bare weights. The
arrays inside are :class:`~attnlab.interpret.codec.Packed`: :func:`attnlab.interpret.codec.to_json`
makes them JSON (inline base64 for an API answer, one compressed blob for an offline page).

Sections (each None when it does not apply): ``layers`` (attention per row and head), ``steps``
(the tutorials' steps for some heads), ``next`` (next-token probabilities per position),
``rollout``, ``lens``, ``roles``, ``generation``, ``features`` (SAE latents, filled by
:func:`attnlab.interpret.sae_view.features_sections`); ``vocab`` labels every token id they mention.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor

from attnlab.checks import position_window
from attnlab.functional import attention_scores, softcap_score_mod
from attnlab.interpret.ablation import parse_heads
from attnlab.interpret.analysis import FUSIONS, HEAD_KINDS, all_head_scores, logit_lens, logsumexp_at
from attnlab.interpret.analysis import rollout as attention_rollout
from attnlab.interpret.codec import pack
from attnlab.interpret.playback import GenerationStep, GenerationTrace
from attnlab.interpret.tracing import STEP_NAMES, AttentionRecord, Trace

__all__ = [
    "SECTIONS",
    "TEMPERATURES",
    "generation_step_data",
    "inspector_data",
    "maps_data",
    "records_data",
    "token_label",
    "token_strings",
]

VERSION = 2
# The sections inspector_data can compute; a live server asks for the ones its page shows.
SECTIONS = ("layers", "steps", "next", "rollout", "lens", "roles")
# The temperatures the offline page's slider offers besides 0 (greedy); a live server takes any. The
# page holds the probabilities of each position's top candidates at each of them, computed by the
# library: one softmax over the whole vocabulary per temperature and position, so they are few.
TEMPERATURES = [0.1, 0.2, 0.3, 0.5, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5, 2.0]
WEIGHTS_BUDGET = 16 << 20  # raw bytes of attention weights before dropping to a coarser dtype
NEXT_CHUNK = 32  # positions per step of the next-token section: its (32, V) temporaries stay in cache
STEPS_BUDGET = 12 << 20  # raw bytes of the tutorials' steps kept for chosen heads
# The tutorials' names for queries, keys and values (the steps after them: tracing.STEP_NAMES), and
# for the parameter-free first step of "A simple self-attention mechanism", where all three are x.
QKV_NAMES = {"q": "queries = self.W_query(x)", "k": "keys = self.W_key(x)", "v": "values = self.W_value(x)"}
PARAMETER_FREE_NAMES = {
    "q": "queries = inputs",
    "k": "keys = inputs",
    "v": "values = inputs",
    "scores": "attn_scores = inputs @ inputs.T",
    "scaled": "attn_scores (this first step does not scale)",
    "masked": "attn_scores (nothing masked)",
    "weights": "attn_weights = torch.softmax(attn_scores, dim=-1)",
    "head_outputs": "context_vec = attn_weights @ inputs",
}


# --------------------------------------------------------------------------------------------
# Token text
# --------------------------------------------------------------------------------------------
# Spaces, newlines and tabs as symbols, the other control characters as \xNN escapes.
_LABELS = {c: f"\\x{c:02x}" for c in [*range(32), 127]} | {ord(" "): "␣", ord("\n"): "↵", ord("\t"): "⇥"}
_LABELS[0xA0] = "⍽"  # a no-break space (SmolLM2 has it as a token of its own), as word processors show it


def token_label(token: str) -> str:
    """A printable label for one token: spaces as ``␣``, newlines as ``↵``, tabs as ``⇥``, no-break spaces as ``⍽``.

    Byte-level tokens are often pure whitespace; without this they would be invisible.
    """
    return token.translate(_LABELS) or "∅"


def token_strings(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each id decoded on its own; a byte that is only part of a UTF-8 character shows as ``\\xNN``.
    Without a tokenizer, or past its vocabulary, ``#id``. A token is decoded after a plain one and that
    one's text cut off: a SentencePiece decoder drops the word boundary (``▁``) of the text's first
    token, which a label must show (``" cat"``, not ``"cat"``)."""
    if tokenizer is None:
        return [f"#{int(i)}" for i in ids]
    anchor, size = _anchor(tokenizer), getattr(tokenizer, "vocab_size", None)
    out = []
    for i in map(int, ids):
        if size is not None and not 0 <= i < size:  # (a model's vocabulary padded past its tokenizer's)
            out.append(f"#{i}")
            continue
        s = tokenizer.decode([i])
        if anchor is not None and not s.startswith(" "):
            joined = tokenizer.decode([anchor[0], i])
            if joined.startswith(anchor[1]) and joined[len(anchor[1]) :] not in ("", "\ufffd"):
                s = joined[len(anchor[1]) :]
        if "\ufffd" in s and hasattr(tokenizer, "decode_bytes"):  # part of a character: show its bytes
            raw = tokenizer.decode_bytes([i])
            if "\ufffd".encode() not in raw:
                s = (" " if s.startswith(" ") and not raw.startswith(b" ") else "") + raw.decode(
                    "utf-8", "backslashreplace"
                )
        out.append(s)
    return out


def _anchor(tokenizer: Any) -> tuple[int, str] | None:
    """``(id, text)`` of a token that decodes to a plain letter alone, to decode others after, or None."""
    if not callable(getattr(tokenizer, "encode", None)):
        return None
    try:
        ids = tokenizer.encode("a")
        text = tokenizer.decode(ids[-1:])
    except (ValueError, KeyError, TypeError):  # (a tokenizer without the letter: labels as decoded alone)
        return None
    return (int(ids[-1]), text) if text == "a" else None


# --------------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------------
def weights_dtype(n: int, precision: str) -> str:
    """The most precise dtype whose ``n`` numbers fit the budget (``precision="auto"``)."""
    if precision != "auto":
        if precision not in ("f32", "u16", "u8"):
            raise ValueError(f"precision must be 'auto', 'f32', 'u16' or 'u8', got {precision!r}")
        return precision
    for dtype, size in (("f32", 4), ("u16", 2)):
        if n * size <= WEIGHTS_BUDGET:
            return dtype
    return "u8"


def _bool_mask(mask: Tensor | None) -> bool:
    return mask is None or mask.dtype == torch.bool


def _is_causal(w: Tensor) -> bool:
    """Square matrices with nothing above the diagonal: stored as lower triangles."""
    return w.shape[-1] == w.shape[-2] and not bool(torch.triu(w, diagonal=1).any())


def _layers(
    rows: Sequence[tuple[str, Sequence[int], Tensor]], dtype: str, causal: Sequence[bool] | None = None
) -> list[dict[str, Any]]:
    """The heads view's rows; ``causal`` (per row) when known, else read from the weights."""
    out = []
    for r, (name, heads, w) in enumerate(rows):  # w: (H, T, S)
        causal_row = _is_causal(w) if causal is None else causal[r]
        out.append(
            {
                "name": name,
                "heads": [int(h) for h in heads],
                "causal": causal_row,
                "weights": pack(w.float(), dtype, tri=causal_row),
            }
        )
    return out


def _base(title: str, text: str, note: str, tokens: Sequence[str]) -> dict[str, Any]:
    return {
        "version": VERSION,
        "title": title,
        "text": text,
        "note": note,
        "tokens": list(tokens),
        "labels": [token_label(t) for t in tokens],
        "model": None,
        "layers": [],
        "steps": None,
        "next": None,
        "rollout": None,
        "lens": None,
        "roles": None,
        "generation": None,
        "features": None,
        "vocab": {},
    }


# --------------------------------------------------------------------------------------------
# The tutorials' steps of one head
# --------------------------------------------------------------------------------------------
def _head_steps(
    row: int,
    head: int,
    name: str,
    st: dict[str, Tensor],
    scale: float,
    float_mask: bool,
    names: dict | None = None,
    softcap: float | None = None,
) -> dict:
    """One head's steps for the page, from ``st``: ``q (T, hd)``, ``k, v (S, hd)``, ``scores``,
    ``masked``, ``weights (T, S)`` and ``head_outputs (T, hd)``, as the library computed them.

    The page stores ``scores`` and which keys each query may attend, and derives ``scaled = scores *
    scale`` (in float32, as torch), for a soft-capped head ``capped = softcap * tanh(scaled / softcap)``,
    and ``masked = allowed ? scaled or capped (+ bias) : -inf``; a layer with an additive float mask
    (a position bias) also stores that bias."""
    scores, masked = st["scores"].float(), st["masked"].float()
    allowed = masked != float("-inf")
    bias = None
    if float_mask:
        before = scores * scale if softcap is None else softcap * torch.tanh(scores * scale / softcap)
        bias = torch.where(allowed, masked - before, torch.zeros_like(masked))
    return {
        "row": row,
        "head": head,
        "name": name,
        "scale": float(scale),
        "softcap": softcap,
        "q": pack(st["q"].float()),
        "k": pack(st["k"].float()),
        "v": pack(st["v"].float()),
        "scores": pack(scores),
        "allowed": pack(allowed.float(), "u8"),  # 1 = may attend
        "bias": None if bias is None else pack(bias),
        "weights": pack(st["weights"].float(), tri=_is_causal(st["weights"])),
        "head_outputs": pack(st["head_outputs"].float()),
        "names": names,
    }


def steps_cost(T: int, S: int, hd: int) -> int:
    """The bytes of one head's tutorial steps on ``T`` queries and ``S`` keys of width ``hd``."""
    return 4 * T * S + T * S + 4 * T * S // 2 + 4 * (2 * T + 2 * S) * hd


def _steps_section(heads: list[dict[str, Any]], omitted: int) -> dict[str, Any]:
    return {
        "names": {**QKV_NAMES, **STEP_NAMES},
        "heads": heads,
        "omitted": omitted,
        "hint": "attnlab viz --steps L.H[,L.H...] stores the steps of other heads" if omitted else "",
    }


# --------------------------------------------------------------------------------------------
# The data of a page
# --------------------------------------------------------------------------------------------
def maps_data(
    rows: Sequence[tuple[str, Sequence[int], Tensor]],
    tokens: Sequence[str],
    *,
    title: str = "",
    text: str = "",
    note: str = "",
    precision: str = "auto",
) -> dict[str, Any]:
    """A page of attention weights only: ``rows`` of ``(name, head numbers, weights (H, T, T))``."""
    data = _base(title, text, note, tokens)
    n = sum(w.numel() for _, _, w in rows)
    data["layers"] = _layers(rows, weights_dtype(n, precision))
    return data


def records_data(
    rows: Sequence[tuple[str, AttentionRecord] | tuple[str, AttentionRecord, Sequence[int]]],
    tokens: Sequence[str],
    *,
    title: str = "",
    text: str = "",
    note: str = "",
) -> dict[str, Any]:
    """A page of attention modules that are not a language model (the tutorials' six-word example):
    each row's weights and the tutorials' steps of its heads, from batch row 0 of each
    :class:`~attnlab.interpret.AttentionRecord` (see :func:`attnlab.interpret.record_module`).
    A row may name the heads to show as a third element (default: all)."""
    data = _base(title, text, note, tokens)
    maps, steps = [], []
    for r, (name, rec, *chosen) in enumerate(rows):
        H, Hkv = rec.q.shape[1], rec.k.shape[1]
        heads = [int(h) for h in chosen[0]] if chosen else list(range(H))
        maps.append((name, heads, rec.weights[0, heads]))
        scores = attention_scores(rec.q, rec.k, scale=1.0, enable_gqa=Hkv != H)  # (b, H, T, S)
        mod = None if rec.softcap is None else softcap_score_mod(rec.softcap)
        masked = attention_scores(rec.q, rec.k, rec.mask, rec.is_causal, rec.scale, enable_gqa=Hkv != H, score_mod=mod)
        float_mask = rec.mask is not None and rec.mask.is_floating_point()
        names = PARAMETER_FREE_NAMES if rec.q is rec.k and rec.k is rec.v else None
        for h in heads:
            g = h // (H // Hkv)  # the key/value head this query head reads
            st = {
                "q": rec.q[0, h],
                "k": rec.k[0, g],
                "v": rec.v[0, g],
                "scores": scores[0, h],
                "masked": masked[0, h],
                "weights": rec.weights[0, h],
                "head_outputs": rec.head_outputs[0, h],
            }
            steps.append(_head_steps(r, h, name, st, rec.scale, float_mask, names, rec.softcap))
    n = sum(w.numel() for _, _, w in maps)
    data["layers"] = _layers(maps, weights_dtype(n, "auto"))
    data["steps"] = _steps_section(steps, 0)
    return data


def resolve_index(arg: str, i: object, n: int) -> int:
    """Index ``i`` of ``n`` (negative: from the end), or a ValueError naming the flag ``arg``."""
    if not isinstance(i, int) or isinstance(i, bool) or not -n <= i < n:
        raise ValueError(f"{arg} {i} is out of range: there are {n} (valid: 0..{n - 1}, or -1 for the last)")
    return i % n


def _pick_step_heads(
    steps: object,
    n_layers: int,
    n_heads: int,
    cost: int,
    roles: dict[str, Tensor] | None,
    shown_layers: list[int],
    shown_heads: list[int],
) -> list[tuple[int, int]]:
    """The heads whose steps the page stores: those named, or (``"auto"``) all shown heads when they
    fit the budget, else the first shown head and the strongest shown head of each role."""
    if steps is None:
        return []
    shown = [(layer, h) for layer in shown_layers for h in shown_heads]
    if steps != "auto":
        named = parse_heads(steps, n_layers, n_heads)
        hidden = [f"{layer}.{h}" for layer, h in named if (layer, h) not in shown]
        if hidden:
            raise ValueError(f"--steps {','.join(hidden)}: not among the heads shown (--layer/--head)")
        return named
    if cost * len(shown) <= STEPS_BUDGET:
        return shown
    wanted = [shown[0]]
    for kind in HEAD_KINDS:
        if roles is not None:
            masked = torch.full_like(roles[kind], -1.0)
            for layer, h in shown:
                masked[layer, h] = roles[kind][layer, h]
            best = int(masked.argmax())
            wanted.append((best // n_heads, best % n_heads))
    picked: list[tuple[int, int]] = []
    for pair in wanted:
        if pair not in picked and (len(picked) + 1) * cost <= STEPS_BUDGET:
            picked.append(pair)
    return picked or shown[:1]


def inspector_data(
    trace: Trace,
    *,
    tokenizer: Any = None,
    title: str | None = None,
    text: str | None = None,
    note: str | None = None,
    steps: object = "auto",
    generation: GenerationTrace | None = None,
    roles: bool = True,
    role_seed: int = 0,
    lens_k: int = 5,
    lens_window: tuple[int, int] | None = None,
    next_k: int = 32,
    precision: str = "auto",
    row: int = 0,
    model_name: str = "",
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    sections: Collection[str] | None = None,
) -> dict[str, Any]:
    """Everything the inspector page shows about one sequence (batch row ``row``) of ``trace``.

    Args:
        trace: from :func:`attnlab.interpret.trace`; with ``stages=True`` the page also has the
            tutorials' steps and the logit lens. Its model (``trace.model``) gives the lens and roles.
        tokenizer: labels tokens (default ``trace.tokenizer``; without one, ids are shown as ``#id``).
        title, text, note: shown at the top (default: the decoded text).
        steps: heads whose tutorials' steps the page stores: ``"auto"`` (all when they fit
            :data:`STEPS_BUDGET`, else (0, 0) and the strongest head of each role), a list of
            ``(layer, head)`` / ``"L.H"``, or None.
        generation: a :class:`~attnlab.interpret.GenerationTrace` of the same model to play back.
        roles: compute the head-role scores (on a repeated random sequence, ``role_seed``).
        lens_k, next_k: candidates kept per position for the logit lens and the next-token view.
        lens_window: the page's positions ``(start, stop)`` of the logit lens (default: all); the
            section's ``start`` says where its arrays begin. The lens costs a whole-vocabulary product
            per layer and position: the live page asks for the positions its view shows.
        precision: attention weights as ``"f32"``, ``"u16"`` or ``"u8"``; ``"auto"``: the most
            precise within :data:`WEIGHTS_BUDGET`.
        model_name: shown in the note.
        layers, heads: show only these layers and heads in the heads view (negative: from the end);
            the other views still cover the whole model.
        sections: compute only these of :data:`SECTIONS` (default: all); the others stay empty
            (``layers`` ``[]``, the rest None), exactly as if they did not apply.
    Padding is dropped: the page shows the row's real tokens only.
    """
    wanted = _check_inspector_args(trace, row, steps, sections)
    model, tokenizer = trace.model, tokenizer if tokenizer is not None else trace.tokenizer
    keep = torch.nonzero(trace.real_tokens()[row]).flatten()  # (T,) the real positions
    ids = trace.idx[row, keep].tolist()
    T, L, H = len(ids), trace.n_layers, trace.n_heads
    data = _page_top(trace, ids, tokenizer, model_name, title, text, note)
    vocab: set[int] = set(ids)

    # each layer and head once, in the order asked (a repeated one would only copy its maps)
    shown_layers = (
        list(range(L)) if layers is None else list(dict.fromkeys(resolve_index("--layer", i, L) for i in layers))
    )
    shown_heads = list(range(H)) if heads is None else list(dict.fromkeys(resolve_index("--head", h, H) for h in heads))
    dtype = None
    if "layers" in wanted:
        data["layers"], dtype = _heads_section(trace, row, keep, shown_layers, shown_heads, precision)
        data["precision"] = dtype
    role_scores = None
    if roles and model is not None and "roles" in wanted:
        role_scores = all_head_scores(model, seed=role_seed)
        data["roles"] = _roles_section(role_scores, role_seed)
    if trace.has_stages and "steps" in wanted:
        cost = steps_cost(T, T, trace.q.shape[-1])
        chosen = _pick_step_heads(steps, L, H, cost, role_scores, shown_layers, shown_heads)
        data["steps"] = _steps_of_trace(trace, row, keep, chosen, shown_layers, len(shown_heads))
    if "next" in wanted:
        data["next"] = _next_section(trace.logits[row, keep], next_k)
        vocab.update(data["next"].pop("top_ids"))
    if "rollout" in wanted:
        data["rollout"] = _rollout_section(trace, row, keep)
    if trace.has_stages and model is not None and "lens" in wanted:
        data["lens"], top = _lens_section(model, trace, row, keep, lens_k, lens_window)
        vocab.update(top.flatten().tolist())
    if generation is not None:
        data["generation"] = _generation_section(generation, row, dtype or weights_dtype(0, precision))
        vocab.update(generation.tokens[row].tolist())
        for s in generation.steps:
            vocab.update(s.candidates[row].tolist())
    ordered = sorted(vocab)
    data["vocab"] = {str(i): token_label(t) for i, t in zip(ordered, token_strings(tokenizer, ordered), strict=True)}
    return data


def _page_top(
    trace: Trace, ids: list[int], tokenizer: Any, model_name: str, title: str | None, text: str | None, note: str | None
) -> dict[str, Any]:
    """The page's title, text, note, tokens and model section, before the sections of the views."""
    model, T, L, H = trace.model, len(ids), trace.n_layers, trace.n_heads
    tokens = token_strings(tokenizer, ids)
    decoded = tokenizer.decode(ids) if tokenizer is not None else " ".join(tokens)
    name = model_name or type(model).__name__
    if note is None:
        note = f"{name}: {L} layers x {H} heads, {T} tokens (row = query token, column = the token it attends to)."
    short = decoded if len(decoded) <= 120 else decoded[:119].rstrip() + "…"
    data = _base(short if title is None else title, decoded if text is None else text, note, tokens)
    data["model"] = _model_section(model, name, L, H)
    return data


def _check_inspector_args(trace: Trace, row: int, steps: object, sections: Collection[str] | None) -> set[str]:
    """The sections :func:`inspector_data` computes, once its arguments are checked against ``trace``."""
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be an attnlab.interpret Trace, got {type(trace).__name__}")
    if not 0 <= row < trace.idx.shape[0]:
        raise ValueError(f"row must be in [0, {trace.idx.shape[0]}), got {row!r}")
    if not trace.has_stages and steps not in (None, "auto"):
        raise ValueError("steps= needs a trace with the stages: trace(model, idx, stages=True)")
    wanted = set(SECTIONS if sections is None else sections)
    if not wanted <= set(SECTIONS):
        raise ValueError(f"sections must be among {', '.join(SECTIONS)}, got {sorted(wanted - set(SECTIONS))}")
    if trace.logits is None and wanted & {"next", "lens"}:
        raise ValueError("the next-token and logit-lens sections need a trace with logits: trace(..., logits=True)")
    return wanted


def _roles_section(role_scores: dict[str, Tensor], role_seed: int) -> dict[str, Any]:
    return {
        "kinds": list(HEAD_KINDS),
        "scores": {kind: pack(role_scores[kind].float()) for kind in HEAD_KINDS},
        "note": f"mean attention to each role's target keys, on random tokens repeated twice (seed {role_seed})",
    }


def _rollout_section(trace: Trace, row: int, keep: Tensor) -> dict[str, Any]:
    return {
        "fusions": list(FUSIONS),
        **{f: pack(attention_rollout(trace, head_fusion=f)[row][keep][:, keep], tri=True) for f in FUSIONS},
    }


def _lens_section(
    model: Any, trace: Trace, row: int, keep: Tensor, lens_k: int, lens_window: tuple[int, int] | None
) -> tuple[dict[str, Any], Tensor]:
    """The logit lens of the page's positions ``lens_window`` (of the real tokens ``keep``), and its
    top token ids ``(L + 1, W, k)`` (for the page's vocabulary)."""
    lo, hi = position_window("lens_window", lens_window, len(keep))
    at = keep[lo:hi]  # (W,) the window's positions in the trace
    first = int(at[0])
    lens = logit_lens(model, trace, k=lens_k, positions=(first, int(at[-1]) + 1))
    at = at - first  # in the lens's positions
    top = lens.tokens[:, row][:, at]  # (L + 1, W, k)
    section = {
        "k": lens.tokens.shape[-1],
        "start": lo,
        "rows": ["embeddings", *[f"after layer {i}" for i in range(trace.n_layers)]],
        "ids": pack(top.int(), "i32"),
        "probs": pack(lens.probs[:, row][:, at].float()),
        "final_probs": pack(lens.final_token_probs[:, row][:, at].float()),
    }
    return section, top


def _model_section(model: Any, name: str, L: int, H: int) -> dict[str, Any] | None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    return {
        "name": name,
        "n_layers": L,
        "n_heads": H,
        "n_kv_heads": getattr(cfg, "kv_heads", H),
        "head_dim": getattr(cfg, "head_dim", None),
        "vocab_size": cfg.vocab_size,
        "context_length": cfg.context_length,
    }


def _heads_section(
    trace: Trace, row: int, keep: Tensor, shown_layers: list[int], shown_heads: list[int], precision: str
) -> tuple[list[dict[str, Any]], str]:
    """The heads view's rows (one per shown layer) and the dtype their weights are stored in."""
    T = len(keep)
    dtype = weights_dtype(len(shown_layers) * len(shown_heads) * T * (T + 1) // 2, precision)
    # A causal layer without an additive mask puts nothing above the diagonal: stored as triangles.
    causal = [trace.is_causal[i] and _bool_mask(trace.masks[i]) for i in shown_layers]
    rows = [(f"layer {i}", shown_heads, _real(trace.weights[i, row], keep, shown_heads)) for i in shown_layers]
    out = _layers(rows, dtype, causal)
    for entry, i in zip(out, shown_layers, strict=True):
        entry["layer"] = i
    return out, dtype


def _real(w: Tensor, keep: Tensor, heads: list[int]) -> Tensor:
    """``w (H, T, S)`` at ``heads``, over the real tokens ``keep``: a view when nothing is left out
    (no copy of a layer's weights, the largest array of a trace)."""
    H, T, S = w.shape
    if heads != list(range(H)):
        w = w[heads]
    if len(keep) == T == S:  # no padding: every position is real
        return w
    return w[:, keep][:, :, keep]


def _steps_of_trace(
    trace: Trace, row: int, keep: Tensor, chosen: list[tuple[int, int]], shown_layers: list[int], n_shown: int
) -> dict[str, Any]:
    """The tutorials' steps of the ``chosen`` ``(layer, head)`` pairs, over the real tokens."""
    group = trace.n_heads // trace.k.shape[2]  # query heads per key/value head
    heads, by_layer = [], {}
    for layer, h in chosen:
        if layer not in by_layer:  # one layer's (B, H, T, S) steps at a time
            by_layer = {layer: trace.steps(layer)}
        st, g = by_layer[layer], h // group
        head_st = {
            "q": trace.q[layer, row, h][keep],
            "k": trace.k[layer, row, g][keep],
            "v": trace.v[layer, row, g][keep],
            "scores": st["scores"][row, h][keep][:, keep],
            "masked": st["masked"][row, h][keep][:, keep],
            "weights": st["weights"][row, h][keep][:, keep],
            "head_outputs": trace.head_outputs[layer, row, h][keep],
        }
        float_mask = not _bool_mask(trace.masks[layer])
        r = shown_layers.index(layer)
        cap = None if trace.softcaps is None else trace.softcaps[layer]
        heads.append(_head_steps(r, h, f"layer {layer}", head_st, trace.scale[layer], float_mask, softcap=cap))
    return _steps_section(heads, len(shown_layers) * n_shown - len(heads))


def _next_section(logits: Tensor, next_k: int) -> dict[str, Any]:
    """Next-token probabilities of each position's ``next_k`` likeliest tokens at every temperature of
    :data:`TEMPERATURES` (``logits (T, V)``), as the library's sampling filter computes them (the logits
    less their maximum, divided by the temperature, softmax; within float32's rounding of
    :func:`~attnlab.interpret.next_token_probabilities`); the page applies top-k and top-p to them as the
    filter does. ``top_ids`` (a list) is for the page's vocabulary."""
    T, V = logits.shape
    n = min(next_k, V)
    top_ids = torch.empty(T, n, dtype=torch.long, device=logits.device)  # the same order at every temperature
    probs = torch.empty(len(TEMPERATURES), T, n, dtype=torch.float32, device=logits.device)
    # One (chunk, V) buffer for every temperature's log-softmax, in place: a fresh softmax per temperature
    # (allocated, then gathered from) pays a new allocation and its page faults each time.
    buf = torch.empty(min(T, NEXT_CHUNK), V, dtype=torch.float32, device=logits.device)
    for s in range(0, T, NEXT_CHUNK):  # a few positions at a time: (chunk, V) temporaries, never (T, V) ones
        chunk = logits[s : s + NEXT_CHUNK].float()  # (c, V)
        ids = top_ids[s : s + NEXT_CHUNK] = torch.topk(chunk, n, dim=-1).indices  # (c, n)
        centred = chunk - chunk.gather(-1, ids[:, :1])  # (c, V), the maximum 0 as in the filter
        x = buf[: len(chunk)]
        for i, t in enumerate(TEMPERATURES):
            torch.div(centred, t, out=x)
            picked = x.gather(-1, ids)  # (c, n), before logsumexp_at spends x
            probs[i, s : s + NEXT_CHUNK] = (picked - logsumexp_at(x, ids[:, :1], spend=True)).exp_()
    return {
        "k": n,
        "ids": pack(top_ids.int(), "i32"),
        "temperatures": TEMPERATURES,
        "probs": pack(probs),  # (temperatures, T, n)
        "vocab_size": logits.shape[-1],
        "top_ids": top_ids.flatten().tolist(),
    }


def generation_step_data(step: GenerationStep, row: int = 0, dtype: str = "f32") -> dict[str, Any]:
    """One generated token of a :class:`~attnlab.interpret.GenerationTrace` as the page plays it
    back: the token, its position, the token of each key (slot) it attended to, its attention
    ``(L, H, S)`` (packed as ``dtype``), its candidates and their probabilities. A live server
    sends one of these per token as it is generated."""
    return {
        "token": int(step.token[row]),
        "position": step.position,
        "key_start": step.key_start,
        "key_index": step.key_index[row].tolist(),  # the token each weight goes to (-1: none)
        "weights": pack(step.weights[:, row].float(), dtype),  # (L, H, S)
        "candidates": step.candidates[row].tolist(),
        "probs": [round(p, 6) for p in step.probs[row].tolist()],
        "token_prob": float(step.token_prob[row]),
    }


def _generation_section(gen: GenerationTrace, row: int, dtype: str) -> dict[str, Any]:
    s = gen.sampling
    return {
        "prompt_length": gen.prompt_length,
        "tokens": gen.tokens[row].tolist(),
        "settings": {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p},
        "steps": [generation_step_data(step, row, dtype) for step in gen.steps],
    }
