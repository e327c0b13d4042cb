"""Edge attribution (EAP, EAP-IG) and circuits, against a float64 reference written here.

The reference runs a small GPT head by head: every reader (each head's query, key and value input,
each MLP, the logits) gets its own copy of the residual stream, so an edge's contribution can be
changed alone and differentiated with autograd, and a circuit can be run edge by edge. It uses the
model's weights and norms, none of attnlab.interpret.circuits.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.interpret import (
    MIB_BUDGETS,
    Circuit,
    EdgeGraph,
    circuit_metrics,
    edge_attribution,
    faithfulness,
    faithfulness_curve,
    logit_diff,
)

V, T = 37, 7
STYLES = {
    "gpt2": {},
    "llama-gqa": dict(pos="rope", norm="rmsnorm", mlp="swiglu", n_kv_heads=2, bias=False),
    "parallel": dict(parallel_residual=True, n_layers=3),
}


@pytest.fixture(scope="module", params=list(STYLES))
def model(request, make_gpt):
    return make_gpt(seed=1, **STYLES[request.param]).double()


def pair(seed: int = 0, B: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``B`` prompts and the same prompts with two tokens changed (IOI-style: a name swapped)."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, V, (B, T), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 1 + torch.randint(0, V - 1, (B,), generator=g)) % V
    corrupted[:, 4] = (corrupted[:, 4] + 3) % V
    return clean, corrupted


METRIC = logit_diff(3, 5)


# ---------------------------------------------------------------------------------------------
# The reference: a head-by-head forward in float64
# ---------------------------------------------------------------------------------------------
def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat(
        [
            a * cos[..., : a.shape[-1]] - b * sin[..., : a.shape[-1]],
            b * cos[..., a.shape[-1] :] + a * sin[..., a.shape[-1] :],
        ],
        -1,
    )


def ref_run(model, idx, add=None, patched=(), corrupted_writers=None, override=None):
    """``(logits, writers)``: ``writers[node]`` is each writer's ``(B, T, d)`` output.

    add: ``{reader node: (B, T, d)}`` added to that reader's input alone. patched: ``(writer, reader)``
    edges whose writer reaches the reader with its output in ``corrupted_writers`` instead of its live
    one. override: ``{"embed": token embeddings, ("z", l): (B, T, H, hd), ("mlp", l): (B, T, d)}``.
    """
    add, override = add or {}, override or {}
    by_reader: dict = {}
    for w, r, *t in patched:  # (writer, reader) or (writer, reader, position)
        at = torch.ones(idx.shape[1], dtype=torch.float64)
        if t:
            at = torch.zeros(idx.shape[1], dtype=torch.float64)
            at[t[0]] = 1.0
        by_reader.setdefault(r, []).append((w, at[None, :, None]))
    live: dict = {}

    def reader_input(node, base):
        x = base + add[node] if node in add else base
        for w, at in by_reader.get(node, ()):
            x = x - (live[w] - corrupted_writers[w]) * at  # this edge carries the corrupted output
        return x

    cfg = model.config
    n = idx.shape[1]
    e = override.get("embed", model.tok_emb(idx))
    x = e + model.pos_emb(torch.arange(n)) if model.pos_emb is not None else e
    live[("embed", None, None)] = x
    for layer, block in enumerate(model.trf_blocks):
        att = block.att
        H, G, hd = att.num_heads, att.num_kv_heads, att.head_dim

        def proj(lin, i, inp, hd=hd):
            out = inp @ lin.weight[i * hd : (i + 1) * hd].T
            return out if lin.bias is None else out + lin.bias[i * hd : (i + 1) * hd]

        q = [proj(att.W_query, h, block.norm1(reader_input(("q_input", layer, h), x))) for h in range(H)]
        k = [proj(att.W_key, g, block.norm1(reader_input(("k_input", layer, g), x))) for g in range(G)]
        v = [proj(att.W_value, g, block.norm1(reader_input(("v_input", layer, g), x))) for g in range(G)]
        if cfg.pos == "rope":
            cos, sin = att.rope_cos_sin(torch.arange(n)[None], torch.float64)
            cos, sin = cos[0, 0], sin[0, 0]  # (T, hd)
            q = [_rotate(t, cos, sin) for t in q]
            k = [_rotate(t, cos, sin) for t in k]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        attn_out = att.out_proj.bias if att.out_proj.bias is not None else 0.0
        for h in range(H):
            g = h // (H // G)  # the key/value head of this query head's group
            if ("z", layer) in override:
                z = override[("z", layer)][:, :, h]
            else:
                scores = (q[h] @ k[g].transpose(1, 2) * att.scale).masked_fill(~causal, float("-inf"))
                z = torch.softmax(scores, -1) @ v[g]  # (B, T, hd)
            result = z @ att.out_proj.weight[:, h * hd : (h + 1) * hd].T  # (B, T, d)
            live[("attn_head_out", layer, h)] = result
            attn_out = attn_out + result
        mid = x if cfg.parallel_residual else x + attn_out
        m = override.get(("mlp", layer))
        if m is None:
            m = block.ff(block.norm2(reader_input(("mlp_in", layer, None), mid)))
        live[("mlp_out", layer, None)] = m
        x = (x + attn_out if cfg.parallel_residual else mid) + m
    final = reader_input(("logits", cfg.n_layers - 1, None), x)
    return model.out_head(model.final_norm(final)), live


def readers_of(model):
    return EdgeGraph.of(model).readers


def reader_grads(model, idx, override=None, metric=METRIC):
    """``{reader: d metric / d (its own input)}``, one backward with a zero leaf added to each reader."""
    leaves = {
        r: torch.zeros(*idx.shape, model.config.emb_dim, dtype=torch.float64, requires_grad=True)
        for r in readers_of(model)
    }
    logits, _ = ref_run(model, idx, add=leaves, override=override)
    grads = torch.autograd.grad(metric(logits), list(leaves.values()), allow_unused=True)
    return {r: torch.zeros_like(leaves[r]) if g is None else g for r, g in zip(leaves, grads, strict=True)}


def deltas(model, clean, corrupted):
    with torch.no_grad():
        _, a = ref_run(model, clean)
        _, b = ref_run(model, corrupted)
    return {w: a[w] - b[w] for w in a}


# ---------------------------------------------------------------------------------------------
# EAP against the definition
# ---------------------------------------------------------------------------------------------
def test_eap_is_each_edges_derivative_by_definition(model, one_thread):
    """Each edge's score: d/d eps of the metric of the corrupted run whose reader alone gets eps times
    the writer's clean-minus-corrupted output (denoising), summed over positions and rows."""
    clean, corrupted = pair(0)
    scores = edge_attribution(model, clean, corrupted, METRIC)
    delta = deltas(model, clean, corrupted)
    items = list(scores.items())
    assert len(items) == EdgeGraph.of(model).n_edges == len(scores)
    for writer, reader, score in items:
        eps = torch.zeros((), dtype=torch.float64, requires_grad=True)
        logits, _ = ref_run(model, corrupted, add={reader: eps * delta[writer]})
        (expected,) = torch.autograd.grad(METRIC(logits), eps)
        assert score == pytest.approx(float(expected), rel=1e-9, abs=1e-12), (writer, reader)


