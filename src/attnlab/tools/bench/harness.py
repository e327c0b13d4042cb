"""The timing driver and the memory probe: how every figure of the benchmarks is taken.

Two rules keep the figures honest on a busy machine:

* **Competitors are timed in the same run, interleaved** (A, B, C, A, B, C, ...: :func:`interleave`),
  so a burst of load hits them alike and the median over rounds ignores it; ratios are given as
  ratios of medians and as the median of per-round ratios (:func:`paired_ratio`).
* **Peak memory is read in a fresh subprocess** (:func:`peak_memory_mb`), so earlier work cannot leak
  into it: the child builds the module, runs a tiny warm-up forward (one-off costs go into the
  baseline), records its resident set, resets the high-water mark, runs one forward and reports the
  new mark.
"""

from __future__ import annotations

import datetime as dt
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn as nn
from torch import Tensor

from attnlab import hardware
from attnlab.checks import non_negative_int, positive_int
from attnlab.tools.bench.registry import build_module

__all__ = [
    "MemoryResult",
    "Timing",
    "available_memory_mb",
    "compare",
    "compare_forward_backward",
    "interleave",
    "load_average",
    "machine",
    "matmul_rate",
    "minor_page_faults",
    "paired_ratio",
    "peak_memory_mb",
]


# -- The machine -----------------------------------------------------------------------------
def minor_page_faults() -> int | None:
    """The process's minor page faults so far, or None where the OS does not count them."""
    try:
        import resource  # Unix only

        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, OSError):
        return None


def load_average() -> float | None:
    """The 1-minute load average (other processes competing for the cores), or None where unknown."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def machine() -> dict[str, object]:
    """What the figures were measured on: date, platform, CPUs, torch and its threads, load now."""
    return {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "load_average_start": load_average(),
        "hardware": hardware.header("cpu"),
    }


def _proc_kb(path: str, key: str) -> int | None:
    """The ``key:  <n> kB`` line of a Linux ``/proc`` file (meminfo, self/status), or None elsewhere."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def available_memory_mb() -> float | None:
    """``MemAvailable`` from ``/proc/meminfo`` in MB, or None where there is no such file."""
    kb = _proc_kb("/proc/meminfo", "MemAvailable")
    return None if kb is None else kb / 1024


def _sync(device: torch.device | None) -> None:
    # Kernels run asynchronously on accelerators: wait for them, or the clock stops too early.
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device is not None and device.type == "mps":
        torch.mps.synchronize()


