"""The model behind ``attnlab serve``: one model, one thread, and the answers of :mod:`attnlab.interpret`.

Every model call runs on one dedicated thread (:meth:`Engine.run`), under a lock, in
``torch.inference_mode()``; requests queue for it. Serialising is deliberate: what the inspector
records is per-call state *on the model* (the hook points' functions of :func:`attnlab.interpret.trace`
and :func:`attnlab.interpret.ablate`), so two calls running at once would record each other's
attention or ablate each other's heads; a copy of the model per worker would cost its memory and
buy nothing on cores one forward pass already keeps busy. One thread, not a lock taken by whichever
worker thread a request lands on: each thread that calls into torch gets its own team of OpenMP
threads, and many teams spinning on a few cores slow every forward pass. The server's event loop
stays free meanwhile, to serve files and notice clients that leave.

A generation advances one token per model call (:meth:`Engine.advance`): between two of its
tokens other requests run (typing stays live while a generation streams), and a generation whose
client has gone is simply not advanced again (:meth:`Engine.finish`). Its KV caches belong to the
generation, not to the model, so interleaving is safe.

Generations and chat answers decode with attnlab's compiled step (:mod:`attnlab.decoding`,
``compile=True``) where the engine is told to (``attnlab serve`` does, unless ``--no-compile``).
Compiling is slow, so it never happens on the model thread, where it would hold up every request:
:meth:`Engine.warm_up` compiles the cache size of short generations (256 slots: a prompt and its new
tokens up to 256) on a thread of its own, and a generation of another size asks for its size to be
compiled likewise. Until its size is compiled a generation runs the eager fast path (the same tokens,
slower).

Recent traces are cached by token ids: the live page asks for the heads, then for the next-token
probabilities, the rollout or the lens of the same prompt, and each of those reuses one forward pass.
While the user types, the heads view needs the attention alone: that pass records no stages and stops
before the final norm and the unembedding; a section that needs more traces the prompt again, fully.
Typing changes the end of the prompt only, so the attention pass keeps the keys and values of its
tokens (:func:`attnlab.interpret.retrace`): the next prompt runs the model on the tokens after the
longest prefix it shares with a recent one, and takes the attention rows of that prefix as they were.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import queue
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

import torch

from attnlab import hardware
from attnlab.checks import check_bool
from attnlab.decoding import FastDecoder, supported
from attnlab.errors import UserError
from attnlab.files import first_line
from attnlab.generation import SamplingConfig, cache_length, stream
from attnlab.interpret import (
    KeptTrace,
    ablation_effect,
    attention_rows,
    inspector_data,
    parse_heads,
    retrace,
    rows_of,
    shared_prefix,
    token_label,
    token_strings,
    trace,
)
from attnlab.interpret.inspector import generation_step_data, resolve_index, steps_cost, weights_dtype
from attnlab.interpret.playback import GenerationStep, key_index, key_offsets, top_candidates
from attnlab.tokenizers import prompt_tokens
from attnlab.tools.loading import LoadedModel

__all__ = ["DEFAULT_PROMPT", "Engine", "GenerationRun", "Limits", "NotALanguageModel"]

DEFAULT_PROMPT = "Your journey starts with one step"
FULL_TRACE_SECTIONS = {"steps", "next", "lens"}  # the sections that need the stages or the logits of a trace
COMPILED_SIZES = 4  # cache sizes of the decoding step compiled (each a graph Dynamo keeps)
T = TypeVar("T")


class NotALanguageModel(UserError):
    """A request that needs a language model, sent to a server of the tutorials' six-word example."""


# Tokens per window the latents' dashboards read the start-up corpus in (at most the model's context).
CORPUS_CONTEXT = 128


