"""What Muon's Newton-Schulz costs in each dtype, against the step it belongs to (issue: the main job on
CPUs without native bf16).

One training step of the ``tiny`` preset at ``attnlab train``'s batch (32 x 64 tokens): forward +
backward, then MuonAdamW's optimizer step with Newton-Schulz in float32 and in bfloat16, and the
same iterations batched by shape (one ``baddbmm`` per shape instead of one matmul per matrix),
interleaved, medians. On a CPU without native bf16 (or one told to behave as one:
``ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2``) the bf16 row is
the emulated path the old default took.

    python benchmarks/newton_schulz.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnlab import hardware
from attnlab.model import GPT, GPTConfig
from attnlab.training.optim import NS_COEFFICIENTS, MuonAdamW, muon_param_groups


def batched_newton_schulz(G: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Newton-Schulz on a stack of matrices of one shape ``(n, rows, cols)``, rows <= cols."""
    a, b, c = NS_COEFFICIENTS
    X = G / G.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        A = X @ X.mT  # (n, rows, rows)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(hardware.header("cpu"), flush=True)
    model = GPT(GPTConfig.preset("tiny"))
    x = torch.randint(0, 256, (32, 64))  # (B, T)
    groups = muon_param_groups(model, lr=1e-3, muon_lr=0.02, weight_decay=0.1)
    opts = {str(dt).removeprefix("torch."): MuonAdamW(groups, ns_dtype=dt) for dt in (torch.float32, torch.bfloat16)}
    mats = [p.detach() for p in groups[0]["params"]]
    by_shape: dict[tuple[int, int], list[torch.Tensor]] = {}
    for m in mats:
        m = m.T if m.shape[0] > m.shape[1] else m  # the smaller Gram side, as newton_schulz does
        by_shape.setdefault(tuple(m.shape), []).append(m)

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        model.loss(x, x).backward()

    runs = {"forward + backward": forward_backward}
    runs |= {f"optimizer step, Newton-Schulz {name}": opt.step for name, opt in opts.items()}
    runs["Newton-Schulz float32, batched by shape"] = lambda: [
        batched_newton_schulz(torch.stack(ms)) for ms in by_shape.values()
    ]
    runs["Newton-Schulz float32, one matrix at a time"] = lambda: [
        batched_newton_schulz(m[None]) for ms in by_shape.values() for m in ms
    ]
    forward_backward()
    for fn in runs.values():
        fn()  # warm-up (and the optimizers' state)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        print(f"{name:45s} {statistics.median(ts) * 1e3:9.1f} ms")


if __name__ == "__main__":
    main()
