"""``attnlab bench``: measure attention implementations and write a report directory.

What is measured (CPU, float32, dropout 0, every competitor in the same run):

* **the machine's matmul rate** (GFLOP/s of an ``n x n`` float32 ``torch.mm``), so every other
  figure is also read as a fraction of what the hardware can do;
* **one causal attention layer, forward+backward, against sequence length**, for the tutorials'
  per-token loop, their matrix form (``CausalAttention``), their stacked-heads wrapper, their
  weight-split ``MultiHeadAttention``, attnlab's ``MultiHeadAttention`` and
  ``torch.nn.MultiheadAttention``; competitors are interleaved (A, B, C, A, B, C, ...) by
  :func:`attnlab.tools.bench.harness.compare_forward_backward` so load from other processes hits all alike,
  and their outputs are checked to agree before they are timed;
* **peak memory of one forward against sequence length**, each point in a fresh process
  (:func:`attnlab.tools.bench.harness.peak_memory_mb`);
* **generation with and without the KV cache** (ms per new token against total length);
* **a GPT training step** (forward, loss, backward, AdamW) against sequence length.

The report directory holds ``report.md`` (tables), ``results.json`` (every figure) and PNG plots.
``--quick`` uses small sizes and finishes in under 3 minutes on a 2-core machine.
"""

from __future__ import annotations

import datetime as _dt
import gc
import io
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
from torch import Tensor

from attnlab.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from attnlab.tools.bench import harness as bm

__all__ = [
    "IMPLEMENTATIONS",
    "BenchConfig",
    "TutorialLoopAttention",
    "add_arguments",
    "attention_flops",
    "bench_attention",
    "bench_generation",
    "bench_memory",
    "bench_training",
    "build_for_memory",
    "build_impl",
    "matmul_rate",
    "run",
    "run_all",
    "write_report",
]


