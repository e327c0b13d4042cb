"""attnlab.tools.bench's registry and harness: the measuring tools behave (no timing thresholds:
performance lives in benchmarks/)."""

from __future__ import annotations

import pytest
import torch

from attnlab.tools.bench import IMPLEMENTATIONS, harness, registry

KW = {"d_model": 24, "num_heads": 4, "context_length": 16}


@pytest.mark.parametrize(
    "pair",
    [
        ("attnlab", "torch"),
        ("attnlab", "tutorial"),
        ("attnlab-wrapper", "tutorial-wrapper"),
        ("tutorial-matrix", "tutorial-loop"),
    ],
)
def test_shared_weights_make_competitors_agree(pair):
    torch.manual_seed(0)
    src, dst = (registry.build_module(name, **KW) for name in pair)
    x = torch.randn(2, 16, 24)
    with torch.no_grad():
        before = (src(x) - dst(x)).abs().max()
    registry.share_weights(src, dst)
    diffs = registry.max_abs_difference({pair[0]: src, pair[1]: dst}, x)
    assert before > 1e-3  # independent initialisations really differ, so the check below can fail
    assert diffs[pair[1]] < 1e-5


def test_share_weights_refuses_to_drop_a_bias_or_a_projection():
    src = registry.build_module("attnlab", **KW)
    with torch.no_grad():
        src.W_query.bias = torch.nn.Parameter(torch.ones(24))  # a biased source, an unbiased target
    with pytest.raises(ValueError, match="bias"):
        registry.share_weights(src, registry.build_module("tutorial", **KW))
    with pytest.raises(ValueError, match="output projection"):  # one head of width d: no out_proj
        registry.share_weights(registry.build_module("attnlab", **KW), registry.build_module("tutorial-matrix", **KW))


