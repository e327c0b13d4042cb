"""attnlab.hardware, the one answer to "is this dtype fast on this device?", and the automatic
choices that follow it: every op of a training step recorded in its dtype (a TorchDispatchMode)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from aten_ops import AtenOps
from attnlab import hardware
from attnlab.training import TrainConfig, Trainer

SMALL = dict(context_length=16, batch_size=4, eval_batches=1, sample_tokens=0, progress=False, device="cpu")


class _Dtypes(TorchDispatchMode):
    """Every dtype an op takes or makes, with the first op that made each (for the message)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[torch.dtype, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs, out))
        for t in flat:
            if isinstance(t, torch.Tensor):
                self.seen.setdefault(t.dtype, str(func))
        return out


def _native(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    monkeypatch.setattr(hardware, "bf16_native", lambda device="cpu": native)


def _dtypes_of_a_step(tmp_path: Path, **settings) -> dict[torch.dtype, str]:
    trainer = Trainer(TrainConfig(out=str(tmp_path), max_steps=2, warmup_steps=0, **SMALL, **settings))
    trainer._train_step()  # the first step: the optimizer's state is made here
    with _Dtypes() as mode:
        trainer._train_step()  # forward, backward, clipping, the optimizer (Newton-Schulz for Muon)
    trainer.close()
    return mode.seen


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_precision_fp32_makes_no_bfloat16_tensor_in_a_step(tmp_path: Path, optimizer: str, monkeypatch) -> None:
    _native(monkeypatch, True)  # even where bf16 would be native and fast
    seen = _dtypes_of_a_step(tmp_path, optimizer=optimizer, precision="fp32")
    assert torch.float32 in seen and torch.bfloat16 not in seen, seen.get(torch.bfloat16)


@pytest.mark.slow
def test_auto_is_float32_throughout_without_native_bf16_and_bf16_with_it(tmp_path: Path, monkeypatch) -> None:
    """The same run: no bfloat16 op when the hardware says it has none; with native bf16 both the
    forward (autocast) and Muon's Newton-Schulz run in bf16 (so the recording can fail)."""
    _native(monkeypatch, False)
    seen = _dtypes_of_a_step(tmp_path / "avx2", optimizer="muon", precision="auto")
    assert torch.bfloat16 not in seen, seen.get(torch.bfloat16)
    _native(monkeypatch, True)
    trainer = Trainer(TrainConfig(out=str(tmp_path / "amx"), max_steps=1, optimizer="muon", **SMALL))
    assert trainer.optimizer.ns_dtype == torch.bfloat16 and trainer.autocast().fast_dtype == torch.bfloat16
    trainer.close()
    assert torch.bfloat16 in _dtypes_of_a_step(tmp_path / "native", optimizer="muon", precision="auto")


@pytest.mark.slow
def test_the_first_line_names_the_recipe_and_why(tmp_path: Path, monkeypatch) -> None:
    lines: list[str] = []
    _native(monkeypatch, False)
    Trainer(TrainConfig(out=str(tmp_path / "a"), max_steps=1, **SMALL), log=lines.append).fit(sample=False)
    assert lines[0] == (
        f"recipe: Muon (blocks' matrices) + AdamW, float32: this CPU has no native bf16 "
        f"({torch.backends.cpu.get_cpu_capability()})"
    )
    _native(monkeypatch, True)
    lines.clear()
    Trainer(TrainConfig(out=str(tmp_path / "b"), max_steps=1, **SMALL), log=lines.append).fit(sample=False)
    assert lines[0].startswith("recipe: Muon (blocks' matrices) + AdamW, bf16 autocast and bf16 Newton-Schulz: ")
    assert lines[0].endswith(f"has native bf16 ({hardware.cpu_capability()})")
    lines.clear()
    cfg = TrainConfig(out=str(tmp_path / "c"), max_steps=1, optimizer="adamw", precision="fp32", **SMALL)
    Trainer(cfg, log=lines.append).fit(sample=False)
    assert lines[0] == "recipe: AdamW, float32: --precision fp32"
    # bf16 asked for where it is emulated: said (it ran 20x slower per step, and nothing told why)
    _native(monkeypatch, False)
    trainer = Trainer(TrainConfig(out=str(tmp_path / "d"), max_steps=1, precision="bf16", **SMALL))
    assert trainer.recipe() == (
        "Muon (blocks' matrices) + AdamW, bf16 autocast and bf16 Newton-Schulz: --precision bf16 (this device has "
        "no native bf16: emulated, often 10-20x slower than fp32; auto picks fp32 here)"
    )
    trainer.close()


def test_training_dtype_follows_precision_and_the_hardware(monkeypatch) -> None:
    for native in (False, True):
        _native(monkeypatch, native)
        assert hardware.training_dtype("fp32", "cpu") == torch.float32
        assert hardware.training_dtype("bf16", "cpu") == torch.bfloat16
        assert hardware.training_dtype("auto", "cpu") == hardware.fast_dtype("cpu")
        assert hardware.fast_dtype("cpu") == (torch.bfloat16 if native else torch.float32)
    with pytest.raises(ValueError, match="precision must be one of auto, fp32, bf16, got 'fp8'"):
        hardware.training_dtype("fp8", "cpu")


def test_inference_dtype_keeps_half_precision_only_where_it_is_native(monkeypatch) -> None:
    _native(monkeypatch, False)
    assert hardware.inference_dtype("cpu", torch.bfloat16) == torch.float32
    assert hardware.inference_dtype("cpu", torch.float16) == torch.float32
    assert hardware.inference_dtype("cpu", torch.float32) == torch.float32
    assert hardware.inference_dtype("cpu", torch.float64) == torch.float64
    _native(monkeypatch, True)
    assert hardware.inference_dtype("cpu", torch.bfloat16) == torch.bfloat16
    assert hardware.inference_dtype("cpu", torch.float16) == torch.float32  # no native fp16 matmul on CPUs


def test_describe_reports_what_the_kernels_see() -> None:
    """The capability is ATen's own (refined only where oneDNN also reports native bf16), and the
    bf16 answer is oneDNN's."""
    hw = hardware.describe("cpu")
    aten = torch.backends.cpu.get_cpu_capability()
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert hw.device == "cpu" and hw.bf16_native == native and hw.name
    assert hw.capability == aten or (native and aten == "AVX512" and hw.capability in ("AMX", "AVX512-BF16"))
    assert hw.why == f"this CPU {'has' if native else 'has no'} native bf16 ({hw.capability})"


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="AVX2 is an x86 CPU class")
def test_a_cpu_told_to_behave_as_avx2_says_it_has_no_native_bf16(subprocess_env) -> None:
    """oneDNN honours ONEDNN_MAX_CPU_ISA: the machine then answers as an AVX2-only CPU would (this
    is how the benchmarks measure that class on a newer CPU)."""
    env = {**subprocess_env, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    code = "from attnlab import hardware; print(hardware.describe('cpu').why)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "this CPU has no native bf16 (AVX2)"


RELEASE = """
import os, threading, time, torch
from attnlab.hardware import release_openmp_threads
torch.set_num_threads(2)
def threads(): return len(os.listdir("/proc/self/task"))
out = {}
def helper():
    torch.ones(1 << 22).exp_()  # a parallel region: this thread's own team of OpenMP workers
    out["team"] = threads()
    out["released"] = release_openmp_threads()
    deadline = time.monotonic() + 5
    while threads() >= out["team"] and time.monotonic() < deadline:
        time.sleep(0.01)
    out["after"] = threads()
t = threading.Thread(target=helper); t.start(); t.join()
print(out["released"], out["team"], out["after"])
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the threads in Linux's /proc")
def test_release_openmp_threads_lets_the_calling_threads_workers_go():
    r = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    released, team, after = r.stdout.split()
    if released != "True":
        pytest.skip("this torch's OpenMP runtime has no omp_pause_resource_all")
    assert int(after) == int(team) - 1, r.stdout  # the helper's one worker (2 threads: itself and one more)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.sampled_from([(5,), (3, 5), (2, 4, 5), (0, 5), (2, 1, 5)]),
    out=st.integers(1, 9),
    with_bias=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_linear_equals_the_float64_product_to_float32_rounding(shape, out, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(shape, generator=g), torch.randn(out, 5, generator=g)
    b = torch.randn(out, generator=g) if with_bias else None
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    with torch.no_grad():
        got = hardware.linear(x, w, b)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.fixture
def cpu_maker(monkeypatch):
    """Makes hardware.linear see a CPU of this maker (``/proc/cpuinfo``'s ``vendor_id``)."""

    def pretend(vendor: str) -> None:
        monkeypatch.setattr(hardware, "cpu_vendor", lambda: vendor)
        hardware._onednn_linear_pays.cache_clear()

    yield pretend
    hardware._onednn_linear_pays.cache_clear()  # (the next call reads the real CPU again)


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel", ""])
def test_linear_takes_onednn_only_where_no_gradient_is_wanted_on_a_cpu_not_intels(vendor, cpu_maker) -> None:
    # oneDNN's operator has no backward: training keeps F.linear (and its gradients), inference on a
    # float32 CPU tensor takes oneDNN where the build has a working one, unless F.linear calls MKL on an
    # Intel CPU (faster there); other dtypes keep F.linear.
    cpu_maker(vendor)
    layer = torch.nn.Linear(6, 4)
    x = torch.randn(3, 6)
    with AtenOps() as ops:
        y = hardware.linear(x, layer.weight, layer.bias)
    assert "_linear_pointwise.default" not in ops.names and y.requires_grad
    y.sum().backward()
    torch.testing.assert_close(layer.weight.grad, torch.ones(3, 4).t() @ x)
    intel_mkl = vendor == "GenuineIntel" and torch.backends.mkl.is_available()
    onednn = torch.backends.mkldnn.enabled and not intel_mkl and hardware._onednn_linear_works()
    with torch.no_grad(), AtenOps() as ops:
        got = hardware.linear(x, layer.weight, layer.bias)
    assert ("_linear_pointwise.default" in ops.names) == onednn
    torch.testing.assert_close(got, torch.nn.functional.linear(x, layer.weight, layer.bias))
    with torch.no_grad(), AtenOps() as ops:
        hardware.linear(x.double(), layer.weight.double(), None)
        hardware.linear(x.bfloat16(), layer.weight.bfloat16(), None)
    assert "_linear_pointwise.default" not in ops.names
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's F.linear, in bfloat16
        assert hardware.linear(x, layer.weight, layer.bias).dtype == torch.bfloat16
    # oneDNN switched off (the switch itself, not torch.backends.mkldnn.flags(), which also sets a TF32
    # option and warns on a build without Intel GPU support)
    enabled, torch.backends.mkldnn.enabled = torch.backends.mkldnn.enabled, False
    try:
        with torch.no_grad(), AtenOps() as ops:
            hardware.linear(x, layer.weight, layer.bias)
    finally:
        torch.backends.mkldnn.enabled = enabled
    assert "_linear_pointwise.default" not in ops.names and torch.backends.mkldnn.enabled == enabled


def test_attnlab_linear_is_nn_linear_with_the_same_state_and_output() -> None:
    from attnlab.attention import Linear

    torch.manual_seed(0)
    ours, theirs = Linear(8, 3), torch.nn.Linear(8, 3)
    theirs.load_state_dict(ours.state_dict())
    assert isinstance(ours, torch.nn.Linear) and list(ours.state_dict()) == ["weight", "bias"]
    x = torch.randn(2, 5, 8)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x))
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)  # with gradients: the same kernel


