"""Edge attribution with SAEs and transcoders spliced in: their latents and error terms as nodes,
against a float64 reference written here.

The reference is test_circuits's head-by-head forward with the SAEs in it, computed by the SAE's
own encode/decode and the model's weights, none of attnlab.interpret.circuits: each reader gets its
own copy of the stream (an SAE's latents read theirs at its input), each latent writes ``z_j W_dec[j]``
and the error node writes the rest of the SAE's output (``x - x^`` of the live stream, detached, as
SAELens splices it, plus the bias and the latents that are not nodes).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.interpret import SAE, SAEConfig, hooks
from attnlab.interpret.circuits import (
    Circuit,
    EdgeGraph,
    SAENodes,
    circuit_metrics,
    edge_attribution,
    sae_graph,
)
from test_circuits import METRIC, STYLES, _rotate, pair

D = 24  # make_gpt's width
# Where the SAEs sit: (hook, hook_out or None, architecture) each.
PLACES = {
    "resid_post": [("blocks.0.hook_resid_post", None, "topk")],
    "resid_pre+mid": [("blocks.0.hook_resid_pre", None, "topk"), ("blocks.1.hook_resid_mid", None, "jumprelu")],
    "mlp_out": [("blocks.1.hook_mlp_out", None, "standard")],
    "transcoder": [("blocks.0.hook_resid_mid", "blocks.0.hook_mlp_out", "standard")],
}


def make_sae(hook: str, hook_out: str | None = None, arch: str = "topk", seed: int = 0, d_sae: int = 40) -> SAE:
    """A float64 SAE (or transcoder) with every parameter random, in eval mode."""
    torch.manual_seed(seed)
    tc = hook_out is not None
    cfg = SAEConfig(
        d_in=D,
        d_sae=d_sae,
        architecture=arch,
        k=6 if arch == "topk" else None,
        hook_name=hook,
        hook_name_out=hook_out,
        d_out=D if tc else None,
        apply_b_dec_to_input=not tc,
    )
    sae = SAE(cfg)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 1 / p.shape[0] ** 0.5))
        if arch == "jumprelu":
            sae.threshold.fill_(0.1)
    return sae.double().eval()


def saes_at(place: str, seed: int = 0) -> list[SAE]:
    return [make_sae(h, o, a, seed=seed + i) for i, (h, o, a) in enumerate(PLACES[place])]


# ---------------------------------------------------------------------------------------------
# The reference: a head-by-head forward in float64 with the SAEs in it
# ---------------------------------------------------------------------------------------------
def ref_run(model, idx, graph, add=None, patched=(), corrupted_writers=None, embed=None):
    """``(logits, writers)`` of ``model`` with ``graph``'s SAEs spliced in; ``writers[node] (B, T, d)``.

    add: ``{reader: (B, T, d)}`` added to that reader's input alone. patched: ``(writer, reader)`` edges
    whose writer reaches the reader with its output in ``corrupted_writers`` instead of its live one.
    embed: token embeddings ``(B, T, d)`` in place of ``idx``'s (EAP-IG-inputs' path).
    """
    add = add or {}
    by_reader: dict = {}
    for w, r in patched:
        by_reader.setdefault(r, []).append(w)
    live: dict = {}
    saes = {s.hook: s for s in graph.saes}

    def reader_input(node, base):
        x = base + add[node] if node in add else base
        for w in by_reader.get(node, ()):
            x = x - (live[w] - corrupted_writers[w])
        return x

    def sae_out(hook, x, x_read):
        """The spliced SAE at ``hook``: latents of ``x_read`` (its input as its reader takes it), the
        error of the live activation ``x`` (detached); the latents' and the error node's writes."""
        s = saes[hook]
        z = s.sae.encode(x_read)  # (B, T, d_sae)
        out = s.sae.decode(z, x_read) + (x - s.sae(x_live_in[hook])).detach()
        writes = 0.0
        for j in s.latents:
            live[("sae_latent", hook, j)] = z[..., j, None] * s.sae.W_dec[j]
            writes = writes + live[("sae_latent", hook, j)]
        live[("sae_error", hook, None)] = out - writes
        return out

    x_live_in: dict = {}  # each SAE's live input (what its error term is the error of)

    def resid(hook, x):
        if hook not in saes:
            return x
        x_live_in[hook] = x
        return sae_out(hook, x, reader_input(("sae_input", hook, None), x))

    cfg = model.config
    n = idx.shape[1]
    e = model.tok_emb(idx) if embed is None else embed
    x = e + model.pos_emb(torch.arange(n)) if model.pos_emb is not None else e
    live[("embed", None, None)] = x
    for layer, block in enumerate(model.trf_blocks):
        x = resid(f"blocks.{layer}.hook_resid_pre", x)
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
            q = [_rotate(t, cos[0, 0], sin[0, 0]) for t in q]
            k = [_rotate(t, cos[0, 0], sin[0, 0]) for t in k]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        attn_out = att.out_proj.bias if att.out_proj.bias is not None else 0.0
        for h in range(H):
            scores = (q[h] @ k[h // (H // G)].transpose(1, 2) * att.scale).masked_fill(~causal, float("-inf"))
            result = torch.softmax(scores, -1) @ v[h // (H // G)] @ att.out_proj.weight[:, h * hd : (h + 1) * hd].T
            live[("attn_head_out", layer, h)] = result
            attn_out = attn_out + result
        mid = x if cfg.parallel_residual else resid(f"blocks.{layer}.hook_resid_mid", x + attn_out)
        out_hook = f"blocks.{layer}.hook_mlp_out"
        mlp_in = reader_input(("mlp_in", layer, None), mid)
        if out_hook in saes and saes[out_hook].place == "transcoder":
            x_live_in[out_hook] = mid
            m = sae_out(out_hook, block.ff(block.norm2(mid)), mlp_in)
        else:
            m = block.ff(block.norm2(mlp_in))
            live[("mlp_out", layer, None)] = m
            if out_hook in saes:
                x_live_in[out_hook] = m
                m = sae_out(out_hook, m, m)
        x = resid(f"blocks.{layer}.hook_resid_post", (x + attn_out if cfg.parallel_residual else mid) + m)
    final = reader_input(("logits", cfg.n_layers - 1, None), x)
    return model.out_head(model.final_norm(final)), live


def reference_scores(model, graph, clean, corrupted, metric=METRIC, ig_steps=None):
    """``{(writer, reader): (delta writer) . (d metric / d reader's own input)}`` for every edge; with
    ``ig_steps``, the mean gradient over the embeddings' path from corrupted to clean (EAP-IG-inputs)."""
    e0, e1 = model.tok_emb(corrupted).detach(), model.tok_emb(clean).detach()
    grad: dict = {}
    for k in range(ig_steps or 1):
        leaves = {r: torch.zeros(*corrupted.shape, D, dtype=torch.float64, requires_grad=True) for r in graph.readers}
        embed = e0 + k / (ig_steps or 1) * (e1 - e0)
        logits, _ = ref_run(model, corrupted, graph, add=leaves, embed=embed)
        grads = torch.autograd.grad(metric(logits), list(leaves.values()), allow_unused=True)
        for r, g in zip(leaves, grads, strict=True):
            g = torch.zeros_like(leaves[r]) if g is None else g
            grad[r] = grad.get(r, 0) + g / (ig_steps or 1)
    with torch.no_grad():
        _, a = ref_run(model, clean, graph)
        _, b = ref_run(model, corrupted, graph)
    return {(w, r): float(((a[w] - b[w]) * grad[r]).sum()) for w, r in Circuit.full(graph).edges()}


# ---------------------------------------------------------------------------------------------
# EAP with SAE nodes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("style", ["gpt2", "llama-gqa"])
@pytest.mark.parametrize("place", list(PLACES))
def test_eap_with_sae_nodes_is_each_edges_derivative(make_gpt, style, place, one_thread):
    model = make_gpt(seed=1, **STYLES[style]).double()
    clean, corrupted = pair(0)
    saes = saes_at(place)
    scores = edge_attribution(model, clean, corrupted, METRIC, saes=saes)
    graph = scores.graph
    assert [s.hook for s in graph.saes] == [h_out or h for h, h_out, _ in PLACES[place]]
    assert all(s.latents for s in graph.saes)  # some latents are nodes: the test checks their edges
    expected = reference_scores(model, graph, clean, corrupted)
    items = list(scores.items())
    assert len(items) == len(expected) == len(scores)
    for writer, reader, score in items:
        assert score == pytest.approx(expected[(writer, reader)], rel=1e-9, abs=1e-12), (writer, reader)
    kinds = {w[0] for w, _, _ in items} | {r[0] for _, r, _ in items}
    assert {"sae_latent", "sae_error"} <= kinds
    big = max(abs(s) for w, _, s in items if w[0] == "sae_latent")
    assert big > 1e-6  # the latents' edges carry something: a test that can fail


@pytest.mark.parametrize("place", ["resid_pre+mid", "transcoder"])
def test_eap_ig_inputs_with_sae_nodes_is_the_mean_gradient_along_the_embeddings(make_gpt, place, one_thread):
    model = make_gpt(seed=2).double()
    clean, corrupted = pair(5)
    scores = edge_attribution(
        model, clean, corrupted, METRIC, method="EAP-IG-inputs", ig_steps=3, saes=saes_at(place), max_tokens=20
    )
    expected = reference_scores(model, scores.graph, clean, corrupted, ig_steps=3)
    for writer, reader, score in scores.items():
        assert score == pytest.approx(expected[(writer, reader)], rel=1e-9, abs=1e-12), (writer, reader)
    eap = edge_attribution(model, clean, corrupted, METRIC, graph=scores.graph)
    assert not torch.allclose(scores.scores, eap.scores)


@pytest.mark.parametrize(
    "where",
    [
        [("blocks.1.hook_resid_post", None, "topk")],
        [("blocks.1.hook_resid_pre", "blocks.1.hook_mlp_out", "standard"), ("blocks.2.hook_mlp_out", None, "topk")],
    ],
)
def test_eap_with_sae_nodes_in_parallel_blocks(make_gpt, where, one_thread):
    """A parallel block's MLP reads the block's input: a transcoder there reads hook_resid_pre."""
    model = make_gpt(seed=1, **STYLES["parallel"]).double()
    clean, corrupted = pair(6)
    saes = [make_sae(h, o, a, seed=i) for i, (h, o, a) in enumerate(where)]
    scores = edge_attribution(model, clean, corrupted, METRIC, saes=saes)
    expected = reference_scores(model, scores.graph, clean, corrupted)
    assert len(expected) == len(scores)
    for writer, reader, score in scores.items():
        assert score == pytest.approx(expected[(writer, reader)], rel=1e-9, abs=1e-12), (writer, reader)
    with torch.no_grad():
        _, corr_w = ref_run(model, corrupted, scores.graph)
    circuit = scores.top_n(len(scores) // 3)
    kept = set(circuit.edges())
    patched = [e for e in Circuit.full(scores.graph).edges() if e not in kept]
    with torch.no_grad():
        logits, _ = ref_run(model, clean, scores.graph, patched=patched, corrupted_writers=corr_w)
    got = circuit_metrics(model, clean, corrupted, METRIC, circuit)
    assert got == pytest.approx([float(METRIC(logits))], rel=1e-9, abs=1e-12)
    with pytest.raises(ValueError, match=r"saes\[0\].*hook_resid_mid"):
        edge_attribution(model, clean, corrupted, METRIC, saes=[make_sae("blocks.0.hook_resid_mid")])


def test_a_residual_sae_is_the_only_way_across_it(make_gpt):
    """Nodes before a residual SAE reach those after it only through its input node; an MLP SAE's
    or a transcoder's latents replace the MLP's node."""
    model = make_gpt(seed=1).double()
    clean, corrupted = pair(1)
    graph = sae_graph(model, saes_at("resid_post"), [(clean, corrupted)])
    edges = {(w, r) for w, r in Circuit.full(graph).edges()}
    assert (("embed", None, None), ("q_input", 1, 0)) not in edges
    assert (("embed", None, None), ("sae_input", "blocks.0.hook_resid_post", None)) in edges
    assert (("mlp_out", 0, None), ("sae_input", "blocks.0.hook_resid_post", None)) in edges
    assert (("sae_error", "blocks.0.hook_resid_post", None), ("q_input", 1, 2)) in edges
    assert not any(r[0] == "q_input" and r[1] == 0 and w[0].startswith("sae") for w, r in edges)
    tc = sae_graph(model, saes_at("transcoder"), [(clean, corrupted)])
    tc_edges = set(Circuit.full(tc).edges())
    assert not any(w == ("mlp_out", 0, None) for w, _ in tc_edges)  # its node writes nothing now
    assert (("embed", None, None), ("mlp_in", 0, None)) in tc_edges
    assert (("sae_error", "blocks.0.hook_mlp_out", None), ("logits", 1, None)) in tc_edges


@pytest.fixture(scope="module")
def linear_readout(make_gpt):
    """A model whose final norm is the identity: the logit difference is linear in the final stream."""
    m = copy.deepcopy(make_gpt(seed=2, **STYLES["llama-gqa"]).double())
    m.final_norm = nn.Identity()
    return m


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**16), place=st.sampled_from(list(PLACES)), cap=st.sampled_from([64, 2]))
def test_eap_with_saes_is_exact_when_the_metric_is_linear(linear_readout, seed, place, cap):
    """The edges into the logits sum to the metric's change: the latents and the error node (which
    holds the latents left out past max_latents) add up to the SAE's output, exactly."""
    clean, corrupted = pair(seed)
    with torch.no_grad():
        total = float(METRIC(linear_readout(clean)) - METRIC(linear_readout(corrupted)))
    for method in ("EAP", "EAP-IG-inputs"):
        scores = edge_attribution(
            linear_readout,
            clean,
            corrupted,
            METRIC,
            method=method,
            ig_steps=3,
            saes=saes_at(place, seed % 5),
            max_latents=cap,
        )
        assert all(len(s.latents) <= cap for s in scores.graph.saes)
        into_logits = sum(s for _, r, s in scores.items() if r[0] == "logits")
        assert into_logits == pytest.approx(total, rel=1e-9, abs=1e-12), method


def test_latents_are_the_active_ones_and_the_cap_keeps_the_largest_change(make_gpt):
    model = make_gpt(seed=3).double()
    clean, corrupted = pair(2)
    sae = make_sae("blocks.1.hook_resid_pre", seed=4)
    seen = {}
    with torch.no_grad():
        for name, idx in (("clean", clean), ("corrupted", corrupted)):
            with hooks(model, {"blocks.1.hook_resid_pre": lambda x, h, name=name: seen.setdefault(name, x)}):
                model(idx)
        zc, zx = sae.encode(seen["clean"]), sae.encode(seen["corrupted"])  # (B, T, d_sae)
    active = ((zc != 0) | (zx != 0)).flatten(0, 1).any(0).nonzero()[:, 0].tolist()
    assert sae_graph(model, [sae], [(clean, corrupted)]).saes[0].latents == tuple(active)
    change = ((zc - zx).abs().sum((0, 1)) * sae.W_dec.norm(dim=-1)).detach()
    top3 = sorted(sorted(active, key=lambda j: -float(change[j]))[:3])
    assert sae_graph(model, [sae], [(clean, corrupted)], max_latents=3).saes[0].latents == tuple(top3)
    assert sae_graph(model, [sae], [(clean, corrupted)], max_latents=0).saes[0].latents == ()


def test_per_position_scores_with_saes_sum_to_the_summed_ones(make_gpt, one_thread):
    model = make_gpt(seed=1).double()
    clean, corrupted = pair(3)
    graph = sae_graph(model, saes_at("resid_pre+mid"), [(clean, corrupted)])
    per = edge_attribution(model, clean, corrupted, METRIC, graph=graph, per_position=True)
    summed = edge_attribution(model, clean, corrupted, METRIC, graph=graph)
    torch.testing.assert_close(per.scores.sum(0), summed.scores, rtol=1e-10, atol=1e-13)
    assert per.graph is graph


# ---------------------------------------------------------------------------------------------
# Circuits with SAE nodes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("place", list(PLACES))
def test_circuits_with_sae_nodes_against_the_reference(make_gpt, place, one_thread):
    model = make_gpt(seed=5).double()
    clean, corrupted = pair(4)
    graph = sae_graph(model, saes_at(place, 1), [(clean, corrupted)])
    with torch.no_grad():
        ends = [float(METRIC(model(clean))), float(METRIC(model(corrupted)))]
        _, corr_w = ref_run(model, corrupted, graph)
    edges = list(Circuit.full(graph).edges())
    g = torch.Generator().manual_seed(0)
    circuits = [Circuit.full(graph), Circuit.empty(graph), Circuit.random(graph, len(edges) // 2, generator=g)]
    # the edges out of the SAEs and all but those into queries
    circuits.append(Circuit.from_edges(graph, [e for e in edges if e[0][0].startswith("sae") or e[1][0] != "q_input"]))
    got = circuit_metrics(model, clean, corrupted, METRIC, circuits)
    assert got[:2] == pytest.approx(ends, rel=1e-10, abs=1e-12)
    for circuit, value in zip(circuits[2:], got[2:], strict=True):
        kept = set(circuit.edges())
        patched = [e for e in edges if e not in kept]
        with torch.no_grad():
            logits, _ = ref_run(model, clean, graph, patched=patched, corrupted_writers=corr_w)
        assert value == pytest.approx(float(METRIC(logits)), rel=1e-9, abs=1e-12)
    assert min(abs(got[2] - e) for e in ends) > 1e-6  # the random circuit is neither end: a test that can fail


def test_greedy_reaches_the_saes_inputs(make_gpt):
    model = make_gpt(seed=1).double()
    clean, corrupted = pair(0)
    scores = edge_attribution(model, clean, corrupted, METRIC, saes=saes_at("resid_post"))
    circuit = scores.greedy(len(scores))
    assert len(circuit) == len(scores)  # every edge lies on a path to the logits, through the SAE too


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------
def test_bad_saes_are_refused_naming_the_argument(make_gpt):
    model = make_gpt(seed=1).double()
    clean, corrupted = pair(0)
    wide = SAE(SAEConfig(d_in=D + 8, d_sae=10, k=2, hook_name="blocks.0.hook_resid_post")).double()
    with pytest.raises(ValueError, match=r"saes\[1\].*d_in=32"):
        edge_attribution(model, clean, corrupted, METRIC, saes=[make_sae("blocks.1.hook_resid_post"), wide])
    attn = make_sae("blocks.0.hook_attn_out")
    with pytest.raises(ValueError, match=r"saes\[0\].*hook_attn_out"):
        edge_attribution(model, clean, corrupted, METRIC, saes=[attn])
    twice = [make_sae("blocks.0.hook_resid_post"), make_sae("blocks.0.hook_resid_post", seed=1)]
    with pytest.raises(ValueError, match=r"saes\[0\] and saes\[1\] both"):
        edge_attribution(model, clean, corrupted, METRIC, saes=twice)
    with pytest.raises(TypeError, match="list of SAEs"):
        edge_attribution(model, clean, corrupted, METRIC, saes=make_sae("blocks.0.hook_resid_post"))
    with pytest.raises(ValueError, match="EAP-IG-activations"):
        edge_attribution(model, clean, corrupted, METRIC, method="EAP-IG-activations", saes=saes_at("mlp_out"))
    graph = sae_graph(model, saes_at("mlp_out"), [(clean, corrupted)])
    with pytest.raises(ValueError, match="not both"):
        edge_attribution(model, clean, corrupted, METRIC, saes=saes_at("mlp_out"), graph=graph)
    s = graph.saes[0]
    others = tuple(j for j in range(40) if j not in s.latents)[: len(s.latents)]  # as many, other latents
    other = EdgeGraph(2, 4, 4, False, (SAENodes(s.sae, s.hook, s.layer, s.place, others),))
    with pytest.raises(ValueError, match="one graph"):
        circuit_metrics(model, clean, corrupted, METRIC, [Circuit.full(graph), Circuit.full(other)])
    with pytest.raises(ValueError, match="max_latents"):
        sae_graph(model, saes_at("mlp_out"), [(clean, corrupted)], max_latents=-1)


def test_a_default_device_elsewhere_leaves_the_results_on_the_cpu(make_gpt):
    # Notebooks call torch.set_default_device; the tensors attnlab builds for its results are on the
    # CPU by name, where the values computed on the model's device are moved ("meta" stands in here
    # for an accelerator the model is not on).
    from attnlab.interpret import activation_patching, edge_attribution, evaluate_sae

    model = make_gpt(seed=3)
    clean, corrupted = pair(1, B=1)
    sae = make_sae("blocks.1.hook_resid_pre", seed=4)
    expected = activation_patching(model, clean, corrupted, METRIC, site="head_out")
    torch.set_default_device("meta")
    try:
        got = activation_patching(model, clean, corrupted, METRIC, site="head_out")
        scores = edge_attribution(model, clean, corrupted, METRIC, saes=[sae], max_latents=4)
        evaluation = evaluate_sae(model, sae, torch.cat([clean, corrupted]).cpu())
    finally:
        torch.set_default_device(None)
    assert got.device.type == "cpu" and torch.equal(got, expected)
    assert scores.scores.device.type == "cpu" and len(scores.graph.saes[0].latents) <= 4
    assert 0 <= evaluation.dead_fraction <= 1
