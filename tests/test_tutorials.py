"""The tutorials' printed numbers, reproduced through attnlab (4 decimals, as printed).

Two kinds of test:

* the tutorials' snippets run **unchanged** after ``from attnlab import ...``; their stdout is
  compared number by number with what the tutorial printed;
* the same numbers computed through attnlab's own API (``simple_self_attention``,
  ``attention_scores``, ``scaled_dot_product_attention``, the modules' ``return_weights``), so that
  they come from attnlab and not from the torch lines of the snippet.

The expected outputs are copied verbatim from the tutorials ("A simple self-attention mechanism"
and the attention-review exercises); nothing here is computed by hand.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
    causal_mask,
    scaled_dot_product_attention,
    simple_self_attention,
)
from attnlab import tutorial_code as tc
from attnlab.functional import attention_scores
from shared_data import SEEDS

# "Your journey starts with one step", as typed in the tutorial.
INPUTS = torch.tensor(
    [
        [0.43, 0.15, 0.89],  # Your (x^1)
        [0.55, 0.87, 0.66],  # journey (x^2)
        [0.57, 0.85, 0.64],  # starts (x^3)
        [0.22, 0.58, 0.33],  # with (x^4)
        [0.77, 0.25, 0.10],  # one (x^5)
        [0.05, 0.80, 0.55],  # step (x^6)
    ]
)
D_IN, D_OUT = 3, 2  # the tutorial's d_in = inputs.shape[1], d_out = 2

_NUMBER = re.compile(r"-?inf|-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def numbers(printed: str) -> list[float]:
    """Every number in a printed text (``grad_fn=<MmBackward0>`` and the like removed)."""
    return [float(t) for t in _NUMBER.findall(re.sub(r"grad_fn=<\w+>", "", printed))]


def assert_printed(actual: torch.Tensor | list[float] | float, printed: str) -> None:
    """``actual`` equals the tutorial's printed numbers to the 4 printed decimals."""
    expected = torch.tensor(numbers(printed), dtype=torch.float64)
    got = torch.as_tensor(actual).detach().to(torch.float64).flatten()
    assert got.numel() == expected.numel(), f"{got.numel()} numbers, the tutorial printed {expected.numel()}"
    # A printed 4-decimal number is within 5e-5 of the true value (plus float32 round-off).
    torch.testing.assert_close(got, expected, atol=5.1e-5, rtol=0.0)


def run_snippet(code: str, namespace: dict) -> str:
    """Run a tutorial snippet as written, in ``namespace``; return what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<tutorial>", "exec"), namespace)
    return out.getvalue()


def assert_prints(code: str, namespace: dict, printed: str) -> None:
    assert_printed(numbers(run_snippet(code, namespace)), printed)


@pytest.fixture
def ns() -> dict:
    """The tutorial's namespace after ``from attnlab import ...``."""
    namespace = {"torch": torch, "nn": torch.nn, "inputs": INPUTS.clone(), "d_in": D_IN, "d_out": D_OUT}
    exec(
        "from attnlab import SelfAttention_v1, SelfAttention_v2, CausalAttention, "
        "MultiHeadAttentionWrapper, MultiHeadAttention",
        namespace,
    )
    assert namespace["MultiHeadAttention"] is attnlab.MultiHeadAttention
    return namespace


# =============================================================================================
# "A simple self-attention mechanism": the parameter-free chain
# =============================================================================================
SCORES_2 = "tensor([0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865])"
SCORES = """tensor([[0.9995, 0.9544, 0.9422, 0.4753, 0.4576, 0.6310],
        [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
        [0.9422, 1.4754, 1.4570, 0.8296, 0.7154, 1.0605],
        [0.4753, 0.8434, 0.8296, 0.4937, 0.3474, 0.6565],
        [0.4576, 0.7070, 0.7154, 0.3474, 0.6654, 0.2935],
        [0.6310, 1.0865, 1.0605, 0.6565, 0.2935, 0.9450]])"""
WEIGHTS = """tensor([[0.2098, 0.2006, 0.1981, 0.1242, 0.1220, 0.1452],
        [0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581],
        [0.1390, 0.2369, 0.2326, 0.1242, 0.1108, 0.1565],
        [0.1435, 0.2074, 0.2046, 0.1462, 0.1263, 0.1720],
        [0.1526, 0.1958, 0.1975, 0.1367, 0.1879, 0.1295],
        [0.1385, 0.2184, 0.2128, 0.1420, 0.0988, 0.1896]])"""
CONTEXT = """tensor([[0.4421, 0.5931, 0.5790],
        [0.4419, 0.6515, 0.5683],
        [0.4431, 0.6496, 0.5671],
        [0.4304, 0.6298, 0.5510],
        [0.4671, 0.5910, 0.5266],
        [0.4177, 0.6503, 0.5645]])"""


def test_dot_products_of_the_second_token():
    # The tutorial's loop is torch.dot(x_i, query) with query = inputs[1] ("journey").
    scores = attention_scores(INPUTS, INPUTS, scale=1.0)  # (6, 6), unscaled as in the tutorial
    assert_printed(scores[1], SCORES_2)


def test_naive_normalisation_and_softmax_of_the_second_token():
    scores_2 = attention_scores(INPUTS, INPUTS, scale=1.0)[1]
    naive = scores_2 / scores_2.sum()
    assert_printed(scores_2.sum(), "tensor(6.5617)")
    assert_printed(naive, "tensor([0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656])")
    assert_printed(naive.sum(), "Sum: tensor(1.0000)")
    _, weights = simple_self_attention(INPUTS, return_weights=True)
    assert_printed(weights[1], "tensor([0.1385, 0.2379, 0.2333, 0.1240, 0.1082, 0.1581])")
    assert_printed(weights[1].sum(), "tensor(1.)")


def test_context_vector_of_the_second_token():
    assert_printed(simple_self_attention(INPUTS)[1], "tensor([0.4419, 0.6515, 0.5683])")


def test_all_scores_weights_and_context_vectors():
    context, weights = simple_self_attention(INPUTS, return_weights=True)
    assert_printed(attention_scores(INPUTS, INPUTS, scale=1.0), SCORES)
    assert_printed(weights, WEIGHTS)
    assert_printed(context, CONTEXT)


