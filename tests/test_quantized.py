"""Quantized weights that stay quantized (attnlab.quantized): each GGML format against the ``gguf``
package's own dequantization, a tiny Llama GGUF quantized vs dequantized through every path
(forward, generation, hooks, patching, LoRA), and the memory of loading a real file."""

from __future__ import annotations

import copy
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

import gguf_files  # noqa: E402
from attnlab import GPT, hardware  # noqa: E402
from attnlab import quantized as q  # noqa: E402
from attnlab.quantized import FORMATS, QuantizedTensor, is_quantized  # noqa: E402

QTYPES = list(FORMATS)
# The formats the gguf package quantizes in Python; the K-quants it only dequantizes (their blocks
# are made here from random bytes with sane scales).
GGUF_QUANTIZES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# Where each K-quant keeps its float16 scales in a block (byte offsets): set to small positive
# numbers so that random bytes make finite weights of a sane size.
F16_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``(rows, cols)`` weights as GGML blocks of ``qtype``: ``(rows, bytes per row)`` uint8."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in GGUF_QUANTIZES:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return gguf.quants.quantize(w, kind).view(np.uint8).reshape(rows, -1)
    fmt = FORMATS[qtype]
    raw = rng.integers(0, 256, (rows, cols // fmt.block, fmt.nbytes), dtype=np.uint8)
    for at in F16_SCALES[qtype]:
        scale = rng.uniform(1e-4, 5e-4, raw.shape[:2]).astype(np.float16)  # weights of at most about 1
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, qtype: str) -> torch.Tensor:
    """The gguf package's dequantization, float64."""
    return torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64))


# --------------------------------------------------------------------------------------------
# One matrix per format
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("qtype", QTYPES)
def test_the_one_row_product_is_the_gguf_packages_weights_times_the_row(qtype):
    """The decoding step's product under torch.compile (a format's sum over its packed fields, or the
    dequantized weight's where it has none), run eagerly here, against float64."""
    raw = blocks(qtype, 40, 512)
    w = QuantizedTensor.from_blocks(qtype, raw, (40, 512))
    x = torch.randn(1, 1, 512)
    want = x.double() @ reference(raw, qtype).T  # (1, 1, 40)
    got = q._matvec(x, w)
    assert got.shape == (1, 1, 40) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))


EIGHT_LANES = [t for t in QTYPES if FORMATS[t].matvec8 is not None]


@pytest.mark.parametrize("qtype", EIGHT_LANES)
def test_the_one_row_product_for_eight_lanes_is_the_gguf_packages_weights_times_the_row(qtype):
    """The one-row product written for 8-lane vector units (AVX2: the packed bytes read as int32
    words, ``x`` reordered to match), run eagerly, against float64."""
    raw = blocks(qtype, 40, 512)
    part = QuantizedTensor.from_blocks(qtype, raw, (40, 512)).parts[0]
    x = torch.randn(512)
    want = reference(raw, qtype) @ x.double()  # (40,)
    fmt = FORMATS[qtype]
    got = fmt.matvec8(q._as_words(part.fields, fmt.words), x.view(-1, fmt.block))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))


def written_for(monkeypatch, lanes: str) -> None:
    """Make the compiled one-row products those written for ``lanes`` ("eight": AVX2's, read as words;
    "any": the other vector units'), whatever this CPU's vector unit (the code is compiled for it: on
    an AVX2 machine "any" is the formulation its users never compile, tested here all the same)."""
    monkeypatch.setattr(hardware, "compiled_vector_bits", lambda: 256 if lanes == "eight" else 512)
    monkeypatch.setattr(q, "_AHEAD", {})  # (nothing compiled for the other formulation is reused)


@pytest.mark.slow
@pytest.mark.filterwarnings("error:quantized one-row products run without torch.compile")
@pytest.mark.parametrize(("qtype", "lanes"), [(t, "any") for t in QTYPES] + [(t, "eight") for t in EIGHT_LANES])
def test_a_formats_one_row_product_compiled_once_takes_every_shape(monkeypatch, qtype, lanes):
    """Each format's one-row product is compiled once (``quantized._compile_ahead``) for any number of
    rows and blocks (once more for an odd number: the 32-weight formats, and the K-quants' code for
    8 lanes, sum an even number of 4 or more in two halves):
    weights of three shapes through the compiled code, against float64; a weight of one row (which that
    code does not take) by the uncompiled sum, exact too. Both formulations: the one for 8-lane vector
    units (where the format has one) and the others'."""
    written_for(monkeypatch, lanes)
    monkeypatch.setattr(q, "COMPILE_AFTER_S", 0.0)
    monkeypatch.setattr(q, "COMPILE_MIN_ELEMENTS", 0)
    compiled = []
    monkeypatch.setattr(q, "_ahead", lambda what, part, ahead=q._ahead: compiled.append(part.rows) or ahead(what, part))
    odd = 99 * FORMATS[qtype].block  # an odd number of blocks (the others' code: see quantized._row_sums)
    for rows, cols in ((40, 512), (7, 1024), (5, odd), (1, 512)):
        raw = blocks(qtype, rows, cols, seed=rows)
        w = QuantizedTensor.from_blocks(qtype, raw, (rows, cols))
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(rows))
        dense = reference(raw, qtype)  # (rows, cols) float64
        want = x.double() @ dense.T  # (1, rows)
        with torch.no_grad():
            got = F.linear(x, w)
        # (float32 sums in another order: their error scales with the sum of the terms' sizes, which one
        # row's single output can exceed many times)
        scale = float((x.double().abs() @ dense.abs().T).max())
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6 * scale)
    assert compiled == [40, 7, 5]
    assert {key[:2] for key in q._AHEAD} == {("matvec", qtype)}
    eight = lanes == "eight" and FORMATS[qtype].matvec8 is not None
    assert q._one_row(FORMATS[qtype], compiling=True)[0] is (FORMATS[qtype].matvec8 if eight else FORMATS[qtype].matvec)


