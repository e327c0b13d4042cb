"""Checkpoints: round trips, RNG states, integrity checks, and consistency under crashes and SIGKILL."""

from __future__ import annotations

import io
import json
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.model import GPT, GPTConfig
from attnlab.training.checkpoint import (
    CHECKPOINT_NAME,
    LATEST_NAME,
    OPTIMIZER_NAME,
    find_checkpoint,
    get_rng_state,
    load_checkpoint,
    read_latest,
    save_checkpoint,
    set_rng_state,
)


def small_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig.preset("tiny", context_length=16, emb_dim=32, n_heads=2, n_layers=2))


def trained(model: GPT, steps: int = 2) -> torch.optim.Optimizer:
    opt = model.configure_optimizer(weight_decay=0.1, lr=1e-2)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(steps):
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_round_trip_restores_weights_optimizer_and_metadata(tmp_path: Path) -> None:
    model = small_model()
    opt = trained(model)
    step_dir = save_checkpoint(tmp_path, step=7, model=model, optimizer=opt, metadata={"hello": [1, 2]})
    assert step_dir == tmp_path / "checkpoints" / "step-00000007"
    assert json.loads((tmp_path / LATEST_NAME).read_text())["step"] == 7
    assert read_latest(tmp_path) == json.loads((tmp_path / LATEST_NAME).read_text())
    ck = load_checkpoint(tmp_path)
    assert ck.step == 7 and ck.metadata["hello"] == [1, 2] and ck.path == step_dir
    for (name, a), (_, b) in zip(model.state_dict().items(), ck.model.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert ck.model.out_head.weight is ck.model.tok_emb.weight  # still tied
    # The optimizer state comes back identical and a fresh optimizer accepts it.
    opt2 = ck.model.configure_optimizer(weight_decay=0.1, lr=1e-2)
    opt2.load_state_dict(ck.optimizer_state)
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    for k in s1:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1[k][name], s2[k][name])
    # A step directory is also a plain GPT.save() directory.
    assert torch.equal(GPT.load(step_dir).tok_emb.weight, model.tok_emb.weight)
    assert find_checkpoint(step_dir) == step_dir


def test_rng_state_round_trip_through_json() -> None:
    state = json.loads(json.dumps(get_rng_state()))  # must be plain JSON
    a = (torch.rand(5), np.random.rand(3), random.random(), torch.randn(2))
    set_rng_state(state)
    b = (torch.rand(5), np.random.rand(3), random.random(), torch.randn(2))
    assert torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2] and torch.equal(a[3], b[3])
    # Dropout draws from the same generator, so its masks repeat too.
    drop = torch.nn.Dropout(0.5)
    set_rng_state(state)
    m1 = drop(torch.ones(100))
    set_rng_state(state)
    assert torch.equal(m1, drop(torch.ones(100)))


