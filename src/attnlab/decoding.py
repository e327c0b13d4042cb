"""The decoding fast path: one new token through every layer of a :class:`attnlab.GPT`, no checks.

A decoding step of a small model is many thin operations: at SmolLM2-135M's 30 layers of width 576,
a token reads 538 MB of float32 weights in some 200 matrix-vector products, and the eager forward
adds, per layer, the argument checks, the mask and position logic of a general ``attend``, three
small projections where one would do, and a module call per step. :class:`FastDecoder` runs the same
math with the work a step needs and nothing else:

* the query, key and value projections as one matmul (their weights concatenated when a generation
  starts, freed when it ends: the parameters, ``state_dict`` and checkpoints stay as they are);
* RoPE's angles once per step for all layers, the new key and value written into the preallocated
  cache, attention over the filled slots only;
* with ``compile=True``, the layers in groups of up to 12 (equal groups: SmolLM2's 30 run as 3 calls
  of 10 layers and one of the head, GPT-2-small's 12 and the head as one call; a model decoding from
  a GGUF file's blocks, below, runs all its layers and the head in one call), each group one
  function compiled by ``torch.compile`` over the whole preallocated cache (static shapes, a mask
  over the filled slots), shared by every group (one compilation); each matrix-vector product of a
  single row as a fused multiply-reduce that inductor turns into one vectorized loop over the
  weights (for a large model four sums at once, over four blocks of the weight's rows:
  ``_STREAMS``), which streams them at memory speed where the BLAS kernel of a one-row matmul does not,
  and attention as multiply-and-sum loops too (CPU; on CUDA the same code, compiled by inductor's
  Triton backend). Fewer calls per token: each costs Dynamo's guard checks and a trip through
  Python (some 50 us). With attention observers set (:func:`attnlab.interpret.observe_attention`:
  serve's generation stream) a variant of that function, compiled apart, also
  returns each layer's query, attention weights over the cache and head outputs; the records the
  eager forward would hand the observers are built from them after the call, outside the graph.
  A batch's matmuls on the CPU (compiled or not) run on the weights prepacked once per generation for
  oneDNN (:func:`packs`; the BLAS kernel behind ``F.linear`` is several times slower at a few rows on
  AMD CPUs; on an Intel CPU the eager step of a small float32 model keeps MKL's matmul on the plain
  weights, faster there), and so do one row's in the eager step of a large bfloat16 model over a long
  generation. The compiled step of a batch of a model too small to pack (the ``tiny`` preset)
  multiplies in inductor's own loops, as one row's does: a batch of up to 8 rows as one sum per row,
  which inductor fuses into one loop reading each weight once for all rows, each row's sum in a
  register of its own (``tiny``'s 8 rows: the compiled kernel 451 -> 368 us a step, AMD Zen 4); a
  larger batch reads the weights, which stay in the CPU's caches, once per row.
  On a CPU a small model's greedy decoding (the ``tiny`` preset) runs :data:`_CHUNK` steps to a compiled
  call (:meth:`FastDecoder.greedy_steps`): the embedding, each step's argmax and the stop ids inside the
  graph, the logits checked once a call; a hook or observer set between the tokens takes back the steps
  run ahead (:meth:`FastDecoder.rewind`).
  On CUDA the whole unobserved step (embedding, RoPE, the groups, the head) is captured in one CUDA
  graph per generation and replayed per token: a step of a small model is hundreds of short
  kernels whose launches, not the weights' reads, take its time (SmolLM2's shape on an H200: 641
  tokens/s against 146 without the graph).

A float32 model loaded from a GGUF file (SmolLM2's Q4_1) decodes on an Intel CPU from the file's
own blocks (:func:`_blocks`, :mod:`attnlab.kernels`): the same float32 weights, found back from their
values when the generation starts, read at a fifth of the bytes (one row or a batch of up to 8). A
Llama-style block on its blocks runs whole in one operator (:func:`attnlab.kernels.block_layer`: one
OpenMP region for the norms, the products, RoPE, the cache's new slot and the attention, not 5
operators and 3 of inductor's loops); a model of such blocks with one RoPE and its head on blocks
(SmolLM2) runs each step as one call, :func:`attnlab.kernels.block_step`, compiled or not, with no
graph and no guards (:attr:`FastDecoder.stepper`). So does a bfloat16 model of such blocks, on its
bfloat16 matrices as they lie (:func:`attnlab.kernels.bf16_linear`'s sums, each operation's output
rounded to bfloat16 as its forward holds it), up to 8 rows; the eager step of another bfloat16 model's
one row multiplies by :func:`attnlab.kernels.bf16_linear` too.

Eager is the reference: generation uses the fast path only where it computes what the model's own
forward would (:func:`supported`), and the tests hold its tokens and logits to the eager path's.
Anything else (hooks, LoRA parametrizations, forward hooks, padding masks, ALiBi,
soft-capping, a rolling cache longer than its layer's window once past the window, training mode)
runs the eager forward. A ring that has wrapped runs the uncompiled fast step (the compiled one's
mask counts slots in order).
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils import parametrize

from attnlab import hardware, kernels
from attnlab.attention import AttentionRecord, Linear, rows_receiver, wants_cache_copies
from attnlab.checks import autocast_on, check_model_logits
from attnlab.functional import causal_mask
from attnlab.positions import apply_rope

__all__ = ["FastDecoder", "fused_bytes", "fused_qkv", "greedy_tokens", "pack_linear", "packs", "supported"]

_ACT = {"gelu_tanh": "tanh", "gelu": "none"}  # GPTConfig.activation -> F.gelu's `approximate`
_GROUP = 12  # the compiled step: layers per compiled call (fewer calls per token, larger graphs to compile)
# The compiled step of a small model's batch of up to this many rows: one sum per row (see _matvec), each
# a multiply-reduce inductor fuses with the others into one loop (more rows: more code to compile).
_ROWS = 8
# The compiled step's matrix-vector product of one row of a model too large for the CPU's caches (see
# _how) as this many sums at once, each over its own quarter of the weight's rows, which inductor fuses
# into one loop: that many independent chains of additions and streams of reads per thread, where one
# sum at a time waits on each addition (SmolLM2's products, a chain of them as in a step: 1 thread
# 19.4 -> 24.2 GB/s, 2 threads 26.7 -> 29.9, the machine's sum 25 and 32; AMD Zen 4). CPU only: a GPU's
# reduction kernel spreads each sum over many threads already. Not for a small model, whose weights
# stay in the caches: the `tiny` preset's one prompt ran 0.96-0.97x so, in process.
_STREAMS = 4
# The compiled step of a small model on a CPU (not _large: its weights stay in the CPU's caches) runs greedy
# decoding this many steps to a call (FastDecoder.greedy_steps): each call costs Dynamo's guards,
# inductor's wrapper and the loop's Python between steps (the argmax, the logits' check, some 0.3 ms
# with the step's inputs), as much as the `tiny` preset's kernel itself (0.4 ms for 8 rows). 4: a step in
# the loop 0.69 ms + 0.07 for its token -> 0.57-0.62 ms, the chunk's compilation 8-12 s more (8: no
# faster, 0.544 against 0.545 ms a step, and 50 s; Xeon with AMX, 2 threads).
_CHUNK = 4


def greedy_tokens(logits: Tensor, checked: bool = False) -> Tensor:
    """``logits (..., V)``' argmax over the last dimension, the first of ties, as ``argmax`` gives it: by
    ``max(dim=-1).indices``, whose CPU kernel is vectorized where argmax's is not (SmolLM2's 49,152
    logits, Xeon with AMX: float32 76 -> 32 us, bfloat16 181 -> 46 us; a batch of 8 in bfloat16 729 -> 175).
    ``checked``: first checked as :func:`attnlab.checks.check_model_logits` checks them (ValueError), from
    the same maxima (NaN propagates into a row's, +inf is it: finite exactly where the row has a token),
    one pass over the logits instead of two."""
    best = logits.max(dim=-1)
    if checked:
        check_model_logits(best.values[..., None])
    return best.indices


# --------------------------------------------------------------------------------------------
# When the fast path computes what the eager forward does
# --------------------------------------------------------------------------------------------
def _plain_modules(hook_dicts: list[dict], hookable: list[nn.Module]) -> bool:
    """No forward (pre-)hook, global or in the modules' ``hook_dicts`` (:func:`_hook_dicts`), no attnlab
    hook (:mod:`attnlab.interpret.hooks`) on the blocks and attention layers ``hookable``. (Attention
    observers are fine: the fast step hands them the record the eager forward would.)"""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return False
    if any(hook_dicts):  # (a C-level scan: FastDecoder.fits runs it every step)
        return False
    return all(m.hook is None for m in hookable)


def _hook_dicts(modules: Any) -> list[dict]:
    """Each module's forward hook and pre-hook dicts (``register_forward_hook`` adds to these dicts, it
    does not replace them, so a list made once sees the hooks set later)."""
    return [d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)]


def _hookable(model: nn.Module) -> list[nn.Module]:
    return [m for block in model.trf_blocks for m in (block, block.att)]


_LINEAR = (nn.Linear, Linear)  # the projections the fast step reads as plain weights (no module of another kind)


def supported(model: nn.Module, caches: list[Any] | None, key_mask: Tensor | None) -> bool:
    """Whether :class:`FastDecoder` may run ``model``'s decoding steps with these caches: an
    :class:`attnlab.GPT` in eval mode whose attention the fast step reproduces (no ALiBi, no
    soft-capping), unmodified by hooks or parametrizations, with plain per-layer caches and no
    padding mask. Checked once per generation; :meth:`FastDecoder.fits` checks each step."""
    cfg = getattr(model, "config", None)
    if cfg is None or caches is None or key_mask is not None or model.training:
        return False
    if not hasattr(model, "trf_blocks"):
        return False
    blocks = model.trf_blocks
    if len(caches) != len(blocks) or autocast_on(model.device):
        return False
    for block in blocks:
        att, lin = block.att, [block.att.W_query, block.att.W_key, block.att.W_value, block.att.out_proj]
        if type(block.ff.layers[0]) not in _LINEAR or type(block.ff.layers[2]) not in _LINEAR:
            return False
        if any(type(m) not in _LINEAR for m in lin) or att.kv_dim != att.d_in or not att.causal:
            return False
        if att.alibi or att.softcap is not None:  # (judged by the modules: a model may hold others than its config's)
            return False
    if any(parametrize.is_parametrized(m) for m in model.modules()):
        return False
    return _plain_modules(_hook_dicts(model.modules()), _hookable(model))


# --------------------------------------------------------------------------------------------
# Fused weights, made for each generation
# --------------------------------------------------------------------------------------------
def fused_qkv(att: nn.Module) -> tuple[Tensor, Tensor | None]:
    """``(W, b)``: the query, key and value projections of ``att`` as one ``(Hq*hd + 2*Hkv*hd, d_in)``
    weight (and bias). A fresh copy, made when a generation starts and freed when it ends: a copy kept
    between generations could go stale unseen (``weight.data[...] = 0`` bumps no version counter), and
    the copy costs a few milliseconds against the seconds of a generation."""
    parts = [att.W_query, att.W_key, att.W_value]
    with torch.no_grad():
        w = torch.cat([p.weight for p in parts]).detach()  # (Hq*hd + 2*Hkv*hd, d_in)
        b = None if att.W_query.bias is None else torch.cat([p.bias for p in parts]).detach()
    return w, b


def fused_bytes(model: nn.Module) -> int:
    """Bytes of the fused projections a generation of ``model`` holds while it runs (the fast path's
    extra memory): the query, key and value weights and biases of every attention layer, once more."""
    total = 0
    for block in getattr(model, "trf_blocks", []):
        for p in (block.att.W_query, block.att.W_key, block.att.W_value):
            total += sum(t.numel() * t.element_size() for t in (p.weight, p.bias) if t is not None)
    return total


def packs(weight: Tensor, rows: int) -> bool:
    """Whether the fast step of a batch (``rows > 1``) runs its matmuls on weights like ``weight``
    prepacked for oneDNN (:func:`pack_linear`): float32 or bfloat16 on a CPU with oneDNN. A matmul of a
    few rows spends as much time re-laying the weight out for its kernel as multiplying (and on AMD CPUs
    the BLAS kernel behind ``F.linear`` is slower still): packed once per generation, GPT-2-small's
    projections at 8 rows ran 2-3.5x faster, its head 3.4x, the ``tiny`` preset's 1.3-2x (2 threads, AMD
    Zen 4). The eager step takes the packed tensors; the compiled one plain tensors, and calls
    :func:`packed_linear`, which finds their packed copies. (One row packs too, eagerly, for a large
    bfloat16 model and a long generation; a small float32 model's batch does not on an Intel CPU, whose
    MKL is faster there on the plain weights: see :func:`_packing`.)"""
    if rows < 2 or weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not torch.backends.mkldnn.enabled or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return weight.dtype in (torch.float32, torch.bfloat16) and _packed_linear_works(weight.dtype)


@functools.cache
def _packed_linear_works(dtype: torch.dtype) -> bool:
    """Whether this build's oneDNN packs and multiplies ``dtype`` weights as ``F.linear`` does (checked
    once per process on a small matmul): a build or CPU where it fails or differs keeps the plain matmul
    rather than failing a generation."""
    try:
        x = torch.linspace(-1, 1, 12, dtype=torch.float32).view(3, 4).to(dtype)
        w = torch.linspace(-2, 2, 20, dtype=torch.float32).view(5, 4).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 3)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(got.float(), F.linear(x, w).float(), rtol=0.02, atol=0.02))
    except RuntimeError:
        return False


def pack_linear(weight: Tensor, rows: int) -> Tensor:
    """``weight (N, K)`` in oneDNN's layout for matmuls of ``rows`` rows (an opaque ``torch._mkldnn``
    tensor that :func:`_matvec` recognises): a copy, made when a generation starts, freed when it ends
    (as :func:`fused_qkv`: the parameters stay as they are)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


