"""Benchmark attnlab's multi-head attention against torch and the tutorials' code, in one run.

Times forward+backward of a causal attention layer at the GPT-2 shape of "Implementing GPT-Style
Attention: A Step-by-Step Guide with PyTorch" (batch 2, 1024 tokens, d_model 768, 12 heads,
dropout 0, float32, CPU) for

* ``attnlab.MultiHeadAttention``,
* ``torch.nn.MultiheadAttention(need_weights=False)`` with a causal mask and ``is_causal=True``,
* the tutorials' own ``MultiHeadAttention`` (explicit ``(T, T)`` scores, mask and softmax),
* and the stacked-heads ``MultiHeadAttentionWrapper`` of attnlab and of the tutorials,

interleaving the competitors' repetitions so that load from other processes hits all of them
alike, then measures the peak memory of one forward at 8192 tokens (each competitor in a fresh
process). Prints the tables and, with ``--json``, writes the figures.

Then sliding-window attention (Mistral's): forward+backward at 8192 tokens, window 512, 12 heads of
64, batch 1, float32, attnlab's band-blocked path (``scaled_dot_product_attention(..., window=512)``)
against full causal attention in torch's fused kernel and against the fused kernel given the dense
window mask, interleaved in one process (goal: at most 0.25x the time of full causal attention),
and the peak memory of the window path at growing lengths, each in a fresh process (goal: linear
in T: doubling T at most ~doubles it).

    python benchmarks/attention.py              # the full benchmark (a few minutes on 2 cores)
    python benchmarks/attention.py --quick      # small sizes, seconds
    python benchmarks/attention.py --only-sliding-window
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
import torch.nn.functional as F

from attnlab import hardware
from attnlab.cli.bench import positive_int
from attnlab.files import atomic_write_json
from attnlab.functional import causal_mask, scaled_dot_product_attention
from attnlab.tools.bench import attention_benchmark, compare, format_attention_report, goals_met, interleave
from attnlab.tools.bench.report import table

SLIDING_GOAL = 0.25  # attnlab's window path / full causal fused attention, forward+backward


# --------------------------------------------------------------------------------------------
# Sliding-window attention
# --------------------------------------------------------------------------------------------
def sliding_window_benchmark(
    *,
    seq_len: int = 8192,
    window: int = 512,
    heads: int = 12,
    head_dim: int = 64,
    batch: int = 1,
    repeats: int = 7,
    warmup: int = 1,
    dense: bool = True,
    memory_lengths: tuple[int, ...] = (4096, 8192, 16384, 32768),
    log=lambda msg: None,
) -> dict[str, object]:
    """Forward+backward of causal attention with a sliding window, three ways, interleaved; then the
    window path's peak memory at each of ``memory_lengths`` (a fresh process each)."""
    g = torch.Generator().manual_seed(0)
    # Contiguous (B, H, T, E), the layout in which torch's fused kernel is fastest (measured: its full causal
    # forward takes ~1.6x longer on the (B, T, H, E) memory a projection hands over).
    Q, K, V = (torch.randn(batch, heads, seq_len, head_dim, generator=g).requires_grad_(True) for _ in range(3))
    q, k, v = Q, K, V
    dy = torch.randn(batch, heads, seq_len, head_dim, generator=g)
    mask = causal_mask(seq_len, window=window) if dense else None  # (T, T) bool
    steps = {
        "torch fused, full causal": lambda: F.scaled_dot_product_attention(Q, K, V, is_causal=True),
        f"attnlab window={window}": lambda: scaled_dot_product_attention(Q, K, V, is_causal=True, window=window),
    }
    if dense:
        steps["torch fused, dense window mask"] = lambda: F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    with torch.no_grad():
        outs = {name: fn() for name, fn in steps.items()}
    reference = outs[f"attnlab window={window}"]
    diff = float((reference - outs["torch fused, dense window mask"]).abs().max()) if dense else None

    def fwd_bwd(fn):
        def step() -> None:
            q.grad = k.grad = v.grad = None
            fn().backward(dy)

        return step

    log(f"sliding window: timing {len(steps)} competitors, {repeats} interleaved rounds after {warmup} warm-up ...")
    timings = interleave({n: fwd_bwd(fn) for n, fn in steps.items()}, repeats, warmup, alternate=True)
    names = list(steps)
    ratio = compare(timings[names[1]], timings[names[0]])
    memory = {}
    for T in memory_lengths:
        log(f"sliding window: peak memory at {T} tokens ...")
        memory[str(T)] = _peak_memory_mb(T, window, heads, head_dim, batch)
    return {
        "config": {
            "seq_len": seq_len,
            "window": window,
            "heads": heads,
            "head_dim": head_dim,
            "batch": batch,
            "dtype": "float32",
            "repeats": repeats,
            "warmup": warmup,
            "threads": torch.get_num_threads(),
        },
        "max_abs_diff_vs_dense_mask": diff,
        "timings": {n: t.to_dict() for n, t in timings.items()},
        "ratio_window_over_full": ratio,
        "goal": SLIDING_GOAL,
        "memory_mb": memory,
    }


