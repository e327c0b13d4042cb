"""attnlab.interpret against references: Hugging Face's GPT-2 (eager attention, its attentions and
hidden states), float64 loops, models whose heads are built to play known roles, the output
projection with a head's columns zeroed, and ``model.generate``."""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.generation import SamplingConfig
from attnlab.interpret import (
    HEAD_KINDS,
    Trace,
    ablate,
    ablation_effect,
    all_head_scores,
    head_scores,
    hooks,
    inspector_data,
    logit_lens,
    next_token_probabilities,
    read_page_data,
    record_module,
    render_page,
    repeated_tokens,
    rollout,
    trace,
    trace_generation,
)
from attnlab.interpret.codec import deflate, on_threads, pack, split, to_json, unpack
from attnlab.model import GPT, GPTConfig

transformers = pytest.importorskip("transformers", reason="transformers not installed (pip install 'attnlab[hf]')")
transformers.logging.set_verbosity_error()


def hf_gpt2(seed: int = 0, *, n_layer: int = 3, n_head: int = 4, n_embd: int = 32, vocab: int = 61, ctx: int = 24):
    """A random GPT2LMHeadModel with eager attention; weights scaled up so heads differ."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=ctx,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or "bias" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def sharp_gpt(seed: int = 0, **overrides) -> GPT:
    """A small attnlab GPT with sharp, varied attention (queries and keys scaled up)."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=37, context_length=24, emb_dim=32, n_heads=4, n_layers=3, drop_rate=0.0)
    model = GPT(GPTConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():
        for block in model.trf_blocks:
            block.att.W_query.weight.normal_(0, 0.5)
            block.att.W_key.weight.normal_(0, 0.5)
            block.att.W_value.weight.normal_(0, 0.3)
        model.tok_emb.weight.normal_(0, 1.0)
    return model


# --------------------------------------------------------------------------------------------
# The trace against Hugging Face GPT-2
# --------------------------------------------------------------------------------------------
def test_trace_equals_hf_gpt2_attentions_hidden_states_and_attention_outputs():
    hf = hf_gpt2()
    ours = GPT.from_hf_gpt2(hf)
    idx = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(1))
    hf_attn_out = {}
    hooks = [
        blk.attn.register_forward_hook(lambda m, a, out, i=i: hf_attn_out.__setitem__(i, out[0]))
        for i, blk in enumerate(hf.transformer.h)
    ]
    with torch.no_grad():
        ref = hf(idx, output_attentions=True, output_hidden_states=True)
    for h in hooks:
        h.remove()
    tr = trace(ours, idx, stages=True)
    L = len(hf.transformer.h)
    assert tr.weights.shape == (L, 2, 4, 17, 17)
    for i in range(L):
        torch.testing.assert_close(tr.weights[i], ref.attentions[i], atol=1e-5, rtol=0)
        torch.testing.assert_close(tr.attn_output[i], hf_attn_out[i], atol=1e-5, rtol=1e-5)
    # hidden_states: the embeddings, each block's output, and (last) the final norm of the stream.
    for i in range(L):
        torch.testing.assert_close(tr.residual[i], ref.hidden_states[i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.final_norm(tr.residual[L]), ref.hidden_states[L], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tr.logits, ref.logits, atol=1e-4, rtol=1e-4)


def test_trace_honours_padding_like_hf_gpt2():
    hf = hf_gpt2(seed=3)
    ours = GPT.from_hf_gpt2(hf)
    idx = torch.randint(1, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :4] = 0  # row 0 is left-padded by 4
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(idx, attention_mask=mask, position_ids=positions, output_attentions=True)
    tr = trace(ours, idx, attention_mask=mask, stages=True)
    real = mask.bool()
    for i in range(len(ref.attentions)):
        for b in range(2):
            q = real[b]  # padded queries attend to nothing in attnlab (zero rows); compare real ones
            torch.testing.assert_close(tr.weights[i, b][:, q], ref.attentions[i][b][:, q], atol=1e-5, rtol=0)
            assert torch.all(tr.weights[i, b][:, :, ~real[b]] == 0)  # padding is never attended
    # Row 0 alone, unpadded, gives the same weights over its real tokens.
    alone = trace(ours, idx[:1, 4:])
    torch.testing.assert_close(tr.weights[:, 0][..., 4:, 4:], alone.weights[:, 0], atol=1e-6, rtol=0)


def test_stages_recompose_the_attention():
    model = sharp_gpt(n_kv_heads=2)  # grouped-query: 4 query heads share 2 key/value heads
    idx = torch.randint(0, 37, (2, 11), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, :3] = False
    tr = trace(model, idx, stages=True, attention_mask=mask)
    assert tr.q.shape == (3, 2, 4, 11, 8) and tr.k.shape == (3, 2, 2, 11, 8) and tr.v.shape == (3, 2, 2, 11, 8)
    for layer in range(3):
        st = tr.steps(layer)
        k = tr.k[layer].repeat_interleave(2, dim=1)  # (B, H, S, hd): query head h reads kv head h // 2
        v = tr.v[layer].repeat_interleave(2, dim=1)
        torch.testing.assert_close(st["scores"], tr.q[layer] @ k.transpose(-2, -1))
        torch.testing.assert_close(st["scaled"], st["scores"] / 8**0.5)
        allowed = torch.ones(11, 11, dtype=torch.bool).tril() & mask[:, None, None, :]  # (B, 1, T, S)
        assert torch.equal(st["masked"] == float("-inf"), ~allowed.expand_as(st["masked"]))
        torch.testing.assert_close(
            st["masked"][allowed.expand_as(st["masked"])], st["scaled"][allowed.expand_as(st["masked"])]
        )
        rows = allowed.expand_as(st["masked"]).any(-1)  # queries with a key (not row 1's padding)
        torch.testing.assert_close(torch.softmax(st["masked"], -1)[rows], st["weights"][rows], atol=1e-6, rtol=0)
        assert torch.all(st["weights"][~rows] == 0)
        torch.testing.assert_close(st["weights"] @ v, tr.head_outputs[layer], atol=1e-6, rtol=1e-5)
        att = model.trf_blocks[layer].att
        concat = tr.head_outputs[layer].transpose(1, 2).flatten(2)  # (B, T, H * hd)
        torch.testing.assert_close(att.out_proj(concat), tr.attn_output[layer], atol=1e-6, rtol=1e-5)
        # The residual stream: the next block's input is this one's plus attention plus MLP.
        block = model.trf_blocks[layer]
        mid = tr.residual[layer] + tr.attn_output[layer]
        torch.testing.assert_close(mid + block.ff(block.norm2(mid)), tr.residual[layer + 1], atol=1e-5, rtol=1e-5)
    assert tr.scores.shape == tr.masked.shape == tr.scaled.shape == (3, 2, 4, 11, 11)


def test_trace_records_the_weights_the_model_applies_and_restores_the_model(ref):
    model = sharp_gpt(drop_rate=0.2).train()
    idx = torch.randint(0, 37, (1, 7), generator=torch.Generator().manual_seed(5))
    seen = []
    hooks_before = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    with hooks(model, {"blocks.1.attn.hook_pattern": lambda x, hook: seen.append(x.shape)}):
        outer = model.trf_blocks[1].att.hook
        tr = trace(model, idx)
        assert model.training and len(seen) == 1  # a hook already set is called and kept
        assert model.trf_blocks[1].att.hook is outer and model.trf_blocks[0].att.hook is None
    assert [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()] == hooks_before
    assert tr.q is None and tr.residual is None
    with pytest.raises(ValueError, match="stages=True"):
        tr.steps(0)
    # Layer 0's weights against float64 loops on its real input (dropout off while tracing).
    model.eval()
    block = model.trf_blocks[0]
    x = block.norm1(model.tok_emb(idx) + model.pos_emb(torch.arange(7)))[0]  # (T, C)
    att = block.att
    q = att.W_query(x).view(7, 4, 8).transpose(0, 1)
    k = att.W_key(x).view(7, 4, 8).transpose(0, 1)
    v = att.W_value(x).view(7, 4, 8).transpose(0, 1)
    _, want = ref.loop_attention_nd(q, k, v, torch.ones(7, 7, dtype=torch.bool).tril())
    torch.testing.assert_close(tr.weights[0, 0].double(), want, atol=1e-6, rtol=0)
    with torch.no_grad():  # works under no_grad too, and without a tokenizer
        assert torch.equal(trace(model, idx[0]).weights, tr.weights)


def test_trace_refuses_what_it_cannot_trace():
    with pytest.raises(TypeError, match="attnlab GPT"):
        trace(torch.nn.Linear(2, 2), torch.zeros(1, 2, dtype=torch.long))
    model = sharp_gpt()
    with pytest.raises(ValueError, match="context_length"):
        trace(model, torch.zeros(1, 30, dtype=torch.long))
    with pytest.raises(TypeError, match="stages must be a bool"):
        trace(model, torch.zeros(1, 3, dtype=torch.long), stages="yes")
    # An error in the forward pass leaves no hook behind.
    boom = {"blocks.2.hook_mlp_out": lambda x, hook: (_ for _ in ()).throw(RuntimeError("boom"))}
    with pytest.raises(RuntimeError, match="boom"), hooks(model, boom):
        trace(model, torch.zeros(1, 3, dtype=torch.long))
    assert all(b.hook is None and b.att.hook is None for b in model.trf_blocks)


# --------------------------------------------------------------------------------------------
# Rollout and the logit lens
# --------------------------------------------------------------------------------------------
def _rollout_loops(weights: torch.Tensor, fusion: str) -> torch.Tensor:
    """Rollout by explicit loops in float64: weights (L, H, T, T) of one sequence."""
    L, H, T, _ = weights.shape
    w = weights.double().tolist()
    result = None
    for layer in range(L):
        a = [[0.0] * T for _ in range(T)]
        for i, j in itertools.product(range(T), range(T)):
            vals = [w[layer][h][i][j] for h in range(H)]
            fused = sum(vals) / H if fusion == "mean" else (max(vals) if fusion == "max" else min(vals))
            a[i][j] = fused + (1.0 if i == j else 0.0)
        for i in range(T):
            s = sum(a[i])
            a[i] = [x / s for x in a[i]]
        if result is None:
            result = a
        else:  # result = a @ result
            result = [[sum(a[i][m] * result[m][j] for m in range(T)) for j in range(T)] for i in range(T)]
    return torch.tensor(result, dtype=torch.float64)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
def test_rollout_matches_float64_loops(fusion):
    model = sharp_gpt()
    tr = trace(model, torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(4)))
    got = rollout(tr, head_fusion=fusion)
    assert got.shape == (2, 9, 9)
    for b in range(2):
        torch.testing.assert_close(got[b].double(), _rollout_loops(tr.weights[:, b], fusion), atol=1e-5, rtol=0)
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 9))
    with pytest.raises(ValueError, match="head_fusion"):
        rollout(tr, head_fusion="median")


