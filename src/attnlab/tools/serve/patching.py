"""The patching view of ``attnlab serve``: ``POST /api/patch`` (see :mod:`attnlab.interpret.patch_view`).

The page's prompt is the clean one; the reader types a corrupted prompt of as many tokens and picks
the answers A and B (token ids, or texts of one token). The answer is the view's section: the metric
``logit(A) - logit(B)`` of both unpatched runs, :func:`attnlab.interpret.activation_patching` of the
sites asked for (``head_out`` (L, H), ``resid_pre`` (L, T)), and with ``head`` that head's pattern on
both prompts.

The work is many model calls (:meth:`Engine.run`), not one: the two unpatched runs, then each site
a few layers at a time (``activation_patching(..., layers=...)``, :data:`PIECES` calls a site). A
site is seconds of a 135M model on a CPU; between two calls the model's thread takes the other
requests waiting (the page's views follow the typing meanwhile), and a client that has left is
noticed and not patched for any further.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from attnlab.interpret import activation_patching, logit_diff, parse_heads
from attnlab.interpret.patch_view import answer_token, head_patterns, patching_section
from attnlab.tools.serve.engine import Engine

__all__ = [
    "MAX_PATCH_TOKENS",
    "PatchJob",
    "layer_chunks",
    "patch_answer",
    "patch_site",
    "patch_sites",
    "prepare_patch",
    "unpatched_runs",
]

# The longest prompts patched: the cost grows as T^2 (resid_pre patches each of the T positions, each
# run T tokens long); past this, a small model's patching on a CPU keeps the page waiting too long.
MAX_PATCH_TOKENS = 64
PIECES = 6  # model calls per site: a typing request waits for one of them at most, not for the whole site


@dataclass(frozen=True)
class PatchJob:
    """A checked request: the two prompts' token ids, the answers' ids, the head whose pattern to show."""

    clean: list[int]
    corrupted: list[int]
    answers: tuple[int, int]
    texts: tuple[str, str]
    head: tuple[int, int] | None


def _encode(engine: Engine, text: str, name: str) -> list[int]:
    ids = engine.encode(text, name)
    if len(ids) > MAX_PATCH_TOKENS:
        raise ValueError(
            f"{name} is {len(ids)} tokens long; patching takes at most {MAX_PATCH_TOKENS} (every position of "
            "every layer is one run of the model): shorten it"
        )
    return ids


def prepare_patch(
    engine: Engine, clean: str, corrupted: str, answers: Sequence[int | str], head: str | None = None
) -> PatchJob:
    """Check a request (no model call): prompts of the same number of tokens that differ, two
    different one-token answers, an existing head."""
    ids = _encode(engine, clean, "clean"), _encode(engine, corrupted, "corrupted")  # a language model's
    loaded = engine.loaded
    cfg = loaded.model.config
    if len(ids[0]) != len(ids[1]):
        raise ValueError(
            f"clean and corrupted must have the same number of tokens (patching pairs positions): the clean "
            f"prompt has {len(ids[0])}, the corrupted one {len(ids[1])}"
        )
    if ids[0] == ids[1]:
        raise ValueError("corrupted is the clean prompt itself: change a word or two, so that the answer changes")
    if len(answers) != 2:
        raise ValueError(f"answers must be two tokens, A and B, got {len(answers)}")
    a, b = (answer_token(loaded.tokenizer, t, cfg.vocab_size, f"answers[{i}]") for i, t in enumerate(answers))
    if a == b:
        raise ValueError(f"answers must be two different tokens, both are token {a}")
    pair = None
    if head is not None:
        pair = parse_heads([head], cfg.n_layers, cfg.n_heads)[0]
    return PatchJob(ids[0], ids[1], (a, b), (clean, corrupted), pair)


def _tensor(engine: Engine, ids: list[int]) -> torch.Tensor:
    return torch.tensor([ids], dtype=torch.long, device=engine.loaded.model.device)


def unpatched_runs(engine: Engine, job: PatchJob) -> tuple[tuple[float, float], tuple | None]:
    """The metric of the clean and the corrupted run, and ``job.head``'s pattern on each (one model call)."""
    model = engine.loaded.model
    metric = logit_diff(*job.answers)

    def work() -> tuple[tuple[float, float], tuple | None]:
        values, patterns = [], []
        for ids in (job.clean, job.corrupted):
            if job.head is None:
                values.append(float(metric(model(_tensor(engine, ids)))))
                continue
            logits, pat = head_patterns(model, _tensor(engine, ids))  # (L, H, T, T)
            values.append(float(metric(logits)))
            patterns.append(pat[job.head].float().cpu())
        pattern = None if job.head is None else (*job.head, *patterns)
        return (values[0], values[1]), pattern

    return engine.run(work)


def layer_chunks(n_layers: int, pieces: int = PIECES) -> list[list[int]]:
    """The layers in about ``pieces`` runs of about equal cost (a row patched at layer ``l`` runs
    through ``n_layers - l`` blocks: the first layers cost the most)."""
    target = n_layers * (n_layers + 1) / 2 / pieces
    chunks, current, cost = [], [], 0
    for layer in range(n_layers):
        current.append(layer)
        cost += n_layers - layer
        if cost >= target:
            chunks.append(current)
            current, cost = [], 0
    return chunks + ([current] if current else [])


def patch_site(engine: Engine, job: PatchJob, site: str, layers: list[int] | None = None) -> torch.Tensor:
    """:func:`attnlab.interpret.activation_patching` of one site, at ``layers`` (one model call)."""
    model, metric = engine.loaded.model, logit_diff(*job.answers)
    clean, corrupted = _tensor(engine, job.clean), _tensor(engine, job.corrupted)
    return engine.run(lambda: activation_patching(model, clean, corrupted, metric, site, layers=layers))


async def patch_sites(
    engine: Engine, job: PatchJob, sites: Sequence[str], call: Callable, left: Callable[[], Awaitable[bool]]
) -> dict[str, torch.Tensor] | None:
    """Every site, a few layers per model call (:func:`layer_chunks`): the requests that came in
    meanwhile run between two calls. ``call(fn, ...)`` runs ``fn`` in a worker thread; ``left()``
    tells whether the client has gone (then None: nothing more is computed)."""
    results = {}
    for site in dict.fromkeys(sites):
        parts = []
        for layers in layer_chunks(engine.loaded.model.config.n_layers):
            if await left():
                return None
            parts.append(await call(patch_site, engine, job, site, layers))
        results[site] = torch.cat(parts)  # (L, H) or (L, T): the chunks are in layer order
    return results


def patch_answer(
    engine: Engine, job: PatchJob, values: tuple[float, float], results: dict[str, torch.Tensor], pattern: Any
) -> dict[str, Any]:
    """The view's section (arrays packed) of what was computed."""
    return patching_section(
        engine.loaded.tokenizer,
        job.clean,
        job.corrupted,
        job.answers,
        values,
        results,
        texts=job.texts,
        pattern=pattern,
        static=False,
    ) | {  # the model's, also for a click's answer (no sites to read them from)
        "n_heads": engine.loaded.model.config.n_heads,
        "n_layers": engine.loaded.model.config.n_layers,
    }
