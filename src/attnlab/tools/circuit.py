"""``attnlab circuit``: which edges between heads and MLPs carry the answer, and how faithful a circuit is.

Edge attribution (:func:`attnlab.interpret.edge_attribution`: EAP or EAP-IG) of a clean and a
corrupted prompt for the metric ``logit(A) - logit(B)`` at the last token; the report lists the
strongest edges (by ``|score|``, with the sign: positive moves the metric toward the clean run) and
the faithfulness of the circuit of the top edges at MIB's budgets (CPR, CMD), and the page draws the
circuit of the chosen budget (:mod:`attnlab.interpret.circuit_view`). With SAEs or transcoders
(``--sae DIR``) spliced in, their latents are nodes too, named ``sae 3.hook_resid_post latent 123``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attnlab.files import atomic_write_text, open_regular
from attnlab.interpret.circuit_view import (
    CircuitResult,
    circuit_page,
    circuit_result,
    circuit_result_pairs,
    node_name,
    notebook_circuit_html,
    parse_budget,
)
from attnlab.interpret.circuits import sae_place
from attnlab.interpret.patch_view import answer_token
from attnlab.interpret.sae import SAE
from attnlab.tokenizers import prompt_tokens
from attnlab.tools.loading import LoadedModel, attach_saes, model_name

__all__ = [
    "MAX_CIRCUIT_TOKENS",
    "METHODS",
    "CircuitReport",
    "circuit_report",
    "circuit_report_pairs",
    "circuit_saes",
    "format_node",
    "read_pairs",
    "save_circuit_page",
    "serve_circuit",
]

METHODS = ("EAP", "EAP-IG-inputs", "EAP-IG-activations")
# The longest prompts a server scores: the edges' scores and the faithfulness runs grow with T (the
# circuits run as the rows of batches of T tokens each); past this a small model keeps the page waiting.
MAX_CIRCUIT_TOKENS = 64
PAIRS_MAX_BYTES = 64 << 20  # a JSONL of prompt pairs: thousands of lines are a few megabytes


format_node = node_name  # ("attn_head_out", 3, 1) -> "a3.1": the printed edges name nodes as the page does


@dataclass
class CircuitReport:
    """:func:`circuit_report`'s result: the library's :class:`~attnlab.interpret.circuit_view.CircuitResult`
    and the answers as typed."""

    result: CircuitResult
    answers: tuple[str, str]
    name: str = "model"

    def format(self, top: int = 20) -> str:
        r, curve = self.result, self.result.curve
        a, b = self.answers
        steps = f", {r.scores.ig_steps} steps" if r.scores.method != "EAP" else ""
        pairs = r.n_pairs
        lines = [
            f"metric: logit({a!r}) - logit({b!r}) at the last token"
            if pairs == 1
            else f"metric: logit(A) - logit(B) at the last token, the mean over {pairs} pairs",
            f"clean run {curve.clean_metric:+.4f}, corrupted run {curve.corrupted_metric:+.4f}",
            f"method: {r.scores.method}{steps}; {len(r.scores)} edges",
            *(
                f"SAE at {s.hook}: {len(s.latents)} of its {s.sae.cfg.d_sae} latents are nodes (those active "
                "on the prompts, the largest change first), the rest is in its error node"
                for s in r.scores.graph.saes
            ),
            f"\nthe {top} strongest edges (score: + moves the metric toward the clean run, - away from it)",
        ]
        width = 34 if r.scores.graph.saes else 14
        for w, rd, score in r.scores.top(top):
            lines.append(f"  {format_node(w):>{width}} -> {format_node(rd):<{width}} {score:+.5f}")
        lines.append("\nfaithfulness of the top edges at MIB's budgets (1 = the whole model, 0 = the corrupted run)")
        for budget, n, f in zip(curve.budgets, curve.n_edges, curve.faithfulness, strict=True):
            lines.append(f"  {budget * 100:6.1f}%  {n:7d} edges  {f:+.4f}")
        lines.append(f"CPR (area under the curve) {curve.cpr:.5f}   CMD (area between it and 1) {curve.cmd:.5f}")
        lines.append(
            f"the circuit drawn: top {r.budget * 100:g}% = {r.budget_edges} edges, "
            f"faithfulness {r.budget_faithfulness:+.4f}"
        )
        return "\n".join(lines)

    def page(self) -> str:
        """The offline page: the circuit as a graph, a clicked head's attention on both prompts."""
        return circuit_page(self.result.section(), title=f"circuit · {self.name}")

    def _repr_html_(self) -> str:
        """In Jupyter: the same view, inline."""
        return notebook_circuit_html(self.result.section())


def circuit_saes(loaded: LoadedModel, saes: dict[str, SAE]) -> list[SAE]:
    """The SAEs of ``--sae`` (read by :func:`attnlab.tools.loading.load_saes`) on the model, each
    checked against it and to be a node of its graph: each error names its ``--sae``."""
    attach_saes(saes, loaded.model)
    for path, sae in saes.items():
        try:
            sae_place(loaded.model, sae)
        except ValueError as e:
            raise ValueError(f"--sae {path}: {e}") from None
    return list(saes.values())


