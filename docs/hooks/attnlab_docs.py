"""MkDocs hooks of the learners' guide: what the pages show is computed when the site builds.

Markers in the Markdown pages are replaced by attnlab's own output, so nothing is pasted and
nothing goes stale:

* ``<!-- lesson: NAME -->``: the printed lesson (``attnlab explain --lesson NAME``), folded;
* ``<!-- lesson-list: KEY -->``: ``attnlab explain --list --tutorial KEY``;
* ``<!-- cli-help: COMMAND -->``: ``attnlab COMMAND --help`` (``<!-- cli-help: -->``: ``attnlab --help``);
* ``<!-- viz-text -->``: ``attnlab viz`` without ``--out`` (the weights of the demo as text).

An unknown marker or lesson fails the build. The page ``viewer-demo.html`` is the demo viewer
that ``attnlab viz --out viewer-demo.html`` writes. Lessons that tokenize as the tutorials do
read GPT-2's BPE files from ``$ATTNLAB_GPT2_BPE_DIR`` (without it they say what to pass).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from pathlib import Path

# The guide documents the checkout it is built from: its src/ comes first on the path.
SRC = Path(__file__).resolve().parents[2] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

MARKER = re.compile(r"^<!-- (?P<kind>lesson|lesson-list|cli-help|viz-text)(?::[ ]*(?P<arg>[\w-]*))? -->[ ]*$", re.M)
ANY_MARKER = re.compile(r"<!-- (lesson|lesson-list|cli-help|viz-text)\b[^>]*-->")


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line if line.strip() else "" for line in text.rstrip("\n").split("\n"))


def _fenced(text: str) -> str:
    return "```text\n" + text.rstrip("\n") + "\n```"


def _lesson(name: str) -> str:
    from attnlab.tools.explain import run_lesson

    buf = io.StringIO()
    run_lesson(name, file=buf, interactive=False)
    title = f'"Output of attnlab explain --lesson {name} (generated when this page was built)"'
    return f"??? example {title}\n\n" + _indent(_fenced(buf.getvalue())) + "\n"


def _lesson_list(key: str) -> str:
    from attnlab import cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = cli.main(["explain", "--list", "--tutorial", key])
    if status != 0:
        raise ValueError(f"attnlab explain --list --tutorial {key} failed")
    return _fenced(buf.getvalue())


def _cli_help(command: str) -> str:
    import importlib

    from attnlab.cli import COMMANDS, build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: the same width on every machine
    try:
        parser, subparsers = build_parser()
        if not command:
            return _fenced(parser.format_help())
        if command not in COMMANDS:
            raise ValueError(f"unknown attnlab command {command!r} in a cli-help marker")
        importlib.import_module(COMMANDS[command][0]).add_arguments(subparsers[command])
        return _fenced(subparsers[command].format_help())
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def _viz_text() -> str:
    from attnlab.tools.viz import demo_view, format_text

    return _fenced(format_text(demo_view()))


def render_markers(markdown: str) -> str:
    """``markdown`` with every marker replaced by what it stands for (see the module docstring)."""

    def replace(m: re.Match[str]) -> str:
        kind, arg = m.group("kind"), m.group("arg") or ""
        if kind == "lesson":
            return _lesson(arg)
        if kind == "lesson-list":
            return _lesson_list(arg)
        if kind == "cli-help":
            return _cli_help(arg)
        return _viz_text()

    out = MARKER.sub(replace, markdown)
    left = ANY_MARKER.search(out)
    if left:
        raise ValueError(f"malformed marker {left.group(0)!r} (a marker is a line of its own)")
    return out


def on_page_markdown(markdown: str, page, config, files) -> str:  # MkDocs' signature
    return render_markers(markdown)


def on_files(files, config):  # MkDocs' signature
    """Add ``viewer-demo.html``: the demo page of ``attnlab viz --out``, rendered now."""
    from mkdocs.structure.files import File

    from attnlab.tools.viz import demo_view, render_html

    files.append(File.generated(config, "viewer-demo.html", content=render_html(demo_view())))
    return files
