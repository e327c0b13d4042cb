"""The MLP's hook points, TransformerLens's ``blocks.{l}.mlp.hook_pre``, ``hook_pre_linear`` (gated MLPs)
and ``hook_post`` (the neurons), against the activations inside Hugging Face models built from a
config: Llama's gated MLP and GPT-2's GELU one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.interpret import SAE, SAEConfig, act_name, hook_names, hooks, run_with_cache, splice
from attnlab.interpret.hooks import HookPoint
from attnlab.model import GPT

transformers = pytest.importorskip("transformers")


def hf_model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer Hugging Face model of random weights (``llama`` or ``gpt2``), in eval mode."""
    torch.manual_seed(seed)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.GPT2Config(vocab_size=61, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg).eval()


def hf_mlps(hf: torch.nn.Module) -> list[torch.nn.Module]:
    return [layer.mlp for layer in (hf.model.layers if hasattr(hf, "model") else hf.transformer.h)]


def hf_mlp_activations(hf: torch.nn.Module, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{hook name: activation}`` read inside ``hf``'s MLPs by torch hooks on their projections:
    Llama's gate and up projections' outputs and the down projection's input, GPT-2's ``c_fc`` output
    and ``c_proj`` input."""
    seen: dict[str, torch.Tensor] = {}

    def output(name):
        return lambda module, args, out: seen.__setitem__(name, out.detach())

    def input(name):
        return lambda module, args: seen.__setitem__(name, args[0].detach())

    handles = []
    for i, mlp in enumerate(hf_mlps(hf)):
        if hasattr(mlp, "gate_proj"):
            handles += [
                mlp.gate_proj.register_forward_hook(output(f"blocks.{i}.mlp.hook_pre")),
                mlp.up_proj.register_forward_hook(output(f"blocks.{i}.mlp.hook_pre_linear")),
                mlp.down_proj.register_forward_pre_hook(input(f"blocks.{i}.mlp.hook_post")),
            ]
        else:
            handles += [
                mlp.c_fc.register_forward_hook(output(f"blocks.{i}.mlp.hook_pre")),
                mlp.c_proj.register_forward_pre_hook(input(f"blocks.{i}.mlp.hook_post")),
            ]
    forward_then_remove(hf, idx, handles)
    return seen


def forward_then_remove(hf: torch.nn.Module, idx: torch.Tensor, handles: list) -> None:
    """``hf(idx)`` without gradients, then the torch hooks ``handles`` removed (also after an error)."""
    try:
        with torch.no_grad():
            hf(idx)
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_mlp_points_are_the_activations_inside_transformers_mlp(kind):
    hf = hf_model(kind)
    ours = GPT.from_hf(hf).eval()
    idx = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    want = hf_mlp_activations(hf, idx)
    _, cache = run_with_cache(ours, idx, lambda name: ".mlp." in name)
    assert sorted(cache) == sorted(want) and len(want) == (6 if kind == "llama" else 4)
    for name, x in want.items():
        torch.testing.assert_close(cache[name], x, rtol=1e-5, atol=1e-5)
    assert cache["post", 1] is cache["blocks.1.mlp.hook_post"]  # TransformerLens's way to index a cache


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_ablating_neurons_at_hook_post_is_zeroing_the_down_projections_input(kind):
    """A replacement at ``mlp.hook_post`` is what the output projection reads: the logits equal
    transformers' with the same neurons zeroed at its down projection's input."""
    hf = hf_model(kind, seed=2)
    ours = GPT.from_hf(hf).eval()
    idx = torch.randint(0, 61, (1, 7), generator=torch.Generator().manual_seed(3))
    neurons = torch.tensor([0, 5, 17, 30])

    def ablate(x, hook):
        x = x.clone()
        x[..., neurons] = 0
        return x

    down = hf_mlps(hf)[1].down_proj if kind == "llama" else hf_mlps(hf)[1].c_proj
    handle = down.register_forward_pre_hook(lambda module, args: (ablate(args[0], None),))
    try:
        with torch.no_grad():
            want = hf(idx).logits
    finally:
        handle.remove()
    with torch.no_grad(), hooks(ours, {"blocks.1.mlp.hook_post": ablate}):
        got = ours(idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(ours(idx), want, atol=1e-4)  # (the ablation changed the logits)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.floats(-2.0, 2.0, allow_nan=False, width=32), min_size=48, max_size=48))
def test_scaling_the_neurons_is_scaling_the_output_projections_columns(scales):
    """``mlp.hook_post * s`` gives the logits of the model whose down projection's column j is times
    ``s[j]``, and a hook on ``mlp.hook_pre_linear`` (the linear half of ``silu(gate) * up``) does too."""
    hf = hf_model("llama", seed=4)
    model = GPT.from_hf(hf).eval()
    s = torch.tensor(scales)  # (48,): one per neuron (intermediate_size)
    idx = torch.arange(6)[None] * 7 % 61
    with torch.no_grad():
        with hooks(model, {"blocks.0.mlp.hook_post": lambda x, hook: x * s}):
            by_post = model(idx)
        with hooks(model, {"blocks.0.mlp.hook_pre_linear": lambda x, hook: x * s}):
            by_up = model(idx)
        model.trf_blocks[0].ff.layers[2].weight.mul_(s)  # (d, 48): column j times s[j]
        want = model(idx)
    torch.testing.assert_close(by_post, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_up, want, rtol=1e-5, atol=1e-5)


def test_a_generations_prefill_shows_the_mlp_hooks_every_position(make_gpt):
    """The prefill's last block runs its MLP on the last position only, unless the MLP is hooked: its
    hook then sees every position, as in a forward pass; each decoding step after it, one."""
    model = make_gpt(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False)
    idx = torch.randint(0, 37, (1, 5), generator=torch.Generator().manual_seed(5))
    shapes = []
    last = f"blocks.{model.config.n_layers - 1}.mlp.hook_post"
    with hooks(model, {last: lambda x, hook: shapes.append(tuple(x.shape))}):
        model.generate(idx, 3, temperature=0)
    assert shapes == [(1, 5, model.config.hidden_dim)] + [(1, 1, model.config.hidden_dim)] * 2


def test_names_widths_and_an_sae_on_the_neurons(make_gpt):
    model = make_gpt(mlp="swiglu")
    assert act_name("post", 1) == "blocks.1.mlp.hook_post"
    assert act_name("hook_pre_linear", 0) == "blocks.0.mlp.hook_pre_linear"
    assert HookPoint("blocks.1.mlp.hook_pre").layer() == 1
    assert "blocks.0.mlp.hook_pre_linear" not in hook_names(make_gpt())  # (GPT-2's MLP is not gated)
    dm = model.config.hidden_dim
    torch.manual_seed(0)
    sae = SAE(SAEConfig(d_in=dm, d_sae=2 * dm, architecture="standard", hook_name="blocks.1.mlp.hook_post")).eval()
    sae.check_model(model)  # the neurons' width, not the residual's
    idx = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        clean = model(idx)
        with splice(model, sae) as cache:
            kept = model(idx)
    torch.testing.assert_close(kept, clean, rtol=1e-5, atol=1e-5)  # (the error term keeps the output)
    assert cache["blocks.1.mlp.hook_post.hook_sae_acts_post"].shape == (2, 6, 2 * dm)
    with pytest.raises(ValueError, match="d_in=24 does not match the model's width"):
        SAE(SAEConfig(d_in=24, d_sae=8, architecture="standard", hook_name="blocks.1.mlp.hook_post")).check_model(model)
