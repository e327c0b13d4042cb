"""The ``attnlab`` command line: one subcommand per module, each loaded only when used.

A subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``. Errors a user can
fix (a missing file, a bad value, a missing optional package) end with one line on stderr and
exit status 2; set ``ATTNLAB_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import signal
import sys
import threading
from types import ModuleType
from typing import Any, NoReturn

from attnlab.errors import UserError

# name -> (module, one-line help). Modules are imported lazily so `attnlab --help` stays instant.
COMMANDS: dict[str, tuple[str, str]] = {
    "explain": ("attnlab.cli.explain", "walk through the tutorials' attention steps, tensor by tensor"),
    "train": ("attnlab.cli.train", "train a GPT on a text file (default: the built-in corpus)"),
    "eval": ("attnlab.cli.eval", "measure a model's loss, perplexity and bits per byte on a text file"),
    "generate": ("attnlab.cli.generate", "generate text from a model (GGUF, Hugging Face, a checkpoint)"),
    "chat": ("attnlab.cli.chat", "chat with an instruct model in the terminal (its chat template, streamed)"),
    "viz": ("attnlab.cli.viz", "draw attention heatmaps (PNG) or an offline HTML viewer"),
    "inspect": ("attnlab.cli.inspect", "look inside a model on a prompt: head roles, logit lens, rollout, ablation"),
    "patch": ("attnlab.cli.patch", "activation patching: which heads and positions carry the answer"),
    "circuit": ("attnlab.cli.circuit", "edge attribution (EAP, EAP-IG): a circuit of heads and MLPs, its faithfulness"),
    "serve": ("attnlab.cli.serve", "the inspector as a live local web app: type, generate, ablate"),
    "bench": ("attnlab.cli.bench", "run the benchmarks and write a report directory"),
    "info": ("attnlab.cli.info", "show versions, devices and the fused kernels available, or describe a model"),
    "sae": ("attnlab.cli.sae", "sparse autoencoders and transcoders: train, measure (SAELens's measures), inspect"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are one line (exit 2) like every other error of the command
    line: argparse prints its whole usage block first, which is what ``--help`` is for."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and one (still empty) sub-parser per subcommand."""
    from attnlab import __version__

    parser = OneLineParser(
        prog="attnlab", description="Self-attention to learn from, measure and build real models on."
    )
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    subparsers = {}
    for name, (module_name, help_text) in COMMANDS.items():
        subparsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        subparsers[name].set_defaults(_module=module_name)
    return parser, subparsers


def _import_holding_ctrl_c(name: str) -> ModuleType:
    """Import torch and a subcommand's module with Ctrl-C held back until they are loaded.

    A KeyboardInterrupt raised inside torch's import can abort the process from C++ or leave numpy
    half-imported (odd AttributeErrors later); held back, it becomes an exit (one line, 130) right after.
    """
    if threading.current_thread() is not threading.main_thread():  # only it may set signal handlers
        return importlib.import_module(name)
    interrupted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    try:
        importlib.import_module("torch")  # every subcommand needs it, some only inside run()
        module = importlib.import_module(name)
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        raise KeyboardInterrupt
    return module


def _run(module: Any, args: argparse.Namespace) -> int:
    """``module.run(args)``, with ``--threads`` torch threads where the command has that option (set
    back after: main() may run inside a larger program, or a test session)."""
    threads = getattr(args, "threads", None) if args.command not in ("serve", "bench") else None  # (their own)
    if threads is None:
        return int(module.run(args) or 0)
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return int(module.run(args) or 0)
    finally:
        torch.set_num_threads(before)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser, subparsers = build_parser()  # (inside: a Ctrl-C this early ends as any other)
        # Two-stage parse: only the chosen subcommand's module is imported, to add its own flags.
        if argv and argv[0] in COMMANDS:
            _import_holding_ctrl_c(COMMANDS[argv[0]][0]).add_arguments(subparsers[argv[0]])
        args, extra = parser.parse_known_args(argv)
        if extra:  # say it with the subcommand's usage, not the top-level one
            (subparsers[args.command] if args.command else parser).error(f"unrecognized arguments: {' '.join(extra)}")
        if args.command is None:
            parser.print_help()
            return 0
        return _run(importlib.import_module(args._module), args)
    except KeyboardInterrupt:
        command = argv[0] if argv and argv[0] in COMMANDS else None
        if command != "serve":  # (Ctrl-C is how a server is stopped: nothing to say)
            with contextlib.suppress(Exception):  # (one line, never a traceback: stderr may be gone too)
                print(f"attnlab{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `attnlab ... | head` closed the pipe: not an error. Point stdout at devnull so the
        # interpreter's final flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UserError, ValueError, OSError, FloatingPointError, ImportError, OverflowError, MemoryError) as exc:
        return _one_line_error(argv, exc)
    except (RuntimeError, TypeError) as exc:  # (torch's words for a number past int64, or for memory no machine has)
        if not any(s in str(exc) for s in ("Overflow when unpacking", "can't allocate memory", "out of memory")):
            raise
        return _one_line_error(argv, exc)


def _one_line_error(argv: list[str], exc: BaseException) -> int:
    """The error as one line on stderr, ``attnlab CMD: error: ...``; exit status 2."""
    if os.environ.get("ATTNLAB_DEBUG"):
        raise exc
    message = str(exc)
    if isinstance(exc, (OverflowError, MemoryError, RuntimeError, TypeError)):  # (torch's words, said as meant)
        first = message.splitlines()[0] if message else ""
        message = f"a setting is too large for this machine ({type(exc).__name__}: {first})"
    if isinstance(exc, ImportError) and exc.name:
        message += " (install attnlab's extras: pip install 'attnlab[train,viz]')"
    where = f"attnlab {argv[0]}" if argv and argv[0] in COMMANDS else "attnlab"
    print(f"{where}: error: {message}", file=sys.stderr)
    return 2


def entry_point() -> None:
    """The ``attnlab`` console script and ``python -m attnlab``: run, then exit with main()'s status.

    Once main() has returned, a Ctrl-C has nothing left to interrupt: it is ignored, so that one
    landing while the interpreter shuts down cannot print a traceback after the command's output.
    """
    code = main()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(code)


if __name__ == "__main__":  # pragma: no cover
    entry_point()
