"""The steps of each tutorial that the first lessons (:mod:`~attnlab.tools.explain.lessons`) leave
out, so that ``attnlab explain --tutorial NAME`` walks a tutorial from its first cell to its last.

Each lesson follows one section of one tutorial, computes its cells with attnlab (the tutorial's
own variant of a class, from :mod:`attnlab.tutorials`, where attnlab's main classes differ), prints
every tensor it prints (whole, not only a first row) and flags the tutorial's mistakes in notes
marked "Tutorial bug", with the right result.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch import Tensor

from attnlab import tutorial_code as tc
from attnlab.attention import CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper, SelfAttention_v2
from attnlab.data import TokenWindowDataset, create_dataloader
from attnlab.functional import causal_mask, scaled_dot_product_attention, simple_self_attention
from attnlab.tokenizers import ByteTokenizer, GPT2Tokenizer, TokenizerLoadError
from attnlab.tools.explain.lessons import count_parameters, implement_tensors, words_text
from attnlab.tools.explain.registry import GPT_GUIDE, IMPLEMENT, ONE_HEAD, REVIEW, SIMPLE, lesson
from attnlab.tools.explain.walk import Walk
from attnlab.tutorials import attention_review, gpt_style, implement, one_head

__all__ = ["CONCEPT_QUESTIONS", "REVIEW_TEXT"]


# ============================================================================================
# "A simple self-attention mechanism"
# ============================================================================================
@lesson(
    "causal-class",
    "CausalAttention on a batch of two texts",
    headline="a compact causal attention class",
    tutorial=SIMPLE,
    section="Implementing a compact causal attention class",
)
def causal_class(w: Walk) -> dict[str, Tensor]:
    inputs = tc.INPUTS.clone()  # (6, 3)
    batch = torch.stack((inputs, inputs), dim=0)  # (2, 6, 3)
    w.show("batch = torch.stack((inputs, inputs), dim=0)", batch, "two texts of six tokens, each token 3-d")
    w.step("torch.manual_seed(123); ca = attnlab.CausalAttention(d_in=3, d_out=2, context_length=6, dropout=0.0)")
    torch.manual_seed(123)
    ca = CausalAttention(3, 2, 6, 0.0)
    context_vecs, weights = ca(batch, return_weights=True)  # (2, 6, 2), (2, 6, 6)
    w.show("weights (ca(batch, return_weights=True))", weights[0], "text 0: causal, each row sums to 1")
    w.show("context_vecs = ca(batch)", context_vecs, "each token is now a 2-d context vector")
    torch.manual_seed(123)
    theirs = tc.CausalAttention(3, 2, 6, 0.0)
    w.check("== the tutorial's class under the same seed", context_vecs, theirs(batch))
    w.say(
        "The tutorial keeps a (context_length, context_length) mask buffer and slices it to the "
        "input's length, mask[:num_tokens, :num_tokens]; attnlab builds the mask for each input (or "
        "lets the fused kernel apply it). A text shorter than context_length works either way, and "
        "its rows are the first rows of the longer text's, since token t sees only tokens 0..t:"
    )
    short = ca(batch[:, :4])  # (2, 4, 2)
    w.check("ca(batch[:, :4]) == context_vecs[:, :4]", short, context_vecs[:, :4])
    return {"batch": batch, "context_vecs": context_vecs, "weights": weights}


# ============================================================================================
# "Implement the Self-Attention Mechanism in PyTorch"
# ============================================================================================
def implement_setup() -> dict[str, object]:
    """The tutorial's setup under its ``torch.manual_seed(42)``, with its weights created by
    :mod:`attnlab.tutorials.implement`'s modules in its order (embedding, W_q, W_k, W_v, then the
    three heads' stacks)."""
    torch.manual_seed(42)
    sentence = "Life is short, eat dessert first is life".lower().replace(",", "").split()
    dict_words = {word: idx for idx, word in enumerate(sorted(sentence))}  # the tutorial's, as written
    sentence_ints = torch.tensor([dict_words[word] for word in sentence])  # (8,)
    embedding_layer = nn.Embedding(len(sentence), 16)
    embedded = embedding_layer(sentence_ints).detach()  # (8, 16)
    single = implement.SelfAttention(d_in=16, d_q=24, d_k=24, d_v=28)
    heads = implement.MultiHeadSelfAttention(d_in=16, d_q=24, d_k=24, d_v=28, num_heads=3)
    return {
        "sentence": sentence,
        "dict_words": dict_words,
        "sentence_ints": sentence_ints,
        "embedded": embedded,
        "single": single,
        "heads": heads,
    }


@lesson(
    "implement-qkv",
    "word ids, embeddings and separate 24/24/28-wide queries, keys, values",
    headline="queries, keys and values of different widths",
    tutorial=IMPLEMENT,
    section="Single head self-attention",
)
def implement_qkv(w: Walk) -> dict[str, Tensor]:
    s = implement_setup()
    sentence, dict_words = s["sentence"], s["dict_words"]
    embedded: Tensor = s["embedded"]  # type: ignore[assignment]
    attention: implement.SelfAttention = s["single"]  # type: ignore[assignment]
    w.say(f"torch.manual_seed(42); the sentence: {' '.join(sentence)}")  # type: ignore[arg-type]
    w.value("dict_words", str(dict_words), "its dictionary (see the softmax-dim lesson for its gaps)")
    w.show("sentence_ints", s["sentence_ints"], "each word's index")  # type: ignore[arg-type]
    w.show("embedded_sentence = nn.Embedding(8, 16)(sentence_ints)", embedded[:2], "rows 0 and 1 of (8, 16)")
    w.value("embedded_sentence.shape", str(tuple(embedded.shape)), "8 words, 16 numbers each")

    w.say(
        "Its weights are torch.rand matrices of shape (d, 16), applied as W @ x: queries and keys 24 "
        "wide (they are multiplied together, so their widths must match), values 28 wide. attnlab's "
        "classes have one width and nn.Linear's init; attnlab.tutorials.implement holds these:"
    )
    w.step("attention = attnlab.tutorials.implement.SelfAttention(d_in=16, d_q=24, d_k=24, d_v=28)")
    W_q, W_k, W_v = attention.W_q, attention.W_k, attention.W_v
    w.value("W_q, W_k, W_v shapes", f"{tuple(W_q.shape)}, {tuple(W_k.shape)}, {tuple(W_v.shape)}")
    theirs = implement_tensors()  # the tutorial's own torch.rand calls
    w.check(
        "W_q, W_k, W_v == the tutorial's torch.rand (same seed, same order)",
        torch.cat([W_q, W_k, W_v]),
        torch.cat([theirs["W_q"], theirs["W_k"], theirs["W_v"]]),
    )

    found: dict[str, Tensor] = {}
    for word_idx in (0, 1):
        x = embedded[word_idx]  # (16,)
        query, key, value = W_q @ x, W_k @ x, W_v @ x  # (24,), (24,), (28,)
        w.say(f"Word idx = {word_idx} ('{sentence[word_idx]}'): W @ x_{word_idx + 1} for each matrix")  # type: ignore[index]
        w.show(f"query_{word_idx + 1} = W_q @ x_{word_idx + 1}", query, "what this word looks for")
        w.value(f"key_{word_idx + 1}.shape, value_{word_idx + 1}.shape", f"{tuple(key.shape)}, {tuple(value.shape)}")
        found.update({f"query_{word_idx + 1}": query, f"key_{word_idx + 1}": key, f"value_{word_idx + 1}": value})

    queries = (W_q @ embedded.T).T  # (8, 24)
    keys = (W_k @ embedded.T).T  # (8, 24)
    values = (W_v @ embedded.T).T  # (8, 28)
    w.say("All words at once: (W @ embedded_sentence.T).T puts words on rows, components on columns.")
    w.value(
        "queries.shape, keys.shape, values.shape", f"{tuple(queries.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}"
    )
    w.check("== embedded_sentence @ W.T, as the module computes them", queries, embedded @ W_q.T)
    return {
        "dict_values": torch.tensor(list(dict_words.values())),  # type: ignore[union-attr]
        "sentence_ints": s["sentence_ints"],  # type: ignore[dict-item]
        "embedded": embedded,
        **found,
        "queries": queries,
        "keys": keys,
        "values": values,
    }


