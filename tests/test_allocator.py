"""attnlab.training.allocator: glibc keeps freed memory after tuning, counted in page faults (not time)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from attnlab.training.allocator import tune_cpu_allocator

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# Allocates, fills and frees a 64 MiB tensor 16 times; prints the minor page faults of the last
# eight rounds per 4 KiB page of the tensor and round (about 1.0: mapped in afresh every time;
# about 0: memory reused). The first rounds are left out: glibc grows its heap by a few blocks
# (faulting them in) before it settles on reusing freed ones.
_PROBE = textwrap.dedent(
    """
    import resource, sys
    import torch
    from attnlab.training.allocator import tune_cpu_allocator
    if sys.argv[1] == "tuned":
        result = tune_cpu_allocator()
        assert result.applied, result.reason
    n = 16 << 20  # float32 elements: 64 MiB
    for _ in range(8):
        torch.empty(n).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        torch.empty(n).fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(faults / (8 * n * 4 / 4096))
    """
)


def _faults_per_page(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "ATTNLAB_MALLOC"))}
    env.pop("GLIBC_TUNABLES", None)
    env.pop("LD_PRELOAD", None)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not GLIBC, reason="the tuning applies to Linux with glibc only")
@pytest.mark.slow
def test_tuned_glibc_reuses_freed_memory_instead_of_faulting_it_in_again():
    untuned = _faults_per_page("default")
    # The control shows the probe can tell: by default each round maps 64 MiB in afresh.
    assert untuned > 0.9, untuned
    # Outside reclaim (the kernel's DAMON, a loaded host) can only add faults, never remove them,
    # so the best of up to three probes is what the tuning itself does.
    tuned = []
    while len(tuned) < 3 and (not tuned or min(tuned) >= 0.2):
        tuned.append(_faults_per_page("tuned"))
    assert min(tuned) < 0.2, tuned  # at most one of the eight rounds faulted in


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"ATTNLAB_MALLOC_TUNING": "0"}, "ATTNLAB_MALLOC_TUNING"),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc"),
        ({"MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX"),
        ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES"),
    ],
)
def test_a_choice_already_made_in_the_environment_is_respected(monkeypatch, env, reason):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = tune_cpu_allocator()
    assert not result.applied
    assert reason in result.reason


@pytest.mark.parametrize("name", ["mmap_threshold", "trim_threshold"])
@pytest.mark.parametrize("value", [0, -1, 2**31, 1.5, True, np.True_, np.int64(2**31)])
def test_bad_thresholds_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        tune_cpu_allocator(**{name: value})
