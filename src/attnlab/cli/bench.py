"""``attnlab bench``: run the benchmarks and write a report directory (see :mod:`attnlab.tools.bench`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from attnlab.cli.options import positive_int  # (benchmarks/ import it from here)
from attnlab.tools.bench import BenchConfig, require_plotting, run_all, write_report


def _int_list(text: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return sorted(set(values))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Measure the tutorials' attention, attnlab's and torch's (time and peak memory against sequence "
        "length), generation with and without the KV cache and a training step, against the machine's "
        "matmul rate; write report.md, results.json and PNG plots into a directory."
    )
    parser.add_argument("--out", metavar="DIR", default="bench-report", help="report directory (default: bench-report)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a few minutes even on a small CPU")
    lens = dict(type=_int_list, metavar="T,T,...")
    parser.add_argument("--seq-lens", **lens, help="attention timing lengths (default 64..2048; quick 64..512)")
    parser.add_argument("--memory-seq-lens", **lens, help="attention memory lengths")
    parser.add_argument("--gen-lens", **lens, help="total lengths of the generation test")
    parser.add_argument("--train-lens", **lens, help="sequence lengths of the training test")
    parser.add_argument("--d-model", type=positive_int, metavar="D", help="attention width (default 768; quick 256)")
    parser.add_argument(
        "--heads", dest="num_heads", type=positive_int, metavar="H", help="attention heads (default 12; quick 4)"
    )
    parser.add_argument("--batch", type=positive_int, metavar="B", help="attention batch size (default 1)")
    parser.add_argument(
        "--repeats", type=positive_int, metavar="N", help="interleaved timing rounds (default 7; quick 5)"
    )
    parser.add_argument(
        "--loop-max-len", type=positive_int, metavar="T", help="longest sequence given to the Python loop (default 64)"
    )
    parser.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help="torch CPU threads (default: torch's choice). On a machine shared with other busy processes, "
        "1 avoids threads spin-waiting for each other, which can slow small ops many times over",
    )
    parser.add_argument("--skip-memory", action="store_true", help="leave out the peak-memory sweep")
    parser.add_argument("--skip-generation", action="store_true", help="leave out the generation test")
    parser.add_argument("--skip-training", action="store_true", help="leave out the training-step test")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    cfg = BenchConfig.quick() if args.quick else BenchConfig()
    for f in dataclasses.fields(cfg):  # each size flag is named as the setting it overrides
        value = getattr(args, f.name, None)
        if value is not None:
            setattr(cfg, f.name, value)
    cfg.memory, cfg.generation, cfg.training = not args.skip_memory, not args.skip_generation, not args.skip_training
    if cfg.d_model % cfg.num_heads:
        raise ValueError(f"--d-model must be divisible by --heads, got {cfg.d_model} and {cfg.num_heads}")
    if cfg.gen_prompt >= min(cfg.gen_lens):
        raise ValueError(f"--gen-lens must all exceed the {cfg.gen_prompt}-token prompt, got {cfg.gen_lens}")
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    require_plotting()  # before the minutes of measuring, not after them
    try:  # made now: a place the report cannot go is an error before the minutes of measuring
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"cannot create the --out directory {out}: {exc.strerror}") from None
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        result = run_all(cfg, lambda msg: print(msg, file=sys.stderr, flush=True))  # progress on stderr
    finally:
        torch.set_num_threads(threads)  # main() may run inside a larger program (or a test session)
    report = write_report(result, out)
    print(f"wrote {report} (and results.json, plots) in {result['seconds']:.0f} s")
    return 0
