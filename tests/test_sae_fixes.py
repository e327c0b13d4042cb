"""attnlab.interpret.sae and attnlab.training.sae: what a review found wrong, each against an
independent reference (SAELens's formulas and conversions written out here, JSON read strictly)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab.interpret import SAE, SAEConfig, evaluate_sae
from attnlab.training.checkpoint import CHECKPOINT_NAME, find_checkpoint
from attnlab.training.sae import SAETrainConfig, SAETrainer, train_sae

HOOK = "blocks.1.hook_resid_post"
SMALL = dict(width=48, k=4, batch_rows=32, buffer_rows=128, context=9, model_batch=4, dead_tokens=64, save_every=3)
QUIET = dict(write=lambda s: None)


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 37, 3000).astype(np.uint16)


def _random_sae(arch: str, *, transcoder: bool = False, d_out: int = 20, seed: int = 1, **kw) -> SAE:
    torch.manual_seed(seed)
    if transcoder:
        kw = dict(d_out=d_out, hook_name_out="blocks.0.hook_mlp_out", apply_b_dec_to_input=False, **kw)
    sae = SAE(SAEConfig(d_in=24, d_sae=40, architecture=arch, k=5 if arch in ("topk", "batchtopk") else None, **kw))
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 1 / p.shape[0] ** 0.5))
        sae.W_dec.mul_(torch.rand(40, 1) * 3 + 0.2)  # rows of unequal norms: the rescaling matters
        if hasattr(sae, "threshold"):
            sae.threshold.copy_(torch.rand(40) * 0.2)
    return sae.eval()


def _saelens_forward(cfg: dict, t: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """SAELens's inference in float64 (no normalization), from a cfg.json and its tensors: the decoder
    norms rescale a TopK SAE alone, as SAELens's classes do."""
    t = {k: v.double() for k, v in t.items()}
    arch, x = cfg["architecture"], x.double()
    xin = x - t["b_dec"] if cfg["apply_b_dec_to_input"] else x
    norms = t["W_dec"].norm(dim=-1) if cfg.get("rescale_acts_by_decoder_norm") and arch == "topk" else 1.0
    if arch == "gated":
        z = (xin @ t["W_enc"] + t["b_gate"] > 0) * (xin @ (t["W_enc"] * t["r_mag"].exp()) + t["b_mag"]).relu()
    else:
        pre = (xin @ t["W_enc"] + t["b_enc"]) * norms
        if arch == "topk":
            v, i = pre.topk(cfg["k"], dim=-1)
            z = torch.zeros_like(pre).scatter(-1, i, v.relu())
        elif "jumprelu" in arch:
            z = pre.relu() * (pre > t["threshold"])
        else:
            z = pre.relu()
    out = (z / norms) @ t["W_dec"] + t["b_dec"]
    return out + x @ t["W_skip"].T if "skip" in arch else out


def _rescaled_reference(sae: SAE, x: torch.Tensor) -> torch.Tensor:
    """The option's meaning in float64: pre-activations times the decoder rows' norms (the gated
    SAE's magnitude path), latents divided by them before decoding."""
    p = {k: v.detach().double() for k, v in sae.state_dict().items()}
    c, x = sae.cfg, x.double()
    norms = p["W_dec"].norm(dim=-1)
    xin = x - p["b_dec"] if c.apply_b_dec_to_input else x
    if c.architecture == "gated":
        gate = xin @ p["W_enc"] + p["b_gate"] > 0
        z = gate * ((xin @ (p["W_enc"] * p["r_mag"].exp()) + p["b_mag"]) * norms).relu()
    else:
        pre = (xin @ p["W_enc"] + p["b_enc"]) * norms
        z = pre.relu() * (pre > p["threshold"]) if c.architecture in ("jumprelu", "batchtopk") else pre.relu()
    return (z / norms) @ p["W_dec"] + p["b_dec"]


