"""``attnlab train``: schedule, metrics, gradient accumulation, exact resume after kills, clear errors."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from attnlab.cli import main
from attnlab.model import GPTConfig
from attnlab.training import TrainConfig, Trainer, lr_at
from attnlab.training.checkpoint import load_checkpoint
from attnlab.training.distributed import rank_seed

# A run small enough for a test: the tiny preset on 16-token windows of the built-in corpus.
SMALL = dict(context_length=16, batch_size=4, eval_batches=2, sample_tokens=0, progress=False)
# For the tests that compare with float32 references computed on the CPU (on CUDA the trainer uses bf16).
ON_CPU = dict(SMALL, device="cpu", precision="fp32")  # float32: compared with float32 references
SMALL_FLAGS = [
    "--context-length",
    "16",
    "--batch-size",
    "4",
    "--eval-batches",
    "2",
    "--sample-tokens",
    "0",
    "--no-progress",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def attnlab(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attnlab", *args], capture_output=True, text=True, env=ENV, timeout=300, **kw
    )


# ---------------------------------------------------------------------------------------------
# Learning-rate schedule
# ---------------------------------------------------------------------------------------------
def test_lr_schedule_values() -> None:
    kw = dict(lr=1.0, warmup_steps=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == pytest.approx(0.1)  # warm-up: (step + 1) / warmup
    assert lr_at(4, **kw) == pytest.approx(0.5)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)  # the cosine starts at the peak
    assert lr_at(60, **kw) == pytest.approx(0.55)  # halfway: (max + min) / 2
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(500, **kw) == pytest.approx(0.1)


@settings(max_examples=40, deadline=None)
@given(
    warmup=st.integers(0, 50),
    total=st.integers(1, 500),
    ratio=st.floats(0, 1),
    lr=st.floats(1e-5, 1.0),
)
def test_lr_schedule_rises_then_never_increases(warmup: int, total: int, ratio: float, lr: float) -> None:
    assume(warmup <= total)
    values = [lr_at(s, lr=lr, warmup_steps=warmup, max_steps=total, min_lr_ratio=ratio) for s in range(total + 5)]
    peak = warmup
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(values[:peak]))
    after = values[peak:]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(after))
    assert all(0 <= v <= lr * (1 + 1e-12) for v in values)
    assert all(lr * ratio * (1 - 1e-12) <= v for v in after)


# ---------------------------------------------------------------------------------------------
# The CLI's help
# ---------------------------------------------------------------------------------------------
def test_help_explains_every_flag(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--data", "--tokenizer", "--bpe-dir", "--preset", "--context-length", "--batch-size", "--max-steps",
        "--lr", "--eval-every", "--checkpoint-every", "--seed", "--out", "--resume", "--device", "--grad-accum",
        "--warmup-steps", "--weight-decay", "--grad-clip", "--compile", "--eval-batches", "--sample-tokens",
        "--malloc-tuning", "--max-time", "--precision", "--optimizer",
    ):  # fmt: skip
        assert flag in text, flag
    assert "global" in text and "130" in text  # the batch-size convention and the exit codes
    presets = re.search(r"--preset NAME\s+model size: (.*?) \(default", text, re.S).group(1)
    assert re.sub(r"\s+", " ", presets).strip().split(", ") == GPTConfig.presets()  # every preset train accepts


def test_eval_help_names_what_model_reads(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--help"])
    assert exc.value.code == 0
    text = re.sub(r"\s+", " ", capsys.readouterr().out)
    assert "a GGUF file" in text and "gemma3" in text  # README's eval --model SmolLM2-...gguf


# ---------------------------------------------------------------------------------------------
# In-process training
# ---------------------------------------------------------------------------------------------
def test_training_learns_and_logs_what_it_did(tmp_path: Path, one_thread) -> None:
    cfg = TrainConfig(
        **{**ON_CPU, "batch_size": 8, "eval_batches": 4},
        out=str(tmp_path),
        max_steps=30,
        eval_every=10,
        checkpoint_every=15,
        lr=2e-3,
        warmup_steps=5,
        optimizer="adamw",  # its param groups are checked below (test_optim.py covers muon)
    )
    trainer = Trainer(cfg)
    result = trainer.fit()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 31))
    for r in rows:
        assert {"step", "loss", "lr", "tokens_per_s"} <= r.keys() and r["tokens_per_s"] > 0
        assert ("val_loss" in r) == (r["step"] % 10 == 0)
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, lr=2e-3, warmup_steps=5, max_steps=30))
    # A byte model starts near ln(256) = 5.55 nats and must learn the byte statistics quickly.
    assert rows[0]["loss"] == pytest.approx(math.log(256), abs=0.3)
    # On 4 validation batches the loss is noisy; its best value must have dropped well below ln(256).
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert min(val) < rows[0]["loss"] - 1.5, val
    assert result.step == 30 and result.val_loss == rows[-1]["val_loss"]
    # The optimizer got the settings: decay on matrices and embeddings only, the configured betas.
    decayed, plain = trainer.optimizer.param_groups
    assert decayed["weight_decay"] == cfg.weight_decay > 0 and plain["weight_decay"] == 0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() < 2 for p in plain["params"])
    assert all(g["betas"] == (cfg.beta1, cfg.beta2) for g in trainer.optimizer.param_groups)

    # The checkpoint holds the final weights, and its validation loss is what was logged:
    # recompute it independently from the checkpoint and the validation windows.
    ck = load_checkpoint(tmp_path)
    assert ck.step == 30
    for (name, a), b in zip(trainer.raw_model.state_dict().items(), ck.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    model = ck.model.eval()
    losses = []
    with torch.no_grad():
        for i in range(cfg.eval_batches):
            x, y = trainer.val_batches.batch(i)
            losses.append(F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item())
    assert sum(losses) / len(losses) == pytest.approx(rows[-1]["val_loss"], rel=1e-6)


@pytest.mark.slow
def test_gradient_accumulation_matches_the_whole_batch(tmp_path: Path, one_thread) -> None:
    runs, norms = {}, {}
    for accum in (1, 2, 4):
        cfg = TrainConfig(out=str(tmp_path / str(accum)), max_steps=4, grad_accum=accum, eval_every=4, **ON_CPU)
        history = Trainer(cfg).fit().history
        runs[accum] = [r["loss"] for r in history]
        norms[accum] = [r["grad_norm"] for r in history]  # gradients, not just losses: AdamW hides a scale
    assert runs[1] == pytest.approx(runs[2], abs=1e-5) and runs[1] == pytest.approx(runs[4], abs=1e-5)
    assert norms[1] == pytest.approx(norms[2], rel=1e-4) and norms[1] == pytest.approx(norms[4], rel=1e-4)


def test_one_step_equals_a_hand_written_clipped_adamw_step(tmp_path: Path, one_thread) -> None:
    """Forward, loss, backward, clipping at --grad-clip and AdamW, against torch's parts by hand."""
    import copy

    from attnlab.model import lm_loss

    cfg = TrainConfig(
        optimizer="adamw",
        out=str(tmp_path),
        max_steps=1,
        warmup_steps=0,
        lr=1e-2,
        grad_clip=1e-3,
        eval_every=1,
        **ON_CPU,
    )
    trainer = Trainer(cfg)
    model = copy.deepcopy(trainer.raw_model)  # the initial weights
    x, y = trainer.train_batches.batch(0, 0)
    result = trainer.fit()

    loss = lm_loss(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    assert norm > 100 * cfg.grad_clip  # the clip really bites
    opt = torch.optim.AdamW(model.optimizer_groups(cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    opt.step()  # the for-loop implementation, against the trainer's fused one
    assert result.history[0]["loss"] == pytest.approx(loss.item(), rel=1e-6)
    assert result.history[0]["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    for (name, want), got in zip(model.state_dict().items(), trainer.raw_model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.slow
def test_resume_in_process_after_max_steps_grows(tmp_path: Path, one_thread) -> None:
    """A finished run continued with a larger --max-steps picks up at its last step."""
    base = dict(out=str(tmp_path), eval_every=5, checkpoint_every=5, warmup_steps=0, lr=1e-3, **SMALL)
    Trainer(TrainConfig(max_steps=5, **base)).fit()
    result = Trainer(TrainConfig(max_steps=8, resume=True, **base)).fit()
    assert result.step == 8 and [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 9))


# ---------------------------------------------------------------------------------------------
# Exact resume after SIGKILL / SIGTERM (subprocesses)
# ---------------------------------------------------------------------------------------------
MAX = 60
RESUME_FLAGS = [
    *SMALL_FLAGS, "--max-steps", str(MAX), "--checkpoint-every", "10", "--eval-every", "25",
    "--dropout", "0.1", "--seed", "7", "--lr", "2e-3", "--warmup-steps", "5",
]  # fmt: skip


def _interrupt(out: Path, sig: int, after_step: int, *flags: str) -> tuple[int, int]:
    """Start ``attnlab train``, wait until a checkpoint past ``after_step`` exists, send ``sig``.
    Returns (exit status, step of the latest checkpoint)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "train", "--out", str(out), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    latest = out / "latest.json"
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if json.loads(latest.read_text())["step"] > after_step:
                break
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        time.sleep(0.005)
    proc.send_signal(sig)
    stderr = proc.communicate(timeout=120)[1].decode()
    step = json.loads(latest.read_text())["step"]
    assert step < MAX, f"the run finished before it could be interrupted: {stderr}"
    return proc.returncode, step


@pytest.mark.slow
def test_sigterm_and_sigkill_then_resume_give_the_uninterrupted_losses(tmp_path: Path) -> None:
    """Dropout is on, so this also checks that the RNG state travels with the checkpoint."""
    ref = tmp_path / "reference"
    r = attnlab("train", "--out", str(ref), *RESUME_FLAGS)
    assert r.returncode == 0, r.stderr
    reference = [row["loss"] for row in read_metrics(ref)]

    out = tmp_path / "interrupted"
    # 1. SIGTERM: the run saves the step it is on and exits with 128 + 15.
    code, step = _interrupt(out, signal.SIGTERM, 0, *RESUME_FLAGS)
    assert code == 128 + signal.SIGTERM
    assert read_metrics(out)[-1]["step"] == step  # the checkpoint is of the last completed step
    # 2. Resume with --resume alone (the settings come from the checkpoint); SIGKILL it mid-run.
    code, step2 = _interrupt(out, signal.SIGKILL, step, "--resume", "--no-progress")
    assert code == -signal.SIGKILL and step2 > step
    # 3. Resume to the end.
    r = attnlab("train", "--out", str(out), "--resume", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert f"at step {step2}" in r.stderr
    rows = read_metrics(out)
    assert [row["step"] for row in rows] == list(range(1, MAX + 1))  # lines past the checkpoint were dropped
    assert [row["loss"] for row in rows] == reference  # bit for bit
    assert [row.get("val_loss") for row in rows] == [row.get("val_loss") for row in read_metrics(ref)]


# ---------------------------------------------------------------------------------------------
# Errors: one line on stderr, exit status 2
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("finished")
    r = attnlab("train", "--out", str(out), *SMALL_FLAGS, "--max-steps", "2", "--eval-every", "2")
    assert r.returncode == 0, r.stderr
    return out


def _damaged(finished_run: Path, tmp_path: Path, how: str) -> Path:
    out = tmp_path / how
    shutil.copytree(finished_run, out)
    step_dir = out / "checkpoints" / "step-00000002"
    if how == "truncated-weights":
        f = step_dir / "model.safetensors"
        f.write_bytes(f.read_bytes()[:100])
    elif how == "corrupt-pointer":
        (out / "latest.json").write_text("{not json")
    return out


@pytest.mark.slow
def test_user_errors_are_one_line(tmp_path: Path, finished_run: Path) -> None:
    cases = {
        "missing data": (["--data", str(tmp_path / "nope.txt")], "nope.txt"),
        "unknown preset": (["--preset", "gpt5"], "gpt5"),
        "unknown tokenizer": (["--tokenizer", "wordpiece"], "wordpiece"),
        "bad batch": (["--batch-size", "6", "--grad-accum", "4"], "--batch-size"),
        "bad lr": (["--lr", "-1"], "--lr"),
        "bad max time": (["--max-time", "nan"], "--max-time"),
        # Each case on its own copy of the run: they run at once, and a run directory takes one at a time.
        "existing checkpoint": (["--out", str(_damaged(finished_run, tmp_path, "copy-1"))], "--resume"),
        "truncated weights": (
            ["--out", str(_damaged(finished_run, tmp_path, "truncated-weights")), "--resume"],
            "model.safetensors",
        ),
        "corrupt pointer": (
            ["--out", str(_damaged(finished_run, tmp_path, "corrupt-pointer")), "--resume"],
            "latest.json",
        ),
        "changed context": (
            ["--out", str(_damaged(finished_run, tmp_path, "copy-2")), "--resume", "--context-length", "32"],
            "--context-length",
        ),
        "other data": (
            ["--out", str(_damaged(finished_run, tmp_path, "copy-3")), "--resume", "--data", __file__],
            "from the built-in corpus",
        ),
        "out is a file": (["--out", __file__], "exists and is not a directory"),
    }
    procs = {}
    for name, (flags, _) in cases.items():
        if "--out" not in flags:
            flags = [*flags, "--out", str(tmp_path / name.replace(" ", "-"))]
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "attnlab", "train", *SMALL_FLAGS, "--max-steps", "2", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=ENV,
        )
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        lines = err.strip().splitlines()
        assert proc.returncode == 2, (name, err)
        assert len(lines) == 1, (name, err)
        assert lines[0].startswith("attnlab train: error:") and cases[name][1] in lines[0], (name, err)
        assert "Traceback" not in err


@pytest.mark.slow
def test_max_time_plans_the_steps_that_fit_and_the_run_keeps_them(tmp_path: Path, one_thread) -> None:
    """A budget the first PLAN_STEPS steps already spent: the run plans one more step, ends there
    with a final evaluation, its learning rate at the schedule's end, and its checkpoint records the
    planned max_steps (a resumed run keeps it and has nothing left)."""
    from attnlab.training.config import PLAN_STEPS

    logs: list[str] = []
    cfg = TrainConfig(out=str(tmp_path), max_steps=500, max_time=1e-3, warmup_steps=30, **ON_CPU)
    result = Trainer(cfg, log=logs.append).fit(sample=False)
    planned = PLAN_STEPS + 1
    assert len(result.history) == planned and "val_loss" in result.history[-1]
    assert any(line.startswith(f"planned {planned} steps: 500 do not fit in 0.001 s of training") for line in logs)
    assert result.history[-1]["lr"] == pytest.approx(
        lr_at(planned - 1, lr=2e-3, warmup_steps=30, max_steps=planned, min_lr_ratio=0.1)
    )
    assert load_checkpoint(tmp_path, load_optimizer=False).metadata["train_config"]["max_steps"] == planned
    again = Trainer(TrainConfig(out=str(tmp_path), resume=True), log=logs.append).fit(sample=False)
    assert again.history == [] and "nothing to train" in logs[-1]
    roomy = TrainConfig(out=str(tmp_path / "roomy"), max_steps=PLAN_STEPS + 3, max_time=1e6, **ON_CPU)
    assert len(Trainer(roomy).fit(sample=False).history) == PLAN_STEPS + 3  # fits: unchanged


def test_only_a_bare_run_gets_the_default_time_budget(tmp_path: Path) -> None:
    from attnlab.training.config import DEFAULT_MAX_TIME

    def budget(given, **settings):
        trainer = Trainer(TrainConfig(out=str(tmp_path / str(len(list(tmp_path.iterdir())))), **settings), given=given)
        trainer.close()
        return trainer.cfg.max_time

    assert budget(set()) == budget({"data", "preset"}) == DEFAULT_MAX_TIME
    assert budget({"max_steps"}, max_steps=5) is None  # steps asked for are steps trained
    assert budget({"max_time"}, max_time=7.0) == 7.0
    assert budget(None) is None  # a TrainConfig built in Python is taken as it is


# ---------------------------------------------------------------------------------------------
# Regressions
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_python_api_resume_takes_seed_data_and_split_from_the_checkpoint(
    tmp_path: Path, monkeypatch, one_thread
) -> None:
    """``train(out=..., resume=True)`` alone continues the run it names, bit for bit, instead of
    silently switching to the default seed, corpus and validation split."""
    from attnlab.data import CACHE_ENV, builtin_corpus
    from attnlab.training import train

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text(builtin_corpus()[5000:25000], encoding="utf-8")
    settings = dict(SMALL, data=str(text), seed=7, val_fraction=0.25, dropout=0.1, lr=3e-3, warmup_steps=2, max_steps=6)
    ref = tmp_path / "ref"
    Trainer(TrainConfig(out=str(ref), checkpoint_every=3, eval_every=3, **settings)).fit()
    reference = read_metrics(ref)
    # The run as it was at step 3.
    out = tmp_path / "resumed"
    shutil.copytree(ref / "checkpoints" / "step-00000003", out / "checkpoints" / "step-00000003")
    (out / "latest.json").write_text(
        json.dumps({"format": "attnlab-checkpoint", "step": 3, "path": "checkpoints/step-00000003"})
    )
    (out / "metrics.jsonl").write_text((ref / "metrics.jsonl").read_text())
    result = train(out=str(out), resume=True)
    assert result.step == 6

    def trajectory(rows: list[dict]) -> list[tuple]:
        return [(r["step"], r["loss"], r["lr"], r["grad_norm"], r.get("val_loss")) for r in rows]

    assert trajectory(read_metrics(out)) == trajectory(reference)  # bit for bit
    # A setting that defines the run cannot change on resume, from Python either.
    with pytest.raises(ValueError, match="--seed"):
        train(out=str(out), resume=True, seed=8)
    with pytest.raises(ValueError, match="--val-fraction"):
        train(out=str(out), resume=True, val_fraction=0.1)


def test_resume_from_another_directory_and_refuse_changed_data(tmp_path: Path, monkeypatch, one_thread) -> None:
    """Paths are recorded absolute (a relative --data used to be looked up from wherever the resumed
    run started), the same file named differently is the same data, a changed file is refused, and
    a run already at --max-steps says so and reports the checkpoint's validation loss."""
    from attnlab.data import CACHE_ENV, builtin_corpus

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    text = tmp_path / "a" / "text.txt"
    text.write_text(builtin_corpus()[:20000], encoding="utf-8")
    base = dict(SMALL, eval_every=2, checkpoint_every=2, warmup_steps=0)
    monkeypatch.chdir(tmp_path / "a")
    Trainer(TrainConfig(data="text.txt", out="run", max_steps=2, **base)).fit()
    assert load_checkpoint("run").metadata["train_config"]["data"] == str(text.resolve())
    # A checkpoint written before paths were absolute and the data hashed still resumes, and is
    # then written with both.
    meta_path = tmp_path / "a" / "run" / "checkpoints" / "step-00000002" / "checkpoint.json"
    meta = json.loads(meta_path.read_text())
    meta["train_config"]["data"] = "text.txt"
    del meta["data"]["sha256"]
    del meta["metadata_sha256"]  # nor did checkpoint.json hash itself then (format version 1)
    meta["version"] = 1
    meta_path.write_text(json.dumps(meta))
    Trainer(TrainConfig(out="run", resume=True, max_steps=3, **base)).fit()
    assert load_checkpoint("run").metadata["train_config"]["data"] == str(text.resolve())
    assert load_checkpoint("run").metadata["data"]["sha256"]

    monkeypatch.chdir(tmp_path / "b")
    run = str(tmp_path / "a" / "run")
    result = Trainer(TrainConfig(out=run, resume=True, max_steps=4, **base)).fit()
    assert result.step == 4 and result.val_loss is not None
    Trainer(TrainConfig(data="../a/./text.txt", out=run, resume=True, max_steps=4, **base))  # the same file

    logs: list[str] = []
    again = Trainer(TrainConfig(out=run, resume=True, max_steps=3, **base), log=logs.append).fit()
    assert again.step == 4 and again.val_loss == result.val_loss
    assert any("already at step 4, at or past --max-steps 3: nothing to train" in m for m in logs), logs

    with text.open("a", encoding="utf-8") as f:
        f.write("one more line")
    with pytest.raises(ValueError, match=r"data file .*text.txt has changed since the checkpoint"):
        Trainer(TrainConfig(out=run, resume=True, max_steps=6, **base))


@pytest.mark.slow
def test_cli_prints_the_summary_then_streams_a_sample_from_a_prompt_that_encodes(tmp_path: Path) -> None:
    """The summary comes before the sample (a long or interrupted sample used to hide it), and
    when the char vocabulary lacks the default prompt's letters, the sample and the printed
    `attnlab generate` hint use a prompt that encodes, and say so."""
    from attnlab.data import builtin_corpus

    lower = tmp_path / "lower.txt"
    lower.write_text(builtin_corpus()[:20000].lower(), encoding="utf-8")
    out = tmp_path / "run"
    flags = [*SMALL_FLAGS, "--sample-tokens", "30", "--max-steps", "2", "--tokenizer", "char", "--data", str(lower)]
    r = subprocess.run(
        [sys.executable, "-m", "attnlab", "train", "--out", str(out), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in the order written
        text=True,
        env=ENV,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout
    chars = lower.read_text(encoding="utf-8")
    used = chars[len(chars) - round(len(chars) * 0.1)]  # the first character of the validation split
    assert f"cannot encode the prompt 'The '; using {used!r}" in r.stdout
    assert r.stdout.index("done: 2 steps") < r.stdout.index("--- sample") < r.stdout.index("generate more:")
    hint = r.stdout.split("generate more: ")[1].strip().splitlines()[0]
    assert hint == f"attnlab generate --checkpoint {out} --prompt {used!r}"
    g = attnlab("generate", "--checkpoint", str(out), "--prompt", used, "--max-new-tokens", "5")
    assert g.returncode == 0 and g.stdout.startswith(used), g.stderr


def test_resumed_settings_rules() -> None:
    saved = TrainConfig(preset="gpt2-small", seed=3, max_steps=50, out="elsewhere").to_dict()
    # Presets compare case-insensitively and through their aliases.
    cfg = TrainConfig(preset="GPT2", resume=True, out="here").resumed(saved, {"preset", "resume", "out"})
    assert (cfg.preset, cfg.seed, cfg.max_steps, cfg.out, cfg.resume) == ("GPT2", 3, 50, "here", True)
    with pytest.raises(ValueError, match="--preset"):
        TrainConfig(preset="tiny").resumed(saved, {"preset"})
    with pytest.raises(ValueError, match="--seed 4"):
        TrainConfig(seed=4).resumed(saved, {"seed"})
    # Without `given`, the settings left at their defaults are the ones taken from the checkpoint.
    cfg = TrainConfig(max_steps=80).resumed(saved)
    assert (cfg.seed, cfg.max_steps, cfg.preset) == (3, 80, "gpt2-small")


def test_bad_preset_is_reported_before_any_tokenizing(tmp_path: Path, monkeypatch) -> None:
    import attnlab.data as data_mod

    def boom(*args, **kwargs):
        raise AssertionError("the data was tokenized before the preset was checked")

    monkeypatch.setattr(data_mod, "tokenize_to_cache", boom)
    with pytest.raises(ValueError, match=r"--preset.*gpt5"):
        Trainer(TrainConfig(out=str(tmp_path), preset="gpt5", **SMALL))
    for name in ("TINY", "gpt2", "GPT2-Medium"):
        TrainConfig(preset=name).validate()


def test_corrupt_pointer_without_resume_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "latest.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"latest\.json"):
        Trainer(TrainConfig(out=str(tmp_path), **SMALL))


def test_grad_norm_is_measured_when_clipping_is_off(tmp_path: Path, one_thread) -> None:
    import copy

    trainer = Trainer(TrainConfig(out=str(tmp_path), grad_clip=0, max_steps=1, eval_every=1, **ON_CPU))
    model = copy.deepcopy(trainer.raw_model).train()  # the tiny preset has no dropout: deterministic
    x, y = trainer.train_batches.batch(0)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    ref = math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in model.parameters() if p.grad is not None))
    assert ref > 0
    assert trainer.fit().history[0]["grad_norm"] == pytest.approx(ref, rel=1e-4)


def test_an_update_that_breaks_the_weights_stops_the_run_without_a_checkpoint_of_them(
    tmp_path: Path, one_thread
) -> None:
    """An absurd learning rate: the training loss of step 1 is finite (it is the loss before the update),
    the update breaks the weights. The run once ended "done" with a NaN validation loss and wrote a
    checkpoint every reader refused (NaN is not JSON); now it stops, naming the step, and writes none."""
    cfg = dict(ON_CPU, optimizer="adamw", lr=1e30, warmup_steps=0, max_steps=1, eval_every=1)
    with pytest.raises(FloatingPointError, match="validation loss became nan at step 1"):
        Trainer(TrainConfig(out=str(tmp_path / "eval"), **cfg)).fit()
    assert not (tmp_path / "eval" / "latest.json").exists()
    # No evaluation before the save: the weights themselves are checked.
    cfg |= dict(lr=1e39, max_steps=2, eval_every=5, checkpoint_every=1)  # (past float32: inf weights)
    with pytest.raises(FloatingPointError, match="weights became NaN or infinite at step 1"):
        Trainer(TrainConfig(out=str(tmp_path / "save"), **cfg)).fit()
    assert not (tmp_path / "save" / "latest.json").exists()


def test_progress_bar_without_tqdm_is_a_note_not_a_crash(tmp_path: Path, monkeypatch, one_thread) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # `from tqdm.auto import tqdm` raises ImportError
    logs: list[str] = []
    cfg = TrainConfig(out=str(tmp_path), max_steps=1, eval_every=1, **{**SMALL, "progress": True})
    assert Trainer(cfg, log=logs.append).fit().step == 1
    assert any("tqdm" in m and "progress" in m for m in logs), logs


def test_a_failing_setup_destroys_the_process_group_it_created(tmp_path: Path, monkeypatch) -> None:
    """Under torchrun, an error after init_process_group (here: a global batch that 2 processes x
    4 micro-steps cannot split) must not leave the process group behind."""
    import torch.distributed as dist

    state = {"initialized": False, "destroyed": 0}

    def init_process_group(backend: str) -> None:
        state["initialized"] = True

    def destroy_process_group() -> None:
        state["initialized"] = False
        state["destroyed"] += 1

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: state["initialized"])
    monkeypatch.setattr(dist, "destroy_process_group", destroy_process_group)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="--batch-size"):
        Trainer(TrainConfig(out=str(tmp_path), device="cpu", grad_accum=4, **SMALL))  # 4 rows / (2 x 4)
    assert state == {"initialized": False, "destroyed": 1}


def test_seed_and_device_errors_name_the_flag(tmp_path: Path, capsys) -> None:
    """A seed torch cannot take and a device attnlab does not run on are one-line errors, before any work."""
    cases = {"--seed": ["--seed", str(2**64)], "--device": ["--device", "meta"]}
    for name, flags in cases.items():
        out = tmp_path / name.strip("-")
        assert main(["train", "--out", str(out), *SMALL_FLAGS, "--no-malloc-tuning", *flags]) == 2, name
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"attnlab train: error: {name}"), lines
        assert not out.exists()
    with pytest.raises(ValueError, match="--seed"):
        TrainConfig(seed=-1).validate()