def test_per_position_scores_are_each_positions_derivative(model, one_thread):
    clean, corrupted = pair(1)
    per = edge_attribution(model, clean, corrupted, METRIC, per_position=True)
    summed = edge_attribution(model, clean, corrupted, METRIC)
    torch.testing.assert_close(per.scores.sum(0), summed.scores, rtol=1e-10, atol=1e-13)
    delta = deltas(model, clean, corrupted)
    grads = reader_grads(model, corrupted)
    for (writer, reader, _), t in zip(summed.top(6), (6, 5, 4, 3, 2, 6), strict=True):
        expected = float((delta[writer][:, t] * grads[reader][:, t]).sum())
        assert per[((*writer, t), (*reader, t))] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    w, r, s = next(per.items())
    assert len(w) == len(r) == 4 and isinstance(s, float)


def test_graph_is_transformerlens_node_for_node_without_grouping(make_gpt):
    """Per position TransformerLens 4.3 enumerates, for each layer, 3H attention readers fed by the
    writers so far, then the MLP reader fed by those and this layer's heads, then the logits."""
    for L, H, G, parallel in ((2, 4, 4, False), (3, 6, 2, False), (3, 4, 4, True)):
        graph = EdgeGraph(L, H, G, parallel)
        count, avail = 0, 1
        for _ in range(L):
            count += (H + 2 * G) * avail
            count += avail if parallel else avail + H
            avail += H + 1
        count += avail
        assert graph.n_edges == count
        kinds = {r[0] for r in graph.readers} | {w[0] for w in graph.writers}
        assert kinds == {"embed", "attn_head_out", "mlp_out", "q_input", "k_input", "v_input", "mlp_in", "logits"}
        assert sum(r[0] == "k_input" for r in graph.readers) == L * G  # grouped: one per key/value head


