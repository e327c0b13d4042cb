"""Hook points with TransformerLens's names: shapes, read/replace, restore, zero cost when unset."""

from __future__ import annotations

import pytest
import torch

from attnlab.interpret import act_name, hook_names, hooks, run_with_cache, trace

FAMILIES = {
    "gpt2": {},
    "llama": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2),
}


@pytest.fixture(params=sorted(FAMILIES))
def model(request, make_gpt):
    return make_gpt(**FAMILIES[request.param])


def expected_shape(name: str, B: int, T: int, model) -> tuple[int, ...]:
    att = model.trf_blocks[0].att
    H, Hkv, hd, d = att.num_heads, att.num_kv_heads, att.head_dim, model.config.emb_dim
    step = name.rsplit("hook_", 1)[1]
    if ".mlp." in name:  # pre, pre_linear, post: the MLP's hidden width
        return (B, T, model.config.hidden_dim)
    return {
        "pos_embed": (T, d),
        "scale": (B, T, 1),
        "q": (B, T, H, hd),
        "rot_q": (B, T, H, hd),
        "z": (B, T, H, hd),
        "result": (B, T, H, d),
        "k": (B, T, Hkv, hd),
        "v": (B, T, Hkv, hd),
        "rot_k": (B, T, Hkv, hd),
        "attn_scores": (B, H, T, T),
        "pattern": (B, H, T, T),
    }.get(step, (B, T, d))


def test_names_and_shapes(model):
    idx = torch.randint(0, 37, (3, 7))
    logits, cache = run_with_cache(model, idx)
    names = hook_names(model)
    split = tuple(f"hook_{s}" for s in ("attn_in", "q_input", "k_input", "v_input"))  # (cached when named)
    assert list(cache) == [n for n in names if not n.endswith(split)]
    L = model.config.n_layers
    rope, gated = model.config.pos == "rope", model.config.mlp == "swiglu"
    for i in range(L):
        for s in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"):
            assert f"blocks.{i}.hook_{s}" in names
        for s in ("q", "k", "v", "attn_scores", "pattern", "z", "result"):
            assert f"blocks.{i}.attn.hook_{s}" in names
        assert (f"blocks.{i}.attn.hook_rot_q" in names) == rope
        mlp = [n for n in names if n.startswith(f"blocks.{i}.mlp.")]  # TransformerLens's order
        assert mlp == [f"blocks.{i}.mlp.hook_{s}" for s in ("pre", "pre_linear", "post") if gated or s != "pre_linear"]
        at = names.index(f"blocks.{i}.hook_resid_mid") + 1
        ln2 = [f"blocks.{i}.ln2.hook_{s}" for s in ("scale", "normalized")]  # the MLP's norm, then the MLP
        assert names[at : at + 2 + len(mlp)] == ln2 + mlp and names[at + 2 + len(mlp)] == f"blocks.{i}.hook_mlp_out"
    assert "hook_embed" in names and "ln_final.hook_normalized" in names
    for name, t in cache.items():
        assert tuple(t.shape) == expected_shape(name, 3, 7, model), name
    torch.testing.assert_close(logits, model(idx), rtol=1e-5, atol=1e-5)
    # TransformerLens's ways to index a cache
    assert cache["pattern", 1] is cache["blocks.1.attn.hook_pattern"]
    assert cache["embed"] is cache["hook_embed"]


def test_cache_agrees_with_trace_and_stream(model):
    """The pattern is the weights the fused path applied; z its heads; the stream adds up."""
    idx = torch.randint(0, 37, (2, 9))
    _, cache = run_with_cache(model, idx)
    tr = trace(model, idx, stages=True)
    for i in range(model.config.n_layers):
        torch.testing.assert_close(cache["pattern", i], tr.weights[i], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cache["z", i], tr.head_outputs[i].transpose(1, 2), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cache["resid_pre", i], tr.residual[i])
        assert torch.equal(cache["resid_mid", i], cache["resid_pre", i] + cache["attn_out", i])
        assert torch.equal(cache["resid_post", i], cache["resid_mid", i] + cache["mlp_out", i])
        torch.testing.assert_close(cache["attn_scores", i].softmax(-1), cache["pattern", i])
    torch.testing.assert_close(model.final_norm(cache["resid_post", model.config.n_layers - 1]), cache["normalized"])


