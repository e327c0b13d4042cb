"""``attnlab serve``: the server started as a user starts it (``python -m attnlab serve ... --port 0``
in a child process, its address read from stdout), asked over HTTP, its answers compared with what
:mod:`attnlab.interpret` computes in this process on the same checkpoint. Also: the bad-request table,
body limits that count the bytes actually sent, static files that cannot leave the assets, a client
that disconnects stopping its generation, 16 concurrent clients, Ctrl-C, and the warning when bound
to another address.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import get_args

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aten_ops import AtenOps
from attnlab.cli import main
from attnlab.interpret import (
    ablation_effect,
    all_head_scores,
    inspector_data,
    next_token_probabilities,
    trace,
    trace_generation,
)
from attnlab.interpret.codec import pack, to_json, unpack
from attnlab.interpret.inspector import SECTIONS
from attnlab.model import GPT, GPTConfig
from attnlab.tokenizers import CharTokenizer
from attnlab.tools.loading import LoadedModel, load_model

pytestmark = pytest.mark.usefixtures("one_thread_module")  # one torch thread (conftest.py)

fastapi = pytest.importorskip("fastapi", reason="attnlab serve needs the serve extra (pip install 'attnlab[serve]')")
httpx = pytest.importorskip("httpx", reason="the serve tests need httpx (pip install 'attnlab[dev]')")

from fastapi.testclient import TestClient  # noqa: E402

from attnlab.tools.serve import Engine, Limits, create_app  # noqa: E402
from attnlab.tools.serve.api import Section  # noqa: E402
from attnlab.tools.serve.app import packed_json  # noqa: E402
from attnlab.tools.viz import demo_view, view_to_dict  # noqa: E402

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
CONTEXT = 48
TOKENIZER = CharTokenizer(CHARS)
MAX_NEW = 2000  # the test server's cap: long enough that a generation outlives any disconnect
PROMPTS = [
    "the cat sat on the mat, the cat sat.",
    "a bad dog",
    "x",
    "abc abc abc abc",
    "she sells sea shells by the sea shore",
    "one, two, three, four, five",
    "quiet",
    "the quick brown fox jumps over the lazy dog.",
]


def sharp_gpt(seed: int = 0, **overrides) -> GPT:
    """A small GPT whose attention and next-token distributions are far from uniform."""
    torch.manual_seed(seed)
    cfg = dict(vocab_size=len(CHARS), context_length=CONTEXT, emb_dim=32, n_heads=4, n_layers=3, drop_rate=0.0)
    model = GPT(GPTConfig(**{**cfg, **overrides})).eval()
    with torch.no_grad():
        for block in model.trf_blocks:
            block.att.W_query.weight.normal_(0, 0.5)
            block.att.W_key.weight.normal_(0, 0.5)
            block.att.out_proj.weight.normal_(0, 0.3)  # heads that matter: ablating one shows
        model.tok_emb.weight.normal_(0, 0.15)
    return model


def save_checkpoint(model: GPT, directory: Path) -> Path:
    d = model.save(directory)
    (d / "tokenizer.json").write_text(json.dumps(CharTokenizer(CHARS).to_dict()))
    return d


class Server:
    """``python -m attnlab serve ARGS --port 0`` in a child process, at the address it prints."""

    def __init__(self, *args: str, env: dict[str, str], timeout: float = 120, compile: bool = False):
        # (--no-compile: compiling the decoding step in the background costs each server a minute of CPU)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "attnlab", "serve", *args, *([] if compile else ["--no-compile"]), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            first = self.lines.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            raise RuntimeError(f"attnlab serve printed no address within {timeout} s") from None
        m = re.search(r" at (http://\S+?)/? \(", first)
        if m is None:
            self.proc.kill()
            raise RuntimeError(f"attnlab serve did not start: {first!r} {self.proc.stderr.read()}")
        self.url, self.first_line = m.group(1), first
        self.host, self.port = "127.0.0.1", int(self.url.rsplit(":", 1)[1])

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30) -> tuple[int, str]:
        """Send ``sig``; the exit status and stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        return self.proc.returncode, self.proc.stderr.read()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, LoadedModel]:
    d = save_checkpoint(sharp_gpt(), tmp_path_factory.mktemp("serve") / "sharp")
    return d, load_model(d)


@pytest.fixture(scope="module")
def server(checkpoint, subprocess_env):
    s = Server("--checkpoint", str(checkpoint[0]), "--max-new-tokens", str(MAX_NEW), env=subprocess_env)
    yield s
    code, err = s.stop()
    assert code == 130 and "Traceback" not in err, (code, err)


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def ids_of(loaded: LoadedModel, prompt: str) -> torch.Tensor:
    return torch.tensor([loaded.tokenizer.encode(prompt)])


def events(lines) -> list[tuple[str, dict]]:
    """Server-sent events ``(name, data)`` from the lines of a response."""
    out, name = [], None
    for line in lines:
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            out.append((name, json.loads(line[5:])))
    return out


def close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)


# --------------------------------------------------------------------------------------------
# Answers equal the library's
# --------------------------------------------------------------------------------------------
def test_the_api_sections_are_the_inspectors():
    assert set(get_args(Section)) == set(SECTIONS)


