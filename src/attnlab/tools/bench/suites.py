"""The benchmark suites: the sweeps of ``attnlab bench`` and the goal benchmark of ``benchmarks/attention.py``.

Every suite builds its competitors from :mod:`~attnlab.tools.bench.registry`, checks that the ones
computing the same function agree, and times them with :mod:`~attnlab.tools.bench.harness`
(interleaved rounds, medians, paired ratios, page faults; memory in fresh processes). Results
are JSON-serialisable dicts; :mod:`~attnlab.tools.bench.report` turns them into tables and plots.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import torch

from attnlab.checks import positive_int
from attnlab.tools.bench.harness import (
    Timing,
    available_memory_mb,
    compare,
    compare_forward_backward,
    interleave,
    load_average,
    machine,
    matmul_rate,
    peak_memory_mb,
)
from attnlab.tools.bench.registry import IMPLEMENTATIONS, build_competitors

__all__ = [
    "GOALS",
    "GOAL_SHAPE",
    "SWEEP",
    "BenchConfig",
    "attention_benchmark",
    "bench_attention",
    "bench_generation",
    "bench_memory",
    "bench_training",
    "goals_met",
    "measure_memory",
    "model_flops_per_step",
    "run_all",
    "time_attention",
]

Log = Callable[[str], None]

# The competitors of `attnlab bench`'s sweeps, in the report's order.
SWEEP = ("tutorial-loop", "tutorial-matrix", "tutorial-wrapper", "tutorial", "attnlab", "torch")


@dataclass
class BenchConfig:
    """Sizes of every sweep of ``attnlab bench``. :meth:`quick` is the few-minutes version."""

    d_model: int = 768
    num_heads: int = 12
    batch: int = 1
    seq_lens: list[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048])
    loop_max_len: int = 64  # the Python loop takes O(T^2) interpreter steps: longer rounds take too long
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
            train_lens=[64, 128, 256],
            train_batch=4,
            train_repeats=3,
            is_quick=True,
        )
        return replace(base, **overrides)


# -- Attention: time and memory --------------------------------------------------------------
def time_attention(
    names: Iterable[str],
    *,
    batch: int,
    seq_len: int,
    d_model: int,
    num_heads: int,
    repeats: int,
    warmup: int,
    seed: int,
) -> tuple[dict[str, float], dict[str, Timing], dict[str, dict[str, object]]]:
    """Forward+backward of the competitors ``names`` (all layers, or all cores) on one input, interleaved.

    Competitors computing the same function get the same weights and must agree first. Input:
    ``torch.rand(batch, seq_len, d_model)`` for layers, packed ``q, k, v`` of width ``3 * d_model``
    for the cores. Returns ``(max_abs_diff, timings, rows)``: rows are each timing as a dict with
    the competitor's label and its FLOP rate (``3 x`` the forward's FLOPs over the median time).
    """
    names = list(names)
    torch.manual_seed(seed)
    core = IMPLEMENTATIONS[names[0]].projections == 0
    # (b, T, d) as in the GPT-2 example of the tutorials; the cores take (b, T, 3d): q, k, v packed.
    x = torch.randn(batch, seq_len, 3 * d_model) if core else torch.rand(batch, seq_len, d_model)
    kw = {"d_model": d_model, "num_heads": num_heads, "context_length": seq_len}
    modules, diffs = build_competitors(names, x, **kw)
    timings = compare_forward_backward(modules, x, repeats=repeats, warmup=warmup, seed=seed)
    rows = {}
    for name, t in timings.items():
        flops = 3.0 * IMPLEMENTATIONS[name].flops(batch, seq_len, d_model)
        rows[name] = {"label": IMPLEMENTATIONS[name].label, **t.to_dict(), "gflops": flops / t.median_ms / 1e6}
    del modules, x
    gc.collect()
    return diffs, timings, rows


def bench_attention(cfg: BenchConfig, log: Log) -> dict[str, object]:
    """Forward+backward of one causal attention layer per :data:`SWEEP` competitor, at each length."""
    d, H, B = cfg.d_model, cfg.num_heads, cfg.batch
    rows = []
    for T in cfg.seq_lens:
        names = [n for n in SWEEP if n != "tutorial-loop" or cfg.loop_max_len >= T]
        log(f"  attention T={T}: {len(names)} competitors x {cfg.repeats} interleaved rounds")
        diffs, timings, results = time_attention(
            names, batch=B, seq_len=T, d_model=d, num_heads=H, repeats=cfg.repeats, warmup=cfg.warmup, seed=cfg.seed
        )
        ratios = {f"attnlab/{other}": compare(timings["attnlab"], timings[other]) for other in ("tutorial", "torch")}
        rows.append({"seq_len": T, "max_abs_diff": diffs, "results": results, "ratios": ratios})
    return {"d_model": d, "num_heads": H, "batch": B, "loop_max_len": cfg.loop_max_len, "rows": rows}


def measure_memory(
    points: Iterable[tuple[str, int]],
    *,
    batch: int,
    d_model: int,
    num_heads: int,
    workers: int = 1,
    threads: int | None = None,
    log: Log,
) -> tuple[dict[str, dict[str, dict[str, object]]], dict[str, str]]:
    """Peak memory of one ``no_grad`` forward at each ``(competitor, length)`` point, each in a fresh process.

    A point whose ``(T, T)`` score tensors would not fit in the available memory is skipped and
    said so: each of the ``workers`` children running at once may need that much, plus 15% and
    1 GiB for the interpreter, torch and the rest. Returns ``(results, skipped)``:
    ``results[name][str(T)]`` is a :class:`~attnlab.tools.bench.harness.MemoryResult` as a dict,
    ``skipped["name@T"]`` the reason.
    """
    jobs, skipped = [], {}
    results: dict[str, dict[str, dict[str, object]]] = {}
    for name, T in points:
        results.setdefault(name, {})
        need_mb = IMPLEMENTATIONS[name].score_bytes(batch, T, num_heads) / 2**20
        avail = available_memory_mb()
        if need_mb and avail is not None and avail < 1.15 * workers * need_mb + 1024:
            skipped[f"{name}@{T}"] = f"needs about {need_mb / 1024:.1f} GiB, {avail / 1024:.1f} GiB available"
            log(f"  memory: skipping {name} at {T} tokens: {skipped[f'{name}@{T}']}")
        else:
            jobs.append((name, T))

    def one(job: tuple[str, int]) -> dict[str, object]:
        name, T = job
        log(f"  memory: one forward of {name} at {batch} x {T} tokens in a fresh process")
        kw = {"d_model": d_model, "num_heads": num_heads, "context_length": T}
        return peak_memory_mb(name, (batch, T, d_model), kwargs=kw, threads=threads).to_dict()

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for (name, T), r in zip(jobs, pool.map(one, jobs), strict=True):
            results[name][str(T)] = r
    return results, skipped


def bench_memory(cfg: BenchConfig, log: Log) -> dict[str, object]:
    """Peak memory of one ``no_grad`` forward per :data:`SWEEP` competitor and length, 2 processes at a time."""
    # The loop is measured at its longest timed length only (its memory is small; its time is not).
    points = [("tutorial-loop", min(cfg.loop_max_len, max(cfg.seq_lens)))]
    points += [(n, T) for T in cfg.memory_seq_lens for n in SWEEP if n != "tutorial-loop"]
    d, H = cfg.d_model, cfg.num_heads
    results, skipped = measure_memory(
        points, batch=cfg.batch, d_model=d, num_heads=H, workers=2, threads=cfg.threads, log=log
    )
    return {"batch": cfg.batch, "d_model": d, "num_heads": H, "results": results, "skipped": skipped}


# -- A GPT: generation and training ----------------------------------------------------------
def model_flops_per_step(n_params: int, n_layers: int, context_length: int, emb_dim: int, tokens: int) -> dict:
    """Model FLOPs of one training step (forward + backward), the PaLM / nanoGPT count.

    ``dense = 6 N tokens`` (``N``: the parameters in a matmul; 2 for the forward multiply-add, 4
    for the two backward products) and ``attention = 12 L T d tokens`` (scores and weighted sum,
    ``2 T d`` each forward and twice that backward, over the full ``T x T`` square); a causal
    kernel skips about half of the attention: ``total_causal``.
    """
    dense = 6 * n_params * tokens
    attention = 12 * n_layers * context_length * emb_dim * tokens
    return {"dense": dense, "attention": attention, "total": dense + attention, "total_causal": dense + attention // 2}


def _gpt(cfg: BenchConfig, context_length: int):
    from attnlab.model import GPT, GPTConfig

    torch.manual_seed(cfg.seed)
    return GPT(GPTConfig.preset(cfg.model_preset, context_length=context_length, drop_rate=0.0))


def bench_generation(cfg: BenchConfig, log: Log) -> dict[str, object]:
    """Greedy generation from a ``gen_prompt``-token prompt up to each total length, with and
    without the KV cache (interleaved), on the ``model_preset`` GPT."""
    from attnlab.generation import generate

    model = _gpt(cfg, max(cfg.gen_lens)).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, cfg.gen_prompt), generator=torch.Generator().manual_seed(0))
    outs: dict[bool, torch.Tensor] = {}

    def step(new: int, cache: bool) -> None:
        outs[cache] = generate(model, prompt, new, temperature=0.0, use_cache=cache)  # (1, prompt + new)

    rows = []
    for L in cfg.gen_lens:
        new = L - cfg.gen_prompt
        if new < 1:
            continue
        log(f"  generation to {L} tokens ({new} new), with and without the cache")
        generate(model, prompt, 2, temperature=0.0, use_cache=True)  # warm-up
        t = interleave({"cache": partial(step, new, True), "no cache": partial(step, new, False)}, cfg.gen_repeats)
        cached, uncached = t["cache"].median_ms, t["no cache"].median_ms
        rows.append(
            {
                "total_len": L,
                "new_tokens": new,
                "cached_ms_per_token": cached / new,
                "uncached_ms_per_token": uncached / new,
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


def bench_training(cfg: BenchConfig, log: Log) -> dict[str, object]:
    """Time of one optimizer step (zero_grad, forward, loss, backward, AdamW) of the ``model_preset`` GPT.

    Model FLOPs per step: :func:`model_flops_per_step` (``6 N B T + 12 L d B T^2``, ``N``
    non-embedding parameters); :func:`run_all` adds it as a fraction of the matmul rate.
    """
    rows = []
    n_params = None
    for T in cfg.train_lens:
        model = _gpt(cfg, T).train()
        opt = model.configure_optimizer(lr=1e-4)
        V, B = model.config.vocab_size, cfg.train_batch
        idx = torch.randint(0, V, (B, T + 1), generator=torch.Generator().manual_seed(cfg.seed))
        x, y = idx[:, :-1], idx[:, 1:]  # (B, T) each

        def step(model=model, opt=opt, x=x, y=y) -> None:
            opt.zero_grad(set_to_none=True)
            model.loss(x, y).backward()
            opt.step()

        log(f"  training step at {B} x {T} tokens")
        med = interleave({"step": step}, cfg.train_repeats, warmup=1)["step"].median_ms / 1e3
        n_params = model.num_parameters(exclude_embeddings=True)
        c = model.config
        flops = model_flops_per_step(n_params, c.n_layers, T, c.emb_dim, B * T)["total"]
        rows.append(
            {"seq_len": T, "batch": B, "median_ms": med * 1e3, "tokens_per_s": B * T / med, "gflops": flops / med / 1e9}
        )
        del model, opt, step
        gc.collect()
    return {"preset": cfg.model_preset, "non_embedding_parameters": n_params, "rows": rows}


def run_all(cfg: BenchConfig, log: Log = lambda msg: None) -> dict[str, object]:
    """Every measurement of ``attnlab bench``'s report, as one JSON-serialisable dict."""
    t_start = time.perf_counter()
    result: dict[str, object] = {"machine": machine(), "config": asdict(cfg)}
    log(f"matmul rate ({cfg.matmul_n} x {cfg.matmul_n} float32) ...")
    mm = result["matmul"] = matmul_rate(cfg.matmul_n)
    log(f"  {mm['gflops_median']:.1f} GFLOP/s (median; best {mm['gflops_best']:.1f})")
    load, cpus = load_average(), result["machine"]["cpus"] or 1
    if load is not None and load > cpus:
        log(
            f"  warning: load average {load:.1f} on {cpus} CPUs: other processes compete for the cores, so "
            "every figure is slower than this machine can do (with several threads, much slower: try --threads 1)"
        )
    sections: dict[str, float] = {}
    for name, what, enabled, fn in (
        ("attention", "attention layer, forward+backward", True, bench_attention),
        ("memory", "peak memory", cfg.memory, bench_memory),
        ("generation", "generation", cfg.generation, bench_generation),
        ("training", "training step", cfg.training, bench_training),
    ):
        if enabled:
            log(what + " ...")
            t0 = time.perf_counter()
            result[name] = fn(cfg, log)
            sections[name] = time.perf_counter() - t0
    result["section_seconds"] = sections
    end = result["matmul_end"] = matmul_rate(cfg.matmul_n)  # did the machine's speed drift during the run?
    # What the hardware can do: the best matmul seen, at the start or the end (load only slows it).
    peak = result["peak_gflops"] = max(mm["gflops_best"], end["gflops_best"])
    log(f"matmul rate at the end: best {end['gflops_best']:.1f} GFLOP/s; every '% of matmul' in the report is of "
        f"the best seen, {peak:.1f}")  # fmt: skip
    rates = [r for row in result["attention"]["rows"] for r in row["results"].values()]
    for r in rates + result.get("training", {}).get("rows", []):
        r["fraction_of_matmul"] = r["gflops"] / peak
    result["machine"]["load_average_end"] = load_average()
    result["seconds"] = time.perf_counter() - t_start
    return result