def test_replacing_with_itself_changes_nothing(model):
    idx = torch.randint(0, 37, (2, 8))
    with torch.no_grad():
        ref = model(idx)
        # Left to the closeness check below: a copy of a norm's scale is divided by step by step (rounding
        # again), and while a split input (attn_in, q/k/v_input) is hooked each head projects its own copy
        # of the input: other products than the fused one, which BLAS may round otherwise (MKL's AVX2 code does)
        split = tuple(f"hook_{s}" for s in ("attn_in", "q_input", "k_input", "v_input"))
        exact = [n for n in hook_names(model) if ".attn." not in n and "scale" not in n and not n.endswith(split)]
        resid = {n: (lambda x, hook: x.clone()) for n in exact}
        with hooks(model, resid):
            assert torch.equal(model(idx), ref)  # the block-level points leave the fused kernel alone
        with hooks(model, dict.fromkeys(hook_names(model), lambda x, hook: x.clone())):
            torch.testing.assert_close(model(idx), ref, rtol=1e-5, atol=1e-6)  # explicit softmax: rounding


def test_replacing_changes_what_follows(model):
    """The whole residual at layer 0 from another prompt gives that prompt's logits, exactly; a
    zeroed head's pattern removes its output."""
    a, b = torch.randint(0, 37, (1, 8)), torch.randint(0, 37, (1, 8))
    with torch.no_grad():
        _, cache = run_with_cache(model, a, ["blocks.0.hook_resid_pre"])
        with hooks(model, {"blocks.0.hook_resid_pre": lambda x, hook: cache[hook.name]}):
            got = model(b)
        assert torch.equal(got, model(a))

        def zero(x, hook):
            x = x.clone()
            x[:, 2] = 0
            return x

        with hooks(model, {"blocks.1.attn.hook_pattern": zero}):
            _, patched = run_with_cache(model, b, ["blocks.1.attn.hook_z"])
        assert torch.all(patched["z", 1][:, :, 2] == 0)


def test_a_score_hook_that_hides_a_whole_row_gives_that_query_zero_weights(model):
    """A hook on ``attn_scores`` may leave a query no key (all ``-inf``): its weights are zeros, as a padded
    query's, never the softmax's NaN; the other queries' weights are the unhooked ones."""
    idx = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(3))

    def hide_query_4(x, hook):
        x = x.clone()
        x[:, :, 4] = float("-inf")
        return x

    with torch.no_grad():
        _, ref = run_with_cache(model, idx, ["blocks.0.attn.hook_pattern"])
        with hooks(model, {"blocks.0.attn.hook_attn_scores": hide_query_4}):
            _, got = run_with_cache(model, idx, ["blocks.0.attn.hook_pattern"])
    pattern = got["pattern", 0]  # (B, H, T, S)
    assert torch.equal(pattern[:, :, 4], torch.zeros_like(pattern[:, :, 4]))
    rest = [0, 1, 2, 3, 5]
    torch.testing.assert_close(pattern[:, :, rest], ref["pattern", 0][:, :, rest], rtol=0, atol=0)


