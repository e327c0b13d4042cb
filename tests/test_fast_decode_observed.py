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
from attnlab.interpret import observe_attention, observe_attention_rows, trace_generation
from test_fast_decode import BASE, FAMILIES, make

pytestmark = pytest.mark.slow

FIELDS = ("q", "k", "v", "weights", "head_outputs", "q_positions", "k_positions", "mask")


@pytest.fixture
def steps(monkeypatch):
    """How many compiled steps ran (a spy on FastDecoder._compiled_step), and with observers."""
    count = {"steps": 0, "observed": 0}
    step = decoding.FastDecoder._compiled_step

    def spy(self, token, pos, observers, head=True):
        count["steps"] += 1
        count["observed"] += any(fn is not None for fn in observers)
        return step(self, token, pos, observers, head)

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


def row_passes(model, idx, n, **kw):
    """``generate(..., return_logits=True, **kw)`` under :func:`observe_attention_rows`: the output and
    each pass's ``(rows, q_positions, k_positions)``, copied (positions may be views of a cache)."""
    passes = []

    def keep(rows, q_pos, k_pos):
        passes.append(tuple(None if t is None else t.clone() for t in (rows, q_pos, k_pos)))

    with observe_attention_rows(model, keep):
        out = model.generate(idx, n, temperature=0, return_logits=True, **kw)
    return out, passes


@pytest.fixture
def variants(monkeypatch):
    """The compiled graphs the steps ran, by variant (a spy on FastDecoder._static_step)."""
    seen: dict[str, int] = {}
    static = decoding.FastDecoder._static_step

    def spy(self, token, slot, variant="plain", head=True):
        seen[variant] = seen.get(variant, 0) + 1
        return static(self, token, slot, variant, head)

    monkeypatch.setattr(decoding.FastDecoder, "_static_step", spy)
    return seen


@pytest.mark.parametrize(
    "family, dtype, tol",
    [("llama-gqa", torch.float64, 1e-9), ("gpt2-window", torch.float64, 1e-9), ("smollm2-like", torch.float32, 1e-5)],
)
def test_the_rows_variant_hands_each_pass_the_eager_records_last_rows(family, dtype, tol, variants):
    """observe_attention_rows on the compiled step (its rows variant: one output, no record per layer):
    each pass's rows and positions are those of the eager forward's records (observe_attention, the
    last query of every layer stacked), the tokens and logits the same; compiled once."""
    model = make(FAMILIES[family], dtype=dtype)
    idx = torch.randint(0, BASE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(6))
    (ref, ref_logits), records = observed_generation(model, idx, 10, fast=False)
    L = len(model.trf_blocks)
    assert len(records) % L == 0
    want = [records[i : i + L] for i in range(0, len(records), L)]  # the passes, each layer's record
    before = graphs()
    (ids, logits), passes = row_passes(model, idx, 10, compile=True)
    assert torch.equal(ids, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=tol, atol=tol)
    assert len(passes) == len(want)
    for (rows, q_pos, k_pos), layers in zip(passes, want, strict=True):
        expected = torch.stack([r.weights[:, :, -1] for _, r in layers])  # (L, B, H, S)
        assert rows.dtype == expected.dtype and rows.shape == expected.shape
        torch.testing.assert_close(rows, expected, rtol=tol, atol=tol)
        first = layers[0][1]
        for got, ref_pos in ((q_pos, first.q_positions), (k_pos, first.k_positions)):
            assert (got is None) == (ref_pos is None) and (got is None or torch.equal(got, ref_pos))
    assert variants.get("rows", 0) > 0 and "observed" not in variants
    assert graphs() - before == 1  # the rows variant, once


def test_rows_with_an_observer_set_before_come_from_its_records(variants):
    """An observer already on a layer keeps getting its records (the observed variant runs), and the
    rows are the same as without it."""
    model = make(FAMILIES["llama-gqa"])
    idx = torch.randint(0, BASE["vocab_size"], (1, 4), generator=torch.Generator().manual_seed(7))
    (ref, _), ref_passes = row_passes(model, idx, 6, fast=False)
    records = []
    model.trf_blocks[1].att.observer = lambda m, r: records.append(r)
    try:
        (ids, _), passes = row_passes(model, idx, 6, compile=True)
    finally:
        model.trf_blocks[1].att.observer = None
    assert torch.equal(ids, ref) and len(records) == len(passes) == len(ref_passes) == 6
    for (rows, *_), (ref_rows, *_) in zip(passes, ref_passes, strict=True):
        torch.testing.assert_close(rows, ref_rows, rtol=1e-9, atol=1e-9)
    assert variants.get("observed", 0) > 0 and "rows" not in variants
    assert records[-1].weights.shape[2] == 1  # (the decoding steps' records: one query each)


