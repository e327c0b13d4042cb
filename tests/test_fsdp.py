"""``torchrun -m attnlab train --fsdp``: 2 sharded CPU processes (FSDP2 over Gloo) follow one process,
their checkpoints (torch.distributed.checkpoint inside attnlab's atomic step directory) survive a
SIGKILL in the middle of a save and resume with any number of processes, sharded or not. Chat
fine-tuning too: the loss on the assistant's tokens only, and the copy of the base model's tokenizer
the checkpoint carries."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from attnlab.cli import main
from attnlab.training.checkpoint import load_checkpoint, read_latest

pytestmark = [
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with Gloo"
    ),
    pytest.mark.slow,
]

HERE = Path(__file__).parent
STEPS = 6
FLAGS = [
    "--context-length", "16", "--batch-size", "8", "--eval-batches", "2", "--sample-tokens", "0", "--no-progress",
    "--max-steps", str(STEPS), "--eval-every", "3", "--checkpoint-every", "3", "--dropout", "0", "--seed", "3",
    "--lr", "3e-3", "--warmup-steps", "2", "--device", "cpu", "--precision", "fp32", "--optimizer", "adamw",
]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TOL = 1e-4
# Chat fine-tuning (--init-from keeps the model's own dropout: no --dropout), the tiniest run that
# evaluates and checkpoints halfway.
CHAT_DATA = HERE.parent / "examples" / "chat_example.jsonl"
CHAT_STEPS = 4
CHAT_FLAGS = [
    "--context-length", "32", "--batch-size", "8", "--eval-batches", "2", "--sample-tokens", "0", "--no-progress",
    "--max-steps", str(CHAT_STEPS), "--eval-every", "2", "--checkpoint-every", "2", "--seed", "3", "--lr", "3e-3",
    "--warmup-steps", "1", "--device", "cpu", "--precision", "fp32",
]  # fmt: skip
TOKENIZERS = importlib.util.find_spec("tokenizers") is not None


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run(
    out: Path,
    nproc: int,
    *extra: str,
    script: list[str] | None = None,
    env: dict | None = None,
    check=True,
    flags: tuple[str, ...] | list[str] = tuple(FLAGS),
):
    if nproc == 1 and script is None:
        cmd = [sys.executable, "-m", "attnlab", "train"]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd = [*launcher, *(script or ["-m", "attnlab"]), "train"]
    r = subprocess.run(
        [*cmd, "--out", str(out), *flags, *extra], capture_output=True, text=True, env=env or ENV, timeout=300
    )
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


def from_step(src: Path, out: Path, step: int) -> Path:
    """A new training directory holding only ``src``'s checkpoint of ``step`` (as if it stopped there)."""
    name = f"step-{step:08d}"
    shutil.copytree(src / "checkpoints" / name, out / "checkpoints" / name)
    (out / "latest.json").write_text(
        json.dumps({"format": "attnlab-checkpoint", "step": step, "path": f"checkpoints/{name}"})
    )
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp")
    run(root / "one", 1)
    r = run(root / "sharded", 2, "--fsdp")
    assert "batch 8 x 16 tokens (4 per process x 1 micro-step(s)), 2 process(es)" in r.stderr, r.stderr
    return {"one": root / "one", "sharded": root / "sharded"}


def assert_follows(run_metrics: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in run_metrics] == [r["step"] for r in reference]
    for a, b in zip(reference, run_metrics, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=TOL), (a, b)
        assert b["lr"] == a["lr"]
        if "val_loss" in a:
            assert b["val_loss"] == pytest.approx(a["val_loss"], abs=TOL)


