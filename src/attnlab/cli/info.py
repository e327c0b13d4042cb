"""``attnlab info``: versions, devices and which fused attention kernels torch offers here;
``attnlab info --model`` (``--preset``): the model's name, parameters, shapes and switches;
``attnlab info --kv-memory``: the KV cache of a model's shapes, MHA vs GQA vs a sliding window.

    attnlab info
    attnlab info --model SmolLM2-135M-Instruct.Q4_1.gguf
    attnlab info --kv-memory --preset llama3-8b --context 32768 --batch 1 --dtype bf16
    attnlab info --kv-memory --model meta-llama/Llama-3.2-1B --context 131072
"""

from __future__ import annotations

import argparse
import platform

import torch

from attnlab import hardware
from attnlab.cli.options import positive_int
from attnlab.model import GPTConfig
from attnlab.tools.info import (
    DTYPE_BYTES,
    available_sdpa_kernels,
    config_of,
    describe_model,
    format_kv_memory,
    kv_memory_rows,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("a model (alone: its name, parameters, shapes and switches)")
    source = model.add_mutually_exclusive_group()
    source.add_argument("--preset", metavar="NAME", help="a GPTConfig preset (e.g. gpt2-small, llama3-8b, mistral-7b)")
    source.add_argument(
        "--model",
        metavar="PATH_OR_REPO",
        help="a GGUF file, a model directory (attnlab's or Hugging Face's config.json, a training run) or a Hub "
        "repository",
    )
    g = parser.add_argument_group("KV-cache memory")
    g.add_argument(
        "--kv-memory",
        action="store_true",
        help="print the KV cache of a model's shapes for MHA, GQA and a sliding window, per layer and total",
    )
    g.add_argument(
        "--context", type=positive_int, metavar="N", help="tokens per sequence (default: the context length)"
    )
    g.add_argument("--batch", type=positive_int, metavar="B", help="sequences (default 1)")
    g.add_argument("--dtype", choices=list(DTYPE_BYTES), help="of the cached numbers (default bf16)")
    g.add_argument(
        "--kv-heads",
        type=positive_int,
        metavar="N",
        help="key/value heads of the GQA line (default: the model's, or groups of 4 query heads)",
    )
    g.add_argument(
        "--window", type=positive_int, metavar="W", help="window of the window lines (default: the model's, or 4096)"
    )


def run(args: argparse.Namespace) -> int:
    if args.kv_memory:
        return _kv_memory(args)
    if any(v is not None for v in (args.context, args.kv_heads, args.window, args.batch, args.dtype)):
        raise ValueError("--context, --kv-heads, --window, --batch and --dtype go with --kv-memory")
    if args.preset or args.model:
        print(describe_model(args.model, preset=args.preset))
        return 0
    from attnlab import __version__

    print(f"attnlab {__version__}, torch {torch.__version__}, Python {platform.python_version()}")
    print(f"CPU threads: {torch.get_num_threads()}")
    cuda = torch.cuda.is_available()
    mps = torch.backends.mps.is_available()
    print(f"CUDA: {cuda}" + (f" ({torch.cuda.get_device_name()})" if cuda else ""))
    print(f"MPS: {mps}")
    devices = [device for device, present in (("cpu", True), ("cuda", cuda), ("mps", mps)) if present]
    for device in devices:
        hw = hardware.describe(device)
        print(
            f"{device}: {hw.name}, {hw.capability}, native bf16: {'yes' if hw.bf16_native else 'no'} -> automatic "
            f"choices: training --precision auto = {_name(hardware.training_dtype('auto', device))} (autocast and "
            f"Muon's Newton-Schulz), bf16 weights run in {_name(hardware.inference_dtype(device, torch.bfloat16))}"
        )
    for device in devices:
        for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
            kernels = available_sdpa_kernels(device, dtype)
            print(f"SDPA kernels on {device} ({_name(dtype)}): {', '.join(kernels) or 'none'}")
    return 0


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kv_memory(args: argparse.Namespace) -> int:
    if not (args.preset or args.model):
        raise ValueError("--kv-memory needs --preset NAME or --model PATH_OR_REPO")
    config, name, _ = config_of(args.model) if args.model else (GPTConfig.preset(args.preset), args.preset, None)
    batch, dtype = args.batch or 1, args.dtype or "bf16"
    rows = kv_memory_rows(
        config, context=args.context, batch=batch, dtype=dtype, kv_heads=args.kv_heads, window=args.window
    )
    print(format_kv_memory(name, config, rows, batch=batch, dtype=dtype))
    return 0
