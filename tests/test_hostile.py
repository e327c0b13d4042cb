"""Hostile run directories and checkpoints: every edit a careless or malicious user can make to a
training directory ends, for each of ``attnlab generate``, ``attnlab viz`` and ``attnlab train
--resume``, in one line on stderr and exit status 2, or in the right result (the same text, the
same attention table, the same losses as the untouched checkpoint). Never a traceback, a hang, a
crash, or data loss.

* :func:`test_hostile_edit` - the table: one row per edit (those the issue lists, and more);
* :func:`test_fuzzed_checkpoint_edits_end_cleanly` - hypothesis edits random fields of a real
  ``checkpoint.json`` / ``config.json`` (with and without updating their hashes);
* subprocess tests for what only a separate process can show: a crafted optimizer state used to
  segfault (exit 139), and two runs on one ``--out``.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from attnlab.cli import main
from attnlab.training.checkpoint import metadata_digest

STEP = "checkpoints/step-00000004"
FLAGS = ["--context-length", "16", "--batch-size", "4", "--eval-batches", "1", "--eval-every", "2"]
FLAGS += ["--checkpoint-every", "2", "--sample-tokens", "0", "--no-progress", "--device", "cpu", "--no-malloc-tuning"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]


# ---------------------------------------------------------------------------------------------
# Running the three commands in this process, each with a deadline
# ---------------------------------------------------------------------------------------------
def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """``fn()``'s result; a test failure when it has not returned after ``seconds`` (it runs in a
    daemon thread, so a blocked read cannot keep the test process alive)."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: a hang"
    if errors:
        raise errors[0]
    return result[0]


COMMANDS = {
    "generate": lambda d: ["generate", "--checkpoint", str(d), "--prompt", "The ", "--max-new-tokens", "12",
                           "--seed", "3", "--device", "cpu"],
    "viz": lambda d: ["viz", "--checkpoint", str(d), "--prompt", "abc"],
    "resume": lambda d: ["train", "--out", str(d), "--resume", "--max-steps", "6", "--no-progress",
                         "--no-malloc-tuning", "--device", "cpu"],
}  # fmt: skip


def run_command(name: str, d: Path, capsys, flags: list[str] = ()) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of one command on directory ``d``; an exception escaping
    ``main`` (a traceback) fails the test."""
    capsys.readouterr()
    code = within(120, lambda: main([*COMMANDS[name](d), *flags]))
    out, err = capsys.readouterr()
    return code, out, err


def result_of(name: str, d: Path, out: str) -> Any:
    """What a successful command produced: the text, the table, or the losses after resuming."""
    if name == "resume":
        lines = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"], r.get("val_loss")) for r in lines if r["step"] > 4]
    return out


# ---------------------------------------------------------------------------------------------
# The checkpoint every row edits
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Four steps of the tiny preset (checkpoints at 2 and 4) on the built-in corpus, on the CPU."""
    out = tmp_path_factory.mktemp("hostile") / "base"
    assert main(["train", "--out", str(out), *FLAGS, "--max-steps", "4"]) == 0
    return out


def copy_run(base: Path, dest: Path) -> Path:
    """A copy of the run whose big files are hard links (edits below replace files, never write
    into them)."""

    def link_big(src: str, dst: str) -> None:
        if src.endswith((".safetensors", ".pt")):
            os.link(src, dst)
        else:
            shutil.copy2(src, dst)

    shutil.copytree(base, dest, copy_function=link_big)
    return dest


@pytest.fixture(scope="module")
def expected(base: Path, tmp_path_factory) -> dict[str, Any]:
    """What each command gives on an untouched copy."""
    d = copy_run(base, tmp_path_factory.mktemp("expected") / "run")
    capsys = _Capture()
    results = {}
    for name in COMMANDS:
        code, out, err = capsys.run(name, d)
        assert code == 0, err
        results[name] = result_of(name, d, out)
    assert len(results["resume"]) == 2 and results["generate"].startswith("The ")
    return results


class _Capture:
    """capsys for a module-scoped fixture: redirect stdout/stderr around one command."""

    def run(self, name: str, d: Path) -> tuple[int, str, str]:
        import contextlib

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = within(120, lambda: main(COMMANDS[name](d)))
        return code, out.getvalue(), err.getvalue()