def test_two_sharded_processes_follow_one_process(runs) -> None:
    one, sharded = metrics(runs["one"]), metrics(runs["sharded"])
    assert_follows(sharded, one)
    assert one[-1]["loss"] < one[0]["loss"] - 0.5  # it trained: equal losses are not equal by accident
    step_dir = runs["sharded"] / "checkpoints" / f"step-{STEPS:08d}"
    meta = json.loads((step_dir / "checkpoint.json").read_text())
    shards = sorted(f for f in meta["files"] if f.startswith("optimizer/"))
    assert shards == ["optimizer/.metadata", "optimizer/__0_0.distcp", "optimizer/__1_0.distcp"]
    assert "optimizer.pt" not in meta["files"] and meta["world_size"] == 2
    # The weights are whole: generate & co. read a sharded run's checkpoint like any other.
    a = load_checkpoint(runs["one"], load_optimizer=False).model.state_dict()
    b = load_checkpoint(runs["sharded"], load_optimizer=False).model.state_dict()
    for k in a:
        assert (a[k] - b[k]).abs().max() < 1e-4, k


def test_sharded_processes_with_micro_steps_follow_one_process(runs, tmp_path) -> None:
    # Regression: --fsdp with --grad-accum above 1 called DDP's no_sync on the FSDP2 model and crashed.
    r = run(tmp_path / "accum", 2, "--fsdp", "--grad-accum", "2")
    assert "batch 8 x 16 tokens (2 per process x 2 micro-step(s)), 2 process(es)" in r.stderr, r.stderr
    assert_follows(metrics(tmp_path / "accum"), metrics(runs["one"]))


@pytest.mark.parametrize(("source", "nproc", "extra"), [("sharded", 1, ()), ("one", 2, ("--fsdp",))])
def test_a_checkpoint_resumes_with_another_process_count_sharded_or_not(runs, tmp_path, source, nproc, extra) -> None:
    out = from_step(runs[source], tmp_path / "resumed", 3)
    run(out, nproc, "--resume", *extra)
    assert_follows(metrics(out), metrics(runs["one"])[3:])


def test_a_sharded_checkpoint_resumes_with_this_runs_optimizer_settings(runs, tmp_path) -> None:
    # distributed checkpoint restored the saving run's param groups: a resumed --weight-decay (betas,
    # eps) was recorded but not used (the same weights at 0.5 as at 0.1).
    from attnlab.training import TrainConfig, Trainer

    out = from_step(runs["sharded"], tmp_path / "resumed", 3)
    given = {"weight_decay", "beta2"}
    trainer = Trainer(TrainConfig(out=str(out), resume=True, weight_decay=0.5, beta2=0.9), given=given)
    try:
        assert trainer.step == 3 and trainer.optimizer.state  # (the file's state is loaded)
        decays = sorted({g["weight_decay"] for g in trainer.optimizer.param_groups})
        assert decays == [0.0, 0.5] and {g["betas"][1] for g in trainer.optimizer.param_groups} == {0.9}
    finally:
        trainer.close()


