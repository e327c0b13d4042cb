"""The circuit view: the edges :func:`~attnlab.interpret.edge_attribution` finds, drawn as a graph.

One section of page data, :func:`circuit_section`, drawn by ``assets/circuit.js`` in three places:
the offline page of ``attnlab circuit --out page.html`` (:func:`circuit_page`), a tab of ``attnlab
serve`` (``POST /api/circuit``: the reader types the corrupted prompt and picks the answers) and
Jupyter (:func:`notebook_circuit_html`). The graph has the layers top to bottom: the embeddings,
then per layer its heads and its MLP, the logits last. An edge's width grows with ``|score|``, its
colour is its sign (red: patching it moves the metric toward the clean run, blue: away from it);
an edge into a head's query, key or value input is drawn solid, dashed or dotted. Clicking a head
shows its attention on both prompts (:func:`attnlab.interpret.trace`).

The section (plain JSON: it is small; no packed arrays)::

    clean, corrupted      {text, tokens}              tokens as printable labels
    answers               [label A, label B]
    metric, method, ig_steps
    n_layers, n_heads, n_kv_heads, n_edges            n_edges: every edge of the graph
    clean_value, corrupted_value                      the metric of each whole run
    budget                {fraction, n_edges, faithfulness}   the circuit drawn
    edges                 [[writer, reader, score], ...]       its strongest (at most max_drawn),
                                                               nodes [kind, layer, head]
    curve                 {budgets, n_edges, faithfulness, cpr, cmd}   MIB's edge budgets
    patterns              {"l.h": {clean, corrupted: (T, T) lists}} the drawn heads' attention
    static                True: nothing can be recomputed (an offline page)
    sae_edges             (with SAE nodes only) [[writer name, reader name, score], ...]: the drawn
                          edges that touch an SAE's latent, error or input (``sae 3.hook_resid_post
                          latent 123``), listed on the page in a table of their own; ``edges`` holds the rest
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from string import Template
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.interpret.circuits import (
    MIB_BUDGETS,
    Circuit,
    EdgeGraph,
    EdgeScores,
    FaithfulnessCurve,
    areas,
    circuit_metrics,
    edge_attribution,
    sae_graph,
)
from attnlab.interpret.inspector import token_label, token_strings
from attnlab.interpret.page import OFFLINE_CSP, iframe, inline, json_for_script
from attnlab.interpret.patch_view import answer_token
from attnlab.interpret.tracing import trace

__all__ = [
    "CIRCUIT_ASSETS",
    "MAX_DRAWN",
    "MAX_PATTERN_VALUES",
    "CircuitResult",
    "PairLogitDiff",
    "circuit_page",
    "circuit_result",
    "circuit_result_pairs",
    "circuit_section",
    "node_name",
    "notebook_circuit_html",
    "parse_budget",
    "read_circuit_asset",
    "sae_node_name",
]

CIRCUIT_ASSETS = ("circuit.html", "circuit.css", "circuit.js")
# The most edges the graph draws: past a few hundred lines a page is a blur (the counts say how many
# the circuit holds; the printed list and the curve use them all).
MAX_DRAWN = 300
# The most attention weights (both prompts) a section holds as text: the page stays tens of MB at most.
MAX_PATTERN_VALUES = 2_000_000
METHODS = ("EAP", "EAP-IG-inputs", "EAP-IG-activations")


def read_circuit_asset(name: str) -> str:
    """The text of one of the circuit view's files (:data:`CIRCUIT_ASSETS`), from the installed package."""
    if name not in CIRCUIT_ASSETS:
        raise ValueError(f"name must be one of {', '.join(CIRCUIT_ASSETS)}, got {name!r}")
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def sae_node_name(node: tuple) -> str:
    """An SAE node's name: ``("sae_latent", "blocks.3.hook_resid_post", 123)`` -> ``sae 3.hook_resid_post
    latent 123``; its error node ``... error``, a residual SAE's input ``... input``."""
    kind, hook, latent = node[:3]
    where = f"sae {str(hook).removeprefix('blocks.')}"
    names = {"sae_latent": f"{where} latent {latent}", "sae_error": f"{where} error", "sae_input": f"{where} input"}
    return names[kind]


def _is_sae(node: tuple) -> bool:
    return str(node[0]).startswith("sae_")


