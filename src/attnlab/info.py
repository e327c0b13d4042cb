"""``attnlab info``: versions, devices and which fused attention kernels torch offers here."""

from __future__ import annotations

import argparse
import platform
import warnings

import torch
import torch.nn.functional as F


def add_arguments(parser: argparse.ArgumentParser) -> None:
    del parser  # no options


def available_sdpa_kernels(device: torch.device | str, dtype: torch.dtype) -> list[str]:
    """The ``F.scaled_dot_product_attention`` backends that run here for a small causal call.

    Whether a kernel is *enabled* (``torch.backends.cuda.flash_sdp_enabled()``) says nothing about
    whether this build, device and dtype support it; so each backend is simply tried, alone, on a
    ``(1, 2, 8, 64)`` input.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 8, 64, device=device, dtype=dtype)  # (B, H, T, hd)
    found = []
    for name, backend in SDPBackend.__members__.items():  # a pybind11 enum: not iterable itself
        if name == "ERROR":
            continue
        try:
            with warnings.catch_warnings(), sdpa_kernel(backend):
                warnings.simplefilter("ignore")  # torch warns why each refused kernel cannot run
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
        except RuntimeError:
            continue
        found.append(name.lower())
    return found


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
