"""``attnlab info``: versions, devices and which fused attention kernels torch offers here."""

from __future__ import annotations

import argparse
import platform

import torch


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
    if torch.cuda.is_available():
        b = torch.backends.cuda
        kernels = f"flash={b.flash_sdp_enabled()} mem_efficient={b.mem_efficient_sdp_enabled()}"
        print(f"SDPA kernels: {kernels} math={b.math_sdp_enabled()}")
    return 0
