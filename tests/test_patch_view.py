"""The patching view (:mod:`attnlab.interpret.patch_view`): the data the inspector page, ``attnlab serve``
(``POST /api/patch``) and Jupyter draw equals :func:`attnlab.interpret.activation_patching` called
directly, and the patterns equal the model's ``hook_pattern``; bad requests get a 4xx naming what is
wrong; ``attnlab viz --corrupted --answers`` puts the view on the page. The browser tests
(``test_serve_browser.py``, ``test_viz_inspector_browser.py``) check what the page draws of it."""

from __future__ import annotations

import json
import re

import pytest
import torch

from attnlab.cli import main
from attnlab.interpret import (
    act_name,
    activation_patching,
    logit_diff,
    patching_data,
    read_page_data,
    render_page,
    run_with_cache,
)
from attnlab.interpret.codec import to_json, unpack
from attnlab.interpret.patch_view import answer_token
from attnlab.model import GPT, GPTConfig
from attnlab.tokenizers import CharTokenizer
from attnlab.tools.loading import load_model

pytestmark = pytest.mark.usefixtures("one_thread_module")

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
TOK = CharTokenizer(CHARS)
CLEAN, CORRUPTED = "the cat sat on a mat", "the dog sat on a mat"


def sharp_gpt(seed: int = 0) -> GPT:
    """A small GPT whose heads matter (patching one moves the metric)."""
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=len(CHARS), context_length=32, emb_dim=32, n_heads=4, n_layers=3, drop_rate=0.0)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for block in model.trf_blocks:
            block.att.W_query.weight.normal_(0, 0.5)
            block.att.W_key.weight.normal_(0, 0.5)
            block.att.out_proj.weight.normal_(0, 0.3)
        model.tok_emb.weight.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple:
    d = sharp_gpt().save(tmp_path_factory.mktemp("patchview") / "sharp")
    (d / "tokenizer.json").write_text(json.dumps(TOK.to_dict()))
    return d, load_model(d)


def ids(text: str) -> torch.Tensor:
    return torch.tensor(TOK.encode(text))


def library(model: GPT, clean: str, corrupted: str, a: int, b: int) -> dict:
    """What the view must show, from the library called directly."""
    metric = logit_diff(a, b)
    out = {
        site: activation_patching(model, ids(clean), ids(corrupted), metric, site) for site in ("head_out", "resid_pre")
    }
    for name, text in (("clean", clean), ("corrupted", corrupted)):
        names = [act_name("pattern", i) for i in range(model.config.n_layers)]
        with torch.no_grad():
            logits, cache = run_with_cache(model, ids(text)[None], names)
        out[name + "_value"] = float(metric(logits))
        out[name + "_patterns"] = torch.stack([cache[n][0] for n in names])  # (L, H, T, T)
    return out


def close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------
# The section
# --------------------------------------------------------------------------------------------
def test_patching_data_is_activation_patching_and_the_patterns_the_models(checkpoint):
    _, loaded = checkpoint
    model = loaded.model
    a, b = TOK.encode("a")[0], TOK.encode("o")[0]
    want = library(model, CLEAN, CORRUPTED, a, b)
    data = unpack(to_json(patching_data(model, ids(CLEAN), ids(CORRUPTED), ("a", b), tokenizer=TOK)))
    assert data["answers"] == [{"id": a, "label": "a"}, {"id": b, "label": "o"}]
    assert data["clean"]["ids"] == TOK.encode(CLEAN) and data["corrupted"]["labels"][3] == "␣"
    assert data["kinds"] == {"head_out": "head", "resid_pre": "pos"}
    assert (data["n_layers"], data["n_heads"]) == (3, 4)
    for site in ("head_out", "resid_pre"):
        close(data["sites"][site], want[site])
    assert data["clean_value"] == pytest.approx(want["clean_value"], abs=1e-5)
    assert data["corrupted_value"] == pytest.approx(want["corrupted_value"], abs=1e-5)
    close(data["patterns"]["clean"], want["clean_patterns"])
    close(data["patterns"]["corrupted"], want["corrupted_patterns"])
    assert data["static"] is True and data["pattern"] is None


