"""The lessons of ``attnlab explain``, by name, and running them.

A lesson is a function ``(walk) -> {name: tensor}`` registered with :func:`lesson`, which records
its name on the command line, a one-line summary, the headline of its title and the tutorial (and,
optionally, the section) it follows. Lessons run in the order they were registered: the order of
the modules that define them (imported by :mod:`attnlab.tools.explain`), then the order inside
each module. A new set of lessons is a new module of ``@lesson`` functions, imported there.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

import torch
from torch import Tensor

from attnlab.tools.explain.walk import Walk, print_options

__all__ = [
    "GPT_GUIDE",
    "IMPLEMENT",
    "LESSONS",
    "ONE_HEAD",
    "REVIEW",
    "SIMPLE",
    "Lesson",
    "check_lesson_names",
    "lesson",
    "lesson_names",
    "run_lesson",
]

# The tutorials, by title (the project's text never names them by anything else).
SIMPLE = '"A simple self-attention mechanism"'
IMPLEMENT = '"Implement the Self-Attention Mechanism in PyTorch"'
GPT_GUIDE = '"Implementing GPT-Style Attention: A Step-by-Step Guide with PyTorch"'
REVIEW = 'the attention-review exercises ("Attention Review")'
ONE_HEAD = '"Self attention for a single individual head"'

LessonFunc = Callable[[Walk], dict[str, Tensor]]


@dataclass(frozen=True)
class Lesson:
    """A lesson: its name on the command line, a one-line summary, the headline of its title, the
    tutorial it follows (one of the titles above), optionally the tutorial's section, and the
    function that prints its steps and returns its key tensors."""

    name: str
    summary: str
    headline: str
    tutorial: str
    func: LessonFunc
    section: str = ""


LESSONS: dict[str, Lesson] = {}


def lesson(
    name: str, summary: str, *, headline: str, tutorial: str, section: str = ""
) -> Callable[[LessonFunc], LessonFunc]:
    """Register the decorated function as lesson ``name`` (after those registered before it)."""

    def register(func: LessonFunc) -> LessonFunc:
        if name in LESSONS:
            raise ValueError(f"a lesson named {name!r} is already registered ({LESSONS[name].func.__qualname__})")
        LESSONS[name] = Lesson(name, summary, headline, tutorial, func, section)
        return func

    return register


def lesson_names() -> list[str]:
    """The lessons' names, in teaching order."""
    return list(LESSONS)


def check_lesson_names(names: list[str]) -> list[str]:
    """``names`` if every one is a lesson; otherwise a ValueError naming the unknown ones and the valid ones."""
    unknown = [n for n in names if n not in LESSONS]
    if unknown:
        quoted = ", ".join(repr(n) for n in unknown)
        raise ValueError(f"unknown lesson {quoted}; choose from: {', '.join(LESSONS)}")
    return names


def run_lesson(name: str, file: TextIO | None = None) -> dict[str, Tensor]:
    """Print lesson ``name`` to ``file`` (default stdout) and return its key tensors.

    The random-number state, torch's print options and autograd mode are restored afterwards.
    Raises ValueError for an unknown name, listing the valid ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    check_lesson_names([name])
    entry, walk = LESSONS[name], Walk(sys.stdout if file is None else file)
    with torch.random.fork_rng(devices=[]), torch.no_grad(), print_options(precision=4):
        walk.title(entry.name, entry.headline, entry.tutorial)
        return entry.func(walk)
