"""The text report of ``attnlab inspect``: head roles, the logit lens, rollout and ablation, as tables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnlab.interpret import (
    HEAD_KINDS,
    ablation_effect,
    all_head_scores,
    logit_lens,
    parse_heads,
    rollout,
    token_label,
    token_strings,
    trace,
)
from attnlab.tools.loading import LoadedModel, model_name
from attnlab.tools.viz.inspector import encode_prompt

__all__ = ["InspectReport", "inspect_report"]


@dataclass
class InspectReport:
    """What ``attnlab inspect`` prints, as numbers (``format()`` gives the text)."""

    name: str
    tokens: list[str]
    roles: dict[str, torch.Tensor]  # kind -> (L, H)
    role_seed: int
    position: int
    lens_rows: list[list[tuple[str, float]]]  # per layer, top-k (token, probability)
    token: int
    fusion: str
    rollout_row: torch.Tensor  # (T,)
    ablation: Any = None  # AblationEffect or None
    ablation_labels: tuple[list[str], list[str]] | None = None
    # Per SAE: (its name, its hook, values (T, n), latents (T, n)): each token's strongest latents.
    latents: list[tuple[str, str, torch.Tensor, torch.Tensor]] | None = None

    def format(self, top: int = 5) -> str:
        L, H = self.roles[HEAD_KINDS[0]].shape
        labels = [token_label(t) for t in self.tokens]
        lines = [f"{self.name}: {L} layers x {H} heads, {len(self.tokens)} tokens"]
        lines.append("tokens: " + "  ".join(f"{i}:{label}" for i, label in enumerate(labels)))
        lines += [
            "",
            f"Head roles: mean attention to each role's target keys (random tokens repeated twice, "
            f"seed {self.role_seed})",
        ]
        for kind in HEAD_KINDS:
            s = self.roles[kind]
            lines.append(f"  {kind:<16}" + "".join(f"{'h' + str(h):>5}" for h in range(H)))
            for layer in range(L):
                lines.append(f"  layer {layer:<10}" + "".join(f"{float(v):5.2f}" for v in s[layer]))
        lines += ["", "Strongest heads of each role (layer.head score)"]
        for kind in HEAD_KINDS:
            s = self.roles[kind].flatten()
            best = torch.topk(s, min(3, s.numel()))
            cells = [
                f"{int(i) // H}.{int(i) % H} {float(v):.2f}" for v, i in zip(best.values, best.indices, strict=True)
            ]
            lines.append(f"  {kind:<16}  " + "   ".join(cells))
        p = self.position
        lines += [
            "",
            f"Logit lens at position {p} ({labels[p]}): the likeliest next tokens read from each layer's "
            "residual stream",
        ]
        names = ["embeddings", *[f"after layer {i}" for i in range(L)]]
        for i, (name, row) in enumerate(zip(names, self.lens_rows, strict=True)):
            tail = " (= output)" if i == L else ""
            lines.append(f"  {name + tail:<26}" + "  ".join(f"{token_label(t)[:12]} {v:.3f}" for t, v in row))
        t = self.token
        order = torch.argsort(self.rollout_row, descending=True)[: max(top, 1) * 2]
        lines += [
            "",
            f"Rollout row of token {t} ({labels[t]}), heads fused by {self.fusion}: how much each input "
            "position flows into it at the top",
        ]
        lines.append("  " + "  ".join(f"{int(j)}:{labels[int(j)]} {float(self.rollout_row[j]):.3f}" for j in order))
        if self.ablation is not None:
            e = self.ablation
            heads = ", ".join(f"{layer}.{h}" for layer, h in e.heads)
            lines += ["", f"Ablating {heads} ({e.mode}):"]
            if e.loss_before is not None:
                lines.append(
                    f"  loss {e.loss_before:.4f} -> {e.loss_after:.4f} nats/token ({e.loss_change:+.4f}); "
                    f"next-token KL(before || after) at the last position {float(e.kl[0]):.4f}"
                )
            else:
                lines.append(f"  next-token KL(before || after) {float(e.kl[0]):.4f} (one token: no loss)")
            before, after = self.ablation_labels
            for when, names, best in (("before:", before, e.top(top)), ("after: ", after, e.top(top, after=True))):
                cells = [f"{token_label(s)} {p:.3f}" for s, (_, p) in zip(names, best, strict=True)]
                lines.append(f"  top next tokens {when} " + "  ".join(cells))
        for name, hook, values, latents in self.latents or []:
            lines += ["", f"Strongest latents of the SAE {name} at {hook} (latent #index: activation), token by token"]
            for t, label in enumerate(labels):
                cells = [f"#{int(i)}: {float(v):.3f}" for v, i in zip(values[t], latents[t], strict=True) if v > 0]
                lines.append(f"  {t:>3} {label[:14]:<14}  " + ("  ".join(cells) or "(none active)"))
        return "\n".join(lines)


def inspect_report(
    loaded: LoadedModel,
    prompt: str,
    *,
    position: int = -1,
    token: int = -1,
    top: int = 5,
    fusion: str = "mean",
    ablate: str | None = None,
    ablate_mode: str = "zero",
    role_seed: int = 0,
    saes: dict[str, Any] | None = None,
) -> InspectReport:
    """Trace ``prompt`` and read it: head roles, the logit lens at ``position``, the rollout row of
    ``token``; with ``ablate`` (``"L.H[,L.H...]"``) the effect of removing those heads; with ``saes``
    (name -> SAE, on the model's device) each token's ``top`` strongest latents of each."""
    model, tok = loaded.model, loaded.tokenizer
    idx = encode_prompt(loaded, prompt)
    T = idx.shape[1]
    for name, value in (("--position", position), ("--token", token)):
        if not -T <= value < T:
            raise ValueError(f"{name} {value} is out of range: the prompt has {T} tokens (0..{T - 1}, or -1)")
    # --ablate's heads are checked before the slow part.
    heads = None if ablate is None else parse_heads(ablate, model.config.n_layers, model.config.n_heads)
    tr = trace(model, idx, stages=True, tokenizer=tok)
    roles = all_head_scores(model, seed=role_seed)
    position, token = position % T, token % T
    lens = logit_lens(model, tr, k=top)
    top_ids, top_probs = lens.tokens[:, 0, position].tolist(), lens.probs[:, 0, position].tolist()  # (L + 1, k)
    lens_rows = [list(zip(token_strings(tok, i), p, strict=True)) for i, p in zip(top_ids, top_probs, strict=True)]
    effect, labels = None, None
    if heads is not None:
        effect = ablation_effect(model, idx, heads, mode=ablate_mode)
        labels = tuple(token_strings(tok, [i for i, _ in effect.top(top, after=after)]) for after in (False, True))
    latents = None
    if saes:
        from attnlab.interpret.sae_view import strongest_latents

        latents = [
            (sae_name, sae.cfg.hook_name, *strongest_latents(model, sae, idx, min(top, sae.cfg.d_sae)))
            for sae_name, sae in saes.items()
        ]
    name = model_name(loaded)
    return InspectReport(
        name=name,
        tokens=token_strings(tok, idx[0].tolist()),
        roles=roles,
        role_seed=role_seed,
        position=position,
        lens_rows=lens_rows,
        token=token,
        fusion=fusion,
        rollout_row=rollout(tr, head_fusion=fusion)[0, token],
        ablation=effect,
        ablation_labels=labels,
        latents=latents,
    )
