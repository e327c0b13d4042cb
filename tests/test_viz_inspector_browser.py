"""The inspector page in a real headless browser (Debian's chromium, via Selenium): every view renders
with no console error and no network request, the controls change what is shown, and the numbers
shown are the library's (the tutorials' steps, next-token probabilities under temperature/top-k/top-p,
rollout, the logit lens, head roles, generation). The scale test opens a 512-token page of a
GPT-2-small-sized model and times loading and repainting.

Set ``ATTNLAB_SCREENSHOT_DIR`` to keep screenshots of the views.
"""

from __future__ import annotations

import html
import os
from pathlib import Path

import pytest
import torch

from attnlab.generation import SamplingConfig
from attnlab.interpret import (
    HEAD_KINDS,
    act_name,
    activation_patching,
    all_head_scores,
    inspector_data,
    logit_diff,
    logit_lens,
    notebook_html,
    notebook_patching_html,
    patching_data,
    render_page,
    rollout,
    run_with_cache,
    trace,
    trace_generation,
)
from attnlab.interpret.inspector import TEMPERATURES
from attnlab.model import GPT, GPTConfig
from attnlab.tools.viz import demo_view, render_html
from browser import (  # skips this module when there is no browser
    ActionChains,
    By,
    Select,
    WebDriverWait,
    start_chromium,
)
from tutorial_numbers import CONTEXT, MASKED_SCORES, SCORES, WEIGHTS

pytestmark = pytest.mark.slow  # a browser each: the fast suite (-m 'not slow') leaves them to CI

VIEWS = ["heads", "steps", "next", "rollout", "lens", "roles", "generation"]


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    d = start_chromium(tmp_path_factory.mktemp("chromium-profile"), page_load_timeout=60)
    yield d
    d.quit()


def sharp_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=200, context_length=48, emb_dim=32, n_heads=4, n_layers=3, drop_rate=0.0)
    model = GPT(GPTConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():
        for block in model.trf_blocks:
            block.att.W_query.weight.normal_(0, 0.5)
            block.att.W_key.weight.normal_(0, 0.5)
        model.tok_emb.weight.normal_(0, 0.5)  # varied next-token distributions
    return model


class Letters:
    """A tokenizer of the model's 200 ids: printable labels, so the page shows words."""

    def decode(self, ids):
        return "".join(f"t{i} " for i in ids)


@pytest.fixture(scope="module")
def gpt_page(tmp_path_factory):
    model = sharp_model()
    idx = torch.tensor([[5, 17, 3, 99, 5, 17, 3, 42, 7, 150, 5, 17, 8, 21]])
    tr = trace(model, idx, stages=True, tokenizer=Letters())
    gen = trace_generation(model, idx, 5, temperature=0.9, top_k=30, generator=torch.Generator().manual_seed(3))
    data = inspector_data(tr, generation=gen, model_name="sharp")
    path = tmp_path_factory.mktemp("gpt") / "inspector.html"
    path.write_text(render_page(data), encoding="utf-8")
    return path, model, tr, gen


@pytest.fixture(scope="module")
def demo_page(tmp_path_factory):
    path = tmp_path_factory.mktemp("demo") / "demo.html"
    path.write_text(render_html(demo_view()), encoding="utf-8")
    return path


def _open(driver, path: Path) -> None:
    driver.get_log("browser")
    driver.get(path.resolve().as_uri())
    WebDriverWait(driver, 60).until(
        lambda d: d.execute_script("return document.body.dataset.ready || document.body.dataset.error")
    )
    assert driver.execute_script("return document.body.dataset.error") is None


def _errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def _show(driver, view: str) -> None:
    driver.find_element(By.CSS_SELECTOR, f'#tabs .tab[data-view="{view}"]').click()
    assert driver.find_element(By.ID, f"view-{view}").is_displayed()


def _screenshot(driver, name: str, tmp_path: Path) -> None:
    out = Path(os.environ.get("ATTNLAB_SCREENSHOT_DIR", tmp_path))
    out.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(out / name))


