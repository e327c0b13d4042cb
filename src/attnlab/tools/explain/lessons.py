"""The lessons of ``attnlab explain``, in teaching order: the tutorials' steps, computed with
attnlab, tensor by tensor.

Each lesson prints its steps through a :class:`~attnlab.tools.explain.walk.Walk` (every tensor
with its shape and one line on what happened) and returns its key tensors, so the tests can
compare them with the numbers the tutorials print. The numbers are the tutorials' own: same
inputs, same ``torch.manual_seed`` calls, same order of parameter creation. Where a tutorial's code
is wrong, the lesson says so in a note marked "Tutorial bug" and shows the right result.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

from attnlab import tutorial_code as tc
from attnlab.attention import (
    CausalAttention,
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    SelfAttention_v1,
    SelfAttention_v2,
)
from attnlab.functional import causal_mask, scaled_dot_product_attention, simple_self_attention
from attnlab.tools.explain.registry import GPT_GUIDE, IMPLEMENT, ONE_HEAD, REVIEW, SIMPLE, lesson
from attnlab.tools.explain.walk import Walk, shape_of

__all__ = ["GPT2_SIZES", "gpt2_parameter_counts"]


def _inputs() -> Tensor:
    return tc.INPUTS.clone()  # (6, 3): "Your journey starts with one step"


def words_text() -> str:
    return " ".join(tc.WORDS)


@lesson(
    "dot-products",
    'scores of "journey" against every word, by dot product',
    headline='how similar is "journey" to each word?',
    tutorial=SIMPLE,
    section="Calculate the scores",
)
def dot_products(w: Walk) -> dict[str, Tensor]:
    inputs = _inputs()
    w.show("inputs", inputs, f"six words, one 3-d embedding per row: {words_text()}")

    w.step("query = inputs[1]")
    query = inputs[1]
    w.show("query", query, 'the embedding of "journey", the word we compute scores for')

    w.step("for i, x_i in enumerate(inputs): attn_scores_2[i] = torch.dot(x_i, query)")
    scores_2 = torch.empty(inputs.shape[0])  # (6,)
    for i, x_i in enumerate(inputs):
        scores_2[i] = torch.dot(x_i, query)
    w.show(
        "attn_scores_2",
        scores_2,
        'one dot product per word: large when the word points the same way as "journey"',
    )

    bad_query = inputs.shape[0]
    try:
        torch.dot(inputs[0], bad_query)  # type: ignore[arg-type]
        error = "no error"
    except TypeError as exc:
        error = f"TypeError: {exc}"
    w.bug(
        SIMPLE,
        f"its loop sets `query = inputs.shape[0]`, which is the int {bad_query} (the number of rows), "
        f"not a vector, so `torch.dot(x_i, query)` fails ({error}). The scores it prints are those "
        f'of inputs[1] ("journey"), computed above with `query = inputs[1]`, which is what its later '
        f"code uses.",
    )

    w.step("attn_scores = inputs @ inputs.T")
    scores = inputs @ inputs.T  # (6, 6)
    w.show(
        "attn_scores",
        scores,
        "every word against every word in one matrix product; row i holds word i's scores",
    )
    w.check('row 1 ("journey") == the loop above', scores[1], scores_2)
    w.say(
        "A matrix product (m x n) @ (n x p) -> (m x p) does all 36 dot products at once; it is "
        "how every later step computes scores."
    )
    return {"inputs": inputs, "scores_2": scores_2, "scores": scores}


@lesson(
    "normalise",
    "turn scores into weights: divide by the sum, or softmax",
    headline="from scores to attention weights that sum to 1",
    tutorial=SIMPLE,
    section="Calculate the Attention Weights",
)
def normalise(w: Walk) -> dict[str, Tensor]:
    inputs = _inputs()
    scores_2 = inputs @ inputs[1]  # (6,) the scores of "journey"
    w.show("attn_scores_2", scores_2, 'the scores of "journey" (see the dot-products lesson)')

    total = scores_2.sum()
    w.show("attn_scores_2.sum()", total, "the plain total of the six scores")
    plain = scores_2 / total  # (6,)
    w.show("attn_weights_2_tmp = attn_scores_2 / attn_scores_2.sum()", plain, "each score over the total")
    w.value("its sum", float(plain.sum()))

    soft = torch.softmax(scores_2, dim=0)  # (6,)
    w.show(
        "attn_weights_2 = torch.softmax(attn_scores_2, dim=0)",
        soft,
        "exp(score) over the sum of exps: the larger scores get a larger share",
    )
    w.value("its sum", float(soft.sum()))

    example = torch.tensor([2.0, -1.0, -0.5])  # an example with negative scores (not the tutorial's)
    w.say("Why softmax? Scores can be negative. Take the made-up scores [2, -1, -0.5]:")
    w.show("example / example.sum()", example / example.sum(), "the plain sum gives weights of 4 and -2")
    w.show("torch.softmax(example, dim=0)", torch.softmax(example, dim=0), "softmax: all positive, sum 1")

    w.step("context, weights = attnlab.simple_self_attention(inputs, return_weights=True)")
    _, weights = simple_self_attention(inputs, return_weights=True)  # (6, 6)
    w.show(
        "weights",
        weights,
        "softmax of every row of inputs @ inputs.T (dim=-1: along the keys of each query)",
    )
    w.show("weights.sum(dim=-1)", weights.sum(dim=-1), "each row sums to 1")
    w.check('row 1 == attn_weights_2 ("journey")', weights[1], soft)
    return {"sum_2": total, "weights_2_plain": plain, "weights_2": soft, "weights": weights}


@lesson(
    "context",
    "context vectors: weighted sums of the inputs",
    headline="context vectors, one word and then all of them",
    tutorial=SIMPLE,
    section="Calculating the context vector",
)
def context(w: Walk) -> dict[str, Tensor]:
    inputs = _inputs()
    weights_2 = torch.softmax(inputs @ inputs[1], dim=0)  # (6,)
    w.show("attn_weights_2", weights_2, 'the softmax weights of "journey" (see the normalise lesson)')

    w.step("for i, x_i in enumerate(inputs): context_vec_2 += attn_weights_2[i] * x_i")
    context_2 = torch.zeros(inputs.shape[1])  # (3,)
    for i, x_i in enumerate(inputs):
        context_2 += weights_2[i] * x_i
    w.show(
        "context_vec_2",
        context_2,
        '"journey" rebuilt as a weighted average of all six words: an enriched embedding',
    )

    w.step("all_context_vecs = attnlab.simple_self_attention(inputs)")
    all_context = simple_self_attention(inputs)  # (6, 3)
    w.show("all_context_vecs", all_context, "softmax(inputs @ inputs.T, dim=-1) @ inputs: every word at once")
    w.check("row 1 == context_vec_2", all_context[1], context_2)

    w.step("attnlab.scaled_dot_product_attention(inputs, inputs, inputs, scale=1.0)")
    general = scaled_dot_product_attention(inputs, inputs, inputs, scale=1.0)  # (6, 3)
    w.check("the general function with Q = K = V = inputs and no scaling", general, all_context)
    w.say(
        "This first version has no parameters: queries, keys and values are all the inputs "
        "themselves. The next lessons project them with trainable matrices and scale the scores."
    )
    return {"context_2": context_2, "context": all_context}


@lesson(
    "trainable",
    "trainable Q/K/V: SelfAttention_v1 and SelfAttention_v2",
    headline="self-attention with trainable weights",
    tutorial=SIMPLE,
    section="Implementing self-attention with trainable weights",
)
def trainable(w: Walk) -> dict[str, Tensor]:
    inputs = _inputs()
    try:
        exec("SelfAttention_v1(d_in, d_out)", {"SelfAttention_v1": SelfAttention_v1})  # the tutorial's line
        undefined = "no error"
    except NameError as exc:
        undefined = f"NameError: {exc}"
    d_in, d_out = inputs.shape[1], 2
    w.bug(
        SIMPLE,
        "its trainable section calls `SelfAttention_v1(d_in, d_out)` and `SelfAttention_v2(d_in, "
        f"d_out)` without defining d_in or d_out: run as written, that is a {undefined}. They first "
        "appear later, in its multi-head section (`d_in, d_out = 3, 2`). Its printed numbers need "
        f"d_in = inputs.shape[1] = {d_in} (the embedding width) and d_out = {d_out} (two output "
        "columns); with them, the numbers below are the ones it prints.",
    )

    w.step("torch.manual_seed(123); sa_v1 = attnlab.SelfAttention_v1(d_in=3, d_out=2)")
    torch.manual_seed(123)
    sa_v1 = SelfAttention_v1(d_in, d_out)
    w.show("sa_v1.W_query", sa_v1.W_query, "torch.rand(d_in, d_out): random at first, learned in training")
    queries = inputs @ sa_v1.W_query  # (6, 2)
    keys = inputs @ sa_v1.W_key  # (6, 2)
    values = inputs @ sa_v1.W_value  # (6, 2)
    w.show("queries = inputs @ W_query", queries, "what each word is looking for")
    w.show("keys = inputs @ W_key", keys, "what each word offers to be found by")
    w.show("values = inputs @ W_value", values, "what each word hands over when attended to")
    scores = queries @ keys.T  # (6, 6)
    w.show("attn_scores = queries @ keys.T", scores, "omega: query i against key j")
    weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)  # (6, 6)
    w.show(
        "attn_weights = softmax(attn_scores / sqrt(d_k), dim=-1)",
        weights,
        "scaled by 1/sqrt(d_k) = 1/sqrt(2) (see the scaling lesson), rows sum to 1",
    )
    context_v1 = sa_v1(inputs)  # (6, 2)
    w.show("sa_v1(inputs)", context_v1, "attn_weights @ values: a 2-d context vector per word")
    w.check("module == the steps above", context_v1, weights @ values)

    w.step("torch.manual_seed(789); sa_v2 = attnlab.SelfAttention_v2(d_in=3, d_out=2)")
    torch.manual_seed(789)
    sa_v2 = SelfAttention_v2(d_in, d_out)
    w.show(
        "sa_v2.W_query.weight",
        sa_v2.W_query.weight,
        "nn.Linear keeps (d_out, d_in) and computes x @ W.T; its own init (uniform in "
        "+-1/sqrt(d_in)), so other numbers than v1",
    )
    context_v2, weights_v2 = sa_v2(inputs, return_weights=True)  # (6, 2), (6, 6)
    w.show("attn_weights (v2)", weights_v2, "softmax(queries @ keys.T / sqrt(2), dim=-1)")
    w.show("sa_v2(inputs)", context_v2, "the context vectors of v2")
    return {"context_v1": context_v1, "weights_v1": weights, "weights_v2": weights_v2, "context_v2": context_v2}


def implement_tensors() -> dict[str, object]:
    """The seed-42 setup of "Implement the Self-Attention Mechanism in PyTorch", step for step."""
    torch.manual_seed(42)
    dim_word_embedding = 16
    sentence = "Life is short, eat dessert first is life".lower().replace(",", "").split()
    dict_words = {word: idx for idx, word in enumerate(sorted(sentence))}  # the tutorial's (skips)
    sentence_ints = torch.tensor([dict_words[word] for word in sentence])  # (8,)
    embedding_layer = nn.Embedding(len(sentence), dim_word_embedding)
    embedded = embedding_layer(sentence_ints).detach()  # (8, 16)
    dim_q, dim_v = 24, 28
    W_q = torch.rand(dim_q, dim_word_embedding)  # (24, 16)
    W_k = torch.rand(dim_q, dim_word_embedding)  # (24, 16)
    W_v = torch.rand(dim_v, dim_word_embedding)  # (28, 16)
    n_heads = 3
    mh_W_q = torch.rand(n_heads, dim_q, dim_word_embedding)  # (3, 24, 16)
    mh_W_k = torch.rand(n_heads, dim_q, dim_word_embedding)  # (3, 24, 16)
    mh_W_v = torch.rand(n_heads, dim_v, dim_word_embedding)  # (3, 28, 16)
    return {
        "sentence": sentence,
        "dict_words": dict_words,
        "sentence_ints": sentence_ints,
        "embedded": embedded,
        "W_q": W_q,
        "W_k": W_k,
        "W_v": W_v,
        "mh": (mh_W_q, mh_W_k, mh_W_v),
        "dim_k": dim_q,
    }


@lesson(
    "softmax-dim",
    "softmax over the wrong axis (dim=0) and how to spot it",
    headline="which axis does softmax normalise?",
    tutorial=IMPLEMENT,
    section="Unnormalized attention scores",
)
def softmax_dim(w: Walk) -> dict[str, Tensor]:
    s = implement_tensors()
    sentence, dict_words = s["sentence"], s["dict_words"]
    w.say(f"torch.manual_seed(42); the sentence: {' '.join(sentence)}")  # type: ignore[arg-type]
    w.value("dict_words", str(dict_words))
    w.show("sentence_ints", s["sentence_ints"], "each word's index in dict_words")  # type: ignore[arg-type]
    fixed = {word: idx for idx, word in enumerate(sorted(set(sentence)))}  # type: ignore[arg-type]
    w.bug(
        IMPLEMENT,
        "its word dictionary `{word: idx for idx, word in enumerate(sorted(sentence))}` numbers the "
        "sorted *sentence*, duplicates included: 'is' and 'life' appear twice, so their later "
        f"positions overwrite the earlier ones and indices 3 and 5 are skipped ({len(dict_words)} "  # type: ignore[arg-type]
        f"words, indices up to {max(dict_words.values())}). The embedding table is sized by the "  # type: ignore[union-attr]
        f"sentence length ({len(sentence)}), which happens to cover index 7. A vocabulary needs "  # type: ignore[arg-type]
        f"`sorted(set(sentence))`: {fixed}. Its numbers below keep its indices, to match its prints.",
    )

    embedded: Tensor = s["embedded"]  # type: ignore[assignment]
    W_q, W_k, W_v = s["W_q"], s["W_k"], s["W_v"]
    dim_k: int = s["dim_k"]  # type: ignore[assignment]
    queries = (W_q @ embedded.T).T  # (8, 24)
    keys = (W_k @ embedded.T).T  # (8, 24)
    values = (W_v @ embedded.T).T  # (8, 28)
    w.say(
        f"embedded_sentence {shape_of(embedded)}; queries {shape_of(queries)}, keys {shape_of(keys)}, "
        f"values {shape_of(values)}: W @ x for every word (W is (d_q, 16), torch.rand)."
    )
    omega_1_5 = queries[0] @ keys[4]
    w.show("omega_1_5 = queries[0] @ keys[4]", omega_1_5, "score of the first word against the 5th")
    omega_1_all = queries[0] @ keys.T  # (8,)
    w.show("omega_1_all = queries[0] @ keys.T", omega_1_all, "the first word against every word")
    weights_1 = torch.softmax(omega_1_all / dim_k**0.5, dim=0)  # (8,)
    w.show(
        "F.softmax(omega_1_all / dim_k ** 0.5, dim=0)",
        weights_1,
        "for a 1-D vector dim=0 is right: the 8 weights sum to 1. Scores in the tens and "
        f"hundreds make it nearly one-hot, on word {int(weights_1.argmax())} "
        f"('{sentence[int(weights_1.argmax())]}')",  # type: ignore[index]
    )
    z_1 = weights_1 @ values  # (28,)
    w.show("context_vector_z_1 = weights_1 @ values", z_1, "the first word's context vector")

    omega_all = queries @ keys.T  # (8, 8)
    weights_dim0 = torch.softmax(omega_all / dim_k**0.5, dim=0)  # (8, 8) the tutorial's
    w.show(
        "F.softmax(omega_all / dim_k ** 0.5, dim=0)",
        weights_dim0,
        "the tutorial's 'normalized attention scores of ALL words': dim=0 on a matrix normalises each COLUMN",
    )
    w.show("its .sum(dim=0) (columns)", weights_dim0.sum(dim=0), "every column sums to 1")
    w.show("its .sum(dim=-1) (rows)", weights_dim0.sum(dim=-1), "the rows, one per query word, do not")
    w.value("its total", float(weights_dim0.sum()), "the tutorial prints this 8.0")
    weights_fixed = torch.softmax(omega_all / dim_k**0.5, dim=-1)  # (8, 8)
    context_dim0 = weights_dim0 @ values  # (8, 28)
    context_fixed = weights_fixed @ values  # (8, 28)
    w.bug(
        IMPLEMENT,
        "it applies softmax over dim=0 to the (queries x keys) matrix, so each key's column sums to "
        "1 instead of each query's row. Its check, 'Sum of this vector = 8.0', cannot catch this: "
        "8 rows of 1 also sum to 8. Row 0 should equal the single-word weights above, and its "
        "context row 0 should equal context_vector_z_1; with dim=0 they do not:",
    )
    w.show("(weights @ values)[0] with dim=0", context_dim0[0], "the tutorial's context_z[0]: near zero")
    w.step("weights = F.softmax(omega_all / dim_k ** 0.5, dim=-1)   # the fix")
    w.show("weights.sum(dim=-1)", weights_fixed.sum(dim=-1), "every query's row sums to 1")
    w.check("row 0 == the single-word weights", weights_fixed[0], weights_1)
    w.check("context row 0 == context_vector_z_1", context_fixed[0], z_1)
    w.step("attnlab.scaled_dot_product_attention(queries, keys, values, return_weights=True)   # scale 1/sqrt(24)")
    lib_out, lib_weights = scaled_dot_product_attention(queries, keys, values, return_weights=True)
    w.check("attnlab's weights == the fixed weights", lib_weights, weights_fixed)
    w.check("attnlab's context == the fixed context", lib_out, context_fixed)

    mh_W_q, mh_W_k, mh_W_v = s["mh"]  # type: ignore[misc]
    n_heads = mh_W_q.shape[0]
    repeated = embedded.T.repeat(n_heads, 1, 1)  # (3, 16, 8)
    mh_q = torch.bmm(mh_W_q, repeated).permute(0, 2, 1)  # (3, 8, 24)
    mh_k = torch.bmm(mh_W_k, repeated).permute(0, 2, 1)  # (3, 8, 24)
    mh_v = torch.bmm(mh_W_v, repeated).permute(0, 2, 1)  # (3, 8, 28)
    mh_scores = torch.bmm(mh_q, mh_k.permute(0, 2, 1))  # (3, 8, 8)
    w.say("Its multi-head part: three heads of random W (3, d, 16), applied with torch.bmm.")
    w.show("multihead_omega_all[0]", mh_scores[0], "head 0's scores (all three: shape (3, 8, 8))")
    mh_weights_dim0 = torch.softmax(mh_scores / dim_k**0.5, dim=0)  # (3, 8, 8)
    mh_weights_fixed = torch.softmax(mh_scores / dim_k**0.5, dim=-1)  # (3, 8, 8)
    w.bug(
        IMPLEMENT,
        "the multi-head softmax is also over dim=0, which is now the HEADS axis: for each (query, "
        "key) pair the three heads' weights sum to 1, and the total is 8 x 8 = "
        f"{float(mh_weights_dim0.sum()):.0f} (its 'Sum of this vector = 64.0'). With dim=-1 each "
        f"head's rows sum to 1 and the total is 3 x 8 = {float(mh_weights_fixed.sum()):.0f}.",
    )
    w.show(
        "softmax(..., dim=0)[:, 0, 0]",
        mh_weights_dim0[:, 0, 0],
        "one (query, key) pair across the three heads: sums to 1",
    )
    w.show("softmax(..., dim=-1)[0].sum(dim=-1)", mh_weights_fixed[0].sum(dim=-1), "fixed: head 0's rows")
    mh_context_dim0 = mh_weights_dim0 @ mh_v  # (3, 8, 28): the tutorial's multihead_context_z
    mh_context_fixed = mh_weights_fixed @ mh_v  # (3, 8, 28)
    w.value("multihead_context_z.shape", str(tuple(mh_context_fixed.shape)), "heads, words, dim_v")
    return {
        "omega_1_5": omega_1_5,
        "omega_1_all": omega_1_all,
        "weights_1": weights_1,
        "z_1": z_1,
        "omega_all": omega_all,
        "weights_dim0": weights_dim0,
        "weights_fixed": weights_fixed,
        "context_dim0": context_dim0,
        "context_fixed": context_fixed,
        "mh_scores": mh_scores,
        "mh_weights_dim0": mh_weights_dim0,
        "mh_weights_fixed": mh_weights_fixed,
        "mh_context_dim0": mh_context_dim0,
        "mh_context_fixed": mh_context_fixed,
    }


@lesson(
    "scaling",
    "why divide by sqrt(d_k): variance and softmax sharpening",
    headline="why the scores are divided by sqrt(d_k)",
    tutorial=ONE_HEAD,
    section="In [47]: scaled attention",
)
def scaling(w: Walk) -> dict[str, Tensor]:
    B, T, head_size = 4, 8, 16
    w.say(
        "The tutorial's In [47] and In [48] draw k and q where its notebook left torch's random "
        "generator: seeded with torch.manual_seed(1337) in In [38], then x = torch.randn(4, 8, 32), "
        "then 16 draws of 4 x 8 x 16 numbers (its key and query layers, nn.Linear(32, 16) each, "
        "made again as its cells were re-run: each draws 512 numbers, as torch.randn(4, 8, 16) "
        "does). Seed 1337; type these lines (on a CPU) to get its numbers:"
    )
    w.step("torch.manual_seed(1337); x = torch.randn(4, 8, 32); _ = torch.randn(16, 4, 8, 16)")
    torch.manual_seed(1337)
    torch.randn(B, T, 32)  # x
    torch.randn(16, B, T, head_size)  # what the notebook drew in between
    w.step("k = torch.randn(B, T, head_size); q = torch.randn(B, T, head_size)   # B, T, hs = 4, 8, 16")
    k = torch.randn(B, T, head_size)  # (B, T, hs)
    q = torch.randn(B, T, head_size)  # (B, T, hs)
    wei = q @ k.transpose(-2, -1)  # (B, T, T)
    w.value("k.var()", float(k.var()), "unit Gaussian")
    w.value("q.var()", float(q.var()), "unit Gaussian")
    w.value("(q @ k.transpose(-2, -1)).var()", float(wei.var()), "the tutorial's 13.6696: order head_size = 16")
    w.step("k = torch.randn(B, T, head_size); q = torch.randn(B, T, head_size)   # In [48]: new draws")
    k2 = torch.randn(B, T, head_size)  # (B, T, hs)
    q2 = torch.randn(B, T, head_size)  # (B, T, hs)
    wei_scaled = q2 @ k2.transpose(-2, -1) * head_size**-0.5  # (B, T, T)
    w.value("(q @ k.transpose(-2, -1) * head_size**-0.5).var()", float(wei_scaled.var()), "its 1.1445: about 1")
    w.say(
        "Each score is a sum of 16 products of independent unit-variance numbers, so its variance "
        "is 16 (= d_k); multiplying by 1/sqrt(16) = 0.25 divides the variance by 16. 256 scores "
        "are a small sample, so the digits vary from draw to draw (a bare "
        "torch.manual_seed(1337) before k and q gives other ones). A larger draw (2000 x 8 x 8 "
        "scores):"
    )
    k_big = torch.randn(2000, T, head_size)
    q_big = torch.randn(2000, T, head_size)
    wei_big = q_big @ k_big.transpose(-2, -1)  # (2000, T, T)
    var_big = wei_big.var()
    var_big_scaled = (wei_big * head_size**-0.5).var()
    w.value("unscaled variance", float(var_big))
    w.value("scaled variance", float(var_big_scaled))

    logits = torch.tensor([0.1, -0.2, 0.3, -0.2, 0.5])
    diffuse = torch.softmax(logits, dim=-1)  # (5,)
    sharp = torch.softmax(logits * 8, dim=-1)  # (5,)
    w.show("torch.softmax(torch.tensor([0.1, -0.2, 0.3, -0.2, 0.5]), dim=-1)", diffuse, "diffuse")
    w.show(
        "torch.softmax(torch.tensor([0.1, -0.2, 0.3, -0.2, 0.5]) * 8, dim=-1)",
        sharp,
        "the same scores x 8: softmax turns towards a one-hot on the largest",
    )
    w.say(
        "x 8 is exactly what skipping the scaling does to a head of size 64 (GPT-2's head_dim): "
        "unscaled scores have 8 = sqrt(64) times the spread. At initialisation each token would "
        "then take its information from a single other token, and the softmax's gradients "
        "vanish. attnlab.scaled_dot_product_attention scales by 1/sqrt(E) unless told otherwise."
    )

    # The GPT-style guide divides twice. It prints no numbers and seeds nothing, so the weights
    # of "A simple self-attention mechanism" (seed 789) stand in.
    inputs = _inputs()
    torch.manual_seed(789)
    sa = SelfAttention_v2(3, 2)
    queries, keys, values = sa.W_query(inputs), sa.W_key(inputs), sa.W_value(inputs)  # (6, 2) each
    d_k = keys.shape[-1]
    _, right = scaled_dot_product_attention(queries, keys, values, is_causal=True, return_weights=True)
    attn_scores = queries @ keys.T / d_k**0.5  # (6, 6): the guide's first division
    mask = torch.triu(torch.ones(6, 6), diagonal=1).bool()
    attn_scores = attn_scores.masked_fill(mask, -torch.inf)
    twice = torch.softmax(attn_scores / d_k**0.5, dim=1)  # (6, 6): and its second
    w.bug(
        GPT_GUIDE,
        "its step-by-step code scales the scores twice: `attn_scores = queries @ keys.T / "
        "keys.shape[-1]**0.5`, then, after masking, `torch.softmax(attn_scores / "
        "keys.shape[-1]**0.5, dim=1)`. That divides by d_k instead of sqrt(d_k): the scores end up "
        "sqrt(d_k) times too small (8 times for GPT-2's head size 64), the weights too flat. Its "
        "classes scale once, "
        "correctly. With the seed-789 weights of " + SIMPLE + " (the guide seeds nothing):",
    )
    w.show("the guide's steps (divided by d_k = 2)", twice, "flatter than they should be")
    w.show("attnlab (divided by sqrt(d_k) once)", right, "the tutorials' causal weights")
    w.check(
        "the guide's == scale=1/d_k",
        twice,
        scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=1 / d_k, return_weights=True)[1],
    )

    # The attention-review CausalAttention reads a global d_out (100 when its Exercise 4 runs).
    torch.manual_seed(123)
    review = tc.CausalAttentionReview(3, 768, 6)
    x = inputs.unsqueeze(0)  # (1, 6, 3)
    review_out = review(x, d_out=100)  # (1, 6, 768): scaled by 1/sqrt(100), as in the notebook
    queries, keys, values = review.W_query(x), review.W_key(x), review.W_value(x)  # (1, 6, 768) each
    _, weights_global = scaled_dot_product_attention(
        queries, keys, values, is_causal=True, scale=1 / 10, return_weights=True
    )
    right_out, weights_right = scaled_dot_product_attention(queries, keys, values, is_causal=True, return_weights=True)
    w.bug(
        REVIEW,
        "its CausalAttention (Exercise 3) divides by `d_out ** 0.5` where d_out is a GLOBAL, not "
        "self.d_out. When Exercise 4 builds CausalAttention(512, 768, ...), the global d_out is "
        "still 100 from Exercise 2, so it scales by 1/10 instead of 1/sqrt(768) = 0.0361. Its "
        "MultiHeadAttentionOneModule uses self.d_head, correctly. Here with d_in=3, d_out=768 "
        "(seed 123) on the six words:",
    )
    w.check("the exercise's output == scale 1/10", review_out, weights_global @ values)
    w.show("last row of its weights (scale 1/10)", weights_global[0, -1], "too sharp")
    w.show("the same row, scale 1/sqrt(768)", weights_right[0, -1], "what d_out=768 should give")
    return {
        "var_k": k.var(),
        "var_q": q.var(),
        "var_scores": wei.var(),
        "var_scores_scaled": wei_scaled.var(),
        "var_big": var_big,
        "var_big_scaled": var_big_scaled,
        "softmax_diffuse": diffuse,
        "softmax_sharp": sharp,
        "guide_twice": twice,
        "guide_right": right,
        "review_global": review_out,
        "review_right": right_out,
    }


@lesson(
    "causal",
    "causal masks both ways: renormalise, or -inf before softmax",
    headline="hide the future: two ways, one result",
    tutorial=SIMPLE,
    section="Causal attention AKA masked attention",
)
def causal(w: Walk) -> dict[str, Tensor]:
    inputs = _inputs()
    w.step("torch.manual_seed(789); sa_v2 = SelfAttention_v2(3, 2)")
    torch.manual_seed(789)
    sa_v2 = SelfAttention_v2(3, 2)
    queries, keys, values = sa_v2.W_query(inputs), sa_v2.W_key(inputs), sa_v2.W_value(inputs)  # (6, 2)
    scores = queries @ keys.T  # (6, 6)
    d_k = keys.shape[-1]
    weights = torch.softmax(scores / d_k**0.5, dim=-1)  # (6, 6)
    w.show("attn_weights", weights, "unmasked: every word attends to all six, later ones too")

    w.say("Way 1: softmax first, then zero the future and renormalise each row.")
    mask_simple = torch.tril(torch.ones(6, 6))  # (6, 6) 1 = keep
    w.show("mask_simple = torch.tril(torch.ones(6, 6))", mask_simple, "1 on and below the diagonal")
    masked_simple = weights * mask_simple
    w.show(
        "masked_simple = attn_weights * mask_simple", masked_simple, "future weights zeroed; rows no longer sum to 1"
    )
    renormalised = masked_simple / masked_simple.sum(dim=-1, keepdim=True)
    w.show("masked_simple / row sums", renormalised, "renormalised so every row sums to 1 again")

    w.say("Way 2: set the future scores to -inf, then softmax (exp(-inf) = 0).")
    mask = torch.triu(torch.ones(6, 6), diagonal=1)  # (6, 6) 1 = hide
    masked = scores.masked_fill(mask.bool(), -torch.inf)
    w.show("masked = attn_scores.masked_fill(mask.bool(), -torch.inf)", masked, "future scores -> -inf")
    weights_inf = torch.softmax(masked / d_k**0.5, dim=1)
    w.show("torch.softmax(masked / sqrt(d_k), dim=1)", weights_inf, "the causal attention weights")
    w.check("way 1 == way 2", renormalised, weights_inf)
    w.say(
        "They agree because softmax followed by renormalising over the kept keys is "
        "exp(s_j) / sum over kept k of exp(s_k), which is what softmax over the -inf-masked row "
        "computes directly, in one pass and without a wasted normalisation."
    )

    w.step("out, w = attnlab.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)")
    out, weights_lib = scaled_dot_product_attention(queries, keys, values, is_causal=True, return_weights=True)
    w.show("attnlab.causal_mask(6)", causal_mask(6), "attnlab's mask: True = may attend (the opposite of triu)")
    w.check("attnlab's weights == way 2", weights_lib, weights_inf)
    w.show("attn_weights @ values (sa_v2's values)", out, "each word mixes only itself and earlier words")
    torch.manual_seed(123)
    values_v1 = inputs @ SelfAttention_v1(3, 2).W_value  # (6, 2): the values of the trainable lesson
    stale = weights_inf @ values_v1  # (6, 2)
    w.bug(
        SIMPLE,
        "its `context_vec = attn_weights @ values` uses a `values` that its causal section never "
        "computes (it projects only queries and keys with sa_v2). The context vectors it prints are "
        "the seed-789 causal weights times the values of SelfAttention_v1 (seed 123), left over "
        "from earlier: two different models mixed. Its first printed row is v1's first value "
        "vector, since word 0 attends only to itself:",
    )
    w.show("attn_weights @ (inputs @ sa_v1.W_value)", stale, "what the tutorial prints")
    w.say("The consistent result is the one above, with sa_v2.W_value(inputs) as the values.")

    w.say(f"The same two ways in {REVIEW} (Exercises 1 and 2, d_out = 100):")
    qkt = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    tril = torch.tril(torch.ones(3, 3))
    after = torch.softmax(qkt / 100**0.5, dim=-1) * tril
    after = after / after.sum(dim=-1, keepdim=True)
    before = torch.softmax(qkt.masked_fill(tril == 0, float("-inf")) / 100**0.5, dim=-1)
    w.show("Exercise 1: mask after softmax, renormalise", after, "")
    w.show("Exercise 2: -inf before softmax", before, "")
    w.check("Exercise 1 == Exercise 2", after, before)

    w.say(
        f"And in {ONE_HEAD}: torch.manual_seed(1337); x = torch.randn(4, 8, 32); key and query "
        "are nn.Linear(32, 16, bias=False); its first head does not scale yet (scale=1.0) and "
        "attends over x itself."
    )
    torch.manual_seed(1337)
    x = torch.randn(4, 8, 32)  # (B, T, C)
    key = nn.Linear(32, 16, bias=False)
    query = nn.Linear(32, 16, bias=False)
    k, q = key(x), query(x)  # (B, T, 16) each
    wei_raw = q @ k.transpose(-2, -1)  # (B, T, T)
    w.show("wei[0] = (q @ k.transpose(-2, -1))[0]", wei_raw[0], "raw affinities of batch element 0")
    head_out, wei = scaled_dot_product_attention(q, k, x, is_causal=True, scale=1.0, return_weights=True)
    w.show(
        "wei[0] after masked_fill(tril == 0, -inf) and softmax",
        wei[0],
        "attnlab: sdpa(q, k, x, is_causal=True, scale=1.0); row t mixes tokens 0..t",
    )
    w.value("out.shape", str(tuple(head_out.shape)), "wei @ x")
    w.say(
        f"A naming note on {GPT_GUIDE}: its CausalAttention calls the key projection W_keys (used "
        "consistently, so it runs; but its state dict has 'W_keys.weight' where the other "
        "tutorials and attnlab have 'W_key.weight', so weights do not load across), and its text "
        "says the class inherits from SelfAttention while the code subclasses nn.Module."
    )
    return {
        "weights": weights,
        "scores_masked": masked,
        "renormalised": renormalised,
        "mask_simple": mask_simple,
        "masked_simple": masked_simple,
        "weights_causal": weights_inf,
        "weights_attnlab": weights_lib,
        "context": out,
        "context_tutorial": stale,
        "review_after": after,
        "review_before": before,
        "head_wei_raw": wei_raw[0],
        "head_wei": wei[0],
    }


@lesson(
    "dropout",
    "nn.Dropout(0.5) on ones and on the attention weights",
    headline="dropping attention weights while training",
    tutorial=SIMPLE,
    section="Masking additional attention weights with dropout",
)
def dropout(w: Walk) -> dict[str, Tensor]:
    inputs = _inputs()
    torch.manual_seed(789)
    sa_v2 = SelfAttention_v2(3, 2)
    queries, keys, values = sa_v2.W_query(inputs), sa_v2.W_key(inputs), sa_v2.W_value(inputs)
    _, weights = scaled_dot_product_attention(queries, keys, values, is_causal=True, return_weights=True)
    w.show("attn_weights", weights, "the causal weights of the causal lesson")

    w.step("torch.manual_seed(123); dropout = torch.nn.Dropout(0.5); dropout(torch.ones(6, 6))")
    torch.manual_seed(123)
    drop = nn.Dropout(0.5)
    on_ones = drop(torch.ones(6, 6))
    w.show("dropout(example)", on_ones, "about half zeroed; survivors scaled by 1/(1 - 0.5) = 2")
    w.value("zeroed", int((on_ones == 0).sum()), "of 36")
    w.step("torch.manual_seed(123); dropout(attn_weights)")
    torch.manual_seed(123)
    on_weights = drop(weights)
    w.show("dropout(attn_weights)", on_weights, "the same mask (same seed, same shape) on the weights")
    w.check("== attn_weights * dropout(ones)", on_weights, weights * on_ones)
    w.say(
        f"Note: the tutorial's printed dropout mask (first row all 2s) does not reproduce here, on "
        f"the CPU with torch {torch.__version__}: dropout draws from the random-number generator, "
        "whose stream differs between devices and torch versions. What carries over: about half "
        "the entries are zeroed and the kept ones are doubled. Its two prints share one mask, as "
        f"here: its 0.8966 is 2 x {float(weights[1, 1]):.4f}."
    )
    w.step("torch.manual_seed(123); attnlab.scaled_dot_product_attention(..., dropout_p=0.5, return_weights=True)")
    torch.manual_seed(123)
    _, weights_lib = scaled_dot_product_attention(
        queries, keys, values, is_causal=True, dropout_p=0.5, return_weights=True
    )
    w.check("attnlab's dropped weights == dropout(attn_weights)", weights_lib, on_weights)
    torch.manual_seed(789)
    ca = CausalAttention(3, 2, 6, dropout=0.5)  # the seed-789 weights, with dropout 0.5
    ca.eval()
    w.check(
        "CausalAttention(3, 2, 6, dropout=0.5).eval() == no dropout",
        ca(inputs),
        scaled_dot_product_attention(queries, keys, values, is_causal=True),
    )
    w.say(
        "Dropout is for training only: attnlab's modules apply it in .train() mode (the default "
        "of a new module) and skip it after .eval(), so evaluation gives the same result every time."
    )

    torch.manual_seed(123)
    kept = nn.Dropout(p=0.1)(torch.ones(1000))
    survivor = float(kept.max())
    w.bug(
        GPT_GUIDE,
        "its text says nn.Dropout(p=0.1) increases the remaining values 'by 10%'. They are "
        f"multiplied by 1/(1 - 0.1) = {survivor:.4f}, i.e. by 11.1%, which keeps the expected "
        "value of every weight unchanged.",
    )
    w.value("nn.Dropout(p=0.1)(torch.ones(1000)).max()", survivor)
    return {"ones": on_ones, "weights": weights, "dropped": on_weights, "dropped_attnlab": weights_lib}


@lesson(
    "multi-head",
    "multi-head as a stack of heads and as a weight split",
    headline="several heads: a stack, then a split",
    tutorial=SIMPLE,
    section="Multi-head attention",
)
def multi_head(w: Walk) -> dict[str, Tensor]:
    inputs = _inputs()
    batch = torch.stack((inputs, inputs), dim=0)  # (2, 6, 3)
    w.value("batch.shape", str(tuple(batch.shape)), "two copies of the six words")

    w.step("torch.manual_seed(123); mha = attnlab.MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)")
    torch.manual_seed(123)
    wrapper = MultiHeadAttentionWrapper(3, 2, 6, 0.0, num_heads=2)
    stacked = wrapper(batch)  # (2, 6, 4)
    w.show("mha(batch)", stacked, "two CausalAttention heads of width 2 side by side: 2 x 2 = 4 wide")
    per_head = torch.cat([head(batch) for head in wrapper.heads], dim=-1)  # (2, 6, 4)
    w.check("== torch.cat([head(batch) for head in mha.heads], dim=-1)", stacked, per_head)
    w.say("attnlab runs the heads in one fused call on their stacked weights; same numbers.")

    w.step("torch.manual_seed(123); mha = attnlab.MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)")
    torch.manual_seed(123)
    mha = MultiHeadAttention(3, 2, 6, 0.0, num_heads=2)
    b, n = batch.shape[:2]
    q = mha.W_query(batch)  # (2, 6, 2)
    w.show("queries = W_query(batch)", q, "ONE projection to d_out = 2 ...")
    q_heads = q.view(b, n, mha.num_heads, mha.head_dim).transpose(1, 2)  # (2, H, 6, hd)
    w.show(
        ".view(b, n, 2, 1).transpose(1, 2)",
        q_heads[0],
        "... split into 2 heads of head_dim = 1 (batch element 0 shown): heads before tokens",
    )
    split, head_weights = mha(batch, return_weights=True)  # (2, 6, 2), (2, 2, 6, 6)
    w.show("attention weights, batch 0", head_weights[0], "one causal (6, 6) matrix per head")
    w.show("mha(batch)", split, "heads concatenated back to width 2, then out_proj mixes them")
    k = mha.W_key(batch).view(b, n, 2, 1).transpose(1, 2)  # (2, H, 6, hd)
    v = mha.W_value(batch).view(b, n, 2, 1).transpose(1, 2)  # (2, H, 6, hd)
    heads = [
        scaled_dot_product_attention(q_heads[:, h], k[:, h], v[:, h], is_causal=True) for h in range(2)
    ]  # each (2, 6, 1)
    w.check("== out_proj(cat of each head on its own)", split, mha.out_proj(torch.cat(heads, dim=-1)))
    w.say(
        "The wrapper makes num_heads separate modules of width d_out each; the split class makes "
        "one projection of width d_out and cuts it into num_heads slices of d_out // num_heads, "
        "plus an output projection. Different models (4 vs 2 wide), the same idea."
    )
    return {"wrapper": stacked, "mha": split, "mha_weights": head_weights}


@lesson(
    "batched-matmul",
    "a @ a.transpose(2, 3): every head's matrix product at once",
    headline="one matmul for all heads",
    tutorial=SIMPLE,
    section="Implementing multi-head attention with weight splits",
)
def batched_matmul(w: Walk) -> dict[str, Tensor]:
    a = torch.tensor(
        [
            [
                [[0.2745, 0.6584, 0.2775, 0.8573], [0.8993, 0.0390, 0.9268, 0.7388], [0.7179, 0.7058, 0.9156, 0.4340]],
                [[0.0772, 0.3565, 0.1479, 0.5331], [0.4066, 0.2318, 0.4545, 0.9737], [0.4606, 0.5159, 0.4220, 0.5786]],
            ]
        ]
    )  # (b, num_heads, num_tokens, head_dim) = (1, 2, 3, 4)
    w.show("a", a, "(b, num_heads, num_tokens, head_dim) = (1, 2, 3, 4)")
    scores = a @ a.transpose(2, 3)  # (1, 2, 3, 3)
    w.show("a @ a.transpose(2, 3)", scores, "@ multiplies the last two dims; the leading (b, heads) ride along")
    first = a[0, 0] @ a[0, 0].T  # (3, 3)
    second = a[0, 1] @ a[0, 1].T  # (3, 3)
    w.show("first_head = a[0, 0] @ a[0, 0].T", first, "head 0 on its own")
    w.show("second_head = a[0, 1] @ a[0, 1].T", second, "head 1 on its own")
    w.check("batched == per head", scores[0], torch.stack([first, second]))
    w.say(
        "This is queries @ keys.transpose(2, 3) in MultiHeadAttention: after the transpose to "
        "(b, heads, tokens, head_dim) one batched matmul scores every head of every sequence."
    )
    _, weights = scaled_dot_product_attention(a, a, a, scale=1.0, return_weights=True)  # (1, 2, 3, 3)
    w.check("attnlab (scale=1.0) weights == softmax(a @ a.T)", weights, torch.softmax(scores, dim=-1))
    return {"a": a, "scores": scores, "first_head": first, "second_head": second}


@lesson(
    "cross-attention",
    "queries from one sequence, keys and values from another",
    headline="attending to another sequence",
    tutorial=ONE_HEAD,
    section="Notes: self-attention and cross-attention",
)
def cross_attention(w: Walk) -> dict[str, Tensor]:
    w.say(
        "Self-attention takes queries, keys and values from the same x. In cross-attention (an "
        "encoder-decoder transformer) the queries come from x, the keys and values from a separate "
        "source, e.g. an encoder's output. " + IMPLEMENT + " ends by announcing it. The tutorials "
        "print no numbers for it, so these are attnlab's own (seed 123)."
    )
    x = _inputs()  # (6, 3)
    w.step(
        "torch.manual_seed(123); mha = attnlab.MultiHeadAttention(d_in=3, d_out=4, "
        "context_length=6, dropout=0.0, num_heads=2, kv_dim=5)"
    )
    torch.manual_seed(123)
    mha = MultiHeadAttention(d_in=3, d_out=4, context_length=6, dropout=0.0, num_heads=2, kv_dim=5)
    source = torch.rand(4, 5)  # (m, kv_dim): a 4-token source sequence, 5 wide
    w.show("source = torch.rand(4, 5)", source, "the other sequence: 4 tokens of width kv_dim = 5")
    w.show("W_key.weight", mha.W_key.weight, "keys and values project from width 5 to d_out = 4")
    out, weights = mha(x, source, return_weights=True)  # (6, 4), (2, 6, 4)
    w.show(
        "weights (mha(x, source, return_weights=True))",
        weights,
        "per head: 6 queries (the words) x 4 source tokens; no causal mask",
    )
    w.show("weights.sum(dim=-1)", weights.sum(dim=-1), "each query's row sums to 1")
    w.show("mha(x, source)", out, "one 4-d vector per word, built from the source's values")

    q = mha.W_query(x).view(6, 2, 2).transpose(0, 1)  # (H, 6, hd)
    k = mha.W_key(source).view(4, 2, 2).transpose(0, 1)  # (H, 4, hd)
    v = mha.W_value(source).view(4, 2, 2).transpose(0, 1)  # (H, 4, hd)
    manual_w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(2), dim=-1)  # (H, 6, 4)
    manual = mha.out_proj((manual_w @ v).transpose(0, 1).reshape(6, 4))  # (6, 4)
    w.check("== softmax(Q K^T / sqrt(2)) V by hand", out, manual)
    return {
        "x": x,
        "source": source,
        "out": out,
        "weights": weights,
        "W_query": mha.W_query.weight.detach().clone(),
        "W_key": mha.W_key.weight.detach().clone(),
        "W_value": mha.W_value.weight.detach().clone(),
        "W_out": mha.out_proj.weight.detach().clone(),
        "b_out": mha.out_proj.bias.detach().clone(),
    }


@lesson(
    "encoder-decoder",
    "encoder (causal=False) vs decoder (causal=True) attention",
    headline="every token talks to every token, or only to the past",
    tutorial=ONE_HEAD,
    section="Notes: encoder and decoder blocks",
)
def encoder_decoder(w: Walk) -> dict[str, Tensor]:
    w.say(
        "The tutorial: an encoder block (e.g. for sentiment analysis) deletes the line "
        "`wei = wei.masked_fill(tril == 0, float('-inf'))` so all tokens talk to each other; a "
        "decoder block keeps it, so the future never leaks into the past. In attnlab this is "
        "MultiHeadAttention(..., causal=False) or causal=True, with the same weights."
    )
    x = _inputs()  # (6, 3)
    torch.manual_seed(123)
    encoder = MultiHeadAttention(3, 2, 6, 0.0, num_heads=1, causal=False)
    decoder = MultiHeadAttention(3, 2, 6, 0.0, num_heads=1, causal=True)
    decoder.load_state_dict(encoder.state_dict())
    _, enc_w = encoder(x, return_weights=True)  # (1, 6, 6)
    _, dec_w = decoder(x, return_weights=True)  # (1, 6, 6)
    w.show("encoder weights (causal=False)", enc_w[0], f"full rows: {words_text()}")
    w.show("decoder weights (causal=True)", dec_w[0], "lower triangle: token t sees tokens 0..t")
    w.check("the last row is the same (the last token sees everything)", enc_w[0, -1], dec_w[0, -1])
    w.say(
        "Each decoder row is a softmax over fewer keys: row t is the encoder's row t cut to tokens "
        "0..t and renormalised (way 1 of the causal lesson)."
    )
    restricted = enc_w[0] * torch.tril(torch.ones(6, 6))
    w.check(
        "decoder == encoder rows cut to 0..t, renormalised", dec_w[0], restricted / restricted.sum(-1, keepdim=True)
    )
    return {"encoder": enc_w[0], "decoder": dec_w[0]}


# GPT-2's published sizes: (layers, d_model, heads). Context 1024, vocabulary 50257.
GPT2_SIZES = {
    "gpt2 (small)": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-large": (36, 1280, 20),
    "gpt2-xl": (48, 1600, 25),
}
GPT2_VOCAB, GPT2_CONTEXT = 50257, 1024


def count_parameters(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


def _meta_embedding(num: int, dim: int) -> nn.Embedding:
    # Handing over the (meta) weight skips the random init: a normal_ on the meta device costs
    # seconds the first time (torch loads its reference decompositions), and shapes are all we need.
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim, device="meta"))


def gpt2_parameter_counts(n_layer: int, d_model: int, n_head: int, *, tied: bool = True) -> dict[str, int]:
    """Parameter counts of a GPT-2-shaped model, counted from modules built on the meta device.

    One block is LayerNorm, attention (attnlab's :class:`MultiHeadAttention` with biases, as GPT-2
    has), LayerNorm, and an MLP ``d -> 4d -> d``; around the blocks: token and position
    embeddings and a final LayerNorm. ``tied`` shares the output layer with the token embedding
    (as GPT-2 does). Nothing is allocated: meta tensors have shapes only.
    """
    with torch.device("meta"):
        attn = MultiHeadAttention(d_model, d_model, GPT2_CONTEXT, 0.0, n_head, qkv_bias=True)
        mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        block = count_parameters(nn.LayerNorm(d_model), attn, nn.LayerNorm(d_model), mlp)
        embeddings = count_parameters(_meta_embedding(GPT2_VOCAB, d_model), _meta_embedding(GPT2_CONTEXT, d_model))
        final_norm = count_parameters(nn.LayerNorm(d_model))
        head = 0 if tied else count_parameters(nn.Linear(d_model, GPT2_VOCAB, bias=False))
    return {
        "attention": count_parameters(attn),
        "block": block,
        "total": embeddings + n_layer * block + final_norm + head,
    }


@lesson(
    "gpt2-sizes",
    "GPT-2 small..xl: heads, head_dim, parameter counts",
    headline="attention at GPT-2 scale",
    tutorial=GPT_GUIDE,
    section="The GPT Architecture: Harnessing the Power of Multi-Head Attention",
)
def gpt2_sizes(w: Walk) -> dict[str, Tensor]:
    w.say(
        "Counted from modules built on torch.device('meta') (shapes, no memory): one attention "
        "layer is attnlab's MultiHeadAttention(d, d, 1024, 0.0, heads, qkv_bias=True): "
        "W_query, W_key, W_value and out_proj, each d x d plus a bias: 4d^2 + 4d."
    )
    header = f"{'model':<13}{'layers':>7}{'d_model':>8}{'heads':>6}{'head_dim':>9}{'attention':>12}{'total':>16}"
    w.line()
    w.line(header)
    rows = []
    for name, (n_layer, d, heads) in GPT2_SIZES.items():
        counts = gpt2_parameter_counts(n_layer, d, heads)
        rows.append([n_layer, d, heads, d // heads, counts["attention"], counts["total"]])
        w.line(f"{name:<13}{n_layer:>7}{d:>8}{heads:>6}{d // heads:>9}{counts['attention']:>12,}{counts['total']:>16,}")
    small = rows[0]
    untied = gpt2_parameter_counts(12, 768, 12, tied=False)["total"]
    w.say(
        "head_dim = d_model / heads is 64 in every size. 'total' is the whole model with the output "
        f"layer tied to the token embedding (as GPT-2 ships); untied, small would have {untied:,}."
    )
    w.say(
        f"The guide gives the smallest GPT-2 '117 million' parameters and the largest '1.5 "
        f"billion'. 117M is the size the GPT-2 paper states for its smallest model; counting "
        f"the modules of that architecture gives {small[5]:,} (about 124M). For xl the count is "
        f"{rows[-1][5]:,}, about 1.56 billion."
    )

    w.say("The guide's GPT-2 snippet, for the smallest size:")
    w.step("batch = torch.rand(2, 1024, 768)")
    w.step("mha = MultiHeadAttention(d_in, d_out, num_heads, context_length, 0.0)")
    try:
        MultiHeadAttention(768, 768, 12, 1024, 0.0)  # the guide's positional order
        order_error = "no error"
    except (TypeError, ValueError) as exc:
        # The first clause is enough here; attnlab's message goes on to show the keyword form.
        order_error = f"{type(exc).__name__}: {str(exc).split(' (', 1)[0]}"
    w.say(
        "The guide puts num_heads third; attnlab keeps the order of " + SIMPLE + " (d_in, d_out, "
        f"context_length, dropout, num_heads), so the guide's positional call (context_length=12, "
        f"dropout=1024, num_heads=0.0) is refused with a hint to pass keywords: {order_error}."
    )
    w.step("MultiHeadAttention(d_in=768, d_out=768, num_heads=12, context_length=1024, dropout=0.0)")
    with torch.device("meta"):  # shapes only: no memory, no random init cost
        mha = MultiHeadAttention(d_in=768, d_out=768, num_heads=12, context_length=1024, dropout=0.0)
        mha_biased = MultiHeadAttention(768, 768, 1024, 0.0, num_heads=12, qkv_bias=True)
    w.value("parameters", count_parameters(mha), "4 x 768 x 768 + 768: attnlab's default qkv_bias=False")
    w.say(
        "The guide's class builds nn.Linear(d_in, d_out) with the default bias=True for queries, "
        f"keys and values as well: that is qkv_bias=True, {count_parameters(mha_biased):,} parameters (GPT-2's "
        "attention also has these biases)."
    )
    w.say(
        f"Its heads: {mha.num_heads} of head_dim {mha.head_dim}. On batch (2, 1024, 768) it returns "
        "context_vecs of shape (2, 1024, 768): d_out = d_in, so attention blocks can be stacked."
    )

    torch.manual_seed(0)
    tiny = tc.BadLM_V2(context_length=4, vocab_size=10, emb_dim=6, att_dim=6, num_heads=3)
    tiny_shape = tuple(tiny.pos_embs.weight.shape)  # (vocab_size, emb_dim), not (context_length, ...)
    pos_params = GPT2_VOCAB * 768  # the same table at the exercise's vocab_size=50257, emb_dim=768
    try:
        tiny(torch.zeros(1, 3, dtype=torch.long))
        short_error = "no error"
    except RuntimeError as exc:
        short_error = f"RuntimeError: {exc}"
    w.bug(
        REVIEW,
        "BadLM_V2 sizes its position embedding by the vocabulary: `nn.Embedding(vocab_size, "
        f"emb_dim)` (attnlab's small demo copy, context_length=4, vocab_size=10, emb_dim=6, gets a table of "
        f"shape {tiny_shape}). "
        f"At the exercise's sizes that is {GPT2_VOCAB:,} x 768 = {pos_params:,} parameters, when only "
        "context_length x "
        f"768 = {4 * 768:,} are ever used (GPT-2's table is 1024 x 768 = {GPT2_CONTEXT * 768:,}). "
        "It should be nn.Embedding(context_length, emb_dim), indexed by "
        "torch.arange(num_tokens): its forward adds pos_embs(torch.arange(self.context_length)), so "
        f"a shorter input fails ({short_error}).",
    )
    counts_table = torch.tensor(rows, dtype=torch.int64)
    return {
        "table": counts_table,
        "untied_small": torch.tensor(untied),
        "bad_pos_params": torch.tensor(pos_params),
        "bad_pos_shape": torch.tensor(tiny_shape),
    }