def test_the_largest_seed_trains_and_rank_seeds_wrap_around(tmp_path: Path, one_thread) -> None:
    top = 2**64 - 1
    result = Trainer(TrainConfig(out=str(tmp_path), seed=top, max_steps=1, eval_every=1, **SMALL)).fit()
    assert result.step == 1 and math.isfinite(result.val_loss)
    assert rank_seed(7, 2, 5) == 7 + 2 * 1_000_003 + 5  # the streams of earlier runs, unchanged
    assert rank_seed(top, 1, 3) == 1_000_003 + 3 - 1  # wrapped around into torch's range
    torch.manual_seed(rank_seed(top, 3, 10))


def test_numpy_settings_are_taken_and_recorded_as_json_numbers(tmp_path: Path, one_thread) -> None:
    """NumPy scalars count as numbers (as everywhere in attnlab), bools never do."""
    cfg = TrainConfig(
        **{**SMALL, "batch_size": np.int64(4)},
        out=str(tmp_path),
        max_steps=np.int32(2),
        eval_every=2,
        lr=np.float32(1e-3),
        weight_decay=np.float64(0.05),
        seed=np.uint64(3),
    )
    assert Trainer(cfg).fit().step == 2
    saved = load_checkpoint(tmp_path).metadata["train_config"]
    assert (saved["batch_size"], saved["max_steps"], saved["seed"]) == (4, 2, 3)
    assert saved["lr"] == pytest.approx(1e-3) and saved["weight_decay"] == 0.05
    for name, bad in (("batch_size", True), ("eval_every", np.True_), ("lr", np.True_), ("dropout", "0.1")):
        with pytest.raises(ValueError, match=f"--{name.replace('_', '-')}"):
            TrainConfig(**{name: bad}).validate()