# --------------------------------------------------------------------------------------------
# The competitors
# --------------------------------------------------------------------------------------------
class TutorialLoopAttention(nn.Module):
    """The tutorials' first attention, as loops: one head of width ``d``, causal.

    "A simple self-attention mechanism" computes each score as ``torch.dot(x_i, query)`` in a
    Python loop, normalises it with a softmax, then sums ``weight_j * value_j`` in another loop.
    This module does exactly that for every query token (with trainable ``W_query``/``W_key``/
    ``W_value`` and the ``1/sqrt(d)`` scaling of the later sections), so it computes the same
    function as the tutorial's ``CausalAttention`` in matrix form: ``O(T^2)`` interpreter steps.

    Shapes: ``x (b, T, d_in)`` -> ``(b, T, d_out)``.
    """

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.W_query = nn.Linear(d_in, d_out, bias=False)
        self.W_key = nn.Linear(d_in, d_out, bias=False)
        self.W_value = nn.Linear(d_in, d_out, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        queries, keys, values = self.W_query(x), self.W_key(x), self.W_value(x)  # (b, T, d_out) each
        scale = keys.shape[-1] ** -0.5
        batches = []
        for b in range(x.shape[0]):
            rows = []
            for i in range(x.shape[1]):
                scores = torch.stack([torch.dot(queries[b, i], keys[b, j]) for j in range(i + 1)])  # (i+1,)
                weights = torch.softmax(scores * scale, dim=0)  # (i+1,)
                context = torch.zeros_like(values[b, 0])  # (d_out,)
                for j in range(i + 1):
                    context = context + weights[j] * values[b, j]
                rows.append(context)
            batches.append(torch.stack(rows))  # (T, d_out)
        return torch.stack(batches)  # (b, T, d_out)


def _loop(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
    return TutorialLoopAttention(d_model, d_model)


def _matrix(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
    from attnlab.tutorial_code import CausalAttention

    return CausalAttention(d_model, d_model, context_length, dropout)


@dataclass(frozen=True)
class Impl:
    """One competitor: how to build it and what it computes (for the FLOP count)."""

    label: str
    build: Callable[..., nn.Module]
    one_head: bool  # a single head of width d (no out_proj) instead of num_heads heads
    out_proj: bool  # has the d x d output projection


IMPLEMENTATIONS: dict[str, Impl] = {
    "tutorial-loop": Impl("tutorial loop (1 head, per-token Python loops)", _loop, True, False),
    "tutorial-matrix": Impl("tutorial CausalAttention (1 head, matrix form)", _matrix, True, False),
    "tutorial-wrapper": Impl(
        "tutorial MultiHeadAttentionWrapper (stacked heads)", bm.BUILDERS["tutorial-wrapper"][0], False, False
    ),
    "tutorial-split": Impl("tutorial MultiHeadAttention (weight split)", bm.BUILDERS["tutorial"][0], False, True),
    "attnlab": Impl("attnlab.MultiHeadAttention", bm.BUILDERS["attnlab"][0], False, True),
    "torch": Impl("torch.nn.MultiheadAttention", bm.BUILDERS["torch"][0], False, True),
}


def build_impl(name: str, d_model: int, num_heads: int, context_length: int) -> nn.Module:
    """Build competitor ``name`` of :data:`IMPLEMENTATIONS` (dropout 0)."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {name!r}; choose from {', '.join(IMPLEMENTATIONS)}")
    return IMPLEMENTATIONS[name].build(d_model=d_model, num_heads=num_heads, context_length=context_length)


def build_for_memory(impl: str, d_model: int, num_heads: int, context_length: int) -> nn.Module:
    """Build ``impl`` and run one tiny forward, so the memory child's baseline already includes the
    one-off costs of a first call (kernel libraries paged in, thread pools): the measured peak is
    then what the long forward itself needs. Used as ``"attnlab.tools.bench:build_for_memory"``."""
    module = build_impl(impl, d_model, num_heads, context_length).eval()
    with torch.no_grad():
        module(torch.randn(1, min(8, context_length), d_model))
    return module


def attention_flops(impl: str, batch: int, seq_len: int, d_model: int) -> float:
    """Floating-point operations of one forward, counting every matmul densely.

    Q/K/V projections ``2*B*T*d*3d``, output projection ``2*B*T*d*d`` (where there is one), scores
    and weighted sum ``2 * 2*B*T^2*d`` (the causal half is not subtracted: no implementation here
    skips it). A backward costs about twice a forward, so forward+backward is ``3x`` this.
    """
    spec = IMPLEMENTATIONS[impl]
    B, T, d = batch, seq_len, d_model
    return 6.0 * B * T * d * d + (2.0 * B * T * d * d if spec.out_proj else 0.0) + 4.0 * B * T * T * d


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------
@dataclass
class BenchConfig:
    """Sizes of every sweep. :meth:`quick` is the under-3-minutes version."""

    d_model: int = 768
    num_heads: int = 12
    batch: int = 1
    seq_lens: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048])
    loop_max_len: int = 64  # the Python loop takes O(T^2) interpreter steps (about 10 s a round at 128)
    repeats: int = 7
    warmup: int = 2
    memory_seq_lens: list[int] = field(default_factory=lambda: [128, 1024, 2048, 4096])
    matmul_n: int = 2048
    gen_lens: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024])
    gen_prompt: int = 8
    gen_repeats: int = 2
    train_lens: list[int] = field(default_factory=lambda: [128, 256, 512, 1024])
    train_batch: int = 8
    train_repeats: int = 5
    model_preset: str = "tiny"  # the GPT used for generation and training
    memory: bool = True
    generation: bool = True
    training: bool = True
    seed: int = 0
    threads: int | None = None  # torch threads of the memory-measuring child processes (None: default)
    is_quick: bool = False  # only labels the report

    @classmethod
    def quick(cls, **overrides: object) -> BenchConfig:
        base = cls(
            d_model=256,
            num_heads=4,
            seq_lens=[64, 128, 256, 512],
            repeats=5,
            warmup=1,
            memory_seq_lens=[256, 1024],
            matmul_n=1024,
            gen_lens=[32, 64, 128],
            gen_repeats=2,
            train_lens=[64, 128, 256],
            train_batch=4,
            train_repeats=3,
            is_quick=True,
        )
        for k, v in overrides.items():
            setattr(base, k, v)
        return base


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------
def matmul_rate(n: int = 2048, repeats: int = 5) -> dict[str, float]:
    """Median GFLOP/s of ``torch.mm`` on two ``n x n`` float32 matrices (``2 n^3`` flops each)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    torch.mm(a, b)  # warm-up: thread pool, kernel selection
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    best, med = min(times), statistics.median(times)
    return {"n": n, "gflops_median": 2 * n**3 / med / 1e9, "gflops_best": 2 * n**3 / best / 1e9}


def _share_single_head(src: nn.Module, dst: nn.Module) -> None:
    with torch.no_grad():
        for name in ("W_query", "W_key", "W_value"):
            getattr(dst, name).weight.copy_(getattr(src, name).weight)


def bench_attention(cfg: BenchConfig, log: Callable[[str], None]) -> dict[str, object]:
    """Forward+backward of one causal attention layer per competitor, at each sequence length."""
    d, H, B = cfg.d_model, cfg.num_heads, cfg.batch
    rows = []
    for T in cfg.seq_lens:
        torch.manual_seed(cfg.seed)
        names = [n for n in IMPLEMENTATIONS if n != "tutorial-loop" or cfg.loop_max_len >= T]
        modules = {n: build_impl(n, d, H, T) for n in names}
        # Same weights everywhere, then check the outputs agree before timing anything.
        bm.share_weights(modules["attnlab"], modules["torch"])
        bm.share_weights(modules["attnlab"], modules["tutorial-split"])
        if "tutorial-loop" in modules:
            _share_single_head(modules["tutorial-matrix"], modules["tutorial-loop"])
        ref_wrapper = bm.build_module("attnlab-wrapper", d_model=d, num_heads=H, context_length=T)
        bm.share_weights(modules["tutorial-wrapper"], ref_wrapper)
        x = torch.rand(B, T, d)  # (B, T, d)
        diffs = bm.max_abs_difference({n: modules[n] for n in ("attnlab", "torch", "tutorial-split")}, x)
        diffs.update(
            bm.max_abs_difference({"attnlab-wrapper": ref_wrapper, "tutorial-wrapper": modules["tutorial-wrapper"]}, x)
        )
        single = {n: modules[n] for n in ("tutorial-matrix", "tutorial-loop") if n in modules}
        if len(single) == 2:
            diffs.update(bm.max_abs_difference(single, x))
        log(f"  attention T={T}: {len(modules)} competitors x {cfg.repeats} interleaved rounds")
        timings = bm.compare_forward_backward(modules, x, repeats=cfg.repeats, warmup=cfg.warmup, seed=cfg.seed)
        row: dict[str, object] = {"seq_len": T, "max_abs_diff": diffs, "results": {}}
        for n, t in timings.items():
            flops = 3.0 * attention_flops(n, B, T, d)
            row["results"][n] = {
                "median_ms": t.median_ms,
                "min_ms": t.min_ms,
                "iqr_ms": t.iqr_ms,
                "gflops": flops / (t.median_ms / 1e3) / 1e9,
                "times_ms": list(t.times_ms),
            }
        rows.append(row)
        del modules, ref_wrapper, x
        gc.collect()
    return {"d_model": d, "num_heads": H, "batch": B, "loop_max_len": cfg.loop_max_len, "rows": rows}


def bench_memory(cfg: BenchConfig, log: Callable[[str], None]) -> dict[str, object]:
    """Peak memory of one ``no_grad`` forward, each (competitor, length) in a fresh process."""
    d, H = cfg.d_model, cfg.num_heads
    jobs, skipped = [], {}
    # The loop is measured at its longest timed length only (its memory is small; its time is not).
    points = [(n, T) for T in cfg.memory_seq_lens for n in IMPLEMENTATIONS if n != "tutorial-loop"]
    points.insert(0, ("tutorial-loop", min(cfg.loop_max_len, max(cfg.seq_lens))))
    for n, T in points:
        need_mb = 0.0
        if n in ("tutorial-split", "tutorial-wrapper"):
            need_mb = bm.tutorial_forward_bytes(cfg.batch, T, H) / 2**20
        elif n == "tutorial-matrix":
            need_mb = bm.tutorial_forward_bytes(cfg.batch, T, 1) / 2**20
        avail = bm.available_memory_mb()
        if need_mb and avail is not None and avail < 1.5 * need_mb + 1024:
            skipped[f"{n}@{T}"] = f"needs about {need_mb / 1024:.1f} GiB, {avail / 1024:.1f} GiB available"
            continue
        jobs.append((n, T))
    log(f"  memory: {len(jobs)} forwards, each in a fresh process (2 at a time)")

    def one(job: tuple[str, int]) -> tuple[str, int, dict[str, object]]:
        n, T = job
        kwargs = {"impl": n, "d_model": d, "num_heads": H, "context_length": T}
        r = bm.peak_memory_mb("attnlab.tools.bench:build_for_memory", (cfg.batch, T, d), kwargs=kwargs)
        return n, T, r.to_dict()

    results: dict[str, dict[str, object]] = {n: {} for n in IMPLEMENTATIONS}
    saved = os.environ.get("OMP_NUM_THREADS")
    if cfg.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(cfg.threads)  # read by torch in each child at start-up
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            for n, T, r in pool.map(one, jobs):
                results[n][str(T)] = r
    finally:
        if cfg.threads is not None:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
    return {"batch": cfg.batch, "d_model": d, "num_heads": H, "results": results, "skipped": skipped}


def _gpt(cfg: BenchConfig, context_length: int):
    from attnlab.model import GPT, GPTConfig

    torch.manual_seed(cfg.seed)
    return GPT(GPTConfig.preset(cfg.model_preset, context_length=context_length, drop_rate=0.0))


def bench_generation(cfg: BenchConfig, log: Callable[[str], None]) -> dict[str, object]:
    """Greedy generation from a ``gen_prompt``-token prompt up to each total length, with and
    without the KV cache (interleaved), on the ``model_preset`` GPT."""
    from attnlab.generation import generate

    model = _gpt(cfg, max(cfg.gen_lens)).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, cfg.gen_prompt), generator=torch.Generator().manual_seed(0))
    rows = []
    for L in cfg.gen_lens:
        new = L - cfg.gen_prompt
        if new < 1:
            continue
        log(f"  generation to {L} tokens ({new} new), with and without the cache")
        times: dict[bool, list[float]] = {True: [], False: []}
        outs = {}
        generate(model, prompt, 2, temperature=0.0, use_cache=True)  # warm-up
        for _ in range(cfg.gen_repeats):
            for cache in (True, False):
                t0 = time.perf_counter()
                outs[cache] = generate(model, prompt, new, temperature=0.0, use_cache=cache)
                times[cache].append(time.perf_counter() - t0)
        cached, uncached = statistics.median(times[True]), statistics.median(times[False])
        rows.append(
            {
                "total_len": L,
                "new_tokens": new,
                "cached_ms_per_token": cached / new * 1e3,
                "uncached_ms_per_token": uncached / new * 1e3,
                "speedup": uncached / cached,
                "same_tokens": bool(torch.equal(outs[True], outs[False])),
            }
        )
    return {
        "preset": cfg.model_preset,
        "parameters": model.num_parameters(),
        "prompt_tokens": cfg.gen_prompt,
        "rows": rows,
    }


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor) -> float:
    """Seconds of one optimizer step: zero_grad, forward + loss, backward, AdamW."""
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model.loss(x, y).backward()
    opt.step()
    return time.perf_counter() - t0