# ---------------------------------------------------------------------------------------------
# 1. rescale_acts_by_decoder_norm survives a save, for SAELens and for attnlab
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "arch, transcoder",
    [(a, False) for a in ("batchtopk", "jumprelu", "gated")] + [(a, True) for a in ("batchtopk", "jumprelu")],
)
def test_rescale_by_decoder_norm_is_saved_as_it_runs(tmp_path, arch, transcoder):
    sae = _random_sae(arch, transcoder=transcoder, rescale_acts_by_decoder_norm=True)
    x = torch.randn(64, 24)
    ref = _rescaled_reference(sae, x)
    torch.testing.assert_close(sae(x).double(), ref, atol=1e-5, rtol=1e-5)  # (gated: ignored the option before)
    sae.save(tmp_path)
    cfg, tensors = json.loads((tmp_path / "cfg.json").read_text()), load_file(str(tmp_path / "sae_weights.safetensors"))
    torch.testing.assert_close(_saelens_forward(cfg, tensors, x), ref, atol=1e-5, rtol=1e-5)  # as SAELens reads it
    torch.testing.assert_close(SAE.load(tmp_path)(x).double(), ref, atol=1e-5, rtol=1e-5)


def test_a_saelens_batchtopk_training_checkpoint_survives_a_save(tmp_path):
    torch.manual_seed(0)
    t = {
        "W_enc": torch.randn(16, 64) / 4,
        "W_dec": torch.randn(64, 16) * 0.3,
        "b_enc": torch.randn(64) * 0.1,
        "b_dec": torch.randn(16) * 0.1,
        "topk_threshold": torch.tensor(0.4, dtype=torch.float64),
    }
    cfg = {
        "architecture": "batchtopk",
        "d_in": 16,
        "d_sae": 64,
        "k": 8,
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "rescale_acts_by_decoder_norm": True,
        "metadata": {"sae_lens_version": "6.5.0", "hook_name": HOOK},
    }
    save_file(t, str(tmp_path / "sae_weights.safetensors"))
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    # SAELens's inference form of it: the norms folded in, a JumpReLU at the scalar threshold.
    T = {k: v.double() for k, v in t.items()}
    n = T["W_dec"].norm(dim=-1)
    x = torch.randn(100, 16)
    pre = (x.double() - T["b_dec"]) @ (T["W_enc"] * n) + T["b_enc"] * n
    ref = (pre.relu() * (pre > T["topk_threshold"])) @ (T["W_dec"] / n[:, None]) + T["b_dec"]
    SAE.load(tmp_path).save(tmp_path / "again")
    torch.testing.assert_close(SAE.load(tmp_path / "again")(x).double(), ref, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# 4. older SAELens files, converted as SAELens's loaders convert them
# ---------------------------------------------------------------------------------------------
def _write(d, cfg: dict, tensors: dict[str, torch.Tensor]):
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "sae_weights.safetensors"))
    (d / "cfg.json").write_text(json.dumps(cfg))
    return d


PRE_6 = {
    "hook_point": "blocks.0.hook_resid_pre",
    "hook_point_head_index": None,
    "d_in": 16,
    "d_sae": 64,
    "activation_fn_str": "relu",
    "apply_b_dec_to_input": True,
    "normalize_activations": "none",
    "finetuning_scaling_factor": False,
}


