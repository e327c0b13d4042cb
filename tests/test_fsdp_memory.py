"""The memory estimate says when a run needs FSDP, and over how many devices."""

from __future__ import annotations

import re

from attnlab.cli import main
from attnlab.model import GPTConfig
from attnlab.training.memory import GiB, estimate_training_memory, fsdp_processes_needed


def test_a_run_whose_weights_do_not_fit_is_told_how_many_devices_fsdp_needs(tmp_path, monkeypatch, capsys) -> None:
    import attnlab.training.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod, "available_memory", lambda device: 12 << 30)  # a 12 GiB device
    args = ["train", "--out", str(tmp_path / "xl"), "--preset", "gpt2-xl", "--batch-size", "1",
            "--context-length", "128", "--device", "cpu", "--precision", "fp32", "--no-malloc-tuning"]  # fmt: skip
    assert main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    n = int(re.search(r"torchrun --nproc_per_node=(\d+) -m attnlab train --fsdp", line).group(1))
    config = GPTConfig.preset("gpt2-xl", vocab_size=256, context_length=128)
    # n is the fewest (power of two) processes whose shards fit: 1.5B parameters x 16 bytes > 12 GiB.
    assert estimate_training_memory(config, 1, shards=n).total <= 12 * GiB
    assert estimate_training_memory(config, 1, shards=n // 2).total > 12 * GiB
    assert n == fsdp_processes_needed(config, 1, 12 * GiB) > 1


def test_activations_too_large_for_any_sharding_get_no_fsdp_advice() -> None:
    config = GPTConfig.preset("tiny", vocab_size=256)
    assert fsdp_processes_needed(config, 10**7, 1 * GiB) is None
    assert fsdp_processes_needed(config, 1, 1 * GiB) == 1
