"""Is this dtype fast on this device? The one place attnlab asks, and every automatic choice follows.

bfloat16 halves the bytes of every tensor, and where the hardware multiplies it natively (CUDA from
Ampere on, CPUs with AVX512-BF16 or AMX, Arm CPUs with the BF16 extension, Apple GPUs on macOS 14+)
it is also faster. Elsewhere it is emulated and much slower than float32, so attnlab never picks bf16
by itself without asking :func:`bf16_native`: for the training autocast (``--precision auto``), Muon's
Newton-Schulz, the inference dtype (:func:`inference_dtype`) and the benchmarks' dtype rows. On the
CPU oneDNN answers, as it runs the matmuls (and honours ``ONEDNN_MAX_CPU_ISA``). :func:`describe` says
what a device does, for ``attnlab info``, the trainer's first line and the benchmarks' headers.

Also here, facts of the CPU runtime: :func:`on_own_thread` and :func:`release_openmp_threads` (OpenMP
teams that outlive their work), :func:`linear` (oneDNN rather than MKL for float32 where that is
faster) and :func:`compile_options` (the vector width every compile names).
"""

from __future__ import annotations

import ctypes
import functools
import platform
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "PRECISIONS",
    "Hardware",
    "bf16_native",
    "cpu_capability",
    "cpu_vendor",
    "describe",
    "fast_dtype",
    "header",
    "inference_dtype",
    "linear",
    "on_own_thread",
    "release_openmp_threads",
    "training_dtype",
]

PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class Hardware:
    """What a device does natively.

    Attributes:
        device: ``"cpu"``, ``"cuda"``, ``"mps"``.
        name: the processor: the CPU's model name as ``/proc/cpuinfo`` gives it, or the GPU's.
        capability: the CPU's vector unit as the kernels see it (``"AVX2"``, ``"AVX512"``,
            ``"AVX512-BF16"``, ``"AMX"``, ``"SVE256"``, ...), or the GPU's (``"sm_90"``, ``"MPS"``).
        bf16_native: whether bfloat16 matmuls run in hardware here.
    """

    device: str
    name: str
    capability: str
    bf16_native: bool

    @property
    def why(self) -> str:
        """One phrase: e.g. ``"this CPU has no native bf16 (AVX2)"``."""
        what = "this CPU" if self.device == "cpu" else f"this {self.device.upper()} device"
        has = "has native bf16" if self.bf16_native else "has no native bf16"
        return f"{what} {has} ({self.capability})"


def bf16_native(device: torch.device | str = "cpu") -> bool:
    """True where bfloat16 matmuls run in hardware on ``device`` (see the module docstring)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "mps":
        return torch.backends.mps.is_available() and torch.backends.mps.is_macos_or_newer(14, 0)
    if device.type == "cpu":
        native = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # no public query exists
        return bool(native is not None and native())
    return False


def fast_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bfloat16 where :func:`bf16_native`, else float32: the dtype an ``auto`` setting picks."""
    return torch.bfloat16 if bf16_native(device) else torch.float32


