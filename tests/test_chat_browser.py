"""The chat box of ``attnlab serve`` in a real headless browser (Debian's chromium, via Selenium): a
user sends a message, the answer streams in and equals attnlab's greedy chat answer computed in this
process, "open in the inspector" makes the conversation and its answer the inspected prompt, and a
second message is answered in the context of the first. No console error.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from attnlab.generation import SamplingConfig
from attnlab.tools.chat import ChatSession
from attnlab.tools.loading import load_pretrained
from browser import By, Keys, WebDriverWait, start_chromium  # skips this module when there is no browser
from test_serve import Server

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from test_chat import write_model_dir  # noqa: E402  (after the skips: it builds with transformers)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]

MAX_NEW = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_model_dir(tmp_path_factory.mktemp("chat-browser") / "tiny")


@pytest.fixture(scope="module")
def server(model_dir, subprocess_env):
    s = Server("--model", str(model_dir), "--max-new-tokens", str(MAX_NEW), env=subprocess_env)
    yield s
    code, err = s.stop()
    assert code == 130 and "Traceback" not in err, (code, err)


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    d = start_chromium(tmp_path_factory.mktemp("chromium-profile"), page_load_timeout=60)
    yield d
    d.quit()


def wait(driver, script: str, *args, timeout: float = 90):
    return WebDriverWait(driver, timeout).until(lambda d: d.execute_script(script, *args))


def test_the_chat_box_answers_and_opens_in_the_inspector(server, driver, model_dir):
    loaded = load_pretrained(str(model_dir))
    session = ChatSession(loaded, sampling=SamplingConfig(temperature=0), max_new_tokens=MAX_NEW)
    first = session.ask("Jack Gisburn?").read()
    second = session.ask("his painting").read()
    driver.get(server.url + "/")
    wait(driver, "return document.body.dataset.liveSeq === '1'")
    chat = driver.find_element(By.ID, "chat")
    assert chat.get_attribute("hidden") is None
    chat.find_element(By.TAG_NAME, "summary").click()
    driver.execute_script(  # greedy: the Next token tab's temperature at 0; answers of MAX_NEW tokens at most
        "const t = document.getElementById('temperature'); t.value = '0';"
        "t.dispatchEvent(new Event('input', {bubbles: true}));"
        f"document.getElementById('chat-max-new').value = '{MAX_NEW}';"
    )
    box = driver.find_element(By.ID, "chat-input")
    box.send_keys("Jack Gisburn?", Keys.ENTER)
    wait(driver, "return document.body.dataset.chatAnswers === '1'")
    answers = driver.find_elements(By.CSS_SELECTOR, ".chat-msg.assistant .text")
    assert [a.get_attribute("textContent") for a in answers] == [first]
    # "open in the inspector": the rendered conversation and the answer become the prompt.
    driver.find_element(By.CSS_SELECTOR, ".chat-msg.assistant button").click()
    rendered = loaded.chat_template.render([{"role": "user", "content": "Jack Gisburn?"}]) + first
    wait(driver, "return document.body.dataset.livePrompt === arguments[0]", rendered)
    assert driver.find_element(By.ID, "prompt").get_attribute("value") == rendered
    # The second message is answered with the first turn in the history.
    box.send_keys("his painting", Keys.ENTER)
    wait(driver, "return document.body.dataset.chatAnswers === '2'")
    answers = driver.find_elements(By.CSS_SELECTOR, ".chat-msg.assistant .text")
    assert [a.get_attribute("textContent") for a in answers] == [first, second]
    assert first and second and first != second  # answers worth comparing
    if os.environ.get("ATTNLAB_SCREENSHOT_DIR"):
        driver.set_window_size(1300, 1400)
        driver.save_screenshot(str(Path(os.environ["ATTNLAB_SCREENSHOT_DIR"]) / "chat.png"))
    errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert not errors, errors
