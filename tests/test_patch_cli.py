"""``attnlab patch``: the library's numbers, printed; heatmaps written; bad input in one line."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.cli import main
from attnlab.interpret import activation_patching, logit_diff
from attnlab.model import GPT, GPTConfig
from attnlab.tokenizers import CharTokenizer
from test_fast_decode import BASE, FAMILIES

LETTERS = "abcdefghijklmnop"
CLEAN, CORRUPTED = "abcabcd", "abcabce"  # the pair most tests patch, answers "a" and "b"


def patch_argv(d) -> list[str]:
    """``attnlab patch`` of the checkpoint ``d`` on CLEAN and CORRUPTED."""
    return ["patch", "--checkpoint", str(d), "--clean", CLEAN, "--corrupted", CORRUPTED, "--answers", "a", "b"]


def char_ids(*texts: str) -> list[torch.Tensor]:
    return [torch.tensor(CharTokenizer(LETTERS).encode(t)) for t in texts]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=16, context_length=16, emb_dim=24, n_heads=4, n_layers=2, drop_rate=0.0))
    d = model.save(tmp_path_factory.mktemp("patch") / "ckpt")
    (d / "tokenizer.json").write_text(json.dumps(CharTokenizer(LETTERS).to_dict()))
    return d, model.eval()


def test_prints_the_librarys_numbers_and_writes_pictures(checkpoint, tmp_path, capsys):
    d, model = checkpoint
    clean, corrupted = CLEAN, CORRUPTED
    out = tmp_path / "page.html"
    argv = patch_argv(d)
    assert main([*argv, "--site", "head_out", "--top", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    ids = char_ids(clean, corrupted)
    metric = logit_diff(0, 1)
    want = activation_patching(model, *ids, metric, "head_out")
    with torch.no_grad():
        lc, lx = (float(metric(model(i[None]))) for i in ids)
    restored = ((want - lx) / (lc - lx)).flatten()
    lines = text.split("head_out:")[1].strip().splitlines()
    # listed by the size of the effect, either way, with its sign
    for line, i in zip(lines[1:4], restored.abs().argsort(descending=True)[:3].tolist(), strict=True):
        L, H = divmod(i, want.shape[1])
        assert line.split()[0] == f"{L}.{H}"
        assert float(line.split()[1]) == pytest.approx(float(want[L, H]), abs=1e-4)
        assert float(line.split()[2]) == pytest.approx(float(restored[i]), abs=2e-3)
    assert f"clean run {lc:+.4f}" in text
    page = out.read_text()
    assert "data:image/png;base64," in page and "head_out" in page
    name = d.name  # a training run by its directory, as the other pages name it
    assert f"<title>{name} · attnlab</title>" in page and "Content-Security-Policy" in page
    assert f"clean run {lc:+.4f}" in page and "$" not in page  # (every placeholder filled)
    from attnlab.tools.loading import load_model
    from attnlab.tools.patch import patch_report

    report = patch_report(load_model(d), clean, corrupted, ("a", "b"), ["resid_pre"])
    # In Jupyter: the inspector's patching view (tests/test_patch_view.py checks its data)
    assert report._repr_html_().startswith('<iframe class="attnlab-patching"')
    torch.testing.assert_close(report.results["resid_pre"], activation_patching(model, *ids, metric, "resid_pre"))
    png = tmp_path / "heads.png"
    assert main([*argv, "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_patterns_single_weights_are_listed_by_head_query_and_key(checkpoint, tmp_path, capsys):
    d, model = checkpoint
    out = tmp_path / "weights.png"
    assert main([*patch_argv(d), "--site", "pattern_dest_src", "--top", "2", "--out", str(out)]) == 0
    want = activation_patching(model, *char_ids(CLEAN, CORRUPTED), logit_diff(0, 1), "pattern_dest_src")
    assert want.shape == (2, 4, 7, 7)  # (L, H, query, key), TransformerLens's
    base = float(want[0, 0, 0, 6])  # a key after its query: the corrupted run
    first = capsys.readouterr().out.split("pattern_dest_src:")[1].strip().splitlines()[1].split()
    layer, head, query, key = torch.unravel_index((want - base).abs().argmax(), want.shape)
    assert first[:5] == [f"{layer}.{head}", repr(CLEAN[query]), f"({query})", "on", repr(CLEAN[key])]  # (clean tokens)
    assert float(first[6]) == pytest.approx(float(want[layer, head, query, key]), abs=1e-4)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_keeps_freed_memory_for_its_reruns(checkpoint, monkeypatch):
    """attnlab patch tunes glibc's allocator (what attnlab train does) before its reruns."""
    import attnlab.cli.patch

    calls = []
    monkeypatch.setattr(attnlab.cli.patch, "tune_cpu_allocator", lambda: calls.append(1))
    assert main([*patch_argv(checkpoint[0]), "--site", "resid_pre"]) == 0
    assert calls == [1]


