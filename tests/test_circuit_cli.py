"""``attnlab circuit``, the circuit view and ``POST /api/circuit``: the library's numbers printed, the
page written atomically with them, bad input in one line (exit 2 / a 4xx with a message), Jupyter's HTML.

The library's own numbers (edge_attribution against float64 references, faithfulness against a
hand-patched model) are held by tests/test_circuits.py; here the command line, the page, the server
and Jupyter must show exactly them.
"""

from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.cli import main
from attnlab.interpret import edge_attribution, faithfulness, faithfulness_curve, logit_diff, trace
from attnlab.interpret.circuit_view import MAX_DRAWN, parse_budget
from attnlab.model import GPT, GPTConfig
from attnlab.tokenizers import CharTokenizer
from attnlab.tools.circuit import format_node

LETTERS = "abcdefghijklmnop"
CLEAN, CORRUPTED = "abcabcd", "abcabce"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model with grouped queries (4 heads, 2 key/value heads): the graph keeps them grouped."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=16, context_length=80, emb_dim=24, n_heads=4, n_kv_heads=2, n_layers=2, drop_rate=0.0)
    model = GPT(cfg)
    with torch.no_grad():  # sharper attention than the 0.02 init, so heads differ
        for block in model.trf_blocks:
            block.att.W_query.weight.normal_(0, 0.5)
            block.att.W_key.weight.normal_(0, 0.5)
    d = model.save(tmp_path_factory.mktemp("circuit") / "ckpt")
    (d / "tokenizer.json").write_text(json.dumps(CharTokenizer(LETTERS).to_dict()))
    return d, model.eval()


def _ids(texts=(CLEAN, CORRUPTED)):
    tok = CharTokenizer(LETTERS)
    return [torch.tensor(tok.encode(t)) for t in texts]


def _argv(d, *extra):
    return [
        "circuit",
        "--checkpoint",
        str(d),
        "--clean",
        CLEAN,
        "--corrupted",
        CORRUPTED,
        "--answers",
        "a",
        "b",
        *extra,
    ]


def _page_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="attn-circuit">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


class _Strict(HTMLParser):
    """Counts open and closed elements: a page whose data broke out of its script would not balance."""

    VOID = frozenset({"meta", "link", "br", "img", "input"})

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (self.stack[-5:], tag)
        self.stack.pop()


