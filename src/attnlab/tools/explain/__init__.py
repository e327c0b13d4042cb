"""``attnlab explain``: the tutorials' attention steps, computed with attnlab, tensor by tensor.

Each lesson is a function that prints its steps (every tensor with its shape and one line on what
happened) and returns its key tensors, so the tests can compare them with the numbers the
tutorials print. The numbers are the tutorials' own: same inputs, same ``torch.manual_seed``
calls, same order of parameter creation. Where a tutorial's code is wrong, the lesson says so in
a note marked "Tutorial bug" and shows the right result.

The tutorials:

* "A simple self-attention mechanism"
* "Implement the Self-Attention Mechanism in PyTorch"
* "Implementing GPT-Style Attention: A Step-by-Step Guide with PyTorch"
* the attention-review exercises ("Concept Questions" / "Attention Review")
* "Self attention for a single individual head"

Use from Python::

    from attnlab.tools.explain import run_lesson, run_tutorial
    tensors = run_lesson("causal")        # prints, and returns {"weights": ..., ...}
    run_tutorial("one-head")              # one tutorial's lessons, in its order, under its sections

Output fits an 80-column terminal. Lessons run on the CPU (the tutorials' numbers are CPU
numbers), without autograd, and leave the caller's random-number state and print options as they
were.

The modules: :mod:`~attnlab.tools.explain.walk` (the printer), :mod:`~attnlab.tools.explain.registry`
(:data:`LESSONS`, :data:`TUTORIALS`, the ``@lesson`` decorator, :func:`run_lesson`,
:func:`run_tutorial`), :mod:`~attnlab.tools.explain.lessons` (the first lessons) and
:mod:`~attnlab.tools.explain.lessons_tutorials` (the steps of each tutorial the first lessons
leave out). A module of new lessons is imported below, after the modules whose lessons come
before its own.
"""

# Importing a module of lessons registers them; they run in the order of these imports.
from attnlab.tools.explain.lessons import gpt2_parameter_counts

# isort: split
from attnlab.tools.explain.lessons_tutorials import CONCEPT_QUESTIONS

# isort: split
from attnlab.tools.explain.lessons_modern import MODERN_LESSONS

# isort: split
from attnlab.tools.explain.registry import (
    LESSONS,
    TUTORIALS,
    Lesson,
    Tutorial,
    check_lesson_names,
    check_tutorial_name,
    lesson,
    lesson_names,
    run_lesson,
    run_tutorial,
    tutorial_lessons,
)
from attnlab.tools.explain.walk import WIDTH, Walk

__all__ = [
    "CONCEPT_QUESTIONS",
    "LESSONS",
    "MODERN_LESSONS",
    "TUTORIALS",
    "WIDTH",
    "Lesson",
    "Tutorial",
    "Walk",
    "check_lesson_names",
    "check_tutorial_name",
    "gpt2_parameter_counts",
    "lesson",
    "lesson_names",
    "run_lesson",
    "run_tutorial",
    "tutorial_lessons",
]