def test_keeps_the_newest_and_saving_the_same_step_is_a_no_op(tmp_path: Path) -> None:
    model = small_model()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step=step, model=model, optimizer=None, metadata={}, keep=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000003", "step-00000004"]
    mtime = (tmp_path / "checkpoints" / "step-00000004" / CHECKPOINT_NAME).stat().st_mtime_ns
    save_checkpoint(tmp_path, step=4, model=model, optimizer=None, metadata={})
    assert (tmp_path / "checkpoints" / "step-00000004" / CHECKPOINT_NAME).stat().st_mtime_ns == mtime


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("victim", ["model.safetensors", OPTIMIZER_NAME])
def test_damaged_files_are_named(tmp_path: Path, damage: str, victim: str) -> None:
    model = small_model()
    step_dir = save_checkpoint(tmp_path, step=1, model=model, optimizer=trained(model), metadata={})
    f = step_dir / victim
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(bytes(data[: len(data) // 2]))
    else:
        f.unlink()
    err = FileNotFoundError if damage == "delete" else ValueError
    with pytest.raises(err, match=victim):
        load_checkpoint(tmp_path)


def test_corrupt_pointer_and_metadata_are_named(tmp_path: Path) -> None:
    model = small_model()
    step_dir = save_checkpoint(tmp_path, step=1, model=model, optimizer=None, metadata={})
    (tmp_path / LATEST_NAME).write_text('{"step": 1, "pa')  # torn JSON
    with pytest.raises(ValueError, match=LATEST_NAME):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=LATEST_NAME):
        read_latest(tmp_path)
    (tmp_path / LATEST_NAME).write_text('{"step": 1}')  # JSON, but no path
    with pytest.raises(ValueError, match=f"{LATEST_NAME} is corrupt"):
        read_latest(tmp_path)
    save_checkpoint(tmp_path / "b", step=1, model=model, optimizer=None, metadata={})
    meta = tmp_path / "b" / "checkpoints" / step_dir.name / CHECKPOINT_NAME
    meta.write_bytes(meta.read_bytes()[:20])
    with pytest.raises(ValueError, match=CHECKPOINT_NAME):
        load_checkpoint(tmp_path / "b")
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        load_checkpoint(tmp_path / "b" / "checkpoints")


def test_pointer_outside_the_training_directory_is_refused(tmp_path: Path) -> None:
    model = small_model()
    save_checkpoint(tmp_path / "other", step=1, model=model, optimizer=None, metadata={})
    save_checkpoint(tmp_path / "run", step=1, model=model, optimizer=None, metadata={})
    elsewhere = next((tmp_path / "other" / "checkpoints").iterdir())
    for path in ("../other/checkpoints/" + elsewhere.name, str(elsewhere)):
        (tmp_path / "run" / LATEST_NAME).write_text(json.dumps({"step": 1, "path": path}))
        with pytest.raises(ValueError, match="outside"):
            load_checkpoint(tmp_path / "run")


def test_a_symlinked_checkpoints_directory_still_loads(tmp_path: Path) -> None:
    # checkpoints/ on another disk through a symlink: the pointer stays inside, its target does not.
    (tmp_path / "scratch").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").symlink_to(tmp_path / "scratch", target_is_directory=True)
    save_checkpoint(tmp_path / "run", step=np.int64(2), model=small_model(), optimizer=None, metadata={})
    assert load_checkpoint(tmp_path / "run").step == 2


@pytest.mark.parametrize("step", [-1, 1.5, True, np.True_, "3"])
def test_a_step_load_checkpoint_would_refuse_is_not_saved(tmp_path: Path, step) -> None:
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        save_checkpoint(tmp_path, step=step, model=small_model(), optimizer=None, metadata={})
    assert not (tmp_path / LATEST_NAME).exists()


def test_numpy_integers_are_steps_and_counts_written_as_json_ints(tmp_path: Path) -> None:
    model = small_model()
    for step in (1, 2):
        save_checkpoint(tmp_path, step=np.int64(step), model=model, optimizer=None, metadata={}, keep=np.int32(1))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002"]
    assert json.loads((tmp_path / LATEST_NAME).read_text())["step"] == 2
    assert load_checkpoint(tmp_path).step == 2


class _Evil:
    def __reduce__(self):  # what a malicious pickle would run
        return (os.system, ("echo pwned",))


def test_optimizer_file_is_never_unpickled(tmp_path: Path) -> None:
    model = small_model()
    step_dir = save_checkpoint(tmp_path, step=1, model=model, optimizer=trained(model), metadata={})
    buf = io.BytesIO()
    torch.save({"state": {}, "param_groups": [], "x": _Evil()}, buf)
    (step_dir / OPTIMIZER_NAME).write_bytes(buf.getvalue())
    # Make the recorded hash match, so only weights_only=True stands in the way.
    import hashlib

    meta = json.loads((step_dir / CHECKPOINT_NAME).read_text())
    meta["files"][OPTIMIZER_NAME] = {"bytes": len(buf.getvalue()), "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}
    (step_dir / CHECKPOINT_NAME).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=OPTIMIZER_NAME):
        load_checkpoint(tmp_path)


def test_crash_before_the_pointer_switch_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:
    import attnlab.training.checkpoint as ckmod

    model = small_model()
    save_checkpoint(tmp_path, step=1, model=model, optimizer=None, metadata={"n": 1})
    real = ckmod.atomic_write_json

    def crash(path, obj):
        if path.name == LATEST_NAME:
            raise OSError("simulated crash before the pointer switch")
        real(path, obj)

    monkeypatch.setattr(ckmod, "atomic_write_json", crash)
    with torch.no_grad():
        model.tok_emb.weight.add_(1.0)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path, step=2, model=model, optimizer=None, metadata={"n": 2})
    ck = load_checkpoint(tmp_path)
    assert ck.step == 1 and ck.metadata["n"] == 1
    monkeypatch.setattr(ckmod, "atomic_write_json", real)
    # The debris of step 2 is replaced by the next real save of step 2.
    save_checkpoint(tmp_path, step=2, model=model, optimizer=None, metadata={"n": 2})
    ck = load_checkpoint(tmp_path)
    assert ck.step == 2 and torch.equal(ck.model.tok_emb.weight, model.tok_emb.weight)


# One driver process (torch imported once) forks a child per trial; the child saves checkpoints in
# a loop, the driver SIGKILLs it at a random moment and copies the directory as the kill left it.
_DRIVER = textwrap.dedent(
    """
    import os, random, shutil, signal, sys, time
    import torch
    import torch._dynamo  # noqa: F401  (AdamW imports it; once here rather than in every child)
    from attnlab.training.checkpoint import save_checkpoint
    from attnlab.model import GPT, GPTConfig

    def saver(out, w):
        model = GPT(GPTConfig.preset("tiny", context_length=64, emb_dim=192, n_layers=4, n_heads=4))
        opt = model.configure_optimizer(lr=1e-3)
        x = torch.randint(0, 256, (1, 8)); model.loss(x, x).backward(); opt.step()
        step = 0
        while True:
            step += 1
            with torch.no_grad():  # weights and optimizer state all equal `step`: checkable after a kill
                for p in model.parameters():
                    p.fill_(step)
                for s in opt.state.values():
                    s["exp_avg"].fill_(step)
            save_checkpoint(out, step=step, model=model, optimizer=opt, metadata={"value": step}, keep=1)
            if step == 1:
                os.write(w, b"1")

    out, copies, trials = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = random.Random(0)
    for trial in range(trials):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                saver(out, w)
            finally:
                os._exit(1)
        os.close(w)
        os.read(r, 1)  # the first complete save of this trial is done
        time.sleep(rng.uniform(0.0, 0.5))  # then die somewhere inside a later save
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        shutil.copytree(out, os.path.join(copies, str(trial)), symlinks=True)
    """
)


@pytest.mark.slow
def test_sigkill_at_any_moment_leaves_a_consistent_checkpoint(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trials = 5
    subprocess.run(
        [sys.executable, "-c", _DRIVER, str(tmp_path / "run"), str(tmp_path / "copies"), str(trials)],
        env=env,
        check=True,
        timeout=300,
    )
    for trial in range(trials):
        ck = load_checkpoint(tmp_path / "copies" / str(trial))
        step = ck.step
        assert step >= 1 and ck.metadata["value"] == step
        for name, p in ck.model.named_parameters():
            assert torch.all(p == step), name
        for s in ck.optimizer_state["state"].values():
            assert torch.all(s["exp_avg"] == step)


def test_debris_past_the_current_step_is_removed_and_valid_checkpoints_kept(tmp_path: Path) -> None:
    """Step directories are ordered by step number, and one at or past the step being saved that
    latest.json never named (a later run killed before its pointer switch) is debris."""
    import shutil

    model = small_model()
    save_checkpoint(tmp_path, step=1, model=model, optimizer=None, metadata={})
    save_checkpoint(tmp_path, step=2, model=model, optimizer=None, metadata={})
    ckpts = tmp_path / "checkpoints"
    shutil.copytree(ckpts / "step-00000002", ckpts / "step-00000300")  # an interrupted later run's
    save_checkpoint(tmp_path, step=3, model=model, optimizer=None, metadata={"n": 3}, keep=2)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-00000002", "step-00000003"]
    assert load_checkpoint(tmp_path).step == 3
    assert load_checkpoint(ckpts / "step-00000002").step == 2


def _edit_metadata(step_dir: Path, edit) -> None:
    meta = json.loads((step_dir / CHECKPOINT_NAME).read_text())
    edit(meta)
    (step_dir / CHECKPOINT_NAME).write_text(json.dumps(meta))


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda m: m.update(version="1"), "version"),
        (lambda m: m.update(version=True), "version"),
        (lambda m: m.update(step="3"), "step"),
        (lambda m: m.update(step=-1), "step"),
        (lambda m: m.update(files=["model.safetensors"]), "files"),
        (lambda m: m["files"].update({"model.safetensors": "abc"}), "model.safetensors"),
        (lambda m: m["files"]["config.json"].update(bytes="12"), "config.json"),
        (lambda m: m["files"].update({"../model.safetensors": {"bytes": 1, "sha256": "0" * 64}}), r"\.\./"),
        (lambda m: m["files"].update({"a/b": {"bytes": 1, "sha256": "0" * 64}}), "a/b"),
    ],
)
def test_hand_edited_metadata_is_a_clear_error(tmp_path: Path, edit, named: str) -> None:
    from attnlab.training.checkpoint import read_metadata

    step_dir = save_checkpoint(tmp_path, step=1, model=small_model(), optimizer=None, metadata={})
    _edit_metadata(step_dir, edit)
    for reader in (load_checkpoint, read_metadata):
        with pytest.raises(ValueError, match=CHECKPOINT_NAME) as exc:
            reader(tmp_path)
        assert re.search(named, str(exc.value)), str(exc.value)


def test_mps_rng_state_travels_when_mps_is_there(monkeypatch) -> None:
    import attnlab.training.checkpoint as ckmod

    assert get_rng_state()["mps"] is None or ckmod._mps_available()
    gen = torch.Generator().manual_seed(5)
    mps_state = {"now": gen.get_state()}  # a stand-in generator state, as bytes
    monkeypatch.setattr(ckmod, "_mps_available", lambda: True)
    monkeypatch.setattr(torch.mps, "get_rng_state", lambda: mps_state["now"].clone(), raising=False)
    monkeypatch.setattr(torch.mps, "set_rng_state", lambda s: mps_state.update(now=s), raising=False)
    saved = json.loads(json.dumps(get_rng_state()))
    before = mps_state["now"].clone()
    mps_state["now"] = torch.zeros_like(before)
    set_rng_state(saved)
    assert torch.equal(mps_state["now"], before)
