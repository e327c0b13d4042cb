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

    python benchmarks/attention.py              # the full benchmark (a few minutes on 2 cores)
    python benchmarks/attention.py --quick      # small sizes, seconds
"""

from __future__ import annotations

import argparse
import sys

from attnlab.cli.bench import positive_int
from attnlab.files import atomic_write_json
from attnlab.tools.bench import attention_benchmark, format_attention_report, goals_met


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
    args = parser.parse_args(argv)
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")

    quick = args.quick
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
        log=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(format_attention_report(result))
    if args.json:
        atomic_write_json(args.json, result)
        print(f"\nwrote {args.json}")
    return 1 if args.check and not goals_met(result) else 0


if __name__ == "__main__":
    sys.exit(main())
