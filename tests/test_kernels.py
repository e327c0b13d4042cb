"""attnlab's kernel of a few float32 rows (:mod:`attnlab.kernels`) against the float64 product, and a
float32 batch decoded on it (eager and compiled steps) against the eager forward: the same greedy tokens,
logits to float32's rounding, the weights swapped for its panels only where it applies. Tests that run
the kernel are marked ``avx512``: they run on any CPU with AVX-512 (decoding takes the kernel on Intel's
only; here, on any CPU that runs it)."""

from __future__ import annotations

import gc
import inspect
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import decoding, hardware, kernels
from attnlab.model import GPT, GPTConfig

needs_kernel = pytest.mark.avx512
BASE = dict(vocab_size=64, context_length=48, emb_dim=96, n_heads=4, n_layers=2, drop_rate=0.0)
FAMILIES = {
    "gpt2": dict(qkv_bias=True),  # biases; GELU after the product
    "llama-gqa": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2, tie_embeddings=False),
}


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 19),
    lead=st.sampled_from([(), (1,)]),
    k=st.integers(1, 70),
    width=st.sampled_from([32, 48]),
    panels=st.integers(1, 5),
    bias=st.booleans(),
    strided=st.booleans(),
    bf16=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_rows_linear_is_the_float64_product(rows, lead, k, width, panels, bias, strided, bf16, seed):
    """``x (B, [1,] K) @ W.T + b`` for any number of rows (8 a pass over the weight), any ``K``, panels
    of either width, float32 or bfloat16 (widened exactly), and an ``x`` of any strides: the float64
    product to the rounding of float32 sums."""
    g = torch.Generator().manual_seed(seed)
    n = width * panels
    x = torch.randn(rows, *lead, 2 * k, generator=g)[..., ::2] if strided else torch.randn(rows, *lead, k, generator=g)
    w = torch.randn(n, k, generator=g)
    if bf16:
        w = w.to(torch.bfloat16).float()  # (the weights the bfloat16 panels hold, exactly)
    b = torch.randn(n, generator=g) if bias else None
    p = kernels.pack_panels(w)
    got = kernels.rows_linear(x, p.to(torch.bfloat16) if bf16 else p, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * k)


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    hd=st.integers(1, 80),
    slots=st.integers(1, 40),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_decode_attention_is_the_float64_softmax_over_the_filled_slots(rows, kv_heads, group, hd, slots, data, seed):
    """``softmax(q k^T * scale) v`` over slots ``0..slot`` of the cache (the rest, here NaN, never read),
    the ``G`` query heads of each key head against its keys: the float64 result to float32's rounding."""
    g = torch.Generator().manual_seed(seed)
    slot = data.draw(st.integers(0, slots - 1))
    q = torch.randn(rows, kv_heads, group, hd, generator=g)
    keys, values = (torch.full((rows, kv_heads, slots, hd), float("nan")) for _ in range(2))
    keys[:, :, : slot + 1] = 3 * torch.randn(rows, kv_heads, slot + 1, hd, generator=g)
    values[:, :, : slot + 1] = torch.randn(rows, kv_heads, slot + 1, hd, generator=g)
    scale = hd**-0.5
    got = kernels.decode_attention(q, keys, values, torch.tensor(slot), scale)
    k, v = keys[:, :, : slot + 1].double(), values[:, :, : slot + 1].double()
    weights = torch.softmax(q.double() @ k.transpose(-1, -2) * scale, dim=-1)  # (B, Hkv, G, S)
    ref = weights @ v  # (B, Hkv, G, hd)
    assert got.shape == ref.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    also, got_weights = kernels.decode_attention_weights(q, keys, values, torch.tensor(slot), scale)
    assert torch.equal(also, got) and got_weights.shape == (rows, kv_heads, group, slots)
    torch.testing.assert_close(got_weights[..., : slot + 1].double(), weights, rtol=1e-5, atol=1e-6)
    assert not got_weights[..., slot + 1 :].any()  # (0 at the empty slots)


@needs_kernel
def test_decode_attention_names_the_argument_at_fault():
    q, k = torch.randn(2, 3, 2, 8), torch.randn(2, 3, 10, 8)
    with pytest.raises(ValueError, match=r"slot must be in \[0, 10\), got 10"):
        kernels.decode_attention(q, k, k, torch.tensor(10), 1.0)
    with pytest.raises(ValueError, match="keys and values contiguous"):
        kernels.decode_attention(q, k.transpose(2, 3), k.transpose(2, 3), torch.tensor(1), 1.0)
    with pytest.raises(TypeError, match="q, keys and values must be float32 CPU tensors, got Double"):
        kernels.decode_attention(q.double(), k, k, torch.tensor(1), 1.0)
    with pytest.raises(ValueError, match="slot must be one int64"):
        kernels.decode_attention(q, k, k, torch.tensor(1.0), 1.0)


def test_pack_panels_lays_out_the_weight_by_panels_and_refuses_what_it_cannot():
    w = torch.randn(96, 7)
    p = kernels.pack_panels(w)  # 96 = 2 x 48
    assert p.shape == (2, 7, 48) and p.is_contiguous()
    assert torch.equal(p.transpose(1, 2).reshape(96, 7), w)
    assert kernels.pack_panels(torch.randn(64, 5)).shape == (2, 5, 32)
    for bad in (torch.randn(40, 8), torch.randn(96, 8, dtype=torch.float64), torch.randn(96), torch.randn(48, 0)):
        with pytest.raises(ValueError, match="weight must be a float32"):
            kernels.pack_panels(bad)
    with pytest.raises(TypeError, match=r"weight must be a torch\.Tensor, got list"):
        kernels.pack_panels([[1.0] * 4] * 32)