@pytest.mark.parametrize(("method", "steps"), [("EAP", 5), ("EAP-IG-inputs", 3)])
def test_prints_the_librarys_edges_and_curve_and_writes_the_page(checkpoint, tmp_path, capsys, method, steps):
    d, model = checkpoint
    out = tmp_path / "circuit.html"
    argv = _argv(d, "--method", method, "--ig-steps", str(steps), "--top", "6", "--budget", "10%", "--out", str(out))
    assert main(argv) == 0
    text = capsys.readouterr().out
    clean, corrupted = _ids()
    metric = logit_diff(0, 1)
    scores = edge_attribution(model, clean, corrupted, metric, method=method, ig_steps=steps)
    curve = faithfulness_curve(model, clean, corrupted, metric, scores)
    # the top edges, strongest |score| first, with their sign
    listed = text.split("the 6 strongest edges")[1].split("\n\n")[0].strip().splitlines()[1:]
    assert len(listed) == 6
    for line, (w, r, s) in zip(listed, scores.top(6), strict=True):
        writer, arrow, reader, score = line.split()
        assert (writer, arrow, reader) == (format_node(w), "->", format_node(r))
        assert float(score) == pytest.approx(s, abs=1e-5)
    # the faithfulness at each of MIB's budgets, CPR and CMD
    rows = re.findall(r"^\s+([\d.]+)%\s+(\d+) edges\s+([-+][\d.]+)$", text, re.M)
    assert [int(n) for _, n, _ in rows] == list(curve.n_edges)
    for (_, _, f), want in zip(rows, curve.faithfulness, strict=True):
        assert float(f) == pytest.approx(want, abs=1e-4)
    cpr, cmd = re.search(
        r"CPR \(area under the curve\) ([\d.]+)\s+CMD \(area between it and 1\) ([\d.]+)", text
    ).groups()
    assert float(cpr) == pytest.approx(curve.cpr, abs=2e-5) and float(cmd) == pytest.approx(curve.cmd, abs=2e-5)

    # the page: parseable, offline, its data the library's
    page = out.read_text(encoding="utf-8")
    parser = _Strict()
    parser.feed(page)
    parser.close()
    assert parser.stack == []
    assert "default-src 'none'" in page and 'src="http' not in page
    data = _page_data(page)
    n = int(0.1 * len(scores))
    assert data["budget"]["n_edges"] == n and data["n_edges"] == len(scores)
    (faith,) = faithfulness(model, clean, corrupted, metric, scores.top_n(n))
    assert data["budget"]["faithfulness"] == pytest.approx(faith, abs=1e-6)
    assert len(data["edges"]) == min(n, MAX_DRAWN)
    for (w, r, s), (w2, r2, s2) in zip(data["edges"], scores.top(n), strict=True):
        assert (tuple(w), tuple(r)) == (w2, r2) and s == pytest.approx(s2, rel=1e-6, abs=1e-9)
    assert data["curve"]["faithfulness"] == pytest.approx(list(curve.faithfulness), abs=1e-6)
    assert data["n_kv_heads"] == 2 and data["method"] == method
    # every head the drawn edges touch has its attention on both prompts: trace's weights
    assert data["patterns"]
    weights = [trace(model, x).weights[:, 0] for x in (clean, corrupted)]  # (L, H, T, T)
    for key, pats in data["patterns"].items():
        layer, head = map(int, key.split("."))
        for which, w in zip(("clean", "corrupted"), weights, strict=True):
            torch.testing.assert_close(torch.tensor(pats[which]), w[layer, head].float(), atol=1e-5, rtol=0)