@pytest.mark.parametrize("T", [161, 333, 700])
def test_rollout_of_a_long_causal_trace_equals_the_dense_float64_product(T):
    """Long causal traces multiply only the lower triangles (in halves, recursively): the same as the
    dense float64 chain of the fused, renormalised layers."""
    model = sharp_gpt(context_length=T, n_layers=3)
    tr = trace(model, torch.randint(0, 37, (1, T), generator=torch.Generator().manual_seed(5)))
    for fusion, fuse in (("mean", torch.mean), ("max", torch.amax)):
        a = fuse(tr.weights.double(), dim=2) + torch.eye(T, dtype=torch.float64)  # (L, B, T, T)
        a = a / a.sum(-1, keepdim=True)
        want = a[2] @ a[1] @ a[0]
        torch.testing.assert_close(rollout(tr, head_fusion=fusion).double(), want, atol=1e-6, rtol=1e-5)


def test_logit_lens_last_layer_is_the_models_own_prediction_and_earlier_ones_read_hf_hidden_states():
    hf = hf_gpt2(seed=7)
    ours = GPT.from_hf_gpt2(hf)
    idx = torch.randint(0, 61, (1, 12), generator=torch.Generator().manual_seed(3))
    tr = trace(ours, idx, stages=True)
    lens = logit_lens(ours, tr, k=4)
    L = len(hf.transformer.h)
    assert lens.tokens.shape == lens.probs.shape == (L + 1, 1, 12, 4)
    top = torch.topk(torch.softmax(tr.logits, -1), 4, dim=-1)
    assert torch.equal(lens.tokens[L], top.indices)
    torch.testing.assert_close(lens.probs[L], top.values)
    with torch.no_grad():
        hidden = hf(idx, output_hidden_states=True).hidden_states
        for layer in range(L):  # Hugging Face's stream through its own ln_f and lm_head
            p = torch.softmax(hf.lm_head(hf.transformer.ln_f(hidden[layer])), -1)
            torch.testing.assert_close(lens.probs[layer], torch.topk(p, 4, -1).values, atol=1e-5, rtol=1e-4)
            final = tr.logits.argmax(-1, keepdim=True)
            torch.testing.assert_close(
                lens.final_token_probs[layer], p.gather(-1, final).squeeze(-1), atol=1e-5, rtol=1e-4
            )
    with pytest.raises(ValueError, match="stages=True"):
        logit_lens(ours, trace(ours, idx))


