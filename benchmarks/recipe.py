"""Training recipes against a wall-clock budget: validation loss against training time, with seeds.

Each candidate is a set of ``attnlab train`` flags. The script first measures each candidate's
step rate (a short calibration run), then gives each a ``--max-steps`` that fills the budget, so
the learning-rate schedule ends where the time does, as a user with that much time would set it.
The runs are interleaved (seed 0 of every candidate, then seed 1, ...), so load from other
processes falls on all alike. Training time is the sum of the optimizer steps' own times, as the
trainer's metrics record them (evaluations and checkpoints are not training). The validation loss
is the one ``attnlab train`` reports (``--eval-batches`` random windows of the validation split).

Printed: per candidate, the final validation loss (mean, spread over seeds, each seed), the
training time, the steps; the ablation (each change alone against the baseline and all together);
a PNG of validation loss against training time. The reference row for nanoGPT is the issue's
measurement of nanoGPT's own CPU recipe on this machine type (nanoGPT is not a package this run
can import).

    python benchmarks/recipe.py --data ../shared/data/tinyshakespeare.txt --tokenizer char --budget 45
    python benchmarks/recipe.py --data ../shared/data/tinyshakespeare.txt --tokenizer char --budget 100
    python benchmarks/recipe.py --budget 100                      # the built-in corpus, bytes
    python benchmarks/recipe.py --budget 45 --seeds 1 --only before,default   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from attnlab import hardware
from attnlab.files import atomic_write_json
from attnlab.tools.bench import load_average, require_plotting

# name -> (flags, what it tests). "before" is attnlab's default before this recipe.
CANDIDATES: dict[str, tuple[list[str], str]] = {
    "before": (["--optimizer", "adamw", "--precision", "fp32"], "the old default: AdamW, float32"),
    "bf16": (["--optimizer", "adamw", "--precision", "bf16"], "AdamW, bf16 autocast"),
    "muon": (["--optimizer", "muon", "--precision", "fp32", "--weight-decay", "0"], "Muon, float32, no decay"),
    "muon+bf16": (
        ["--optimizer", "muon", "--precision", "bf16", "--weight-decay", "0"],
        "Muon + bf16 autocast, no weight decay",
    ),
    "default": (
        ["--optimizer", "muon", "--precision", "auto", "--weight-decay", "0.1"],
        "the default: Muon + weight decay 0.1 on Muon's matrices, bf16 where this machine has it natively",
    ),
    "muon+fp32": (
        ["--optimizer", "muon", "--precision", "fp32", "--weight-decay", "0.1"],
        "the default's optimizer in float32 (what auto picks without native bf16)",
    ),
    "modern": (
        ["--optimizer", "muon", "--precision", "bf16", "--weight-decay", "0", "--preset", "modern"],
        "Muon + bf16, no decay, on the 'modern' preset (RoPE, RMSNorm, QK-norm, ReLU^2, untied, no biases)",
    ),
}
NANOGPT = {"time_s": 100.0, "val_loss": 1.886}  # the measurement (tinyshakespeare, char)
CALIBRATION_STEPS = 40


def train(flags: list[str], common: list[str], out: Path, max_steps: int, seed: int, eval_every: int) -> list[dict]:
    """One ``attnlab train`` run; its metrics lines."""
    cmd = [sys.executable, "-m", "attnlab", "train", *common, *flags, "--out", str(out), "--no-progress"]
    cmd += ["--max-steps", str(max_steps), "--seed", str(seed), "--eval-every", str(eval_every)]
    cmd += ["--sample-tokens", "0", "--checkpoint-every", str(max_steps)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def curve(metrics: list[dict], tokens_per_step: int) -> list[tuple[float, float, int]]:
    """(training seconds so far, validation loss, step) at each evaluation."""
    t, points = 0.0, []
    for rec in metrics:
        t += tokens_per_step / rec["tokens_per_s"]
        if "val_loss" in rec:
            points.append((t, rec["val_loss"], rec["step"]))
    return points


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="text file (default: the built-in corpus)")
    p.add_argument("--tokenizer", default="byte", choices=["byte", "char"])
    p.add_argument("--budget", type=float, default=100.0, help="training seconds per run (default 100)")
    p.add_argument("--seeds", type=int, default=3, help="runs per candidate (default 3)")
    p.add_argument("--only", help=f"comma-separated candidates (default all: {','.join(CANDIDATES)})")
    p.add_argument("--evals", type=int, default=8, help="evaluations per run, for the curves (default 8)")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--plot", default="recipe.png", help="the PNG of loss against time (default recipe.png)")
    a = p.parse_args()
    require_plotting()
    names = a.only.split(",") if a.only else list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown or a.budget <= 0 or a.seeds < 1 or a.evals < 1:
        p.error(f"--only must name candidates from {', '.join(CANDIDATES)}, --budget/--seeds/--evals positive")
    common = ["--tokenizer", a.tokenizer] + (["--data", str(Path(a.data).resolve())] if a.data else [])
    tokens_per_step = 32 * 64  # the defaults of --batch-size and the tiny context, which no candidate changes
    load = [load_average()]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # Calibration: each candidate's steps per second (median of the steps after the first few).
        rate = {}
        for name in names:
            m = train(CANDIDATES[name][0], common, root / f"cal-{name}", CALIBRATION_STEPS, 0, CALIBRATION_STEPS)
            rate[name] = statistics.median(r["tokens_per_s"] for r in m[10:]) / tokens_per_step
        steps = {n: max(60, int(a.budget * rate[n])) for n in names}
        print(f"budget {a.budget:g} s: " + ", ".join(f"{n} {steps[n]} steps ({rate[n]:.1f}/s)" for n in names))
        runs: dict[str, list[list[tuple[float, float, int]]]] = {n: [] for n in names}
        for seed in range(a.seeds):
            for name in names:
                out = root / f"{name}-{seed}"
                m = train(CANDIDATES[name][0], common, out, steps[name], seed, max(1, steps[name] // a.evals))
                runs[name].append(curve(m, tokens_per_step))
                points = "  ".join(f"{t:.0f}s:{v:.3f}" for t, v, _ in runs[name][-1])
                print(f"  seed {seed} {name:8s} validation loss at training time: {points}", flush=True)
                load.append(load_average())
    result = summarize(runs, steps, a, [x for x in load if x is not None])
    print_report(result)
    plot(runs, a, result)
    if a.json:
        atomic_write_json(a.json, result)


def summarize(runs: dict, steps: dict, a: argparse.Namespace, load: list[float]) -> dict:
    rows = {}
    for name, curves in runs.items():
        finals = [c[-1][1] for c in curves]
        times = [c[-1][0] for c in curves]
        rows[name] = {
            "flags": " ".join(CANDIDATES[name][0]),
            "what": CANDIDATES[name][1],
            "steps": steps[name],
            "val_loss_mean": statistics.mean(finals),
            "val_loss_sd": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "val_losses": finals,
            "time_s_mean": statistics.mean(times),
            "curves": [[{"time_s": t, "val_loss": v, "step": st} for t, v, st in c] for c in curves],
        }
    return {
        "data": a.data or "built-in corpus",
        "tokenizer": a.tokenizer,
        "budget_s": a.budget,
        "seeds": a.seeds,
        "load_average": [min(load), max(load)] if load else None,
        "cpu_count": os.cpu_count(),
        "candidates": rows,
    }


def print_report(result: dict) -> None:
    rows = result["candidates"]
    print(f"\n{hardware.header('cpu')}")
    print(f"\n{result['data']} ({result['tokenizer']}), budget {result['budget_s']:g} s, {result['seeds']} seeds")
    print("| recipe | flags | steps | training time | validation loss (mean ± sd) | runs |")
    print("|---|---|---:|---:|---:|---|")
    for name, r in rows.items():
        each = ", ".join(f"{v:.3f}" for v in r["val_losses"])
        print(
            f"| {name} | `{r['flags']}` | {r['steps']} | {r['time_s_mean']:.1f} s | "
            f"{r['val_loss_mean']:.3f} ± {r['val_loss_sd']:.3f} | {each} |"
        )
    if "before" in rows:
        print("\nablation against 'before' (negative = better):")
        base = rows["before"]["val_loss_mean"]
        for name, r in rows.items():
            if name != "before":
                print(f"  {name:8s} {r['val_loss_mean'] - base:+.3f}  ({r['what']})")
    if result["load_average"]:
        print(f"load average during the runs: {result['load_average'][0]:.2f}-{result['load_average'][1]:.2f}")


def plot(runs: dict, a: argparse.Namespace, result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, curves) in enumerate(runs.items()):
        for j, c in enumerate(curves):
            label = name if j == 0 else None
            ax.plot([t for t, _, _ in c], [v for _, v, _ in c], color=f"C{i}", alpha=0.8, label=label)
    if a.tokenizer == "char" and a.data and "shakespeare" in Path(a.data).name:
        ax.scatter([NANOGPT["time_s"]], [NANOGPT["val_loss"]], color="black", marker="x", label="nanoGPT CPU recipe")
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("validation loss (nats per token)")
    ax.set_title(f"{result['data'] if a.data is None else Path(a.data).name}, budget {a.budget:g} s")
    ax.set_ylim(top=min(ax.get_ylim()[1], 3.0))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.plot, dpi=110)
    print(f"plot: {a.plot}")


if __name__ == "__main__":
    main()
