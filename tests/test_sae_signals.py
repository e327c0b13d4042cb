"""``attnlab sae train`` stopped by SIGTERM / SIGINT while its first buffer fills (minutes of model
forwards on a big buffer): it stops at once, quietly (one line), with the trainer's exit status."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from attnlab.training.rundir import LOCK_NAME


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_first_fill_stops_at_once(tmp_path, smollm2_gguf, subprocess_env, sig):
    out = tmp_path / "run"
    flags = ["--hook", "blocks.15.hook_resid_post", "--width", "1152", "--k", "16", "--no-progress"]
    flags += ["--buffer-rows", "65536", "--out", str(out)]  # a fill of ~500 windows: minutes on one thread
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnlab", "sae", "train", "--model", str(smollm2_gguf), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env,
    )
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and not (out / LOCK_NAME).exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # the run directory is locked just before the fill begins
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(1.0)  # well into the model's forwards
        sent = time.monotonic()
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
        waited = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + sig, stderr
    assert waited < 10, f"took {waited:.1f}s to stop"
    assert stdout == "stopped before the first step: nothing to save\n" and stderr == ""
    assert not (out / "checkpoints").exists()