@needs_kernel
def test_rows_linear_names_the_argument_at_fault():
    p, x = kernels.pack_panels(torch.randn(96, 8)), torch.randn(3, 8)
    with pytest.raises(TypeError, match="x must be a float32 CPU tensor, got Double"):
        kernels.rows_linear(x.double(), p)
    with pytest.raises(TypeError, match="panels must be a float32 or bfloat16 CPU tensor, got Half"):
        kernels.rows_linear(x, p.half())
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 8\) .* got shape \[3, 7\]"):
        kernels.rows_linear(torch.randn(3, 7), p)
    with pytest.raises(ValueError, match="x must be"):
        kernels.rows_linear(torch.tensor(1.0), p)
    with pytest.raises(ValueError, match=r"bias must be \(96\), got shape \[2, 48\]"):
        kernels.rows_linear(x, p, torch.randn(2, 48))
    with pytest.raises(ValueError, match="panels must be pack_panels'"):
        kernels.rows_linear(x, p.transpose(1, 2))
    assert kernels.rows_linear(torch.randn(0, 8), p).shape == (0, 96)  # no rows: nothing to do


def test_the_kernels_say_why_they_cannot_run(monkeypatch):
    """Called where they cannot run (no AVX-512, or no compiler): one clear error, not torch.ops' own."""
    monkeypatch.setattr(kernels, "_loaded", False)
    monkeypatch.setattr(kernels, "runs", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with pytest.raises(RuntimeError, match=r"need a CPU with AVX-512 .* vector unit is AVX2"):
        kernels.rows_linear(torch.randn(2, 8), torch.randn(1, 8, 32))
    with pytest.raises(RuntimeError, match="need a CPU with AVX-512"):
        kernels.decode_attention(*(torch.randn(1, 1, 1, 4),) * 3, torch.tensor(0), 1.0)


def test_the_kernel_runs_only_on_intel_cpus_with_avx512(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_vendor", lambda: "AuthenticAMD")
    assert not kernels.available()
    monkeypatch.setattr(hardware, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert not kernels.available()


def make(family: str, **overrides) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**BASE, **FAMILIES[family], **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4)
    return model


@needs_kernel
@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("vocab", [64, 61], ids=["head-on-panels", "head-packed"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_float32_batch_on_the_kernel_equals_the_eager_forward(family, vocab, compile, steps, monkeypatch):
    """A large model's float32 batch (here: any size counts as large) swaps its weights for panels; a
    head whose vocabulary does not divide into panels keeps oneDNN's packing (eager) or its registered
    copy (compiled), in the same step; the compiled step attends by decode_attention. The eager
    forward's tokens and logits, and no graph break."""
    monkeypatch.setattr(decoding, "_PACK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)  # (any CPU that runs it, Intel's or not)
    model = make(family, vocab_size=vocab)
    idx = torch.randint(0, vocab, (3, 6), generator=torch.Generator().manual_seed(1))
    decoder = decoding.FastDecoder(model, model.new_kv_caches(3, 16), compile=compile)
    assert all(w[j].dim() == 3 for w, *_ in decoder.layers for j in (2, 6, 12, 14))  # every projection
    assert (decoder.head[2].dim() == 3) == (vocab == 64)
    assert all(spec[12] == compile for _, spec, *_ in decoder.layers)  # decode_attention: the compiled step
    del decoder
    gc.collect()
    ref = model.generate(idx, 10, temperature=0, return_logits=True, fast=False)
    torch._dynamo.utils.counters.clear()
    got = model.generate(idx, 10, temperature=0, return_logits=True, compile=compile)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)
    assert steps[0] == 9
    assert not torch._dynamo.utils.counters["graph_break"]  # (the kernels' operators inside the graph)
    gc.collect()
    assert not decoding._PACKED  # (a head registered for the compiled step goes with its decoder)


@needs_kernel
def test_more_rows_and_other_dtypes_keep_onednn(monkeypatch):
    """Past 8 rows the kernel would read each weight once per 8: oneDNN's packing, which reads it once.
    A float64 or bfloat16 model, or one row, never takes the panels."""
    monkeypatch.setattr(decoding, "_PACK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    model = make("llama-gqa")
    assert decoding.FastDecoder(model, model.new_kv_caches(8, 16)).layers[0][0][2].dim() == 3
    nine = decoding.FastDecoder(model, model.new_kv_caches(9, 16)).layers[0][0][2]
    assert nine.layout == torch._mkldnn or not decoding.packs(nine, 9)
    assert decoding.FastDecoder(model, model.new_kv_caches(1, 16)).layers[0][0][2].dim() == 2
    for dtype in (torch.float64, torch.bfloat16):
        w = decoding.FastDecoder(model.to(dtype), model.new_kv_caches(3, 16)).layers[0][0][2]
        assert w.dim() == 2


@needs_kernel
def test_a_compiled_screened_decoder_on_panels_still_computes_its_logits(monkeypatch):
    """Every weight on panels and the head screened (so nothing registered for the packed operator): a
    step that asks for the logits multiplies the plain float32 head, the eager forward's logits."""
    monkeypatch.setattr(decoding, "_PACK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(decoding, "SCREEN_MIN_VOCAB", 0)
    monkeypatch.setattr(decoding, "screens", lambda model, device: True)
    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    model = make("llama-gqa")
    idx = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(2))
    caches = model.new_kv_caches(3, 16)
    with torch.no_grad():
        ref = model(idx)[:, -1]  # (B, V): the eager forward's next-token logits
        model(idx[:, :-1], kv_caches=caches)
        decoder = decoding.FastDecoder(model, caches, compile=True, tokens_only=True)
        assert decoder.screen is not None and decoder.layers[0][0][2].dim() == 3
        torch.testing.assert_close(decoder.step(idx[:, -1]), ref, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.slow
def test_the_built_kernel_is_kept_and_loaded_by_later_processes(tmp_path):
    """The first process builds in a folder of its own and keeps the library (named by the source, the
    flags, torch and Python); the next loads it without building; where nothing can be kept the kernel
    still runs."""
    code = "import logging; logging.basicConfig(level=logging.INFO); from attnlab import kernels; print(kernels.runs())"

    def run(extensions_dir):
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_dir)}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip(), done.stderr

    out, log = run(tmp_path)
    assert out == "True" and "building attnlab's kernels" in log
    assert len(list(tmp_path.glob("attnlab_kernels_*.so"))) == 1
    assert not list(tmp_path.glob(".*tmp"))  # (written atomically: no temporary left)
    out, log = run(tmp_path)
    assert out == "True" and "building" not in log
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # (a file where the folder would go: nothing can be kept)
    out, log = run(blocked)
    assert out == "True" and "could not keep the built kernel" in log


# --------------------------------------------------------------------------------------------
# A GGUF file's blocks (pack_blocks, block_linear)
# --------------------------------------------------------------------------------------------
def quantized(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """``w`` as a GGUF file holds it in ``qtype`` and the loader gives it back in float32: quantized and
    dequantized by the ``gguf`` package (llama.cpp's reference quantizers)."""
    gguf = pytest.importorskip("gguf")
    kind = gguf.GGMLQuantizationType[qtype]
    return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), kind), kind).copy())


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    qtype=st.sampled_from(["Q4_1", "Q4_0", "Q8_0"]),
    rows=st.integers(1, 19),
    k_blocks=st.integers(1, 6),
    width=st.sampled_from([32, 48]),
    panels=st.integers(1, 4),
    scale=st.sampled_from([1e-3, 1.0, 300.0]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_block_linear_on_a_gguf_quantization_is_the_float64_product(
    qtype, rows, k_blocks, width, panels, scale, bias, seed
):
    """A weight quantized as llama.cpp does, then dequantized to float32 (a GGUF model loaded in float32):
    pack_blocks finds its blocks back (Q4_0's as Q4_1's with ``m = -8 d``, whatever the sign of ``d``),
    and block_linear on them is the float64 product of the float32 weight to float32's rounding; a pass
    of 3-8 rows sums exactly as rows_linear does, bit for bit."""
    g = torch.Generator().manual_seed(seed)
    n, k = width * panels, 32 * k_blocks
    w = quantized(scale * torch.randn(n, k, generator=g), qtype)
    blocks = kernels.pack_blocks(w)
    assert blocks is not None and blocks.dtype == torch.uint8
    assert blocks.numel() == n * k // 32 * (34 if qtype == "Q8_0" else 20)  # 8.5 or 5 bits a weight
    x = torch.randn(rows, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    got = kernels.block_linear(x, blocks, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * k * scale)
    if 3 <= rows <= 8:
        assert torch.equal(got, kernels.rows_linear(x, kernels.pack_panels(w), b))


@needs_kernel
def test_pack_blocks_keeps_a_weight_float32_unless_every_value_comes_back_exactly():
    torch.manual_seed(0)
    w = quantized(torch.randn(64, 96), "Q4_1")
    assert kernels.pack_blocks(w) is not None
    assert kernels.pack_blocks(torch.randn(64, 96)) is None  # (not a quantization)
    for edit in (
        lambda t: t.__setitem__((5, 40), torch.nextafter(t[5, 40], torch.tensor(9.0))),  # one weight one ulp off
        lambda t: t.__setitem__((63, 95), float("nan")),
        lambda t: t.__setitem__((0, 0), float("inf")),
    ):
        edited = w.clone()
        edit(edited)
        assert kernels.pack_blocks(edited) is None
    assert kernels.pack_blocks(w[:40]) is None  # 40 rows: not 32 or 48 a panel
    assert kernels.pack_blocks(w[:, :80]) is None  # 80 columns: not whole blocks of 32
    assert kernels.pack_blocks(torch.zeros(32, 32)) is not None  # (d = 0: every q 0)
    flat = torch.full((32, 32), 0.5)  # (every weight m, d = 0) ...
    assert kernels.pack_blocks(flat) is not None
    flat[7, 3] = float("nan")  # ... but one NaN, which a minimum or maximum may skip
    assert kernels.pack_blocks(flat) is None
    assert kernels.pack_blocks(torch.full((32, 32), 1e-44)) is None  # (a scale that rounds to 0: not 0 weights)
    with pytest.raises(ValueError, match=r"weight must be a float32 \(N, K\) matrix on the CPU, got torch.float64"):
        kernels.pack_blocks(w.double())
    with pytest.raises(TypeError, match=r"weight must be a torch\.Tensor, got ndarray"):
        kernels.pack_blocks(w.numpy())


@needs_kernel
def test_block_linear_names_the_argument_at_fault():
    blocks, x = kernels.pack_blocks(quantized(torch.randn(96, 64), "Q8_0")), torch.randn(3, 64)
    with pytest.raises(TypeError, match="x must be a float32 CPU tensor, got Double"):
        kernels.block_linear(x.double(), blocks)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 64\) .* got shape \[3, 32\]"):
        kernels.block_linear(torch.randn(3, 32), blocks)
    with pytest.raises(ValueError, match=r"bias must be \(96\), got shape \[48\]"):
        kernels.block_linear(x, blocks, torch.randn(48))
    with pytest.raises(TypeError, match="blocks must be a uint8 CPU tensor"):
        kernels.block_linear(x, blocks.float())
    with pytest.raises(ValueError, match="blocks must be pack_blocks'"):
        kernels.block_linear(x, blocks[:, :, :100].contiguous())


def gguf_model(family: str, **overrides) -> GPT:
    """:func:`make`'s model with every matrix as a GGUF file would give it back in float32: the layers'
    Q4_1, the embeddings and head Q8_0 (as llama.cpp's Q4_1 files keep them)."""
    model = make(family, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(quantized(p.detach(), "Q8_0" if "emb" in name or "out_head" in name else "Q4_1"))
    return model


@needs_kernel
@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_gguf_models_decoding_reads_its_blocks_and_equals_the_eager_forward(
    family, rows, compile, steps, monkeypatch
):
    """A float32 model whose matrices are a GGUF quantization's: one row or a batch, the decoder reads every
    projection and the head from their blocks (the compiled step attends by decode_attention), with the
    eager forward's tokens and logits and no graph break, all its layers and the head one compiled call
    whatever the groups of other models; an edit to a weight between generations is seen."""
    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    monkeypatch.setattr(decoding, "_GROUP", 1)  # (a layer a call for a model on float32 weights)
    model = gguf_model(family)
    idx = torch.randint(0, 64, (rows, 6), generator=torch.Generator().manual_seed(1))
    decoder = decoding.FastDecoder(model, model.new_kv_caches(rows, 16), compile=compile)
    assert all(w[j].dtype == torch.uint8 for w, *_ in decoder.layers for j in (2, 6, 12, 14))
    assert len(decoder.groups) == 1 < len(decoder.layers)
    assert decoder.head[2].dtype == torch.uint8 and decoder.screen is None
    assert all(spec[12] == compile for _, spec, *_ in decoder.layers)
    # (compiled, a Llama-style block runs whole in one call of block_layer; GPT-2's has biases and GELU;
    # and a model of such blocks, compiled or not, steps in one call of block_step)
    assert all(spec[13] == (compile and family == "llama-gqa") for _, spec, *_ in decoder.layers)
    assert (decoder.stepper is not None) == (family == "llama-gqa")
    del decoder
    for _ in range(2):
        ref = model.generate(idx, 10, temperature=0, return_logits=True, fast=False)
        torch._dynamo.utils.counters.clear()
        steps[0] = 0
        got = model.generate(idx, 10, temperature=0, return_logits=True, compile=compile)
        assert torch.equal(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)
        assert steps[0] >= 9  # (every step on the fast path; a small model's compiled chunks run 4 at once)
        assert not torch._dynamo.utils.counters["graph_break"]
        with torch.no_grad():  # an edit no version counter sees: the next generation's blocks are found anew
            model.trf_blocks[0].ff.layers[0].weight.data[:, :32] *= -1


@needs_kernel
def test_a_model_with_a_matrix_off_its_quantization_keeps_its_groups_of_layers(monkeypatch):
    """One call for all layers only where every layer's products read blocks: a weight one ulp off its
    quantization keeps float32 (inductor's own loops in the graph), and the layers their groups."""
    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    monkeypatch.setattr(decoding, "_GROUP", 1)
    model = gguf_model("llama-gqa")
    caches = model.new_kv_caches(1, 16)
    assert len(decoding.FastDecoder(model, caches, compile=True).groups) == 1
    with torch.no_grad():
        w = model.trf_blocks[-1].ff.layers[2].weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(1.0))
    decoder = decoding.FastDecoder(model, caches, compile=True)
    assert decoder.layers[-1][0][14].dtype == torch.float32 and decoder.layers[0][0][14].dtype == torch.uint8
    assert len(decoder.groups) == len(decoder.layers) > 1


@needs_kernel
def test_a_model_loaded_from_a_q4_1_gguf_file_decodes_from_its_blocks(tmp_path, monkeypatch):
    """Through the loader: a Llama written to a Q4_1 GGUF file as llama.cpp does, loaded in float32, has
    its projections found back as blocks; greedy decoding gives the eager forward's tokens."""
    gguf_files = pytest.importorskip("gguf_files")
    pytest.importorskip("transformers")
    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    path = gguf_files.write_gguf(tmp_path / "tiny.Q4_1.gguf", qtype="Q4_1")
    model = GPT.from_gguf(path, dtype=torch.float32).eval()
    decoder = decoding.FastDecoder(model, model.new_kv_caches(1, 16))
    assert all(w[j].dtype == torch.uint8 for w, *_ in decoder.layers for j in (2, 6, 12, 14))
    idx = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    ref = model.generate(idx, 8, temperature=0, fast=False)
    assert torch.equal(model.generate(idx, 8, temperature=0), ref)


@needs_kernel
def test_block_linear_takes_any_number_of_blocks_and_decode_attention_empty_heads():
    """A weight of more than 16,384 inputs (Qwen2.5-7B's MLP: 18,944) and heads of no features: no limit
    of the kernels' own, no out-of-bounds read."""
    torch.manual_seed(0)
    w = quantized(torch.randn(32, 32 * 600), "Q8_0")
    x = torch.randn(2, 32 * 600)
    got = kernels.block_linear(x, kernels.pack_blocks(w))
    torch.testing.assert_close(got.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-2)
    q, k = torch.randn(1, 2, 3, 0), torch.randn(1, 2, 5, 0)
    assert kernels.decode_attention(q, k, k, torch.tensor(2), 1.0).shape == (1, 2, 3, 0)


@needs_kernel
def test_a_short_generation_keeps_the_float32_weights(monkeypatch):
    """Finding the blocks costs more than a few steps save: an eager generation known to be shorter than
    _BLOCK_MIN_STEPS keeps the float32 weights (one of unknown length, or compiled, reads the blocks)."""
    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    model = gguf_model("llama-gqa")
    short = decoding.FastDecoder(model, model.new_kv_caches(1, 16), steps=decoding._BLOCK_MIN_STEPS - 1)
    assert not short.blocks and short.layers[0][0][2].dtype == torch.float32
    assert decoding.FastDecoder(model, model.new_kv_caches(1, 16), steps=None).blocks
    # Compiled, always the blocks: a graph on the float32 weights would be another compilation (serve's
    # precompiled graphs read the blocks, whatever a request's length)
    compiled = decoding.FastDecoder(model, model.new_kv_caches(1, 16), compile=True, steps=1)
    assert compiled.blocks


@needs_kernel
@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 3])
def test_an_observed_compiled_step_on_the_blocks_hands_over_the_eager_records(rows, monkeypatch):
    """Every layer observed (serve's stream): the compiled step reads the blocks and attends by
    decode_attention_weights, and hands the observers the eager forward's records (their weights 0 at
    the slots not yet filled, as the masked loops gave them)."""
    from test_fast_decode_observed import assert_same_records, observed_generation

    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    model = gguf_model("llama-gqa")
    idx = torch.randint(0, 64, (rows, 5), generator=torch.Generator().manual_seed(3))
    (ref, ref_logits), ref_records = observed_generation(model, idx, 10, fast=False)
    (ids, logits), records = observed_generation(model, idx, 10, compile=True)
    assert torch.equal(ids, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert_same_records(ref_records, records, 1e-5)


# --------------------------------------------------------------------------------------------
# A whole Llama-style block in one call (block_layer)
# --------------------------------------------------------------------------------------------
@needs_kernel
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    kv_heads=st.integers(1, 2),
    group=st.integers(1, 3),
    hd=st.sampled_from([32, 64]),
    width=st.sampled_from([64, 96]),
    hidden=st.sampled_from([64, 96]),
    slots=st.integers(1, 12),
    rope=st.booleans(),
    weights=st.booleans(),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_block_layer_is_the_float64_block(rows, kv_heads, group, hd, width, hidden, slots, rope, weights, data, seed):
    """block_layer on a block's GGUF blocks (the layers' Q4_1, or Q8_0) against the eager step's math of the
    same block (:func:`attnlab.decoding._layer`, SDPA over the filled slots) in float64: the output, the
    new key and value in their slot (the other slots untouched), the queries after RoPE, the heads'
    outputs and the attention's weights (0 past the slot)."""
    g = torch.Generator().manual_seed(seed)
    qtype = data.draw(st.sampled_from(["Q4_1", "Q8_0"]))
    H, C, F = kv_heads * group, width, hidden
    pos = data.draw(st.integers(0, slots - 1))

    def matrix(n: int, k: int) -> torch.Tensor:
        return quantized(torch.randn(n, k, generator=g) / k**0.5, qtype)

    mats = [matrix((H + 2 * kv_heads) * hd, C), matrix(C, H * hd), matrix(2 * F, C), matrix(C, F)]
    n1, n2 = 1 + 0.1 * torch.randn(C, generator=g), 1 + 0.1 * torch.randn(C, generator=g)
    x = torch.randn(rows, 1, C, generator=g)
    keys, values = torch.randn(2, rows, kv_heads, slots, hd, generator=g)
    angles = torch.rand(hd // 2, generator=g) * 6
    cos, sin = (torch.cat([angles, angles]).cos(), torch.cat([angles, angles]).sin()) if rope else (None, None)
    scale = hd**-0.5
    spec = (("rms", 1e-5, 0.0), False, None, H, kv_heads, hd, hd, scale, ("swiglu", "tanh"), False, False, "eager")
    spec = (*spec, False, False)
    w = [None] * 18
    w[0], w[2], w[6], w[10], w[12], w[14] = n1, *mats[:2], n2, *mats[2:]
    ref_k, ref_v = keys.double(), values.double()
    w64 = tuple(None if t is None else t.double() for t in w)
    c64 = None if cos is None else cos.double()
    s64 = None if sin is None else sin.double()
    records = []
    ref = decoding._layer(
        x.double(), c64, s64, ref_k, ref_v, pos, w64, spec, False, lambda *r: records.append(r), filled=pos + 1
    )
    got_k, got_v = keys.clone(), values.clone()
    blocks = [kernels.pack_blocks(m) for m in mats]
    products = (n1, blocks[0], blocks[1], n2, blocks[2], blocks[3])
    out, q, heads, w_att = kernels.block_layer(
        x, None if cos is None else (cos, sin), got_k, got_v, torch.tensor(pos), products, H, scale, 1e-5, weights
    )
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(got_k.double(), ref_k, **tol)
    torch.testing.assert_close(got_v.double(), ref_v, **tol)
    q_ref, _, _, weights_ref, heads_ref = records[0]  # (B, H, 1, hd), ..., (B, H, 1, S), (B, H, 1, hd)
    torch.testing.assert_close(q.double(), q_ref, **tol)
    torch.testing.assert_close(heads.reshape(rows, H, 1, hd).double(), heads_ref, **tol)
    if weights:
        w_att = w_att.reshape(rows, H, slots)
        torch.testing.assert_close(w_att[..., : pos + 1].double(), weights_ref[:, :, 0], **tol)
        assert not w_att[..., pos + 1 :].any()
    else:
        assert w_att.numel() == 0


@needs_kernel
def test_block_layer_names_the_argument_at_fault():
    torch.manual_seed(0)
    mats = [quantized(torch.randn(n, k), "Q4_1") for n, k in ((128, 64), (64, 64), (128, 64), (64, 64))]
    blocks = [kernels.pack_blocks(m) for m in mats]
    norm = torch.ones(64)
    x, keys, values = torch.randn(1, 1, 64), torch.zeros(1, 1, 8, 32), torch.zeros(1, 1, 8, 32)
    products = (norm, blocks[0], blocks[1], norm, blocks[2], blocks[3])

    def call(**change):
        args = dict(x=x, rope=None, keys=keys, values=values, slot=torch.tensor(3), weights=products, heads=2)
        args.update(change)
        return kernels.block_layer(**args, scale=1.0, eps=1e-5)

    assert call()[0].shape == (1, 1, 64)
    with pytest.raises(TypeError, match="must be float32 CPU tensors, got Double"):
        call(x=x.double())
    with pytest.raises(ValueError, match=r"x must be \(B, 1, C\) with B from 1 to 8, got shape \[9, 1, 64\]"):
        call(x=torch.randn(9, 1, 64), keys=torch.zeros(9, 1, 8, 32), values=torch.zeros(9, 1, 8, 32))
    with pytest.raises(ValueError, match="heads must be a multiple of the cache's 1 key heads"):
        call(heads=0)
    with pytest.raises(ValueError, match=r"slot must be in \[0, 8\), got 8"):
        call(slot=torch.tensor(8))
    with pytest.raises(ValueError, match=r"the products must multiply .* got \(K, N\) \(64, 128\), \(64, 64\)"):
        call(heads=1)  # (q/k/v would be 96 outputs)
    with pytest.raises(TypeError, match="qkv must be a uint8 CPU tensor"):
        call(weights=(norm, mats[0], *products[2:]))
    with pytest.raises(ValueError, match="cos and sin must be float32, contiguous, 32 values each"):
        call(rope=(torch.ones(16), torch.ones(16)))
    with pytest.raises(ValueError, match=r"the norms' weights must be \(64\)"):
        call(weights=(torch.ones(32), *products[1:]))


@needs_kernel
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_serves_rows_from_the_one_call_step_are_the_eager_records(compile, monkeypatch):
    """A model of Llama-style blocks on their blocks steps in one call of block_step, compiled or not, no
    graph compiled; under observe_attention_rows (serve's stream) each pass's rows are the eager forward's
    records' last rows, with the same positions, tokens and logits. An observer that wants whole records
    takes the compiled step's observed graph (compiled) or the eager step (not)."""
    from test_fast_decode_observed import assert_same_records, graphs, observed_generation, row_passes

    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    model = gguf_model("llama-gqa")
    idx = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(6))
    (ref, ref_logits), records = observed_generation(model, idx, 10, fast=False)
    L = len(model.trf_blocks)
    want = [records[i : i + L] for i in range(0, len(records), L)]
    calls = []  # each block_step call's with_weights
    step = kernels.block_step

    def spy(*args, **kwargs):
        bound = inspect.signature(step).bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(bound.arguments["with_weights"])
        return step(*args, **kwargs)

    monkeypatch.setattr(decoding.kernels, "block_step", spy)
    before = graphs()
    (ids, logits), passes = row_passes(model, idx, 10, compile=compile)
    assert torch.equal(ids, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert len(passes) == len(want) and calls == [True] * (len(want) - 1)  # (the prompt's pass: the forward)
    for (rows, q_pos, k_pos), layers in zip(passes, want, strict=True):
        expected = torch.stack([r.weights[:, :, -1] for _, r in layers])  # (L, B, H, S)
        torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-5)
        first = layers[0][1]
        assert torch.equal(q_pos, first.q_positions) and torch.equal(k_pos, first.k_positions)
    assert graphs() == before
    calls.clear()
    (ids, logits), got = observed_generation(model, idx, 10, compile=compile)
    assert torch.equal(ids, ref) and not calls
    assert_same_records(records, got, 1e-5)
    # (plain greedy decoding: one call a step; compiled, this small model's steps run 4 to a compiled call)
    assert torch.equal(model.generate(idx, 10, temperature=0, compile=compile), ref)
    assert calls == ([] if compile else [False] * 9)


@needs_kernel
def test_block_step_names_the_argument_at_fault():
    torch.manual_seed(0)
    mats = [quantized(torch.randn(n, k), "Q4_1") for n, k in ((128, 64), (64, 64), (128, 64), (64, 64), (96, 64))]
    blocks = [kernels.pack_blocks(m) for m in mats]
    norm = torch.ones(64)
    layer = [norm, blocks[0], blocks[1], norm, blocks[2], blocks[3]]
    x, cache = torch.randn(1, 1, 64), torch.zeros(1, 1, 8, 32)

    def call(**change):
        args = dict(x=x, rope=None, keys=[cache], values=[cache.clone()], positions=[], slot=torch.tensor(2))
        args.update(layers=layer, heads=2, scale=1.0, eps=1e-5, final_norm=norm, head=blocks[4])
        args.update(change)
        return kernels.block_step(**args)

    logits, weights = call()
    assert logits.shape == (1, 96) and weights.numel() == 0
    assert call(with_weights=True)[1].shape == (1, 1, 2, 3)  # (the filled slots)
    with pytest.raises(ValueError, match=r"slot must be in \[0, 8\), got 8"):
        call(slot=torch.tensor(8))
    with pytest.raises(ValueError, match="keys and values must be one tensor a block and layers six, got 1, 1 and 5"):
        call(layers=layer[:5])
    with pytest.raises(ValueError, match=r"final_norm must be float32 \(C\) for x \(B, 1, C\)"):
        call(final_norm=torch.ones(32))
    with pytest.raises(TypeError, match="head must be a uint8 CPU tensor"):
        call(head=mats[4])
    with pytest.raises(ValueError, match=r"positions must be int64 \(B, M\) past the slot"):
        call(positions=[torch.zeros(1, 2, dtype=torch.long)])
    positions = torch.full((1, 8), -1)
    call(positions=[positions])
    assert positions.tolist() == [[-1, -1, 2, -1, -1, -1, -1, -1]]


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(0, 19),
    lead=st.sampled_from([(), (1,)]),
    blocks=st.integers(1, 5),
    n=st.integers(1, 40),
    bias=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bf16_linear_is_the_float64_product_rounded_to_bfloat16(rows, lead, blocks, n, bias, strided, seed):
    """``x (B, [1,] K) @ W.T + b`` in bfloat16 for any number of rows (8 a pass over the weight), any
    ``N`` (its last rows fewer than 8) and ``K`` a multiple of 32, an ``x`` of any strides: the float64
    product of the same bfloat16 values, to one rounding to bfloat16 and float32's sums."""
    g = torch.Generator().manual_seed(seed)
    k = 32 * blocks
    x = torch.randn(rows, *lead, 2 * k, generator=g)[..., ::2] if strided else torch.randn(rows, *lead, k, generator=g)
    x, w = x.bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    assert_bf16_product(x, w, w, b, seed)


def assert_bf16_product(x, w, weight, b, seed):
    """bf16_linear of ``x (B, [1,] K)`` by ``weight`` (``w (N, K)`` as it lies, or packed) is the float64
    product of the same bfloat16 values to one rounding to bfloat16 and float32's sums; and a row's sums
    keep one order whatever the rows beside it (alone: the same bits)."""
    got = kernels.bf16_linear(x, weight, b)
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), ref, rtol=2**-8, atol=1e-6 * w.shape[1])
    if x.shape[0]:
        i = seed % x.shape[0]
        assert torch.equal(kernels.bf16_linear(x[i : i + 1], weight, b), got[i : i + 1])