# The compiled step of a batch, and the eager step of one row, pack a model whose matrices hold at least
# this many elements (each packed_linear call costs some 30 us of dispatch, a one-row oneDNN call on a
# small weight more than F.linear's): GPT-2-small's 124M at 8 rows ran 2.7x transformers packed,
# the ``tiny`` preset's 1.7M slower packed.
_PACK_MIN_ELEMENTS = 1 << 24
# The eager step of one row packs bfloat16 weights (where attnlab's kernel does not multiply them: see
# FastDecoder) for a generation of at least this many steps: packing SmolLM2's takes 0.1-0.2 s (2 threads,
# AMD Zen 4), a step then takes 24.1 ms against 29.5 on the plain weights. (float32 packed reads no faster
# than the plain weights: by oneDNN 36.3 against 36.0 ms a step; on an Intel Xeon 19.8 GB/s against MKL's
# 26.5, see hardware.linear.)
_PACK_ONE_ROW_STEPS = 32
# The packed copies hold the matrices once more while a generation runs: no packing past this many bytes
# of them (a model of some 500M float32 parameters), where the copy would be a memory cost a laptop feels.
_PACK_MAX_BYTES = 1 << 31
# A float32 batch of up to this many rows multiplies by attnlab's own kernel where it runs
# (attnlab.kernels: 8 rows a pass over the weight): SmolLM2's products at 8 rows read 21.7 GB/s against
# oneDNN's packed 16.5 (an Intel Xeon with AMX, 2 threads). More rows keep oneDNN, whose kernel reads
# the weight once for all of them.
_PANEL_ROWS = 8
# Finding a GGUF file's blocks (see _blocks) costs SmolLM2 76 ms a generation, which its one-row steps
# make up in some 6 (a float32 step 29 -> 15 ms eager, 21 -> 8.5 compiled; Intel Xeon, 2 threads): shorter
# known generations of the eager step keep the float32 weights.
_BLOCK_MIN_STEPS = 8


def _packing(model: nn.Module, rows: int, compile: bool, steps: int | None, big: bool) -> bool:
    """Whether a :class:`FastDecoder` of ``rows`` rows packs ``model``'s weights for oneDNN (see :func:`packs`);
    ``big``: :func:`_large` of ``model``."""
    if sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2) > _PACK_MAX_BYTES:
        return False
    head = model.out_head.weight
    if rows > 1:  # the eager step of a batch; the compiled one for a large model. A small model's float32
        # batch only where hardware.linear multiplies float32 by oneDNN: MKL's plain few-row matmul, its kernel
        # on an Intel CPU, beat the packed one there (the `tiny` preset's 8 rows: 8020 against 6563 tokens/s).
        small_pays = head.dtype != torch.float32 or hardware.linear_on_onednn(head.dtype, head.device)
        wanted = big or (not compile and small_pays)
    else:  # (bfloat16's: float32's one row reads the plain weights as fast, by hardware.linear's kernel)
        wanted = big and not compile and steps is not None and steps >= _PACK_ONE_ROW_STEPS
        wanted = wanted and head.dtype == torch.bfloat16
    # packs() last: its check of oneDNN runs a matmul, made only where a decoder would pack (it asks of
    # a batch; one row's case is the rule above).
    return wanted and packs(head, max(rows, 2))


def _bf16_products(weights: list[tuple], head: Tensor) -> bool:
    """Whether :func:`attnlab.kernels.bf16_linear` takes every product of ``weights`` (each layer's
    :meth:`FastDecoder._weights`) and the output ``head`` as they are: contiguous, on the CPU, ``K`` a
    multiple of 32, bfloat16."""
    mats = [w[j] for w in weights for j in _MATRICES] + [head]
    dense = all(m.dim() == 2 and m.is_contiguous() and m.shape[1] % 32 == 0 for m in mats)
    return dense and all(m.device.type == "cpu" and m.dtype == torch.bfloat16 for m in mats)


def _large(model: nn.Module) -> bool:
    """Whether ``model``'s matrices hold at least :data:`_PACK_MIN_ELEMENTS` elements: large enough to pack."""
    return sum(p.numel() for p in model.parameters() if p.dim() == 2) >= _PACK_MIN_ELEMENTS


def _batch_products(large: bool, packed: bool, cpu: bool, mkl: bool = False) -> str:
    """How the compiled step of a :class:`FastDecoder` multiplies a batch's rows (:func:`_matvec`): on the
    ``packed`` weights; on a CPU, a model too small to pack (not ``large``, :func:`_large`) in inductor's
    loops (``"reduce"``; up to :data:`_ROWS` rows one sum per row, see :func:`_how`), whose weights stay
    in the CPU's caches while each row reads them, where MKL's few-row matmul reads them slower (the
    ``tiny`` preset, 8 rows: a step 0.80 -> 0.67 ms, AMD Zen 4); else the matmul: a GPU's, a large
    model's (whose weights each row would read from memory again, where oneDNN is missing), and a float32
    batch's where MKL's kernels are Intel's own (``mkl``: :func:`attnlab.hardware.mkl_runs_float32`). There
    the `tiny` preset's 4 greedy steps in one call (:data:`_CHUNK`, its code around the kernels in C++)
    took 1.74 ms against 2.04 in inductor's loops (Intel Xeon, 2 threads; with its code around the kernels
    in Python, 2.33 against 2.29)."""
    if packed:
        return "packed"
    return "reduce" if cpu and not large and not mkl else "plain"


# The compiled step of a batch: inductor takes plain tensors only (an opaque oneDNN tensor has no fake
# twin to trace), so the graph calls packed_linear with the plain weight, which finds the packed copy
# its FastDecoder registered here, by the weight's address, shape and dtype, while the decoder lives
# (counted: two generations at once on one model share the copies).
_PACKED: dict[tuple, list] = {}  # key -> [packed weight, decoders holding it]
_PACKED_LOCK = threading.Lock()


def _packed_key(weight: Tensor) -> tuple:
    return (weight.data_ptr(), tuple(weight.shape), weight.dtype)


def _register_packs(weights: list[Tensor], rows: int) -> list[tuple]:
    keys = []
    with _PACKED_LOCK:
        for w in weights:
            key = _packed_key(w)
            if key in _PACKED:
                _PACKED[key][1] += 1
            else:
                _PACKED[key] = [pack_linear(w, rows), 1]
            keys.append(key)
    return keys


def _release_packs(keys: list[tuple]) -> None:
    with _PACKED_LOCK:
        for key in keys:
            if key in _PACKED:
                _PACKED[key][1] -= 1
                if _PACKED[key][1] == 0:
                    del _PACKED[key]


def packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None, gelu: str) -> Tensor:
    """``x @ weight.T + bias`` (``gelu``: ``"none"`` or ``"tanh"`` applies that GELU, ``""`` none) by
    oneDNN on the packed copy of ``weight`` a :class:`FastDecoder` registered; a plain matmul if there is
    none. The compiled step calls it as an operator of its own, one opaque kernel (:func:`_packed_op`)."""
    entry = _PACKED.get(_packed_key(weight))
    if entry is None:
        y = F.linear(x, weight, bias)
        return F.gelu(y, approximate=gelu) if gelu else y
    attr = "gelu" if gelu else "none"
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), entry[0], bias, attr, [], gelu)


_PACKED_OP: Any = None  # torch.ops.attnlab.packed_linear, once a decoder has registered it


def _packed_op() -> Any:
    """The operator ``attnlab::packed_linear`` over :func:`packed_linear`, registered by the first
    decoder that compiles a packed step (not when attnlab is imported: a process that never needs it,
    a training run's, registers nothing)."""
    global _PACKED_OP
    with _PACKED_LOCK:
        if _PACKED_OP is None:
            op = torch.library.custom_op("attnlab::packed_linear", packed_linear, mutates_args=())
            op.register_fake(lambda x, weight, bias, gelu: x.new_empty((*x.shape[:-1], weight.shape[0])))
            _PACKED_OP = op
    return _PACKED_OP


# --------------------------------------------------------------------------------------------
# Greedy decoding's head, screened in bfloat16
# --------------------------------------------------------------------------------------------
# A float32 head of a large vocabulary is a third of what a step reads (GPT-2-small: 154 of 495 MB).
# Greedy decoding needs only its argmax: :class:`ScreenedHead` reads a bfloat16 copy (half the bytes) and
# scores the best few exactly. Vocabularies smaller than this keep the plain head (the `tiny` preset's 256).
SCREEN_MIN_VOCAB = 4096
SCREEN_CANDIDATES = 16  # tokens per row scored exactly: enough that the gap to the 16th best covers the bound
# The candidates come from the SCREEN_CANDIDATES blocks of this many tokens with the largest maxima (see
# ScreenedHead._candidates), not a top-k over the whole vocabulary: GPT-2-small's 8 rows 599 -> 244 us.
_SCREEN_BLOCK = 64
# Steps a generation must run for its decoder to screen: making the copy and its bounds takes some 100 ms for
# GPT-2-small's head (Intel Xeon, 2 threads), what 20 steps of a batch of 8 save.
SCREEN_MIN_STEPS = 32