def test_simple_chain_snippets_run_unchanged(ns):
    # The loops of the tutorial (with its query fixed to inputs[1], which its printed numbers use).
    code = """
query = inputs[1]
atten_scores_2 = torch.empty(inputs.shape[0])
for i, x_i in enumerate(inputs):
    atten_scores_2[i] = torch.dot(x_i, query)
print(atten_scores_2)
attn_weights_2 = torch.softmax(atten_scores_2, dim=0)
context_vec_2 = torch.zeros(query.shape)
for i, x_i in enumerate(inputs):
    context_vec_2 += attn_weights_2[i] * x_i
print(context_vec_2)
attn_scores = inputs @ inputs.T
print(attn_scores)
attn_weights = torch.softmax(attn_scores, dim=-1)
print(attn_weights)
all_context_vecs = attn_weights @ inputs
print(all_context_vecs)
"""
    assert_prints(code, ns, SCORES_2 + "tensor([0.4419, 0.6515, 0.5683])" + SCORES + WEIGHTS + CONTEXT)
    # ... and attnlab's functions agree with the snippet's own tensors.
    torch.testing.assert_close(simple_self_attention(INPUTS), ns["all_context_vecs"])


def test_simple_self_attention_batched_matches_per_item():
    batch = torch.stack((INPUTS, INPUTS.flip(0)))  # (2, 6, 3)
    context, weights = simple_self_attention(batch, return_weights=True)
    for i in range(2):
        c, w = simple_self_attention(batch[i], return_weights=True)
        torch.testing.assert_close(context[i], c)
        torch.testing.assert_close(weights[i], w)


# =============================================================================================
# Trainable weights: SelfAttention_v1 (seed 123) and SelfAttention_v2 (seed 789)
# =============================================================================================
V1_OUT = """tensor([[0.2996, 0.8053],
        [0.3061, 0.8210],
        [0.3058, 0.8203],
        [0.2948, 0.7939],
        [0.2927, 0.7891],
        [0.2990, 0.8040]], grad_fn=<MmBackward0>)"""
V2_WEIGHTS = """tensor([[0.1921, 0.1646, 0.1652, 0.1550, 0.1721, 0.1510],
        [0.2041, 0.1659, 0.1662, 0.1496, 0.1665, 0.1477],
        [0.2036, 0.1659, 0.1662, 0.1498, 0.1664, 0.1480],
        [0.1869, 0.1667, 0.1668, 0.1571, 0.1661, 0.1564],
        [0.1830, 0.1669, 0.1670, 0.1588, 0.1658, 0.1585],
        [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529]],
        grad_fn=<SoftmaxBackward0>)"""
MASK_SIMPLE = """tensor([[1., 0., 0., 0., 0., 0.],
        [1., 1., 0., 0., 0., 0.],
        [1., 1., 1., 0., 0., 0.],
        [1., 1., 1., 1., 0., 0.],
        [1., 1., 1., 1., 1., 0.],
        [1., 1., 1., 1., 1., 1.]])"""
MASKED_SIMPLE = """tensor([[0.1921, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
        [0.2041, 0.1659, 0.0000, 0.0000, 0.0000, 0.0000],
        [0.2036, 0.1659, 0.1662, 0.0000, 0.0000, 0.0000],
        [0.1869, 0.1667, 0.1668, 0.1571, 0.0000, 0.0000],
        [0.1830, 0.1669, 0.1670, 0.1588, 0.1658, 0.0000],
        [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529]],
        grad_fn=<MulBackward0>)"""
MASKED_SCORES = """tensor([[0.2899, -inf, -inf, -inf, -inf, -inf],
        [0.4656, 0.1723, -inf, -inf, -inf, -inf],
        [0.4594, 0.1703, 0.1731, -inf, -inf, -inf],
        [0.2642, 0.1024, 0.1036, 0.0186, -inf, -inf],
        [0.2183, 0.0874, 0.0882, 0.0177, 0.0786, -inf],
        [0.3408, 0.1270, 0.1290, 0.0198, 0.1290, 0.0078]],
        grad_fn=<MaskedFillBackward0>)"""
CAUSAL_WEIGHTS = """tensor([[1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
        [0.5517, 0.4483, 0.0000, 0.0000, 0.0000, 0.0000],
        [0.3800, 0.3097, 0.3103, 0.0000, 0.0000, 0.0000],
        [0.2758, 0.2460, 0.2462, 0.2319, 0.0000, 0.0000],
        [0.2175, 0.1983, 0.1984, 0.1888, 0.1971, 0.0000],
        [0.1935, 0.1663, 0.1666, 0.1542, 0.1666, 0.1529]],
        grad_fn=<SoftmaxBackward0>)"""
CAUSAL_CONTEXT = """tensor([[0.1855, 0.8812],
        [0.2795, 0.9361],
        [0.3133, 0.9508],
        [0.2994, 0.8595],
        [0.2702, 0.7554],
        [0.2772, 0.7618]], grad_fn=<MmBackward0>)"""


def _sa_v1() -> SelfAttention_v1:
    torch.manual_seed(123)
    return SelfAttention_v1(D_IN, D_OUT)


def _sa_v2() -> SelfAttention_v2:
    torch.manual_seed(789)
    return SelfAttention_v2(D_IN, D_OUT)


def test_self_attention_v1_seed_123(ns):
    assert_prints("torch.manual_seed(123)\n\nsa_v1 = SelfAttention_v1(d_in, d_out)\nprint(sa_v1(inputs))\n", ns, V1_OUT)
    assert isinstance(ns["sa_v1"], attnlab.SelfAttention_v1)


def test_self_attention_v2_seed_789_weights(ns):
    code = """torch.manual_seed(789)
sa_v2 = SelfAttention_v2(d_in, d_out)

queries = sa_v2.W_query(inputs)
keys = sa_v2.W_key(inputs)
attn_scores = queries @ keys.T
attn_weights = torch.softmax(attn_scores / keys.shape[-1]**0.5, dim=-1)

print(attn_weights)
"""
    assert_prints(code, ns, V2_WEIGHTS)
    # The same weights from attnlab itself.
    _, weights = _sa_v2()(INPUTS, return_weights=True)
    assert_printed(weights, V2_WEIGHTS)