# ---------------------------------------------------------------------------------------------
# Edits
# ---------------------------------------------------------------------------------------------
def replace_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` as a new file at ``path`` (a hard-linked original stays untouched)."""
    if os.path.lexists(path):
        path.unlink()
    path.write_bytes(data)


def rehash(d: Path, *, files: bool = True, self_hash: bool = True) -> None:
    """What a careful editor does after changing files: update the sizes and SHA-256 recorded in
    checkpoint.json, and its own hash."""
    p = d / STEP / "checkpoint.json"
    meta = json.loads(p.read_text())
    if files:
        for name in list(meta.get("files", {})):
            f = d / STEP / name
            if f.is_file():
                data = f.read_bytes()
                meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if self_hash and "metadata_sha256" in meta:
        meta["metadata_sha256"] = metadata_digest(meta)
    replace_bytes(p, json.dumps(meta).encode())


class Whole:
    """What an edit function returns to replace the whole document (its other return values are
    ignored: edits change the document in place)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def _edited(doc: Any, fn: Callable[[Any], Any]) -> Any:
    new = fn(doc)
    return new.value if isinstance(new, Whole) else doc


def meta(fn: Callable[[dict], Any], *, rehashed: bool = True) -> Callable[[Path], None]:
    """An edit of checkpoint.json: ``fn`` changes the parsed dict in place (or returns a Whole)."""

    def apply(d: Path) -> None:
        p = d / STEP / "checkpoint.json"
        replace_bytes(p, json.dumps(_edited(json.loads(p.read_text()), fn)).encode())
        if rehashed:
            rehash(d)

    return apply


def config(fn: Callable[[dict], Any], *, also_meta: bool = False) -> Callable[[Path], None]:
    """An edit of config.json (hashes updated); ``also_meta`` makes the same edit in model_config."""

    def apply(d: Path) -> None:
        p = d / STEP / "config.json"
        replace_bytes(p, json.dumps(_edited(json.loads(p.read_text()), fn)).encode())
        if also_meta:
            mp = d / STEP / "checkpoint.json"
            m = json.loads(mp.read_text())
            fn(m["model_config"])
            replace_bytes(mp, json.dumps(m).encode())
        rehash(d)

    return apply


def optimizer(fn: Callable[[dict], Any]) -> Callable[[Path], None]:
    """An edit of optimizer.pt (saved back with torch.save, hashes updated)."""

    def apply(d: Path) -> None:
        p = d / STEP / "optimizer.pt"
        buf = io.BytesIO()
        torch.save(_edited(torch.load(p, weights_only=True), fn), buf)
        replace_bytes(p, buf.getvalue())
        rehash(d)

    return apply


def each_state(fn: Callable[[dict], None]) -> Callable[[dict], None]:
    def apply(sd: dict) -> None:
        for s in sd["state"].values():
            fn(s)

    return apply


def first_state(fn: Callable[[dict], None], key: str = "exp_avg") -> Callable[[dict], None]:
    """``fn`` on the first state holding ``key`` of a parameter that is a non-square matrix (so that
    a transposed moment has another shape): an AdamW state (the embedding), or with ``key``
    ``momentum_buffer`` a Muon one."""

    def apply(sd: dict) -> None:
        matrices = (s for s in sd["state"].values() if key in s and s[key].dim() == 2)
        fn(next(s for s in matrices if len(set(s[key].shape)) == 2))

    return apply


def other_model_optimizer(d: Path) -> None:
    """The optimizer state of another model (width 128), which used to resume with exit 0."""
    from attnlab.model import GPT, GPTConfig

    model = GPT(GPTConfig.preset("tiny", context_length=16, emb_dim=128, n_heads=4))
    opt = model.configure_optimizer(lr=1e-3)
    x = torch.randint(0, 256, (2, 16))
    for _ in range(4):
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    replace_bytes(d / STEP / "optimizer.pt", buf.getvalue())
    rehash(d)


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def pickled_optimizer(d: Path) -> None:
    buf = io.BytesIO()
    torch.save({"state": {}, "param_groups": [], "x": _Evil()}, buf)
    replace_bytes(d / STEP / "optimizer.pt", buf.getvalue())
    rehash(d)


def truncated(name: str) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        p = d / STEP / name
        replace_bytes(p, p.read_bytes()[:100])

    return apply


def fifo(rel: str) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        (d / rel).unlink()
        os.mkfifo(d / rel)

    return apply


def dev_zero(rel: str) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        (d / rel).unlink()
        (d / rel).symlink_to("/dev/zero")

    return apply


def latest(value: Any) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        text = value if isinstance(value, str) else json.dumps(value)
        replace_bytes(d / "latest.json", text.encode())

    return apply


def step_everywhere(d: Path) -> None:
    """Step 4 renamed 5 in every file that names it, hashes updated: only the optimizer's step
    counters still say 4."""
    meta(lambda m: (m.update(step=5), m["data"].update(next_step=5)))(d)
    latest_json = json.loads((d / "latest.json").read_text())
    latest(dict(latest_json, step=5))(d)


def nan_weights(d: Path) -> None:
    from safetensors.torch import load_file, save_file

    p = d / STEP / "model.safetensors"
    state = load_file(str(p))
    state["final_norm.weight"] = torch.full_like(state["final_norm.weight"], float("nan"))
    p.unlink()
    save_file(state, str(p), metadata={"format": "pt", "attnlab": "GPT"})
    rehash(d)


def legacy(d: Path) -> None:
    """The format before checkpoint.json hashed itself (version 1), as older attnlab wrote it."""
    meta(lambda m: (m.pop("metadata_sha256"), m.update(version=1)), rehashed=False)(d)


def reformatted(d: Path) -> None:
    """The same JSON, re-indented with the keys in another order: the self-hash is of the content."""
    p = d / STEP / "checkpoint.json"
    m = json.loads(p.read_text())
    replace_bytes(p, json.dumps(dict(reversed(list(m.items()))), indent=7).encode())


def debris(d: Path) -> None:
    """What a SIGKILL during a save leaves: the temporary files of latest.json and metrics.jsonl,
    and a half-assembled step directory."""
    (d / ".latest.json.abc123.tmp").write_text('{"step": 9')
    (d / ".metrics.jsonl.abc123.tmp").write_text("")
    (d / "checkpoints" / ".tmp-step-00000006-xyz").mkdir()
    (d / "checkpoints" / ".tmp-step-00000006-xyz" / "config.json").write_text("{}")


def nested(depth: int) -> Callable[[Path], None]:
    def apply(d: Path) -> None:
        replace_bytes(d / STEP / "checkpoint.json", ("[" * depth + "]" * depth).encode())

    return apply


def huge_checkpoint_json(d: Path) -> None:
    replace_bytes(d / STEP / "checkpoint.json", b'{"format": "' + b"x" * (20 << 20) + b'"}')


ZERO_TORCH_STATE = base64.b64encode(bytes(torch.get_rng_state().numel())).decode()

SELF = "metadata_sha256"
SAME = "same"  # the command works and gives exactly what it gives on the untouched run
ANY = "any"  # exit 0 or one line and exit 2 (e.g. viz of NaN weights shows NaN: visible, not silent)


def err(text: str) -> str:
    """Exit status 2 and one line, the error, containing ``text``."""
    return "error:" + text


def late_err(text: str) -> str:
    """An error that can only show once training runs: exit status 2, the error as the last line
    (after the run's start line), no traceback."""
    return "late:" + text


def row(edit, generate: str, viz: str | None = None, resume: str | None = None):
    """One edit and what each command must do (``viz`` defaults to generate's, ``resume`` too)."""
    viz = generate if viz is None else viz
    return edit, {"generate": generate, "viz": viz, "resume": viz if resume is None else resume}


def opt_row(edit, message: str = "optimizer"):
    """generate and viz never read optimizer.pt: they work; a resume refuses it."""
    return row(edit, SAME, SAME, err(message))


CASES = {
    # checkpoint.json: every entry of the schema, and the file's own hash
    "step+1, not rehashed": row(meta(lambda m: m.update(step=m["step"] + 1), rehashed=False), err("next_step")),
    # A change that keeps every entry plausible: only the file's own hash can tell.
    "lr changed, not rehashed": row(meta(lambda m: m["train_config"].update(lr=0.5), rehashed=False), err(SELF)),
    "val_loss changed, not rehashed": row(meta(lambda m: m.update(val_loss=0.25), rehashed=False), err(SELF)),
    "step+1, rehashed": row(meta(lambda m: m.update(step=m["step"] + 1)), err("next_step")),
    "step+1 in every file": row(step_everywhere, SAME, SAME, err("step counter")),
    "files {}": row(meta(lambda m: m.update(files={})), err("model.safetensors")),
    "no optimizer.pt entry": row(meta(lambda m: m["files"].pop("optimizer.pt")), SAME, SAME, err("no optimizer state")),
    "no optimizer.pt entry, not rehashed": row(
        meta(lambda m: m["files"].pop("optimizer.pt"), rehashed=False), err(SELF)
    ),
    "files lists ../x": row(meta(lambda m: m["files"].update({"../x": m["files"]["config.json"]})), err("../x")),
    "no tokenizer": row(meta(lambda m: m.pop("tokenizer")), err("tokenizer")),
    "char tokenizer of 2": row(meta(lambda m: m.update(tokenizer={"name": "char", "chars": "ab"})), err("vocab")),
    "gpt2 tokenizer bpe_dir 5": row(meta(lambda m: m.update(tokenizer={"name": "gpt2", "bpe_dir": 5})), err("bpe_dir")),
    "tokenizer null": row(meta(lambda m: m.update(tokenizer=None)), err("tokenizer")),
    "rng 'x'": row(meta(lambda m: m.update(rng="x")), err("rng")),
    "rng [{}]": row(meta(lambda m: m.update(rng=[{}])), err("rng")),
    "rng [{torch: AAAA}]": row(meta(lambda m: m.update(rng=[{"torch": "AAAA"}])), err("rng")),
    "rng torch state short": row(meta(lambda m: m["rng"][0].update(torch="AAAA")), err("torch")),
    "rng torch state zeros": row(meta(lambda m: m["rng"][0].update(torch=ZERO_TORCH_STATE)), SAME, SAME, ANY),
    "rng numpy words past 2**32": row(meta(lambda m: m["rng"][0]["numpy"][1].__setitem__(0, 2**40)), err("numpy")),
    "rng python state short": row(meta(lambda m: m["rng"][0]["python"][1].pop()), err("python")),
    "rng of 2 processes, world_size 1": row(meta(lambda m: m["rng"].append(m["rng"][0])), err("world_size")),
    "data []": row(meta(lambda m: m.update(data=[])), err("data")),
    "data next_step 3": row(meta(lambda m: m["data"].update(next_step=3)), err("next_step")),
    "data of other text": row(meta(lambda m: m["data"].update(sha256="0" * 64)), SAME, SAME, err("built-in corpus")),
    "train_config data=5": row(meta(lambda m: m["train_config"].update(data=5)), err("--data")),
    "train_config val_fraction='x'": row(
        meta(lambda m: m["train_config"].update(val_fraction="x")), err("val_fraction")
    ),
    "train_config min_lr_ratio=null": row(
        meta(lambda m: m["train_config"].update(min_lr_ratio=None)), err("min_lr_ratio")
    ),
    "train_config beta2='x'": row(meta(lambda m: m["train_config"].update(beta2="x")), err("beta2")),
    "train_config beta1=1": row(meta(lambda m: m["train_config"].update(beta1=1)), err("beta1")),
    "train_config sample_prompt=5": row(
        meta(lambda m: m["train_config"].update(sample_prompt=5)), err("--sample-prompt")
    ),
    "train_config seed=2**64": row(
        meta(lambda m: (m["train_config"].update(seed=2**64), m["data"].update(seed=2**64))), err("--seed")
    ),
    "train_config batch_size=0": row(meta(lambda m: m["train_config"].update(batch_size=0)), err("--batch-size")),
    "train_config out=''": row(meta(lambda m: m["train_config"].update(out="")), err("--out")),
    "train_config progress='no'": row(meta(lambda m: m["train_config"].update(progress="no")), err("--progress")),
    "train_config device=meta": row(meta(lambda m: m["train_config"].update(device="meta")), SAME, SAME, SAME),
    "train_config context 32": row(meta(lambda m: m["train_config"].update(context_length=32)), err("context_length")),
    "train_config null": row(meta(lambda m: m.update(train_config=None)), err("train_config")),
    "train_config lr=1e300": row(
        meta(lambda m: m["train_config"].update(lr=1e300)), SAME, SAME, late_err("overflows torch.float32")
    ),
    "train_config val_fraction=1e-300": row(
        meta(lambda m: m["train_config"].update(val_fraction=1e-300)), SAME, SAME, err("validation split")
    ),
    "val_loss NaN": row(meta(lambda m: m.update(val_loss=float("nan"))), err("val_loss")),
    "step 10**30": row(meta(lambda m: m.update(step=10**30)), err("step")),
    "version 3": row(meta(lambda m: m.update(version=3)), err("version")),
    "format missing": row(meta(lambda m: m.pop("format")), err("not an attnlab checkpoint")),
    "checkpoint.json [1]": row(meta(lambda m: Whole([1]), rehashed=False), err("not an attnlab checkpoint")),
    "checkpoint.json nested 100000 deep": row(nested(100_000), err("checkpoint.json")),
    "checkpoint.json of 20 MB": row(huge_checkpoint_json, err("checkpoint.json")),
    "checkpoint.json a FIFO": row(fifo(f"{STEP}/checkpoint.json"), err("FIFO")),
    "checkpoint.json -> /dev/zero": row(dev_zero(f"{STEP}/checkpoint.json"), err("not a regular file")),
    "extra user metadata, rehashed": row(meta(lambda m: m.update(note="hello")), SAME),
    "extra user metadata, not rehashed": row(meta(lambda m: m.update(note="hi"), rehashed=False), err(SELF)),
    "format 1 (legacy)": row(legacy, SAME),
    "format 1 (legacy) with a bad rng": row(
        lambda d: (legacy(d), meta(lambda m: m.update(rng="x"), rehashed=False)(d)), err("rng")
    ),
    "re-indented, keys reordered": row(reformatted, SAME),
    # config.json and the weights
    "config.json [1]": row(config(lambda c: Whole([1])), err("config.json")),
    "config.json null": row(config(lambda c: Whole(None)), err("config.json")),
    "config.json n_layers 1000000": row(
        config(lambda c: c.update(n_layers=1_000_000), also_meta=True), err("n_layers")
    ),
    "config.json n_layers 3": row(config(lambda c: c.update(n_layers=3), also_meta=True), err("layers")),
    "config.json n_layers 3, not in model_config": row(config(lambda c: c.update(n_layers=3)), err("differs")),
    "config.json emb_dim 512": row(config(lambda c: c.update(emb_dim=512), also_meta=True), err("does not match")),
    "config.json qkv_bias 'yes'": row(config(lambda c: c.update(qkv_bias="yes"), also_meta=True), err("qkv_bias")),
    "weights truncated": row(truncated("model.safetensors"), err("model.safetensors")),
    "weights NaN, rehashed": row(nan_weights, err("NaN"), ANY, late_err("the training loss became nan")),
    "weights a FIFO": row(fifo(f"{STEP}/model.safetensors"), err("model.safetensors")),
    # optimizer.pt: generate and viz never read it; a resume checks it against the model first
    "optimizer {'foo': 1}": opt_row(optimizer(lambda sd: Whole({"foo": 1}))),
    "optimizer []": opt_row(optimizer(lambda sd: Whole([]))),
    "optimizer a tensor": opt_row(optimizer(lambda sd: Whole(torch.zeros(3)))),
    "optimizer exp_avg of shape (1,)": opt_row(optimizer(each_state(lambda s: s.update(exp_avg=torch.zeros(1))))),
    "optimizer exp_avg_sq of shape (1,)": opt_row(optimizer(each_state(lambda s: s.update(exp_avg_sq=torch.zeros(1))))),
    "optimizer momentum_buffer of shape (1,)": opt_row(
        optimizer(first_state(lambda s: s.update(momentum_buffer=torch.zeros(1)), "momentum_buffer"))
    ),
    "optimizer momentum_buffer transposed": opt_row(
        optimizer(first_state(lambda s: s.update(momentum_buffer=s["momentum_buffer"].T), "momentum_buffer"))
    ),
    "optimizer momentum_buffer NaN": opt_row(
        optimizer(first_state(lambda s: s["momentum_buffer"].fill_(float("nan")), "momentum_buffer"))
    ),
    "optimizer a Muon state as an Adam one": opt_row(
        optimizer(first_state(lambda s: s.update(exp_avg=s.pop("momentum_buffer")), "momentum_buffer"))
    ),
    "optimizer exp_avg transposed": opt_row(optimizer(first_state(lambda s: s.update(exp_avg=s["exp_avg"].T)))),
    "optimizer exp_avg float64": opt_row(optimizer(first_state(lambda s: s.update(exp_avg=s["exp_avg"].double())))),
    "optimizer exp_avg NaN": opt_row(optimizer(first_state(lambda s: s["exp_avg"].fill_(float("nan"))))),
    "optimizer exp_avg_sq negative": opt_row(optimizer(first_state(lambda s: s["exp_avg_sq"].fill_(-1.0)))),
    "optimizer step counter 3": opt_row(optimizer(each_state(lambda s: s["step"].fill_(3.0))), "step counter"),
    "optimizer state of one parameter missing": opt_row(optimizer(lambda sd: sd["state"].pop(0))),
    "optimizer state empty (a fresh AdamW)": opt_row(optimizer(lambda sd: sd.update(state={}))),
    "optimizer a third param group": opt_row(optimizer(lambda sd: sd["param_groups"].append(sd["param_groups"][0]))),
    "optimizer lr 'x'": opt_row(optimizer(lambda sd: sd["param_groups"][0].update(lr="x"))),
    # A setting the run's optimizer does not have (AdamW's amsgrad in a Muon run's groups) is refused;
    # the values of its own settings are not taken (the run's configuration is), see below.
    "optimizer amsgrad on": opt_row(optimizer(lambda sd: sd["param_groups"][0].update(amsgrad=True)), "settings"),
    "optimizer another lr": row(optimizer(lambda sd: sd["param_groups"][0].update(lr=123.0)), SAME),
    "optimizer setting of another kind": opt_row(optimizer(lambda sd: sd["param_groups"][0].update(betas="x"))),
    "optimizer of another model": opt_row(other_model_optimizer),
    "optimizer a pickled object": opt_row(pickled_optimizer, "never unpickles"),
    "optimizer truncated": opt_row(truncated("optimizer.pt")),
    "optimizer a FIFO": opt_row(fifo(f"{STEP}/optimizer.pt")),
    # latest.json
    "latest.json a FIFO": row(fifo("latest.json"), err("FIFO")),
    "latest.json -> /dev/zero": row(dev_zero("latest.json"), err("not a regular file")),
    "latest.json [1]": row(latest([1]), err("latest.json")),
    "latest.json torn": row(latest('{"step": 4, "pa'), err("latest.json")),
    "latest.json path ../x": row(latest({"format": "attnlab-checkpoint", "step": 4, "path": "../x"}), err("outside")),
    "latest.json path /etc": row(latest({"format": "attnlab-checkpoint", "step": 4, "path": "/etc"}), err("outside")),
    "latest.json step 2": row(latest({"format": "attnlab-checkpoint", "step": 2, "path": STEP}), err("latest.json")),
    "latest.json step '4'": row(latest({"format": "attnlab-checkpoint", "step": "4", "path": STEP}), err("step")),
    "latest.json deleted": row(
        lambda d: (d / "latest.json").unlink(), err("not a checkpoint"), None, err("latest.json")
    ),
    # what a kill leaves behind
    "temporary files of a killed save": row(debris, SAME),
}


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo() (POSIX)")
@pytest.mark.parametrize("case", list(CASES))
def test_hostile_edit(case: str, base: Path, expected: dict[str, Any], tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # where a pickle's payload would write pwned.txt
    edit, outcomes = CASES[case]
    for name, want in outcomes.items():
        d = copy_run(base, tmp_path / name)
        edit(d)
        code, out, err_text = run_command(name, d, capsys)
        lines = err_text.strip().splitlines()
        if want == SAME:
            assert code == 0, (name, err_text)
            assert result_of(name, d, out) == expected[name], name
        elif want == ANY:
            assert code == 0 or (code == 2 and len(lines) == 1), (name, code, err_text)
        elif want.startswith("late:"):
            assert code == 2 and "Traceback" not in err_text, (name, code, err_text)
            assert lines[-1].startswith("attnlab train: error:") and want.removeprefix("late:") in lines[-1], lines
        else:
            assert code == 2, (name, code, err_text)
            assert len(lines) == 1 and lines[0].startswith(f"attnlab {COMMANDS[name](d)[0]}: error:"), (name, lines)
            assert want.removeprefix("error:") in lines[0], (name, lines[0])
    assert not (tmp_path / "pwned.txt").exists()


def test_debris_is_cleared_by_a_resume(base: Path, tmp_path: Path, capsys) -> None:
    d = copy_run(base, tmp_path / "run")
    debris(d)
    assert run_command("resume", d, capsys)[0] == 0
    left = [p.name for p in d.iterdir()] + [p.name for p in (d / "checkpoints").iterdir()]
    assert not [n for n in left if n.endswith(".tmp") or n.startswith(".tmp-")], left


def test_debris_is_cleared_by_a_resume_that_trains_nothing(base: Path, tmp_path: Path, capsys) -> None:
    # (a killed save's step directory, as large as the model, stayed until the next save)
    d = copy_run(base, tmp_path / "run")
    debris(d)
    argv = ["train", "--out", str(d), "--resume", "--max-steps", "4", "--no-progress", "--device", "cpu"]
    assert main(argv) == 0
    assert "nothing to train" in capsys.readouterr().err
    assert not list((d / "checkpoints").glob(".tmp-*"))


def test_a_legacy_checkpoint_resumes_and_is_written_in_the_new_format(base: Path, tmp_path: Path, capsys) -> None:
    d = copy_run(base, tmp_path / "run")
    legacy(d)
    assert run_command("resume", d, capsys)[0] == 0
    new = json.loads((d / "checkpoints" / "step-00000006" / "checkpoint.json").read_text())
    assert new["version"] == 2 and new["metadata_sha256"] == metadata_digest(new)


# ---------------------------------------------------------------------------------------------
# Fuzzing: random edits of a real checkpoint.json / config.json
# ---------------------------------------------------------------------------------------------
def _paths(obj: Any, prefix: tuple = (), depth: int = 0) -> list[tuple]:
    """JSON paths into ``obj`` (dict keys, and the first and last few entries of lists)."""
    out = [prefix]
    if depth >= 4:
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k), depth + 1)
    elif isinstance(obj, list):
        idx = sorted({*range(min(3, len(obj))), *range(max(0, len(obj) - 2), len(obj))})
        for i in idx:
            out += _paths(obj[i], (*prefix, i), depth + 1)
    return out


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, -1, 2**31, 2**63, 2**64, 10**30])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["", "x", "byte", "char", "gpt2", "attnlab-checkpoint", "tiny", "cpu", "meta", "../x", "AAAA"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6,
)


@st.composite
def edits(draw: st.DrawFn, base_meta: dict, base_config: dict) -> tuple[str, tuple, str, Any, bool]:
    """(file, path, action, value, rehash): set or delete the entry at ``path`` of checkpoint.json
    or config.json, then (or not) update the hashes."""
    file = draw(st.sampled_from(["checkpoint.json", "checkpoint.json", "config.json"]))
    obj = base_meta if file == "checkpoint.json" else base_config
    path = draw(st.sampled_from(_paths(obj)))
    action = draw(st.sampled_from(["set", "set", "delete"])) if path else "set"
    value = draw(JSON_VALUES) if action == "set" else None
    return file, path, action, value, draw(st.booleans())


def apply_edit(d: Path, file: str, path: tuple, action: str, value: Any, rehashed: bool) -> None:
    p = d / STEP / file
    doc = json.loads(p.read_text())
    if not path:
        doc = value
    else:
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        if action == "delete":
            del parent[path[-1]]
        else:
            parent[path[-1]] = value
    replace_bytes(p, json.dumps(doc).encode())
    if rehashed:
        with_hash = json.loads((d / STEP / "checkpoint.json").read_text())
        if isinstance(with_hash, dict) and isinstance(with_hash.get("files"), dict):
            rehash(d)


@pytest.fixture(scope="module")
def base_docs(base: Path) -> tuple[dict, dict]:
    return (
        json.loads((base / STEP / "checkpoint.json").read_text()),
        json.loads((base / STEP / "config.json").read_text()),
    )


def test_fuzzed_checkpoint_edits_end_cleanly(base: Path, base_docs, tmp_path_factory, capsys) -> None:
    """Hypothesis picks an entry anywhere in checkpoint.json or config.json, sets it to a random
    JSON value (or deletes it), and updates the hashes or not. Each command must return exit 0 or 2
    (2: one line on stderr; after a resumed run's own log lines when the setting only fails once
    training runs), within its deadline, without an exception escaping."""
    base_meta, base_config = base_docs

    @settings(
        max_examples=int(os.environ.get("ATTNLAB_FUZZ_EXAMPLES", "40")),
        deadline=None,  # each example runs three commands; `within` bounds each
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        database=None,
    )
    @given(edit=edits(base_meta, base_config))
    def check(edit) -> None:
        root = tmp_path_factory.mktemp("fuzz")
        for name in COMMANDS:
            d = copy_run(base, root / name)
            apply_edit(d, *edit)
            # Settings that only make a resumed run long (a sample of 2**31 tokens, an evaluation
            # of 10**18 batches, torch.compile) are the user's to choose: keep the run short.
            flags = ["--sample-tokens", "0", "--eval-batches", "1", "--no-compile"] if name == "resume" else []
            code, _, err_text = run_command(name, d, capsys, flags)
            lines = err_text.strip().splitlines()
            assert code in (0, 2), (edit, name, code, err_text)
            event(f"{name} exit {code}")  # pytest --hypothesis-show-statistics: how the edits ended
            if code == 2 and name != "resume":
                assert len(lines) == 1 and lines[0].startswith("attnlab "), (edit, name, lines)
            elif code == 2:  # a setting that only fails once training runs (lr 1e300: a NaN loss) ends
                # the run's log with one error line; before it, only the run's own log lines
                assert lines[-1].startswith("attnlab train: error:") and "Traceback" not in err_text, (edit, lines)
                assert all(x.startswith(("attnlab train: ", "step ", "note: ")) for x in lines[:-1]), (edit, lines)
        shutil.rmtree(root)

    check()


# ---------------------------------------------------------------------------------------------
# Only a separate process can show these
# ---------------------------------------------------------------------------------------------
def attnlab(*args: str, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attnlab", *args], capture_output=True, text=True, env=ENV, timeout=300, **kw
    )


def test_a_crafted_optimizer_state_is_one_line_not_a_segfault(base: Path, tmp_path: Path) -> None:
    """exp_avg / exp_avg_sq of shape (1,) load under weights_only=True, and the fused AdamW kernel
    then read past their end: exit 139 (SIGSEGV) or 134 (munmap_chunk(): invalid pointer)."""
    d = copy_run(base, tmp_path / "run")
    optimizer(each_state(lambda s: s.update(exp_avg=torch.zeros(1), exp_avg_sq=torch.zeros(1))))(d)
    r = attnlab("train", "--out", str(d), "--resume", "--max-steps", "6", "--no-progress", "--device", "cpu")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and "exp_avg" in lines[0] and "optimizer.pt" in lines[0], lines


def test_two_runs_on_one_out_the_second_is_refused_naming_the_first(base: Path, tmp_path: Path) -> None:
    """The second `attnlab train` on a directory in use is refused at once with the holder's pid;
    the first one goes on and finishes, and metrics.jsonl reads as its run alone."""
    out = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "train", "--out", str(out), *FLAGS, "--max-steps", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file() and time.monotonic() < deadline:  # training has begun
            time.sleep(0.1)
        second = attnlab("train", "--out", str(out), *FLAGS, "--max-steps", "60", "--resume")
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert "in use by another attnlab train" in lines[0] and f"process {first.pid}" in lines[0], lines
        assert first.wait(timeout=300) == 0, first.stderr.read()
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGKILL)
            first.wait()
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 61))
    # Once the first run is over, the directory is free again.
    assert attnlab("train", "--out", str(out), *FLAGS, "--max-steps", "61", "--resume").returncode == 0