@pytest.mark.cuda
def test_cuda_training_in_bf16_learns_samples_and_resumes_exactly(tmp_path: Path) -> None:
    """On CUDA: bf16 autocast, the loss falls, the run resumed from its step-10 checkpoint (dropout
    on) repeats the uninterrupted run's losses bit for bit, and the seeded sample is drawn on the GPU."""
    settings = dict(SMALL, device="cuda", max_steps=20, eval_every=5, checkpoint_every=5, keep_checkpoints=4)
    base = dict(settings, warmup_steps=2, lr=3e-3, dropout=0.1)
    ref = tmp_path / "ref"
    trainer = Trainer(TrainConfig(out=str(ref), **base))
    ctx = trainer.autocast()
    assert isinstance(ctx, torch.autocast) and ctx.fast_dtype == torch.bfloat16
    whole = [r["loss"] for r in trainer.fit().history]
    assert sum(whole[-5:]) < sum(whole[:5]) - 2.5, whole  # from ln(256) = 5.5 towards the byte statistics
    out = tmp_path / "resumed"  # the run as it was at step 10
    shutil.copytree(ref / "checkpoints" / "step-00000010", out / "checkpoints" / "step-00000010")
    (out / "latest.json").write_text(
        json.dumps({"format": "attnlab-checkpoint", "step": 10, "path": "checkpoints/step-00000010"})
    )
    resumed = Trainer(TrainConfig(out=str(out), resume=True, **base)).fit()
    assert [r["loss"] for r in resumed.history] == whole[10:]
    text = trainer.sample("The ", 20)
    assert text.startswith("The ") and text == trainer.sample("The ", 20)


