"""The patching view: activation patching of a clean and a corrupted prompt, as the pages draw it.

One section of page data, :func:`patching_section`, drawn by ``assets/patching.js`` in three places:
the inspector page (``attnlab viz --corrupted TEXT --answers A B``: computed once, static), the live
page of ``attnlab serve`` (``POST /api/patch``: the reader types the corrupted prompt and picks the
answers) and Jupyter (:func:`notebook_patching_html`, the view alone: ``patching.html``). The view
shows, for the metric ``logit(A) - logit(B)`` at the last token, the corrupted run with one clean
activation patched in (:func:`attnlab.interpret.activation_patching`) as two heatmaps, layer x head
(``head_out``) and layer x position (``resid_pre``), and the attention pattern of a clicked head on
both prompts (``blocks.{l}.attn.hook_pattern``: what the patched runs themselves compute).

The section (arrays :class:`~attnlab.interpret.codec.Packed`)::

    clean, corrupted      {text, ids, tokens, labels}
    answers               [{id, label}, {id, label}]   A and B
    clean_value, corrupted_value                        the metric of each unpatched run
    n_layers, n_heads
    sites                 {site: (L, H) or (L, T) float32}, raw metric values (not normalized)
    kinds                 {site: "head" | "pos"}
    patterns              {clean, corrupted: (L, H, T, T)} every head (a static page), or None
    pattern               {layer, head, clean, corrupted: (T, T)} one head (a live answer), or None
    static                True: nothing can be recomputed (an offline page)
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from string import Template
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.interpret.codec import pack, to_json
from attnlab.interpret.hooks import act_name, attention_layers, eval_mode, run_with_cache
from attnlab.interpret.inspector import token_label, token_strings
from attnlab.interpret.page import OFFLINE_CSP, iframe, inline, json_for_script, read_asset
from attnlab.interpret.patching import SITES, activation_patching, logit_diff

__all__ = [
    "PATTERNS_BUDGET",
    "VIEW_SITES",
    "answer_token",
    "head_patterns",
    "notebook_patching_html",
    "patching_data",
    "patching_page",
    "patching_section",
]

VIEW_SITES = ("head_out", "resid_pre")  # the two heatmaps: layer x head, layer x position
# Raw bytes of both prompts' patterns of every head a static page may hold; beyond it they are
# stored with fewer bits (u16, u8), and beyond that not at all (a live server sends one head's).
PATTERNS_BUDGET = 16 << 20


def answer_token(tokenizer: Any, answer: object, vocab_size: int, name: str = "answer") -> int:
    """The token id of ``answer``: an id in ``[0, vocab_size)``, or a text that is exactly one token."""
    if isinstance(answer, int) and not isinstance(answer, bool):
        if not 0 <= answer < vocab_size:
            raise ValueError(f"{name}: token id {answer} is out of range, the vocabulary is [0, {vocab_size})")
        return answer
    if not isinstance(answer, str) or not answer:
        raise ValueError(f"{name} must be a token id or a text of exactly one token, got {answer!r}")
    if tokenizer is None:
        raise ValueError(f"{name}: a text answer ({answer!r}) needs a tokenizer; give a token id")
    ids = [int(i) for i in tokenizer.encode(answer)]
    if len(ids) != 1:
        parts = " + ".join(repr(t) for t in token_strings(tokenizer, ids)) if ids else "nothing"
        # A hint: the answer with a leading space (byte-level BPE writes a word's space into its token)
        # or without it (SentencePiece adds one itself); a char tokenizer without a space cannot offer it.
        spaced = answer.startswith(" ")
        other, how = (answer[1:], "without its leading space") if spaced else (" " + answer, "with a leading space")
        try:
            one = bool(other) and len(tokenizer.encode(other)) == 1
        except ValueError:
            one = False
        hint = f" ({other!r}, {how}, is one)" if one else ""
        raise ValueError(f"{name} {answer!r} is {len(ids)} tokens ({parts}); an answer must be exactly one token{hint}")
    if not 0 <= ids[0] < vocab_size:
        raise ValueError(f"{name} {answer!r} is token {ids[0]}, outside the model's vocabulary [0, {vocab_size})")
    return ids[0]


def head_patterns(model: nn.Module, idx: Tensor) -> tuple[Tensor, Tensor]:
    """The logits ``(1, T, V)`` of ``idx (T,)`` or ``(1, T)`` and every head's attention pattern
    ``(L, H, T, T)`` (``blocks.{l}.attn.hook_pattern``), from one forward pass."""
    idx = idx[None] if idx.dim() == 1 else idx
    names = [act_name("pattern", i) for i in range(len(attention_layers(model)))]
    with eval_mode(model), torch.no_grad():
        logits, cache = run_with_cache(model, idx, names)
    return logits, torch.stack([cache[n][0] for n in names])  # (L, H, T, T)


def _prompt(tokenizer: Any, ids: Sequence[int], text: str | None) -> dict[str, Any]:
    tokens = token_strings(tokenizer, ids)
    labels = [token_label(t) for t in tokens]
    return {"text": text if text is not None else "".join(tokens), "ids": list(ids), "tokens": tokens, "labels": labels}


def _pack_square(t: Tensor, dtype: str) -> Any:
    """Attention patterns ``(..., T, T)``: lower triangles when nothing lies above the diagonal (causal)."""
    tri = bool(torch.all(torch.triu(t, diagonal=1) == 0))
    return pack(t.float(), dtype, tri=tri)


def _patterns_dtype(n: int) -> str | None:
    """The most precise dtype in which ``n`` weights fit :data:`PATTERNS_BUDGET` (None: none does)."""
    for dtype, size in (("f32", 4), ("u16", 2), ("u8", 1)):
        if n * size <= PATTERNS_BUDGET:
            return dtype
    return None


def patching_section(
    tokenizer: Any,
    clean: Sequence[int],
    corrupted: Sequence[int],
    answers: tuple[int, int],
    values: tuple[float, float],
    results: dict[str, Tensor],
    *,
    texts: tuple[str | None, str | None] = (None, None),
    patterns: tuple[Tensor, Tensor] | None = None,
    pattern: tuple[int, int, Tensor, Tensor] | None = None,
    static: bool = True,
) -> dict[str, Any]:
    """The page data of the patching view from what was computed (see the module's notes).

    Args:
        clean, corrupted: the token ids of the two prompts. answers: the ids of A and B.
        values: the metric of the clean and of the corrupted run.
        results: ``{site: activation_patching(...)}`` for ``head`` and ``pos`` sites (others are skipped).
        patterns: every head's pattern on each prompt, ``(L, H, T, T)`` twice (kept within
            :data:`PATTERNS_BUDGET`); pattern: one head's, ``(layer, head, (T, T), (T, T))``.
        static: whether the page can ask for more (False: a live server's answer).
    """
    kinds = {site: SITES[site][1] for site in results if SITES[site][1] in ("head", "pos")}
    shapes = [results[s].shape for s in kinds]
    L = shapes[0][0] if shapes else (patterns[0].shape[0] if patterns is not None else 0)
    H = next((sh[1] for s, sh in zip(kinds, shapes, strict=True) if kinds[s] == "head"), None)
    if H is None and patterns is not None:
        H = patterns[0].shape[1]
    a, b = answers
    section: dict[str, Any] = {
        "clean": _prompt(tokenizer, clean, texts[0]),
        "corrupted": _prompt(tokenizer, corrupted, texts[1]),
        "answers": [{"id": int(t), "label": token_label(token_strings(tokenizer, [int(t)])[0])} for t in (a, b)],
        "metric": "logit(A) - logit(B) at the last token",
        "clean_value": float(values[0]),
        "corrupted_value": float(values[1]),
        "n_layers": int(L),
        "n_heads": None if H is None else int(H),
        "sites": {site: pack(results[site].float()) for site in kinds},
        "kinds": kinds,
        "patterns": None,
        "patterns_note": "",
        "pattern": None,
        "static": bool(static),
    }
    if patterns is not None:
        dtype = _patterns_dtype(2 * patterns[0].numel())
        if dtype is None:
            section["patterns_note"] = (
                f"the attention patterns of {patterns[0].shape[0] * patterns[0].shape[1]} heads on "
                f"{len(clean)} tokens would make the page too big: attnlab serve shows them"
            )
        else:
            section["patterns"] = {
                "clean": _pack_square(patterns[0], dtype),
                "corrupted": _pack_square(patterns[1], dtype),
            }
    if pattern is not None:
        layer, head, pc, px = pattern
        section["pattern"] = {
            "layer": int(layer),
            "head": int(head),
            "clean": _pack_square(pc, "f32"),
            "corrupted": _pack_square(px, "f32"),
        }
    return section


def patching_data(
    model: nn.Module,
    clean: Tensor,
    corrupted: Tensor,
    answers: tuple[object, object],
    *,
    tokenizer: Any = None,
    texts: tuple[str | None, str | None] = (None, None),
    sites: Sequence[str] = VIEW_SITES,
    patterns: bool = True,
) -> dict[str, Any]:
    """Activation patching of ``sites`` for the metric ``logit(A) - logit(B)`` at the last token,
    and every head's pattern on both prompts: :func:`patching_section` of a static page.

    Args:
        clean, corrupted: ``(T,)`` or ``(1, T)`` token ids, the same length.
        answers: A and B, token ids or texts of one token each (texts need ``tokenizer``).
    """
    vocab = model.config.vocab_size
    a, b = (answer_token(tokenizer, t, vocab, f"answers[{i}]") for i, t in enumerate(answers))
    if a == b:
        raise ValueError(f"answers must be two different tokens, both are token {a}")
    for site in sites:
        if site not in SITES or SITES[site][1] not in ("head", "pos"):
            good = [s for s in SITES if SITES[s][1] in ("head", "pos")]
            raise ValueError(f"sites must be among {', '.join(good)}, got {site!r}")
    metric = logit_diff(a, b)
    results = {site: activation_patching(model, clean, corrupted, metric, site) for site in sites}  # checks the pair
    ids = [(x[0] if x.dim() == 2 else x).tolist() for x in (clean, corrupted)]
    logits_c, pat_c = head_patterns(model, clean)
    logits_x, pat_x = head_patterns(model, corrupted)
    values = (float(metric(logits_c)), float(metric(logits_x)))
    return patching_section(
        tokenizer, ids[0], ids[1], (a, b), values, results, texts=texts, patterns=(pat_c, pat_x) if patterns else None
    )


# --------------------------------------------------------------------------------------------
# The view alone (Jupyter): patching.html with the viewer's styles and code
# --------------------------------------------------------------------------------------------
def patching_page(section: dict[str, Any], *, title: str = "activation patching") -> str:
    """A self-contained offline page holding only the patching view (``assets/patching.html``)."""
    data = to_json({"patching": section}, blob=True)
    return Template(read_asset("patching.html")).substitute(
        csp=OFFLINE_CSP,
        title=html.escape(title),
        styles=inline("style", read_asset("viewer.css")) + "\n" + inline("style", read_asset("patching.css")),
        data=f'<script type="application/json" id="attn-patch">{json_for_script(data)}</script>',
        scripts=inline("script", read_asset("patching.js")) + "\n" + inline("script", read_asset("viewer.js")),
    )


def notebook_patching_html(section: dict[str, Any], *, height: int = 1000) -> str:
    """:func:`patching_page` for a Jupyter cell, in an ``<iframe srcdoc>`` (as :func:`notebook_html`)."""
    return iframe(patching_page(section), "patching", height)
