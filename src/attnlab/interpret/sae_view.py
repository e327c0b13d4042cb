"""Dashboards of an SAE's latents: what each one reads and what it writes, streamed over a corpus.

For each chosen latent: its top-activating contexts (the tokens around each of its strongest
activations, with the latent's activation on every one of them, for shading), a histogram of its
nonzero activations, its density (the fraction of tokens on which it fires), and the tokens it
promotes and suppresses through the unembedding (``W_dec[latent] @ W_U``, the final norm's gain not
folded in).

The corpus is read in windows of ``context`` tokens, ``batch`` windows at a time; memory stays
bounded whatever its length: a running top-k per latent (with its contexts), fixed histogram bins
(log-spaced, so one set of bins fits latents of any scale) and counts. The model runs only up to the
SAE's hook point (the pass is stopped there), so a latent of an early layer costs less.

:func:`dashboard_data` gathers the figures; :func:`dashboard_page` renders the offline page (the files
``assets/sae_dashboard.{html,css,js}``, everything inline, no network).

The inspector page shows an SAE too, in its Features view (``assets/features.{js,css}``, which draws a
dashboard with ``sae_dashboard.js``): :func:`features_section` gathers, for one prompt, each token's
strongest latents (:func:`strongest_latents`) and the dashboards of the latents they list, over the
prompt and over a corpus; ``attnlab viz --sae`` and ``attnlab serve --sae`` show them.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from string import Template
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

from attnlab.files import atomic_write_text
from attnlab.interpret.hooks import activation_at, eval_mode
from attnlab.interpret.inspector import token_label, token_strings
from attnlab.interpret.page import OFFLINE_CSP, inline, json_for_script
from attnlab.interpret.sae import SAE, check_sae

__all__ = [
    "DASHBOARD_ASSETS",
    "LatentStats",
    "collect",
    "dashboard_data",
    "dashboard_page",
    "features_section",
    "features_sections",
    "latent_logits",
    "prompt_latents",
    "read_dashboard_data",
    "save_dashboard",
    "stats_dashboard",
    "strongest_latents",
]

DASHBOARD_ASSETS = ("sae_dashboard.html", "sae_dashboard.css", "sae_dashboard.js")
# Histogram bins of log10(activation): 1e-4 .. 1e4, 64 bins (values outside go to the end bins).
LOG_LO, LOG_HI, BINS = -4.0, 4.0, 64


@dataclass
class LatentStats:
    """What streaming the corpus gathered, for ``n`` chosen latents.

    Attributes:
        latents: ``(n,)`` the latents' indices in the SAE.
        top_values: ``(n, k)`` each latent's strongest activations, descending (0 where fewer fired).
        top_positions: ``(n, k)`` the token index in the corpus of each (-1 where none).
        context_acts: ``(n, k, 2w+1)`` the latent's activation on the tokens around each, ``w`` each side.
        context_ids: ``(n, k, 2w+1)`` those tokens' ids (-1 outside the window they were read in).
        histogram: ``(n, BINS)`` counts of nonzero activations by log10 bin (``LOG_LO`` .. ``LOG_HI``).
        fired: ``(n,)`` on how many tokens each latent was nonzero; tokens: tokens read.
    """

    latents: Tensor
    top_values: Tensor
    top_positions: Tensor
    context_acts: Tensor
    context_ids: Tensor
    histogram: Tensor
    fired: Tensor
    tokens: int = 0

    @classmethod
    def empty(cls, latents: Tensor, k: int, window: int) -> LatentStats:
        n, span = latents.numel(), 2 * window + 1
        return cls(
            latents=latents,
            top_values=torch.zeros(n, k),
            top_positions=torch.full((n, k), -1, dtype=torch.long),
            context_acts=torch.zeros(n, k, span),
            context_ids=torch.full((n, k, span), -1, dtype=torch.long),
            histogram=torch.zeros(n, BINS, dtype=torch.long),
            fired=torch.zeros(n, dtype=torch.long),
        )

    def select(self, rows: Sequence[int]) -> LatentStats:
        """The statistics of the latents at ``rows`` (positions in :attr:`latents`, not latent indices)."""
        r = torch.as_tensor(list(rows), dtype=torch.long)
        return LatentStats(
            latents=self.latents[r],
            top_values=self.top_values[r],
            top_positions=self.top_positions[r],
            context_acts=self.context_acts[r],
            context_ids=self.context_ids[r],
            histogram=self.histogram[r],
            fired=self.fired[r],
            tokens=self.tokens,
        )

    def narrowed(self, top_k: int, window: int) -> LatentStats:
        """The statistics :func:`collect` gathers with fewer examples (``top_k``) and a narrower ``window``
        (each at most this one's): the strongest ``top_k`` examples, the ``2 * window + 1`` tokens around
        each (the same numbers, ties between equal activations aside)."""
        w = self.context_acts.shape[2] // 2
        if not (top_k <= self.top_values.shape[1] and window <= w):
            raise ValueError(f"top_k={top_k} and window={window} must be at most {self.top_values.shape[1]} and {w}")
        around = slice(w - window, w + window + 1)
        return replace(
            self,
            top_values=self.top_values[:, :top_k],
            top_positions=self.top_positions[:, :top_k],
            context_acts=self.context_acts[:, :top_k, around],
            context_ids=self.context_ids[:, :top_k, around],
        )

    @property
    def density(self) -> Tensor:
        """``(n,)`` the fraction of tokens on which each latent fired."""
        return self.fired.double() / max(self.tokens, 1)

    def update(self, acts: Tensor, idx: Tensor, first: int) -> None:
        """Fold in one batch: ``acts (B, T, n)`` the chosen latents on ``idx (B, T)``, whose first token
        is token ``first`` of the corpus (the windows follow each other)."""
        B, T, n = acts.shape
        k, span = self.top_values.shape[1], self.context_acts.shape[2]
        w = span // 2
        acts, idx = acts.float().cpu(), idx.cpu()  # the statistics live on the CPU, whatever the model's device
        flat = acts.reshape(B * T, n)  # (N, n)
        nonzero = flat != 0
        self.fired += nonzero.sum(0)
        self.tokens += B * T
        # Histogram: every nonzero activation into its log10 bin, per latent.
        rows, cols = nonzero.nonzero(as_tuple=True)
        if rows.numel():
            logs = flat[rows, cols].abs().clamp_min(1e-30).log10()
            bins = ((logs - LOG_LO) / (LOG_HI - LOG_LO) * BINS).long().clamp(0, BINS - 1)
            self.histogram.view(-1).index_add_(0, cols * BINS + bins, torch.ones_like(bins))
        # This batch's top k of each latent, with the activations and ids around each (same window only).
        kk = min(k, B * T)
        values, where = flat.topk(kk, dim=0)  # (kk, n) each
        values, where = values.T, where.T  # (n, kk)
        b, t = where // T, where % T  # (n, kk)
        offsets = torch.arange(-w, w + 1)  # (span,)
        tt = t[..., None] + offsets  # (n, kk, span)
        inside = (tt >= 0) & (tt < T)
        ttc = tt.clamp(0, T - 1)
        bb = b[..., None].expand_as(ttc)
        lat = torch.arange(n)[:, None, None].expand_as(ttc)
        ctx_acts = torch.where(inside, acts[bb, ttc, lat], torch.zeros(()))  # (n, kk, span)
        ctx_ids = torch.where(inside, idx[bb, ttc], torch.full((), -1))  # (n, kk, span)
        positions = first + b * T + t  # (n, kk)
        # Merge with what was kept: the k largest of both, values descending.
        all_values = torch.cat([self.top_values, values], dim=1)  # (n, k + kk)
        keep = all_values.topk(k, dim=1).indices  # (n, k)
        self.top_values = all_values.gather(1, keep)
        self.top_positions = torch.cat([self.top_positions, positions], 1).gather(1, keep)
        keep3 = keep[..., None].expand(-1, -1, span)
        self.context_acts = torch.cat([self.context_acts, ctx_acts], 1).gather(1, keep3)
        self.context_ids = torch.cat([self.context_ids, ctx_ids], 1).gather(1, keep3)
        dead = self.top_values <= 0  # a latent that fired fewer than k times: no example there
        self.top_positions[dead] = -1
        self.context_ids[dead] = -1


@torch.no_grad()
def strongest_latents(model: nn.Module, sae: SAE, idx: Tensor, n: int = 5) -> tuple[Tensor, Tensor]:
    """Each token's ``n`` strongest latents (what the inspector shows for a token): ``idx (T,)`` or
    ``(1, T)`` -> ``(values (T, n), latents (T, n))``, values descending (0 where fewer fired)."""
    _check_n(n, check_sae(sae, "strongest_latents").cfg.d_sae)
    values, latents = prompt_latents(model, sae, idx).topk(n, dim=-1)  # (T, n) each, descending
    return values.float().cpu(), latents.cpu()


def _check_n(n: object, d_sae: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= d_sae:
        raise ValueError(f"n must be an int in [1, d_sae={d_sae}], got {n!r}")


@torch.no_grad()
def prompt_latents(model: nn.Module, sae: SAE, idx: Tensor) -> Tensor:
    """Every latent on every token of one prompt: ``idx (T,)`` or ``(1, T)`` -> ``(T, d_sae)``, on the
    SAE's device (the model run up to the SAE's hook only)."""
    if not isinstance(idx, Tensor) or idx.dim() not in (1, 2) or (idx.dim() == 2 and idx.shape[0] != 1):
        got = tuple(idx.shape) if isinstance(idx, Tensor) else type(idx).__name__
        raise ValueError(f"idx must be the token ids of one prompt, (T,) or (1, T), got {got}")
    check_sae(sae, "prompt_latents").check_model(model)
    with eval_mode(model):
        x = activation_at(model, sae.cfg.hook_name, idx.reshape(1, -1))  # (1, T, d_in)
    return sae.encode(x)[0]  # (T, d_sae)


def _check_latents(latents: object, d_sae: int) -> Tensor:
    if isinstance(latents, int) and not isinstance(latents, bool):
        if not 1 <= latents <= d_sae:
            raise ValueError(f"latents: a count must be in [1, d_sae={d_sae}], got {latents}")
        return torch.arange(latents)
    chosen = list(latents) if isinstance(latents, (list, tuple, range, Tensor)) else None
    ok = chosen is not None and all(0 <= int(i) < d_sae for i in chosen) and len(set(map(int, chosen))) == len(chosen)
    if not ok or not chosen:
        raise ValueError(f"latents must be a count or distinct indices in [0, {d_sae}), got {latents!r}")
    return torch.tensor([int(i) for i in chosen], dtype=torch.long)


@torch.no_grad()
def collect(
    model: nn.Module,
    sae: SAE,
    tokens: np.ndarray | Tensor,
    latents: int | Sequence[int] = 100,
    *,
    max_tokens: int = 1_000_000,
    context: int = 128,
    batch: int = 16,
    top_k: int = 10,
    window: int = 10,
    progress: Callable[[int], None] | None = None,
) -> LatentStats:
    """Stream ``tokens`` (a 1-D array of ids, e.g. :func:`attnlab.data.tokenize_to_cache`'s memmap) through
    ``model`` up to the SAE's hook and fold each batch's latents into :class:`LatentStats`: at most
    ``max_tokens`` tokens, in windows of ``context``, ``batch`` windows at a time. ``progress(tokens)``
    is called after each batch."""
    chosen = _check_latents(latents, check_sae(sae, "collect").cfg.d_sae)
    for name, v in (("max_tokens", max_tokens), ("context", context), ("batch", batch), ("top_k", top_k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be a non-negative int, got {window!r}")
    sae.check_model(model)
    ids = tokens if isinstance(tokens, Tensor) else torch.from_numpy(np.asarray(tokens).astype(np.int64, copy=False))
    if ids.dim() != 1:
        raise ValueError(f"tokens must be a 1-D array of token ids, got shape {tuple(ids.shape)}")
    n_windows = min(ids.numel(), max_tokens) // context
    if n_windows < 1:
        raise ValueError(
            f"tokens: {min(ids.numel(), max_tokens)} tokens read (of {ids.numel()}, max_tokens={max_tokens}), fewer "
            f"than one window of context={context}"
        )
    device = next(model.parameters()).device
    stats = LatentStats.empty(chosen, top_k, window)
    lat = chosen.to(device)
    with eval_mode(model), eval_mode(sae):
        for w0 in range(0, n_windows, batch):
            w1 = min(w0 + batch, n_windows)
            idx = ids[w0 * context : w1 * context].view(w1 - w0, context).to(device)  # (B, T)
            x = activation_at(model, sae.cfg.hook_name, idx)  # (B, T, d_in)
            z = sae.encode(x)[..., lat]  # (B, T, n) the chosen latents
            stats.update(z, idx, w0 * context)
            if progress is not None:
                progress(stats.tokens)
    return stats


@torch.no_grad()
def latent_logits(model: nn.Module, sae: SAE, latents: Tensor) -> Tensor | None:
    """``(n, V)``: each latent's decoder row through the output head, ``W_dec[latents] @ W_U`` (the
    head applied as a module, so a quantized one works as it is); None where the SAE writes
    something of another width than the residual stream (a transcoder into an MLP's neurons)."""
    head = model.out_head
    if sae.W_dec.shape[-1] != head.weight.shape[-1]:
        return None
    param = next(head.parameters())
    rows = sae.W_dec[latents.to(sae.W_dec.device)].to(device=param.device)  # (n, d)
    if param.is_floating_point():
        rows = rows.to(param.dtype)
    return head(rows).float().cpu()  # (n, V)


def dashboard_data(
    model: nn.Module,
    sae: SAE,
    tokens: np.ndarray | Tensor,
    tokenizer: Any = None,
    latents: int | Sequence[int] = 100,
    *,
    n_logits: int = 10,
    title: str | None = None,
    **collect_kw: Any,
) -> dict[str, Any]:
    """The dashboards' data (plain JSON): :func:`collect` over ``tokens``, then each latent's promoted and
    suppressed tokens (``n_logits`` each). ``tokenizer`` names the tokens (else ``#id``)."""
    stats = collect(model, sae, tokens, latents, **collect_kw)
    return stats_dashboard(model, sae, stats, tokenizer, n_logits=n_logits, title=title)


def stats_dashboard(
    model: nn.Module,
    sae: SAE,
    stats: LatentStats,
    tokenizer: Any = None,
    *,
    n_logits: int = 10,
    title: str | None = None,
) -> dict[str, Any]:
    """:func:`dashboard_data` of statistics already gathered (:func:`collect`; a few of its latents:
    :meth:`LatentStats.select`)."""
    logits = latent_logits(model, sae, stats.latents)  # (n, V), or None: not the stream's width
    up = down = None
    used = [stats.context_ids.flatten()]
    if logits is not None:
        n = min(n_logits, logits.shape[1])  # (a vocabulary smaller than the tokens asked for: all of it)
        up, down = logits.topk(n, dim=1), (-logits).topk(n, dim=1)
        used += [up.indices.flatten(), down.indices.flatten()]
    used = torch.cat(used)
    vocab = sorted({int(i) for i in used.unique().tolist() if i >= 0})
    strings = dict(zip(vocab, (token_label(s) for s in token_strings(tokenizer, vocab)), strict=True))
    edges = [10 ** (LOG_LO + (LOG_HI - LOG_LO) * i / BINS) for i in range(BINS + 1)]
    out = []
    for r, latent in enumerate(stats.latents.tolist()):
        examples = []
        for e in range(stats.top_values.shape[1]):
            if int(stats.top_positions[r, e]) < 0:
                continue
            ids = stats.context_ids[r, e].tolist()
            examples.append(
                {
                    "value": round(float(stats.top_values[r, e]), 5),
                    "position": int(stats.top_positions[r, e]),
                    "tokens": [strings[i] if i >= 0 else None for i in ids],
                    "acts": [round(float(a), 4) for a in stats.context_acts[r, e].tolist()],
                }
            )
        hist = stats.histogram[r]
        nz = hist.nonzero().flatten()
        lo, hi = (int(nz[0]), int(nz[-1]) + 1) if nz.numel() else (0, 0)
        out.append(
            {
                "latent": latent,
                "density": float(stats.density[r]),
                "max": round(float(stats.top_values[r, 0]), 5),
                "examples": examples,
                "hist": {"lo": edges[lo], "hi": edges[hi], "counts": hist[lo:hi].tolist()},
                "promotes": None
                if up is None
                else [[strings[int(i)], round(float(v), 4)] for v, i in zip(up.values[r], up.indices[r], strict=True)],
                "suppresses": None
                if down is None
                else [
                    [strings[int(i)], round(float(-v), 4)] for v, i in zip(down.values[r], down.indices[r], strict=True)
                ],
            }
        )
    return {
        "title": title or f"SAE latents at {sae.cfg.hook_name}",
        "hook": sae.cfg.hook_name,
        "d_sae": sae.cfg.d_sae,
        "tokens": stats.tokens,
        "latents": out,
    }


# The Features view's one line on steering: an offline page holds numbers, it cannot run the model.
STEERING_OFFLINE = (
    "Steering runs the model: attnlab generate --steer SAE_DIR:LATENT:STRENGTH, or the Features tab of "
    "attnlab serve --sae DIR."
)


def features_section(
    model: nn.Module,
    sae: SAE,
    idx: Tensor,
    tokenizer: Any = None,
    *,
    name: str | None = None,
    n: int = 5,
    max_latents: int = 256,
    top_k: int = 5,
    window: int = 8,
    n_logits: int = 8,
    corpus: np.ndarray | Tensor | None = None,
    corpus_name: str | None = None,
    corpus_tokens: int = 65_536,
    context: int = 128,
) -> dict[str, Any]:
    """The inspector's Features view of one SAE on one prompt ``idx (T,)`` or ``(1, T)`` (plain JSON).

    ``values``, ``latents`` ``(T, n)``: each token's ``n`` strongest latents (:func:`strongest_latents`'s
    figures). The latents that appear there (at most ``max_latents``, the strongest first) get a
    dashboard (:func:`dashboard_data`'s entries, in the order of ``shown``): over the prompt's own tokens,
    and with ``corpus`` (1-D token ids) over its first ``corpus_tokens`` tokens in windows of
    ``context``; ``acts`` ``(len(shown), T)``: each one's activation on every token of the prompt (the
    page shades the tokens by it).
    """
    _check_n(n, sae.cfg.d_sae)
    if not isinstance(max_latents, int) or isinstance(max_latents, bool) or max_latents < 1:
        raise ValueError(f"max_latents must be a positive int, got {max_latents!r}")
    z = prompt_latents(model, sae, idx)  # (T, d_sae)
    values, latents = z.topk(n, dim=-1)  # (T, n) each: strongest_latents's figures, from the same pass
    values, latents, z = values.float().cpu(), latents.cpu(), z.float().cpu()
    ids = idx.reshape(-1).cpu()
    # The latents a token lists (fired), each once, by its largest activation on the prompt.
    listed = latents[values > 0].unique()
    shown = listed[z[:, listed].amax(0).argsort(descending=True)][:max_latents].tolist()
    dashboards: dict[str, Any] = {"prompt": [], "corpus": None}
    corpus_info = None
    if shown:
        common = dict(top_k=top_k, window=window, n_logits=n_logits)
        dashboards["prompt"] = dashboard_data(model, sae, ids, tokenizer, shown, context=len(ids), **common)["latents"]
        if corpus is not None:
            longest = getattr(getattr(model, "config", None), "context_length", context)  # windows the model reads
            ctx = min(context, longest, len(corpus), corpus_tokens)
            data = dashboard_data(
                model, sae, corpus, tokenizer, shown, context=ctx, max_tokens=corpus_tokens, **common
            )  # fmt: skip
            dashboards["corpus"] = data["latents"]
            corpus_info = {"name": corpus_name or "the corpus", "tokens": data["tokens"]}
    return {
        "name": name or sae.cfg.hook_name,
        "hook": sae.cfg.hook_name,
        "d_sae": sae.cfg.d_sae,
        "architecture": sae.cfg.architecture,
        "transcoder": sae.cfg.transcoder,
        "n": n,
        "values": values.tolist(),
        "latents": latents.tolist(),
        "shown": shown,
        "acts": [[round(float(a), 5) for a in row] for row in z[:, shown].T.tolist()],
        "dashboards": dashboards,
        "corpus": corpus_info,
        "steering": STEERING_OFFLINE,
    }


def features_sections(
    model: nn.Module,
    saes: Mapping[str, SAE] | Sequence[SAE],
    idx: Tensor,
    tokenizer: Any = None,
    *,
    corpus: np.ndarray | Tensor | None = None,
    **options: Any,
) -> list[dict[str, Any]]:
    """The inspector page's ``features`` (its Features view): one :func:`features_section` per SAE
    (``saes`` by name, or a list), on the prompt ``idx (T,)``; ``options``: its keywords. A page's data::

        data = inspector_data(tr)
        data["features"] = features_sections(model, {"L6 resid": sae}, tr.idx[0], tokenizer)
    """
    named = list(saes.items()) if isinstance(saes, Mapping) else [(None, sae) for sae in saes]
    for _, sae in named:
        if not isinstance(sae, SAE):
            raise TypeError(f"saes must hold attnlab SAEs, got {type(sae).__name__}")
    return [features_section(model, sae, idx, tokenizer, name=name, corpus=corpus, **options) for name, sae in named]


def read_dashboard_asset(name: str) -> str:
    """The text of one of the dashboard's files (:data:`DASHBOARD_ASSETS`), from the installed package."""
    if name not in DASHBOARD_ASSETS:
        raise ValueError(f"name must be one of {', '.join(DASHBOARD_ASSETS)}, got {name!r}")
    return resources.files(__package__).joinpath("assets", name).read_text(encoding="utf-8")


def dashboard_page(data: dict[str, Any]) -> str:
    """The offline page of :func:`dashboard_data`'s ``data``: inline CSS, JS and JSON, no network."""
    return Template(read_dashboard_asset("sae_dashboard.html")).substitute(
        csp=OFFLINE_CSP,
        title=html.escape(data.get("title") or "SAE latents"),
        styles=inline("style", read_dashboard_asset("sae_dashboard.css")),
        data=f'<script type="application/json" id="sae-data">{json_for_script(data)}</script>',
        scripts=inline("script", read_dashboard_asset("sae_dashboard.js")),
    )


def save_dashboard(data: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write :func:`dashboard_page` atomically to ``path``."""
    atomic_write_text(path, dashboard_page(data))
    return Path(path)


def read_dashboard_data(page: str) -> dict[str, Any]:
    """The data embedded in a page written by :func:`dashboard_page`."""
    start = page.index('id="sae-data">') + len('id="sae-data">')
    return json.loads(page[start : page.index("</script>", start)])
