"""``attnlab info``: versions, devices and which fused attention kernels torch offers here."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F


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