@pytest.mark.slow
@pytest.mark.parametrize("lanes", ["any", "eight"])
def test_the_compiled_one_row_product_of_rows_in_two_formats(monkeypatch, lanes):
    """F.linear compiled on one row of a weight whose rows are Q4_1 then Q8_0 (as a fused projection
    can be): each part's sum, concatenated, against float64; two rows take the dense product. Both
    formulations of the sums (see above)."""
    written_for(monkeypatch, lanes)
    torch.compiler.reset()  # (Dynamo's guards do not see the formulation: the other case's graph would be reused)
    raws = blocks("Q4_1", 24, 256), blocks("Q8_0", 16, 256, seed=1)
    parts = [QuantizedTensor.from_blocks(t, r, (len(r), 256)) for t, r in zip(("Q4_1", "Q8_0"), raws, strict=True)]
    w = torch.cat(parts)
    dense = torch.cat([reference(raws[0], "Q4_1"), reference(raws[1], "Q8_0")])  # (40, 256)
    step = torch.compile(F.linear, fullgraph=True, dynamic=False, options=hardware.compile_options())
    for rows in (1, 2):
        x = torch.randn(rows, 256)
        want = x.double() @ dense.T
        torch.testing.assert_close(step(x, w).double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    x = torch.randn(1, 256, requires_grad=True)  # one row with gradients: the product's backward
    step(x, w).sum().backward()
    want = dense.sum(0, keepdim=True)  # d(sum(x @ w.T)) / dx, (1, 256)
    torch.testing.assert_close(x.grad.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [t for t in EIGHT_LANES if FORMATS[t].block == 256])
def test_a_k_quants_row_read_in_two_halves_inside_a_compiled_graph(monkeypatch, qtype):
    """Inside a graph compiled with fixed shapes (a compiled decoding step), Q4_K's and Q5_K's one-row
    products for 8 lanes read a row of an even number of super-blocks, 4 or more, in two halves (six
    here), and of an odd number whole (five); the other K-quants' read every row whole: against float64."""
    written_for(monkeypatch, "eight")
    torch.compiler.reset()  # (each format's graphs would count towards Dynamo's limit of graphs for F.linear)
    step = torch.compile(F.linear, fullgraph=True, dynamic=False, options=hardware.compile_options())
    for cols in (6 * 256, 5 * 256):
        raw = blocks(qtype, 24, cols, seed=cols)
        w = QuantizedTensor.from_blocks(qtype, raw, (24, cols))
        x = torch.randn(1, cols, generator=torch.Generator().manual_seed(cols))
        want = x.double() @ reference(raw, qtype).T
        scale = float((x.double().abs() @ reference(raw, qtype).abs().T).max())
        with torch.no_grad():
            torch.testing.assert_close(step(x, w).double(), want, rtol=0, atol=1e-6 * scale)


@pytest.mark.filterwarnings("error:quantized one-row products run without torch.compile")
@pytest.mark.parametrize("compile_after_s", [0.0, math.inf])
def test_an_eager_one_row_product_of_a_large_weight_is_exact_compiled_or_not(monkeypatch, compile_after_s):
    """Uncompiled, one row of a weight of COMPILE_MIN_ELEMENTS or more goes through inductor's one-row
    products (each format's sum over its packed fields, here Q4_1's and Q6_K's) once the process's eager
    dequantizations of tiles have taken COMPILE_AFTER_S seconds, through the tiles before; the compile
    must not fail (it would warn and leave the tiles to do it). Against float64, for one row of each
    leading shape; two rows always take the tiles."""
    monkeypatch.setattr(q, "COMPILE_AFTER_S", compile_after_s)
    tiled = []
    monkeypatch.setattr(q, "_product", lambda x, w, product=q._product: tiled.append(x.shape) or product(x, w))
    raws = blocks("Q4_1", 160, 512), blocks("Q6_K", 96, 512, seed=1)
    w = torch.cat(
        [QuantizedTensor.from_blocks(t, r, (len(r), 512)) for t, r in zip(("Q4_1", "Q6_K"), raws, strict=True)]
    )
    assert w.numel() >= q.COMPILE_MIN_ELEMENTS
    dense = torch.cat([reference(raws[0], "Q4_1"), reference(raws[1], "Q6_K")])  # (256, 512) float64
    shapes = [(512,), (1, 512), (1, 1, 512), (2, 512)]
    for shape in shapes:
        x = torch.randn(shape)
        want = x.double() @ dense.T
        with torch.no_grad():
            got = F.linear(x, w)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    assert tiled == [torch.Size(s) for s in (shapes if compile_after_s else shapes[-1:])]


def test_products_compile_once_the_eager_dequantizations_have_taken_compile_after_s(monkeypatch):
    """The ski-rental rule: a process's one-row products take the eager tiles until their
    dequantizations have taken COMPILE_AFTER_S seconds in all, and are compiled from then on."""
    monkeypatch.setattr(q, "COMPILE_AFTER_S", 1e-9)  # (paid by any one dequantization)
    monkeypatch.setattr(q, "_rent_paid_s", 0.0)
    tiled = []
    monkeypatch.setattr(q, "_product", lambda x, w, product=q._product: tiled.append(x.shape) or product(x, w))
    w = QuantizedTensor.from_blocks("Q4_1", blocks("Q4_1", 160, 512), (160, 512))
    x = torch.randn(1, 512)
    with torch.no_grad():
        first, second = F.linear(x, w), F.linear(x, w)
    assert tiled == [x.shape]  # the first by the tiles, the second compiled
    torch.testing.assert_close(first, second, rtol=0, atol=1e-5 * float(first.abs().max()))


@pytest.mark.slow
@pytest.mark.filterwarnings("error:quantized tiles are dequantized without torch.compile")
@pytest.mark.parametrize(
    ("kind", "lanes"),
    [(name, lanes) for name, f in FORMATS.items() if f.tile is not None for lanes in ("any", "eight")],
)
def test_a_compiled_tile_is_the_eager_dequantization_bit_for_bit(monkeypatch, kind, lanes):
    """A 4-bit format's ``tile`` (its dequantization written for torch.compile) compiled gives gguf's
    numbers bit for bit, and its ``tile8`` (for 8 float lanes: the packed bytes read as words) the same
    numbers in its columns' order; once compiling pays (COMPILE_AFTER_S), a product of more than one row
    dequantizes its tiles so (``tile8`` where the code is made for 8 lanes), against float64."""
    written_for(monkeypatch, lanes)
    fmt = FORMATS[kind]
    raw = blocks(kind, 160, 512)  # (COMPILE_MIN_ELEMENTS or more)
    fields = QuantizedTensor.from_blocks(kind, raw, (160, 512)).parts[0].fields
    if lanes == "eight":
        columns = (torch.arange(0, 512, fmt.block)[:, None] + fmt.tile8[1]).flatten()  # (512,)
        assert sorted(columns.tolist()) == list(range(512))  # (a permutation of each block's weights)
        compiled = q._compile_ahead(fmt.tile8[0], fields, None, fmt.words)
        assert torch.equal(compiled(fields), q.dequantize(kind, fields)[:, columns])
    else:
        compiled = q._compile_ahead(fmt.tile, fields, None)
        assert torch.equal(compiled(fields), q.dequantize(kind, fields))
    monkeypatch.setattr(q, "COMPILE_AFTER_S", 0.0)
    used = []
    ahead = q._ahead
    monkeypatch.setattr(q, "_ahead", lambda what, part: used.append((what, part.format)) or ahead(what, part))
    w = QuantizedTensor.from_blocks(kind, raw, (160, 512))
    x = torch.randn(3, 512)
    want = x.double() @ reference(raw, kind).T
    with torch.no_grad():
        got = F.linear(x, w)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    assert used == [("tile8" if lanes == "eight" else "tile", kind)]


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_is_the_gguf_packages_bit_for_bit(qtype):
    raw = blocks(qtype, 24, 512)
    w = QuantizedTensor.from_blocks(qtype, raw, (24, 512))
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]))
    assert w.shape == (24, 512) and w.dtype == torch.float32 and w.formats == (qtype,)
    assert torch.equal(w.dequantize(), want)
    # The file's bytes (the K-quants' 6-bit scales a byte each; Q4_K's, Q5_K's and Q6_K's sub-block scales
    # as float32 products: 22 more bytes a block of Q4_K's 144, 46 of Q6_K's 210, for their products' speed).
    assert w.storage_bytes <= raw.nbytes * (1.23 if qtype in ("Q4_K", "Q5_K", "Q6_K") else 1.04)