def test_build_competitors_checks_each_against_its_reference():
    """A reference that is not timed is still built for the check (the tutorial wrapper's is attnlab's)."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 24)
    modules, diffs = registry.build_competitors(["tutorial-wrapper", "tutorial", "attnlab", "torch"], x, **KW)
    assert list(modules) == ["tutorial-wrapper", "tutorial", "attnlab", "torch"]
    assert set(diffs) == {"tutorial-wrapper", "tutorial", "torch"}
    assert max(diffs.values()) < 1e-5
    for name in IMPLEMENTATIONS:  # every reference is itself a competitor that is its own reference
        ref = IMPLEMENTATIONS[name].reference
        assert ref is None or IMPLEMENTATIONS[ref].reference is None


def test_attention_cores_agree_with_each_other():
    torch.manual_seed(0)
    qkv = torch.randn(2, 16, 3 * 24)
    cores, diffs = registry.build_competitors(["attnlab-core", "torch-core", "tutorial-core"], qkv, **KW)
    assert max(diffs.values()) < 1e-5
    out = cores["attnlab-core"](qkv)
    assert out.shape == (2, 4, 16, 6)
    # causal: the first query sees only the first key, so its output is the first value
    v = qkv.view(2, 16, 3, 4, 6)[:, 0, 2]  # (b, H, hd)
    torch.testing.assert_close(out[:, :, 0], v)


def test_compare_forward_backward_interleaves_and_counts():
    torch.manual_seed(0)
    calls = []

    class Spy(torch.nn.Module):
        def __init__(self, tag):
            super().__init__()
            self.tag, self.lin = tag, torch.nn.Linear(8, 8)

        def forward(self, x):
            calls.append(self.tag)
            return self.lin(x)

    timings = harness.compare_forward_backward(
        {"a": Spy("a"), "b": lambda: Spy("b")}, torch.randn(2, 3, 8), repeats=3, warmup=1
    )
    # one forward each for the output shapes, then warm-up and timed rounds interleaved A, B, A, B, ...
    assert calls == ["a", "b"] + ["a", "b"] * 4
    assert [len(t.times_ms) for t in timings.values()] == [3, 3]
    assert all(t.min_ms <= t.median_ms <= t.max_ms for t in timings.values())
    assert harness.paired_ratio(timings["a"], timings["a"]) == pytest.approx(1.0)


def test_interleave_can_alternate_who_goes_first():
    calls = []
    steps = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    timings = harness.interleave(steps, repeats=3, warmup=1, alternate=True)
    assert calls == list("abc") + list("abc") + list("cba") + list("abc")  # warm-up round 0, timed rounds 0-2
    assert list(timings) == ["a", "b", "c"] and all(len(t.times_ms) == 3 for t in timings.values())
    ratios = harness.compare(timings["a"], timings["b"])
    assert ratios["paired"] == pytest.approx(harness.paired_ratio(timings["a"], timings["b"]))
    assert ratios["of_medians"] == pytest.approx(timings["a"].median_ms / timings["b"].median_ms)


def test_compare_forward_backward_counts_the_page_faults_of_each_step():
    pytest.importorskip("resource", reason="page faults are counted where the OS reports them (Unix)")
    import mmap

    pages = 1024

    class FreshMemory(torch.nn.Linear):
        """Maps in and touches 1024 new pages every forward: at least 1024 minor faults."""

        def forward(self, x):
            with mmap.mmap(-1, pages * mmap.PAGESIZE) as m:
                for i in range(pages):
                    m[i * mmap.PAGESIZE] = 1
            return super().forward(x)

    timings = harness.compare_forward_backward(
        {"fresh": FreshMemory(8, 8), "plain": torch.nn.Linear(8, 8)}, torch.randn(2, 3, 8), repeats=3, warmup=1
    )
    assert len(timings["fresh"].page_faults) == 3
    assert min(timings["fresh"].page_faults) >= pages
    assert timings["plain"].median_page_faults < pages
    assert timings["fresh"].to_dict()["median_page_faults"] == timings["fresh"].median_page_faults


@pytest.mark.parametrize(("kwargs", "err"), [({"repeats": 0}, ValueError), ({"warmup": -1}, ValueError)])
def test_compare_forward_backward_rejects_bad_counts(kwargs, err):
    with pytest.raises(err, match=next(iter(kwargs))):
        harness.compare_forward_backward({"a": torch.nn.Linear(4, 4)}, torch.randn(2, 4), **kwargs)


def test_build_module_errors():
    with pytest.raises(ValueError, match="spec"):
        registry.build_module("no-such-thing")
    m = registry.build_module("torch.nn:Linear", in_features=3, out_features=2)
    assert isinstance(m, torch.nn.Linear)


@pytest.mark.slow
def test_peak_memory_sees_the_tutorial_scores():
    # 1 x 512 tokens, 12 heads: the tutorial path holds ~3 x 12 x 512^2 floats (36 MiB) at once.
    kw = {"d_model": 96, "num_heads": 12, "context_length": 512}
    tut = harness.peak_memory_mb("tutorial", (1, 512, 96), kwargs=kw)
    ours = harness.peak_memory_mb("attnlab", (1, 512, 96), kwargs=kw)
    expected = IMPLEMENTATIONS["tutorial"].score_bytes(1, 512, 12) / 2**20
    assert tut.forward_mb > 0.8 * expected
    assert ours.forward_mb < tut.forward_mb
    with pytest.raises(RuntimeError, match="failed"):
        harness.peak_memory_mb("tutorial", (1, 600, 96), kwargs=kw)  # longer than context_length: the child fails


def _benchmark(name: str):
    """The script ``benchmarks/<name>.py`` imported as a module (its functions, not its run)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_breakdown_profiles_one_and_the_same_step():
    """benchmarks/decode_breakdown.py profiles repeated calls of one decoding step: each call is the step
    after the prompt (the caches' count set back), the eager forward's logits, the same every time."""
    from attnlab.model import GPT, GPTConfig

    breakdown = _benchmark("decode_breakdown")
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", drop_rate=0.0)).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    token = torch.tensor([3])
    dec, step = breakdown.stepper(model, prompt, token, 8, compile=False)
    first, second = step(), step()
    assert dec.plan.slots == 8 and dec.caches[0].seen == 6
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    with torch.no_grad():
        ref = model(torch.cat([prompt, token[None]], dim=1))[:, -1]
    torch.testing.assert_close(first, ref, rtol=1e-5, atol=1e-5)


def test_generate_benchmark_finds_where_tokens_part_and_the_eager_gap_there():
    """benchmarks/generate.py's ``departures``: the first new token where a decoder's tokens differ from
    the eager ones, and the eager forward's two best logits there (those the token was chosen from),
    counted in steps of the model's dtype; nothing for a decoder with the same tokens."""
    from attnlab.model import GPT, GPTConfig

    bench = _benchmark("generate")
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", drop_rate=0.0)).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    ref = model.generate(prompt, 6, temperature=0, fast=False)
    other = ref.clone()
    other[1, 5 + 3] = (other[1, 5 + 3] + 1) % model.config.vocab_size  # row 1 parts at new token 3
    other[1, 5 + 4] = (other[1, 5 + 4] + 1) % model.config.vocab_size
    assert bench.departures(model, prompt, 6, ref, {}) == {}
    found = bench.departures(model, prompt, 6, ref, {"other": other})
    with torch.no_grad():  # the logits that chose new token 3 of row 1: the eager forward over what precedes it
        top = model(ref[1:, : 5 + 3])[0, -1].topk(2).values
    step = torch.finfo(torch.float32).eps * 2.0 ** torch.floor(torch.log2(top[0].abs())).item()
    assert found["other"].startswith("parts from the eager tokens at new token 3 of 6 (row 1)")
    assert f"({top[0]:.4g}, {top[1]:.4g})" in found["other"]
    steps = float(found["other"].split(" are ")[1].split(" ")[0])
    assert abs(steps - float((top[0] - top[1]) / step)) <= max(1.0, 1e-3 * steps)