def test_causal_mask_snippets_run_unchanged(ns):
    """The causal section, run as written on attnlab's ``sa_v2`` (seed 789)."""
    run_snippet(
        "torch.manual_seed(789)\nsa_v2 = SelfAttention_v2(d_in, d_out)\nqueries = sa_v2.W_query(inputs)\n"
        "keys = sa_v2.W_key(inputs)\nattn_scores = queries @ keys.T\n"
        "attn_weights = torch.softmax(attn_scores / keys.shape[-1]**0.5, dim=-1)\n",
        ns,
    )
    assert_prints(
        "context_length = attn_scores.shape[0]\n"
        "mask_simple = torch.tril(torch.ones(context_length, context_length))\nprint(mask_simple)\n",
        ns,
        MASK_SIMPLE,
    )
    assert_prints("masked_simple = attn_weights*mask_simple\nprint(masked_simple)\n", ns, MASKED_SIMPLE)
    run_snippet(
        "row_sums = masked_simple.sum(dim=-1, keepdim=True)\nmasked_simple_norm = masked_simple / row_sums\n", ns
    )
    assert_prints(
        "mask = torch.triu(torch.ones(context_length, context_length), diagonal=1)\n"
        "masked = attn_scores.masked_fill(mask.bool(), -torch.inf)\nprint(masked)\n",
        ns,
        MASKED_SCORES,
    )
    assert_prints(
        "attn_weights = torch.softmax(masked / keys.shape[-1]**0.5, dim=1)\nprint(attn_weights)\n", ns, CAUSAL_WEIGHTS
    )
    # The tutorial does not print masked_simple_norm; it says the renormalised weights equal these.
    assert_printed(ns["masked_simple_norm"], CAUSAL_WEIGHTS)


def test_causal_weights_through_attnlab():
    sa_v2 = _sa_v2()
    queries, keys = sa_v2.W_query(INPUTS), sa_v2.W_key(INPUTS)  # (6, 2) each
    assert_printed(causal_mask(6).float(), MASK_SIMPLE)
    # The -inf trick: attnlab's scores, unscaled and causally masked.
    assert_printed(attention_scores(queries, keys, is_causal=True, scale=1.0), MASKED_SCORES)
    # Way 1: multiply the (non-causal) weights by the mask and renormalise.
    _, weights = sa_v2(INPUTS, return_weights=True)
    masked_simple = weights * causal_mask(6)
    assert_printed(masked_simple, MASKED_SIMPLE)
    assert_printed(masked_simple / masked_simple.sum(dim=-1, keepdim=True), CAUSAL_WEIGHTS)
    # Way 2: -inf before the softmax, as attnlab does it (both backends agree in the test below).
    _, causal = scaled_dot_product_attention(queries, keys, keys, is_causal=True, return_weights=True)
    assert_printed(causal, CAUSAL_WEIGHTS)
    # CausalAttention creates W_query, W_key, W_value like SelfAttention_v2: same seed, same weights.
    torch.manual_seed(789)
    _, ca_weights = CausalAttention(D_IN, D_OUT, 6, 0.0)(INPUTS, return_weights=True)
    assert_printed(ca_weights, CAUSAL_WEIGHTS)


def test_causal_context_vectors():
    """``context_vec = attn_weights @ values``: the tutorial never shows where ``values`` comes from.

    Its first printed row equals ``values[0]`` (the first token attends only to itself), and the
    rows match the values of the v1 step, ``inputs @ W_value`` under ``torch.manual_seed(123)``
    (the book this tutorial follows computes ``values = inputs @ W_value`` there), combined with
    the causal weights of ``sa_v2`` (seed 789).
    """
    values = INPUTS @ _sa_v1().W_value  # (6, 2)
    sa_v2 = _sa_v2()
    queries, keys = sa_v2.W_query(INPUTS), sa_v2.W_key(INPUTS)
    for backend in ("fused", "reference"):
        out = scaled_dot_product_attention(queries, keys, values, is_causal=True, backend=backend)
        assert_printed(out, CAUSAL_CONTEXT)
    # sa_v2's own values give other numbers: the printed ones really are v1's.
    other = scaled_dot_product_attention(queries, keys, sa_v2.W_value(INPUTS), is_causal=True)
    assert not torch.allclose(other, values.new_tensor(numbers(CAUSAL_CONTEXT)).view(6, 2), atol=1e-3)


# =============================================================================================
# Dropout: the tutorial's printed masks come from another RNG stream
# =============================================================================================
def test_dropout_behaves_like_nn_dropout():
    """attnlab's dropout is nn.Dropout's: same call, same mask under the same seed, same scaling.

    The tutorial's printed masks (``torch.manual_seed(123); nn.Dropout(0.5)(torch.ones(6, 6))``) do
    not reproduce with CPU torch 2.13: the random stream differs from the tutorial's platform.
    So this checks the behaviour instead of those printed numbers.
    """
    sa_v2 = _sa_v2()
    queries, keys = sa_v2.W_query(INPUTS), sa_v2.W_key(INPUTS)
    _, weights = scaled_dot_product_attention(queries, keys, keys, is_causal=True, return_weights=True)
    torch.manual_seed(123)
    expected = torch.nn.Dropout(0.5)(weights)
    torch.manual_seed(123)
    _, dropped = scaled_dot_product_attention(queries, keys, keys, is_causal=True, dropout_p=0.5, return_weights=True)
    torch.testing.assert_close(dropped, expected)
    kept = dropped != 0
    assert 0 < int(kept.sum()) < int((weights != 0).sum())  # some dropped, some kept
    torch.testing.assert_close(dropped[kept], weights[kept] * 2.0)  # kept ones scaled by 1/(1-p)


def test_causal_attention_module_dropout_train_and_eval():
    torch.manual_seed(0)
    ca = CausalAttention(D_IN, D_OUT, 6, 0.5)
    batch = torch.stack((INPUTS, INPUTS))
    ca.eval()
    out_eval, w_eval = ca(batch, return_weights=True)
    torch.testing.assert_close(ca(batch), out_eval)  # no dropout at evaluation
    ca.train()
    torch.manual_seed(5)
    out_train, w_train = ca(batch, return_weights=True)
    torch.manual_seed(5)
    torch.testing.assert_close(w_train, torch.nn.Dropout(0.5)(w_eval))
    torch.testing.assert_close(out_train, w_train @ ca.W_value(batch))