# -- The goal benchmark: GPT-2's attention layer against torch and the tutorial path ---------
# Goals of the project (ratios; lower is better), set at GPT-2's attention shape.
GOALS = {"attnlab/torch": 1.0, "attnlab/tutorial": 0.35, "memory attnlab/tutorial": 0.2}
GOAL_SHAPE = {"batch": 2, "seq_len": 1024, "d_model": 768, "num_heads": 12, "memory_seq_len": 8192}


def attention_benchmark(
    *,
    batch: int = 2,
    seq_len: int = 1024,
    d_model: int = 768,
    num_heads: int = 12,
    repeats: int = 15,
    warmup: int = 2,
    wrappers: bool = True,
    core: bool = True,
    memory: bool = True,
    memory_batch: int = 1,
    memory_seq_len: int = 8192,
    seed: int = 0,
    malloc_tuning: bool = False,
    log: Log | None = None,
) -> dict[str, object]:
    """Time attnlab's multi-head attention against torch's and the tutorial's, and measure memory.

    Timing: forward+backward of a causal layer (dropout 0, float32, CPU) on ``(batch, seq_len,
    d_model)``, the competitors sharing weights, interleaved over ``repeats`` rounds; with ``core``, a
    second block times the attention alone. Memory: one ``no_grad`` forward on ``(memory_batch,
    memory_seq_len, d_model)`` per competitor (:func:`measure_memory`). ``malloc_tuning`` first tunes
    this process's allocator for good, as ``attnlab train`` does (default: as a library user gets it).

    Returns a JSON-serialisable dict; :func:`attnlab.tools.bench.report.format_attention_report`
    prints it as tables, :func:`goals_met` judges it.
    """
    shape = {"batch": batch, "seq_len": seq_len, "d_model": d_model, "num_heads": num_heads}
    for name, v in {**shape, "memory_batch": memory_batch, "memory_seq_len": memory_seq_len}.items():
        positive_int(name, v)
    if d_model % num_heads:
        raise ValueError(f"d_model must be divisible by num_heads, got d_model={d_model} and num_heads={num_heads}")
    log = log or (lambda msg: None)
    allocator = "as the process found it (not tuned)"
    if malloc_tuning:  # as `attnlab train` tunes it, for good
        from attnlab.training.allocator import tune_cpu_allocator

        allocator = tune_cpu_allocator().reason
    blocks = [["attnlab", "torch", "tutorial"] + (["attnlab-wrapper", "tutorial-wrapper"] if wrappers else [])]
    if core:
        blocks.append(["attnlab-core", "torch-core", "tutorial-core"])
    diffs, timings, rows = {}, {}, {}
    load_before = load_average()
    for names in blocks:  # interleaved within a block, not across
        what = "the attention alone" if names[0] == "attnlab-core" else f"{len(names)} competitors"
        log(f"timing {what}, {repeats} interleaved rounds after {warmup} warm-up ...")
        d, t, r = time_attention(names, **shape, repeats=repeats, warmup=warmup, seed=seed)
        diffs, timings, rows = diffs | d, timings | t, rows | r
    load_after = load_average()
    ratios = _time_ratios(timings, wrappers=wrappers, core=core)
    goal = {k: v for k, v in GOAL_SHAPE.items() if k != "memory_seq_len"}
    result: dict[str, object] = {
        "config": {
            **shape,
            "causal": True,
            "dropout": 0.0,
            "dtype": "float32",
            "device": "cpu",
            "repeats": repeats,
            "warmup": warmup,
            "machine": machine(),
            # 1-minute load average before and after timing: other processes competing for the cores.
            "load_average": [load_before, load_after],
            "allocator": allocator,
        },
        "max_abs_diff": diffs,
        "timings": rows,
        "ratios": ratios,
        "goals": dict(GOALS),
        "goal_shape": dict(GOAL_SHAPE),
        # The goals are set at the GPT-2 shape; at other sizes the ratios are shown, not judged.
        "goals_apply": {
            "time": shape == goal,
            "memory": (d_model, num_heads) == (goal["d_model"], goal["num_heads"])
            and memory_seq_len >= GOAL_SHAPE["memory_seq_len"],
        },
    }
    if memory:
        result["memory"], ratio = _forward_memory(memory_batch, memory_seq_len, d_model, num_heads, log)
        if ratio is not None:
            ratios["memory attnlab/tutorial"] = ratio
    return result