# -- Timing ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """Times of one competitor, in milliseconds, one per (interleaved) round.

    ``times_ms`` is wall-clock time, the figure the goals are about. ``cpu_ms`` is the process's CPU
    time over the same steps (all threads): it grows less than wall time when other processes take
    the cores, a second, load-resistant view. ``page_faults``: the minor page faults of each step
    (memory mapped in afresh: see :mod:`attnlab.training.allocator`), where the OS counts them.
    """

    name: str
    times_ms: tuple[float, ...]
    cpu_ms: tuple[float, ...] = ()
    page_faults: tuple[int, ...] = ()

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms)

    @property
    def min_ms(self) -> float:
        return min(self.times_ms)

    @property
    def max_ms(self) -> float:
        return max(self.times_ms)

    @property
    def median_cpu_ms(self) -> float | None:
        return statistics.median(self.cpu_ms) if self.cpu_ms else None

    @property
    def median_page_faults(self) -> float | None:
        return statistics.median(self.page_faults) if self.page_faults else None

    @property
    def iqr_ms(self) -> float:
        """Interquartile range: the spread of the middle half of the rounds."""
        if len(self.times_ms) < 2:
            return 0.0
        q = statistics.quantiles(self.times_ms, n=4, method="inclusive")
        return q[2] - q[0]

    def to_dict(self) -> dict[str, object]:
        stats = ("median_ms", "min_ms", "max_ms", "iqr_ms", "median_cpu_ms", "median_page_faults")
        per_round = ("times_ms", "cpu_ms", "page_faults")
        return (
            {"name": self.name} | {k: getattr(self, k) for k in stats} | {k: list(getattr(self, k)) for k in per_round}
        )


def paired_ratio(a: Timing, b: Timing) -> float:
    """Median over rounds of ``a_i / b_i``: robust to load that drifts between rounds."""
    if len(a.times_ms) != len(b.times_ms):
        raise ValueError(f"timings have different repetition counts: {len(a.times_ms)} and {len(b.times_ms)}")
    return statistics.median(ta / tb for ta, tb in zip(a.times_ms, b.times_ms, strict=True))


def compare(a: Timing, b: Timing) -> dict[str, float]:
    """``a``'s time over ``b``'s three ways: ratio of medians, paired (per-round) and of CPU times."""
    return {
        "of_medians": a.median_ms / b.median_ms,
        "paired": paired_ratio(a, b),
        "cpu": (a.median_cpu_ms or 0.0) / (b.median_cpu_ms or 1.0),
    }


def interleave(
    steps: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int = 0,
    *,
    device: torch.device | None = None,
    alternate: bool = False,
) -> dict[str, Timing]:
    """Time zero-argument callables in interleaved rounds: A, B, C, A, B, C, ...

    ``steps``: name -> the step to time; each of the ``repeats`` rounds (after ``warmup`` untimed ones:
    first-call allocations, kernel selection) runs every step once, in the given order (reversed every
    other round with ``alternate``). ``device`` is synchronised around each step (CUDA/MPS run
    asynchronously). Returns name -> :class:`Timing`, in the order given.
    """
    positive_int("repeats", repeats)
    non_negative_int("warmup", warmup)
    if not steps:
        raise ValueError("steps must name at least one step")

    def run(fn: Callable[[], object]) -> tuple[float, float, int | None]:
        _sync(device)
        f0 = minor_page_faults()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        _sync(device)
        wall_ms, cpu_ms = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
        f1 = minor_page_faults()
        return wall_ms, cpu_ms, (f1 - f0 if f0 is not None and f1 is not None else None)

    def order(r: int) -> list[str]:
        return list(steps)[::-1] if alternate and r % 2 else list(steps)

    for r in range(warmup):
        for name in order(r):
            run(steps[name])
    runs: dict[str, list[tuple[float, float, int | None]]] = {name: [] for name in steps}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection inside one competitor's step would be charged to it alone
    try:
        for r in range(repeats):
            for name in order(r):
                runs[name].append(run(steps[name]))
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        name: Timing(
            name, tuple(w for w, _, _ in rs), tuple(c for _, c, _ in rs), tuple(f for _, _, f in rs if f is not None)
        )
        for name, rs in runs.items()
    }


def compare_forward_backward(
    modules: Mapping[str, nn.Module | Callable[[], nn.Module]],
    x: Tensor,
    repeats: int = 10,
    warmup: int = 2,
    *,
    seed: int = 0,
) -> dict[str, Timing]:
    """Time forward+backward of several modules on the same input, interleaved (:func:`interleave`).

    ``modules``: name -> module, or a zero-argument factory returning one. A step is
    ``y = m(x); y.backward(dy)`` on ``x (b, n, d_in)`` requiring grad (as for a layer inside a model),
    with a fixed random ``dy`` (seeded by ``seed``: no loss reduction is timed); gradients are
    cleared between steps. Returns name -> :class:`Timing`, in the order given.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    positive_int("repeats", repeats)
    non_negative_int("warmup", warmup)
    built = {name: (m if isinstance(m, nn.Module) else m()) for name, m in modules.items()}
    for name, m in built.items():
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"modules[{name!r}] must be an nn.Module or a factory returning one, got {type(m).__name__}"
            )
    x = x.detach().clone().requires_grad_(True)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():  # output widths differ (the wrappers), so one dy per module
        dys = {name: torch.randn(m(x).shape, generator=gen, dtype=x.dtype).to(x.device) for name, m in built.items()}

    def step(name: str) -> None:
        built[name].zero_grad(set_to_none=True)
        x.grad = None
        built[name](x).backward(dys[name])

    return interleave({name: partial(step, name) for name in built}, repeats, warmup, device=x.device)


