"""A kernel of attnlab's own: a few float32 rows times a weight streamed from memory, on Intel CPUs.

Decoding a batch of 2-8 rows multiplies them by every weight of the model once per step. oneDNN and MKL
read a weight at some 16.5-18.5 GB/s there, where a plain sum over it reads 22.5 (an Intel Xeon with AMX,
2 threads, SmolLM2's 120 products a step at 8 rows); ``csrc/rows_linear.cpp`` reads it at 21.7, with a
software prefetch ahead of its one sequential stream per thread (see the file). Its products are float32
sums, as oneDNN's, in another order.

It is C++ built on first use by ``torch.utils.cpp_extension`` (some 10 s, then cached on disk), for CPUs
where it was measured faster: Intel's with AVX-512. Where the build fails (no compiler) or the CPU is
another, :func:`available` says no and decoding keeps oneDNN.
"""

from __future__ import annotations

import functools
import logging
import pathlib

import torch
from torch import Tensor

from attnlab import hardware

__all__ = ["available", "pack_panels", "panel_width", "rows_linear"]

_LOG = logging.getLogger(__name__)
_SOURCE = pathlib.Path(__file__).parent / "csrc" / "rows_linear.cpp"


def panel_width(weight: Tensor) -> int:
    """The panel width the kernel takes ``weight (N, K)`` in: 48 output columns where ``N`` divides by 48,
    else 32 where it divides by 32, else 0 (not packable)."""
    n = weight.shape[0]
    return 48 if n % 48 == 0 else 32 if n % 32 == 0 else 0


def pack_panels(weight: Tensor) -> Tensor:
    """``weight (N, K)`` float32 as the kernel reads it: panels ``(N / w, K, w)`` of ``w``
    (:func:`panel_width`) output columns each, one contiguous stream per panel. A copy, made when a
    generation starts (as the oneDNN packing it replaces: the parameters stay as they are)."""
    w = panel_width(weight)
    if weight.dim() != 2 or weight.dtype != torch.float32 or not w:
        got = f"{weight.dtype} {tuple(weight.shape)}"
        raise ValueError(f"weight must be a float32 (N, K) matrix with N a multiple of 32, got {got}")
    N, K = weight.shape
    return weight.detach().view(N // w, w, K).transpose(1, 2).contiguous()  # (N / w, K, w)


def rows_linear(x: Tensor, panels: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x (..., K) @ W.T + bias`` for ``W`` packed by :func:`pack_panels`: ``(..., N)``, float32, CPU,
    up to 8 rows a pass over the weight. Only where :func:`available`."""
    return torch.ops.attnlab_kernels.rows_linear(x, panels, bias)


def available() -> bool:
    """Whether :func:`rows_linear` runs here: an Intel CPU with AVX-512 (where it was measured), and the
    kernel built (on the first call)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512" or hardware.cpu_vendor() != "GenuineIntel":
        return False
    return _built()


@functools.cache
def _built() -> bool:
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(
            "attnlab_kernels",
            [str(_SOURCE)],
            extra_cflags=["-O3", "-mavx512f", "-mfma", "-fopenmp"],  # (-fopenmp: at::parallel_for threads by OpenMP)
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # (no compiler, no ninja, a header missing: oneDNN's kernels then)
        _LOG.info("attnlab's rows_linear kernel did not build (%s); decoding keeps oneDNN's kernels", e)
        return False

    @torch.library.register_fake("attnlab_kernels::rows_linear")
    def _(x: Tensor, panels: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty((*x.shape[:-1], panels.shape[0] * panels.shape[2]))

    return True
