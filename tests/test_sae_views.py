"""SAE latents in the inspector page (``attnlab viz --sae``, its Features view), in ``attnlab inspect --sae``
and in ``attnlab serve --sae`` (the Features tab's routes): every figure compared with
:func:`~attnlab.interpret.sae_view.strongest_latents`, ``sae.encode`` and
:func:`~attnlab.interpret.sae_view.dashboard_data` computed here, steering with the
:func:`~attnlab.interpret.steer` context manager's own generation; bad ``--sae`` refused in one line."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.cli import main
from attnlab.generation import stream
from attnlab.interpret import (
    SAE,
    SAEConfig,
    hooks,
    inspector_data,
    read_page_data,
    render_page,
    steer,
    token_label,
    token_strings,
    trace,
)
from attnlab.interpret.sae_view import dashboard_data, features_sections, latent_logits, strongest_latents
from attnlab.model import GPT, GPTConfig
from attnlab.tokenizers import CharTokenizer
from attnlab.tools.loading import LoadedModel, load_model

pytestmark = pytest.mark.usefixtures("one_thread_module")

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
TOKENIZER = CharTokenizer(CHARS)
HOOK = "blocks.1.hook_resid_post"  # the last block's output: a strong push there moves the next token
PROMPT = "the cat sat on the mat, the dog ran."
TEXT = "a quick brown fox jumps over the lazy dog. she sells sea shells by the sea shore. " * 4


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=len(CHARS), context_length=48, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0)
    return GPT(cfg).eval()


def grab(model: GPT, idx: torch.Tensor, hook: str = HOOK) -> torch.Tensor:
    seen = {}
    with torch.no_grad(), hooks(model, {hook: lambda x, h: seen.setdefault("x", x.clone())}):
        model(idx)
    return seen["x"]  # (B, T, d)


def make_sae(model: GPT, seed: int = 0, d_sae: int = 48, k: int = 4, hook: str = HOOK) -> SAE:
    """A TopK SAE whose latents differ from token to token: centred on the model's activations, the
    encoder scaled to them (else the activations' common part picks the same latents everywhere)."""
    torch.manual_seed(seed)
    sae = SAE(SAEConfig(d_in=model.config.emb_dim, d_sae=d_sae, architecture="topk", k=k, hook_name=hook))
    x = grab(model, torch.tensor([TOKENIZER.encode(TEXT[:48])]), hook)
    with torch.no_grad():
        sae.b_dec.copy_(x.mean((0, 1)))
        sae.W_enc.copy_(torch.randn_like(sae.W_enc) / x.std())
        sae.W_dec.mul_(torch.rand(d_sae, 1) * 3)  # rows of different norms: a wrong row shows
    return sae.eval()


def encode_all(model: GPT, sae: SAE, idx: torch.Tensor) -> torch.Tensor:
    """Every latent on every token of ``idx (1, T)``, by ``sae.encode`` on the hook's activation: ``(T, d_sae)``."""
    with torch.no_grad():
        return sae.encode(grab(model, idx, sae.cfg.hook_name))[0]


def ids(text: str) -> torch.Tensor:
    return torch.tensor([TOKENIZER.encode(text)])


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_gpt()


@pytest.fixture(scope="module")
def sae(model) -> SAE:
    return make_sae(model)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model, sae) -> tuple[Path, Path, Path]:
    """The model as a training directory (with its tokenizer), the SAE saved (SAELens's format), a text file."""
    root = tmp_path_factory.mktemp("sae-views")
    d = model.save(root / "tiny")
    (d / "tokenizer.json").write_text(json.dumps(TOKENIZER.to_dict()))
    sae.save(root / "sae")
    text = root / "corpus.txt"
    text.write_text(TEXT, encoding="utf-8")
    return d, root / "sae", text


