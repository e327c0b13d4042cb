"""``attnlab bench`` and ``benchmarks/``: measure attention implementations, one harness for all.

What is measured (CPU, float32, dropout 0): the machine's matmul rate (every other figure is also
a fraction of it); one causal attention layer, forward+backward, against sequence length, for the
tutorials' forms (per-token loop, ``CausalAttention``, stacked heads, weight split), attnlab's
``MultiHeadAttention`` and ``torch.nn.MultiheadAttention``, their outputs checked to agree first;
peak memory of one forward; generation with and without the KV cache; a GPT training step; and, for
``benchmarks/attention.py``, the project's goals at GPT-2's attention shape.

The modules: :mod:`.registry` (the competitors), :mod:`.harness` (timing, the memory probe, the
matmul rate), :mod:`.suites` (the sweeps and the goal benchmark), :mod:`.report` (``report.md``,
``results.json``, PNG plots, the goal benchmark's tables). ``attnlab bench --quick`` finishes in a
few minutes even on a small CPU.
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
