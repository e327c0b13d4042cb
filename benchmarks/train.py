"""Training throughput and model-FLOPs utilisation (MFU) of ``attnlab train``'s step, in one run.

Times the trainer's own optimizer step (batch fetch, forward, cross-entropy, backward, gradient
clipping, AdamW) on the given preset and batch, and, interleaved with it (so that load from other
processes hits both alike), a square float32 matrix product: the machine's own achievable matmul
rate. MFU is the model's useful FLOP rate divided by that rate. Like ``attnlab train``, it first
tunes glibc's malloc to keep freed memory (:mod:`attnlab.training.allocator`; ``--no-malloc-tuning`` to
measure without) and reports the minor page faults per step either way.

Model FLOPs per optimizer step (the PaLM / nanoGPT convention, stated so the figure can be checked)::

    tokens = batch_size * context_length
    flops  = 6 * N * tokens + 12 * n_layers * context_length * emb_dim * tokens

* ``N``: parameters that take part in a matmul: everything except the position embedding (the
  token embedding counts once: it *is* the LM head's matrix when tied). ``6 N`` per token: 2 for
  the forward multiply-add, 4 for the two backward products (inputs and weights).
* ``12 L T d`` per token: the attention scores ``Q K^T`` and the weighted sum ``A V``, each
  ``2 T d`` forward and twice that backward, over the full ``T x T`` square. A causal kernel skips
  about half of it; the figure with the causal half (``6 L T d``) is printed too.

The reference rate is the median over rounds of ``2 n^3 / time`` for an ``n x n`` float32 matmul
(default ``n = 1024``) on the same device and threads. Goal: MFU >= 50% for the ``tiny`` preset on
a CPU.

    python benchmarks/train.py                      # tiny preset, the training defaults
    python benchmarks/train.py --json train.json    # also write the figures
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

import torch

from attnlab import hardware
from attnlab.files import atomic_write_json
from attnlab.tools.bench import interleave, load_average, model_flops_per_step, paired_ratio
from attnlab.training import TrainConfig, Trainer
from attnlab.training.allocator import tune_cpu_allocator

GOAL_MFU = 0.5


def run(args: argparse.Namespace) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = tune_cpu_allocator() if args.malloc_tuning else None
    d = TrainConfig()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(
            out=tmp,
            preset=args.preset,
            context_length=args.context_length or d.context_length,
            batch_size=args.batch_size or d.batch_size,
            max_steps=10**9,  # the schedule never ends during the benchmark
            device=args.device,
            compile=args.compile,
            progress=False,
            sample_tokens=0,
        )
        trainer = Trainer(cfg, log=lambda msg: None)
    cfg = trainer.cfg  # with the preset's defaults filled in
    model, device = trainer.raw_model, trainer.device
    mc = trainer.model_config
    n_params = model.num_parameters(exclude_embeddings=True)
    tokens = cfg.batch_size * mc.context_length
    flops = model_flops_per_step(n_params, mc.n_layers, mc.context_length, mc.emb_dim, tokens)

    n = args.matmul_size
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def matmul() -> None:
        for _ in range(args.matmul_reps):
            a @ b

    def step() -> None:
        trainer._train_step()
        trainer.step += 1

    # Interleaved: a burst of load hits both. Times are per step and per matmul.
    t = interleave({"step": step, "matmul": matmul}, args.repeats, args.warmup, device=device)
    faults = t["step"].page_faults
    step_med, mm_med = t["step"].median_ms / 1e3, t["matmul"].median_ms / 1e3 / args.matmul_reps
    matmul_flops = 2 * n**3 / mm_med
    achieved = flops["total"] / step_med
    # Per round: (F / step_i) / (2 n^3 reps / matmul_i) = F / (2 n^3 reps) * matmul_i / step_i.
    paired = flops["total"] / (2 * n**3 * args.matmul_reps) * paired_ratio(t["matmul"], t["step"])
    load = load_average()
    return {
        "preset": args.preset,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "compile": bool(args.compile),
        "malloc_tuning": allocator.reason if allocator is not None else "off (--no-malloc-tuning)",
        "malloc_tuned": bool(allocator and allocator.applied),
        "page_faults_per_step": statistics.mean(faults) if faults else None,  # None: the OS does not count them
        "batch_size": cfg.batch_size,
        "context_length": mc.context_length,
        "n_layers": mc.n_layers,
        "emb_dim": mc.emb_dim,
        "n_params_matmul": n_params,
        "tokens_per_step": tokens,
        "flops_per_step": flops,
        "formula": "6*N*tokens + 12*n_layers*context_length*emb_dim*tokens (N excludes the position embedding)",
        "step_ms_median": step_med * 1e3,
        "step_ms": list(t["step"].times_ms),
        "tokens_per_s": tokens / step_med,
        "model_gflops_per_s": achieved / 1e9,
        "matmul_size": n,
        "matmul_gflops_per_s": matmul_flops / 1e9,
        "mfu": achieved / matmul_flops,
        "mfu_paired_median": paired,
        "mfu_causal": flops["total_causal"] / step_med / matmul_flops,
        "goal_mfu": GOAL_MFU,
        "load_average": load,
        "torch": torch.__version__,
    }


def report(r: dict) -> str:
    f = r["flops_per_step"]
    lines = [
        hardware.header(r["device"]),
        f"attnlab training step: preset {r['preset']}, batch {r['batch_size']} x {r['context_length']} tokens, "
        f"{r['device']}, {r['threads']} thread(s){', compiled' if r['compile'] else ''}"
        + (f", load average {r['load_average']:.1f}" if r["load_average"] is not None else ""),
        f"  model FLOPs/step   {f['total'] / 1e9:8.3f} GFLOP  (6*N*tokens {f['dense'] / 1e9:.3f} + attention "
        f"{f['attention'] / 1e9:.3f}; N = {r['n_params_matmul']:,})",
        f"  step time          {r['step_ms_median']:8.1f} ms (median), "
        + (f"{r['page_faults_per_step']:.0f}" if r["page_faults_per_step"] is not None else "n/a")
        + f" minor page faults/step; allocator: {r['malloc_tuning']}",
        f"  tokens/s           {r['tokens_per_s']:8.0f}",
        f"  model FLOP rate    {r['model_gflops_per_s']:8.2f} GFLOP/s",
        f"  fp32 matmul rate   {r['matmul_gflops_per_s']:8.2f} GFLOP/s "
        f"({r['matmul_size']}x{r['matmul_size']}, measured in the same run)",
        f"  MFU                {r['mfu']:8.1%}  (median of per-round ratios {r['mfu_paired_median']:.1%}; "
        f"counting causal attention as half: {r['mfu_causal']:.1%}); goal >= {r['goal_mfu']:.0%}: "
        + ("met" if r["mfu"] >= r["goal_mfu"] else "NOT met"),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    parser.add_argument("--batch-size", type=int, help="sequences per step (default: attnlab train's)")
    parser.add_argument("--context-length", type=int, help="tokens per sequence (default: attnlab train's)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, mps or auto (default: cpu)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument(
        "--malloc-tuning",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tune glibc's malloc as attnlab train does (default: on)",
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds (default: 15)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default: 3)")
    parser.add_argument("--matmul-size", type=int, default=1024, help="n of the n x n reference matmul (default: 1024)")
    parser.add_argument("--matmul-reps", type=int, default=3, help="matmuls per timed round (default: 3)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--check", action="store_true", help="exit with status 1 when MFU < 50%%")
    args = parser.parse_args(argv)
    for name in ("repeats", "matmul_size", "matmul_reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    r = run(args)
    print(report(r))
    if args.json:
        atomic_write_json(args.json, r)
        print(f"wrote {args.json}")
    return 1 if args.check and r["mfu"] < GOAL_MFU else 0


if __name__ == "__main__":
    sys.exit(main())
