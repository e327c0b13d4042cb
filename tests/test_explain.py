"""Tests of ``attnlab explain``: every lesson runs, fits 80 columns and prints the tutorials' numbers.

The expected values are the tutorials' printed outputs, in ``tests/tutorial_numbers.py``;
``test_expected_numbers_are_the_tutorials`` checks that each one really appears in the tutorial's
text when the tutorials are available.
"""

from __future__ import annotations

import functools
import io
import math
import re
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import cli
from attnlab import tutorial_code as tc
from attnlab.tools import explain
from attnlab.tools.explain import LESSONS, TUTORIALS, run_lesson, run_tutorial, tutorial_lessons
from conftest import loop_attention
from shared_data import GPT2_BPE_DIR, SEEDS, gpt2_bpe_missing
from tutorial_numbers import (
    BATCHED,
    CAUSAL_CONTEXT_PRINTED,
    CAUSAL_WEIGHTS,
    CONTEXT,
    CONTEXT_2,
    CONTEXT_DIM0_ROW0_HEAD,
    CONTEXT_DIM0_ROW3_HEAD,
    DROPOUT_MASK_PRINTED,
    DROPPED_WEIGHTS_PRINTED,
    HEAD_WEI,
    HEAD_WEI_RAW,
    IMPLEMENT,
    INF,
    MASKED_SCORES,
    MH_CONTEXT_DIM0_ROW0_HEAD,
    MH_SCORES_ROW0,
    MH_WEIGHTS_DIM0_ROW0,
    MHA_ROWS,
    OMEGA_1_5,
    OMEGA_1_ALL,
    ONE_HEAD,
    PLAIN_2,
    REVIEW,
    REVIEW_MASKED,
    SA_V1,
    SA_V2_WEIGHTS,
    SCORES,
    SCORES_2,
    SIMPLE,
    SOFTMAX_2,
    SOFTMAX_DIFFUSE,
    SOFTMAX_SHARP,
    SUM_2,
    WEIGHTS,
    WEIGHTS_1,
    WEIGHTS_DIM0_ROWS,
    WRAPPER_ROWS,
    Z_1,
)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
@functools.cache
def lesson(name: str) -> tuple[dict[str, torch.Tensor], str]:
    """Run a lesson once per test session: (its tensors, its printed text)."""
    buf = io.StringIO()
    tensors = run_lesson(name, file=buf, bpe_dir=GPT2_BPE_DIR, interactive=False)
    return tensors, buf.getvalue()


def prose(text: str) -> str:
    """The text with line wrapping undone (and the bug notes' "!" margins removed)."""
    return " ".join(word for word in text.split() if word != "!")


def close4(actual: torch.Tensor, expected, atol: float = 1e-4) -> None:
    """Equal to the tutorial's 4-decimal print: within rounding (+ float noise)."""
    expected = torch.tensor(expected, dtype=torch.float64)
    actual = actual.detach().double()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite), "the -inf entries differ"
    assert torch.equal(actual[~finite], expected[~finite])
    torch.testing.assert_close(actual[finite], expected[finite], atol=atol, rtol=0)


def close_sci(actual: torch.Tensor, expected) -> None:
    """Equal to a scientific-notation print (5 significant digits)."""
    torch.testing.assert_close(
        actual.detach().double(), torch.tensor(expected, dtype=torch.float64), rtol=2e-4, atol=1e-35
    )


# --------------------------------------------------------------------------------------------
# Every lesson
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LESSONS))
def test_lesson_runs_and_fits_80_columns(name):
    tensors, text = lesson(name)
    assert tensors and all(isinstance(t, torch.Tensor) for t in tensors.values())
    assert f"{name}:" in text
    too_wide = [line for line in text.splitlines() if len(line) > 80]
    assert not too_wide, too_wide
    assert "\t" not in text
    assert "grad_fn" not in text  # lessons run without autograd
    if name != "gpt2-sizes":  # that one prints a table of counts
        assert "shape (" in text  # tensors are printed with their shapes


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 12), min_size=0, max_size=4),
    exponent=st.integers(-40, 12),
    negative=st.booleans(),
    special=st.sampled_from([None, "inf", "-inf", "nan", "int", "bool"]),
    name=st.text(alphabet="abc xyz_.()[]=", min_size=1, max_size=120),
)
def test_any_tensor_prints_within_80_columns(shape, exponent, negative, special, name):
    g = torch.Generator().manual_seed(len(shape) * 1000 + exponent)
    t = torch.rand(shape, generator=g, dtype=torch.float64) * 10.0**exponent
    if negative:
        t = t - t.mean() if t.numel() else t
    if special in ("inf", "-inf", "nan") and t.numel():
        t.view(-1)[0] = float(special)
    elif special == "int":
        t = (t * 1000).long()
    elif special == "bool":
        t = t > t.mean() if t.numel() else t.bool()
    buf = io.StringIO()
    explain.Walk(buf).show(name, t, "a note " * 30)
    lines = buf.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]


def test_lesson_names_and_summaries():
    assert explain.lesson_names() == list(LESSONS)
    for required in ["dot-products", "normalise", "context", "trainable", "scaling", "causal", "dropout"]:
        assert required in LESSONS
    for required in ["multi-head", "batched-matmul", "cross-attention", "encoder-decoder", "gpt2-sizes"]:
        assert required in LESSONS
    assert all(lesson.summary for lesson in LESSONS.values())
    titles = [SIMPLE, IMPLEMENT, REVIEW, ONE_HEAD, "Implementing GPT-Style Attention: A Step-by-Step Guide"]
    for lesson in LESSONS.values():  # each lesson names the tutorial it follows, by its title
        assert [t for t in titles if t in lesson.tutorial], (lesson.name, lesson.tutorial)