# =============================================================================================
# CausalAttention, MultiHeadAttentionWrapper, MultiHeadAttention (seed 123)
# =============================================================================================
WRAPPER_OUT = """tensor([[[-0.4519, 0.2216, 0.4772, 0.1063],
        [-0.5874, 0.0058, 0.5891, 0.3257],
        [-0.6300, -0.0632, 0.6202, 0.3860],
        [-0.5675, -0.0843, 0.5478, 0.3589],
        [-0.5526, -0.0981, 0.5321, 0.3428],
        [-0.5299, -0.1081, 0.5077, 0.3493]],

        [[-0.4519, 0.2216, 0.4772, 0.1063],
        [-0.5874, 0.0058, 0.5891, 0.3257],
        [-0.6300, -0.0632, 0.6202, 0.3860],
        [-0.5675, -0.0843, 0.5478, 0.3589],
        [-0.5526, -0.0981, 0.5321, 0.3428],
        [-0.5299, -0.1081, 0.5077, 0.3493]]], grad_fn=<CatBackward0>)
context_vecs.shape: torch.Size([2, 6, 4])"""
MHA_OUT = """tensor([[[0.3190, 0.4858],
        [0.2943, 0.3897],
        [0.2856, 0.3593],
        [0.2693, 0.3873],
        [0.2639, 0.3928],
        [0.2575, 0.4028]],

        [[0.3190, 0.4858],
        [0.2943, 0.3897],
        [0.2856, 0.3593],
        [0.2693, 0.3873],
        [0.2639, 0.3928],
        [0.2575, 0.4028]]], grad_fn=<ViewBackward0>)
context_vecs.shape: torch.Size([2, 6, 2])"""
BATCHED_MATMUL = """tensor([[[[1.3208, 1.1631, 1.2879],
        [1.1631, 2.2150, 1.8424],
        [1.2879, 1.8424, 2.0402]],

        [[0.4391, 0.7003, 0.5903],
        [0.7003, 1.3737, 1.0620],
        [0.5903, 1.0620, 0.9912]]]])"""
FIRST_HEAD = """tensor([[1.3208, 1.1631, 1.2879],
        [1.1631, 2.2150, 1.8424],
        [1.2879, 1.8424, 2.0402]])"""
SECOND_HEAD = """tensor([[0.4391, 0.7003, 0.5903],
        [0.7003, 1.3737, 1.0620],
        [0.5903, 1.0620, 0.9912]])"""
A = torch.tensor(
    [
        [
            [[0.2745, 0.6584, 0.2775, 0.8573], [0.8993, 0.0390, 0.9268, 0.7388], [0.7179, 0.7058, 0.9156, 0.4340]],
            [[0.0772, 0.3565, 0.1479, 0.5331], [0.4066, 0.2318, 0.4545, 0.9737], [0.4606, 0.5159, 0.4220, 0.5786]],
        ]
    ]
)  # (b, num_heads, num_tokens, head_dim) = (1, 2, 3, 4)


def test_causal_attention_shape(ns):
    code = """batch = torch.stack((inputs, inputs), dim=0)
print(batch.shape)
torch.manual_seed(123)
context_length = batch.shape[1]
ca = CausalAttention(d_in, d_out, context_length, 0.0)
context_vecs = ca(batch)

print("context_vecs.shape:", context_vecs.shape)
"""
    assert_prints(code, ns, "torch.Size([2, 6, 3])\ncontext_vecs.shape: torch.Size([2, 6, 2])")
    # The tutorial prints no numbers here: compare with its own class under the same seed.
    torch.manual_seed(123)
    theirs = tc.CausalAttention(D_IN, D_OUT, 6, 0.0)
    torch.testing.assert_close(ns["context_vecs"], theirs(ns["batch"]))


def test_multi_head_attention_wrapper_seed_123(ns):
    code = """batch = torch.stack((inputs, inputs), dim=0)
torch.manual_seed(123)
context_length = batch.shape[1]  # This is the number of tokens
d_in, d_out = 3, 2

mha = MultiHeadAttentionWrapper(d_in, d_out, context_length, 0.0, num_heads=2)
context_vecs = mha(batch)
print(context_vecs)
print("context_vecs.shape:", context_vecs.shape)
"""
    assert_prints(code, ns, WRAPPER_OUT)


def test_multi_head_attention_seed_123(ns):
    code = """batch = torch.stack((inputs, inputs), dim=0)
torch.manual_seed(123)
batch_size, context_length, d_in = batch.shape
d_out = 2
mha = MultiHeadAttention(d_in, d_out, context_length, 0.0, num_heads=2)
context_vecs = mha(batch)
print(context_vecs)
print("context_vecs.shape:", context_vecs.shape)
"""
    assert_prints(code, ns, MHA_OUT)


def test_batched_matmul_example(ns):
    code = """a = A
print(a @ a.transpose(2, 3))

first_head = a[0, 0, :, :]
first_res = first_head @ first_head.T
print("First head:\\n", first_res)
second_head = a[0, 1, :, :]
second_res = second_head @ second_head.T
print("\\nSecond head:\\n", second_res)
"""
    ns["A"] = A
    assert_prints(code, ns, BATCHED_MATMUL + FIRST_HEAD + SECOND_HEAD)
    # attnlab's unscaled scores of the batched heads, and of each head alone.
    scores = attention_scores(A, A, scale=1.0)  # (1, 2, 3, 3)
    assert_printed(scores, BATCHED_MATMUL)
    assert_printed(attention_scores(A[0, 0], A[0, 0], scale=1.0), FIRST_HEAD)
    assert_printed(attention_scores(A[0, 1], A[0, 1], scale=1.0), SECOND_HEAD)


# =============================================================================================
# The tutorials' classes run unchanged on (n, d_in) and (b, n, d_in), and match the tutorial
# code under the same seed at other sizes too
# =============================================================================================
def _specs(d_in: int, d_out: int, n: int, heads: int) -> list[tuple[type, type, tuple]]:
    """(attnlab class, tutorial class, constructor arguments) for each of the tutorial's classes."""
    return [
        (SelfAttention_v1, tc.SelfAttention_v1, (d_in, d_out)),
        (SelfAttention_v2, tc.SelfAttention_v2, (d_in, d_out)),
        (CausalAttention, tc.CausalAttention, (d_in, d_out, n, 0.0)),
        (MultiHeadAttentionWrapper, tc.MultiHeadAttentionWrapper, (d_in, d_out, n, 0.0, heads)),
        (MultiHeadAttention, tc.MultiHeadAttention, (d_in, d_out * heads, n, 0.0, heads)),
    ]