# ---------------------------------------------------------------------------------------------
# Sum to total on a model whose metric is linear in the activations
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def linear_readout(make_gpt):
    """A Llama-style model whose final norm is the identity: the logit difference is then a linear
    function of the final residual stream, which is the sum of the writers' outputs."""
    m = make_gpt(seed=2, **STYLES["llama-gqa"]).double()
    m = copy.deepcopy(m)
    m.final_norm = nn.Identity()
    return m


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_eap_is_exact_when_the_metric_is_linear(linear_readout, seed):
    clean, corrupted = pair(seed)
    with torch.no_grad():
        total = float(METRIC(linear_readout(clean)) - METRIC(linear_readout(corrupted)))
    for method in ("EAP", "EAP-IG-inputs", "EAP-IG-activations"):
        scores = edge_attribution(linear_readout, clean, corrupted, METRIC, method=method, ig_steps=3)
        into_logits = sum(s for _, r, s in scores.items() if r[0] == "logits")
        assert into_logits == pytest.approx(total, rel=1e-9, abs=1e-12), method


# ---------------------------------------------------------------------------------------------
# EAP-IG
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["EAP-IG-inputs", "EAP-IG-activations"])
def test_eap_ig_with_one_step_is_eap(model, method, one_thread):
    clean, corrupted = pair(3)
    eap = edge_attribution(model, clean, corrupted, METRIC)
    for per_position in (False, True):
        ig = edge_attribution(model, clean, corrupted, METRIC, method=method, ig_steps=1, per_position=per_position)
        expected = (
            eap.scores
            if not per_position
            else edge_attribution(model, clean, corrupted, METRIC, per_position=True).scores
        )
        torch.testing.assert_close(ig.scores, expected, rtol=1e-10, atol=1e-14)


def test_eap_ig_inputs_is_the_mean_gradient_along_the_embeddings(model, one_thread):
    clean, corrupted = pair(4)
    steps = 3
    e0, e1 = model.tok_emb(corrupted).detach(), model.tok_emb(clean).detach()
    mean = None
    for k in range(steps):
        g = reader_grads(model, corrupted, override={"embed": e0 + k / steps * (e1 - e0)})
        mean = g if mean is None else {r: mean[r] + g[r] for r in g}
    delta = deltas(model, clean, corrupted)
    scores = edge_attribution(model, clean, corrupted, METRIC, method="EAP-IG-inputs", ig_steps=steps, max_tokens=20)
    for writer, reader, score in scores.items():
        assert score == pytest.approx(float((delta[writer] * mean[reader]).sum()) / steps, rel=1e-9, abs=1e-12)
    assert not torch.allclose(scores.scores, edge_attribution(model, clean, corrupted, METRIC).scores)


def _z(model, idx):
    """Each layer's per-head z, ``(B, T, H, hd)``, by inverting nothing: z = pattern @ v of the reference."""
    zs = {}
    for layer, block in enumerate(model.trf_blocks):
        att = block.att

        def pre(module, args, layer=layer, att=att):
            zs[("z", layer)] = args[0].detach().view(*args[0].shape[:2], att.num_heads, att.head_dim)

        h = att.out_proj.register_forward_pre_hook(pre)
        with torch.no_grad():
            model(idx)
        h.remove()
    return zs


def test_eap_ig_activations_interpolates_one_writer_layer_at_a_time(model, one_thread):
    clean, corrupted = pair(5, B=1)
    steps = 2
    zc, zx = _z(model, clean), _z(model, corrupted)
    with torch.no_grad():
        _, wc = ref_run(model, clean)
        _, wx = ref_run(model, corrupted)
    groups = [("embed", model.tok_emb(corrupted).detach(), model.tok_emb(clean).detach(), ["embed"])]
    for layer in range(model.config.n_layers):
        groups.append((("z", layer), zx[("z", layer)], zc[("z", layer)], ["attn_head_out"], layer))
        groups.append((("mlp", layer), wx[("mlp_out", layer, None)], wc[("mlp_out", layer, None)], ["mlp_out"], layer))
    delta = deltas(model, clean, corrupted)
    expected: dict = {}
    for key, a0, a1, kinds, *layer in groups:
        mean = None
        for k in range(steps):
            g = reader_grads(model, corrupted, override={key: a0 + k / steps * (a1 - a0)})
            mean = g if mean is None else {r: mean[r] + g[r] for r in g}
        for w in delta:
            if w[0] in kinds and (not layer or w[1] == layer[0]):
                for r in mean:
                    expected[(w, r)] = float((delta[w] * mean[r]).sum()) / steps
    scores = edge_attribution(
        model, clean, corrupted, METRIC, method="EAP-IG-activations", ig_steps=steps, max_tokens=15
    )
    for writer, reader, score in scores.items():
        assert score == pytest.approx(expected[(writer, reader)], rel=1e-9, abs=1e-12), (writer, reader)


