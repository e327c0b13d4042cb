"""The norms' hook points, TransformerLens's ``blocks.{l}.ln1.hook_scale`` and ``hook_normalized`` (and
``ln2``, the sandwich norms ``ln1_post``/``ln2_post``, ``ln_final``): against the norms inside Hugging Face
models built from a config, float64 formulas on each norm's input, and what a replaced scale gives."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.attention import OffsetRMSNorm
from attnlab.interpret import act_name, hook_names, hooks, run_with_cache
from attnlab.interpret.hooks import BLOCK_NORMS
from attnlab.model import GPT
from test_fast_decode import FAMILIES, make, prompt
from test_mlp_hooks import forward_then_remove, hf_model

# LayerNorm with a bias; RMSNorm; Gemma's offset gain; the sandwich norms; OLMo 2's norms after the
# sublayers only; a parallel residual (the MLP's norm reads the block's input).
KINDS = ["gpt2", "llama-gqa", "gemma", "gemma3", "olmo2", "neox"]


def norms(model: GPT) -> dict[str, torch.nn.Module]:
    """``{point prefix: norm module}``: each block's norms by TransformerLens's names, and the final one."""
    out = {f"blocks.{i}.{n}.": getattr(b, a) for i, b in enumerate(model.trf_blocks) for n, a in BLOCK_NORMS}
    return {p: m for p, m in out.items() if m is not None} | {"ln_final.": model.final_norm}


@contextlib.contextmanager
def norm_inputs(model: GPT) -> Iterator[dict[str, torch.Tensor]]:
    """Inside the block, what each norm module reads (``{point prefix: input}``, by torch pre-hooks)."""
    seen: dict[str, torch.Tensor] = {}
    handles = [
        m.register_forward_pre_hook(lambda m, args, p=p: seen.__setitem__(p, args[0].detach().clone()))
        for p, m in norms(model).items()
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def divisor(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The float64 scale a norm divides by: ``sqrt(var + eps)`` (LayerNorm), ``sqrt(mean(x^2) + eps)``."""
    x = x.double()
    if isinstance(norm, torch.nn.LayerNorm):
        x = x - x.mean(-1, keepdim=True)
    return (x.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt()


def bias(norm: torch.nn.Module) -> torch.Tensor | float:
    return norm.bias if isinstance(norm, torch.nn.LayerNorm) and norm.bias is not None else 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_each_norms_scale_and_output_in_float64(kind):
    """Every norm of every family has its two points, in TransformerLens's order around the sublayer
    they feed; ``hook_scale`` is the float64 divisor of what the norm read and ``hook_normalized`` the
    norm's output."""
    model = make(FAMILIES[kind])
    idx = prompt(2, 9)
    names = hook_names(model)
    found = norms(model)
    assert {n.rsplit("hook_", 1)[0] for n in names if n.endswith(("hook_scale", "hook_normalized"))} == set(found)
    for i in range(model.config.n_layers):
        order = [n for n in names if n.startswith(f"blocks.{i}.") and ("ln" in n or n.endswith(("hook_q", "hook_pre")))]
        ln1 = [f"blocks.{i}.ln1.hook_scale", f"blocks.{i}.ln1.hook_normalized"] if f"blocks.{i}.ln1." in found else []
        ln2 = [f"blocks.{i}.ln2.hook_scale", f"blocks.{i}.ln2.hook_normalized"] if f"blocks.{i}.ln2." in found else []
        assert order[: len(ln1) + 1] == [*ln1, f"blocks.{i}.attn.hook_q"]
        at = order.index(f"blocks.{i}.mlp.hook_pre")
        assert order[at - len(ln2) : at] == ln2
    with norm_inputs(model) as inputs:
        _, cache = run_with_cache(model, idx)
    for prefix, norm in found.items():
        scale, normalized = cache[f"{prefix}hook_scale"], cache[f"{prefix}hook_normalized"]
        assert scale.shape == (*idx.shape, 1) and normalized.shape == (*idx.shape, model.config.emb_dim)
        torch.testing.assert_close(scale, divisor(norm, inputs[prefix]), rtol=1e-12, atol=0)
        with torch.no_grad():
            assert torch.equal(normalized, norm(inputs[prefix]))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_norm_points_are_the_norms_inside_transformers(kind):
    """``ln1``, ``ln2`` and ``ln_final``'s outputs are transformers' ``input_layernorm``,
    ``post_attention_layernorm`` and ``norm`` (GPT-2: ``ln_1``, ``ln_2``, ``ln_f``); the scales are
    the divisors of what those read."""
    hf = hf_model(kind, seed=5)
    ours = GPT.from_hf(hf).eval()
    idx = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    if kind == "llama":
        pairs = [(layer, ("input_layernorm", "post_attention_layernorm")) for layer in hf.model.layers]
        final = hf.model.norm
    else:
        pairs = [(layer, ("ln_1", "ln_2")) for layer in hf.transformer.h]
        final = hf.transformer.ln_f
    modules = {
        f"blocks.{i}.ln{j + 1}.": getattr(layer, a)
        for i, (layer, attrs) in enumerate(pairs)
        for j, a in enumerate(attrs)
    }
    modules["ln_final."] = final
    seen = {}
    record = [lambda m, a, out, p=p: seen.__setitem__(p, (a[0], out)) for p in modules]
    forward_then_remove(hf, idx, [m.register_forward_hook(r) for m, r in zip(modules.values(), record, strict=True)])
    _, cache = run_with_cache(ours, idx, lambda name: name.endswith(("hook_scale", "hook_normalized")))
    assert len(cache) == 2 * len(modules)
    for prefix, (x, out) in seen.items():
        torch.testing.assert_close(cache[f"{prefix}hook_normalized"], out, rtol=1e-5, atol=1e-5)
        eps = modules[prefix].eps if kind == "gpt2" else modules[prefix].variance_epsilon
        centred = x.double() - x.double().mean(-1, keepdim=True) if kind == "gpt2" else x.double()
        want = (centred.pow(2).mean(-1, keepdim=True) + eps).sqrt()
        torch.testing.assert_close(cache[f"{prefix}hook_scale"].double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=5, deadline=None)
@given(factor=st.floats(0.25, 4.0), layer=st.integers(0, 2))
def test_a_replaced_scale_is_what_the_norm_divides_by(kind, factor, layer):
    """``hook_scale`` times ``c``: the norm's output is ``(out - bias) / c + bias`` (the gain is
    linear), for a block's first norm and for the final one."""
    model = make(FAMILIES[kind])
    idx = prompt(1, 7)
    prefix = next(p for p in norms(model) if p.startswith(f"blocks.{layer}."))
    for point in (prefix, "ln_final."):
        norm = norms(model)[point]
        _, clean = run_with_cache(model, idx, [f"{point}hook_normalized"])
        scaled = {f"{point}hook_scale": lambda x, hook: x * factor}
        with hooks(model, scaled):
            _, cache = run_with_cache(model, idx, [f"{point}hook_normalized"])
        want = (clean[f"{point}hook_normalized"] - bias(norm)) / factor + bias(norm)
        torch.testing.assert_close(cache[f"{point}hook_normalized"], want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["gpt2", "gemma"])
def test_frozen_scales_from_another_prompt(kind):
    """TransformerLens's frozen LayerNorm: every norm's scale from prompt A, the rest of the pass on
    prompt B; each norm's output is then B's centred input over A's scale, times the gain (float64)."""
    model = make(FAMILIES[kind])
    a, b = prompt(1, 8, seed=3), prompt(1, 8, seed=4)
    scale_names = [n for n in hook_names(model) if n.endswith("hook_scale")]
    _, clean = run_with_cache(model, a, scale_names)
    fns = {n: lambda x, hook: clean[hook.name] for n in scale_names}
    with norm_inputs(model) as seen, hooks(model, fns):
        _, frozen = run_with_cache(model, b, lambda n: n.endswith("hook_normalized"))
    for prefix, norm in norms(model).items():
        x = seen[prefix]
        if isinstance(norm, torch.nn.LayerNorm):
            x = x - x.mean(-1, keepdim=True)
        gain = norm.offset + norm.weight if isinstance(norm, OffsetRMSNorm) else norm.weight
        want = x / clean[f"{prefix}hook_scale"] * gain + bias(norm)
        torch.testing.assert_close(frozen[f"{prefix}hook_normalized"], want, rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        assert not torch.allclose(frozen["ln_final.hook_normalized"], run_with_cache(model, b)[1]["normalized"])


def test_a_scale_hook_that_keeps_the_scale_leaves_the_forward_exact():
    """Returning None (or the tensor given) keeps the norm's own output, bit for bit; a copy of the scale
    goes through the step-by-step norm, the same to rounding."""
    model = make(FAMILIES["gpt2"], dtype=torch.float32)
    idx = prompt(2, 8)
    scales = [n for n in hook_names(model) if n.endswith("hook_scale")]
    with torch.no_grad():
        ref = model(idx)
        with hooks(model, dict.fromkeys(scales, lambda x, hook: None)):
            assert torch.equal(model(idx), ref)
        with hooks(model, dict.fromkeys(scales, lambda x, hook: x)):
            assert torch.equal(model(idx), ref)
        with hooks(model, dict.fromkeys(scales, lambda x, hook: x.clone())):
            torch.testing.assert_close(model(idx), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("point", ["blocks.0.ln1.", "ln_final."])
def test_a_scale_edited_in_place_divides_as_a_returned_one_does(point):
    # TransformerLens's idiom, x.mul_(c) in the hook: the norm gave its own output, as if unhooked.
    model = make(FAMILIES["gpt2"], dtype=torch.float32)
    idx = prompt(2, 8)
    with torch.no_grad():
        ref = model(idx)
        with hooks(model, {f"{point}hook_scale": lambda x, hook: x * 2}):
            returned = model(idx)
        with hooks(model, {f"{point}hook_scale": lambda x, hook: x.mul_(2)}):
            assert torch.equal(model(idx), returned)

        def in_place(x, hook):  # (returns None)
            x.mul_(2)

        with hooks(model, {f"{point}hook_scale": in_place}):
            assert torch.equal(model(idx), returned)
    assert (returned - ref).abs().max() > 0.1


@pytest.mark.parametrize("kind", ["gemma", "gemma3"])  # (the tiny gemma3 takes Gemma 3's scale too)
def test_gemmas_hook_embed_is_the_scaled_embedding_the_stream_starts_from(kind):
    # hook_embed was taken before the sqrt(d) scale: TransformerLens's is after it (it equals
    # resid_pre 0), and an edit there (steering) was multiplied by sqrt(d) on the way in.
    model = make({**FAMILIES[kind], "embed_scale": 48**0.5}, dtype=torch.float32)
    idx = prompt(1, 6)
    _, cache = run_with_cache(model, idx, ["hook_embed", "blocks.0.hook_resid_pre"])
    assert torch.equal(cache["hook_embed"], cache["blocks.0.hook_resid_pre"])
    with torch.no_grad():
        want = model.tok_emb.weight[idx].float() * model.config.embed_scale
    torch.testing.assert_close(cache["hook_embed"], want)
    v = torch.randn(model.config.emb_dim, generator=torch.Generator().manual_seed(0))
    with hooks(model, {"hook_embed": lambda x, hook: x + v}):
        _, pushed = run_with_cache(model, idx, ["blocks.0.hook_resid_pre"])
    torch.testing.assert_close(pushed["blocks.0.hook_resid_pre"], cache["blocks.0.hook_resid_pre"] + v)


def test_the_caches_negative_layers_count_from_the_last():
    model = make(FAMILIES["llama-gqa"])
    _, cache = run_with_cache(model, prompt(1, 5))
    last = model.config.n_layers - 1
    assert cache["pattern", -1] is cache[f"blocks.{last}.attn.hook_pattern"]
    assert cache["scale", -2, "ln2"] is cache[f"blocks.{last - 1}.ln2.hook_scale"]


def test_act_name_and_the_caches_keys():
    assert act_name("scale", 3, "ln2") == "blocks.3.ln2.hook_scale"
    assert act_name("normalized", 0, "ln1_post") == "blocks.0.ln1_post.hook_normalized"
    assert act_name("scale") == "ln_final.hook_scale" and act_name("normalized") == "ln_final.hook_normalized"
    with pytest.raises(ValueError, match="layer_type"):
        act_name("scale", 3)
    model = make(FAMILIES["llama-gqa"])
    _, cache = run_with_cache(model, prompt(1, 5))
    assert cache["scale", 1, "ln2"] is cache["blocks.1.ln2.hook_scale"]
    assert cache["scale"] is cache["ln_final.hook_scale"]


@pytest.mark.parametrize(
    ("args", "want"),
    [
        (("attn", 3), "blocks.3.attn.hook_pattern"),
        (("attn_logits", 1), "blocks.1.attn.hook_attn_scores"),
        (("query", 0), "blocks.0.attn.hook_q"),
        (("key", 2), "blocks.2.attn.hook_k"),
        (("value", 1), "blocks.1.attn.hook_v"),
        (("mlp_pre", 2), "blocks.2.mlp.hook_pre"),
        (("mlp_post", 0), "blocks.0.mlp.hook_post"),
        (("pattern3",), "blocks.3.attn.hook_pattern"),
        (("k6a",), "blocks.6.attn.hook_k"),
        (("resid_post10",), "blocks.10.hook_resid_post"),
        (("scale4ln1",), "blocks.4.ln1.hook_scale"),
        (("blocks.0.hook_resid_pre",), "blocks.0.hook_resid_pre"),
    ],
)
def test_act_name_reads_transformerlens_spellings(args, want):
    # TransformerLens's utils.get_act_name gives these names for these arguments (its aliases, compact
    # forms and full names); act_name refused them, and so did the cache's keys built on it.
    assert act_name(*args) == want


def test_the_caches_keys_take_transformerlens_spellings():
    model = make(FAMILIES["llama-gqa"])
    _, cache = run_with_cache(model, prompt(1, 5))
    assert cache["attn", 1] is cache["blocks.1.attn.hook_pattern"]
    assert cache["pattern1"] is cache["blocks.1.attn.hook_pattern"] and cache["key", 0] is cache["k", 0]


def test_nested_blocks_chain_a_norms_functions_and_each_exit_puts_them_back():
    """An inner block's function on a scale sees the outer block's replacement and replaces it in turn
    (one norm divides by both factors); leaving the inner block keeps the outer one's; leaving both,
    the norm has no hook left."""
    model = make(FAMILIES["llama-gqa"])
    idx = prompt(1, 6)
    point, seen = "blocks.1.ln2.", []
    norm = norms(model)[point]
    _, clean = run_with_cache(model, idx, [f"{point}hook_normalized", f"{point}hook_scale"])
    with hooks(model, {f"{point}hook_scale": lambda x, hook: 2 * x}):
        with hooks(model, {f"{point}hook_scale": lambda x, hook: seen.append(x) or 3 * x}):
            _, inner = run_with_cache(model, idx, [f"{point}hook_normalized"])
        _, outer = run_with_cache(model, idx, [f"{point}hook_normalized"])
        assert len(norm._forward_hooks) == 1  # (one hook runs the functions of both blocks)
    torch.testing.assert_close(seen[0], 2 * clean[f"{point}hook_scale"], rtol=1e-12, atol=0)
    torch.testing.assert_close(inner[f"{point}hook_normalized"], clean[f"{point}hook_normalized"] / 6)
    torch.testing.assert_close(outer[f"{point}hook_normalized"], clean[f"{point}hook_normalized"] / 2)
    assert not norm._forward_hooks