def _js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def _set(driver, element_id: str, value) -> None:
    """Move a slider / type into a number box as a user would (the input event fires)."""
    driver.execute_script(
        "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event('input', {bubbles: true}));",
        element_id,
        str(value),
    )


def _hover_token(driver, i: int) -> None:
    tok = driver.find_elements(By.CSS_SELECTOR, "#tokens .tok")[i]
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", tok)
    ActionChains(driver).move_to_element(tok).perform()


# --------------------------------------------------------------------------------------------
def test_every_view_renders_without_errors_or_network(driver, gpt_page, demo_page, tmp_path):
    path = gpt_page[0]
    _open(driver, path)
    for view in VIEWS:
        _show(driver, view)
        box = driver.find_element(By.ID, f"view-{view}")
        assert len(box.text) > 40, view  # something was drawn
        _screenshot(driver, f"inspector-{view}.png", tmp_path)
    assert _errors(driver) == []
    assert _js(driver, "return performance.getEntriesByType('resource').length") == 0
    # The tutorials' example has only the views of attention modules: the others are disabled.
    _open(driver, demo_page)
    disabled = [t.get_attribute("data-view") for t in driver.find_elements(By.CSS_SELECTOR, "#tabs .tab:disabled")]
    assert disabled == ["next", "rollout", "lens", "roles", "generation", "patching", "circuit", "features"]
    _show(driver, "steps")
    assert _errors(driver) == []


def _cells(driver, step: str) -> list[str]:
    return _js(
        driver,
        f"return Array.from(document.querySelectorAll('[data-step=\"{step}\"] .cell'), c => c.dataset.value);",
    )


def _floats(values: list[str]) -> torch.Tensor:
    return torch.tensor([float("-inf") if v == "-inf" else float(v) for v in values])


def test_the_tutorials_steps_show_the_tutorials_numbers(driver, demo_page, tmp_path):
    _open(driver, demo_page)
    _show(driver, "steps")  # row 0: softmax(x x^T), the first step of "A simple self-attention mechanism"
    assert "attn_scores = inputs @ inputs.T" in driver.find_element(By.ID, "steps").text
    torch.testing.assert_close(_floats(_cells(driver, "scores")), torch.tensor(SCORES).flatten(), atol=1e-4, rtol=0)
    torch.testing.assert_close(_floats(_cells(driver, "weights")), torch.tensor(WEIGHTS).flatten(), atol=1e-4, rtol=0)
    torch.testing.assert_close(
        _floats(_cells(driver, "head_outputs")), torch.tensor(CONTEXT).flatten(), atol=1e-4, rtol=0
    )
    Select(driver.find_element(By.ID, "layer-select")).select_by_index(2)  # CausalAttention, seed 789
    masked = torch.tensor(MASKED_SCORES).flatten()  # the tutorial masks the unscaled scores
    scores = _floats(_cells(driver, "scores"))
    kept = masked != float("-inf")
    torch.testing.assert_close(scores[kept], masked[kept], atol=1e-4, rtol=0)
    got = _floats(_cells(driver, "masked"))
    assert torch.equal(got == float("-inf"), ~kept)
    torch.testing.assert_close(got[kept], scores[kept] * 2**-0.5, atol=1e-4, rtol=0)
    # Hovering a cell explains it in the tutorial's terms.
    cell = driver.find_element(By.CSS_SELECTOR, '[data-step="masked"] .cell[data-q="1"][data-k="4"]')
    ActionChains(driver).move_to_element(cell).perform()
    assert "-inf: query 1 may not attend to key 4" in driver.find_element(By.ID, "steps-readout").text
    _screenshot(driver, "demo-steps.png", tmp_path)
    assert _errors(driver) == []