def corpus_context(model: Any, tokens: int) -> int:
    """The window the start-up corpus of ``tokens`` tokens is read in, for ``model``."""
    return max(1, min(CORPUS_CONTEXT, model.config.context_length, tokens))


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (the API refuses more with a 4xx).

    Attributes:
        max_new_tokens: tokens one generation may stream.
        max_body_bytes: the largest request body read.
        max_prompt_chars: the longest prompt text (the context window limits its tokens too).
        max_trace_bytes: the attention maps one inspected prompt may hold (layers x heads x tokens²
            float32 numbers: a prompt as long as SmolLM2's context would need 72 GB).
        max_maps_bytes: the attention maps one answer may send, in the precision it sends them (the
            answer is built in memory, several times that size on its way out).
    """

    max_new_tokens: int = 256
    max_body_bytes: int = 256 << 10
    max_prompt_chars: int = 100_000
    max_trace_bytes: int = 2 << 30
    max_maps_bytes: int = 64 << 20


@dataclass
class GenerationRun:
    """One streaming generation: :meth:`Engine.advance` adds a token, :meth:`Engine.finish` ends it."""

    ids: list[int]
    prompt_length: int
    sampling: SamplingConfig
    max_new_tokens: int
    candidates: int
    tokens: Any  # the iterator of attnlab.generation.stream
    produced: int = 0
    finished: bool = False
    end_reason: str = ""  # "length" (all tokens made), "shutdown", "stopped" (its client left)
    started: float = field(default_factory=time.perf_counter)


class Engine:
    """A loaded model (or the tutorials' six-word example) and everything the API computes with it.

    Args:
        loaded: from :func:`attnlab.tools.loading.load` (a language model); or None with ``demo``.
        demo: the page data of the tutorials' six-word example (:func:`attnlab.tools.viz.view_to_dict`
            of :func:`attnlab.tools.viz.demo_view`), served as it is.
        name: the model's name on the page.
        limits: what a request may ask for.
        cache_size: traces kept (each holds the stages and the logits of one prompt).
        kept_bytes: memory for the attention traces kept with their keys and values, whose prefix the
            next prompts reuse, at most ``4 * cache_size`` of them; the latest is kept whatever its size.
        prompt: the prompt the page opens with (default: the tutorials' "Your journey starts with
            one step", when the tokenizer can read it).
        saes: SAEs of the model by name (on its device, in its dtype): the Features tab
            (:mod:`~attnlab.tools.serve.features`); each is checked against the model here.
        sae_corpus: 1-D token ids the latents' dashboards may also read (``sae_corpus_name``: what to call it).
        compile: decode generations and chat answers with the compiled step once it is compiled for
            their cache size, on a thread of its own (see the module's docstring); CPU and CUDA only.
    """

    def __init__(
        self,
        loaded: LoadedModel | None = None,
        *,
        demo: dict[str, Any] | None = None,
        name: str = "",
        limits: Limits | None = None,
        cache_size: int = 4,
        kept_bytes: int = 512 << 20,
        prompt: str | None = None,
        compile: bool = False,
        saes: dict[str, Any] | None = None,
        sae_corpus: Any = None,
        sae_corpus_name: str = "the corpus",
    ):
        if (loaded is None) == (demo is None):
            raise ValueError("Engine needs a loaded model or the demo's page data, exactly one")
        self.loaded, self.demo = loaded, demo
        self.limits = limits or Limits()
        self.name = name or ("the tutorials' six-word example" if demo is not None else type(loaded.model).__name__)
        self.lock = threading.Lock()
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnlab-model")
        self._model_thread_lock = threading.Lock()  # held while work is handed to the model thread (see rest)
        self.cache_size, self.kept_bytes = cache_size, kept_bytes
        self._traces: OrderedDict[tuple[int, ...], Any] = OrderedDict()
        self._kept: OrderedDict[tuple[int, ...], KeptTrace] = OrderedDict()  # attention traces, keys and values
        self._roles: dict[str, Any] | None = None
        self._labels: dict[int, str] = {}  # token id -> label (at most the vocabulary)
        self._stats_lock = threading.Lock()
        self.closing = False  # set when the server shuts down: generations end at their next token
        self.default_prompt = self._first_prompt(prompt)
        self.saes = dict(saes or {})
        if self.saes and loaded is None:
            raise ValueError("saes= needs a language model (the SAEs read its activations)")
        for sae in self.saes.values():
            sae.check_model(loaded.model)
        if sae_corpus is not None and loaded is not None:  # whole windows only: /api/info counts what is read
            context = corpus_context(loaded.model, len(sae_corpus))
            sae_corpus = sae_corpus[: len(sae_corpus) // context * context]
        self.sae_corpus, self.sae_corpus_name = sae_corpus, sae_corpus_name
        self.corpus_stats: OrderedDict[tuple[int, ...], Any] = OrderedDict()  # (sae, settings) -> every latent's
        device = None if loaded is None else loaded.model.device
        self.compile = check_bool("compile", compile) and device is not None and device.type in ("cpu", "cuda")
        self.compile_error: str | None = None  # why compiling failed (then generations stay on the fast path)
        self._compiles: dict[int, threading.Event] = {}  # cache slots -> done
        self._compile_jobs: queue.SimpleQueue = queue.SimpleQueue()
        # Held while a size is asked for and while a failure is recorded: a size asked for just as the
        # compiling thread failed was counted as compiling for good (its job never ran).
        self._compile_lock = threading.Lock()
        self._compiler: threading.Thread | None = None
        self.stats: dict[str, int] = {
            "model_calls": 0,
            "traces": 0,
            "trace_cache_hits": 0,
            "tokens_run": 0,
            "prefix_reuses": 0,
            "tokens_reused": 0,
            "generations_started": 0,
            "generations_finished": 0,
            "generations_stopped": 0,
            "generations_active": 0,
            "generation_steps": 0,
            "compiled_generations": 0,
            "steps_compiled": 0,
            "steps_compiling": 0,
            "compile_failed": 0,
        }
        # The model is the model thread's from here: a thread that loaded it and lives on (a script's main
        # one; attnlab serve loads on a thread that ends) lets its OpenMP workers go as far as the runtime
        # allows, or the model thread's barriers wait throttled (see run).
        hardware.release_openmp_threads()

    # -- bookkeeping ------------------------------------------------------------------------------
    def count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[key] += n

    def snapshot(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self.stats)

    def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` alone on the model: on the model's thread, under the lock, in inference mode.
        Blocks the calling thread until it is done (the server calls it from worker threads).

        A request's torch work all runs here, its small after-work too: on another thread it would get
        a team of OpenMP workers of its own (see :func:`attnlab.hardware.release_openmp_threads`)."""

        def alone() -> T:
            with self.lock, torch.inference_mode():
                self.count("model_calls")
                return fn()

        return self._submit(alone).result()

    def _submit(self, fn: Callable[[], T]) -> Future[T]:
        with self._model_thread_lock:
            return self._model_thread.submit(fn)

    def rest(self) -> None:
        """End the model thread once its work is done, its OpenMP workers with it (see :meth:`run`); the next
        call starts another. For a process that runs torch on another thread meanwhile (a benchmark)."""
        with self._model_thread_lock:
            old = self._model_thread
            self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attnlab-model")
        old.shutdown(wait=True)

    @property
    def is_language_model(self) -> bool:
        return self.loaded is not None

    def _need_model(self) -> LoadedModel:
        if self.loaded is None:
            raise NotALanguageModel(
                "this server shows the tutorials' six-word example, which is not a language model: prompts, "
                "generation and ablation need one (attnlab serve --checkpoint DIR or --model NAME)"
            )
        return self.loaded

    # -- what the page needs first ----------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        """The model, the limits, and whether prompts can be typed."""
        model = None
        if self.loaded is not None:
            cfg = self.loaded.model.config
            model = {
                "name": self.name,
                "n_layers": cfg.n_layers,
                "n_heads": cfg.n_heads,
                "n_kv_heads": getattr(cfg, "kv_heads", cfg.n_heads),
                "head_dim": getattr(cfg, "head_dim", None),
                "vocab_size": cfg.vocab_size,
                "context_length": cfg.context_length,
            }
        return {
            "name": self.name,
            "language_model": self.is_language_model,
            "chat": self.loaded is not None and self.loaded.chat_template is not None,
            "model": model,
            "default_prompt": self.default_prompt,
            "saes": self._sae_info(),
            "sae_corpus": None
            if self.sae_corpus is None
            else {"name": self.sae_corpus_name, "tokens": len(self.sae_corpus)},
            "torch_threads": torch.get_num_threads(),
            "limits": asdict(self.limits) | {"max_prompt_tokens": None if model is None else model["context_length"]},
        }

    def _sae_info(self) -> list[dict[str, Any]]:
        """The SAEs of the Features tab, in the order of ``attnlab serve --sae``."""
        return [
            {
                "index": i,
                "name": name,
                "hook": sae.cfg.hook_name,
                "d_sae": sae.cfg.d_sae,
                "architecture": sae.cfg.architecture,
                "transcoder": sae.cfg.transcoder,
            }
            for i, (name, sae) in enumerate(self.saes.items())
        ]

    def _first_prompt(self, prompt: str | None) -> str:
        """The prompt the page opens with: ``prompt`` (checked), else the tutorials' sentence if the
        tokenizer can read it (or its lower case), else nothing."""
        if self.loaded is None:
            return ""
        if prompt is not None:
            self.encode(prompt)  # a bad --prompt is an error now, not on the page
            return prompt
        for text in (DEFAULT_PROMPT, DEFAULT_PROMPT.lower()):
            try:
                self.encode(text)
                return text
            except ValueError:
                continue
        return ""

    def encode(self, prompt: str, field: str = "prompt") -> list[int]:
        """The prompt's token ids (after the model's BOS, where it expects one), checked against the
        context window; errors name the request's ``field``."""
        loaded = self._need_model()
        try:
            ids = prompt_tokens(loaded.tokenizer, prompt)
        except ValueError as e:  # (the tokenizer's words: which field they are about)
            raise ValueError(f"{field}: {e}") from None
        if not ids:
            raise ValueError(f"{field}: the prompt encodes to no tokens; type some text")
        ctx = loaded.model.config.context_length
        if len(ids) > ctx:
            raise ValueError(
                f"{field}: the prompt is {len(ids)} tokens long, more than the model's context window "
                f"(context_length={ctx}); shorten it"
            )
        return ids

    def labels(self, ids: Sequence[int]) -> dict[str, str]:
        """Printable labels of token ids, as the page shows them (each decoded once: a stream asks for
        eleven a token)."""
        ids = sorted(set(int(i) for i in ids))
        new = [i for i in ids if i not in self._labels]
        if new:
            tokenizer = self._need_model().tokenizer
            self._labels.update(zip(new, map(token_label, token_strings(tokenizer, new)), strict=True))
        return {str(i): self._labels[i] for i in ids}

    def tokenize(self, prompt: str) -> dict[str, Any]:
        ids = self.encode(prompt)
        tokens = token_strings(self._need_model().tokenizer, ids)
        return {"ids": ids, "tokens": tokens, "labels": [token_label(t) for t in tokens]}

    # -- traces -----------------------------------------------------------------------------------
    def _trace(self, ids: list[int], full: bool = True):
        """The trace of ``ids``: with the stages and the logits (``full``), or the attention alone, which
        is all the heads view and rollout need (what the page asks while the user types: no final norm,
        no unembedding, nothing kept but the weights). Call with the lock held."""
        key = tuple(ids)
        cached = self._traces.get(key)
        if cached is None:
            self._check_trace_size(len(ids))
        if cached is not None and (cached.logits is not None or not full):
            self._traces.move_to_end(key)
            self.count("trace_cache_hits")
            return cached
        loaded = self._need_model()
        idx = torch.tensor([ids], dtype=torch.long, device=loaded.model.device)
        if full:
            tr = trace(loaded.model, idx, stages=True, logits=True, tokenizer=loaded.tokenizer)
            self.count("tokens_run", len(ids))
        else:  # the attention alone: from the recent prompt sharing the longest prefix, if any
            base = max(self._kept.values(), key=lambda k: shared_prefix(k.trace.idx, idx), default=None)
            kept = retrace(loaded.model, idx, base, tokenizer=loaded.tokenizer)
            self.count("tokens_run", len(ids) - kept.reused)
            if kept.reused:
                self.count("prefix_reuses")
                self.count("tokens_reused", kept.reused)
            self._keep(key, kept)
            tr = kept.trace
        self.count("traces")
        _remember(self._traces, key, tr, self.cache_size)
        # In bytes too: a few long prompts' traces (2.3 GB each at 1,410 tokens of SmolLM2) took the server past
        # 6 GB; those kept hold at most max_trace_bytes, the latest whatever its size.
        total = sum(_nbytes(t) for t in self._traces.values())
        while len(self._traces) > 1 and total > self.limits.max_trace_bytes:
            total -= _nbytes(self._traces.popitem(last=False)[1])
        return tr

    def _check_maps_size(self, T: int, n_layers: int, n_heads: int, precision: str) -> None:
        """A ValueError (a 422) where the heads view's maps would pass :attr:`Limits.max_maps_bytes` as sent."""
        n = n_layers * n_heads * T * (T + 1) // 2  # (causal maps are sent as their lower triangles)
        dtype = weights_dtype(n, precision)
        need = n * {"f32": 4, "u16": 2, "u8": 1}[dtype]
        if need > self.limits.max_maps_bytes:
            raise ValueError(
                f"the heads view of {T} tokens, {n_layers} layers x {n_heads} heads in {dtype}, is "
                f"{need / 2**20:.0f} MiB, more than this server sends ({self.limits.max_maps_bytes >> 20} MiB): ask "
                "for fewer layers or heads (layers:, heads:), precision u8, or a shorter prompt"
            )

    def _check_trace_size(self, T: int) -> None:
        """A ValueError (a 422) where ``T`` tokens' attention maps would pass :attr:`Limits.max_trace_bytes`."""
        cfg = self._need_model().model.config
        need = cfg.n_layers * cfg.n_heads * T * T * 4
        if need > self.limits.max_trace_bytes:
            longest = math.isqrt(self.limits.max_trace_bytes // (4 * cfg.n_layers * cfg.n_heads))
            raise ValueError(
                f"the prompt is {T} tokens: its attention maps ({cfg.n_layers} layers x {cfg.n_heads} heads x "
                f"{T}² numbers, {need / 2**30:.1f} GiB) are more than this server traces; inspect at most "
                f"{longest} tokens"
            )

    def _keep(self, key: tuple[int, ...], kept: KeptTrace) -> None:
        """Keep ``kept`` last; forget the oldest while they hold more than ``kept_bytes`` (not the latest)."""
        _remember(self._kept, key, kept, self.cache_size * 4)

        def size(k: KeptTrace) -> int:
            caches = sum(c.keys.nbytes + c.values.nbytes for c in k.caches)
            return k.trace.weights.nbytes + caches

        total = sum(size(k) for k in self._kept.values())
        while len(self._kept) > 1 and total > self.kept_bytes:
            total -= size(self._kept.popitem(last=False)[1])

    def inspect(
        self,
        prompt: str,
        sections: Collection[str],
        *,
        steps: Sequence[str] | None = None,
        layers: Sequence[int] | None = None,
        heads: Sequence[int] | None = None,
        precision: str = "auto",
        lens_k: int = 5,
        lens_window: tuple[int, int] | None = None,
        next_k: int = 32,
    ) -> dict[str, Any]:
        """:func:`attnlab.interpret.inspector_data` of the prompt, the given sections only (arrays
        still :class:`~attnlab.interpret.codec.Packed`); ``lens_window``: the positions ``[start, stop)``
        of the logit lens (default: all). Head roles depend on the model alone: they are computed once."""
        ids = self.encode(prompt)
        sections = set(sections)
        loaded = self._need_model()
        cfg = loaded.model.config
        # checked here, naming the request's fields (the library's words are the command line's flags)
        layers = None if layers is None else [resolve_index("layers:", i, cfg.n_layers) for i in layers]
        heads = None if heads is None else [resolve_index("heads:", h, cfg.n_heads) for h in heads]
        if "layers" in sections:
            self._check_maps_size(
                len(ids), len(set(layers or range(cfg.n_layers))), len(set(heads or range(cfg.n_heads))), precision
            )
        if "steps" in sections and steps is not None:  # (named heads: "auto" keeps to the page's budget)
            shown = {(layer, h) for layer in layers or range(cfg.n_layers) for h in heads or range(cfg.n_heads)}
            try:
                named = parse_heads(steps, cfg.n_layers, cfg.n_heads)
            except ValueError as e:  # (its words name the library's argument, heads)
                raise ValueError(f"steps: {str(e).removeprefix('heads ')}") from None
            hidden = [f"{layer}.{h}" for layer, h in named if (layer, h) not in shown]
            if hidden:
                raise ValueError(f"steps: {', '.join(hidden)} not among the heads shown (layers:, heads:)")
            need = len(steps) * steps_cost(len(ids), len(ids), cfg.head_dim)
            if need > self.limits.max_maps_bytes:
                raise ValueError(
                    f"the steps of {len(steps)} heads on {len(ids)} tokens are {need / 2**20:.0f} MiB, more than "
                    f"this server sends ({self.limits.max_maps_bytes >> 20} MiB): name fewer heads (steps:) or "
                    "send a shorter prompt"
                )

        def work() -> dict[str, Any]:
            tr = self._trace(ids, full=bool(sections & FULL_TRACE_SECTIONS))
            data = inspector_data(
                tr,
                sections=sections - {"roles"},
                steps="auto" if steps is None else list(steps),
                title=prompt,
                text=prompt,
                model_name=self.name,
                layers=layers,
                heads=heads,
                precision=precision,
                lens_k=lens_k,
                lens_window=lens_window,
                next_k=next_k,
                roles=False,
            )
            if "roles" in sections:
                data["roles"] = self._head_roles()
            return data

        data = self.run(work)
        data["ids"] = ids
        data["vocab_size"] = loaded.model.config.vocab_size
        return data

    def _head_roles(self) -> dict[str, Any]:
        """The head-role section of the page (computed once: it depends on the model alone). Call with
        the lock held."""
        if self._roles is None:
            loaded = self._need_model()
            one = torch.zeros((1, 1), dtype=torch.long, device=loaded.model.device)
            tr = trace(loaded.model, one, logits=False)  # any trace: the roles come from a probe of their own
            self._roles = inspector_data(tr, sections={"roles"})["roles"]
        return self._roles

    def warm_up(self) -> None:
        """Compute the head roles on the model's thread now, without waiting for them: the page's first
        full inspection then finds them ready. A request that comes meanwhile waits its turn."""
        if self.loaded is None:
            return

        def roles() -> None:
            with self.lock, torch.inference_mode():
                self._head_roles()
                if self.compile:
                    self.compiled_step(1, 1)

        self._submit(roles)  # (an error here surfaces again when a request asks for roles)

    # -- the compiled decoding step ---------------------------------------------------------------
    def compiled_step(self, prompt_length: int, max_new_tokens: int) -> bool:
        """Whether a generation of these lengths (a chat answer's: nothing observes it) may decode with the
        compiled step: compiled already for its cache size. If not, that size is compiled on the
        compiling thread (at most :data:`COMPILED_SIZES` sizes), and this generation runs the eager fast
        path. Call on the model thread, with the lock held (the model is checked for what the fast path
        supports)."""
        if not self.compile or self.compile_error is not None:
            return False
        model = self._need_model().model
        slots = cache_length(model, prompt_length, max_new_tokens, compile=True)
        done = self._compiles.get(slots)
        if done is not None:
            return done.is_set()
        if len(self._compiles) >= COMPILED_SIZES:
            return False
        if not supported(model, model.new_kv_caches(1, 1), None):
            return False
        with self._compile_lock:
            if self.compile_error is not None:  # (failed since the check above)
                return False
            self._compiles[slots] = threading.Event()
            self.count("steps_compiling")
            self._compile_jobs.put(slots)
            # (a daemon: a server that stops does not wait; it ends, with its OpenMP workers, when idle: see run)
            if self._compiler is None:
                self._compiler = threading.Thread(target=self._compile, name="attnlab-compile", daemon=True)
                self._compiler.start()
        return False

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until every compilation asked for so far is done (or failed: :attr:`compile_error`);
        False if ``timeout`` seconds passed first. (Not on the model thread: it waits for the model
        thread's queue first, where :meth:`warm_up` asks for its compilations.)"""
        self._submit(lambda: None).result()
        deadline = None if timeout is None else time.monotonic() + timeout
        for event in list(self._compiles.values()):
            while not event.is_set() and self.compile_error is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                event.wait(0.1 if left is None else min(0.1, left))
        return True

    def _compile(self) -> None:
        """The compiling thread: each asked-for cache size compiled by a step on caches of its own
        (:meth:`attnlab.decoding.FastDecoder.precompile`). The compiling runs on a copy of the model's
        modules, their weights shared, without the engine's lock: the requests go on meanwhile (a size
        takes minutes), and their hooks are set on the model's own modules, never on the copy's. Then a
        step of the model itself, under the lock, finds that code made (Dynamo's graph takes the modules'
        tensors as inputs, not the modules) and only checks it."""
        loaded = self._need_model()
        model = loaded.model
        with self.lock:  # (no request's hooks on the model while it is copied)
            shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
            shadow = copy.deepcopy(model, shared)
        while True:
            with self._compile_lock:
                try:
                    slots = self._compile_jobs.get_nowait()
                except queue.Empty:
                    self._compiler = None  # (the next size asked for starts a thread anew)
                    return
            try:
                for m, lock in ((shadow, contextlib.nullcontext()), (model, self.lock)):
                    with lock, torch.inference_mode():  # (as the generations run: the graph's guards check it)
                        decoder = FastDecoder(m, m.new_kv_caches(1, slots), compile=True)
                        decoder.precompile()  # a chat answer's step
                        decoder.precompile(attention_rows)  # the generation stream's: each token's attention too
            except Exception as exc:  # e.g. no C++ compiler for inductor: the fast path stays
                with self._compile_lock:  # every size asked for until now is no longer compiling
                    self.compile_error = f"{type(exc).__name__}: {first_line(exc)}"
                    self.count("steps_compiling", -sum(not done.is_set() for done in list(self._compiles.values())))
                print(
                    f"attnlab serve: warning: the compiled decoding step failed ({self.compile_error}); "
                    "generations run the eager fast path",
                    file=sys.stderr,
                    flush=True,
                )
                self.count("compile_failed")  # (nothing else is compiled: compiled_step answers False now)
                return
            self._compiles[slots].set()
            self.count("steps_compiling", -1)
            self.count("steps_compiled")

    def next_tokens(
        self,
        prompt: str,
        *,
        position: int = -1,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        k: int = 12,
    ) -> dict[str, Any]:
        """The ``k`` likeliest next tokens after ``position`` (-1: the last token) and their
        probabilities under temperature/top-k/top-p, from
        :meth:`attnlab.generation.SamplingConfig.probabilities` over the whole vocabulary."""
        ids = self.encode(prompt)
        T_ = len(ids)
        if not -T_ <= position < T_:
            raise ValueError(f"position {position} is out of range: the prompt has {T_} tokens (0..{T_ - 1}, or -1)")
        pos = position % T_
        sampling = SamplingConfig(temperature, top_k, top_p)  # checks the settings, as generation does

        def work() -> tuple[list[int], list[float]]:
            logits = self._trace(ids).logits[0, pos : pos + 1]  # (1, V)
            top, top_probs = top_candidates(logits.float(), sampling.probabilities(logits), k)  # (1, k) x2
            return top[0].tolist(), top_probs[0].tolist()

        top_ids, probs = self.run(work)
        return {
            "position": pos,
            "ids": top_ids,
            "probs": probs,
            "greedy": sampling.greedy,
            "labels": self.labels(top_ids + ids[pos : pos + 1]),
        }

    def ablate(
        self,
        prompt: str,
        heads: Sequence[str],
        *,
        mode: str = "zero",
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        k: int = 10,
    ) -> dict[str, Any]:
        """:func:`attnlab.interpret.ablation_effect` of removing ``heads`` ("L.H") on the prompt: the
        change in loss, KL, and the next-token distribution after the last token under the sampling
        settings, before and after (the ``k`` likeliest of each, with both probabilities)."""
        ids = self.encode(prompt)
        loaded = self._need_model()
        cfg = loaded.model.config
        pairs = parse_heads(list(heads), cfg.n_layers, cfg.n_heads)
        sampling = SamplingConfig(temperature, top_k, top_p)

        def work():  # (all of it on the model thread: see run)
            idx = torch.tensor([ids], dtype=torch.long, device=loaded.model.device)
            effect = ablation_effect(loaded.model, idx, pairs, mode=mode)
            before = sampling.probabilities(effect.logits_before)[0]  # (V,)
            after = sampling.probabilities(effect.logits_after)[0]
            n = min(k, before.shape[-1])
            top_before, top_after = torch.topk(before, n).indices.tolist(), torch.topk(after, n).indices.tolist()
            union = list(dict.fromkeys(top_before + top_after))
            rows = [{"id": i, "before": float(before[i]), "after": float(after[i])} for i in union]
            rows.sort(key=lambda r: (-r["before"], -r["after"]))
            return effect, float(effect.kl[0]), top_before, top_after, rows

        effect, kl, top_before, top_after, rows = self.run(work)
        return {
            "heads": [f"{layer}.{h}" for layer, h in effect.heads],
            "mode": effect.mode,
            "loss_before": effect.loss_before,
            "loss_after": effect.loss_after,
            "loss_change": effect.loss_change,
            "kl": kl,
            "greedy": sampling.greedy,
            "top_before": top_before,
            "top_after": top_after,
            "rows": rows,
            "labels": self.labels([r["id"] for r in rows]),
        }

    # -- generation, a token at a time ------------------------------------------------------------
    def start_generation(
        self,
        prompt: str,
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int = 0,
        candidates: int = 10,
    ) -> GenerationRun:
        """A generation of up to ``max_new_tokens`` after the prompt, sampled with ``seed``: the tokens
        ``model.generate`` draws with ``torch.Generator(device=model.device).manual_seed(seed)``."""
        self.check_new_tokens(max_new_tokens)
        ids = self.encode(prompt)
        model = self._need_model().model
        sampling = SamplingConfig(temperature, top_k, top_p)

        def work() -> GenerationRun:
            idx = torch.tensor([ids], dtype=torch.long, device=model.device)
            g = torch.Generator(device=model.device).manual_seed(int(seed))
            # Each token's attention read at the hook points (attention_rows), by the compiled step where
            # this size is compiled (the hook functions compiled with it), else by the eager one.
            compiled = self.compiled_step(len(ids), max_new_tokens)
            tokens = stream(
                model, idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, generator=g,
                reading=attention_rows, compile=compiled,
            )  # fmt: skip
            self.count("compiled_generations", int(compiled))
            return GenerationRun(list(ids), len(ids), sampling, max_new_tokens, candidates, tokens)

        run = self.run(work)
        self.count("generations_started")
        self.count("generations_active")
        return run

    def check_new_tokens(self, max_new_tokens: int) -> None:
        """ValueError when a generation asks for more tokens than :attr:`limits` allow."""
        if max_new_tokens > self.limits.max_new_tokens:
            raise ValueError(
                f"max_new_tokens: {max_new_tokens} is more than this server allows ({self.limits.max_new_tokens}; "
                "attnlab serve --max-new-tokens N)"
            )

    def ended(self, run: Any) -> bool:
        """Whether ``run`` (a generation or a chat answer) takes no more tokens: finished already,
        the server shutting down, or ``max_new_tokens`` produced (``run.end_reason`` says which)."""
        if run.finished:
            return True
        if self.closing or run.produced >= run.max_new_tokens:
            run.end_reason = "shutdown" if self.closing else "length"
            return True
        return False

    def advance(self, run: GenerationRun) -> dict[str, Any] | None:
        """The next token of ``run`` with its attention and candidates (the page's generation step,
        :func:`attnlab.interpret.inspector.generation_step_data`), or None when it is complete."""
        if self.ended(run):
            return None
        model = self._need_model().model

        def work() -> dict[str, Any] | None:
            step = step_of_stream(model, run)
            if step is None:
                return None
            run.produced += 1
            run.ids.append(int(step.token[0]))
            self.count("generation_steps")
            # (packed here, on the model thread: see run)
            return generation_step_data(step, 0, "f32")

        data = self.run(work)
        if data is None:
            run.end_reason = run.end_reason or "length"
            return None
        data["labels"] = self.labels([data["token"], *data["candidates"]])
        return data

    def finish(self, run: GenerationRun) -> None:
        """End ``run``, complete or not (its client gone: "stopped"); safe to call twice."""

        def close() -> bool:
            if run.finished:
                return False
            run.finished = True
            run.tokens.close()  # the stream's own clean-up (the model's training mode)
            return True

        if not self.run(close):
            return
        stopped = not run.end_reason
        run.end_reason = run.end_reason or "stopped"
        self.count("generations_active", -1)
        self.count("generations_stopped" if stopped else "generations_finished")

    # -- the tutorials' six-word example ----------------------------------------------------------
    def demo_data(self) -> dict[str, Any]:
        if self.demo is None:
            raise LookupError("this server runs a language model, not the tutorials' six-word example")
        return self.demo


def _nbytes(obj: Any) -> int:
    """The bytes of the tensors ``obj`` holds: in its fields (a dataclass), items or elements."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if dataclasses.is_dataclass(obj):
        return sum(_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def _remember(cache: OrderedDict, key: tuple[int, ...], value: Any, size: int) -> None:
    """Put ``value`` last in the least-recently-used ``cache`` of ``size`` entries."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > size:
        cache.popitem(last=False)


def step_of_stream(model: torch.nn.Module, run: GenerationRun) -> GenerationStep | None:
    """Advance ``run`` by one token and record it as :func:`attnlab.interpret.trace_generation` does:
    the attention row of the query that produced the token (each layer's last pass), the candidates
    after temperature/top-k/top-p from the logits it was drawn from, and the token of each key.
    Call with the engine's lock held (the hooks live on the model meanwhile)."""
    step = next(run.tokens, None)  # (token (B,), the logits it was drawn from (B, V), what attention_rows read)
    if step is None:
        return None
    token, logits, read = step
    # The pass's last query's weights in every layer, (L, B, H, S), read before the next step writes the
    # caches again (the positions may be views of them).
    weights, q_positions, k_positions = rows_of(model, read)
    weights = weights.float()  # (L, B, H, S)
    logits = logits.float()  # (B, V), as trace_generation's (ties among bfloat16 logits in one order)
    if run.sampling.greedy:  # one-hot on the token drawn, the argmax: no (B, V) distribution to build
        candidates = top_candidates(logits, None, run.candidates)[0]  # (B, k)
        candidate_probs = (candidates == token[:, None]).float()
        token_prob = torch.ones(token.shape, device=token.device)
    else:
        probs = run.sampling.probabilities(logits)  # (B, V): what the token was drawn from
        candidates, candidate_probs = top_candidates(logits, probs, run.candidates)  # (B, k) x2
        token_prob = probs.gather(-1, token[:, None]).squeeze(-1)
    position = len(run.ids)  # the new token's index: the prompt and the tokens before it
    S = weights.shape[-1]
    # (no offsets to work out while the keys are every token so far, in order: key_index's own case)
    offsets = None if position == S else key_offsets(q_positions, k_positions)
    return GenerationStep(
        token=token,
        position=position,
        key_start=position - S,
        key_index=key_index(offsets, position, S, token.shape[0], token.device),
        weights=weights,
        candidates=candidates,
        probs=candidate_probs,
        token_prob=token_prob,
    )
