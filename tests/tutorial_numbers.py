"""The numbers the tutorials print, copied from their text (4 decimals, or 5 significant digits
in scientific notation), shared by the tests that check attnlab reproduces them.
``tests/test_explain.py::test_expected_numbers_are_the_tutorials`` checks that each one really
appears in the tutorial's text when the tutorials are available.

Below them, every printed output of the five tutorials (:func:`printed_blocks`) and how attnlab
reproduces it (:data:`REPRODUCED`); ``tests/test_tutorials.py`` checks that every printed number is
reproduced there or listed, with the reason, in the table of ``docs/tutorial-numbers.md``.
"""

import functools
import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

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


# ============================================================================================
# Every number the tutorials print: where it is printed, and how attnlab reproduces it
# ============================================================================================
# ``printed_blocks(text)`` finds what a tutorial's code printed: every ``tensor(...)`` that is not
# ``torch.tensor(`` (code), every ``torch.Size([...])`` and every output line ``Some label = value``
# (``Sum of this vector = 8.0``). ``REPRODUCED`` maps each block, by its position in the tutorial, to
# how attnlab reproduces it; the blocks it does not reproduce are listed, with the reason, in the
# table of docs/tutorial-numbers.md. tests/test_tutorials.py checks the three agree.

GPT_GUIDE = "Implementing GPT-Style Attention: A Step-by-Step Guide with PyTorch"
TITLES = (SIMPLE, IMPLEMENT, GPT_GUIDE, REVIEW, ONE_HEAD)

_NUMBER = re.compile(r"(?<![\w.])-?(?:inf|\d+(?:\.\d*)?(?:e[-+]?\d+)?)(?![\w])")
_START = re.compile(
    r"(?<![\w.])tensor\("  # a printed tensor (code writes torch.tensor)
    r"|torch\.Size\(\["  # a printed shape
    r"|^(?P<label>[A-Z][a-z]+(?: [\w.\->]+)*) = (?P<value>\{[^}\n]*\}|-?\d[\d.e+-]*)[ \t]*$",  # Label = value
    re.M,
)
# What may follow on the lines of a printed tensor: numbers, brackets, commas, inf, booleans,
# grad_fn=<...>, and further tensors of a printed list.
_TENSOR_LINE = re.compile(r"(?:[\s\[\]\(\),.\d+\-e]|inf|True|False|tensor\(|grad_fn=<\w*>?)*")


@dataclass(frozen=True)
class Block:
    """One printed output: its position among the tutorial's printed blocks, its text, its numbers
    (as printed) and whether the tutorial's text cuts it off before its end."""

    index: int
    text: str
    numbers: tuple[str, ...]
    truncated: bool


def printed_blocks(text: str) -> list[Block]:
    """The printed outputs of a tutorial's text, in order."""
    blocks: list[Block] = []
    pos = 0
    while (m := _START.search(text, pos)) is not None:
        if m.group(0).startswith("tensor("):
            depth, j, end, truncated = 0, m.start(), None, False
            while j < len(text):
                c = text[j]
                if c == "(":
                    depth += 1
                elif c == ")":
                    depth -= 1
                    if depth == 0:
                        end = j + 1
                        break
                elif c == "\n":  # the next line must still look like a tensor
                    nl = text.find("\n", j + 1)
                    line = text[j + 1 : len(text) if nl < 0 else nl]
                    if line.strip() and not _TENSOR_LINE.fullmatch(line):
                        end, truncated = j, True
                        break
                j += 1
            end = len(text) if end is None else end
            body = text[m.start() : end]
            truncated = truncated and body.count("[") > body.count("]")  # cut off inside the tensor
            numbers = _NUMBER.findall(re.sub(r"grad_fn=<\w+>|tensor\(", " ", body))
        elif m.group(0).startswith("torch.Size"):
            end = text.index(")", m.start()) + 1
            body, truncated = text[m.start() : end], False
            numbers = _NUMBER.findall(body)
        else:
            end, body, truncated = m.end(), m.group(0), False
            numbers = _NUMBER.findall(m.group("value").replace(":", " "))
        blocks.append(Block(len(blocks), body, tuple(numbers), truncated))
        pos = end
    return blocks


