"""SAE dashboards (attnlab.interpret.sae_view, ``attnlab sae dashboard``): the streamed statistics against
the whole corpus's latents computed at once here, the unembedding products against W_dec @ W_U, the page."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from attnlab.cli import main
from attnlab.interpret import SAE, SAEConfig, hooks
from attnlab.interpret.sae_view import (
    BINS,
    LOG_HI,
    LOG_LO,
    collect,
    dashboard_data,
    dashboard_page,
    latent_logits,
    read_dashboard_data,
)

HOOK = "blocks.1.hook_resid_pre"


def make_sae(d_in: int = 24, d_sae: int = 48, seed: int = 0, hook: str = HOOK) -> SAE:
    torch.manual_seed(seed)
    sae = SAE(SAEConfig(d_in=d_in, d_sae=d_sae, architecture="topk", k=6, hook_name=hook))
    with torch.no_grad():
        sae.b_enc.normal_(0, 0.3)
    return sae.eval()


def grab(model, windows):
    seen = {}
    with torch.no_grad(), hooks(model, {HOOK: lambda x, h: seen.setdefault("x", x)}):
        model(windows)
    return seen["x"]  # (B, T, d)


def all_latents(model, sae, ids, context):
    """Every token's latents, the whole corpus at once: ``(N, d_sae)`` float64."""
    windows = ids[: len(ids) // context * context].view(-1, context)
    with torch.no_grad():
        z = copy.deepcopy(sae).double().encode(grab(model, windows).double())  # (B, T, d_sae)
    return z.reshape(-1, sae.cfg.d_sae), windows


@pytest.mark.parametrize("batch", [1, 3])
def test_streamed_statistics_equal_the_whole_corpus_at_once(make_gpt, batch):
    model, sae = make_gpt(seed=1), make_sae(seed=1)
    context, k, w = 8, 4, 2
    ids = torch.randint(0, 37, (7 * context + 3,), generator=torch.Generator().manual_seed(0))
    x = grab(model, ids[: 7 * context].view(7, context))
    with torch.no_grad():  # centred input: the stream's common part would pick the same latents everywhere
        sae.b_dec.copy_(x.mean((0, 1)))
        sae.W_enc.copy_(torch.randn_like(sae.W_enc) / x.std())
    z, windows = all_latents(model, sae, ids, context)  # (N, d_sae)
    fires = (z != 0).sum(0)  # (d_sae,)
    by_count = fires.argsort(descending=True).tolist()
    rare = [i for i in by_count if 0 < fires[i] <= k]  # fewer firings than the top k holds
    chosen = list(dict.fromkeys(by_count[:2] + rare[:2] + by_count[-1:]))  # often, rarely, least
    assert len(chosen) == 5 and len(rare) >= 2
    stats = collect(model, sae, ids.numpy(), chosen, context=context, batch=batch, top_k=k, window=w)
    z = z[:, chosen]  # (N, n)
    N = z.shape[0]
    assert stats.tokens == N == 56 and (stats.top_values[:, 0] > 0).sum() >= 4
    np.testing.assert_allclose(stats.density.numpy(), (z != 0).double().mean(0).numpy())
    for r in range(len(chosen)):
        col = z[:, r]
        order = sorted(range(N), key=lambda i: -float(col[i]))[:k]  # the k strongest tokens
        fired = [i for i in order if col[i] > 0]
        np.testing.assert_allclose(stats.top_values[r, : len(fired)].numpy(), col[fired].numpy(), rtol=1e-5)
        assert stats.top_positions[r, : len(fired)].tolist() == fired or torch.allclose(
            col[stats.top_positions[r, : len(fired)]], col[fired]
        )  # (ties may pick either position)
        for e, pos in enumerate(stats.top_positions[r, : len(fired)].tolist()):
            win, t = divmod(pos, context)
            for o in range(-w, w + 1):
                if 0 <= t + o < context:
                    assert int(stats.context_ids[r, e, o + w]) == int(windows[win, t + o])
                    assert math.isclose(float(stats.context_acts[r, e, o + w]), float(col[pos + o]), rel_tol=1e-5)
                else:  # outside the window it was read in: nothing
                    assert int(stats.context_ids[r, e, o + w]) == -1
        assert (stats.top_positions[r, len(fired) :] == -1).all()
        # The histogram: log10 bins of the nonzero activations.
        nz = col[col != 0].numpy()
        bins = np.clip(((np.log10(nz) - LOG_LO) / (LOG_HI - LOG_LO) * BINS).astype(int), 0, BINS - 1)
        np.testing.assert_array_equal(stats.histogram[r].numpy(), np.bincount(bins, minlength=BINS))


def test_promoted_tokens_are_w_dec_times_w_u(make_gpt):
    model, sae = make_gpt(seed=2), make_sae(seed=2)
    latents = torch.tensor([3, 9])
    got = latent_logits(model, sae, latents)
    ref = sae.W_dec.detach().double()[latents] @ model.out_head.weight.detach().double().T  # (2, V)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    ids = torch.randint(0, 37, (64,), generator=torch.Generator().manual_seed(1))
    data = dashboard_data(model, sae, ids, None, [3, 9], context=8, n_logits=3)
    top = ref[0].topk(3).indices.tolist()
    assert [t for t, _ in data["latents"][0]["promotes"]] == [f"#{i}" for i in top]
    low = ref[1].topk(3, largest=False).indices.tolist()
    assert [t for t, _ in data["latents"][1]["suppresses"]] == [f"#{i}" for i in low]
    page = dashboard_page(data)
    assert "default-src 'none'" in page and "<script src" not in page
    assert read_dashboard_data(page) == data


def test_a_transcoder_into_the_mlps_neurons_has_a_dashboard_without_tokens(make_gpt, tmp_path, capsys):
    # Its decoder rows have the MLP's width, not the stream's: W_dec @ W_U failed with a shape error
    # (a traceback from `sae dashboard` and `viz --sae`).
    model = make_gpt(seed=2)
    torch.manual_seed(0)
    cfg = SAEConfig(d_in=24, d_sae=32, architecture="topk", k=4, hook_name="blocks.1.hook_resid_mid",
                    d_out=96, hook_name_out="blocks.1.mlp.hook_post", apply_b_dec_to_input=False)  # fmt: skip
    sae = SAE(cfg).eval()
    assert latent_logits(model, sae, torch.tensor([0, 1])) is None
    ids = torch.randint(0, 37, (64,), generator=torch.Generator().manual_seed(1))
    data = dashboard_data(model, sae, ids, None, [0, 1], context=8, n_logits=3)
    assert [L["promotes"] for L in data["latents"]] == [None, None] == [L["suppresses"] for L in data["latents"]]
    assert read_dashboard_data(dashboard_page(data)) == data


def test_bad_arguments(make_gpt):
    model, sae = make_gpt(), make_sae()
    ids = np.zeros(40, dtype=np.int64)
    with pytest.raises(ValueError, match="latents"):
        collect(model, sae, ids, [48], context=8)
    with pytest.raises(ValueError, match="fewer than one window"):
        collect(model, sae, ids[:5], 4, context=8)
    with pytest.raises(ValueError, match="context must be a positive int"):
        collect(model, sae, ids, 4, context=0)


@pytest.mark.slow
def test_cli_dashboard_on_smollm2(smollm2_gguf, tmp_path, capsys, one_thread):
    sae = make_sae(d_in=576, d_sae=64, hook="blocks.2.hook_resid_post")
    sae.save(tmp_path / "sae")
    text = tmp_path / "t.txt"
    text.write_text("The cat sat on the mat. The dog ran to the park and back again. " * 6, encoding="utf-8")
    out = tmp_path / "page.html"
    args = ["sae", "dashboard", "--model", str(smollm2_gguf), "--sae", str(tmp_path / "sae"), "--data", str(text)]
    code = main([*args, "--latents", "5", "--tokens", "64", "--context", "32", "--out", str(out), "--no-progress"])
    assert code == 0, capsys.readouterr().err
    data = read_dashboard_data(out.read_text(encoding="utf-8"))
    assert [L["latent"] for L in data["latents"]] == list(range(5)) and data["tokens"] == 64
    assert main([*args, "--latents", "65", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--latents must be at most the SAE's d_sae=64" in err and err.count("\n") == 1


def test_a_tokens_strongest_latents(make_gpt):
    from attnlab.interpret.sae_view import strongest_latents

    model, sae = make_gpt(seed=4), make_sae(seed=4)
    idx = torch.randint(0, 37, (9,), generator=torch.Generator().manual_seed(2))
    values, latents = strongest_latents(model, sae, idx, n=3)
    with torch.no_grad():
        z = copy.deepcopy(sae).double().encode(grab(model, idx[None]).double())[0]  # (T, d_sae) float64
    assert values.shape == latents.shape == (9, 3) and (values[:, 0] > 0).all()
    for t in range(9):
        ref = sorted(range(48), key=lambda j: -float(z[t, j]))[:3]
        np.testing.assert_allclose(values[t].numpy(), z[t, ref].numpy(), rtol=1e-5, atol=1e-7)
        assert torch.allclose(z[t, latents[t]], z[t, ref])  # (ties may list either latent)
    with pytest.raises(ValueError, match="n must be an int"):
        strongest_latents(model, sae, idx, n=0)
    with pytest.raises(ValueError, match="one prompt"):
        strongest_latents(model, sae, idx.view(3, 3))


@pytest.mark.cuda
def test_on_cuda_the_figures_are_the_cpus(make_gpt):
    """Device-agnostic: the dashboards, a splice's latents and steering on a CUDA model and SAE equal
    the CPU's (to float32 rounding)."""
    from attnlab.interpret import run_with_cache, sae_point, splice, steer

    model, sae = make_gpt(seed=1), make_sae(seed=1)
    ids = torch.randint(0, 37, (40,), generator=torch.Generator().manual_seed(0))
    cpu = collect(model, sae, ids, 6, context=8, top_k=3, window=1)
    gpu_model, gpu_sae = copy.deepcopy(model).cuda(), copy.deepcopy(sae).cuda()
    gpu = collect(gpu_model, gpu_sae, ids.cuda(), 6, context=8, top_k=3, window=1)
    torch.testing.assert_close(gpu.top_values, cpu.top_values, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(gpu.density, cpu.density)
    idx = ids[:8][None]
    for m, s in ((model, sae), (gpu_model, gpu_sae)):
        with splice(m, s), steer(m, s, 2, 3.0):
            _, cache = run_with_cache(m, idx.to(next(m.parameters()).device))
        if m is model:
            ref = cache[sae_point(sae, "acts_post")]
    torch.testing.assert_close(cache[sae_point(gpu_sae, "acts_post")].cpu(), ref, atol=1e-4, rtol=1e-4)