# --------------------------------------------------------------------------------------------
# Head roles on a model built to have them
# --------------------------------------------------------------------------------------------
V_ROLE, C_ROLE = 16, 32
TOK, POS, PREV, SINK = 0, 16, 48, 191


def role_model() -> GPT:
    """Two layers of three heads whose roles are known by construction.

    The residual stream has one-hot blocks: the token (TOK), the position (POS) and, written by
    layer 0 head 0, the previous token (PREV). Every projection's rows sum to zero (through the SINK
    column), so LayerNorm's mean subtraction cancels and each head sees its one-hot inputs scaled.

    Layer 0: head 0 previous-token (q = position i, k = position j + 1; its value, the token, is
    written to PREV), head 1 first-token, head 2 self. Layer 1: head 0 induction (q = the token,
    k = the token before j, read from PREV), head 1 duplicate-token (same token, not itself),
    head 2 uniform (no role).
    """
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=V_ROLE, context_length=C_ROLE, emb_dim=192, n_heads=3, n_layers=2, drop_rate=0.0)
    model = GPT(cfg).eval()
    M = 2.0
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for ln in [model.final_norm, *[m for b in model.trf_blocks for m in (b.norm1, b.norm2)]]:
            ln.weight.fill_(1.0)
        for t in range(V_ROLE):
            model.tok_emb.weight[t, TOK + t] = 10.0
        for i in range(C_ROLE):
            model.pos_emb.weight[i, POS + i] = 10.0
        a0, a1 = model.trf_blocks[0].att, model.trf_blocks[1].att
        hd = 64
        q0, k0, v0 = a0.W_query.weight, a0.W_key.weight, a0.W_value.weight
        for i in range(C_ROLE):
            q0[0 * hd + i, POS + i] = M  # head 0: previous token
            if i + 1 < hd:
                k0[0 * hd + i + 1, POS + i] = 1.0
            q0[1 * hd + 0, POS + i] = M  # head 1: first token
            q0[2 * hd + i, POS + i] = M  # head 2: self
            k0[2 * hd + i, POS + i] = 1.0
        k0[1 * hd + 0, POS + 0] = 1.0
        for t in range(V_ROLE):
            v0[0 * hd + t, TOK + t] = 1.0  # head 0 carries the token...
            a0.out_proj.weight[PREV + t, 0 * hd + t] = 1.0  # ... into PREV
        q1, k1 = a1.W_query.weight, a1.W_key.weight
        for t in range(V_ROLE):
            q1[0 * hd + t, TOK + t] = M  # head 0: induction
            k1[0 * hd + t, PREV + t] = 1.0
            q1[1 * hd + t, TOK + t] = M  # head 1: duplicate token...
            k1[1 * hd + t, TOK + t] = 1.0
        for i in range(C_ROLE):
            q1[1 * hd + 16 + i, POS + i] = M  # ... but not itself
            k1[1 * hd + 16 + i, POS + i] = -1.0
        for w in (q0, k0, v0, q1, k1, a1.W_value.weight):
            w[:, SINK] = -w.sum(dim=1)
    return model


def test_head_scores_find_heads_built_for_each_role():
    model = role_model()
    scores = all_head_scores(model)
    expected = {
        "previous-token": (0, 0),
        "first-token": (0, 1),
        "self": (0, 2),
        "induction": (1, 0),
        "duplicate-token": (1, 1),
    }
    for kind, (layer, head) in expected.items():
        s = head_scores(model, kind)
        assert s.shape == (2, 3) and torch.equal(s, scores[kind])
        assert bool(((s >= 0) & (s <= 1 + 1e-6)).all())
        assert s[layer, head] > 0.9, (kind, s)
        others = s.clone()
        others[layer, head] = 0
        assert others.max() < 0.6, (kind, s)
    assert scores["induction"][1, 2] < 0.2 and scores["duplicate-token"][1, 2] < 0.2  # the uniform head


def test_head_scores_on_a_given_trace_use_its_tokens_and_padding():
    model = role_model()
    idx = torch.tensor([[3, 3, 5, 7, 1, 5, 7, 2], [0, 9, 4, 6, 9, 4, 8, 8]])
    mask = torch.ones_like(idx, dtype=torch.bool)
    mask[0, 0] = False  # row 0: the first 3 is padding
    tr = trace(model, idx, attention_mask=mask)
    w = tr.weights  # (L, B, H, T, T)
    # Duplicate-token by hand: queries with an earlier real copy of their token.
    want = []
    for layer, h in itertools.product(range(2), range(3)):
        vals = []
        for b, i in itertools.product(range(2), range(8)):
            if not mask[b, i]:
                continue
            js = [j for j in range(i) if mask[b, j] and idx[b, j] == idx[b, i]]
            if js:
                vals.append(float(sum(w[layer, b, h, i, j] for j in js)))
        want.append(sum(vals) / len(vals))
    got = head_scores(model, "duplicate-token", trace=tr)
    torch.testing.assert_close(got.flatten().double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=0)
    # Induction by hand: the token after an earlier copy. Row 0: 5 (at 5) -> 7 (at 3), 7 (at 6) -> 1 (at 4);
    # row 1: 9 (at 4) -> 4 (at 2), 4 (at 5) -> 6 (at 3); the second 8 has no earlier successor.
    got = head_scores(model, "induction", trace=tr)
    for layer, h in itertools.product(range(2), range(3)):
        vals = [w[layer, 0, h, 5, 3], w[layer, 0, h, 6, 4], w[layer, 1, h, 4, 2], w[layer, 1, h, 5, 3]]
        assert float(got[layer, h]) == pytest.approx(float(sum(vals)) / 4, abs=1e-6)
    first = head_scores(model, "first-token", trace=tr)  # row 0's first real token is position 1
    want = (w[:, 0, :, 2:, 1].sum(-1) + w[:, 1, :, 1:, 0].sum(-1)) / (6 + 7)
    torch.testing.assert_close(first, want, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="no query"):
        head_scores(model, "induction", trace=trace(model, torch.arange(6)[None]))
    with pytest.raises(ValueError, match="kind must be one of"):
        head_scores(model, "copying")


