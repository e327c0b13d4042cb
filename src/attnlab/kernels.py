"""Kernels of attnlab's own for decoding float32 on Intel CPUs: a few rows times a weight streamed from
memory (:func:`rows_linear`), the same from the blocks a GGUF file quantized the weight in
(:func:`block_linear`), and one new query per row against a cache's filled slots (:func:`decode_attention`);
and a few bfloat16 rows times a bfloat16 weight where it lies (:func:`bf16_linear`: a bfloat16 model's
products, in the eager step of one row and in :func:`block_step`).

A GGUF model loaded in float32 (SmolLM2-135M-Instruct's Q4_1 file: 538 MB of float32 weights) holds
each matrix dequantized, every weight ``d * q + m`` (Q4_1: ``q`` 4 bits, ``d`` and ``m`` float16 for
each 32 weights of a row) or ``d * q`` (Q8_0). :func:`pack_blocks` finds ``d``, ``m`` and ``q`` back
from the float32 values when a generation starts and keeps them only if every weight comes back bit for
bit; :func:`block_linear` multiplies from them, 3-8 rows a pass each weight rebuilt in a register (the
sums of :func:`rows_linear`, bit for bit), one or two rows each block's sum factored: the same float32
weights, the same tokens, from 97 MB a step instead of 538 (SmolLM2's one row: 4.35-4.60x transformers'
``generate`` on the float32 weights, where reading them all could reach 1.6-1.7x at most; Intel Xeon, 2
threads). Q4_0's ``d * (q - 8)`` is Q4_1's form with ``m = -8 d``.

Decoding a batch of 2-8 rows multiplies them by every weight of the model once per step. oneDNN and MKL
read a weight at some 16.5-18.5 GB/s there, where a plain sum over it reads 22.5 (an Intel Xeon with AMX,
2 threads, SmolLM2's 120 products a step at 8 rows); ``csrc/kernels.cpp`` reads it at 21.7, with a
software prefetch ahead of its one sequential stream per thread (see the file). Its products are float32
sums, as oneDNN's, in another order. The compiled decoding step attends over all the slots of its
preallocated cache with a mask, in inductor's loops (256 slots for a generation of up to 256 tokens):
SmolLM2's batch of 8 read 94 MB of cache a step there, 7 ms of 37; :func:`decode_attention` reads the
filled slots only, each key and value row once for the query heads that share it.

It is C++ built on first use by ``torch.utils.cpp_extension`` (some 7 s), then kept as a library named
by its source, torch's and Python's versions and the flags (in ``$TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``), which later processes load. Each build runs in a folder of its own and
its library replaces the kept one atomically: no lock a killed build could leave behind. Decoding uses it
where it was measured faster, Intel's CPUs with AVX-512 (:func:`available`); it runs on any CPU with
AVX-512 (:func:`runs`). Where the build fails (no compiler), both say no and decoding keeps oneDNN.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pathlib
import sys
import tempfile
import threading

import torch
from torch import Tensor

from attnlab import files, hardware

__all__ = [
    "amx_available",
    "available",
    "bf16_linear",
    "block_linear",
    "decode_attention",
    "decode_attention_weights",
    "pack_amx",
    "pack_blocks",
    "pack_panels",
    "panel_width",
    "rows_linear",
    "runs",
]

_LOG = logging.getLogger(__name__)
_SOURCE = pathlib.Path(__file__).parent / "csrc" / "kernels.cpp"
# -fopenmp: at::parallel_for divides the panels between torch's OpenMP threads (without it, one thread)
# CPU_CAPABILITY_AVX512: ATen's vectorised math (at::vec) in its AVX-512 form
# -mf16c: float16 <-> float32 in one instruction (the blocks' scales)
_CFLAGS = [
    "-O3",
    "-mavx512f",
    "-mavx512dq",
    "-mavx512bw",
    "-mavx512vl",
    "-mfma",
    "-mf16c",
    "-fopenmp",
    "-DCPU_CAPABILITY_AVX512",
]


def panel_width(weight: Tensor) -> int:
    """The panel width the kernel takes ``weight (N, K)`` in: 48 output columns where ``N`` divides by 48,
    else 32 where it divides by 32, else 0 (not packable)."""
    n = weight.shape[0]
    return 48 if n % 48 == 0 else 32 if n % 32 == 0 else 0


def pack_panels(weight: Tensor) -> Tensor:
    """``weight (N, K)`` float32 as the kernel reads it: panels ``(N / w, K, w)`` of ``w``
    (:func:`panel_width`) output columns each, one contiguous stream per panel. A copy, made when a
    generation starts (as the oneDNN packing it replaces: the parameters stay as they are)."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    ok = weight.dim() == 2 and weight.dtype == torch.float32 and weight.device.type == "cpu"
    if not ok or not panel_width(weight) or weight.shape[1] == 0:
        got = f"{weight.dtype} {tuple(weight.shape)} on {weight.device}"
        raise ValueError(
            f"weight must be a float32 (N, K) matrix on the CPU, N a multiple of 32 or 48, K >= 1; got {got}"
        )
    w = panel_width(weight)
    N, K = weight.shape
    return weight.detach().view(N // w, w, K).transpose(1, 2).contiguous()  # (N / w, K, w)


def amx_available() -> bool:
    """Whether :func:`pack_amx`'s weights may be multiplied here: a CPU with AMX's bfloat16 tiles whose
    kernel lets this process use them (torch's ``init_amx``), and the kernels :func:`runs`."""
    return runs() and bool(torch.ops.attnlab_kernels.amx_available())


def pack_amx(weight: Tensor) -> Tensor:
    """A bfloat16 ``weight (N, K)`` (``N`` a multiple of 48, ``K`` of 32) as AMX's tiles read it:
    ``(N / 16, K / 32, 16, 16, 2)``, each tile 32 ``k`` of 16 output columns, ``k``'s pairs a lane. A
    copy, made when a generation starts: :func:`bf16_linear` and :func:`block_step` multiply it by
    tiles where :func:`amx_available` (a batch's rows at once: SmolLM2's products at 8 rows 1.7x faster
    than on the matrices as they lie; Intel Xeon, 2 threads). Their sums are float32 in the tiles' order,
    inputs and results below ``2^-126`` flushed to zero, as AMX does."""
    if not _loaded:
        _require()
    return torch.ops.attnlab_kernels.pack_amx(weight)


def rows_linear(x: Tensor, panels: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x (..., K) @ W.T + bias`` for ``W (N, K)`` packed by :func:`pack_panels`: ``(..., N)``, float32,
    CPU, up to 8 rows a pass over the weight. The panels may be bfloat16 too (``pack_panels(W)`` rounded:
    the screened head's, :class:`attnlab.decoding.ScreenedHead`), each weight widened exactly, the sums
    float32. Only where :func:`runs` (the kernel checks its arguments:
    ValueError or TypeError naming the one at fault)."""
    if not _loaded:
        _require()
    return torch.ops.attnlab_kernels.rows_linear(x, panels, bias)


def bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x (..., K) @ weight.T + bias`` for a bfloat16 ``weight (N, K)`` as it lies (no packed copy),
    ``K`` a multiple of 32: ``(..., N)`` bfloat16, CPU, up to 8 rows a pass over the weight (each
    weight read and widened once for them all). Float32 products and sums, rounded once to bfloat16
    with the bias (the compiled step's one-row sums, in another order); a row's sums in one order
    whatever rows stand beside it. Only where :func:`runs` (the kernel checks its arguments: ValueError
    or TypeError naming the one at fault)."""
    if not _loaded:
        _require()
    return torch.ops.attnlab_kernels.bf16_linear(x, weight, bias)


def pack_blocks(weight: Tensor) -> Tensor | None:
    """``weight (N, K)`` float32 in the blocks a GGUF file quantized it in, where it has them: each row's
    32-weight blocks as Q4_1 (``w = d * q + m``, ``q`` 4 bits, ``d`` and ``m`` float16; Q4_0's ``d * (q -
    8)`` is Q4_1's with ``m = -8 d``) or else Q8_0 (``w = d * q``, ``q`` 8 bits), found back from the
    float32 values and kept only if every weight comes back bit for bit; else None (the weight stays
    float32). ``N`` a multiple of 32 or 48, ``K`` of 32.
    uint8 ``(N / w, K / 32, 20 w | 34 w)`` in panels of ``w`` (:func:`panel_width`) output columns (see
    ``csrc/kernels.cpp``); made when a generation starts, as :func:`pack_panels`' copy. Only where
    :func:`runs`."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        got = f"{weight.dtype} {tuple(weight.shape)} on {weight.device}"
        raise ValueError(f"weight must be a float32 (N, K) matrix on the CPU, got {got}")
    if not _loaded:
        _require()
    blocks = torch.ops.attnlab_kernels.pack_blocks(weight.detach())
    return blocks if blocks.numel() else None


def block_linear(x: Tensor, blocks: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x (..., K) @ W.T + bias`` for ``W (N, K)`` kept as :func:`pack_blocks` blocks: ``(..., N)``,
    float32, CPU, up to 8 rows a pass. A pass of 3-8 rows rebuilds each weight exactly from its block,
    its sums those of :func:`rows_linear` on the same weight, bit for bit; one of 1 or 2 rows sums each
    block as ``d * sum(x q) + m * sum(x)`` (fewer operations a weight; float32 sums in another order, and
    an infinite ``x`` gives NaN there, not infinity). In a fifth (Q4_1) or a quarter (Q8_0) of the
    bytes. Only where :func:`runs`."""
    if not _loaded:
        _require()
    return torch.ops.attnlab_kernels.block_linear(x, blocks, bias)


def block_layer(
    x: Tensor,
    rope: tuple[Tensor, Tensor] | None,
    keys: Tensor,
    values: Tensor,
    slot: Tensor,
    weights: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor],
    heads: int,
    scale: float,
    eps: float,
    with_weights: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One block of a Llama-style model for one new token per row, in one call: ``x (B, 1, C)``, ``B``
    up to 8 -> ``(B, 1, C)``. RMSNorm (``eps``), the fused query, key and value projection, RoPE at
    ``rope``'s angles (``(cos, sin)``, ``hd`` values each; None: no RoPE), the new key and value
    written to slot ``slot`` (a 0-d int64 tensor) of ``keys``/``values`` ``(B, Hkv, M, hd)`` (in place),
    grouped-query attention of the ``heads`` queries over the filled slots (``scale``), the output
    projection and residual, RMSNorm, SwiGLU and the down projection and residual. ``weights``: the
    first norm's weight, the q/k/v, output, second norm's, gate-and-up (``[gate | up]``) and down
    projections, each product as :func:`pack_blocks`' blocks; no biases.

    Returns the block's output, the queries after RoPE ``(B, H, 1, hd)``, the heads' outputs ``(B, Hkv,
    G, hd)`` and, ``with_weights``, the attention's weights ``(B, Hkv, G, M)`` (0 at the empty slots;
    else an empty tensor). The sums those of :func:`block_linear` and :func:`decode_attention`; the
    norms' in double. Only where :func:`runs` (the kernel checks its arguments: ValueError or TypeError
    naming the one at fault)."""
    if not _loaded:
        _require()
    cos, sin = (None, None) if rope is None else rope
    norm1, qkv, out, norm2, up, down = weights
    return torch.ops.attnlab_kernels.block_layer(
        x, cos, sin, keys, values, slot, norm1, qkv, out, norm2, up, down, heads, scale, eps, with_weights
    )


def block_step(
    x: Tensor,
    rope: tuple[Tensor, Tensor] | None,
    keys: list[Tensor],
    values: list[Tensor],
    positions: list[Tensor],
    slot: Tensor,
    layers: list[Tensor],
    heads: int,
    scale: float,
    eps: float,
    final_norm: Tensor,
    head: Tensor,
    with_weights: bool = False,
) -> tuple[Tensor, Tensor]:
    """A decoding step of a Llama-style model all of whose blocks :func:`block_layer` computes, with one
    RoPE for all: ``x (B, 1, C)`` (the new tokens' embeddings) through every block (``keys``, ``values``:
    each block's cache, written in place; ``positions``: each cache's positions record ``(B, M)``, the
    slot's set to ``slot``, or ``[]``; ``layers``: each block's six tensors, :func:`block_layer`'s
    ``weights`` one after the other), the final RMSNorm ``final_norm`` and the ``head`` (:func:`pack_blocks`'
    blocks) -> the logits ``(B, V)`` and, ``with_weights``, every block's attention weights over the
    filled slots, ``(L, B, H, slot + 1)`` float32 (caches of one size; else an empty tensor). One call,
    no graph. A bfloat16 model's too: ``x``, the caches and the logits bfloat16, the products and the
    head its bfloat16 matrices as they lie (:func:`bf16_linear`'s sums), the norms' weights float32; each
    operation's output rounded to bfloat16 as the model's forward holds it, the sums float32. Only
    where :func:`runs`."""
    if not _loaded:
        _require()
    cos, sin = (None, None) if rope is None else rope
    return torch.ops.attnlab_kernels.block_step(
        x, cos, sin, keys, values, positions, slot, layers, heads, scale, eps, final_norm, head, with_weights
    )


def decode_attention(q: Tensor, keys: Tensor, values: Tensor, slot: Tensor, scale: float) -> Tensor:
    """One new query per row against the filled slots ``0..slot`` of a float32 cache: ``softmax(q k^T *
    scale) v``, ``q (B, Hkv, G, hd)`` (the ``G`` query heads sharing each key head), ``keys``/``values``
    contiguous ``(B, Hkv, M, hd)``, ``slot`` a 0-d int64 tensor -> ``(B, Hkv, G, hd)``. Only where :func:`runs`."""
    if not _loaded:
        _require()
    return torch.ops.attnlab_kernels.decode_attention(q, keys, values, slot, scale)


def decode_attention_weights(
    q: Tensor, keys: Tensor, values: Tensor, slot: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """:func:`decode_attention`, and its softmax weights over all ``M`` slots ``(B, Hkv, G, M)``, 0 at the
    empty ones (what an observer of the step reads). Only where :func:`runs`."""
    if not _loaded:
        _require()
    return torch.ops.attnlab_kernels.decode_attention_weights(q, keys, values, slot, scale)


def available() -> bool:
    """Whether decoding multiplies a float32 batch by :func:`rows_linear` (and a bfloat16 row by
    :func:`bf16_linear`): an Intel CPU (where it was measured faster than oneDNN) that :func:`runs` it."""
    return hardware.cpu_vendor() == "GenuineIntel" and runs()


def runs() -> bool:
    """Whether :func:`rows_linear` runs here: a CPU with AVX-512, and the kernel built (the first call
    builds it, or loads the kept build)."""
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and _built()


_loaded = False  # the kernels' library loaded in this process (by _built)


def _require() -> None:
    """Load the kernels (the first call of a process), or say why they cannot run here."""
    if not runs():
        raise RuntimeError(
            "attnlab's kernels need a CPU with AVX-512 and a C++ compiler to build them; "
            f"this CPU's vector unit is {torch.backends.cpu.get_cpu_capability()} (attnlab.kernels.runs() is False)"
        )


def _library() -> pathlib.Path:
    """Where the built kernel is kept: a name for this source, these flags, torch and Python."""
    key = hashlib.sha256(
        b"\0".join([_SOURCE.read_bytes(), " ".join(_CFLAGS).encode(), torch.__version__.encode(), sys.version.encode()])
    ).hexdigest()[:16]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or pathlib.Path.home() / ".cache" / "torch_extensions"
    return pathlib.Path(root) / f"attnlab_kernels_{key}.so"


_BUILD_LOCK = threading.Lock()  # (two threads' first decoders: one build, one library loaded)


def _built() -> bool:
    with _BUILD_LOCK:
        return _build_once()


@functools.cache
def _build_once() -> bool:
    global _loaded
    try:
        kept = _library()
        if kept.is_file():
            torch.ops.load_library(str(kept))
        else:
            _build(kept)
    except Exception as e:  # (no compiler, no ninja, a header missing: oneDNN's kernels then)
        _LOG.info("attnlab's kernels are not available (%s); decoding keeps oneDNN's and inductor's", e)
        return False

    @torch.library.register_fake("attnlab_kernels::rows_linear")
    def _(x: Tensor, panels: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty((*x.shape[:-1], panels.shape[0] * panels.shape[2]))

    @torch.library.register_fake("attnlab_kernels::bf16_linear")
    def _(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @torch.library.register_fake("attnlab_kernels::block_linear")
    def _(x: Tensor, blocks: Tensor, bias: Tensor | None) -> Tensor:
        width = blocks.shape[2] // (20 if blocks.shape[2] in (640, 960) else 34)
        return x.new_empty((*x.shape[:-1], blocks.shape[0] * width))

    @torch.library.register_fake("attnlab_kernels::block_layer")
    def _(x, cos, sin, keys, values, slot, norm1, qkv, out, norm2, up, down, heads, scale, eps, weights):
        B, Hkv, M, hd = keys.shape
        G = heads // Hkv
        seen = (B, Hkv, G, M) if weights else (0,)
        return x.new_empty(x.shape), x.new_empty((B, heads, 1, hd)), x.new_empty((B, Hkv, G, hd)), x.new_empty(seen)

    @torch.library.register_fake("attnlab_kernels::decode_attention_weights")
    def _(q: Tensor, keys: Tensor, values: Tensor, slot: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return out, torch.empty((*q.shape[:3], keys.shape[2]), dtype=q.dtype, device=q.device)

    @torch.library.register_fake("attnlab_kernels::decode_attention")
    def _(q: Tensor, keys: Tensor, values: Tensor, slot: Tensor, scale: float) -> Tensor:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    _loaded = True
    return True


def _build(kept: pathlib.Path) -> None:
    """Build the kernel in a folder of this process's own, load it, and keep its library at ``kept``
    (where a folder can't be written, this process uses it all the same)."""
    from torch.utils import cpp_extension

    _LOG.info("building attnlab's kernels (once: the library is kept in %s)", kept.parent)
    with tempfile.TemporaryDirectory(prefix="attnlab_kernels_") as tmp:
        built = cpp_extension.load(
            "attnlab_kernels",
            [str(_SOURCE)],
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=tmp,
            is_python_module=False,
            verbose=False,
        )
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            files.atomic_write_bytes(kept, pathlib.Path(built).read_bytes())
        except OSError as e:
            _LOG.info("could not keep the built kernel in %s (%s)", kept.parent, e)