def agrees(actual: float, printed: str, *, truncated: bool = False, atol: float = 0.0) -> bool:
    """``actual`` equals a number as the tutorial printed it: to its 4 decimals (fixed point), to its
    5 significant digits (scientific notation), exactly (integers), within float32 round-off.

    A printed ``x.xxxx`` stands for a value within half a unit of its last decimal; torch writes
    ``1.`` for a whole number and ``.item()`` prints every digit, both taken to 4 decimals here.
    The round-off allowance covers float32 sums in another order (4e-7 relative: about 3 ulps; the
    worst seen is 1.5e-7, the tutorial's own 42.1271 / 42.1272 for one score) and exponentials of
    large scores (3e-5 relative: a softmax weight's error grows with |score| x 1e-7; the tutorial
    itself prints 5.9746e-23 and 5.9747e-23 for the same weight of two identical words). A number
    the tutorial's text cuts off (``0.089`` for ``0.0892``) is compared to its printed digits.
    ``atol`` widens the allowance for sums that cancel (see :class:`Reproduced`).
    """
    p = float(printed)
    if math.isinf(p) or re.fullmatch(r"-?\d+", printed):
        return actual == p
    if "e" in printed:
        mantissa, exponent = printed.split("e")
        digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return abs(actual - p) <= 0.5 * 10.0 ** (int(exponent) - digits) + 3e-5 * abs(p) + atol
    decimals = len(printed.split(".")[1])
    if truncated:
        return p <= actual < p + 10.0**-decimals if p >= 0 else p - 10.0**-decimals < actual <= p
    return abs(actual - p) <= 0.5e-4 + 4e-7 * abs(p) + atol