def _build(cls: type, args: tuple, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return cls(*args)


SIZES = (5, 4, 7, 3)  # d_in, d_out, n, heads
IDS = ["v1", "v2", "causal", "wrapper", "mha"]


@pytest.mark.parametrize("index", range(5), ids=IDS)
def test_same_seed_same_numbers_as_the_tutorial_code(index):
    ours_cls, theirs_cls, args = _specs(*SIZES)[index]
    ours, theirs = _build(ours_cls, args, 7), _build(theirs_cls, args, 7)
    n, d_in = SIZES[2], SIZES[0]
    x = torch.randn(2, n, d_in)
    # the tutorial's v1/v2 use keys.T: 2-D inputs only
    expected = torch.stack([theirs(x[0]), theirs(x[1])]) if index < 2 else theirs(x)
    torch.testing.assert_close(ours(x), expected, atol=1e-6, rtol=1e-5)
    # (n, d_in) inputs give the batch items' results
    torch.testing.assert_close(ours(x[1]), expected[1], atol=1e-6, rtol=1e-5)
    # inputs shorter than context_length too (the tutorial code slices its mask)
    if index >= 2:
        torch.testing.assert_close(ours(x[:, :4]), theirs(x[:, :4]), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("index", [2, 3, 4], ids=IDS[2:])
def test_training_dropout_draws_the_tutorials_masks(index):
    """In training, under one seed, dropout drops what the tutorial's code drops: the wrapper's heads
    draw their masks head after head, as the tutorial's loop over its heads does (they once drew one
    (b, H, n, n) mask and gave other numbers)."""
    d_in, _, n, _ = SIZES
    ours_cls, theirs_cls, args = _specs(*SIZES)[index]
    args = (*args[:3], 0.5, *args[4:])
    ours, theirs = _build(ours_cls, args, 7).train(), _build(theirs_cls, args, 7).train()
    x = torch.randn(2, n, d_in)
    torch.manual_seed(0)
    got = ours(x)
    torch.manual_seed(0)
    torch.testing.assert_close(got, theirs(x), atol=1e-6, rtol=1e-5)


def test_exercise_5_dropout_draws_the_exercises_masks():
    from attnlab.tutorials.attention_review import MultiHeadAttention as Exercise5

    torch.manual_seed(123)
    ours = Exercise5(3, 4, 2, 6, 0.5)
    torch.manual_seed(123)
    theirs = tc.MultiHeadAttentionReview(3, 4, 2, 6, 0.5)
    batch = torch.stack((tc.INPUTS, tc.INPUTS))
    torch.manual_seed(0)
    got = ours(batch)
    torch.manual_seed(0)
    torch.testing.assert_close(got, theirs(batch, d_out=2))  # d_out=2: each head's width (its scale)


# =============================================================================================
# State dicts
# =============================================================================================
@pytest.mark.parametrize("index", [2, 3, 4], ids=IDS[2:])
def test_state_dict_holds_weights_only_and_loads_the_tutorials(index):
    ours_cls, theirs_cls, args = _specs(*SIZES)[index]
    ours, theirs = _build(ours_cls, args, 7), _build(theirs_cls, args, 8)
    sd = ours.state_dict()
    assert set(sd) == {name for name, _ in ours.named_parameters()}
    assert not any(k.endswith("mask") for k in sd)
    their_sd = theirs.state_dict()
    assert any(k.endswith("mask") for k in their_sd)  # the tutorial classes do carry the mask
    x = torch.randn(3, SIZES[2], SIZES[0])
    assert not torch.allclose(ours(x), theirs(x))  # different seeds: different weights so far
    # attnlab's module loads the tutorial's state dict strictly ...
    result = ours.load_state_dict(their_sd)
    assert not result.missing_keys and not result.unexpected_keys
    # ... and gives the tutorial's outputs.
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-5)
    # The tutorial's classes load attnlab's state dict, all but their mask buffers.
    other = _build(ours_cls, args, 9)
    result = theirs.load_state_dict(other.state_dict(), strict=False)
    assert result.missing_keys and all(k.endswith("mask") for k in result.missing_keys)
    assert not result.unexpected_keys
    torch.testing.assert_close(theirs(x), other(x), atol=1e-6, rtol=1e-5)


# =============================================================================================
# The attention-review exercises
# =============================================================================================
EXERCISE_WEIGHTS = """tensor([[1.0000, 0.0000, 0.0000],
        [0.4975, 0.5025, 0.0000],
        [0.3300, 0.3333, 0.3367]])"""
QKT = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])


def test_review_exercises_1_and_2_run_unchanged():
    ns = {"torch": torch, "QKT": QKT.clone()}
    ex1 = """n = 3
d_out = 100
softmax_QKT = torch.softmax(QKT / (d_out ** 0.5), dim=-1)
mask = torch.tril(torch.ones(n, n))
masked_softmax_QKT = softmax_QKT * mask

# Normalizing so that the sum of each row is still 1
masked_attention = (masked_softmax_QKT / masked_softmax_QKT.sum(dim=-1, keepdim=True))
print(masked_attention)
"""
    ex2 = """mask = torch.tril(torch.ones(n, n))
masked_QKT = QKT.masked_fill(mask == 0, float('-inf'))
softmax_QKT = torch.softmax(masked_QKT / (d_out ** 0.5), dim=-1)
print(softmax_QKT)
"""
    assert_prints(ex1, ns, EXERCISE_WEIGHTS)
    assert_prints(ex2, ns, EXERCISE_WEIGHTS)


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_review_exercises_1_and_2_through_attnlab(backend):
    # Q K^T = QKT when Q = QKT and K = I; with V = I the output is the weights themselves.
    eye = torch.eye(3)
    scale = 1.0 / 100**0.5  # the exercises' d_out = 100
    out = scaled_dot_product_attention(QKT, eye, eye, is_causal=True, scale=scale, backend=backend)
    assert_printed(out, EXERCISE_WEIGHTS)
    if backend == "reference":
        _, weights = scaled_dot_product_attention(QKT, eye, eye, is_causal=True, scale=scale, return_weights=True)
        assert_printed(weights, EXERCISE_WEIGHTS)
        # Exercise 1's way: softmax first, then mask and renormalise; same numbers.
        w = torch.softmax(attention_scores(QKT, eye, scale=scale), dim=-1) * causal_mask(3)
        assert_printed(w / w.sum(dim=-1, keepdim=True), EXERCISE_WEIGHTS)


