"""``attnlab bench``: its competitors compute what they claim, its FLOP counts are right, and it
writes a complete report. No timing is asserted (timings belong to the benchmark, not the tests)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from attnlab import causal_mask
from attnlab.cli import main
from attnlab.tools.bench import (
    IMPLEMENTATIONS,
    SWEEP,
    TutorialLoopAttention,
    attention_benchmark,
    build_module,
    format_attention_report,
    goals_met,
    matmul_rate,
    peak_memory_mb,
)
from attnlab.tools.bench.report import table
from attnlab.tutorial_code import CausalAttention


def build(name: str, d: int, H: int, T: int) -> torch.nn.Module:
    return build_module(name, d_model=d, num_heads=H, context_length=T)


def test_tutorial_loop_matches_the_matrix_form_and_an_explicit_float64_loop(ref):
    torch.manual_seed(0)
    loop = TutorialLoopAttention(6, 4)
    matrix = CausalAttention(6, 4, 5, 0.0)
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            getattr(matrix, name).weight.copy_(getattr(loop, name).weight)
    x = torch.randn(2, 5, 6, requires_grad=True)
    y = loop(x)
    torch.testing.assert_close(y, matrix(x))
    for b in range(2):
        q, k, v = loop.W_query(x[b]), loop.W_key(x[b]), loop.W_value(x[b])
        want, _ = ref.loop_attention(q, k, v, allowed=causal_mask(5))
        torch.testing.assert_close(y[b].double(), want, atol=1e-6, rtol=1e-5)
    y.sum().backward()  # it is timed forward+backward: the graph must be differentiable
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", [n for n in SWEEP if n != "tutorial-loop"] + ["attnlab-wrapper", "tutorial-core"])
def test_flop_count_matches_torchs_counter(name):
    """Impl.flops counts what torch's own FlopCounterMode sees: forward exactly, fwd+bwd 3x.

    torch's counter does not see inside the CPU fused attention kernel, so attnlab and torch are
    run on their explicit paths here (same matmuls, weights materialised); the fused cores cannot be.
    """
    B, T, d, H = 2, 16, 32, 4
    torch.manual_seed(0)
    module = build(name, d, H, T)
    if name in ("attnlab", "attnlab-wrapper"):
        forward = lambda x: module(x, return_weights=True)[0]
    elif name == "torch":
        mask = ~causal_mask(T)  # torch: True = may not attend
        forward = lambda x: module.mha(x, x, x, need_weights=True, attn_mask=mask)[0]
    else:
        forward = module
    x = torch.randn(B, T, 3 * d if name.endswith("-core") else d, requires_grad=True)
    with FlopCounterMode(display=False) as fwd:
        y = forward(x)
    with FlopCounterMode(display=False) as both:
        forward(x).backward(torch.ones_like(y))
    assert fwd.get_total_flops() == IMPLEMENTATIONS[name].flops(B, T, d)
    assert both.get_total_flops() == 3 * IMPLEMENTATIONS[name].flops(B, T, d)


def test_every_competitor_maps_x_to_the_same_shape():
    x = torch.randn(1, 8, 16)
    for name in IMPLEMENTATIONS:
        if name.endswith("-core"):  # packed q, k, v in; per-head context out
            assert build(name, 16, 2, 8)(torch.randn(1, 8, 48)).shape == (1, 2, 8, 8), name
        else:
            assert build(name, 16, 2, 8)(x).shape == (1, 8, 16), name
    with pytest.raises(ValueError, match="unknown implementation"):
        build("numpy", 16, 2, 8)


def test_matmul_rate_is_reported_in_gflops():
    r = matmul_rate(64, repeats=2)
    assert r["n"] == 64 and r["gflops_best"] >= r["gflops_median"] > 0


@pytest.mark.slow
def test_memory_probe_sees_the_tutorials_quadratic_scores():
    """The fresh-process probe (with its warm-up forward) sees the T^2 score tensors grow ~16x for
    4x the tokens: 3 x H x T^2 floats = 48 MiB at 1024 tokens, 3 MiB at 256."""
    kw = {"d_model": 64, "num_heads": 4}
    small = peak_memory_mb("tutorial", (1, 256, 64), kwargs={**kw, "context_length": 256})
    large = peak_memory_mb("tutorial", (1, 1024, 64), kwargs={**kw, "context_length": 1024})
    assert large.forward_mb > 30
    assert large.forward_mb > 5 * small.forward_mb


def test_text_and_markdown_tables_align_their_columns():
    rows = [["a", "1.5", "x"], ["long name", "10.25", "yy"]]
    assert table(["name", "ms", "note"], rows, align="lrl") == [
        "name          ms  note",
        "a            1.5  x",
        "long name  10.25  yy",
    ]
    assert table(["name", "ms"], [["a", "1"]], markdown=True) == ["| name | ms |", "|:---|---:|", "| a | 1 |"]


TINY = ["--quick", "--seq-lens", "8,16", "--d-model", "32", "--heads", "2", "--loop-max-len", "8", "--repeats", "1"]
TINY += ["--gen-lens", "12,16", "--train-lens", "8", "--threads", "1"]  # 1 thread: fast on a busy machine


@pytest.mark.slow
def test_cli_writes_a_complete_report(tmp_path, capsys):
    out = tmp_path / "report"
    threads = torch.get_num_threads()
    out.mkdir()
    (out / "attention_memory.png").write_bytes(b"an earlier run's plot")  # this run skips memory: must go
    assert main(["bench", *TINY, "--out", str(out), "--skip-memory"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert torch.get_num_threads() == threads  # the threads setting is restored afterwards
    names = sorted(p.name for p in out.iterdir())
    assert names == ["attention_time.png", "generation.png", "report.md", "results.json", "training.png"]
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = json.loads((out / "results.json").read_text())
    rows = result["attention"]["rows"]
    assert [r["seq_len"] for r in rows] == [8, 16]
    assert set(rows[0]["results"]) == set(SWEEP)
    assert "tutorial-loop" not in rows[1]["results"]  # beyond --loop-max-len
    assert max(max(r["max_abs_diff"].values()) for r in rows) < 1e-4  # same function, same weights
    assert set(rows[0]["max_abs_diff"]) == {"tutorial-loop", "tutorial-wrapper", "tutorial", "torch"}
    assert all(r["same_tokens"] for r in result["generation"]["rows"])  # the cache changes nothing
    # Every FLOP rate is the FLOP count over the median time, and its fraction is of the best matmul seen.
    peak = result["peak_gflops"]
    assert peak == max(result["matmul"]["gflops_best"], result["matmul_end"]["gflops_best"])
    for row in rows:
        for name, r in row["results"].items():
            flops = 3 * IMPLEMENTATIONS[name].flops(1, row["seq_len"], 32)
            assert r["gflops"] == pytest.approx(flops / (r["median_ms"] / 1e3) / 1e9)
            assert r["fraction_of_matmul"] == pytest.approx(r["gflops"] / peak)
            assert r["median_ms"] == pytest.approx(sorted(r["times_ms"])[len(r["times_ms"]) // 2])
        attnlab, torch_ = row["results"]["attnlab"], row["results"]["torch"]
        assert row["ratios"]["attnlab/torch"]["of_medians"] == pytest.approx(attnlab["median_ms"] / torch_["median_ms"])
    report = (out / "report.md").read_text()
    for label in [IMPLEMENTATIONS[n].label for n in SWEEP]:
        assert label in report
    for heading in ("matmul rate", "forward + backward", "KV cache", "Training step"):
        assert heading in report
    assert f"**{result['peak_gflops']:.1f} GFLOP/s**" in report


def test_cli_refuses_to_measure_without_matplotlib(tmp_path, monkeypatch, capsys):
    """A missing plotting package is a one-line error before anything is measured: no progress on
    stderr (every suite logs as it starts), no report directory, and it comes at once."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: `import matplotlib` raises ImportError
    out = tmp_path / "report"
    assert main(["bench", *TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "attnlab bench: error: the report's plots need matplotlib, which is not installed: pip install 'attnlab[viz]'"
    ]
    assert not out.exists()


def test_cli_refuses_an_out_it_cannot_create_before_measuring(tmp_path, capsys):
    (tmp_path / "file").write_text("not a directory")
    out = tmp_path / "file" / "report"
    assert main(["bench", *TINY, "--out", str(out)]) == 2
    err = capsys.readouterr().err  # one line, and no suite's progress: nothing was measured
    assert err.splitlines() == [f"attnlab bench: error: cannot create the --out directory {out}: Not a directory"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--d-model", "10", "--heads", "3"], "--d-model must be divisible by --heads"),
        (["--gen-lens", "4"], "--gen-lens must all exceed"),
    ],
)
def test_cli_reports_bad_input(argv, message, capsys):
    assert main(["bench", "--quick", *argv]) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_bad_lists(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--seq-lens", "64,abc"])
    assert "comma-separated positive integers" in capsys.readouterr().err


@pytest.mark.slow
def test_goal_report_formats_a_quick_run():
    result = attention_benchmark(batch=1, seq_len=16, d_model=24, num_heads=4, repeats=2, warmup=0, memory=False)
    text = format_attention_report(result)
    assert "attnlab/torch" in text and "goal is for" in text  # goals are not judged at toy sizes
    assert "faults" in text and "malloc: as the process found it" in text
    assert goals_met(result)  # nothing judged, nothing missed
    assert max(result["max_abs_diff"].values()) < 1e-4
    assert set(result["timings"]) == set(IMPLEMENTATIONS) - {"tutorial-loop", "tutorial-matrix"}
    json.dumps(result)  # serialisable