def test_steps_of_a_model_head_match_the_trace(driver, gpt_page):
    path, _, tr, _ = gpt_page
    _open(driver, path)
    _show(driver, "steps")
    Select(driver.find_element(By.ID, "layer-select")).select_by_index(2)
    Select(driver.find_element(By.ID, "head-select")).select_by_index(3)
    st = tr.steps(2)
    for name in ("scores", "scaled", "masked", "weights"):
        want = st[name][0, 3].flatten()
        got = _floats(_cells(driver, name))
        finite = want != float("-inf")
        assert torch.equal(got == float("-inf"), ~finite), name
        torch.testing.assert_close(got[finite], want[finite], atol=6e-5, rtol=0)
    torch.testing.assert_close(
        _floats(_cells(driver, "head_outputs")), tr.head_outputs[2, 0, 3].flatten(), atol=6e-5, rtol=0
    )
    torch.testing.assert_close(_floats(_cells(driver, "q")), tr.q[2, 0, 3].flatten(), atol=6e-5, rtol=0)


def _next_rows(driver) -> list[tuple[int, float]]:
    rows = _js(
        driver,
        "return Array.from(document.querySelectorAll('#next-table tr[data-id]'), r => [r.dataset.id, r.dataset.prob]);",
    )
    return [(int(i), float(p)) for i, p in rows]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, None, None), (0.7, 5, None), (1.5, None, 0.3), (0.8, 8, 0.9), (0, None, None)],
)
def test_next_token_probabilities_follow_the_controls_as_sampling_does(driver, gpt_page, temperature, top_k, top_p):
    path, _, tr, _ = gpt_page
    _open(driver, path)
    _show(driver, "next")
    position = 6
    driver.find_elements(By.CSS_SELECTOR, "#tokens .tok")[position].click()  # pin the position
    grid = [0.0, *TEMPERATURES]
    _set(driver, "temperature", grid.index(temperature))
    _set(driver, "top-k", top_k or 0)
    _set(driver, "top-p", top_p or 1)
    rows = _next_rows(driver)
    want = SamplingConfig(temperature, top_k, top_p).probabilities(tr.logits[0, position][None])[0]
    top = torch.topk(want, len(rows))
    assert [i for i, _ in rows][: int((top.values > 0).sum())] == top.indices[top.values > 0].tolist()
    got = torch.tensor([p for _, p in rows])
    torch.testing.assert_close(got, want[[i for i, _ in rows]], atol=1e-5, rtol=1e-4)
    assert "Next token after position 6" in driver.find_element(By.ID, "next-title").text
    assert "Approximate" not in driver.find_element(By.ID, "next-note").text
    assert _errors(driver) == []


def test_rollout_view_shows_the_rollout_row_of_the_hovered_token(driver, gpt_page):
    path, _, tr, _ = gpt_page
    _open(driver, path)
    _show(driver, "rollout")
    Select(driver.find_element(By.ID, "rollout-fusion")).select_by_value("max")
    _hover_token(driver, 9)
    got = [
        float(w)
        for w in _js(driver, "return Array.from(document.querySelectorAll('#tokens .tok'), t => t.dataset.weight)")
    ]
    torch.testing.assert_close(torch.tensor(got), rollout(tr, head_fusion="max")[0, 9], atol=1e-4, rtol=0)
    cells = _js(driver, "return Array.from(document.querySelectorAll('#rollout .cell'), c => c.dataset.value)")
    torch.testing.assert_close(_floats(cells), rollout(tr, head_fusion="max")[0].flatten(), atol=1e-4, rtol=0)


def test_logit_lens_view_shows_the_lens(driver, gpt_page):
    path, model, tr, _ = gpt_page
    _open(driver, path)
    _show(driver, "lens")
    _hover_token(driver, 4)
    lens = logit_lens(model, tr, k=5)
    cells = _js(
        driver,
        "return Array.from(document.querySelectorAll('#lens-table td.cell'),"
        " c => [c.dataset.layer, c.dataset.pos, c.dataset.id, c.dataset.prob]);",
    )
    assert len(cells) == 4 * 13  # embeddings + 3 layers, 13 positions around 4
    for layer, pos, i, p in cells:
        layer, pos = int(layer), int(pos)
        assert int(i) == int(lens.tokens[layer, 0, pos, 0])
        assert float(p) == pytest.approx(float(lens.probs[layer, 0, pos, 0]), abs=1e-6)
    assert "around position 4" in driver.find_element(By.ID, "lens-title").text


