"""The ``attnlab`` entry point: lazy imports, subcommand usage errors, Ctrl-C at any moment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from attnlab.cli import main


def test_import_and_help_do_not_load_torch():
    code = (
        "import sys, contextlib, attnlab, attnlab.cli\n"
        "with contextlib.suppress(SystemExit):\n"
        "    attnlab.cli.main(['--help'])\n"
        "print('torch loaded:', 'torch' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("torch loaded: False"), r.stdout + r.stderr
    # ...while every public name is still there, loaded on first use.
    import attnlab

    assert (
        attnlab.MultiHeadAttention.__module__ == "attnlab.attention"
        and attnlab.functional.__name__ == "attnlab.functional"
    )
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        attnlab.nope


@pytest.mark.parametrize(
    ("argv", "usage"),
    [(["info", "extra"], "usage: attnlab info --help"), (["bench", "--nope"], "usage: attnlab bench")],
)
def test_unknown_arguments_show_the_subcommands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and usage in err and f"unrecognized arguments: {argv[1]}" in err
    assert len(err.splitlines()) == 1  # one line, as every other error (argparse printed its usage block)


@pytest.mark.parametrize(
    "argv", [["train", "--batch-size", "abc"], ["train", "--precision", "fp8"], ["sae", "train", "--tokens", "x"]]
)
def test_a_flags_type_or_choice_error_is_one_line(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and f"attnlab {argv[0]}" in err, err


@pytest.mark.slow
def test_ctrl_c_while_torch_loads_is_one_line_and_130(subprocess_env):
    """Ctrl-C during the imports used to print tracebacks, abort from C++ or break numpy's import."""
    interrupted = 0
    for delay in (0.2, 0.5, 0.9, 1.4):
        proc = subprocess.Popen(
            [sys.executable, "-m", "attnlab", "generate", "--checkpoint", os.devnull + "-missing"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=subprocess_env,
        )
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert "Traceback" not in err and "Error" not in err, (delay, err)
        # 130 when interrupted. If main() had already finished ("checkpoint not found", status 2), the
        # signal may still land during interpreter shutdown, which then ends by SIGINT (-2).
        finished = "checkpoint not found" in err and proc.returncode in (2, -signal.SIGINT)
        assert proc.returncode == 130 or finished, (delay, proc.returncode, err)
        assert proc.returncode != 130 or err.strip() == "attnlab generate: interrupted", (delay, err)
        interrupted += proc.returncode == 130
    assert interrupted, "every run finished before its Ctrl-C: nothing was tested"


def test_threads_are_the_commands_and_set_back_after_it(capsys):
    # On a busy 2-core machine two torch threads made generate 3-7x slower; only serve and bench could say.
    import argparse

    import torch

    from attnlab import cli

    seen = []

    class Command:
        @staticmethod
        def run(args):
            seen.append(torch.get_num_threads())
            return 0

    before = torch.get_num_threads()
    assert cli._run(Command, argparse.Namespace(command="generate", threads=1)) == 0
    assert seen == [1] and torch.get_num_threads() == before
    commands = [["generate"], ["chat"], ["eval"], ["patch"], ["circuit"], ["inspect"], ["viz"], ["train"]]
    commands += [["sae", "train"], ["sae", "eval"], ["sae", "dashboard"]]  # (train and sae had none)
    for command in commands:
        with pytest.raises(SystemExit) as exc:
            cli.main([*command, "--threads", "0"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.splitlines()) == 1 and "--threads" in err, (command, err)


@pytest.mark.parametrize(("command", "flag"), [("viz", "--seed"), ("inspect", "--role-seed")])
def test_a_seed_out_of_range_is_one_line_naming_the_flag(command, flag, capsys):
    # (it printed torch's "Overflow when unpacking long long", naming no flag)
    from attnlab import cli

    for value in (str(2**64), "-1"):
        with pytest.raises(SystemExit) as exc:
            cli.main([command, "--demo", flag, value])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.splitlines()) == 1 and f"argument {flag}: expected a seed" in err, err


H = "99999999999999999999999999999"


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["generate", "--model", "m.gguf", "--threads", "2147483648"], "--threads"),  # (torch's overflow, unnamed)
        (["viz", "--model", "m.gguf", "--prompt", "hi", "--out", "x.html", "--generate", H], "--generate"),  # (hung)
        (["circuit", "--model", "m.gguf", "--clean", "a", "--corrupted", "b", "--answers", "a", "b",
          "--ig-steps", "1000000000"], "--ig-steps"),  # (hung)
        (["sae", "dashboard", "--model", "m.gguf", "--sae", "s", "--out", "x.html", "--top", H], "--top"),
        (["sae", "train", "--model", "m.gguf", "--hook", "h", "--out", "o", "--width", H], "--width"),
        (["sae", "train", "--model", "m.gguf", "--hook", "h", "--out", "o", "--seed", H], "--seed"),
    ],
)  # fmt: skip
def test_a_count_past_what_any_machine_takes_is_one_line_naming_the_flag(argv, flag, capsys):
    # (tracebacks from torch's "Overflow when unpacking long long" or its allocator, or a run that never ended)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and f"argument {flag}: expected" in err, err