@pytest.mark.slow
def test_info_and_tokens(client, checkpoint):
    _, loaded = checkpoint
    cfg = loaded.model.config
    info = client.get("/api/info").json()
    assert info["language_model"] is True
    assert info["model"]["n_layers"] == cfg.n_layers and info["model"]["n_heads"] == cfg.n_heads
    assert info["limits"]["max_prompt_tokens"] == CONTEXT and info["limits"]["max_new_tokens"] == MAX_NEW
    r = client.post("/api/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert r["ids"] == loaded.tokenizer.encode(PROMPTS[0])
    assert r["labels"][3] == "␣"


def test_inspect_returns_what_inspector_data_computes(client, checkpoint):
    _, loaded = checkpoint
    prompt = PROMPTS[0]
    tr = trace(loaded.model, ids_of(loaded, prompt), stages=True, tokenizer=loaded.tokenizer)
    want = unpack(to_json(inspector_data(tr, steps=["1.2", "2.0"], title=prompt, text=prompt, model_name="sharp")))
    r = client.post("/api/inspect", json={"prompt": prompt, "sections": list(SECTIONS), "steps": ["1.2", "2.0"]})
    assert r.status_code == 200, r.text
    got = unpack(r.json())
    assert got["tokens"] == want["tokens"] and got["labels"] == want["labels"]
    assert got["ids"] == loaded.tokenizer.encode(prompt)
    assert got["precision"] == want["precision"] == "f32"
    for mine, theirs in zip(got["layers"], want["layers"], strict=True):
        assert mine["layer"] == theirs["layer"] and mine["heads"] == theirs["heads"]
        close(mine["weights"], theirs["weights"])
    assert [(h["row"], h["head"]) for h in got["steps"]["heads"]] == [(1, 2), (2, 0)]
    for mine, theirs in zip(got["steps"]["heads"], want["steps"]["heads"], strict=True):
        for name in ("q", "k", "v", "scores", "allowed", "weights", "head_outputs"):
            close(mine[name], theirs[name], 1e-5)
    for name in ("ids", "probs"):
        close(got["next"][name], want["next"][name])
    for fusion in ("mean", "max", "min"):
        close(got["rollout"][fusion], want["rollout"][fusion])
    for name in ("ids", "probs", "final_probs"):
        close(got["lens"][name], want["lens"][name])
    roles = all_head_scores(loaded.model)
    for kind, scores in got["roles"]["scores"].items():
        close(scores, roles[kind])
    assert got["vocab"] == want["vocab"]


def test_sections_are_computed_on_demand_and_traces_reused(client):
    prompt = "on demand, on demand"
    before = client.get("/api/stats").json()
    r = client.post("/api/inspect", json={"prompt": prompt}).json()  # the heads only: the typing path
    assert len(r["layers"]) == 3 and r["lens"] is None and r["next"] is None and r["roles"] is None
    r = client.post("/api/inspect", json={"prompt": prompt, "sections": ["lens"]}).json()
    assert r["layers"] == [] and r["lens"] is not None and r["rollout"] is None
    client.post("/api/next", json={"prompt": prompt, "temperature": 0.5})
    r = client.post("/api/inspect", json={"prompt": prompt, "sections": ["layers", "rollout"]}).json()
    assert len(r["layers"]) == 3 and r["rollout"] is not None
    after = client.get("/api/stats").json()
    # Typing traces the attention alone; the lens needs the stages and the logits: a second pass, which
    # the next-token answer and the heads view reuse.
    assert after["traces"] - before["traces"] == 2
    assert after["trace_cache_hits"] - before["trace_cache_hits"] == 2


def test_the_lens_of_a_window_is_that_slice_of_the_whole_lens(client):
    prompt = "a window of the lens"
    whole = unpack(client.post("/api/inspect", json={"prompt": prompt, "sections": ["lens"]}).json())["lens"]
    body = {"prompt": prompt, "sections": ["lens"], "lens_window": [3, 9]}
    part = unpack(client.post("/api/inspect", json=body).json())["lens"]
    assert (whole["start"], part["start"]) == (0, 3) and part["ids"].shape[1] == 6
    for name in ("ids", "probs", "final_probs"):
        torch.testing.assert_close(part[name], whole[name][:, 3:9])


def typed(text: str, deletions: dict[int, int]) -> list[str]:
    """The prompts a reader sends typing ``text`` a character at a time; after character ``i`` in
    ``deletions``, that many backspaces, one request each."""
    out = []
    for i in range(1, len(text) + 1):
        out.append(text[:i])
        for n in range(1, deletions.get(i, 0) + 1):
            out.append(text[: i - n])
    return [p for p in out if p]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_typing_runs_only_the_new_tokens_and_answers_as_a_fresh_trace(tmp_path):
    """Each keystroke's heads view (and rollout) equals what inspector_data computes from a fresh trace
    of the whole prompt, while the model runs only on the tokens after the prefix shared with a
    recent prompt (a deletion back to a prompt seen before costs no pass at all)."""
    model = sharp_gpt()
    loaded = LoadedModel(model, CharTokenizer(CHARS), tmp_path)
    engine = Engine(loaded)
    prompts = typed("the cat sat on it.", {5: 2, 12: 4})
    run, seen = 0, set()
    for prompt in prompts:
        ids = loaded.tokenizer.encode(prompt)
        before = engine.snapshot()
        got = unpack(to_json(engine.inspect(prompt, ["layers", "rollout"])))
        after = engine.snapshot()
        tr = trace(model, torch.tensor([ids]), stages=False, logits=False)
        want = unpack(to_json(inspector_data(tr, sections={"layers", "rollout"}, title=prompt, text=prompt)))
        assert got["precision"] == want["precision"] == "f32"
        # Equal up to float rounding: the new rows come from products of other shapes (see test_prefix.py;
        # hardware.linear's kernel rounds them differently by up to some 6e-6 of a weight here).
        for mine, theirs in zip(got["layers"], want["layers"], strict=True):
            torch.testing.assert_close(mine["weights"], theirs["weights"], rtol=1e-5, atol=1e-5)
        for fusion in ("mean", "max", "min"):
            torch.testing.assert_close(got["rollout"][fusion], want["rollout"][fusion], rtol=1e-5, atol=1e-5)
        # The longest prefix shared with a prompt seen before (the engine keeps the recent ones).
        shared = max((common_prefix(ids, list(q)) for q in seen), default=0)
        assert after["tokens_run"] - before["tokens_run"] == len(ids) - shared, prompt
        run += len(ids) - shared
        seen.add(tuple(ids))
    total = sum(len(p) for p in prompts)
    assert engine.snapshot()["tokens_run"] == run < total / 5  # one character, one token: a fifth is generous
    assert engine.snapshot()["prefix_reuses"] > len(prompts) / 2


def test_kept_traces_stay_within_their_memory(tmp_path):
    """With no memory for them, only the latest prompt's keys and values are kept: typing on an older
    prompt runs it whole again."""
    loaded = LoadedModel(sharp_gpt(), CharTokenizer(CHARS), tmp_path)
    for kept_bytes, reused in ((512 << 20, True), (0, False)):
        engine = Engine(loaded, kept_bytes=kept_bytes)
        engine.inspect("a long first prompt", ["layers"])
        engine.inspect("no shared start", ["layers"])
        before = engine.snapshot()["tokens_run"]
        engine.inspect("a long first prompt, typed on", ["layers"])
        assert engine.snapshot()["tokens_run"] - before == (
            len(", typed on") if reused else len("a long first prompt, typed on")
        )


def test_head_roles_are_computed_at_start_in_the_background(tmp_path):
    """warm_up (which attnlab serve calls once it listens) computes the head roles on the model's thread:
    the first request for them runs no pass but its prompt's, and gets what all_head_scores computes."""
    model = sharp_gpt()
    engine = Engine(LoadedModel(model, CharTokenizer(CHARS), tmp_path))
    engine.warm_up()
    engine.run(lambda: None)  # queued behind the warm-up: it has finished
    passes: list[int] = []
    handle = model.trf_blocks[0].register_forward_pre_hook(lambda m, a: passes.append(a[0].shape[1]))
    try:
        got = unpack(to_json(engine.inspect("roles now", ["roles"])))
    finally:
        handle.remove()
    assert passes == [len("roles now")]
    for kind, scores in all_head_scores(model).items():
        close(got["roles"]["scores"][kind], scores)


def test_repeated_layers_and_heads_are_shown_once_and_a_too_long_trace_is_refused(tmp_path):
    """A request repeating a layer or head 4096 times asked for as many copies of its maps (one small
    request used 20 GB); a prompt whose maps pass Limits.max_trace_bytes is refused before tracing."""
    from attnlab.interpret import inspector_data

    model = sharp_gpt()
    engine = Engine(
        LoadedModel(model, CharTokenizer(CHARS), tmp_path), limits=Limits(max_trace_bytes=3 * 4 * 12 * 12 * 4)
    )
    once = to_json(engine.inspect("abcab", ["layers"], layers=[1, 0], heads=[2, 3]))
    many = to_json(engine.inspect("abcab", ["layers"], layers=[1, 0] * 300 + [-2], heads=[2, 3, -1] * 300))
    assert many == once and [entry["layer"] for entry in unpack(once)["layers"]] == [1, 0]
    tr = trace(model, torch.tensor([[0, 1, 2]]), stages=True, logits=True)
    twice, single = (
        to_json(inspector_data(tr, layers=ls, heads=hs, sections=["layers"]))
        for ls, hs in (([0, 0, -3], [1, 1]), ([0], [1]))
    )
    assert twice == single
    engine.inspect("abcabcabcabc", ["layers"])  # 12 tokens: within the limit
    with pytest.raises(ValueError, match=r"the prompt is 13 tokens: .* inspect at most 12 tokens"):
        engine.inspect("abcabcabcabca", ["layers"])


def test_a_server_on_another_loopback_address_takes_requests_naming_it():
    # Regression: bound to 127.0.0.2 (loopback), the Host check knew 127.0.0.1 and localhost only, and
    # every request, the page's own included, got a 400.
    from attnlab.tools.serve.server import allowed_hosts

    assert {"127.0.0.2", "127.0.0.1", "localhost"} <= allowed_hosts("127.0.0.2")
    assert "::1" in allowed_hosts("[::1]") and allowed_hosts("0.0.0.0") is None
    with TestClient(create_app(Engine(demo=view_to_dict(demo_view())), allowed_hosts=allowed_hosts("127.0.0.2"))) as c:
        assert c.get("/api/info", headers={"host": "127.0.0.2:8766"}).status_code == 200
        assert c.get("/api/info", headers={"host": "evil.example"}).status_code == 400


def test_an_answers_maps_past_the_limit_are_refused_naming_what_to_ask_for(tmp_path):
    """One 10 KB request (1,000 tokens, every layer in f32) once built a 1.4 GB answer and took the
    server to 9.7 GB: the heads view is bounded by Limits.max_maps_bytes in the precision it is sent."""
    model = sharp_gpt()  # 3 layers x 4 heads
    maps = lambda T, dtype_bytes, L=3, H=4: L * H * T * (T + 1) // 2 * dtype_bytes
    engine = Engine(LoadedModel(model, CharTokenizer(CHARS), tmp_path), limits=Limits(max_maps_bytes=maps(10, 4)))
    engine.inspect("abcabcabca", ["layers"], precision="f32")  # 10 tokens in f32: at the limit
    with pytest.raises(ValueError, match=r"the heads view of 11 tokens, 3 layers x 4 heads in f32, .* fewer layers"):
        engine.inspect("abcabcabcab", ["layers"], precision="f32")
    engine.inspect("abcabcabcab", ["layers"], precision="u8")  # a quarter of the bytes
    engine.inspect("abcabcabcab", ["layers"], layers=[0], precision="f32")  # a third of the maps
    assert maps(25, 1) > maps(10, 4)
    with pytest.raises(ValueError, match="in u8"):  # (the coarsest precision, and still too large)
        engine.inspect("abcab" * 5, ["layers"], precision="u8")


def test_the_traces_kept_hold_at_most_max_trace_bytes(tmp_path):
    # Three different 1,410-token prompts' traces, all kept, took the server past 6 GB.
    from attnlab.tools.serve.engine import _nbytes

    model = sharp_gpt()
    engine = Engine(LoadedModel(model, CharTokenizer(CHARS), tmp_path))
    engine.inspect("abcabcabca", ["layers", "lens"])
    one = _nbytes(next(iter(engine._traces.values())))
    engine = Engine(LoadedModel(model, CharTokenizer(CHARS), tmp_path), limits=Limits(max_trace_bytes=2 * one + 1))
    for prompt in ("abcabcabca", "bcabcabcab", "cabcabcabc"):
        engine.inspect(prompt, ["layers", "lens"])
    assert len(engine._traces) == 2 and sum(_nbytes(t) for t in engine._traces.values()) <= 2 * one + 1
    assert engine.inspect("cabcabcabc", ["layers"])  # (the latest is the one kept last)


def test_named_heads_steps_past_the_limit_are_refused(tmp_path):
    # 256 named heads' steps on 450 tokens: a 642 MB answer and 2.5 GB of the server's memory, no limit.
    from attnlab.interpret.inspector import steps_cost

    model = sharp_gpt()  # 3 layers x 4 heads
    hd = model.config.head_dim
    engine = Engine(
        LoadedModel(model, CharTokenizer(CHARS), tmp_path), limits=Limits(max_maps_bytes=2 * steps_cost(10, 10, hd))
    )
    assert engine.inspect("abcabcabca", ["steps"], steps=["0.0", "1.1"])["steps"]  # two heads at the limit
    with pytest.raises(ValueError, match=r"the steps of 3 heads on 10 tokens .* name fewer heads"):
        engine.inspect("abcabcabca", ["steps"], steps=["0.0", "1.1", "2.2"])
    engine.inspect("abcabcabca", ["steps"])  # ("auto": the page's own budget)


@settings(max_examples=40, deadline=None)
@given(
    text=st.text(max_size=30) | st.sampled_from(['"attnlab-', 'attnlab-0"', '\\"b64"', "\u2028\x00"]),
    sizes=st.lists(st.integers(0, 40), max_size=4),
)
def test_answers_are_the_json_of_the_packed_arrays(text, sizes):
    """The server's byte-spliced JSON is exactly ``json.dumps(to_json(data))``, whatever text the
    answer carries around its arrays."""
    data = {
        "text": text,
        "arrays": [pack(torch.rand(n)) for n in sizes],
        "nested": {text: [pack(torch.rand(2, 2), "u16", tri=True), None, 1.5, True]},
    }
    want = json.dumps(to_json(data), ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    assert packed_json(data) == want.encode()
    assert unpack(json.loads(packed_json(data)))["text"] == text


@pytest.mark.parametrize(
    ("position", "temperature", "top_k", "top_p"),
    [(-1, 1.0, None, None), (3, 0.7, 5, None), (10, 1.5, None, 0.3), (-2, 0.8, 8, 0.9), (0, 0.0, None, None)],
)
def test_next_tokens_are_the_sampling_distribution(client, checkpoint, position, temperature, top_k, top_p):
    _, loaded = checkpoint
    prompt = PROMPTS[0]
    body = {"prompt": prompt, "position": position, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    r = client.post("/api/next", json={**body, "k": 10}).json()
    logits = trace(loaded.model, ids_of(loaded, prompt)).logits[0, position]
    want = next_token_probabilities(logits[None], temperature=temperature, top_k=top_k, top_p=top_p)[0]
    top = torch.topk(want, 10)
    assert r["position"] == position % len(prompt) and r["greedy"] == (temperature == 0)
    nonzero = int((top.values > 0).sum())
    assert r["ids"][:nonzero] == top.indices[:nonzero].tolist()
    close(torch.tensor(r["probs"]), want[r["ids"]])
    assert r["labels"][str(r["ids"][0])] == loaded.tokenizer.decode(r["ids"][:1]).replace(" ", "␣")


def test_ablation_is_ablation_effect(client, checkpoint):
    _, loaded = checkpoint
    prompt = PROMPTS[4]
    r = client.post("/api/ablate", json={"prompt": prompt, "heads": ["2.1", "0.3"], "temperature": 0.9}).json()
    effect = ablation_effect(loaded.model, ids_of(loaded, prompt), [(2, 1), (0, 3)])
    assert r["heads"] == ["0.3", "2.1"] and r["mode"] == "zero"
    assert r["loss_before"] == pytest.approx(effect.loss_before, abs=1e-5)
    assert r["loss_after"] == pytest.approx(effect.loss_after, abs=1e-5)
    assert r["kl"] == pytest.approx(float(effect.kl[0]), abs=1e-6) and r["kl"] > 1e-4  # the heads matter
    before = next_token_probabilities(effect.logits_before, temperature=0.9)[0]
    after = next_token_probabilities(effect.logits_after, temperature=0.9)[0]
    assert r["top_before"] == torch.topk(before, 10).indices.tolist()
    assert r["top_after"] == torch.topk(after, 10).indices.tolist()
    ids = [row["id"] for row in r["rows"]]
    close(torch.tensor([row["before"] for row in r["rows"]]), before[ids])
    close(torch.tensor([row["after"] for row in r["rows"]]), after[ids])


def check_generation(got: list[tuple[str, dict]], gen, prompt_ids: list[int]) -> None:
    """Streamed events against :func:`trace_generation`."""
    names = [name for name, _ in got]
    assert names == ["start", *["token"] * len(gen.steps), "done"], names
    start, done = got[0][1], got[-1][1]
    assert start["tokens"] == prompt_ids and start["prompt_length"] == len(prompt_ids)
    assert done == {"generated": len(gen.steps), "reason": "length"}
    for (_, step), want in zip(got[1:-1], gen.steps, strict=True):
        step = unpack(step)
        assert step["token"] == int(want.token[0]) and step["position"] == want.position
        assert step["key_start"] == want.key_start and step["key_index"] == want.key_index[0].tolist()
        close(step["weights"], want.weights[:, 0], 1e-5)
        assert step["candidates"] == want.candidates[0].tolist()
        close(torch.tensor(step["probs"]), want.probs[0], 1e-5)
        assert step["token_prob"] == pytest.approx(float(want.token_prob[0]), abs=1e-5)
        assert step["labels"][str(step["token"])] == TOKENIZER.decode([step["token"]]).replace(" ", "␣")


@pytest.mark.parametrize(("temperature", "top_k", "top_p", "seed"), [(0.9, 10, None, 3), (0.0, None, None, 0)])
def test_generation_streams_what_trace_generation_records(client, checkpoint, temperature, top_k, top_p, seed):
    _, loaded = checkpoint
    prompt = PROMPTS[7]  # 44 tokens: with 12 more the window slides past the context of 48
    body = {"prompt": prompt, "max_new_tokens": 12, "temperature": temperature, "top_k": top_k, "seed": seed}
    with client.stream("POST", "/api/generate", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = events(r.iter_lines())
    idx = ids_of(loaded, prompt)
    g = torch.Generator().manual_seed(seed)
    gen = trace_generation(loaded.model, idx, 12, temperature=temperature, top_k=top_k, top_p=top_p, generator=g)
    assert gen.steps[-1].key_start > 0  # the window did slide
    check_generation(got, gen, idx[0].tolist())
    # ... and those are the tokens model.generate draws with the same seed.
    g = torch.Generator().manual_seed(seed)
    ids = loaded.model.generate(idx, 12, temperature=temperature, top_k=top_k, generator=g)
    assert [e["token"] for name, e in got if name == "token"] == ids[0, idx.shape[1] :].tolist()


@pytest.mark.parametrize("mixed", [False, True])
def test_a_ring_cache_models_stream_equals_trace_generation(tmp_path, mixed):
    """A RoPE model past its window (a rolling cache: keys out of order), through the engine in-process;
    ``mixed``: a window on one layer only (Gemma 3's kind), whose rows are laid on the other's keys."""
    sizes = dict(vocab_size=len(CHARS), emb_dim=32, n_heads=4, n_layers=2)
    config = dict(context_length=16, window=4, window_layers=[0]) if mixed else dict(context_length=8)
    model = GPT(GPTConfig.preset("modern", **sizes, **config))
    model.eval()
    engine = Engine(LoadedModel(model, CharTokenizer(CHARS), tmp_path))
    prompt = "abcdef"
    run = engine.start_generation(prompt, 9, temperature=1.0, seed=2)
    got = [("start", {"tokens": list(run.ids), "prompt_length": run.prompt_length})]
    while (step := engine.advance(run)) is not None:
        got.append(("token", to_json(step)))
    engine.finish(run)
    got.append(("done", {"generated": run.produced, "reason": run.end_reason}))
    idx = ids_of(LoadedModel(model, CharTokenizer(CHARS), tmp_path), prompt)
    gen = trace_generation(model, idx, 9, generator=torch.Generator().manual_seed(2))
    if mixed:  # the window layer's evicted keys: weight 0 in its rows, which sum to 1 over the rest
        assert all(bool((s.weights[0, :, :, : -model.config.window] == 0).all()) for s in gen.steps)
        torch.testing.assert_close(gen.steps[-1].weights.sum(-1), torch.ones(2, 1, 4))
    else:
        assert any(s.key_index[0].tolist() != sorted(s.key_index[0].tolist()) for s in gen.steps)  # out of order
    check_generation(got, gen, idx[0].tolist())
    assert engine.snapshot()["generations_finished"] == 1 and engine.snapshot()["generations_active"] == 0


def test_every_model_call_runs_on_one_thread_in_inference_mode(tmp_path):
    model = sharp_gpt()
    seen: set[tuple[str, bool]] = set()
    model.out_head.register_forward_hook(
        lambda m, a, out: seen.add((threading.current_thread().name, torch.is_inference_mode_enabled()))
    )
    engine = Engine(LoadedModel(model, CharTokenizer(CHARS), tmp_path))

    def work(i: int) -> None:
        prompt = PROMPTS[i % len(PROMPTS)]
        engine.inspect(prompt, ["layers", "lens"])
        engine.next_tokens(prompt, temperature=0.5)
        if len(prompt) > 1:
            engine.ablate(prompt, ["0.1"])
        run = engine.start_generation(prompt, 2)
        while engine.advance(run) is not None:
            pass
        engine.finish(run)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(work, range(8)))
    assert len(seen) == 1 and next(iter(seen))[1] is True, seen
    assert next(iter(seen))[0].startswith("attnlab-model")
    assert engine.snapshot()["generations_finished"] == 8


def test_a_requests_torch_work_all_runs_on_the_model_thread(tmp_path):
    # A torch operation on a request's thread could give that thread a team of OpenMP workers, which
    # would slow the model thread's steps for as long as the thread lives (Engine.run).
    engine = Engine(LoadedModel(sharp_gpt(), CharTokenizer(CHARS), tmp_path))
    prompt = PROMPTS[0]
    with AtenOps() as ops:
        engine.inspect(prompt, ["layers", "lens", "next", "roles"])
        engine.next_tokens(prompt, temperature=0.5)
        engine.ablate(prompt, ["0.1"])
        run = engine.start_generation(prompt, 3, temperature=0.7)
        while engine.advance(run) is not None:
            pass
        engine.finish(run)
    assert ops.names == [], sorted(set(ops.names))
    assert engine.snapshot()["generations_finished"] == 1


def test_rest_ends_the_model_thread_and_the_next_call_runs_on_a_new_one(tmp_path):
    engine = Engine(LoadedModel(sharp_gpt(), CharTokenizer(CHARS), tmp_path))
    first = engine.run(threading.current_thread)
    want = engine.next_tokens(PROMPTS[0], temperature=0.5)
    engine.rest()
    assert not first.is_alive()  # ended, its OpenMP workers with it
    second = engine.run(threading.current_thread)
    assert second is not first and second.name.startswith("attnlab-model")
    assert engine.next_tokens(PROMPTS[0], temperature=0.5) == want


def test_the_page_opens_with_a_prompt_the_tokenizer_reads(tmp_path):
    loaded = LoadedModel(sharp_gpt(), CharTokenizer(CHARS), tmp_path)
    assert Engine(loaded).info()["default_prompt"] == "your journey starts with one step"  # no capitals here
    assert Engine(loaded, prompt="abc").info()["default_prompt"] == "abc"
    with pytest.raises(ValueError, match="more than the model's context window"):
        Engine(loaded, prompt="ab" * CONTEXT)


def test_a_bad_prompt_flag_is_a_one_line_error(checkpoint, capsys, monkeypatch):
    import attnlab.tools.serve

    monkeypatch.setattr(attnlab.tools.serve, "serve", lambda *a, **k: pytest.fail("served a bad --prompt"))
    assert main(["serve", "--checkpoint", str(checkpoint[0]), "--prompt", "ABC"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab serve: error: --prompt: "), err


# --------------------------------------------------------------------------------------------
# Bad requests: a 4xx with a one-line JSON message, and nothing else happens
# --------------------------------------------------------------------------------------------
LONG = "ab" * CONTEXT  # 96 tokens, twice the context
BAD = [
    # (method, path, body, headers, status, in the detail)
    ("POST", "/api/inspect", {"prompt": LONG}, None, 422, "more than the model's context window"),
    ("POST", "/api/next", {"prompt": ""}, None, 422, "prompt: String should have at least 1 character"),
    ("POST", "/api/next", {"prompt": "x" * 100_001}, None, 422, "prompt: String should have at most 100000"),
    ("POST", "/api/next", {"prompt": "x" * 300_000}, None, 413, "request body too large"),
    ("POST", "/api/next", {"prompt": "abc 123"}, None, 422, "prompt: character '1'"),  # not a character of the model
    ("POST", "/api/generate", {"prompt": "abc", "max_new_tokens": MAX_NEW + 1}, None, 422, "more than this server"),
    ("POST", "/api/generate", {"prompt": "abc", "max_new_tokens": 10**6}, None, 422, "max_new_tokens: Input should"),
    ("POST", "/api/generate", {"prompt": "abc", "max_new_tokens": 0}, None, 422, "max_new_tokens"),
    ("POST", "/api/next", b'{"prompt": "abc"', None, 400, "not valid JSON"),
    ("POST", "/api/next", b'{"prompt": "abc", "temperature": NaN}', None, 4, ""),
    ("POST", "/api/next", [1, 2], None, 422, "Input should be a valid dictionary"),
    ("POST", "/api/next", {"prompt": "abc", "temperature": "1"}, None, 422, "temperature: Input should be a valid"),
    ("POST", "/api/next", {"prompt": "abc", "k": True}, None, 422, "k: Input should be a valid integer, got true"),
    ("POST", "/api/next", {"prompt": "abc", "k": "5"}, None, 422, 'k: Input should be a valid integer, got "5"'),
    # (a union's members were named: "answers.0.constrained-int: ...; answers.0.str: ...")
    (
        "POST",
        "/api/patch",
        {"clean": "ab", "corrupted": "ba", "answers": [None, "a"]},
        None,
        422,
        "answers.0: Input should be a valid integer or Input should be a valid string, got null",
    ),
    ("POST", "/api/next", b'{"prompt": "ab\xe9"}', None, 400, "the request body is not UTF-8 text (byte 14"),
    ("POST", "/api/next", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None, 400, "nested too deeply"),
    ("POST", "/api/generate", {"prompt": "abc", "top_k": 10**20}, None, 422, "top_k: Input should be less than"),
    ("POST", "/api/inspect", {"prompt": "abc", "lens_window": ["1", 2]}, None, 422, "lens_window.0: Input should"),
    ("POST", "/api/next", {"prompt": "abc", "colour": "red"}, None, 422, "colour: Extra inputs are not permitted"),
    ("POST", "/api/next", {"prompt": "abc", "temperature": -1}, None, 422, "temperature"),
    ("POST", "/api/next", {"prompt": "abc", "top_p": 0}, None, 422, "top_p"),
    ("POST", "/api/next", {"prompt": "abc", "top_k": 0}, None, 422, "top_k"),
    ("POST", "/api/next", {"prompt": "abc", "position": 3}, None, 422, "position 3 is out of range"),
    ("POST", "/api/inspect", {"prompt": "abc", "sections": ["lens"], "lens_window": [1, 4]}, None, 422, "lens_window"),
    ("POST", "/api/inspect", {"prompt": "abc", "lens_window": [-1, 2]}, None, 422, "lens_window"),
    ("POST", "/api/inspect", {"prompt": "abc", "lens_window": [1, 2, 3]}, None, 422, "lens_window"),
    ("POST", "/api/ablate", {"prompt": "abc", "heads": ["3.0"]}, None, 422, "head 3.0 does not exist"),
    ("POST", "/api/ablate", {"prompt": "abc", "heads": ["0.4"]}, None, 422, "head 0.4 does not exist"),
    ("POST", "/api/ablate", {"prompt": "abc", "heads": ["a.b"]}, None, 422, "heads.0: String should match"),
    ("POST", "/api/ablate", {"prompt": "abc", "heads": []}, None, 422, "heads"),
    ("POST", "/api/inspect", {"prompt": "abc", "sections": ["steps"], "steps": ["0.9"]}, None, 422, "steps: head 0.9"),
    ("POST", "/api/inspect", {"prompt": "abc", "sections": ["steps"], "steps": []}, None, 422, "steps: must name"),
    ("POST", "/api/inspect", {"prompt": "abc", "layers": [7]}, None, 422, "layers: 7 is out of range"),
    # (the request's fields named: the library's message named the command line's --steps, --layer/--head)
    (
        "POST",
        "/api/inspect",
        {"prompt": "abc", "sections": ["steps"], "steps": ["2.1"], "layers": [0]},
        None,
        422,
        "steps: 2.1 not among the heads shown (layers:, heads:)",
    ),
    ("POST", "/api/inspect", {"prompt": "abc", "heads": [0, -9]}, None, 422, "heads: -9 is out of range"),
    ("POST", "/api/inspect", {"prompt": "abc", "sections": ["secrets"]}, None, 422, "sections.0"),
    ("POST", "/api/next", "prompt=abc", {"content-type": "application/x-www-form-urlencoded"}, 415, "send JSON"),
    ("POST", "/api/next", '{"prompt": "abc"}', {"content-type": "text/plain"}, 415, "send JSON"),
    ("GET", "/api/next", None, None, 405, "GET is not allowed on /api/next: use POST"),
    ("GET", "/api/nothing", None, None, 404, "Not Found"),
    # (a POST that no route takes was refused for its content type, 415, before the router answered)
    ("POST", "/api/nothing", None, None, 404, "Not Found"),
    ("POST", "/api/info", None, None, 405, "POST is not allowed on /api/info: use GET"),
    ("GET", "/api/demo", None, None, 404, "not the tutorials' six-word example"),
    ("GET", "/api/info", None, {"host": "evil.example"}, 400, "Host header"),
    ("GET", "/api/info", None, {"host": "attacker.test:8000"}, 400, "Host header"),
    ("POST", "/api/next", {"prompt": "abc"}, {"content-length": "10000000"}, 413, "the limit is 262144"),
]


@pytest.mark.parametrize(("method", "path", "body", "headers", "status", "detail"), BAD)
def test_bad_requests_get_a_one_line_4xx(server, client, method, path, body, headers, status, detail):
    before = client.get("/api/stats").json()
    kwargs = {"headers": headers or {}}
    if isinstance(body, bytes | str):
        kwargs["content"] = body.encode() if isinstance(body, str) else body
        kwargs["headers"] = {"content-type": "application/json", **kwargs["headers"]}
    elif body is not None:
        kwargs["json"] = body
    if "content-length" in kwargs["headers"]:  # a lying header: httpx would correct it, so send it raw
        status_got, text = raw_request(server, method, path, json.dumps(body).encode(), kwargs["headers"])
    else:
        r = client.request(method, path, **kwargs)
        status_got, text = r.status_code, r.text
    if status < 10:  # any 4xx
        assert 400 <= status_got < 500, (status_got, text)
    else:
        assert status_got == status, text
    answer = json.loads(text)
    assert list(answer) == ["detail"] and isinstance(answer["detail"], str)
    assert "\n" not in answer["detail"] and detail in answer["detail"], answer
    after = client.get("/api/stats").json()
    assert after["generations_started"] == before["generations_started"]


def test_a_wrong_method_says_which_are_allowed(client):
    r = client.get("/api/generate")
    assert r.status_code == 405 and r.headers["allow"] == "POST"  # (the header was dropped)


def raw_request(server, method: str, path: str, body: bytes = b"", headers: dict | None = None) -> tuple[int, str]:
    """One HTTP/1.1 request written by hand (what a client library would refuse to send)."""
    head = {"host": "127.0.0.1", "connection": "close", **(headers or {})}
    if body and "content-length" not in head:
        head["content-length"] = str(len(body))
    if body and "content-type" not in head:
        head["content-type"] = "application/json"
    lines = [f"{method} {path} HTTP/1.1", *[f"{k}: {v}" for k, v in head.items()], "", ""]
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        s.sendall("\r\n".join(lines).encode("latin-1") + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head_text, _, payload = data.partition(b"\r\n\r\n")
    status = int(head_text.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head_text.lower():
        out, rest = b"", payload
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2 :]
        payload = out
    return status, payload.decode("utf-8", "replace")


def test_a_body_over_the_limit_is_refused_as_it_streams_in(server):
    """No Content-Length (chunked): the bytes are counted as they arrive."""
    big = json.dumps({"prompt": "a" * 300_000}).encode()

    def chunks():
        for i in range(0, len(big), 8192):
            yield big[i : i + 8192]

    with httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/api/next", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert r.status_code == 413 and "more than" in r.json()["detail"] and "262144" in r.json()["detail"]


TRAVERSALS = [
    "/assets/../../../../../../etc/passwd",
    "/assets/..%2f..%2f..%2f..%2f..%2f..%2fetc%2fpasswd",
    "/assets/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/%2e%2e/etc/passwd",
    "/assets/%2e%2e%2fpage.py",
    "/assets/..%5cpage.py",
    "/assets/%2fetc%2fpasswd",
    "/assets//etc/passwd",
    "/assets/viewer.js/../../page.py",
    "/assets/viewer.js%00.py",
    "/assets/page.py",
    "/assets/__init__.py",
    "/assets/",
    "//etc/passwd",
    "/../../../../etc/passwd",
    "/%2e%2e/%2e%2e/etc/passwd",
    "/etc/passwd",
    "/src/attnlab/interpret/page.py",
    "/assets/viewer.JS",
]


@pytest.mark.parametrize("path", TRAVERSALS)
def test_static_files_come_from_the_assets_only(server, path):
    status, text = raw_request(server, "GET", path)
    assert status in (400, 404), (path, status)
    assert "root:" not in text and "import " not in text and "def " not in text, (path, text[:200])


def test_the_page_and_its_files(client):
    from attnlab.interpret.page import read_asset

    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "connect-src 'self'" in csp and "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert "unsafe-inline" not in csp and r.headers["x-content-type-options"] == "nosniff"
    head = client.head("/")  # (what curl -I and link checkers send)
    assert head.status_code == 200 and head.headers["content-type"] == r.headers["content-type"]
    page = r.text
    assert '<script src="assets/viewer.js"></script>' in page and 'id="attn-live"' in page
    assert "<script>" not in page  # nothing inline runs: the policy would block it
    for name, ctype in (("viewer.js", "text/javascript"), ("viewer.css", "text/css"), ("viewer.html", "text/html")):
        r = client.get(f"/assets/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(ctype)
        assert r.text == read_asset(name)


def test_openapi_documents_the_api_and_no_cdn_page_is_served(client):
    schema = client.get("/openapi.json").json()
    for path in ("/api/info", "/api/tokenize", "/api/inspect", "/api/next", "/api/ablate", "/api/generate"):
        assert path in schema["paths"], path
    assert "GenerateRequest" in schema["components"]["schemas"]
    assert schema["components"]["schemas"]["NextRequest"]["properties"]["k"]["maximum"] == 256
    assert client.get("/docs").status_code == 404  # Swagger UI would load its code from a CDN


# --------------------------------------------------------------------------------------------
# Streaming, concurrency, shutting down
# --------------------------------------------------------------------------------------------
def wait_for(fn, timeout: float = 20.0, every: float = 0.05):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if value := fn():
            return value
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s")


@pytest.mark.slow
def test_a_client_that_disconnects_stops_its_generation(server, client):
    before = client.get("/api/stats").json()
    assert before["generations_active"] == 0
    body = {"prompt": PROMPTS[0], "max_new_tokens": MAX_NEW, "temperature": 1.0}
    with httpx.Client(base_url=server.url, timeout=30) as own, own.stream("POST", "/api/generate", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("event: token")
            if seen == 3:
                break
    # The connection is closed: the server must notice and stop generating.
    stats = wait_for(lambda: (s := client.get("/api/stats").json())["generations_active"] == 0 and s)
    assert stats["generations_stopped"] == before["generations_stopped"] + 1
    assert stats["generations_finished"] == before["generations_finished"]
    made = stats["generation_steps"] - before["generation_steps"]
    assert 3 <= made < MAX_NEW
    time.sleep(0.5)
    assert client.get("/api/stats").json()["generation_steps"] == stats["generation_steps"]  # nothing more
    print(f"\nthe client left after 3 tokens; the server made {made} and stopped")


def expected_answers(loaded: LoadedModel) -> dict:
    """What the library says for every request of the concurrency test."""
    out = {}
    for p in PROMPTS:
        idx = ids_of(loaded, p)
        tr = trace(loaded.model, idx)
        out[("weights", p)] = tr.weights[:, 0]  # (L, H, T, T)
        for t, k in ((1.0, None), (0.5, 4), (0.0, None)):
            probs = next_token_probabilities(tr.logits[0, -1][None], temperature=t, top_k=k)[0]
            out[("next", p, t, k)] = probs
        if len(p) >= 2:
            effect = ablation_effect(loaded.model, idx, [(1, 1)])
            out[("ablate", p)] = (effect.loss_after, float(effect.kl[0]))
    return out


@pytest.mark.slow
def test_sixteen_concurrent_clients_each_get_their_own_answer(server, checkpoint):
    _, loaded = checkpoint
    want = expected_answers(loaded)
    settings = [(1.0, None), (0.5, 4), (0.0, None)]
    jobs = []
    for i in range(196):  # + 4 generations streaming at the same time: 200 requests
        p = PROMPTS[i % len(PROMPTS)]
        kind = ("next", "inspect", "next", "ablate")[i % 4]
        if kind == "ablate" and len(p) < 2:
            kind = "next"
        jobs.append((kind, p, settings[(i // 4) % 3]))
    failures: list[str] = []
    # (Each request may wait as long as the whole workload: while a server compiles its step, every
    # request waits for it, over a minute with an empty compiler cache on a busy machine.)

    def one(job) -> None:
        kind, p, (t, k) = job
        with httpx.Client(base_url=server.url, timeout=300) as c:
            if kind == "next":
                r = c.post("/api/next", json={"prompt": p, "temperature": t, "top_k": k, "k": 8}).json()
                probs = want[("next", p, t, k)]
                if not torch.allclose(torch.tensor(r["probs"]), probs[r["ids"]], atol=1e-6, rtol=0) or (
                    r["probs"][0] != pytest.approx(float(probs.max()), abs=1e-6)
                ):
                    failures.append(f"next {p!r} {t} {k}")
            elif kind == "inspect":
                r = unpack(c.post("/api/inspect", json={"prompt": p}).json())
                got = torch.stack([layer["weights"] for layer in r["layers"]])
                if got.shape != want[("weights", p)].shape or not torch.allclose(got, want[("weights", p)], atol=1e-6):
                    failures.append(f"inspect {p!r}")
            else:
                r = c.post("/api/ablate", json={"prompt": p, "heads": ["1.1"]}).json()
                loss, kl = want[("ablate", p)]
                if abs(r["loss_after"] - loss) > 1e-5 or abs(r["kl"] - kl) > 1e-6:
                    failures.append(f"ablate {p!r}")

    def generation(seed: int) -> None:
        body = {"prompt": PROMPTS[seed], "max_new_tokens": 6, "temperature": 1.0, "seed": seed}
        with httpx.Client(base_url=server.url, timeout=300) as c, c.stream("POST", "/api/generate", json=body) as r:
            got = [e["token"] for name, e in events(r.iter_lines()) if name == "token"]
        idx = ids_of(loaded, PROMPTS[seed])
        ids = loaded.model.generate(idx, 6, temperature=1.0, generator=torch.Generator().manual_seed(seed))
        if got != ids[0, idx.shape[1] :].tolist():
            failures.append(f"generation {seed}")

    start = time.perf_counter()
    pool = ThreadPoolExecutor(16)
    futures = [pool.submit(generation, s) for s in range(4)] + [pool.submit(one, job) for job in jobs]
    done, pending = wait(futures, timeout=300)  # a server that corrupts its state may also stall
    pool.shutdown(wait=not pending, cancel_futures=True)
    assert not pending, f"{len(pending)} of 200 requests unanswered after 300 s"
    for f in done:
        f.result()
    print(f"\n200 requests from 16 clients in {time.perf_counter() - start:.1f} s")
    assert failures == []


@pytest.mark.slow
def test_ctrl_c_mid_generation_shuts_down_cleanly(checkpoint, subprocess_env):
    s = Server("--checkpoint", str(checkpoint[0]), "--max-new-tokens", str(MAX_NEW), env=subprocess_env)
    got: list[tuple[str, dict]] = []

    def listen() -> None:
        body = {"prompt": PROMPTS[1], "max_new_tokens": MAX_NEW}
        with httpx.Client(base_url=s.url, timeout=60) as c, c.stream("POST", "/api/generate", json=body) as r:
            got.extend(events(r.iter_lines()))

    reader = threading.Thread(target=listen)
    reader.start()
    with httpx.Client(base_url=s.url, timeout=30) as c:
        wait_for(lambda: c.get("/api/stats").json()["generation_steps"] >= 5)
    start = time.perf_counter()
    code, err = s.stop(signal.SIGINT)
    took = time.perf_counter() - start
    reader.join(30)
    assert code == 130, (code, err)
    assert "Traceback" not in err and "Error" not in err, err
    assert took < 10, took
    assert got and got[-1][0] == "done" and got[-1][1]["reason"] == "shutdown"  # the stream ended properly
    assert got[-1][1]["generated"] < MAX_NEW


@pytest.mark.slow
def test_bound_elsewhere_it_warns_in_one_line(subprocess_env):
    s = Server("--demo", "--host", "0.0.0.0", env=subprocess_env)
    try:
        # No Host check away from loopback (any name may reach it); the demo answers.
        r = httpx.get(f"http://127.0.0.1:{s.port}/api/info", headers={"host": "my-laptop.lan"}, timeout=30)
        assert r.status_code == 200 and r.json()["language_model"] is False
    finally:
        code, err = s.stop()
    assert code == 130
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab serve: warning: listening on 0.0.0.0"), err


def test_on_loopback_it_says_where_and_warns_nothing(server):
    assert server.first_line.startswith("attnlab serve: sharp at http://127.0.0.1:")
    assert server.proc.poll() is None


# --------------------------------------------------------------------------------------------
# The tutorials' six-word example, and the command line
# --------------------------------------------------------------------------------------------
def test_the_demo_serves_the_six_word_example():
    app = create_app(Engine(demo=view_to_dict(demo_view())), allowed_hosts={"testserver"})
    with TestClient(app) as c:
        assert c.get("/api/info").json()["language_model"] is False
        got = unpack(c.get("/api/demo").json())
        want = unpack(to_json(view_to_dict(demo_view())))
        assert got["tokens"] == ["Your", "journey", "starts", "with", "one", "step"]
        for mine, theirs in zip(got["layers"], want["layers"], strict=True):
            close(mine["weights"], theirs["weights"])
        r = c.post("/api/next", json={"prompt": "Your journey"})
        assert r.status_code == 409 and "not a language model" in r.json()["detail"]


def test_a_generation_that_fails_midway_ends_its_stream_with_an_error_event(tmp_path):
    engine = Engine(LoadedModel(sharp_gpt(), CharTokenizer(CHARS), tmp_path))
    real, calls = engine.advance, []

    def advance(run):
        calls.append(run)
        if len(calls) == 2:
            raise RuntimeError("the disk caught fire\nsecond line")
        return real(run)

    engine.advance = advance
    app = create_app(engine, allowed_hosts={"testserver"})
    with TestClient(app) as c, c.stream("POST", "/api/generate", json={"prompt": "abc", "max_new_tokens": 5}) as r:
        got = events(r.iter_lines())
    assert [name for name, _ in got] == ["start", "token", "error"]
    assert got[-1][1] == {"detail": "generation failed: RuntimeError: the disk caught fire"}
    stats = engine.snapshot()
    assert stats["generations_active"] == 0 and stats["generations_stopped"] == 1


def test_limits_are_the_servers(tmp_path):
    engine = Engine(LoadedModel(sharp_gpt(), CharTokenizer(CHARS), tmp_path), limits=Limits(max_new_tokens=4))
    with TestClient(create_app(engine, allowed_hosts={"testserver"})) as c:
        assert c.get("/api/info").json()["limits"]["max_new_tokens"] == 4
        r = c.post("/api/generate", json={"prompt": "abc", "max_new_tokens": 5})
        assert r.status_code == 422 and "(4;" in r.json()["detail"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give the model to serve: --checkpoint DIR, --model NAME, or --demo"),
        (["--demo", "--port", "70000"], "--port must be in 0..65535"),
        (["--demo", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--checkpoint", os.devnull + "-missing"], "checkpoint not found"),
    ],
)
def test_command_line_errors_are_one_line(capsys, monkeypatch, argv, message):
    import attnlab.tools.serve

    monkeypatch.setattr(attnlab.tools.serve, "serve", lambda *a, **k: pytest.fail("served despite an error"))
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab serve: error: ") and message in err[0], err
