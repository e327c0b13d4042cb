"""The heads' split inputs (TransformerLens's ``hook_attn_in``, ``hook_q_input``, ``hook_k_input``,
``hook_v_input``): a copy of the residual per head, each head's query, key and value projected from its
own. Held to the model without them (the same numbers) and to patching the projections themselves:
a head's input patched with the clean residual is that head's query (key, value) patched with the
clean run's."""

from __future__ import annotations

import pytest
import torch

from attnlab.interpret import act_name, hook_names, hooks, run_with_cache
from test_fast_decode import FAMILIES, make

SPLIT = ("q_input", "k_input", "v_input")


def prompts():
    g = torch.Generator().manual_seed(3)
    clean = torch.randint(0, 61, (2, 9), generator=g)
    corrupted = clean.clone()
    corrupted[:, 2] = (clean[:, 2] + 7) % 61
    return clean, corrupted


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hooked_split_inputs_leave_every_family_as_it_was(family):
    """Functions that keep the copies: the logits of the model's own forward (float64), in every family
    (sandwich norms, OLMo 2's norm of all heads' queries, a parallel residual, ALiBi, windows)."""
    model = make(FAMILIES[family])
    idx = prompts()[0]
    noop = {act_name(s, layer): lambda x, hook: None for s in SPLIT for layer in (0, 2)}
    with torch.no_grad():
        want = model(idx)
        with hooks(model, noop):
            got = model(idx)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["gpt2", "llama-gqa", "gemma3", "neox", "phi3-window"])
def test_a_heads_input_patched_is_its_projection_patched(family):
    """Head h's query input (key/value group g's input) replaced by the clean run's residual gives the
    logits of head h's query (group g's key, value) replaced by the clean run's: each head projects its
    own copy, through the block's norm. With ``attn_in`` (as many key heads as query heads) all three."""
    model = make(FAMILIES[family])
    clean, corrupted = prompts()
    att = model.trf_blocks[1].att
    layer, h, g = 1, att.num_heads - 1, att.num_kv_heads - 1  # (a group of several query heads under GQA)
    names = [act_name(s, layer) for s in ("resid_pre", "q", "k", "v")]
    _, cache = run_with_cache(model, clean, names)
    resid, q, k, v = (cache[n] for n in names)

    def put(head, source, input_=False):
        def fn(x, hook):
            x = x.clone()
            x[:, :, head] = source if input_ else source[:, :, head]
            return x

        return fn

    steps = [("q", h, q), ("k", g, k), ("v", g, v)]
    if att.num_kv_heads == att.num_heads:
        steps.append(("attn_in", h, None))
    with torch.no_grad():
        base = model(corrupted)
        for step, head, projected in steps:
            point = act_name(step if projected is None else f"{step}_input", layer)
            with hooks(model, {point: put(head, resid, True)}):
                got = model(corrupted)
            if projected is None:  # attn_in: the head's query, key and value
                want_fns = {act_name(s, layer): put(h, t) for s, t in (("q", q), ("k", k), ("v", v))}
            else:
                want_fns = {act_name(step, layer): put(head, projected)}
            with hooks(model, want_fns):
                want = model(corrupted)
            assert (want - base).abs().max() > 1e-3, step  # the patch moves the logits: a test that can fail
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10, msg=step)


def test_the_split_inputs_names_shapes_and_cache():
    gpt2, gqa = make(FAMILIES["gpt2"]), make(FAMILIES["llama-gqa"])
    assert act_name("q_input", 2) == "blocks.2.hook_q_input" and act_name("hook_attn_in", 0) == "blocks.0.hook_attn_in"
    for model in (gpt2, gqa):
        names = hook_names(model)
        assert all(act_name(s, layer) in names for s in SPLIT for layer in range(3))
        # in TransformerLens's order: after resid_pre, before the first norm's points
        i = names.index("blocks.1.hook_q_input")
        assert names[i - 1] in ("blocks.1.hook_resid_pre", "blocks.1.hook_attn_in")
    assert "blocks.0.hook_attn_in" in hook_names(gpt2) and "blocks.0.hook_attn_in" not in hook_names(gqa)
    with pytest.raises(ValueError, match=r"unknown hook name 'blocks\.0\.hook_attn_in'"):
        run_with_cache(gqa, prompts()[0], ["blocks.0.hook_attn_in"])
    idx = prompts()[0]
    _, everything = run_with_cache(gqa, idx)  # (None: every point but the split inputs)
    assert not any(n.endswith(tuple(f"hook_{s}" for s in ("attn_in", *SPLIT))) for n in everything)
    _, cache = run_with_cache(gqa, idx, [act_name(s, 1) for s in ("resid_pre", *SPLIT)])
    resid = cache["blocks.1.hook_resid_pre"]  # (B, T, d)
    att = gqa.trf_blocks[1].att
    for step, heads in (("q_input", att.num_heads), ("k_input", att.num_kv_heads), ("v_input", att.num_kv_heads)):
        assert torch.equal(cache[act_name(step, 1)], resid[:, :, None].expand(-1, -1, heads, -1))
    _, filtered = run_with_cache(gqa, idx, lambda n: n.endswith("hook_k_input"))
    assert list(filtered) == [act_name("k_input", i) for i in range(3)]


def test_gradients_through_the_split_inputs_are_the_models():
    """The split computation is the same function: every parameter's gradient as without it (float64),
    and a gradient reaches each head's input."""
    model = make(FAMILIES["llama-gqa"])
    idx = prompts()[0]
    kept = {}

    def keep(x, hook):
        x.retain_grad()
        kept[hook.name] = x

    model.zero_grad()
    model(idx).square().mean().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with hooks(model, {act_name(s, 1): keep for s in SPLIT}):
        model(idx).square().mean().backward()
    for p, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-9, atol=1e-12)
    assert all(kept[n].grad is not None and kept[n].grad.abs().sum() > 0 for n in kept)


def test_generation_with_the_split_inputs_hooked_keeps_its_tokens_and_logits():
    """Decoding with a KV cache through the split path (each new token's copies, the cached keys of the
    split projections): the same tokens and logits as without it."""
    from attnlab.generation import generate

    model = make(FAMILIES["llama-gqa"])
    idx = prompts()[0][:1, :5]
    want, want_logits = generate(model, idx, max_new_tokens=6, temperature=0.0, return_logits=True)
    seen = []
    with hooks(model, {act_name("k_input", 1): lambda x, hook: seen.append(x.shape[1])}):
        got, logits = generate(model, idx, max_new_tokens=6, temperature=0.0, return_logits=True)
    assert torch.equal(got, want) and seen[:2] == [5, 1]  # the prompt's copies, then one token's
    torch.testing.assert_close(logits, want_logits, rtol=0, atol=1e-12)
