"""The logit lens's cached centred unembedding (``analysis._CENTRED``): made once per head, never served
stale. Each lens is held to the same lens computed with an empty cache (the same operations: equal
bit for bit), and every edit is checked to change the lens, so a stale copy would show."""

from __future__ import annotations

import weakref

import pytest
import torch

from attnlab.interpret import analysis, logit_lens, trace
from test_interpret_chunked import llama_like


def fresh(model, tr, monkeypatch):
    """The lens made with nothing cached (the cache itself left as it was)."""
    kept = analysis._CENTRED
    monkeypatch.setattr(analysis, "_CENTRED", weakref.WeakKeyDictionary())
    try:
        return logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    finally:
        monkeypatch.setattr(analysis, "_CENTRED", kept)


def same(a, b) -> bool:
    names = ("tokens", "probs", "final_token_probs")
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in names)


@pytest.fixture
def setup():
    model = llama_like()
    idx = torch.randint(0, 700, (1, 21), generator=torch.Generator().manual_seed(7))
    return model, idx


def test_the_centred_unembedding_is_made_once_per_head(setup, monkeypatch):
    model, idx = setup
    tr = trace(model, idx, stages=True)
    first = logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    entry = analysis._CENTRED[model.out_head]
    again = logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    assert analysis._CENTRED[model.out_head] is entry  # served, not made again
    assert same(first, again) and same(first, fresh(model, tr, monkeypatch))
    torch.testing.assert_close(
        first.probs, logit_lens(model, tr, k=5, search_dtype=torch.float32).probs, rtol=1e-3, atol=1e-6
    )


def edit_data(W: torch.Tensor, row: int) -> None:
    W.data[row] = 3.0 * W.data[0]  # through .data: no version counter moves


def edit_copy(W: torch.Tensor, row: int) -> None:
    with torch.no_grad():
        W[row].copy_(3.0 * W[0])


def edit_one_bit(W: torch.Tensor, row: int) -> None:
    bits = W.data.view(torch.int32)
    bits[row, 5] ^= 1 << 22  # one element's mantissa, through a view the version counter never sees


@pytest.mark.parametrize("edit", [edit_data, edit_copy, edit_one_bit])
def test_an_edited_weight_is_never_served_from_a_stale_cache(setup, monkeypatch, edit):
    model, idx = setup
    tr = trace(model, idx, stages=True)
    before = logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    old = analysis._CENTRED[model.out_head]
    edit(model.out_head.weight, 17)  # tied: the embedding changes too, but the trace is the old one
    after = logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    assert analysis._CENTRED[model.out_head] is not old  # remade
    want = fresh(model, tr, monkeypatch)
    assert not same(before, want)  # the edit changes the lens: a stale cache would show
    assert same(after, want)


def test_a_replaced_weight_is_never_served_from_a_stale_cache(setup, monkeypatch):
    model, idx = setup
    tr = trace(model, idx, stages=True)
    before = logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    W = model.out_head.weight.detach().clone()
    W[3] = -2.0 * W[4]
    model.out_head.weight = torch.nn.Parameter(W)  # untied now: a new tensor at a new address
    after = logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    want = fresh(model, tr, monkeypatch)
    assert not same(before, want) and same(after, want)


def test_other_repeated_dimensions_remake_only_those_columns(setup, monkeypatch):
    model, idx = setup
    tr = trace(model, idx, stages=True)
    logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    old = analysis._CENTRED[model.out_head]
    # Another stream whose largest dimensions are others: the repeated columns must follow them.
    tr.residual = tr.residual.clone()
    quiet = [j for j in range(tr.residual.shape[-1]) if j not in old.dims.tolist()][:4]
    tr.residual[..., quiet] *= 40.0
    got = logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    new = analysis._CENTRED[model.out_head]
    assert not torch.equal(new.dims, old.dims) and set(quiet) <= set(new.dims.tolist())
    assert new.mean is old.mean  # the weight did not change: only the columns were remade
    assert same(got, fresh(model, tr, monkeypatch))


def test_a_cache_made_in_inference_mode_serves_outside_it(setup, monkeypatch):
    model, idx = setup
    with torch.inference_mode():
        tr = trace(model, idx, stages=True)
        inside = logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    tr = trace(model, idx, stages=True)
    outside = logit_lens(model, tr, k=5, search_dtype=torch.bfloat16)
    assert same(inside, outside)
    edit_data(model.out_head.weight, 9)  # and an edit after it is still seen
    assert same(logit_lens(model, tr, k=5, search_dtype=torch.bfloat16), fresh(model, tr, monkeypatch))


def test_the_cache_lets_the_model_go():
    model = llama_like(vocab=300)
    tr = trace(model, torch.arange(9)[None], stages=True)
    logit_lens(model, tr, k=3, search_dtype=torch.bfloat16)
    head = weakref.ref(model.out_head)
    assert head() in analysis._CENTRED
    del model, tr
    import gc

    gc.collect()
    assert head() is None
