"""The fast decoding step of a batch on weights prepacked for oneDNN (:func:`attnlab.decoding.packs`),
against the eager forward: the same greedy tokens, logits to float32's (bfloat16's) rounding, the
packed copies made (a spy counts them) and used only where they apply; a model too small to pack
multiplies its batch in the compiled step's own loops."""

from __future__ import annotations

import gc

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import decoding, hardware
from attnlab.model import GPT, GPTConfig

BASE = dict(vocab_size=61, context_length=48, emb_dim=64, n_heads=4, n_layers=2, drop_rate=0.0)
FAMILIES = {
    "gpt2-gelu-tanh": dict(qkv_bias=True),  # GELU applied inside the packed matmul
    "tiny-gelu": dict(qkv_bias=False, activation="gelu"),
    "llama-gqa": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2, tie_embeddings=False),
}

needs_onednn = pytest.mark.skipif(
    not decoding.packs(torch.zeros(1), 2), reason="prepacked weights need a CPU build of torch with oneDNN"
)


@pytest.fixture
def packed(monkeypatch):
    """How many weights were prepacked for oneDNN (a spy on pack_linear); attnlab's own kernel of a few
    float32 rows, which takes the place of that packing where it runs, off (tests/test_kernels.py)."""
    monkeypatch.setattr(decoding.kernels, "available", lambda: False)
    count = [0]
    pack = decoding.pack_linear

    def spy(w, rows):
        count[0] += 1
        return pack(w, rows)

    monkeypatch.setattr(decoding, "pack_linear", spy)
    return count


def make(overrides: dict, dtype: torch.dtype) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**BASE, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4)
    return model.to(dtype)


def assert_agrees(model: GPT, idx: torch.Tensor, n: int) -> None:
    """``n`` greedy tokens on the fast path: the eager forward's tokens, its logits to float32's rounding."""
    ref = model.generate(idx, n, temperature=0, return_logits=True, fast=False)
    fast = model.generate(idx, n, temperature=0, return_logits=True)
    assert torch.equal(fast[0], ref[0])
    torch.testing.assert_close(fast[1], ref[1], rtol=1e-4, atol=1e-4)