def tutorial_texts() -> dict[str, str]:
    """Each tutorial's text by title (a test that needs them skips, saying why, when they are absent)."""
    import pytest

    from shared_data import SEEDS

    if not SEEDS.is_dir():
        pytest.skip(f"the tutorials' texts are not at {SEEDS}")
    found = {}
    for path in sorted(SEEDS.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        for title in TITLES:
            if title in text[:2000]:
                found[title] = text
    missing = [t for t in TITLES if t not in found]
    if missing:
        pytest.skip(f"no tutorial titled {missing} in {SEEDS}")
    return found


@functools.cache
def lesson_tensors(name: str) -> dict:
    """A lesson's returned tensors (run once per test session, printing into a buffer)."""
    from attnlab.tools.explain import run_lesson
    from shared_data import GPT2_BPE_DIR

    return run_lesson(name, file=io.StringIO(), bpe_dir=GPT2_BPE_DIR, interactive=False)


def _lesson(name: str, key: str, then: Callable | None = None) -> Callable[[], object]:
    return lambda: (then or (lambda t: t))(lesson_tensors(name)[key])


def _shape(name: str, key: str) -> Callable[[], object]:
    return _lesson(name, key, lambda t: list(t.shape))


def _sum(name: str, key: str) -> Callable[[], object]:
    return _lesson(name, key, lambda t: t.sum())


@dataclass(frozen=True)
class Reproduced:
    """How attnlab reproduces printed block ``index`` of ``tutorial`` (which starts with ``starts``).

    ``atol``: an absolute float32 allowance for a block whose entries are small sums of large terms
    (cancellation), where 5 significant digits are more than float32 carries; still far inside
    the 4 decimals asked for.
    """

    tutorial: str
    index: int
    starts: str
    how: str
    get: Callable[[], object]
    atol: float = 0.0


def _entries(tutorial: str, rows: list[tuple]) -> list[Reproduced]:
    return [Reproduced(tutorial, *row) for row in rows]


REPRODUCED: list[Reproduced] = [
    *_entries(
        SIMPLE,
        [
            (0, "tensor([0.9544", "dot-products: attn_scores_2", _lesson("dot-products", "scores_2")),
            (1, "tensor(6.5617", "normalise: attn_scores_2.sum()", _lesson("normalise", "sum_2")),
            (2, "tensor([0.1455", "normalise: attn_weights_2_tmp", _lesson("normalise", "weights_2_plain")),
            (3, "tensor(1.0000", "normalise: its sum", _sum("normalise", "weights_2_plain")),
            (4, "tensor([0.1385", "normalise: torch.softmax(attn_scores_2)", _lesson("normalise", "weights_2")),
            (5, "tensor(1.)", "normalise: its sum", _sum("normalise", "weights_2")),
            (
                6,
                "tensor([0., 0., 0.])",
                "context: the loop's start, torch.zeros(3)",
                _lesson("context", "context_2", torch.zeros_like),
            ),
            (7, "tensor([0.4419", "context: context_vec_2", _lesson("context", "context_2")),
            (8, "tensor([[0.9995", "dot-products: inputs @ inputs.T", _lesson("dot-products", "scores")),
            (9, "tensor([[0.2098", "normalise: simple_self_attention weights", _lesson("normalise", "weights")),
            (10, "tensor([[0.4421", "context: simple_self_attention(inputs)", _lesson("context", "context")),
            (11, "tensor([[0.2996", "trainable: SelfAttention_v1 (seed 123)", _lesson("trainable", "context_v1")),
            (
                12,
                "tensor([[0.1921",
                "trainable: SelfAttention_v2 weights (seed 789)",
                _lesson("trainable", "weights_v2"),
            ),
            (13, "tensor([[1., 0.", "causal: mask_simple", _lesson("causal", "mask_simple")),
            (14, "tensor([[0.1921, 0.0000", "causal: masked_simple", _lesson("causal", "masked_simple")),
            (15, "tensor([[0.2899", "causal: scores masked with -inf", _lesson("causal", "scores_masked")),
            (16, "tensor([[1.0000, 0.0000", "causal: causal weights", _lesson("causal", "weights_causal")),
            (
                17,
                "tensor([[0.1855",
                "causal: weights @ SelfAttention_v1's values (its bug)",
                _lesson("causal", "context_tutorial"),
            ),
            (20, "torch.Size([2, 6, 3])", "causal-class: batch.shape", _shape("causal-class", "batch")),
            (
                21,
                "torch.Size([2, 6, 2])",
                "causal-class: CausalAttention(batch).shape",
                _shape("causal-class", "context_vecs"),
            ),
            (
                22,
                "tensor([[[-0.4519",
                "multi-head: MultiHeadAttentionWrapper (seed 123)",
                _lesson("multi-head", "wrapper"),
            ),
            (23, "torch.Size([2, 6, 4])", "multi-head: its shape", _shape("multi-head", "wrapper")),
            (24, "tensor([[[[1.3208", "batched-matmul: a @ a.transpose(2, 3)", _lesson("batched-matmul", "scores")),
            (25, "tensor([[1.3208", "batched-matmul: first head", _lesson("batched-matmul", "first_head")),
            (26, "tensor([[0.4391", "batched-matmul: second head", _lesson("batched-matmul", "second_head")),
            (27, "tensor([[[0.3190", "multi-head: MultiHeadAttention (seed 123)", _lesson("multi-head", "mha")),
            (28, "torch.Size([2, 6, 2])", "multi-head: its shape", _shape("multi-head", "mha")),
        ],
    ),
    *_entries(
        IMPLEMENT,
        [
            (0, "Word dictionary = {", "implement-qkv: dict_words' values", _lesson("implement-qkv", "dict_values")),
            (1, "tensor([6, 4, 7", "implement-qkv: sentence_ints", _lesson("implement-qkv", "sentence_ints")),
            (2, "torch.Size([8, 16])", "implement-qkv: embedded_sentence.shape", _shape("implement-qkv", "embedded")),
            (4, "torch.Size([24])", "implement-qkv: query_1.shape", _shape("implement-qkv", "query_1")),
            (5, "torch.Size([24])", "implement-qkv: key_1.shape", _shape("implement-qkv", "key_1")),
            (6, "torch.Size([28])", "implement-qkv: value_1.shape", _shape("implement-qkv", "value_1")),
            (8, "torch.Size([24])", "implement-qkv: query_2.shape", _shape("implement-qkv", "query_2")),
            (9, "torch.Size([24])", "implement-qkv: key_2.shape", _shape("implement-qkv", "key_2")),
            (10, "torch.Size([28])", "implement-qkv: value_2.shape", _shape("implement-qkv", "value_2")),
            (11, "torch.Size([8, 24])", "implement-qkv: queries.shape", _shape("implement-qkv", "queries")),
            (12, "torch.Size([8, 24])", "implement-qkv: keys.shape", _shape("implement-qkv", "keys")),
            (13, "torch.Size([8, 28])", "implement-qkv: values.shape", _shape("implement-qkv", "values")),
            (14, "Unnormalized attention score", "softmax-dim: omega_1_5", _lesson("softmax-dim", "omega_1_5")),
            (15, "tensor([ 47.9667", "softmax-dim: omega_1_all", _lesson("softmax-dim", "omega_1_all")),
            (16, "tensor([[ 47.9667", "implement-all-words: omega_all", _lesson("implement-all-words", "omega_all")),
            (
                17,
                "torch.Size([8, 8])",
                "implement-all-words: omega_all.shape",
                _shape("implement-all-words", "omega_all"),
            ),
            (18, "tensor([5.5834e-09", "softmax-dim: the first word's weights", _lesson("softmax-dim", "weights_1")),
            (19, "Sum of this vector = 1.0", "softmax-dim: their sum", _sum("softmax-dim", "weights_1")),
            (
                20,
                "tensor([[2.4049e-09",
                "implement-all-words: softmax(dim=0) (its bug)",
                _lesson("implement-all-words", "weights_dim0"),
            ),
            (
                21,
                "Sum of this vector = 8.0",
                "implement-all-words: its sum",
                _sum("implement-all-words", "weights_dim0"),
            ),
            (22, "torch.Size([28])", "softmax-dim: context_vector_z_1.shape", _shape("softmax-dim", "z_1")),
            (23, "tensor([5.2083", "softmax-dim: context_vector_z_1", _lesson("softmax-dim", "z_1")),
            (
                24,
                "torch.Size([8, 28])",
                "implement-all-words: context_z.shape",
                _shape("implement-all-words", "context_dim0"),
            ),
            (
                25,
                "tensor([[ 1.0208e-08",
                "implement-all-words: context_z (its dim=0)",
                _lesson("implement-all-words", "context_dim0"),
            ),
            (
                27,
                "torch.Size([3, 24])",
                "implement-multi-head: multihead_query_1.shape",
                _shape("implement-multi-head", "query_1"),
            ),
            (
                28,
                "torch.Size([3, 24])",
                "implement-multi-head: multihead_key_1.shape",
                _shape("implement-multi-head", "key_1"),
            ),
            (
                29,
                "torch.Size([3, 28])",
                "implement-multi-head: multihead_value_1.shape",
                _shape("implement-multi-head", "value_1"),
            ),
            (
                30,
                "torch.Size([3, 16, 8])",
                "implement-multi-head: repeated_inputs.shape",
                _shape("implement-multi-head", "repeated"),
            ),
            (
                31,
                "torch.Size([3, 24, 8])",
                "implement-multi-head: bmm queries",
                _shape("implement-multi-head", "queries_bmm"),
            ),
            (
                32,
                "torch.Size([3, 24, 8])",
                "implement-multi-head: bmm keys",
                _shape("implement-multi-head", "keys_bmm"),
            ),
            (
                33,
                "torch.Size([3, 28, 8])",
                "implement-multi-head: bmm values",
                _shape("implement-multi-head", "values_bmm"),
            ),
            (
                34,
                "torch.Size([3, 8, 24])",
                "implement-multi-head: permuted queries",
                _shape("implement-multi-head", "queries"),
            ),
            (
                35,
                "torch.Size([3, 8, 24])",
                "implement-multi-head: permuted keys",
                _shape("implement-multi-head", "keys"),
            ),
            (
                36,
                "torch.Size([3, 8, 28])",
                "implement-multi-head: permuted values",
                _shape("implement-multi-head", "values"),
            ),
            (
                37,
                "tensor([[[ 63.3466",
                "implement-multi-head: multihead_omega_all",
                _lesson("implement-multi-head", "scores"),
            ),
            (38, "torch.Size([3, 8, 8])", "implement-multi-head: its shape", _shape("implement-multi-head", "scores")),
            (
                39,
                "tensor([[[5.5202e-01",
                "implement-multi-head: softmax(dim=0) (its bug)",
                _lesson("implement-multi-head", "weights_dim0"),
            ),
            (
                40,
                "Sum of this vector = 64.0",
                "implement-multi-head: its sum",
                _sum("implement-multi-head", "weights_dim0"),
            ),
            (
                41,
                "torch.Size([3, 8, 28])",
                "implement-multi-head: multihead_context_z.shape",
                _shape("implement-multi-head", "context_dim0"),
            ),
            # Entries near 0.005 are sums of terms near 10: the tutorial's own identical rows (words 1
            # and 6, both "is") print 4.5435e-03 and 4.5432e-03 there. 1e-5 is float32 on such sums.
            (
                42,
                "tensor([[[ 1.2550e+01",
                "implement-multi-head: multihead_context_z (its dim=0)",
                _lesson("implement-multi-head", "context_dim0"),
                1e-5,
            ),
        ],
    ),
    *_entries(
        REVIEW,
        [
            (
                0,
                "torch.Size([40, 50, 1024])",
                "review-self-attention: SelfAttentionV2 output",
                _lesson("review-self-attention", "shape", list),
            ),
            (1, "tensor([[3, 0, 0]", "review-masks: torch.tril(a)", _lesson("review-masks", "tril_a")),
            (
                2,
                "tensor([[1., 0., 0.]",
                "review-masks: torch.tril(torch.ones(3, 3))",
                _lesson("review-masks", "ones_mask"),
            ),
            (3, "tensor([[3., 0., 0.]", "review-masks: b * c", _lesson("review-masks", "product")),
            (4, "tensor([[1.0000, 0.0000, 0.0000]", "review-masks: Exercise 1", _lesson("review-masks", "after")),
            (5, "tensor([[1., 0., 0.]", "review-masks: example_mask", _lesson("review-masks", "example_mask")),
            (6, "tensor([[3., -inf", "review-masks: masked_fill with -inf", _lesson("review-masks", "filled")),
            (8, "tensor([[1.0000, 0.0000, 0.0000]", "review-masks: Exercise 2", _lesson("review-masks", "before")),
            (
                9,
                "torch.Size([20, 100, 768])",
                "review-masks: Exercise 4",
                _lesson("review-masks", "exercise4_shape", list),
            ),
            (
                10,
                "torch.Size([20, 100, 768])",
                "review-multi-head: Exercise 5",
                _lesson("review-multi-head", "exercise5_shape", list),
            ),
            (
                11,
                "torch.Size([40, 80, 1536])",
                "review-multi-head: Exercise 7",
                _lesson("review-multi-head", "exercise7_shape", list),
            ),
        ],
    ),
    *_entries(
        ONE_HEAD,
        [
            (0, "tensor([[-1.7629", "one-head: wei[0] before masking", _lesson("one-head", "wei_raw", lambda t: t[0])),
            (1, "torch.Size([4, 8, 32])", "one-head: (wei @ x).shape", _shape("one-head", "out_x")),
            (2, "tensor([[[1.0000", "one-head: wei, the whole batch", _lesson("one-head", "wei")),
            (3, "tensor([[1.0000", "one-head: wei[0]", _lesson("one-head", "wei", lambda t: t[0])),
            (
                4,
                "tensor([[-1.1915e+00",
                "one-head-values: wei[0] of In [33]",
                _lesson("one-head-values", "wei_raw", lambda t: t[0]),
            ),
            (5, "tensor(13.6696)", "scaling: the unscaled variance", _lesson("scaling", "var_scores")),
            (6, "tensor(1.1445)", "scaling: the scaled variance", _lesson("scaling", "var_scores_scaled")),
            (7, "tensor([0.1925", "scaling: softmax, diffuse", _lesson("scaling", "softmax_diffuse")),
            (8, "tensor([0.0326", "scaling: softmax x 8, sharp", _lesson("scaling", "softmax_sharp")),
        ],
    ),
]


# ============================================================================================
# The table of printed numbers attnlab does not reproduce (docs/tutorial-numbers.md)
# ============================================================================================
@dataclass(frozen=True)
class Unreproduced:
    """A row of the table: the tutorial, the printed block's first characters, where it is, its
    numbers as printed, and the reason."""

    tutorial: str
    starts: str
    where: str
    numbers: tuple[str, ...]
    reason: str


def unreproduced_table(markdown: str) -> list[Unreproduced]:
    """The rows of the one table in docs/tutorial-numbers.md."""
    rows = []
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    for line in lines[2:]:  # past the header and its |---| line
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 5:
            raise ValueError(f"a row of the numbers table needs 5 cells, got {len(cells)}: {line!r}")
        tutorial, starts, where, numbers, reason = cells
        rows.append(
            Unreproduced(tutorial, starts.strip("`"), where, tuple(n.strip() for n in numbers.split(",")), reason)
        )
    return rows
