"""An 8B model on a laptop's memory: a Llama-3-8B-shaped GGUF file in Q4_0, kept quantized.

The file is written once (random weights quantized by the ``gguf`` package's own Q4_0 quantizer,
about 4.7 GB, in ``--cache``, outside the repository). Then, in one process, each step's time and its
peak RSS (the kernel's high-water mark ``VmHWM``, reset before each step through
``/proc/self/clear_refs``) and the RSS after it:

* load: ``GPT.from_gguf`` (the matrices stay in the file's blocks);
* inspect: :func:`attnlab.interpret.trace` of 64 tokens with the stages, and the inspector page's data
  (:func:`attnlab.interpret.inspector_data`: head roles, logit lens, rollout, next-token probabilities);
* patch: :func:`attnlab.interpret.activation_patching` of ``resid_pre`` over 8 layers, every position of a
  16-token pair (128 patched runs; ``max_tokens=2048``: one batched pass);
* generate: 16 greedy tokens after a 16-token prompt;
* LoRA: two steps of the default adapters (q, k, v, o; rank 8) on 64 tokens, AdamW.

Goal (issue 54): every step within 8 GB peak. For contrast, transformers' GGUF loading of the same file
runs in a child process watched from here: it dequantizes every tensor to float32 (about 32 GB for 8B
weights), so it is stopped when its RSS passes ``--hf-limit-gb`` (default 14, on a 24 GB machine) and
the benchmark prints how far it got.

    python benchmarks/scale.py                         # writes ~/.cache/attnlab-bench once (minutes)
    python benchmarks/scale.py --cache /tmp/bench --parts attnlab
    python benchmarks/scale.py --layers 4              # a quick look: the 8B widths, 4 layers
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from attnlab import hardware

# Llama 3 8B's config.json
SHAPE = dict(width=4096, hidden=14336, layers=32, heads=32, kv_heads=8, vocab=128256, context=8192, theta=500000.0)


def write_q4_0(path: Path, layers: int) -> Path:
    """The 8B-shaped Llama 3 GGUF of random Q4_0 weights (``gguf.quants.quantize``), written tensor by
    tensor (never the whole model in memory), once; norms are ones."""
    if path.is_file():
        return path
    import gguf
    import numpy as np

    s, rng = SHAPE, np.random.default_rng(0)
    shapes = {"token_embd.weight": (s["vocab"], s["width"]), "output_norm.weight": (s["width"],),
              "output.weight": (s["vocab"], s["width"])}  # fmt: skip
    kv = s["width"] // s["heads"] * s["kv_heads"]
    for i in range(layers):
        for name, shape in (("attn_q", (s["width"], s["width"])), ("attn_k", (kv, s["width"])),
                            ("attn_v", (kv, s["width"])), ("attn_output", (s["width"], s["width"])),
                            ("ffn_gate", (s["hidden"], s["width"])), ("ffn_up", (s["hidden"], s["width"])),
                            ("ffn_down", (s["width"], s["hidden"]))):  # fmt: skip
            shapes[f"blk.{i}.{name}.weight"] = shape
        shapes[f"blk.{i}.attn_norm.weight"] = shapes[f"blk.{i}.ffn_norm.weight"] = (s["width"],)
    q4 = gguf.GGMLQuantizationType.Q4_0
    tmp = path.with_suffix(".tmp")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    writer.add_name("attnlab-bench-llama3-8b-shape")
    for key, value in {"llama.context_length": s["context"], "llama.embedding_length": s["width"],
                       "llama.block_count": layers, "llama.feed_forward_length": s["hidden"],
                       "llama.attention.head_count": s["heads"], "llama.attention.head_count_kv": s["kv_heads"],
                       "llama.rope.freq_base": s["theta"], "llama.attention.layer_norm_rms_epsilon": 1e-5,
                       "llama.vocab_size": s["vocab"]}.items():  # fmt: skip
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(key, value)

    def data(name: str, shape: tuple[int, ...]) -> np.ndarray:
        if len(shape) == 1:
            return np.ones(shape, np.float32)
        std = 1.0 / shape[1] ** 0.5  # (an output of about unit RMS from an input of unit RMS)
        rows = []
        for r in range(0, shape[0], 4096):  # (a float32 slab of 4096 rows at a time)
            slab = rng.standard_normal((min(4096, shape[0] - r), shape[1]), dtype=np.float32) * std
            rows.append(gguf.quants.quantize(slab, q4))
        return np.concatenate(rows)

    for name, shape in shapes.items():  # (the header names every tensor's type and size first)
        kind = gguf.GGMLQuantizationType.F32 if len(shape) == 1 else q4
        nbytes = (shape[0] * 4) if len(shape) == 1 else shape[0] * shape[1] // 32 * 18
        writer.add_tensor_info(name, shape, np.float32, nbytes, raw_dtype=kind)  # (numpy's order: rows first)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (name, shape) in enumerate(shapes.items()):
        writer.write_tensor_data(data(name, shape))
        print(f"\r  writing {path.name}: {i + 1}/{len(shapes)} tensors", end="", flush=True)
    writer.close()
    tmp.replace(path)
    print()
    return path


def rss_gb(field: str) -> float:
    """``VmRSS`` or ``VmHWM`` of this process, in GB."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) / 1e6


