"""``attnlab explain``: print the tutorials' lessons (see :mod:`attnlab.tools.explain`)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from attnlab.tools.explain import LESSONS, WIDTH, check_lesson_names, lesson_names, run_lesson


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``attnlab explain``."""
    parser.add_argument(
        "--lesson",
        action="append",
        metavar="NAME",
        help="run only this lesson (repeat the flag, or separate names with commas); default: all",
    )
    parser.add_argument("--list", action="store_true", help="list the lessons with one line on each")


def run(args: argparse.Namespace) -> int:
    """Run ``attnlab explain``: the chosen lessons (default all, in order), or ``--list``."""
    if getattr(args, "list", False):
        width = max(len(n) for n in LESSONS) + 2
        for lesson in LESSONS.values():
            lines = textwrap.wrap(lesson.summary, width=WIDTH - width) or [""]
            print(f"{lesson.name:<{width}}{lines[0]}")
            for line in lines[1:]:
                print(" " * width + line)
        return 0
    names = [n.strip() for arg in (args.lesson or []) for n in arg.split(",") if n.strip()]
    if args.lesson and not names:  # --lesson "" must not mean "every lesson"
        raise ValueError(f"--lesson needs a lesson name (see --list), got {args.lesson[0]!r}")
    names = check_lesson_names(names or lesson_names())  # every name checked before anything prints
    try:
        for i, name in enumerate(names):
            if i:
                print()
            run_lesson(name)
        sys.stdout.flush()
    except BrokenPipeError:
        # `attnlab explain | head`: the reader left. Point stdout at devnull so that Python's
        # final flush does not raise again, and end quietly.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    return 0