# ---------------------------------------------------------------------------------------------
# Circuits and faithfulness
# ---------------------------------------------------------------------------------------------
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), style=st.sampled_from(list(STYLES)))
def test_full_circuit_is_clean_and_empty_is_corrupted(make_gpt, seed, style):
    m = make_gpt(seed=seed % 7, **STYLES[style]).double()
    clean, corrupted = pair(seed)
    graph = EdgeGraph.of(m)
    with torch.no_grad():
        ends = [float(METRIC(m(clean))), float(METRIC(m(corrupted)))]
    got = circuit_metrics(m, clean, corrupted, METRIC, [Circuit.full(graph), Circuit.empty(graph)])
    assert got == pytest.approx(ends, rel=1e-10, abs=1e-12)
    per_pos = [
        Circuit(graph, graph.valid.expand(T, -1, -1).clone()),
        Circuit(graph, torch.zeros(T, *graph.valid.shape, dtype=torch.bool)),
    ]
    assert circuit_metrics(m, clean, corrupted, METRIC, per_pos) == pytest.approx(ends, rel=1e-10, abs=1e-12)
    assert faithfulness(m, clean, corrupted, METRIC, [Circuit.full(graph), Circuit.empty(graph)]) == pytest.approx(
        [1.0, 0.0], abs=1e-9
    )