def bench_training(cfg: BenchConfig, log: Callable[[str], None]) -> dict[str, object]:
    """Time of one optimizer step (forward, loss, backward, AdamW) of the ``model_preset`` GPT.

    Model FLOPs per step: ``6 N B T + 12 L d B T^2`` (``N`` non-embedding parameters, the
    PaLM-paper count with dense attention); :func:`run_all` adds it as a fraction of the matmul rate.
    """
    rows = []
    n_params = None
    for T in cfg.train_lens:
        model = _gpt(cfg, T).train()
        opt = model.configure_optimizer(lr=1e-4)
        gen = torch.Generator().manual_seed(cfg.seed)
        V, B = model.config.vocab_size, cfg.train_batch
        idx = torch.randint(0, V, (B, T + 1), generator=gen)
        x, y = idx[:, :-1], idx[:, 1:]  # (B, T) each

        log(f"  training step at {B} x {T} tokens")
        _train_step(model, opt, x, y)  # warm-up
        times = [_train_step(model, opt, x, y) for _ in range(cfg.train_repeats)]
        med = statistics.median(times)
        n_params = model.num_parameters(exclude_embeddings=True)
        c = model.config
        flops = 6.0 * n_params * B * T + 12.0 * c.n_layers * c.emb_dim * B * T * T
        rows.append(
            {
                "seq_len": T,
                "batch": B,
                "median_ms": med * 1e3,
                "tokens_per_s": B * T / med,
                "gflops": flops / med / 1e9,
            }
        )
        del model, opt
        gc.collect()
    return {"preset": cfg.model_preset, "non_embedding_parameters": n_params, "rows": rows}


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def run_all(cfg: BenchConfig, log: Callable[[str], None] = lambda msg: None) -> dict[str, object]:
    """Every measurement of the report, as one JSON-serialisable dict."""
    t_start = time.perf_counter()
    result: dict[str, object] = {
        "machine": {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "load_average_start": _load(),
        },
        "config": asdict(cfg),
    }
    log(f"matmul rate ({cfg.matmul_n} x {cfg.matmul_n} float32) ...")
    mm = matmul_rate(cfg.matmul_n)
    result["matmul"] = mm
    log(f"  {mm['gflops_median']:.1f} GFLOP/s (median; best {mm['gflops_best']:.1f})")
    load, cpus = _load(), os.cpu_count() or 1
    if load is not None and load > cpus:
        log(
            f"  warning: load average {load:.1f} on {cpus} CPUs: other processes compete for the cores, so "
            "every figure is slower than this machine can do (with several threads, much slower: try --threads 1)"
        )
    sections: dict[str, float] = {}

    def section(name: str, what: str, fn: Callable[[], object]) -> None:
        log(what + " ...")
        t0 = time.perf_counter()
        result[name] = fn()
        sections[name] = time.perf_counter() - t0

    section("attention", "attention layer, forward+backward", lambda: bench_attention(cfg, log))
    if cfg.memory:
        section("memory", "peak memory", lambda: bench_memory(cfg, log))
    if cfg.generation:
        section("generation", "generation", lambda: bench_generation(cfg, log))
    if cfg.training:
        section("training", "training step", lambda: bench_training(cfg, log))
    result["section_seconds"] = sections
    result["matmul_end"] = matmul_rate(cfg.matmul_n)  # did the machine's speed drift during the run?
    # What the hardware can do: the best matmul seen, at the start or the end (load only slows it).
    peak = max(mm["gflops_best"], result["matmul_end"]["gflops_best"])
    result["peak_gflops"] = peak
    log(f"matmul rate at the end: best {result['matmul_end']['gflops_best']:.1f} GFLOP/s; every '% of matmul' "
        f"in the report is of the best seen, {peak:.1f}")  # fmt: skip
    for row in result["attention"]["rows"]:
        for r in row["results"].values():
            r["fraction_of_matmul"] = r["gflops"] / peak
    for r in result.get("training", {}).get("rows", []):
        r["fraction_of_matmul"] = r["gflops"] / peak
    result["machine"]["load_average_end"] = _load()
    result["seconds"] = time.perf_counter() - t_start
    return result