@lesson(
    "implement-all-words",
    "the whole 8x8 score and weight matrices and the 8x28 context matrix z",
    headline="every word against every word, printed whole",
    tutorial=IMPLEMENT,
    section="Compute unnormalized attention scores for ALL input words",
)
def implement_all_words(w: Walk) -> dict[str, Tensor]:
    s = implement_setup()
    embedded: Tensor = s["embedded"]  # type: ignore[assignment]
    attention: implement.SelfAttention = s["single"]  # type: ignore[assignment]
    queries, keys, values = embedded @ attention.W_q.T, embedded @ attention.W_k.T, embedded @ attention.W_v.T
    dim_k = keys.shape[-1]
    omega_all = queries @ keys.T  # (8, 8)
    w.show("omega_all = queries @ keys.T", omega_all, "row i: word i's query against every word's key")
    weights_dim0 = torch.softmax(omega_all / dim_k**0.5, dim=0)  # (8, 8): the tutorial's
    w.show(
        "F.softmax(omega_all / dim_k ** 0.5, dim=0)   # the tutorial's",
        weights_dim0,
        "dim=0: every COLUMN sums to 1 (Tutorial bug: see the softmax-dim lesson)",
    )
    w.value("its .sum().item()", float(weights_dim0.sum()), "the tutorial's 'Sum of this vector = 8.0'")
    context_dim0 = weights_dim0 @ values  # (8, 28)
    w.show("context_z = that @ values   # the tutorial's z", context_dim0, "rows mixed across queries")

    w.step("z, weights = attention(embedded_sentence, return_weights=True)   # attnlab: rows sum to 1")
    context, weights = attention(embedded, return_weights=True)  # (8, 28), (8, 8)
    w.show("weights", weights, "softmax over each query's row (dim=-1): what dim=0 should have been")
    w.show("weights.sum(dim=-1)", weights.sum(dim=-1), "every word's weights sum to 1")
    w.show("z", context, "each word's 28-d context vector: a weighted average of the values")
    w.check(
        "z[0] == the single-word context_vector_z_1",
        context[0],
        torch.softmax(omega_all[0] / dim_k**0.5, dim=0) @ values,
    )
    return {
        "omega_all": omega_all,
        "weights_dim0": weights_dim0,
        "context_dim0": context_dim0,
        "weights": weights,
        "context": context,
    }