@needs_onednn
@pytest.mark.parametrize("onednn", [True, False], ids=["oneDNN", "MKL"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_batch_on_packed_weights_equals_the_eager_forward(family, onednn, packed, monkeypatch):
    # A small float32 model's batch packs where hardware.linear multiplies float32 by oneDNN (a CPU not
    # Intel's); on an Intel CPU its MKL runs the plain weights (faster there). The same tokens either way.
    monkeypatch.setattr(hardware, "_onednn_linear_pays", lambda: onednn)
    model = make(FAMILIES[family], torch.float32)
    assert_agrees(model, torch.randint(0, BASE["vocab_size"], (5, 6), generator=torch.Generator().manual_seed(1)), 12)
    assert packed[0] == onednn * (4 * BASE["n_layers"] + 1)  # q/k/v, out, the MLP's two, each layer; the head


@needs_onednn
def test_bfloat16_batch_agrees_with_the_eager_forward(packed):
    if not decoding.packs(torch.zeros(1, dtype=torch.bfloat16), 2):
        pytest.skip("this CPU's oneDNN has no bfloat16 matmul")
    model = make(FAMILIES["gpt2-gelu-tanh"], torch.bfloat16)
    idx = torch.randint(0, BASE["vocab_size"], (4, 6), generator=torch.Generator().manual_seed(2))
    ref = model.generate(idx, 8, temperature=0, return_logits=True, fast=False)
    fast = model.generate(idx, 8, temperature=0, return_logits=True)
    # bfloat16 keeps 8 bits: the paths round differently, so compare the logits and the first token
    # (later tokens may flip on a near tie and then follow different texts).
    assert torch.equal(fast[0][:, 6], ref[0][:, 6])
    torch.testing.assert_close(fast[1][:, 0], ref[1][:, 0], rtol=0.05, atol=0.1)
    assert packed[0] > 0


@needs_onednn
@pytest.mark.parametrize("onednn", [True, False], ids=["oneDNN", "MKL"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_one_row_in_float32_multiplies_by_hardware_linears_kernel_on_the_plain_weights(
    family, onednn, packed, monkeypatch
):
    # One row, a short generation: nothing packed; the eager step's products go to hardware.linear's
    # kernel on the weights as they are: oneDNN's matmul (a spy counts them inside the steps), or on an
    # Intel CPU F.linear's MKL; the tokens and logits are the eager forward's either way.
    monkeypatch.setattr(hardware, "_onednn_linear_pays", lambda: onednn)  # (a CPU not Intel's, or Intel's)
    assert hardware.linear_on_onednn(torch.float32, "cpu") == onednn  # (its check of oneDNN made before the spy counts)
    calls, inside = [0], [False]
    mkldnn, step = torch.ops.mkldnn, decoding.FastDecoder.step

    class Spy:  # stands in for torch.ops.mkldnn
        def __getattr__(self, name):
            return getattr(mkldnn, name)

        @staticmethod
        def _linear_pointwise(x, w, *args):
            calls[0] += inside[0] and w.layout == torch.strided
            return mkldnn._linear_pointwise(x, w, *args)

    def spied_step(self, token):
        inside[0] = True
        try:
            return step(self, token)
        finally:
            inside[0] = False

    monkeypatch.setattr(decoding.torch.ops, "mkldnn", Spy(), raising=False)
    monkeypatch.setattr(decoding.FastDecoder, "step", spied_step)
    model = make(FAMILIES[family], torch.float32)
    assert_agrees(model, torch.randint(0, BASE["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(4)), 10)
    assert packed[0] == 0
    assert calls[0] == onednn * 9 * (4 * BASE["n_layers"] + 1)  # 9 steps x (4 a layer + the head)
    assert not hardware.linear_on_onednn(torch.float64, "cpu")  # float64: F.linear
    assert not hardware.linear_on_onednn(torch.bfloat16, "cpu")  # (F.linear calls oneDNN itself)


def test_packing_applies_only_to_a_batch_of_float32_or_bfloat16_on_a_cpu(monkeypatch):
    w = torch.zeros(4, 4)
    assert not decoding.packs(w, 1)  # one row: the compiled step's matrix-vector products
    assert not decoding.packs(w.double(), 8)  # oneDNN has no float64 matmul
    assert not decoding.packs(torch.zeros(4, 4, device="meta"), 8)
    if decoding.packs(w, 8):  # a oneDNN whose packed matmul differs from F.linear (a build, a CPU): plain
        decoding._packed_linear_works.cache_clear()
        monkeypatch.setattr(torch.nn.functional, "linear", lambda x, w, b=None: torch.zeros(x.shape[0], w.shape[0]))
        try:
            assert not decoding.packs(w, 8)
        finally:
            decoding._packed_linear_works.cache_clear()


@needs_onednn
@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2-gelu-tanh", "llama-gqa"])
def test_the_compiled_step_of_a_batch_on_packed_weights_equals_the_eager_forward(family, packed, steps, monkeypatch):
    """The compiled graph calls packed_linear on plain weights; it finds the copies the decoder
    registered (a spy on the registry counts the finds), and they go when the decoder does."""
    monkeypatch.setattr(decoding, "_PACK_MIN_ELEMENTS", 0)  # (these models are below the size that packs)
    calls = [0]

    class Registry(dict):  # counts the packed copies packed_linear finds
        def get(self, key, default=None):
            found = super().get(key, default)
            calls[0] += found is not None
            return found

    monkeypatch.setattr(decoding, "_PACKED", Registry())
    model = make(FAMILIES[family], torch.float32)
    idx = torch.randint(0, BASE["vocab_size"], (3, 6), generator=torch.Generator().manual_seed(3))
    ref = model.generate(idx, 10, temperature=0, return_logits=True, fast=False)
    got = model.generate(idx, 10, temperature=0, return_logits=True, compile=True)
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)
    assert packed[0] == 4 * BASE["n_layers"] + 1
    assert steps[0] == 9, steps
    assert calls[0] == 9 * (4 * BASE["n_layers"] + 1), calls  # every matmul of the 9 steps on a packed weight
    gc.collect()
    assert not decoding._PACKED  # released with the decoder


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    lead=st.sampled_from([(), (1,)]),
    k=st.integers(1, 40),
    n=st.integers(1, 24),
    bias=st.booleans(),
    transposed=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_a_batch_summed_row_by_row_is_the_float64_product(rows, lead, k, n, bias, transposed, dtype, seed):
    """``_matvec(..., "rows")`` (a small model's batch in the compiled step: one sum per row), the
    broadcast ``"reduce"`` and ``"streams"`` (a large model's row: four sums at once over blocks of
    ``w``'s rows where they divide evenly) are ``x @ w.T + b`` of ``x (B, [1,] K)``, for a weight of
    any strides: the float64 product to the rounding of float32 sums (bfloat16: of the result's
    bfloat16)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, *lead, k, generator=g).to(dtype)
    w = torch.randn(k, n, generator=g).to(dtype).t() if transposed else torch.randn(n, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    tol = dict(rtol=1e-5, atol=1e-5 * k) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-2 * k**0.5)
    for how in ("rows", "reduce", "streams"):
        got = decoding._matvec(x, w, b, how)
        assert got.shape == ref.shape and got.dtype == dtype
        torch.testing.assert_close(got.double(), ref, **tol)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [3, decoding._ROWS + 1])
def test_the_compiled_step_of_a_small_models_batch_multiplies_in_its_own_loops(dtype, rows, packed, steps, monkeypatch):
    """A model too small to pack: on a CPU the compiled step of its batch multiplies in inductor's loops
    (``"reduce"``, as one row's: up to ``_ROWS`` rows one sum per row, more rows one sum over the
    batch), nothing packed, with the eager forward's tokens and logits; packed once the model counts as
    large (where oneDNN packs), a matmul on a GPU, and a float32 batch's matmul where MKL's kernels are
    Intel's (an Intel CPU, either way on any CPU here), with the same tokens and logits."""
    model = make(FAMILIES["llama-gqa"], dtype)
    caches = model.new_kv_caches(rows, 16)
    monkeypatch.setattr(hardware, "mkl_runs_float32", lambda device: False)  # (a CPU not Intel's)
    assert decoding.FastDecoder(model, caches, compile=True).batch == "reduce"
    assert decoding._how(True, rows, "reduce") == ("rows" if rows <= decoding._ROWS else "reduce")
    assert decoding._how(True, 1, "reduce") == "reduce" and decoding._how(True, 3, "packed") == "packed"
    assert decoding._how(True, 1, "plain") == "streams"  # one row of a large model
    assert decoding._batch_products(decoding._large(model), False, cpu=False) == "plain"
    idx = torch.randint(0, BASE["vocab_size"], (rows, 6), generator=torch.Generator().manual_seed(6))
    ref = model.generate(idx, 10, temperature=0, return_logits=True, fast=False)
    got = model.generate(idx, 10, temperature=0, return_logits=True, compile=True)
    assert packed[0] == 0 and steps[0] == -(-9 // decoding._CHUNK) * decoding._CHUNK  # (greedy: in chunks)
    if dtype == torch.float32:
        assert torch.equal(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)
    else:  # (the first token and logits, as the bfloat16 test above: later ones may flip on a near tie)
        assert torch.equal(got[0][:, 6], ref[0][:, 6])
        torch.testing.assert_close(got[1][:, 0], ref[1][:, 0], rtol=0.05, atol=0.1)
    monkeypatch.setattr(hardware, "mkl_runs_float32", lambda device: True)  # (an Intel CPU)
    mkl = decoding.FastDecoder(model, caches, compile=True).batch
    assert mkl == ("plain" if dtype == torch.float32 else "reduce")
    assert decoding.FastDecoder(model, model.new_kv_caches(1, 16), compile=True).batch == "reduce"  # (one row)
    if dtype == torch.float32 and rows == 3:  # (MKL's products in the compiled chunk)
        by_mkl = model.generate(idx, 10, temperature=0, return_logits=True, compile=True)
        assert torch.equal(by_mkl[0], ref[0])
        torch.testing.assert_close(by_mkl[1], ref[1], rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(decoding, "_PACK_MIN_ELEMENTS", 0)
    expected = "packed" if decoding.packs(model.out_head.weight, rows) else "plain"
    assert decoding.FastDecoder(model, caches, compile=True).batch == expected


@needs_onednn
def test_one_row_packs_for_a_large_bfloat16_model_and_a_long_generation(packed, monkeypatch):
    """The eager step of one row packs bfloat16 weights where the model is large and the generation
    long enough to pay for the copies: the eager forward's first token and logits (to bfloat16's
    rounding); a short one does not pack, nor does float32 (oneDNN reads its plain weights as fast)."""
    if not decoding.packs(torch.zeros(1, dtype=torch.bfloat16), 2):
        pytest.skip("this CPU's oneDNN has no bfloat16 matmul")
    monkeypatch.setattr(decoding, "_PACK_MIN_ELEMENTS", 0)  # (these models are below the size that packs)
    monkeypatch.setattr(decoding, "_PACK_ONE_ROW_STEPS", 10)
    model = make(FAMILIES["llama-gqa"], torch.bfloat16)
    idx = torch.randint(0, BASE["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(4))
    ref = model.generate(idx, 12, temperature=0, return_logits=True, fast=False)
    got = model.generate(idx, 12, temperature=0, return_logits=True)
    assert torch.equal(got[0][:, 6], ref[0][:, 6])
    torch.testing.assert_close(got[1][:, 0], ref[1][:, 0], rtol=0.05, atol=0.1)
    assert packed[0] == 4 * BASE["n_layers"] + 1
    model.generate(idx, 9, temperature=0)  # fewer steps than pay
    assert packed[0] == 4 * BASE["n_layers"] + 1
    make(FAMILIES["llama-gqa"], torch.float32).generate(idx, 12, temperature=0)  # float32: oneDNN, unpacked
    assert packed[0] == 4 * BASE["n_layers"] + 1
    monkeypatch.setattr(decoding, "_PACK_MIN_ELEMENTS", 10**9)  # a small model: never
    model.generate(idx, 12, temperature=0)
    assert packed[0] == 4 * BASE["n_layers"] + 1
    monkeypatch.setattr(decoding, "_PACK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(decoding, "_PACK_MAX_BYTES", 1000)  # a model too large to copy: never, batch or not
    model.generate(idx, 12, temperature=0)
    model.generate(idx.expand(3, -1), 12, temperature=0)
    assert packed[0] == 4 * BASE["n_layers"] + 1


def test_packed_linear_without_a_packed_copy_is_a_plain_matmul():
    x, w, b = torch.randn(3, 1, 8), torch.randn(5, 8), torch.randn(5)
    torch.testing.assert_close(decoding.packed_linear(x, w, b, ""), torch.nn.functional.linear(x, w, b))
    want = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, None), approximate="tanh")
    torch.testing.assert_close(decoding.packed_linear(x, w, None, "tanh"), want)


def test_float64_batches_run_unpacked(packed):
    model = make(FAMILIES["tiny-gelu"], torch.float64)
    idx = torch.randint(0, BASE["vocab_size"], (3, 4))
    ref = model.generate(idx, 6, temperature=0, return_logits=True, fast=False)
    fast = model.generate(idx, 6, temperature=0, return_logits=True)
    assert torch.equal(fast[0], ref[0])
    torch.testing.assert_close(fast[1], ref[1], rtol=1e-10, atol=1e-10)
    assert packed[0] == 0