def test_head_roles_grid_and_clicking_a_head_selects_it(driver, gpt_page):
    path, model, tr, _ = gpt_page
    _open(driver, path)
    _show(driver, "roles")
    roles = all_head_scores(model)
    for kind in HEAD_KINDS:
        Select(driver.find_element(By.ID, "role-kind")).select_by_value(kind)
        got = _js(driver, "return Array.from(document.querySelectorAll('#roles-grid .rcell'), c => c.dataset.score)")
        torch.testing.assert_close(torch.tensor([float(x) for x in got]), roles[kind].flatten(), atol=1e-6, rtol=0)
    driver.find_element(By.CSS_SELECTOR, '#roles-grid .rcell[data-layer="1"][data-head="2"]').click()
    assert driver.find_element(By.ID, "view-heads").is_displayed()
    assert driver.find_element(By.ID, "matrix-title").text == "layer 1 · head 2"
    cells = _js(driver, "return Array.from(document.querySelectorAll('#matrix .cell'), c => c.dataset.weight)")
    torch.testing.assert_close(_floats(cells), tr.weights[1, 0, 2].flatten(), atol=1e-4, rtol=0)


def test_generation_plays_back_each_tokens_attention_and_candidates(driver, gpt_page):
    path, _, _, gen = gpt_page
    _open(driver, path)
    Select(driver.find_element(By.ID, "layer-select")).select_by_index(1)
    Select(driver.find_element(By.ID, "head-select")).select_by_index(2)
    _show(driver, "generation")
    for s, step in enumerate(gen.steps):
        if s:
            driver.find_element(By.ID, "gen-next").click()
        assert driver.find_element(By.ID, "gen-step").text.startswith(f"token {s + 1} of 5")
        rows = _js(
            driver,
            "return Array.from(document.querySelectorAll('#gen-candidates tr[data-id]'),"
            " r => [r.dataset.id, r.dataset.prob, r.className]);",
        )
        assert [int(i) for i, _, _ in rows] == step.candidates[0].tolist()
        torch.testing.assert_close(torch.tensor([float(p) for _, p, _ in rows]), step.probs[0], atol=1e-6, rtol=0)
        assert [c for _, _, c in rows].count("chosen") == 1
        weights = _js(
            driver,
            "return Array.from(document.querySelectorAll('#gen-text .tok'), t => t.dataset.weight || null);",
        )
        assert len(weights) == step.position + 1 and weights[-1] is None  # the new token, not yet attended
        got = torch.tensor([float(w) for w in weights[step.key_start : step.position]])
        torch.testing.assert_close(got, step.weights[1, 0, 2], atol=1e-4, rtol=0)
    driver.find_element(By.ID, "gen-mean").click()
    got = torch.tensor([float(w) for w in _js(driver, "return Array.from(document.querySelectorAll('#gen-text .tok'),"
                                                      " t => t.dataset.weight).filter(w => w);")])  # fmt: skip
    torch.testing.assert_close(got, gen.steps[-1].weights[1, 0].mean(0), atol=1e-4, rtol=0)
    driver.find_element(By.ID, "gen-prev").click()
    assert driver.find_element(By.ID, "gen-step").text.startswith("token 4 of 5")
    assert _errors(driver) == []