def test_repeated_tokens_are_distinct_within_each_copy():
    x = repeated_tokens(50, 40, seed=3, batch=2)
    assert x.shape == (2, 40) and torch.equal(x[:, :20], x[:, 20:])
    assert all(len(set(row[:20].tolist())) == 20 for row in x)
    assert torch.equal(x, repeated_tokens(50, 40, seed=3, batch=2))
    assert not torch.equal(x, repeated_tokens(50, 40, seed=4, batch=2))
    with pytest.raises(ValueError, match="batch must be a positive int"):  # (torch's "stack expects a non-empty")
        repeated_tokens(50, 40, batch=0)


# --------------------------------------------------------------------------------------------
# Ablation
# --------------------------------------------------------------------------------------------
def test_ablating_heads_equals_zeroing_their_columns_of_the_output_projection():
    model = sharp_gpt()
    idx = torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(6))
    heads = [(0, 1), (2, 3), (2, 0)]
    with torch.no_grad():
        before = model(idx)
        with ablate(model, heads) as pairs:
            got = model(idx)
        assert pairs == sorted(heads)
        assert torch.equal(model(idx), before)  # hooks gone
        reference = GPT(model.config).eval()
        reference.load_state_dict(model.state_dict())
        for layer, h in heads:
            reference.trf_blocks[layer].att.out_proj.weight[:, h * 8 : (h + 1) * 8] = 0
        torch.testing.assert_close(got, reference(idx), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(got, before)


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_an_ablation_holds_while_hook_result_is_hooked(mode):
    # Regression: with hook_result hooked (run_with_cache's default names hook every point), the layer
    # projects each head apart and out_proj, where ablate works, never ran: the clean run came back.
    from attnlab.interpret import run_with_cache

    model = sharp_gpt()
    idx = torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(7))
    with torch.no_grad(), ablate(model, [(1, 2)], mode=mode):
        want = model(idx)
        got, cache = run_with_cache(model, idx)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, model(idx), atol=1e-4)  # (the ablation changes the logits)
    if mode == "zero":
        assert not cache["blocks.1.attn.hook_result"][..., 2, :].any()


def test_out_projs_pre_hooks_with_kwargs_run_while_hook_result_is_hooked():
    from attnlab.interpret import run_with_cache

    model = sharp_gpt()
    idx = torch.randint(0, 37, (1, 8), generator=torch.Generator().manual_seed(9))

    def halve(module, args, kwargs):
        return (args[0] * 0.5,), kwargs

    handle = model.trf_blocks[1].att.out_proj.register_forward_pre_hook(halve, with_kwargs=True)
    try:
        with torch.no_grad():
            want = model(idx)
            got, _ = run_with_cache(model, idx)
    finally:
        handle.remove()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, model(idx), atol=1e-4)


def test_mean_ablation_replaces_a_head_with_its_average_output():
    model = sharp_gpt()
    idx = torch.randint(0, 37, (1, 10), generator=torch.Generator().manual_seed(8))
    tr = trace(model, idx, stages=True)
    mean = tr.head_outputs[1, 0, 2].mean(0)  # (hd,) head 2 of layer 1, over the tokens
    with torch.no_grad():
        ref = GPT(model.config).eval()
        ref.load_state_dict(model.state_dict())
        att = ref.trf_blocks[1].att
        att.out_proj.bias += att.out_proj.weight[:, 16:24] @ mean  # the mean, as a constant
        att.out_proj.weight[:, 16:24] = 0
        with ablate(model, ["1.2"], mode="mean", reference=idx):
            torch.testing.assert_close(model(idx), ref(idx), atol=1e-5, rtol=1e-5)
        with ablate(model, "1.2", mode="mean"):  # no reference: the mean over this call's tokens
            torch.testing.assert_close(model(idx), ref(idx), atol=1e-5, rtol=1e-5)


def test_ablation_effect_reports_loss_and_next_token_change():
    model = sharp_gpt()
    idx = torch.randint(0, 37, (1, 12), generator=torch.Generator().manual_seed(9))
    effect = ablation_effect(model, idx, [(0, 0), (1, 1)])
    with torch.no_grad():
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], idx[0, 1:])
        with ablate(model, [(0, 0), (1, 1)]):
            after = model(idx)
    assert effect.loss_before == pytest.approx(float(loss), abs=1e-6)
    loss_after = torch.nn.functional.cross_entropy(after[0, :-1], idx[0, 1:])
    assert effect.loss_after == pytest.approx(float(loss_after), abs=1e-6)
    assert effect.loss_change == pytest.approx(float(loss_after - loss), abs=1e-6)
    p, q = torch.softmax(logits[0, -1], -1), torch.softmax(after[0, -1], -1)
    assert float(effect.kl[0]) == pytest.approx(float((p * (p.log() - q.log())).sum()), abs=1e-6)
    assert [t for t, _ in effect.top(3)] == torch.topk(p, 3).indices.tolist()
    assert [t for t, _ in effect.top(3, after=True)] == torch.topk(q, 3).indices.tolist()


@pytest.mark.parametrize(
    ("heads", "message"),
    [([(3, 0)], "does not exist"), ([(0, 4)], "does not exist"), (["0-1"], "'L.H' strings"), ([], "at least one")],
)
def test_ablate_refuses_heads_that_do_not_exist(heads, message):
    model = sharp_gpt()
    with pytest.raises(ValueError, match=message), ablate(model, heads):
        pass
    with pytest.raises(ValueError, match="mode"), ablate(model, [(0, 0)], mode="noise"):
        pass