def test_each_heads_result_is_its_share_of_the_output_projection(model):
    """``attn.hook_result`` (TransformerLens's): head h's ``z`` times its columns of ``out_proj``, in
    float64; the heads' sum plus the bias is ``attn_out``; zeroing a head's result is zeroing its ``z``."""
    idx = torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(7))
    att = model.trf_blocks[1].att
    H, hd = att.num_heads, att.head_dim
    _, cache = run_with_cache(model, idx)
    w = att.out_proj.weight.double()  # (d, H * hd)
    want = torch.stack([cache["z", 1][:, :, h].double() @ w[:, h * hd : (h + 1) * hd].T for h in range(H)], 2)
    torch.testing.assert_close(cache["result", 1].double(), want, rtol=1e-5, atol=1e-6)  # (B, T, H, d)
    bias = 0 if att.out_proj.bias is None else att.out_proj.bias
    torch.testing.assert_close(cache["result", 1].sum(2) + bias, cache["attn_out", 1], rtol=1e-5, atol=1e-6)

    def zero_head(x, hook):
        x = x.clone()
        x[:, :, 2] = 0
        return x

    with torch.no_grad():
        with hooks(model, {"blocks.1.attn.hook_result": zero_head}):
            by_result = model(idx)
        with hooks(model, {"blocks.1.attn.hook_z": zero_head}):
            by_z = model(idx)
        torch.testing.assert_close(by_result, by_z, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(by_result, model(idx), atol=1e-4)


def test_gradients_through_hooks(model):
    idx = torch.randint(0, 37, (1, 6))
    kept = {}

    def keep(x, hook):
        x.retain_grad()
        kept[hook.name] = x

    with hooks(model, {"blocks.1.hook_resid_mid": keep, "blocks.0.attn.hook_pattern": keep}):
        model(idx)[0, -1, 3].backward()
    assert kept["blocks.1.hook_resid_mid"].grad is not None
    assert kept["blocks.0.attn.hook_pattern"].grad.abs().sum() > 0
    model.zero_grad()


def test_restored_on_exit_and_on_error(model):
    idx = torch.randint(0, 37, (1, 6))
    ref = model(idx)
    fns = {"blocks.0.attn.hook_q": lambda x, h: x * 2, "hook_embed": lambda x, h: x * 0}
    with pytest.raises(RuntimeError, match="boom"), hooks(model, fns):
        raise RuntimeError("boom")
    assert all(b.hook is None and b.att.hook is None and b.ff.hook is None for b in model.trf_blocks)
    assert not model.tok_emb._forward_hooks
    assert torch.equal(model(idx), ref)


def test_nested_blocks_run_both(model):
    idx = torch.randint(0, 37, (1, 5))
    seen = []
    with hooks(model, {"blocks.0.hook_resid_pre": lambda x, h: seen.append("outer")}):
        with hooks(model, {"blocks.0.hook_resid_pre": lambda x, h: seen.append("inner")}):
            model(idx)
        model(idx)
    assert seen == ["outer", "inner", "outer"]


def test_bad_names_and_returns(model):
    with pytest.raises(ValueError, match=r"unknown hook name 'blocks.0.hook_resid'.*did you mean"):  # noqa: SIM117
        with hooks(model, {"blocks.0.hook_resid": lambda x, h: None}):
            pass
    with pytest.raises(TypeError, match=r"blocks.0.hook_resid_pre must be a function"):  # noqa: SIM117
        with hooks(model, {"blocks.0.hook_resid_pre": 3}):
            pass
    bad = {"blocks.1.attn.hook_z": lambda x, h: x[:, :1]}
    with (
        pytest.raises(ValueError, match=r"blocks.1.attn.hook_z must return None or a tensor of shape"),
        hooks(model, bad),
    ):
        model(torch.randint(0, 37, (1, 5)))
    for name, fn, got in [
        ("blocks.0.attn.hook_z", lambda x, h: x.double(), "torch.float64 on cpu"),
        ("blocks.0.hook_resid_pre", lambda x, h: x.to("meta"), "torch.float32 on meta"),
        ("blocks.0.ln1.hook_scale", lambda x, h: x.long(), "torch.int64 on cpu"),  # (once NaN logits)
    ]:
        match = rf"{name} must return .* torch.float32 on cpu \(as it was given\), got .*{got}"
        with pytest.raises(ValueError, match=match), hooks(model, {name: fn}):
            model(torch.randint(0, 37, (1, 5)))
    with pytest.raises(ValueError, match="needs an int layer"):
        act_name("pattern")


def test_generation_unchanged_and_hookable(make_gpt):
    """Decoding with a KV cache gives the same tokens with an empty hooks block; hooks also see it."""
    from attnlab.generation import generate

    model = make_gpt(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    idx = torch.randint(0, 37, (1, 4))
    ref = generate(model, idx, max_new_tokens=6, temperature=0.0)
    steps = []
    with hooks(model, {"blocks.0.hook_resid_pre": lambda x, h: steps.append(x.shape[1])}):
        got = generate(model, idx, max_new_tokens=6, temperature=0.0)
    assert torch.equal(got, ref)
    assert steps[0] == 4 and set(steps[1:]) == {1}


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        FAMILIES["llama"],
        dict(pos="rope", parallel_residual=True, rotary_fraction=1 / 3),  # GPT-NeoX's and Phi's blocks
        dict(pos="rope", norm="rmsnorm", mlp="geglu", bias=False, post_norms=True, qk_norm=True),  # Gemma's
    ],
    ids=["gpt2", "llama", "parallel", "post-norms"],
)
def test_every_listed_hook_point_is_reached(make_gpt, overrides):
    """hook_names lists exactly the points a forward reaches: a listed point that never fires would
    take a hook and silently ignore it (a parallel block has no resid_mid)."""
    model = make_gpt(**overrides)
    names, seen = hook_names(model), []
    with hooks(model, dict.fromkeys(names, lambda x, hook: seen.append(hook.name))):
        model(torch.randint(0, 37, (2, 5)))
    assert sorted(set(seen)) == sorted(names)
    if model.config.parallel_residual:
        with pytest.raises(ValueError, match="parallel"), hooks(model, {"blocks.0.hook_resid_mid": print}):
            pass
