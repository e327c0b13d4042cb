"""The CUDA paths against their CPU references (marked ``cuda``: run where a GPU is, ``pytest -m cuda``).

Each test computes the same thing on the GPU and by the CPU reference (float64, or the eager forward
on the same device) and compares: the decoding fast path and its compiled step (inductor's Triton
backend on CUDA) against the eager forward, attnlab's Llama against transformers' built from the
same config, the inspector's trace and logit lens, and activation patching. float32 on the GPU may
differ from the CPU in the order of its sums (and by TF32 where a library enables it), so these
compare at float32 tolerances, and greedy tokens on the peaked test models of test_fast_decode.
"""

from __future__ import annotations

import pytest
import torch

from attnlab.interpret import activation_patching, attribution_patching, logit_diff, logit_lens, trace
from attnlab.interpret.circuits import edge_attribution, faithfulness
from attnlab.interpret.patching import SITES
from attnlab.model import GPT, GPTConfig
from attnlab.quantized import is_quantized
from test_fast_decode import BASE, FAMILIES, assert_same_records, make, observed_generation
from test_quantized import prompt, write_quantized_gguf

pytestmark = pytest.mark.cuda
DEVICE = "cuda"


def on(model: GPT, dtype: torch.dtype = torch.float32) -> GPT:
    return model.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("family", ["gpt2", "smollm2-like", "gemma3", "neox"])
@pytest.mark.parametrize("compile", [False, True])
def test_decoding_on_cuda_equals_the_eager_forward_and_the_cpu(family, compile, steps):
    cpu = make(FAMILIES[family])  # float64 on the CPU: the reference
    idx = torch.randint(0, BASE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(3))
    ref_tokens, ref_logits = cpu.generate(idx, 12, temperature=0, return_logits=True, fast=False)
    gpu = on(make(FAMILIES[family]))
    eager = gpu.generate(idx.to(DEVICE), 12, temperature=0, return_logits=True, fast=False)
    fast = gpu.generate(idx.to(DEVICE), 12, temperature=0, return_logits=True, compile=compile)
    assert steps[0] > 0  # the fast path ran on the GPU
    for tokens, logits in (eager, fast):
        assert tokens.device.type == DEVICE and logits.dtype == torch.float32
        assert torch.equal(tokens.cpu(), ref_tokens)
        torch.testing.assert_close(logits.double().cpu(), ref_logits.double(), rtol=2e-3, atol=2e-3)


def test_the_compiled_step_on_cuda_replays_a_cuda_graph(monkeypatch, steps):
    """The compiled step's route on a GPU replays CUDA graphs (``mode="reduce-overhead"``: inductor's
    CUDA graph trees warm up and record first, then replay); every step's logits are its own (the
    graph's output buffer is overwritten by the next replay)."""
    replays = [0]
    replay = torch.cuda.CUDAGraph.replay

    def spy(self):
        replays[0] += 1
        return replay(self)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", spy)
    model = on(make(FAMILIES["llama-gqa"]))
    idx = torch.randint(0, BASE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(7)).to(DEVICE)
    ref = model.generate(idx, 12, temperature=0, return_logits=True, fast=False)
    for _ in range(2):  # a second generation captures its own graph (new caches)
        got = model.generate(idx, 12, temperature=0, return_logits=True, compile=True)
        assert torch.equal(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)
    assert 0 < replays[0] <= steps[0] == 2 * 11


@pytest.mark.parametrize("family", ["llama-gqa", "gpt2-window"])
def test_a_hooked_compiled_generation_on_cuda_sees_the_eager_forward(family, steps):
    """Hooks on a GPU (serve's generation stream): a generation with compile=True runs the eager
    forward while they are set, and every hook sees the eager forward's values, in float64."""
    model = make(FAMILIES[family]).to(DEVICE)
    idx = torch.randint(0, BASE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    (ref, ref_logits), ref_records = observed_generation(model, idx, 10, fast=False)
    (ids, logits), records = observed_generation(model, idx, 10, compile=True)
    assert torch.equal(ids, ref)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-9, atol=1e-9)
    assert_same_records(ref_records, records, 1e-9)
    assert steps[0] == 0


def test_speculative_decoding_on_cuda_equals_greedy():
    """Prompt lookup and a draft model on the GPU: the tokens and logits of plain greedy decoding."""
    model = make(FAMILIES["smollm2-like"]).to(DEVICE)
    draft = make({**FAMILIES["smollm2-like"], "n_layers": 1}, seed=1).to(DEVICE)
    idx = torch.randint(0, BASE["vocab_size"], (1, 4), generator=torch.Generator().manual_seed(9)).repeat(1, 3)
    idx = idx.to(DEVICE)  # (1, 12): a prompt that repeats itself, so lookups find guesses
    ref = model.generate(idx, 20, temperature=0, return_logits=True, fast=False)
    for kw in (dict(prompt_lookup=4), dict(draft_model=draft, draft_tokens=3)):
        ids, logits = model.generate(idx, 20, temperature=0, return_logits=True, **kw)
        assert ids.device.type == DEVICE and torch.equal(ids, ref[0])
        torch.testing.assert_close(logits, ref[1], rtol=1e-9, atol=1e-9)


