"""``attnlab info``: the kernels it lists are the ones that run."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnlab.cli import main
from attnlab.tools.info import available_sdpa_kernels


def test_listed_kernels_run_and_unlisted_ones_do_not():
    listed = available_sdpa_kernels("cpu", torch.float32)
    assert "math" in listed  # the reference kernel runs everywhere
    q = torch.randn(1, 2, 8, 64)
    for name, backend in SDPBackend.__members__.items():
        if name == "ERROR":
            continue
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, q, q, is_causal=True)
            ran = True
        except RuntimeError:
            ran = False
        assert ran == (name.lower() in listed), name


def test_info_prints_versions_and_kernels(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out
    assert "SDPA kernels on cpu (float32): " + ", ".join(available_sdpa_kernels("cpu", torch.float32)) in out