def test_a_trace_shows_the_same_page_inside_a_notebook_iframe(driver, gpt_page, tmp_path):
    _, _, tr, _ = gpt_page
    cell = tr._repr_html_()
    assert cell == notebook_html(inspector_data(tr))
    host = tmp_path / "notebook.html"
    host.write_text(f"<!DOCTYPE html><html><body><h1>a notebook</h1>{cell}</body></html>", encoding="utf-8")
    driver.get_log("browser")
    driver.get(host.as_uri())
    frame = driver.find_element(By.CSS_SELECTOR, "iframe.attnlab-inspector")
    assert html.unescape(frame.get_attribute("srcdoc")).startswith("<!DOCTYPE html>")
    driver.switch_to.frame(frame)
    try:
        WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.body.dataset.ready"))
        cells = _js(driver, "return Array.from(document.querySelectorAll('#matrix .cell'), c => c.dataset.weight)")
        torch.testing.assert_close(_floats(cells), tr.weights[0, 0, 0].flatten(), atol=1e-4, rtol=0)
        assert _js(driver, "return performance.getEntriesByType('resource').length") == 0
    finally:
        driver.switch_to.default_content()
    assert _errors(driver) == []


# --------------------------------------------------------------------------------------------
# The patching view: precomputed on the page (attnlab viz --corrupted --answers), or alone in Jupyter
# --------------------------------------------------------------------------------------------
CLEAN_IDS = [5, 17, 3, 99, 5, 17, 3, 42, 7, 150, 5, 17]
CORRUPTED_IDS = [5, 17, 3, 99, 5, 18, 3, 42, 7, 150, 5, 17]


@pytest.fixture(scope="module")
def patched(tmp_path_factory):
    model = sharp_model(1)
    clean, corrupted = torch.tensor(CLEAN_IDS), torch.tensor(CORRUPTED_IDS)
    section = patching_data(model, clean, corrupted, (3, 42), tokenizer=Letters())
    data = inspector_data(trace(model, clean[None], stages=True, tokenizer=Letters()), model_name="sharp")
    data["patching"] = section
    path = tmp_path_factory.mktemp("patching") / "page.html"
    path.write_text(render_page(data), encoding="utf-8")
    names = [act_name("pattern", i) for i in range(3)]
    patterns = [
        torch.stack([c[n][0] for n in names])
        for c in (run_with_cache(model, i[None], names)[1] for i in (clean, corrupted))
    ]
    metric = logit_diff(3, 42)
    want = {site: activation_patching(model, clean, corrupted, metric, site) for site in ("head_out", "resid_pre")}
    return path, section, want, patterns


def _check_patching_view(driver, want, patterns) -> None:
    """The heatmaps hold activation_patching's values; a click on a head shows its pattern on both prompts."""
    WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.body.dataset.patchPattern"))
    for site, values in want.items():
        got = _js(driver, f"return Array.from(document.querySelectorAll('#patch-{site} .cell'), c => c.dataset.value)")
        torch.testing.assert_close(_floats(got).reshape(values.shape), values, atol=1e-5, rtol=0)
    cols = _js(driver, "return Array.from(document.querySelectorAll('#patch-resid_pre .clab'), c => c.textContent)")
    assert cols[5] == "t17␣→t18␣" and cols[4] == "t5␣"  # the position where the prompts differ, marked
    for layer, head in ((2, 3), (0, 1)):
        driver.find_element(By.CSS_SELECTOR, f'#patch-head_out .cell[data-q="{layer}"][data-k="{head}"]').click()
        WebDriverWait(driver, 10).until(
            lambda d, key=f"{layer}.{head}": d.execute_script("return document.body.dataset.patchPattern") == key
        )
        for which, pattern in zip(("clean", "corrupted"), patterns, strict=True):
            got = _js(
                driver,
                f"return Array.from(document.querySelectorAll('#patch-pattern-{which} .cell'), c => c.dataset.weight)",
            )
            torch.testing.assert_close(_floats(got), pattern[layer, head].flatten(), atol=1e-4, rtol=0)


