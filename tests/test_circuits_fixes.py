"""Circuits: ``max_tokens`` bounds every pass (the same scores and metrics as one pass), non-finite
metrics and scores are refused, position-resolved edges are looked up and built by their positions,
``--pairs`` splits lines as JSON Lines does, ``--out`` in a missing directory is refused before the
work, and edge attribution runs inside ``torch.inference_mode()``.

The one-pass results these are compared with are checked against float64 references in
tests/test_circuits.py and tests/test_circuits_sae.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from attnlab.cli import main
from attnlab.interpret import Circuit, EdgeGraph, circuit_metrics, edge_attribution, faithfulness
from attnlab.interpret.circuit_view import PairLogitDiff
from attnlab.interpret.circuits import EdgeScores
from attnlab.tokenizers import CharTokenizer
from attnlab.tools.circuit import read_pairs
from test_circuits_sae import saes_at

B, T = 6, 7


def batch(seed: int = 0, V: int = 37) -> tuple[torch.Tensor, torch.Tensor, PairLogitDiff]:
    """``B`` pairs, two tokens changed in each, and a metric whose answers differ by row: it can only
    be computed on all the rows at once (a pass of some rows would pair them with the wrong answers)."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, V, (B, T), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2] = (corrupted[:, 2] + 1 + torch.randint(0, V - 1, (B,), generator=g)) % V
    corrupted[:, 4] = (corrupted[:, 4] + 3) % V
    a = torch.randint(0, V, (B,), generator=g)
    return clean, corrupted, PairLogitDiff(a, (a + 1 + torch.randint(0, V - 1, (B,), generator=g)) % V)