# --------------------------------------------------------------------------------------------
# Generation and next-token probabilities
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=0.0),
        dict(temperature=0.8, top_k=5),
        dict(temperature=1.3, top_p=0.7),
        dict(temperature=1.0, top_k=8, top_p=0.9, eos_id=3),
    ],
)
@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_trace_makes_the_tokens_generate_makes(sampling, use_cache):
    model = sharp_gpt(context_length=16)
    idx = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(10))
    want = model.generate(idx, 14, generator=torch.Generator().manual_seed(11), use_cache=use_cache, **sampling)
    got = trace_generation(
        model, idx, 14, generator=torch.Generator().manual_seed(11), use_cache=use_cache, candidates=5, **sampling
    )
    assert torch.equal(got.tokens, want)
    assert len(got.steps) == want.shape[1] - 6
    config = SamplingConfig(sampling.get("temperature", 1.0), sampling.get("top_k"), sampling.get("top_p"))
    for s, step in enumerate(got.steps):
        assert step.position == 6 + s and torch.equal(step.token, want[:, 6 + s])
        # The step's attention row is what a plain pass over the window gives its last token.
        window = want[:, step.key_start : step.position]
        full = trace(model, window)
        torch.testing.assert_close(step.weights, full.weights[:, :, :, -1], atol=1e-5, rtol=0)
        probs = config.probabilities(model(window)[:, -1])  # (B, V)
        top = torch.topk(probs, 5, dim=-1)
        torch.testing.assert_close(step.probs, top.values, atol=1e-5, rtol=0)
        torch.testing.assert_close(step.token_prob, probs.gather(-1, step.token[:, None])[:, 0], atol=1e-5, rtol=0)
        assert bool((step.token_prob > 0).all()) or "eos_id" in sampling
    if use_cache:  # the window slid past the 16-token context: keys start later
        assert got.steps[-1].key_start > 0


@pytest.mark.parametrize(
    "preset, sampling",
    [
        ("gpt2", dict(temperature=0.0)),
        ("gpt2", dict(temperature=0.9, top_k=6)),
        ("modern", dict(temperature=1.2, top_p=0.8)),
        ("modern", dict(temperature=1.0, eos_id=5)),
    ],
)
def test_generation_from_the_prompts_trace_equals_generation_from_the_prompt(preset, sampling):
    """prefix=: the trace's keys and values seed the cache instead of a prompt pass; the tokens, each
    step's attention and candidates are those of the plain trace_generation (and of generate)."""
    torch.manual_seed(3)
    cfg = GPTConfig.preset(preset, vocab_size=41, context_length=32, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 41, (2, 9), generator=torch.Generator().manual_seed(4))
    tr = trace(model, idx, stages=True)
    passes = []
    hook = model.trf_blocks[0].register_forward_pre_hook(lambda m, args: passes.append(args[0].shape[1]))
    eager = trace_generation(model, idx, 10, generator=torch.Generator().manual_seed(5), prefix=tr, **sampling)
    assert passes and 9 not in passes  # the prompt was not run again (a hooked model: eager steps)
    hook.remove()
    got = trace_generation(model, idx, 10, generator=torch.Generator().manual_seed(5), prefix=tr, **sampling)
    want = trace_generation(model, idx, 10, generator=torch.Generator().manual_seed(5), **sampling)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(eager.tokens, want.tokens)
    assert torch.equal(got.tokens, model.generate(idx, 10, generator=torch.Generator().manual_seed(5), **sampling))
    assert len(got.steps) == len(want.steps)
    for a, b in zip(got.steps, want.steps, strict=True):
        assert (a.position, a.key_start) == (b.position, b.key_start) and torch.equal(a.key_index, b.key_index)
        torch.testing.assert_close(a.weights, b.weights, atol=1e-6, rtol=0)
        torch.testing.assert_close(a.probs, b.probs, atol=1e-6, rtol=0)
        assert torch.equal(a.candidates[a.probs > 1e-4], b.candidates[b.probs > 1e-4])
    # Where the cache would slide (more tokens than the context), or another prompt: the usual path.
    long = trace_generation(model, idx, 30, generator=torch.Generator().manual_seed(5), prefix=tr, **sampling)
    assert torch.equal(long.tokens, model.generate(idx, 30, generator=torch.Generator().manual_seed(5), **sampling))
    other = trace_generation(model, idx.flip(1), 3, prefix=tr, generator=torch.Generator().manual_seed(5))
    assert torch.equal(other.tokens, model.generate(idx.flip(1), 3, generator=torch.Generator().manual_seed(5)))
    with pytest.raises(TypeError, match="prefix"):
        trace_generation(model, idx, 3, prefix="trace")
    # No new token, or a bad count: the same answer with the prefix as without.
    none = trace_generation(model, idx, 0, prefix=tr)
    assert torch.equal(none.tokens, idx) and not none.steps
    for bad in (True, -1, 2.0):
        with pytest.raises(ValueError, match=f"max_new_tokens must be a non-negative int, got {bad!r}"):
            trace_generation(model, idx, bad, prefix=tr)
        with pytest.raises(ValueError, match=f"max_new_tokens must be a non-negative int, got {bad!r}"):
            trace_generation(model, idx, bad)


@pytest.mark.parametrize("overrides", [{}, {"pos": "rope"}])
def test_generation_trace_with_a_left_padded_batch(overrides):
    model = sharp_gpt(**overrides)
    idx = torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(12))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[0, :3] = False
    want = model.generate(idx, 5, attention_mask=mask, generator=torch.Generator().manual_seed(1))
    got = trace_generation(model, idx, 5, attention_mask=mask, generator=torch.Generator().manual_seed(1))
    assert torch.equal(got.tokens, want)
    for step in got.steps:
        assert torch.all(step.weights[:, 0, :, :3] == 0)  # padding never attended
        S = step.weights.shape[-1]
        every = torch.arange(step.position - S, step.position)  # (S,) the token in each key, in order
        assert torch.equal(step.key_index[1], every)
        # the padded row's padding is no token (-1); learned positions too (it was numbered as tokens 0-2)
        assert torch.equal(step.key_index[0], torch.where(every < 3, -1, every))


def test_generation_trace_with_sinks_and_a_left_padded_batch_is_the_eager_trace():
    """Window layers with sinks beside a global one, a left-padded batch: the first token's rows are the
    eager trace's last query's, each weight on the token key_index names (the layers hold as many keys
    in other slots: the global layer's cache starts with the sinks)."""
    model = sharp_gpt(pos="rope", window=6, window_layers=[0, 1], sinks=2)
    idx = torch.randint(0, 37, (2, 14), generator=torch.Generator().manual_seed(15))
    mask = torch.ones(2, 14, dtype=torch.bool)
    mask[0, :4] = False
    got = trace_generation(model, idx, 2, attention_mask=mask, temperature=0)
    want = trace(model, idx, attention_mask=mask).weights[:, :, :, -1]  # (L, B, H, T), keys in order
    step = got.steps[0]
    for b in range(2):
        index = step.key_index[b]
        held = index >= 0
        torch.testing.assert_close(step.weights[:, b][..., held], want[:, b][..., index[held]])
        assert torch.all(step.weights[:, b][..., ~held] == 0)
    assert torch.equal(got.tokens, model.generate(idx, 2, attention_mask=mask, temperature=0))