@pytest.mark.parametrize("site", ["neuron", "neuron_by_pos"])
def test_the_mlps_neurons_are_listed_by_layer_and_neuron(checkpoint, tmp_path, capsys, site):
    d, model = checkpoint
    out = tmp_path / "neurons.png"
    assert main([*patch_argv(d), "--site", site, "--top", "2", "--out", str(out)]) == 0
    want = activation_patching(model, *char_ids(CLEAN, CORRUPTED), logit_diff(0, 1), site)
    D = model.config.hidden_dim
    assert want.shape == ((2, D) if site == "neuron" else (2, 7, D))
    first = capsys.readouterr().out.split(f"{site}:")[1].strip().splitlines()[1].strip()
    corrupted_value = logit_diff(0, 1)(model(char_ids(CLEAN, CORRUPTED)[1][None])).item()
    where = torch.unravel_index((want - corrupted_value).abs().argmax(), want.shape)
    layer, neuron = int(where[0]), int(where[-1])
    label = f"layer {layer} neuron {neuron}"
    if site == "neuron_by_pos":
        label += f" at position {int(where[1])} {CLEAN[int(where[1])]!r}"
    assert first.startswith(label)
    assert float(first[len(label) :].split()[0]) == pytest.approx(float(want[where]), abs=1e-4)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--corrupted", "abcab"], "same number of tokens"),
        (["--answers", "ab", "c"], "'ab' is 2 tokens"),
        (["--out", "x.jpg"], "--out must end in one of .html, .htm, .png"),
        (["--top", "0"], "--top must be >= 1"),
        (["--out", "/nonexistent-dir/x.png"], "the directory /nonexistent-dir does not exist"),  # (once after the work)
        (
            ["--answers", "a", "a"],
            "twice (its logit minus itself is always 0)",
        ),  # (once "the prompts give the same logit difference")
        (["--clean", "", "--corrupted", ""], "--clean encodes to no tokens"),  # once a traceback
        (["--corrupted", ""], "--corrupted encodes to no tokens"),
        (["--clean", "abc" * 6, "--corrupted", "abd" * 6], "--clean is 18 tokens long, more than the model's"),
    ],
)
def test_bad_input_is_one_line(checkpoint, extra, message, capsys):
    d, _ = checkpoint
    argv = patch_argv(d)
    assert main(argv + extra) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_a_rope_model_patches_a_prompt_longer_than_its_context(tmp_path, capsys):
    """Relative positions slide a window over a long prompt (the forward and activation_patching take it), so
    the context check above is for learned positions only (a review found it refused RoPE models too)."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=16, context_length=8, emb_dim=24, n_heads=4, n_layers=2, drop_rate=0.0)
    model = GPT(GPTConfig(**cfg, pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)).eval()
    d = model.save(tmp_path / "ckpt")
    (d / "tokenizer.json").write_text(json.dumps(CharTokenizer(LETTERS).to_dict()))
    clean, corrupted = "abcabcdabcab", "abcabcdabcae"  # 12 tokens
    argv = ["patch", "--checkpoint", str(d), "--clean", clean, "--corrupted", corrupted, "--answers", "b", "c"]
    assert main(argv) == 0, capsys.readouterr().err
    ids = char_ids(clean, corrupted)
    want = activation_patching(model, *ids, logit_diff(1, 2), "resid_pre")  # (L, T)
    assert want.shape[-1] == 12 and f"{float(want.abs().max()):.3f}" in capsys.readouterr().out


# Gemma 2 (logits soft-capped) and Gemma 3 (a RoPE base of its own in the window layers), as
# tests/test_patching.py builds them, with this file's 16-letter vocabulary.
GEMMAS = {
    "gemma2": dict(
        FAMILIES["gemma"], post_norms=True, window=6, window_layers=[0, 2], attn_softcap=50.0, logit_softcap=2.0
    ),
    "gemma3": FAMILIES["gemma3"],
}


@pytest.fixture(scope="module")
def gemma_checkpoints(tmp_path_factory):
    out = {}
    for name, cfg in GEMMAS.items():
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**BASE, **cfg, "vocab_size": len(LETTERS)}))
        d = model.save(tmp_path_factory.mktemp("patch") / name)
        (d / "tokenizer.json").write_text(json.dumps(CharTokenizer(LETTERS).to_dict()))
        out[name] = d, model.eval()
    return out


@pytest.mark.parametrize("family", list(GEMMAS))
def test_gemma_models_are_patched(gemma_checkpoints, family, capsys):
    """Once a traceback (the patching reruns lacked Gemma 2's soft cap and Gemma 3's per-layer RoPE base):
    the printed best head is the library's, whose numbers tests/test_patching.py holds to hooked forwards."""
    d, model = gemma_checkpoints[family]
    clean, corrupted = "abcabcdab", "abdabcdab"
    argv = ["patch", "--checkpoint", str(d), "--clean", clean, "--corrupted", corrupted, "--answers", "c", "d"]
    assert main([*argv, "--site", "head_out", "--top", "3"]) == 0
    text = capsys.readouterr().out
    ids = char_ids(clean, corrupted)
    metric = logit_diff(*CharTokenizer(LETTERS).encode("cd"))
    want = activation_patching(model, *ids, metric, "head_out")
    with torch.no_grad():
        lc, lx = (float(metric(model(i[None]))) for i in ids)
    best = int(((want - lx) / (lc - lx)).flatten().abs().argmax())  # the largest effect, either way
    L, H = divmod(best, want.shape[1])
    line = text.split("head_out:")[1].strip().splitlines()[1].split()
    assert line[0] == f"{L}.{H}" and float(line[1]) == pytest.approx(float(want[L, H]), abs=1e-4)