@lesson(
    "implement-multi-head",
    "three heads with torch.bmm: stacked scores, weights and contexts, whole",
    headline="three heads at once with torch.bmm",
    tutorial=IMPLEMENT,
    section="Multi-head self-attention",
)
def implement_multi_head(w: Walk) -> dict[str, Tensor]:
    s = implement_setup()
    embedded: Tensor = s["embedded"]  # type: ignore[assignment]
    heads: implement.MultiHeadSelfAttention = s["heads"]  # type: ignore[assignment]
    w.step("heads = attnlab.tutorials.implement.MultiHeadSelfAttention(d_in=16, d_q=24, d_k=24, d_v=28, num_heads=3)")
    mh_W_q, mh_W_k, mh_W_v = heads.W_q, heads.W_k, heads.W_v  # (3, 24, 16), (3, 24, 16), (3, 28, 16)
    w.value("W_q, W_k, W_v shapes", f"{tuple(mh_W_q.shape)}, {tuple(mh_W_k.shape)}, {tuple(mh_W_v.shape)}")
    theirs = implement_tensors()["mh"]  # the tutorial's own torch.rand calls
    w.check("== the tutorial's multihead_W_query, _key, _value", torch.cat([mh_W_q, mh_W_k]), torch.cat(theirs[:2]))

    x_1 = embedded[0]  # (16,)
    query_1, key_1, value_1 = mh_W_q @ x_1, mh_W_k @ x_1, mh_W_v @ x_1  # (3, 24), (3, 24), (3, 28)
    w.show("multihead_query_1 = multihead_W_query @ x_1", query_1, "word 0: one 24-d query per head")
    w.value("multihead_key_1.shape, multihead_value_1.shape", f"{tuple(key_1.shape)}, {tuple(value_1.shape)}")
    w.bug(
        IMPLEMENT,
        "its text says 'Each query has now shape n_heads x dim_word_embedding', i.e. 3 x 16. A "
        f"query is W_q @ x, so its width is dim_q: the shape is n_heads x dim_q = {tuple(query_1.shape)}, "
        "as its own printed 'Multihead-query size = torch.Size([3, 24])' shows.",
    )

    repeated = embedded.T.repeat(3, 1, 1)  # (3, 16, 8)
    w.value("repeated_inputs = embedded_sentence.T.repeat(3, 1, 1)", str(tuple(repeated.shape)), "one copy per head")
    mh_q = torch.bmm(mh_W_q, repeated)  # (3, 24, 8)
    mh_k = torch.bmm(mh_W_k, repeated)  # (3, 24, 8)
    mh_v = torch.bmm(mh_W_v, repeated)  # (3, 28, 8)
    w.value("torch.bmm(W, repeated_inputs) shapes", f"{tuple(mh_q.shape)}, {tuple(mh_k.shape)}, {tuple(mh_v.shape)}")
    bmm = (mh_q, mh_k, mh_v)
    mh_q, mh_k, mh_v = (t.permute(0, 2, 1) for t in bmm)  # (3, 8, 24), (3, 8, 24), (3, 8, 28)
    w.value(
        ".permute(0, 2, 1) shapes", f"{tuple(mh_q.shape)}, {tuple(mh_k.shape)}, {tuple(mh_v.shape)}", "words on rows"
    )
    w.say("attnlab needs neither the copies nor bmm: x (8, 16) broadcasts against W (3, d, 16).")

    scores = torch.bmm(mh_q, mh_k.permute(0, 2, 1))  # (3, 8, 8)
    w.show("multihead_omega_all = torch.bmm(queries, keys.permute(0, 2, 1))", scores, "one 8x8 score matrix per head")
    dim_k = mh_k.shape[-1]
    weights_dim0 = torch.softmax(scores / dim_k**0.5, dim=0)  # (3, 8, 8): the tutorial's
    w.show(
        "F.softmax(multihead_omega_all / dim_k ** 0.5, dim=0)   # the tutorial's",
        weights_dim0,
        "dim=0 is now the HEADS axis (Tutorial bug: see the softmax-dim lesson)",
    )
    w.value("its .sum().item()", float(weights_dim0.sum()), "the tutorial's 64.0: 8 x 8 pairs, 1 each")
    context_dim0 = weights_dim0 @ mh_v  # (3, 8, 28)
    w.show("multihead_context_z = that @ values   # the tutorial's", context_dim0, "per head, 8 words x 28")

    w.step("z, weights = heads(embedded_sentence, return_weights=True)   # attnlab: rows sum to 1")
    context, weights = heads(embedded, return_weights=True)  # (3, 8, 28), (3, 8, 8)
    w.show("weights", weights, "each head's rows sum to 1")
    w.value("weights.sum().item()", float(weights.sum()), "3 heads x 8 rows")
    w.show("z", context, "one (8, 28) context matrix per head")
    w.check(
        "== softmax(scores / sqrt(24), dim=-1) @ values", context, torch.softmax(scores / dim_k**0.5, dim=-1) @ mh_v
    )
    return {
        "query_1": query_1,
        "key_1": key_1,
        "value_1": value_1,
        "repeated": repeated,
        "queries_bmm": bmm[0],
        "keys_bmm": bmm[1],
        "values_bmm": bmm[2],
        "queries": mh_q,
        "keys": mh_k,
        "values": mh_v,
        "scores": scores,
        "weights_dim0": weights_dim0,
        "context_dim0": context_dim0,
        "weights": weights,
        "context": context,
    }


# ============================================================================================
# "Implementing GPT-Style Attention: A Step-by-Step Guide with PyTorch"
# ============================================================================================
_GUIDE_SEED = 123  # the guide seeds nothing; this makes its steps repeatable


@lesson(
    "gpt-simplified",
    "the guide's simplified self-attention: softmax(x x^T) x",
    headline="self-attention without weights, three lines",
    tutorial=GPT_GUIDE,
    section="Simplified Self-Attention Mechanism",
)
def gpt_simplified(w: Walk) -> dict[str, Tensor]:
    inputs = tc.INPUTS.clone()  # (6, 3)
    w.say(f"The guide's inputs are those of {SIMPLE} ({words_text()}); it prints no numbers.")
    scores = inputs @ inputs.T  # (6, 6)
    w.show("attn_scores = inputs @ inputs.T", scores, "attn_scores[i][j]: dot product of tokens i and j")
    weights = torch.softmax(scores, dim=-1)  # (6, 6)
    w.show("attn_weights = torch.softmax(attn_scores, dim=-1)", weights, "how much token i attends to token j")
    context = weights @ inputs  # (6, 3)
    w.show("context_vecs = attn_weights @ inputs", context, "each row: a weighted sum of the inputs")
    w.check("== attnlab.simple_self_attention(inputs)", context, simple_self_attention(inputs))
    return {"scores": scores, "weights": weights, "context": context}


def _guide_projections(inputs: Tensor) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
    torch.manual_seed(_GUIDE_SEED)
    return nn.Linear(3, 2), nn.Linear(3, 2), nn.Linear(3, 2)  # W_query, W_key, W_value: bias=True


@lesson(
    "gpt-trainable",
    "the guide's biased nn.Linear projections, step by step, and its SelfAttention",
    headline="trainable, biased query/key/value projections",
    tutorial=GPT_GUIDE,
    section="Adding Trainable Weights to Self-Attention",
)
def gpt_trainable(w: Walk) -> dict[str, Tensor]:
    inputs = tc.INPUTS.clone()  # (6, 3)
    w.say(
        f"The guide seeds nothing, so its numbers are anyone's; here torch.manual_seed({_GUIDE_SEED}) "
        "before its three nn.Linear(d_in=3, d_out=2) layers, so you can repeat them."
    )
    W_query, W_key, W_value = _guide_projections(inputs)
    w.value("print(W_query)", repr(W_query), "nn.Linear's default bias=True")
    w.show("W_query.bias", W_query.bias, "added to every query: x @ W.T + b")
    queries, keys, values = W_query(inputs), W_key(inputs), W_value(inputs)  # (6, 2) each
    w.show("queries = W_query(inputs)", queries, "")
    w.show("keys = W_key(inputs)", keys, "")
    w.show("values = W_value(inputs)", values, "")
    scores = queries @ keys.T / keys.shape[-1] ** 0.5  # (6, 6)
    w.show("attn_scores = queries @ keys.T / keys.shape[-1]**0.5", scores, "scaled once, by sqrt(d_k) = sqrt(2)")
    weights = torch.softmax(scores, dim=-1)  # (6, 6)
    context = weights @ values  # (6, 2)
    w.show("torch.softmax(attn_scores, dim=-1) @ values", context, "the context vectors")

    w.step(f"torch.manual_seed({_GUIDE_SEED}); sa = attnlab.tutorials.gpt_style.SelfAttention(3, 2)")
    torch.manual_seed(_GUIDE_SEED)
    sa = gpt_style.SelfAttention(3, 2)
    w.check("sa(inputs) == the steps above (same seed, same order)", sa(inputs), context)
    torch.manual_seed(_GUIDE_SEED)
    w.check("== the guide's class", sa(inputs), tc.GuideSelfAttention(3, 2)(inputs))
    torch.manual_seed(_GUIDE_SEED)
    w.check(
        "== attnlab.SelfAttention_v2(3, 2, qkv_bias=True)", sa(inputs), SelfAttention_v2(3, 2, qkv_bias=True)(inputs)
    )
    torch.manual_seed(_GUIDE_SEED)
    unbiased = SelfAttention_v2(3, 2)(inputs)  # qkv_bias=False: other draws, no bias
    w.say(
        "attnlab's SelfAttention_v2 defaults to qkv_bias=False (as " + SIMPLE + "): without "
        "qkv_bias=True the guide's code builds a different model, max |difference| "
        f"{float((unbiased - context).abs().max()):.4f} here."
    )
    return {"queries": queries, "keys": keys, "values": values, "scores": scores, "context": context}