def test_generation_trace_of_a_prompt_longer_than_the_context():
    """A RoPE model's prompt longer than its context fills the cache in passes of the context (a ring):
    one step a new token, the first from the prompt's last pass, the tokens generate's."""
    model = sharp_gpt(pos="rope", context_length=8)
    idx = torch.randint(0, 37, (2, 19), generator=torch.Generator().manual_seed(14))  # 3 passes of 8
    want = model.generate(idx, 4, temperature=0)
    got = trace_generation(model, idx, 4, temperature=0)
    assert torch.equal(got.tokens, want) and len(got.steps) == 4
    for step in got.steps:  # the ring's 8 tokens (the last pass of the prompt: and its own 3 after them)
        S = step.weights.shape[-1]
        assert (11 if step.position == 19 else 8) == S
        torch.testing.assert_close(step.weights.sum(-1), torch.ones(3, 2, 4))
        assert sorted(step.key_index[0].tolist()) == list(range(step.position - S, step.position))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, None), (0.5, 4, None), (1.7, None, 0.6), (0.9, 6, 0.8), (0.0, None, None)],
)
def test_next_token_probabilities_are_what_sampling_draws_from(temperature, top_k, top_p):
    model = sharp_gpt()
    tr = trace(model, torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(13)))
    p = next_token_probabilities(tr, temperature=temperature, top_k=top_k, top_p=top_p)
    assert p.shape == tr.logits.shape
    torch.testing.assert_close(p.sum(-1), torch.ones(2, 9))
    config = SamplingConfig(temperature, top_k, top_p)
    for b, t in itertools.product(range(2), range(9)):
        torch.testing.assert_close(p[b, t], config.probabilities(tr.logits[b, t][None])[0])
    if top_k:
        assert bool(((p > 0).sum(-1) <= top_k).all())
    if temperature == 0:
        assert torch.equal(p.argmax(-1), tr.logits.argmax(-1)) and bool((p.max(-1).values == 1).all())
    with pytest.raises(ValueError, match="temperature"):
        next_token_probabilities(tr, temperature=-1)


# --------------------------------------------------------------------------------------------
# The tutorials' modules
# --------------------------------------------------------------------------------------------
def test_records_of_the_tutorials_modules_show_their_numbers():
    from attnlab import CausalAttention, MultiHeadAttention, MultiHeadAttentionWrapper, SelfAttention_v2
    from attnlab.functional import simple_self_attention
    from attnlab.tutorial_code import INPUTS
    from tutorial_numbers import CAUSAL_WEIGHTS, SA_V2_WEIGHTS, WEIGHTS

    rec = record_module(simple_self_attention, INPUTS)
    torch.testing.assert_close(rec.weights[0, 0], torch.tensor(WEIGHTS), atol=1e-4, rtol=0)
    torch.testing.assert_close(rec.q[0, 0] @ rec.k[0, 0].T, INPUTS @ INPUTS.T)
    torch.manual_seed(789)
    rec = record_module(SelfAttention_v2(3, 2), INPUTS)
    torch.testing.assert_close(rec.weights[0, 0], torch.tensor(SA_V2_WEIGHTS), atol=1e-4, rtol=0)
    torch.manual_seed(789)
    causal = CausalAttention(3, 2, 6, 0.0)
    rec = record_module(causal, INPUTS)
    torch.testing.assert_close(rec.weights[0, 0], torch.tensor(CAUSAL_WEIGHTS), atol=1e-4, rtol=0)
    assert rec.is_causal and rec.scale == pytest.approx(2**-0.5)
    torch.testing.assert_close(rec.weights[0, 0] @ rec.v[0, 0], causal(INPUTS))
    for cls in (MultiHeadAttentionWrapper, MultiHeadAttention):
        torch.manual_seed(123)
        module = cls(3, 2, 6, 0.0, num_heads=2)
        rec = record_module(module, INPUTS)
        assert rec.weights.shape == (1, 2, 6, 6)
        torch.testing.assert_close(rec.weights[0], module(INPUTS, return_weights=True)[1])
        torch.testing.assert_close(rec.weights @ rec.v, rec.head_outputs)
    with pytest.raises(TypeError, match="tutorials' attention modules"):
        record_module(torch.nn.Linear(3, 3), INPUTS)


# --------------------------------------------------------------------------------------------
# The page's data
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f32", "u16", "u8", "i32"])
@pytest.mark.parametrize("tri", [False, True])
@pytest.mark.parametrize("blob", [False, True])
def test_packed_arrays_round_trip(dtype, tri, blob):
    g = torch.Generator().manual_seed(0)
    t = torch.rand(3, 5, 5, generator=g).tril() if dtype != "i32" else torch.randint(0, 1000, (3, 5, 5)).tril()
    data = {"a": pack(t, dtype, tri=tri), "nested": [{"b": pack(t[0], dtype)}], "x": 1}
    back = unpack(to_json(data, blob=blob))
    step = {"f32": 0.0, "i32": 0.0, "u16": 0.5 / 65535, "u8": 0.5 / 255}[dtype]
    torch.testing.assert_close(back["a"].double(), t.double(), atol=step + 1e-7, rtol=0)
    torch.testing.assert_close(back["nested"][0]["b"].double(), t[0].double(), atol=step + 1e-7, rtol=0)
    assert back["x"] == 1 and "blob" not in back


COMPRESSORS = ["zlib"] + (["isal"] if importlib.util.find_spec("isal") else [])


@settings(max_examples=8, deadline=None)
@given(
    parts=st.integers(1, 5),
    size=st.integers(1 << 20, 3 << 20),
    seed=st.integers(0, 9),
    level=st.sampled_from([1, 6]),
    library=st.sampled_from(COMPRESSORS),
)
def test_deflate_in_pieces_is_one_zlib_stream(parts, size, seed, level, library):
    """The page's blob compressed in pieces on threads (by zlib, or ISA-L where it is installed): one
    zlib stream (header, segments, Adler-32) that zlib (and so the browser's DecompressionStream) reads
    back whole, ending exactly at its end."""
    g = torch.Generator().manual_seed(seed)
    raw = (torch.randint(0, 7, (size,), generator=g, dtype=torch.uint8) * 37).numpy().tobytes()  # compressible
    out = deflate(raw, level, parts, library=importlib.import_module("isal.isal_zlib" if library == "isal" else "zlib"))
    d = zlib.decompressobj()
    assert d.decompress(out) == raw and d.eof and d.unused_data == b""
    assert len(out) < len(raw)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 100), parts=st.integers(1, 9))