@pytest.mark.parametrize("qtype", QTYPES)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 70), batch=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_product_and_its_gradient_equal_the_dequantized_matrix(qtype, rows, batch, seed, monkeypatch):
    import attnlab.quantized as q

    monkeypatch.setattr(q, "TILE_ELEMENTS", 512 * 16)  # several tiles of rows, and a last partial one
    raw = blocks(qtype, rows, 512, seed)
    w = QuantizedTensor.from_blocks(qtype, raw, (rows, 512))
    ref = reference(raw, qtype)  # (rows, 512) float64
    x = torch.randn(batch, 3, 512, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    y = F.linear(x, w)
    want = x.detach().double() @ ref.T
    y_ = y.detach()
    tol = 1e-5 * float(want.abs().max()) + 1e-6
    assert y.dtype == torch.float32 and y.shape == (batch, 3, rows)
    assert float((y_.double() - want).abs().max()) <= tol
    g = torch.randn(batch, 3, rows, generator=torch.Generator().manual_seed(seed + 1))
    y.backward(g)
    want_grad = g.double() @ ref
    assert float((x.grad.double() - want_grad).abs().max()) <= 1e-5 * float(want_grad.abs().max()) + 1e-6
    with torch.no_grad():  # the inference path (no autograd Function) computes the same
        assert torch.allclose(F.linear(x, w), y_, rtol=0, atol=tol)


def test_rows_move_with_their_blocks():
    """cat, split, slicing and index_select keep blocks (how converters fuse and split projections),
    across formats; an embedding lookup dequantizes the rows asked for."""
    a = QuantizedTensor.from_blocks("Q4_1", blocks("Q4_1", 6, 64), (6, 64))
    b = QuantizedTensor.from_blocks("Q8_0", blocks("Q8_0", 4, 64, 1), (4, 64))
    both = torch.cat([a, b])
    dense = torch.cat([a.dequantize(), b.dequantize()])
    assert is_quantized(both) and both.formats == ("Q4_1", "Q8_0") and torch.equal(both.dequantize(), dense)
    top, bottom = both.split([5, 5])
    assert is_quantized(top) and torch.equal(bottom.dequantize(), dense[5:])
    assert torch.equal(both[3:8].dequantize(), dense[3:8])
    order = torch.tensor([5, 0, 2])
    assert torch.equal(a[order].dequantize(), a.dequantize()[order])
    ids = torch.tensor([[9, 0], [5, 5]])
    assert torch.equal(F.embedding(ids, both), dense[ids])
    assert torch.equal((both + 1.0), dense + 1.0)  # any other operation: on the dense values
    assert torch.equal(both.to(torch.float64).dequantize(), dense.double())


def test_one_row_by_an_int_reads_that_row_alone(monkeypatch):
    # (w[5] dequantized the whole matrix: direct_logit_attribution's two rows of SmolLM2's 49,152 x 576
    # head took 200 MB more than the dense model)
    w = QuantizedTensor.from_blocks("Q4_1", blocks("Q4_1", 6, 64), (6, 64))
    dense = w.dequantize()
    monkeypatch.setattr(QuantizedTensor, "dequantize", lambda *a, **k: pytest.fail("the whole matrix dequantized"))
    for i in (0, 5, -1, -6):
        assert torch.equal(w[i], dense[i])
    with pytest.raises(IndexError):
        w[6]


def test_bad_blocks_are_refused_by_name():
    with pytest.raises(ValueError, match="format must be one of"):
        QuantizedTensor.from_blocks("Q4_9", np.zeros((1, 18), np.uint8), (1, 32))
    with pytest.raises(ValueError, match="in_features=48 is not a whole number of Q4_0 blocks"):
        QuantizedTensor.from_blocks("Q4_0", np.zeros((1, 27), np.uint8), (1, 48))
    with pytest.raises(ValueError, match="raw must be 18 bytes"):
        QuantizedTensor.from_blocks("Q4_0", np.zeros((1, 20), np.uint8), (1, 32))
    w = QuantizedTensor.from_blocks("Q4_0", blocks("Q4_0", 2, 32), (2, 32))
    with pytest.raises(TypeError, match="floating-point dtype"):
        w.to(torch.int8)


# --------------------------------------------------------------------------------------------
# The 4-bit formats on torch's int4 kernel (_weight_int4pack_mm_for_cpu)
# --------------------------------------------------------------------------------------------
INT4 = ["Q4_0", "Q4_1", "Q4_K"]


def kernel_dequantized(pack, in_features: int) -> torch.Tensor:
    """The weight ``(N, K)`` as the int4 kernel computes it: its product with the identity (each output
    one weight times 1, plus zeros: exact)."""
    eye = torch.eye(in_features, dtype=pack.dtype)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, pack.weight, q.INT4_GROUP, pack.scales_and_zeros).T