# --------------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------------
def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else ":---" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _fmt_pct(x: float) -> str:
    return f"{100 * x:.1f}%" if x >= 0.001 else f"{100 * x:.2g}%"


def _figure(path: Path, draw: Callable[[object], None], ncols: int = 1) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.2 * ncols, 4.4), layout="constrained")
    draw(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())


def _log_x(ax, ticks: list[int]) -> None:
    """Log-2 x axis labelled at the measured lengths only (no 6x10^1-style minor labels)."""
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(True, which="both", alpha=0.3)


def _log_y(ax) -> None:
    """Log y axis with plain numbers (2, 5, 10, 20, ...) rather than 6x10^0-style labels."""
    from matplotlib.ticker import FuncFormatter

    def minor(v: float, _pos: object) -> str:
        return f"{v:g}" if v > 0 and round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


PLOT_NAMES = ("attention_time.png", "attention_memory.png", "generation.png", "training.png")


def _plots(result: dict, out: Path) -> list[str]:
    names: list[str] = []
    att = result["attention"]
    rows = att["rows"]

    def series(key: str) -> dict[str, tuple[list[int], list[float]]]:
        s: dict[str, tuple[list[int], list[float]]] = {}
        for row in rows:
            for n, r in row["results"].items():
                s.setdefault(n, ([], []))
                s[n][0].append(row["seq_len"])
                s[n][1].append(r[key])
        return s

    def draw_attention(fig) -> None:
        ax1, ax2 = fig.subplots(1, 2)
        for n, (xs, ys) in series("median_ms").items():
            ax1.plot(xs, ys, marker="o", label=IMPLEMENTATIONS[n].label)
        for n, (xs, ys) in series("fraction_of_matmul").items():
            ax2.plot(xs, [100 * y for y in ys], marker="o", label=IMPLEMENTATIONS[n].label)
        ax1.set(yscale="log", xlabel="sequence length (tokens)", ylabel="ms (median)",
                title="time of forward+backward")  # fmt: skip
        ax2.set(yscale="log", xlabel="sequence length (tokens)", ylabel="% of measured matmul rate",
                title=f"fraction of the matmul rate ({result['peak_gflops']:.0f} GFLOP/s)")  # fmt: skip
        for ax in (ax1, ax2):
            _log_x(ax, att_lens)
            _log_y(ax)
        ax1.legend(fontsize=7)
        fig.suptitle(f"one causal attention layer: d={att['d_model']}, {att['num_heads']} heads, batch {att['batch']}")

    att_lens = [row["seq_len"] for row in rows]
    _figure(out / "attention_time.png", draw_attention, ncols=2)
    names.append("attention_time.png")

    mem = result.get("memory")
    if mem:

        def draw_memory(fig) -> None:
            ax = fig.subplots()
            lens = set()
            for n, pts in mem["results"].items():
                if not pts:
                    continue
                xs = sorted(int(t) for t in pts)
                lens.update(xs)
                # A log axis cannot show 0: anything under 0.1 MB is drawn at 0.1 (the table has the figure).
                ys = [max(0.1, pts[str(t)]["forward_mb"]) for t in xs]
                ax.plot(xs, ys, marker="o", label=IMPLEMENTATIONS[n].label)
            ax.set(yscale="log", xlabel="sequence length (tokens)",
                   ylabel="MB above the process baseline", title="peak memory of one forward (no_grad)")  # fmt: skip
            _log_x(ax, sorted(lens))
            _log_y(ax)
            ax.legend(fontsize=7)

        _figure(out / "attention_memory.png", draw_memory)
        names.append("attention_memory.png")

    gen = result.get("generation")
    if gen and gen["rows"]:

        def draw_generation(fig) -> None:
            ax = fig.subplots()
            xs = [r["total_len"] for r in gen["rows"]]
            ax.plot(xs, [r["cached_ms_per_token"] for r in gen["rows"]], marker="o", label="with KV cache")
            ax.plot(xs, [r["uncached_ms_per_token"] for r in gen["rows"]], marker="o", label="without (re-run window)")
            title = f"greedy generation, GPT '{gen['preset']}' ({gen['parameters'] / 1e6:.2f}M parameters)"
            ax.set(yscale="log", xlabel="total tokens (prompt + generated)", ylabel="ms per new token",
                   title=title)  # fmt: skip
            _log_x(ax, xs)
            _log_y(ax)
            ax.legend()

        _figure(out / "generation.png", draw_generation)
        names.append("generation.png")

    tr = result.get("training")
    if tr and tr["rows"]:

        def draw_training(fig) -> None:
            ax1, ax2 = fig.subplots(1, 2)
            xs = [r["seq_len"] for r in tr["rows"]]
            ax1.plot(xs, [r["median_ms"] for r in tr["rows"]], marker="o")
            ax1.set(yscale="log", xlabel="sequence length (tokens)", ylabel="ms per step",
                    title=f"training step, batch {tr['rows'][0]['batch']}")  # fmt: skip
            ax2.plot(xs, [100 * r["fraction_of_matmul"] for r in tr["rows"]], marker="o")
            ax2.set(xlabel="sequence length (tokens)", ylabel="% of measured matmul rate",
                    title="model FLOP/s as a fraction of matmul rate")  # fmt: skip
            for ax in (ax1, ax2):
                _log_x(ax, xs)
            _log_y(ax1)
            _log_y(ax)
            fig.suptitle(f"GPT '{tr['preset']}': forward, loss, backward, AdamW step")

        _figure(out / "training.png", draw_training, ncols=2)
        names.append("training.png")
    return names