@pytest.mark.parametrize("command", ["patch", "viz"])
def test_a_model_patching_cannot_rerun_is_one_line(checkpoint, tmp_path, monkeypatch, capsys, command):
    """A model whose forward does more than its blocks, final norm and head (here a bias on the logits):
    the library's ValueError, one line and status 2, not a traceback."""
    d, _ = checkpoint
    decode = GPT.decode_logits
    monkeypatch.setattr(GPT, "decode_logits", lambda self, *a, **k: decode(self, *a, **k) + 1.0)
    pair = ["--corrupted", "abcabce", "--answers", "a", "b"]
    if command == "patch":
        argv = ["patch", "--checkpoint", str(d), "--clean", "abcabcd", *pair]
    else:
        argv = [
            "viz",
            "--checkpoint",
            str(d),
            "--prompt",
            "abcabcd",
            "--out",
            str(tmp_path / "p.html"),
            "--generate",
            "0",
            *pair,
        ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "not supported by activation_patching" in err and len(err.splitlines()) == 1, err


def test_a_patch_that_moves_the_metric_the_other_way_is_listed_with_its_sign():
    """Issue 55: a head whose patch pushes the logit difference away from the clean run (IOI's negative
    name movers) must be listed, ranked by the size of its effect, with a minus sign."""
    from attnlab.tools.patch import PatchReport

    g = torch.Generator().manual_seed(3)
    values = torch.rand(4, 5, generator=g, dtype=torch.float64) * 2.0  # raw logit differences, (L, H)
    values[2, 3] = -6.0  # the corrupted run is 1.0, the clean one 3.0: this patch moves it by -3.5 clean runs
    report = PatchReport(["a"], ("a", "b"), 3.0, 1.0, results={"head_out": values})
    top = report.top("head_out", 3)
    restored = (values - 1.0) / (3.0 - 1.0)
    assert top[0][0] == "2.3" and top[0][2] == pytest.approx(-3.5)
    # the rest: the next largest |effect|, whatever its sign, from a reference ranking written here
    ranked = sorted(((abs(float(restored[i, j])), f"{i}.{j}") for i in range(4) for j in range(5)), reverse=True)
    assert [label for label, _, _ in top] == [label for _, label in ranked[:3]]
    text = report.format(top=3)
    assert "2.3" in text and "-3.500" in text and "either way" in text


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=24),
    k=st.integers(1, 30),
)
def test_the_listed_patches_are_the_largest_effects_either_way(values, k):
    """Whatever the results: the k listed are k of largest |restored| (no unlisted one is larger), in
    non-increasing |restored|, each with its own signed value."""
    from attnlab.tools.patch import PatchReport

    results = torch.tensor(values, dtype=torch.float64).view(1, -1)  # (L=1, H)
    report = PatchReport(["a"], ("a", "b"), 2.0, -1.0, results={"head_out": results})
    top = report.top("head_out", k)
    restored = [(v + 1.0) / 3.0 for v in values]
    assert len(top) == min(k, len(values))
    sizes = [abs(frac) for _, _, frac in top]
    assert sizes == sorted(sizes, reverse=True)
    listed = {int(label.split(".")[1]) for label, _, _ in top}
    for label, value, frac in top:
        h = int(label.split(".")[1])
        assert value == values[h] and frac == pytest.approx(restored[h])
    unlisted = [abs(restored[h]) for h in range(len(values)) if h not in listed]
    assert not unlisted or max(unlisted) <= min(sizes) + 1e-12