needs_amx = pytest.mark.skipif(
    not (kernels.runs() and kernels.amx_available()), reason="needs a CPU with AMX's bfloat16 tiles (an Intel Xeon)"
)


@needs_amx
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 19),
    blocks=st.integers(1, 4),
    groups=st.integers(1, 3),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bf16_linear_on_amx_tiles_is_the_float64_product_rounded_to_bfloat16(rows, blocks, groups, bias, seed):
    """pack_amx's weight through bf16_linear (AMX's tiles): the float64 product of the same bfloat16
    values to one rounding and float32's sums, for any number of rows; a row alone gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    k, n = 32 * blocks, 48 * groups
    x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    assert_bf16_product(x, w, kernels.pack_amx(w), b, seed)


@needs_amx
def test_pack_amx_lays_out_tiles_and_names_the_argument_at_fault():
    w = torch.randn(96, 64).bfloat16()
    p = kernels.pack_amx(w)  # (N / 16, K / 32, 16, 16, 2): p[a, c, r, j, t] = w[16 a + j, 32 c + 2 r + t]
    assert p.shape == (6, 2, 16, 16, 2) and p[1, 1, 3, 5, 1] == w[16 + 5, 32 + 7]
    with pytest.raises(ValueError, match=r"multiple of 48 rows, got shape \[32, 64\]"):
        kernels.pack_amx(w[:32])
    with pytest.raises(TypeError, match="weight must be a bfloat16 CPU tensor, got Float"):
        kernels.pack_amx(w.float())
    with pytest.raises(ValueError, match=r"weight must be pack_amx's .* got BFloat16 \[6, 2, 16, 8, 4\]"):
        kernels.bf16_linear(torch.randn(2, 64).bfloat16(), p.reshape(6, 2, 16, 8, 4))


@needs_kernel
def test_without_amx_a_bfloat16_batch_keeps_its_matrices(monkeypatch):
    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    monkeypatch.setattr(decoding.kernels, "amx_available", lambda: False)
    model = make("llama-gqa", emb_dim=96).to(torch.bfloat16)
    decoder = decoding.FastDecoder(model, model.new_kv_caches(3, 16))
    assert decoder.stepper is not None and not decoder.amx
    assert decoder.stepper["layers"][1] is decoder.layers[0][0][2]  # (the fused q/k/v matrix as it lies)


@needs_kernel
def test_bf16_linear_names_the_argument_at_fault():
    w, x = torch.randn(5, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    with pytest.raises(TypeError, match="weight must be a bfloat16 CPU tensor, got Float"):
        kernels.bf16_linear(x, w.float())
    with pytest.raises(ValueError, match=r"K a multiple of 32, got shape \[5, 48\]"):
        kernels.bf16_linear(x[:, :48], w[:, :48].contiguous())
    with pytest.raises(ValueError, match=r"contiguous \(N, K\) matrix, K a multiple of 32, got shape \[5, 64\]"):
        kernels.bf16_linear(x, torch.randn(64, 5).bfloat16().T)
    with pytest.raises(TypeError, match="x must be a bfloat16 CPU tensor, got Float"):
        kernels.bf16_linear(x.float(), w)
    with pytest.raises(ValueError, match=r"x must be \(\.\.\., 64\) .* got shape \[3, 32\]"):
        kernels.bf16_linear(x[:, :32], w)
    with pytest.raises(ValueError, match=r"bias must be \(5\), got shape \[4\]"):
        kernels.bf16_linear(x, w, torch.zeros(4).bfloat16())
    with pytest.raises(TypeError, match="bias must be a bfloat16 CPU tensor, got Float"):
        kernels.bf16_linear(x, w, torch.zeros(5))


@needs_kernel
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_bfloat16_row_decodes_on_the_kernel_as_the_eager_forward(family, steps, monkeypatch):
    """The eager step of one bfloat16 row multiplies by bf16_linear (every product, the head too), or a
    model of Llama-style blocks steps in one call of block_step on its matrices: the eager forward's
    tokens and its logits to bfloat16's rounding. A batch takes the one-call step too, or keeps oneDNN."""
    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    model = make(family).to(torch.bfloat16)
    llama = family == "llama-gqa"
    products, whole = [], []
    real, step = kernels.bf16_linear, kernels.block_step
    monkeypatch.setattr(decoding.kernels, "bf16_linear", lambda *a: products.append(a[1].shape) or real(*a))
    monkeypatch.setattr(decoding.kernels, "block_step", lambda *a, **k: whole.append(1) or step(*a, **k))
    one = decoding.FastDecoder(model, model.new_kv_caches(1, 16))
    assert one.batch == "bf16" and (one.stepper is not None) == llama
    assert decoding.FastDecoder(model, model.new_kv_caches(1, 16), compile=True).batch != "bf16"
    batch = decoding.FastDecoder(model, model.new_kv_caches(3, 16))
    assert batch.batch != "bf16" and (batch.stepper is not None) == llama
    idx = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
    ref = model.generate(idx, 10, temperature=0, return_logits=True, fast=False)
    assert not products and not whole
    got = model.generate(idx, 10, temperature=0, return_logits=True)
    assert steps[0] == 9
    assert (len(products), len(whole)) == ((0, 9) if llama else (9 * (4 * 2 + 1), 0))  # (4 products a layer, the head)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=2e-2, atol=0.1)