def parse_budget(budget: object) -> float:
    """A circuit's size as a fraction of all edges: ``0.05``, ``"5%"`` or ``"0.05"``, in (0, 1]."""
    value: object = budget
    if isinstance(budget, str):
        text = budget.strip()
        try:
            value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            raise ValueError(f"budget must be a percentage like 5% or a fraction like 0.05, got {budget!r}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not 0 < value <= 1:
        raise ValueError(f"budget must be a share of the edges in (0%, 100%], got {budget!r}")
    return float(value)


@dataclass
class CircuitResult:
    """What :func:`circuit_result` computed: every edge's score, the faithfulness curve over MIB's
    budgets and the circuit of the chosen budget, with what the view needs to draw them."""

    scores: EdgeScores
    curve: FaithfulnessCurve
    budget: float
    budget_edges: int
    budget_faithfulness: float
    clean_ids: list[int]
    corrupted_ids: list[int]
    answers: tuple[int, int]
    tokenizer: Any = None
    texts: tuple[str | None, str | None] = (None, None)
    patterns: tuple[Tensor, Tensor] | None = None  # (L, H, T, T) on each prompt
    n_pairs: int = 1  # the scores and faithfulness are the mean over this many pairs (the ids: the first's)

    def section(self, *, max_drawn: int = MAX_DRAWN, static: bool = True) -> dict[str, Any]:
        """The view's page data (see the module's notes)."""
        return circuit_section(self, max_drawn=max_drawn, static=static)

    def _repr_html_(self) -> str:
        return notebook_circuit_html(self.section())


def circuit_result(
    model: nn.Module,
    clean: Tensor,
    corrupted: Tensor,
    answers: tuple[object, object],
    *,
    tokenizer: Any = None,
    texts: tuple[str | None, str | None] = (None, None),
    method: str = "EAP",
    ig_steps: int = 5,
    budget: object = 0.05,
    budgets: Sequence[float] = MIB_BUDGETS,
    patterns: bool = True,
    saes: Sequence[Any] = (),
    max_latents: int = 64,
) -> CircuitResult:
    """Edge attribution of ``clean`` against ``corrupted`` for ``logit(A) - logit(B)`` at the last
    token, MIB's faithfulness curve of its top edges, and the circuit of the ``budget`` strongest.

    Args:
        clean, corrupted: ``(T,)`` or ``(1, T)`` token ids of the same length.
        answers: A and B, token ids or texts of one token each (texts need ``tokenizer``).
        method, ig_steps: as :func:`~attnlab.interpret.edge_attribution`.
        budget: the drawn circuit's share of the edges (:func:`parse_budget`: ``0.05`` or ``"5%"``).
        patterns: also trace both prompts for every head's attention (the view shows a clicked head's).
        saes, max_latents: SAEs or transcoders spliced in, their latents nodes of the graph
            (:func:`~attnlab.interpret.circuits.sae_graph`).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    fraction = parse_budget(budget)
    vocab = model.config.vocab_size
    a, b = (answer_token(tokenizer, t, vocab, f"answers[{i}]") for i, t in enumerate(answers))
    if a == b:
        raise ValueError(f"answers must be two different tokens, both are token {a}")
    if not isinstance(clean, Tensor) or not isinstance(corrupted, Tensor):
        raise TypeError(f"clean and corrupted must be tensors of token ids, got {type(clean).__name__}")
    if clean.is_floating_point() or corrupted.is_floating_point() or clean.dtype == torch.bool:
        raise TypeError(f"clean and corrupted must hold integer token ids, got {clean.dtype} and {corrupted.dtype}")
    x = [(t[0] if t.dim() == 2 and t.shape[0] == 1 else t) for t in (clean, corrupted)]
    if x[0].dim() != 1 or x[0].shape != x[1].shape:
        raise ValueError(
            f"clean and corrupted must be token ids (T,) or (1, T) of the same length, got shapes "
            f"{tuple(clean.shape)} and {tuple(corrupted.shape)}"
        )
    # one pair: the mean over one pair (the curve's circuits and the budget's run in one batch)
    return circuit_result_pairs(
        model,
        [(x[0].tolist(), x[1].tolist(), a, b)],
        tokenizer=tokenizer,
        texts=texts,
        method=method,
        ig_steps=ig_steps,
        budget=fraction,
        budgets=budgets,
        patterns=patterns,
        saes=saes,
        max_latents=max_latents,
    )


@dataclass(frozen=True)
class PairLogitDiff:
    """``logits[i, -1, a[i]] - logits[i, -1, b[i]]`` averaged over the rows: each pair has its own
    answers (a batch of IOI prompts names different people). ``a``, ``b``: ``(B,)`` token ids."""

    a: Tensor
    b: Tensor

    def rows(self, logits: Tensor) -> Tensor:
        """``(B,)``: the metric of each row of ``logits (B, T, V)``."""
        i = torch.arange(logits.shape[0], device=logits.device)
        return logits[i, -1, self.a.to(logits.device)] - logits[i, -1, self.b.to(logits.device)]

    def __call__(self, logits: Tensor) -> Tensor:
        return self.rows(logits).mean()


def _mean_scores(model: nn.Module, batches: list, run: Callable, **kw: Any) -> EdgeScores:
    """The edges' scores of ``batches`` (``(weight, clean (B, T), corrupted (B, T), metric)``), their
    weighted mean; with ``kw["saes"]``, one :func:`sae_graph` chosen on all of them."""
    saes, max_latents = kw.pop("saes"), kw.pop("max_latents")
    graph = None
    if saes:
        graph = run(lambda: sae_graph(model, list(saes), [(c, x) for _, c, x, _ in batches], max_latents))
    total = None
    for weight, clean, corrupted, metric in batches:
        s = run(lambda c=clean, x=corrupted, m=metric: edge_attribution(model, c, x, m, graph=graph, **kw))
        total = s.scores * weight if total is None else total + s.scores * weight
    return EdgeScores(s.graph, total, s.method, s.ig_steps, False)


def _pairs_by_length(pairs: object) -> dict[int, list[int]]:
    """``{length: indices of the pairs of that length}`` of ``(clean ids, corrupted ids, A, B)`` pairs, checked."""
    if not isinstance(pairs, (list, tuple)) or not pairs:
        raise ValueError("pairs must be a non-empty list of (clean ids, corrupted ids, A, B)")
    groups: dict[int, list[int]] = {}
    for i, pair in enumerate(pairs):
        if not isinstance(pair, (list, tuple)) or len(pair) != 4:
            raise ValueError(f"pairs[{i}] must be (clean ids, corrupted ids, A, B), got {pair!r}")
        if len(pair[0]) != len(pair[1]) or not pair[0]:
            raise ValueError(
                f"pairs[{i}]: clean and corrupted must have the same number of tokens, at least one "
                f"(edges pair positions), got {len(pair[0])} and {len(pair[1])}"
            )
        if pair[2] == pair[3]:
            raise ValueError(f"pairs[{i}]: the answers must be two different tokens, both are {pair[2]!r}")
        groups.setdefault(len(pair[0]), []).append(i)
    return groups


def circuit_result_pairs(
    model: nn.Module,
    pairs: Sequence[tuple[Sequence[int], Sequence[int], int, int]],
    *,
    tokenizer: Any = None,
    texts: tuple[str | None, str | None] = (None, None),
    method: str = "EAP",
    ig_steps: int = 5,
    budget: object = 0.05,
    budgets: Sequence[float] = MIB_BUDGETS,
    patterns: bool = True,
    run: Callable[[Callable[[], Any]], Any] | None = None,
    saes: Sequence[Any] = (),
    max_latents: int = 64,
) -> CircuitResult:
    """:func:`circuit_result` of many pairs at once, the mean over pairs as the papers report it.

    ``pairs``: ``(clean ids, corrupted ids, A, B)`` each, clean and corrupted of one length (pairs may
    differ in length). Pairs of one length run together as the rows of one batch; the scores are the
    mean over all pairs (each length's batch weighted by its count: the scores are linear in the
    metric, so that is the score of the mean metric). A circuit's metric, the clean and the corrupted
    run's are means over all pairs too, and faithfulness and the curve are computed from those means
    (MIB's normalisation of the batch mean). The page's prompts and attention are the first pair's.

    ``run(stage)`` calls each stage of model work (each length's scores, its circuits, the attention):
    a server passes its model thread's runner, so that the requests waiting meanwhile run between two
    stages instead of after the whole; None calls them here.

    ``saes`` are spliced in, their latents nodes (:func:`~attnlab.interpret.circuits.sae_graph`: at
    most ``max_latents`` of each, chosen on all the pairs, so every length's scores share one graph).
    """
    run = (lambda stage: stage()) if run is None else run
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    fraction = parse_budget(budget)
    fractions = list(budgets) if isinstance(budgets, (list, tuple)) else None
    ok = fractions and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b <= 1 for b in fractions)
    if not ok or fractions != sorted(fractions):
        raise ValueError(f"budgets must be increasing fractions of the edges in (0, 1], got {budgets!r}")
    device = next(model.parameters()).device
    groups = _pairs_by_length(pairs)
    N = len(pairs)
    batches = []  # (weight, clean (B, T), corrupted (B, T), metric)
    for rows in groups.values():
        ids = lambda k, rows=rows: torch.tensor([list(pairs[r][k]) for r in rows], dtype=torch.long, device=device)
        answers = [torch.tensor([int(pairs[r][k]) for r in rows], device=device) for k in (2, 3)]
        batches.append((len(rows) / N, ids(0), ids(1), PairLogitDiff(*answers)))
    scores = _mean_scores(model, batches, run, method=method, ig_steps=ig_steps, saes=saes, max_latents=max_latents)
    counts = [int(b * len(scores)) for b in fractions]
    n = int(fraction * len(scores))
    # the clean and the corrupted run are the full and the empty circuit, run beside the others: the
    # same sums, so the whole model's faithfulness is 1 (not 1 up to the rounding of another batch)
    circuits = [*(scores.top_n(k) for k in [*counts, n]), Circuit.full(scores.graph), Circuit.empty(scores.graph)]

    def measure(clean: Tensor, corrupted: Tensor, metric: PairLogitDiff) -> tuple[Tensor, float, float]:
        """Every circuit's metric, and the clean and corrupted run's, on one length's batch."""
        values = circuit_metrics(model, clean, corrupted, metric, circuits)
        return torch.tensor(values[:-2], dtype=torch.float64), values[-2], values[-1]

    values = torch.zeros(len(circuits) - 2, dtype=torch.float64)
    m_clean = m_corr = 0.0
    for weight, clean, corrupted, metric in batches:
        v, c, x = run(lambda c=clean, x=corrupted, m=metric: measure(c, x, m))
        values, m_clean, m_corr = values + weight * v, m_clean + weight * c, m_corr + weight * x
    if m_clean == m_corr:
        raise ValueError(f"the mean metric is {m_clean} on both prompts of the pairs: faithfulness is undefined")
    faith = ((values - m_corr) / (m_clean - m_corr)).tolist()
    cpr, cmd = areas(fractions, faith[:-1])
    curve = FaithfulnessCurve(tuple(fractions), tuple(counts), tuple(faith[:-1]), cpr, cmd, m_clean, m_corr)
    first = pairs[0]
    pats = None
    if patterns:
        pats = run(
            lambda: tuple(
                trace(model, torch.tensor(list(x), dtype=torch.long, device=device), logits=False)
                .weights[:, 0]
                .float()
                .cpu()
                for x in first[:2]
            )
        )
    return CircuitResult(
        scores,
        curve,
        fraction,
        n,
        faith[-1],
        list(first[0]),
        list(first[1]),
        (int(first[2]), int(first[3])),
        tokenizer,
        texts,
        pats,
        n_pairs=N,
    )


def _node(node: tuple) -> list:
    return [node[0], node[1], node[2]]


def _heads_of(graph: EdgeGraph, edges: list[tuple[tuple, tuple, float]]) -> list[tuple[int, int]]:
    """The query heads the drawn edges touch (a writer head, a query input, or a key/value input's
    group), in the order of their strongest edge (``edges`` come strongest first)."""
    group = graph.n_heads // graph.n_kv_heads
    heads: dict[tuple[int, int], None] = {}
    for w, r, _ in edges:
        if w[0] == "attn_head_out":
            heads[(w[1], w[2])] = None
        if r[0] == "q_input":
            heads[(r[1], r[2])] = None
        elif r[0] in ("k_input", "v_input"):
            heads.update(dict.fromkeys((r[1], r[2] * group + i) for i in range(group)))
    return list(heads)


def _prompt(tokenizer: Any, ids: list[int], text: str | None) -> dict[str, Any]:
    tokens = [token_label(t) for t in token_strings(tokenizer, ids)]
    return {"text": text if text is not None else "".join(token_strings(tokenizer, ids)), "tokens": tokens}


def circuit_section(result: CircuitResult, *, max_drawn: int = MAX_DRAWN, static: bool = True) -> dict[str, Any]:
    """The view's page data of ``result``: the circuit's ``max_drawn`` strongest edges, the curve, and
    the attention of the heads they touch on both prompts (see the module's notes)."""
    if isinstance(max_drawn, bool) or not isinstance(max_drawn, int) or max_drawn < 1:
        raise ValueError(f"max_drawn must be a positive int, got {max_drawn!r}")
    scores, curve, g = result.scores, result.curve, result.scores.graph
    top = scores.top(min(result.budget_edges, max_drawn))
    drawn = [e for e in top if not (_is_sae(e[0]) or _is_sae(e[1]))]  # the graph draws the model's nodes
    tok = result.tokenizer
    section: dict[str, Any] = {
        "clean": _prompt(tok, result.clean_ids, result.texts[0]),
        "corrupted": _prompt(tok, result.corrupted_ids, result.texts[1]),
        "answers": [token_label(token_strings(tok, [int(t)])[0]) for t in result.answers],
        "metric": "logit(A) - logit(B) at the last token",
        "method": scores.method,
        "ig_steps": scores.ig_steps,
        "n_layers": g.n_layers,
        "n_heads": g.n_heads,
        "n_kv_heads": g.n_kv_heads,
        "n_edges": len(scores),
        "clean_value": curve.clean_metric,
        "corrupted_value": curve.corrupted_metric,
        "budget": {
            "fraction": result.budget,
            "n_edges": result.budget_edges,
            "faithfulness": result.budget_faithfulness,
        },
        "edges": [[_node(w), _node(r), score] for w, r, score in drawn],
        "curve": {
            "budgets": list(curve.budgets),
            "n_edges": list(curve.n_edges),
            "faithfulness": list(curve.faithfulness),
            "cpr": curve.cpr,
            "cmd": curve.cmd,
        },
        "patterns": {},
        "patterns_note": "",
        "static": bool(static),
        "pairs": result.n_pairs,
    }
    if g.saes:
        section["sae_edges"] = [[node_name(w), node_name(r), score] for w, r, score in top if _is_sae(w) or _is_sae(r)]
    if result.patterns is not None:
        heads = _heads_of(g, drawn)
        T = len(result.clean_ids)
        kept = heads[: max(0, MAX_PATTERN_VALUES // (2 * T * T))]  # the strongest edges' heads first
        if len(kept) < len(heads):
            section["patterns_note"] = (
                f"the attention of {len(kept)} of the circuit's {len(heads)} heads (those of its strongest edges): "
                f"all of them on {T} tokens would make the page too big"
            )
        for layer, head in kept:
            section["patterns"][f"{layer}.{head}"] = {
                # 5 decimals: the heatmap's colours and readout need no more, and the page stays small
                which: [[round(v, 5) for v in row] for row in p[layer, head].tolist()]
                for which, p in zip(("clean", "corrupted"), result.patterns, strict=True)
            }
    return section


def node_name(node: tuple) -> str:
    """A node's short name, as the page and ``attnlab circuit`` write it (TransformerLens's): ``a3.1``,
    ``m2``, ``a5.0<q``, ``a5.kv0<k``, ``input``, ``logits``; an SAE's node by :func:`sae_node_name`."""
    kind, layer, head = node[:3]
    if _is_sae(node):
        return sae_node_name(node)
    return {
        "embed": "input",
        "logits": "logits",
        "attn_head_out": f"a{layer}.{head}",
        "mlp_out": f"m{layer}",
        "mlp_in": f"m{layer}",
        "q_input": f"a{layer}.{head}<q",
        "k_input": f"a{layer}.kv{head}<k",
        "v_input": f"a{layer}.kv{head}<v",
    }[kind]


def _sae_table(section: dict[str, Any]) -> str:
    """The drawn edges that touch SAE nodes, as a plain table (the graph draws the model's nodes)."""
    rows = section.get("sae_edges")
    if rows is None:
        return ""
    cells = "".join(
        f'<tr><td class="name">{html.escape(w)}</td><td class="name">{html.escape(r)}</td><td>{s:+.4g}</td></tr>'
        for w, r, s in rows
    )
    note = "" if rows else "<p>None of the drawn edges touches an SAE's latents, error or input.</p>"
    return (
        '<section id="circuit-sae-edges" class="circuit-sae"><h2>Edges of SAE latents</h2>'
        "<p>The circuit's drawn edges into or out of a spliced SAE's latents, error term or input "
        "(the graph above draws the model's heads and MLPs).</p>"
        f"{note}<table><tr><th>writer</th><th>reader</th><th>score</th></tr>{cells}</table></section>"
    )


def circuit_page(section: dict[str, Any], *, title: str = "circuit") -> str:
    """A self-contained offline page of the circuit view (``assets/circuit.html``): no network at all."""
    return Template(read_circuit_asset("circuit.html")).substitute(
        csp=OFFLINE_CSP,
        title=html.escape(title),
        styles=inline("style", read_circuit_asset("circuit.css")),
        data=f'<script type="application/json" id="attn-circuit">{json_for_script(section)}</script>'
        + _sae_table(section),
        scripts=inline("script", read_circuit_asset("circuit.js")),
    )


def notebook_circuit_html(section: dict[str, Any], *, height: int = 900) -> str:
    """:func:`circuit_page` for a Jupyter cell, in an ``<iframe srcdoc>`` (:func:`attnlab.interpret.page.iframe`)."""
    return iframe(circuit_page(section), "circuit", height)