def test_the_patterns_are_dropped_to_fewer_bits_then_left_out_when_too_big(checkpoint, monkeypatch):
    import attnlab.interpret.patch_view as pv

    _, loaded = checkpoint
    want = library(loaded.model, CLEAN, CORRUPTED, 0, 1)
    n = 2 * 3 * 4 * len(CLEAN) ** 2  # both prompts' (L, H, T, T)
    monkeypatch.setattr(pv, "PATTERNS_BUDGET", n * 2)  # u16 fits, f32 does not
    data = unpack(to_json(patching_data(loaded.model, ids(CLEAN), ids(CORRUPTED), (0, 1), tokenizer=TOK)))
    close(data["patterns"]["clean"], want["clean_patterns"], atol=1 / 65535)
    monkeypatch.setattr(pv, "PATTERNS_BUDGET", n // 2 - 1)
    data = patching_data(loaded.model, ids(CLEAN), ids(CORRUPTED), (0, 1), tokenizer=TOK)
    assert data["patterns"] is None and "too big" in data["patterns_note"]


@pytest.mark.parametrize(
    ("answers", "corrupted", "message"),
    [
        (("ab", "c"), CORRUPTED, "answers[0] 'ab' is 2 tokens ('a' + 'b'); an answer must be exactly one token"),
        (("a", ""), CORRUPTED, "answers[1] must be a token id or a text of exactly one token"),
        (("a", 99), CORRUPTED, "answers[1]: token id 99 is out of range, the vocabulary is [0, 29)"),
        (("a", "a"), CORRUPTED, "answers must be two different tokens"),
        (("a", "b"), "the dog sat", "clean and corrupted must have the same number of tokens"),
    ],
)
def test_bad_answers_and_prompts_are_named(checkpoint, answers, corrupted, message):
    _, loaded = checkpoint
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        patching_data(loaded.model, ids(CLEAN), ids(corrupted), answers, tokenizer=TOK)


def test_an_answer_that_needs_a_leading_space_says_so():
    class Words:  # " paris" is one token, "paris" two
        def encode(self, text):
            return {" paris": [5], "paris": [3, 4]}[text]

        def decode(self, ids):
            return {3: "par", 4: "is", 5: " paris"}[ids[0]]

    assert answer_token(Words(), " paris", 10) == 5
    with pytest.raises(ValueError, match=r"is 2 tokens \('par' \+ 'is'\).*' paris', with a leading space, is one"):
        answer_token(Words(), "paris", 10)


@pytest.mark.parametrize("site", ["head_out", "resid_pre", "head_out_by_pos", "k"])
@pytest.mark.parametrize("layers", [[1], [2, 0], range(3), (0, 1)])
def test_patching_some_layers_gives_those_rows_of_the_whole(checkpoint, site, layers):
    """What a server runs in pieces (layers=...), to take other requests between them."""
    _, loaded = checkpoint
    metric = logit_diff(3, 14)
    whole = activation_patching(loaded.model, ids(CLEAN), ids(CORRUPTED), metric, site)
    part = activation_patching(loaded.model, ids(CLEAN), ids(CORRUPTED), metric, site, layers=layers, max_tokens=50)
    close(part, whole[sorted(layers)], atol=1e-5)


@pytest.mark.parametrize("layers", [[], [3], [-1], [0, 0], [True], "0", 1])
def test_bad_layers_are_named(checkpoint, layers):
    _, loaded = checkpoint
    with pytest.raises(ValueError, match=r"layers must be distinct layer indices in \[0, 3\), at least one"):
        activation_patching(loaded.model, ids(CLEAN), ids(CORRUPTED), logit_diff(3, 14), "head_out", layers=layers)


# --------------------------------------------------------------------------------------------
# The inspector page (attnlab viz) and Jupyter
# --------------------------------------------------------------------------------------------
def test_viz_puts_the_precomputed_view_on_the_page(checkpoint, tmp_path, capsys):
    d, loaded = checkpoint
    out = tmp_path / "page.html"
    argv = ["viz", "--checkpoint", str(d), "--prompt", CLEAN, "--out", str(out), "--generate", "0"]
    assert main([*argv, "--corrupted", CORRUPTED, "--answers", "a", "o"]) == 0
    assert "activation patching (the Patching tab)" in capsys.readouterr().out
    page = out.read_text(encoding="utf-8")
    from attnlab.interpret import read_asset

    assert read_asset("patching.js") in page and read_asset("patching.css") in page
    got = read_page_data(page)["patching"]
    want = library(loaded.model, CLEAN, CORRUPTED, TOK.encode("a")[0], TOK.encode("o")[0])
    for site in ("head_out", "resid_pre"):
        close(got["sites"][site], want[site])
    close(got["patterns"]["corrupted"], want["corrupted_patterns"])
    assert got["corrupted"]["text"] == CORRUPTED and got["static"] is True
    # Without the options the page is as before: no patching files.
    assert main(argv) == 0
    page = out.read_text(encoding="utf-8")
    assert read_asset("patching.js") not in page and read_page_data(page).get("patching") is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--corrupted", CORRUPTED], "--corrupted needs --answers A B"),
        (["--answers", "a", "b"], "--answers needs --corrupted TEXT"),
        (["--corrupted", "the dog", "--answers", "a", "b"], "--prompt and --corrupted must have the same number"),
        (["--corrupted", CORRUPTED, "--answers", "ab", "b"], "'ab' is 2 tokens"),
    ],
)
def test_viz_patching_options_fail_in_one_line(checkpoint, tmp_path, capsys, extra, message):
    d, _ = checkpoint
    assert main(["viz", "--checkpoint", str(d), "--prompt", CLEAN, "--out", str(tmp_path / "p.html"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_viz_patching_needs_a_models_html_page(checkpoint, tmp_path, capsys):
    d, _ = checkpoint
    argv = ["viz", "--checkpoint", str(d), "--prompt", CLEAN, "--corrupted", CORRUPTED, "--answers", "a", "b"]
    assert main([*argv, "--out", str(tmp_path / "p.png")]) == 2
    assert "--out FILE.html" in capsys.readouterr().err


def test_a_patch_report_shows_the_same_view_in_jupyter(checkpoint):
    import html as html_lib

    from attnlab.interpret.page import read_asset
    from attnlab.tools.patch import patch_report

    _, loaded = checkpoint
    report = patch_report(loaded, CLEAN, CORRUPTED, ("a", "o"), ["head_out", "resid_pre"])
    frame = report._repr_html_()
    assert frame.startswith('<iframe class="attnlab-patching" sandbox="allow-scripts"')
    page = html_lib.unescape(frame.split('srcdoc="', 1)[1].rsplit('"></iframe>', 1)[0])
    for name in ("patching.js", "viewer.js", "patching.css", "viewer.css"):
        assert read_asset(name) in page  # the files themselves, inline
    start = page.index('id="attn-patch">') + len('id="attn-patch">')
    got = unpack(json.loads(page[start : page.index("</script>", start)]))["patching"]
    want = library(loaded.model, CLEAN, CORRUPTED, TOK.encode("a")[0], TOK.encode("o")[0])
    close(got["sites"]["head_out"], want["head_out"])
    close(got["sites"]["resid_pre"], want["resid_pre"])
    close(got["patterns"]["clean"], want["clean_patterns"])


def test_render_page_adds_the_patching_files_only_with_a_patching_section(checkpoint):
    from attnlab.interpret import inspector_data, read_asset, trace

    _, loaded = checkpoint
    data = inspector_data(trace(loaded.model, ids(CLEAN)[None]), sections=["layers"], roles=False)
    assert read_asset("patching.js") not in render_page(data)
    data["patching"] = patching_data(loaded.model, ids(CLEAN), ids(CORRUPTED), (0, 1), tokenizer=TOK)
    page = render_page(data)
    # patching.js registers its view before viewer.js runs showInspector
    assert page.index(read_asset("patching.js")) < page.index(read_asset("viewer.js"))


# --------------------------------------------------------------------------------------------
# attnlab serve: POST /api/patch
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(checkpoint):
    pytest.importorskip("fastapi", reason="attnlab serve needs the serve extra (pip install 'attnlab[serve]')")
    pytest.importorskip("httpx", reason="the serve tests need httpx (pip install 'attnlab[dev]')")
    from fastapi.testclient import TestClient

    from attnlab.tools.serve import Engine, create_app

    _, loaded = checkpoint
    engine = Engine(loaded)
    with TestClient(create_app(engine)) as c:
        c.engine = engine
        yield c


def test_the_api_answers_what_activation_patching_computes(client, checkpoint):
    _, loaded = checkpoint
    a, b = TOK.encode("a")[0], TOK.encode("o")[0]
    want = library(loaded.model, CLEAN, CORRUPTED, a, b)
    before = client.engine.snapshot()["model_calls"]
    r = client.post("/api/patch", json={"clean": CLEAN, "corrupted": CORRUPTED, "answers": [a, "o"]})
    assert r.status_code == 200, r.text
    # One model call for the two unpatched runs, then each site in pieces: other requests run in between.
    from attnlab.tools.serve.patching import layer_chunks

    assert layer_chunks(3) == [[0], [1], [2]]
    assert client.engine.snapshot()["model_calls"] - before == 1 + 2 * 3
    got = unpack(r.json())
    assert got["answers"] == [{"id": a, "label": "a"}, {"id": b, "label": "o"}]
    assert got["static"] is False and got["pattern"] is None and got["patterns"] is None
    assert got["sites"]["head_out"].shape == (3, 4) and got["sites"]["resid_pre"].shape == (3, len(CLEAN))
    for site in ("head_out", "resid_pre"):
        close(got["sites"][site], want[site])
    assert got["clean_value"] == pytest.approx(want["clean_value"], abs=1e-5)
    assert got["corrupted_value"] == pytest.approx(want["corrupted_value"], abs=1e-5)
    assert got["clean"]["labels"] == [c.replace(" ", "␣") for c in CLEAN]

    # A clicked head: its pattern on both prompts, no patching.
    r = client.post(
        "/api/patch", json={"clean": CLEAN, "corrupted": CORRUPTED, "answers": ["a", "o"], "sites": [], "head": "2.1"}
    )
    assert r.status_code == 200, r.text
    got = unpack(r.json())
    assert got["sites"] == {} and (got["pattern"]["layer"], got["pattern"]["head"]) == (2, 1)
    close(got["pattern"]["clean"], want["clean_patterns"][2, 1])
    close(got["pattern"]["corrupted"], want["corrupted_patterns"][2, 1])


def test_the_patching_assets_are_served_and_linked(client):
    from attnlab.interpret.page import read_asset

    page = client.get("/").text
    assert page.index('<script src="assets/patching.js">') < page.index('<script src="assets/viewer.js">')
    assert '<link rel="stylesheet" href="assets/patching.css">' in page
    for name, ctype in (("patching.js", "text/javascript"), ("patching.css", "text/css")):
        r = client.get(f"/assets/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(ctype) and r.text == read_asset(name)
    assert "/api/patch" in client.get("/openapi.json").json()["paths"]


GOOD = {"clean": CLEAN, "corrupted": CORRUPTED, "answers": ["a", "o"]}
BAD = [
    ({"corrupted": "the dog sat"}, 422, "clean and corrupted must have the same number of tokens"),
    ({"corrupted": CLEAN}, 422, "corrupted is the clean prompt itself"),
    ({"answers": ["at", "o"]}, 422, "answers[0] 'at' is 2 tokens"),
    ({"answers": ["a", 29]}, 422, "answers[1]: token id 29 is out of range"),
    ({"answers": ["a", -1]}, 422, "answers.1"),
    ({"answers": ["a", "a"]}, 422, "answers must be two different tokens"),
    ({"answers": [TOK.encode("a")[0], "a"]}, 422, "answers must be two different tokens"),
    ({"answers": ["a"]}, 422, "answers: List should have at least 2 items"),
    ({"answers": ["a", "b", "c"]}, 422, "answers: List should have at most 2 items"),
    ({"answers": ["a", ""]}, 422, "answers.1"),
    ({"corrupted": "the dog sat on a ma1"}, 422, "corrupted: character '1'"),
    ({"clean": "x" * 40, "corrupted": "y" * 40}, 422, "clean: the prompt is 40 tokens long, more than the model's"),
    ({"corrupted": ""}, 422, "corrupted: String should have at least 1 character"),
    ({"head": "3.0"}, 422, "head 3.0 does not exist"),
    ({"head": "x"}, 422, "head: String should match"),
    ({"sites": ["pattern"]}, 422, "sites.0"),
    ({"metric": "kl"}, 422, "metric: Extra inputs are not permitted"),
]


@pytest.mark.parametrize(("change", "status", "detail"), BAD)
def test_bad_patch_requests_get_a_4xx_naming_what_is_wrong(client, change, status, detail):
    before = client.engine.snapshot()["model_calls"]
    r = client.post("/api/patch", json={**GOOD, **change})
    assert r.status_code == status, r.text
    answer = r.json()
    assert list(answer) == ["detail"] and "\n" not in answer["detail"] and detail in answer["detail"], answer
    assert client.engine.snapshot()["model_calls"] == before  # refused before the model ran


@pytest.mark.parametrize("n_layers", [1, 2, 5, 12, 30, 80])
def test_a_site_is_cut_into_pieces_of_about_equal_cost(n_layers):
    from attnlab.tools.serve.patching import PIECES, layer_chunks

    chunks = layer_chunks(n_layers)
    assert [layer for chunk in chunks for layer in chunk] == list(range(n_layers))
    assert min(n_layers, PIECES - 2) <= len(chunks) <= PIECES + 1
    costs = [sum(n_layers - layer for layer in chunk) for chunk in chunks]
    if n_layers >= 2 * PIECES:  # a piece costs at most about twice its share
        assert max(costs) <= 2 * sum(costs) / PIECES, costs


def test_prompts_longer_than_the_patching_limit_are_refused(client, monkeypatch):
    import attnlab.tools.serve.patching as sp

    monkeypatch.setattr(sp, "MAX_PATCH_TOKENS", 12)
    r = client.post("/api/patch", json=GOOD)
    assert r.status_code == 422 and r.json()["detail"].startswith(f"clean is {len(CLEAN)} tokens long; patching takes")


def test_the_demo_server_has_no_patching(checkpoint):
    pytest.importorskip("fastapi", reason="attnlab serve needs the serve extra (pip install 'attnlab[serve]')")
    from fastapi.testclient import TestClient

    from attnlab.tools.serve import Engine, create_app
    from attnlab.tools.viz import demo_view, view_to_dict

    with TestClient(create_app(Engine(demo=view_to_dict(demo_view())))) as c:
        r = c.post("/api/patch", json=GOOD)
    assert r.status_code == 409 and "not a language model" in r.json()["detail"]


def test_a_loaded_model_is_required_for_a_text_answer():
    with pytest.raises(ValueError, match="needs a tokenizer"):
        answer_token(None, "a", 10, "answers[0]")


# --------------------------------------------------------------------------------------------
# SmolLM2: the cheap part of a request (the unpatched runs and a clicked head's pattern)
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_the_api_values_are_transformers_logit_difference(smollm2_gguf, smollm2_transformers):
    pytest.importorskip("fastapi", reason="attnlab serve needs the serve extra (pip install 'attnlab[serve]')")
    from fastapi.testclient import TestClient

    from attnlab.tools.loading import load_pretrained
    from attnlab.tools.serve import Engine, create_app

    hf, hf_tok = smollm2_transformers
    loaded = load_pretrained(str(smollm2_gguf))
    clean = "When Mary and John went to the store, John gave a drink to"
    corrupted = "When Mary and John went to the store, Mary gave a drink to"
    with TestClient(create_app(Engine(loaded))) as c:
        body = {"clean": clean, "corrupted": corrupted, "answers": [" Mary", " John"], "sites": [], "head": "23.3"}
        r = c.post("/api/patch", json=body)
        assert r.status_code == 200, r.text
        bad = c.post("/api/patch", json={**body, "answers": [" Mary", " Johnathan"]})
    got = unpack(r.json())
    a, b = (hf_tok.encode(t, add_special_tokens=False)[0] for t in (" Mary", " John"))
    assert [x["id"] for x in got["answers"]] == [a, b]
    before = hf.config._attn_implementation
    hf.set_attn_implementation("eager")  # the weights of output_attentions (the fixture is shared: put back)
    try:
        for name, text in (("clean", clean), ("corrupted", corrupted)):
            ids = hf_tok.encode(text, add_special_tokens=False)
            assert got[name]["ids"] == ids
            with torch.no_grad():
                out = hf(torch.tensor([ids]), output_attentions=True)
            want = float(out.logits[0, -1, a] - out.logits[0, -1, b])
            assert got[f"{name}_value"] == pytest.approx(want, abs=2e-3)
            close(got["pattern"][name], out.attentions[23][0, 3], atol=1e-4)
    finally:
        hf.set_attn_implementation(before)
    assert bad.status_code == 422 and "answers[1] ' Johnathan' is" in bad.json()["detail"]


@pytest.mark.slow
def test_typing_is_answered_between_the_pieces_of_a_patch_request(client, monkeypatch):
    """A patch request is many model calls: a prompt typed meanwhile (POST /api/inspect) is answered
    after the piece under way, long before the patching ends."""
    import threading
    import time

    import attnlab.tools.serve.patching as sp

    real = sp.activation_patching

    def slow(*args, **kwargs):  # each piece of a site takes 0.4 s: the patch request, about 2.4 s
        time.sleep(0.4)
        return real(*args, **kwargs)

    monkeypatch.setattr(sp, "activation_patching", slow)
    done = {}

    def patch() -> None:
        done["status"] = client.post("/api/patch", json=GOOD).status_code
        done["patched"] = time.perf_counter()

    t = threading.Thread(target=patch)
    t.start()
    time.sleep(0.6)  # into the patching
    r = client.post("/api/inspect", json={"prompt": "typed meanwhile", "sections": ["layers"]})
    typed = time.perf_counter()
    t.join()
    assert r.status_code == 200 and done["status"] == 200
    assert done["patched"] - typed > 0.8  # at least two pieces were still to come