def test_the_page_is_written_atomically(checkpoint, tmp_path, monkeypatch, capsys):
    """A write that fails at the rename leaves the old page whole, and no half-written file behind."""
    import attnlab.files

    d, _ = checkpoint
    out = tmp_path / "circuit.html"
    out.write_text("the old page")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(attnlab.files.os, "replace", fail)
    assert main(_argv(d, "--out", str(out))) == 2
    assert "disk full" in capsys.readouterr().err
    assert out.read_text() == "the old page"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["circuit.html"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--answers", "ab", "b"], "--answers: the first answer 'ab' is 2 tokens"),
        (["--corrupted", "abcabcde"], "--clean and --corrupted must have the same number of tokens"),
        (["--corrupted", CLEAN], "--corrupted is the clean prompt itself"),  # (once: a faithfulness of noise)
        (["--method", "EAP-IG"], "--method must be one of EAP, EAP-IG-inputs, EAP-IG-activations"),
        (["--budget", "0%"], "--budget: budget must be a share of the edges in (0%, 100%]"),
        (["--budget", "150%"], "--budget: budget must be a share of the edges in (0%, 100%]"),
        (["--budget", "five"], "--budget: budget must be a percentage like 5% or a fraction like 0.05"),
        (["--ig-steps", "0"], "argument --ig-steps: expected an integer from 1 to 1,024, got 0"),
        (["--out", "c.png"], "--out must end in one of .html"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(checkpoint, capsys, extra, message):
    d, _ = checkpoint
    try:
        code = main(_argv(d, *extra))
    except SystemExit as exc:  # (argparse's own refusal of a flag's value)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err and "Traceback" not in err


def test_parse_budget_reads_percentages_and_fractions():
    assert parse_budget("5%") == pytest.approx(0.05) and parse_budget(0.2) == 0.2 and parse_budget("1") == 1.0
    for bad in (0, -0.1, 1.01, float("nan"), True, "x%", None):
        with pytest.raises(ValueError, match="budget"):
            parse_budget(bad)


def test_jupyter_shows_the_same_view_inline(checkpoint):
    from attnlab.tools.circuit import circuit_report
    from attnlab.tools.loading import load_model

    d, model = checkpoint
    report = circuit_report(load_model(d), CLEAN, CORRUPTED, ("a", "b"), budget="20%")
    for shown in (report._repr_html_(), report.result._repr_html_()):
        assert shown.startswith('<iframe class="attnlab-circuit" sandbox="allow-scripts"')
        page = html.unescape(re.search(r'srcdoc="(.*)"></iframe>', shown, re.S).group(1))
        data = _page_data(page)
        want = edge_attribution(model, *_ids(), logit_diff(0, 1))
        n = int(0.2 * len(want))
        assert [(tuple(w), tuple(r)) for w, r, _ in data["edges"]] == [(w, r) for w, r, _ in want.top(n)]
        assert "function" in page and "attn-circuit" in page  # the view's code is inline: no network


# --------------------------------------------------------------------------------------------
# attnlab serve: POST /api/circuit and the tab's files
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(checkpoint, tmp_path_factory):
    from fastapi.testclient import TestClient

    from attnlab.tools.loading import load_model
    from attnlab.tools.serve.app import create_app
    from attnlab.tools.serve.engine import Engine

    d, _ = checkpoint
    app = create_app(Engine(load_model(d)), allowed_hosts={"testserver"})
    with TestClient(app) as c:
        yield c


def test_a_circuit_whose_client_left_stops_at_the_next_model_call(checkpoint):
    # The server ran every stage of a circuit (minutes and GBs on a real model) for a reader long gone.
    from attnlab.tools.circuit import serve_circuit
    from attnlab.tools.loading import load_model
    from attnlab.tools.serve.engine import Engine

    engine = Engine(load_model(checkpoint[0]))
    asked = []

    def left():  # the client goes after the first model call
        asked.append(engine.snapshot()["model_calls"])
        return len(asked) > 1

    body = {"clean": CLEAN, "corrupted": CORRUPTED, "answers": ["a", 1], "ig_steps": 2}
    assert serve_circuit(engine, **body, left=left) is None
    assert engine.snapshot()["model_calls"] == 1 and asked == [0, 1]
    assert serve_circuit(engine, **body, left=lambda: False) is not None  # (3 calls: see below)
    assert engine.snapshot()["model_calls"] == 4


def test_serve_answers_the_circuit_view(checkpoint, client):
    _, model = checkpoint
    body = {"clean": CLEAN, "corrupted": CORRUPTED, "answers": ["a", 1], "method": "EAP-IG-activations",
            "ig_steps": 2, "budget": "25%"}  # fmt: skip
    calls = client.get("/api/stats").json()["model_calls"]
    r = client.post("/api/circuit", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    # in stages, each its own model call (the scores, the circuits, the attention): the requests that
    # come in meanwhile run between them
    assert client.get("/api/stats").json()["model_calls"] - calls == 3
    clean, corrupted = _ids()
    metric = logit_diff(0, 1)
    want = edge_attribution(model, clean, corrupted, metric, method="EAP-IG-activations", ig_steps=2)
    n = int(0.25 * len(want))
    assert data["static"] is False and data["budget"]["n_edges"] == n
    for (w, r_, s), (w2, r2, s2) in zip(data["edges"], want.top(n), strict=True):
        assert (tuple(w), tuple(r_)) == (w2, r2) and s == pytest.approx(s2, rel=1e-5, abs=1e-8)
    curve = faithfulness_curve(model, clean, corrupted, metric, want)
    assert data["curve"]["cpr"] == pytest.approx(curve.cpr, abs=1e-6)
    # the page links the tab's files, and the server serves them
    page = client.get("/").text
    assert 'src="assets/circuit.js"' in page and 'data-view="circuit"' in page
    assert page.index("assets/patching.js") < page.index("assets/circuit.js") < page.index("assets/viewer.js")
    js = client.get("/assets/circuit.js")
    assert js.status_code == 200 and "CircuitView" in js.text


@pytest.mark.parametrize(
    ("change", "status", "message"),
    [
        ({"corrupted": "abcabcde"}, 422, "same number of tokens"),
        ({"corrupted": CLEAN}, 422, "corrupted is the clean prompt itself"),
        ({"answers": ["ab", "b"]}, 422, "answers[0] 'ab' is 2 tokens"),
        ({"answers": ["a", "a"]}, 422, "two different tokens"),
        ({"method": "ACDC"}, 422, "method"),
        ({"budget": "0%"}, 422, "budget must be a share of the edges"),
        ({"budget": 2.0}, 422, "budget must be a share of the edges"),
        ({"ig_steps": 0}, 422, "ig_steps"),
        ({"clean": "a" * 65, "corrupted": "b" * 65}, 422, "at most 64"),
    ],
)
def test_serve_answers_a_bad_circuit_request_with_a_4xx_and_a_message(client, change, status, message):
    body = {"clean": CLEAN, "corrupted": CORRUPTED, "answers": ["a", "b"]} | change
    r = client.post("/api/circuit", json=body)
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    assert message in detail and "\n" not in detail


# --------------------------------------------------------------------------------------------
# Prompts in bulk: --pairs FILE.jsonl, the mean over pairs
# --------------------------------------------------------------------------------------------
PAIRS = [  # two lengths: the pairs of each length run as one batch, the mean is over all three
    ("abcabcd", "abcabce", "a", "b"),
    ("bcdbcda", "bcdbcdf", "c", "d"),
    ("abcab", "abcae", "c", "a"),
]


def _write_pairs(path, pairs):
    path.write_text("".join(json.dumps({"clean": c, "corrupted": x, "answers": [a, b]}) + "\n" for c, x, a, b in pairs))
    return path


def test_pairs_are_scored_together_as_the_mean_over_pairs(checkpoint, tmp_path, capsys):
    from attnlab.interpret import circuit_metrics
    from attnlab.interpret.circuits import MIB_BUDGETS

    d, model = checkpoint
    path = _write_pairs(tmp_path / "pairs.jsonl", PAIRS)
    out = tmp_path / "pairs.html"
    argv = ["circuit", "--checkpoint", str(d), "--pairs", str(path), "--top", "5", "--out", str(out)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "the mean over 3 pairs" in text
    # the reference: each pair alone, then the mean (the scores are linear in the metric)
    tok = CharTokenizer(LETTERS)
    runs = [
        (*(torch.tensor(tok.encode(t)) for t in (c, x)), logit_diff(*tok.encode(a), *tok.encode(b)))
        for c, x, a, b in PAIRS
    ]
    per_pair = [edge_attribution(model, c, x, m) for c, x, m in runs]
    mean = per_pair[0]
    mean = type(mean)(mean.graph, sum(s.scores for s in per_pair) / len(per_pair), "EAP", 1, False)
    listed = text.split("the 5 strongest edges")[1].split("\n\n")[0].strip().splitlines()[1:]
    for line, (w, r, s) in zip(listed, mean.top(5), strict=True):
        writer, _, reader, score = line.split()
        assert (writer, reader) == (format_node(w), format_node(r)) and float(score) == pytest.approx(s, abs=1e-5)
    circuits = [mean.top_n(int(b * len(mean))) for b in MIB_BUDGETS]
    values = torch.tensor([circuit_metrics(model, c, x, m, circuits) for c, x, m in runs]).mean(0)
    with torch.no_grad():
        m_clean = sum(float(m(model(c[None]))) for c, _, m in runs) / 3
        m_corr = sum(float(m(model(x[None]))) for _, x, m in runs) / 3
    want = (values - m_corr) / (m_clean - m_corr)
    rows = re.findall(r"^\s+([\d.]+)%\s+(\d+) edges\s+([-+][\d.]+)$", text, re.M)
    assert [float(f) for _, _, f in rows] == pytest.approx(want.tolist(), abs=1e-4)
    data = _page_data(out.read_text(encoding="utf-8"))
    assert data["pairs"] == 3 and data["clean"]["text"] == PAIRS[0][0]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ([PAIRS[0], ("abcab", "abcabe", "a", "b")], "line 2: clean and corrupted must have the same number of tokens"),
        ([PAIRS[0], PAIRS[1], ("abc", "abd", "ab", "b")], "line 3: the first answer 'ab' is 2 tokens"),
        ([PAIRS[0], ("abcab", "abcab", "a", "b")], "line 2: corrupted is the clean prompt itself"),
    ],
)
def test_a_bad_pair_is_refused_with_its_line_number(checkpoint, tmp_path, capsys, lines, message):
    d, _ = checkpoint
    path = _write_pairs(tmp_path / "pairs.jsonl", lines)
    assert main(["circuit", "--checkpoint", str(d), "--pairs", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_a_pairs_line_that_is_not_json_is_refused_with_its_number(checkpoint, tmp_path, capsys):
    d, _ = checkpoint
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"clean": "abc", "corrupted": "abd", "answers": ["a", "b"]}) + "\n\n{not json\n")
    assert main(["circuit", "--checkpoint", str(d), "--pairs", str(path)]) == 2
    assert "line 3: not valid JSON" in capsys.readouterr().err
    assert main(["circuit", "--checkpoint", str(d), "--pairs", str(path), "--clean", "abc"]) == 2
    assert "not both" in capsys.readouterr().err


@settings(max_examples=50, deadline=None)
@given(fraction=st.floats(1e-4, 1.0, allow_nan=False))
def test_a_budget_reads_the_same_as_a_percentage_or_a_fraction(fraction):
    assert parse_budget(f"{fraction * 100!r}%") == pytest.approx(fraction, rel=1e-12)
    assert parse_budget(repr(fraction)) == fraction == parse_budget(fraction)


def test_a_page_keeps_the_attention_of_the_strongest_edges_heads_when_all_would_not_fit(checkpoint, monkeypatch):
    import attnlab.interpret.circuit_view as view
    from attnlab.interpret import circuit_result

    _, model = checkpoint
    result = circuit_result(model, *_ids(), (0, 1), budget="50%")
    full = result.section()
    T = len(_ids()[0])
    assert len(full["patterns"]) > 2 and full["patterns_note"] == ""
    monkeypatch.setattr(view, "MAX_PATTERN_VALUES", 2 * 2 * T * T)  # two heads' worth
    small = result.section()
    # the two heads kept are the first the strongest edges touch (a reference walk written here)
    group = model.config.n_heads // model.config.kv_heads
    order = []
    for w, r, _ in full["edges"]:
        touched = [(w[1], w[2])] if w[0] == "attn_head_out" else []
        if r[0] == "q_input":
            touched.append((r[1], r[2]))
        elif r[0] in ("k_input", "v_input"):
            touched += [(r[1], r[2] * group + i) for i in range(group)]
        order += [f"{layer}.{head}" for layer, head in touched if f"{layer}.{head}" not in order]
    assert list(small["patterns"]) == order[:2]
    assert all(small["patterns"][k] == full["patterns"][k] for k in order[:2])
    assert f"2 of the circuit's {len(order)} heads" in small["patterns_note"]


# ---------------------------------------------------------------------------------------------
# --sae: SAE latents as nodes
# ---------------------------------------------------------------------------------------------
def _saved_sae(directory, hook="blocks.0.hook_resid_post", d_in=24, seed=0):
    """A random TopK SAE (40 latents, k=6) saved as SAELens's files; returns it and its directory."""
    from attnlab.interpret import SAE, SAEConfig

    torch.manual_seed(seed)
    sae = SAE(SAEConfig(d_in=d_in, d_sae=40, architecture="topk", k=6, hook_name=hook))
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 1 / p.shape[0] ** 0.5))
    return sae.eval(), sae.save(directory)


