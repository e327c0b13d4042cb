"""``attnlab info``: versions, devices and which fused attention kernels torch offers here."""

from __future__ import annotations

import argparse
import platform

import torch

from attnlab.tools.info import available_sdpa_kernels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def run(args: argparse.Namespace) -> int:
    from attnlab import __version__

    print(f"attnlab {__version__}, torch {torch.__version__}, Python {platform.python_version()}")
    print(f"CPU threads: {torch.get_num_threads()}")
    print(
        f"CUDA: {torch.cuda.is_available()}"
        + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else "")
    )
    mps = getattr(torch.backends, "mps", None)
    print(f"MPS: {bool(mps and mps.is_available())}")
    devices = [("cpu", torch.float32)]
    if torch.cuda.is_available():
        devices += [("cuda", torch.float32), ("cuda", torch.bfloat16)]
    if mps and mps.is_available():
        devices += [("mps", torch.float32)]
    for device, dtype in devices:
        kernels = available_sdpa_kernels(device, dtype)
        print(f"SDPA kernels on {device} ({str(dtype).removeprefix('torch.')}): {', '.join(kernels) or 'none'}")
    return 0