class Passes:
    """The tokens of every forward through the model (its input ids' rows x positions)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tokens: list[int] = []
        self.model = model

    def __enter__(self) -> Passes:
        self.handle = self.model.register_forward_pre_hook(lambda m, args: self.tokens.append(args[0].numel()))
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


# ---------------------------------------------------------------------------------------------
# max_tokens
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_tokens", [15, 5])  # two rows a pass; one row (fewer tokens than a row)
@pytest.mark.parametrize(
    ("method", "per_position", "place"),
    [
        ("EAP", False, None),
        ("EAP", True, None),
        ("EAP-IG-inputs", False, None),
        ("EAP-IG-activations", True, None),
        ("EAP", False, "resid_pre+mid"),
        ("EAP-IG-inputs", False, "transcoder"),
    ],
)
def test_max_tokens_bounds_every_pass_and_keeps_the_scores(
    make_gpt, one_thread, max_tokens, method, per_position, place
):
    model = make_gpt(seed=1, n_kv_heads=2).double()
    clean, corrupted, metric = batch()
    saes = saes_at(place) if place else ()
    kw = dict(method=method, ig_steps=3, per_position=per_position, saes=saes)
    whole = edge_attribution(model, clean, corrupted, metric, **kw)
    with Passes(model) as passes:
        split = edge_attribution(model, clean, corrupted, metric, max_tokens=max_tokens, **kw)
    assert max(passes.tokens) <= max(max_tokens, T)
    assert whole.graph.same_nodes(split.graph)
    torch.testing.assert_close(split.scores, whole.scores, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("max_tokens", [15, 5, 30])  # rows split; one row a pass; one circuit a pass
def test_max_tokens_bounds_every_pass_of_circuits_and_keeps_their_metrics(make_gpt, one_thread, max_tokens):
    model = make_gpt(seed=2, parallel_residual=True).double()
    clean, corrupted, metric = batch(1)
    scores = edge_attribution(model, clean, corrupted, metric)
    g = scores.graph
    circuits = [scores.top_n(5), scores.greedy(20), Circuit.random(g, 30, torch.Generator().manual_seed(0))]
    whole = circuit_metrics(model, clean, corrupted, metric, circuits)
    faith = faithfulness(model, clean, corrupted, metric, circuits)
    with Passes(model) as passes:
        split = circuit_metrics(model, clean, corrupted, metric, circuits, max_tokens=max_tokens)
        split_faith = faithfulness(model, clean, corrupted, metric, circuits, max_tokens=max_tokens)
    assert max(passes.tokens) <= max(max_tokens, T)
    assert split == pytest.approx(whole, rel=1e-10, abs=1e-12)
    assert split_faith == pytest.approx(faith, rel=1e-10, abs=1e-12)


def test_per_position_circuits_split_into_passes_keep_their_metrics(make_gpt, one_thread):
    model = make_gpt(seed=3).double()
    clean, corrupted, metric = batch(2)
    sp = edge_attribution(model, clean, corrupted, metric, per_position=True)
    circuits = [sp.top_n(10), sp.top_n(40)]
    whole = circuit_metrics(model, clean, corrupted, metric, circuits)
    with Passes(model) as passes:
        split = circuit_metrics(model, clean, corrupted, metric, circuits, max_tokens=2 * T)
    assert max(passes.tokens) <= 2 * T
    assert split == pytest.approx(whole, rel=1e-10, abs=1e-12)


# ---------------------------------------------------------------------------------------------
# Non-finite metrics and scores
# ---------------------------------------------------------------------------------------------
def test_a_metric_that_is_not_finite_is_refused(make_gpt):
    model = make_gpt(seed=1)
    clean, corrupted, _ = batch()
    nan_metric = lambda logits: torch.log(logits[:, -1, 0] - 100).mean()  # NaN: the log of a negative number
    with pytest.raises(ValueError, match="metric must return a finite value, got nan"):
        edge_attribution(model, clean, corrupted, nan_metric)
    g = EdgeGraph.of(model)
    with pytest.raises(ValueError, match="metric must return a finite value, got nan for circuits"):
        faithfulness(model, clean, corrupted, nan_metric, Circuit.full(g))
    with pytest.raises(ValueError, match="metric must return a finite value, got nan for circuits"):
        circuit_metrics(model, clean, corrupted, nan_metric, Circuit.empty(g))


def test_a_metric_whose_gradient_is_not_finite_gives_no_scores(make_gpt):
    model = make_gpt(seed=1)
    clean, corrupted, _ = batch()
    # finite (0) on every run, its gradient infinite: sqrt at 0
    metric = lambda logits: torch.sqrt(logits[:, -1, 0] - logits[:, -1, 0].detach()).mean()
    with pytest.raises(ValueError, match="scores must be finite"):
        edge_attribution(model, clean, corrupted, metric)


def test_a_model_with_a_nan_weight_is_refused_not_ranked(make_gpt):
    model = make_gpt(seed=1)
    clean, corrupted, metric = batch()
    scores = edge_attribution(model, clean, corrupted, metric)
    with torch.no_grad():
        model.trf_blocks[1].ff.layers[0].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="the model's logits are not finite"):
        edge_attribution(model, clean, corrupted, metric)
    with pytest.raises(ValueError, match="the model's logits are not finite"):
        faithfulness(model, clean, corrupted, metric, scores.top_n(3))
    bad = scores.scores.clone()
    w, r = scores.graph.writer_index(("embed", None, None)), scores.graph.reader_index(("q_input", 0, 1))
    bad[w, r] = float("nan")
    with pytest.raises(ValueError, match=r"scores must be finite, got nan on 1 edges \(the first \('embed'"):
        EdgeScores(scores.graph, bad, "EAP", 1, False)


# ---------------------------------------------------------------------------------------------
# Position-resolved edges
# ---------------------------------------------------------------------------------------------
def test_position_resolved_lookups_read_the_edges_own_position(make_gpt):
    model = make_gpt(seed=1)
    clean, corrupted, metric = batch()
    sp = edge_attribution(model, clean, corrupted, metric, per_position=True)
    items = {(w, r): s for w, r, s in sp.items()}
    for w, r, s in sp.top(10):
        assert sp[(w, r)] == items[(w, r)] == s
    w, r, _ = sp.top(1)[0]
    with pytest.raises(KeyError, match="an edge joins nodes at the same position"):
        sp[(w, (*r[:3], (r[3] + 3) % T))]
    with pytest.raises(KeyError, match=r"a position is an int in \[0, 7\)"):
        sp[((*w[:3], T), (*r[:3], T))]
    with pytest.raises(ValueError, match="position-resolved nodes are"):
        sp[(w[:3], r[:3])]
    summed = edge_attribution(model, clean, corrupted, metric)
    with pytest.raises(ValueError, match="position-summed nodes are"):
        summed[(w, r)]


def test_from_edges_builds_a_per_position_circuit_of_position_resolved_edges(make_gpt):
    model = make_gpt(seed=1).double()
    clean, corrupted, metric = batch()
    sp = edge_attribution(model, clean, corrupted, metric, per_position=True)
    built = Circuit.from_edges(sp.graph, sp.top(12), positions=T)
    assert torch.equal(built.mask, sp.top_n(12).mask)
    assert faithfulness(model, clean, corrupted, metric, built) == faithfulness(
        model, clean, corrupted, metric, sp.top_n(12)
    )
    with pytest.raises(ValueError, match=r"edges\[0\] = .* is position-resolved: give positions=T"):
        Circuit.from_edges(sp.graph, sp.top(2))
    w, r, _ = sp.top(1)[0]
    with pytest.raises(ValueError, match="an edge joins nodes at the same position"):
        Circuit.from_edges(sp.graph, [(w, (*r[:3], (r[3] + 1) % T))], positions=T)


# ---------------------------------------------------------------------------------------------
# Whole-model faithfulness
# ---------------------------------------------------------------------------------------------
def test_the_whole_models_faithfulness_is_one_and_the_empty_circuits_zero(make_gpt):
    model = make_gpt(seed=1)  # float32: a separate unbatched run of the endpoints differs in the last bits
    clean, corrupted, metric = batch()
    g = EdgeGraph.of(model)
    assert faithfulness(model, clean, corrupted, metric, [Circuit.full(g), Circuit.empty(g)]) == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------
# torch.inference_mode()
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["EAP", "EAP-IG-activations"])
def test_edge_attribution_runs_inside_inference_mode(make_gpt, method):
    model = make_gpt(seed=1).double()
    clean, corrupted, metric = batch()
    want = edge_attribution(model, clean, corrupted, metric, method=method, ig_steps=2)
    with torch.inference_mode():
        got = edge_attribution(model, clean.clone(), corrupted.clone(), metric, method=method, ig_steps=2)
    torch.testing.assert_close(got.scores, want.scores, rtol=1e-12, atol=0)


# ---------------------------------------------------------------------------------------------
# --pairs and --out
# ---------------------------------------------------------------------------------------------
def test_pairs_lines_end_at_newline_only(tmp_path):
    tok = CharTokenizer("abcdefgh")
    rows = [
        {"clean": "abcab", "corrupted": "abcac", "answers": ["a", "b"], "note": "one\u2028two\u2029three\x85"},
        {"clean": "bca", "corrupted": "bcb", "answers": ["c", "d"], "note": "\u2028"},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_bytes("\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode() + b"\r\n")
    pairs = read_pairs(path, tok, 16, tok.vocab_size)
    assert [p[:4] for p in pairs] == [
        (tok.encode(r["clean"]), tok.encode(r["corrupted"]), *(tok.encode(a)[0] for a in r["answers"])) for r in rows
    ]
    path.write_bytes(path.read_bytes() + b'{"clean": "ab"}\n')
    with pytest.raises(ValueError, match="line 3: expected"):
        read_pairs(path, tok, 16, tok.vocab_size)


def test_out_in_a_missing_directory_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    import attnlab.cli.circuit as cli

    def never(args: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "load_from_model_arguments", never)
    out = tmp_path / "missing" / "c.html"
    argv = ["circuit", "--checkpoint", str(tmp_path), "--clean", "ab", "--corrupted", "ac", "--answers", "a", "b"]
    assert main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"the directory {out.parent} does not exist" in err