def test_a_new_lesson_is_registered_after_the_others_and_runs():
    names_before = explain.lesson_names()

    @explain.lesson("test-extra", "a lesson added by a test", headline="three numbers", tutorial=ONE_HEAD, section="2")
    def extra(w: explain.Walk) -> dict[str, torch.Tensor]:
        t = torch.arange(3.0)
        w.show("t", t, "counting")
        return {"t": t}

    try:
        assert explain.lesson_names() == [*names_before, "test-extra"]
        assert LESSONS["test-extra"].section == "2" and LESSONS["test-extra"].func is extra
        buf = io.StringIO()
        assert torch.equal(run_lesson("test-extra", file=buf)["t"], torch.arange(3.0))
        lines = buf.getvalue().splitlines()
        assert lines[1] == "test-extra: three numbers" and lines[2] == f"(following {ONE_HEAD})"
        assert lines[0] == lines[3] == "=" * 78 and lines[-3:] == ["t  shape (3,)", "  # counting", "  [0., 1., 2.]"]
        with pytest.raises(ValueError, match="already registered"):
            explain.lesson("test-extra", "again", headline="h", tutorial=ONE_HEAD)(extra)
    finally:
        del LESSONS["test-extra"]
    assert explain.lesson_names() == names_before


def test_run_lesson_restores_rng_and_print_options():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    torch.set_printoptions(precision=7)
    try:
        run_lesson("dropout", file=io.StringIO())
        assert torch.equal(torch.rand(3), expected)  # the lesson's manual_seed calls did not leak
        assert torch._tensor_str.PRINT_OPTS.precision == 7
    finally:
        torch.set_printoptions(profile="default")
    assert torch.is_grad_enabled()


def test_run_lesson_unknown_name():
    with pytest.raises(ValueError, match=r"unknown lesson 'nope'.*dot-products"):
        run_lesson("nope", file=io.StringIO())
    with pytest.raises(TypeError, match="name must be a str"):
        run_lesson(3, file=io.StringIO())  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The tutorials' numbers
# --------------------------------------------------------------------------------------------
def test_dot_products():
    t, text = lesson("dot-products")
    close4(t["scores_2"], SCORES_2)
    close4(t["scores"], SCORES)
    assert "Tutorial bug" in prose(text) and "query = inputs.shape[0]" in prose(text) and "TypeError" in prose(text)


def test_normalise():
    t, _ = lesson("normalise")
    close4(t["sum_2"], SUM_2)
    close4(t["weights_2_plain"], PLAIN_2)
    close4(t["weights_2"], SOFTMAX_2)
    close4(t["weights"], WEIGHTS)


def test_context():
    t, _ = lesson("context")
    close4(t["context_2"], CONTEXT_2)
    close4(t["context"], CONTEXT)


def test_trainable():
    t, text = lesson("trainable")
    close4(t["context_v1"], SA_V1)
    close4(t["weights_v2"], SA_V2_WEIGHTS)
    torch.testing.assert_close(t["weights_v1"].sum(-1), torch.ones(6))
    assert "0.2996" in text and "0.1921" in text


def test_softmax_dim():
    t, text = lesson("softmax-dim")
    assert abs(float(t["omega_1_5"]) - OMEGA_1_5) < 1e-3
    close4(t["omega_1_all"], OMEGA_1_ALL, atol=2e-4)
    close_sci(t["weights_1"], WEIGHTS_1)
    close4(t["z_1"], Z_1)
    for row, expected in WEIGHTS_DIM0_ROWS.items():
        close_sci(t["weights_dim0"][row], expected)
    close_sci(t["context_dim0"][0, :6], CONTEXT_DIM0_ROW0_HEAD)
    close_sci(t["context_dim0"][3, :6], CONTEXT_DIM0_ROW3_HEAD)
    close4(t["mh_scores"][0, 0], MH_SCORES_ROW0, atol=2e-4)
    close_sci(t["mh_weights_dim0"][0, 0], MH_WEIGHTS_DIM0_ROW0)
    close_sci(t["mh_context_dim0"][0, 0, :6], MH_CONTEXT_DIM0_ROW0_HEAD)
    # The bug as the lesson states it: dim=0 normalises columns; the totals are 8 and 64.
    torch.testing.assert_close(t["weights_dim0"].sum(0), torch.ones(8))
    assert (t["weights_dim0"].sum(-1) - 1).abs().max() > 0.5
    assert float(t["weights_dim0"].sum()) == pytest.approx(8.0, abs=1e-4)
    assert float(t["mh_weights_dim0"].sum()) == pytest.approx(64.0, abs=1e-3)
    # The fix: rows sum to 1, row 0 is the single-word computation.
    torch.testing.assert_close(t["weights_fixed"].sum(-1), torch.ones(8))
    torch.testing.assert_close(t["weights_fixed"][0], t["weights_1"])
    torch.testing.assert_close(t["context_fixed"][0], t["z_1"])
    torch.testing.assert_close(t["mh_weights_fixed"].sum(-1), torch.ones(3, 8))
    assert text.count("Tutorial bug") >= 3  # dictionary, dim=0, multi-head dim=0
    assert "'is': 4" in prose(text) and "indices 3 and 5 are skipped" in prose(text)