# Run twice on one fresh inductor cache: compiled products (a torch.compile with attnlab's options, and a
# quantized format's one-row product compiled ahead) against the same sums uncompiled.
_ISA_PROBE = """
import sys, torch
from attnlab import hardware, quantized
g = torch.Generator().manual_seed(0)
fields = {"d": (torch.rand(300, 18, generator=g) / 8).half(), "m": (-torch.rand(300, 18, generator=g) / 8).half(),
          "qs": torch.randint(0, 256, (300, 18, 16), dtype=torch.uint8, generator=g)}
x = torch.randn(18, 32, generator=g)
matvec = quantized.FORMATS["Q4_1"].matvec
want = matvec(fields, x)
compiled = torch.compile(matvec, dynamic=False, options=hardware.compile_options())
ahead = quantized._compile_ahead(matvec, fields, 32)
scale = float(want.abs().max())
print(hardware.compile_options()["cpp.simdlen"], float((compiled(fields, x) - want).abs().max()) / scale,
      float((ahead(fields, x) - want).abs().max()) / scale)
"""


@pytest.mark.slow
def test_compiled_code_is_right_when_the_cache_was_filled_on_another_vector_unit(tmp_path):
    """Inductor's on-disk cache does not key CPU code by the vector unit: without
    :func:`hardware.compile_options` a process told ``ATEN_CPU_CAPABILITY=default`` (scalar) would be handed
    the code a process with AVX-512 cached (written for 16 floats a vector) and fail to build it (told AVX2,
    it builds it and sums wrongly). (On an AVX2-only CPU the code cached first is 8 floats wide, as the
    scalar build's vectors: the test can fail only where the first process has a wider unit.)"""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    runs = []
    for told in ({}, {"ATEN_CPU_CAPABILITY": "default"}):
        out = subprocess.run(
            [sys.executable, "-c", _ISA_PROBE], env={**env, **told}, capture_output=True, text=True, check=True
        )
        width, *errors = out.stdout.split()
        runs.append(int(width))
        assert all(float(e) <= 1e-5 for e in errors), (told, out.stdout)
    assert runs[1] == 1 and runs[0] in (1, 128, 256, 512)