def screens(model: nn.Module, device: torch.device) -> bool:
    """Whether greedy decoding of ``model`` on ``device`` may take its tokens from a :class:`ScreenedHead`:
    a float32 head (no bias, no soft cap) of at least :data:`SCREEN_MIN_VOCAB` rows, on a CPU whose
    bfloat16 matmuls are native (:func:`attnlab.hardware.bf16_native`; emulated, the screen would cost
    more than the float32 head)."""
    w = model.out_head.weight
    return (
        device.type == "cpu"
        and w.dtype == torch.float32
        and getattr(model.out_head, "bias", None) is None
        and model.config.logit_softcap is None
        and w.shape[0] >= SCREEN_MIN_VOCAB
        and w.numel() * 2 <= _PACK_MAX_BYTES  # (the copy is held while a generation runs, as packed weights are)
        and hardware.bf16_native(device)
        and packs(torch.empty(0, dtype=torch.bfloat16), 2)  # oneDNN's bfloat16 product (F.linear's is slower)
    )


def _bf16_panels(w: Tensor) -> Tensor:
    """``w (V, C)`` float32 as :func:`attnlab.kernels.rows_linear`'s bfloat16 panels ``(ceil(V / 48), C,
    48)``, rounded to the nearest even; rows past ``V`` zero. One pass, where a bfloat16 copy and oneDNN's
    packing of it took two (GPT-2-small's head: 73 against 90 ms, Intel Xeon, 2 threads)."""
    V, C = w.shape
    full, P = V // 48, -(-V // 48)
    panels = torch.empty(P, C, 48, dtype=torch.bfloat16, device=w.device)
    panels[:full].copy_(w[: full * 48].view(full, 48, C).transpose(1, 2))
    if full < P:  # (the last panel's rows past V: zeros, whose screen values are sliced off)
        tail = w.new_zeros(48, C)
        tail[: V - full * 48] = w[full * 48 :]
        panels[full].copy_(tail.T)
    return panels


class ScreenedHead:
    """The greedy token of a float32 head ``w (V, C)`` from a bfloat16 screen of every row and an exact
    score of the best few: the argmax of ``h @ w.T`` without reading all of ``w`` in float32.

    One step, for the final-normed ``h (B, C)``:

    1. The screen ``s = bf16(h) @ bf16(w).T`` (float32 sums), ``(B, V)``: half the bytes. On an Intel CPU
       by :func:`attnlab.kernels.rows_linear` on bfloat16 panels (a float32 result; GPT-2-small's 8 rows
       5.3-5.7 ms against oneDNN's 6.5-7.0, Intel Xeon, 2 threads), else by oneDNN (a bfloat16 result).
    2. Its :data:`SCREEN_CANDIDATES` best ids per row; their logits ``h . w_j`` in float32 (the rows of
       ``w`` gathered).
    3. The best of those is the argmax if it beats every other token's logit for certain. Each logit is
       within ``e`` of ``s_j + u |s_j|``: ``h . w_j - s_j`` is ``(h - bf16(h)) . w_j + bf16(h) . (w_j -
       bf16(w_j))`` plus the screen's own sums and rounding, so ``e = |h - bf16(h)| . max_j |w_j|
       + |bf16(h)| . 2^(e_k - 8) + C 2^-23 |bf16(h)| max_j |bf16(w_j)|`` (``2^e_k <= max_j |w_jk| <
       2^(e_k + 1)``: bfloat16's largest rounding in column k; the maxima taken once), and ``u = 2^-8``,
       bfloat16's rounding. A token left out has ``s_j`` at most
       the worst candidate's ``t``, so its logit is at most ``t + u |t| + e``, and a best candidate
       above that wins. A row where it is not (or where anything is NaN) takes its logits in float32
       from all of ``w``, as without the screen; NaN logits raise there as they would. (SmolLM2, two
       batches of 8 random prompts, 2,032 rows: ``e`` 1.5-2.3 where the screen's largest error was
       0.13-0.27; 17 rows not sure. GPT-2-small's random weights: 2 of 2,032.)

    Ties among the candidates go to the smallest id, as ``argmax`` does. The result is the argmax of
    the float32 logits up to their own rounding: two tokens within a few float32 ulps of each other
    may come out either way, as they may between any two float32 kernels.

    The copy (``V x C`` bfloat16: half the head's bytes) is made by the decoder of each greedy generation
    and freed with it, so an edit to the weight between generations is always seen.
    """

    def __init__(self, w: Tensor, rows: int) -> None:
        w = w.detach()  # (V, C) float32
        self.w, C = w, w.shape[1]
        # Rounding to bfloat16 (to nearest, 8 significant bits) moves an entry of [2^e, 2^(e+1)) by at most
        # 2^(e-8), and a row's norm by at most 2^-8 of it: bounds from one pass over w each, where the exact
        # maxima would take the bfloat16 copy apart again.
        self.col = torch.maximum(w.amax(0), -w.amin(0))  # (C,) max_j |w_jk| (aminmax took 5x as long)
        binade = torch.frexp(self.col).exponent - 1  # (C,) e of max_j |w_jk|: every entry is below 2^(e+1)
        # (C,) >= max_j |w_jk - bf16(w_jk)|, and the 2^-126 a CPU's bfloat16 kernel may read a subnormal entry as 0
        self.err = torch.ldexp(torch.ones_like(self.col), binade - 8) + 2.0**-126
        # What flushing to zero below 2^-126 may cost one logit: h's subnormal entries read as 0 (each at most
        # 2^-126 times its column), each of the C products and the result itself.
        self.flush = 2.0**-126 * (self.col.sum() + C + 1)
        self.sums = C * 2.0**-23 * (1 + 2.0**-8) * torch.linalg.vector_norm(w, dim=1).max()  # see the docstring
        if kernels.available():  # attnlab's kernel on bfloat16 panels: float32 sums, a float32 screen
            self.wb = _bf16_panels(w)  # (ceil(V / 48), C, 48)
        else:  # oneDNN's on its packing of the bfloat16 copy (a bfloat16 screen)
            wb = w.to(torch.bfloat16)  # (V, C)
            self.wb = pack_linear(wb, max(rows, 2)) if packs(wb, max(rows, 2)) else wb
        self.screened = self.unsure = 0  # rows screened, and of them rows not sure (taken from all of w)
        # Block b: the ids b + j * nb (j < _SCREEN_BLOCK), strided so that the blocks' maxima are elementwise
        # maxima of contiguous stretches; the last V - nb * _SCREEN_BLOCK ids are candidates always.
        V, self.nb = w.shape[0], w.shape[0] // _SCREEN_BLOCK
        self.offsets = torch.arange(_SCREEN_BLOCK, device=w.device) * self.nb  # (_SCREEN_BLOCK,)
        self.tail = torch.arange(_SCREEN_BLOCK * self.nb, V, device=w.device)  # (V mod _SCREEN_BLOCK,)

    def _candidates(self, screen: Tensor) -> tuple[Tensor, Tensor]:
        """The :data:`SCREEN_CANDIDATES` largest screen values of each row of ``screen (B, V)`` and their
        ids, each ``(B, n)``, unsorted: those of a top-k over each row. Each row's n largest lie in the n
        blocks whose maxima are largest (a block holding one of them has a maximum at least the n-th
        largest value, and at most n blocks do), so the top-k runs over those blocks and the tail only;
        any token left out is at most the smallest candidate (its block's maximum is), as argmax's bound
        needs. A NaN is a maximum (as topk takes it), so it reaches the candidates."""
        B = screen.shape[0]
        if self.nb < SCREEN_CANDIDATES:  # (a head too small for the blocks: screens() asks for more rows)
            top = screen.topk(SCREEN_CANDIDATES, dim=-1, sorted=False)
            return top.values, top.indices
        body = screen[:, : _SCREEN_BLOCK * self.nb].unflatten(1, (_SCREEN_BLOCK, self.nb))  # (B, 64, nb)
        blocks = body.amax(1).topk(SCREEN_CANDIDATES, dim=-1, sorted=False).indices  # (B, n)
        ids = (blocks.unsqueeze(-1) + self.offsets).flatten(1)  # (B, n * 64)
        ids = torch.cat([ids, self.tail.expand(B, -1)], dim=1)  # (B, n * 64 + V mod 64)
        top = screen.gather(1, ids).topk(SCREEN_CANDIDATES, dim=-1, sorted=False)  # (B, n)
        return top.values, ids.gather(1, top.indices)

    def argmax(self, h: Tensor) -> Tensor:
        """``h (B, C)`` float32 -> the greedy tokens ``(B,)``. Logits that hold NaN or +inf (where a row
        could not be screened, its float32 logits are checked) raise ValueError, as
        :func:`attnlab.checks.check_model_logits` does."""
        hb = h.to(torch.bfloat16)  # (B, C)
        hbf = hb.float()  # (B, C): bf16(h), exactly
        if self.wb.dim() == 3:  # (B, V) float32: attnlab's kernel on the panels (past V, the padding's zeros)
            screen = kernels.rows_linear(hbf, self.wb)[:, : self.w.shape[0]]
        else:  # (B, V) bfloat16: oneDNN's kernel on the packed copy
            screen = _matvec(hb, self.wb, None, "plain")
        values, ids = self._candidates(screen)  # (B, n) each
        ids = ids.sort(dim=-1).values  # (B, n): ascending, so the first of equal maxima wins
        exact = torch.bmm(F.embedding(ids, self.w), h.unsqueeze(-1)).squeeze(-1)  # (B, n, C) @ (B, C, 1) -> (B, n)
        best = exact.max(dim=-1)  # (B,)
        tokens = ids.gather(-1, best.indices.unsqueeze(-1)).squeeze(-1)  # (B,)
        e = (h - hbf).abs() @ self.col + hbf.abs() @ self.err + torch.linalg.vector_norm(hbf, dim=-1) * self.sums
        e = e + self.flush  # (B,)
        t = values.amin(dim=-1).float()  # (B,) the worst candidate's screen value
        sure = best.values > t + 2.0**-8 * t.abs() + e * 1.001  # (B,); False where anything is NaN
        self.screened += h.shape[0]
        if bool(sure.all()):
            return tokens
        unsure = (~sure).nonzero().squeeze(1)  # (b,)
        self.unsure += len(unsure)
        logits = F.linear(h[unsure], self.w)  # (b, V): as without the screen
        check_model_logits(logits)
        return tokens.index_put_((unsure,), greedy_tokens(logits))


# --------------------------------------------------------------------------------------------
# The math of one step (one function for every layer: the compiled version is compiled once)
# --------------------------------------------------------------------------------------------
def _norm(x: Tensor, w: Tensor | None, b: Tensor | None, spec: tuple | None) -> Tensor:
    """The block's LayerNorm / RMSNorm / Gemma's offset RMSNorm as functions (``spec``: kind, eps, offset)."""
    if spec is None:
        return x
    kind, eps, offset = spec
    if kind == "ln":
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)
    if offset == 0:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (offset + w.float())).type_as(x)


