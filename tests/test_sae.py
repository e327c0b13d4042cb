"""attnlab.interpret.sae: SAEs and transcoders against float64 formulas written here, their files
(SAELens's, sparsify's, Gemma Scope's), splicing into a model and SAELens's measures."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from attnlab.interpret import SAE, SAEConfig, evaluate_sae, hooks, splice

HOOK = "blocks.0.hook_resid_post"


def make_sae(arch: str, d_in: int = 24, d_sae: int = 40, k: int = 5, seed: int = 0, **kw) -> SAE:
    """An SAE whose every parameter is random (biases and thresholds too), in eval mode."""
    torch.manual_seed(seed)
    transcoder = kw.get("d_out") is not None
    cfg = SAEConfig(
        d_in=d_in,
        d_sae=d_sae,
        architecture=arch,
        k=k if arch in ("topk", "batchtopk") else None,
        hook_name=kw.pop("hook_name", HOOK),
        apply_b_dec_to_input=not transcoder,
        **kw,
    )
    sae = SAE(cfg)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 1 / p.shape[0] ** 0.5))
            if name == "threshold":
                p.copy_(torch.rand_like(p) * 0.3)
        if arch == "batchtopk":
            sae.threshold.fill_(0.25)
    return sae.eval()


def reference(sae: SAE, x: torch.Tensor, *, training: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Latents and reconstruction in float64, one row at a time, from the published formulas."""
    c = sae.cfg
    p = {n: t.detach().double() for n, t in sae.state_dict().items()}
    rows = x.double().reshape(-1, c.d_in)
    pres, zs, outs = [], [], []
    for row in rows:
        xin = row - p["b_dec"] if c.apply_b_dec_to_input else row
        if c.architecture == "gated":
            gate = (xin @ p["W_enc"] + p["b_gate"]) > 0
            mag = xin @ (p["W_enc"] * p["r_mag"].exp()) + p["b_mag"]
            z = torch.where(gate, mag.clamp_min(0), torch.zeros_like(mag))
        else:
            pre = xin @ p["W_enc"] + p["b_enc"]
            if c.architecture == "standard":
                z = pre.clamp_min(0)
            elif c.architecture == "topk":
                keep = pre.argsort(descending=True)[: c.k]
                z = torch.zeros_like(pre)
                z[keep] = pre[keep].clamp_min(0)
            elif c.architecture in ("jumprelu", "batchtopk"):
                z = torch.where(pre > p["threshold"], pre.clamp_min(0), torch.zeros_like(pre))
            pres.append(pre)
        out = z @ p["W_dec"] + p["b_dec"]
        if c.skip:
            out = out + p["W_skip"] @ row
        zs.append(z)
        outs.append(out)
    lead = x.shape[:-1]
    return torch.stack(zs).reshape(*lead, c.d_sae), torch.stack(outs).reshape(*lead, c.width_out)


ARCHS = ["standard", "topk", "batchtopk", "jumprelu", "gated"]


@pytest.mark.parametrize("arch", ARCHS)
def test_encode_decode_match_the_formulas(arch):
    sae = make_sae(arch)
    x = torch.randn(3, 7, 24)
    z, out = sae.encode_decode(x)
    z_ref, out_ref = reference(sae, x)
    torch.testing.assert_close(z.double(), z_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sae(x), out)
    assert z.shape == (3, 7, 40) and out.dtype == x.dtype


@settings(max_examples=20, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 12),
    st.integers(1, 8),
    st.sampled_from(["topk", "standard", "jumprelu"]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_shapes_and_transcoders_with_skip(rows, d_in, k, arch, skip, seed):
    d_sae = 4 * d_in + k
    kw = {"d_out": d_in + 3, "skip": skip} if arch != "topk" or skip else {}
    sae = make_sae(arch, d_in=d_in, d_sae=d_sae, k=k, seed=seed, **kw)
    x = torch.randn(rows, d_in, generator=torch.Generator().manual_seed(seed))
    z, out = sae.encode_decode(x)
    z_ref, out_ref = reference(sae, x)
    torch.testing.assert_close(z.double(), z_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), out_ref, atol=1e-5, rtol=1e-5)
    if arch == "topk":
        assert ((z != 0).sum(-1) <= k).all()


def test_batchtopk_keeps_k_per_row_on_average_while_training():
    sae = make_sae("batchtopk", k=4).train()
    x = torch.randn(16, 24)
    z = sae.encode(x)
    pre = sae.pre_activations(x).detach().relu()
    assert int((z != 0).sum()) == 4 * 16  # the batch's 64 largest, spread over the rows as they fall
    kept = z[z != 0]
    assert kept.min() >= pre.flatten().topk(64).values.min() - 1e-6


