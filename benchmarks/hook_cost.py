"""What the hook points cost when no hook is set: KV-cache decoding, this tree against the tree
before the hook points (a git revision), paired.

Each round starts one child process per tree (the same seeded model, the same prompt), in
alternating order, so machine load hits both alike; each child reports greedy decoding speed
(tokens/s, the prefill not timed). The table shows the medians and their ratio (goal: 1.00 within
noise), and a second pair with every hook point of the current tree *set* (a no-op function), to
show what a hook costs once it is used. Each child times the best of 3 runs; the table shows the
best and the median over rounds.

    python benchmarks/hook_cost.py                     # against `git merge-base HEAD main`
    python benchmarks/hook_cost.py --base 9080d6e --rounds 7
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import sys, time, torch
torch.set_num_threads({threads})
from attnlab import hardware
from attnlab.model import GPT, GPTConfig
from attnlab.generation import generate
torch.manual_seed(0)
sizes = dict(n_layers={layers}, emb_dim={width}, n_heads={heads})
cfg = GPTConfig.preset("modern", vocab_size=4096, context_length=1024, **sizes)
model = GPT(cfg).eval()
idx = torch.randint(0, 4096, (1, 16))
generate(model, idx, max_new_tokens=8, temperature=0.0)  # warm-up
hooked = {hooked}
if hooked:
    from attnlab.interpret import hook_names, hooks
    ctx = hooks(model, dict.fromkeys([n for n in hook_names(model) if ".attn." not in n], lambda x, h: None))
else:
    import contextlib
    ctx = contextlib.nullcontext()
with ctx:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        generate(model, idx, max_new_tokens={new}, temperature=0.0)
        best = min(best, time.perf_counter() - t0)
print({new} / best)
"""


def export_tree(rev: str, into: Path) -> Path:
    """``src/`` of git revision ``rev`` unpacked under ``into``."""
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    path = into / "archive.tar"
    path.write_bytes(archive)
    with tarfile.open(path) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def rate(src: Path, args: argparse.Namespace, hooked: bool = False) -> float:
    code = CHILD.format(
        threads=args.threads, layers=args.layers, width=args.width, heads=args.heads, new=args.new, hooked=hooked
    )
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="decoding speed with and without the hook points (no hook set)")
    ap.add_argument("--base", default=None, help="git revision before the hook points (default: merge-base with main)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--new", type=int, default=128, help="tokens decoded per timing")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    base = (
        args.base
        or subprocess.run(
            ["git", "merge-base", "HEAD", "main"], cwd=ROOT, check=True, capture_output=True, text=True
        ).stdout.strip()
    )
    from attnlab import hardware

    print(hardware.header("cpu"), flush=True)
    print(
        f"# hook cost: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print(f"# torch CPU capability: {torch.backends.cpu.get_cpu_capability()}; load average {os.getloadavg()}")
    print(f"# modern GPT {args.layers} layers x {args.width} wide, {args.new} greedy tokens, {args.threads} thread(s)")
    with tempfile.TemporaryDirectory() as tmp:
        before = export_tree(base, Path(tmp))
        now = ROOT / "src"
        runs: dict[str, list[float]] = {"before": [], "now": [], "now, hooks set": []}
        for r in range(args.rounds):
            order = [("before", before, False), ("now", now, False), ("now, hooks set", now, True)]
            for name, src, hooked in order if r % 2 == 0 else order[::-1]:
                runs[name].append(rate(src, args, hooked))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f} tok/s" for k, v in runs.items()), flush=True)
    print(f"\nbase {base[:10]}; tokens/s, best and median of {args.rounds} rounds (best: least disturbed by load)")
    for name, v in runs.items():
        best, med = max(v), statistics.median(v)
        ratio = (
            f"best ratio {best / max(runs['before']):.3f}, median ratio {med / statistics.median(runs['before']):.3f}"
        )
        print(f"{name:16} best {best:7.1f}  median {med:7.1f}  vs before: {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