@lesson(
    "gpt-causal",
    "the guide's causal mask on its scaled scores, and its second scaling",
    headline="masking future tokens, step by step",
    tutorial=GPT_GUIDE,
    section="Causal Attention: Masking Future Tokens",
)
def gpt_causal(w: Walk) -> dict[str, Tensor]:
    inputs = tc.INPUTS.clone()
    W_query, W_key, W_value = _guide_projections(inputs)
    queries, keys, values = W_query(inputs), W_key(inputs), W_value(inputs)  # (6, 2) each
    attn_scores = queries @ keys.T / keys.shape[-1] ** 0.5  # (6, 6): already scaled (gpt-trainable)
    w.say(f"Continuing the gpt-trainable lesson (seed {_GUIDE_SEED}): attn_scores is already divided by sqrt(d_k).")
    mask = torch.triu(torch.ones(6, 6), diagonal=1).bool()  # (6, 6) True = hide
    w.show(
        "mask = create_mask(6)   # torch.triu(torch.ones(6, 6), diagonal=1).bool()",
        mask,
        "True above the diagonal: the future",
    )
    masked = attn_scores.masked_fill(mask, -torch.inf)
    w.show("attn_scores = attn_scores.masked_fill(mask, -torch.inf)", masked, "")
    twice = torch.softmax(masked / keys.shape[-1] ** 0.5, dim=1)  # (6, 6)
    w.show("torch.softmax(attn_scores / keys.shape[-1]**0.5, dim=1)   # the guide's", twice, "")
    right_out, right = scaled_dot_product_attention(queries, keys, values, is_causal=True, return_weights=True)
    w.bug(
        GPT_GUIDE,
        "attn_scores was already divided by sqrt(d_k) when it was computed; dividing again before "
        "the softmax scales by 1/d_k = 1/2 instead of 1/sqrt(2), which flattens the weights (the "
        "scaling lesson has the same with other weights). Its classes scale once. The right "
        "weights, scaled once:",
    )
    w.show("attnlab.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)", right, "")
    w.check(
        "the guide's == scale 1/d_k",
        twice,
        scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=0.5, return_weights=True)[1],
    )
    w.show("context vectors (right weights @ values)", right_out, "each token mixes itself and earlier ones")
    return {"mask": mask, "masked": masked, "twice": twice, "right": right, "right_context": right_out}


@lesson(
    "gpt-causal-class",
    "dropout(p=0.1), and the guide's CausalAttention: W_keys first, dropout=0.1 by default",
    headline="the guide's CausalAttention class",
    tutorial=GPT_GUIDE,
    section="Adding Dropout",
)
def gpt_causal_class(w: Walk) -> dict[str, Tensor]:
    inputs = tc.INPUTS.clone()
    batch = torch.stack((inputs, inputs))  # (2, 6, 3)
    weights = torch.full((6, 6), 1.0).tril() / torch.arange(1, 7).unsqueeze(1)  # uniform causal weights
    w.step(f"torch.manual_seed({_GUIDE_SEED}); dropout = nn.Dropout(p=0.1); attn_weights = dropout(attn_weights)")
    torch.manual_seed(_GUIDE_SEED)
    dropped = nn.Dropout(p=0.1)(weights)
    w.show("on uniform causal weights (row t: 1/(t+1))", dropped, "a few zeroed; the rest times 1/0.9")
    w.say(
        "The kept weights are multiplied by 1/(1 - 0.1) = 1.1111, not increased 'by 10%' as the "
        "guide's text says (the dropout lesson has the note)."
    )

    w.step(f"torch.manual_seed({_GUIDE_SEED}); guide = CausalAttention(3, 2, 6)   # the guide's class")
    torch.manual_seed(_GUIDE_SEED)
    guide = tc.GuideCausalAttention(3, 2, 6)
    torch.manual_seed(_GUIDE_SEED)
    ours = CausalAttention(3, 2, 6)
    w.bug(
        GPT_GUIDE,
        "its CausalAttention creates its key projection, W_keys, BEFORE W_query (the other "
        "tutorials and attnlab: W_query, W_key, W_value). Under the same seed, attnlab's "
        "CausalAttention gets the guide's key weights as its query weights, and other numbers:",
    )
    w.check("attnlab's W_query == the guide's W_keys", ours.W_query.weight, guide.W_keys.weight)
    guide.eval()
    ours.eval()
    expected = guide(batch)  # (2, 6, 2)
    wrong = float((ours(batch) - expected).abs().max())
    w.value("max |attnlab.CausalAttention - the guide's|", wrong, "same seed, different model")
    w.say(
        "The right result: attnlab.tutorials.gpt_style.CausalAttention creates W_keys first, so "
        "the same seed gives the guide's numbers:"
    )
    torch.manual_seed(_GUIDE_SEED)
    exact = gpt_style.CausalAttention(3, 2, 6)
    exact.eval()
    context = exact(batch)  # (2, 6, 2)
    w.show("gpt_style.CausalAttention(3, 2, 6).eval()(batch)", context[0], "text 0")
    w.check("== the guide's class", context, expected)
    renamed = {k.replace("W_keys", "W_key"): v for k, v in guide.state_dict().items()}
    ours.load_state_dict(renamed)
    w.check("== attnlab.CausalAttention with W_keys loaded as W_key", ours(batch), expected)

    guide.train()  # a new module is in training mode
    torch.manual_seed(1)
    first = guide(batch)
    second = guide(batch)
    w.bug(
        GPT_GUIDE,
        "its CausalAttention defaults to dropout=0.1 (the other tutorials pass dropout, or default "
        "to 0.0, as attnlab does). A freshly built module is in training mode, so "
        "CausalAttention(d_in, d_out, context_length) drops attention weights at random and two "
        f"calls on the same batch differ (max |difference| {float((first - second).abs().max()):.4f} "
        "here). Call .eval() (as above) or pass dropout=0.0 for the context vectors themselves.",
    )
    return {"dropped": dropped, "context": context, "expected": expected, "train_1": first, "train_2": second}