def reset_peak() -> None:
    """Reset the kernel's high-water mark of this process's RSS (``VmHWM``) to its current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def step(name: str, fn, results: dict):
    reset_peak()
    t0 = time.perf_counter()
    out = fn()
    s = time.perf_counter() - t0
    results[name] = {"s": s, "peak_gb": rss_gb("VmHWM"), "rss_gb": rss_gb("VmRSS")}
    r = results[name]
    print(f"  {name:32s} {s:8.1f} s   peak RSS {r['peak_gb']:5.2f} GB   RSS after {r['rss_gb']:5.2f} GB", flush=True)
    return out


def ours(path: Path, layers: int) -> dict:
    from attnlab import GPT
    from attnlab.interpret import activation_patching, inspector_data, trace
    from attnlab.interpret.patching import logit_diff
    from attnlab.training.lora import LoRASettings, apply_lora

    results: dict = {}
    print(f"  (after import torch, attnlab: RSS {rss_gb('VmRSS'):.2f} GB)")
    model = step("load (quantized)", lambda: GPT.from_gguf(path).eval(), results)
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    x = torch.randint(0, V, (1, 64), generator=g)
    corrupted = x.clone()
    corrupted[0, 10] = (corrupted[0, 10] + 1) % V

    def inspect():
        with torch.no_grad():
            tr = trace(model, x, stages=True)
        return inspector_data(tr)

    step("inspect, 64 tokens", inspect, results)
    metric = logit_diff(1, 2)
    pl = min(8, layers)  # (every position of a 16-token pair: 8 x 16 patched runs, in one pass of 2048 tokens)
    chosen = list(range(pl))
    patch = lambda: activation_patching(
        model, x[:, :16], corrupted[:, :16], metric, "resid_pre", layers=chosen, max_tokens=2048
    )
    step(f"activation patching, resid_pre, {pl} layers x 16", patch, results)
    step("generate 16 tokens", lambda: model.generate(x[:, :16], 16, temperature=0), results)

    def lora():
        apply_lora(model, LoRASettings.make(8))
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        for _ in range(2):
            logits = model(x[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[0, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    step("two LoRA steps, 64 tokens", lora, results)
    return results


def transformers_load(path: Path, limit_gb: float) -> None:
    """transformers' GGUF loading of ``path`` in a child process, stopped past ``limit_gb`` of RSS."""
    code = (
        "import transformers, sys; transformers.AutoModelForCausalLM.from_pretrained("
        f"{str(path.parent)!r}, gguf_file={path.name!r}, dtype='float32'); print('loaded')"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, killed, last = 0.0, False, [""]

    def read() -> None:
        for chunk in iter(lambda: child.stdout.read(256), ""):
            last[0] = (last[0] + chunk)[-400:]

    threading.Thread(target=read, daemon=True).start()
    t0 = time.perf_counter()
    while child.poll() is None:
        try:
            kb = int(re.search(r"^VmRSS:\s+(\d+)", Path(f"/proc/{child.pid}/status").read_text(), re.M).group(1))
            peak = max(peak, kb / 1e6)
        except (OSError, AttributeError):
            pass
        if peak > limit_gb:
            child.kill()
            killed = True
            break
        time.sleep(0.1)
    child.wait()
    s = time.perf_counter() - t0
    progress = re.findall(r"(\d+)/(\d+) \[", last[0])
    how_far = f", {progress[-1][0]} of {progress[-1][1]} tensors converted" if progress else ""
    if killed:
        print(f"  transformers GGUF load: stopped at {peak:.1f} GB RSS after {s:.0f} s{how_far} (limit {limit_gb} GB)")
    else:
        tail = last[0].strip().splitlines()[-1:] or [""]
        print(f"  transformers GGUF load: exit {child.returncode} after {s:.0f} s, peak {peak:.1f} GB: {tail[0][:200]}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/attnlab-bench"), help="where the file is kept")
    ap.add_argument("--layers", type=int, default=SHAPE["layers"], help="blocks (default 32: the 8B model)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--parts", nargs="+", default=["attnlab", "transformers"], choices=["attnlab", "transformers"])
    ap.add_argument("--hf-limit-gb", type=float, default=14.0, help="stop transformers' load past this RSS")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    Path(args.cache).mkdir(parents=True, exist_ok=True)
    size = "8b" if args.layers == SHAPE["layers"] else f"{args.layers}l"
    name = f"attnlab-bench-llama3-{size}.Q4_0.gguf"
    path = write_q4_0(Path(args.cache) / name, args.layers)
    print(hardware.header())
    size_gb, load = path.stat().st_size / 1e9, os.getloadavg()[0]
    print(f"{path.name}: {size_gb:.2f} GB, {args.layers} layers; load average {load:.1f}")
    if "attnlab" in args.parts:
        results = ours(path, args.layers)
        worst = max(r["peak_gb"] for r in results.values())
        print(f"  largest peak RSS {worst:.2f} GB (goal <= 8 GB): {'met' if worst <= 8 else 'missed'}")
    if "transformers" in args.parts:
        transformers_load(path, args.hf_limit_gb)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