@pytest.mark.parametrize("norm", ["layer_norm", "constant_norm_rescale"])
def test_rescale_by_decoder_norm_and_normalizations(norm):
    torch.manual_seed(3)
    sae = make_sae("topk", normalize_activations=norm, rescale_acts_by_decoder_norm=True)
    with torch.no_grad():
        sae.W_dec.mul_(torch.rand(40, 1) + 0.5)  # rows of unequal norm: the rescaling matters
    x = torch.randn(5, 24, dtype=torch.float64) * 3 + 1
    p = {n: t.detach().double() for n, t in sae.state_dict().items()}
    if norm == "layer_norm":
        mu = x.mean(-1, keepdim=True)
        std = (x - mu).std(-1, keepdim=True)
        xn, undo = (x - mu) / (std + 1e-5), lambda y: y * std + mu
    else:
        coeff = 24**0.5 / x.norm(dim=-1, keepdim=True)
        xn, undo = x * coeff, lambda y: y / coeff
    norms = p["W_dec"].norm(dim=-1)
    pre = ((xn - p["b_dec"]) @ p["W_enc"] + p["b_enc"]) * norms
    idx = pre.topk(5, dim=-1).indices
    z_ref = torch.zeros_like(pre).scatter(-1, idx, pre.gather(-1, idx).clamp_min(0))
    out_ref = undo((z_ref / norms) @ p["W_dec"] + p["b_dec"])
    z, out = sae.double().encode_decode(x)
    torch.testing.assert_close(z, z_ref)
    torch.testing.assert_close(out, out_ref)


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("transcoder", [False, True])
def test_saelens_round_trip(tmp_path, arch, transcoder):
    kw = {"d_out": 24, "skip": True, "hook_name_out": "blocks.0.hook_mlp_out"} if transcoder else {}
    sae = make_sae(arch, **kw)
    if transcoder and arch not in ("standard", "jumprelu", "batchtopk"):
        with pytest.raises(ValueError, match="SAELens has no"):
            sae.save(tmp_path, format="saelens")
        return
    sae.save(tmp_path, format="saelens")
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    expected = {"batchtopk": "jumprelu"}.get(arch, arch)
    if transcoder:
        expected = {"standard": "skip_transcoder"}.get(arch, "jumprelu_skip_transcoder")
    assert cfg["architecture"] == expected and cfg["metadata"]["hook_name"] == HOOK
    assert set(load_file(str(tmp_path / "sae_weights.safetensors"))) == set(sae.state_dict())
    back = SAE.load(tmp_path)
    x = torch.randn(4, 24)
    torch.testing.assert_close(back.encode_decode(x), sae.encode_decode(x), atol=0, rtol=0)
    assert back.cfg.hook_name == HOOK and back.cfg.transcoder == transcoder
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave nothing behind


def test_saelens_pre_6_flat_config(tmp_path):
    sae = make_sae("topk")
    save_file({k: v.contiguous() for k, v in sae.state_dict().items()}, str(tmp_path / "sae_weights.safetensors"))
    flat = {
        "d_in": 24,
        "d_sae": 40,
        "hook_point": HOOK,
        "activation_fn_str": "topk",
        "activation_fn_kwargs": {"k": 5},
        "apply_b_dec_to_input": True,
        "normalize_activations": False,
    }
    (tmp_path / "cfg.json").write_text(json.dumps(flat))
    back = SAE.load(tmp_path)
    assert back.cfg.architecture == "topk" and back.cfg.k == 5 and back.cfg.hook_name == HOOK
    x = torch.randn(3, 24)
    torch.testing.assert_close(back(x), sae(x))


