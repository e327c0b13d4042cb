"""The Features tab of ``attnlab serve --sae DIR``: SAE latents of the page's prompt, and steering.

Three answers, each computed by :mod:`attnlab.interpret` on the engine's model thread:

* ``POST /api/features``: each token's strongest latents (:func:`~attnlab.interpret.sae_view.strongest_latents`).
* ``POST /api/latent``: one latent's activation on every token of the prompt and its dashboard
  (:func:`~attnlab.interpret.sae_view.dashboard_data`: top contexts, histogram, density, promoted and
  suppressed tokens), over the prompt or over the corpus given at start-up (``--sae-data``: the first
  such request reads the corpus once for every latent of the SAE, :func:`~attnlab.interpret.sae_view.collect`;
  its statistics are kept, and each latent's dashboard is then formatted from them).
* ``POST /api/steer``: a generation with latents' directions added at the SAE's hook point
  (:func:`~attnlab.interpret.steer`, nested for several latents), and the same generation without
  them (same seed), to compare.

The steering hooks live on the shared model only while one request's tokens are drawn, under the
engine's lock (:meth:`Engine.run`): no other request sees them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from attnlab.errors import UserError
from attnlab.generation import SamplingConfig, stream
from attnlab.interpret import steer
from attnlab.interpret.sae_view import (
    LatentStats,
    collect,
    dashboard_data,
    prompt_latents,
    stats_dashboard,
    strongest_latents,
)
from attnlab.tools.serve.engine import Engine, corpus_context

__all__ = ["NoSAE", "corpus_stats", "features_answer", "latent_answer", "steer_answer"]

CORPUS_STATS = 4  # the corpus's statistics kept, by SAE and settings (each: a pass over the corpus)
LATENTS_BYTES = 64 << 20  # the latents of one batch of windows, (batch, context, d_sae) float32, at most


class NoSAE(UserError):
    """A Features request to a server started without ``--sae``."""


def _sae(engine: Engine, index: int) -> Any:
    """The ``index``-th SAE of the server, or an error naming the ``sae`` field (a server with SAEs has a
    language model: :class:`Engine` refuses them without one)."""
    if not engine.saes:
        raise NoSAE("sae: this server has no SAE loaded (start it with attnlab serve --sae DIR)")
    if not 0 <= index < len(engine.saes):
        raise ValueError(f"sae: {index} is out of range: {len(engine.saes)} SAE(s) loaded (0..{len(engine.saes) - 1})")
    return list(engine.saes.values())[index]


def _latent(sae: Any, latent: int, field: str = "latent") -> int:
    if not 0 <= latent < sae.cfg.d_sae:
        raise ValueError(
            f"{field}: {latent} is out of range: the SAE has d_sae={sae.cfg.d_sae} (0..{sae.cfg.d_sae - 1})"
        )
    return latent


def corpus_stats(engine: Engine, sae: int, top_k: int, window: int) -> LatentStats:
    """Every latent of SAE ``sae`` over the start-up corpus (:func:`~attnlab.interpret.sae_view.collect`),
    read once and kept. Call on the model's thread, with the lock held (:meth:`Engine.run`)."""
    key = (sae, top_k, window)
    # A pass kept for more examples or a wider window holds these too: no pass over the corpus again.
    wider = [k for k in engine.corpus_stats if k[0] == sae and k[1] >= top_k and k[2] >= window and k != key]
    if key not in engine.corpus_stats and wider:
        engine.corpus_stats.move_to_end(wider[-1])
        return engine.corpus_stats[wider[-1]].narrowed(top_k, window)
    stats = engine.corpus_stats.get(key)
    if stats is None:  # one pass over the corpus up to the hook, in windows the model reads
        model, model_sae, corpus = engine.loaded.model, _sae(engine, sae), engine.sae_corpus
        context = corpus_context(model, len(corpus))
        batch = max(1, min(16, LATENTS_BYTES // (4 * context * model_sae.cfg.d_sae)))
        d_sae = model_sae.cfg.d_sae
        stats = collect(model, model_sae, corpus, d_sae, context=context, batch=batch, top_k=top_k, window=window)
    engine.corpus_stats[key] = stats
    engine.corpus_stats.move_to_end(key)  # the least recently used goes first
    while len(engine.corpus_stats) > CORPUS_STATS:
        engine.corpus_stats.popitem(last=False)
    return stats


def features_answer(engine: Engine, prompt: str, *, sae: int = 0, n: int = 8) -> dict[str, Any]:
    """Each token's ``n`` strongest latents: ``values``, ``latents`` ``(T, n)`` (values descending, 0
    where fewer fired), with the prompt's tokens."""
    model_sae = _sae(engine, sae)
    if not 1 <= n <= model_sae.cfg.d_sae:
        raise ValueError(f"n: must be in [1, d_sae={model_sae.cfg.d_sae}], got {n}")
    ids = engine.encode(prompt)
    model = engine.loaded.model

    def work() -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(ids, dtype=torch.long, device=model.device)
        return strongest_latents(model, model_sae, idx, n)

    values, latents = engine.run(work)
    labels = engine.labels(ids)
    return {
        "sae": sae,
        "hook": model_sae.cfg.hook_name,
        "d_sae": model_sae.cfg.d_sae,
        "ids": ids,
        "labels": [labels[str(i)] for i in ids],
        "values": values.tolist(),
        "latents": latents.tolist(),
    }


def latent_answer(
    engine: Engine,
    prompt: str,
    latent: int,
    *,
    sae: int = 0,
    over: str = "prompt",
    top_k: int = 5,
    window: int = 8,
    n_logits: int = 10,
) -> dict[str, Any]:
    """One latent on the prompt: ``acts`` ``(T,)`` its activation on each token, and ``dashboard`` (one
    entry of :func:`dashboard_data`) over the prompt (``over="prompt"``) or the start-up corpus."""
    model_sae = _sae(engine, sae)
    latent = _latent(model_sae, latent)
    if over == "corpus" and engine.sae_corpus is None:
        raise ValueError("over: this server was started without a corpus (attnlab serve --sae-data FILE)")
    ids = engine.encode(prompt)
    loaded = engine.loaded
    model, tokenizer = loaded.model, loaded.tokenizer
    settings = dict(top_k=top_k, window=window, n_logits=n_logits)

    def work() -> tuple[list[float], dict[str, Any], int]:
        idx = torch.tensor(ids, dtype=torch.long, device=model.device)
        acts = prompt_latents(model, model_sae, idx)[:, latent].float().cpu().tolist()  # (T,)
        if over == "prompt":
            data = dashboard_data(model, model_sae, idx, tokenizer, [latent], context=len(ids), **settings)
            return acts, data["latents"][0], data["tokens"]
        stats = corpus_stats(engine, sae, top_k, window).select([latent])
        return acts, stats_dashboard(model, model_sae, stats, tokenizer, n_logits=n_logits)["latents"][0], stats.tokens

    acts, dashboard, tokens = engine.run(work)
    return {
        "sae": sae,
        "latent": latent,
        "over": over,
        "corpus": engine.sae_corpus_name if over == "corpus" else None,
        "tokens": tokens,
        "acts": acts,
        "dashboard": dashboard,
    }


def steer_answer(
    engine: Engine,
    prompt: str,
    steering: Sequence[tuple[int, float]],
    max_new_tokens: int,
    *,
    sae: int = 0,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    compare: bool = True,
) -> dict[str, Any]:
    """``max_new_tokens`` tokens after the prompt with each ``(latent, strength)`` of ``steering`` added
    (:func:`attnlab.interpret.steer`), sampled with ``seed`` (the tokens ``model.stream`` draws with
    ``torch.Generator(device=model.device).manual_seed(seed)`` inside those ``steer`` blocks); with ``compare`` also the
    same generation unsteered."""
    model_sae = _sae(engine, sae)
    for i, (latent, strength) in enumerate(steering):
        _latent(model_sae, latent, f"steer.{i}.latent")
        if not math.isfinite(strength):
            raise ValueError(f"steer.{i}.strength: must be a finite number, got {strength}")
    engine.check_new_tokens(max_new_tokens)
    SamplingConfig(temperature, top_k, top_p)  # the settings checked as generation checks them
    ids = engine.encode(prompt)
    loaded = engine.loaded
    model = loaded.model

    def generate(pushes: Sequence[tuple[int, float]]) -> list[int]:
        # One model call a token, the steering hooks on only inside it: the other requests run between
        # two tokens, on the model as it is (as /api/generate's steps do).
        tokens: Iterator[torch.Tensor] | None = None

        def step() -> int | None:
            nonlocal tokens
            with contextlib.ExitStack() as stack:
                for latent, strength in pushes:  # nested blocks: the directions add up
                    stack.enter_context(steer(model, model_sae, latent, strength))
                if tokens is None:  # (made inside the blocks too: the decoding path is chosen here)
                    idx = torch.tensor([ids], dtype=torch.long, device=model.device)
                    g = torch.Generator(device=model.device).manual_seed(int(seed))
                    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=g)
                    tokens = stream(model, idx, max_new_tokens, **kw)
                t = next(tokens, None)
                return None if t is None else int(t[0])

        out = []
        while (t := engine.run(step)) is not None:
            out.append(t)
        return out

    steered = generate(steering)
    plain = generate([]) if compare else None
    decode = loaded.tokenizer.decode

    def run(tokens: list[int]) -> dict[str, Any]:
        labels = engine.labels(tokens)
        return {"tokens": tokens, "text": decode(tokens), "labels": [labels[str(t)] for t in tokens]}

    return {
        "sae": sae,
        "hook": model_sae.cfg.hook_name_out or model_sae.cfg.hook_name,
        "steering": [{"latent": int(latent), "strength": float(strength)} for latent, strength in steering],
        "prompt_length": len(ids),
        "steered": run(steered),
        "plain": None if plain is None else run(plain),
    }