@lesson(
    "gpt-multi-head",
    "the guide's MultiHeadAttention (num_heads third, biased) and its width claim",
    headline="the guide's multi-head attention",
    tutorial=GPT_GUIDE,
    section="Multi-Head Attention",
)
def gpt_multi_head(w: Walk) -> dict[str, Tensor]:
    inputs = tc.INPUTS.clone()
    batch = torch.stack((inputs, inputs))  # (2, 6, 3)
    w.step(f"torch.manual_seed({_GUIDE_SEED}); mha = attnlab.tutorials.gpt_style.MultiHeadAttention(3, 4, 2, 6, 0.0)")
    torch.manual_seed(_GUIDE_SEED)
    mha = gpt_style.MultiHeadAttention(3, 4, 2, 6, 0.0)  # d_in, d_out, num_heads, context_length, dropout
    out, weights = mha(batch, return_weights=True)  # (2, 6, 4), (2, 2, 6, 6)
    w.show("weights[0]", weights[0], "2 heads of head_dim 2, each causal")
    w.show("mha(batch)", out, "(2, 6, 4): d_out = 4 wide, from 3-wide inputs")
    torch.manual_seed(_GUIDE_SEED)
    w.check("== the guide's class (same seed)", out, tc.GuideMultiHeadAttention(3, 4, 2, 6, 0.0)(batch))
    torch.manual_seed(_GUIDE_SEED)
    keyword = MultiHeadAttention(d_in=3, d_out=4, num_heads=2, context_length=6, dropout=0.0, qkv_bias=True)
    w.check("== attnlab.MultiHeadAttention(..., qkv_bias=True) by keyword", out, keyword(batch))
    concat = out.shape[-1]
    w.bug(
        GPT_GUIDE,
        "its step 'Concatenating the Head Outputs' says the result has 'a dimension of d_model, which "
        "is the same as the original input embeddings'. The concatenation is num_heads x head_dim = d_out wide; "
        f"it equals the input's width only when d_in == d_out (as in GPT models). Here d_in = "
        f"{batch.shape[-1]}, d_out = {concat}: the output is {concat} wide.",
    )

    w.say("Its GPT-2 snippet (12 heads, d_in = d_out = 768, 1024 tokens), on attnlab's fused kernel:")
    w.step("torch.manual_seed(123); batch = torch.rand(2, 1024, 768)")
    torch.manual_seed(123)
    big = torch.rand(2, 1024, 768)
    w.step("mha = MultiHeadAttention(d_in, d_out, num_heads, context_length, 0.0)   # the guide's order")
    big_mha = gpt_style.MultiHeadAttention(768, 768, 12, 1024, 0.0)
    context_vecs = big_mha(big)  # (2, 1024, 768)
    w.show("context_vecs[0, :2, :4]", context_vecs[0, :2, :4], "a corner of the (2, 1024, 768) result")
    w.value("context_vecs.shape", str(tuple(context_vecs.shape)), "d_out = d_in: the blocks can be stacked")
    return {"out": out, "weights": weights, "gpt2_shape": torch.tensor(context_vecs.shape)}


# ============================================================================================
# The attention-review exercises
# ============================================================================================
REVIEW_TEXT = "Concept Questions"  # the first words of the exercises' notebook

CONCEPT_QUESTIONS = (
    (
        "What is the purpose of masking during self-attention?",
        "Masking can ensure that tokens don't attend to *future* tokens, which is useful because LLMs "
        "want to predict the next singular token based on *past* tokens.",
    ),
    (
        "What matrix do we mask, and what matrix do we use to perform masking?",
        "We want to mask QK^T in order for the weights of future tokens to be 0 during the weighted sum "
        "of values process. We use a lower triangular matrix of 1s to mask QK^T.",
    ),
    (
        "What is the purpose of using dropout in a self-attention module?",
        "Dropout helps the model generalize better and reduces overfitting by having the model train on "
        "slightly malformed data. Then, when we actually use/test the model, we don't use dropout.",
    ),
    (
        "What is the purpose of multi-head attention?",
        "We use multiple heads because each head can learn a different pattern from the text. "
        "Multi-head attention improves performance/accuracy in general.",
    ),
)


@lesson(
    "quiz",
    "the exercises' four concept questions: asks, then answers",
    headline="four questions on masking, dropout and heads",
    tutorial=REVIEW,
    section="Concept Questions",
)
def quiz(w: Walk) -> dict[str, Tensor]:
    w.say(
        "Answer each question for yourself first. In a terminal the lesson waits for Enter before "
        "it shows the exercises' answer; otherwise (a pipe, a file, CI) it prints both."
    )
    for i, (question, answer) in enumerate(CONCEPT_QUESTIONS, 1):
        w.ask(i, question, answer)
    mask = causal_mask(4)  # (4, 4) True = may attend
    w.show(
        "attnlab.causal_mask(4)",
        mask,
        "answer 2 in attnlab: True on and below the diagonal = may attend; -inf is filled where False",
    )
    torch.manual_seed(0)
    dropped = nn.Dropout(0.5)(torch.ones(8))
    w.show("nn.Dropout(0.5)(torch.ones(8))   # training mode", dropped, "answer 3: kept values x 1/(1-p)")
    return {"causal_mask": mask, "dropped": dropped}


@lesson(
    "review-self-attention",
    "SelfAttentionV2 (biased) on a [40, 50, 768] batch -> [40, 50, 1024]",
    headline="the self-attention module of the last lecture",
    tutorial=REVIEW,
    section="Attention Review",
)
def review_self_attention(w: Walk) -> dict[str, Tensor]:
    w.say("The exercises seed nothing and print only the shape; torch.manual_seed(0) here.")
    torch.manual_seed(0)
    X_batch = torch.randn(40, 50, 768)  # (B, N, d_in)
    w.step("self_attention = attnlab.tutorials.attention_review.SelfAttentionV2(768, 1024)")
    self_attention = attention_review.SelfAttentionV2(768, 1024)
    w.value("print(self_attention.W_query)", repr(self_attention.W_query), "nn.Linear(d_in, d_out): bias=True")
    w.value("parameters", count_parameters(self_attention), "3 x (768 x 1024 + 1024): weights and biases")
    context_batch = self_attention(X_batch)  # (40, 50, 1024)
    w.show("context_batch[0, :2, :4]", context_batch[0, :2, :4], "a corner of the result")
    w.value("context_batch.shape", str(tuple(context_batch.shape)), "B x N x d_out")
    torch.manual_seed(0)
    torch.randn(40, 50, 768)
    theirs = tc.SelfAttentionV2(768, 1024)
    w.check("== the exercise's class (same seed)", context_batch, theirs(X_batch))
    w.say(
        "Its nn.Linear layers keep their default bias: in attnlab that is SelfAttention_v2(768, "
        "1024, qkv_bias=True) (same creation order, same numbers); attnlab's default qkv_bias=False "
        "is a different model. It has no mask: every token sees every token."
    )
    return {"shape": torch.tensor(context_batch.shape), "corner": context_batch[0, :2, :4]}