def test_scaling():
    t, text = lesson("scaling")
    close4(t["softmax_diffuse"], SOFTMAX_DIFFUSE)
    close4(t["softmax_sharp"], SOFTMAX_SHARP)
    assert 15.0 < float(t["var_big"]) < 17.0
    assert 0.93 < float(t["var_big_scaled"]) < 1.07
    assert float(t["var_scores"]) > 4 * float(t["var_big_scaled"])
    # The GPT-style guide's double scaling, against an independent computation of scale 1/d_k.
    close4(t["guide_right"], CAUSAL_WEIGHTS)
    right = torch.tensor(CAUSAL_WEIGHTS, dtype=torch.float64)
    assert (t["guide_twice"].double() - right).abs().max() > 0.01
    masked = torch.tensor(MASKED_SCORES, dtype=torch.float64)
    torch.testing.assert_close(t["guide_twice"].double(), torch.softmax(masked / 2, dim=-1), atol=2e-4, rtol=0)
    # The review exercise's global d_out changes the result.
    assert (t["review_global"] - t["review_right"]).abs().max() > 1e-4
    assert "Tutorial bug" in prose(text) and "twice" in prose(text) and "GLOBAL" in prose(text)
    assert "Implementing GPT-Style Attention" in prose(text)


def test_causal():
    t, text = lesson("causal")
    close4(t["weights"], SA_V2_WEIGHTS)
    close4(t["scores_masked"], MASKED_SCORES)
    close4(t["weights_causal"], CAUSAL_WEIGHTS)
    close4(t["renormalised"], CAUSAL_WEIGHTS)
    torch.testing.assert_close(t["renormalised"], t["weights_causal"])
    torch.testing.assert_close(t["weights_attnlab"], t["weights_causal"])
    # The printed context vectors are the causal weights times SelfAttention_v1's values.
    close4(t["context_tutorial"], CAUSAL_CONTEXT_PRINTED)
    assert (t["context"] - t["context_tutorial"]).abs().max() > 0.1
    close4(t["review_after"], REVIEW_MASKED)
    close4(t["review_before"], REVIEW_MASKED)
    close4(t["head_wei_raw"], HEAD_WEI_RAW)
    close4(t["head_wei"], HEAD_WEI)
    assert "way 1 == way 2" in prose(text) and "Tutorial bug" in prose(text) and "W_keys" in prose(text)


def test_dropout():
    t, text = lesson("dropout")
    ones, weights, dropped = t["ones"], t["weights"], t["dropped"]
    close4(weights, CAUSAL_WEIGHTS)
    assert set(ones.unique().tolist()) <= {0.0, 2.0}
    assert 8 <= int((ones == 0).sum()) <= 28  # about half of 36
    torch.testing.assert_close(dropped, weights * ones)
    torch.testing.assert_close(t["dropped_attnlab"], dropped)
    # The tutorial's own prints are these weights under its (device-dependent) mask.
    close4(torch.tensor(DROPOUT_MASK_PRINTED) * weights, DROPPED_WEIGHTS_PRINTED)
    assert "does not reproduce" in prose(text) and torch.__version__ in text
    assert "1.1111" in text  # the guide's "by 10%" corrected


def test_multi_head():
    t, _ = lesson("multi-head")
    close4(t["wrapper"], [WRAPPER_ROWS, WRAPPER_ROWS])
    close4(t["mha"], [MHA_ROWS, MHA_ROWS])
    assert t["mha_weights"].shape == (2, 2, 6, 6)
    torch.testing.assert_close(t["mha_weights"].sum(-1), torch.ones(2, 2, 6))


def test_batched_matmul():
    t, _ = lesson("batched-matmul")
    close4(t["scores"], [BATCHED])
    close4(t["first_head"], BATCHED[0])
    close4(t["second_head"], BATCHED[1])


def test_cross_attention_matches_float64_reference():
    t, _ = lesson("cross-attention")
    x, src = t["x"].double(), t["source"].double()
    assert t["weights"].shape == (2, 6, 4) and t["out"].shape == (6, 4)
    H, hd = 2, 2
    q = (x @ t["W_query"].double().T).view(6, H, hd)
    k = (src @ t["W_key"].double().T).view(4, H, hd)
    v = (src @ t["W_value"].double().T).view(4, H, hd)
    out = torch.zeros(6, H * hd, dtype=torch.float64)
    for h in range(H):
        for i in range(6):  # explicit loops: no attention code shared with attnlab
            s = torch.tensor([float(q[i, h] @ k[j, h]) / math.sqrt(hd) for j in range(4)], dtype=torch.float64)
            p = torch.exp(s - s.max())
            p = p / p.sum()
            torch.testing.assert_close(t["weights"][h, i].double(), p, atol=1e-6, rtol=0)
            out[i, h * hd : (h + 1) * hd] = sum(p[j] * v[j, h] for j in range(4))
    expected = out @ t["W_out"].double().T + t["b_out"].double()
    torch.testing.assert_close(t["out"].double(), expected, atol=1e-6, rtol=0)


def test_encoder_decoder():
    t, _ = lesson("encoder-decoder")
    enc, dec = t["encoder"], t["decoder"]
    assert (enc > 0).all()
    lower = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    assert (dec[~lower] == 0).all() and (dec[lower] > 0).all()
    torch.testing.assert_close(enc[-1], dec[-1])
    torch.testing.assert_close(dec.sum(-1), torch.ones(6))