@pytest.mark.parametrize("kw", [{"fast": False}, {}, {"compile": True}])
@pytest.mark.parametrize("sinks", [0, 2])
def test_rows_of_layers_over_different_keys_are_laid_on_the_widest_layers_keys(kw, sinks):
    """Gemma 3's window layers keep fewer keys than its global one once the text is longer than the
    window: each layer's row laid on the global layer's keys by position (its record's weights where it
    holds the key, 0 outside its window), the positions handed the global layer's; the eager forward's
    rows, the fast step's and the compiled one's alike; trace_generation plays such a generation back.
    With 2 sinks and a context of 8, every layer's ring has 8 slots, holding the tokens in other ones."""
    extra = {"sinks": 2, "context_length": 8} if sinks else {}
    model = make({**FAMILIES["gemma3"], **extra})  # window 6 on layers 0 and 1, layer 2 global
    idx = torch.randint(0, BASE["vocab_size"], (2, 7 if sinks else 9), generator=torch.Generator().manual_seed(8))
    records: list[list] = []

    def record(layer, r):
        if layer == 0:
            records.append([])
        records[-1].append((r.weights[:, :, -1].clone(), r.k_positions.clone(), r.q_positions.clone()))

    with observe_attention(model, record, last_query=True):
        want = model.generate(idx, 4, temperature=0, fast=False)
    (ids, _), passes = row_passes(model, idx, 4, **kw)
    assert torch.equal(ids, want) and len(passes) == len(records) == 4
    for (rows, q_pos, k_pos), layers in zip(passes, records, strict=True):
        wide = max(layers, key=lambda t: t[0].shape[-1])
        assert rows.shape == (3, 2, *wide[0].shape[1:]) and torch.equal(k_pos.expand(2, -1), wide[1].expand(2, -1))
        assert torch.equal(q_pos.expand(2, -1), wide[2].expand(2, -1))
        for row, (w, pos, _) in zip(rows, layers, strict=True):
            for b in range(2):
                mine, theirs = pos.expand(2, -1)[b].tolist(), k_pos.expand(2, -1)[b].tolist()
                cols = [theirs.index(p) for p in mine if p >= 0]
                torch.testing.assert_close(row[b][:, cols], w[b][:, [i for i, p in enumerate(mine) if p >= 0]])
                rest = [c for c in range(len(theirs)) if c not in cols]
                assert torch.all(row[b][:, rest] == 0)
            torch.testing.assert_close(row.sum(-1), torch.ones_like(row.sum(-1)))  # every key it attended is there
    played = trace_generation(model, idx, 4, temperature=0)
    assert torch.equal(played.tokens, want)
    for step in played.steps:
        S = step.weights.shape[-1]
        assert step.key_start == step.position - S
        assert torch.equal(step.key_index, torch.arange(step.position - S, step.position).expand(2, S))


def test_precompile_of_the_rows_variant_over_caches_of_several_sizes_compiles_the_observed_one():
    """A model whose window layers keep fewer slots: its stream's steps run the "observed" variant (no
    (L, B, H, S) stack), so precompile("rows") compiles that one, not an error that would leave a server
    without its compiled step."""
    with torch.inference_mode():
        for family, want in (("gemma3", "observed"), ("smollm2-like", "rows")):
            model = make(FAMILIES[family])
            decoder = decoding.FastDecoder(model, model.new_kv_caches(1, 256), compile=True)
            assert decoder.even == (want == "rows")
            ran: list[str] = []
            decoder._static_step = lambda token, slot, variant="plain", ran=ran: ran.append(variant)  # (no compiling)
            decoder.precompile("rows")
            assert ran == [want]


def test_precompile_of_the_rows_variant_and_a_bad_variant(variants):
    """precompile("rows"): the stream's generation afterwards compiles nothing; an unknown variant is a
    ValueError naming the argument."""
    model = make({**FAMILIES["smollm2-like"], "emb_dim": 40})
    idx = torch.randint(0, BASE["vocab_size"], (1, 7), generator=torch.Generator().manual_seed(9))
    (ref, _), ref_passes = row_passes(model, idx, 5, fast=False)
    with torch.inference_mode():
        decoder = decoding.FastDecoder(model, model.new_kv_caches(1, 256), compile=True)
        decoder.precompile("rows")
        before = graphs()
        (ids, _), passes = row_passes(model, idx, 5, compile=True)
        with pytest.raises(ValueError, match="variant must be one of"):
            decoder.precompile("records")
    assert graphs() == before and torch.equal(ids, ref) and len(passes) == len(ref_passes)
    for (rows, *_), (ref_rows, *_) in zip(passes, ref_passes, strict=True):
        torch.testing.assert_close(rows, ref_rows, rtol=1e-9, atol=1e-9)