def circuit_report(
    loaded: LoadedModel,
    clean: str,
    corrupted: str,
    answers: tuple[str, str],
    *,
    method: str = "EAP",
    ig_steps: int = 5,
    budget: object = 0.05,
    saes: Sequence[SAE] = (),
    max_latents: int = 64,
) -> CircuitReport:
    """Edge attribution and faithfulness of two prompts of the same number of tokens (the command
    line's checks: each error names its flag); ``saes`` (:func:`circuit_saes`) spliced in, their latents nodes."""
    model, tok = loaded.model, loaded.tokenizer
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if isinstance(ig_steps, bool) or not isinstance(ig_steps, int) or ig_steps < 1:
        raise ValueError(f"--ig-steps must be a positive int, got {ig_steps!r}")
    V, names = model.config.vocab_size, ("--answers: the first answer", "--answers: the second answer")
    a, b = (answer_token(tok, t, V, name) for t, name in zip(answers, names, strict=True))
    if a == b:
        raise ValueError(f"--answers must be two different tokens, both are {answers[0]!r}")
    device = next(model.parameters()).device
    ids = [torch.tensor(prompt_tokens(tok, t), dtype=torch.long, device=device) for t in (clean, corrupted)]
    ctx = model.config.context_length
    for flag, i in zip(("--clean", "--corrupted"), ids, strict=True):
        if i.numel() == 0:
            raise ValueError(f"{flag} encodes to no tokens: give a prompt of at least one token")
        if i.numel() > ctx:
            raise ValueError(f"{flag} is {i.numel()} tokens long, more than the model's context_length={ctx}")
    if ids[0].numel() != ids[1].numel():
        raise ValueError(
            f"--clean and --corrupted must have the same number of tokens (edges pair positions), "
            f"got {ids[0].numel()} and {ids[1].numel()}"
        )
    if torch.equal(ids[0], ids[1]):  # (no effect to explain: every faithfulness would be noise)
        raise ValueError("--corrupted is the clean prompt itself: change a word or two, so that the answer changes")
    try:
        parse_budget(budget)
    except ValueError as e:
        raise ValueError(f"--budget: {e}") from None
    result = circuit_result(
        model,
        ids[0],
        ids[1],
        (a, b),
        tokenizer=tok,
        texts=(clean, corrupted),
        method=method,
        ig_steps=ig_steps,
        budget=budget,
        saes=saes,
        max_latents=max_latents,
    )
    return CircuitReport(result, tuple(answers), model_name(loaded))


def read_pairs(path: str | os.PathLike[str], tokenizer: Any, context_length: int, vocab_size: int) -> list[tuple]:
    """A JSONL of prompt pairs, one ``{"clean": TEXT, "corrupted": TEXT, "answers": [A, B]}`` a line
    (blank lines skipped), as ``(clean ids, corrupted ids, A id, B id)``; every error names its line."""
    path = Path(path)
    with open_regular(path, "--pairs file") as f:
        raw = f.read(PAIRS_MAX_BYTES + 1)
    if len(raw) > PAIRS_MAX_BYTES:
        raise ValueError(f"--pairs {path} is larger than {PAIRS_MAX_BYTES:,} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--pairs {path} is not UTF-8 text: {e}") from None
    pairs = []
    # JSON Lines ends a line at "\n" alone: str.splitlines() would also split inside a JSON string at
    # U+2028, U+2029 or U+0085, which JSON allows unescaped
    for n, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        where = f"--pairs {path.name} line {n}"
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(obj, dict) or not {"clean", "corrupted", "answers"} <= obj.keys():
            raise ValueError(
                f'{where}: expected {{"clean": TEXT, "corrupted": TEXT, "answers": [A, B]}}, got {line[:80]!r}'
            )
        clean, corrupted, answers = obj["clean"], obj["corrupted"], obj["answers"]
        if not isinstance(clean, str) or not isinstance(corrupted, str):
            raise ValueError(f"{where}: clean and corrupted must be texts")
        if not isinstance(answers, list) or len(answers) != 2 or not all(isinstance(x, str) for x in answers):
            raise ValueError(f"{where}: answers must be two texts, A and B, got {answers!r}")
        ids = [[int(i) for i in prompt_tokens(tokenizer, t)] for t in (clean, corrupted)]
        if not ids[0] or len(ids[0]) > context_length:
            raise ValueError(f"{where}: clean is {len(ids[0])} tokens, it must be 1 to context_length={context_length}")
        if len(ids[0]) != len(ids[1]):
            raise ValueError(
                f"{where}: clean and corrupted must have the same number of tokens (edges pair positions), "
                f"got {len(ids[0])} and {len(ids[1])}"
            )
        if ids[0] == ids[1]:
            raise ValueError(f"{where}: corrupted is the clean prompt itself: change a word or two")
        a, b = (
            answer_token(tokenizer, t, vocab_size, f"{where}: {w}")
            for t, w in zip(answers, ("the first answer", "the second answer"), strict=True)
        )
        if a == b:
            raise ValueError(f"{where}: the answers must be two different tokens, both are {answers[0]!r}")
        pairs.append((ids[0], ids[1], a, b, clean, corrupted, tuple(answers)))
    if not pairs:
        raise ValueError(f"--pairs {path} holds no pairs (one JSON object a line)")
    return pairs