def test_bfloat16_decoding_on_cuda_follows_float32(steps):
    """bfloat16 on the GPU, fast and compiled: the first step's logits near float32's; the compiled
    step's tokens and logits equal the fast path's within bfloat16 rounding."""
    model = make(FAMILIES["smollm2-like"])
    idx = torch.randint(0, BASE["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    f32 = on(model).generate(idx, 1, temperature=0, return_logits=True, fast=False)[1]
    bf16 = on(make(FAMILIES["smollm2-like"]), torch.bfloat16)
    first = bf16.generate(idx, 1, temperature=0, return_logits=True, fast=False)[1]
    assert bf16.out_head.weight.dtype == torch.bfloat16
    scale = f32.abs().max()
    assert (first.float() - f32).abs().max() < 0.05 * scale
    fast = bf16.generate(idx, 8, temperature=0, return_logits=True)
    compiled = bf16.generate(idx, 8, temperature=0, return_logits=True, compile=True)
    assert steps[0] == 2 * 7
    n = int((fast[0] != compiled[0]).int().cumprod(-1).eq(0).sum())  # tokens equal before any flip
    assert n >= 1
    torch.testing.assert_close(compiled[1][:, :n].float(), fast[1][:, :n].float(), rtol=0.05, atol=0.05 * scale)


def test_llama_on_cuda_equals_transformers_built_from_its_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval().to(DEVICE)
    ours = GPT.from_hf(hf).eval().to(DEVICE)
    idx = torch.randint(0, 97, (2, 17), device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=1e-4, atol=1e-4)
        want = hf.generate(idx, max_new_tokens=10, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(idx))
    assert torch.equal(ours.generate(idx, 10, temperature=0, compile=True), want)


def test_trace_and_logit_lens_on_cuda_equal_the_cpu():
    cpu = make(FAMILIES["llama-gqa"])
    gpu = on(make(FAMILIES["llama-gqa"]))
    idx = torch.randint(0, BASE["vocab_size"], (1, 20), generator=torch.Generator().manual_seed(5))
    ref, got = trace(cpu, idx, stages=True), trace(gpu, idx.to(DEVICE), stages=True)
    assert got.weights.device.type == DEVICE
    torch.testing.assert_close(got.weights.cpu().double(), ref.weights.double(), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.residual.cpu().double(), ref.residual, rtol=1e-4, atol=1e-3)
    lens_ref, lens_got = logit_lens(cpu, ref), logit_lens(gpu, got, search_dtype=torch.float32)
    assert torch.equal(lens_got.tokens.cpu(), lens_ref.tokens)


@pytest.mark.parametrize("candidates", [8, 128])
def test_logit_lens_bfloat16_search_on_cuda_equals_the_exact_lens(candidates, monkeypatch):
    """The lens's bfloat16 search on the GPU (its two-step top-n: 8 candidates select among the
    vocabulary's blocks, 128 take them all) against the exact float32 lens on the same trace."""
    from attnlab.interpret import analysis
    from test_interpret_chunked import llama_like

    monkeypatch.setattr(analysis, "LENS_CANDIDATES", candidates)
    gpu = on(llama_like(vocab=700))
    idx = torch.randint(0, 700, (2, 23), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    tr = trace(gpu, idx, stages=True)
    exact = logit_lens(gpu, tr, k=5, search_dtype=torch.float32)
    fast = logit_lens(gpu, tr, k=5, search_dtype=torch.bfloat16)
    torch.testing.assert_close(fast.probs, exact.probs, rtol=2e-3, atol=1e-6)
    torch.testing.assert_close(fast.final_token_probs, exact.final_token_probs, rtol=2e-3, atol=1e-6)
    gaps = exact.probs[..., :-1] - exact.probs[..., 1:]
    clear = (gaps > 1e-6).all(-1)  # no near tie among the top 5
    assert torch.equal(fast.tokens[clear], exact.tokens[clear])


@pytest.mark.parametrize("compile", [False, True])
def test_a_wrapped_ring_on_cuda_hands_its_steps_to_the_eager_forward(compile, steps):
    """Past the context a rolling cache wraps: the fast step (compiled or not) runs the steps up to the
    ring's last slot, the eager forward the rest around it: the eager forward's tokens and logits."""
    model = on(make({**FAMILIES["smollm2-like"], "context_length": 10}))
    idx = torch.randint(0, BASE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    ref = model.generate(idx, 16, temperature=0, return_logits=True, fast=False)
    got = model.generate(idx, 16, temperature=0, return_logits=True, compile=compile)
    assert steps[0] == 10 - 5  # the ring's slots after the prompt's
    assert torch.equal(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1], rtol=2e-3, atol=2e-3)


def cpu_and_gpu(family: str, rows: int) -> tuple[GPT, GPT, torch.Tensor, torch.Tensor]:
    """The same test model on the CPU and on the GPU, and a clean and a corrupted prompt ``(rows, 8)``."""
    g = torch.Generator().manual_seed(6)
    clean, corrupted = (torch.randint(0, BASE["vocab_size"], (rows, 8), generator=g) for _ in range(2))
    return make(FAMILIES[family]), on(make(FAMILIES[family])), clean, corrupted


@pytest.mark.parametrize("site", sorted(SITES))
def test_activation_patching_on_cuda_equals_the_cpu(site):
    """Every site: the results come back on the CPU as the CPU's are (the patched runs on the GPU)."""
    cpu, gpu, clean, corrupted = cpu_and_gpu("gpt2", 1)
    ref = activation_patching(cpu, clean, corrupted, logit_diff(3, 7), site)
    got = activation_patching(gpu, clean.to(DEVICE), corrupted.to(DEVICE), logit_diff(3, 7), site)
    assert got.device.type == "cpu" and got.shape == ref.shape
    torch.testing.assert_close(got.double(), ref.double(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("site", ["resid_pre", "head_out", "pattern_dest_src", "neuron"])
def test_attribution_patching_on_cuda_equals_the_cpu(site):
    cpu, gpu, clean, corrupted = cpu_and_gpu("gpt2", 1)
    ref = attribution_patching(cpu, clean, corrupted, logit_diff(3, 7), site)
    got = attribution_patching(gpu, clean.to(DEVICE), corrupted.to(DEVICE), logit_diff(3, 7), site)
    assert got.shape == ref.shape
    torch.testing.assert_close(got.cpu().double(), ref.double(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("method", ["EAP", "EAP-IG-inputs", "EAP-IG-activations"])
def test_edge_attribution_and_faithfulness_on_cuda_equal_the_cpu(method):
    cpu, gpu, clean, corrupted = cpu_and_gpu("llama-gqa", 2)
    metric = logit_diff(3, 7)
    ref = edge_attribution(cpu, clean, corrupted, metric, method=method, ig_steps=3)
    got = edge_attribution(gpu, clean.to(DEVICE), corrupted.to(DEVICE), metric, method=method, ig_steps=3)
    torch.testing.assert_close(got.scores.cpu().double(), ref.scores.double(), rtol=1e-3, atol=1e-4)
    circuit = ref.top_n(20)  # (the same edges on both devices: the CPU's ranking)
    want = faithfulness(cpu, clean, corrupted, metric, circuit)
    have = faithfulness(gpu, clean.to(DEVICE), corrupted.to(DEVICE), metric, circuit)
    assert have == pytest.approx(want, rel=1e-3, abs=1e-4)


def test_the_config_presets_train_a_step_on_cuda_in_bfloat16_autocast():
    model = GPT(GPTConfig(**{**BASE, **FAMILIES["smollm2-like"]})).to(DEVICE)
    idx = torch.randint(0, BASE["vocab_size"], (2, 16), device=DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(idx[:, :-1]).flatten(0, 1).float(), idx[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0"])
def test_a_quantized_model_on_cuda_computes_the_dequantized_models_numbers(tmp_path, qtype):
    """A GGUF model's weights moved to the GPU keep their blocks and compute there: the forward, greedy
    decoding (eager and compiled: inside the compiled step the dequantization is inductor's, fused into
    its consumer) and attribution patching (gradients to the activations) against the dequantized float32
    model on the CPU."""
    path = write_quantized_gguf(tmp_path / f"tiny.{qtype}.gguf", qtype)
    quant, dense = GPT.from_gguf(path).to(DEVICE), GPT.from_gguf(path, dtype=torch.float32)
    matrices = [p for p in quant.parameters() if p.dim() == 2]
    assert all(is_quantized(p) and p.device.type == DEVICE for p in matrices)
    idx = prompt(20)
    with torch.no_grad():
        got, want = quant(idx.to(DEVICE)).cpu(), dense(idx)
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())  # (the GPU sums in other orders)
    tokens, logits = dense.generate(idx[:, :8], 8, temperature=0, return_logits=True, fast=False)
    for compile in (False, True):
        got_tokens, got_logits = quant.generate(
            idx[:, :8].to(DEVICE), 8, temperature=0, return_logits=True, compile=compile
        )
        assert torch.equal(got_tokens.cpu(), tokens)
        torch.testing.assert_close(got_logits.cpu(), logits, rtol=1e-4, atol=1e-4 * float(logits.abs().max()))
    clean, corrupted, metric = idx[0, :10], prompt(10, seed=1)[0], logit_diff(5, 7)
    want = attribution_patching(dense, clean, corrupted, metric, "resid_pre")
    got = attribution_patching(quant, clean.to(DEVICE), corrupted.to(DEVICE), metric, "resid_pre").cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


def test_a_cpu_generator_for_a_cuda_model_is_one_clear_error():
    gpu = on(make(FAMILIES["gpt2"]))
    idx = torch.zeros(1, 3, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"generator must be on the model's device \(cuda\)"):
        gpu.generate(idx, 2, generator=torch.Generator().manual_seed(0))
    seeded = torch.Generator(device=DEVICE).manual_seed(0)
    assert gpu.generate(idx, 2, generator=seeded).shape == (1, 5)
    assert gpu.generate(idx, 2, temperature=0, generator=torch.Generator()).shape == (1, 5)  # (greedy draws none)
