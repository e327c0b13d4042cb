"""Lessons on attention since GPT-2: ``rope``, ``alibi``, ``sliding-window``, ``gqa`` and ``soft-capping``.

The tutorials stop at GPT-2's attention. These lessons start from their numbers (the six words of
"A simple self-attention mechanism", the trainable projections of its ``SelfAttention_v2`` under the
tutorial's seed) and show, tensor by tensor, what the models after it changed, each claim checked
numerically: a rotation keeps lengths and makes scores depend only on the distance between tokens;
ALiBi's penalty does the same without parameters; a window bounds what a token sees and what the
cache must keep; shared key/value heads shrink the cache by the group size; a soft cap bounds every
score while leaving small ones as they were.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab import tutorial_code as tc
from attnlab.attention import MultiHeadAttention, SelfAttention_v2
from attnlab.functional import causal_mask, scaled_dot_product_attention, softcap_score_mod
from attnlab.positions import alibi_bias, alibi_score_mod, alibi_slopes, apply_rope, rope_cos_sin, rope_inv_freq
from attnlab.tools.explain.registry import GPT_GUIDE, lesson
from attnlab.tools.explain.walk import Walk
from attnlab.tools.info import kv_cache_bytes

__all__ = ["MODERN_LESSONS"]

MODERN_LESSONS = ("rope", "alibi", "sliding-window", "gqa", "soft-capping")  # registered below, in this order

# What these lessons follow: the GPT-style guide, then past where it stops (not one of its sections,
# so `attnlab explain --tutorial gpt-style` keeps to the guide itself).
AFTER_GUIDE = f"{GPT_GUIDE}, then the models after GPT-2"


def _qk_of_the_tutorial() -> tuple[Tensor, Tensor, Tensor]:
    """Queries, keys and values of the six words from "A simple self-attention mechanism"'s
    SelfAttention_v2(3, 2) under its seed 789: (6, 2) each, one feature pair per vector."""
    torch.manual_seed(789)
    sa = SelfAttention_v2(3, 2)
    x = tc.INPUTS.clone()
    return sa.W_query(x), sa.W_key(x), sa.W_value(x)


@lesson(
    "rope",
    "rotary positions: a rotation per position, scores that see only distances",
    headline="RoPE: rotate queries and keys by their positions",
    tutorial=AFTER_GUIDE,
)
def rope(w: Walk) -> dict[str, Tensor]:
    w.say(
        "GPT-2 adds a learned vector per absolute position to each token. Llama, Mistral, Qwen and "
        "nanochat instead rotate every query and key: feature pair i of a token at position m turns "
        "by the angle m * theta^(-2i/d). The queries and keys of the six words, from the tutorial's "
        "SelfAttention_v2(3, 2) (seed 789), are 2-d: one pair, turning by 1 radian per position."
    )
    q, k, _ = _qk_of_the_tutorial()  # (6, 2) each
    positions = torch.arange(6)
    w.show("queries", q, "one 2-d query per word, before any position")
    w.step("cos, sin = rope_cos_sin(torch.arange(6), head_dim=2); q_rot = apply_rope(q, cos, sin)")
    cos, sin = rope_cos_sin(positions, 2)  # (6, 2) each
    q_rot, k_rot = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (6, 2) each
    w.show("q_rot", q_rot, "word m turned by m radians: (a, b) -> (a cos m - b sin m, b cos m + a sin m)")
    w.check("a rotation keeps every length: |q_rot| == |q|", q_rot.norm(dim=-1), q.norm(dim=-1))

    scores = q_rot @ k_rot.T  # (6, 6)
    w.show("scores = q_rot @ k_rot.T", scores, "query m against key n, both rotated")
    shifted_cos, shifted_sin = rope_cos_sin(positions + 100, 2)
    shifted = apply_rope(q, shifted_cos, shifted_sin) @ apply_rope(k, shifted_cos, shifted_sin).T  # (6, 6)
    w.say(
        "Rotating q by m and k by n is rotating q by m - n relative to k: the score depends only "
        "on the distance m - n. Move the whole sentence 100 positions on, and nothing changes:"
    )
    w.check("scores at positions 100..105 == scores at 0..5", shifted, scores)
    by_distance = torch.stack(
        [(apply_rope(q[1:2], *rope_cos_sin(torch.tensor([d]), 2)) * k[0]).sum() for d in range(6)]
    )  # (6,)
    w.show(
        'score of "journey" against "Your" at distance 0..5',
        by_distance,
        "|q||k| cos(angle + distance): the score turns with the distance, whatever the positions",
    )
    w.say(
        "With more features, each pair turns at its own speed: pair 0 one radian per token, the "
        "last about 1/theta. Fast pairs tell neighbours apart, slow ones far-apart tokens."
    )
    inv_freq = rope_inv_freq(64, theta=10000.0)  # (32,)
    w.show("rope_inv_freq(64)", inv_freq[[0, 1, 2, 15, 30, 31]], "radians per position of pairs 0, 1, 2, 15, 30, 31")
    w.say(
        "In attnlab: MultiHeadAttention(..., rope=True) or GPTConfig(pos='rope'); with a KV cache the "
        "keys are stored already rotated, at their original positions, so nothing is recomputed."
    )
    return {"q_rot": q_rot, "scores": scores, "shifted": shifted, "by_distance": by_distance}


@lesson(
    "alibi",
    "ALiBi: a per-head penalty on distance instead of position vectors",
    headline="ALiBi: subtract slope x distance from every score",
    tutorial=AFTER_GUIDE,
)
def alibi(w: Walk) -> dict[str, Tensor]:
    w.say(
        "ALiBi (BLOOM, MPT) adds no vectors at all: the score of query i for key j gets "
        "-slope_h * (i - j), a straight-line penalty on distance, one slope per head. The slopes "
        "form a geometric sequence: 2^(-8/H), 2^(-16/H), ..."
    )
    slopes = alibi_slopes(4)  # (4,)
    w.show("alibi_slopes(4)", slopes, "head 0 forgets fastest, head 3 looks far back")
    bias = alibi_bias(slopes, torch.arange(6), torch.arange(6))  # (4, 6, 6)
    w.show("alibi_bias(...)[0]", bias[0], "head 0: -1/4 per token of distance (the upper half is masked)")

    inputs = tc.INPUTS.clone()  # (6, 3)
    scores = inputs @ inputs.T  # (6, 6), the tutorial's dot products
    masked = (scores + bias).masked_fill(~causal_mask(6), float("-inf"))  # (4, 6, 6)
    weights = torch.softmax(masked, dim=-1)  # (4, 6, 6)
    w.show(
        'weights of "step" (the last word), per head',
        weights[:, 5],
        "the tutorial's scores inputs @ inputs.T plus each head's bias: steep slopes keep to the last words",
    )
    plain = torch.softmax(scores.masked_fill(~causal_mask(6), float("-inf")), dim=-1)[5]  # (6,)
    w.show('without ALiBi, "step"', plain, "the tutorial's causal weights: no notion of distance")

    q = inputs.expand(1, 4, 6, 3)  # (1, H, 6, 3): the words as queries, keys and values, in 4 heads
    with_mod = scaled_dot_product_attention(q, q, q, is_causal=True, scale=1.0, score_mod=alibi_score_mod(slopes))
    with_mask = scaled_dot_product_attention(q, q, q, attn_mask=bias, is_causal=True, scale=1.0)
    w.step("score_mod = lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx - kv_idx)")
    w.check("flex-style score_mod == the explicit bias as attn_mask", with_mod, with_mask)
    w.say(
        "No table of positions: the same line extends to any length (the paper trains on 1024 "
        "tokens and reads 2048). In attnlab: MultiHeadAttention(..., alibi=True), GPTConfig(pos='alibi')."
    )
    return {"slopes": slopes, "bias": bias, "weights": weights, "with_mod": with_mod}


@lesson(
    "sliding-window",
    "sliding windows: the mask, and a KV cache that stops growing",
    headline="sliding-window attention and its rolling cache",
    tutorial=AFTER_GUIDE,
)
def sliding_window(w: Walk) -> dict[str, Tensor]:
    w.say(
        "Mistral, Gemma and gpt-oss let a token see only the last W tokens (itself included): "
        "the causal mask keeps a band of width W. The work per token stops growing with the "
        "text, and so does the KV cache."
    )
    w.step("causal_mask(6, window=3)")
    band = causal_mask(6, window=3)  # (6, 6)
    w.show("causal_mask(6, window=3)", band.int(), "1 = may attend: the diagonal and 2 keys before it")
    sinks = causal_mask(6, window=3, sinks=1)  # (6, 6)
    w.show("causal_mask(6, window=3, sinks=1)", sinks.int(), "StreamingLLM's sink: the first token stays visible")

    inputs = tc.INPUTS.clone()  # (6, 3)
    weights = torch.softmax((inputs @ inputs.T).masked_fill(~band, float("-inf")), dim=-1)  # (6, 6)
    w.show("weights in the window", weights, "the tutorial's scores, each row over at most 3 words")

    torch.manual_seed(123)
    mha = MultiHeadAttention(3, 4, 6, 0.0, num_heads=2, rope=True, window=3).eval()
    cache = mha.new_kv_cache(1, rolling=True)
    w.step("mha = MultiHeadAttention(3, 4, 6, 0.0, num_heads=2, rope=True, window=3)")
    w.step("cache = mha.new_kv_cache(1, rolling=True)  # window slots, reused round the ring")
    text = torch.cat([inputs, inputs.flip(0)])  # (12, 3): the sentence, then backwards
    steps, held = [], []
    for t in range(12):
        steps.append(mha(text[None, t : t + 1], kv_cache=cache))  # (1, 1, 4)
        held.append(cache.positions[0].clone())  # (3,): the position each slot holds
    held_t = torch.stack(held)  # (12, 3)
    w.show(
        "cache.positions after each of 12 tokens",
        held_t,
        "3 slots whatever the length: token t overwrites the oldest slot (-1 = empty)",
    )
    w.value("cache.keys.shape", str(tuple(cache.keys.shape)), "(batch, kv heads, window, head_dim): flat")
    full = mha(text[None])  # (1, 12, 4): the whole sequence at once, the window as a mask
    w.check("token by token through the ring == all 12 at once", torch.cat(steps, 1), full)
    w.say(
        "Stacked layers pass information further: with L layers of window W a token reaches "
        "L * (W - 1) tokens back. attnlab's GPT with relative positions always generates this way: "
        "its window defaults to the context length, and past it the cache rolls instead of re-encoding."
    )
    return {"band": band, "sinks": sinks, "weights": weights, "held": held_t, "full": full}


@lesson(
    "gqa",
    "grouped-query attention: query heads sharing key/value heads",
    headline="GQA: fewer key/value heads, a smaller cache",
    tutorial=AFTER_GUIDE,
)
def gqa(w: Walk) -> dict[str, Tensor]:
    w.say(
        "Every query head of GPT-2 has its own key and value head. Llama 2 70B, Llama 3, Mistral "
        "and Qwen give a group of query heads one shared key/value head: the projections W_key and "
        "W_value shrink, and so does the KV cache, by the group size."
    )
    torch.manual_seed(123)
    mha = MultiHeadAttention(3, 8, 6, 0.0, num_heads=4, num_kv_heads=2).eval()
    w.step("mha = MultiHeadAttention(3, 8, 6, 0.0, num_heads=4, num_kv_heads=2)")
    w.value("W_query.weight.shape", str(tuple(mha.W_query.weight.shape)), "4 query heads of head_dim 2")
    w.value("W_key.weight.shape", str(tuple(mha.W_key.weight.shape)), "2 key heads: 0, 1 share one; 2, 3 the other")
    batch = tc.INPUTS.clone()[None]  # (1, 6, 3)
    out, weights = mha(batch, return_weights=True)  # (1, 6, 8), (1, 4, 6, 6)
    w.show("weights of head 0 and head 1", weights[0, :2], "same keys and values, their own queries: other weights")

    q = mha.W_query(batch).view(1, 6, 4, 2).transpose(1, 2)  # (1, 4, 6, 2)
    k = mha.W_key(batch).view(1, 6, 2, 2).transpose(1, 2)  # (1, 2, 6, 2)
    v = mha.W_value(batch).view(1, 6, 2, 2).transpose(1, 2)  # (1, 2, 6, 2)
    repeated = scaled_dot_product_attention(
        q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True
    )  # (1, 4, 6, 2)
    w.step("k.repeat_interleave(2, dim=1): each key head copied for its 2 query heads")
    merged = mha.out_proj(repeated.transpose(1, 2).reshape(1, 6, 8))  # (1, 6, 8)
    w.check("GQA == MHA with the key/value heads repeated", merged, out)

    w.say(
        "The cache holds keys and values of every layer for every token: 2 x layers x kv_heads x "
        "head_dim numbers per token. For a Llama 2 7B-sized model (32 layers, 32 heads of 128) "
        "at 32,768 tokens in bfloat16:"
    )
    sizes = torch.tensor(
        [kv_cache_bytes(n_layers=32, n_kv_heads=h, head_dim=128, tokens=32768, bytes_per_elem=2) for h in (32, 8, 1)]
    )  # (3,)
    w.show("bytes with 32, 8, 1 key/value heads", sizes, "MHA, GQA with groups of 4 (Llama 3 8B), MQA")
    w.say(
        f"{sizes[0] / 1e9:.2f} GB, {sizes[1] / 1e9:.2f} GB and {sizes[2] / 1e9:.2f} GB: "
        "`attnlab info --kv-memory` prints such tables for any preset or model."
    )
    return {"weights": weights, "out": out, "repeated": repeated, "sizes": sizes}


@lesson(
    "soft-capping",
    "soft-capping: cap * tanh(scores / cap), the step Gemma 2 adds before the mask",
    headline="soft-capped attention scores",
    tutorial=AFTER_GUIDE,
)
def soft_capping(w: Walk) -> dict[str, Tensor]:
    w.say(
        "Gemma 2 bounds every attention score: after scaling, scores become cap * tanh(scores / cap) "
        "(cap = 50), and its final logits the same way (cap = 30). Small scores pass almost as they "
        "were; none can exceed the cap, so no single key can take all of a softmax. The tutorial's "
        "scores inputs @ inputs.T, times 4 to make them large, with a cap of 2:"
    )
    inputs = tc.INPUTS.clone()  # (6, 3)
    scores = 4 * (inputs @ inputs.T)  # (6, 6)
    cap = 2.0
    w.step("capped = cap * torch.tanh(attn_scores / cap)")
    capped = cap * torch.tanh(scores / cap)  # (6, 6)
    w.show("attn_scores", scores, f"up to {float(scores.max()):.1f}")
    w.show("capped", capped, "all within (-2, 2)")
    w.value("capped.abs().max()", float(capped.abs().max()), f"below the cap of {cap:g}")
    small = torch.tensor([0.01, -0.05, 0.1])
    w.check("near 0 the cap changes almost nothing", cap * torch.tanh(small / cap), small)
    masked = capped.masked_fill(~causal_mask(6), float("-inf"))  # (6, 6)
    weights = torch.softmax(masked, dim=-1)  # (6, 6)
    w.show("weights = softmax(masked capped scores)", weights, "the cap, then the mask, then the softmax")
    _, lib = scaled_dot_product_attention(
        scores[None, None],
        torch.eye(6)[None, None],
        torch.eye(6)[None, None],
        is_causal=True,
        scale=1.0,
        score_mod=softcap_score_mod(cap),
        return_weights=True,
    )  # (1, 1, 6, 6): queries = the scores, keys = the identity, so q @ k.T = the scores
    w.check("attnlab's score_mod=softcap_score_mod(2.0) applies the same step", lib[0, 0], weights)
    w.say(
        "In attnlab: MultiHeadAttention(..., softcap=50.0), GPTConfig(attn_softcap=50.0, "
        "logit_softcap=30.0); the inspector's steps of such a head show the capped scores between "
        "the scaled and the masked ones."
    )
    return {"scores": scores, "capped": capped, "weights": weights}