def test_review_self_attention_shape():
    # In [3]: SelfAttentionV2(768, 1024) with nn.Linear's default bias.
    X_batch = torch.randn(40, 50, 768)
    with torch.no_grad():
        context_batch = SelfAttention_v2(768, 1024, qkv_bias=True)(X_batch)
    assert_printed(list(context_batch.shape), "torch.Size([40, 50, 1024])")


def test_review_exercise_4_runs_unchanged(ns):
    code = """x_batch = torch.randn(20, 100, 512)
causal_att_model = CausalAttention(x_batch.shape[2], 768, x_batch.shape[1])
with torch.no_grad():
    contextual_embeddings = causal_att_model(x_batch)
print(contextual_embeddings.shape)
"""
    assert_prints(code, ns, "torch.Size([20, 100, 768])")


def test_review_exercise_3_class_same_numbers():
    """Exercise 3's CausalAttention (full-length input; its unsliced mask needs that) vs attnlab."""
    torch.manual_seed(3)
    theirs = tc.CausalAttentionReview(6, 8, 5)
    torch.manual_seed(3)
    ours = CausalAttention(6, 8, 5)  # dropout defaults to 0.0, as in the exercise
    x = torch.randn(2, 5, 6)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-5)


def test_review_exercise_6_class_same_numbers():
    """Exercise 6's MultiHeadAttentionOneModule (num_heads third) vs attnlab by keyword."""
    torch.manual_seed(4)
    theirs = tc.MultiHeadAttentionOneModule(6, 12, 3, 5)
    torch.manual_seed(4)
    ours = MultiHeadAttention(d_in=6, d_out=12, num_heads=3, context_length=5)
    x = torch.randn(2, 5, 6)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("call", "shape"),
    [
        ("MultiHeadAttention(x_batch.shape[2], 768, 3, x_batch.shape[1])", (20, 100, 512)),  # exercise 5
        ("MultiHeadAttention(x.shape[2], 1536, 3, 80)", (40, 80, 768)),  # exercise 7 (OneModule)
    ],
    ids=["exercise5", "exercise7"],
)
def test_review_positional_num_heads_third_is_a_clear_error(ns, call, shape):
    ns["x_batch"] = ns["x"] = torch.empty(shape, device="meta")
    with pytest.raises(TypeError, match=r"num_heads.*keyword.*num_heads=\.\.\."):
        run_snippet(call, ns)


def test_causal_attention_has_no_argument_order_hint():
    # Regression: CausalAttention's error sent users to a num_heads keyword it does not take.
    with pytest.raises(ValueError, match=r"dropout must be a float in \[0, 1\), got 2$"):
        CausalAttention(3, 2, 6, 2)
    with pytest.raises(TypeError, match="qkv_bias must be a bool, got 'False'"):
        MultiHeadAttention(3, 4, 6, num_heads=2, qkv_bias="False")
    with pytest.raises(TypeError, match="out_bias must be a bool, got 1"):
        MultiHeadAttention(3, 4, 6, num_heads=2, out_bias=1)
    with pytest.raises(TypeError, match="qkv_bias must be a bool, got 'no'"):
        CausalAttention(3, 2, 6, qkv_bias="no")


def test_gpt_style_positional_order_is_a_clear_error():
    # The GPT-style guide: MultiHeadAttention(d_in, d_out, num_heads, context_length, 0.0).
    with pytest.raises(TypeError, match=r"num_heads.*keyword"):
        MultiHeadAttention(768, 768, 12, 1024, 0.0)
    with pytest.raises(ValueError, match=r"dropout.*keyword"):
        MultiHeadAttention(768, 768, 12, 1024, 4)


def test_review_exercises_5_and_7_keyword_form(ns):
    code = """x_batch = torch.randn(20, 100, 512)
multihead_model = MultiHeadAttention(d_in=x_batch.shape[2], d_out=768, num_heads=3, context_length=x_batch.shape[1])
with torch.no_grad():
    contextual_embeddings = multihead_model(x_batch)
print(contextual_embeddings.shape)
x = torch.randn(40, 80, 768)
multihead_model = MultiHeadAttention(d_in=x.shape[2], d_out=1536, num_heads=3, context_length=80)
with torch.no_grad():
    contextual_embeddings = multihead_model(x)
print(contextual_embeddings.shape)
"""
    assert_prints(code, ns, "torch.Size([20, 100, 768])\ntorch.Size([40, 80, 1536])")


def test_every_number_written_here_is_printed_by_the_tutorials():
    """The expected values in this file are copied from the tutorials' text: each 4-decimal
    number in it must appear there (a typo, or a number produced by our own code, would not)."""
    if not SEEDS.is_dir():
        pytest.skip(f"the tutorials' texts are not at {SEEDS}")
    tutorials = "\n".join(p.read_text(encoding="utf-8") for p in sorted(SEEDS.glob("*.txt")))
    with open(__file__, encoding="utf-8") as f:
        numbers = set(re.findall(r"(?<![\w.])-?\d+\.\d{4}(?!\d)", f.read()))
    assert len(numbers) > 100  # the pattern finds the expected tensors
    assert not sorted(n for n in numbers if n not in tutorials)


# =============================================================================================
# attnlab.tutorials: each tutorial's classes, exactly (argument order, defaults, creation order)
# =============================================================================================
from attnlab.tutorials import attention_review, gpt_style, implement, one_head  # noqa: E402
from tutorial_numbers import REPRODUCED, TITLES, agrees, printed_blocks, tutorial_texts, unreproduced_table  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _pair(ours_cls, theirs_cls, args, seed=11, kwargs=None):
    torch.manual_seed(seed)
    ours = ours_cls(*args, **(kwargs or {}))
    torch.manual_seed(seed)
    theirs = theirs_cls(*args, **(kwargs or {}))
    return ours, theirs


