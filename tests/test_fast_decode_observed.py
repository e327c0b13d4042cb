"""The compiled decoding step with attention observers (:mod:`attnlab.decoding`): serve's generation
stream and ``trace_generation`` observe every step, and the compiled step serves them.

Against the eager forward (``fast=False``), the reference: the same tokens and logits, and every
observer gets the record the eager forward hands it (q, keys, values, weights, head outputs,
positions, mask), in float64 to rounding and in float32 to its tolerance. The observed variant
compiles once for a generation (no recompilation per step), and :meth:`FastDecoder.precompile`
compiles it ahead, so the generation that follows compiles nothing. Each test compiles (slow).
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from attnlab import decoding
from test_fast_decode import BASE, FAMILIES, make

pytestmark = pytest.mark.slow

FIELDS = ("q", "k", "v", "weights", "head_outputs", "q_positions", "k_positions", "mask")


@pytest.fixture
def steps(monkeypatch):
    """How many compiled steps ran (a spy on FastDecoder._compiled_step), and with observers."""
    count = {"steps": 0, "observed": 0}
    step = decoding.FastDecoder._compiled_step

    def spy(self, token, pos, observers):
        count["steps"] += 1
        count["observed"] += any(fn is not None for fn in observers)
        return step(self, token, pos, observers)

    monkeypatch.setattr(decoding.FastDecoder, "_compiled_step", spy)
    return count


def graphs() -> int:
    """Graphs Dynamo compiled so far in this process."""
    return counters["stats"]["unique_graphs"]


def observed_generation(model, idx, n, layers=None, **kw):
    """``generate(..., return_logits=True, **kw)`` with ``layers``' attention observed (default: all):
    the output and the ``(layer, record)`` pairs in call order."""
    records = []
    chosen = range(len(model.trf_blocks)) if layers is None else layers
    for i in chosen:
        model.trf_blocks[i].att.observer = lambda m, r, i=i: records.append((i, r))
    try:
        out = model.generate(idx, n, temperature=0, return_logits=True, **kw)
    finally:
        for i in chosen:
            model.trf_blocks[i].att.observer = None
    return out, records


def assert_same_records(ref, got, tol):
    assert len(got) == len(ref) > 0
    for (la, a), (lb, b) in zip(ref, got, strict=True):
        assert la == lb and a.is_causal == b.is_causal and a.scale == b.scale and a.softcap == b.softcap
        for name in FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert y.dtype == x.dtype and y.shape == x.shape, name
                torch.testing.assert_close(y, x, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize(
    "family, dtype, tol",
    [("llama-gqa", torch.float64, 1e-9), ("gpt2-window", torch.float64, 1e-9), ("smollm2-like", torch.float32, 1e-5)],
)
def test_observed_compiled_steps_hand_over_the_eager_records(family, dtype, tol, steps):
    """Every layer observed: the compiled step's tokens, logits and records are the eager forward's; the
    observed variant compiled once for all the steps. (gpt2-window: learned positions, the head in the
    layers' call, and the window's end hands the steps back to the eager fast path.)"""
    model = make(FAMILIES[family], dtype=dtype)
    idx = torch.randint(0, BASE["vocab_size"], (3, 5), generator=torch.Generator().manual_seed(3))
    (ref, ref_logits), ref_records = observed_generation(model, idx, 12, fast=False)
    before = graphs()
    (ids, logits), records = observed_generation(model, idx, 12, compile=True)
    assert torch.equal(ids, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=tol, atol=tol)
    assert_same_records(ref_records, records, tol)
    assert steps["observed"] == steps["steps"] > 0 and (family == "gpt2-window" or steps["steps"] == 11)
    assert graphs() - before == 1  # the observed variant, once: no recompilation per step
    (again, _), _ = observed_generation(model, idx, 12, compile=True)
    assert torch.equal(again, ref) and graphs() - before == 1


def test_some_layers_observed_in_groups_of_layers(steps, monkeypatch):
    """Layers in several compiled calls and the head a call of its own: the observers of the layers
    that have one get the eager records, the others nothing; then observers gone, the plain variant."""
    monkeypatch.setattr(decoding, "_GROUP", 1)
    model = make(FAMILIES["smollm2-like"], seed=4)
    idx = torch.randint(0, BASE["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(4))
    (ref, ref_logits), ref_records = observed_generation(model, idx, 9, layers=[0, 2], fast=False)
    (ids, logits), records = observed_generation(model, idx, 9, layers=[0, 2], compile=True)
    assert torch.equal(ids, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-9, atol=1e-9)
    assert_same_records(ref_records, records, 1e-9)
    assert {layer for layer, _ in records} == {0, 2} and steps["observed"] == 8
    plain = model.generate(idx, 9, temperature=0, compile=True)
    assert torch.equal(plain, ref) and steps["steps"] == 16 and steps["observed"] == 8


def test_precompile_compiles_ahead(steps):
    """A decoder's precompile(observed=True) on caches of its own, in inference mode: the generation of
    the same shapes afterwards (in inference mode, as a server runs it) compiles nothing, and its
    caches and the model are as before."""
    model = make({**FAMILIES["llama-gqa"], "emb_dim": 32})
    idx = torch.randint(0, BASE["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(5))
    (ref, ref_logits), ref_records = observed_generation(model, idx, 6, fast=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.inference_mode():
        caches = model.new_kv_caches(2, 256)  # the slots generate(compile=True) gives 7 + 6 tokens
        decoder = decoding.FastDecoder(model, caches, compile=True)
        decoder.precompile("observed")
        assert all(c.seen == 0 and bool((c.positions == -1).all()) for c in caches)
        before = graphs()
        (ids, logits), records = observed_generation(model, idx, 6, compile=True)
    assert graphs() == before and steps["observed"] == 5  # (precompile runs the compiled calls alone)
    assert torch.equal(ids, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-9, atol=1e-9)
    assert_same_records(ref_records, records, 1e-9)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="compile=True"):
        decoding.FastDecoder(model, caches).precompile()