def matmul_rate(n: int = 2048, repeats: int = 5, device: str | torch.device = "cpu") -> dict[str, float]:
    """What the hardware can do: GFLOP/s of ``torch.mm`` on two ``n x n`` float32 matrices
    (``2 n^3`` flops each), the median and the best of ``repeats`` after one warm-up."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(device) for _ in range(2))
    t = interleave({"mm": lambda: torch.mm(a, b)}, repeats, warmup=1, device=torch.device(device))["mm"]
    return {"n": n, "gflops_median": 2 * n**3 / t.median_ms / 1e6, "gflops_best": 2 * n**3 / t.min_ms / 1e6}


# -- Peak memory of a forward, in a fresh subprocess -----------------------------------------
@dataclass(frozen=True)
class MemoryResult:
    """Resident memory of one forward, measured in a fresh process (megabytes, 2**20 bytes);
    ``forward_mb = peak - baseline`` is what the forward itself needed."""

    spec: str
    baseline_mb: float  # after importing torch, building the module and input, a tiny warm-up forward
    peak_mb: float  # the high-water mark after the forward
    exact: bool  # False: the mark could not be reset after building (peak_mb is an upper bound)
    seconds: float

    @property
    def forward_mb(self) -> float:
        return max(0.0, self.peak_mb - self.baseline_mb)

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "forward_mb": self.forward_mb}


def _maxrss_mb() -> float:
    import resource  # Unix only; imported here so the rest of this module works everywhere

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024  # bytes on macOS, KB on Linux


def _memory_child(payload: str) -> None:
    """Entry point of the measuring subprocess: prints one JSON line with its figures."""
    cfg = json.loads(payload)
    torch.manual_seed(cfg["seed"])
    dtype = getattr(torch, cfg["dtype"])
    module = build_module(cfg["spec"], **cfg["kwargs"]).to(dtype).eval()
    x = torch.randn(cfg["input_shape"], dtype=dtype)  # (b, T, d_in)
    with torch.no_grad():
        module(x[:1, :8] if x.dim() >= 2 else x)  # the one-off costs of a first call go into the baseline
    gc.collect()
    rss_kb = _proc_kb("/proc/self/status", "VmRSS")
    baseline = rss_kb / 1024 if rss_kb is not None else _maxrss_mb()
    try:  # "5" resets the peak resident set (VmHWM) to the current one (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        exact = _proc_kb("/proc/self/status", "VmHWM") is not None
    except OSError:
        exact = False
    t0 = time.perf_counter()
    if cfg["no_grad"]:
        with torch.no_grad():
            y = module(x)
    else:
        y = module(x.requires_grad_(True))
        y.backward(torch.ones_like(y))
    seconds = time.perf_counter() - t0
    hwm_kb = _proc_kb("/proc/self/status", "VmHWM")
    peak = hwm_kb / 1024 if (exact and hwm_kb is not None) else _maxrss_mb()
    print(json.dumps({"baseline_mb": baseline, "peak_mb": peak, "exact": exact, "seconds": seconds}))


def peak_memory_mb(
    spec: str,
    input_shape: tuple[int, ...],
    *,
    kwargs: Mapping[str, object] | None = None,
    no_grad: bool = True,
    dtype: str = "float32",
    seed: int = 0,
    threads: int | None = None,
    timeout: float | None = 1800.0,
) -> MemoryResult:
    """Peak resident memory of one forward (or forward+backward) of a module, in a fresh process.

    ``spec``: a registry name or ``"package.module:callable"``, built from ``kwargs`` (JSON-serialisable:
    :func:`~attnlab.tools.bench.registry.build_module`) and run on a random input of ``input_shape``
    (``no_grad=False`` also runs a backward); ``threads``: the child's ``OMP_NUM_THREADS``. Returns a
    :class:`MemoryResult` (``forward_mb`` is the figure to compare); RuntimeError when the subprocess
    failed (out of memory, an error in the module).
    """
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype must name a torch dtype such as 'float32', got {dtype!r}")
    shape = tuple(input_shape)
    if not shape or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
        raise ValueError(f"input_shape must be a tuple of positive ints, got {input_shape!r}")
    payload = {"spec": spec, "kwargs": dict(kwargs or {}), "input_shape": list(shape), "no_grad": bool(no_grad)}
    payload.update(dtype=dtype, seed=seed)
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(positive_int("threads", threads))
    argv = [sys.executable, "-c", "import sys, attnlab.tools.bench.harness as b; b._memory_child(sys.argv[1])"]
    proc = subprocess.run([*argv, json.dumps(payload)], capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        why = "killed (likely out of memory)" if proc.returncode in (-9, 137) else f"exit status {proc.returncode}"
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"memory measurement of {spec!r} failed: {why}; {tail[0]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return MemoryResult(spec, data["baseline_mb"], data["peak_mb"], data["exact"], data["seconds"])