@pytest.mark.parametrize("qtype", INT4)
def test_int4_repacking_is_the_gguf_packages_dequantization_bit_for_bit(qtype):
    """The repacking is lossless: with float32 scales and zeros, the kernel's weights are gguf's."""
    raw = blocks(qtype, 48, 512, seed=3)
    w = QuantizedTensor.from_blocks(qtype, raw, (48, 512))
    want = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]))
    codes, scale, zero, exact = q.int4_affine(w.parts[0])
    assert codes.shape == (48, 512) and int(codes.max()) <= 15 and scale.shape == zero.shape == (48, 16)
    assert bool(exact.all())
    assert torch.equal(
        (codes.float() - 8).unflatten(-1, (16, 32)).mul(scale[..., None]).add(zero[..., None]).flatten(-2), want
    )
    assert torch.equal(kernel_dequantized(q.int4_pack(w.parts, torch.float32), 512), want)


@pytest.mark.slow
def test_int4_repacking_of_the_real_q4_1_file_is_exact(smollm2_gguf):
    """Every Q4_1 matrix of SmolLM2's file: zeros ``m + 8d`` exact in float32, so the kernel's weights are
    the file's numbers (checked on the kernel for one layer's matrices)."""
    model = GPT.from_gguf(smollm2_gguf)
    matrices = {n: w for n, w in model.named_parameters() if is_quantized(w) and w.formats == ("Q4_1",)}
    assert len(matrices) >= 30 * 5
    assert all(bool(q.int4_affine(w.parts[0])[3].all()) for w in matrices.values())
    for name in (n for n in matrices if n.startswith("trf_blocks.0.")):
        w = matrices[name]
        assert torch.equal(kernel_dequantized(q.int4_pack(w.parts, torch.float32), w.shape[1]), w.dequantize()), name