def training_dtype(precision: str, device: torch.device | str) -> torch.dtype:
    """The compute dtype of a training step under ``--precision`` (``auto``: :func:`fast_dtype`).

    The forward pass autocasts to it and Muon's Newton-Schulz runs in it; ``fp32`` means float32
    everywhere, with no bfloat16 tensor made anywhere in a step."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "auto":
        return fast_dtype(device)
    return torch.bfloat16 if precision == "bf16" else torch.float32


def inference_dtype(device: torch.device | str, stored: torch.dtype) -> torch.dtype:
    """The dtype a published model with weights stored in ``stored`` runs in on ``device`` by
    default: half precision as stored where the device computes it natively (bf16 per
    :func:`bf16_native`, fp16 on GPUs), else float32 (exact, and fast everywhere); float64 as
    stored, except on MPS, which has no float64."""
    device = torch.device(device)
    if stored == torch.bfloat16 and bf16_native(device):
        return torch.bfloat16
    if stored == torch.float16 and device.type in ("cuda", "mps"):
        return torch.float16
    return torch.float64 if stored == torch.float64 and device.type != "mps" else torch.float32


def float64_device(device: torch.device | str) -> torch.device:
    """Where the float64 sums of tensors on ``device`` run: the device itself, or the CPU for MPS,
    which has no float64."""
    device = torch.device(device)
    return torch.device("cpu") if device.type == "mps" else device


def as_float64(t: Tensor) -> Tensor:
    """``t`` in float64: on its own device, or on the CPU where that has no float64 (MPS)."""
    return t.to(float64_device(t.device), torch.float64)


def describe(device: torch.device | str = "cpu") -> Hardware:
    """What ``device`` is and whether it has native bf16 (for headers and ``attnlab info``)."""
    device = torch.device(device)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return Hardware("cuda", torch.cuda.get_device_name(device), f"sm_{major}{minor}", bf16_native(device))
    if device.type == "mps":
        return Hardware("mps", platform.processor() or "Apple GPU", "MPS", bf16_native(device))
    name = _cpuinfo("model name") or platform.processor() or platform.machine() or "CPU"
    return Hardware("cpu", name, cpu_capability(), bf16_native(device))


def header(device: torch.device | str = "cpu") -> str:
    """The line a benchmark starts with: where it ran, as ``"cpu: <model name>, AVX2, native bf16: no;
    torch <version>, <n> threads"`` (figures from different CPU classes are not comparable)."""
    hw = describe(device)
    return (
        f"{hw.device}: {hw.name}, {hw.capability}, native bf16: {'yes' if hw.bf16_native else 'no'}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


def cpu_capability() -> str:
    """The CPU's vector unit as torch's kernels use it: ATen's ``get_cpu_capability()`` (``AVX2``,
    ``AVX512``, ``SVE256``, ``DEFAULT``, ...), refined to ``AMX`` or ``AVX512-BF16`` where oneDNN
    also reports native bf16 (the units that make bf16 fast)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512" and bf16_native("cpu"):
        for unit, query in (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported")):
            if getattr(torch.cpu, query, lambda: False)():
                return unit
    return cap


def compile_options() -> dict[str, Any]:
    """Inductor options for every ``torch.compile`` of attnlab's (and ``standalone_compile``'s
    ``config_patches``): the CPU's vector width, named (``cpp.simdlen``: 512 for AVX-512, 256 for AVX2).

    Inductor's on-disk cache does not key its CPU code by the vector unit, so code written for one
    width could be handed to a process with another, and compute wrong sums (or fail to build); a
    named width is part of the key. Imports the compiler: call it where compiling starts."""
    global _simdlen
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    _simdlen = pick_vec_isa().bit_width() or 1  # (1: scalar code, where inductor uses no vector unit)
    return {"cpp.simdlen": _simdlen}


_simdlen: int | None = None


def compiled_vector_bits() -> int | None:
    """The vector width in bits that :func:`compile_options` named (the code attnlab's compiles make),
    None before it was first called: what code written for one vector unit checks, cheaply, even while
    ``torch.compile`` traces it."""
    return _simdlen


@functools.cache
def cpu_vendor() -> str:
    """The CPU's maker as ``/proc/cpuinfo`` names it (``"GenuineIntel"``, ``"AuthenticAMD"``), or ``""``
    where it says nothing (not Linux, an Arm CPU). Read once."""
    return _cpuinfo("vendor_id")


def _cpuinfo(field: str) -> str:
    """The first value of ``field`` in ``/proc/cpuinfo``, or ``""`` where there is no such file or field."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(field) and ":" in line:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def release_openmp_threads() -> bool:
    """Let the calling thread's OpenMP workers go (``omp_pause_resource_all``, soft), where torch's OpenMP
    runtime has the call (GCC's libgomp, LLVM's libomp: Linux); True if it did.

    Each thread that ran a parallel region keeps a team of workers, and while a process's OpenMP threads
    outnumber its CPUs libgomp's barriers sleep instead of spinning: a team that another live thread
    keeps slows every step of a decoding loop. The pause lets it go after plain elementwise work, not
    after a model's forward (docs/performance.md, *Serve*); there only the thread's end does
    (:func:`on_own_thread`)."""
    pause = _omp_pause()
    return pause is not None and pause(1) == 0  # 1: omp_pause_soft


_T = TypeVar("_T")


def on_own_thread(fn: Callable[[], _T]) -> _T:
    """``fn()`` on a new thread, waited for: its result, or its exception raised again here. The OpenMP
    team that its parallel operations give that thread ends with it (see :func:`release_openmp_threads`):
    for work done once beside a long-lived torch thread (``attnlab serve`` loads its model so)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # (raised again on the calling thread)
            out["error"] = exc

    thread = threading.Thread(target=run, name="attnlab-once", daemon=True)  # (Ctrl-C ends the process)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["result"]


@functools.cache
def _omp_pause():
    """``omp_pause_resource_all`` of the OpenMP runtime this process has loaded, or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as f:
            paths = {line.split()[-1] for line in f if any(n in line for n in ("libgomp", "libomp", "libiomp"))}
        for path in sorted(paths):
            fn = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
            if fn is not None:
                fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                return fn
    except (OSError, AttributeError):
        pass
    return None


_STREAMS = 4  # the compiled one-row product's sums side by side (see linear)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, by oneDNN's matmul on the weight as it is (no packed copy) for
    float32 on a CPU other than Intel's where no gradient is wanted, else by ``F.linear`` itself.

    ``F.linear`` of float32 calls MKL, which runs generic code paths on other makers' CPUs, where
    oneDNN's matmul is faster (most of all for a decoding step's few rows, bound by reading the
    weight). Anything that needs a gradient (oneDNN's operator has no backward), autocast, tensor
    subclasses (a DTensor's shards), other devices and dtypes take ``F.linear``. The two agree to
    float32's rounding; a build whose oneDNN does not (checked once per process) keeps ``F.linear``.

    Under ``torch.compile`` on a CPU, one row (a decoding step's) is a multiply-and-sum that inductor
    turns into a vectorized loop reading the weight at the memory's speed (a library kernel called from
    the graph reads it slower on some CPUs); it runs over four quarters of the weight's rows side by
    side, so each thread has four independent chains of additions, not one. Other compiled products
    take ``F.linear`` (inductor makes its own choice).

    A weight whose class says ``owns_linear`` (:class:`attnlab.quantized.QuantizedTensor`: a GGUF
    file's blocks) computes its own product, eager or compiled: ``F.linear`` hands it to the weight."""
    if owns_linear(weight):
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling() and x.device.type == "cpu" and x.shape[:-1].numel() == 1:
        parts = weight.chunk(_STREAMS) if weight.shape[0] >= _STREAMS else (weight,)
        y = torch.cat([(x.unsqueeze(-2) * part).sum(-1) for part in parts], dim=-1)  # (..., 1, K) * (N, K) -> (..., N)
        return y if bias is None else y + bias
    if (
        x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and type(x) is Tensor
        and type(weight) in (Tensor, torch.nn.Parameter)
        and (bias is None or (type(bias) in (Tensor, torch.nn.Parameter) and bias.dtype == torch.float32))
        and not (
            torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
        )
        and not torch.compiler.is_compiling()
        and not torch.is_autocast_enabled("cpu")  # (F.linear is autocast's: it casts to the autocast dtype)
        and torch.backends.mkldnn.enabled  # (asked at each call, as torch does)
        and _onednn_linear_pays()
        and _onednn_linear_works()
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def owns_linear(weight: Tensor) -> bool:
    """Whether ``weight``'s class computes its own ``F.linear`` (a quantized weight, LoRA's update of one)."""
    return getattr(type(weight), "owns_linear", False)


@functools.cache
def _onednn_linear_pays() -> bool:
    """Whether oneDNN's float32 matmul is the faster one here: unless ``F.linear`` calls MKL (torch's
    x86 builds) on an Intel CPU, where MKL runs its own code paths rather than generic ones (see
    :func:`linear`). A CPU whose maker is unknown keeps oneDNN."""
    return not (torch.backends.mkl.is_available() and cpu_vendor() == "GenuineIntel")


@functools.cache
def _onednn_linear_works() -> bool:
    """Whether this build has oneDNN and its matmul on a plain float32 weight equals ``F.linear`` (checked
    once per process on a small one; whether oneDNN is enabled is asked at each call, as torch does)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.no_grad():
            x = torch.linspace(-1, 1, 12).view(1, 3, 4)
            w, b = torch.linspace(-2, 2, 20).view(5, 4), torch.linspace(0, 1, 5)
            got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return bool(torch.allclose(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5))
    except (RuntimeError, AttributeError):
        return False