_MEMORY_CHILD = """
import gc, json, sys, torch
from attnlab.functional import scaled_dot_product_attention
T, W, H, E, B = map(int, sys.argv[1:6])

def kb(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

def run(T):
    q, k, v = (torch.randn(B, T, H, E).requires_grad_(True) for _ in range(3))
    dy = torch.randn(B, H, T, E)
    yield
    out = scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, window=W)
    out.backward(dy)
    yield

for _ in run(4 * W):  # one-off costs of a first call (kernels, caches) go into the baseline
    pass
steps = run(T)
next(steps)  # inputs built
gc.collect()
baseline = kb("VmRSS") / 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set (VmHWM) starts again from here (Linux >= 4.0)
next(steps)
peak = kb("VmHWM") / 1024
print(json.dumps({"inputs_mb": 4 * 4 * B * T * H * E / 2**20, "baseline_mb": baseline, "peak_mb": peak,
                  "forward_backward_mb": peak - baseline}))
"""


def _peak_memory_mb(T: int, window: int, heads: int, head_dim: int, batch: int) -> dict[str, float]:
    """Peak resident memory one forward+backward of the window path adds, in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_CHILD, str(T), str(window), str(heads), str(head_dim), str(batch)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def format_sliding_window_report(result: dict[str, object]) -> str:
    cfg = result["config"]
    lines = [
        "",
        f"sliding-window attention: forward+backward, batch {cfg['batch']} x {cfg['seq_len']} tokens, window "
        f"{cfg['window']}, {cfg['heads']} heads of {cfg['head_dim']}, {cfg['dtype']}, {cfg['threads']} threads",
        f"  {cfg['repeats']} interleaved rounds (order reversed every other round) after {cfg['warmup']} warm-up",
    ]
    if result["max_abs_diff_vs_dense_mask"] is not None:
        lines.append(
            f"  attnlab window == dense window mask: max |difference| {result['max_abs_diff_vs_dense_mask']:.1e}"
        )
    rows = [
        [name, f"{t['median_ms']:.0f}", f"{t['iqr_ms']:.0f}", f"{t['min_ms']:.0f}", f"{t['max_ms']:.0f}"]
        for name, t in result["timings"].items()
    ]
    lines += table(["competitor", "median ms", "IQR ms", "min ms", "max ms"], rows)
    r, goal = result["ratio_window_over_full"], result["goal"]
    verdict = "met" if r["of_medians"] <= goal else "MISSED"
    if (cfg["seq_len"], cfg["window"], cfg["heads"], cfg["head_dim"], cfg["batch"]) != (8192, 512, 12, 64, 1):
        verdict = "(the goal is set for 8192 tokens, window 512, 12 heads of 64, batch 1)"
    lines.append(
        f"ratio attnlab window / full causal: {r['of_medians']:.3f} (paired {r['paired']:.3f}, CPU {r['cpu']:.3f})"
        f"   goal <= {goal:.2f}  {verdict}"
    )
    mem = result["memory_mb"]
    if mem:
        lines.append("")
        lines.append("peak memory of one forward+backward of the window path (a fresh process each):")
        rows, previous = [], None
        for T, m in mem.items():
            growth = "" if previous is None else f"x{m['forward_backward_mb'] / previous:.2f}"
            rows.append([T, f"{m['inputs_mb']:.0f}", f"{m['forward_backward_mb']:.0f}", growth])
            previous = m["forward_backward_mb"]
        lines += table(["tokens", "q, k, v, dy MB", "added MB", "vs half the tokens"], rows)
        lines.append("  (linear in T: each doubling of T about doubles it; a dense (T, T) mask would quadruple)")
    return "\n".join(lines)


def sliding_goal_met(result: dict[str, object]) -> bool:
    cfg = result["config"]
    if (cfg["seq_len"], cfg["window"], cfg["heads"], cfg["head_dim"], cfg["batch"]) != (8192, 512, 12, 64, 1):
        return True  # measured, not judged
    return result["ratio_window_over_full"]["of_medians"] <= result["goal"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (batch 1, 256 tokens, memory at 1024)")
    parser.add_argument("--batch", type=positive_int, help="timing batch size (default 2; quick 1)")
    parser.add_argument("--seq-len", type=positive_int, help="timing sequence length (default 1024; quick 256)")
    parser.add_argument("--d-model", type=positive_int, default=768, help="model width (default 768)")
    parser.add_argument("--heads", type=positive_int, default=12, help="attention heads (default 12)")
    parser.add_argument("--repeats", type=positive_int, help="timed interleaved rounds (default 15; quick 5)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 2; quick 1)")
    parser.add_argument("--memory-seq-len", type=positive_int, help="tokens of the memory test (default 8192)")
    parser.add_argument("--skip-memory", action="store_true", help="time only, skip the peak-memory test")
    parser.add_argument("--no-wrapper", action="store_true", help="leave out the stacked-heads wrappers")
    parser.add_argument(
        "--malloc-tuning",
        action="store_true",
        help="first tune glibc's malloc as attnlab train does (attnlab.training.allocator): freed memory is reused "
        "instead of faulted in again; off by default, as a library user's process is",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--check", action="store_true", help="exit with status 1 when a goal is missed")
    parser.add_argument("--skip-sliding-window", action="store_true", help="leave out the sliding-window section")
    parser.add_argument(
        "--only-sliding-window", action="store_true", help="run the sliding-window section alone (8192 tokens)"
    )
    parser.add_argument("--window", type=positive_int, default=512, help="sliding window (default 512)")
    args = parser.parse_args(argv)
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)

    quick = args.quick
    sliding = None
    if not args.skip_sliding_window:
        sliding = sliding_window_benchmark(
            seq_len=2048 if quick else 8192,
            window=min(args.window, 128) if quick else args.window,
            repeats=args.repeats or (3 if quick else 7),
            warmup=args.warmup if args.warmup is not None else 1,
            memory_lengths=(1024, 2048) if quick else (4096, 8192, 16384, 32768),
            log=log,
        )
    if args.only_sliding_window:
        print(hardware.header("cpu"), flush=True)
        print(format_sliding_window_report(sliding).lstrip("\n"))
        if args.json:
            atomic_write_json(args.json, {"sliding_window": sliding})
        return 1 if args.check and not sliding_goal_met(sliding) else 0
    result = attention_benchmark(
        batch=args.batch or (1 if quick else 2),
        seq_len=args.seq_len or (256 if quick else 1024),
        d_model=args.d_model,
        num_heads=args.heads,
        repeats=args.repeats or (5 if quick else 15),
        warmup=args.warmup if args.warmup is not None else (1 if quick else 2),
        wrappers=not args.no_wrapper,
        memory=not args.skip_memory,
        memory_seq_len=args.memory_seq_len or (1024 if quick else 8192),
        malloc_tuning=args.malloc_tuning,
        log=log,
    )
    print(format_attention_report(result))
    if sliding is not None:
        print(format_sliding_window_report(sliding))
        result["sliding_window"] = sliding
    if args.json:
        atomic_write_json(args.json, result)
        print(f"\nwrote {args.json}")
    met = goals_met(result) and (sliding is None or sliding_goal_met(sliding))
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main())
