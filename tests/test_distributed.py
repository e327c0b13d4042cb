"""``torchrun -m attnlab train``: 2 CPU processes (DDP over Gloo) follow the 1-process run with the
same global batch, only rank 0 writes, and a 2-process checkpoint resumes in 1 process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with Gloo"
    ),
    pytest.mark.slow,
]

STEPS = 6
FLAGS = [
    "--context-length", "16", "--batch-size", "8", "--eval-batches", "2", "--sample-tokens", "0", "--no-progress",
    "--max-steps", str(STEPS), "--eval-every", "3", "--checkpoint-every", "3", "--dropout", "0", "--seed", "3",
    "--lr", "3e-3", "--warmup-steps", "2", "--device", "cpu",
    "--precision", "fp32",  # bf16 rounds a half batch's sums otherwise than the whole batch's
]  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def train(out: Path, nproc: int, *extra: str) -> subprocess.CompletedProcess:
    if nproc == 1:
        cmd = [sys.executable, "-m", "attnlab", "train"]
    else:  # torchrun, as a user would type it (python -m torch.distributed.run is the same program)
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd = [*run, "-m", "attnlab", "train"]
    r = subprocess.run([*cmd, "--out", str(out), *FLAGS, *extra], capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return r


# How far 2 processes may drift from 1. AdamW: rounding only (the all-reduced gradient sums in
# another order). Muon orthogonalises each update in bf16, which turns last-bit differences of the
# gradient into differences of about 1e-3 of the update (measured: 2e-4 in the loss at step 3).
TOLERANCE = {"adamw": 1e-6, "muon": 2e-3}


@pytest.fixture(scope="module", params=sorted(TOLERANCE))
def runs(tmp_path_factory, request) -> dict:
    root = tmp_path_factory.mktemp("ddp")
    optimizer = request.param
    logs = {n: train(root / f"n{n}", n, "--optimizer", optimizer).stderr for n in (1, 2)}
    # Each process computes its share of the global batch of 8, not all of it.
    assert "batch 8 x 16 tokens (8 per process x 1 micro-step(s)), 1 process(es)" in logs[1], logs[1]
    assert "batch 8 x 16 tokens (4 per process x 1 micro-step(s)), 2 process(es)" in logs[2], logs[2]
    return {1: root / "n1", 2: root / "n2", "optimizer": optimizer, "tol": TOLERANCE[optimizer]}


def test_two_processes_follow_one_process_with_the_same_global_batch(runs) -> None:
    one, two = metrics(runs[1]), metrics(runs[2])
    # Rank 0 alone writes: one line per step, not one per process.
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=runs["tol"]), (a, b)
        assert b["lr"] == a["lr"]
        assert ("val_loss" in a) == ("val_loss" in b)
        if "val_loss" in a:
            assert b["val_loss"] == pytest.approx(a["val_loss"], abs=runs["tol"])
    # The training actually moved (so equal losses are not equal by accident).
    assert one[-1]["loss"] < one[0]["loss"] - 0.5
    meta = json.loads((runs[2] / "checkpoints" / f"step-{STEPS:08d}" / "checkpoint.json").read_text())
    assert meta["world_size"] == 2 and len(meta["rng"]) == 2


def test_a_two_process_checkpoint_resumes_in_one_process(runs, tmp_path: Path) -> None:
    # Take the 2-process run as it was at step 3 (its step-3 checkpoint and metrics) ...
    out = tmp_path / "resumed"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(runs[2] / "checkpoints" / "step-00000003", out / "checkpoints" / "step-00000003")
    (out / "latest.json").write_text(
        json.dumps({"format": "attnlab-checkpoint", "step": 3, "path": "checkpoints/step-00000003"})
    )
    (out / "metrics.jsonl").write_text((runs[2] / "metrics.jsonl").read_text())  # lines past 3 must be dropped
    # ... and finish it with one process: it must track the 1-process run.
    r = train(out, 1, "--resume", "--optimizer", runs["optimizer"])
    assert "written by 2 process(es), this run has 1" in r.stderr
    one, resumed = metrics(runs[1]), metrics(out)
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(one, resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=10 * runs["tol"]), (a, b)


# A process under DDP whose group is destroyed: Gloo's worker threads must be gone before the
# interpreter shuts down, or one may free a collective's tensor then and abort the process (1 run
# of the 2-process training in 10 did, with torch 2.13, until start_process_group imported
# torch._dynamo before the group: DDP imports it, and imported after the group it keeps it alive).
GLOO_THREADS = """
import os, socket, torch
from torch.nn.parallel import DistributedDataParallel as DDP
from attnlab.training.distributed import start_process_group
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
assert start_process_group(torch.device("cpu"))
model = DDP(torch.nn.Linear(4, 4))
model(torch.randn(2, 4)).sum().backward()
del model
torch.distributed.destroy_process_group()
print(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the threads from Linux's /proc")
def test_destroying_the_process_group_ends_the_gloo_threads() -> None:
    r = subprocess.run([sys.executable, "-c", GLOO_THREADS], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "gloo" not in r.stdout, r.stdout