def test_the_inspector_page_carries_a_static_patching_view(driver, patched, tmp_path):
    path, section, want, patterns = patched
    _open(driver, path)
    _show(driver, "patching")
    _check_patching_view(driver, want, patterns)
    box = driver.find_element(By.ID, "patch-corrupted")
    assert box.get_attribute("disabled") == "true" and box.get_attribute("value") == section["corrupted"]["text"]
    assert not driver.find_element(By.ID, "patch-run").is_displayed()
    assert "This page is static" in driver.find_element(By.ID, "view-patching").text
    _screenshot(driver, "inspector-patching.png", tmp_path)
    assert _errors(driver) == []
    assert _js(driver, "return performance.getEntriesByType('resource').length") == 0


def test_a_patch_report_shows_the_view_alone_inside_a_notebook_iframe(driver, patched, tmp_path):
    _, section, want, patterns = patched
    host = tmp_path / "notebook.html"
    host.write_text(f"<!DOCTYPE html><html><body><h1>a notebook</h1>{notebook_patching_html(section)}</body></html>")
    driver.get_log("browser")
    driver.get(host.as_uri())
    driver.switch_to.frame(driver.find_element(By.CSS_SELECTOR, "iframe.attnlab-patching"))
    try:
        WebDriverWait(driver, 30).until(lambda d: d.execute_script("return document.body.dataset.ready"))
        _check_patching_view(driver, want, patterns)
        assert _js(driver, "return performance.getEntriesByType('resource').length") == 0
    finally:
        driver.switch_to.default_content()
    assert _errors(driver) == []


# --------------------------------------------------------------------------------------------
# Scale: 512 tokens through a GPT-2-small-sized model (random weights, 12 layers x 12 heads)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_page(tmp_path_factory):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("gpt2-small", drop_rate=0.0)).eval()
    idx = torch.randint(0, 50257, (1, 512), generator=torch.Generator().manual_seed(0))
    tr = trace(model, idx, stages=True)
    path = tmp_path_factory.mktemp("big") / "big.html"
    path.write_text(render_page(inspector_data(tr)), encoding="utf-8")
    return path, tr


@pytest.mark.slow
def test_a_512_token_page_of_gpt2_small_loads_and_repaints(driver, big_page, tmp_path):
    """The page of 512 tokens opens, repaints on every switch and reads its weights back. How fast it
    does so (goals: drawn in under 3 s, repainted in under 200 ms) is measured by
    ``benchmarks/inspector.py``, not asserted here: on a shared 2-core machine beside other tests the
    times vary past those goals (a run drew it in 3.6 s)."""
    path, tr = big_page
    size = path.stat().st_size
    assert size < 50e6, f"the page is {size / 1e6:.1f} MB"
    _open(driver, path)
    ready_ms = float(_js(driver, "return document.body.dataset.readyMs"))
    frames = []
    for i in (1, 5, 11):
        _js(driver, "document.body.dataset.frameMs = ''")
        Select(driver.find_element(By.ID, "head-select")).select_by_index(i)
        WebDriverWait(driver, 10).until(lambda d: d.execute_script("return document.body.dataset.frameMs"))
        frames.append(float(_js(driver, "return document.body.dataset.frameMs")))
    for i in (3, 11):
        _js(driver, "document.body.dataset.frameMs = ''")
        Select(driver.find_element(By.ID, "layer-select")).select_by_index(i)
        WebDriverWait(driver, 10).until(lambda d: d.execute_script("return document.body.dataset.frameMs"))
        frames.append(float(_js(driver, "return document.body.dataset.frameMs")))
    print(f"\n512-token page: {size / 1e6:.1f} MB, ready in {ready_ms:.0f} ms, repaints {frames} ms")
    # A large matrix is a canvas; hovering it reads the stored (8-bit) weight.
    canvas = driver.find_element(By.CSS_SELECTOR, "#matrix canvas")
    _js(driver, "arguments[0].scrollIntoView({block: 'start'})", canvas)
    rect = _js(driver, "const r = arguments[0].getBoundingClientRect(); return [r.width, r.height];", canvas)
    for q, k in ((300, 120), (511, 0), (40, 40)):
        x = (k + 0.5) * rect[0] / 512 - rect[0] / 2
        y = (q + 0.5) * rect[1] / 512 - rect[1] / 2
        ActionChains(driver).move_to_element_with_offset(canvas, round(x), round(y)).perform()
        got_q, got_k = int(canvas.get_attribute("data-q")), int(canvas.get_attribute("data-k"))
        assert abs(got_q - q) <= 1 and abs(got_k - k) <= 1
        want = float(tr.weights[11, 0, 11, got_q, got_k])
        assert float(canvas.get_attribute("data-weight")) == pytest.approx(want, abs=0.5 / 255 + 1e-4)
    for view in VIEWS[:-1]:  # no generation on this page
        _show(driver, view)
    _screenshot(driver, "big-lens.png", tmp_path)
    assert _errors(driver) == []