@needs_kernel
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["one-call", "soft-cap"])
def test_a_bfloat16_batch_is_left_unpacked_only_for_the_one_call_step(softcap, monkeypatch):
    """A bfloat16 batch of Llama-style blocks leaves its products unpacked only where the one-call step
    takes them as they lie; with a logit soft cap, which block_step does not compute, it steps layer by
    layer on oneDNN's packed matrices, as any large batch does, and decodes as the eager forward."""
    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    monkeypatch.setattr(decoding, "_PACK_MIN_ELEMENTS", 0)  # (these models are below the size that packs)
    model = make("llama-gqa", logit_softcap=softcap).to(torch.bfloat16)
    decoder = decoding.FastDecoder(model, model.new_kv_caches(3, 16), steps=64)
    one_call = softcap is None
    assert (decoder.stepper is not None) == one_call
    assert (decoder.layers[0][0][2].layout == torch._mkldnn) != one_call  # (the fused q/k/v projection)
    idx = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(2))
    ref = model.generate(idx, 8, temperature=0, return_logits=True, fast=False)
    got = model.generate(idx, 8, temperature=0, return_logits=True)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=2e-2, atol=0.1)


@needs_kernel
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("width", [96, 128], ids=["hd24", "hd32"])  # (heads of 16 values' multiples: vectors)
def test_a_bfloat16_llama_steps_in_one_call_as_its_forward(width, rows, compile, monkeypatch):
    """A bfloat16 model of Llama-style blocks (bf16_linear takes its products) steps in one call of
    block_step on its matrices, compiled or not, no graph compiled: each step's logits are the eager
    forward's over the whole text to bfloat16's rounding (each operation's output rounded as the forward
    holds it, the sums float32), and so are the keys and values it writes into the caches and, under
    observe_attention_rows (serve's stream), every layer's attention row, in bfloat16."""
    from attnlab.interpret.tracing import observe_attention_rows
    from test_fast_decode_observed import graphs

    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    model = make("llama-gqa", emb_dim=width).to(torch.bfloat16)
    idx = torch.randint(0, 64, (rows, 6), generator=torch.Generator().manual_seed(2))
    caches = model.new_kv_caches(rows, 16)
    decoder = decoding.FastDecoder(model, caches, compile=compile)
    assert decoder.stepper is not None and decoder.stepper["head"] is model.out_head.weight
    # (a batch's products on AMX's tiles where the CPU has them: every product's N a multiple of 48, width 96's)
    assert decoder.amx == (rows > 1 and width == 96 and kernels.amx_available())
    calls = []
    step = kernels.block_step
    monkeypatch.setattr(decoding.kernels, "block_step", lambda *a, **k: calls.append(1) or step(*a, **k))
    before = graphs()
    got, want = [], []  # (each step's rows under observe_attention_rows, (L, B, H, S))
    with torch.inference_mode():
        logits = model.decode_logits(idx, None, caches, last_only=True)[:, -1]  # the prompt's (B, V)
        text = idx
        for _ in range(8):
            token = logits.argmax(-1)  # (B,)
            text = torch.cat([text, token[:, None]], dim=1)
            got.clear(), want.clear()
            with observe_attention_rows(model, lambda *r: got.append(r[0])):
                logits = decoder.step(token)
            assert logits.dtype == torch.bfloat16
            ref_caches = model.new_kv_caches(rows, 16)
            with observe_attention_rows(model, lambda *r: want.append(r[0])):
                ref = model.decode_logits(text, None, ref_caches, last_only=True)[:, -1]  # (B, V)
            torch.testing.assert_close(logits.float(), ref.float(), rtol=2e-2, atol=0.1)
            assert got[-1].dtype == torch.bfloat16 and got[-1].shape == want[-1].shape
            torch.testing.assert_close(got[-1].float(), want[-1].float(), rtol=2e-2, atol=1e-2)
            T = text.shape[1]
            for c, r in zip(caches, ref_caches, strict=True):
                torch.testing.assert_close(c.keys[:, :, :T].float(), r.keys[:, :, :T].float(), rtol=2e-2, atol=0.05)
                torch.testing.assert_close(c.values[:, :, :T].float(), r.values[:, :, :T].float(), rtol=2e-2, atol=0.05)
    assert len(calls) == 8 and graphs() == before


