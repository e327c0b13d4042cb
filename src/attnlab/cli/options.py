"""Options shared by the commands that read a model and a prompt (``attnlab viz``, ``attnlab inspect``)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from attnlab.tools.loading import LoadedModel


def check_out_file(value: str | None, suffixes: tuple[str, ...]) -> None:
    """``--out FILE``: one of ``suffixes`` in a directory this process can write to, or a ValueError,
    known before any work (the file is written when the work is done)."""
    if value is None:
        return
    if Path(value).suffix.lower() not in suffixes:  # ("" has none: refused, not taken for "no file")
        raise ValueError(f"--out must end in one of {', '.join(suffixes)}; got {value!r}")
    folder = Path(value).expanduser().parent
    if Path(value).expanduser().is_dir():
        raise ValueError(f"--out {value} is a directory: name a file in it")
    if not folder.is_dir():
        raise ValueError(f"--out {value}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"--out {value}: the directory {folder} is not writable by this process")


def index_list(text: str) -> list[int]:
    """``--layer 0,2``: a comma-separated list of indices."""
    try:
        out = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an index or a comma-separated list like 0,2, got {text!r}"
        ) from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one index")
    return out


def positive_int(text: str) -> int:
    """argparse type of counts and sizes (``attnlab bench``, ``attnlab info``, the benchmark scripts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def at_most(limit: int, least: int = 1) -> Any:
    """argparse type of a count from ``least`` to ``limit`` (past it: an overflow in torch, an
    allocation no machine has, or a loop that never ends)."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer from {least} to {limit:,}, got {text!r}") from None
        if not least <= value <= limit:
            raise argparse.ArgumentTypeError(f"expected an integer from {least} to {limit:,}, got {value}")
        return value

    return count


MAX_THREADS = 1024


def seed(text: str) -> int:
    """argparse type of seeds: what torch's generators take, 0 to 2**64 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not 0 <= value < 1 << 64:
        raise argparse.ArgumentTypeError(f"expected a seed from 0 to 2**64 - 1, got {value}")
    return value


# What --model reads (generate, chat, inspect, viz, serve): one line for every command's help.
MODEL_SOURCES = (
    "a GGUF file (llama.cpp: llama, qwen2, qwen3, gemma, gemma2, gemma3, phi3, olmo2, gptneox), or a Hugging Face "
    "directory or Hub id (cached) of GPT-2, Llama, Mistral, Qwen2/2.5/3, Gemma 1/2/3, Phi-3, OLMo 2/3 or GPT-NeoX"
)


def add_model_arguments(parser: argparse.ArgumentParser, *, what: str) -> Any:
    """``--checkpoint DIR | --model NAME``, ``--prompt``, ``--bpe-dir``, ``--device``; returns the
    group of the model's sources (a command may add one, as serve's ``--demo``)."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="an attnlab model: a directory written by `attnlab train --out` (or one of its step directories), "
        'or by GPT.save() plus a tokenizer.json (the tokenizer\'s to_dict() as JSON, e.g. {"name": "byte"})',
    )
    source.add_argument(
        "--model",
        metavar="NAME",
        help=f"gpt2, gpt2-medium, gpt2-large, gpt2-xl (downloaded once when online), {MODEL_SOURCES}",
    )
    parser.add_argument("--prompt", metavar="TEXT", help=f"the text {what}")
    parser.add_argument(
        "--bpe-dir",
        metavar="DIR",
        help="where GPT-2's encoder.json and vocab.bpe are (default: the model's directory, "
        "$ATTNLAB_GPT2_BPE_DIR, or tiktoken's cache)",
    )
    parser.add_argument("--device", default="cpu", metavar="DEV", help="cpu, cuda, mps or auto (default: cpu)")
    add_dtype_argument(parser)
    return source


DTYPE_NAMES = ("float32", "bfloat16", "float16")


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: torch's threads for the command (:func:`attnlab.cli.main` sets them around it)."""
    parser.add_argument(
        "--threads",
        type=at_most(MAX_THREADS),
        default=None,
        metavar="N",
        help="torch threads (default: torch's, one per core; on a busy machine with few cores, fewer are "
        "often several times faster)",
    )


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype``: the dtype ``--model``'s weights are read in (:func:`model_dtype`)."""
    parser.add_argument(
        "--dtype",
        choices=DTYPE_NAMES,
        default=None,
        help="with --model: the weights' dtype; float32 makes a GGUF file's quantized matrices dense (default: a GGUF "
        "file's matrices stay in its blocks; other models: their own half precision where the device has it "
        "natively, else float32; `attnlab info` says which)",
    )


def model_dtype(args: argparse.Namespace) -> torch.dtype | None:
    """``--dtype`` as a torch dtype, None where not given."""
    import torch

    return None if args.dtype is None else getattr(torch, args.dtype)


def load_from_model_arguments(args: argparse.Namespace) -> LoadedModel:
    """The model :func:`add_model_arguments`' flags name: ``--checkpoint`` or ``--model`` (in ``--dtype``),
    on ``--device``."""
    from attnlab.checks import resolve_device
    from attnlab.tools.loading import load

    device = resolve_device(args.device)
    return load(args.checkpoint, args.model, device=device, bpe_dir=args.bpe_dir, dtype=model_dtype(args))


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    """``--temperature``, ``--top-k``, ``--top-p``, ``--seed``: as ``attnlab generate``."""
    parser.add_argument(
        "--temperature", type=float, default=1.0, metavar="T", help="softmax temperature; 0 = greedy (default: 1)"
    )
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K likeliest tokens")
    parser.add_argument(
        "--top-p", type=float, default=None, metavar="P", help="nucleus sampling: the likeliest tokens up to P"
    )
    parser.add_argument("--seed", type=seed, default=0, metavar="S", help="seed for sampling (default: 0)")


def check_sampling(args: argparse.Namespace) -> None:
    if not args.temperature >= 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")


COMPILE_UP_FRONT_TOKENS = 32  # (a small model's products switch to compiled ones within about that many)


def compile_quantized_up_front(model: Any, tokens: int | None) -> None:
    """Where a model kept in a GGUF file's blocks will generate ``tokens`` tokens (None: a chat, many),
    its products compile now, with a note: the seconds that takes come before the first token, not as a
    silent stall in the middle of the output when the process's clock says compiling pays
    (:data:`attnlab.quantized.COMPILE_AFTER_S`). Fewer tokens keep the eager products."""
    import sys

    from attnlab.quantized import compile_from_now, is_quantized

    if tokens is not None and tokens < COMPILE_UP_FRONT_TOKENS:
        return
    if any(is_quantized(p) and p.device.type == "cpu" for p in model.parameters()):
        print("compiling the products of the file's quantized weights (once; a few seconds)", file=sys.stderr)
        compile_from_now()
