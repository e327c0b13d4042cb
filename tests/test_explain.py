"""Tests of ``attnlab explain``: every lesson runs, fits 80 columns and prints the tutorials' numbers.

The expected values below are copied from the tutorials' printed outputs (4 decimals, or 5
significant digits in scientific notation). ``test_expected_numbers_are_the_tutorials`` checks
that each one really appears in the tutorial's text when the tutorials are available.
"""

from __future__ import annotations

import functools
import io
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import cli, explain
from attnlab.explain import LESSONS, run_lesson

SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"

# ---------------------------------------------------------------- "A simple self-attention mechanism"
SIMPLE = "A simple self-attention mechanism"
SCORES_2 = [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865]
SCORES = [
    [0.9995, 0.9544, 0.9422, 0.4753, 0.4576, 0.6310],
    [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
    [0.9422, 1.4754, 1.4570, 0.8296, 0.7154, 1.0605],
    [0.4753, 0.8434, 0.8296, 0.4937, 0.3474, 0.6565],
    [0.4576, 0.7070, 0.7154, 0.3474, 0.6654, 0.2935],
    [0.6310, 1.0865, 1.0605, 0.6565, 0.2935, 0.9450],
]
SUM_2 = 6.5617
PLAIN_2 = [0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656]
SOFTMAX_2 = [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581]
WEIGHTS = [
    [0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
    [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
    [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
    [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
    [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
    [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896],
]
CONTEXT_2 = [0.4419, 0.6515, 0.5683]
CONTEXT = [
    [0.4421, 0.5931, 0.5790],
    [0.4419, 0.6515, 0.5683],
    [0.4431, 0.6496, 0.5671],
    [0.4304, 0.6298, 0.5510],
    [0.4671, 0.5910, 0.5266],
    [0.4177, 0.6503, 0.5645],
]
SA_V1 = [
    [0.2996, 0.8053],
    [0.3061, 0.8210],
    [0.3058, 0.8203],
    [0.2948, 0.7939],
    [0.2927, 0.7891],
    [0.2990, 0.8040],
]
SA_V2_WEIGHTS = [
    [0.1921, 0.1646, 0.1652, 0.1550, 0.1721, 0.1510],
    [0.2041, 0.1659, 0.1662, 0.1496, 0.1665, 0.1477],
    [0.2036, 0.1659, 0.1662, 0.1498, 0.1664, 0.1480],
    [0.1869, 0.1667, 0.1668, 0.1571, 0.1661, 0.1564],
    [0.1830, 0.1669, 0.1670, 0.1588, 0.1658, 0.1585],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]
INF = -math.inf
MASKED_SCORES = [
    [0.2899, INF, INF, INF, INF, INF],
    [0.4656, 0.1723, INF, INF, INF, INF],
    [0.4594, 0.1703, 0.1731, INF, INF, INF],
    [0.2642, 0.1024, 0.1036, 0.0186, INF, INF],
    [0.2183, 0.0874, 0.0882, 0.0177, 0.0786, INF],
    [0.3408, 0.1270, 0.1290, 0.0198, 0.1290, 0.0078],
]
CAUSAL_WEIGHTS = [
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.5517, 0.4483, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3800, 0.3097, 0.3103, 0.0000, 0.0000, 0.0000],
    [0.2758, 0.2460, 0.2462, 0.2319, 0.0000, 0.0000],
    [0.2175, 0.1983, 0.1984, 0.1888, 0.1971, 0.0000],
    [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529],
]
CAUSAL_CONTEXT_PRINTED = [  # the tutorial's context_vec (made with SelfAttention_v1's values)
    [0.1855, 0.8812],
    [0.2795, 0.9361],
    [0.3133, 0.9508],
    [0.2994, 0.8595],
    [0.2702, 0.7554],
    [0.2772, 0.7618],
]
DROPOUT_MASK_PRINTED = [  # the tutorial's torch.manual_seed(123) dropout(ones): not reproducible on CPU
    [2.0, 2.0, 2.0, 2.0, 2.0, 2.0],
    [0.0, 2.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 2.0, 0.0, 2.0, 0.0],
    [2.0, 2.0, 0.0, 0.0, 0.0, 2.0],
    [2.0, 0.0, 0.0, 0.0, 0.0, 2.0],
    [0.0, 2.0, 0.0, 0.0, 0.0, 0.0],
]
DROPPED_WEIGHTS_PRINTED = [
    [2.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.0000, 0.8966, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.0000, 0.0000, 0.6206, 0.0000, 0.0000, 0.0000],
    [0.5517, 0.4921, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.4350, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.0000, 0.3327, 0.0000, 0.0000, 0.0000, 0.0000],
]
WRAPPER_ROWS = [
    [-0.4519, 0.2216, 0.4772, 0.1063],
    [-0.5874, 0.0058, 0.5891, 0.3257],
    [-0.6300, -0.0632, 0.6202, 0.3860],
    [-0.5675, -0.0843, 0.5478, 0.3589],
    [-0.5526, -0.0981, 0.5321, 0.3428],
    [-0.5299, -0.1081, 0.5077, 0.3493],
]
MHA_ROWS = [
    [0.3190, 0.4858],
    [0.2943, 0.3897],
    [0.2856, 0.3593],
    [0.2693, 0.3873],
    [0.2639, 0.3928],
    [0.2575, 0.4028],
]
BATCHED = [
    [[1.3208, 1.1631, 1.2879], [1.1631, 2.2150, 1.8424], [1.2879, 1.8424, 2.0402]],
    [[0.4391, 0.7003, 0.5903], [0.7003, 1.3737, 1.0620], [0.5903, 1.0620, 0.9912]],
]

# ---------------------------------------------------------------- "Implement the Self-Attention Mechanism in PyTorch"
IMPLEMENT = "Implement the Self-Attention Mechanism in PyTorch"
OMEGA_1_5 = -46.02456283569336
OMEGA_1_ALL = [47.9667, 58.9805, 42.1271, 141.0643, -46.0246, -72.1767, 58.9805, 47.9667]
WEIGHTS_1 = [5.5834e-09, 5.2879e-08, 1.6952e-09, 1.0000e00, 2.5976e-17, 1.2479e-19, 5.2879e-08, 5.5834e-09]
Z_1 = [
    5.2083, 4.5906, 3.1900, 4.1853, 4.7579, 4.2178, 3.4120, 5.0137, 4.0621, 4.1455, 6.3549, 3.0836, 6.4934, 4.0425,
    4.8676, 3.0821, 6.8482, 5.5784, 4.6929, 5.4580, 5.6707, 4.9629, 4.2686, 5.6802, 5.3528, 4.5219, 4.6112, 4.7807,
]  # fmt: skip
WEIGHTS_DIM0_ROWS = {  # rows of its dim=0 "normalized attention scores of ALL words"
    0: [2.4049e-09, 1.0642e-11, 6.0284e-11, 9.5202e-31, 1.0108e-10, 1.0688e-18, 1.0642e-11, 2.4049e-09],
    3: [1.0000e00, 1.0000e00, 1.0000e00, 1.0000e00, 5.0760e-19, 2.0151e-33, 1.0000e00, 1.0000e00],
    5: [6.4806e-20, 2.6022e-25, 4.5103e-22, 0.0000e00, 9.9992e-01, 1.0000e00, 2.6022e-25, 6.4806e-20],
}
CONTEXT_DIM0_ROW0_HEAD = [1.0208e-08, 4.5245e-09, 8.9584e-09, 8.8031e-09, 1.0888e-08, 1.1263e-08]
CONTEXT_DIM0_ROW3_HEAD = [1.3486e01, 1.5032e01, 1.2241e01, 6.8524e00, 1.0054e01, 1.7727e01]
MH_SCORES_ROW0 = [63.3466, 69.7982, 60.7684, 168.7238, -35.8708, -90.1632, 69.7982, 63.3466]
MH_WEIGHTS_DIM0_ROW0 = [5.5202e-01, 9.7718e-01, 8.2888e-01, 8.5065e-01, 8.6035e-02, 1.8976e-03, 9.7718e-01, 5.5202e-01]
MH_CONTEXT_DIM0_ROW0_HEAD = [1.2550e01, 8.2323e00, 9.1246e00, 2.9574e00, 1.3149e01, 1.1474e01]

# ---------------------------------------------------------------- the attention-review exercises
REVIEW = "Attention Review"
REVIEW_MASKED = [[1.0000, 0.0000, 0.0000], [0.4975, 0.5025, 0.0000], [0.3300, 0.3333, 0.3367]]

# ---------------------------------------------------------------- "Self attention for a single individual head"
ONE_HEAD = "Self attention for a single individual head"
HEAD_WEI_RAW = [
    [-1.7629, -1.3011, 0.5652, 2.1616, -1.0674, 1.9632, 1.0765, -0.4530],
    [-3.3334, -1.6556, 0.1040, 3.3782, -2.1825, 1.0415, -0.0557, 0.2927],
    [-1.0226, -1.2606, 0.0762, -0.3813, -0.9843, -1.4303, 0.0749, -0.9547],
    [0.7836, -0.8014, -0.3368, -0.8496, -0.5602, -1.1701, -1.2927, -1.0260],
    [-1.2566, 0.0187, -0.7880, -1.3204, 2.0363, 0.8638, 0.3719, 0.9258],
    [-0.3126, 2.4152, -0.1106, -0.9931, 3.3449, -2.5229, 1.4187, 1.2196],
    [1.0876, 1.9652, -0.2621, -0.3158, 0.6091, 1.2616, -0.5484, 0.8048],
    [-1.8044, -0.4126, -0.8306, 0.5898, -0.7987, -0.5856, 0.6433, 0.6303],
]
HEAD_WEI = [
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.1574, 0.8426, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.2088, 0.1646, 0.6266, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.5792, 0.1187, 0.1889, 0.1131, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.0294, 0.1052, 0.0469, 0.0276, 0.7909, 0.0000, 0.0000, 0.0000],
    [0.0176, 0.2689, 0.0215, 0.0089, 0.6812, 0.0019, 0.0000, 0.0000],
    [0.1691, 0.4066, 0.0438, 0.0416, 0.1048, 0.2012, 0.0329, 0.0000],
    [0.0210, 0.0843, 0.0555, 0.2297, 0.0573, 0.0709, 0.2423, 0.2391],
]
SOFTMAX_DIFFUSE = [0.1925, 0.1426, 0.2351, 0.1426, 0.2872]
SOFTMAX_SHARP = [0.0326, 0.0030, 0.1615, 0.0030, 0.8000]


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------
@functools.cache
def lesson(name: str) -> tuple[dict[str, torch.Tensor], str]:
    """Run a lesson once per test session: (its tensors, its printed text)."""
    buf = io.StringIO()
    tensors = run_lesson(name, file=buf)
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
    assert cli.main(["explain", "--list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert [line.split()[0] for line in lines if not line.startswith(" ")] == list(LESSONS)
    assert all(len(line) <= 80 for line in lines)


def test_cli_unknown_lesson(capsys):
    assert cli.main(["explain", "--lesson", "nope"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0] and "dot-products" in err[0]
    assert captured.out == ""


def test_cli_unknown_lesson_among_good_ones_prints_nothing(capsys):
    assert cli.main(["explain", "--lesson", "causal", "--lesson", "bogus"]) == 2
    assert capsys.readouterr().out == ""


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