@pytest.mark.parametrize("qtype", INT4)
def test_bfloat16_weights_compute_with_the_int4_kernel(qtype):
    """``.to(torch.bfloat16)`` packs a 4-bit weight for the kernel (bfloat16 scales: a bfloat16 product's
    accuracy); float32 keeps the exact tiled product; moving rows repacks; other formats have no pack."""
    raw = blocks(qtype, 72, 512, seed=5)  # (72 rows: the pack's last block of 16 half rows of zeros)
    w = QuantizedTensor.from_blocks(qtype, raw, (72, 512))
    assert w.int4 is None  # float32: torch's kernel is scalar there (see quantized.INT4_DTYPES)
    wb = w.to(torch.bfloat16)
    assert wb.int4 is not None and wb.int4.scales_and_zeros.shape == (16, 80, 2) and "int4 kernel" in repr(wb)
    assert wb.storage_bytes <= 2.5 * raw.nbytes  # the blocks and the pack (its scales and zeros: 4 bytes a group)
    x = torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = x.double() @ reference(raw, qtype).T
    y = F.linear(x, wb)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 72)
    assert torch.equal(y, q.int4_mm(x, wb.int4, 72))
    assert float((y.double() - want).abs().max()) <= 2e-2 * float(want.abs().max())
    top = wb[:32]  # rows move with their blocks and are packed again
    assert top.int4 is not None and torch.equal(F.linear(x, top), y[..., :32])
    assert wb.detach().int4 is wb.int4 and wb.clone().int4 is not None
    assert wb.to(torch.float32).int4 is None
    assert QuantizedTensor.from_blocks("Q8_0", blocks("Q8_0", 16, 64), (16, 64)).to(torch.bfloat16).int4 is None


@pytest.mark.slow
def test_a_bfloat16_quantized_model_runs_on_the_int4_kernel(tmp_path):
    """The tiny model in Q4_1 as ``.to(torch.bfloat16)``: every matrix packed, logits a bfloat16 model's
    distance from the dense float32 ones, and the float32 model still within 1e-5 of them."""
    path = write_quantized_gguf(tmp_path / "tiny.Q4_1.gguf", "Q4_1")
    quant, dense = GPT.from_gguf(path), GPT.from_gguf(path, dtype=torch.float32)
    bf16 = GPT.from_gguf(path).to(torch.bfloat16)
    matrices = [p for p in bf16.parameters() if is_quantized(p)]
    assert matrices and all(p.int4 is not None for p in matrices)
    assert not any(p.int4 is not None for p in quant.parameters() if is_quantized(p))
    idx = prompt(20)
    with torch.no_grad():
        want = dense(idx)
        assert float((quant(idx) - want).abs().max()) <= 1e-5 * float(want.abs().max())
        got = bf16(idx)
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max()) <= 5e-2 * float(want.abs().max())
    out = bf16.generate(idx[:1, :8], 6, temperature=0)
    assert out.shape == (1, 14)


@pytest.mark.slow
def test_compiled_decoding_of_a_bfloat16_quantized_model_calls_the_int4_kernel(tmp_path):
    """The compiled step of the bfloat16 model: the int4 kernel inside inductor's graph, the eager tokens."""
    path = write_quantized_gguf(tmp_path / "tiny.Q4_0.gguf", "Q4_0")
    bf16 = GPT.from_gguf(path).to(torch.bfloat16)
    idx = prompt(8)[:1]
    want = bf16.generate(idx, 6, temperature=0, fast=False)
    assert torch.equal(bf16.generate(idx, 6, temperature=0, compile=True), want)