@lesson(
    "review-masks",
    "torch.tril masks, Exercises 1-4, and the exercises' unsliced mask",
    headline="masks with torch.tril, before and after softmax",
    tutorial=REVIEW,
    section="Causal Attention",
)
def review_masks(w: Walk) -> dict[str, Tensor]:
    a = torch.tensor([[3, 4, 5], [1, 7, 3], [2, 4, 5]])
    tril_a = torch.tril(a)
    w.show("torch.tril(a)", tril_a, "keeps the diagonal and below, zeros the upper right")
    ones_mask = torch.tril(torch.ones(3, 3))
    w.show("b = torch.tril(torch.ones(3, 3))", ones_mask, "a mask: 1 = keep")
    product = ones_mask * a
    w.show("d = b * c", product, "multiplying by the mask zeros the future")

    qkt = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.7, 0.8, 0.9]])
    n, d_out = 3, 100
    after = torch.softmax(qkt / d_out**0.5, dim=-1) * torch.tril(torch.ones(n, n))
    after = after / after.sum(dim=-1, keepdim=True)
    w.show("Exercise 1: softmax, mask, renormalise (d_out = 100)", after, "")
    example_mask = torch.tril(torch.ones(3, 3))
    w.show("example_mask = torch.tril(torch.ones(3, 3))", example_mask, "")
    filled = a.float().masked_fill(example_mask == 0, float("-inf"))
    w.show("a.masked_fill(example_mask == 0, float('-inf'))", filled, "-inf where the mask is 0")
    w.show("example_mask == 0", example_mask == 0, "True where -inf goes")
    before = torch.softmax(qkt.masked_fill(torch.tril(torch.ones(n, n)) == 0, float("-inf")) / d_out**0.5, dim=-1)
    w.show("Exercise 2: -inf before softmax", before, "")
    w.check("Exercise 1 == Exercise 2", after, before)
    eye = torch.eye(3)
    w.check(
        "== attnlab.scaled_dot_product_attention(QKT, I, I, is_causal=True, scale=1/10)",
        before,
        scaled_dot_product_attention(qkt, eye, eye, is_causal=True, scale=1 / 10),
    )

    w.say("Exercise 3's CausalAttention registers tril(ones(context_length, context_length)) and uses it whole:")
    w.step("masked_fill(self.mask == 0, float('-inf'))   # (context_length, context_length), not cut to N")
    x = tc.INPUTS.clone().unsqueeze(0)  # (1, 6, 3)
    torch.manual_seed(123)
    theirs = tc.CausalAttentionReview(3, 2, 6)
    try:
        theirs(x[:, :4])
        error = "no error"
    except RuntimeError as exc:
        error = f"RuntimeError: {str(exc).splitlines()[0]}"
    torch.manual_seed(123)
    ours = attention_review.CausalAttention(3, 2, 6)
    full, short = ours(x), ours(x[:, :4])  # (1, 6, 2), (1, 4, 2)
    w.bug(
        REVIEW,
        "its CausalAttention (Exercise 3) and MultiHeadAttentionOneModule (Exercise 6) apply the "
        "whole (context_length, context_length) mask, so any input shorter than context_length "
        f"fails ({error}). The mask must be cut to the input, mask[:N, :N]. Then the first 4 "
        "tokens' context vectors are the first 4 rows of the 6-token result (token t sees 0..t):",
    )
    w.show("attention_review.CausalAttention(3, 2, 6)(x[:, :4])", short[0], "4 tokens, seed 123")
    w.check("== the first 4 rows of the 6-token result", short, full[:, :4])
    w.check("the 6-token result == the exercise's class (no global d_out: its own 2)", full, theirs(x))
    w.say(
        "Its forward also divides by the GLOBAL d_out, still 100 from Exercise 2, not self.d_out "
        "(the scaling lesson shows Exercise 4 with it; review-multi-head shows Exercise 5)."
    )

    w.say("Exercise 4: batch 20, context length 100, embedding 512, d_out = 768 (shapes only: meta device):")
    w.step("causal_att_model = CausalAttention(x_batch.shape[2], 768, x_batch.shape[1])")
    with torch.device("meta"):
        shape = CausalAttention(512, 768, 100)(torch.empty(20, 100, 512)).shape
    w.value("contextual_embeddings.shape", str(tuple(shape)))
    return {
        "tril_a": tril_a,
        "ones_mask": ones_mask,
        "product": product,
        "after": after,
        "example_mask": example_mask,
        "filled": filled,
        "before": before,
        "short": short,
        "full": full,
        "exercise4_shape": torch.tensor(shape),
    }


