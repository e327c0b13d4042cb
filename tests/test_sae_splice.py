"""A spliced SAE's latents, input, reconstruction and error as hook points (SAELens's names): hook_names,
hooks, run_with_cache, activation and attribution patching, against float64 references written here
with plain hooks on the model's own point (no splice)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.interpret import (
    SAE,
    SAEConfig,
    activation_patching,
    attribution_patching,
    hook_names,
    hooks,
    logit_diff,
    run_with_cache,
    sae_point,
    splice,
)

HOOK = "blocks.0.hook_resid_post"
POINTS = ("input", "acts_pre", "acts_post", "recons", "error", "output")


def make_sae(arch: str = "topk", d_in: int = 24, d_sae: int = 40, seed: int = 0, **kw) -> SAE:
    """An SAE with every parameter random, in eval mode."""
    torch.manual_seed(seed)
    transcoder = kw.get("d_out") is not None
    cfg = SAEConfig(
        d_in=d_in,
        d_sae=d_sae,
        architecture=arch,
        k=5 if arch in ("topk", "batchtopk") else None,
        hook_name=kw.pop("hook_name", HOOK),
        apply_b_dec_to_input=not transcoder,
        **kw,
    )
    sae = SAE(cfg)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 1 / p.shape[0] ** 0.5))
    return sae.eval()


def grab(model, idx, name):
    """The activation at ``name`` of an unspliced run (a plain hook)."""
    seen = {}
    with torch.no_grad(), hooks(model, {name: lambda x, h: seen.setdefault("x", x)}):
        model(idx)
    return seen["x"]


def test_points_are_hook_names_only_while_spliced(make_gpt):
    model, sae = make_gpt(), make_sae()
    plain = hook_names(model)
    names = [f"{HOOK}.hook_sae_{p}" for p in POINTS]
    with splice(model, sae):
        spliced = hook_names(model)
        at = spliced.index(HOOK)
        assert spliced[at + 1 : at + 7] == names  # right after the point they replace, in the pass's order
        assert [n for n in spliced if n not in names] == plain  # TransformerLens's names unchanged
        idx = torch.randint(0, 37, (2, 7))
        _, cache = run_with_cache(model, idx)
        assert [n for n in cache if ".hook_sae_" in n] == names
        x = cache[HOOK.replace("resid_post", "resid_mid")] + cache["blocks.0.hook_mlp_out"]
        torch.testing.assert_close(cache[names[0]], x)
        torch.testing.assert_close(cache[names[2]], sae.encode(x))
        torch.testing.assert_close(cache[names[3]], sae(x))
        torch.testing.assert_close(cache[names[4]], x - sae(x))
        torch.testing.assert_close(cache[names[5]], cache[HOOK])
        assert sae_point(sae, "acts_post") == names[2]
    assert hook_names(model) == plain
    with pytest.raises(ValueError, match="unknown hook name"), hooks(model, {names[2]: lambda x, h: None}):
        pass
    with splice(model, sae, keep_error=False):
        assert f"{HOOK}.hook_sae_error" not in hook_names(model)


def test_hooks_on_latents_edit_the_pass_and_are_removed_on_exit(make_gpt):
    model, sae = make_gpt().double(), make_sae().double()
    idx = torch.randint(0, 37, (1, 6))
    name = sae_point(sae, "acts_post")
    x = grab(model, idx, HOOK)  # (1, T, d) float64
    z = sae.encode(x)
    j = int(z[0, 3].argmax())
    calls = []

    def zero_j(acts, hook):
        calls.append(hook.name)
        assert hook.layer() == 0
        acts = acts.clone()
        acts[0, 3, j] = 0
        return acts

    with torch.no_grad(), splice(model, sae) as seen:
        with hooks(model, {name: zero_j}):
            edited = model(idx)
        after = model(idx)  # the function is gone
    assert calls == [name]
    # Reference: the plain model with the stream at (3) moved by -z_j W_dec[j], float64.
    with (
        torch.no_grad(),
        hooks(
            model,
            {HOOK: lambda s, h: s + torch.nn.functional.pad((-z[0, 3, j] * sae.W_dec[j])[None, None], (0, 0, 3, 2))},
        ),
    ):
        ref = model(idx)
    torch.testing.assert_close(edited, ref, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(after, model(idx).detach(), atol=1e-10, rtol=1e-10)
    assert seen[name].shape == (1, 6, 40)
    with pytest.raises(ValueError, match="already a hook point"), splice(model, sae), splice(model, sae):
        pass


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**16), arch=st.sampled_from(["standard", "topk", "jumprelu", "gated"]))
def test_spliced_output_with_error_equals_the_model(make_gpt, seed, arch):
    model = make_gpt(seed=seed % 3).double()
    sae = make_sae(arch, seed=seed, hook_name=f"blocks.{seed % 2}.hook_resid_mid").double()
    idx = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        clean = model(idx)
        with splice(model, sae):
            spliced = model(idx)
    torch.testing.assert_close(spliced, clean, atol=1e-10, rtol=1e-10)


def test_transcoder_points_follow_its_output_hook(make_gpt):
    model = make_gpt().double()
    tc = make_sae("standard", d_out=24, hook_name="blocks.1.hook_resid_mid", hook_name_out="blocks.1.hook_mlp_out")
    tc = tc.double()
    idx = torch.randint(0, 37, (1, 5))
    with splice(model, tc):
        names = hook_names(model)
        at = names.index("blocks.1.hook_mlp_out")
        assert names[at + 1] == "blocks.1.hook_mlp_out.hook_sae_input"
        _, cache = run_with_cache(model, idx, lambda n: n.startswith("blocks.1.hook_"))
    torch.testing.assert_close(cache["blocks.1.hook_mlp_out.hook_sae_input"], cache["blocks.1.hook_resid_mid"])
    torch.testing.assert_close(
        cache["blocks.1.hook_mlp_out.hook_sae_recons"] + cache["blocks.1.hook_mlp_out.hook_sae_error"],
        grab(model, idx, "blocks.1.hook_mlp_out"),
        atol=1e-12,
        rtol=1e-12,
    )


def _pair(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, 37, (1, 6), generator=g)
    corrupted = clean.clone()
    corrupted[0, 1] = (clean[0, 1] + 5) % 37
    corrupted[0, 4] = (clean[0, 4] + 11) % 37
    return clean, corrupted


def test_activation_patching_a_latent_against_plain_hooks(make_gpt):
    model, sae = make_gpt(seed=1).double(), make_sae("topk", seed=1).double()
    clean, corrupted = _pair()
    metric = logit_diff(3, 7)
    calls = []
    with splice(model, sae):
        got = activation_patching(model, clean, corrupted, metric, sae_point(sae, "acts_post"))
        recons, keep = sae_point(sae, "recons"), lambda *c: calls.append(c)
        by_pos = activation_patching(model, clean, corrupted, metric, recons, max_tokens=12, progress=keep)
    assert got.shape == (6, 40) and by_pos.shape == (6,)
    assert calls == [(0, 6), (2, 6), (4, 6), (6, 6)]  # (two patched runs of 6 tokens a pass)
    # Reference: decoding is linear in the latents, so patching latent j at position p moves the
    # stream at p by (z_clean - z_corrupted)[p, j] * W_dec[j]; run that on the plain model in float64.
    x_clean, x_corr = grab(model, clean, HOOK), grab(model, corrupted, HOOK)
    with torch.no_grad():
        dz = (sae.encode(x_clean) - sae.encode(x_corr))[0]  # (T, d_sae)
        drec = (sae(x_clean) - sae(x_corr))[0]  # (T, d)
    shifts = torch.zeros(6, 40, 6, 24, dtype=torch.float64)  # one patched run per (p, j), as batch rows
    pos_shifts = torch.zeros(6, 6, 24, dtype=torch.float64)
    for p in range(6):
        shifts[p, :, p] = dz[p, :, None] * sae.W_dec.detach()  # (d_sae, d)
        pos_shifts[p, p] = drec[p]

    def run_shifted(shift):  # (R, T, d) -> (R,) metric of each patched run
        with torch.no_grad(), hooks(model, {HOOK: lambda s, h: s + shift}):
            return metric.rows(model(corrupted.expand(shift.shape[0], -1)))

    ref, ref_pos = run_shifted(shifts.reshape(-1, 6, 24)).reshape(6, 40), run_shifted(pos_shifts)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)  # (the result is float32)
    torch.testing.assert_close(by_pos.double(), ref_pos, atol=1e-5, rtol=1e-5)
    assert (ref != ref[0, 0]).any()  # the patches differ: a test that can fail


def test_attribution_patching_a_latent_is_the_float64_gradient(make_gpt):
    model, sae = make_gpt(seed=2).double(), make_sae("topk", seed=2).double()
    clean, corrupted = _pair(1)
    metric = logit_diff(5, 9)
    with splice(model, sae):
        got = attribution_patching(model, clean, corrupted, metric, sae_point(sae, "acts_post"))
        got_err = attribution_patching(model, clean, corrupted, metric, sae_point(sae, "error"))
    # Reference: autograd through the plain model from a leaf at the SAE's point; the metric's
    # gradient wrt latent j at p is W_dec[j] . d metric / d stream[p] (decoding is linear).
    x_clean, x_corr = grab(model, clean, HOOK), grab(model, corrupted, HOOK)
    leaf = {}

    def start(s, h):
        leaf["x"] = s.detach().requires_grad_(True)
        return leaf["x"]

    with hooks(model, {HOOK: start}):
        (g,) = torch.autograd.grad(metric(model(corrupted)), [leaf["x"]])  # (1, T, d)
    with torch.no_grad():
        dz = (sae.encode(x_clean) - sae.encode(x_corr))[0]  # (T, d_sae)
        derr = ((x_clean - sae(x_clean)) - (x_corr - sae(x_corr)))[0]  # (T, d)
    ref = dz * (g[0] @ sae.W_dec.detach().T)  # (T, d_sae)
    assert got.shape == (6, 40) and got_err.shape == (6,)
    torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_err.double(), (derr * g[0]).sum(-1), atol=1e-6, rtol=1e-5)
    assert ref.abs().max() > 1e-3


def test_patching_refuses_an_sae_point_that_is_not_spliced(make_gpt):
    model, sae = make_gpt(), make_sae()
    clean, corrupted = _pair()
    with pytest.raises(ValueError, match="not a point of an SAE spliced"):
        activation_patching(model, clean, corrupted, logit_diff(1, 2), sae_point(sae, "acts_post"))
    with pytest.raises(ValueError, match="point must be one of"):
        sae_point(sae, "latents")


@pytest.mark.parametrize("arch", ["standard", "topk", "jumprelu", "gated", "transcoder"])
def test_float32_spliced_output_equals_the_model_and_the_cache_holds_latents_and_error(make_gpt, arch):
    """In the model's own float32, to rounding: the error term makes the splice exact."""
    model = make_gpt(seed=3)
    if arch == "transcoder":
        sae = make_sae("standard", d_out=24, hook_name="blocks.1.hook_resid_mid", hook_name_out="blocks.1.hook_mlp_out")
        x_name, out_name = "blocks.1.hook_resid_mid", "blocks.1.hook_mlp_out"
    else:
        sae = make_sae(arch, seed=4)
        x_name = out_name = HOOK
    idx = torch.randint(0, 37, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain, cache = run_with_cache(model, idx)
        with splice(model, sae):
            spliced, sp_cache = run_with_cache(model, idx)
    torch.testing.assert_close(spliced, plain, atol=2e-5, rtol=1e-5)
    z, err = sp_cache[sae_point(sae, "acts_post")], sp_cache[sae_point(sae, "error")]
    assert z.shape == (3, 11, 40) and err.shape == (3, 11, 24)
    torch.testing.assert_close(z, sae.encode(cache[x_name]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(err, cache[out_name] - sae.decode(z, cache[x_name]), atol=1e-5, rtol=1e-5)
    assert (z != 0).any() and err.abs().max() > 1e-3  # neither is trivially zero


def test_activation_patching_the_error_node_against_plain_hooks(make_gpt):
    model, sae = make_gpt(seed=1).double(), make_sae("jumprelu", seed=3).double()
    clean, corrupted = _pair(2)
    metric = logit_diff(4, 8)
    with splice(model, sae):
        got = activation_patching(model, clean, corrupted, metric, sae_point(sae, "error"))
    assert got.shape == (6,)
    # Reference: the error at p taken from the clean run moves the stream at p by the errors' difference.
    x_clean, x_corr = grab(model, clean, HOOK), grab(model, corrupted, HOOK)
    with torch.no_grad():
        derr = ((x_clean - sae(x_clean)) - (x_corr - sae(x_corr)))[0]  # (T, d)
        shifts = torch.zeros(6, 6, 24, dtype=torch.float64)
        for p in range(6):
            shifts[p, p] = derr[p]
        with hooks(model, {HOOK: lambda s, h: s + shifts}):
            ref = metric.rows(model(corrupted.expand(6, -1)))
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    assert (ref != ref[0]).any()


def test_patching_a_transcoders_latents_against_plain_hooks(make_gpt):
    model = make_gpt(seed=2).double()
    tc = make_sae("standard", d_out=24, hook_name="blocks.0.hook_resid_mid", hook_name_out="blocks.0.hook_mlp_out")
    tc = tc.double()
    clean, corrupted = _pair(3)
    metric = logit_diff(2, 6)
    out = "blocks.0.hook_mlp_out"
    with splice(model, tc):
        effect = activation_patching(model, clean, corrupted, metric, sae_point(tc, "acts_post"))
        estimate = attribution_patching(model, clean, corrupted, metric, sae_point(tc, "acts_post"))
    # Reference: the MLP's output at p moves by dz[p, j] * W_dec[j]; the gradient there, by autograd.
    x_clean, x_corr = grab(model, clean, "blocks.0.hook_resid_mid"), grab(model, corrupted, "blocks.0.hook_resid_mid")
    with torch.no_grad():
        dz = (tc.encode(x_clean) - tc.encode(x_corr))[0]  # (T, d_sae)
        shifts = torch.zeros(6, 40, 6, 24, dtype=torch.float64)
        for p in range(6):
            shifts[p, :, p] = dz[p, :, None] * tc.W_dec
        shifts = shifts.reshape(-1, 6, 24)
        with hooks(model, {out: lambda m, h: m + shifts}):
            ref = metric.rows(model(corrupted.expand(shifts.shape[0], -1))).reshape(6, 40)
    leaf = {}

    def start(m, h):
        leaf["m"] = m.detach().requires_grad_(True)
        return leaf["m"]

    with hooks(model, {out: start}):
        (g,) = torch.autograd.grad(metric(model(corrupted)), [leaf["m"]])  # (1, T, d)
    torch.testing.assert_close(effect.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(estimate.double(), dz * (g[0] @ tc.W_dec.detach().T), atol=1e-6, rtol=1e-5)
    assert ref.sub(ref[0, 0]).abs().max() > 1e-4
