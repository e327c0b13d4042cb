"""The ``attnlab`` command line: one subcommand per module, each loaded only when used.

A subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``. Errors a user can
fix (a missing file, a bad value, a missing optional package) end with one line on stderr and
exit status 2; set ``ATTNLAB_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from attnlab.errors import UserError

# name -> (module, one-line help). Modules are imported lazily so `attnlab --help` stays instant.
COMMANDS: dict[str, tuple[str, str]] = {
    "explain": ("attnlab.explain", "walk through the tutorials' attention steps, tensor by tensor"),
    "train": ("attnlab.train", "train a GPT on a text file (default: the built-in corpus)"),
    "generate": ("attnlab.generate_cli", "generate text from a trained checkpoint"),
    "viz": ("attnlab.viz", "draw attention heatmaps (PNG) or an offline HTML viewer"),
    "bench": ("attnlab.bench", "run the benchmarks and write a report directory"),
    "info": ("attnlab.info", "show versions, devices and the fused kernels available"),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and one (still empty) sub-parser per subcommand."""
    from attnlab import __version__

    parser = argparse.ArgumentParser(
        prog="attnlab",
        description="Self-attention to learn from, measure and build real models on.",
    )
    parser.add_argument("--version", action="version", version=f"attnlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers = {}
    for name, (module_name, help_text) in COMMANDS.items():
        subparsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        subparsers[name].set_defaults(_module=module_name)
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subparsers = build_parser()
    # Two-stage parse: only the chosen subcommand's module is imported, to add its own flags.
    if argv and argv[0] in COMMANDS:
        importlib.import_module(COMMANDS[argv[0]][0]).add_arguments(subparsers[argv[0]])
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(importlib.import_module(args._module).run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `attnlab ... | head` closed the pipe: not an error. Point stdout at devnull so the
        # interpreter's final flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (UserError, ValueError, OSError, FloatingPointError, ImportError) as exc:
        if os.environ.get("ATTNLAB_DEBUG"):
            raise
        message = str(exc)
        if isinstance(exc, ImportError) and exc.name:
            message += " (install attnlab's extras: pip install 'attnlab[train,viz]')"
        print(f"attnlab {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
