"""The live page of ``attnlab serve`` in a real headless browser (Debian's chromium, via Selenium): a
user types a prompt, moves a slider, generates, ablates a head from the grid; what the page shows is
compared with what :mod:`attnlab.interpret` computes in this process. No console error, no request
leaving the server's address.

Set ``ATTNLAB_SCREENSHOT_DIR`` to keep screenshots of the page.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from attnlab.interpret import (
    ablation_effect,
    act_name,
    activation_patching,
    logit_diff,
    next_token_probabilities,
    run_with_cache,
    trace,
    trace_generation,
)
from browser import By, Keys, Select, WebDriverWait, start_chromium  # skips this module when there is no browser
from test_serve import Server, checkpoint  # noqa: F401  (the same model)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]


@pytest.fixture(scope="module")
def server(checkpoint, subprocess_env):  # noqa: F811
    s = Server("--checkpoint", str(checkpoint[0]), "--max-new-tokens", "64", env=subprocess_env)
    yield s
    code, err = s.stop()
    assert code == 130 and "Traceback" not in err, (code, err)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    d = start_chromium(tmp_path_factory.mktemp("chromium-profile"), page_load_timeout=60)
    yield d
    d.quit()


def _js(driver, script: str, *args):
    return driver.execute_script(script, *args)


def _wait(driver, script: str, timeout: float = 60):
    return WebDriverWait(driver, timeout).until(lambda d: d.execute_script(script))


def _errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def _set(driver, element_id: str, value) -> None:
    """Move a slider / type into a number box as a user would (the input event fires)."""
    _js(
        driver,
        "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
        "e.dispatchEvent(new Event('input', {bubbles: true}));",
        element_id,
        str(value),
    )


def _show(driver, view: str) -> None:
    driver.find_element(By.CSS_SELECTOR, f'#tabs .tab[data-view="{view}"]').click()
    assert driver.find_element(By.ID, f"view-{view}").is_displayed()


def _floats(values) -> torch.Tensor:
    return torch.tensor([float("-inf") if v == "-inf" else float(v) for v in values])


def _type(driver, text: str) -> float:
    """Replace the prompt by typing it; the seconds until the page shows it."""
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(Keys.DELETE)
    start = time.perf_counter()
    box.send_keys(text)
    _wait(driver, f"return document.body.dataset.livePrompt === {text!r}")
    return time.perf_counter() - start


def _screenshot(driver, name: str) -> None:
    out = os.environ.get("ATTNLAB_SCREENSHOT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(out) / name))


def test_type_slide_generate_and_ablate(driver, server, checkpoint):  # noqa: F811
    _, loaded = checkpoint
    model, tok = loaded.model, loaded.tokenizer
    driver.get_log("browser")
    driver.get(server.url + "/")
    _wait(driver, "return document.body.dataset.ready || document.body.dataset.error")
    assert _js(driver, "return document.body.dataset.error") is None
    assert driver.find_element(By.ID, "prompt").get_attribute("value") == "your journey starts with one step"

    # Choose a head, then type: the new prompt is drawn for the same head.
    Select(driver.find_element(By.ID, "layer-select")).select_by_index(2)
    Select(driver.find_element(By.ID, "head-select")).select_by_index(1)
    prompt = "the cat sat on the mat, the cat"
    took = _type(driver, prompt)
    idx = torch.tensor([tok.encode(prompt)])
    tr = trace(model, idx, stages=True)
    shown = _js(driver, "return Array.from(document.querySelectorAll('#tokens .tok'), t => t.firstChild.textContent)")
    assert shown == [c.replace(" ", "␣") for c in prompt]
    assert driver.find_element(By.ID, "matrix-title").text == "layer 2 · head 1"
    cells = _js(driver, "return Array.from(document.querySelectorAll('#matrix .cell'), c => c.dataset.weight)")
    torch.testing.assert_close(_floats(cells), tr.weights[2, 0, 1].flatten(), atol=1e-4, rtol=0)
    live_ms = float(_js(driver, "return document.body.dataset.liveMs"))
    print(
        f"\ntyped {len(prompt)} characters: shown {took:.2f} s after the first key; "
        f"the last request + draw {live_ms:.0f} ms"
    )

    # The tutorials' steps of that head, fetched when the tab opens.
    _show(driver, "steps")
    _wait(driver, "return document.querySelectorAll('[data-step=\"weights\"] .cell').length > 0")
    cells = _js(
        driver, "return Array.from(document.querySelectorAll('[data-step=\"scores\"] .cell'), c => c.dataset.value)"
    )
    torch.testing.assert_close(_floats(cells), tr.steps(2)["scores"][0, 1].flatten(), atol=1e-4, rtol=0)

    # Next token: move the temperature slider, set top-k; the distribution is the library's.
    _show(driver, "next")
    _set(driver, "temperature", 0.7)
    _set(driver, "top-k", 5)
    want = next_token_probabilities(tr.logits[0, -1][None], temperature=0.7, top_k=5)[0]

    def rows():
        return _js(
            driver,
            "return Array.from(document.querySelectorAll('#next-table tr[data-id]'),"
            " r => [r.dataset.id, r.dataset.prob]);",
        )

    WebDriverWait(driver, 30).until(lambda d: (r := rows()) and abs(float(r[0][1]) - float(want.max())) < 1e-6)
    got = rows()
    assert [int(i) for i, _ in got][:5] == torch.topk(want, 5).indices.tolist()
    torch.testing.assert_close(_floats([p for _, p in got]), want[[int(i) for i, _ in got]], atol=1e-6, rtol=0)
    assert sum(float(p) > 0 for _, p in got) == 5
    # A k past every vocabulary keeps every token, as 0 does (the server's 422 was an uncaught error, before).
    _set(driver, "top-k", 2_000_000)
    WebDriverWait(driver, 30).until(lambda d: sum(float(p) > 0 for _, p in rows()) > 5)
    _set(driver, "top-k", 5)
    WebDriverWait(driver, 30).until(lambda d: sum(float(p) > 0 for _, p in rows()) == 5)

    # Generate: tokens stream in with their attention, drawn with those settings.
    _set(driver, "max-new", 6)
    _set(driver, "seed", 3)
    driver.find_element(By.ID, "generate").click()
    _wait(driver, "return document.body.dataset.generationDone === '6'")
    assert driver.find_element(By.ID, "view-generation").is_displayed()
    gen = trace_generation(model, idx, 6, temperature=0.7, top_k=5, generator=torch.Generator().manual_seed(3))
    assert driver.find_element(By.ID, "gen-step").text.startswith("token 6 of 6")
    shown = _js(
        driver, "return Array.from(document.querySelectorAll('#gen-candidates tr[data-id]'), r => +r.dataset.id)"
    )
    assert shown == gen.steps[-1].candidates[0].tolist()
    weights = _js(
        driver, "return Array.from(document.querySelectorAll('#gen-text .tok'), t => t.dataset.weight || null)"
    )
    step = gen.steps[-1]
    assert len(weights) == step.position + 1
    got = _floats([w for w in weights[step.key_start : step.position]])
    torch.testing.assert_close(got, step.weights[2, 0, 1], atol=1e-4, rtol=0)
    text = _js(
        driver,
        "return Array.from(document.querySelectorAll('#gen-text .tok.generated'), t => t.firstChild.textContent)",
    )
    assert text == [tok.decode([int(t)]).replace(" ", "␣") for t in gen.new_tokens[0]]

    # Ablate from the grid: layer 1 head 2 in the heads view's thumbnails.
    driver.find_element(By.CSS_SELECTOR, 'input[name="click"][value="ablate"]').click()
    _show(driver, "heads")
    driver.find_element(By.CSS_SELECTOR, '#thumbs .thumb[data-layer="1"][data-head="2"]').click()
    _wait(driver, "return document.body.dataset.ablation === '1.2'")
    assert "ablated" in driver.find_element(
        By.CSS_SELECTOR, '#thumbs .thumb[data-layer="1"][data-head="2"]'
    ).get_attribute("class")
    effect = ablation_effect(model, idx, [(1, 2)])
    before = next_token_probabilities(effect.logits_before, temperature=0.7, top_k=5)[0]
    after = next_token_probabilities(effect.logits_after, temperature=0.7, top_k=5)[0]
    table = _js(
        driver,
        "return Array.from(document.querySelectorAll('#ablation-table tr[data-id]'),"
        " r => [+r.dataset.id, +r.dataset.before, +r.dataset.after]);",
    )
    assert table and {i for i, _, _ in table} >= set(torch.topk(after, 5).indices.tolist())
    for i, b, a in table:
        assert b == pytest.approx(float(before[i]), abs=1e-6) and a == pytest.approx(float(after[i]), abs=1e-6)
    assert f"{float(effect.kl[0]):.4f}" in driver.find_element(By.ID, "ablation-note").text
    assert driver.find_element(By.ID, "matrix-title").text == "layer 2 · head 1"  # clicking ablated, not selected
    _screenshot(driver, "serve-ablation.png")

    # The remaining views draw from the server too.
    for view in ("rollout", "lens", "roles"):
        _show(driver, view)
        _wait(driver, f"return document.getElementById('view-{view}').innerText.length > 80")
    assert _errors(driver) == []
    origin = server.url.rstrip("/")
    urls = _js(driver, "return performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and all(u.startswith(origin + "/") for u in urls), urls
    assert {u[len(origin) :] for u in urls} >= {
        "/assets/viewer.js",
        "/assets/viewer.css",
        "/api/generate",
        "/api/ablate",
    }


def _cells(driver, box: str, key: str) -> list[str]:
    return _js(driver, f"return Array.from(document.querySelectorAll('#{box} .cell'), c => c.dataset.{key})")


def test_the_patching_tab_patches_and_shows_a_heads_pattern_on_both_prompts(driver, server, checkpoint):  # noqa: F811
    """Type a corrupted prompt, pick answer A among the likeliest tokens and type B; the heatmaps hold
    what activation_patching computes; a click on a head shows its pattern on both prompts."""
    _, loaded = checkpoint
    model, tok = loaded.model, loaded.tokenizer
    driver.get_log("browser")
    driver.get(server.url + "/")
    _wait(driver, "return document.body.dataset.ready || document.body.dataset.error")
    clean, corrupted = "the cat sat on the mat", "the dog sat on the mat"
    _type(driver, clean)
    _show(driver, "patching")
    _wait(driver, "return document.querySelectorAll('#patch-a option').length > 2")
    assert driver.find_element(By.ID, "patch-corrupted").get_attribute("value") == clean  # prefilled
    box = driver.find_element(By.ID, "patch-corrupted")
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(corrupted + "s")
    _wait(driver, "return document.getElementById('patch-count').textContent.includes('must match')")
    box.send_keys(Keys.BACKSPACE)
    _wait(driver, f"return document.getElementById('patch-count').textContent.includes('{len(clean)} tokens each')")
    idx = torch.tensor([tok.encode(clean)])
    top = torch.topk(model(idx)[0, -1], 10).indices.tolist()
    options = _js(driver, "return Array.from(document.querySelectorAll('#patch-a option'), o => o.value)")
    assert options == [str(i) for i in top] + ["text"]  # the clean run's likeliest next tokens, then free text
    a = top[0]
    b_text = next(c for c in "zqx" if tok.encode(c)[0] != a)
    Select(driver.find_element(By.ID, "patch-b")).select_by_value("text")
    text_box = driver.find_element(By.ID, "patch-b-text")
    text_box.send_keys("zq")  # two tokens: the server says so
    driver.find_element(By.ID, "patch-run").click()
    _wait(driver, "return document.body.dataset.patchError")
    assert "answers[1] 'zq' is 2 tokens" in driver.find_element(By.ID, "patch-status").text
    text_box.clear()
    text_box.send_keys(b_text)
    driver.find_element(By.ID, "patch-run").click()
    _wait(
        driver,
        "return document.body.dataset.patchReady && !document.body.dataset.patching"
        " && !document.body.dataset.patchError && document.body.dataset.patchPattern",
    )

    b = tok.encode(b_text)[0]
    ids = [torch.tensor(tok.encode(t)) for t in (clean, corrupted)]
    metric = logit_diff(a, b)
    for site in ("head_out", "resid_pre"):
        want = activation_patching(model, *ids, metric, site)
        got = _floats(_cells(driver, f"patch-{site}", "value")).reshape(want.shape)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # The head that restores the most is shown first; then a click shows another's.
    names = [act_name("pattern", i) for i in range(model.config.n_layers)]
    patterns = [torch.stack([c[n][0] for n in names]) for c in (run_with_cache(model, i[None], names)[1] for i in ids)]
    for layer, head in [tuple(map(int, _js(driver, "return document.body.dataset.patchPattern").split("."))), (2, 1)]:
        driver.find_element(By.CSS_SELECTOR, f'#patch-head_out .cell[data-q="{layer}"][data-k="{head}"]').click()
        _wait(driver, f"return document.body.dataset.patchPattern === '{layer}.{head}'")
        for which, pattern in zip(("clean", "corrupted"), patterns, strict=True):
            got = _floats(_cells(driver, f"patch-pattern-{which}", "weight"))
            torch.testing.assert_close(got, pattern[layer, head].flatten(), atol=1e-4, rtol=0)
    selected = driver.find_elements(By.CSS_SELECTOR, "#patch-head_out .cell.selected")
    assert [(c.get_attribute("data-q"), c.get_attribute("data-k")) for c in selected] == [("2", "1")]
    _screenshot(driver, "serve-patching.png")
    others = [e for e in _errors(driver) if "422" not in e["message"]]
    assert others == []


def test_a_prompt_the_model_cannot_read_is_said_on_the_page(driver, server):
    driver.get_log("browser")
    driver.get(server.url + "/")
    _wait(driver, "return document.body.dataset.ready || document.body.dataset.error")
    _type(driver, "fine")
    box = driver.find_element(By.ID, "prompt")
    box.send_keys("x" * 60)  # past the context of 48
    _wait(driver, "return document.body.dataset.liveError")
    status = driver.find_element(By.ID, "live-status")
    assert "more than the model's context window" in status.text and "error" in status.get_attribute("class")
    # The views still show the last prompt that fit; the console has the 422, nothing else.
    assert _js(driver, "return document.body.dataset.livePrompt") == "fine"
    others = [e for e in _errors(driver) if "422" not in e["message"]]
    assert others == []
    box.send_keys(Keys.BACKSPACE * 60)
    _wait(driver, "return !document.body.dataset.liveError && document.body.dataset.livePrompt === 'fine'")


def test_the_demo_page_shows_the_six_words(driver, subprocess_env):
    s = Server("--demo", env=subprocess_env)
    try:
        driver.get_log("browser")
        driver.get(s.url + "/")
        _wait(driver, "return document.body.dataset.ready || document.body.dataset.error")
        words = _js(
            driver, "return Array.from(document.querySelectorAll('#tokens .tok'), t => t.firstChild.textContent)"
        )
        assert words == ["Your", "journey", "starts", "with", "one", "step"]
        assert driver.find_element(By.ID, "prompt").get_attribute("disabled") == "true"
        assert "language model" in driver.find_element(By.ID, "live-status").text
        disabled = [t.get_attribute("data-view") for t in driver.find_elements(By.CSS_SELECTOR, "#tabs .tab:disabled")]
        assert disabled == ["next", "rollout", "lens", "roles", "generation", "patching", "circuit", "features"]
        _show(driver, "steps")
        assert "attn_scores = inputs @ inputs.T" in driver.find_element(By.ID, "steps").text
        assert _errors(driver) == []
    finally:
        code, err = s.stop()
    assert code == 130 and "Traceback" not in err
