"""``attnlab generate``: streams the checkpoint's continuation, decoded by the checkpoint's tokenizer."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.tokenizers import get_tokenizer
from attnlab.training import TrainConfig, Trainer
from attnlab.training.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread_module")  # one torch thread (conftest.py)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, one_thread_module) -> Path:
    """A few steps of the tiny preset: enough for the byte statistics, which is all we need."""
    out = tmp_path_factory.mktemp("gen")
    Trainer(
        TrainConfig(
            out=str(out),
            context_length=32,
            batch_size=8,
            max_steps=15,
            eval_every=15,
            eval_batches=1,
            sample_tokens=0,
            progress=False,
            lr=3e-3,
            warmup_steps=2,
        )
    ).fit()
    return out


class Recorder(io.StringIO):
    """A stdout that remembers what was written between flushes."""

    def __init__(self) -> None:
        super().__init__()
        self.flushed: list[str] = []
        self._mark = 0

    def flush(self) -> None:
        super().flush()
        text = self.getvalue()
        self.flushed.append(text[self._mark :])
        self._mark = len(text)


def generate(monkeypatch, *args: str) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(sys, "stdout", rec)
    assert main(["generate", *args]) == 0
    return rec


@pytest.mark.slow
def test_greedy_output_is_the_models_greedy_continuation(checkpoint: Path, monkeypatch) -> None:
    rec = generate(
        monkeypatch, "--checkpoint", str(checkpoint), "--prompt", "def ", "--max-new-tokens", "24", "--temperature", "0"
    )
    ck = load_checkpoint(checkpoint, load_optimizer=False)
    tok = get_tokenizer("byte")
    ids = torch.tensor([tok.encode("def ")])
    expected = tok.decode(ck.model.generate(ids, 24, temperature=0.0, use_cache=False)[0].tolist())
    assert rec.getvalue() == expected + "\n"
    # Streamed: the prompt, then (at least) one flush per generated piece, not one at the end.
    pieces = [p for p in rec.flushed if p]
    assert pieces[0] == "def " and len(pieces) >= 10


def test_seeded_sampling_is_reproducible_and_the_seed_matters(checkpoint: Path, monkeypatch) -> None:
    base = ["--checkpoint", str(checkpoint), "--prompt", "The ", "--max-new-tokens", "40", "--top-k", "20"]
    a = generate(monkeypatch, *base, "--seed", "1").getvalue()
    b = generate(monkeypatch, *base, "--seed", "1").getvalue()
    c = generate(monkeypatch, *base, "--seed", "2", "--top-p", "0.9").getvalue()
    assert a == b and a != c and a.startswith("The ")


def test_step_directory_works_too(checkpoint: Path, monkeypatch) -> None:
    step_dir = checkpoint / "checkpoints" / "step-00000015"
    a = generate(
        monkeypatch, "--checkpoint", str(step_dir), "--prompt", "x", "--max-new-tokens", "5", "--temperature", "0"
    )
    b = generate(
        monkeypatch, "--checkpoint", str(checkpoint), "--prompt", "x", "--max-new-tokens", "5", "--temperature", "0"
    )
    assert a.getvalue() == b.getvalue()


@pytest.mark.slow
def test_errors_are_one_line(checkpoint: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "latest.json").write_text("{")
    cases = {
        "missing": (["--checkpoint", str(tmp_path / "nope")], "nope"),
        "corrupt": (["--checkpoint", str(bad)], "latest.json"),
        "top-p": (["--checkpoint", str(checkpoint), "--top-p", "1.5"], "--top-p"),
        "temperature": (["--checkpoint", str(checkpoint), "--temperature", "-1"], "--temperature"),
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "attnlab", "generate", "--prompt", "a", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name, (flags, _) in cases.items()
    }
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (name, err)
        assert lines[0].startswith("attnlab generate: error:") and cases[name][1] in lines[0], (name, err)
        assert "Traceback" not in err


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--seed", str(2**64)], "--seed"),
        (["--seed", "-1"], "--seed"),
        (["--device", "meta"], "--device"),
        (["--top-k", "0"], "--top-k"),
        (["--top-p", "0"], "--top-p"),
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--max-new-tokens", "-1"], "--max-new-tokens"),
        (["--max-new-tokens", "10000000000"], "--max-new-tokens"),  # used to preallocate 80 GB
        (["--max-new-tokens", "99999999999999999999"], "--max-new-tokens"),  # used to be an overflow TypeError
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(checkpoint: Path, capsys, flags: list[str], flag: str) -> None:
    assert main(["generate", "--checkpoint", str(checkpoint), *flags]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"attnlab generate: error: {flag} "), lines
    assert captured.out == ""  # refused before the prompt was echoed


def test_the_largest_seed_is_taken(checkpoint: Path, monkeypatch) -> None:
    base = ["--checkpoint", str(checkpoint), "--prompt", "a", "--max-new-tokens", "5"]
    top = generate(monkeypatch, *base, "--seed", str(2**64 - 1)).getvalue()
    assert top == generate(monkeypatch, *base, "--seed", str(2**64 - 1)).getvalue() and top.startswith("a")


@pytest.mark.parametrize("flags", [["--temperature", "1e-300"], ["--top-p", "1e-300", "--seed", "1"]])
def test_settings_too_small_for_float32_pick_the_likeliest_token(
    checkpoint: Path, monkeypatch, flags: list[str]
) -> None:
    """A temperature or nucleus that float32 rounds to 0 still means "the likeliest token": the greedy
    text, not a traceback (before the fix: a RuntimeError in torch.multinomial on the CPU, a device-side
    assert on CUDA that broke every later CUDA call of the process)."""
    base = ["--checkpoint", str(checkpoint), "--prompt", "def ", "--max-new-tokens", "12"]
    greedy = generate(monkeypatch, *base, "--temperature", "0").getvalue()
    assert generate(monkeypatch, *base, *flags).getvalue() == greedy


def test_an_ascii_only_stdout_gets_escapes_not_an_abort(checkpoint: Path, monkeypatch) -> None:
    """With an ASCII-only stdout (PYTHONIOENCODING=ascii, a C locale) generate used to abort at
    the first non-ASCII character; now such characters are printed as backslash escapes."""
    raw = io.BytesIO()
    ascii_out = io.TextIOWrapper(raw, encoding="ascii")  # errors="strict", as a real ASCII terminal
    monkeypatch.setattr(sys, "stdout", ascii_out)
    base = ["generate", "--checkpoint", str(checkpoint), "--max-new-tokens", "30", "--seed", "0"]
    assert main([*base, "--prompt", "café → "]) == 0
    ascii_out.flush()
    printed = raw.getvalue().decode("ascii")
    assert printed.startswith("caf\\xe9 \\u2192 ")
    # The same characters as a UTF-8 stdout gets, escaped.
    utf8 = generate(monkeypatch, *base[1:], "--prompt", "café → ").getvalue()
    assert printed == utf8.encode("ascii", "backslashreplace").decode("ascii")
