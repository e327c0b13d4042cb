"""``attnlab info``: the kernels it lists are the ones that run, and they compute attention.

``available_sdpa_kernels`` is checked against ``F.scaled_dot_product_attention`` itself: each
listed backend, forced with ``sdpa_kernel``, must compute causal attention equal to explicit
float64 loops (on other inputs than the probe's), and each backend it leaves out must refuse.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnlab import causal_mask
from attnlab.cli import main
from attnlab.tools.info import available_sdpa_kernels

# The devices the probe can be checked on here; (device, dtype, tolerance against float64).
CASES = [("cpu", torch.float32, 1e-5)]
if torch.cuda.is_available():
    CASES += [("cuda", torch.float32, 1e-3), ("cuda", torch.bfloat16, 2e-2)]  # float32 may use TF32


@pytest.mark.parametrize(("device", "dtype", "tol"), CASES)
def test_listed_kernels_compute_causal_attention(device, dtype, tol, ref):
    listed = available_sdpa_kernels(device, dtype)
    assert "math" in listed  # the reference kernel runs everywhere
    assert len(set(listed)) == len(listed) and set(listed) <= {n.lower() for n in SDPBackend.__members__}
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 5, 64, generator=g) for _ in range(3))  # (B, H, T, hd)
    want, _ = ref.loop_attention_nd(q, k, v, allowed=causal_mask(5))
    for name in listed:
        with sdpa_kernel(SDPBackend.__members__[name.upper()]):
            got = F.scaled_dot_product_attention(*(t.to(device, dtype) for t in (q, k, v)), is_causal=True)
        torch.testing.assert_close(got.double().cpu(), want, atol=tol, rtol=tol, msg=f"{name} on {device}")


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch says why each refused kernel cannot run
@pytest.mark.parametrize(("device", "dtype", "tol"), CASES)
def test_unlisted_kernels_refuse(device, dtype, tol):
    del tol
    listed = available_sdpa_kernels(device, dtype)
    q = torch.randn(1, 2, 8, 64, device=device, dtype=dtype)
    unlisted = [b for name, b in SDPBackend.__members__.items() if name != "ERROR" and name.lower() not in listed]
    for backend in unlisted:
        with pytest.raises(RuntimeError), sdpa_kernel(backend):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_info_prints_versions_and_kernels(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out
    assert "SDPA kernels on cpu (float32): " + ", ".join(available_sdpa_kernels("cpu", torch.float32)) in out