def test_split_covers_the_buffer_in_at_most_parts_pieces(size, parts):
    raw = bytes(range(size))
    pieces = split(raw, parts)
    assert b"".join(pieces) == raw and 1 <= len(pieces) <= max(1, min(parts, size))
    assert len({len(p) for p in pieces[:-1]}) <= 1 and len(pieces[-1]) <= len(pieces[0])  # equal, the last shorter
    assert on_threads(bytes, pieces) == [bytes(p) for p in pieces]  # in order, whatever thread ran each


def test_inspector_data_holds_what_the_library_computes(gpt2):
    hf = hf_gpt2(vocab=50257, n_embd=32, ctx=24)
    model = GPT.from_hf_gpt2(hf)
    text = "The cat sat on the mat. The cat sat"
    idx = torch.tensor([gpt2.encode(text)])
    tr = trace(model, idx, stages=True, tokenizer=gpt2)
    gen = trace_generation(model, idx, 3, temperature=0.7, top_k=20, generator=torch.Generator().manual_seed(0))
    data = inspector_data(tr, generation=gen, steps=["0.1", (2, 3)])
    back = read_page_data(render_page(data))
    T = idx.shape[1]
    assert back["tokens"] == [gpt2.decode([i]) for i in idx[0].tolist()] and back["text"] == text
    assert back["precision"] == "f32"
    for layer in range(3):
        torch.testing.assert_close(back["layers"][layer]["weights"], tr.weights[layer, 0], atol=0, rtol=0)
    steps = {(s["row"], s["head"]): s for s in back["steps"]["heads"]}
    assert sorted(steps) == [(0, 1), (2, 3)] and back["steps"]["omitted"] == 10
    st = tr.steps(2)
    s = steps[2, 3]
    torch.testing.assert_close(s["scores"], st["scores"][0, 3])
    assert torch.equal(s["allowed"] == 1, st["masked"][0, 3] != float("-inf"))
    torch.testing.assert_close(s["weights"], st["weights"][0, 3], atol=0, rtol=0)
    torch.testing.assert_close(s["head_outputs"], st["head_outputs"][0, 3], atol=0, rtol=0)
    assert s["bias"] is None and s["scale"] == tr.scale[2]
    for f in ("mean", "max", "min"):
        torch.testing.assert_close(back["rollout"][f], rollout(tr, head_fusion=f)[0])
    lens = logit_lens(model, tr)
    assert torch.equal(back["lens"]["ids"].long(), lens.tokens[:, 0])
    roles = all_head_scores(model)
    for kind in HEAD_KINDS:
        torch.testing.assert_close(back["roles"]["scores"][kind], roles[kind])
    nxt = back["next"]
    for ti, temp in enumerate(nxt["temperatures"]):
        p = next_token_probabilities(tr, temperature=temp)[0]  # (T, V)
        torch.testing.assert_close(nxt["probs"][ti], p.gather(-1, nxt["ids"].long()), atol=1e-7, rtol=0)
    assert nxt["ids"].shape == (T, 32)
    g = back["generation"]
    assert g["tokens"] == gen.tokens[0].tolist() and len(g["steps"]) == 3
    torch.testing.assert_close(g["steps"][1]["weights"], gen.steps[1].weights[:, 0])
    assert all(str(i) in back["vocab"] for i in g["tokens"])
    assert "<iframe" in tr._repr_html_()


def test_inspector_data_drops_padding_and_picks_step_heads_by_budget(monkeypatch):
    import attnlab.interpret.inspector as inspector

    model = sharp_gpt()
    idx = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, :3] = False
    tr = trace(model, idx, stages=True, attention_mask=mask)
    data = read_page_data(render_page(inspector_data(tr, row=1)))
    assert data["tokens"] == [f"#{i}" for i in idx[1, 3:].tolist()]
    alone = trace(model, idx[1:, 3:], stages=True)
    torch.testing.assert_close(data["layers"][0]["weights"], alone.weights[0, 0], atol=1e-6, rtol=0)
    torch.testing.assert_close(data["rollout"]["mean"], rollout(alone)[0], atol=1e-6, rtol=0)
    assert len(data["steps"]["heads"]) == 12  # everything fits
    monkeypatch.setattr(inspector, "STEPS_BUDGET", 3 * inspector.steps_cost(5, 5, 8))
    data = inspector_data(tr, row=1)
    assert (data["steps"]["heads"][0]["row"], data["steps"]["heads"][0]["head"]) == (0, 0)
    assert len(data["steps"]["heads"]) == 3 and data["steps"]["omitted"] == 9
    monkeypatch.setattr(inspector, "WEIGHTS_BUDGET", 10)
    assert read_page_data(render_page(inspector_data(tr)))["precision"] == "u8"
    with pytest.raises(ValueError, match="row must be"):
        inspector_data(tr, row=2)


def test_trace_is_a_dataclass_with_the_documented_fields():
    model = sharp_gpt()
    tr = trace(model, torch.zeros(1, 4, dtype=torch.long), stages=True)
    assert isinstance(tr, Trace) and tr.n_layers == 3 and tr.n_heads == 4 and tr.has_stages
    assert tr.residual.shape == (4, 1, 4, 32) and tr.logits.shape == (1, 4, 37)


def test_generation_trace_maps_keys_to_tokens_for_modules_with_positions():
    """With RoPE modules the records carry positions; when the window slides, generation re-encodes it
    from position 0, so positions are not token indices: the trace maps every key to its token."""
    from attnlab.attention import MultiHeadAttention

    model = sharp_gpt(context_length=12)
    for block in model.trf_blocks:
        rotary = MultiHeadAttention(32, 32, 12, 0.0, num_heads=4, rope=True)
        rotary.load_state_dict(block.att.state_dict())
        block.att = rotary
    idx = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(14))
    want = model.generate(idx, 12, generator=torch.Generator().manual_seed(2))
    got = trace_generation(model, idx, 12, generator=torch.Generator().manual_seed(2))
    assert torch.equal(got.tokens, want)
    for step in got.steps:
        S = step.weights.shape[-1]
        assert torch.equal(step.key_index[0], torch.arange(step.position - S, step.position))
        window = want[:, step.key_index[0, 0] : step.position]
        torch.testing.assert_close(step.weights, trace(model, window).weights[:, :, :, -1], atol=1e-5, rtol=0)
    assert got.steps[-1].key_start > 0  # the window slid