def test_a_circuit_runs_as_edge_by_edge_patching(model, one_thread):
    """Random circuits (and per-position ones) against the reference run edge by edge."""
    clean, corrupted = pair(6)
    graph = EdgeGraph.of(model)
    with torch.no_grad():
        _, corr = ref_run(model, corrupted)
    gen = torch.Generator().manual_seed(0)
    circuits = [Circuit.random(graph, n, gen) for n in (5, graph.n_edges // 2, graph.n_edges - 3)]
    got = circuit_metrics(model, clean, corrupted, METRIC, circuits, max_tokens=2 * T * 2)  # two circuits a pass
    for circuit, value in zip(circuits, got, strict=True):
        kept = set(circuit.edges())
        left_out = [(w, r) for w, r in Circuit.full(graph).edges() if (w, r) not in kept]
        with torch.no_grad():
            logits, _ = ref_run(model, clean, patched=left_out, corrupted_writers=corr)
        assert value == pytest.approx(float(METRIC(logits)), rel=1e-9, abs=1e-12)
    # per position: each position keeps its own random circuit
    mask = torch.stack([Circuit.random(graph, graph.n_edges // 2, gen).mask for _ in range(T)])
    (value,) = circuit_metrics(model, clean, corrupted, METRIC, Circuit(graph, mask))
    idx = graph.valid.nonzero().tolist()
    left_out = [(graph.writers[w], graph.readers[r], t) for t in range(T) for w, r in idx if not mask[t, w, r]]
    with torch.no_grad():
        logits, _ = ref_run(model, clean, patched=left_out, corrupted_writers=corr)
    assert value == pytest.approx(float(METRIC(logits)), rel=1e-9, abs=1e-12)


def test_selection(model):
    clean, corrupted = pair(7)
    scores = edge_attribution(model, clean, corrupted, METRIC)
    values = sorted((abs(s) for _, _, s in scores.items()), reverse=True)
    top = scores.top_n(10)
    assert len(top) == 10
    assert min(abs(scores[e]) for e in top.edges()) == values[9]
    assert [abs(s) for *_, s in scores.top(10)] == values[:10]
    cut = scores.threshold(values[14])
    assert len(cut) == sum(v >= values[14] for v in values)
    greedy = scores.greedy(25)
    assert len(greedy) == 25
    kept = set(greedy.edges())
    writers = {w for w, _ in kept}
    group = model.config.n_heads // model.config.kv_heads
    for _, reader in kept:  # every edge's reader belongs to a node already in the circuit, or is the logits
        kind, layer, head = reader
        if kind == "logits":
            continue
        if kind == "mlp_in":
            assert ("mlp_out", layer, None) in writers
        elif kind == "q_input":
            assert ("attn_head_out", layer, head) in writers
        else:
            assert any(("attn_head_out", layer, h) in writers for h in range(head * group, (head + 1) * group))


def test_faithfulness_curve_areas(model, one_thread):
    clean, corrupted = pair(8)
    scores = edge_attribution(model, clean, corrupted, METRIC)
    curve = faithfulness_curve(model, clean, corrupted, METRIC, scores)
    assert curve.budgets == MIB_BUDGETS
    assert curve.n_edges == tuple(int(b * len(scores)) for b in MIB_BUDGETS)
    x, f = np.array(MIB_BUDGETS), np.array(curve.faithfulness)
    assert curve.cpr == pytest.approx(np.trapezoid(f, x), rel=1e-12)
    assert curve.cmd == pytest.approx(np.trapezoid(np.abs(1 - f), x), rel=1e-12)
    top = [scores.top_n(n) for n in curve.n_edges]
    assert list(curve.faithfulness) == pytest.approx(faithfulness(model, clean, corrupted, METRIC, top), rel=1e-12)
    greedy = faithfulness_curve(model, clean, corrupted, METRIC, scores, budgets=(0.1, 0.5), select="greedy")
    assert len(greedy.faithfulness) == 2


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------
def test_bad_input(make_gpt):
    m = make_gpt(seed=0)
    clean, corrupted = pair(0)
    with pytest.raises(ValueError, match="method must be one of"):
        edge_attribution(m, clean, corrupted, METRIC, method="EAP-IG")
    with pytest.raises(ValueError, match="ig_steps must be an int >= 1, got 0"):
        edge_attribution(m, clean, corrupted, METRIC, method="EAP-IG-inputs", ig_steps=0)
    with pytest.raises(ValueError, match="same shape"):
        edge_attribution(m, clean, corrupted[:, :-1], METRIC)
    with pytest.raises(TypeError, match="clean must be a tensor of token ids"):
        edge_attribution(m, [1, 2, 3], corrupted, METRIC)
    with pytest.raises(TypeError, match="metric must be a function"):
        edge_attribution(m, clean, corrupted, "logit_diff")
    with pytest.raises(ValueError, match="metric must return a scalar"):
        edge_attribution(m, clean, corrupted, lambda logits: logits[:, -1, 0])
    with pytest.raises(ValueError, match="metric must return a tensor computed from the logits"):
        edge_attribution(m, clean, corrupted, lambda logits: 1.0)
    with pytest.raises(TypeError, match="per_position must be a bool"):
        edge_attribution(m, clean, corrupted, METRIC, per_position=1)
    with pytest.raises(TypeError, match="model must be an attnlab GPT"):
        edge_attribution(nn.Linear(2, 2), clean, corrupted, METRIC)
    with pytest.raises(ValueError, match="post_norms=True"):
        edge_attribution(make_gpt(seed=0, post_norms=True, norm="rmsnorm"), clean, corrupted, METRIC)
    with pytest.raises(ValueError, match="qk_norm='full'"):
        edge_attribution(make_gpt(seed=0, qk_norm="full", pos="rope"), clean, corrupted, METRIC)
    graph = EdgeGraph.of(m)
    with pytest.raises(ValueError, match="is not an edge of the graph"):
        Circuit.from_edges(graph, [(("mlp_out", 1, None), ("q_input", 0, 0))])
    with pytest.raises(ValueError, match="is not a writer of this graph"):
        Circuit.from_edges(graph, [(("mlp_out", 9, None), ("logits", 1, None))])
    scores = edge_attribution(m, clean, corrupted, METRIC)
    with pytest.raises(TypeError, match="n must be a non-negative int"):
        scores.top_n(-1)
    with pytest.raises(ValueError, match="budgets must be increasing fractions"):
        faithfulness_curve(m, clean, corrupted, METRIC, scores, budgets=(0.5, 0.1))
    with pytest.raises(ValueError, match="select must be"):
        faithfulness_curve(m, clean, corrupted, METRIC, scores, select="random")
    with pytest.raises(ValueError, match=r"faithfulness .* is undefined"):
        faithfulness(m, clean, clean, METRIC, Circuit.full(graph))
    with pytest.raises(TypeError, match="circuits must be a Circuit"):
        circuit_metrics(m, clean, corrupted, METRIC, [])
    other = EdgeGraph.of(make_gpt(seed=0, n_layers=3))
    with pytest.raises(ValueError, match="another model's graph"):
        circuit_metrics(m, clean, corrupted, METRIC, Circuit.full(other))