# ---------------------------------------------------------------------------------------------
# The run directory: attnlab's own, one run at a time
# ---------------------------------------------------------------------------------------------
def _snapshot(d: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(d)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("resume", [False, True])
def test_a_foreign_out_directory_is_refused_and_left_untouched(tmp_path: Path, capsys, resume: bool) -> None:
    """attnlab train --out DIR used to delete DIR/checkpoints/step-* and truncate DIR/metrics.jsonl
    when DIR had no latest.json."""
    out = tmp_path / "mine"
    (out / "checkpoints" / "step-00000001").mkdir(parents=True)
    (out / "checkpoints" / "step-00000001" / "weights.bin").write_bytes(b"precious")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (out / "notes.txt").write_text("mine")
    before = _snapshot(out)
    flags = ["--resume"] if resume else []
    assert main(["train", "--out", str(out), *SMALL_FLAGS, "--max-steps", "1", "--no-malloc-tuning", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab train: error: --out") and "latest.json" in lines[0], lines
    assert _snapshot(out) == before
    (out / "checkpoints").rename(tmp_path / "elsewhere")  # files, but no checkpoints: still not ours
    assert main(["train", "--out", str(out), *SMALL_FLAGS, "--max-steps", "1", "--no-malloc-tuning", *flags]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "is not empty (metrics.jsonl, notes.txt) and holds no attnlab run" in lines[0], lines
    assert not (out / ".attnlab-train.lock").exists()


def test_an_empty_or_own_directory_is_taken(tmp_path: Path, one_thread) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    Trainer(TrainConfig(out=str(empty), max_steps=1, **ON_CPU)).fit()
    assert (empty / "latest.json").is_file() and (empty / ".attnlab-train.lock").is_file()
    # A run killed before its first checkpoint leaves metrics.jsonl and its lock file: a new run
    # may start over there (the metrics are its own).
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / ".attnlab-train.lock").write_text('{"pid": 1}')
    (killed / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
    Trainer(TrainConfig(out=str(killed), max_steps=2, **ON_CPU)).fit()
    assert [r["step"] for r in read_metrics(killed)] == [1, 2]


def test_a_directory_in_use_is_refused_naming_the_process(tmp_path: Path, one_thread) -> None:
    cfg = TrainConfig(out=str(tmp_path / "run"), max_steps=2, **ON_CPU)
    first = Trainer(cfg)  # holds the lock from set-up on
    with pytest.raises(ValueError, match=rf"in use by another attnlab train \(process {os.getpid()} on "):
        Trainer(dataclasses_replace(cfg, resume=True))
    first.fit()  # the refused one changed nothing
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]
    # fit() gave the lock back: the next run may resume.
    assert Trainer(dataclasses_replace(cfg, resume=True, max_steps=3)).fit().step == 3


def test_a_run_clears_what_a_killed_save_left(tmp_path: Path, one_thread) -> None:
    out = tmp_path / "run"
    Trainer(TrainConfig(out=str(out), max_steps=1, **ON_CPU)).fit()
    debris = [out / ".latest.json.k1ll3d.tmp", out / ".metrics.jsonl.k1ll3d.tmp"]
    for p in debris:
        p.write_text("torn")
    Trainer(TrainConfig(out=str(out), resume=True, max_steps=2, **ON_CPU)).fit()
    assert not any(p.exists() for p in debris)


def test_checkpoints_without_their_pointer_are_not_taken_for_debris(tmp_path: Path, one_thread) -> None:
    out = tmp_path / "run"
    Trainer(TrainConfig(out=str(out), max_steps=2, checkpoint_every=1, **ON_CPU)).fit()
    (out / "latest.json").unlink()
    before = _snapshot(out / "checkpoints")
    for resume in (False, True):
        with pytest.raises(ValueError, match=r"holds checkpoints \(step-00000001, step-00000002\) but no latest\.json"):
            Trainer(TrainConfig(out=str(out), resume=resume, max_steps=3, **ON_CPU))
    assert _snapshot(out / "checkpoints") == before


def test_a_first_save_stopped_before_its_pointer_is_taken_up_by_resume(tmp_path: Path, one_thread) -> None:
    # A kill between the step directory's rename and latest.json's write, at the run's first save, left
    # a directory that neither --resume nor a new run would take.
    out = tmp_path / "run"
    Trainer(TrainConfig(out=str(out), max_steps=2, checkpoint_every=2, **ON_CPU)).fit()
    (out / "latest.json").unlink()
    with pytest.raises(ValueError, match=r"but no latest\.json; restore it to resume \(or pass --resume"):
        Trainer(TrainConfig(out=str(out), max_steps=3, **ON_CPU))
    resumed = Trainer(TrainConfig(out=str(out), resume=True, max_steps=3, **ON_CPU))
    assert resumed.fit().step == 3 and resumed.resumed_from.name == "step-00000002"
    # A step directory whose files are not whole is not taken up.
    (out / "latest.json").unlink()
    for d in (out / "checkpoints").glob("step-*"):
        if d.name != "step-00000003":
            shutil.rmtree(d)
    with open(out / "checkpoints" / "step-00000003" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=r"model\.safetensors"):
        Trainer(TrainConfig(out=str(out), resume=True, max_steps=4, **ON_CPU))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo() (POSIX)")
def test_a_metrics_log_that_is_no_file_is_refused_without_blocking(tmp_path: Path, one_thread) -> None:
    out = tmp_path / "run"
    Trainer(TrainConfig(out=str(out), max_steps=1, **ON_CPU)).fit()
    (out / "metrics.jsonl").unlink()
    os.mkfifo(out / "metrics.jsonl")
    with pytest.raises(ValueError, match=r"metrics log .*metrics\.jsonl is a FIFO"):
        Trainer(TrainConfig(out=str(out), resume=True, max_steps=2, **ON_CPU)).fit()


def test_metrics_lines_too_long_or_torn_are_dropped(tmp_path: Path, one_thread) -> None:
    out = tmp_path / "run"
    Trainer(TrainConfig(out=str(out), max_steps=2, **ON_CPU)).fit()
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 1, "pad": "' + "x" * 200_000 + '"}\n')  # no line attnlab writes is this long
        f.write('{"step": 2, "lo')  # torn by a kill
    Trainer(TrainConfig(out=str(out), resume=True, max_steps=3, **ON_CPU)).fit()
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]


def dataclasses_replace(cfg: TrainConfig, **kw) -> TrainConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


# ---------------------------------------------------------------------------------------------
# Settings: every field checked (they also come from a checkpoint's JSON)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("out", "", "--out"),
        ("data", 5, "--data"),
        ("data", "", "--data"),
        ("bpe_dir", 3, "--bpe-dir"),
        ("val_fraction", "x", "val_fraction"),
        ("min_lr_ratio", None, "min_lr_ratio"),
        ("beta1", 1.0, "beta1"),
        ("beta2", "x", "beta2"),
        ("beta2", float("nan"), "beta2"),
        ("sample_prompt", 5, "--sample-prompt"),
        ("device", 0, "--device"),
        ("preset", None, "--preset"),
        ("resume", "yes", "--resume"),
        ("compile", 1, "--compile"),
        ("progress", None, "--progress"),
        ("seed", 2**64, "--seed"),
        ("batch_size", 2**63, "--batch-size"),
        ("sample_tokens", 2**31, "--sample-tokens"),
        ("lr", float("inf"), "--lr"),
    ],
)
def test_every_setting_is_checked_naming_its_flag(field: str, value, named: str) -> None:
    with pytest.raises(ValueError, match=f"^{named}") as exc:
        dataclasses_replace(TrainConfig(), **{field: value}).validate()
    assert "\n" not in str(exc.value)