@pytest.mark.parametrize("transcoder", [False, True])
def test_sparsify_round_trip_and_its_formula(tmp_path, transcoder):
    kw = {"d_out": 24, "skip": True} if transcoder else {}
    sae = make_sae("topk", **kw)
    sae.save(tmp_path, format="sparsify")
    w = load_file(str(tmp_path / "sae.safetensors"))
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert cfg["num_latents"] == 40 and cfg["k"] == 5 and cfg["transcode"] == transcoder and cfg["d_in"] == 24
    assert w["encoder.weight"].shape == (40, 24)
    # sparsify's forward, as its sparse_coder.py writes it: relu(linear) -> top-k -> gather W_dec rows.
    x = torch.randn(6, 24, dtype=torch.float64)
    w = {k: v.double() for k, v in w.items()}
    xin = x if transcoder else x - w["b_dec"]
    pre = torch.relu(xin @ w["encoder.weight"].T + w["encoder.bias"])
    acts, idx = pre.topk(5, dim=-1)
    out = torch.einsum("nk,nkd->nd", acts, w["W_dec"][idx]) + w["b_dec"]
    if transcoder:
        out = out + x @ w["W_skip"].T
    back = SAE.load(tmp_path).double()
    torch.testing.assert_close(back(x), out)
    torch.testing.assert_close(back(x), sae.double()(x))


def test_a_sparsify_flag_written_as_a_string_is_refused(tmp_path):
    # bool("false") is True: the SAE loaded as a transcoder, its meaning inverted.
    make_sae("topk").save(tmp_path, format="sparsify")
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    for key in ("transcode", "skip_connection"):
        (tmp_path / "cfg.json").write_text(json.dumps(cfg | {key: "false"}))
        with pytest.raises(ValueError, match=f"{key} must be true or false, got 'false'"):
            SAE.load(tmp_path)


def test_the_cfg_json_dtype_is_what_the_weights_are_cast_to(tmp_path):
    # SAELens casts the weights to cfg.json's dtype: a file saved after .half() says float32 over float16
    # tensors, and SAELens computes in float32 (attnlab computed in float16: latents 9e-3 apart).
    sae = make_sae("topk")
    sae.save(tmp_path)
    w = load_file(str(tmp_path / "sae_weights.safetensors"))
    save_file({k: v.half() for k, v in w.items()}, str(tmp_path / "sae_weights.safetensors"))
    back = SAE.load(tmp_path)
    assert back.dtype == torch.float32
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert cfg["dtype"] == "float32"
    for dtype, want in (("torch.bfloat16", torch.bfloat16), (None, torch.float16)):
        (tmp_path / "cfg.json").write_text(json.dumps(cfg | {"dtype": dtype}))
        assert SAE.load(tmp_path).dtype == want
    (tmp_path / "cfg.json").write_text(json.dumps(cfg | {"dtype": "int8"}))
    with pytest.raises(ValueError, match="dtype must be one of float32"):
        SAE.load(tmp_path)


def test_sparsify_refuses_what_it_cannot_hold(tmp_path):
    with pytest.raises(ValueError, match="TopK SAEs only"):
        make_sae("jumprelu").save(tmp_path, format="sparsify")
    with pytest.raises(ValueError, match="format must be"):
        make_sae("topk").save(tmp_path, format="pickle")


def test_gemma_scope_params(tmp_path):
    rng = np.random.default_rng(0)
    params = {
        "W_enc": rng.standard_normal((24, 40)).astype(np.float32) / 5,
        "W_dec": rng.standard_normal((40, 24)).astype(np.float32) / 6,
        "b_enc": rng.standard_normal(40).astype(np.float32) / 5,
        "b_dec": rng.standard_normal(24).astype(np.float32) / 5,
        "threshold": rng.random(40).astype(np.float32) / 4,
    }
    np.savez(tmp_path / "params.npz", **params)
    sae = SAE.load(tmp_path / "params.npz", hook_name=HOOK)
    assert sae.cfg.architecture == "jumprelu" and not sae.cfg.apply_b_dec_to_input
    x = rng.standard_normal((5, 24))
    p = {k: v.astype(np.float64) for k, v in params.items()}
    pre = x @ p["W_enc"] + p["b_enc"]  # Gemma Scope's JumpReLU: no b_dec subtracted from the input
    z = pre * (pre > p["threshold"])
    out = z @ p["W_dec"] + p["b_dec"]
    got = sae.double()(torch.from_numpy(x))
    np.testing.assert_allclose(got.detach().numpy(), out, atol=1e-6)
    assert SAE.load(tmp_path).cfg.d_sae == 40  # the directory works too
    np.save(tmp_path / "evil.npy", np.array([object()], dtype=object))
    bad = dict(params, W_enc=np.array([{"a": 1}] * 4, dtype=object))
    np.savez(tmp_path / "pickled.npz", **bad)
    with pytest.raises(ValueError, match=r"not a readable \.npz"):
        SAE.load(tmp_path / "pickled.npz")  # allow_pickle=False: an object array is refused, never unpickled


