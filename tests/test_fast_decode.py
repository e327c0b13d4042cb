"""The decoding fast path (:mod:`attnlab.decoding`) against the eager forward, the reference.

Every family's switches on a small model built from its config, in float64 (so the two paths agree
to rounding, and the greedy tokens cannot flip on a near tie): the tokens and the logits of
``generate(fast=True)`` must equal those of ``generate(fast=False)``, and the fast path must have run
(a spy counts its steps). Where it does not apply (hooks, observers, LoRA, forward hooks, padding
masks, ALiBi, soft-capping, a cache that wraps) it must hand over to the eager path, with the same
tokens again. Its fused projection weights follow the parameters when they change.
"""

from __future__ import annotations

import pytest
import torch

from attnlab import decoding
from attnlab.model import GPT, GPTConfig

BASE = dict(vocab_size=61, context_length=48, emb_dim=48, n_heads=4, n_layers=3, drop_rate=0.0)
LLAMA = dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False)
FAMILIES = {
    "gpt2": dict(qkv_bias=True),
    "gpt2-window": dict(qkv_bias=True, window=8),
    "llama-gqa": dict(LLAMA, n_kv_heads=2),
    "smollm2-like": dict(LLAMA, n_kv_heads=2, tie_embeddings=True, rope_theta=100000.0),
    "modern": dict(pos="rope", norm="rmsnorm", mlp="relu2", qk_norm=True, bias=False, tie_embeddings=False),
    "qwen2": dict(LLAMA, n_kv_heads=2, qkv_bias=True),
    "gemma": dict(LLAMA, mlp="geglu", norm_offset=1.0, head_size=16, embed_scale=48**0.5, tie_embeddings=True),
    "gemma3": dict(
        LLAMA, qk_norm=True, post_norms=True, window=6, window_layers=[0, 1], rope_local_theta=100.0, head_size=8
    ),
    "olmo2": dict(LLAMA, qk_norm="full", pre_norms=False, post_norms=True),
    "neox": dict(pos="rope", norm="layernorm", qkv_bias=True, parallel_residual=True, rotary_fraction=0.25, n_heads=3),
    "nope": dict(pos="none", norm="rmsnorm", mlp="swiglu", bias=False),
    "phi3-window": dict(LLAMA, rotary_fraction=0.5, window=40),
}


def make(overrides: dict, seed: int = 0, dtype: torch.dtype = torch.float64) -> GPT:
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**BASE, **overrides})).to(dtype).eval()
    with torch.no_grad():  # larger than the init: peaked, varied next-token distributions
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(4)
            elif "norm" in name and name.endswith("weight"):
                p.add_(0.2 * torch.randn_like(p))
    return model


def both(model: GPT, idx: torch.Tensor, n: int, **kw):
    ref = model.generate(idx, n, return_logits=True, fast=False, **kw)
    fast = model.generate(idx, n, return_logits=True, **kw)
    return ref, fast


def assert_same(ref, fast, tol: float = 1e-10) -> None:
    assert torch.equal(ref[0], fast[0])
    torch.testing.assert_close(fast[1], ref[1], rtol=tol, atol=tol)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fast_steps_equal_the_eager_forward(family, steps):
    model = make(FAMILIES[family])
    idx = torch.randint(0, BASE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))
    ref, fast = both(model, idx, 20, temperature=0)
    assert_same(ref, fast)
    # every step after the prefill (a window's ring too: each new key in its oldest slot once it wraps)
    assert steps[0] == 19