def test_a_sigkill_during_a_sharded_save_leaves_the_previous_checkpoint(runs, tmp_path) -> None:
    out = tmp_path / "killed"
    # Both processes are killed right after writing their optimizer shards of the step-6 save, before
    # rank 0 wrote the weights and checkpoint.json and switched latest.json.
    killer = [str(HERE / "fsdp_kill_during_save.py")]
    r = run(out, 2, "--fsdp", script=killer, env={**ENV, "ATTNLAB_TEST_KILL_AT_SAVE": "2"}, check=False)
    assert r.returncode != 0
    assert read_latest(out)["step"] == 3
    debris = list((out / "checkpoints").glob(".tmp-step-00000006-*"))
    assert debris and (debris[0] / "optimizer").is_dir()  # the kill did land inside the save
    ckpt = load_checkpoint(out)  # the previous checkpoint, whole and verified
    assert ckpt.step == 3 and ckpt.optimizer_dir is not None
    run(out, 1, "--resume")  # and it continues (the debris is cleared by the next save)
    assert_follows(metrics(out), metrics(runs["one"]))
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_fsdp_without_torchrun_is_one_line(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--fsdp", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--fsdp shards the model over torchrun's processes" in err, err


@pytest.mark.skipif(not TOKENIZERS, reason="the base model's tokenizer.json needs tokenizers (pip install tokenizers)")
def test_chat_fine_tuning_sharded_follows_one_process_and_carries_the_tokenizer(tmp_path) -> None:
    """--init-from an instruct model (a Hugging Face tokenizer.json, a chat template) with chat data: 2
    processes --fsdp, whose shares of a batch count different numbers of assistant tokens, give one
    process's loss at every step; the sharded checkpoint holds the base's tokenizer (hf_tokenizer.json),
    which load_model and a sharded --resume read once the base model is gone."""
    from attnlab.cli.train import add_arguments, config_from_args, load_init
    from attnlab.tokenizers import HFTokenizer
    from attnlab.tools.loading import load_model
    from attnlab.training.trainer import Trainer
    from test_finetune import CHATML, byte_level_tokenizer_json, llama_like

    base = tmp_path / "base"
    byte_level_tokenizer_json(base / "hf" / "tokenizer.json")
    model, g = llama_like(), torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights larger than the init: tokens' losses far apart, so a wrong weighting shows
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    model.save(base / "model")
    hf = HFTokenizer(base / "hf" / "tokenizer.json")
    (base / "model" / "tokenizer.json").write_text(json.dumps(hf.to_dict()))
    chat = {"chat_template": {"source": CHATML, "bos_token": "", "eos_token": ""}, "stop_ids": [10]}
    (base / "model" / "chat.json").write_text(json.dumps(chat))  # an instruct model's, as --merge writes it
    flags = ["--init-from", str(base / "model"), "--data", str(CHAT_DATA), *CHAT_FLAGS]

    # The two processes' shares of each global batch (rows [0, 4) and [4, 8)), as the trainer draws them.
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg, given = config_from_args(parser.parse_args([*flags, "--out", str(tmp_path / "draw")]))
    trainer, counts = Trainer(cfg, given=given, init=load_init(cfg.init_from)), []
    try:
        for step in range(CHAT_STEPS):
            _, y = trainer.train_batches.batch(step)  # (8, T): the global batch, -100 where not the assistant's
            counts.append((int((y[:4] != -100).sum()), int((y[4:] != -100).sum())))
    finally:
        trainer.close()
    assert any(a != b for a, b in counts), counts  # a mean per process would be right by accident otherwise

    one, sharded = tmp_path / "one", tmp_path / "sharded"
    run(one, 1, *flags, flags=())
    run(sharded, 2, "--fsdp", *flags, flags=())
    assert_follows(metrics(sharded), metrics(one))
    assert all("val_loss" in m for m in metrics(one)[1::2])  # (the validation loss is compared too)

    step_dir = sharded / "checkpoints" / f"step-{CHAT_STEPS:08d}"
    meta = load_checkpoint(sharded, load_optimizer=False).metadata
    assert meta["world_size"] == 2 and meta["chat_template"]["source"] == CHATML and meta["stop_ids"] == [10]
    assert meta["tokenizer"] == {**hf.to_dict(), "path": "hf_tokenizer.json"}  # the copy, by its name in the step
    assert "hf_tokenizer.json" in json.loads((step_dir / "checkpoint.json").read_text())["files"]  # hashed
    assert (step_dir / "hf_tokenizer.json").read_bytes() == (base / "hf" / "tokenizer.json").read_bytes()

    shutil.rmtree(base)  # the base model gone: the checkpoint stands alone
    loaded = load_model(sharded)
    assert isinstance(loaded.tokenizer, HFTokenizer) and loaded.tokenizer == hf
    assert loaded.tokenizer.path == step_dir / "hf_tokenizer.json" and loaded.stop_ids == (10,)
    assert loaded.tokenizer.encode("héllo, <|im_end|>") == hf.encode("héllo, <|im_end|>")
    resumed = from_step(sharded, tmp_path / "resumed", CHAT_STEPS // 2)
    run(resumed, 2, "--fsdp", "--resume", flags=())  # reads the tokenizer and the template from the checkpoint
    assert_follows(metrics(resumed), metrics(one)[CHAT_STEPS // 2 :])