@lesson(
    "review-multi-head",
    "Exercise 5's wrapper (no output projection) vs attnlab's MultiHeadAttention; Exercises 6-7",
    headline="two multi-head classes that are not the same model",
    tutorial=REVIEW,
    section="Multi-head Attention",
)
def review_multi_head(w: Walk) -> dict[str, Tensor]:
    w.say(
        "Exercise 5's MultiHeadAttention(d_in, d_out, num_heads, context_length) stacks num_heads "
        "CausalAttention heads of width d_out // num_heads and concatenates them: no output "
        "projection. attnlab's MultiHeadAttention splits one projection and adds out_proj. Passing "
        "the exercise's arguments by keyword builds attnlab's model, not the exercise's:"
    )
    with torch.device("meta"):  # parameter counts need shapes only
        exercise = attention_review.MultiHeadAttention(512, 768, 3, 100)
        keyword = MultiHeadAttention(d_in=512, d_out=768, num_heads=3, context_length=100)
        small_exercise = attention_review.MultiHeadAttention(12, 24, 3, 6)
        small_keyword = MultiHeadAttention(d_in=12, d_out=24, num_heads=3, context_length=6)
    counts = [count_parameters(m) for m in (exercise, keyword, small_exercise, small_keyword)]
    w.line()
    w.line(f"{'parameters':<42}{'d_in=512, d_out=768':>19}{'d_in=12, d_out=24':>18}")
    w.line(f"{'the exercise (3 heads, no out_proj)':<42}{counts[0]:>19,}{counts[2]:>18,}")
    w.line(f"{'attnlab MultiHeadAttention(...keywords)':<42}{counts[1]:>19,}{counts[3]:>18,}")
    w.say(
        "The exercise's model is MultiHeadAttentionWrapper(d_in, d_out // num_heads, context_length, "
        "dropout, num_heads); attnlab.tutorials.attention_review.MultiHeadAttention takes the "
        "exercise's arguments and builds it (same parameters, same creation order):"
    )
    x = torch.randn(2, 6, 12, generator=torch.Generator().manual_seed(0))  # (2, 6, 12)
    torch.manual_seed(123)
    review = attention_review.MultiHeadAttention(12, 24, 3, 6)
    out = review(x)  # (2, 6, 24)
    w.show(
        "attention_review.MultiHeadAttention(12, 24, 3, 6)(x)[0, :3, :8]",
        out[0, :3, :8],
        "seed 123; head 0's 8 columns of 24",
    )
    torch.manual_seed(123)
    w.check(
        "== MultiHeadAttentionWrapper(12, 8, 6, 0.0, num_heads=3)",
        out,
        MultiHeadAttentionWrapper(12, 8, 6, 0.0, num_heads=3)(x),
    )
    torch.manual_seed(123)
    theirs = tc.MultiHeadAttentionReview(12, 24, 3, 6)
    w.check("== the exercise's class, heads scaled by their own width", out, theirs(x, d_out=8))

    scale_now, scale_right = 1 / math.sqrt(100), 1 / math.sqrt(768 // 3)
    buggy = theirs(x, d_out=100)  # the notebook: the global d_out is 100
    w.bug(
        REVIEW,
        "Exercise 5's heads are its Exercise 3 CausalAttention, which divides the scores by the "
        "GLOBAL d_out ** 0.5. In the notebook that global is 100 (set in Exercises 1 and 2; "
        "Exercises 4 and 5 pass 768 as an argument), so every head scales by 1/sqrt(100) = "
        f"{scale_now:.4f}, where its own width 768 // 3 = 256 needs 1/sqrt(256) = {scale_right:.4f}. "
        "The right result is the one above; with the global 100 (here, 8-wide heads):",
    )
    heads = [
        scaled_dot_product_attention(h.W_query(x), h.W_key(x), h.W_value(x), is_causal=True, scale=scale_now)
        for h in theirs.heads
    ]
    w.check("the exercise's (global d_out = 100) == every head at scale 1/10", buggy, torch.cat(heads, dim=-1))
    w.value("max |exercise - right|", float((buggy - out).abs().max()), "a different function")

    w.say("Exercises 6 and 7: MultiHeadAttentionOneModule is attnlab's MultiHeadAttention with num_heads third:")
    torch.manual_seed(4)
    one = attention_review.MultiHeadAttentionOneModule(12, 24, 3, 6)
    torch.manual_seed(4)
    w.check("== the exercise's class (same seed)", one(x), tc.MultiHeadAttentionOneModule(12, 24, 3, 6)(x))
    torch.manual_seed(4)
    w.check(
        "== attnlab.MultiHeadAttention(d_in=12, d_out=24, num_heads=3, context_length=6)",
        one(x),
        MultiHeadAttention(d_in=12, d_out=24, num_heads=3, context_length=6)(x),
    )
    with torch.device("meta"):
        ex5 = attention_review.MultiHeadAttention(512, 768, 3, 100)(torch.empty(20, 100, 512)).shape
        ex7 = attention_review.MultiHeadAttentionOneModule(768, 1536, 3, 80)(torch.empty(40, 80, 768)).shape
    w.value("Exercise 5: contextual_embeddings.shape", str(tuple(ex5)), "x_batch (20, 100, 512)")
    w.value("Exercise 7: contextual_embeddings.shape", str(tuple(ex7)), "x (40, 80, 768), d_out = 1536")
    return {
        "counts": torch.tensor(counts),
        "out": out,
        "buggy": buggy,
        "exercise5_shape": torch.tensor(ex5),
        "exercise7_shape": torch.tensor(ex7),
    }


@lesson(
    "review-loader",
    "the tiktoken sliding-window loader: GPT-2 ids, windows with a stride, batches",
    headline="from text to (inputs, targets) windows",
    tutorial=REVIEW,
    section="Optional: Update BadLM to use multi-head attention",
)
def review_loader(w: Walk) -> dict[str, Tensor]:
    text = "This is a very useless sentence that talks about itself."
    w.say(f"The exercises' text: {text!r}, with tiktoken.get_encoding('gpt2').")
    try:
        tokenizer = GPT2Tokenizer(bpe_dir=w.bpe_dir)
        source = f"GPT-2's BPE from {w.bpe_dir}" if w.bpe_dir else "GPT-2's BPE"
        made = "tokenizer = attnlab.tokenizers.GPT2Tokenizer(bpe_dir=DIR)   # tiktoken's gpt2, built offline"
    except (TokenizerLoadError, FileNotFoundError, ImportError, ValueError) as exc:
        tokenizer = ByteTokenizer()
        source = "the byte tokenizer (not the exercises' ids)"
        w.notice(
            "GPT-2's tokenizer is not available here "
            f"({type(exc).__name__}: {str(exc).split(';')[0]}). For the exercises' ids pass "
            "--bpe-dir DIR (Python: run_lesson('review-loader', bpe_dir=DIR)) or set "
            "ATTNLAB_GPT2_BPE_DIR=DIR, where DIR holds GPT-2's encoder.json and vocab.bpe. Going on "
            "with attnlab's byte tokenizer: same windows, other ids."
        )
        made = "tokenizer = attnlab.tokenizers.ByteTokenizer()   # GPT-2's BPE files not found"
    w.step(made)
    ids = torch.tensor(tokenizer.encode(text))  # (n,)
    w.show("token_ids = tokenizer.encode(text)", ids, f"{len(ids)} ids from {source}")
    pieces = [tokenizer.decode([int(i)]) for i in ids]
    w.value("one id at a time", " | ".join(pieces))

    context_length = 4
    windows = {}
    for stride in (1, 2, 4):
        dataset = TokenWindowDataset(ids, context_length, stride)  # MyData's windows
        inputs = torch.stack([dataset[i][0] for i in range(len(dataset))])  # (windows, 4)
        targets = torch.stack([dataset[i][1] for i in range(len(dataset))])  # (windows, 4)
        windows[stride] = (inputs, targets)
        w.step(f"attnlab.data.TokenWindowDataset(token_ids, context_length=4, stride={stride})   # MyData's windows")
        w.show("input_ids", inputs, f"starts 0, {stride}, {2 * stride}, ... below len(token_ids) - 4")
        w.show("target_ids", targets, "the same windows shifted by one: the next token of each")
    w.say(
        "stride 1 overlaps windows by 3 tokens; stride 4 = context_length does not overlap. As in "
        "MyData, every start is below len(token_ids) - context_length, so every input window has "
        "its target window, one token later, inside the text."
    )

    w.step("loader = attnlab.data.create_dataloader(text, 2, 4, 1, shuffle=False, tokenizer=tokenizer)")
    loader = create_dataloader(text, 2, context_length, 1, shuffle=False, tokenizer=tokenizer)
    batches = list(loader)
    w.value("batches", len(batches), f"{len(windows[1][0])} windows, 2 per batch, drop_last=True")
    w.show("first batch: inputs", batches[0][0], "(batch_size, context_length)")
    w.say(
        "my_batch shuffles (shuffle=True) and its BadLM_V2 is untrained and unseeded, so the "
        "predictions the exercises print are random ids. BadLM_V2's position table is sized by the "
        "vocabulary (the gpt2-sizes lesson has the note); examples/badlm_v2.py runs the fixed "
        "model on attnlab's MultiHeadAttention with this loader."
    )
    return {
        "ids": ids,
        "inputs_stride1": windows[1][0],
        "targets_stride1": windows[1][1],
        "inputs_stride2": windows[2][0],
        "inputs_stride4": windows[4][0],
        "first_batch": batches[0][0],
        "gpt2": torch.tensor(isinstance(tokenizer, GPT2Tokenizer)),
    }


# ============================================================================================
# "Self attention for a single individual head"
# ============================================================================================
@lesson(
    "one-head",
    "a single head on a (4, 8, 32) batch: q, k, the whole batch of wei",
    headline="one head of self-attention, every batch element",
    tutorial=ONE_HEAD,
    section="In [38]: version 4 : self attention",
)
def single_head(w: Walk) -> dict[str, Tensor]:
    w.step("torch.manual_seed(1337); B, T, C = 4, 8, 32; x = torch.randn(B, T, C)")
    torch.manual_seed(1337)
    x = torch.randn(4, 8, 32)  # (B, T, C)
    w.show("x[0, :2, :6]", x[0, :2, :6], "a corner of x: 4 sequences of 8 tokens, 32 numbers each")
    w.step("head = attnlab.tutorials.one_head.Head(32, 16, scale=1.0)   # its key, query (and value) layers")
    head = one_head.Head(32, 16, scale=1.0)  # key, query, value: the tutorial's order; it does not scale yet
    k, q = head.key(x), head.query(x)  # (B, T, 16) each
    wei_raw = q @ k.transpose(-2, -1)  # (B, T, T)
    w.show("wei = q @ k.transpose(-2, -1)", wei_raw, "raw affinities, every batch element (the tutorial prints [0])")
    _, wei = scaled_dot_product_attention(q, k, x, is_causal=True, scale=1.0, return_weights=True)  # (B, T, T)
    w.show("wei after masked_fill(tril == 0, -inf) and softmax", wei, "(B, T, T): row t mixes tokens 0..t")
    out = wei @ x  # (B, T, C)
    w.value("out = wei @ x; out.shape", str(tuple(out.shape)), "In [35] aggregates x itself")

    uniform = torch.softmax(torch.zeros(8, 8).masked_fill(torch.tril(torch.ones(8, 8)) == 0, float("-inf")), dim=-1)
    differs = float((wei[0] - wei[1]).abs().max())
    w.bug(
        ONE_HEAD,
        "In [23] comments that 'every single batch element contains different tokens at different "
        "positions and so this is not data dependent'. It is the opposite: wei is computed from each "
        "element's own queries and keys, so it IS data dependent, and differs between batch elements "
        f"(max |wei[0] - wei[1]| = {differs:.4f}); the earlier versions' wei (a masked softmax of "
        "zeros: uniform averages) was the same for every element and every input:",
    )
    w.show("softmax(zeros masked by tril)   # versions 2 and 3", uniform, "the same for any x")
    return {"x": x, "wei_raw": wei_raw, "wei": wei, "out_x": out, "uniform": uniform}


@lesson(
    "one-head-values",
    "the head with values: out = wei @ v, shape (4, 8, 16)",
    headline="what a head hands over: the values",
    tutorial=ONE_HEAD,
    section="In [33]: the head with values",
)
def one_head_values(w: Walk) -> dict[str, Tensor]:
    w.say(
        "In [33] builds key, query and value anew. Its printed wei[0] comes from its notebook's "
        "random state at that moment: seeded with 1337 in In [38], then x, then 20 more nn.Linear(32, "
        "16) layers (cells re-run; each draws 512 numbers). Type this (on a CPU) to get its numbers:"
    )
    w.step("torch.manual_seed(1337); x = torch.randn(4, 8, 32); _ = torch.randn(20, 4, 8, 16)")
    torch.manual_seed(1337)
    x = torch.randn(4, 8, 32)  # (B, T, C)
    torch.randn(20, 4, 8, 16)  # the notebook's draws in between
    w.step("head = attnlab.tutorials.one_head.Head(32, 16, scale=1.0)   # key, query, value")
    head = one_head.Head(32, 16, scale=1.0)
    k, q, v = head.key(x), head.query(x), head.value(x)  # (B, T, 16) each
    wei_raw = q @ k.transpose(-2, -1)  # (B, T, T)
    w.show("wei[0] = (q @ k.transpose(-2, -1))[0]", wei_raw[0], "the tutorial's In [33] print")
    out, wei = head(x, return_weights=True)  # (B, T, 16), (B, T, T)
    w.show("out = head(x)   # wei @ v", out, "(4, 8, 16): 16 wide, the head size")
    manual = torch.softmax(wei_raw.masked_fill(torch.tril(torch.ones(8, 8)) == 0, float("-inf")), dim=-1) @ v
    w.check("== softmax(masked wei) @ v, as its cell computes", out, manual)
    w.say(
        "x is each token's private information; v is what the token communicates to the tokens "
        "that find it interesting (their query matches its key). out aggregates v, not x."
    )
    return {"wei_raw": wei_raw, "wei": wei, "out": out}