def test_the_front_end_reads_inline_arrays_as_a_server_would_send_them(driver, gpt_page, tmp_path):
    """A live server answers with inline base64 arrays (to_json(blob=False)), not one blob: the same
    front end draws them."""
    from string import Template

    from attnlab.interpret.codec import to_json
    from attnlab.interpret.page import OFFLINE_CSP, inline, json_for_script, read_asset

    _, _, tr, _ = gpt_page
    data = to_json(inspector_data(tr), blob=False)
    assert "blob" not in data and "b64" in data["layers"][0]["weights"]
    page = Template(read_asset("viewer.html")).substitute(
        csp=OFFLINE_CSP,
        title="inline",
        styles=inline("style", read_asset("viewer.css")),
        data=f'<script type="application/json" id="attn-data">{json_for_script(data)}</script>',
        scripts=inline("script", read_asset("viewer.js")),
    )
    path = tmp_path / "inline.html"
    path.write_text(page, encoding="utf-8")
    _open(driver, path)
    Select(driver.find_element(By.ID, "layer-select")).select_by_index(2)
    cells = _js(driver, "return Array.from(document.querySelectorAll('#matrix .cell'), c => c.dataset.weight)")
    torch.testing.assert_close(_floats(cells), tr.weights[2, 0, 0].flatten(), atol=1e-4, rtol=0)
    for view in VIEWS[:-1]:
        _show(driver, view)
    assert _errors(driver) == []


def test_generation_view_places_a_ring_caches_keys_on_their_tokens(driver, tmp_path):
    """A modern GPT generates past its window with a ring cache: keys sit in slots out of order; the
    page puts each weight on its token."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("modern", vocab_size=60, context_length=8, emb_dim=32, n_heads=4, n_layers=2)).eval()
    idx = torch.randint(0, 60, (1, 6), generator=torch.Generator().manual_seed(1))
    gen = trace_generation(model, idx, 9, generator=torch.Generator().manual_seed(2))
    path = tmp_path / "modern.html"
    path.write_text(render_page(inspector_data(trace(model, idx, stages=True), generation=gen)), encoding="utf-8")
    _open(driver, path)
    Select(driver.find_element(By.ID, "layer-select")).select_by_index(1)
    _show(driver, "generation")
    for s, step in enumerate(gen.steps):
        if s:
            driver.find_element(By.ID, "gen-next").click()
        weights = _js(
            driver, "return Array.from(document.querySelectorAll('#gen-text .tok'), t => t.dataset.weight || null);"
        )
        want = [None] * (step.position + 1)
        for slot, t in enumerate(step.key_index[0].tolist()):
            want[t] = float(step.weights[1, 0, 0, slot])
        assert [w is None for w in weights] == [w is None for w in want]
        got = torch.tensor([float(w) for w in weights if w is not None])
        torch.testing.assert_close(got, torch.tensor([w for w in want if w is not None]), atol=1e-4, rtol=0)
    assert _errors(driver) == []
