"""The Features view in a real headless browser (Debian's chromium, via Selenium): the offline page of
``attnlab viz --sae`` and the Features tab of ``attnlab serve --sae``. A reader clicks a token, reads its
strongest latents, clicks one, reads its dashboard and the tokens shaded by it; on the live page steers a
generation. What the page shows is compared with :mod:`attnlab.interpret` in this process; no console
error, no request leaving the page's origin.

Set ``ATTNLAB_SCREENSHOT_DIR`` to keep screenshots.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from attnlab.interpret import SAE, inspector_data, render_page, trace
from attnlab.interpret.sae_view import features_sections, strongest_latents
from attnlab.tools.loading import load_model
from browser import By, WebDriverWait, start_chromium  # skips this module when there is no browser
from test_sae_views import PROMPT, TEXT, TOKENIZER, _stream, checkpoint, encode_all, ids, model, sae  # noqa: F401
from test_serve import Server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]


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


def _screenshot(driver, name: str) -> None:
    out = os.environ.get("ATTNLAB_SCREENSHOT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(out) / name))


def _rows(driver) -> list[tuple[int, float]]:
    got = _js(
        driver,
        "return Array.from(document.querySelectorAll('#features-table tr.latent-row'),"
        " r => [r.dataset.latent, r.dataset.value]);",
    )
    return [(int(a), float(v)) for a, v in got]


def _choose_token(driver, t: int) -> list[tuple[int, float]]:
    driver.find_element(By.CSS_SELECTOR, f'#tokens .tok[data-index="{t}"]').click()  # pins it
    _wait(driver, f"return document.body.dataset.featuresToken === '{t}' && "
                  "document.querySelectorAll('#features-table tr.latent-row').length > 0")  # fmt: skip
    return _rows(driver)


def _strip(driver) -> list[float]:
    return [
        float(w)
        for w in _js(driver, "return Array.from(document.querySelectorAll('#tokens .tok'), t => t.dataset.weight)")
    ]


def _want_rows(gpt, autoencoder, prompt: str, t: int, n: int) -> list[tuple[int, float]]:
    values, latents = strongest_latents(gpt, autoencoder, ids(prompt), n)
    return [(int(i), float(v)) for v, i in zip(values[t], latents[t], strict=True) if v > 0]


def test_the_offline_features_view(driver, model, sae, tmp_path):  # noqa: F811
    idx = ids(PROMPT)
    data = inspector_data(trace(model, idx, stages=True, tokenizer=TOKENIZER), title=PROMPT, text=PROMPT)
    corpus = np.array(TOKENIZER.encode(TEXT), dtype=np.int64)
    data["features"] = features_sections(model, {"mine": sae}, idx[0], TOKENIZER, corpus=corpus, corpus_name="c.txt")
    page = tmp_path / "page.html"
    page.write_text(render_page(data), encoding="utf-8")
    driver.get_log("browser")
    driver.get(page.resolve().as_uri())
    _wait(driver, "return document.body.dataset.ready || document.body.dataset.error")
    assert _js(driver, "return document.body.dataset.error") is None
    driver.find_element(By.CSS_SELECTOR, '#tabs .tab[data-view="features"]').click()
    assert driver.find_element(By.ID, "view-features").is_displayed()
    assert "attnlab generate --steer" in driver.find_element(By.ID, "features-steer-note").text

    got = _choose_token(driver, 6)
    want = _want_rows(model, sae, PROMPT, 6, 5)
    assert [i for i, _ in got] == [i for i, _ in want]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-6)

    # Click the token's second latent: the tokens shaded by its activation, its dashboard drawn.
    latent = got[1][0]
    driver.find_element(By.CSS_SELECTOR, f'#features-table tr.latent-row[data-latent="{latent}"]').click()
    _wait(driver, f"return document.getElementById('features-latent').dataset.latent === '{latent}'")
    z = encode_all(model, sae, idx)[:, latent]
    np.testing.assert_allclose(_strip(driver), z.numpy(), atol=6e-5)
    box = driver.find_element(By.ID, "features-latent")
    assert box.find_element(By.TAG_NAME, "h2").text == f"Latent #{latent}, over this prompt's {len(PROMPT)} tokens"
    i = data["features"][0]["shown"].index(latent)
    dash = data["features"][0]["dashboards"]["prompt"][i]
    values = [float(v.text) for v in box.find_elements(By.CSS_SELECTOR, ".ctx .val")]
    np.testing.assert_allclose(values, [e["value"] for e in dash["examples"]], rtol=1e-3)
    assert float(box.find_element(By.CSS_SELECTOR, ".ctx .val").text) == pytest.approx(float(z.max()), rel=1e-3)
    promotes = [td.text for td in box.find_elements(By.CSS_SELECTOR, "table.logits tr td:first-child")][:8]
    assert promotes == [t for t, _ in dash["promotes"]]

    # Over the corpus: that section's dashboard.
    driver.find_element(By.CSS_SELECTOR, '#features-over option[value="corpus"]').click()
    _wait(driver, "return document.querySelector('#features-latent h2').textContent.includes('corpus')")
    corpus_dash = data["features"][0]["dashboards"]["corpus"][i]
    values = [float(v.text) for v in box.find_elements(By.CSS_SELECTOR, ".ctx .val")]
    np.testing.assert_allclose(values, [e["value"] for e in corpus_dash["examples"]], rtol=1e-3)
    _screenshot(driver, "features-offline.png")
    assert _errors(driver) == []


@pytest.fixture(scope="module")
def server(checkpoint, subprocess_env):  # noqa: F811
    d, sae_dir, text = checkpoint
    s = Server("--checkpoint", str(d), "--max-new-tokens", "32", "--sae", str(sae_dir), "--sae-data", str(text),
               env=subprocess_env)  # fmt: skip
    yield s
    code, err = s.stop()
    assert code == 130 and "Traceback" not in err, (code, err)


def test_the_live_features_tab_and_steering(driver, server, checkpoint):  # noqa: F811
    d, sae_dir, _ = checkpoint
    loaded, served_sae = load_model(d), SAE.load(sae_dir)
    driver.get_log("browser")
    driver.get(server.url + "/")
    _wait(driver, "return document.body.dataset.ready || document.body.dataset.error")
    assert _js(driver, "return document.body.dataset.error") is None
    prompt = driver.find_element(By.ID, "prompt").get_attribute("value")
    driver.find_element(By.CSS_SELECTOR, '#tabs .tab[data-view="features"]').click()
    got = _choose_token(driver, 2)
    want = _want_rows(loaded.model, served_sae, prompt, 2, 8)
    assert [i for i, _ in got] == [i for i, _ in want]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in want], rtol=1e-6)

    latent = got[0][0]
    driver.find_element(By.CSS_SELECTOR, f'#features-table tr.latent-row[data-latent="{latent}"]').click()
    _wait(driver, f"return document.getElementById('features-latent').dataset.latent === '{latent}'")
    z = encode_all(loaded.model, served_sae, ids(prompt))[:, latent]
    np.testing.assert_allclose(_strip(driver), z.numpy(), atol=6e-5)
    assert driver.find_element(By.CSS_SELECTOR, "#features-steer-rows .steer-latent").get_attribute("value") == str(
        latent
    )

    # Steer: the chosen latent x 30, 8 greedy tokens; the same tokens as the steer context manager's run.
    strength = driver.find_element(By.CSS_SELECTOR, "#features-steer-rows .steer-strength")
    strength.clear()
    strength.send_keys("30")
    tokens = driver.find_element(By.ID, "features-steer-tokens")
    tokens.clear()
    tokens.send_keys("8")
    driver.find_element(By.ID, "features-steer-run").click()
    _wait(driver, "return document.body.dataset.steered || document.body.dataset.steerError")
    assert _js(driver, "return document.body.dataset.steerError") is None
    steered = [int(t) for t in _js(driver, "return document.body.dataset.steered").split(",")]
    assert steered == _stream(loaded.model, served_sae, prompt, 8, 0, 0.0, [(latent, 30.0)])
    plain = _js(driver, "return document.querySelector('.features-gen[data-run=\"unsteered\"]').dataset.tokens")
    assert [int(t) for t in plain.split(",")] == _stream(loaded.model, served_sae, prompt, 8, 0, 0.0)
    _screenshot(driver, "features-live.png")
    assert _errors(driver) == []
