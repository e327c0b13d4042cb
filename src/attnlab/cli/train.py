"""``attnlab train``: train a GPT on a text file (default: the built-in corpus), then sample from it.

The command-line face of :mod:`attnlab.training`. Examples::

    attnlab train                                    # tiny byte-level GPT on the Python docs, minutes on a CPU
    attnlab train --data input.txt --tokenizer char --max-steps 5000 --out runs/shakespeare
    attnlab train --out runs/shakespeare --resume    # continue after Ctrl-C, a crash or a kill
    torchrun --nproc_per_node=4 -m attnlab train --preset gpt2-small --tokenizer gpt2 --data big.txt
    attnlab train --init-from ./SmolLM2-135M --data notes.txt --lora-rank 8 --merge merged/  # fine-tune
    attnlab train --init-from ./SmolLM2-135M --data chats.jsonl --out runs/chat              # chat fine-tune
    torchrun --nproc_per_node=8 -m attnlab train --fsdp --preset gpt2-xl --tokenizer gpt2 --data big.txt

Exit status: 0 done; 130 / 143 stopped by SIGINT / SIGTERM *after* saving a checkpoint; 2 a user error.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from attnlab.cli.options import add_threads_argument
from attnlab.files import atomic_write_json, current_umask, fsync_dir, safe_write
from attnlab.model import GPTConfig
from attnlab.tokenizers import tokenizer_to_dict
from attnlab.training.allocator import tune_cpu_allocator
from attnlab.training.chat_data import template_from_hf_dir
from attnlab.training.checkpoint import has_checkpoint
from attnlab.training.config import DEFAULT_MAX_TIME, OPTIMIZERS, PLAN_STEPS, PRECISIONS, TINY_LR, TrainConfig
from attnlab.training.finetune import FINETUNE_CONTEXT, FINETUNE_LR, LORA_LR
from attnlab.training.lora import TARGETS, merge_lora
from attnlab.training.trainer import SAMPLE_SETTINGS, Trainer

_D = TrainConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Train a GPT on a text file (default: the Python documentation that ships with CPython, so it\n"
        "runs offline), with a progress bar, DIR/metrics.jsonl and fault-proof checkpoints; then print a\n"
        "short sample. Under torchrun it trains with DistributedDataParallel."
    )
    parser.epilog = (
        "On --resume, settings you do not pass are taken from the checkpoint; the model, tokenizer, data,\n"
        "seed and context length always are. Exit status: 0 done; 130/143 stopped by SIGINT/SIGTERM after\n"
        "saving a checkpoint; 2 user error.\n"
        "Multi-process: torchrun --nproc_per_node=N -m attnlab train ... (--batch-size stays the global batch)."
    )
    # Every default is None so that --resume can tell "given" from "not given"; the real defaults
    # are TrainConfig's and are shown in the help.
    g = parser.add_argument_group("data")
    g.add_argument("--data", metavar="PATH", help="UTF-8 text file to train on (default: the built-in corpus)")
    g.add_argument(
        "--tokenizer",
        metavar="NAME",
        help="byte: the 256 byte values, lossless; char: one id per character of the text; "
        "gpt2: GPT-2's BPE via tiktoken (default: byte)",
    )
    g.add_argument(
        "--bpe-dir", metavar="DIR", help="directory with GPT-2's encoder.json + vocab.bpe (gpt2 tokenizer, offline)"
    )
    g = parser.add_argument_group("model")
    g.add_argument(
        "--preset", metavar="NAME", help=f"model size: {', '.join(GPTConfig.presets())} (default: {_D.preset})"
    )
    g.add_argument(
        "--context-length",
        type=int,
        metavar="T",
        help="tokens per training window and the model's context (default: 64 for tiny, else the preset's)",
    )
    g.add_argument("--dropout", type=float, metavar="P", help="dropout rate (default: the preset's)")
    g = parser.add_argument_group("fine-tuning a pretrained model")
    g.add_argument(
        "--init-from",
        metavar="MODEL",
        help="start from a pretrained model instead of random weights: a Hugging Face directory or name, a GGUF "
        f"file or an attnlab checkpoint; it brings its tokenizer, trains on --context-length windows (default "
        f"{FINETUNE_CONTEXT}, shorter where the text's splits are) with AdamW at lr {FINETUNE_LR:g} "
        f"(LoRA: {LORA_LR:g}). --data FILE.jsonl of "
        '{"messages": [...]} lines fine-tunes on chats (loss on the assistant\'s tokens only)',
    )
    g.add_argument(
        "--lora-rank", type=int, metavar="R", help="LoRA adapters of rank R on a frozen --init-from model (0: none)"
    )
    g.add_argument("--lora-alpha", type=float, metavar="A", help="LoRA's scale is A / R (default: A = 2R)")
    g.add_argument(
        "--lora-targets",
        metavar="LIST",
        help=f"the matrices LoRA adapts in every block, comma-separated among {','.join(TARGETS)} (default: q,k,v,o)",
    )
    g.add_argument(
        "--merge",
        metavar="DIR",
        help="after training, write the model (LoRA adapters merged into its weights) to DIR as a plain "
        "model that --checkpoint/--init-from read",
    )
    g = parser.add_argument_group("optimisation")
    g.add_argument(
        "--batch-size",
        type=int,
        metavar="B",
        help=f"sequences per optimizer step, summed over all processes and micro-steps (default: {_D.batch_size})",
    )
    g.add_argument(
        "--grad-accum",
        type=int,
        metavar="K",
        help=f"split each batch into K micro-batches, accumulating gradients (default: {_D.grad_accum})",
    )
    g.add_argument(
        "--max-steps",
        type=int,
        metavar="N",
        help=f"optimizer steps to train for (default: {_D.max_steps}; a new run from scratch given neither this "
        f"nor --max-time plans them to fit {DEFAULT_MAX_TIME:g} s, see --max-time)",
    )
    g.add_argument(
        "--max-time",
        type=float,
        metavar="SECONDS",
        help=f"plan the run to fit SECONDS of training steps: after {PLAN_STEPS} steps, --max-steps is lowered to "
        "the steps that fit at the measured rate, and the learning rate decays over them (default: none; a new "
        f"run from scratch given neither flag plans for {DEFAULT_MAX_TIME:g} s so that slower CPUs finish in time)",
    )
    g.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        help="adamw: AdamW on every parameter; muon: Muon on the transformer blocks' weight matrices, AdamW on "
        f"embeddings, gains and biases (default: {_D.optimizer}; adamw with --init-from or --fsdp)",
    )
    g.add_argument(
        "--lr",
        type=float,
        help="peak learning rate of AdamW (with --optimizer muon, of the AdamW part: embeddings, gains, biases; "
        f"default: {TINY_LR:g} for tiny; GPT-3's for the gpt2-* widths, 6e-4 for gpt2-small down to 2e-4 "
        "for gpt2-xl)",
    )
    g.add_argument(
        "--muon-lr",
        type=float,
        metavar="LR",
        help=f"peak learning rate of Muon's matrices, with --optimizer muon (default: {_D.muon_lr:g})",
    )
    g.add_argument(
        "--warmup-steps",
        type=int,
        metavar="N",
        help=f"linear warm-up steps before the cosine decay to lr/10 (default: {_D.warmup_steps})",
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        metavar="W",
        help="decoupled weight decay: with adamw on matrices and embeddings, not biases/LayerNorms; with muon on "
        f"Muon's matrices (default: {_D.weight_decay:g})",
    )
    g.add_argument(
        "--grad-clip", type=float, metavar="C", help=f"clip the gradient norm to C; 0 = off (default: {_D.grad_clip:g})"
    )
    g.add_argument("--seed", type=int, help=f"seed of the initial weights, batches and dropout (default: {_D.seed})")
    g = parser.add_argument_group("evaluation, checkpoints and output")
    g.add_argument(
        "--eval-every", type=int, metavar="N", help=f"validation loss every N steps (default: {_D.eval_every})"
    )
    g.add_argument(
        "--eval-batches",
        type=int,
        metavar="N",
        help=f"batches of the validation split per evaluation (default: {_D.eval_batches})",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        metavar="N",
        help=f"save a checkpoint every N steps, and always at the end (default: {_D.checkpoint_every})",
    )
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        metavar="N",
        help=f"step checkpoints kept in DIR (default: {_D.keep_checkpoints})",
    )
    g.add_argument(
        "--out",
        metavar="DIR",
        help=f"directory for checkpoints and metrics.jsonl (default: {_D.out}); "
        "refuses to overwrite an existing checkpoint without --resume",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        default=None,
        help="continue from DIR's latest checkpoint exactly where it stopped (starts fresh if DIR has none)",
    )
    g.add_argument(
        "--sample-tokens",
        type=int,
        metavar="N",
        help=f"tokens of sample text printed after training; 0 = none (default: {_D.sample_tokens})",
    )
    g.add_argument("--sample-prompt", metavar="TEXT", help=f"prompt of that sample (default: {_D.sample_prompt!r})")
    g = parser.add_argument_group("hardware")
    g.add_argument(
        "--device",
        metavar="DEV",
        help="auto (cuda, else mps, else cpu), cpu, cuda, cuda:N or mps (default: auto); "
        "under torchrun each process takes the GPU of its LOCAL_RANK",
    )
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="every compute dtype of a step (the forward's autocast, Muon's Newton-Schulz): bf16, fp32, or "
        "auto = bf16 where the hardware has native bf16 matmuls (CUDA, CPUs with AVX512-BF16/AMX), else fp32 "
        "(default: auto; `attnlab info` says what yours picks)",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the model (faster steps after a slow first one; default: off)",
    )
    add_threads_argument(g)
    g.add_argument(
        "--malloc-tuning",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on Linux with glibc, keep freed memory in the process for the next step instead of mapping it "
        "in again page by page (a few %% faster CPU steps; see attnlab.training.allocator; default: on)",
    )
    g.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None, help="show the progress bar (default: on)"
    )
    g.add_argument(
        "--fsdp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="under torchrun: shard the weights, gradients and optimizer state over the processes (FSDP2) "
        "instead of replicating them (DDP); for models that do not fit one device",
    )


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, set[str]]:
    """The settings given as flags over TrainConfig's defaults, and the names of those given.

    On --resume the Trainer takes every setting not given from the checkpoint (and refuses a given
    one that a resumed run cannot change), exactly as for the Python API.
    """
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    defaults = {}
    if (args.init_from or args.fsdp) and args.optimizer is None:
        defaults["optimizer"] = "adamw"  # fine-tuning, sharding: AdamW (see attnlab.training.finetune, .fsdp)
    return dataclasses.replace(TrainConfig(), **defaults, **given), set(given)


def load_init(name: str, device: Any = None, *, lora: bool = False) -> Any:
    """``--init-from``: an attnlab model (a training directory, a step directory, a GPT.save()
    directory) or else a published one (a Hugging Face directory or name, a GGUF file).

    ``lora``: a GGUF file's matrices stay in its blocks (frozen: LoRA's adapters train beside them);
    without LoRA every weight trains, so the file is dequantized to float32 as it loads."""
    import torch

    from attnlab.tools.loading import is_attnlab_directory, load_model, load_pretrained

    p = Path(name).expanduser()
    if is_attnlab_directory(p):
        loaded = load_model(p, device=device, what="--init-from")
        if not lora:  # (a run on a GGUF base kept its blocks: every weight trains here)
            loaded.model.dequantize_()
    else:
        dtype = None if lora else torch.float32
        loaded = load_pretrained(name, device=device, dtype=dtype, what="--init-from")
    if getattr(loaded, "chat_template", None) is None and loaded.path.is_dir():  # an instruct model's format
        loaded.chat_template = template_from_hf_dir(loaded.path)
    return loaded


def run(args: argparse.Namespace) -> int:
    cfg, given = config_from_args(args)
    cfg.validate()  # (before --init-from is read and --merge's directory made: a bad flag is named first)
    if args.malloc_tuning:
        tune_cpu_allocator()
    merge = Path(args.merge).expanduser() if args.merge else None
    if merge is not None and cfg.fsdp:
        raise ValueError("--merge with --fsdp: the checkpoint's model.safetensors is already the whole model")
    if merge is not None and merge.exists() and (not merge.is_dir() or any(merge.iterdir())):
        raise ValueError(f"--merge {merge} exists and is not an empty directory; choose a new one")
    if merge is not None and merge.resolve() == Path(cfg.out).expanduser().resolve():
        raise ValueError(f"--merge {merge} is the run's --out: choose a directory of its own")
    if merge is not None:  # (before training: a place it cannot be written is found now, not after the run)
        try:
            merge.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--merge {merge}: cannot make its directory {merge.parent} ({e.strerror})") from None
        if not os.access(merge.parent, os.W_OK | os.X_OK):
            raise ValueError(f"--merge {merge}: its directory {merge.parent} is not writable")
    init = None
    if cfg.init_from and not (cfg.resume and has_checkpoint(Path(cfg.out).expanduser())):
        init = load_init(cfg.init_from, lora=bool(cfg.lora_rank))  # a resumed run takes the model from its checkpoint
    trainer = None
    try:
        # Inside the try: Trainer() itself may fail after it started the process group.
        trainer = Trainer(cfg, given=given, init=init)
        result = trainer.fit(sample=False)  # sampled below, after the summary, as it is generated
    finally:
        if trainer is not None:
            trainer.close()  # the group it started, destroyed
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    cfg = trainer.cfg  # with the checkpoint's settings on --resume
    if result.interrupted:
        return 128 + int(result.interrupted)
    if not trainer.dist.is_main:
        return 0
    if merge is not None:
        _merge(trainer, merge)
    vl = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a"
    kind = {"byte": "byte", "char": "character", "gpt2": "GPT-2 token"}.get(trainer.tokenizer.name, "token")
    unit = f"nats/{kind}"  # (a model's own tokenizer, "hf": its tokens)
    print(f"done: {result.step} steps, validation loss {vl} {unit}; checkpoint {result.checkpoint}", file=sys.stderr)
    prompt = trainer.sample_prompt(cfg.sample_prompt)
    if cfg.sample_tokens > 0 and not cfg.fsdp:  # a sharded model generates only with every process
        _print_sample(trainer, prompt)
    print(f"generate more: attnlab generate --checkpoint {result.out} --prompt {prompt!r}", file=sys.stderr)
    return 0


def _merge(trainer: Trainer, out: Path) -> None:
    """``--merge DIR``: the trained model as GPT.save() + tokenizer.json (adapters merged in)."""
    from attnlab.tools.loading import CHAT_NAME, TOKENIZER_NAME

    model = merge_lora(trainer.raw_model)  # in place: training is over
    # Assembled beside DIR and renamed into place whole: a stop half-way leaves no DIR that lacks a file.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        os.chmod(tmp, 0o777 & ~current_umask())  # (what mkdir would give, not mkdtemp's 0o700)
        model.save(tmp)
        # a Hugging Face tokenizer's JSON is copied beside it (hf_tokenizer.json): the directory stands alone
        atomic_write_json(tmp / TOKENIZER_NAME, tokenizer_to_dict(trainer.tokenizer, tmp))
        chat = trainer.chat_metadata()  # an instruct model's chat template and stop ids: attnlab chat --checkpoint
        if chat:
            atomic_write_json(tmp / CHAT_NAME, chat)
        os.replace(tmp, out)  # (over an empty DIR too)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(out.parent)
    print(f"merged model written to {out} (read it with --checkpoint {out} or --init-from {out})", file=sys.stderr)


def _print_sample(trainer: Trainer, prompt: str) -> None:
    """Stream the trainer's sample of ``prompt`` to stdout, framed on stderr."""
    cfg, s = trainer.cfg, SAMPLE_SETTINGS
    if prompt != cfg.sample_prompt:
        print(f"(the tokenizer cannot encode the prompt {cfg.sample_prompt!r}; using {prompt!r})", file=sys.stderr)
    what = f"{cfg.sample_tokens} tokens, temperature {s.temperature:g}, top-k {s.top_k}"
    print(f"--- sample ({what}) ---", file=sys.stderr, flush=True)

    def show(text: str) -> None:  # an ASCII-only terminal gets escapes, not an exception
        safe_write(sys.stdout, text)
        sys.stdout.flush()

    show(prompt)
    trainer.sample(prompt, cfg.sample_tokens, s, on_text=show)
    show("\n")
    print("---", file=sys.stderr)