# --------------------------------------------------------------------------------------------
# A tiny Llama in a GGUF file, quantized vs dequantized
# --------------------------------------------------------------------------------------------
def tiny_256(seed: int = 0):
    """A tiny transformers Llama 256 wide (a whole K-quant block of 256 per row), 2 layers."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=gguf_files.VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def write_quantized_gguf(
    path: Path, qtype: str, model=None, seed: int = 0, shapes: dict | None = None, meta: dict | None = None
) -> Path:
    """``model`` (default :func:`tiny_256`) as llama.cpp writes it, its matrices in ``qtype``: through
    ``gguf``'s quantizer where it has one, else as random blocks of that format (with sane scales).
    ``shapes`` (``{llama.cpp name: shape}``) writes random blocks of those shapes instead (vectors: ones),
    with ``meta`` over the tiny model's metadata."""
    model = tiny_256(seed) if model is None else model
    values = gguf_files.llama_metadata(model) | (meta or {})
    if shapes is None:
        arrays = gguf_files.gguf_tensors(model)
    else:
        arrays = {k: np.ones(s, np.float32) if len(s) == 1 else np.empty(s, np.uint8) for k, s in shapes.items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in values.items():
        gguf_files._add(writer, key, value)
    kind = gguf.GGMLQuantizationType[qtype]
    for i, (name, w) in enumerate(arrays.items()):
        if w.ndim != 2:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
        elif qtype in GGUF_QUANTIZES and shapes is None:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, blocks(qtype, *w.shape, seed=seed + i), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def q4k(tmp_path_factory):
    """The tiny model in Q4_K: ``(quantized, dequantized float32)``."""
    path = write_quantized_gguf(tmp_path_factory.mktemp("q4k") / "tiny.Q4_K.gguf", "Q4_K")
    return GPT.from_gguf(path), GPT.from_gguf(path, dtype=torch.float32)


def prompt(n: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, gguf_files.VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


class LinearShapes(torch.overrides.TorchFunctionMode):
    """Records ``(input shape, weight shape)`` of each ``F.linear`` a model calls, or oneDNN's linear that
    :func:`attnlab.hardware.linear` calls for float32 on CPUs other than Intel's (not the calls inside
    another's handling: a quantized weight's tiles)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear or str(getattr(func, "overloadpacket", func)) == "mkldnn._linear_pointwise":
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_a_quantized_model_makes_the_dense_models_products(q4k):
    """Shape for shape, a prompt's queries, keys and values one product as the dense model's: a matmul
    library may choose its order of sums by the shape (MKL's AVX2 code does), so three products where the
    dense model makes one would round differently."""
    quant, dense = q4k
    seen = {}
    for name, model in (("quantized", quant), ("dense", dense)):
        with torch.no_grad():
            model(prompt(20))  # (once before: attnlab.hardware's one-off check of oneDNN is not the model's)
        with torch.no_grad(), LinearShapes() as mode:
            model(prompt(20))
        seen[name] = mode.shapes
    assert seen["quantized"] == seen["dense"]
    config = dense.config
    fused = (config.n_heads + 2 * config.n_kv_heads) * (config.emb_dim // config.n_heads)
    assert ((2, 20, config.emb_dim), (fused, config.emb_dim)) in seen["quantized"]


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "F16"])
def test_quantized_model_computes_the_dequantized_models_logits(tmp_path, qtype):
    """The same weights, multiplied by the same library: oneDNN off, the dense model's products are
    ``F.linear``'s as the tiles' are (with it on, CPUs other than Intel's multiply the dense weights by
    oneDNN, whose order of sums differs from MKL's: a random tiny model's logits, unlike a trained one's,
    magnify that past 1e-5; the real file's test below holds the two libraries to it)."""
    path = write_quantized_gguf(tmp_path / f"tiny.{qtype}.gguf", qtype)
    quant, dense = GPT.from_gguf(path), GPT.from_gguf(path, dtype=torch.float32)
    matrices = [p for n, p in quant.named_parameters() if p.dim() == 2]
    assert matrices and all(is_quantized(p) and p.formats == (qtype,) for p in matrices)
    assert not any(is_quantized(p) for p in dense.parameters())
    idx = prompt(20)
    with torch.no_grad(), torch.backends.mkldnn.flags(enabled=False):
        got, want = quant(idx), dense(idx)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.slow
def test_the_real_q4_1_model_computes_its_dequantized_models_logits(smollm2_gguf):
    """SmolLM2 kept quantized against its dense float32 model, each with the products it takes by default
    on this CPU: within 1e-5 of the largest logit."""
    quant, dense = GPT.from_gguf(smollm2_gguf), GPT.from_gguf(smollm2_gguf, dtype=torch.float32)
    idx = torch.randint(0, quant.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = quant(idx), dense(idx)
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


def test_quantized_weights_are_frozen_and_dtype_gives_a_dense_model(q4k, tmp_path):
    quant, dense = q4k
    assert quant.dtype == torch.float32 and quant.tok_emb.weight is quant.out_head.weight
    assert all(not p.requires_grad for p in quant.parameters() if is_quantized(p))
    assert quant.num_parameters() == dense.num_parameters()
    path = write_quantized_gguf(tmp_path / "tiny.Q8_0.gguf", "Q8_0")
    half = GPT.from_gguf(path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and not any(is_quantized(p) for p in half.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_quantized_model_saves_in_its_blocks_and_loads_the_same_weights(q4k, tmp_path, dtype):
    # A checkpoint of a GGUF base was its dequantized float32 copy: five times the file, and for an
    # 8B model twice its 32 GB in memory while it was written.
    quant, dense = q4k
    quant = copy.deepcopy(quant).to(dtype)
    saved = quant.save(tmp_path / "ck")
    loaded = GPT.load(saved)
    dense.save(tmp_path / "dense")
    size = (saved / "model.safetensors").stat().st_size
    assert size < 0.5 * (tmp_path / "dense" / "model.safetensors").stat().st_size
    want = dict(quant.named_parameters())
    for name, p in loaded.named_parameters():
        assert (
            is_quantized(p) == is_quantized(want[name])
            and p.dtype == dtype
            and not (is_quantized(p) and p.requires_grad)
        ), name
        if is_quantized(p):
            assert p.formats == want[name].formats and torch.equal(p.dequantize(), want[name].dequantize()), name
        else:
            assert torch.equal(p, want[name]), name
    idx = prompt(8)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(idx), quant.eval()(idx))


def test_a_saved_quantized_model_whose_layout_does_not_hold_is_one_error_naming_the_file(q4k, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    quant, _ = q4k
    saved = quant.save(tmp_path / "ck")
    with safe_open(str(saved / "model.safetensors"), framework="pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    layout = json.loads(metadata["attnlab.quantized"])
    name = next(iter(layout))
    field = next(k for k in tensors if k.startswith(f"{name}:0:"))
    cases = {
        "not JSON": ({**metadata, "attnlab.quantized": "{"}, tensors),
        "described as": (
            {**metadata, "attnlab.quantized": json.dumps({name: [layout[name][0], "int8", ["Q4_K"]]})},
            tensors,
        ),
        "is not a format": (
            {**metadata, "attnlab.quantized": json.dumps({name: [layout[name][0], "float32", ["Q9"]]})},
            tensors,
        ),
        "needs a field": (metadata, {k: v for k, v in tensors.items() if k != field}),
        "no quantized weight": ({**metadata, "attnlab.quantized": json.dumps({})}, tensors),
    }
    for i, (match, (meta, ts)) in enumerate(cases.items()):
        d = tmp_path / f"bad{i}"
        d.mkdir()
        shutil.copy(saved / "config.json", d / "config.json")
        save_file(ts, str(d / "model.safetensors"), metadata=meta)
        with pytest.raises(ValueError, match=match) as e:
            GPT.load(d)
        assert str(d / "model.safetensors") in str(e.value)


@pytest.mark.parametrize("compile_after_s", [0.0, math.inf])  # one-row products compiled, or tiles
def test_generation_eager_and_fast_gives_the_dense_models_tokens(q4k, monkeypatch, compile_after_s):
    monkeypatch.setattr(q, "COMPILE_AFTER_S", compile_after_s)
    quant, dense = q4k
    idx = prompt(8)
    want = dense.generate(idx, 12, temperature=0, fast=False)
    assert torch.equal(quant.generate(idx, 12, temperature=0, fast=False), want)
    assert torch.equal(quant.generate(idx, 12, temperature=0), want)


@pytest.mark.slow
def test_compiled_decoding_gives_the_dense_models_tokens(q4k):
    quant, dense = q4k
    idx = prompt(8)[:1]
    want = dense.generate(idx, 6, temperature=0, fast=False)
    assert torch.equal(quant.generate(idx, 6, temperature=0, compile=True), want)


def test_run_with_cache_and_attribution_patching_on_the_quantized_model(q4k):
    from attnlab.interpret import activation_patching, attribution_patching, logit_diff, run_with_cache

    quant, dense = q4k
    idx = prompt(10)[:1]
    (_, cache_q), (_, cache_d) = run_with_cache(quant, idx), run_with_cache(dense, idx)
    assert set(cache_q) == set(cache_d)
    for name in cache_d:
        got, want = cache_q[name], cache_d[name]
        finite = want.isfinite()  # (the masked attention scores are -inf in both)
        assert torch.equal(finite, got.isfinite()), name
        scale = float(want[finite].abs().max()) + 1e-6
        assert float((got[finite] - want[finite]).abs().max()) <= 1e-5 * scale, name
    clean, corrupted = idx[0], prompt(10, seed=1)[0]
    metric = logit_diff(5, 7)
    est_q = attribution_patching(quant, clean, corrupted, metric, "resid_pre")
    est_d = attribution_patching(dense, clean, corrupted, metric, "resid_pre")
    # (gradients of a logit difference: float32's rounding, in the order oneDNN's tiles sum on CPUs other
    # than Intel's, reaches 2.4e-4 of the largest estimate; a wrong gradient is off by its whole size)
    assert torch.allclose(est_q, est_d, rtol=1e-3, atol=1e-3 * float(est_d.abs().max()))
    act_q = activation_patching(quant, clean, corrupted, metric, "resid_pre")
    act_d = activation_patching(dense, clean, corrupted, metric, "resid_pre")
    assert torch.allclose(act_q, act_d, rtol=1e-4, atol=1e-4 * float(act_d.abs().max()))
    assert all(is_quantized(p) for p in quant.parameters() if p.dim() == 2)


def test_run_with_cache_with_gradients_reaches_every_activation_of_the_quantized_model(q4k):
    # Regression: the quantized embedding is frozen, so the activations made from it alone (hook_embed,
    # blocks.0.hook_resid_pre) were outside the graph and torch.autograd.grad refused them.
    from attnlab.interpret import run_with_cache

    grads = []
    for model in q4k:
        logits, cache = run_with_cache(model, prompt(8)[:1], grad=True)
        names = list(cache)
        assert all(cache[n].requires_grad for n in names if cache[n].is_floating_point())
        grads.append(
            dict(
                zip(
                    names,
                    torch.autograd.grad(logits[0, -1].logsumexp(-1), list(cache.values()), allow_unused=True),
                    strict=True,
                )
            )
        )
    for name in ("hook_embed", "blocks.0.hook_resid_pre", "blocks.1.hook_resid_pre"):
        want = grads[1][name]
        torch.testing.assert_close(grads[0][name], want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


def test_lora_trains_on_the_frozen_quantized_base(q4k, tmp_path):
    from attnlab.training.lora import LoRASettings, apply_lora

    path = write_quantized_gguf(tmp_path / "tiny.Q4_K.gguf", "Q4_K")
    model = GPT.from_gguf(path).train()
    base = {n: p.dequantize().clone() for n, p in model.named_parameters() if is_quantized(p)}
    n = apply_lora(model, LoRASettings.make(4, targets="q,v,o,up,down"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert n == sum(p.numel() for p in trainable) > 0
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    idx = prompt(16)
    losses = []
    for _ in range(3):
        loss = model.loss(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        if name.removesuffix(".original").replace(".parametrizations.weight", ".weight") in base:
            assert is_quantized(p) and p.grad is None
    stays = {n: p for n, p in model.named_parameters() if is_quantized(p)}
    assert len(stays) == len(base)
    for n, p in stays.items():
        key = n.replace(".parametrizations.weight.original", ".weight")
        assert torch.equal(p.dequantize(), base[key])


# --------------------------------------------------------------------------------------------
# Memory: peak RSS of loading and a 64-token forward, beyond `import torch, attnlab`
# --------------------------------------------------------------------------------------------
MEASURE = r"""
import json, re, sys, torch, attnlab
from attnlab import GPT

def high_water():  # VmHWM: the peak RSS of this process since its exec, in KiB
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1))

# The eager tiles throughout: compiling them is chosen by the seconds spent dequantizing (sooner on a slow
# or busy machine: beside another test worker this forward crosses it) and then holds the compiler's own
# memory, which does not grow with the model; this measures the weights and the fixed costs of a process
# that has not compiled.
base = high_water()
import attnlab.quantized
attnlab.quantized.COMPILE_AFTER_S = float("inf")
if sys.argv[2] == "load_pretrained":  # as every command loads it: with its tokenizer and chat template
    from attnlab.tools.loading import load_pretrained

    model = load_pretrained(sys.argv[1]).model
else:
    model = GPT.from_gguf(sys.argv[1])
with torch.no_grad():
    model(torch.zeros(1, 64, dtype=torch.long))
print(json.dumps({"extra": (high_water() - base) * 1024}))
"""


def extra_rss(path: Path, limit: float, how: str = "from_gguf") -> int:
    """Bytes of peak RSS beyond ``import torch, attnlab``, in a fresh process. (VmHWM rather than
    ``getrusage``'s ``ru_maxrss``, which Linux carries over from the parent process across ``exec``: in
    a child of a large process such as pytest it starts at the parent's size and hides the load.)"""
    if not Path("/proc/self/status").is_file():
        pytest.skip("VmHWM is Linux's (/proc/self/status)")
    # The lowest of up to three fresh processes (the first at most ``limit`` ends the search): the same
    # load and forward peak a few MB apart from one process to the next (where the allocator's arenas and
    # the kernels' pages land), as timings are taken at their best.
    command = [sys.executable, "-c", MEASURE, str(path), how]
    best = math.inf
    for _ in range(3):
        out = subprocess.run(command, capture_output=True, text=True, check=True)
        best = min(best, json.loads(out.stdout.strip().splitlines()[-1])["extra"])
        if best <= limit:
            break
    return best


@pytest.mark.slow
def test_memory_of_the_real_q4_1_model_is_at_most_1_5x_its_file(smollm2_gguf):
    """SmolLM2's 98 MB file: its weights, plus what does not grow with the model (the gguf reader's
    parse of a 49,152-token header, kernels' code pages, the 64 x 49,152 logits, a tile of rows)."""
    size = smollm2_gguf.stat().st_size
    extra = extra_rss(smollm2_gguf, limit=1.5 * size)
    assert extra <= 1.5 * size, (extra, size)


@pytest.mark.slow
def test_memory_of_the_real_q4_1_model_loaded_as_the_commands_load_it(smollm2_gguf):
    """``load_pretrained``, as every command loads a file: the model, and the tokenizer built from the
    parsed header, which goes before the weights load. The tokenizer and its imports add a cost that
    does not grow with the weights (about 15 MB with SmolLM2's 49,152 tokens); the header's parse and
    the weights once peaked together, 78 MB above the model alone (2.2x the file)."""
    size = smollm2_gguf.stat().st_size
    model_alone = extra_rss(smollm2_gguf, limit=1.5 * size)
    extra = extra_rss(smollm2_gguf, limit=model_alone + 16e6, how="load_pretrained")
    assert extra - model_alone <= 32e6, (extra / size, model_alone / size)


@pytest.mark.slow
def test_memory_of_a_q4_k_model_is_at_most_1_5x_its_file(tmp_path):
    """A 170 MB Q4_K file (width 2048, 6 layers, random blocks): its weights and the fixed costs of a
    process that loads and runs a model (imports, kernels, the reader's parse of the header)."""
    width, hidden, layers = 2048, 5632, 6
    shapes = {"token_embd.weight": (gguf_files.VOCAB, width), "output.weight": (gguf_files.VOCAB, width)}
    for i in range(layers):
        for name, shape in (("attn_q", (width, width)), ("attn_k", (width, width)), ("attn_v", (width, width)),
                            ("attn_output", (width, width)), ("ffn_gate", (hidden, width)),
                            ("ffn_up", (hidden, width)), ("ffn_down", (width, hidden))):  # fmt: skip
            shapes[f"blk.{i}.{name}.weight"] = shape
        shapes[f"blk.{i}.attn_norm.weight"] = shapes[f"blk.{i}.ffn_norm.weight"] = (width,)
    shapes["output_norm.weight"] = (width,)
    meta = {"llama.embedding_length": width, "llama.block_count": layers, "llama.feed_forward_length": hidden,
            "llama.attention.head_count": 16, "llama.attention.head_count_kv": 16,
            "llama.rope.dimension_count": width // 16}  # fmt: skip
    path = write_quantized_gguf(tmp_path / "mid.Q4_K.gguf", "Q4_K", shapes=shapes, meta=meta)
    size = path.stat().st_size
    assert size > 150e6
    extra = extra_rss(path, limit=1.5 * size)
    assert extra <= 1.5 * size, (extra, size)


def test_blocks_of_the_wrong_kind_are_named():
    # bytes gave an AttributeError on .dtype, a shape of floats was truncated, "Q9" a KeyError.
    raw = np.zeros((4, 34), np.uint8)
    with pytest.raises(TypeError, match="raw must be a numpy array of the file's bytes"):
        QuantizedTensor.from_blocks("Q8_0", raw.tobytes(), (4, 32))
    for shape in ((4.5, 32), (-4, 32), (4,)):
        with pytest.raises(ValueError, match="shape must be \\(out_features, in_features\\), two positive ints"):
            QuantizedTensor.from_blocks("Q8_0", raw, shape)
    assert QuantizedTensor.from_blocks("Q8_0", raw, (np.int64(4), 32)).shape == (4, 32)
    with pytest.raises(ValueError, match="format must be one of"):
        q.dequantize("Q9", {})
