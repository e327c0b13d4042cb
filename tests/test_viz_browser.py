"""The ``attnlab viz`` HTML page in a real headless browser (Debian's chromium, via Selenium).

The page must load with no console errors and no network requests, hovering a token must change
what is highlighted (by the weights the model computed), and choosing another head or clicking a
thumbnail must change the view. Skipped with a reason when chromium, chromedriver or selenium is
missing (``.ci/run`` installs them: ``apt-get install -y chromium chromium-driver`` and
``pip install selenium``).

Set ``ATTNLAB_SCREENSHOT_DIR`` to keep screenshots of the pages for a human to look at.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from attnlab.model import GPT, GPTConfig
from attnlab.tokenizers import ByteTokenizer
from attnlab.tools.viz import demo_view, model_view, save_html, token_label
from browser import (  # skips this module when there is no browser
    ActionChains,
    By,
    Select,
    WebDriverWait,
    start_chromium,
)

pytestmark = pytest.mark.slow  # a browser each: the fast suite (-m 'not slow') leaves them to CI

INJECTION = '</script><script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> é'


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    d = start_chromium(tmp_path_factory.mktemp("chromium-profile"), page_load_timeout=30)
    yield d
    d.quit()


@pytest.fixture(scope="module")
def gpt_page(tmp_path_factory):
    """A tiny random GPT (3 layers x 4 heads) on a prompt that tries to inject HTML."""
    torch.manual_seed(0)
    # Large random weights so heads differ visibly (GPT-2's 0.02 init makes attention near uniform).
    model = GPT(GPTConfig(vocab_size=256, context_length=96, emb_dim=32, n_heads=4, n_layers=3, drop_rate=0.0))
    with torch.no_grad():
        for block in model.trf_blocks:
            block.att.W_query.weight.normal_(0, 0.6)
            block.att.W_key.weight.normal_(0, 0.6)
    tok = ByteTokenizer()
    ids = tok.encode(INJECTION)
    tokens = [tok.decode([i]) for i in ids]
    view = model_view(model, ids, tokens, title=INJECTION, text=INJECTION)
    path = save_html(view, tmp_path_factory.mktemp("gpt") / "gpt.html")
    return path, view


@pytest.fixture(scope="module")
def demo_page(tmp_path_factory):
    view = demo_view()
    return save_html(view, tmp_path_factory.mktemp("demo") / "demo.html"), view


def _open(driver, path: Path) -> None:
    driver.get_log("browser")  # drop earlier pages' messages
    driver.get(path.resolve().as_uri())
    WebDriverWait(driver, 20).until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")


def _errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def _tokens(driver) -> list[dict]:
    return driver.execute_script(
        """return Array.from(document.querySelectorAll('#tokens .tok')).map(t => ({
             weight: t.dataset.weight, bg: getComputedStyle(t).backgroundColor,
             active: t.classList.contains('active'), text: t.firstChild.textContent}));"""
    )


def _matrix(driver) -> list[str]:
    return driver.execute_script(
        "return Array.from(document.querySelectorAll('#matrix .cell')).map(c => c.dataset.weight);"
    )


def _screenshot(driver, name: str, tmp_path: Path) -> Path:
    out = Path(os.environ.get("ATTNLAB_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    assert driver.save_screenshot(str(path)), "chromium returned no screenshot"
    assert path.stat().st_size > 10_000  # a blank page compresses to far less
    return path


def test_pages_load_without_errors_or_network(driver, demo_page, gpt_page, tmp_path):
    for path, _ in (demo_page, gpt_page):
        _open(driver, path)
        assert _errors(driver) == []
        # Nothing fetched: the page is one file (the CSP would also block and log any request).
        resources = driver.execute_script("return performance.getEntriesByType('resource').length")
        assert resources == 0
        _screenshot(driver, f"{path.stem}.png", tmp_path)


def test_hover_highlights_where_the_token_attends(driver, demo_page, tmp_path):
    path, view = demo_page
    _open(driver, path)
    Select(driver.find_element(By.ID, "layer-select")).select_by_index(2)  # CausalAttention (seed 789)
    weights = view.layers[2].weights[0]  # (6, 6)
    before = _tokens(driver)
    assert all(t["weight"] == "" and not t["active"] for t in before)
    assert len({t["bg"] for t in before}) == 1  # nothing highlighted yet

    tokens = driver.find_elements(By.CSS_SELECTOR, "#tokens .tok")
    for q in (3, 5):
        ActionChains(driver).move_to_element(tokens[q]).perform()
        after = _tokens(driver)
        assert [t["active"] for t in after] == [j == q for j in range(6)]
        got = [float(t["weight"]) for t in after]
        assert got == pytest.approx(weights[q].tolist(), abs=1e-4)
        # The highlight follows the weights: future tokens (weight 0) stay unhighlighted and the
        # most-attended token gets the strongest colour.
        assert all(after[j]["bg"] == before[j]["bg"] for j in range(q + 1, 6))
        assert after[0]["bg"] != before[0]["bg"]
    _screenshot(driver, "demo-hover.png", tmp_path)
    readout = driver.find_element(By.ID, "readout").text
    assert "attends most to token 0" in readout
    assert _errors(driver) == []


def test_direction_toggle_and_keyboard_focus(driver, demo_page):
    path, view = demo_page
    _open(driver, path)
    Select(driver.find_element(By.ID, "layer-select")).select_by_index(4)  # MultiHeadAttention
    driver.find_element(By.CSS_SELECTOR, 'input[name="direction"][value="col"]').click()
    driver.execute_script("document.querySelectorAll('#tokens .tok')[1].focus()")
    got = [float(t["weight"]) for t in _tokens(driver)]
    assert got == pytest.approx(view.layers[4].weights[0][:, 1].tolist(), abs=1e-4)  # column 1: who looks at it


def test_picking_a_head_or_a_thumbnail_changes_the_view(driver, gpt_page, tmp_path):
    path, view = gpt_page
    _open(driver, path)
    T = len(view.tokens)
    w00 = _matrix(driver)
    assert [float(v) for v in w00] == pytest.approx(view.layers[0].weights[0].flatten().tolist(), abs=1e-4)
    colours = "return Array.from(document.querySelectorAll('#matrix .cell'), c => getComputedStyle(c).backgroundColor)"
    colours_before = driver.execute_script(colours)
    assert len(set(colours_before)) > 10  # a heatmap, not a flat colour

    Select(driver.find_element(By.ID, "head-select")).select_by_value("2")
    w02 = _matrix(driver)
    assert w02 != w00
    assert [float(v) for v in w02] == pytest.approx(view.layers[0].weights[2].flatten().tolist(), abs=1e-4)
    assert driver.execute_script(colours) != colours_before
    assert driver.find_element(By.ID, "matrix-title").text == "layer 0 · head 2"

    thumb = driver.find_element(By.CSS_SELECTOR, '.thumb[data-layer="2"][data-head="1"]')
    thumb.click()
    assert Select(driver.find_element(By.ID, "layer-select")).first_selected_option.text == "layer 2"
    assert Select(driver.find_element(By.ID, "head-select")).first_selected_option.text == "head 1"
    assert "selected" in thumb.get_attribute("class")
    assert len(driver.find_elements(By.CSS_SELECTOR, ".thumb.selected")) == 1
    assert [float(v) for v in _matrix(driver)] == pytest.approx(view.layers[2].weights[1].flatten().tolist(), abs=1e-4)

    # Hover a matrix cell: its query row lights up the token strip.
    cell = driver.find_element(By.CSS_SELECTOR, f'#matrix .cell[data-q="{T - 1}"][data-k="0"]')
    ActionChains(driver).move_to_element(cell).perform()
    got = [float(t["weight"]) for t in _tokens(driver)]
    assert got == pytest.approx(view.layers[2].weights[1][T - 1].tolist(), abs=1e-4)
    assert _errors(driver) == []
    _screenshot(driver, "gpt-hover.png", tmp_path)


def test_prompt_text_cannot_inject_html(driver, gpt_page):
    path, view = gpt_page
    _open(driver, path)
    assert driver.execute_script("return window.__pwned") is None
    assert driver.execute_script("return document.images.length") == 0
    assert len(driver.find_elements(By.TAG_NAME, "script")) == 2  # the data block and the viewer
    assert driver.execute_script("return document.getElementById('title').textContent") == INJECTION
    labels = [t["text"] for t in _tokens(driver)]
    assert labels == [token_label(t) for t in view.tokens]
    assert _errors(driver) == []