# --------------------------------------------------------------------------------------------
# The offline page's Features view
# --------------------------------------------------------------------------------------------
def test_the_pages_latents_are_strongest_latents_and_encode(model, sae):
    idx = ids(PROMPT)
    data = inspector_data(trace(model, idx, stages=True, tokenizer=TOKENIZER))
    data["features"] = features_sections(model, {"mine": sae}, idx[0], TOKENIZER, n=5)
    page = render_page(data)
    assert "class FeaturesView" in page and "const SAE_DASHBOARD" in page and "<script src" not in page
    got = read_page_data(page)["features"]
    assert len(got) == 1 and got[0]["name"] == "mine" and got[0]["hook"] == HOOK
    f = got[0]
    values, latents = strongest_latents(model, sae, idx, 5)
    np.testing.assert_array_equal(np.array(f["values"], dtype=np.float32), values.numpy())
    assert f["latents"] == latents.tolist()
    z = encode_all(model, sae, idx)  # (T, d_sae)
    assert (values[:, -1] == 0).all() and (values[:, 0] > 0).all()  # k=4 of 5: a listed zero, dropped below
    listed = {int(i) for i, v in zip(latents.flatten(), values.flatten(), strict=True) if v > 0}
    assert set(f["shown"]) == listed and len(listed) > 8  # the latents vary from token to token
    order = [float(z[:, i].max()) for i in f["shown"]]
    assert order == sorted(order, reverse=True)
    for i, latent in enumerate(f["shown"]):
        np.testing.assert_allclose(f["acts"][i], z[:, latent].numpy(), atol=1e-5)
        dash = f["dashboards"]["prompt"][i]
        assert dash["latent"] == latent
        assert math.isclose(dash["max"], float(z[:, latent].max()), rel_tol=1e-4)
        assert math.isclose(dash["density"], float((z[:, latent] != 0).double().mean()), rel_tol=1e-12)
        peak = int(z[:, latent].argmax())
        assert dash["examples"][0]["position"] == peak
    # The promoted tokens: the latent's decoder row through the unembedding.
    first = f["shown"][0]
    up = latent_logits(model, sae, torch.tensor([first]))[0].topk(8).indices.tolist()
    assert [t for t, _ in f["dashboards"]["prompt"][0]["promotes"]] == [token_label(TOKENIZER.decode([i])) for i in up]
    assert f["dashboards"]["corpus"] is None and "attnlab generate --steer" in f["steering"]
    assert read_page_data(render_page(inspector_data(trace(model, idx))))["features"] is None


def test_the_corpus_dashboards_are_dashboard_data_over_it(model, sae):
    idx = ids("the dog ran")
    corpus = np.array(TOKENIZER.encode(TEXT), dtype=np.int64)
    (f,) = features_sections(model, [sae], idx[0], TOKENIZER, corpus=corpus, corpus_tokens=200, corpus_name="t.txt")
    want = dashboard_data(
        model, sae, corpus, TOKENIZER, f["shown"], context=48, max_tokens=200, top_k=5, window=8, n_logits=8
    )
    want = json.loads(json.dumps(want, allow_nan=False))
    assert f["corpus"] == {"name": "t.txt", "tokens": 192} and want["tokens"] == 192
    assert f["dashboards"]["corpus"] == want["latents"] and f["dashboards"]["corpus"] != f["dashboards"]["prompt"]


def test_at_most_max_latents_dashboards_the_strongest(model, sae):
    idx = ids(PROMPT)
    (f,) = features_sections(model, [sae], idx[0], max_latents=3)
    z = encode_all(model, sae, idx)
    latents, values = torch.tensor(f["latents"]), torch.tensor(f["values"])
    listed = {int(i) for i in latents[values > 0]}
    want = sorted(listed, key=lambda i: -float(z[:, i].max()))[:3]
    assert f["shown"] == want and len(f["acts"]) == len(f["dashboards"]["prompt"]) == 3
    assert [d["latent"] for d in f["dashboards"]["prompt"]] == want
    with pytest.raises(ValueError, match="max_latents must be a positive int"):
        features_sections(model, [sae], idx[0], max_latents=0)
    with pytest.raises(TypeError, match="saes must hold attnlab SAEs"):
        features_sections(model, [model], idx[0])


def test_dashboards_of_a_model_whose_vocabulary_is_padded_past_its_tokenizer(sae):
    # (a vocabulary padded to a round size, as nanoGPT's 50,304: "ids must lie in [0, 29), got 29")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=len(CHARS) + 3, context_length=48, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0)
    padded = GPT(cfg).eval()
    with torch.no_grad():
        padded.out_head.weight[len(CHARS) :] = 50 * sae.W_dec[0]  # (the padded rows: latent 0's most promoted)
    data = dashboard_data(padded, sae, ids(TEXT)[0], TOKENIZER, [0, 1], context=48, top_k=3, window=8)
    promoted = [token for token, _ in data["latents"][0]["promotes"]]
    assert {f"#{i}" for i in range(len(CHARS), len(CHARS) + 3)} & set(promoted), promoted
    assert token_strings(TOKENIZER, [1, len(CHARS) + 2]) == [TOKENIZER.decode([1]), f"#{len(CHARS) + 2}"]