def test_on_own_thread_returns_the_result_and_raises_the_error_of_a_thread_that_has_ended():
    seen = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 41 + int(torch.ones(3).sum() == 3)

    assert hardware.on_own_thread(work) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(ValueError, match="from the thread"):
        hardware.on_own_thread(lambda: (_ for _ in ()).throw(ValueError("from the thread")))


OWN_THREAD = """
import os, time, torch
from attnlab.hardware import on_own_thread
torch.set_num_threads(2)
def threads(): return len(os.listdir("/proc/self/task"))
before = threads()
on_own_thread(lambda: torch.ones(1 << 22).exp_())  # a parallel region: that thread's own team of workers
deadline = time.monotonic() + 5
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.01)
print(before, threads())
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the threads in Linux's /proc")
def test_on_own_thread_leaves_no_openmp_workers_behind():
    r = subprocess.run([sys.executable, "-c", OWN_THREAD], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    before, after = r.stdout.split()
    assert int(after) == int(before), r.stdout


def test_float64_sums_run_on_the_cpu_for_mps_only() -> None:
    # MPS has no float64: patching, attribution, SAE evaluation and the trainer's validation loss
    # sum there on the CPU, and a float64 checkpoint runs in float32.
    assert hardware.float64_device("mps") == torch.device("cpu")
    assert hardware.float64_device("mps:0") == torch.device("cpu")
    assert hardware.float64_device("cuda:1") == torch.device("cuda:1")
    assert hardware.float64_device(torch.device("cpu")) == torch.device("cpu")
    assert hardware.inference_dtype("mps", torch.float64) == torch.float32
    assert hardware.inference_dtype("cuda", torch.float64) == torch.float64
    x = torch.arange(3, dtype=torch.float32)
    assert hardware.as_float64(x).dtype == torch.float64 and hardware.as_float64(x).tolist() == [0.0, 1.0, 2.0]