def _wide(t: Tensor) -> Tensor:
    """``t`` in float32 if it is a half type (for sums and softmax), else as it is (float64 stays)."""
    return t.float() if t.element_size() < 4 else t


def _matvec(x: Tensor, w: Tensor, b: Tensor | None, how: str) -> Tensor:
    """``x @ w.T + b``. ``how``: ``"reduce"`` (compiled: one row, or a batch of a small model on a CPU,
    see :func:`_batch_products`): a multiply-and-sum that inductor fuses into one loop streaming ``w``
    (accumulating in float32), instead of the BLAS call of a few-row matmul; ``"streams"`` (compiled,
    one row of a model whose weights stream from memory): the same as :data:`_STREAMS` sums at once,
    each over its own block of ``w``'s rows (on a CPU, where the rows divide evenly); ``"rows"``
    (compiled, a small model's batch of up to :data:`_ROWS` rows): the same sum for each row of ``x (B, ..., K)``
    apart, which inductor fuses into one loop over ``w`` with ``B`` independent sums (over a broadcast
    batch it sums one row's output at a time, a chain of dependent additions bound by their latency);
    ``"packed"`` (compiled, a batch): :func:`packed_linear`; ``"eager"`` (the eager step):
    :func:`attnlab.hardware.linear`; ``"bf16"`` (the eager step of one bfloat16 row, see
    :class:`FastDecoder`): :func:`attnlab.kernels.bf16_linear`; ``"plain"``: a matmul."""
    if how == "bf16":
        return kernels.bf16_linear(x, w, b)
    if w.dtype == torch.uint8:  # a GGUF file's blocks, for attnlab's own kernel (see _blocks)
        return kernels.block_linear(x, w, b)
    if w.dim() == 3:  # panels for attnlab's own kernel of a few float32 rows (see FastDecoder._pack)
        return kernels.rows_linear(x, w, b)
    if w.layout == torch._mkldnn:  # prepacked for oneDNN (see pack_linear): the bias added in the same call
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    if how == "packed":
        return _PACKED_OP(x, w, b, "")
    if how == "eager":  # (float32 on a CPU: oneDNN's matmul, or MKL's on an Intel CPU: see hardware.linear)
        return hardware.linear(x, w, b)
    if how not in ("rows", "reduce", "streams"):
        return F.linear(x, w, b)
    xw, ww = _wide(x).unsqueeze(-2), _wide(w)  # (..., 1, K), (N, K)
    N = w.shape[0]
    if how == "rows":  # one sum per row, which inductor fuses into one loop: w read once for all rows
        y = torch.stack([(r * ww).sum(-1) for r in xw.unbind(0)])  # (B, ..., N)
    elif how == "streams" and N % _STREAMS == 0 and w.device.type == "cpu":  # (see _STREAMS)
        y = torch.cat([(xw * wg).sum(-1) for wg in ww.view(_STREAMS, N // _STREAMS, -1).unbind(0)], dim=-1)
    else:
        y = (xw * ww).sum(-1)  # (..., N)
    y = y.to(x.dtype)
    return y if b is None else y + b


def _mlp(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, kind: str, how: str) -> Tensor:
    mlp, approximate = kind
    if mlp == "gelu" and w1.layout == torch._mkldnn:  # prepacked: the GELU applied by the matmul's kernel
        return _matvec(torch.ops.mkldnn._linear_pointwise(x, w1, b1, "gelu", [], approximate), w2, b2, how)
    if mlp == "gelu" and how == "packed" and w1.dim() == 2:
        return _matvec(_PACKED_OP(x, w1, b1, approximate), w2, b2, how)
    h = _matvec(x, w1, b1, how)
    if mlp == "gelu":
        h = F.gelu(h, approximate=approximate)
    elif mlp == "relu2":
        h = F.relu(h).square()
    else:  # swiglu / geglu: [gate | up]
        gate, up = h.chunk(2, dim=-1)
        h = (F.silu(gate) if mlp == "swiglu" else F.gelu(gate, approximate=approximate)) * up
    return _matvec(h, w2, b2, how)


def _layer(
    x: Tensor,
    cos: Tensor | None,
    sin: Tensor | None,
    keys: Tensor,
    values: Tensor,
    slot: Tensor,
    w: tuple,
    spec: tuple,
    static: bool,
    observe: Any = None,
    seen: list | None = None,
    filled: int | None = None,
) -> Tensor:
    """One block for one new token per row: ``x (B, 1, C)`` -> ``(B, 1, C)``.

    ``keys``/``values`` ``(B, Hkv, M, hd)``: the layer's cache buffers; the new key and value go to
    slot ``slot`` (a 0-d int64 tensor). ``static``: attend over all ``M`` slots with a mask (shapes
    never change: the compiled step), or with ``spec``'s ``own_attention`` by attnlab's kernel over the
    filled ones (:func:`attnlab.kernels.decode_attention`); else over the ``filled`` first slots (``slot``
    then a Python int; ``filled`` by default ``slot + 1``, all of a wrapped ring's slots).
    ``w``: the layer's tensors (see :meth:`FastDecoder._weights`); ``spec``: its constants.
    ``observe(q, keys, values, weights, heads)``: called with the attention weights, computed
    explicitly then (not static). ``seen`` (static): a list that gets the layer's ``(q (B, H, 1, hd),
    weights (B, H, 1, M), head outputs (B, H, 1, hd))`` for the observers, called after the compiled call.
    """
    n1w, n1b, wqkv, bqkv, qnw, knw = w[:6]  # (the rest: _after_attention's)
    norm, qk_norm, qspec, H, Hkv, hd, rd, scale = spec[:8]
    batch, own_attention, whole = spec[11:]
    B = x.shape[0]
    if static and whole:  # the whole block in one call of attnlab's kernel (see FastDecoder)
        rope = None if cos is None else (cos.reshape(-1), sin.reshape(-1))
        observed = seen is not None
        products = tuple(w[j] for j in _WHOLE)
        x, q, att, weights = kernels.block_layer(x, rope, keys, values, slot, products, H, scale, norm[1], observed)
        if observed:  # (the records' parts, as below)
            seen.append((q, weights.reshape(B, H, 1, keys.shape[2]), att.reshape(B, H, 1, hd)))
        return x
    how = _how(static, B, batch)
    h = _norm(x, n1w, n1b, norm if n1w is not None else None)
    q, k, v = _matvec(h, wqkv, bqkv, how).split([H * hd, Hkv * hd, Hkv * hd], dim=-1)  # (B, 1, .) x3
    if qk_norm == "full":  # all heads' queries (keys) together (OLMo 2)
        q, k = _norm(q, qnw, None, qspec), _norm(k, knw, None, qspec)
    q, k, v = q.view(B, 1, H, hd), k.view(B, 1, Hkv, hd), v.view(B, 1, Hkv, hd)
    if qk_norm is True:  # each head
        q, k = _norm(q, qnw, None, qspec), _norm(k, knw, None, qspec)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, 1, hd), (B, Hkv, 1, hd) x2
    if cos is not None:
        if rd == hd:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # partial rotary: the first rd features turn
            q = torch.cat([apply_rope(q[..., :rd], cos, sin), q[..., rd:]], dim=-1)
            k = torch.cat([apply_rope(k[..., :rd], cos, sin), k[..., rd:]], dim=-1)
    G = H // Hkv
    if static:
        keys.index_copy_(2, slot.view(1), k.to(keys.dtype))  # (B, Hkv, M, hd): the new key in its slot
        values.index_copy_(2, slot.view(1), v.to(values.dtype))
        M = keys.shape[2]
        qg = q.reshape(B, Hkv, G, hd)  # the G query heads that share each key head
        if own_attention:  # attnlab's kernel over the filled slots only (see FastDecoder)
            if seen is None:
                att = kernels.decode_attention(qg, keys, values, slot, scale)  # (B, Hkv, G, hd)
            else:  # and its weights for the observers (0 at the empty slots)
                att, weights = kernels.decode_attention_weights(qg, keys, values, slot, scale)  # (B, Hkv, G, .) x2
                seen.append((q, weights.reshape(B, H, 1, M), att.reshape(B, H, 1, hd)))
            return _after_attention(x, att, w, spec, how)
        filled = torch.arange(M, device=x.device) <= slot  # (M,): the slots written so far
        # The products as multiply-and-sum loops inductor fuses (no two bmm calls a layer; every row of
        # a batch attends to its own cache, so a batch shares no reads a matmul could reuse).
        # The softmax's division after the sum over the slots: the exponentials are a stored (B, Hkv, G, M)
        # result, their products with the values stay inside the sum's loop (no (B, Hkv, G, M, hd) buffer).
        scores = (_wide(qg).unsqueeze(-2) * _wide(keys).unsqueeze(2)).sum(-1) * scale  # (B, Hkv, G, M)
        scores = scores.masked_fill(~filled, float("-inf"))
        e = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # (B, Hkv, G, M): 0 at empty slots
        att = (e.unsqueeze(-1) * _wide(values).unsqueeze(2)).sum(-2) / e.sum(-1, keepdim=True)  # (B, Hkv, G, hd)
        att = att.to(values.dtype)
        if seen is not None:  # (0 at the empty slots: the caller cuts the weights to the filled ones)
            weights = (e / e.sum(-1, keepdim=True)).to(q.dtype).reshape(B, H, 1, M)
            seen.append((q, weights, att.reshape(B, H, 1, hd)))
        heads = att.reshape(B, 1, H * hd)
    else:
        keys[:, :, slot] = k[:, :, 0].to(keys.dtype)
        values[:, :, slot] = v[:, :, 0].to(values.dtype)
        S = slot + 1 if filled is None else filled
        K, V = keys[:, :, :S], values[:, :, :S]  # (B, Hkv, S, hd): the filled slots
        if observe is None:
            att = F.scaled_dot_product_attention(q, K, V, scale=scale, enable_gqa=G > 1)  # (B, H, 1, hd)
        else:  # an observer reads the weights: explicit, as the eager forward computes them then
            Kx, Vx = (K.repeat_interleave(G, dim=1), V.repeat_interleave(G, dim=1)) if G > 1 else (K, V)
            weights = torch.softmax(q @ Kx.transpose(-1, -2) * scale, dim=-1)  # (B, H, 1, S)
            att = weights @ Vx  # (B, H, 1, hd)
            observe(q, K, V, weights, att)
        heads = att.transpose(1, 2).reshape(B, 1, H * hd)
    return _after_attention(x, heads, w, spec, how)


def _after_attention(x: Tensor, heads: Tensor, w: tuple, spec: tuple, how: str) -> Tensor:
    """The rest of :func:`_layer` from the heads' outputs ``heads (B, ...)`` (``B * H * hd`` values in
    head order): the output projection, the residuals and the MLP -> ``(B, 1, C)``."""
    (_, _, _, _, _, _, wo, bo, p1w, p1b, n2w, n2b, w1, b1, w2, b2, p2w, p2b) = w
    norm, mlp, parallel, post = spec[0], spec[8], spec[9], spec[10]
    out = _matvec(heads.reshape(x.shape[0], 1, -1), wo, bo, how)  # (B, 1, C)
    if post:
        out = _norm(out, p1w, p1b, norm)
    if parallel:
        return x + out + _mlp(_norm(x, n2w, n2b, norm), w1, b1, w2, b2, mlp, how)
    x = x + out
    ff = _mlp(_norm(x, n2w, n2b, norm if n2w is not None else None), w1, b1, w2, b2, mlp, how)
    if post:
        ff = _norm(ff, p2w, p2b, norm)
    return x + ff


def _llama_block(block: nn.Module, norm: tuple, mlp: str) -> bool:
    """Whether ``block`` (its norms ``norm``, its MLP ``mlp``: see GPTConfig) is what
    :func:`attnlab.kernels.block_layer` computes: RMSNorm (no offset) before attention and before the MLP
    and nowhere else, no query or key norm, RoPE over every feature or none, SwiGLU, sequential
    residuals, and no bias anywhere."""
    att, ff = block.att, block.ff.layers
    linear = [att.W_query, att.W_key, att.W_value, att.out_proj, ff[0], ff[2]]
    return (
        norm[0] == "rms"
        and norm[2] == 0
        and block.norm1 is not None
        and block.norm2 is not None
        and block.post_norm1 is None
        and block.post_norm2 is None
        and not att.qk_norm
        and (not att.rope or att.rope_dim == att.head_dim)
        and mlp == "swiglu"
        and not block.parallel_residual
        and all(getattr(m, "bias", None) is None for m in [*linear, block.norm1, block.norm2])
    )


def _one_call(model: nn.Module, caches: list[Any], shaped: list[bool]) -> bool:
    """Whether each step of ``model`` over ``caches`` may be one call of :func:`attnlab.kernels.block_step`,
    its products aside (each block's on its blocks or a bfloat16 model's matrices, and the head's, are the
    caller's to check): every block Llama-style (``shaped``, see :func:`_llama_block`) with the model's
    one RoPE, the same heads, scale and position records in every block; the final norm without bias, no
    soft cap; the caches contiguous."""
    cfg, atts = model.config, [block.att for block in model.trf_blocks]
    if not all(shaped) or cfg.pos != "rope" or cfg.logit_softcap is not None or len(model.rope_sources) != 1:
        return False
    if getattr(model.final_norm, "bias", None) is not None or not all(att.rope for att in atts):
        return False
    kinds = {(a.num_heads, a.num_kv_heads, a.head_dim, a.scale, a.has_positions) for a in atts}
    return len(kinds) == 1 and all(c.keys.is_contiguous() and c.values.is_contiguous() for c in caches)


def _how(static: bool, rows: int, batch: str) -> str:
    """How :func:`_matvec` multiplies in a step of ``rows`` rows (``static``: the compiled step; ``batch``:
    how its decoder's compiled step multiplies a batch, :func:`_batch_products`, or ``"bf16"``: the eager
    step's one bfloat16 row by attnlab's kernel, see :class:`FastDecoder`)."""
    if batch == "bf16":
        return batch
    if not static:
        return "eager"
    if rows == 1:  # a small model's weights stay in the CPU's caches: one sum at a time keeps up there
        return "reduce" if batch == "reduce" else "streams"
    return "rows" if batch == "reduce" and rows <= _ROWS else batch


def _head(
    x: Tensor,
    nw: Tensor | None,
    nb: Tensor | None,
    w: Tensor,
    norm: tuple,
    cap: float | None,
    batch: str,
    static: bool,
):
    """Final norm and output head of ``x (B, 1, C)``: logits ``(B, V)`` (Gemma 2's soft cap with ``cap``)."""
    logits = _matvec(_norm(x[:, -1], nw, nb, norm), w, None, _how(static, x.shape[0], batch))  # (B, V)
    return logits if cap is None else cap * torch.tanh(logits / cap)


def _layers(
    x: Tensor,
    ropes: tuple[list, tuple],
    keys: list[Tensor],
    values: list[Tensor],
    positions: list[Tensor | None],
    slot: Tensor,
    ws: list[tuple],
    specs: list[tuple],
    head: tuple | None,
    seen: list | None = None,
) -> Tensor:
    """Layers in a row over their static caches (the compiled step: one call, one graph, for all of
    them): ``x (B, 1, C)`` -> ``(B, 1, C)``, or with ``head`` (:func:`_head`'s arguments after ``x``)
    the logits ``(B, V)``. ``ropes``: the layers' RoPE as :meth:`FastDecoder._ropes` gives it. ``positions``: the
    caches' position records (``None`` where a layer keeps none), the new slot's entry written here too.
    ``seen``: see :func:`_layer`."""
    angles, which = ropes
    for i, k, v, p, w, spec in zip(which, keys, values, positions, ws, specs, strict=True):
        cos, sin = (None, None) if i is None else angles[i]
        if p is not None:  # (as the eager update(): the cache records the position of the slot)
            p.index_fill_(1, slot.view(1), slot)
        x = _layer(x, cos, sin, k, v, slot, w, spec, True, seen=seen)
    return x if head is None else _head(x, *head, True)


def _embed(token: Tensor, emb: Tensor, scale: Tensor | None, pos: Tensor | None) -> Tensor:
    """The first block's input ``(B, 1, C)`` for ``token (B,)``: its row of the embedding ``emb``, times
    the embedding's ``scale`` (a 0-d tensor or None), plus its learned position's row ``pos (1, 1, C)``
    (or None)."""
    x = F.embedding(token.view(-1, 1), emb)  # (B, 1, C)
    if scale is not None:
        x = x * scale
    return x if pos is None else x + pos


def _greedy_steps(
    token: Tensor,
    finished: Tensor,
    stop: Tensor | None,
    embed: tuple,
    ropes: tuple[list, tuple],
    slot: Tensor,
    group: tuple,
    head: tuple,
    n: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``n`` greedy decoding steps from ``token (B,)`` at position ``slot`` (a 0-d int64 tensor),
    each step's token the argmax of its logits fed to the next (the compiled chunk of a small model: one
    call, one graph). A row ``finished (B,)`` (it produced one of the ``stop`` ids) keeps emitting the first,
    as :func:`attnlab.generation.next_tokens` does. ``embed``: the token embedding's weight, the embedding
    scale (a 0-d tensor or None) and the learned positions' rows ``(1, n, C)`` (or None); ``ropes``:
    the layers' RoPE at the chunk's positions ``(1, 1, n, rd)``, as :meth:`FastDecoder._ropes` gives it; ``group``:
    :func:`_layers`'s caches, weights and specs; ``head``: :func:`_head`'s arguments after ``x``.
    Returns each step's tokens ``(B, n)``, finished rows after it ``(B, n)`` and logits ``(B, n, V)``."""
    emb, scale, pos_rows = embed
    tokens, done, logits = [], [], []
    for j in range(n):
        x = _embed(token, emb, scale, None if pos_rows is None else pos_rows[:, j : j + 1])  # (B, 1, C)
        rope = ([(c[:, :, j : j + 1], s[:, :, j : j + 1]) for c, s in ropes[0]], ropes[1])
        step = _layers(x, rope, *group[:3], slot + j, *group[3:], head)  # (B, V)
        token = step.argmax(dim=-1)  # (B,): greedy
        if stop is not None:
            token = token.masked_fill(finished, stop[0])
            finished = finished | (token[:, None] == stop).any(dim=-1)
        tokens.append(token)
        done.append(finished)
        logits.append(step)
    return torch.stack(tokens, 1), torch.stack(done, 1), torch.stack(logits, 1)


def _observed_layers(*args: Any) -> tuple[Tensor, list[tuple[Tensor, Tensor, Tensor]]]:
    """:func:`_layers`, and each layer's ``(q, weights, head outputs)`` of the new query (see
    :func:`_layer`), from which the step builds its observers' records after the call. A function of
    its own: compiled apart (one graph per variant, neither recompiling the other's)."""
    seen: list[tuple[Tensor, Tensor, Tensor]] = []
    return _layers(*args, seen), seen


def _attention_rows(*args: Any) -> tuple[Tensor, Tensor]:
    """:func:`_layers`, and the new query's attention weights in every layer, ``(n, B, H, M)`` over all
    slots (0 at the empty ones): one output of the graph for a callback that takes them all at once
    (:func:`attnlab.attention.rows_receiver`), instead of three per layer and a record built from them.
    Compiled apart, as :func:`_observed_layers`."""
    seen: list[tuple[Tensor, Tensor, Tensor]] = []
    x = _layers(*args, seen)
    return x, torch.stack([weights[:, :, 0] for _, weights, _ in seen])  # (n, B, H, M)


VARIANTS = ("plain", "observed", "rows")  # the compiled step's graphs: no observer, records, rows (see step)


@functools.cache
def _compiled(fn: Any, cpp_wrapper: bool = False) -> Any:
    # dynamic=False: the shapes of a generation never change (the cache buffers are preallocated).
    # realize_opcount_threshold: inductor inlines a pointwise result (a norm's output, RoPE's rotation)
    # into each loop that reads it unless it costs more than this many operations: in a matrix-vector
    # product that means once per weight row, not once per step. A low threshold stores such results
    # instead (a few KB): CPU, SmolLM2's layer 10% (float32) to 35% (bfloat16) faster. 5, not 4: a
    # bfloat16 query times a bfloat16 key (two loads, two conversions, a multiply) must stay inside the
    # attention's sum; at 4 inductor stored it, a (B, Hkv, G, M, hd) float32 buffer, and bfloat16
    # attention over 1024 slots took 166 us a layer instead of 102 (SmolLM2's heads, 2 threads).
    # cpp_wrapper: the code around the kernels in C++ (see FastDecoder.chunk_fn).
    options = {"realize_opcount_threshold": 5, "cpp_wrapper": cpp_wrapper}
    return torch.compile(fn, dynamic=False, options=options)


_MATRICES = (2, 6, 12, 14)  # the projections' weights in a layer's tuple of tensors (see FastDecoder._weights)
_WHOLE = (0, 2, 6, 10, 12, 14)  # what attnlab.kernels.block_layer takes of it: the norms and the products


def _blocks(weights: list[tuple], head: Tensor) -> dict:
    """The projections of ``weights`` (each layer's :meth:`FastDecoder._weights`) and the output ``head``
    whose float32 values are exactly a GGUF file's Q4_1, Q4_0 or Q8_0 blocks, as those blocks
    (:func:`attnlab.kernels.pack_blocks`): ``{(layer, index in its tuple) or "head": blocks}``, empty
    where none is (a model not loaded from such a file). Found back from the weights when each generation
    starts, as the fused projections are, never kept between generations (``weight.data[...] = 0`` bumps
    no version counter): SmolLM2's 121 (its 210 projections fused, and the head), some 76 ms on 2 threads
    (Intel Xeon)."""
    found = {}
    if (b := kernels.pack_blocks(head.detach())) is not None:
        found["head"] = b
    for i, w in enumerate(weights):
        for j in _MATRICES:
            if (b := kernels.pack_blocks(w[j].detach())) is not None:
                found[(i, j)] = b
    return found


# --------------------------------------------------------------------------------------------
# The decoder
# --------------------------------------------------------------------------------------------
class FastDecoder:
    """Decoding steps of ``model`` over its KV ``caches`` (one token per row per step).

    Args:
        model: an :class:`attnlab.GPT` for which :func:`supported` holds.
        caches: its per-layer caches, already holding the prompt (the prefill runs the eager forward).
        compile: run each layer (and the head) as a function compiled by ``torch.compile`` over the whole
            preallocated cache. The first step compiles (once per process and shape set).
        steps: how many steps the generation may run (None: unknown). The eager step of one row packs
            a large model's bfloat16 weights for oneDNN (see :func:`packs`) only if it runs enough of them,
            and the eager step reads a GGUF file's blocks (see :func:`_blocks`) only for at least
            :data:`_BLOCK_MIN_STEPS`.
        tokens_only: the generation is greedy and wants each step's token, not its logits: for a batch
            (2 rows or more) of at least :data:`SCREEN_MIN_STEPS` steps where :func:`screens` holds,
            :meth:`step_tokens` finds the argmax by a :class:`ScreenedHead` (the float32 head is then
            neither packed nor read whole).
    """

    def __init__(
        self,
        model: nn.Module,
        caches: list[Any],
        *,
        compile: bool = False,
        steps: int | None = None,
        tokens_only: bool = False,
    ) -> None:
        self.model, self.caches, self.compile = model, caches, compile
        cfg = model.config
        self.cfg = cfg
        norm = ("ln", cfg.ln_eps, 0.0) if cfg.norm == "layernorm" else ("rms", cfg.ln_eps, cfg.norm_offset)
        self.norm = norm
        rows = caches[0].keys.shape[0]
        # On a CPU, a batch (or one row of a large model over many steps): the matmuls on weights prepacked
        # for oneDNN (see _packing), given to the eager step as they are, registered for the compiled one
        # (which calls packed_linear).
        large = _large(model)  # (a walk over the parameters: once)
        cpu = caches[0].keys.device.type == "cpu"
        head_w = model.out_head.weight  # (a float32 batch on an Intel CPU: MKL's matmuls, see _batch_products)
        weights = [self._weights(block) for block in model.trf_blocks]
        # The eager step of a bfloat16 model's one row on an Intel CPU: every product by attnlab's kernel on
        # the weights as they lie (attnlab.kernels.bf16_linear), not oneDNN's on a packed copy made each
        # generation: SmolLM2's fast path 22.1 -> 34.2 tokens/s, the same tokens (Intel Xeon, 2 threads,
        # alternating in one process). A compiled step the one-call step below does not take keeps inductor's
        # loops: the kernel in SmolLM2's graph read its 121 products in 12.6 ms of a 17 ms step, no faster
        # end to end (1.00-1.01x).
        bf16_cache = (
            cpu
            and model.tok_emb.weight.dtype == torch.bfloat16
            and all(c.keys.dtype == c.values.dtype == torch.bfloat16 for c in caches)
        )
        # (a bfloat16 model whose products attnlab's kernel takes as they lie: its one-call step too, below)
        bf16_products = bf16_cache and rows <= _PANEL_ROWS and _bf16_products(weights, head_w)
        self.bf16_matrices = bf16_products and kernels.available()
        bf16 = self.bf16_matrices and rows == 1 and not compile
        shaped = [_llama_block(block, norm, cfg.mlp) for block in model.trf_blocks]  # (block_layer's kind)
        one_call = _one_call(model, caches, shaped)
        # (none packed where the products stay as they lie: one row's bf16_linear, or the one-call step's
        # matrices, where its stepper takes them)
        stepped = self.bf16_matrices and one_call
        pack = not bf16 and not stepped and _packing(model, rows, compile, steps, large)
        mkl = rows > 1 and head_w.dtype == torch.float32 and hardware.mkl_runs_float32(caches[0].keys.device)
        self.batch = "bf16" if bf16 else _batch_products(large, pack and compile, cpu, mkl)
        # (a batch only: one row's compiled product streams the float32 head at the machine's read rate, and
        # the screen's calls around a one-row bfloat16 product cost what it saves: SmolLM2 float32, compiled,
        # 39.2 tokens/s screened against 40.9; a batch of 8 of GPT-2-small's size 193.0 against 170.1)
        # A float32 model on an Intel CPU, one row or a batch of up to _PANEL_ROWS: each projection whose
        # float32 weights are exactly a GGUF file's Q4_1, Q4_0 or Q8_0 blocks (a model loaded from one) is
        # multiplied from those blocks (attnlab.kernels.block_linear: a fifth or a quarter of the bytes, the
        # sums those of rows_linear or as close), found back when a generation of at least _BLOCK_MIN_STEPS
        # steps (or of unknown length) starts (see _blocks).
        float32 = head_w.dtype == torch.float32 and caches[0].keys.dtype == torch.float32
        # (where attnlab's kernels may multiply, blocks or panels; available() last: its first call builds them)
        own_kernels = rows <= _PANEL_ROWS and cpu and float32
        # (compiled, always: a graph on the blocks and one on the float32 weights are two compilations, and
        # serve's precompiled graphs read the blocks whatever a request's length)
        enough = compile or steps is None or steps >= _BLOCK_MIN_STEPS
        quantized = own_kernels and enough and kernels.available()
        self.blocks = _blocks(weights, head_w) if quantized else {}
        long = steps is None or steps >= SCREEN_MIN_STEPS
        screened = tokens_only and rows > 1 and long and screens(model, caches[0].keys.device)
        # (a head read from its blocks reads fewer bytes than the screen's bfloat16 copy)
        self.screen = ScreenedHead(head_w, rows) if screened and "head" not in self.blocks else None
        # A float32 batch of a large model on an Intel CPU: attnlab's own kernels for the products (see
        # _pack) and, in the compiled step, for attention over the cache's filled slots (see _layer); so too
        # one row whose weights come from their blocks.
        self.panels = pack and rows >= 2 and own_kernels and kernels.available()
        contiguous = all(c.keys.is_contiguous() and c.values.is_contiguous() for c in caches)
        own = self.panels or bool(self.blocks)  # (products on attnlab's kernels)
        own_attention = own and compile and contiguous
        self.layers = []
        llama = []  # each block Llama-style, its products on their blocks or bfloat16 matrices (<= _PANEL_ROWS rows)
        for i, (block, w) in enumerate(zip(model.trf_blocks, weights, strict=True)):
            att = block.att
            llama.append(shaped[i] and (self.bf16_matrices or all((i, j) in self.blocks for j in _MATRICES)))
            # Such a block: the compiled step runs it whole in one call of attnlab's kernel
            # (attnlab.kernels.block_layer), not 5 operators and 3 of inductor's loops.
            whole = own_attention and llama[-1]
            spec = (
                norm,
                att.qk_norm,
                None if att.q_norm is None else ("rms", att.q_norm.eps, getattr(att.q_norm, "offset", 0.0)),
                att.num_heads,
                att.num_kv_heads,
                att.head_dim,
                att.rope_dim if att.rope else 0,
                att.scale,
                (cfg.mlp, _ACT[cfg.activation]),
                block.parallel_residual,
                block.post_norm1 is not None,
                self.batch,
                own_attention,
                whole,
            )
            self.layers.append((w, spec, att.window, block.local_rope, att.has_positions))
        self.head = (
            model.final_norm.weight,
            getattr(model.final_norm, "bias", None),
            model.out_head.weight,
            cfg.logit_softcap,
        )
        if pack or self.blocks:
            self._pack(rows, compile, pack)
        # (on attnlab's kernels, whose operators are C++: the code around them in C++ too, inductor's
        # cpp_wrapper; SmolLM2's batch of 8, 232.0 -> 258.2 tokens/s, Intel Xeon, 2 threads)
        self.layers_fn = _compiled(_layers, own) if compile else None
        # (compiled at their first calls; on attnlab's kernels in C++ too: serve's float32 stream of SmolLM2
        # from its blocks, 85.2 -> 101.6 tokens/s, 0.71x -> 0.85x `generate(compile=True)`)
        self.observed_fn = _compiled(_observed_layers, own) if compile else None
        self.rows_fn = _compiled(_attention_rows, own) if compile else None
        # (the rows of all layers are one tensor of the graph's: caches of one size)
        self.even = len({cache.max_length for cache in caches}) == 1
        # On CUDA the unobserved compiled step is captured in a CUDA graph at its first call (see _replay).
        self.cuda_graph = compile and caches[0].keys.is_cuda
        self.graph = None
        self.head_fn = _compiled(_head) if compile else None
        # Greedy steps a compiled call (greedy_steps): a small model on a CPU, whose steps are short (a
        # GPU's are captured in a CUDA graph; a large model's steps read its weights for milliseconds).
        self.chunk = _CHUNK if compile and cpu and not large and len(model.trf_blocks) <= _GROUP else 1
        # Its code around the kernel in C++ (inductor's cpp_wrapper): the Python one allocates 163 buffers and
        # makes 317 views of them a call of the `tiny` preset's batch of 8, 0.4 of its 2.3 ms. A generation
        # of 32 tokens: 28.6 -> 27.0 ms (Intel Xeon, 2 threads, 160 alternate pairs); both side by side in
        # benchmarks/generate.py's run, 3-5% more tokens/s. The first compile takes 8 s longer (34 -> 42 s
        # with an empty cache).
        self.chunk_fn = _compiled(_greedy_steps, True) if self.chunk > 1 else None
        # The compiled step's calls: groups of up to _GROUP layers (one call each; the last one ends with
        # the head), with the arguments that stay the same from step to step. A model decoding from its
        # blocks (every layer's products) runs all its layers and the head in one call: its products are
        # attnlab's operators, so the graph is small for its layers (the group of 10 and the head's,
        # cold: 31 s to compile; all 30 and the head: 62 s, once per machine in inductor's cache), and
        # each call of the step costs Dynamo's guards and a trip through Python and the graph's wrapper
        # (SmolLM2, float32, in one process: 7.33 -> 6.86 ms a token, Intel Xeon, 2 threads).
        L = len(self.layers)
        on_blocks = all((i, j) in self.blocks for i in range(L) for j in _MATRICES)
        most = L if on_blocks else min(L, _GROUP)
        g = max(d for d in range(1, most + 1) if L % d == 0)  # equal groups: one graph for all
        self.groups = []
        for a in range(0, L, g):
            idx = range(a, min(L, a + g))
            self.groups.append(
                (
                    idx,
                    [caches[i].keys for i in idx],
                    [caches[i].values for i in idx],
                    [caches[i].positions if self.layers[i][4] else None for i in idx],
                    [self.layers[i][0] for i in idx],
                    [self.layers[i][1] for i in idx],
                )
            )
        # Hooks may come and go: checked each step, as C-level scans of lists made here (a step of SmolLM2
        # ran them over 457 modules in Python: some 0.1-0.4 ms of the main thread per token, while the
        # other threads wait).
        self.hook_dicts, self.hookable = _hook_dicts(model.modules()), _hookable(model)
        self.atts = [block.att for block in model.trf_blocks]
        # Each layer's RoPE among a step's distinct (cos, sin) pairs (see _ropes): the model's shared ones
        # (model.rope_angles), then those of a module with a RoPE of its own in a model without; None: none.
        shared = list(model.rope_sources) if cfg.pos == "rope" else []
        self.own_ropes = [att for att in self.atts if att.rope and cfg.pos != "rope"]
        index: list[int | None] = []
        for block, att in zip(model.trf_blocks, self.atts, strict=True):
            if not att.rope:
                index.append(None)
            elif cfg.pos == "rope":
                index.append(shared.index(block.local_rope))
            else:  # (a module of its own RoPE in a model without: its angles, as its forward does)
                index.append(len(shared) + self.own_ropes.index(att))
        self.rope_index = tuple(index)
        windows = [window for _, _, window, _, _ in self.layers]
        self.limits = [min(c.max_length, w or c.max_length) for c, w in zip(caches, windows, strict=True)]
        # A rolling cache whose ring is no longer than its layer's window (so are those new_kv_caches
        # makes) holds only keys the next token attends to, before it wraps and after: its steps stay
        # here past the limit, each new key in the oldest slot (eager; the compiled step's mask counts
        # slots in order, so it hands a wrapped ring to the eager step).
        self.rings = [
            c.rolling and (w is None or c.max_length - c.sinks <= w) for c, w in zip(caches, windows, strict=True)
        ]
        # Every block Llama-style on its blocks (or a bfloat16 model's on its matrices), one RoPE for all, the
        # head likewise: a step (no observer, or serve's rows) is one call of attnlab's kernel,
        # attnlab.kernels.block_step, compiled or not.
        self.amx = False  # (the stepper's products on AMX's tiles: see _stepper)
        self.stepper = self._stepper() if one_call and all(llama) else None

    def _stepper(self) -> dict | None:
        """What :meth:`_whole_step` calls :func:`attnlab.kernels.block_step` with, where it can (every block
        Llama-style on its blocks or a bfloat16 model's matrices, and :func:`_one_call`, checked by the
        caller) and the head is on its blocks (or a bfloat16 matrix). Else None. The caches, weights and
        constants, fixed while the decoder lives; the RoPE's angles for every slot, computed here once
        (``(M, hd)`` each: :attr:`rope_table`)."""
        model = self.model
        if "head" not in self.blocks and not self.bf16_matrices:
            return None
        norm, _, _, H, _, hd, _, scale = self.layers[0][1][:8]  # (every block's the same: _one_call)
        M = max(cache.max_length for cache in self.caches)
        at = torch.arange(M, device=self.caches[0].keys.device).view(1, M)
        # (a bfloat16 model's angles rounded to bfloat16, as its forward takes them)
        dtype = torch.bfloat16 if self.bf16_matrices else torch.float32
        cos, sin = next(iter(model.rope_angles(at, dtype).values()))  # (1, 1, M, hd) each
        self.rope_table = cos.reshape(M, hd).float(), sin.reshape(M, hd).float()
        # A bfloat16 batch multiplies by AMX's tiles where the CPU has them (attnlab.kernels.pack_amx): each
        # product's matrix copied once a generation for them, a step's 8 rows of SmolLM2's products 1.7x
        # faster than widened and multiplied in FMAs (the head keeps its matrix).
        rows = self.caches[0].keys.shape[0]
        mats = [w[j] for w, *_ in self.layers for j in _MATRICES]
        self.amx = (
            self.bf16_matrices and rows > 1 and all(m.shape[0] % 48 == 0 for m in mats) and kernels.amx_available()
        )

        def weight(t: Tensor, j: int) -> Tensor:  # (the norms' weights in float32: a bfloat16 model's copied once)
            if j in (0, 10):
                return t.float()
            return kernels.pack_amx(t) if self.amx else t

        return dict(
            keys=[c.keys for c in self.caches],
            values=[c.values for c in self.caches],
            positions=[c.positions for c in self.caches] if self.layers[0][4] else [],
            layers=[weight(w[j], j) for w, *_ in self.layers for j in _WHOLE],
            heads=H,
            scale=scale,
            eps=norm[1],
            final_norm=self.head[0].float(),
            head=self.head[2],
        )

    def _whole_step(self, token: Tensor, pos: int, rows: bool) -> tuple[Tensor, Any]:
        """The step for ``token (B,)`` at slot ``pos`` as one call of :func:`attnlab.kernels.block_step`
        (see :attr:`stepper`): the logits ``(B, V)`` and, with ``rows``, every layer's attention weights
        over the filled slots ``(L, B, H, pos + 1)`` (:func:`_attention_rows`' cut as the caller cuts them),
        in the model's dtype."""
        x = _embed(token, self.model.tok_emb.weight, self._embed_scale(), None)  # (B, 1, C)
        rope = (self.rope_table[0][pos], self.rope_table[1][pos])  # (hd,) each
        logits, seen = kernels.block_step(x, rope, slot=torch.tensor(pos), with_weights=rows, **self.stepper)
        return logits, seen.to(logits.dtype) if rows else seen  # (a bfloat16 model's: float32 from the kernel)

    def _pack(self, rows: int, compile: bool, pack: bool) -> None:
        """The projections' weights (and the head's, unless screened: then the float32 head is read only
        where a row cannot be) as the step multiplies them: those with GGUF blocks (:func:`_blocks`) swap
        for them; with ``pack``, a float32 batch of up to :data:`_PANEL_ROWS` rows swaps each other one
        for its panels where :func:`attnlab.kernels.available` (see :func:`_matvec`); else the eager step
        swaps it for its oneDNN packing, and the compiled one registers it, while this decoder lives, for
        the operator its graph calls (:func:`packed_linear`)."""

        def swap(t: Tensor, key: Any) -> Tensor | None:  # (None: registered)
            if key in self.blocks:
                return self.blocks[key]
            if not pack:
                return t
            if self.panels and kernels.panel_width(t):
                return kernels.pack_panels(t)
            return None if compile else pack_linear(t, rows)

        registered = []
        if self.screen is None:
            head = swap(self.head[2], "head")
            if head is None:
                registered.append(self.head[2])
            else:
                self.head = (*self.head[:2], head, self.head[3])
        for i, (w, *rest) in enumerate(self.layers):
            w = list(w)
            for j in _MATRICES:
                packed = swap(w[j], (i, j))
                if packed is None:
                    registered.append(w[j])
                else:
                    w[j] = packed
            self.layers[i] = (tuple(w), *rest)
        if compile and pack:  # (the graph's products on plain weights call it: here, the head if screened)
            _packed_op()
        if registered:
            weakref.finalize(self, _release_packs, _register_packs(registered, rows))

    @staticmethod
    def _weights(block: nn.Module) -> tuple:
        att, ff = block.att, block.ff.layers

        def nb(m: nn.Module | None) -> tuple[Tensor | None, Tensor | None]:
            return (None, None) if m is None else (m.weight, getattr(m, "bias", None))

        wqkv, bqkv = fused_qkv(att)
        return (
            *nb(block.norm1),
            wqkv,
            bqkv,
            None if att.q_norm is None else att.q_norm.weight,
            None if att.k_norm is None else att.k_norm.weight,
            att.out_proj.weight,
            att.out_proj.bias,
            *nb(block.post_norm1),
            *nb(block.norm2),
            ff[0].weight,
            ff[0].bias,
            ff[2].weight,
            ff[2].bias,
            *nb(block.post_norm2),
        )

    def fits(self) -> bool:
        """Whether the next step may run here: a free slot within every layer's window in every cache, or
        a rolling cache no longer than the window (past it, only without observers), so attention
        covers exactly the filled slots; and no hook set on the model since (those run the eager forward)."""
        if not _plain_modules(self.hook_dicts, self.hookable):
            return False
        # (a free slot, and within the window: seen < max_length and seen + 1 <= window; or a ring)
        past = [cache.seen >= limit for cache, limit in zip(self.caches, self.limits, strict=True)]
        if not any(past):
            return True
        # Past a limit: rings only, and no observer (its record would need the eager forward's mask
        # and positions of a ring out of order).
        return all(ring for ring, p in zip(self.rings, past, strict=True) if p) and all(
            att.observer is None for att in self.atts
        )

    def step(self, token: Tensor) -> Tensor:
        """Feed ``token (B,)`` (the newest token of each row) and return its logits ``(B, V)``."""
        return self._step(token, True)

    def step_tokens(self, token: Tensor) -> Tensor:
        """Feed ``token (B,)`` and return the greedy next tokens ``(B,)``: the argmax of :meth:`step`'s
        logits, checked as :func:`attnlab.checks.check_model_logits` checks them (ValueError), found by
        the :class:`ScreenedHead` where the decoder has one (``tokens_only``)."""
        if self.screen is None:
            logits = self.step(token)  # (B, V)
            return greedy_tokens(logits, checked=True)
        return self.screen.argmax(self._step(token, False))  # (B, C) -> (B,)

    def _step(self, token: Tensor, head: bool) -> Tensor:
        """A step for ``token (B,)``: with ``head`` the logits ``(B, V)``, else the final norm's output ``(B, C)``."""
        model = self.model
        pos = self.caches[0].seen
        observers = [att.observer for att in self.atts]  # (called with the eager forward's records)
        # (the compiled step, or attnlab's kernel's, compiled or not: see __init__)
        if all(pos < cache.max_length for cache in self.caches) and (
            self.compile or (self.stepper is not None and head and self._variant(observers)[0] != "observed")
        ):
            return self._compiled_step(token, pos, observers, head)
        at = torch.tensor([[pos]], device=token.device)  # (1, 1)
        x, (angles, which) = self._inputs(token, at)
        nw, nb, w_head, cap = self.head
        masks: dict = {}  # the step's observed masks, shared by its layers (see _observer)
        for block, cache, i, (w, spec, _, _, has_positions), fn, ring in zip(
            model.trf_blocks, self.caches, which, self.layers, observers, self.rings, strict=True
        ):
            cos, sin = (None, None) if i is None else angles[i]
            M = cache.max_length
            slot = cache.ring_slot(pos) if ring and pos >= M else pos  # a wrapped ring: its oldest slot
            if has_positions:  # (as the eager update(): the cache records the position of the slot)
                cache.positions[:, slot] = pos
            observe = None if fn is None else self._observer(block.att, cache, at, has_positions, fn, masks)
            x = _layer(x, cos, sin, cache.keys, cache.values, slot, w, spec, False, observe, filled=min(pos + 1, M))
            cache.seen, cache.length = pos + 1, min(pos + 1, M)
        if not head:
            return _norm(x[:, -1], nw, nb, self.norm)  # (B, C)
        return _head(x, nw, nb, w_head, self.norm, cap, self.batch, False)  # (B, V)

    def room(self, steps: int) -> bool:
        """Whether each of the next ``steps`` steps has a free slot within every layer's window in every
        cache (no ring wraps): what :meth:`greedy_steps` needs of the caches."""
        return all(cache.seen + steps <= limit for cache, limit in zip(self.caches, self.limits, strict=True))

    def unobserved(self) -> bool:
        """No hook and no attention observer set on the model: what :meth:`greedy_steps` needs (its steps
        run ahead, in one call, with no record)."""
        return _plain_modules(self.hook_dicts, self.hookable) and all(att.observer is None for att in self.atts)

    def rewind(self, steps: int) -> None:
        """Take back the last ``steps`` steps of :meth:`greedy_steps` (not yet used: a hook came): the
        caches end where those steps began, the next step overwrites their slots."""
        for cache in self.caches:
            cache.length = cache.seen = cache.seen - steps

    def greedy_steps(self, token: Tensor, finished: Tensor, stop: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """:attr:`chunk` greedy steps in one compiled call (a small model on a CPU; call where
        ``room(chunk)`` and :meth:`unobserved` hold), the first fed ``token (B,)``: each step's tokens
        ``(B, chunk)``, the rows ``finished`` after it ``(B, chunk)`` (a row that produced one of the
        ``stop`` ids keeps emitting the first; ``finished (B,)``, before the first step, is not changed)
        and its logits ``(B, chunk, V)``, unchecked. The caches advance by ``chunk`` slots: a generation
        that ends inside a chunk leaves its caches holding the steps after its last token."""
        pos, n = self.caches[0].seen, self.chunk
        model, cfg = self.model, self.cfg
        emb = model.tok_emb.weight
        at = torch.arange(pos, pos + n, device=token.device).view(1, n)  # (1, chunk)
        pos_rows = F.embedding(at, model.pos_emb.weight) if cfg.pos == "learned" else None  # (1, chunk, C)
        (_, *group), nw, nb, head, cap = self.groups[0], *self.head
        slot = torch.tensor(pos, device=token.device)
        # token: a copy with its own strides (a column of a generation's token buffer has the buffer's
        # width as its stride, which the compiled code's guards would see as a new shape each time)
        token = token.clone(memory_format=torch.contiguous_format)
        ropes = self._ropes(at, emb.dtype)
        out = self.chunk_fn(
            token, finished, stop, (emb, self._embed_scale(), pos_rows), ropes, slot, group,
            (nw, nb, head, self.norm, cap, self.batch), n,
        )  # fmt: skip
        for cache in self.caches:
            cache.length = cache.seen = pos + n
        return out

    def _inputs(self, token: Tensor, at: Tensor) -> tuple[Tensor, tuple[list, tuple]]:
        """The first block's input ``x (B, 1, C)`` for ``token (B,)`` at position ``at (1, 1)`` and each
        layer's RoPE (:meth:`_ropes`). Functions of the weights, no module called (a server compiles
        on a thread of its own: :meth:`precompile`)."""
        model = self.model
        pos = F.embedding(at, model.pos_emb.weight) if self.cfg.pos == "learned" else None  # (1, 1, C)
        x = _embed(token, model.tok_emb.weight, self._embed_scale(), pos)  # (B, 1, C)
        return x, self._ropes(at, x.dtype)

    def _embed_scale(self) -> Tensor | None:
        """The embedding's scale (Gemma) as the eager forward applies it, rounded to the weights' dtype."""
        scale = self.cfg.embed_scale
        return None if scale is None else torch.tensor(scale, dtype=self.model.tok_emb.weight.dtype)

    def _ropes(self, at: Tensor, dtype: torch.dtype) -> tuple[list, tuple]:
        """The layers' RoPE at position ``at (1, 1)``: the distinct ``(cos, sin)`` pairs, each computed once
        (Gemma 3: its window layers have their own), and each layer's index among them, :attr:`rope_index`
        (None: no RoPE). So a compiled call takes them: Dynamo checks in Python (``is``) each tensor passed
        again (SmolLM2's 30 layers sharing one pair, 60 checks a call: 0.1 ms)."""
        angles = [*self.model.rope_angles(at, dtype).values(), *(att.rope_cos_sin(at, dtype) for att in self.own_ropes)]
        return angles, self.rope_index

    def _compiled_step(self, token: Tensor, pos: int, observers: list, head: bool = True) -> Tensor:
        """The compiled step for ``token (B,)`` at position ``pos``: logits ``(B, V)`` (without ``head``: the
        final norm's output ``(B, C)``). With an observer
        on any layer the observed variant runs, and each observer gets, after the calls, the record
        the eager forward would hand it (the weights cut to the filled slots). Observers that hand
        their weights to one callback (:func:`attnlab.attention.rows_receiver`) get no records: the
        rows variant hands it every layer's row at once, with layer 0's positions."""
        variant, rows_to = self._variant(observers)
        if self.stepper and head and variant != "observed":  # (one call of attnlab's kernel: see __init__)
            logits, seen = self._whole_step(token, pos, variant == "rows")
        elif self.cuda_graph and variant == "plain" and head:
            logits, seen = self._replay(token, pos), []
        else:
            logits, seen = self._static_step(token, torch.tensor(pos, device=token.device), variant, head)
        for cache in self.caches:
            cache.length = cache.seen = pos + 1
        if variant == "plain":
            return logits
        at = torch.tensor([[pos]], device=token.device)  # (1, 1)
        S = pos + 1
        if variant == "rows":  # (as the records would give them: see _observer)
            k_pos = self.caches[0].positions[:, :S] if self.layers[0][4] else None
            rows_to(seen[..., :S], None if k_pos is None else at, k_pos)  # (L, B, H, S)
            return logits
        masks: dict = {}
        for (q, weights, heads), block, cache, (_, _, _, _, has_positions), observer in zip(
            seen, self.model.trf_blocks, self.caches, self.layers, observers, strict=True
        ):
            if observer is not None:
                observe = self._observer(block.att, cache, at, has_positions, observer, masks)
                observe(q, cache.keys[:, :, :S], cache.values[:, :, :S], weights[..., :S], heads)
        return logits

    def _variant(self, observers: list) -> tuple[str, Any]:
        """Which compiled graph a step runs for the layers' ``observers`` (see :data:`VARIANTS`), and for
        "rows" the callback that takes them."""
        if all(fn is None for fn in observers):
            return "plain", None
        rows_to = rows_receiver(observers) if self.even else None
        return ("observed" if rows_to is None else "rows"), rows_to

    def _static_step(
        self, token: Tensor, slot: Tensor, variant: str = "plain", head: bool = True
    ) -> tuple[Tensor, Any]:
        """The compiled calls of a step: ``token (B,)`` at position ``slot`` (a 0-d int64 tensor on the
        model's device) -> logits ``(B, V)`` (without ``head``: the final norm's output ``(B, C)``, the
        norm outside the graph) and what the ``variant`` hands its observers: "observed",
        each layer's ``(q, weights over all slots, head outputs)``; "rows", the weights of all layers
        ``(L, B, H, M)``. Tensor operations only, no host synchronisation: on CUDA the plain step is
        captured in a CUDA graph (:meth:`_replay`). The caches' lengths are the caller's to advance."""
        x, (angles, which) = self._inputs(token, slot.view(1, 1))
        nw, nb, w_head, cap = self.head
        fn = {"plain": self.layers_fn, "observed": self.observed_fn, "rows": self.rows_fn}[variant]
        one = len(self.groups) == 1  # then the head too in that call; else a call of its own
        seen: list = []
        for layers, *args in self.groups:
            last = (nw, nb, w_head, self.norm, cap, self.batch) if one and head else None
            x = fn(x, (angles, which[layers.start : layers.stop]), *args[:3], slot, *args[3:], last)
            if variant != "plain":
                x, more = x
                seen += [more] if variant == "rows" else more
        if variant == "rows":
            seen = seen[0] if one else torch.cat(seen)  # (L, B, H, M)
        if not head:
            return _norm(x[:, -1], nw, nb, self.norm), seen  # (B, C)
        return (x if one else self.head_fn(x, nw, nb, w_head, self.norm, cap, self.batch, True)), seen  # (B, V)

    def _replay(self, token: Tensor, pos: int) -> Tensor:
        """:meth:`_static_step` as one CUDA graph: captured at the first step (after warm-up calls that
        compile; they write the same key and value to the same slot as the step does), then replayed
        with the token and position copied into its input buffers."""
        if self.graph is None:
            self.graph_token = token.clone()
            self.graph_slot = torch.full((), pos, dtype=torch.long, device=token.device)
            side = torch.cuda.Stream(token.device)  # warm-up off the default stream, as capture asks
            side.wait_stream(torch.cuda.current_stream(token.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._static_step(self.graph_token, self.graph_slot)
            torch.cuda.current_stream(token.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: a server's other threads (a background compilation) may use the GPU meanwhile.
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.graph_logits, _ = self._static_step(self.graph_token, self.graph_slot)  # (B, V)
        self.graph_token.copy_(token)
        self.graph_slot.fill_(pos)
        self.graph.replay()
        return self.graph_logits.clone()  # the next replay overwrites the graph's output

    def precompile(self, variant: str = "plain", stop_ids: tuple[int, ...] = ()) -> None:
        """Compile the step for this decoder's shapes (its batch, its caches' slots, the model's dtype)
        now: the ``variant`` of :data:`VARIANTS` ("plain": no observer; "observed": observers that get
        records; "rows": serve's generation stream, :func:`attnlab.interpret.observe_attention_rows`, which
        over caches of several sizes (a model whose window layers keep fewer slots) runs, and so compiles,
        the "observed" variant, as :meth:`_variant` picks). One step on this
        decoder's caches, which must be new ones of its own: they are reset afterwards. No module of the
        model is called and nothing on it changes (its weights are read): a server compiles on a thread
        of its own while its model thread answers requests. Run it in the grad mode the generation will
        run in (``torch.inference_mode()``, as generation's steps do), with caches made in it too
        (the compiled code's guards check both). (No CUDA graph: that is captured by each generation.)
        A decoder whose greedy decoding runs :attr:`chunk` steps to a call compiles that call too, for
        generations that stop at ``stop_ids`` (each set of them is a graph of its own)."""
        if not self.compile:
            raise ValueError("precompile needs a FastDecoder made with compile=True")
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if variant == "rows" and not self.even:  # (the rows of all layers are one tensor: caches of one size)
            variant = "observed"
        device = self.caches[0].keys.device
        token = torch.zeros(self.caches[0].keys.shape[0], dtype=torch.long, device=device)  # (B,)
        if self.stepper is None or variant == "observed":  # (else a step is attnlab's kernel: no graph)
            self._static_step(token, torch.zeros((), dtype=torch.long, device=device), variant)
        if self.chunk > 1 and variant == "plain" and self.room(self.chunk):  # (greedy decoding's calls too)
            for cache in self.caches:
                cache.reset()
            stop = torch.tensor(stop_ids, dtype=torch.long, device=device) if stop_ids else None
            self.greedy_steps(token, torch.zeros_like(token, dtype=torch.bool), stop)
        for cache in self.caches:
            cache.reset()

    @staticmethod
    def _observer(att: nn.Module, cache: Any, at: Tensor, has_positions: bool, observer: Any, masks: dict) -> Any:
        """``observe`` for :func:`_layer`: ``observer`` gets the :class:`AttentionRecord` the eager forward
        hands ``att.observer``. ``masks``: the step's masks by window, sinks and keys, made once for all
        its layers (a model whose window is its context has a rolling cache and a mask in every layer's
        record: SmolLM2's 30 took 0.4 ms a token, 40% of the records' cost)."""

        def observe(q: Tensor, keys: Tensor, values: Tensor, weights: Tensor, heads: Tensor) -> None:
            S = keys.shape[2]
            window, sinks = att.window, att.sinks
            if window is None and cache.rolling:
                window, sinks = cache.max_length - cache.sinks, cache.sinks  # the ring is the window
            mask = None
            if window is not None:
                mask = masks.get((window, sinks, S))
                if mask is None:
                    mask = masks[window, sinks, S] = causal_mask(1, S, window=window, sinks=sinks, device=q.device)
            k_pos = cache.positions[:, :S] if has_positions else None
            if cache.rolling and wants_cache_copies(observer):  # views of slots the next steps overwrite
                keys, values, k_pos = keys.clone(), values.clone(), k_pos.clone()
            q_pos = at if has_positions else None
            record = AttentionRecord(q, keys, values, mask, True, att.scale, weights, heads, q_pos, k_pos, att.softcap)
            observer(att, record)

        return observe
