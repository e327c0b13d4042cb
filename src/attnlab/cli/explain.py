"""``attnlab explain``: print the tutorials' lessons (see :mod:`attnlab.tools.explain`)."""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

from attnlab.tools.explain import (
    LESSONS,
    TUTORIALS,
    WIDTH,
    Lesson,
    check_lesson_names,
    check_tutorial_name,
    lesson_names,
    run_lesson,
    run_tutorial,
    tutorial_lessons,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``attnlab explain``."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--lesson",
        action="append",
        metavar="NAME",
        help="run only this lesson (repeat the flag, or separate names with commas); default: all",
    )
    which.add_argument(
        "--tutorial",
        metavar="NAME",
        help=f"follow one tutorial: its lessons in its order, under its section titles ({', '.join(TUTORIALS)})",
    )
    parser.add_argument(
        "--list", action="store_true", help="list the lessons, by tutorial and section (with --tutorial: its lessons)"
    )
    parser.add_argument(
        "--bpe-dir",
        metavar="DIR",
        help="directory with GPT-2's encoder.json and vocab.bpe, for the lessons that tokenize as the "
        "tutorials do (default: $ATTNLAB_GPT2_BPE_DIR, else tiktoken's download)",
    )


def _wrapped(text: str, indent: str) -> None:
    # Continued lines are indented 3 columns more: never at a lesson name's column (4).
    for line in textwrap.wrap(text, width=WIDTH, initial_indent=indent, subsequent_indent=indent + "   "):
        print(line)


def _print_lessons(lessons: list[Lesson], indent: str) -> None:
    """Lessons under their section titles (a title once per run of lessons in that section)."""
    width = max(len(n) for n in LESSONS) + 2
    section = None
    for entry in lessons:
        if entry.section != section:
            section = entry.section
            if section:
                _wrapped(f"{section}:", indent)
        pad = indent + ("  " if section else "")
        lines = textwrap.wrap(entry.summary, width=WIDTH - len(pad) - width) or [""]
        print(f"{pad}{entry.name:<{width}}{lines[0]}")
        for line in lines[1:]:
            print(" " * (len(pad) + width) + line)


def _list(tutorial: str | None) -> None:
    """``--list``: the lessons grouped by tutorial, each tutorial's in its own order."""
    chosen = [check_tutorial_name(tutorial)] if tutorial else list(TUTORIALS.values())
    groups = [(f"--tutorial {t.key}: {t.title}", tutorial_lessons(t.key)) for t in chosen]
    if not tutorial:  # then the lessons of no tutorial, under their source
        titles = {t.title for t in TUTORIALS.values()}
        others: dict[str, list[Lesson]] = {}
        for entry in LESSONS.values():
            if entry.tutorial not in titles:
                others.setdefault(entry.tutorial, []).append(entry)
        groups += others.items()
    for i, (heading, lessons) in enumerate(groups):
        if i:
            print()
        _wrapped(heading, "")
        _print_lessons(lessons, "  ")


def _check_bpe_dir(bpe_dir: str) -> None:
    d = Path(bpe_dir).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(
            f"--bpe-dir {bpe_dir}: {'not a directory' if d.exists() else 'no such directory'}; "
            "expected a directory with GPT-2's encoder.json and vocab.bpe"
        )
    missing = [f for f in ("encoder.json", "vocab.bpe") if not (d / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"--bpe-dir {bpe_dir}: no {' or '.join(missing)} in it; expected GPT-2's encoder.json and vocab.bpe"
        )


def run(args: argparse.Namespace) -> int:
    """Run ``attnlab explain``: the chosen lessons (default all, in order), a tutorial, or ``--list``."""
    tutorial = getattr(args, "tutorial", None)
    bpe_dir = getattr(args, "bpe_dir", None)
    if tutorial is not None:
        check_tutorial_name(tutorial)  # a bad name is one line on stderr, before anything prints
    if bpe_dir is not None:  # a wrong directory is a mistake to fix, not a reason to fall back to bytes
        _check_bpe_dir(bpe_dir)
    if args.lesson and getattr(args, "list", False):  # (--lesson would go unread)
        raise ValueError("--list lists every lesson (with --tutorial, that tutorial's): it takes no --lesson")
    if getattr(args, "list", False):
        _list(tutorial)
        return 0
    names = [n.strip().lower() for arg in (args.lesson or []) for n in arg.split(",") if n.strip()]
    if args.lesson and not names:  # --lesson "" must not mean "every lesson"
        raise ValueError(f"--lesson needs a lesson name (see --list), got {args.lesson[0]!r}")
    names = check_lesson_names(names or lesson_names())  # every name checked before anything prints
    if tutorial is not None:
        run_tutorial(tutorial, bpe_dir=bpe_dir)
    else:
        for i, name in enumerate(names):
            if i:
                print()
            run_lesson(name, bpe_dir=bpe_dir)
    sys.stdout.flush()  # `attnlab explain | head`: a closed pipe raises here, and main() ends quietly
    return 0
