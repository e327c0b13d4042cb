"""The circuit page in a real browser: it draws the graph without errors or requests, and clicking a
head opens its attention on both prompts (the weights the page holds, which tests/test_circuit_cli.py
holds to attnlab.interpret.trace)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from attnlab.cli import main
from attnlab.model import GPT, GPTConfig
from attnlab.tokenizers import CharTokenizer
from browser import By, WebDriverWait, start_chromium  # skips this module when there is no browser

pytestmark = pytest.mark.slow  # a browser: the fast suite (-m 'not slow') leaves it to CI

LETTERS = "abcdefghijklmnop"


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=16, context_length=16, emb_dim=24, n_heads=4, n_kv_heads=2, n_layers=2, drop_rate=0.0)
    model = GPT(cfg)
    with torch.no_grad():
        for block in model.trf_blocks:
            block.att.W_query.weight.normal_(0, 0.5)
            block.att.W_key.weight.normal_(0, 0.5)
    d = model.save(tmp_path_factory.mktemp("circuit") / "ckpt")
    (d / "tokenizer.json").write_text(json.dumps(CharTokenizer(LETTERS).to_dict()))
    out = tmp_path_factory.mktemp("page") / "circuit.html"
    argv = ["circuit", "--checkpoint", str(d), "--clean", "abcabcd", "--corrupted", "abcabce", "--answers", "a", "b"]
    assert main([*argv, "--budget", "30%", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    d = start_chromium(tmp_path_factory.mktemp("chromium-profile"))
    yield d
    d.quit()


def test_clicking_a_head_opens_its_attention_on_both_prompts(driver, page):
    text = page.read_text(encoding="utf-8")
    data = json.loads(re.search(r'id="attn-circuit">(.*?)</script>', text, re.S).group(1))
    driver.get_log("browser")
    driver.get(page.resolve().as_uri())
    WebDriverWait(driver, 20).until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")
    assert [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")] == []
    assert driver.execute_script("return performance.getEntriesByType('resource').length") == 0
    # one path per drawn edge (a key/value edge goes to each drawn head of its group: at least one)
    paths = driver.find_elements(By.CSS_SELECTOR, "#circuit-graph path.edge")
    assert len(paths) >= len(data["edges"]) > 0
    heads = driver.find_elements(By.CSS_SELECTOR, "#circuit-graph .node.head")
    assert heads, "the circuit has no head"
    key = heads[0].get_attribute("data-node")[1:]  # "a0.1" -> "0.1"
    assert driver.execute_script("return document.body.dataset.circuitHead") is None
    heads[0].click()
    WebDriverWait(driver, 5).until(lambda d: d.execute_script("return document.body.dataset.circuitHead") == key)
    panes = driver.find_elements(By.CSS_SELECTOR, "#circuit-attn section.pane")
    assert [p.get_attribute("data-prompt") for p in panes] == ["clean", "corrupted"]
    T = len(data["clean"]["tokens"])
    for pane in panes:
        assert len(pane.find_elements(By.CSS_SELECTOR, "rect.cell")) == T * T
    # the cells' weights are the page's: the first row of the clean prompt's pattern
    titles = driver.execute_script(
        "return Array.from(document.querySelectorAll('#circuit-attn section.pane')[0]"
        ".querySelectorAll('rect.cell title')).slice(0, arguments[0]).map(t => t.textContent)",
        T,
    )
    want = data["patterns"][key]["clean"][0]
    assert [float(t.rsplit(": ", 1)[1]) for t in titles] == pytest.approx(want, abs=1e-4)
    assert "Layer " + key.split(".")[0] in driver.find_element(By.ID, "circuit-attn-title").text


# --------------------------------------------------------------------------------------------
# The Circuit tab of attnlab serve
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory, subprocess_env):
    from attnlab.tools.loading import load_model
    from test_serve import Server, save_checkpoint, sharp_gpt

    d = save_checkpoint(sharp_gpt(), tmp_path_factory.mktemp("serve") / "sharp")
    s = Server("--checkpoint", str(d), env=subprocess_env)
    yield s, load_model(d)
    code, err = s.stop()
    assert code == 130 and "Traceback" not in err, (code, err)


def test_the_circuit_tab_finds_the_circuit_and_opens_a_heads_attention(driver, server):
    from attnlab.interpret import edge_attribution, logit_diff
    from attnlab.tools.circuit import format_node

    s, loaded = server
    model, tok = loaded.model, loaded.tokenizer
    clean, corrupted = "the cat sat on the mat", "the dog sat on the mat"
    driver.get_log("browser")
    driver.get(s.url + "/")
    wait = lambda script, t=60: WebDriverWait(driver, t).until(lambda d: d.execute_script(script))
    wait("return document.body.dataset.ready || document.body.dataset.error")
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(clean)
    wait(f"return document.body.dataset.livePrompt === {clean!r}")
    driver.find_element(By.CSS_SELECTOR, '#tabs .tab[data-view="circuit"]').click()
    assert driver.find_element(By.ID, "view-circuit").is_displayed()
    text = driver.find_element(By.ID, "circuit-corrupted")
    assert text.get_attribute("value") == clean  # prefilled with the page's prompt
    text.clear()
    text.send_keys(corrupted)
    driver.find_element(By.ID, "circuit-a").send_keys("zq")  # two tokens: the server says so
    driver.find_element(By.ID, "circuit-b").send_keys("x")
    driver.find_element(By.ID, "circuit-run").click()
    wait("return document.body.dataset.circuitError")
    assert "answers[0] 'zq' is 2 tokens" in driver.find_element(By.ID, "circuit-status").text
    driver.find_element(By.ID, "circuit-a").clear()
    driver.find_element(By.ID, "circuit-a").send_keys("s")
    driver.find_element(By.ID, "circuit-run").click()
    wait("return document.body.dataset.circuitEdges && !document.body.dataset.circuitRunning"
         " && !document.body.dataset.circuitError")  # fmt: skip
    # the table of the strongest edges is the library's
    ids = [torch.tensor(tok.encode(t)) for t in (clean, corrupted)]
    drawn = int(driver.execute_script("return document.body.dataset.circuitEdges"))  # the 5% circuit's
    want = edge_attribution(model, *ids, logit_diff(tok.encode("s")[0], tok.encode("x")[0])).top(min(20, drawn))
    rows = driver.execute_script(
        "return Array.from(document.querySelectorAll('#circuit-edges tr')).slice(1)"
        ".map(r => Array.from(r.cells, c => c.textContent))"
    )
    assert [(w, r) for w, r, _ in rows] == [(format_node(w), format_node(r)) for w, r, _ in want]
    assert [float(v) for _, _, v in rows] == pytest.approx([v for _, _, v in want], rel=1e-3, abs=1e-6)
    head = driver.find_elements(By.CSS_SELECTOR, "#circuit-graph .node.head")[0]
    key = head.get_attribute("data-node")[1:]
    head.click()
    wait(f"return document.body.dataset.circuitHead === {key!r}", 10)
    T = len(ids[0])
    panes = driver.find_elements(By.CSS_SELECTOR, "#circuit-attn section.pane")
    assert [len(p.find_elements(By.CSS_SELECTOR, "rect.cell")) for p in panes] == [T * T, T * T]
    others = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING") and "422" not in e["message"]]
    assert others == []


@pytest.fixture(scope="module")
def sae_page(page):
    """The same model's page with an SAE spliced in at blocks.0.hook_resid_post (``--sae``)."""
    from attnlab.interpret import SAE, SAEConfig

    torch.manual_seed(1)
    sae = SAE(SAEConfig(d_in=24, d_sae=40, architecture="topk", k=6, hook_name="blocks.0.hook_resid_post"))
    sae_dir = sae.save(page.parent / "sae")
    ckpt = next(page.parent.parent.glob("circuit*/ckpt"))
    out = page.parent / "circuit-sae.html"
    argv = ["circuit", "--checkpoint", str(ckpt), "--clean", "abcabcd", "--corrupted", "abcabce", "--answers", "a", "b"]
    assert main([*argv, "--budget", "30%", "--sae", str(sae_dir), "--out", str(out)]) == 0
    return out


def test_a_page_with_sae_latents_draws_and_lists_them_by_name(driver, sae_page):
    text = sae_page.read_text(encoding="utf-8")
    data = json.loads(re.search(r'id="attn-circuit">(.*?)</script>', text, re.S).group(1))
    assert data["sae_edges"], "no drawn edge touches the SAE"
    driver.get_log("browser")
    driver.get(sae_page.resolve().as_uri())
    WebDriverWait(driver, 20).until(lambda d: d.execute_script("return document.body.dataset.ready") == "1")
    assert [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "WARNING")] == []
    assert driver.execute_script("return performance.getEntriesByType('resource').length") == 0
    assert len(driver.find_elements(By.CSS_SELECTOR, "#circuit-graph path.edge")) >= len(data["edges"])
    table = driver.find_element(By.ID, "circuit-sae-edges")
    assert table.is_displayed()
    rows = [[c.text for c in r.find_elements(By.TAG_NAME, "td")] for r in table.find_elements(By.TAG_NAME, "tr")[1:]]
    assert [r[:2] for r in rows] == [e[:2] for e in data["sae_edges"]]
    assert any(r[0].startswith("sae 0.hook_resid_post latent ") for r in rows)