def test_hub_id_downloads_the_folder_only(tmp_path, monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    make_sae("topk").save(tmp_path / "layers.3", format="sparsify")
    calls = []

    def fake_download(repo_id, allow_patterns=None, revision=None):
        calls.append((repo_id, allow_patterns, revision))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    sae = SAE.load("EleutherAI/sae-test", subfolder="layers.3", hook_name=HOOK)
    assert calls == [("EleutherAI/sae-test", ["layers.3/*"], None)]
    assert sae.cfg.k == 5 and sae.cfg.hook_name == HOOK


def _saved(tmp_path, arch="topk"):
    make_sae(arch).save(tmp_path)
    return json.loads((tmp_path / "cfg.json").read_text()), load_file(str(tmp_path / "sae_weights.safetensors"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda c, w: c.update(architecture="matryoshka"), "unknown architecture 'matryoshka'"),
        (lambda c, w: c.update(d_sae=41), r"W_enc has shape \(24, 40\)"),
        (lambda c, w: w["W_dec"].__setitem__((0, 0), float("nan")), "W_dec holds NaN"),
        (lambda c, w: w.pop("b_enc"), "no 'b_enc'"),
        (lambda c, w: w.update(extra=torch.zeros(2)), "does not have: extra"),
        (lambda c, w: c.update(k=0), "needs k"),
        (lambda c, w: c.update(d_in="24"), "d_in must be a positive int"),
    ],
)
def test_bad_files_are_clear_value_errors(tmp_path, damage, message):
    cfg, w = _saved(tmp_path)
    damage(cfg, w)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    save_file(w, str(tmp_path / "sae_weights.safetensors"))
    with pytest.raises(ValueError, match=message):
        SAE.load(tmp_path)


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="SAE not found"):
        SAE.load(tmp_path / "nothing")
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError, match="no SAE in"):
        SAE.load(tmp_path / "d")
    _saved(tmp_path / "d")
    (tmp_path / "d" / "sae_weights.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match="not a readable safetensors"):
        SAE.load(tmp_path / "d")
    with pytest.raises(TypeError, match="path must be"):
        SAE.load(3)


def test_hook_width_is_checked(make_gpt):
    model = make_gpt()
    sae = make_sae("topk", d_in=16, d_sae=32)
    with pytest.raises(ValueError, match="d_in=16 does not match the model's width 24"):
        sae.check_model(model)
    with pytest.raises(ValueError, match="not a hook point"):
        make_sae("topk", hook_name="blocks.9.hook_resid_post").check_model(model)
    with pytest.raises(ValueError, match="input must be a tensor"):
        make_sae("topk")(torch.zeros(3, 5))


# ---------------------------------------------------------------------------------------------
# Splice and measures
# ---------------------------------------------------------------------------------------------
def test_splice_keeps_the_output_and_exposes_latents(make_gpt):
    model = make_gpt()
    sae = make_sae("topk")
    idx = torch.randint(0, 37, (2, 9))
    with torch.no_grad():
        clean = model(idx)
        with splice(model, sae) as cache:
            kept = model(idx)
        z = cache[f"{HOOK}.hook_sae_acts_post"]
        err = cache[f"{HOOK}.hook_sae_error"]
        with hooks(model, {HOOK: lambda x, h: None}):
            pass
        torch.testing.assert_close(kept, clean, atol=1e-5, rtol=1e-5)  # reconstruction + error = x
        torch.testing.assert_close(z, sae.encode(cache[f"{HOOK}.hook_sae_input"]))
        # Ablate the strongest latent at the last position: the stream moves by -z_i * W_dec[i], exactly.
        i = int(z[0, -1].argmax())

        def ablate(acts, hook):
            acts = acts.clone()
            acts[0, -1, i] = 0
            return acts

        with splice(model, sae, fns={"hook_sae_acts_post": ablate}) as edited:
            model(idx)
        moved = edited[f"{HOOK}.hook_sae_recons"] - cache[f"{HOOK}.hook_sae_recons"]
        torch.testing.assert_close(moved[0, -1], -z[0, -1, i] * sae.W_dec[i], atol=1e-6, rtol=1e-5)
        assert moved[1].abs().max() == 0 and torch.equal(edited[f"{HOOK}.hook_sae_error"], err)
        with splice(model, sae, keep_error=False):
            without = model(idx)
        assert (without - clean).abs().max() > 1e-4
    with pytest.raises(ValueError, match="unknown SAE hook"), splice(model, sae, fns={"hook_sae_latents": ablate}):
        pass


def test_splice_a_transcoder(make_gpt):
    model = make_gpt()
    tc = make_sae("standard", d_out=24, hook_name="blocks.1.hook_resid_mid", hook_name_out="blocks.1.hook_mlp_out")
    idx = torch.randint(0, 37, (2, 8))
    seen = {}
    with (
        torch.no_grad(),
        splice(model, tc, keep_error=False),
        hooks(
            model,
            {
                "blocks.1.hook_resid_mid": lambda x, h: seen.setdefault("in", x),
                "blocks.1.hook_mlp_out": lambda x, h: seen.setdefault("out", x),
            },
        ),
    ):
        model(idx)
    torch.testing.assert_close(seen["out"], tc(seen["in"]))


def _reference_evaluation(model, sae, idx, ignore=()):
    """SAELens's measures in float64, written out: a copy of the model in float64, hooks by hand."""
    m = type(model)(model.config).double().eval()
    m.load_state_dict(model.state_dict())
    s = SAE(sae.cfg, dtype=torch.float64)
    s.load_state_dict(sae.state_dict())
    s.eval()
    keep = torch.ones_like(idx, dtype=torch.bool)
    for t in ignore:
        keep &= idx != t
    acts = {}
    with torch.no_grad():
        with hooks(m, {HOOK: lambda x, h: acts.setdefault("x", x)}):
            clean = m(idx)
        x = acts["x"]
        z, r = s.encode_decode(x)
        with hooks(m, {HOOK: lambda a, h: torch.where(keep[..., None], r, a)}):
            spliced = m(idx)
        with hooks(m, {HOOK: lambda a, h: torch.zeros_like(a)}):
            ablated = m(idx)

    def ce(lg):
        lp = lg[:, :-1].log_softmax(-1)
        nll = -lp.gather(-1, idx[:, 1:, None])[..., 0]
        return nll[keep[:, :-1]].mean().item()

    def kl(lg):
        p, q = clean.log_softmax(-1), lg.log_softmax(-1)
        return (p.exp() * (p - q)).sum(-1)[keep].mean().item()

    xs, rs, zs = x[keep], r[keep], z[keep]
    ev = 1 - ((xs - rs) ** 2).sum(-1).mean() / ((xs - xs.mean(0)) ** 2).sum(-1).mean()
    ev_about_zero = 1 - ((xs - rs) ** 2).sum() / (xs**2).sum()
    return {
        "l0": (zs != 0).sum(-1).double().mean().item(),
        "explained_variance": ev.item(),
        "dead_fraction": ((zs != 0).sum(0) == 0).double().mean().item(),
        "ce_clean": ce(clean),
        "ce_spliced": ce(spliced),
        "ce_zero_ablated": ce(ablated),
        "kl_spliced": kl(spliced),
        "kl_zero_ablated": kl(ablated),
    }, ev_about_zero.item()


@pytest.mark.parametrize("arch", ["topk", "jumprelu"])
def test_evaluate_sae_against_the_formulas(make_gpt, arch):
    model = make_gpt()
    with torch.no_grad():  # a mean far from zero: explained variance about the mean and about zero differ
        model.tok_emb.weight.add_(3.0)
    sae = make_sae(arch, d_sae=60, k=3)
    idx = torch.randint(0, 37, (5, 12), generator=torch.Generator().manual_seed(1))
    acts = {}
    with torch.no_grad(), hooks(model, {HOOK: lambda x, h: acts.setdefault("x", x)}):
        model(idx)
        sae.b_dec.copy_(acts["x"].mean((0, 1)))  # reconstructions near the data: a moderate explained variance
    ignore = (int(idx[0, 0]),)
    got = evaluate_sae(model, sae, idx, batch_size=2, ignore_tokens=ignore)
    ref, ev_zero = _reference_evaluation(model, sae, idx, ignore)
    for key, value in ref.items():
        assert getattr(got, key) == pytest.approx(value, abs=1e-4, rel=1e-5), key
    assert got.ce_loss_recovered == pytest.approx(
        (ref["ce_zero_ablated"] - ref["ce_spliced"]) / (ref["ce_zero_ablated"] - ref["ce_clean"]), abs=1e-3
    )
    assert abs(ev_zero - got.explained_variance) > 0.05  # the pre-#665 figure is another number
    assert got.tokens == int((idx != ignore[0]).sum())
    assert 0 < got.dead_fraction < 1
    assert got.density.shape == (60,)


def test_evaluate_sae_rejects_bad_tokens(make_gpt):
    with pytest.raises(ValueError, match="integer tensor"):
        evaluate_sae(make_gpt(), make_sae("topk"), torch.zeros(2, 5))
    with pytest.raises(ValueError, match="at least 2 positions"):
        evaluate_sae(make_gpt(), make_sae("topk"), torch.zeros(2, 1, dtype=torch.long))


def test_evaluate_sae_reports_its_progress(make_gpt):
    # `attnlab sae eval` printed nothing for two minutes.
    seen = []
    tokens = torch.randint(0, 37, (5, 6), generator=torch.Generator().manual_seed(0))
    quiet = evaluate_sae(make_gpt(), make_sae("topk"), tokens, batch_size=2)
    loud = evaluate_sae(make_gpt(), make_sae("topk"), tokens, batch_size=2, progress=seen.append)
    assert seen == [12, 24, 30] and loud.as_dict() == quiet.as_dict()
    with pytest.raises(TypeError, match="progress must be a callable or None, got int"):
        evaluate_sae(make_gpt(), make_sae("topk"), tokens, progress=3)


@pytest.mark.parametrize("norm", ["none", "constant_norm_rescale", "layer_norm"])
@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("transcoder", [False, True])
def test_latent_writes_are_the_decoders_terms(norm, rescale, transcoder):
    """decode(z, x) = decode(0, x) + the sum of every latent's write: what makes each latent a node."""
    torch.manual_seed(0)
    kw = dict(d_out=12, apply_b_dec_to_input=False, skip=True) if transcoder else {}
    cfg = SAEConfig(
        d_in=12,
        d_sae=30,
        architecture="topk",
        k=4,
        normalize_activations=norm,
        rescale_acts_by_decoder_norm=rescale,
        **kw,
    )
    sae = SAE(cfg, dtype=torch.float64)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    x = torch.randn(3, 5, 12, dtype=torch.float64) * 3 + 1
    z = sae.encode(x)
    writes = sae.latent_writes(z, range(30), x)  # (3, 5, 30, 12)
    assert writes.shape == (3, 5, 30, 12)
    torch.testing.assert_close(sae.decode(torch.zeros_like(z), x) + writes.sum(-2), sae.decode(z, x))
    some = sae.latent_writes(z, [7, 2], x)
    torch.testing.assert_close(some, writes[..., [7, 2], :])
    for bad in (x[..., :-1], x[:1], "x"):  # another width, another batch, not a tensor
        with pytest.raises(ValueError, match=r"SAE.decode: x must be the input the latents came from, \(3, 5, 12\)"):
            sae.decode(z, bad)


def test_a_missing_sae_is_named_where_it_is_taken(make_gpt):
    # (an AttributeError on None's .cfg or .check_model, before)
    from attnlab.interpret.sae_view import collect, prompt_latents, strongest_latents

    model, idx = make_gpt(), torch.randint(0, 37, (1, 8))
    calls = {
        "evaluate_sae": lambda: evaluate_sae(model, None, idx),
        "prompt_latents": lambda: prompt_latents(model, None, idx[0]),
        "strongest_latents": lambda: strongest_latents(model, None, idx[0]),
        "collect": lambda: collect(model, None, idx[0]),
        "splice": lambda: splice(model, None).__enter__(),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=f"{name}: sae must be an attnlab SAE, got NoneType"):
            call()


def test_latent_writes_names_latents_out_of_range_and_latents_of_another_width():
    # latent -1 gave the last latent's write, 1.5 latent 1's, and a z of another width a result: silently.
    sae = make_sae("topk")
    z = torch.rand(3, sae.cfg.d_sae)
    for bad in ([-1], [1.5], [sae.cfg.d_sae]):
        with pytest.raises(ValueError, match=r"latents must be latent indices in \[0, 40\)"):
            sae.latent_writes(z, bad)
    with pytest.raises(ValueError, match=r"z must be latents \(\.\.\., d_sae=40\), got shape \(3, 10\)"):
        sae.latent_writes(torch.rand(3, 10), [1])


@pytest.mark.parametrize("name", ["skip", "apply_b_dec_to_input", "rescale_acts_by_decoder_norm"])
def test_a_config_flag_that_is_not_a_bool_is_refused(name):
    # rescale_acts_by_decoder_norm="no" was kept, truthy: the option on, silently.
    with pytest.raises(ValueError, match=f"SAE config: {name} must be True or False, got 'no'"):
        SAEConfig(d_in=24, d_sae=40, architecture="topk", k=5, **{name: "no"})