def circuit_report_pairs(
    loaded: LoadedModel,
    path: str | os.PathLike[str],
    *,
    method: str = "EAP",
    ig_steps: int = 5,
    budget: object = 0.05,
    saes: Sequence[SAE] = (),
    max_latents: int = 64,
) -> CircuitReport:
    """Edge attribution and faithfulness of every pair of a JSONL file, the mean over pairs
    (:func:`attnlab.interpret.circuit_view.circuit_result_pairs`), ``saes`` spliced in."""
    model, tok = loaded.model, loaded.tokenizer
    if method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {method!r}")
    if isinstance(ig_steps, bool) or not isinstance(ig_steps, int) or ig_steps < 1:
        raise ValueError(f"--ig-steps must be a positive int, got {ig_steps!r}")
    try:
        parse_budget(budget)
    except ValueError as e:
        raise ValueError(f"--budget: {e}") from None
    rows = read_pairs(path, tok, model.config.context_length, model.config.vocab_size)
    result = circuit_result_pairs(
        model,
        [r[:4] for r in rows],
        tokenizer=tok,
        texts=(rows[0][4], rows[0][5]),
        method=method,
        ig_steps=ig_steps,
        budget=budget,
        saes=saes,
        max_latents=max_latents,
    )
    return CircuitReport(result, rows[0][6], model_name(loaded))


def save_circuit_page(report: CircuitReport, path: str | os.PathLike[str]) -> Path:
    """Write the page atomically (a reader never sees half a page)."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"--out must end in .html, got {str(path)!r}")
    atomic_write_text(path, report.page())
    return path


def serve_circuit(
    engine: Any,
    clean: str,
    corrupted: str,
    answers: list[int | str],
    *,
    method: str = "EAP",
    ig_steps: int = 5,
    budget: object = 0.05,
    left: Callable[[], bool] | None = None,
) -> dict[str, Any] | None:
    """``POST /api/circuit`` of ``attnlab serve``: the view's section (plain JSON) for ``engine``'s model.

    The request is checked first (prompts of the same number of tokens, at most
    :data:`MAX_CIRCUIT_TOKENS`; two different one-token answers; a known method; a budget in (0, 1]),
    each error a ValueError naming the field; then the work runs as a few model calls (``engine.run``).
    ``left()`` tells whether the client has gone: asked before each call, and then None, nothing
    more computed.
    """
    ids = []
    for name, text in (("clean", clean), ("corrupted", corrupted)):
        try:
            got = engine.encode(text)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        if len(got) > MAX_CIRCUIT_TOKENS:
            raise ValueError(
                f"{name} is {len(got)} tokens long; a circuit takes at most {MAX_CIRCUIT_TOKENS}: shorten it"
            )
        ids.append(got)
    if len(ids[0]) != len(ids[1]):
        raise ValueError(
            f"clean and corrupted must have the same number of tokens (edges pair positions): the clean prompt has "
            f"{len(ids[0])}, the corrupted one {len(ids[1])}"
        )
    if ids[0] == ids[1]:
        raise ValueError("corrupted is the clean prompt itself: change a word or two, so that the answer changes")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    parse_budget(budget)
    loaded = engine.loaded
    model = loaded.model
    vocab = model.config.vocab_size
    pair = tuple(answer_token(loaded.tokenizer, t, vocab, f"answers[{i}]") for i, t in enumerate(answers))
    if len(pair) != 2 or pair[0] == pair[1]:
        raise ValueError(f"answers must be two different tokens, got {list(answers)!r}")

    def run(stage: Callable[[], Any]) -> Any:
        if left is not None and left():
            raise _ClientLeft

        def grads_on() -> Any:
            # the engine runs in inference mode; edge attribution needs the metric's gradient
            with torch.inference_mode(False), torch.enable_grad():
                return stage()

        return engine.run(grads_on)

    # each stage is one model call: the requests that came in meanwhile (the page's other views
    # following the typing) run between two of them, not after the whole circuit
    try:
        result = circuit_result_pairs(
            model,
            [(ids[0], ids[1], pair[0], pair[1])],
            tokenizer=loaded.tokenizer,
            texts=(clean, corrupted),
            method=method,
            ig_steps=ig_steps,
            budget=budget,
            run=run,
        )
    except _ClientLeft:
        return None
    return result.section(static=False)


class _ClientLeft(Exception):
    """Raised between two model calls of :func:`serve_circuit` whose client has gone."""
