"""``attnlab serve``'s chat box on the compiled decoding step, and its generation stream beside it.

An engine told to compile (:class:`attnlab.tools.serve.Engine` ``compile=True``, what ``attnlab serve``
does) compiles the step on a thread of its own at warm-up, on a copy of the model's modules (requests
go on meanwhile), then checks it on the model itself under the engine's lock. Chat answers then decode on the compiled
step and compile nothing on the model thread: the same answers as an engine that does not compile.
The generation stream reads every layer's attention at each token at the hook points, compiled with
the step (its own compiled step, made at warm-up beside the chat's): the tokens ``model.generate``
draws, and the attention the eager forward shows (``trace_generation``). Each test that compiles is
slow; one engine compiles for them all.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch._dynamo.utils import counters

from attnlab.decoding import FastDecoder, Route
from attnlab.tokenizers import CharTokenizer
from attnlab.tools.loading import LoadedModel

pytest.importorskip("fastapi", reason="attnlab serve needs the serve extra (pip install 'attnlab[serve]')")
from attnlab.tools.serve import Engine
from attnlab.tools.serve.chat import advance_chat, start_chat
from test_serve import CHARS, sharp_gpt

pytestmark = pytest.mark.usefixtures("one_thread_module")

LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2)


def graphs() -> int:
    """Graphs Dynamo compiled so far in this process."""
    return counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def chat_engines(tmp_path_factory, one_thread_module):
    """``(plain, compiled)``: two engines on one tiny ChatML Llama, the second told to compile, warmed up
    and its step compiled (once for the module's tests)."""
    pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    from attnlab.tools.loading import load_pretrained
    from test_chat import write_model_dir

    loaded = load_pretrained(str(write_model_dir(tmp_path_factory.mktemp("chat") / "chat")), device="cpu")
    plain, compiled = Engine(loaded), Engine(loaded, compile=True)
    assert not plain.compile and compiled.compile
    compiled.warm_up()
    assert compiled.wait_compiled(timeout=900) and compiled.compile_error is None
    stats = compiled.snapshot()
    assert stats["steps_compiled"] == 1 and stats["steps_compiling"] == 0  # the chat box's step
    return plain, compiled


def stream_all(engine: Engine, prompt: str, n: int, **kw) -> list[dict]:
    run = engine.start_generation(prompt, n, **kw)
    steps = []
    while (data := engine.advance(run)) is not None:
        steps.append(data)
    engine.finish(run)
    return steps


def chat_answer(engine: Engine, messages: list[dict], n: int) -> tuple[list[int], str]:
    run = start_chat(engine, messages, n, temperature=0.0)
    while advance_chat(engine, run) is not None:
        pass
    engine.finish(run)
    return run.answer_ids, run.end_reason


@pytest.mark.slow
def test_the_compiling_thread_ends_when_no_size_is_left(chat_engines):
    # (with it its OpenMP workers, which would otherwise slow the model thread's steps: Engine.run)
    deadline = time.monotonic() + 10
    while any(t.name == "attnlab-compile" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == "attnlab-compile"]


def test_the_chat_box_runs_the_compiled_step(chat_engines, routes):
    plain, compiled = chat_engines
    messages = [{"role": "user", "content": "Jack Gisburn?"}]
    want = chat_answer(plain, messages, 10)
    assert len(want[0]) > 0 and routes and set(routes) == {Route.EAGER}  # (the fast step, uncompiled)
    routes.clear()
    before, generations = graphs(), compiled.snapshot()["compiled_generations"]
    assert chat_answer(compiled, messages, 10) == want
    assert len(routes) == len(want[0]) - 1 and set(routes) == {Route.COMPILED}  # every step after the prompt's
    assert graphs() == before  # nothing compiled on the model thread
    assert compiled.snapshot()["compiled_generations"] == generations + 1
    assert plain.snapshot()["compiled_generations"] == 0


@pytest.mark.slow
def test_the_generation_stream_runs_the_compiled_step_with_the_tokens_and_attention_of_the_eager_forward(
    chat_engines, routes
):
    """The stream reads each token's attention at the hook points inside the fast step (compiled on the
    compiling engine): the tokens ``model.generate`` draws (with ``torch.Generator().manual_seed(seed)``)
    and each token's attention rows as ``trace_generation`` plays them back from the eager forward, on
    both engines; nothing compiled on the model thread."""
    from attnlab.interpret import trace_generation
    from attnlab.interpret.codec import to_json, unpack

    plain, compiled = chat_engines
    model = compiled.loaded.model
    prompt = "Jack Gisburn had always"
    idx = torch.tensor([compiled.encode(prompt)])
    before, generations = graphs(), compiled.snapshot()["compiled_generations"]
    for kw in (dict(temperature=0.0), dict(temperature=0.9, top_k=12, seed=7)):
        sampling = {k: v for k, v in kw.items() if k != "seed"}
        g = torch.Generator().manual_seed(kw.get("seed", 0))
        want = model.generate(idx, 14, generator=g, fast=False, **sampling)[0, idx.shape[1] :].tolist()
        g = torch.Generator().manual_seed(kw.get("seed", 0))
        played = trace_generation(model, idx, 14, generator=g, **sampling)
        assert played.new_tokens[0].tolist() == want
        for engine, route in ((plain, Route.EAGER), (compiled, Route.COMPILED)):
            routes.clear()
            got = stream_all(engine, prompt, 14, **kw)
            assert [d["token"] for d in got] == want
            assert [d["position"] for d in got] == list(range(idx.shape[1], idx.shape[1] + 14))
            assert routes == [route] * 13  # every step after the prompt's on the fast step
            for d, step in zip(got, played.steps, strict=True):
                assert d["key_start"] == step.key_start and d["key_index"] == step.key_index[0].tolist()
                weights = unpack(to_json({"w": d["weights"]}))["w"]  # (L, H, S)
                torch.testing.assert_close(weights, step.weights[:, 0].float(), rtol=1e-5, atol=1e-6)
    assert graphs() == before  # (the stream's step was compiled at warm-up, on the compiling thread)
    assert compiled.snapshot()["compiled_generations"] == generations + 2


@pytest.mark.slow
def test_sixteen_clients_while_it_compiles_then_after(tmp_path, subprocess_env):
    """``attnlab serve`` as a user starts it (compiling by default): the sixteen-client workload of
    test_serve (200 requests, 4 generations among them, every answer checked) while the step compiles
    in the background (the requests wait while the compiling thread holds the engine), then again once
    it is compiled, when the stream's generations run the compiled step (each counts as compiled); Ctrl-C
    exits cleanly."""
    import httpx

    from attnlab.tools.loading import load_model
    from test_serve import MAX_NEW, Server, save_checkpoint, test_sixteen_concurrent_clients_each_get_their_own_answer

    d = save_checkpoint(sharp_gpt(), tmp_path / "sharp")
    checkpoint = (d, load_model(d))
    server = Server("--checkpoint", str(d), "--max-new-tokens", str(MAX_NEW), env=subprocess_env, compile=True)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            test_sixteen_concurrent_clients_each_get_their_own_answer(server, checkpoint)
            deadline = time.monotonic() + 900  # (a wait, not a check of time)
            while c.get("/api/stats").json()["steps_compiled"] < 1 and time.monotonic() < deadline:
                time.sleep(1)
            before = c.get("/api/stats").json()
            assert before["steps_compiled"] == 1 and before["steps_compiling"] == 0 and before["compile_failed"] == 0
            test_sixteen_concurrent_clients_each_get_their_own_answer(server, checkpoint)
            after = c.get("/api/stats").json()
            assert after["generations_started"] - before["generations_started"] == 4
            assert after["compiled_generations"] - before["compiled_generations"] == 4  # (the streams' steps)
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


def test_requests_run_while_a_size_compiles(tmp_path, monkeypatch):
    # The compiling thread held the engine's lock for the whole compile: every request waited minutes.
    # It now compiles on a copy of the model's modules (the weights shared) and takes the lock only for
    # the model's own step, which finds the code made.
    model = sharp_gpt(2, **LLAMA)
    engine = Engine(LoadedModel(model, CharTokenizer(CHARS), tmp_path), compile=True)
    compiling, go, seen = threading.Event(), threading.Event(), []
    real = FastDecoder.precompile

    def slow(self, reading=None):
        seen.append(self.model is model)
        if self.model is not model:  # (the copy: a compile taking long)
            assert self.model.tok_emb.weight is model.tok_emb.weight and self.model.trf_blocks[0].hook is None
            compiling.set()
            assert go.wait(60)
        return real(self, reading)

    monkeypatch.setattr(FastDecoder, "precompile", slow)
    engine.warm_up()
    assert compiling.wait(60)
    answered = threading.Event()
    threading.Thread(target=lambda: engine.run(lambda: None) or answered.set(), daemon=True).start()
    assert answered.wait(30)  # (it waited for the compile before)
    go.set()
    assert engine.wait_compiled(timeout=900) and engine.compile_error is None
    assert seen == [False, False, True, True]  # the copy's two steps, then the model's own


def test_a_size_asked_for_as_the_compilation_fails_is_not_left_compiling(tmp_path, monkeypatch):
    """The warm-up asks for the short generations' size; its compilation fails, and the compiling thread
    has let the engine go but not yet recorded the failure when a request of another size checks the
    model (the failure's message waits for that check, the check for the failure to be recorded): that
    size is refused, and nothing stays counted as compiling."""
    from attnlab.tools.serve import engine as engine_module

    failing, second_checking = threading.Event(), threading.Event()

    class SlowError(Exception):
        def __str__(self) -> str:  # (read after the engine's lock is let go, before the failure is recorded)
            second_checking.wait(30)
            return "division by zero"

    def fail(self):
        failing.set()
        raise SlowError

    monkeypatch.setattr(FastDecoder, "precompile", fail)
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
    assert failing.wait(30)
    assert engine.run(lambda: engine.compiled_step(300, 10)) is False  # (a request of 300 + 10 tokens)
    assert engine.wait_compiled(timeout=60)
    assert len(calls) == 2 and engine.compile_error == "SlowError: division by zero"
    stats = engine.snapshot()
    assert stats["compile_failed"] == 1 and stats["steps_compiling"] == 0 and stats["steps_compiled"] == 0, stats


def test_a_failed_compilation_leaves_the_fast_path(tmp_path, monkeypatch, capsys, steps):
    """No C++ compiler, say: one warning line, the stats say so, and chat answers decode on the eager
    fast step (the generation stream runs the eager forward either way): the same tokens."""
    pytest.importorskip("transformers")
    pytest.importorskip("jinja2")
    from attnlab.tools.loading import load_pretrained
    from test_chat import write_model_dir

    def fail(self):
        raise RuntimeError("no C++ compiler found\nsecond line")

    monkeypatch.setattr(FastDecoder, "precompile", fail)
    loaded = load_pretrained(str(write_model_dir(tmp_path / "chat")), device="cpu")
    capsys.readouterr()  # (transformers' progress bars writing the model)
    engine = Engine(loaded, compile=True)
    engine.warm_up()
    assert engine.wait_compiled(timeout=60)
    assert engine.compile_error == "RuntimeError: no C++ compiler found"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab serve: warning: the compiled decoding step failed"), err
    messages = [{"role": "user", "content": "Jack Gisburn?"}]
    want = chat_answer(Engine(loaded), messages, 6)
    steps[0] = 0
    assert chat_answer(engine, messages, 6) == want and steps[0] == len(want[0]) - 1 > 0
    got = stream_all(engine, "abc", 5, temperature=0.0)
    assert [d["token"] for d in got] == [d["token"] for d in stream_all(Engine(loaded), "abc", 5, temperature=0.0)]
    stats = engine.snapshot()
    assert stats["compile_failed"] == 1 and stats["steps_compiling"] == 0 and stats["compiled_generations"] == 0