@pytest.mark.parametrize("kind", [dict(rope=True, window=4), dict(alibi=True), dict(alibi=True, window=5, sinks=1)])
def test_stages_recompose_what_modules_with_positions_compute(kind):
    """RoPE rotates q and k, ALiBi adds a bias, a window masks: the record says so and the steps
    (scores from the rotated q and k, the mask or bias applied) recompose the weights applied."""
    from attnlab.attention import MultiHeadAttention

    model = sharp_gpt()
    for block in model.trf_blocks:
        att = MultiHeadAttention(32, 32, 24, 0.0, num_heads=4, **kind)
        att.load_state_dict(block.att.state_dict())
        block.att = att
    idx = torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(15))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, :2] = False
    tr = trace(model, idx, stages=True, attention_mask=mask)
    for layer in range(3):
        st = tr.steps(layer)
        rows = (st["masked"] != float("-inf")).any(-1)
        torch.testing.assert_close(torch.softmax(st["masked"], -1)[rows], st["weights"][rows], atol=2e-6, rtol=0)
        torch.testing.assert_close(st["weights"] @ tr.v[layer], tr.head_outputs[layer], atol=1e-6, rtol=1e-5)
        if kind.get("window"):  # nothing beyond the window (the sink excepted)
            far = torch.ones(10, 10, dtype=torch.bool).tril(-kind["window"])
            far[:, : kind.get("sinks", 0)] = False
            assert torch.all(st["weights"][0][:, far] == 0)
    data = read_page_data(render_page(inspector_data(tr, steps=["1.2"])))
    (head,) = data["steps"]["heads"]
    if kind.get("alibi"):  # the page keeps the bias, so it can show masked = scaled + bias
        st = tr.steps(1)
        allowed = st["masked"][0, 2] != float("-inf")
        torch.testing.assert_close(head["bias"][allowed], (st["masked"] - st["scaled"])[0, 2][allowed])
    else:
        assert head["bias"] is None


def test_a_modern_gpt_rolling_cache_generation_and_page():
    """The 'modern' preset (RoPE, RMSNorm, QK-norm, a sliding window of the context): generation runs a
    ring cache whose slots hold keys out of order; each step's weights, put back at their tokens,
    are the last row of a plain pass over everything generated so far."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("modern", vocab_size=50, context_length=8, emb_dim=32, n_heads=4, n_layers=2)).eval()
    idx = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(16))
    want = model.generate(idx, 12, top_k=10, generator=torch.Generator().manual_seed(3))
    got = trace_generation(model, idx, 12, top_k=10, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got.tokens, want)
    assert any(not torch.equal(s.key_index[0], s.key_index[0].sort().values) for s in got.steps)  # a ring
    for step in got.steps:
        full = trace(model, want[:, : step.position]).weights[:, 0, :, -1]  # (L, H, position)
        placed = torch.zeros_like(full)
        placed[:, :, step.key_index[0]] = step.weights[:, 0]
        torch.testing.assert_close(placed, full, atol=1e-5, rtol=0)
    tr = trace(model, want[:, :8], stages=True)
    lens = logit_lens(model, tr)
    assert torch.equal(lens.tokens[-1, 0, :, 0], tr.logits[0].argmax(-1))
    data = read_page_data(render_page(inspector_data(tr, generation=got)))
    assert data["generation"]["steps"][-1]["key_index"] == got.steps[-1].key_index[0].tolist()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 3),
    blocks=st.integers(16, 80),
    k=st.integers(1, 20),
    levels=st.sampled_from([None, 7, 200]),
)
def test_top_ids_are_topks_values_ties_in_any_order(seed, rows, blocks, k, levels):
    """top_ids against torch.topk on vocabularies of whole blocks (its search) with many ties (values
    rounded to a few levels, as bfloat16 logits tie) or none: the same values in the same order, distinct
    ids, and topk's very ids where no value ties."""
    from attnlab.interpret.playback import top_ids

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, blocks * 64, generator=g, dtype=torch.float64)
    if levels is not None:
        x = (x * levels / 4).round()
    ids = top_ids(x, k)
    want = torch.topk(x, k, dim=-1)
    assert ids.shape == (rows, k) and ids.dtype == torch.long
    assert torch.equal(x.gather(-1, ids), want.values)
    assert all(len(set(r.tolist())) == k for r in ids)
    if levels is None:
        assert torch.equal(ids, want.indices)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    sampling=st.sampled_from(
        [dict(temperature=0.0), dict(temperature=0.7, top_k=3), dict(temperature=1.0, top_p=0.5), dict(temperature=1.3)]
    ),
)
def test_candidates_are_the_likeliest_tokens_then_the_runners_up(seed, sampling):
    """A generation step's candidates: the probabilities a top-k of the distribution gives (the likeliest
    first), and the tokens the filter leaves at zero (greedy's all but one) by logit, not arbitrary zeros."""
    from attnlab.interpret.playback import top_candidates

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 3
    probs = SamplingConfig(**sampling).probabilities(logits)  # (3, 40)
    ids, p = top_candidates(logits, probs, 10)
    assert torch.equal(p, probs.gather(-1, ids))
    torch.testing.assert_close(p, torch.topk(probs, 10).values, rtol=0, atol=0)
    chosen = logits.gather(-1, ids)  # (3, 10)
    assert (chosen.diff(dim=-1) <= 0).all()  # by logit
    left = torch.ones_like(logits, dtype=torch.bool).scatter(-1, ids, False)
    assert (chosen[:, -1] >= logits.masked_fill(~left, float("-inf")).amax(-1)).all()  # none better left out
    assert torch.equal(ids[:, 0], logits.argmax(-1))


@pytest.mark.parametrize("other", [{"n_layers": 2}, {"vocab_size": 50}, {"emb_dim": 48}])
def test_the_logit_lens_of_another_models_trace_is_refused(other):
    # More layers or another vocabulary gave rows of the wrong model silently; another width, torch's error.
    model = sharp_gpt()
    idx = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(0))
    tr = trace(sharp_gpt(**other), idx, stages=True)
    with pytest.raises(ValueError, match="trace is of another model"):
        logit_lens(model, tr)
    logit_lens(model, trace(model, idx, stages=True))  # (its own: fine)
