"""attnlab.training.sae and ``attnlab sae``: training SAEs and transcoders on a model's activations,
exact resumption, the bounded buffer, the CLI's lines and exit statuses."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from attnlab.interpret import SAE, SAEConfig, evaluate_sae, hooks
from attnlab.training.sae import ActivationBuffer, SAETrainConfig, SAETrainer, train_sae

HOOK = "blocks.1.hook_resid_post"
SMALL = dict(width=48, k=4, batch_rows=32, buffer_rows=128, context=9, model_batch=4, dead_tokens=64, save_every=3)


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    return np.random.default_rng(0).integers(0, 37, 3000).astype(np.uint16)


def _state(sae: SAE) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in sae.state_dict().items()}


@pytest.mark.parametrize(
    "settings",
    [
        dict(hook=HOOK, architecture="topk"),
        dict(hook=HOOK, architecture="batchtopk"),
        dict(hook=HOOK, architecture="jumprelu"),
        dict(hook="blocks.1.hook_resid_mid", hook_out="blocks.1.hook_mlp_out", skip=True, architecture="topk"),
        dict(hook="blocks.1.mlp.hook_post", architecture="topk"),  # (the MLP's neurons: their width, not d)
    ],
    ids=["topk", "batchtopk", "jumprelu", "transcoder", "neurons"],
)
def test_resume_gives_the_same_weights(make_gpt, corpus, tmp_path, settings):
    model = make_gpt()
    n = 10  # steps: two and a half buffers, checkpoints every 3 steps (the resume lands mid-buffer)
    quiet = dict(write=lambda s: None)
    straight = train_sae(model, corpus, tmp_path / "a", tokens=32 * n, **SMALL, **settings, **quiet)
    train_sae(model, corpus, tmp_path / "b", tokens=32 * (n // 2), **SMALL, **settings, **quiet)
    lines = []
    resumed = train_sae(model, corpus, tmp_path / "b", tokens=32 * n, **SMALL, **settings, write=lines.append)
    assert lines[0] == f"resuming {tmp_path / 'b'} at step {n // 2} of {n}"
    # The curve: the first run's summary line (its last step) kept, the resumed run's appended.
    curve = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in curve] == [n // 2, n]
    assert straight.steps == resumed.steps == n
    a, b = _state(straight.sae), _state(resumed.sae)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # What training saved is a SAELens directory that loads back to the same SAE.
    back = SAE.load(tmp_path / "a" / "sae")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in straight.sae.state_dict().items())
    assert not list((tmp_path / "a" / "checkpoints").glob(".tmp-*"))


def test_a_first_save_stopped_before_its_pointer_is_taken_up(make_gpt, corpus, tmp_path):
    # A kill between the step directory's rename and latest.json's write left a run that only
    # moving files by hand could resume: the directory was refused as "checkpoints but no latest.json".
    model = make_gpt()
    quiet = dict(write=lambda s: None)
    straight = train_sae(model, corpus, tmp_path / "a", tokens=32 * 6, **SMALL, hook=HOOK, **quiet)
    train_sae(model, corpus, tmp_path / "b", tokens=32 * 3, **SMALL, hook=HOOK, **quiet)  # one save, at step 3
    (tmp_path / "b" / "latest.json").unlink()
    lines = []
    resumed = train_sae(model, corpus, tmp_path / "b", tokens=32 * 6, **SMALL, hook=HOOK, write=lines.append)
    assert lines[:2] == [
        "step-00000003's save was stopped before latest.json was written; resuming from it",
        f"resuming {tmp_path / 'b'} at step 3 of 6",
    ]
    a, b = _state(straight.sae), _state(resumed.sae)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # A damaged one is not taken up: one error naming the file.
    train_sae(model, corpus, tmp_path / "c", tokens=32 * 3, **SMALL, hook=HOOK, **quiet)
    (tmp_path / "c" / "latest.json").unlink()
    weights = next((tmp_path / "c" / "checkpoints").glob("step-*")) / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"x")
    with pytest.raises(ValueError, match="does not match the SHA-256"):
        train_sae(model, corpus, tmp_path / "c", tokens=32 * 6, **SMALL, hook=HOOK, **quiet)
    assert not (tmp_path / "c" / "latest.json").exists()


def test_jumprelu_takes_no_k_and_a_run_that_cannot_find_dead_latents_says_so(make_gpt, corpus, tmp_path):
    # JumpReLU has no k, but the default k=32 refused a width of 16, and another --k refused a resume;
    # and with the defaults (1M tokens, dead after 1M) no latent could ever count as dead: the reports
    # said 0 dead where most latents never fired, and AuxK never ran.
    model = make_gpt()
    cfg = {**SMALL, "width": 16, "save_every": 2, "architecture": "jumprelu"}
    lines = []
    train_sae(model, corpus, tmp_path / "j", hook=HOOK, tokens=32 * 3, **cfg, write=lines.append)
    assert not any(line.startswith("note: --dead-tokens") for line in lines)
    lines = []
    train_sae(model, corpus, tmp_path / "j", hook=HOOK, tokens=32 * 4, **cfg | {"k": 3}, write=lines.append)
    assert lines[0] == f"resuming {tmp_path / 'j'} at step 3 of 4"
    lines = []
    cfg |= {"dead_tokens": 32 * 2}
    train_sae(model, corpus, tmp_path / "n", hook=HOOK, tokens=32 * 2, **cfg, write=lines.append)
    assert lines[0] == "note: --dead-tokens 64 is not below --tokens 64: no latent can count as dead in this run"
    with pytest.raises(ValueError, match="width must be an int >= k=32"):
        SAETrainConfig(hook=HOOK, width=16)


def test_training_learns_and_reports(make_gpt, corpus, tmp_path):
    model = make_gpt()
    lines: list[str] = []
    cfg = {**SMALL, "save_every": 100, "buffer_rows": 512, "width": 96, "k": 8}
    result = train_sae(model, corpus, tmp_path, hook=HOOK, tokens=32 * 120, lr=3e-3, **cfg, write=lines.append)
    first, last = result.history[0], result.history[-1]
    assert last["explained_variance"] > first["explained_variance"] + 0.2
    assert last["explained_variance"] > 0.5
    assert last["l0"] == pytest.approx(8.0)  # TopK: exactly k per row
    assert lines[-1].startswith(f"final: explained variance {last['explained_variance']:.4f}, L0 8.0, dead latents ")
    assert f"after 120 steps; SAE in {tmp_path / 'sae'}" in lines[-1]
    # metrics.jsonl: the training curve, one line per summary of 10 steps.
    curve = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in curve] == list(range(10, 121, 10))
    assert [m["tokens"] for m in curve] == [m["step"] * 32 for m in curve]
    assert [m["explained_variance"] for m in curve] == [h["explained_variance"] for h in result.history]
    assert all(b["seconds"] >= a["seconds"] for a, b in itertools.pairwise(curve))
    # The reported figure is what evaluate_sae measures on fresh windows (SAELens's definition), roughly.
    idx = torch.from_numpy(corpus[:900].astype(np.int64)).view(100, 9)
    measured = evaluate_sae(model, result.sae, idx)
    assert measured.explained_variance == pytest.approx(last["explained_variance"], abs=0.15)


def test_aux_loss_revives_dead_latents(make_gpt, corpus, tmp_path):
    """With AuxK, latents dead at the start fire again; without it more stay dead."""
    model = make_gpt()
    dead = {}
    for alpha in (0.0, 1.0):
        trainer = SAETrainer(
            model,
            corpus,
            SAETrainConfig(hook=HOOK, tokens=32 * 60, auxk_alpha=alpha, lr=3e-3, **{**SMALL, "save_every": 1000}),
            tmp_path / str(alpha),
            progress=False,
            write=lambda s: None,
        )
        with torch.no_grad():
            trainer.sae.b_enc[:24] = -50.0  # half the latents can never win a top-k slot on their own
        trainer.fit()
        dead[alpha] = int((trainer.since_fired >= SMALL["dead_tokens"]).sum())
    assert dead[1.0] < dead[0.0]


def test_the_buffer_is_bounded_shuffled_and_exact(make_gpt, corpus):
    model = make_gpt()
    cfg = SAETrainConfig(hook=HOOK, **{**SMALL, "buffer_rows": 100})
    buf = ActivationBuffer(model, corpus, cfg)
    buf.fill(0)
    assert buf.x.shape == (100, 24)  # never more rows than the buffer holds
    first = buf.x.clone()
    buf.fill(1)
    assert not torch.equal(buf.x, first)
    buf.fill(0)
    assert torch.equal(buf.x, first)  # a cycle is rebuilt exactly from (seed, cycle)
    # Rows are the model's activations at the hook, at the seeded windows' positions after the first.
    seen = {}
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(corpus) - 9 + 1, (-(-100 // 8),), generator=g)
    with torch.no_grad(), hooks(model, {HOOK: lambda x, h: seen.__setitem__("y", x)}):
        model(torch.from_numpy(np.stack([corpus[s : s + 9] for s in starts.tolist()]).astype(np.int64)))
    rows = seen["y"][:, 1:].reshape(-1, 24)
    assert min(float((rows - r).abs().max(-1).values.min()) for r in buf.x[:5]) < 1e-5


def test_the_buffer_leaves_out_massive_activations(make_gpt, corpus):
    """Rows made 1000x longer at one token (a stand-in for a model's massive activations) are left
    out at the default ratio, more windows are read to fill the buffer, and ratio 0 keeps them."""
    model = make_gpt()
    big = 7  # the corpus's token whose residual stream is made massive

    def inflate(x, hook, ids):
        return torch.where((ids == big)[..., None], x * 1000, x)

    seen: dict[str, torch.Tensor] = {}
    original = model.forward

    def forward(idx, *a, **kw):  # the hook below needs the token ids
        seen["ids"] = idx
        return original(idx, *a, **kw)

    model.forward = forward
    with hooks(model, {"blocks.0.hook_resid_post": lambda x, h: inflate(x, h, seen["ids"])}):
        kept = ActivationBuffer(model, corpus, SAETrainConfig(hook=HOOK, **SMALL))
        kept.fill(0)
        every = ActivationBuffer(model, corpus, SAETrainConfig(hook=HOOK, **{**SMALL, "outlier_ratio": 0}))
        every.fill(0)
    norms, median = kept.x.norm(dim=-1), every.x.norm(dim=-1).median()
    assert kept.x.shape == every.x.shape == (SMALL["buffer_rows"], 24)  # filled all the same
    assert kept.left_out > 0 and every.left_out == 0
    assert float(norms.max()) < 10 * float(median)
    assert float(every.x.norm(dim=-1).max()) > 100 * float(median)  # ratio 0: the massive rows are there
    with pytest.raises(ValueError, match="outlier_ratio must be 0"):
        SAETrainConfig(hook=HOOK, outlier_ratio=0.5)
    with pytest.raises(TypeError, match="outlier_ratio must be a number"):
        SAETrainConfig(hook=HOOK, outlier_ratio="10")


def test_bad_settings_and_directories(make_gpt, corpus, tmp_path):
    model = make_gpt()
    with pytest.raises(ValueError, match=r"architecture \(--arch\) must be"):
        SAETrainConfig(hook=HOOK, architecture="gated")
    with pytest.raises(ValueError, match="buffer_rows"):
        SAETrainConfig(hook=HOOK, buffer_rows=8, batch_rows=16)
    for bad, error, match in [
        (dict(jumprelu_bandwidth=0), ValueError, "jumprelu_bandwidth must be a finite number > 0, got 0"),
        (dict(lr=-1.0), ValueError, "lr must be a finite number > 0"),
        (dict(lr=float("nan")), ValueError, "lr must be a finite number > 0, got nan"),
        (dict(lr="1e-3"), TypeError, "lr must be a number, got str"),
        (dict(auxk_alpha=float("nan")), ValueError, "auxk_alpha must be a finite number >= 0"),
        (dict(l0_coefficient=-1), ValueError, "l0_coefficient must be a finite number >= 0"),
        (dict(threshold_lr=float("nan")), ValueError, "threshold_lr must be a finite number > 0"),
        (dict(seed="a"), TypeError, "seed must be an int, got str"),
    ]:
        with pytest.raises(error, match=match):
            SAETrainConfig(hook=HOOK, **bad)
    with pytest.raises(ValueError, match="not a hook point"):
        SAETrainer(model, corpus, SAETrainConfig(hook="blocks.7.hook_resid_post"), tmp_path)
    with pytest.raises(ValueError, match=r"context \(--context\) 17 is longer than the model's context of 16 tokens"):
        SAETrainer(model, corpus, SAETrainConfig(hook=HOOK, context=17), tmp_path)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        train_sae(model, corpus, tmp_path / "foreign", hook=HOOK, tokens=64, **SMALL, write=lambda s: None)
    train_sae(model, corpus, tmp_path / "run", hook=HOOK, tokens=64, **SMALL, write=lambda s: None)
    with pytest.raises(ValueError, match=r"other settings \(k\)"):
        train_sae(model, corpus, tmp_path / "run", hook=HOOK, tokens=128, **{**SMALL, "k": 5}, write=lambda s: None)
    # A bfloat16 model's activations are not the float32 model's: no resuming across them.
    with pytest.raises(ValueError, match=r"other settings \(model_dtype\)"):
        bf16 = model.to(torch.bfloat16)
        train_sae(bf16, corpus, tmp_path / "run", hook=HOOK, tokens=128, **SMALL, write=lambda s: None)


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attnlab", "sae", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli_bad_sae_file_is_one_line_and_exit_2(tmp_path, subprocess_env):
    d = tmp_path / "sae"
    SAE(SAEConfig(d_in=24, d_sae=40, architecture="topk", k=5, hook_name=HOOK)).save(d)
    cfg = json.loads((d / "cfg.json").read_text())
    cfg["architecture"] = "matryoshka"
    (d / "cfg.json").write_text(json.dumps(cfg))
    r = _cli("info", str(d), env=subprocess_env)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("attnlab sae: error: ") and "matryoshka" in r.stderr


@pytest.mark.slow
def test_cli_trains_on_smollm2(tmp_path, smollm2_gguf, subprocess_env):
    """The real model: a TopK SAE on SmolLM2's middle residual stream, a few steps; the saved SAE
    loads and ``sae eval`` measures it."""
    out = tmp_path / "run"
    common = ["--model", str(smollm2_gguf), "--hook", "blocks.15.hook_resid_post", "--width", "1152", "--k", "16"]
    small = ["--batch-rows", "128", "--buffer-rows", "256", "--context", "33", "--save-every", "2", "--no-progress"]
    r = _cli("train", *common, *small, "--tokens", "512", "--out", str(out), env=subprocess_env)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("final: explained variance ") and "L0 16.0" in last and "/1152" in last
    sae = SAE.load(out / "sae")
    assert sae.cfg.hook_name == "blocks.15.hook_resid_post" and sae.cfg.d_in == 576
    r = _cli(
        "eval", "--sae", str(out / "sae"), "--model", str(smollm2_gguf), "--tokens", "256", "--json", env=subprocess_env
    )
    assert r.returncode == 0, r.stderr
    figures = json.loads(r.stdout)
    assert figures["l0"] == pytest.approx(16.0) and figures["tokens"] == 256
    assert figures["ce_zero_ablated"] > figures["ce_clean"]
    # --dtype reaches the model: the run (a float32 model's) is not resumed with bfloat16 activations.
    r = _cli("train", *common, *small, "--tokens", "1024", "--dtype", "bfloat16", "--out", str(out), env=subprocess_env)
    assert r.returncode == 2 and "other settings (model_dtype)" in r.stderr, r.stderr


def test_the_buffer_stops_the_pass_at_its_last_hook(make_gpt, corpus):
    model = make_gpt()
    for hook, hook_out, later in (
        ("blocks.0.hook_resid_post", None, "blocks.1.hook_resid_pre"),
        ("blocks.0.hook_resid_mid", "blocks.0.hook_mlp_out", "blocks.0.hook_resid_post"),
    ):
        cfg = SAETrainConfig(hook=hook, hook_out=hook_out, **SMALL)
        calls: list[str] = []

        def note(x, h, calls=calls):
            calls.append(h.name)

        with hooks(model, {later: note, "hook_embed": note}):
            ActivationBuffer(model, corpus, cfg).fill(0)
        assert calls and set(calls) == {"hook_embed"}  # the pass ran, and nothing after the hook did


def test_a_topk_step_has_the_dense_formulas_gradient(make_gpt, corpus, tmp_path):
    """The step decodes the k kept latents as a sum of rows (an embedding bag); its gradients, AuxK
    included, are those of the dense formula written here in float64."""
    import copy

    model = make_gpt()
    for skip, hook_out in ((False, None), (True, "blocks.1.hook_mlp_out")):
        hook = "blocks.1.hook_resid_mid" if hook_out else HOOK
        cfg = SAETrainConfig(hook=hook, hook_out=hook_out, skip=skip, architecture="topk", **SMALL)
        trainer = SAETrainer(model, corpus, cfg, tmp_path / f"run{skip}", progress=False)
        with torch.no_grad():  # a transcoder starts with W_dec = 0: give every parameter a value
            for p in trainer.sae.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        trainer.since_fired[:20] = cfg.dead_tokens  # 20 dead latents: the AuxK term is on
        before = copy.deepcopy(trainer.sae).double()
        x, y = (t.double() for t in trainer.buffer.batch(0))
        grads = {}

        def record(grads=grads, sae=trainer.sae, step=trainer.optimizer.step):
            grads.update({n: p.grad.clone() for n, p in sae.named_parameters()})  # before Adam moves them
            step()

        trainer.optimizer.step = record
        trainer.train_step()
        # Reference: dense latents, dense decoding, in float64.
        pre = before.pre_activations(x)
        vals, idx = pre.topk(cfg.k, dim=-1)
        z = torch.zeros_like(pre).scatter(-1, idx, vals.relu())
        out = z @ before.W_dec + before.b_dec + (x @ before.W_skip.T if skip else 0)
        err = y - out
        total = (y - y.mean(0)).pow(2).sum()
        dead = torch.zeros(pre.shape[-1], dtype=torch.bool)
        dead[:20] = True
        k_aux = min(y.shape[-1] // 2, 20)
        aux_pre = torch.where(dead, pre, torch.full_like(pre, -torch.inf))
        av, ai = aux_pre.topk(k_aux, dim=-1)
        e_hat = torch.zeros_like(pre).scatter(-1, ai, av.relu()) @ before.W_dec
        aux = min(20 / (y.shape[-1] // 2), 1.0) * (e_hat - err.detach()).pow(2).sum() / total
        (err.pow(2).sum() / total + cfg.auxk_alpha * aux).backward()
        if not skip:
            before.remove_parallel_gradient()
        for name, p in before.named_parameters():
            torch.testing.assert_close(grads[name].double(), p.grad, atol=1e-5, rtol=1e-4, msg=name)
        assert before.W_dec.grad.abs().max() > 1e-4


def test_a_signal_mid_run_saves_a_checkpoint_and_the_sae_so_far(make_gpt, corpus, tmp_path):
    """SIGTERM while the second buffer fills (after the first buffer's steps): the run stops with a
    checkpoint and ``DIR/sae`` holding the SAE as it stands; the same call resumes to the straight weights."""
    import os
    import signal

    model = make_gpt()
    cfg = SAETrainConfig(hook=HOOK, tokens=32 * 8, **SMALL)  # 4 steps a buffer, 8 steps in all
    trainer = SAETrainer(model, corpus, cfg, tmp_path / "run", write=lambda s: None, progress=False)
    fill = trainer.buffer.fill

    def fill_then_signal(cycle: int) -> None:
        if cycle == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives inside the fill: it stops before any step of it
        fill(cycle)

    trainer.buffer.fill = fill_then_signal
    with pytest.raises(KeyboardInterrupt):
        trainer.fit()
    assert trainer.stopped == signal.SIGTERM and trainer.step == 4
    so_far = SAE.load(tmp_path / "run" / "sae")
    assert all(torch.equal(so_far.state_dict()[k], v) for k, v in trainer.sae.state_dict().items())
    straight = train_sae(model, corpus, tmp_path / "straight", hook=HOOK, tokens=32 * 8, **SMALL, write=lambda s: None)
    resumed = train_sae(model, corpus, tmp_path / "run", hook=HOOK, tokens=32 * 8, **SMALL, write=lambda s: None)
    assert all(torch.equal(resumed.sae.state_dict()[k], v) for k, v in straight.sae.state_dict().items())


def test_eval_and_dashboard_take_no_context_longer_than_the_models(make_gpt, tmp_path, capsys):
    # sae train refused it; eval ran on (10 minutes and 2.6 GB at --context 100000 before it was stopped).
    # (And an attnlab model, which every other command reads with --checkpoint, was refused by sae.)
    from attnlab.cli import main

    model = make_gpt(vocab_size=256)
    model.save(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text('{"name": "byte"}')
    SAE(SAEConfig(d_in=24, d_sae=32, architecture="topk", k=4, hook_name=HOOK)).save(tmp_path / "sae")
    (tmp_path / "t.txt").write_text("the cat sat on the mat " * 50)
    common = ["--checkpoint", str(tmp_path / "m"), "--sae", str(tmp_path / "sae"), "--data", str(tmp_path / "t.txt")]
    # (dashboard with no --latents: every one of this SAE's 32, where the default 100 was refused)
    for argv in (["eval"], ["dashboard", "--out", str(tmp_path / "d.html")]):
        assert main(["sae", *argv, *common, "--context", "17"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--context 17 is longer than the model's context of 16 tokens" in err, err
        assert main(["sae", *argv, *common, "--context", "16", "--tokens", "64", "--no-progress"]) == 0
        capsys.readouterr()
        # no --context: the model's 16 where shorter than the default 128 (refused before, as if given)
        assert main(["sae", *argv, *common, "--tokens", "64", "--no-progress"]) == 0, capsys.readouterr().err
        capsys.readouterr()
    train = ["sae", "train", *common[:2], *common[4:], "--hook", HOOK, "--tokens", "64", "--out", str(tmp_path / "r")]
    small = ["--batch-rows", "16", "--buffer-rows", "64", "--no-progress"]
    assert main([*train, *small, "--device", "auto"]) == 0, (
        capsys.readouterr().err
    )  # (torch.device("auto"): a traceback)
    # (--context 0 trained at the default 128, silently; a count past int64: torch's traceback)
    for bad, message in ((["--context", "0"], "context must be a positive int, got 0"),
                         (["--dead-tokens", str(10**30)], "a setting is too large for this machine")):  # fmt: skip
        capsys.readouterr()
        assert main([*train[:-1], str(tmp_path / "bad"), *small, *bad]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "--context", "0"], "--context must be a positive int, got 0"),
        (["eval", "--tokens", "-5"], "--tokens must be a positive int, got -5"),
        (["eval", "--tokens", "3", "--context", "128"], "--tokens 3 is less than one window of --context 128"),
        (["eval", "--context", "1"], "--context must be at least 2 tokens"),
        (["dashboard", "--context", "0", "--out", "d.html"], "--context must be a positive int, got 0"),
        (["dashboard", "--out", "d.txt"], "--out must end in one of .html, .htm; got 'd.txt'"),
        (["dashboard", "--tokens", "8", "--context", "16", "--out", "d.html"], "--tokens 8 is less than one window"),
        (["train", "--hook", HOOK, "--out", "run", "--dead-tokens", "0"], "dead_tokens must be a positive int, got 0"),
        (["train", "--hook", HOOK, "--out", "run", "--seed", "-1"], "argument --seed: expected a seed from 0"),
        (["train", "--hook", HOOK, "--out", "run", "--lr", "-1"], "lr must be a finite number > 0, got -1.0"),
    ],
)
def test_cli_bad_numbers_are_one_line_before_the_model_is_read(argv, message, monkeypatch, capsys):
    from attnlab.cli import main

    def never(*args, **kwargs):
        pytest.fail("the model was read despite a bad setting")

    for where in ("attnlab.tools.loading.load", "attnlab.tools.loading.load_pretrained"):
        monkeypatch.setattr(where, never)
    argv = [*argv, "--model", "m.gguf"] + (["--sae", "nowhere"] if argv[0] != "train" else [])
    try:
        code = main(["sae", *argv])
    except SystemExit as exc:  # (argparse's own refusal of a flag's value)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