def _weights(**extra: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    w = {"W_enc": torch.randn(16, 64), "W_dec": torch.randn(64, 16), "b_enc": torch.randn(64), "b_dec": torch.randn(16)}
    return {**w, **extra}


def test_older_saelens_files_load_as_saelens_loads_them(tmp_path):
    x = torch.randn(5, 16)
    w = _weights(scaling_factor=torch.ones(64))  # pre-6.0: a scaling factor of ones, which SAELens drops
    sae = SAE.load(_write(tmp_path / "ones", PRE_6, w))
    ref = _saelens_forward({"architecture": "standard", "apply_b_dec_to_input": True}, w, x)
    torch.testing.assert_close(sae(x).double(), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="scaling_factor that is not all ones"):
        SAE.load(
            _write(
                tmp_path / "twos",
                {**PRE_6, "finetuning_scaling_factor": True},
                {**w, "scaling_factor": w["b_enc"].clone()},
            )
        )
    with pytest.raises(ValueError, match=r"one head \(hook_point_head_index\)"):
        SAE.load(_write(tmp_path / "head", {**PRE_6, "hook_point_head_index": 3}, _weights()))
    # A JumpReLU file with log_threshold: SAELens takes exp of it as the threshold.
    w = _weights(log_threshold=torch.randn(64))
    cfg = {"architecture": "jumprelu", "d_in": 16, "d_sae": 64, "apply_b_dec_to_input": True}
    sae = SAE.load(_write(tmp_path / "log", {**cfg, "metadata": {"sae_lens_version": "5.9.0", "hook_name": HOOK}}, w))
    ref = _saelens_forward(cfg, {**w, "threshold": w["log_threshold"].exp()}, x)
    torch.testing.assert_close(sae(x).double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "key, value", [("architecture", ["topk"]), ("normalize_activations", ["none"]), ("apply_b_dec_to_input", "no")]
)
def test_wrong_json_types_are_one_line_value_errors(tmp_path, capsys, key, value):
    from attnlab.cli import main

    d = tmp_path / "sae"
    _random_sae("topk").save(d)
    cfg = json.loads((d / "cfg.json").read_text())
    (d / "cfg.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(ValueError, match=f"{key} must be"):
        SAE.load(d)
    assert main(["sae", "info", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{key} must be" in err


# ---------------------------------------------------------------------------------------------
# 5. saving over the other format
# ---------------------------------------------------------------------------------------------
def test_saving_over_the_other_format_loads_what_was_saved(tmp_path):
    x = torch.randn(4, 24)
    a, b = _random_sae("topk"), _random_sae("topk", seed=2)
    for first, second, fmt, stale in (
        (a, b, "sparsify", "sae_weights.safetensors"),
        (b, a, "saelens", "sae.safetensors"),
    ):
        d = tmp_path / fmt
        first.save(d, format="saelens" if fmt == "sparsify" else "sparsify")
        second.save(d, format=fmt)
        assert not (d / stale).exists()
        torch.testing.assert_close(SAE.load(d)(x), second(x))
    # Both weights files beside one cfg.json (a save cut short): cfg.json says which is meant.
    (tmp_path / "saelens" / "sae.safetensors").write_bytes((tmp_path / "sparsify" / "sae.safetensors").read_bytes())
    (tmp_path / "sparsify" / "sae_weights.safetensors").write_bytes(
        (tmp_path / "saelens" / "sae_weights.safetensors").read_bytes()
    )
    torch.testing.assert_close(SAE.load(tmp_path / "saelens")(x), a(x))
    torch.testing.assert_close(SAE.load(tmp_path / "sparsify")(x), b(x))


# ---------------------------------------------------------------------------------------------
# 6, 7. a transcoder's output hook: given when the files lack it, refused before the input hook
# ---------------------------------------------------------------------------------------------
def test_a_transcoder_without_its_output_hook_takes_one(make_gpt, tmp_path, monkeypatch, capsys):
    model = make_gpt()
    sae = _random_sae("jumprelu", transcoder=True, d_out=24, hook_name="blocks.0.hook_resid_mid")
    sae.save(tmp_path)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    del cfg["metadata"]["hook_name_out"]
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"hook_name_out=.*--hook-out"):
        SAE.load(tmp_path).check_model(model)
    loaded = SAE.load(tmp_path, hook_name_out="blocks.0.hook_mlp_out")
    loaded.check_model(model)
    idx = torch.randint(0, 37, (2, 8))
    assert evaluate_sae(model, loaded, idx).tokens == 16
    with pytest.raises(ValueError, match="an autoencoder"):
        SAE.load(_random_sae("topk").save(tmp_path / "ae"), hook_name_out="blocks.0.hook_mlp_out")
    # An autoencoder that does not subtract b_dec from its input (SAELens's apply_b_dec_to_input=False)
    # is still one: its file says so (once it became a transcoder silently).
    plain = _random_sae("jumprelu", apply_b_dec_to_input=False).save(tmp_path / "ae2")
    with pytest.raises(ValueError, match="an autoencoder"):
        SAE.load(plain, hook_name_out="blocks.0.hook_mlp_out")
    # The CLI passes --hook-out where it takes --hook.
    from attnlab.cli import main

    seen = []

    def load(path, **kw):
        seen.append(kw["hook_name_out"])
        raise ValueError("stop here")

    monkeypatch.setattr(SAE, "load", load)
    for argv in (["eval"], ["dashboard", "--out", str(tmp_path / "d.html")]):
        assert main(["sae", *argv, "--sae", "x", "--model", "m.gguf", "--hook-out", "blocks.0.hook_mlp_out"]) == 2
    assert seen == ["blocks.0.hook_mlp_out"] * 2
    capsys.readouterr()


def test_an_output_hook_before_the_input_hook_is_refused(make_gpt, corpus, tmp_path):
    model = make_gpt()
    sae = SAE(
        SAEConfig(
            d_in=24,
            d_sae=40,
            architecture="topk",
            k=5,
            hook_name="blocks.1.hook_resid_post",
            hook_name_out="blocks.0.hook_mlp_out",
            apply_b_dec_to_input=False,
        )
    )
    for call in (lambda: sae.check_model(model), lambda: evaluate_sae(model, sae, torch.randint(0, 37, (1, 8)))):
        with pytest.raises(
            ValueError, match=r"'blocks\.0\.hook_mlp_out' comes before its input hook 'blocks\.1\.hook_resid_post'"
        ):
            call()
    cfg = SAETrainConfig(hook="blocks.1.hook_resid_post", hook_out="blocks.0.hook_mlp_out", **SMALL)
    with pytest.raises(ValueError, match=r"--hook-out 'blocks\.0\.hook_mlp_out' comes before --hook"):
        SAETrainer(model, corpus, cfg, tmp_path / "run", **QUIET)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------
# 2. a TopK transcoder no format holds is refused before training
# ---------------------------------------------------------------------------------------------
def test_a_topk_transcoder_of_two_widths_is_refused_before_training(make_gpt, corpus, tmp_path):
    model = make_gpt()
    hooks = dict(hook="blocks.1.hook_resid_mid", hook_out="blocks.1.mlp.hook_post")  # width 24 -> the MLP's 96
    with pytest.raises(ValueError, match=r"TopK transcoder from --hook \(width 24\) to --hook-out \(width 96\)"):
        SAETrainer(model, corpus, SAETrainConfig(**hooks, **SMALL), tmp_path / "topk", **QUIET)
    assert not (tmp_path / "topk").exists()
    # What the message suggests trains and saves.
    result = train_sae(model, corpus, tmp_path / "btk", **hooks, architecture="batchtopk", tokens=64, **SMALL, **QUIET)
    back = SAE.load(tmp_path / "btk" / "sae")
    x = torch.randn(3, 24)
    torch.testing.assert_close(back(x), result.sae(x))


# ---------------------------------------------------------------------------------------------
# 3. a resumed run keeps its data and model
# ---------------------------------------------------------------------------------------------
def test_resuming_with_other_data_or_another_model_is_refused(make_gpt, corpus, tmp_path):
    model = make_gpt()
    train_sae(model, corpus, tmp_path, hook=HOOK, tokens=32 * 4, **SMALL, **QUIET)
    other = corpus.copy()
    other[1000] = (other[1000] + 1) % 37  # one token differs
    with pytest.raises(ValueError, match="--data is not the one the run in --out"):
        train_sae(model, other, tmp_path, hook=HOOK, tokens=32 * 8, **SMALL, **QUIET)
    with pytest.raises(ValueError, match="--model is not the one the run in --out"):
        train_sae(make_gpt(seed=1), corpus, tmp_path, hook=HOOK, tokens=32 * 8, **SMALL, **QUIET)
    lines = []  # the same data in another dtype, the same model: it resumes
    train_sae(model, corpus.astype(np.int64), tmp_path, hook=HOOK, tokens=32 * 8, **SMALL, write=lines.append)
    assert lines[0].startswith("resuming ")


@pytest.mark.parametrize("edit", ["files_list", "no_settings", "outside", "dev_zero"])
def test_a_resumed_checkpoint_edited_and_rehashed_is_refused(make_gpt, corpus, tmp_path, edit):
    """The checkpoint's self-hash has no key: anyone can edit it and hash it again. Its entries were
    trusted (a traceback; a file outside the run read and hashed; /dev/zero read until memory ran out)."""
    import hashlib

    from attnlab.training.checkpoint import SELF_HASH, metadata_digest

    model = make_gpt()
    train_sae(model, corpus, tmp_path, hook=HOOK, tokens=32 * 4, **SMALL, **QUIET)
    step = tmp_path / json.loads((tmp_path / "latest.json").read_text())["path"]
    meta = json.loads((step / "checkpoint.json").read_text())
    if edit == "files_list":
        meta["files"] = ["x"]
    elif edit == "no_settings":
        del meta["settings"]
    elif edit == "outside":
        outside = tmp_path.parent / "outside.txt"
        outside.write_text("secret")
        entry = {"bytes": 6, "sha256": hashlib.sha256(b"secret").hexdigest()}
        meta["files"]["../../outside.txt"] = entry
    else:
        (step / "model.safetensors").unlink()
        (step / "model.safetensors").symlink_to("/dev/zero")
        del meta["files"]["model.safetensors"]
    meta[SELF_HASH] = metadata_digest(meta)
    (step / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a well-formed SAE checkpoint"):
        train_sae(model, corpus, tmp_path, hook=HOOK, tokens=32 * 8, **SMALL, **QUIET)


# ---------------------------------------------------------------------------------------------
# 12. NaN activations and a NaN loss stop the run, clearly
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio", [0.0, 10.0])
def test_nan_activations_are_refused_naming_the_hook(make_gpt, corpus, tmp_path, ratio):
    model = make_gpt()
    with torch.no_grad():
        model.tok_emb.weight[5] = float("nan")
    with pytest.raises(ValueError, match=f"activations at {HOOK} hold NaN"):
        train_sae(model, corpus, tmp_path, hook=HOOK, tokens=64, outlier_ratio=ratio, **SMALL, **QUIET)


def _strict_json(line: str) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(make_gpt, corpus, tmp_path):
    model = make_gpt()
    trainer = SAETrainer(model, corpus, SAETrainConfig(hook=HOOK, tokens=32 * 40, **SMALL), tmp_path, **QUIET)
    batch = trainer.buffer.batch

    def poisoned(step: int):
        x, y = batch(step)
        return (x * float("nan"), y) if step == 13 else (x, y)  # the 14th step's rows

    trainer.buffer.batch = poisoned
    with pytest.raises(FloatingPointError, match="loss became nan at step 14"):
        trainer.fit()
    assert json.loads((find_checkpoint(tmp_path) / CHECKPOINT_NAME).read_text())["step"] == 12
    assert [_strict_json(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [10]
    assert not (tmp_path / "sae").exists()
    for name, t in trainer.sae.state_dict().items():
        assert torch.isfinite(t).all(), name


# ---------------------------------------------------------------------------------------------
# 13. a resumed run's curve stays on the grid of 10 steps
# ---------------------------------------------------------------------------------------------
def test_a_resumed_curve_stays_on_the_grid(make_gpt, corpus, tmp_path):
    model = make_gpt()
    train_sae(model, corpus, tmp_path, hook=HOOK, tokens=32 * 23, **SMALL, **QUIET)
    train_sae(model, corpus, tmp_path, hook=HOOK, tokens=32 * 40, **SMALL, **QUIET)
    curve = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in curve] == [10, 20, 23, 30, 40]


# ---------------------------------------------------------------------------------------------
# 8, 10, 11. the CLI: one line and exit 2
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, message",
    [
        (["info", "trunc.npz"], "is not a readable .npz file"),
        (["info", "nonexist/sae"], "no local directory nonexist/sae, and as a Hub id: cannot reach the Hub"),
        (["dashboard", "--model", "m.gguf", "--sae", "x", "--out", "no/d.html"], "the directory no does not exist"),
    ],
    ids=["truncated-npz", "missing-dir", "dashboard-out"],
)
def test_cli_bad_paths_are_one_line(tmp_path, monkeypatch, capsys, argv, message):
    from attnlab.cli import main

    def never(*args, **kwargs):
        pytest.fail("the model was read before the bad path was reported")

    monkeypatch.setattr("attnlab.tools.loading.load_pretrained", never)
    np.savez(tmp_path / "params.npz", W_enc=np.zeros((4, 8), np.float32))
    (tmp_path / "trunc.npz").write_bytes((tmp_path / "params.npz").read_bytes()[:40])
    huggingface_hub = pytest.importorskip("huggingface_hub")

    def offline(*args, **kwargs):
        raise OSError("cannot reach the Hub\nplease check your connection")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    assert main(["sae", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, "float32"])
def test_an_sae_of_a_dtype_that_is_not_floating_point_is_named(dtype):
    # (torch's "normal_kernel_cpu" not implemented for 'Long', or randn's argument listing, before)
    with pytest.raises(TypeError, match=r"SAE\(dtype\) must be None or a floating-point torch.dtype"):
        SAE(SAEConfig(d_in=8, d_sae=16, k=4), dtype=dtype)


def test_an_sae_on_a_device_that_is_not_there_is_named():
    with pytest.raises(ValueError, match=r"SAE\(device\)='nowhere' is not a device name"):
        SAE(SAEConfig(d_in=8, d_sae=16, k=4), device="nowhere")
    sae = SAE(SAEConfig(d_in=8, d_sae=16, k=4), dtype=torch.float64, device="cpu")
    assert sae.W_dec.dtype == torch.float64 and sae(torch.randn(3, 8, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize("fill", [0.0, 3.0])
def test_activations_that_do_not_vary_are_named_not_trained_on(make_gpt, corpus, tmp_path, fill):
    # (every row the same: the FVU divided by rounding noise, explained variance -3.7e15, or by 0, which
    # the run blamed on the learning rate)
    trainer = SAETrainer(make_gpt(), corpus, SAETrainConfig(hook=HOOK, tokens=32 * 8, **SMALL), tmp_path, **QUIET)
    batch = trainer.buffer.batch

    def constant(step: int):
        x, _ = batch(step)
        rows = torch.full_like(x, fill) + torch.linspace(0, 1, x.shape[-1]) * fill
        return rows, rows

    trainer.buffer.batch = constant
    with pytest.raises(ValueError, match=f"activations at {HOOK} do not vary over a batch of"):
        trainer.fit()


def test_a_zero_row_under_constant_norm_rescale_reconstructs_as_zero():
    # (0 * inf: every output and some latents NaN)
    sae = SAE(SAEConfig(d_in=8, d_sae=32, k=4, normalize_activations="constant_norm_rescale")).eval()
    x = torch.randn(3, 8)
    x[1] = 0.0
    out = sae(x)
    assert torch.equal(out[1], torch.zeros(8)) and torch.equal(sae.encode(x)[1], torch.zeros(32))
    torch.testing.assert_close(out[[0, 2]], sae(x[[0, 2]]))  # the other rows as alone


def test_explained_variance_does_not_depend_on_the_activations_scale(make_gpt):
    # The same SAE on activations scaled by s (its encoder by 1/s, its decoder by s) explains the same
    # share; the cutoff for "no variance" was absolute, so at s = 1e-6 it read 1.0.
    tokens = torch.randint(0, 37, (4, 8), generator=torch.Generator().manual_seed(0))
    hook = "blocks.0.hook_resid_pre"  # (the embeddings: scaled by s exactly)

    def explained(scale: float) -> float:
        torch.manual_seed(1)
        model, sae = make_gpt(), SAE(SAEConfig(d_in=24, d_sae=64, k=4, hook_name=hook)).eval()
        with torch.no_grad():
            model.tok_emb.weight.mul_(scale)
            model.pos_emb.weight.mul_(scale)
            sae.W_dec.mul_(scale)
            sae.W_enc.div_(scale)
        return evaluate_sae(model, sae, tokens).explained_variance

    assert explained(1e-6) == pytest.approx(explained(1.0), rel=1e-6) and explained(1.0) < 0.99
