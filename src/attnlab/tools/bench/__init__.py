"""``attnlab bench`` and ``benchmarks/``: measure attention implementations, one harness for all.

What is measured (CPU, float32, dropout 0, every competitor in the same run):

* **the machine's matmul rate** (GFLOP/s of an ``n x n`` float32 ``torch.mm``), so every other
  figure is also read as a fraction of what the hardware can do;
* **one causal attention layer, forward+backward, against sequence length**, for the tutorials'
  per-token loop, their matrix form (``CausalAttention``), their stacked-heads wrapper, their
  weight-split ``MultiHeadAttention``, attnlab's ``MultiHeadAttention`` and
  ``torch.nn.MultiheadAttention``; competitors are interleaved (A, B, C, A, B, C, ...) so load from
  other processes hits all alike, and their outputs are checked to agree before they are timed;
* **peak memory of one forward against sequence length**, each point in a fresh process;
* **generation with and without the KV cache** (ms per new token against total length);
* **a GPT training step** (forward, loss, backward, AdamW) against sequence length;
* and, for ``benchmarks/attention.py``, the project's goals at GPT-2's attention shape.

The modules: :mod:`.registry` (the competitors, one set of names), :mod:`.harness` (the timing
driver, the memory probe, page faults, the matmul rate), :mod:`.suites` (the sweeps and the goal
benchmark), :mod:`.report` (``report.md``, ``results.json``, PNG plots; the goal benchmark's tables).
``attnlab bench --quick`` uses small sizes and finishes in a few minutes even on a small CPU.
"""

from __future__ import annotations

from attnlab.tools.bench.harness import (
    MemoryResult,
    Timing,
    compare,
    compare_forward_backward,
    interleave,
    load_average,
    matmul_rate,
    minor_page_faults,
    paired_ratio,
    peak_memory_mb,
)
from attnlab.tools.bench.registry import (
    IMPLEMENTATIONS,
    Impl,
    TutorialLoopAttention,
    build_competitors,
    build_module,
    share_weights,
)
from attnlab.tools.bench.report import format_attention_report, require_plotting, write_report
from attnlab.tools.bench.suites import (
    GOALS,
    SWEEP,
    BenchConfig,
    attention_benchmark,
    goals_met,
    model_flops_per_step,
    run_all,
)

__all__ = [
    "GOALS",
    "IMPLEMENTATIONS",
    "SWEEP",
    "BenchConfig",
    "Impl",
    "MemoryResult",
    "Timing",
    "TutorialLoopAttention",
    "attention_benchmark",
    "build_competitors",
    "build_module",
    "compare",
    "compare_forward_backward",
    "format_attention_report",
    "goals_met",
    "interleave",
    "load_average",
    "matmul_rate",
    "minor_page_faults",
    "model_flops_per_step",
    "paired_ratio",
    "peak_memory_mb",
    "require_plotting",
    "run_all",
    "share_weights",
    "write_report",
]