@pytest.mark.parametrize(
    ("ours_cls", "theirs_cls", "args", "two_d_only"),
    [
        (gpt_style.SelfAttention, tc.GuideSelfAttention, (5, 4), True),
        (gpt_style.CausalAttention, tc.GuideCausalAttention, (5, 4, 7), False),
        (gpt_style.MultiHeadAttention, tc.GuideMultiHeadAttention, (5, 6, 3, 7, 0.0), False),
        (attention_review.SelfAttentionV2, tc.SelfAttentionV2, (5, 4), False),
        (attention_review.MultiHeadAttentionOneModule, tc.MultiHeadAttentionOneModule, (5, 6, 3, 7), False),
    ],
    ids=["guide-self", "guide-causal", "guide-mha", "review-v2", "review-onemodule"],
)
def test_tutorial_variants_same_seed_same_numbers(ours_cls, theirs_cls, args, two_d_only):
    ours, theirs = _pair(ours_cls, theirs_cls, args)
    ours.eval(), theirs.eval()  # the guide's CausalAttention defaults to dropout 0.1
    x = torch.randn(2, 7, 5)
    expected = torch.stack([theirs(x[0]), theirs(x[1])]) if two_d_only else theirs(x)
    torch.testing.assert_close(ours(x), expected, atol=1e-6, rtol=1e-5)
    # and a state dict of the tutorial's class loads into ours (mask buffers dropped, names mapped)
    other = theirs_cls(*args)
    ours.load_state_dict(other.state_dict())
    other.eval()
    expected = torch.stack([other(x[0]), other(x[1])]) if two_d_only else other(x)
    torch.testing.assert_close(ours(x), expected, atol=1e-6, rtol=1e-5)