def test_gpt2_sizes_table():
    t, text = lesson("gpt2-sizes")
    table = t["table"].tolist()
    # layers, d_model, heads, head_dim, attention params (4d^2 + 4d), total params
    assert [row[:4] for row in table] == [[12, 768, 12, 64], [24, 1024, 16, 64], [36, 1280, 20, 64], [48, 1600, 25, 64]]
    assert [row[4] for row in table] == [4 * d * d + 4 * d for d in (768, 1024, 1280, 1600)]
    assert table[0][5] == 124_439_808
    assert int(t["untied_small"]) == 124_439_808 + 50257 * 768
    assert t["bad_pos_shape"].tolist() == [10, 6]  # BadLM_V2(context_length=4, vocab_size=10, emb_dim=6)
    assert int(t["bad_pos_params"]) == 50257 * 768
    assert "124,439,808" in prose(text) and "117 million" in prose(text) and "BadLM_V2" in prose(text)


@pytest.mark.parametrize(("n_layer", "d", "heads"), [(12, 768, 12), (48, 1600, 25)])
def test_gpt2_counts_match_transformers(n_layer, d, heads):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=n_layer, n_embd=d, n_head=heads)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config)  # built from a config, never downloaded
    counts = explain.gpt2_parameter_counts(n_layer, d, heads)
    assert counts["total"] == sum(p.numel() for p in model.parameters())  # tied: counted once
    attn = model.transformer.h[0].attn
    assert counts["attention"] == sum(p.numel() for p in attn.parameters())


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------
def test_cli_list(capsys):
    """--list shows every lesson once, under its tutorial (in the tutorial's order) and section."""
    assert cli.main(["explain", "--list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines)
    listed = [m.group(1) for line in lines if (m := re.match(r"^    (\S+)", line))]
    headers = [i for i, line in enumerate(lines) if line.startswith("--tutorial ")]
    blank = [i for i, line in enumerate(lines) if not line.strip()] + [len(lines)]  # blocks end at a blank line
    # Lessons beyond the five tutorials (e.g. attention since GPT-2) come after them, under their source.
    beyond = next(i for i in blank if i > headers[-1])
    listed += [m.group(1) for line in lines[beyond:] if (m := re.match(r"^  ([a-z0-9][\w-]*) ", line))]
    assert sorted(listed) == sorted(LESSONS)  # each lesson exactly once
    assert [lines[i].split()[1].rstrip(":") for i in headers] == list(TUTORIALS)
    for n, key in enumerate(TUTORIALS):
        end = next(i for i in blank if i > headers[n])
        block = lines[headers[n] : end]
        assert TUTORIALS[key].title in " ".join(" ".join(block[:2]).split())
        names = [m.group(1) for line in block if (m := re.match(r"^    (\S+)", line))]
        assert names == [entry.name for entry in tutorial_lessons(key)]
        sections = [line.strip()[:-1] for line in block if re.match(r"^  \S", line)]
        assert sections == list(dict.fromkeys(entry.section for entry in tutorial_lessons(key)))


def test_cli_list_one_tutorial(capsys):
    assert cli.main(["explain", "--list", "--tutorial", "one-head"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"--tutorial one-head: {TUTORIALS['one-head'].title}"
    assert [m.group(1) for line in out.splitlines() if (m := re.match(r"^    (\S+)", line))] == [
        entry.name for entry in tutorial_lessons("one-head")
    ]


def test_cli_unknown_lesson(capsys):
    assert cli.main(["explain", "--lesson", "nope"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0] and "dot-products" in err[0]
    assert captured.out == ""


def test_cli_lesson_names_any_case_and_not_with_list(capsys):
    assert cli.main(["explain", "--lesson", "Causal"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("causal:")
    assert cli.main(["explain", "--list", "--lesson", "rope"]) == 2  # --lesson once went unread
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--list" in err[0] and "--lesson" in err[0]


def test_lessons_print_the_tutorials_numbers_under_a_float64_default():
    # Regression: a notebook's torch.set_default_dtype(torch.float64) broke some lessons (mixed dtypes)
    # and changed others' numbers; the lesson runs in float32 and the caller's default comes back.
    want = io.StringIO()
    run_lesson("one-head", want, interactive=False)
    torch.set_default_dtype(torch.float64)
    try:
        got = io.StringIO()
        run_lesson("one-head", got, interactive=False)
        run_lesson("trainable", io.StringIO(), interactive=False)
        assert torch.get_default_dtype() == torch.float64
        # and no default-device mode left behind, which every later torch call would pay for
        from torch.overrides import _get_current_function_mode_stack

        assert not _get_current_function_mode_stack()
    finally:
        torch.set_default_dtype(torch.float32)
    assert got.getvalue() == want.getvalue()


def test_cli_unknown_lesson_among_good_ones_prints_nothing(capsys):
    assert cli.main(["explain", "--lesson", "causal", "--lesson", "bogus"]) == 2
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("where", "message"),
    [("missing", "no such directory"), ("file", "not a directory"), ("empty", "no encoder.json or vocab.bpe")],
)
def test_cli_a_wrong_bpe_dir_is_one_line(tmp_path, capsys, where, message):
    """A --bpe-dir that is not GPT-2's files is a mistake to fix (exit 2), as in attnlab train; the
    lessons fall back to bytes only when no directory was given (once they did for any)."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    for argv in (["--tutorial", "review"], ["--lesson", "review-loader"]):
        assert cli.main(["explain", *argv, "--bpe-dir", str(tmp_path / where)]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and f"--bpe-dir {tmp_path / where}: {message}" in err[0], err
        assert captured.out == ""


def test_cli_repeated_and_comma_lessons(capsys):
    assert cli.main(["explain", "--lesson", "batched-matmul", "--lesson", "normalise,context"]) == 0
    out = capsys.readouterr().out
    firsts = [out.index(f"{name}:") for name in ("batched-matmul", "normalise", "context")]
    assert firsts == sorted(firsts)  # in the order asked for
    assert "causal:" not in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_cli_all_lessons(capsys):
    assert cli.main(["explain"]) == 0
    out = capsys.readouterr().out
    for name in LESSONS:
        assert f"\n{name}: " in "\n" + out
    assert all(len(line) <= 80 for line in out.splitlines())


# --------------------------------------------------------------------------------------------
# The expected numbers above are the tutorials' own
# --------------------------------------------------------------------------------------------
def _tutorial_text(title: str) -> str:
    if not SEEDS.is_dir():
        pytest.skip(f"the tutorials' texts are not at {SEEDS}")
    for path in sorted(SEEDS.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        if title in text[:2000]:
            return text
    pytest.skip(f"no tutorial titled {title!r} in {SEEDS}")


def _flat(values) -> list[float]:
    if isinstance(values, (int, float)):
        return [float(values)]
    return [v for item in values for v in _flat(item)]


@pytest.mark.parametrize(
    ("title", "values", "fmt"),
    [
        (SIMPLE, [SCORES_2, SCORES, PLAIN_2, SOFTMAX_2, WEIGHTS, CONTEXT_2, CONTEXT, SA_V1], "{:.4f}"),
        (SIMPLE, [SA_V2_WEIGHTS, CAUSAL_WEIGHTS, CAUSAL_CONTEXT_PRINTED, DROPPED_WEIGHTS_PRINTED], "{:.4f}"),
        (SIMPLE, [[v for v in row if v != INF] for row in MASKED_SCORES], "{:.4f}"),
        (SIMPLE, [WRAPPER_ROWS, MHA_ROWS, BATCHED, [SUM_2]], "{:.4f}"),
        (IMPLEMENT, [OMEGA_1_ALL, Z_1, MH_SCORES_ROW0], "{:.4f}"),
        (IMPLEMENT, [WEIGHTS_1, list(WEIGHTS_DIM0_ROWS.values()), MH_WEIGHTS_DIM0_ROW0], "{:.4e}"),
        (IMPLEMENT, [CONTEXT_DIM0_ROW0_HEAD, CONTEXT_DIM0_ROW3_HEAD, MH_CONTEXT_DIM0_ROW0_HEAD], "{:.4e}"),
        (REVIEW, [REVIEW_MASKED], "{:.4f}"),
        (ONE_HEAD, [HEAD_WEI_RAW, HEAD_WEI, SOFTMAX_DIFFUSE, SOFTMAX_SHARP], "{:.4f}"),
    ],
)
def test_expected_numbers_are_the_tutorials(title, values, fmt):
    text = _tutorial_text(title)
    missing = [fmt.format(v) for v in _flat(values) if fmt.format(v) not in text]
    assert not missing, missing


# ============================================================================================
# Following a tutorial: sections, order, the command line
# ============================================================================================
def _normalised(text: str) -> str:
    text = text.replace("\u2019", "'").replace("\\(", "").replace("\\)", "").replace("**", "")
    return " ".join(text.split())


def steps(text: str) -> str:
    """The text with wrapping undone and the code prompts (``>>>``, ``...``) removed."""
    return " ".join(word for word in text.split() if word not in ("!", ">>>", "..."))


TITLE_IN_TEXT = {  # how each tutorial's text begins
    "simple": "A simple self-attention mechanism",
    "implement": "Implement the Self-Attention Mechanism in PyTorch",
    "gpt-style": "Implementing GPT-Style Attention: A Step-by-Step Guide with PyTorch",
    "review": "Concept Questions",
    "one-head": "Self attention for a single individual head",
}


@pytest.mark.parametrize("key", list(TUTORIALS))
def test_sections_are_the_tutorials_own(key):
    """Each section title is the tutorial's own heading (for a notebook without headings: a cell,
    ``In [N]: what it does``, or its ``Notes:``), the sections are in the tutorial's order, and every
    lesson of the tutorial sits in one of them."""
    t = TUTORIALS[key]
    text = _normalised(_tutorial_text(TITLE_IN_TEXT[key]))
    positions = []
    for section in t.sections:
        cell = re.match(r"^(In \[\d+\]:|Notes:)", section)
        anchor = cell.group(1) if cell else _normalised(section)
        assert anchor in text, section
        positions.append(text.index(anchor))
    assert positions == sorted(positions)
    ours = tutorial_lessons(key)
    assert ours and all(entry.section in t.sections for entry in ours)


def test_tutorial_lessons_follow_the_sections():
    for key, t in TUTORIALS.items():
        order = [t.sections.index(entry.section) for entry in tutorial_lessons(key)]
        assert order == sorted(order), key
    assert [e.name for e in tutorial_lessons("simple")][:3] == ["dot-products", "normalise", "context"]
    assert explain.check_tutorial_name('"Self attention for a single individual head"').key == "one-head"
    with pytest.raises(ValueError, match=r"unknown tutorial 'nope'.*simple"):
        tutorial_lessons("nope")


def test_a_lesson_must_name_a_section_of_its_tutorial():
    with pytest.raises(ValueError, match="has no section"):
        explain.lesson("bad-section", "x", headline="h", tutorial=TUTORIALS["simple"].title, section="Nope")(dict)
    assert "bad-section" not in LESSONS


def test_run_tutorial_heads_each_section_and_runs_its_lessons_in_order():
    buf = io.StringIO()
    results = run_tutorial("one-head", file=buf, interactive=False)
    text = buf.getvalue()
    names = [entry.name for entry in tutorial_lessons("one-head")]
    assert list(results) == names
    starts = [text.index(f"\n{name}: ") for name in names]
    assert starts == sorted(starts)
    heads = [text.index(f"Section: {entry.section}") for entry in tutorial_lessons("one-head")]
    assert heads == sorted(heads) and all(h < s for h, s in zip(heads, starts, strict=True))
    assert text.startswith("#" * 78) and TUTORIALS["one-head"].title in text.splitlines()[1]
    assert all(len(line) <= 80 for line in text.splitlines())
    torch.testing.assert_close(results["one-head"]["wei"][0], torch.tensor(HEAD_WEI), atol=1e-4, rtol=0)


def test_cli_tutorial(capsys):
    assert cli.main(["explain", "--tutorial", "gpt-style"]) == 0
    out = capsys.readouterr().out
    for entry in tutorial_lessons("gpt-style"):
        assert f"Section: {entry.section}" in out.replace("\n  ", " ") and f"\n{entry.name}: " in out
    assert "dot-products:" not in out


def test_cli_tutorial_errors(capsys):
    assert cli.main(["explain", "--tutorial", "nope"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "unknown tutorial 'nope'" in captured.err and "one-head" in captured.err
    with pytest.raises(SystemExit) as exc:  # --lesson and --tutorial exclude each other (argparse: exit 2)
        cli.main(["explain", "--tutorial", "simple", "--lesson", "causal"])
    assert exc.value.code == 2


# ============================================================================================
# The quiz: asks, waits when a learner is at a terminal, answers
# ============================================================================================
def test_quiz_prints_questions_then_answers_without_a_terminal():
    t, text = lesson("quiz")
    for i, (question, answer) in enumerate(explain.CONCEPT_QUESTIONS, 1):
        q, a = prose(text).index(f"Q{i}. {question}"), prose(text).index(f"A: {answer}")
        assert q < a
    assert "press Enter" not in text
    torch.testing.assert_close(t["causal_mask"], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_quiz_waits_for_enter_when_interactive(monkeypatch):
    class Stdin:
        """Records when each line is read, relative to what the lesson has printed."""

        def __init__(self, out: io.StringIO) -> None:
            self.out, self.reads = out, []

        def readline(self) -> str:
            self.reads.append(self.out.getvalue())
            return "\n"

    out = io.StringIO()
    stdin = Stdin(out)
    monkeypatch.setattr(sys, "stdin", stdin)
    run_lesson("quiz", file=out, interactive=True)
    assert len(stdin.reads) == len(explain.CONCEPT_QUESTIONS)
    for i, (question, answer) in enumerate(explain.CONCEPT_QUESTIONS):
        before = prose(stdin.reads[i])
        assert question in before and answer not in before  # asked, not yet answered
        assert prose(out.getvalue()).index(answer) > len(prose(stdin.reads[i])) - 1


@pytest.mark.slow
def test_explain_quiz_through_a_pipe_does_not_wait(subprocess_env):
    """stdin not a terminal (CI, a pipe): no prompt, no read; question then answer."""
    proc = subprocess.run(
        [sys.executable, "-m", "attnlab", "explain", "--lesson", "quiz"],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env,
        input="",
    )
    assert proc.returncode == 0, proc.stderr
    assert "press Enter" not in proc.stdout and "Q4. What is the purpose of multi-head attention?" in proc.stdout


# ============================================================================================
# The new steps, and each tutorial bug's "right result"
# ============================================================================================
def test_trainable_note_on_undefined_d_in_d_out():
    t, text = lesson("trainable")
    assert "without defining d_in or d_out" in prose(text) and "NameError" in prose(text)
    assert "d_in = inputs.shape[1] = 3" in prose(text) and "d_out = 2" in prose(text)
    close4(t["context_v1"], SA_V1)  # the right result: the tutorial's numbers with d_in=3, d_out=2


def test_causal_class_lesson():
    t, _ = lesson("causal-class")
    torch.manual_seed(123)
    theirs = tc.CausalAttention(3, 2, 6, 0.0)
    torch.testing.assert_close(t["context_vecs"], theirs(t["batch"]))
    assert t["context_vecs"].shape == (2, 6, 2) and t["batch"].shape == (2, 6, 3)


def test_implement_lessons_print_everything_whole():
    t, text = lesson("implement-all-words")
    assert t["omega_all"].shape == (8, 8) and t["context_dim0"].shape == (8, 28)
    for row in range(8):  # every row of the 8x8 matrix is printed, not only the first
        assert f"{float(t['omega_all'][row, 3]):.4f}" in text
    torch.testing.assert_close(t["weights"].sum(-1), torch.ones(8))
    m, mtext = lesson("implement-multi-head")
    assert m["scores"].shape == (3, 8, 8) and m["context_dim0"].shape == (3, 8, 28)
    assert f"{float(m['scores'][2, 7, 3]):.4f}" in mtext  # the last head's last row is printed too
    torch.testing.assert_close(m["weights"].sum(-1), torch.ones(3, 8))


def test_implement_query_shape_note_and_right_result():
    t, text = lesson("implement-multi-head")
    assert "Tutorial bug" in text and "n_heads x dim_q = (3, 24)" in prose(text)
    from attnlab.tools.explain.lessons_tutorials import implement_setup

    s = implement_setup()
    x_1 = s["embedded"][0].double()
    expected = torch.stack([s["heads"].W_q[h].double() @ x_1 for h in range(3)])  # (3, 24), head by head
    assert t["query_1"].shape == (3, 24)
    torch.testing.assert_close(t["query_1"].double(), expected, atol=1e-5, rtol=1e-6)


def test_implement_right_weights_match_float64_loops():
    t, _ = lesson("implement-all-words")
    q, _ = lesson("implement-qkv")
    _, ref = loop_attention(q["queries"], q["keys"], q["values"])
    torch.testing.assert_close(t["weights"].double(), ref, atol=1e-6, rtol=1e-4)


def test_gpt_guide_lessons_and_their_notes():
    _, text = lesson("gpt-trainable")
    assert "bias=True" in text
    c, ctext = lesson("gpt-causal")
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    _, right = loop_attention(*_guide_qkv(), allowed=causal)  # scaled once, by 1/sqrt(2)
    torch.testing.assert_close(c["right"].double(), right, atol=1e-6, rtol=0)
    _, twice = loop_attention(*_guide_qkv(), allowed=causal, scale=0.5)  # the guide's 1/d_k
    torch.testing.assert_close(c["twice"].double(), twice, atol=1e-6, rtol=0)
    assert "Tutorial bug" in ctext and "1/d_k" in prose(ctext)


def _guide_qkv() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(123)
    layers = [torch.nn.Linear(3, 2) for _ in range(3)]
    x = tc.INPUTS.clone()
    with torch.no_grad():
        return tuple(layer(x) for layer in layers)


def test_gpt_causal_class_notes_and_right_results():
    t, text = lesson("gpt-causal-class")
    assert text.count("Tutorial bug") == 2 and "W_keys, BEFORE W_query" in prose(text)
    assert "defaults to dropout=0.1" in prose(text)
    # Right result: the guide's class itself, built here on its own, in eval mode.
    torch.manual_seed(123)
    guide = tc.GuideCausalAttention(3, 2, 6).eval()
    batch = torch.stack((tc.INPUTS, tc.INPUTS))
    torch.testing.assert_close(t["context"], guide(batch))
    # ... which is causal attention over its own projections (a float64 loop).
    with torch.no_grad():
        q, k, v = guide.W_query(tc.INPUTS), guide.W_keys(tc.INPUTS), guide.W_value(tc.INPUTS)
    ref, _ = loop_attention(q, k, v, allowed=torch.tril(torch.ones(6, 6, dtype=torch.bool)))
    torch.testing.assert_close(t["context"][0].double(), ref, atol=1e-6, rtol=0)
    assert (t["train_1"] - t["train_2"]).abs().max() > 1e-3  # dropout 0.1 in training mode: calls differ
    torch.testing.assert_close(t["dropped"][t["dropped"] != 0].max(), torch.tensor(1 / 0.9))


def test_gpt_multi_head_width_note():
    t, text = lesson("gpt-multi-head")
    assert t["out"].shape == (2, 6, 4)  # d_out = 4 wide from 3-wide inputs: the right width
    assert "d_in == d_out" in prose(text) and "Tutorial bug" in text
    assert t["gpt2_shape"].tolist() == [2, 1024, 768]


def test_review_masks_unsliced_mask_note_and_right_result():
    t, text = lesson("review-masks")
    assert "Tutorial bug" in text and "mask[:N, :N]" in prose(text) and "RuntimeError" in prose(text)
    torch.manual_seed(123)
    theirs = tc.CausalAttentionReview(3, 2, 6)
    with pytest.raises(RuntimeError):
        theirs(tc.INPUTS[:4].unsqueeze(0))  # the exercise's class, as the note says
    with torch.no_grad():
        q, k, v = (layer(tc.INPUTS[:4]) for layer in (theirs.W_query, theirs.W_key, theirs.W_value))
    ref, _ = loop_attention(q, k, v, allowed=torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    torch.testing.assert_close(t["short"][0].double(), ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(t["short"], t["full"][:, :4])
    close4(t["after"], REVIEW_MASKED)
    close4(t["before"], REVIEW_MASKED)


def test_review_multi_head_architecture_counts_and_scale():
    t, text = lesson("review-multi-head")
    assert t["counts"].tolist() == [3 * 512 * 768, 3 * 512 * 768 + 768 * 768 + 768, 864, 1464]
    assert "1/sqrt(100) = 0.1000" in prose(text) and "1/sqrt(256) = 0.0625" in prose(text)
    # The right result is each 8-wide head at its own scale 1/sqrt(8), concatenated (float64 loops).
    x = torch.randn(2, 6, 12, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(123)
    theirs = tc.MultiHeadAttentionReview(12, 24, 3, 6)
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    for b in range(2):
        heads, wrong = [], []
        for head in theirs.heads:
            with torch.no_grad():
                q, k, v = head.W_query(x[b]), head.W_key(x[b]), head.W_value(x[b])
            heads.append(loop_attention(q, k, v, allowed=causal)[0])
            wrong.append(loop_attention(q, k, v, allowed=causal, scale=0.1)[0])
        torch.testing.assert_close(t["out"][b].double(), torch.cat(heads, -1), atol=1e-6, rtol=0)
        torch.testing.assert_close(t["buggy"][b].double(), torch.cat(wrong, -1), atol=1e-6, rtol=0)


def test_review_self_attention_shape():
    t, text = lesson("review-self-attention")
    assert t["shape"].tolist() == [40, 50, 1024] and "bias=True" in text


@pytest.mark.skipif(gpt2_bpe_missing() is not None, reason=str(gpt2_bpe_missing()))
def test_review_loader_with_gpt2_ids():
    t, text = lesson("review-loader")
    assert bool(t["gpt2"])
    from attnlab.tokenizers import GPT2Tokenizer

    text_ = "This is a very useless sentence that talks about itself."
    ids = GPT2Tokenizer(bpe_dir=GPT2_BPE_DIR).encode(text_)
    assert t["ids"].tolist() == ids and len(ids) == 11
    for stride, key in [(1, "inputs_stride1"), (2, "inputs_stride2"), (4, "inputs_stride4")]:
        # MyData's loop, as the exercises write it
        expected = [ids[i : i + 4] for i in range(0, len(ids) - 4, stride)]
        assert t[key].tolist() == expected
    assert t["targets_stride1"].tolist() == [ids[i + 1 : i + 5] for i in range(0, len(ids) - 4)]
    assert t["first_batch"].tolist() == [ids[0:4], ids[1:5]]
    assert "GPT-2's tokenizer is not available" not in text


def test_review_loader_says_what_to_pass_without_the_bpe_files(tmp_path):
    buf = io.StringIO()
    t = run_lesson("review-loader", file=buf, bpe_dir=tmp_path / "nothing-here", interactive=False)
    text = prose(buf.getvalue())
    assert "--bpe-dir DIR" in text and "ATTNLAB_GPT2_BPE_DIR" in text and "encoder.json and vocab.bpe" in text
    assert not bool(t["gpt2"]) and t["inputs_stride1"].shape[1] == 4  # it goes on, with bytes


def test_one_head_lessons_whole_batch_values_and_note():
    t, text = lesson("one-head")
    assert t["wei"].shape == (4, 8, 8)
    close4(t["wei"][0], HEAD_WEI)
    close4(t["wei_raw"][0], HEAD_WEI_RAW)
    for b in range(4):  # the right result: each element's weights from its own q and k (float64 loops)
        head = _one_head()
        with torch.no_grad():
            q, k = head.query(t["x"][b]), head.key(t["x"][b])
        _, ref = loop_attention(q, k, t["x"][b], allowed=torch.tril(torch.ones(8, 8, dtype=torch.bool)), scale=1.0)
        torch.testing.assert_close(t["wei"][b].double(), ref, atol=1e-6, rtol=0)
    assert (t["wei"][0] - t["wei"][1]).abs().max() > 0.1  # data dependent
    assert "not data dependent" in prose(text) and "IS data dependent" in prose(text)
    v, vtext = lesson("one-head-values")
    assert v["out"].shape == (4, 8, 16)
    assert "_ = torch.randn(20, 4, 8, 16)" in steps(vtext)


def _one_head():
    from attnlab.tutorials.one_head import Head

    torch.manual_seed(1337)
    torch.randn(4, 8, 32)
    return Head(32, 16, scale=1.0)


def test_scaling_says_its_seed_and_the_line_to_type():
    t, text = lesson("scaling")
    assert "torch.manual_seed(1337); x = torch.randn(4, 8, 32); _ = torch.randn(16, 4, 8, 16)" in steps(text)
    # The line, typed as the lesson shows it, gives the tutorial's numbers.
    torch.manual_seed(1337)
    torch.randn(4, 8, 32)
    torch.randn(16, 4, 8, 16)
    k, q = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    assert float((q @ k.transpose(-2, -1)).var()) == pytest.approx(13.6696, abs=5e-5)
    assert float(t["var_scores"]) == pytest.approx(13.6696, abs=5e-5)
    assert float(t["var_scores_scaled"]) == pytest.approx(1.1445, abs=5e-5)


@pytest.mark.slow
def test_explain_quiz_in_a_terminal_waits_for_enter(subprocess_env):
    """At a terminal (a pseudo-terminal here) the quiz shows a question and waits; Enter answers it."""
    pty = pytest.importorskip("pty")
    import os
    import select
    import time

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "explain", "--lesson", "quiz"],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=subprocess_env,
    )
    os.close(follower)
    seen = b""

    def read_until(marker: bytes, timeout: float) -> bool:
        nonlocal seen
        end = time.monotonic() + timeout
        while marker not in seen and time.monotonic() < end:
            if select.select([leader], [], [], 0.2)[0]:
                try:
                    seen += os.read(leader, 4096)
                except OSError:  # the child closed the terminal
                    break
        return marker in seen

    try:
        assert read_until(b"press Enter", 120)
        time.sleep(0.5)
        read_until(b"A: Masking", 0.5)
        assert b"Q1." in seen and b"A: Masking" not in seen  # asked, waiting: not answered yet
        for _ in explain.CONCEPT_QUESTIONS:
            os.write(leader, b"\n")
        assert read_until(b"A: We use multiple heads", 60)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