def format_markdown(result: dict, plots: list[str]) -> str:
    """``report.md``: the tables of every measurement, with the plots linked."""
    m, cfg, mm = result["machine"], result["config"], result["matmul"]
    peak = result["peak_gflops"]
    mode = "quick" if cfg["is_quick"] else "full"
    L = [
        "# attnlab benchmark report",
        "",
        f"{m['date']}, {mode} run, {result['seconds']:.0f} s. torch {m['torch']}, {m['torch_threads']} thread(s) on "
        f"{m['cpus']} CPUs ({m['processor']}), Python {m['python']}, {m['platform']}. Load average "
        f"{m['load_average_start'] or 0:.1f} at the start, {m['load_average_end'] or 0:.1f} at the end (other "
        "processes competing for the cores slow every figure; competitors are interleaved so they share it).",
        "",
        "## The machine's matmul rate",
        "",
        f"`torch.mm` of two {mm['n']} x {mm['n']} float32 matrices on {m['torch_threads']} thread(s): "
        f"**{peak:.1f} GFLOP/s**, the best of {mm['gflops_best']:.1f} (start of the run, median "
        f"{mm['gflops_median']:.1f}) and {result['matmul_end']['gflops_best']:.1f} (end, median "
        f'{result["matmul_end"]["gflops_median"]:.1f}). Every "% of matmul" below is a measured FLOP rate '
        "divided by this best rate: the fraction of what these cores can do.",
        "",
    ]
    att = result["attention"]
    names = [n for n in IMPLEMENTATIONS if any(n in r["results"] for r in att["rows"])]
    L += [
        "## One causal attention layer: forward + backward",
        "",
        f"d_model {att['d_model']}, {att['num_heads']} heads, batch {att['batch']}, float32, dropout 0. Median of "
        f"{cfg['repeats']} interleaved rounds after {cfg['warmup']} warm-up; median ms, the best round's ms, and the "
        "median's FLOP rate as % of the matmul rate (FLOPs counted densely: 3 x forward). The loop runs only up to "
        f"{att['loop_max_len']} tokens (O(T^2) Python steps). The one-head rows compute one head of width "
        "d_model; the wrapper has no output projection.",
        "",
    ]
    table = []
    for n in names:
        cells = [IMPLEMENTATIONS[n].label]
        for row in att["rows"]:
            r = row["results"].get(n)
            cells.append(
                "—"
                if r is None
                else f"{r['median_ms']:.1f} ms, best {r['min_ms']:.1f} ({_fmt_pct(r['fraction_of_matmul'])})"
            )
        table.append(cells)
    L += _md_table(["implementation"] + [f"T={row['seq_len']}" for row in att["rows"]], table)
    ratios = []
    for row in att["rows"]:
        res = row["results"]
        parts = [f"T={row['seq_len']}:"]
        for other in ("tutorial-split", "torch"):
            if other in res:
                parts.append(f"attnlab / {other} {res['attnlab']['median_ms'] / res[other]['median_ms']:.2f}")
        ratios.append(" ".join(parts))
    worst = max(max(row["max_abs_diff"].values()) for row in att["rows"])
    L += [
        "",
        "Time ratios (lower = attnlab faster): " + "; ".join(ratios) + ".",
        f"Outputs agree before timing: largest |difference| between implementations of the same function {worst:.1e}.",
        "",
    ]
    if "attention_time.png" in plots:
        L += ["![attention time](attention_time.png)", ""]

    mem = result.get("memory")
    if mem:
        lens = sorted({int(t) for pts in mem["results"].values() for t in pts})
        L += [
            "## Peak memory of one forward",
            "",
            f"MB above the process's baseline during one `torch.no_grad()` forward, batch {mem['batch']}, each point "
            "in a fresh process (after a tiny warm-up forward, so one-off library costs are in the baseline).",
            "",
        ]
        table = []
        for n, pts in mem["results"].items():
            if pts:
                table.append(
                    [IMPLEMENTATIONS[n].label]
                    + [f"{pts[str(t)]['forward_mb']:.1f}" if str(t) in pts else "—" for t in lens]
                )
        L += _md_table(["implementation"] + [f"T={t}" for t in lens], table)
        for key, why in mem["skipped"].items():
            L.append(f"\nSkipped {key}: {why}.")
        L += ["", "![attention memory](attention_memory.png)", ""] if "attention_memory.png" in plots else [""]

    gen = result.get("generation")
    if gen:
        L += [
            "## Generation with and without the KV cache",
            "",
            f"Greedy decoding from a {gen['prompt_tokens']}-token prompt with GPT preset '{gen['preset']}' "
            f"({gen['parameters'] / 1e6:.2f}M parameters); median of {cfg['gen_repeats']} interleaved runs.",
            "",
        ]
        L += _md_table(
            ["total tokens", "ms/token, cache", "ms/token, no cache", "speed-up", "same tokens"],
            [
                [
                    str(r["total_len"]),
                    f"{r['cached_ms_per_token']:.2f}",
                    f"{r['uncached_ms_per_token']:.2f}",
                    f"{r['speedup']:.1f}x",
                    "yes" if r["same_tokens"] else "NO",
                ]
                for r in gen["rows"]
            ],
        )
        L += ["", "![generation](generation.png)", ""] if "generation.png" in plots else [""]

    tr = result.get("training")
    if tr:
        L += [
            "## Training step",
            "",
            f"GPT preset '{tr['preset']}' ({tr['non_embedding_parameters'] / 1e6:.2f}M non-embedding parameters): "
            "zero_grad, forward, cross-entropy, backward, AdamW step; median of "
            f"{cfg['train_repeats']} steps after one warm-up. Model FLOPs = 6 N B T + 12 L d B T^2.",
            "",
        ]
        L += _md_table(
            ["batch x tokens", "ms/step", "tokens/s", "GFLOP/s", "% of matmul"],
            [
                [
                    f"{r['batch']} x {r['seq_len']}",
                    f"{r['median_ms']:.1f}",
                    f"{r['tokens_per_s']:.0f}",
                    f"{r['gflops']:.1f}",
                    _fmt_pct(r["fraction_of_matmul"]),
                ]
                for r in tr["rows"]
            ],
        )
        L += ["", "![training](training.png)", ""] if "training.png" in plots else [""]
    return "\n".join(L).rstrip() + "\n"


def write_report(result: dict, out: str | os.PathLike) -> Path:
    """Write ``results.json``, the PNG plots and ``report.md`` into ``out`` (created if needed)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "results.json", result)
    plots = _plots(result, out)
    # A plot an earlier run left here that this run did not draw would contradict report.md.
    for stale in set(PLOT_NAMES) - set(plots):
        (out / stale).unlink(missing_ok=True)
    atomic_write_text(out / "report.md", format_markdown(result, plots))
    return out / "report.md"