@needs_kernel
def test_block_step_of_a_bfloat16_model_names_the_argument_at_fault(monkeypatch):
    """A bfloat16 model's step takes bfloat16 matrices and float32 norms; a float32 one's, blocks: each
    argument of the wrong kind is a TypeError naming it."""
    monkeypatch.setattr(decoding.kernels, "available", kernels.runs)
    model = make("llama-gqa").to(torch.bfloat16)
    decoder = decoding.FastDecoder(model, model.new_kv_caches(1, 16))
    args = dict(decoder.stepper)
    x, rope, slot = torch.randn(1, 1, 96).bfloat16(), tuple(t[0] for t in decoder.rope_table), torch.tensor(0)
    assert kernels.block_step(x, rope, slot=slot, **args)[0].shape == (1, 64)
    blocks = kernels.pack_blocks(torch.zeros(64, 96))
    with pytest.raises(TypeError, match="block_step: head must be a bfloat16 CPU tensor, got Byte"):
        kernels.block_step(x, rope, slot=slot, **{**args, "head": blocks})
    layers = list(args["layers"])
    layers[1] = layers[1].float()
    with pytest.raises(TypeError, match="block_layer: qkv must be a bfloat16 CPU tensor, got Float"):
        kernels.block_step(x, rope, slot=slot, **{**args, "layers": layers})
    layers = list(args["layers"])
    layers[0] = layers[0].bfloat16()
    with pytest.raises(TypeError, match="the norms' weights must be float32 CPU tensors, got BFloat16"):
        kernels.block_step(x, rope, slot=slot, **{**args, "layers": layers})
    with pytest.raises(TypeError, match="block_step: head must be a uint8 CPU tensor"):  # (float32 x: blocks)
        kernels.block_step(x.float(), rope, slot=slot, **args)