def test_viz_sae_writes_the_features_view(checkpoint, tmp_path, capsys):
    d, sae_dir, text = checkpoint
    out = tmp_path / "page.html"
    argv = ["viz", "--checkpoint", str(d), "--prompt", PROMPT, "--generate", "0", "--out", str(out)]
    code = main([*argv, "--sae", str(sae_dir), "--sae-data", str(text), "--sae-tokens", "100"])
    assert code == 0, capsys.readouterr().err
    assert "the latents of 1 SAE (the Features tab)" in capsys.readouterr().out
    (f,) = read_page_data(out.read_text(encoding="utf-8"))["features"]
    loaded = load_model(d)
    sae = SAE.load(sae_dir)
    values, latents = strongest_latents(loaded.model, sae, ids(PROMPT), 5)
    np.testing.assert_array_equal(np.array(f["values"], dtype=np.float32), values.numpy())
    assert f["latents"] == latents.tolist() and f["name"] == str(sae_dir)
    assert f["corpus"] == {"name": "corpus.txt", "tokens": 96}  # 100 tokens in windows of 48


def test_inspect_sae_lists_each_tokens_strongest_latents(checkpoint, capsys):
    d, sae_dir, _ = checkpoint
    assert main(["inspect", "--checkpoint", str(d), "--prompt", "the cat", "--top", "3", "--sae", str(sae_dir)]) == 0
    out = capsys.readouterr().out
    lines = out[out.index("Strongest latents of the SAE") :].splitlines()[1:]
    values, latents = strongest_latents(load_model(d).model, SAE.load(sae_dir), ids("the cat"), 3)
    assert len(lines) == len("the cat")
    for t, line in enumerate(lines):
        got = [(int(a), float(b)) for a, b in (cell.split(": ") for cell in line.split("#")[1:])]
        want = [(int(i), float(v)) for v, i in zip(values[t], latents[t], strict=True) if v > 0]
        assert [i for i, _ in got] == [i for i, _ in want]
        np.testing.assert_allclose([v for _, v in got], [v for _, v in want], atol=5e-4)


# --------------------------------------------------------------------------------------------
# A bad --sae: one line, exit 2, before the work
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bad_saes(tmp_path_factory, model) -> dict[str, tuple[Path, str]]:
    root = tmp_path_factory.mktemp("bad-saes")
    SAE(SAEConfig(d_in=32, d_sae=8, architecture="topk", k=2, hook_name="blocks.7.hook_resid_post")).save(root / "hook")
    SAE(SAEConfig(d_in=16, d_sae=8, architecture="topk", k=2, hook_name=HOOK)).save(root / "width")
    return {
        "missing": (root / "nowhere", "SAE not found"),
        "hook": (root / "hook", "is not a hook point of this model"),
        "width": (root / "width", "d_in=16 does not match the model's width 32"),
    }


@pytest.mark.parametrize("which", ["missing", "hook", "width"])
@pytest.mark.parametrize("command", ["viz", "inspect", "serve"])
def test_a_bad_sae_is_one_line_before_the_work(checkpoint, bad_saes, monkeypatch, capsys, command, which):
    import attnlab.cli.inspect
    import attnlab.cli.viz

    d, _, _ = checkpoint
    path, message = bad_saes[which]

    def never(*args, **kwargs):
        pytest.fail("the work began despite a bad --sae")

    monkeypatch.setattr(attnlab.cli.viz, "model_inspector", never)
    monkeypatch.setattr(attnlab.cli.inspect, "inspect_report", never)
    if command == "serve":
        serving()
        monkeypatch.setattr("attnlab.tools.serve.serve", never)
    if which == "missing":  # nothing read: not even the model (every command reads it through this load)
        monkeypatch.setattr("attnlab.tools.loading.load", never)
    argv = [command, "--checkpoint", str(d), "--prompt", "the cat", "--sae", str(path)]
    if command == "viz":
        argv += ["--out", "never.html"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"attnlab {command}: error: --sae {path}: ") and message in err, err