def test_sampling_draws_the_same_tokens(steps):
    model = make(FAMILIES["llama-gqa"])
    idx = torch.randint(0, BASE["vocab_size"], (3, 4), generator=torch.Generator().manual_seed(2))
    kw = dict(temperature=0.9, top_k=20, top_p=0.95)
    ref = model.generate(idx, 15, generator=torch.Generator().manual_seed(5), fast=False, **kw)
    fast = model.generate(idx, 15, generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(ref, fast) and steps[0] == 14


@pytest.mark.parametrize("family", ["gpt2", "llama-gqa"])
def test_past_the_context_and_around_the_ring(family, steps):
    """GPT-2 re-encodes its window when the cache is full (the eager forward, then the fast path
    again); a rolling cache wraps and the fast path goes on around the ring: the same tokens."""
    model = make({**FAMILIES[family], "context_length": 12})
    idx = torch.randint(0, BASE["vocab_size"], (1, 5))
    ref, fast = both(model, idx, 30, temperature=0)
    assert_same(ref, fast)
    if family == "gpt2":
        assert 0 < steps[0] < 29
    else:  # 29 steps, the ring of 12 slots wrapped twice
        assert steps[0] == 29


@pytest.mark.parametrize("overrides", [dict(window=6, sinks=2), dict(window=5), dict(context_length=7)])
def test_a_ring_goes_on_around_its_slots_as_the_eager_forward_writes_them(overrides, steps):
    """Past its window a rolling cache wraps: each new key goes to the oldest ring slot (sinks kept),
    as the eager forward's update() puts it. The same tokens and logits, every step on the fast path,
    and after a few wraps the caches hold the same keys, values and positions in the same slots."""
    model = make({**FAMILIES["llama-gqa"], **overrides})
    idx = torch.randint(0, BASE["vocab_size"], (2, 4), generator=torch.Generator().manual_seed(6))
    ref, fast = both(model, idx, 25, temperature=0)
    assert_same(ref, fast)
    assert steps[0] == 24
    held = []
    for fast_step in (False, True):
        caches = model.new_kv_caches(2)
        with torch.inference_mode():
            model.decode_logits(idx, None, caches)
            decoder = decoding.FastDecoder(model, caches)
            for t in range(17):
                token = ref[0][:, 4 + t]
                if fast_step:
                    assert decoder.fits()
                    decoder.step(token)
                else:
                    model.decode_logits(token[:, None], None, caches)
        assert caches[0].seen == 21 > caches[0].max_length and caches[0].length == caches[0].max_length
        held.append([(c.keys.clone(), c.values.clone(), c.positions.clone()) for c in caches])
    for a, b in zip(*held, strict=True):
        assert torch.equal(a[2], b[2])
        torch.testing.assert_close(b[0], a[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(b[1], a[1], rtol=1e-10, atol=1e-10)


def test_a_padded_batch_runs_eager_with_the_same_tokens(steps):
    model = make(FAMILIES["llama-gqa"])
    idx = torch.randint(0, BASE["vocab_size"], (2, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    ref, fast = both(model, idx, 8, temperature=0, attention_mask=mask)
    assert_same(ref, fast)
    assert steps[0] == 0


@pytest.mark.parametrize("overrides", [dict(pos="alibi"), dict(LLAMA, attn_softcap=2.0, logit_softcap=5.0)])
def test_alibi_and_soft_capping_run_eager(overrides, steps):
    model = make(overrides)
    ref, fast = both(model, torch.randint(0, BASE["vocab_size"], (1, 4)), 6, temperature=0)
    assert_same(ref, fast)
    assert steps[0] == 0


def test_hooks_and_forward_hooks_run_eager(steps):
    from attnlab.interpret.hooks import hooks

    model = make(FAMILIES["llama-gqa"])
    idx = torch.randint(0, BASE["vocab_size"], (1, 4))
    ref = model.generate(idx, 6, temperature=0, fast=False)
    doubled = lambda x, hook: 2 * x
    with hooks(model, {"blocks.1.hook_mlp_out": doubled}):
        hooked = model.generate(idx, 6, temperature=0)
    with hooks(model, {"blocks.1.hook_mlp_out": doubled}):
        hooked_ref = model.generate(idx, 6, temperature=0, fast=False)
    assert torch.equal(hooked, hooked_ref) and steps[0] == 0
    handle = model.trf_blocks[0].att.out_proj.register_forward_pre_hook(lambda m, a: (a[0] * 0,))
    try:
        ablated = model.generate(idx, 6, temperature=0)
        assert steps[0] == 0 and torch.equal(ablated, model.generate(idx, 6, temperature=0, fast=False))
    finally:
        handle.remove()
    assert torch.equal(model.generate(idx, 6, temperature=0), ref) and steps[0] == 5


@pytest.mark.parametrize(
    "kind, compile",
    [
        ("pre_hook", False),
        ("hook", False),
        ("attnlab_hook", False),
        pytest.param("attnlab_hook", True, marks=pytest.mark.slow),
    ],
)
def test_a_hook_set_during_a_generation_hands_its_steps_to_the_eager_forward(kind, compile, steps):
    """FastDecoder.fits checks each step for hooks set since the generation started (on any module,
    torch's or attnlab's): the steps after one is set run the eager forward, which runs the hook.
    Compiled, greedy steps run ahead in chunks: those after the hook are taken back (the caches rewound)
    and run again by the eager forward."""
    import contextlib

    from attnlab.interpret.hooks import hooks

    model = make(FAMILIES["llama-gqa"])
    idx = torch.randint(0, BASE["vocab_size"], (1, 4))
    module = model.trf_blocks[1].ff.layers[2]

    def add(stack: contextlib.ExitStack) -> None:
        if kind == "pre_hook":
            stack.callback(module.register_forward_pre_hook(lambda m, a: (a[0] * 0,)).remove)
        elif kind == "hook":
            stack.callback(module.register_forward_hook(lambda m, a, out: out * 0).remove)
        else:
            stack.enter_context(hooks(model, {"blocks.1.hook_mlp_out": lambda x, hook: 0 * x}))

    def run(fast: bool, compile: bool = False) -> tuple[list[int], torch.Tensor]:
        out, logits = [], []
        with contextlib.ExitStack() as stack:
            stream = model.stream(idx, 8, temperature=0, fast=fast, compile=compile, with_logits=True)
            for i, (token, step_logits) in enumerate(stream):
                out.append(token.tolist())
                logits.append(step_logits)
                if i == 2:
                    add(stack)
        return out, torch.stack(logits)

    fast, fast_logits = run(True, compile)
    # tokens 2 and 3 (the first comes from the prefill); none after the hook. (A chunk: its steps for
    # tokens 2 to 5, the last two taken back.)
    assert steps[0] == (decoding._CHUNK if compile else 2)
    ref, ref_logits = run(False)
    assert fast == ref
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-9, atol=1e-9)
    unhooked = model.generate(idx, 8, temperature=0, return_logits=True)[1]  # (1, 8, V)
    assert not torch.allclose(ref_logits[3:].float(), unhooked[0, 3:, None])  # (the hook changed the logits)


@pytest.mark.parametrize("family", ["gpt2", "gpt2-window", "llama-gqa", "gemma3", "olmo2"])
def test_observers_get_the_records_of_the_eager_forward(family, steps):
    """attnlab.interpret's observers (serve's live generation, trace_generation) run on the fast path
    and see what the eager forward shows them: weights, keys, values, positions, mask."""
    from attnlab.interpret.tracing import observe_attention

    model = make(FAMILIES[family])
    idx = torch.randint(0, BASE["vocab_size"], (2, 4))
    records = {True: [], False: []}
    for fast in (False, True):
        with observe_attention(model, lambda layer, r, fast=fast: records[fast].append((layer, r))):
            model.generate(idx, 7, temperature=0, fast=fast)
    assert steps[0] > 0 and len(records[True]) == len(records[False]) == 7 * 3
    for (la, a), (lb, b) in zip(records[False], records[True], strict=True):
        assert la == lb and a.is_causal == b.is_causal and a.scale == b.scale
        for name in ("q", "k", "v", "weights", "head_outputs", "q_positions", "k_positions", "mask"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("fast", [False, True])
def test_a_rolling_caches_records_are_copies_unless_the_observer_declines(fast, steps):
    """A rolling cache (RoPE) writes over old slots, so observers get copies of its keys, values and key
    positions; ``observe_attention(copy_cache=False)`` hands views of the cache instead (one buffer, step
    after step), with the same values; an observer set before that keeps its records still gets copies."""
    from attnlab.interpret.tracing import observe_attention

    model = make(FAMILIES["llama-gqa"])
    idx = torch.randint(0, BASE["vocab_size"], (2, 4), generator=torch.Generator().manual_seed(5))

    def run(copy_cache: bool, outer: bool = False) -> list:
        seen = []  # layer 0's records: the tensors and their values at the call

        def on(layer, r):
            if layer == 0:
                seen.append((r.k, r.v, r.k_positions, r.k.clone(), r.v.clone(), r.k_positions.clone()))

        att = model.trf_blocks[0].att
        att.observer = (lambda m, r: None) if outer else None
        try:
            with observe_attention(model, on, copy_cache=copy_cache):
                model.generate(idx, 6, temperature=0, fast=fast)
        finally:
            att.observer = None
        return seen

    def buffers(seen) -> set:
        return {t.untyped_storage().data_ptr() for rec in seen[1:] for t in rec[:3]}  # (the decoding steps)

    copies, views, outer = run(True), run(False), run(False, outer=True)
    assert len(copies) == len(views) == 6 and steps[0] == (3 * 5 if fast else 0)  # 5 decoding steps a run
    for a, b in zip(copies, views, strict=True):
        for x, y in zip(a[3:], b[3:], strict=True):
            torch.testing.assert_close(y, x, rtol=0, atol=0)
    assert len(buffers(views)) == 3  # the cache's keys, values and positions, step after step
    assert len(buffers(copies)) == len(buffers(outer)) == 3 * 5  # a copy of each at each step
    with pytest.raises(TypeError, match="copy_cache"), observe_attention(model, lambda layer, r: None, copy_cache="no"):
        pass


@pytest.mark.parametrize("family", ["gpt2", "gpt2-window", "llama-gqa", "gemma3", "phi3-window", "nope"])
def test_an_observer_of_the_last_query_gets_that_row_of_the_eager_records(family):
    """``observe_attention(last_query=True)``: each pass's records hold the last query's weights ``(b, H,
    1, S)`` (a padded batch: masks, windows, GQA, rolling caches), equal to that row of the full records,
    and the pass's output is the same; an observer set before that reads every row keeps its full ones."""
    from attnlab.interpret.tracing import observe_attention

    model = make(FAMILIES[family])
    idx = torch.randint(0, BASE["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :3] = False  # left padding: the prompt's mask reaches the records

    def run(last_query: bool, outer: bool = False):
        records = []
        att = model.trf_blocks[0].att
        att.observer = (lambda m, r: None) if outer else None
        try:
            with observe_attention(model, lambda layer, r: records.append(r), last_query=last_query):
                out = model.generate(idx, 4, temperature=0, attention_mask=mask, return_logits=True, fast=False)
        finally:
            att.observer = None
        return out, records

    (ids, logits), full = run(False)
    (ids_row, logits_row), rows = run(True)
    assert torch.equal(ids_row, ids)
    torch.testing.assert_close(logits_row, logits, rtol=1e-12, atol=1e-12)
    assert len(rows) == len(full) and full[0].weights.shape[2] == 9  # the prompt's pass first
    for a, b in zip(full, rows, strict=True):
        assert b.weights.shape[2] == 1
        torch.testing.assert_close(b.weights, a.weights[:, :, -1:], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(b.head_outputs, a.head_outputs, rtol=1e-12, atol=1e-12)
    _, outer = run(True, outer=True)
    assert outer[0].weights.shape[2] == 9 and outer[1].weights.shape[2] == 1  # layer 0 keeps its rows
    with pytest.raises(TypeError, match="last_query"), observe_attention(model, lambda layer, r: None, last_query=1):
        pass


def test_lora_runs_eager_and_merged_weights_run_fast(steps):
    from attnlab.training.lora import LoRASettings, apply_lora, merge_lora

    model = make(FAMILIES["llama-gqa"])
    apply_lora(model, LoRASettings.make(4, targets="q,v,down"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    idx = torch.randint(0, BASE["vocab_size"], (1, 4))
    ref, fast = both(model, idx, 8, temperature=0)
    assert_same(ref, fast)
    assert steps[0] == 0
    merge_lora(model)
    ref, fast = both(model, idx, 8, temperature=0)
    assert_same(ref, fast)
    assert steps[0] == 7


def test_fused_weights_follow_the_parameters(steps):
    model = make(FAMILIES["llama-gqa"])
    keys = set(model.state_dict())
    idx = torch.randint(0, BASE["vocab_size"], (1, 4))
    model.generate(idx, 4, temperature=0)
    with torch.no_grad():  # in place (an optimizer step), then a new tensor (load_state_dict(assign=True))
        model.trf_blocks[1].att.W_key.weight.mul_(-1.5)
    assert_same(*both(model, idx, 8, temperature=0))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["trf_blocks.0.att.W_value.weight"].normal_()
    model.load_state_dict(state, assign=True)
    assert_same(*both(model, idx, 8, temperature=0))
    assert set(model.state_dict()) == keys  # the fused copies are no parameters or buffers
    assert decoding.fused_bytes(model) > 0
    # An edit through .data bumps no version counter: a fused copy kept from the last generation would
    # miss it (the ablation people do by hand, weight.data[...] = 0).
    before = both(model, idx, 8, temperature=0)[1]
    model.trf_blocks[0].att.W_value.weight.data[:, :] = 0.0
    ref, fast = both(model, idx, 8, temperature=0)
    assert_same(ref, fast)
    assert not torch.allclose(before[1], fast[1])  # the edit did change the model


def test_training_mode_comes_back_and_float32_agrees(steps):
    model = make(FAMILIES["smollm2-like"], dtype=torch.float32).train()
    idx = torch.randint(0, BASE["vocab_size"], (4, 6))
    ref, fast = both(model, idx, 10, temperature=0)
    assert torch.equal(ref[0], fast[0])
    torch.testing.assert_close(fast[1], ref[1], rtol=1e-4, atol=1e-4)
    assert model.training and steps[0] == 9


def test_bad_switches_are_type_errors():
    model = make(FAMILIES["gpt2"])
    with pytest.raises(TypeError, match="fast"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 2, fast="yes")
    with pytest.raises(TypeError, match="compile"):
        model.stream(torch.zeros(1, 2, dtype=torch.long), 2, compile=1)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, chunk",
    [("smollm2-like", 1), ("gpt2", 1), ("smollm2-like", decoding._CHUNK)] + [(f, 2) for f in ("gpt2", "gemma", "neox")],
)
def test_the_compiled_step_equals_the_eager_forward(family, chunk, steps, monkeypatch):
    """One compiled layer function (and head) over the whole preallocated cache, in float64: a step a
    call, or (a small model's greedy decoding on a CPU) ``chunk`` steps a call, each step's token the
    argmax of its logits (the last call's steps after the 11th unused). Chunks of every way of making
    the first block's input: learned positions (GPT-2), RoPE, partial (NeoX), the embedding's scale
    (Gemma, whose offset RMSNorm computes in float32, as the eager forward's does: to float32's rounding)."""
    monkeypatch.setattr(decoding, "_CHUNK", chunk)
    model = make(FAMILIES[family])
    # (chunks of 2 and one batch size for the families beside SmolLM2's: each graph is C++ that an empty
    # inductor cache, as CI's, compiles for up to a minute)
    sizes = (1, 2) if family == "smollm2-like" or chunk == 1 else (2,)
    for B in sizes:
        idx = torch.randint(0, BASE["vocab_size"], (B, 5))
        ref = model.generate(idx, 12, temperature=0, return_logits=True, fast=False)
        compiled = model.generate(idx, 12, temperature=0, return_logits=True, compile=True)
        assert_same(ref, compiled, tol=1e-5 if family == "gemma" else 1e-9)
    assert steps[0] == len(sizes) * -(-11 // chunk) * chunk


def test_greedy_decoding_runs_in_chunks_on_a_small_models_compiled_cpu_step(monkeypatch):
    """Chunks (several steps a compiled call) where the steps are short: a small model, compiled, on a
    CPU, its layers one call; else a step a call."""
    model = make(FAMILIES["llama-gqa"])
    caches = model.new_kv_caches(2, 16)
    assert decoding.FastDecoder(model, caches, compile=True).chunk == decoding._CHUNK > 1
    assert decoding.FastDecoder(model, caches).chunk == 1
    monkeypatch.setattr(decoding, "_GROUP", 2)  # three layers: two calls a step
    assert decoding.FastDecoder(model, caches, compile=True).chunk == 1
    monkeypatch.undo()
    monkeypatch.setattr(decoding, "_PACK_MIN_ELEMENTS", 0)  # a large model: its steps read the weights for long
    assert decoding.FastDecoder(model, caches, compile=True).chunk == 1


@pytest.mark.slow
@pytest.mark.parametrize("family", ["olmo2", "modern"])
def test_greedy_chunks_stop_where_the_eager_forward_stops(family, steps):
    """A small model's greedy steps in chunks, with stop ids: a row that stops inside a chunk emits the
    first stop id from then on (and is fed it), and the generation ends inside a chunk once every row
    has stopped: the eager forward's tokens and logits, in float64."""
    model = make(FAMILIES[family])
    idx = torch.randint(0, BASE["vocab_size"], (3, 5), generator=torch.Generator().manual_seed(8))
    free = model.generate(idx, 16, temperature=0, fast=False)[:, 5:]  # (3, 16): without stop ids
    stop = (int(free[0, 2]), int(free[1, 9]), int(free[2, 9]))  # row 0 inside the first chunk
    ref = model.generate(idx, 16, temperature=0, eos_id=stop, return_logits=True, fast=False)
    got = model.generate(idx, 16, temperature=0, eos_id=stop, return_logits=True, compile=True)
    assert_same(ref, got, tol=1e-9)
    new = ref[0].shape[1] - 5
    assert new < 16 and bool((ref[0][:, 8:] == stop[0]).any())  # it ended early; a row emits the first stop id
    assert steps[0] == -(-(new - 1) // decoding._CHUNK) * decoding._CHUNK  # every step in a chunk


@pytest.mark.slow
def test_greedy_chunks_of_another_prompt_length_compile_nothing_new():
    """The chunk's graph serves prompts of any length on caches of one size: the token it is fed is a
    column of the generation's token buffer, whose stride (the buffer's width) follows the prompt."""
    from torch._dynamo.utils import counters

    model = make(FAMILIES["smollm2-like"])
    g = torch.Generator().manual_seed(11)
    short = torch.randint(0, BASE["vocab_size"], (2, 5), generator=g)
    long = torch.randint(0, BASE["vocab_size"], (2, 7), generator=g)
    model.generate(short, 12, temperature=0, compile=True)
    before = counters["stats"]["unique_graphs"]
    ref = model.generate(long, 12, temperature=0, return_logits=True, fast=False)
    got = model.generate(long, 12, temperature=0, return_logits=True, compile=True)
    assert_same(ref, got, tol=1e-9)
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.slow
def test_greedy_chunks_up_to_the_context_and_past_it(steps):
    """GPT-2's learned positions: a generation that ends at its context's last position runs its last
    steps in a chunk too (whose unused step takes the last slot, which no step fills otherwise); one that
    goes on past the context re-encodes its window between chunks. The eager forward's tokens and
    logits, in float64."""
    model = make({**FAMILIES["gpt2"], "context_length": 16})
    idx = torch.randint(0, BASE["vocab_size"], (2, 4), generator=torch.Generator().manual_seed(10))
    ref = model.generate(idx, 12, temperature=0, return_logits=True, fast=False)  # positions 0..15
    got = model.generate(idx, 12, temperature=0, return_logits=True, compile=True)
    assert_same(ref, got, tol=1e-9)
    assert steps[0] == 3 * decoding._CHUNK  # 11 steps: three chunks, no step alone
    ref = model.generate(idx, 30, temperature=0, return_logits=True, fast=False)
    got = model.generate(idx, 30, temperature=0, return_logits=True, compile=True)
    assert_same(ref, got, tol=1e-9)


@pytest.mark.slow
def test_nan_logits_inside_a_chunk_raise_at_their_step(steps):
    """A step inside a chunk whose logits are NaN (a NaN in the position of the 7th new token, which the
    8th comes from): the tokens before it come, then the ValueError of the eager forward's generation
    at the same step."""
    model = make(FAMILIES["gpt2"])
    with torch.no_grad():
        model.pos_emb.weight[11] = float("nan")  # a 5-token prompt: the 7th new token's position
    idx = torch.randint(0, BASE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(9))

    def run(**kw) -> list:
        got = []
        with pytest.raises(ValueError, match="NaN"):
            for token in model.stream(idx, 12, temperature=0, **kw):
                got.append(token.tolist())
        return got

    got = run(compile=True)
    assert got == run(fast=False) and len(got) == 7
    assert steps[0] == 2 * decoding._CHUNK  # (the second chunk holds the NaN step)


@pytest.mark.slow
def test_the_compiled_step_hands_a_wrapped_ring_to_the_eager_step(steps):
    """The compiled step's mask counts slots in order: once a ring wraps, the steps run the eager
    fast step, with the same tokens and logits as the eager forward."""
    model = make({**FAMILIES["smollm2-like"], "context_length": 10})
    idx = torch.randint(0, BASE["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(7))
    ref = model.generate(idx, 16, temperature=0, return_logits=True, fast=False)
    compiled = model.generate(idx, 16, temperature=0, return_logits=True, compile=True)
    assert_same(ref, compiled, tol=1e-9)
    assert steps[0] == 15


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 2])
def test_the_compiled_step_in_groups_of_layers(group, steps, monkeypatch):
    """Layers in several compiled calls (the head a call of its own), the caches' positions written
    inside them: the same tokens, logits and cache records as the eager forward, in float64."""
    monkeypatch.setattr(decoding, "_GROUP", group)
    model = make(FAMILIES["llama-gqa"], seed=group)
    idx = torch.randint(0, BASE["vocab_size"], (2, 5))
    ref = model.generate(idx, 12, temperature=0, return_logits=True, fast=False)
    compiled = model.generate(idx, 12, temperature=0, return_logits=True, compile=True)
    assert_same(ref, compiled, tol=1e-9)
    assert steps[0] == 11
    records = []
    for compile in (False, True):  # the caches' records after the same steps, eager and compiled
        caches = model.new_kv_caches(2, 16)
        with torch.inference_mode():
            model.decode_logits(idx, None, caches)
            decoder = decoding.FastDecoder(model, caches, compile=compile)
            for t in range(3):
                decoder.step(idx[:, t])
        records.append([c.positions.clone() for c in caches])
    for a, b in zip(*records, strict=True):
        assert torch.equal(a, b) and torch.equal(a[:, :8], torch.arange(8).expand(2, 8))


@pytest.mark.slow
def test_smollm2_fast_steps_equal_eager(smollm2_gguf, steps):
    model = GPT.from_gguf(smollm2_gguf)
    idx = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    ref, fast = both(model, idx, 12, temperature=0)
    assert torch.equal(ref[0], fast[0])
    torch.testing.assert_close(fast[1], ref[1], rtol=1e-4, atol=1e-4)
    assert steps[0] == 11