def test_gpt_style_defaults_and_order_differ_from_attnlabs():
    """The claim in attention.py's docstring ("same creation order, so the same numbers under the
    tutorials' seeds") does not hold for the GPT-style guide: attnlab's CausalAttention under the
    guide's seed is another model; the guide's variant is exact."""
    x = torch.randn(2, 7, 5)
    theirs = _pair(CausalAttention, tc.GuideCausalAttention, (5, 4, 7))[1].eval()
    torch.manual_seed(11)
    ours = CausalAttention(5, 4, 7).eval()
    assert not torch.allclose(ours(x), theirs(x), atol=1e-4)
    assert gpt_style.CausalAttention(5, 4, 7).dropout.p == 0.1 == tc.GuideCausalAttention(5, 4, 7).dropout.p
    assert next(iter(gpt_style.CausalAttention(5, 4, 7).state_dict())) == "W_keys.weight"
    # The guide's biased layers need qkv_bias=True in attnlab's classes.
    torch.manual_seed(11)
    unbiased = MultiHeadAttention(d_in=5, d_out=6, num_heads=3, context_length=7, dropout=0.0)
    torch.manual_seed(11)
    biased = MultiHeadAttention(d_in=5, d_out=6, num_heads=3, context_length=7, dropout=0.0, qkv_bias=True)
    torch.manual_seed(11)
    guide = tc.GuideMultiHeadAttention(5, 6, 3, 7, 0.0)
    torch.testing.assert_close(biased(x), guide(x), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(unbiased(x), guide(x), atol=1e-4)


@pytest.mark.parametrize(("d_in", "d_out", "heads"), [(12, 24, 3), (512, 768, 3), (6, 8, 2)])
def test_exercise5_multi_head_is_a_wrapper_without_output_projection(d_in, d_out, heads):
    with torch.device("meta"):
        exercise = tc.MultiHeadAttentionReview(d_in, d_out, heads, 10)
        ours = attention_review.MultiHeadAttention(d_in, d_out, heads, 10)
        keyword = MultiHeadAttention(d_in=d_in, d_out=d_out, num_heads=heads, context_length=10)
    count = lambda m: sum(p.numel() for p in m.parameters())
    assert count(ours) == count(exercise) == 3 * d_in * d_out
    assert count(keyword) == count(exercise) + d_out * d_out + d_out  # attnlab's adds out_proj
    if (d_in, d_out) == (12, 24):
        assert (count(exercise), count(keyword)) == (864, 1464)  # the figures


def test_exercise5_numbers_equal_the_wrapper_and_the_exercise():
    x = torch.randn(2, 6, 12)
    ours, theirs = _pair(attention_review.MultiHeadAttention, tc.MultiHeadAttentionReview, (12, 24, 3, 6))
    torch.testing.assert_close(ours(x), theirs(x, d_out=8), atol=1e-6, rtol=1e-5)  # heads at their own scale
    torch.manual_seed(11)
    wrapper = MultiHeadAttentionWrapper(12, 8, 6, 0.0, num_heads=3)
    torch.testing.assert_close(ours(x), wrapper(x))
    out, w = ours(x[:, :4], return_weights=True)  # shorter than context_length: fine here
    assert out.shape == (2, 4, 24) and w.shape == (2, 3, 4, 4)
    # attnlab's MultiHeadAttention, by keyword, is a different function
    torch.manual_seed(11)
    keyword = MultiHeadAttention(d_in=12, d_out=24, num_heads=3, context_length=6)
    assert not torch.allclose(keyword(x), ours(x), atol=1e-3)
    with pytest.raises(ValueError, match="d_out must be divisible by num_heads"):
        attention_review.MultiHeadAttention(12, 25, 3, 6)


def test_one_module_state_dict_with_projection_loads_and_exposes_it():
    theirs = tc.MultiHeadAttentionOneModule(6, 12, 3, 5)
    ours = attention_review.MultiHeadAttentionOneModule(6, 12, 3, 5)
    result = ours.load_state_dict(theirs.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    assert ours.projection is ours.out_proj and ours.d_head == 4
    x = torch.randn(2, 5, 6)
    torch.testing.assert_close(ours(x), theirs(x), atol=1e-6, rtol=1e-5)


def test_implement_classes_hold_the_tutorials_weights_and_numbers():
    """Created after the tutorial's embedding under its seed 42, attnlab.tutorials.implement holds
    its W_q, W_k, W_v and the three heads' stacks, and computes its (row-normalised) attention."""
    from tutorial_numbers import OMEGA_1_ALL, WEIGHTS_1, Z_1

    torch.manual_seed(42)
    ints = torch.tensor([6, 4, 7, 1, 0, 2, 4, 6])
    embedded = torch.nn.Embedding(8, 16)(ints).detach()
    single = implement.SelfAttention(16, 24, 24, 28)
    heads = implement.MultiHeadSelfAttention(16, 24, 24, 28, 3)
    torch.manual_seed(42)
    torch.nn.Embedding(8, 16)
    W = [torch.rand(24, 16), torch.rand(24, 16), torch.rand(28, 16)]
    MW = [torch.rand(3, 24, 16), torch.rand(3, 24, 16), torch.rand(3, 28, 16)]
    for p, w in zip((single.W_q, single.W_k, single.W_v, heads.W_q, heads.W_k, heads.W_v), W + MW, strict=True):
        assert torch.equal(p, w)
    with torch.no_grad():
        z, weights = single(embedded, return_weights=True)
        z_heads, w_heads = heads(embedded, return_weights=True)
    omega_1_all = (embedded[0] @ single.W_q.T) @ (embedded @ single.W_k.T).T
    torch.testing.assert_close(omega_1_all.double(), torch.tensor(OMEGA_1_ALL, dtype=torch.float64), atol=2e-4, rtol=0)
    torch.testing.assert_close(weights[0].double(), torch.tensor(WEIGHTS_1, dtype=torch.float64), rtol=2e-4, atol=1e-35)
    assert_printed(z[0], str(Z_1))
    assert z.shape == (8, 28) and z_heads.shape == (3, 8, 28) and w_heads.shape == (3, 8, 8)
    torch.testing.assert_close(weights.sum(-1), torch.ones(8))
    torch.testing.assert_close(w_heads.sum(-1), torch.ones(3, 8))
    # each head of the stack is the single-head module with that head's matrices
    for h in range(3):
        one = implement.SelfAttention(16, 24, 24, 28)
        one.load_state_dict({"W_q": heads.W_q[h], "W_k": heads.W_k[h], "W_v": heads.W_v[h]})
        with torch.no_grad():
            torch.testing.assert_close(one(embedded), z_heads[h])
    with pytest.raises(ValueError, match="d_k must equal d_q"):
        implement.SelfAttention(16, 24, 20, 28)


def test_one_head_head_creates_key_query_value_in_the_tutorials_order():
    from tutorial_numbers import HEAD_WEI

    torch.manual_seed(1337)
    x = torch.randn(4, 8, 32)
    head = one_head.Head(32, 16, scale=1.0)
    torch.manual_seed(1337)
    torch.randn(4, 8, 32)
    key, query, value = (torch.nn.Linear(32, 16, bias=False) for _ in range(3))  # the tutorial's order
    for ours, theirs in ((head.key, key), (head.query, query), (head.value, value)):
        assert torch.equal(ours.weight, theirs.weight)
    with torch.no_grad():
        out, wei = head(x, return_weights=True)
    assert_printed(wei[0], str(HEAD_WEI))
    assert out.shape == (4, 8, 16)
    with torch.no_grad():  # the default scale is the paper's 1/sqrt(head_size); causal=False sees everything
        scaled = one_head.Head(32, 16)
        scaled.load_state_dict(head.state_dict())
        torch.testing.assert_close(scaled(x), scaled_dot_product_attention(query(x), key(x), value(x), is_causal=True))
        encoder = one_head.Head(32, 16, causal=False)
        encoder.load_state_dict(head.state_dict())
        assert (encoder(x, return_weights=True)[1] > 0).all()


# =============================================================================================
# Every number the tutorials print: reproduced (to the decimals printed) or listed in the docs
# =============================================================================================
def _values(got) -> list[float]:
    if isinstance(got, torch.Tensor):
        return [float(v) for v in got.detach().double().flatten().tolist()]
    if isinstance(got, (list, tuple)):
        return [float(v) for v in got]
    return [float(got)]


def test_every_printed_number_is_reproduced_or_listed():
    """Each printed block is either reproduced by the lesson or call REPRODUCED names (every number,
    to its printed decimals) or listed in docs/tutorial-numbers.md, with the reason; a number is
    never in both, and the table lists only what the tutorials print."""
    texts = tutorial_texts()
    table = unreproduced_table((DOCS / "tutorial-numbers.md").read_text(encoding="utf-8"))
    assert all(row.tutorial in TITLES and row.reason for row in table)
    entries = {(r.tutorial, r.index): r for r in REPRODUCED}
    assert len(entries) == len(REPRODUCED)  # no block mapped twice
    problems, listed_blocks, total = [], [], 0
    for title in TITLES:
        for block in printed_blocks(texts[title]):
            if not block.numbers:  # e.g. a printed boolean mask
                continue
            total += len(block.numbers)
            entry = entries.pop((title, block.index), None)
            if entry is None:
                listed_blocks.append((title, block))
                continue
            if not block.text.startswith(entry.starts):
                problems.append(f"{title} block {block.index} starts {block.text[:30]!r}, not {entry.starts!r}")
                continue
            got = _values(entry.get())
            if block.truncated:
                got = got[: len(block.numbers)]
            if len(got) != len(block.numbers):
                problems.append(
                    f"{title} block {block.index} ({entry.how}): {len(got)} values, {len(block.numbers)} printed"
                )
                continue
            last = len(block.numbers) - 1
            bad = [
                (p, round(g, 6))
                for i, (g, p) in enumerate(zip(got, block.numbers, strict=True))
                if not agrees(g, p, truncated=block.truncated and i == last, atol=entry.atol)
            ]
            if bad:
                problems.append(f"{title} block {block.index} ({entry.how}): {bad[:4]}")
    assert not entries, f"entries for blocks that do not exist: {sorted(entries)}"
    # The blocks attnlab does not reproduce are exactly the table's rows (each row one block).
    rows = list(table)
    for title, block in listed_blocks:
        match = next(
            (r for r in rows if r.tutorial == title and block.text.startswith(r.starts) and r.numbers == block.numbers),
            None,
        )
        if match is None:
            problems.append(f"{title} block {block.index} {block.text[:40]!r}: neither reproduced nor in the table")
        else:
            rows.remove(match)
    assert not rows, f"rows of the table that match no unreproduced printed block: {rows}"
    assert not problems, "\n".join(problems)
    assert total > 2000  # every tensor, whole: not a sample