def test_sae_latents_are_named_in_the_printed_edges_and_on_the_page(checkpoint, tmp_path, capsys):
    d, model = checkpoint
    _, sae_dir = _saved_sae(tmp_path / "sae")
    mlp_dir = tmp_path / "mlp"
    _saved_sae(mlp_dir, hook="blocks.1.hook_mlp_out", seed=1)
    out = tmp_path / "circuit.html"
    argv = _argv(d, "--sae", str(sae_dir), "--sae", str(mlp_dir), "--top", "30", "--budget", "30%", "--out", str(out))
    assert main(argv) == 0
    text = capsys.readouterr().out
    from attnlab.interpret import SAE

    saes = [SAE.load(sae_dir), SAE.load(mlp_dir)]
    scores = edge_attribution(model, *_ids(), logit_diff(0, 1), saes=saes)
    for s in scores.graph.saes:
        assert f"SAE at {s.hook}: {len(s.latents)} of its 40 latents are nodes" in text
    listed = text.split("the 30 strongest edges")[1].split("\n\n")[0].strip().splitlines()[1:]
    assert len(listed) == 30
    for line, (w, r, s) in zip(listed, scores.top(30), strict=True):
        writer, rest = line.strip().split(" -> ")
        reader, score = rest.rsplit(None, 1)
        assert (writer, reader.strip()) == (format_node(w), format_node(r))
        assert float(score) == pytest.approx(s, abs=1e-5)
    assert re.search(r"sae 0\.hook_resid_post latent \d+ ->", text)
    assert format_node(("sae_latent", "blocks.0.hook_resid_post", 7)) == "sae 0.hook_resid_post latent 7"
    assert format_node(("sae_error", "blocks.1.hook_mlp_out", None)) == "sae 1.hook_mlp_out error"
    page = out.read_text()
    parser = _Strict()
    parser.feed(page)
    assert parser.stack == []
    data = _page_data(page)
    drawn = scores.top(min(int(0.3 * len(scores)), MAX_DRAWN))
    with_sae = [(w, r, s) for w, r, s in drawn if w[0].startswith("sae") or r[0].startswith("sae")]
    assert with_sae and len(data["sae_edges"]) == len(with_sae)
    for (w, r, s), row in zip(with_sae, data["sae_edges"], strict=True):
        assert row[:2] == [format_node(w), format_node(r)] and row[2] == pytest.approx(s, rel=1e-6)
        assert html.escape(format_node(w)) in page.split('id="circuit-sae-edges"')[1]
    assert not any(str(n[0]).startswith("sae") for e in data["edges"] for n in e[:2])  # the graph draws the model's


@pytest.mark.parametrize(
    ("which", "message"),
    [("wide", "d_in=32 does not match"), ("missing", "no SAE in"), ("attn", "hook_attn_out")],
)
def test_a_bad_sae_is_one_line_naming_its_flag(checkpoint, tmp_path, capsys, which, message):
    d, _ = checkpoint
    path = tmp_path / which
    if which == "wide":
        _saved_sae(path, d_in=32)
    elif which == "attn":
        _saved_sae(path, hook="blocks.0.hook_attn_out")
    else:
        path.mkdir()
    assert main(_argv(d, "--sae", str(path))) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err and "Traceback" not in err
    assert f"--sae {path}: " in err


def test_circuit_result_refuses_float_token_ids(checkpoint):
    # They were truncated to integers silently (every other entry point refuses them).
    from attnlab.interpret import circuit_result

    _, model = checkpoint
    clean, corrupted = _ids()
    with pytest.raises(TypeError, match=r"must hold integer token ids, got torch\.float32"):
        circuit_result(model, clean.float() + 0.7, corrupted.float() + 0.7, (0, 1))
