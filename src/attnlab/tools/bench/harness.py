"""Measuring attention modules: interleaved forward+backward timings and the peak memory of a forward.

Used by ``benchmarks/attention.py`` and ``attnlab bench``. Two rules keep the figures honest on a
busy machine:

* **Competitors are timed in the same run, interleaved** (A, B, C, A, B, C, ...): a burst of load
  from another process hits every competitor alike, and the median over repetitions ignores it.
  Ratios are reported both as ratios of medians and as the median of per-round ratios (each round
  times every competitor back to back, so its ratio is the least disturbed figure).
* **Peak memory is read from a fresh subprocess**: the allocator's caches and the high-water mark
  of earlier work cannot leak into the figure. The child builds the module and input, records its
  resident set (the baseline), resets the kernel's high-water mark, runs one forward and reports
  the new high-water mark. The difference is what the forward itself needed.

Modules under test are built by name from :data:`BUILDERS` (``"attnlab"``, ``"torch"``,
``"tutorial"``, ``"attnlab-wrapper"``, ``"tutorial-wrapper"``) or from any importable
``"package.module:callable"`` that accepts the same keyword arguments.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "BUILDERS",
    "GOALS",
    "AttentionCore",
    "MemoryResult",
    "Timing",
    "TorchCausalMHA",
    "attention_benchmark",
    "available_memory_mb",
    "build_module",
    "compare_forward_backward",
    "format_attention_report",
    "goals_met",
    "max_abs_difference",
    "minor_page_faults",
    "paired_ratio",
    "peak_memory_mb",
    "positive_int",
    "share_weights",
    "tutorial_forward_bytes",
]


# --------------------------------------------------------------------------------------------
# The competitors
# --------------------------------------------------------------------------------------------
class TorchCausalMHA(nn.Module):
    """``torch.nn.MultiheadAttention`` as a causal self-attention layer ``x -> y``.

    ``need_weights=False`` and ``is_causal=True`` with the matching ``attn_mask`` let torch route to
    its fused kernel (the hint needs the mask to be given too). ``batch_first=True``; torch's
    ``bias`` covers both the packed input projection and ``out_proj``.

    Shapes: ``x (b, n, d_model)`` -> ``(b, n, d_model)``.
    """

    def __init__(self, d_model: int, num_heads: int, context_length: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.mha = nn.MultiheadAttention(d_model, num_heads, dropout=dropout, bias=bias, batch_first=True)
        self.context_length = context_length
        self._mask: Tensor | None = None

    def _causal(self, n: int, device: torch.device) -> Tensor:
        # torch's convention is the opposite of attnlab's: True = may NOT attend.
        if self._mask is None or self._mask.shape[0] != n or self._mask.device != device:
            self._mask = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)  # (n, n)
        return self._mask

    def forward(self, x: Tensor) -> Tensor:
        mask = self._causal(x.shape[-2], x.device)
        return self.mha(x, x, x, need_weights=False, attn_mask=mask, is_causal=True)[0]  # (b, n, d)


def positive_int(text: str) -> int:
    """argparse type for the benchmark scripts' and ``attnlab bench``'s counts and sizes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _attnlab(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
    from attnlab.attention import MultiHeadAttention

    return MultiHeadAttention(d_model, d_model, context_length, dropout, num_heads)


def _tutorial(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
    from attnlab.tutorial_code import MultiHeadAttention

    return MultiHeadAttention(d_model, d_model, context_length, dropout, num_heads)


def _attnlab_wrapper(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
    from attnlab.attention import MultiHeadAttentionWrapper

    return MultiHeadAttentionWrapper(d_model, d_model // num_heads, context_length, dropout, num_heads)


def _tutorial_wrapper(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
    from attnlab.tutorial_code import MultiHeadAttentionWrapper

    return MultiHeadAttentionWrapper(d_model, d_model // num_heads, context_length, dropout, num_heads)


def _torch(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
    return TorchCausalMHA(d_model, num_heads, context_length, dropout)


class AttentionCore(nn.Module):
    """Causal multi-head attention without projections: packed ``q, k, v`` in, context out.

    Isolates what the implementations differ in (the projections are the same matmuls in all of
    them). ``impl``: ``"attnlab"`` (:func:`attnlab.functional.scaled_dot_product_attention`),
    ``"torch"`` (``F.scaled_dot_product_attention``) or ``"tutorial"`` (the tutorials' explicit
    scores, ``masked_fill_`` with their ``triu`` mask buffer, softmax of scaled scores, ``@ V``).

    Shapes: ``qkv (b, n, 3 * d_model)`` -> ``(b, num_heads, n, d_model // num_heads)``.
    """

    def __init__(self, d_model: int, num_heads: int, context_length: int, impl: str) -> None:
        super().__init__()
        if impl not in ("attnlab", "torch", "tutorial"):
            raise ValueError(f"impl must be 'attnlab', 'torch' or 'tutorial', got {impl!r}")
        self.num_heads, self.head_dim, self.impl = num_heads, d_model // num_heads, impl
        if impl == "tutorial":
            self.register_buffer("mask", torch.triu(torch.ones(context_length, context_length), diagonal=1))

    def forward(self, qkv: Tensor) -> Tensor:
        from attnlab.functional import scaled_dot_product_attention

        b, n, _ = qkv.shape
        q, k, v = qkv.view(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # each (b, H, n, hd)
        if self.impl == "attnlab":
            return scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, H, n, hd)
        if self.impl == "torch":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, H, n, hd)
        # The tutorials' steps, as written in their MultiHeadAttention.forward.
        attn_scores = q @ k.transpose(2, 3)  # (b, H, n, n)
        attn_scores.masked_fill_(self.mask.bool()[:n, :n], -torch.inf)
        attn_weights = torch.softmax(attn_scores / k.shape[-1] ** 0.5, dim=-1)  # (b, H, n, n)
        return attn_weights @ v  # (b, H, n, hd)


def _core(impl: str) -> Callable[..., nn.Module]:
    def build(d_model: int, num_heads: int, context_length: int, dropout: float = 0.0) -> nn.Module:
        if dropout:
            raise ValueError("the attention-core competitors have no dropout; pass dropout=0.0")
        return AttentionCore(d_model, num_heads, context_length, impl)

    return build


# name -> (builder(d_model, num_heads, context_length, dropout) -> module, description for tables)
BUILDERS: dict[str, tuple[Callable[..., nn.Module], str]] = {
    "attnlab": (_attnlab, "attnlab.MultiHeadAttention"),
    "torch": (_torch, "torch.nn.MultiheadAttention"),
    "tutorial": (_tutorial, "tutorial MultiHeadAttention"),
    "attnlab-wrapper": (_attnlab_wrapper, "attnlab.MultiHeadAttentionWrapper"),
    "tutorial-wrapper": (_tutorial_wrapper, "tutorial MultiHeadAttentionWrapper"),
    # Attention only (input: packed q, k, v of shape (b, n, 3 * d_model)).
    "attnlab-core": (_core("attnlab"), "attnlab scaled_dot_product_attention"),
    "torch-core": (_core("torch"), "torch F.scaled_dot_product_attention"),
    "tutorial-core": (_core("tutorial"), "tutorial scores/mask/softmax/@V"),
}


def build_module(spec: str, **kwargs: object) -> nn.Module:
    """Build a module from a :data:`BUILDERS` name or an importable ``"package.module:callable"``."""
    if not isinstance(spec, str):
        raise TypeError(f"spec must be a str, got {type(spec).__name__}")
    if spec in BUILDERS:
        return BUILDERS[spec][0](**kwargs)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"spec must be one of {sorted(BUILDERS)} or 'package.module:callable', got {spec!r}")
    obj: object = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec!r} is not callable")
    return obj(**kwargs)


@torch.no_grad()
def share_weights(source: nn.Module, target: nn.Module) -> None:
    """Copy a multi-head layer's weights into another implementation of the same function.

    Knows the attnlab/tutorial layout (``W_query``/``W_key``/``W_value``/``out_proj``), the
    wrapper layout (``heads[i].W_*``) and :class:`TorchCausalMHA` (packed ``in_proj_weight``), so
    the benchmark can check that every competitor computes the same outputs before timing them.
    A bias the source lacks is zeroed in the target; a non-zero bias the target lacks is a ValueError.
    """
    names = ("W_query", "W_key", "W_value")

    def params(m: nn.Module) -> tuple[list[Tensor], list[Tensor | None], Tensor | None, Tensor | None]:
        """([Wq, Wk, Wv] as (out, in)), [bq, bk, bv], out_proj weight, out_proj bias."""
        if isinstance(m, TorchCausalMHA):
            b = m.mha.in_proj_bias
            return (
                list(m.mha.in_proj_weight.chunk(3)),
                list(b.chunk(3)) if b is not None else [None] * 3,
                m.mha.out_proj.weight,
                m.mha.out_proj.bias,
            )
        if hasattr(m, "heads"):
            ws = [torch.cat([getattr(h, n).weight for h in m.heads]) for n in names]
            has_bias = getattr(m.heads[0], names[0]).bias is not None
            bs = [torch.cat([getattr(h, n).bias for h in m.heads]) if has_bias else None for n in names]
            return ws, bs, None, None
        return (
            [getattr(m, n).weight for n in names],
            [getattr(m, n).bias for n in names],
            m.out_proj.weight,
            m.out_proj.bias,
        )

    def put(dst: Tensor | None, src: Tensor | None) -> None:
        if dst is None and src is not None and bool(src.any()):
            raise ValueError(
                f"share_weights: the source {type(source).__name__} has a non-zero bias that the target "
                f"{type(target).__name__} lacks, so they cannot compute the same function"
            )
        if dst is not None:
            if src is None:
                dst.zero_()
            else:
                dst.copy_(src)

    ws, bs, wo, bo = params(source)
    if isinstance(target, TorchCausalMHA):
        target.mha.in_proj_weight.copy_(torch.cat(ws))
        if target.mha.in_proj_bias is not None:
            for dst, src in zip(target.mha.in_proj_bias.chunk(3), bs, strict=True):
                put(dst, src)
        out_proj = target.mha.out_proj
    elif hasattr(target, "heads"):
        hd = ws[0].shape[0] // len(target.heads)
        for i, h in enumerate(target.heads):
            rows = slice(i * hd, (i + 1) * hd)
            for n, w, b in zip(names, ws, bs, strict=True):
                getattr(h, n).weight.copy_(w[rows])
                put(getattr(h, n).bias, None if b is None else b[rows])
        return
    else:
        for n, w, b in zip(names, ws, bs, strict=True):
            getattr(target, n).weight.copy_(w)
            put(getattr(target, n).bias, b)
        out_proj = target.out_proj
    if wo is not None:
        out_proj.weight.copy_(wo)
    put(out_proj.bias, bo)


@torch.no_grad()
def max_abs_difference(modules: Mapping[str, nn.Module], x: Tensor) -> dict[str, float]:
    """Largest ``|y_name - y_first|`` of each module's forward against the first module's."""
    outs = {name: m(x) for name, m in modules.items()}
    first = next(iter(outs.values()))
    return {name: float((y - first).abs().max()) for name, y in outs.items()}


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """Times of one competitor, in milliseconds, one per (interleaved) repetition.

    ``times_ms`` is wall-clock time, the figure the goals are about. ``cpu_ms`` is the process's
    CPU time over the same steps (all threads together): on an idle machine about
    ``threads x wall``; it grows less than wall time when other processes take the cores, so a
    ratio of CPU times is a second, load-resistant view of the same comparison. ``page_faults``:
    the process's minor page faults during each step (where the OS counts them): memory the step
    had the kernel map in afresh, a cost that depends on the machine (see :mod:`attnlab.training.allocator`).
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
        """Interquartile range: the spread of the middle half of the repetitions."""
        if len(self.times_ms) < 2:
            return 0.0
        q = statistics.quantiles(self.times_ms, n=4, method="inclusive")
        return q[2] - q[0]

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "max_ms": self.max_ms,
            "iqr_ms": self.iqr_ms,
            "median_cpu_ms": self.median_cpu_ms,
            "median_page_faults": self.median_page_faults,
            "times_ms": list(self.times_ms),
            "cpu_ms": list(self.cpu_ms),
            "page_faults": list(self.page_faults),
        }


def paired_ratio(a: Timing, b: Timing) -> float:
    """Median over repetitions of ``a_i / b_i``: robust to load that drifts between rounds."""
    if len(a.times_ms) != len(b.times_ms):
        raise ValueError(f"timings have different repetition counts: {len(a.times_ms)} and {len(b.times_ms)}")
    return statistics.median(ta / tb for ta, tb in zip(a.times_ms, b.times_ms, strict=True))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def minor_page_faults() -> int | None:
    """The process's minor page faults so far, or None where the OS does not count them."""
    try:
        import resource  # Unix only

        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, OSError):
        return None


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def compare_forward_backward(
    modules: Mapping[str, nn.Module | Callable[[], nn.Module]],
    x: Tensor,
    repeats: int = 10,
    warmup: int = 2,
    *,
    seed: int = 0,
) -> dict[str, Timing]:
    """Time forward+backward of several modules on the same input, interleaved.

    Each repetition runs every module once in the given order (A, B, C, A, B, C, ...). A step is
    ``y = m(x); y.backward(dy)`` with a fixed random ``dy`` (so no loss reduction is timed) and
    ``x.requires_grad`` (as for a layer inside a model, the input gradient is computed too);
    gradients are cleared, not accumulated, between steps.

    Args:
        modules: name -> module, or a zero-argument factory returning one.
        x: ``(b, n, d_in)`` input; a detached copy requiring grad is used.
        repeats: timed repetitions per module (>= 1).
        warmup: untimed repetitions per module first (first-call allocations, kernel selection).
        seed: seed of ``dy``.
    Returns:
        name -> :class:`Timing`, in the order given.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not modules:
        raise ValueError("modules must name at least one module")
    _check_count("repeats", repeats, 1)
    _check_count("warmup", warmup, 0)
    built = {name: (m if isinstance(m, nn.Module) else m()) for name, m in modules.items()}
    for name, m in built.items():
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"modules[{name!r}] must be an nn.Module or a factory returning one, got {type(m).__name__}"
            )
    x = x.detach().clone().requires_grad_(True)
    dys: dict[str, Tensor] = {}
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, m in built.items():
            shape = m(x).shape  # output widths differ (the wrappers), so one dy per module
            dys[name] = torch.randn(shape, generator=gen, dtype=x.dtype).to(x.device)

    def step(name: str) -> tuple[float, float, int | None]:
        m = built[name]
        m.zero_grad(set_to_none=True)
        x.grad = None
        _sync(x.device)
        f0 = minor_page_faults()
        t0, c0 = time.perf_counter(), time.process_time()
        m(x).backward(dys[name])
        _sync(x.device)
        wall_ms, cpu_ms = (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3
        f1 = minor_page_faults()
        return wall_ms, cpu_ms, (f1 - f0 if f0 is not None and f1 is not None else None)

    for _ in range(warmup):
        for name in built:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in built}
    cpu: dict[str, list[float]] = {name: [] for name in built}
    faults: dict[str, list[int]] = {name: [] for name in built}
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()  # a collection inside one competitor's step would be charged to it alone
    try:
        for _ in range(repeats):
            for name in built:
                wall_ms, cpu_ms, n_faults = step(name)
                times[name].append(wall_ms)
                cpu[name].append(cpu_ms)
                if n_faults is not None:
                    faults[name].append(n_faults)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: Timing(name, tuple(times[name]), tuple(cpu[name]), tuple(faults[name])) for name in built}


# --------------------------------------------------------------------------------------------
# Peak memory of a forward, in a fresh subprocess
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryResult:
    """Resident memory of one forward, measured in a fresh process (megabytes, 2**20 bytes).

    ``baseline_mb``: resident set after importing torch and building the module and input.
    ``peak_mb``: the process's high-water mark after the forward. ``forward_mb = peak - baseline``:
    what the forward itself needed. ``exact`` is False where the high-water mark could not be reset
    after building (then ``peak_mb`` may include the build's own transient peak, an upper bound).
    """

    spec: str
    baseline_mb: float
    peak_mb: float
    exact: bool
    seconds: float
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def forward_mb(self) -> float:
        return max(0.0, self.peak_mb - self.baseline_mb)

    def to_dict(self) -> dict[str, object]:
        return {
            "spec": self.spec,
            "baseline_mb": self.baseline_mb,
            "peak_mb": self.peak_mb,
            "forward_mb": self.forward_mb,
            "exact": self.exact,
            "seconds": self.seconds,
            **self.extra,
        }


def available_memory_mb() -> float | None:
    """``MemAvailable`` from ``/proc/meminfo`` in MB, or None where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def tutorial_forward_bytes(batch: int, seq_len: int, num_heads: int, itemsize: int = 4) -> int:
    """What the tutorial path's forward holds at once: scores, scaled scores and weights.

    Three ``(batch, num_heads, seq_len, seq_len)`` tensors coexist inside ``softmax(scores / s)``.
    """
    return 3 * batch * num_heads * seq_len * seq_len * itemsize


def _status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


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
    x = torch.randn(cfg["input_shape"], dtype=dtype)
    gc.collect()
    rss_kb = _status_kb("VmRSS")
    baseline = rss_kb / 1024 if rss_kb is not None else _maxrss_mb()
    try:  # "5" resets the peak resident set (VmHWM) to the current one (Linux >= 4.0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        exact = _status_kb("VmHWM") is not None
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
    hwm_kb = _status_kb("VmHWM")
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
    timeout: float | None = 1800.0,
) -> MemoryResult:
    """Peak resident memory of one forward (or forward+backward) of a module, in a fresh process.

    Args:
        spec: a :data:`BUILDERS` name or ``"package.module:callable"``.
        input_shape: shape of the random input, e.g. ``(1, 8192, 768)``.
        kwargs: keyword arguments of the builder (for :data:`BUILDERS`: ``d_model``,
            ``num_heads``, ``context_length``, optionally ``dropout``); JSON-serialisable.
        no_grad: run the forward under ``torch.no_grad()``; False also runs a backward.
        dtype: name of a torch dtype (``"float32"``).
    Returns:
        A :class:`MemoryResult`; ``forward_mb`` is the figure to compare.
    Raises:
        RuntimeError: the subprocess failed (out of memory, an error in the module).
    """
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise ValueError(f"dtype must name a torch dtype such as 'float32', got {dtype!r}")
    shape = tuple(input_shape)
    if not shape or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
        raise ValueError(f"input_shape must be a tuple of positive ints, got {input_shape!r}")
    payload = json.dumps(
        {
            "spec": spec,
            "kwargs": dict(kwargs or {}),
            "input_shape": list(shape),
            "no_grad": bool(no_grad),
            "dtype": dtype,
            "seed": seed,
        }
    )
    code = "import sys, attnlab.tools.bench.harness as b; b._memory_child(sys.argv[1])"
    proc = subprocess.run(
        [sys.executable, "-c", code, payload],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONHASHSEED": "0"},
        check=False,
    )
    if proc.returncode != 0:
        why = "killed (likely out of memory)" if proc.returncode in (-9, 137) else f"exit status {proc.returncode}"
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        raise RuntimeError(f"memory measurement of {spec!r} failed: {why}; {tail[0]}")
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return MemoryResult(spec, data["baseline_mb"], data["peak_mb"], data["exact"], data["seconds"])


# --------------------------------------------------------------------------------------------
# The attention benchmark: GPT-2's attention layer against torch and the tutorial path
# --------------------------------------------------------------------------------------------
# Goals of the project (ratios; lower is better).
GOALS = {"attnlab/torch": 1.0, "attnlab/tutorial": 0.35, "memory attnlab/tutorial": 0.2}
GOAL_SHAPE = (2, 1024, 768, 12)  # batch, seq_len, d_model, num_heads of the timing goals
GOAL_MEMORY_SEQ_LEN = 8192


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _format_load(load: object) -> str:
    if not isinstance(load, list) or None in load:
        return ""
    return f", load average {load[0]:.1f} -> {load[1]:.1f}"


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
    log: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Time attnlab's multi-head attention against torch's and the tutorial's, and measure memory.

    Timing: forward+backward of a causal layer (dropout 0, float32, CPU, torch's default threads) on
    ``(batch, seq_len, d_model)``, every competitor sharing the same weights (their outputs are
    checked to agree first), interleaved over ``repeats`` rounds. With ``core``, a second interleaved
    block times the attention alone (packed ``q, k, v`` in, no projections). Memory: peak of one
    ``torch.no_grad()`` forward on ``(memory_batch, memory_seq_len, d_model)``, each competitor in
    a fresh subprocess; the tutorial path is skipped (and said so) when the machine lacks the
    memory for its ``num_heads x seq_len^2`` score tensors. ``malloc_tuning`` first applies
    :func:`attnlab.training.allocator.tune_cpu_allocator` to this process (for good: it cannot be undone),
    as ``attnlab train`` does; the default measures the process as a library user gets it.

    Returns a JSON-serialisable dict; :func:`format_attention_report` prints it as tables.
    """
    for name, v in (("batch", batch), ("seq_len", seq_len), ("d_model", d_model), ("num_heads", num_heads)):
        _check_count(name, v, 1)
    _check_count("memory_batch", memory_batch, 1)
    _check_count("memory_seq_len", memory_seq_len, 1)
    if d_model % num_heads:
        raise ValueError(f"d_model must be divisible by num_heads, got d_model={d_model} and num_heads={num_heads}")
    log = log or (lambda msg: None)
    if malloc_tuning:
        from attnlab.training.allocator import tune_cpu_allocator

        allocator = tune_cpu_allocator().reason
    else:
        allocator = "as the process found it (not tuned)"
    names = ["attnlab", "torch", "tutorial"] + (["attnlab-wrapper", "tutorial-wrapper"] if wrappers else [])
    torch.manual_seed(seed)
    kw = {"d_model": d_model, "num_heads": num_heads, "context_length": seq_len}
    modules = {name: build_module(name, **kw) for name in names}
    share_weights(modules["attnlab"], modules["torch"])
    share_weights(modules["attnlab"], modules["tutorial"])
    if wrappers:
        share_weights(modules["attnlab-wrapper"], modules["tutorial-wrapper"])
    x = torch.rand(batch, seq_len, d_model)  # (b, n, d) as in the GPT-2 example of the tutorials
    log("checking that the competitors agree ...")
    diffs = max_abs_difference({n: modules[n] for n in ("attnlab", "torch", "tutorial")}, x)
    if wrappers:
        diffs.update(max_abs_difference({n: modules[n] for n in ("attnlab-wrapper", "tutorial-wrapper")}, x))
    log(f"timing {len(names)} competitors, {repeats} interleaved rounds after {warmup} warm-up ...")
    load_before = _load_average()
    timings = compare_forward_backward(modules, x, repeats=repeats, warmup=warmup, seed=seed)
    load_after = _load_average()

    def ratio(a: str, b: str) -> dict[str, float]:
        return {
            "of_medians": timings[a].median_ms / timings[b].median_ms,
            "paired": paired_ratio(timings[a], timings[b]),
            "cpu": (timings[a].median_cpu_ms or 0.0) / (timings[b].median_cpu_ms or 1.0),
        }

    ratios = {"attnlab/torch": ratio("attnlab", "torch"), "attnlab/tutorial": ratio("attnlab", "tutorial")}
    if wrappers:
        ratios["attnlab-wrapper/tutorial-wrapper"] = ratio("attnlab-wrapper", "tutorial-wrapper")
    del modules
    if core:
        cores = {name: build_module(name, **kw) for name in ("attnlab-core", "torch-core", "tutorial-core")}
        qkv = torch.randn(batch, seq_len, 3 * d_model)  # (b, n, 3d): q, k, v packed
        diffs.update(max_abs_difference(cores, qkv))
        log(f"timing the attention alone, {repeats} interleaved rounds after {warmup} warm-up ...")
        timings.update(compare_forward_backward(cores, qkv, repeats=repeats, warmup=warmup, seed=seed))
        load_after = _load_average()
        ratios["core: attnlab/torch"] = ratio("attnlab-core", "torch-core")
        ratios["core: attnlab/tutorial"] = ratio("attnlab-core", "tutorial-core")
        del cores, qkv
    result: dict[str, object] = {
        "config": {
            "batch": batch,
            "seq_len": seq_len,
            "d_model": d_model,
            "num_heads": num_heads,
            "causal": True,
            "dropout": 0.0,
            "dtype": "float32",
            "device": "cpu",
            "repeats": repeats,
            "warmup": warmup,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "python": sys.version.split()[0],
            # 1-minute load average before and after timing: other processes competing for the cores.
            "load_average": [load_before, load_after],
            "allocator": allocator,
        },
        "max_abs_diff_vs_attnlab": diffs,
        "timings": {name: {"label": BUILDERS[name][1], **t.to_dict()} for name, t in timings.items()},
        "ratios": ratios,
        "goals": dict(GOALS),
        # The goals are set at the GPT-2 shape; at other sizes the ratios are shown, not judged.
        "goals_apply": {
            "time": (batch, seq_len, d_model, num_heads) == GOAL_SHAPE,
            "memory": (d_model, num_heads) == GOAL_SHAPE[2:] and memory_seq_len >= GOAL_MEMORY_SEQ_LEN,
        },
    }
    del x
    gc.collect()

    if memory:
        mem_kw = {"d_model": d_model, "num_heads": num_heads, "context_length": memory_seq_len}
        shape = (memory_batch, memory_seq_len, d_model)
        mem: dict[str, object] = {"batch": memory_batch, "seq_len": memory_seq_len, "results": {}, "skipped": {}}
        for name in ("attnlab", "torch", "tutorial"):
            need_mb = (
                tutorial_forward_bytes(memory_batch, memory_seq_len, num_heads) / 2**20 if name == "tutorial" else 0
            )
            avail = available_memory_mb()
            if need_mb and avail is not None and avail < 1.15 * need_mb + 1024:
                mem["skipped"][name] = f"needs about {need_mb / 1024:.1f} GiB, {avail / 1024:.1f} GiB available"
                log(f"memory: skipping {name}: {mem['skipped'][name]}")
                continue
            log(f"memory: one forward of {name} at {memory_batch} x {memory_seq_len} tokens in a fresh process ...")
            mem["results"][name] = peak_memory_mb(name, shape, kwargs=mem_kw).to_dict()
        res = mem["results"]
        if "attnlab" in res and "tutorial" in res:
            ratios["memory attnlab/tutorial"] = res["attnlab"]["forward_mb"] / res["tutorial"]["forward_mb"]
        result["memory"] = mem
    return result


def format_attention_report(result: Mapping[str, object]) -> str:
    """The tables of :func:`attention_benchmark`'s result, as printed by the benchmark script."""
    cfg = result["config"]
    timings = result["timings"]
    ratios = result["ratios"]
    diffs = result["max_abs_diff_vs_attnlab"]
    applies = result.get("goals_apply", {"time": True, "memory": True})
    lines = [
        "attnlab attention benchmark: forward+backward of one causal attention layer",
        f"  batch {cfg['batch']} x {cfg['seq_len']} tokens, d_model {cfg['d_model']}, {cfg['num_heads']} heads, "
        f"dropout 0, {cfg['dtype']}, {cfg['device']}; torch {cfg['torch']}, {cfg['threads']} threads, "
        f"{cfg['cpus']} CPUs" + _format_load(cfg.get("load_average")),
        f"  {cfg['repeats']} interleaved rounds (A,B,C,A,B,C,...) after {cfg['warmup']} warm-up; "
        "same weights in every competitor",
        f"  malloc: {cfg.get('allocator', 'not recorded')}; faults = median minor page faults per step",
        "  outputs agree (max |y - y_attnlab|; wrappers against each other): "
        + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items() if not k.startswith("attnlab")),
        "",
        f"{'competitor':<36}{'median ms':>10}{'IQR ms':>9}{'min ms':>9}{'max ms':>9}{'CPU ms':>9}{'faults':>9}",
    ]
    for t in timings.values():
        if t["name"] == "attnlab-core":
            lines.append("attention alone (packed q, k, v in, no projections; same interleaving):")
        lines.append(
            f"{t['label']:<36}{t['median_ms']:>10.1f}{t['iqr_ms']:>9.1f}{t['min_ms']:>9.1f}{t['max_ms']:>9.1f}"
            f"{t.get('median_cpu_ms') or 0.0:>9.0f}"
            + (f"{t['median_page_faults']:>9.0f}" if t.get("median_page_faults") is not None else f"{'-':>9}")
        )
    lines += ["", f"{'ratio (lower = attnlab faster)':<36}{'medians':>10}{'paired':>9}{'CPU':>9}{'goal':>9}"]
    for key, r in ratios.items():
        if key.startswith("memory"):
            continue
        goal = GOALS.get(key)
        verdict = "" if goal is None else ("  met" if r["of_medians"] <= goal else "  MISSED")
        if goal is not None and not applies["time"]:
            verdict = "  (goal is for batch 2 x 1024, d 768, 12 heads)"
        goal_s = "-" if goal is None else f"<= {goal:.2f}"
        figures = f"{r['of_medians']:>10.2f}{r['paired']:>9.2f}{r.get('cpu', 0.0):>9.2f}"
        lines.append(f"{key:<36}{figures}{goal_s:>9}{verdict}")

    mem = result.get("memory")
    if mem:
        lines += [
            "",
            f"peak memory of one forward (torch.no_grad), batch {mem['batch']} x {mem['seq_len']} tokens, "
            "each in a fresh process",
            f"{'competitor':<36}{'forward MB':>11}{'baseline MB':>13}{'peak MB':>10}{'time s':>8}",
        ]
        for name, m in mem["results"].items():
            lines.append(
                f"{BUILDERS[name][1]:<36}{m['forward_mb']:>11.0f}{m['baseline_mb']:>13.0f}{m['peak_mb']:>10.0f}"
                f"{m['seconds']:>8.1f}" + ("" if m["exact"] else "  (upper bound)")
            )
        if "torch" in mem["results"]:
            lines.append(
                "  (torch.nn.MultiheadAttention in eval mode under no_grad takes its inference fast path, "
                "which forms the masked scores)"
            )
        for name, why in mem["skipped"].items():
            lines.append(f"{BUILDERS[name][1]:<36}  skipped: {why}")
        r = ratios.get("memory attnlab/tutorial")
        if r is not None:
            goal = GOALS["memory attnlab/tutorial"]
            verdict = "met" if r <= goal else "MISSED"
            if not applies["memory"]:
                verdict = f"(goal is for {GOAL_MEMORY_SEQ_LEN} tokens, d 768, 12 heads)"
            lines.append(f"{'ratio attnlab / tutorial':<36}{r:>11.3f}   goal <= {goal:.2f}  {verdict}")
    return "\n".join(lines)


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