def test_out_empty_is_one_line_and_writes_nothing(tmp_path: Path, capsys, monkeypatch) -> None:
    """--out "" used to train into the working directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--out", "", *SMALL_FLAGS, "--max-steps", "1", "--no-malloc-tuning"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab train: error: --out"), lines
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Memory: refuse what cannot fit, before allocating it
# ---------------------------------------------------------------------------------------------
def test_the_memory_estimate_is_a_lower_bound_of_the_parameters() -> None:
    from attnlab.model import GPT, GPTConfig
    from attnlab.training.memory import estimate_training_memory

    for name in GPTConfig.presets():
        config = GPTConfig.preset(name)
        with torch.device("meta"):
            n = GPT(config).num_parameters()
        est = estimate_training_memory(config, 1)
        assert 0.99 * n <= est.parameters <= n, name  # biases and LayerNorms left out: < 1 %
        assert est.states == 16 * est.parameters


def test_a_run_that_cannot_fit_is_refused_with_the_estimate(tmp_path: Path, monkeypatch, capsys) -> None:
    import attnlab.training.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "available_memory", lambda device: 8 << 30)  # an 8 GiB machine
    out = tmp_path / "xl"
    code = main(
        [
            "train",
            "--out",
            str(out),
            "--preset",
            "gpt2-xl",
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--no-malloc-tuning",
        ]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    from attnlab.model import GPTConfig
    from attnlab.training.memory import GiB, estimate_training_memory

    config = GPTConfig.preset("gpt2-xl", vocab_size=256)  # the byte tokenizer: 256 ids
    need = estimate_training_memory(config, 32).total  # the default batch, fp32 on CPU
    assert f"needs at least {need / GiB:.1f} GiB on cpu but 8.0 GiB are available" in lines[0], lines[0]
    for flag in ("--batch-size", "--grad-accum", "--context-length", "--preset"):
        assert flag in lines[0]
    assert not (out / "checkpoints").exists()
    # The tiny preset fits in 8 GiB: the check refuses nothing it should not.
    Trainer(TrainConfig(out=str(tmp_path / "tiny"), max_steps=1, **ON_CPU))


def test_an_absurd_batch_is_one_line_on_this_machine(tmp_path: Path, capsys) -> None:
    """No monkeypatching: 10**9 sequences of 64 tokens need petabytes of logits anywhere."""
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), "--batch-size", str(10**9), "--device", "cpu", "--no-malloc-tuning"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--batch-size" in lines[0] and "GiB" in lines[0], lines


def test_an_allocator_refusal_during_training_is_one_line_naming_the_flags(tmp_path: Path, capsys, monkeypatch) -> None:
    import attnlab.training.trainer as trainer_mod

    def oom(self):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: 9 GB")

    monkeypatch.setattr(trainer_mod.Trainer, "_train_step", oom)
    out = tmp_path / "run"
    assert (
        main(["train", "--out", str(out), *SMALL_FLAGS, "--max-steps", "2", "--device", "cpu", "--no-malloc-tuning"])
        == 2
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("attnlab train: error: ran out of memory on cpu") and "--batch-size" in lines[-1]
    assert len(lines) == 3  # the recipe and the run's start lines, then the error
    # The lock went with the failed run.
    Trainer(TrainConfig(out=str(out), max_steps=1, **ON_CPU)).close()


@pytest.mark.parametrize(("flags", "named"), [(["--context-length", "10000000"], "context_length=10000000")])
def test_a_context_past_sane_limits_is_one_line_before_any_work(tmp_path: Path, capsys, flags, named: str) -> None:
    out = tmp_path / "run"
    assert main(["train", "--out", str(out), *flags, "--device", "cpu", "--no-malloc-tuning"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab train: error: --preset tiny") and named in lines[0], lines
    assert not (out / "checkpoints").exists()


def test_a_run_without_safetensors_is_refused_before_it_trains(tmp_path: Path, monkeypatch) -> None:
    # With the core install alone a run trained to its first save (step 200), then stopped: work lost.
    monkeypatch.setitem(sys.modules, "safetensors", None)  # (what `import safetensors` finds uninstalled)
    with pytest.raises(ImportError, match=r"needs safetensors: pip install 'attnlab\[train\]'"):
        Trainer(TrainConfig(out=str(tmp_path / "run"), max_steps=2, **ON_CPU))
    assert not (tmp_path / "run").exists()


def test_a_planned_run_resumed_with_max_steps_trains_them(tmp_path: Path) -> None:
    # The saved --max-time came back with the checkpoint and planned the resumed run again: asked for
    # 25 steps, it stopped at the budget's count.
    base = dict(out=str(tmp_path), eval_every=100, checkpoint_every=100, warmup_steps=0, **ON_CPU)
    first = Trainer(TrainConfig(max_steps=800, max_time=1e-3, **base), log=lambda s: None).fit(sample=False)
    assert first.step < 25  # (planned down: the budget fits a step or so past the planning steps)
    again = Trainer(TrainConfig(max_steps=25, resume=True, **base), given={"max_steps"}, log=lambda s: None)
    assert again.cfg.max_time is None
    assert again.fit(sample=False).step == 25