def _time_ratios(timings: dict, *, wrappers: bool, core: bool) -> dict[str, object]:
    """attnlab's time against each competitor's (:func:`compare`), keyed ``"attnlab/torch"``,
    ``"core: attnlab/torch"``, ..."""
    pairs = [("attnlab", "torch"), ("attnlab", "tutorial")]
    pairs += [("attnlab-wrapper", "tutorial-wrapper")] if wrappers else []
    pairs += [("attnlab-core", "torch-core"), ("attnlab-core", "tutorial-core")] if core else []
    keys = [f"core: {a}/{b}".replace("-core", "") if a.endswith("-core") else f"{a}/{b}" for a, b in pairs]
    return {key: compare(timings[a], timings[b]) for key, (a, b) in zip(keys, pairs, strict=True)}


def _forward_memory(
    batch: int, seq_len: int, d_model: int, num_heads: int, log: Log
) -> tuple[dict[str, object], float | None]:
    """The peak memory of one forward of attnlab, torch and the tutorial (:func:`measure_memory`), and
    attnlab's over the tutorial's (None when either was skipped)."""
    points = [(name, seq_len) for name in ("attnlab", "torch", "tutorial")]
    res, skipped = measure_memory(points, batch=batch, d_model=d_model, num_heads=num_heads, log=log)
    key = str(seq_len)
    ratio = None
    if key in res["attnlab"] and key in res["tutorial"]:
        ratio = res["attnlab"][key]["forward_mb"] / res["tutorial"][key]["forward_mb"]
    return {"batch": batch, "seq_len": seq_len, "results": res, "skipped": skipped}, ratio


def goals_met(result: Mapping[str, object]) -> bool:
    """True when every goal that was measured (at the shape it is set for) is met."""
    ratios = result["ratios"]
    applies = result.get("goals_apply", {"time": True, "memory": True})
    for key, goal in GOALS.items():
        r = ratios.get(key)
        if r is None or not applies["memory" if key.startswith("memory") else "time"]:
            continue
        value = r["of_medians"] if isinstance(r, Mapping) else r
        if value > goal:
            return False
    return True