@pytest.mark.parametrize("command", ["viz", "serve"])
def test_a_missing_sae_data_file_is_one_line_before_the_model(checkpoint, monkeypatch, capsys, command, tmp_path):
    if command == "serve":
        serving()

    d, sae_dir, _ = checkpoint

    def never(*args, **kwargs):
        pytest.fail("the model was read despite a missing --sae-data")

    monkeypatch.setattr("attnlab.tools.loading.load", never)  # (every command reads its model through it)
    argv = [command, "--checkpoint", str(d), "--prompt", "the cat", "--sae", str(sae_dir)]
    argv += ["--sae-data", str(tmp_path / "none.txt")] + (["--out", "never.html"] if command == "viz" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: --sae-data: data file not found: {tmp_path / 'none.txt'}" in err, err


# --------------------------------------------------------------------------------------------
# attnlab serve --sae: the Features tab's routes
# --------------------------------------------------------------------------------------------
def serving():
    """The serve extra's test client and attnlab's app (the tests above need neither: they skip alone)."""
    pytest.importorskip("fastapi", reason="attnlab serve needs the serve extra (pip install 'attnlab[serve]')")
    pytest.importorskip("httpx", reason="the serve tests need httpx (pip install 'attnlab[dev]')")
    from fastapi.testclient import TestClient

    from attnlab.tools.serve import Engine, Limits, create_app

    return TestClient, Engine, Limits, create_app


CORPUS = np.array(TOKENIZER.encode(TEXT), dtype=np.int64)[:150]


@pytest.fixture(scope="module")
def client(model, sae, tmp_path_factory):
    TestClient, Engine, Limits, create_app = serving()
    loaded = LoadedModel(model, TOKENIZER, tmp_path_factory.mktemp("served"))
    engine = Engine(loaded, limits=Limits(max_new_tokens=24), saes={"mine": sae}, sae_corpus=CORPUS,
                    sae_corpus_name="corpus.txt")  # fmt: skip
    with TestClient(create_app(engine, allowed_hosts={"testserver"})) as c:
        yield c


def test_info_names_the_saes_and_the_corpus(client):
    info = client.get("/api/info").json()
    assert info["saes"] == [
        {"index": 0, "name": "mine", "hook": HOOK, "d_sae": 48, "architecture": "topk", "transcoder": False}
    ]
    # the corpus's 150 tokens are read in whole windows of the model's 48: 144, as the dashboards say
    assert info["sae_corpus"] == {"name": "corpus.txt", "tokens": 144}
    page = client.get("/").text
    assert '<script src="assets/features.js">' in page and '<script src="assets/sae_dashboard.js">' in page
    assert "class FeaturesView" in client.get("/assets/features.js").text


def test_features_are_strongest_latents(client, model, sae):
    r = client.post("/api/features", json={"prompt": PROMPT, "n": 6})
    assert r.status_code == 200, r.text
    got = r.json()
    values, latents = strongest_latents(model, sae, ids(PROMPT), 6)
    np.testing.assert_array_equal(np.array(got["values"], dtype=np.float32), values.numpy())
    assert got["latents"] == latents.tolist() and got["ids"] == TOKENIZER.encode(PROMPT)
    assert got["labels"][3] == "␣"


def test_a_latents_activations_and_dashboards(client, model, sae):
    z = encode_all(model, sae, ids(PROMPT))
    latent = int(z.amax(0).argmax())  # the prompt's strongest latent
    r = client.post("/api/latent", json={"prompt": PROMPT, "latent": latent})
    assert r.status_code == 200, r.text
    got = r.json()
    np.testing.assert_allclose(got["acts"], z[:, latent].numpy(), atol=1e-6)
    prompt_ids = ids(PROMPT)[0]
    want = dashboard_data(model, sae, prompt_ids, TOKENIZER, [latent], context=len(prompt_ids), top_k=5, window=8)
    assert got["over"] == "prompt" and got["tokens"] == len(prompt_ids)
    assert got["dashboard"] == json.loads(json.dumps(want["latents"][0]))
    r = client.post("/api/latent", json={"prompt": PROMPT, "latent": latent, "over": "corpus", "top_k": 3})
    got = r.json()
    want = dashboard_data(model, sae, CORPUS, TOKENIZER, [latent], context=48, top_k=3, window=8)
    assert got["tokens"] == want["tokens"] == 144 and got["corpus"] == "corpus.txt"
    assert got["dashboard"] == json.loads(json.dumps(want["latents"][0]))
    # The corpus was read once for every latent: another latent's dashboard is its row of those statistics.
    other = int(z.amax(0).argsort()[-2])
    got = client.post("/api/latent", json={"prompt": "x", "latent": other, "over": "corpus", "top_k": 3}).json()
    want = dashboard_data(model, sae, CORPUS, TOKENIZER, [other], context=48, top_k=3, window=8)
    assert got["dashboard"] == json.loads(json.dumps(want["latents"][0]))
    np.testing.assert_allclose(got["acts"], encode_all(model, sae, ids("x"))[:, other].numpy(), atol=1e-6)


@pytest.mark.parametrize("over", ["prompt", "corpus"])
def test_more_promoted_tokens_than_the_vocabulary_holds_are_all_of_it(client, model, sae, over):
    # (n_logits 50 of a 29-token vocabulary: topk's "selected index k out of range", a 500)
    r = client.post("/api/latent", json={"prompt": PROMPT, "latent": 0, "n_logits": 50, "over": over})
    assert r.status_code == 200, r.text
    promoted = r.json()["dashboard"]["promotes"]
    assert len(promoted) == len(CHARS) == model.config.vocab_size


def test_a_corpus_read_for_more_examples_serves_fewer_and_narrower_without_reading_it_again(
    model, sae, tmp_path, monkeypatch
):
    # Each (top_k, window) was a pass over the whole corpus, and four were kept: a reader trying the
    # settings waited for a pass at every change.
    import attnlab.tools.serve.features as features

    _, Engine, _, _ = serving()
    engine = Engine(LoadedModel(model, TOKENIZER, tmp_path), saes={"mine": sae}, sae_corpus=CORPUS)
    passes, collect = [], features.collect
    monkeypatch.setattr(features, "collect", lambda *a, **kw: passes.append(kw) or collect(*a, **kw))
    latent = int(encode_all(model, sae, ids(PROMPT)).amax(0).argmax())
    for top_k, window in ((5, 8), (3, 8), (2, 4), (5, 0), (6, 8)):
        got = features.latent_answer(engine, PROMPT, latent, over="corpus", top_k=top_k, window=window)
        want = dashboard_data(model, sae, CORPUS, TOKENIZER, [latent], context=48, top_k=top_k, window=window)
        assert got["dashboard"] == want["latents"][0], (top_k, window)
    assert [(kw["top_k"], kw["window"]) for kw in passes] == [(5, 8), (6, 8)]  # (more examples: a pass)


def _stream(model, sae, prompt, n, seed, temperature, pushes=()):
    """``n`` tokens as the ``steer`` context manager's own run draws them (nested blocks, one per latent)."""
    g = torch.Generator().manual_seed(seed)
    with contextlib.ExitStack() as stack:
        for latent, strength in pushes:
            stack.enter_context(steer(model, sae, latent, strength))
        return [int(t[0]) for t in stream(model, ids(prompt), n, temperature=temperature, generator=g)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_steering_is_the_steer_context_managers_generation(client, model, sae, temperature):
    pushes = [(5, 30.0), (17, -12.5)]
    body = {"prompt": "the cat", "steer": [{"latent": a, "strength": s} for a, s in pushes], "max_new_tokens": 12}
    r = client.post("/api/steer", json=body | {"temperature": temperature, "seed": 7})
    assert r.status_code == 200, r.text
    got = r.json()
    steered = _stream(model, sae, "the cat", 12, 7, temperature, pushes)
    plain = _stream(model, sae, "the cat", 12, 7, temperature)
    assert got["steered"]["tokens"] == steered and got["plain"]["tokens"] == plain
    assert got["steered"]["text"] == TOKENIZER.decode(steered)
    if temperature == 0:  # (the tiny model's sampled tokens barely depend on its near-uniform distribution)
        assert steered != plain  # a strong push shows
    assert got["hook"] == HOOK and got["steering"] == [
        {"latent": 5, "strength": 30.0},
        {"latent": 17, "strength": -12.5},
    ]
    # Strength 0 leaves the tokens as they were; compare=false skips the unsteered run.
    body = {"prompt": "the cat", "steer": [{"latent": 5, "strength": 0}], "max_new_tokens": 12, "compare": False}
    got = client.post("/api/steer", json=body | {"temperature": temperature, "seed": 7}).json()
    assert got["steered"]["tokens"] == plain and got["plain"] is None


def test_steering_lets_other_requests_run_between_its_tokens(model, sae, tmp_path):
    # The whole steered generation (and its unsteered twin) was one model call: every other request
    # waited for it, minutes on a real model. Now each token is a call of its own, and a request that
    # runs between two of them sees the model unsteered, and leaves the generation as it was.
    from attnlab.tools.serve.features import steer_answer

    _, Engine, _, _ = serving()
    engine = Engine(LoadedModel(model, TOKENIZER, tmp_path), saes={"mine": sae})
    run, between = engine.run, []

    def run_then_another_request(fn):
        out = run(fn)
        between.append(run(lambda: model(ids("the dog"))[0, -1]))  # (B, T, V) -> (V,)
        return out

    engine.run = run_then_another_request
    pushes = [(5, 30.0)]
    got = steer_answer(engine, "the cat", pushes, 12, temperature=0.0, seed=7)
    assert got["steered"]["tokens"] == _stream(model, sae, "the cat", 12, 7, 0.0, pushes)
    assert got["plain"]["tokens"] == _stream(model, sae, "the cat", 12, 7, 0.0)
    assert len(between) == 2 * 13  # each token's call, and the one that finds the stream ended
    with torch.no_grad():
        want = model(ids("the dog"))[0, -1]
    assert all(torch.equal(b, want) for b in between)


@pytest.mark.parametrize(
    ("route", "body", "status", "message"),
    [
        ("latent", {"latent": 48}, 422, "latent: 48 is out of range: the SAE has d_sae=48"),
        ("latent", {"latent": -1}, 422, "latent: Input should be greater than or equal to 0"),
        ("latent", {"latent": 1, "sae": 1}, 422, "sae: 1 is out of range: 1 SAE(s) loaded"),
        ("features", {"n": 0}, 422, "n: Input should be greater than or equal to 1"),
        ("steer", {"steer": [{"latent": 3, "strength": 1}, {"latent": 99, "strength": 1}]}, 422, "steer.1.latent: 99"),
        (
            "steer",
            {"steer": [{"latent": 3, "strength": float("nan")}]},
            422,
            "steer.0.strength: Input should be a finite",
        ),
        (
            "steer",
            {"steer": [{"latent": 3, "strength": float("inf")}]},
            422,
            "steer.0.strength: Input should be a finite",
        ),
        ("steer", {"steer": []}, 422, "steer: List should have at least 1 item"),
        ("steer", {"steer": [{"latent": 3, "strength": 1}], "max_new_tokens": 25}, 422, "max_new_tokens: 25 is more"),
    ],
)
def test_bad_requests_name_the_field(client, route, body, status, message):
    r = client.post(f"/api/{route}", content=json.dumps({"prompt": "the cat", **body}),
                    headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == status, r.text
    detail = r.json()["detail"]
    assert message in detail and "\n" not in detail, detail


def test_without_an_sae_the_routes_say_so(model, tmp_path):
    TestClient, Engine, _, create_app = serving()
    engine = Engine(LoadedModel(model, TOKENIZER, tmp_path))
    with TestClient(create_app(engine, allowed_hosts={"testserver"})) as c:
        assert c.get("/api/info").json()["saes"] == []
        for route, body in (
            ("features", {}),
            ("latent", {"latent": 0}),
            ("steer", {"steer": [{"latent": 0, "strength": 1}]}),
        ):
            r = c.post(f"/api/{route}", json={"prompt": "the cat", **body})
            assert r.status_code == 409 and r.json()["detail"].startswith("sae: this server has no SAE loaded"), r.text
    corpusless = Engine(LoadedModel(model, TOKENIZER, tmp_path), saes={"s": make_sae(model)})
    with TestClient(create_app(corpusless, allowed_hosts={"testserver"})) as c:
        r = c.post("/api/latent", json={"prompt": "the cat", "latent": 0, "over": "corpus"})
        assert r.status_code == 422 and r.json()["detail"].startswith("over: this server was started without a corpus")
