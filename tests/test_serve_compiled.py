"""``attnlab serve``'s generation stream and chat box on the compiled decoding step.

An engine told to compile (:class:`attnlab.tools.serve.Engine` ``compile=True``, what ``attnlab serve``
does) compiles the step on a thread of its own at warm-up; the generations after it decode with the
compiled step and compile nothing on the model thread. Against an engine that does not compile, on
the same model: the same tokens, candidates and probabilities, and the same attention rows per layer.
Each test compiles (slow), but the one where compiling fails.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch._dynamo.utils import counters

from attnlab import decoding
from attnlab.interpret.codec import to_json, unpack
from attnlab.tokenizers import CharTokenizer
from attnlab.tools.loading import LoadedModel

pytest.importorskip("fastapi", reason="attnlab serve needs the serve extra (pip install 'attnlab[serve]')")
from attnlab.tools.serve import Engine
from attnlab.tools.serve.chat import advance_chat, start_chat
from test_serve import CHARS, sharp_gpt

pytestmark = pytest.mark.usefixtures("one_thread_module")

LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2)


@pytest.fixture
def compiled_steps(monkeypatch):
    """The compiled steps the model thread ran (a spy on FastDecoder._compiled_step, and on greedy_steps:
    each call its ``chunk`` steps, and ``[1]`` counts those calls; the compiling thread's own steps are
    not counted: they run before the spy is read)."""
    count = [0, 0]
    step, greedy_steps = decoding.FastDecoder._compiled_step, decoding.FastDecoder.greedy_steps

    def spy(self, *args):
        count[0] += 1
        return step(self, *args)

    def chunk_spy(self, *args):
        count[0] += self.chunk
        count[1] += 1
        return greedy_steps(self, *args)

    monkeypatch.setattr(decoding.FastDecoder, "_compiled_step", spy)
    monkeypatch.setattr(decoding.FastDecoder, "greedy_steps", chunk_spy)
    return count


def stream_all(engine: Engine, prompt: str, n: int, **kw) -> list[dict]:
    run = engine.start_generation(prompt, n, **kw)
    steps = []
    while (data := engine.advance(run)) is not None:
        steps.append(data)
    engine.finish(run)
    return steps


@pytest.mark.slow
def test_the_generation_stream_runs_the_compiled_step_compiled_at_warm_up(tmp_path, compiled_steps):
    model = sharp_gpt(5, **LLAMA)
    plain = Engine(LoadedModel(model, CharTokenizer(CHARS), tmp_path))
    engine = Engine(LoadedModel(model, CharTokenizer(CHARS), tmp_path), compile=True)
    assert not plain.compile and engine.compile
    engine.warm_up()
    assert engine.wait_compiled(timeout=900) and engine.compile_error is None
    stats = engine.snapshot()
    assert stats["steps_compiled"] == 2 and stats["steps_compiling"] == 0  # the stream's and the chat's
    compiled_steps[0] = 0
    graphs = counters["stats"]["unique_graphs"]
    for kw in (dict(temperature=0.0), dict(temperature=0.9, top_k=12, seed=7)):
        want = stream_all(plain, "the cat sat on", 14, **kw)
        got = stream_all(engine, "the cat sat on", 14, **kw)
        assert len(got) == len(want) == 14
        for a, b in zip(want, got, strict=True):
            for key in ("token", "position", "key_start", "key_index", "candidates", "labels"):
                assert a[key] == b[key], key
            assert b["probs"] == pytest.approx(a["probs"], abs=1e-5)
            assert b["token_prob"] == pytest.approx(a["token_prob"], abs=1e-5)
            wa, wb = (unpack(to_json({"w": d["weights"]}))["w"] for d in (a, b))  # (L, H, S)
            assert wa.shape == (model.config.n_layers, model.config.n_heads, a["position"])
            torch.testing.assert_close(wb, wa, rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled on the model thread
    assert compiled_steps[0] == 2 * 13 and engine.snapshot()["compiled_generations"] == 2
    assert plain.snapshot()["compiled_generations"] == 0


@pytest.mark.slow
def test_the_chat_box_runs_the_compiled_step(tmp_path, compiled_steps):
    pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    from attnlab.tools.loading import load_pretrained
    from test_chat import write_model_dir

    loaded = load_pretrained(str(write_model_dir(tmp_path / "chat")), device="cpu")
    plain, engine = Engine(loaded), Engine(loaded, compile=True)
    engine.warm_up()
    assert engine.wait_compiled(timeout=900) and engine.compile_error is None
    compiled_steps[0] = 0
    messages = [{"role": "user", "content": "Jack Gisburn?"}]
    answers = []
    for e in (plain, engine):
        before = counters["stats"]["unique_graphs"]
        run = start_chat(e, messages, 10, temperature=0.0)
        while advance_chat(e, run) is not None:
            pass
        e.finish(run)
        answers.append((run.answer_ids, run.end_reason))
    assert answers[0] == answers[1] and len(answers[0][0]) > 0
    assert compiled_steps[0] > 0 and engine.snapshot()["compiled_generations"] == 1
    # The model is small: its greedy answer ran steps in chunks, compiled ahead (for the model's stop ids).
    assert compiled_steps[1] > 0 and counters["stats"]["unique_graphs"] == before


@pytest.mark.slow
def test_sixteen_clients_while_it_compiles_then_on_the_compiled_step(tmp_path, subprocess_env):
    """``attnlab serve`` as a user starts it (compiling by default): the sixteen-client workload of
    test_serve (200 requests, 4 generations among them, every answer checked) while the step compiles
    in the background, then again on the compiled step; Ctrl-C exits cleanly."""
    import httpx

    from attnlab.tools.loading import load_model
    from test_serve import MAX_NEW, Server, save_checkpoint, test_sixteen_concurrent_clients_each_get_their_own_answer

    d = save_checkpoint(sharp_gpt(), tmp_path / "sharp")
    checkpoint = (d, load_model(d))
    server = Server("--checkpoint", str(d), "--max-new-tokens", str(MAX_NEW), env=subprocess_env, compile=True)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            test_sixteen_concurrent_clients_each_get_their_own_answer(server, checkpoint)
            deadline = time.monotonic() + 900
            while c.get("/api/stats").json()["steps_compiled"] < 2 and time.monotonic() < deadline:
                time.sleep(1)
            before = c.get("/api/stats").json()
            assert before["steps_compiled"] == 2 and before["steps_compiling"] == 0
            test_sixteen_concurrent_clients_each_get_their_own_answer(server, checkpoint)
            after = c.get("/api/stats").json()
            assert after["compiled_generations"] - before["compiled_generations"] == 4
    finally:
        code, err = server.stop()
    assert code == 130 and "Traceback" not in err and "warning" not in err, (code, err)


@pytest.mark.slow
def test_ctrl_c_while_it_compiles(tmp_path, subprocess_env):
    """A server stopped while its compiling thread works exits at once and cleanly (the thread is a
    daemon: nothing waits for a compilation)."""
    import httpx

    from test_serve import Server, save_checkpoint, wait_for

    d = save_checkpoint(sharp_gpt(1, **LLAMA), tmp_path / "llama")
    server = Server("--checkpoint", str(d), env=subprocess_env, compile=True)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        wait_for(lambda: c.get("/api/stats").json()["steps_compiling"] > 0)
    start = time.perf_counter()
    code, err = server.stop()
    assert code == 130 and "Traceback" not in err and "Fatal" not in err, (code, err)
    assert time.perf_counter() - start < 10


def test_a_size_asked_for_as_the_compilation_fails_is_not_left_compiling(tmp_path, monkeypatch):
    """The warm-up asks for two variants; the compiling thread fails on the first while the model thread
    is between its check and its count of the second (the failure waits for that check to begin, the
    check for the failure to be recorded): the second is refused, and nothing stays counted as compiling."""
    import threading

    from attnlab.tools.serve import engine as engine_module

    second_checking = threading.Event()

    def fail(self, *args):
        second_checking.wait(30)
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(decoding.FastDecoder, "precompile", fail)
    model = sharp_gpt(2, **LLAMA)
    engine = Engine(LoadedModel(model, CharTokenizer(CHARS), tmp_path), compile=True)
    calls = []
    real = engine_module.supported

    def supported(*args):
        calls.append(1)
        if len(calls) == 2:
            second_checking.set()
            deadline = time.monotonic() + 30
            while engine.compile_error is None and time.monotonic() < deadline:
                time.sleep(0.01)
        return real(*args)

    monkeypatch.setattr(engine_module, "supported", supported)
    engine.warm_up()
    assert engine.wait_compiled(timeout=60)
    engine.run(lambda: None)  # (the warm-up done)
    assert len(calls) == 2 and engine.compile_error == "ZeroDivisionError: division by zero"
    stats = engine.snapshot()
    assert stats["compile_failed"] == 1 and stats["steps_compiling"] == 0, stats


def test_a_failed_compilation_leaves_the_fast_path(tmp_path, monkeypatch, capsys):
    """No C++ compiler, say: one warning line, the stats say so, and generations stream on the fast path."""

    def fail(self, *args):
        raise RuntimeError("no C++ compiler found\nsecond line")

    monkeypatch.setattr(decoding.FastDecoder, "precompile", fail)
    model = sharp_gpt(2, **LLAMA)
    engine = Engine(LoadedModel(model, CharTokenizer(CHARS), tmp_path), compile=True)
    engine.warm_up()
    assert engine.wait_compiled(timeout=60)
    assert engine.compile_error == "RuntimeError: no C++ compiler found"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab serve: warning: the compiled decoding step failed"), err
    want = stream_all(Engine(LoadedModel(model, CharTokenizer(CHARS), tmp_path)), "abc", 5, temperature=0.0)
    got = stream_all(engine, "abc", 5, temperature=0.0)
    assert [d["token"] for d in got] == [d["token"] for d in want]
    stats = engine.snapshot()
    assert stats["compile_failed"] == 1 and stats["steps_compiling"] == 0 and stats["compiled_generations"] == 0
