"""The decoding fast path (:mod:`attnlab.decoding`) against the eager forward, the reference.

Everything here goes through the public API: ``generate`` and ``stream`` with ``fast=False`` (the
eager forward with its checks, every step), ``fast=True`` (the default: :class:`FastDecoder`'s step,
the model's own forward over slot views of the caches) and ``compile=True`` (that step compiled by
``torch.compile``), :class:`FastDecoder`'s own methods, and the ``steps`` fixture (a spy on the public
:meth:`FastDecoder.step`: how many steps ran on the fast path).

Every family's switches on a small model built from its config, in float32: the tokens of
``generate(fast=True)`` must equal those of ``generate(fast=False)``, its logits to float32's
rounding, and the fast step must have run every decoding step it may (until the smallest ring of the
generation's caches would wrap). Where it must not (hooks, forward hooks, LoRA, padding masks, a ring
that would wrap) the eager forward takes the steps, with the same tokens again, and hooks see the eager
forward's values. The compiled step (slow: each compilation takes 10-30 s
on a small CPU) runs on the smallest models, as few compilations as the checks allow.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch._dynamo.utils import counters

from attnlab.decoding import DecodePlan, FastDecoder, Route, supported
from attnlab.generation import cache_length
from attnlab.interpret import hook_names, hooks, observe_attention_rows, trace_generation
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
    "alibi": dict(pos="alibi"),
    "soft-capping": dict(LLAMA, attn_softcap=2.0, logit_softcap=5.0),
}
F32 = 1e-5  # float32 logits of the fast step against the eager forward's (attention over more, masked, slots)
pytestmark = pytest.mark.usefixtures("one_thread")  # (small models run fastest on one thread; the machine is shared)
FIELDS = ("rot_q", "rot_k", "v", "pattern", "z", "q_positions", "k_positions", "mask")


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


def prompt(rows: int, tokens: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, BASE["vocab_size"], (rows, tokens), generator=torch.Generator().manual_seed(seed))


def both(model: GPT, idx: torch.Tensor, n: int, **kw):
    ref = model.generate(idx, n, return_logits=True, fast=False, **kw)
    fast = model.generate(idx, n, return_logits=True, **kw)
    return ref, fast


def assert_same(ref, fast, tol: float = 1e-10) -> None:
    assert torch.equal(ref[0], fast[0])
    torch.testing.assert_close(fast[1], ref[1], rtol=tol, atol=tol)


def fast_steps(model: GPT, rows: int, prompt_length: int, n: int) -> int:
    """The decoding steps a generation of ``n`` tokens runs on the fast path: all ``n - 1`` of them, but
    none once a ring of its caches would wrap (the eager forward's ring logic takes over there)."""
    slots = min(c.max_length for c in model.new_kv_caches(rows, cache_length(model, prompt_length, n)))
    return min(n - 1, slots - prompt_length)


def graphs() -> int:
    """Graphs Dynamo compiled so far in this process."""
    return counters["stats"]["unique_graphs"]


# --------------------------------------------------------------------------------------------
# Every family, fast and eager
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fast_steps_equal_the_eager_forward(family, steps):
    """ALiBi and soft-capping included: the fast step is the model's own forward, so whatever the
    forward computes it computes."""
    model = make(FAMILIES[family], dtype=torch.float32)
    idx = prompt(2, 3)
    ref, fast = both(model, idx, 20, temperature=0)
    assert_same(ref, fast, F32)
    # every step after the prefill (the windowed ones until their ring is full: gemma3's of 6 slots, 3 steps)
    assert steps[0] == fast_steps(model, 2, 3, 20) > 0
    if family in ("gpt2", "alibi", "soft-capping"):
        assert steps[0] == 19


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [2, 5, 8])
@pytest.mark.parametrize("family", ["gpt2", "llama-gqa"])
def test_a_batch_of_rows_agrees_with_the_eager_forward(family, rows, dtype, steps):
    model = make({**FAMILIES[family], "n_layers": 2, "emb_dim": 64}, dtype=dtype)
    idx = prompt(rows, 6, seed=rows)
    ref, fast = both(model, idx, 10, temperature=0)
    assert steps[0] == 9
    if dtype == torch.float32:
        assert_same(ref, fast, F32)
    else:  # bfloat16 keeps 8 bits: the first token and its logits (later tokens may flip on a near tie)
        assert torch.equal(fast[0][:, 6], ref[0][:, 6])
        torch.testing.assert_close(fast[1][:, 0], ref[1][:, 0], rtol=0.05, atol=0.1)


def test_a_float64_model_agrees_to_its_rounding(steps):
    model = make(FAMILIES["qwen2"])
    ref, fast = both(model, prompt(3, 4), 12, temperature=0)
    assert_same(ref, fast, 1e-10)
    assert steps[0] == 11


def test_sampling_draws_the_same_tokens(steps):
    model = make(FAMILIES["llama-gqa"], dtype=torch.float32)
    idx = prompt(3, 4, seed=2)
    kw = dict(temperature=0.9, top_k=20, top_p=0.95)
    ref = model.generate(idx, 15, generator=torch.Generator().manual_seed(5), fast=False, **kw)
    fast = model.generate(idx, 15, generator=torch.Generator().manual_seed(5), **kw)
    assert torch.equal(ref, fast) and steps[0] == 14


def test_stop_ids_end_rows_where_the_eager_forward_ends_them(steps):
    """A row that emits a stop id emits the first stop id from then on, and the generation ends once every
    row has stopped: the eager forward's tokens and logits."""
    model = make(FAMILIES["olmo2"], dtype=torch.float32)
    idx = prompt(3, 5, seed=8)
    free = model.generate(idx, 16, temperature=0, fast=False)[:, 5:]  # (3, 16): without stop ids
    stop = (int(free[0, 2]), int(free[1, 9]), int(free[2, 9]))
    ref, fast = both(model, idx, 16, temperature=0, eos_id=stop)
    assert_same(ref, fast, F32)
    new = ref[0].shape[1] - 5
    assert new < 16 and bool((ref[0][:, 8:] == stop[0]).any())  # it ended early; a row emits the first stop id
    assert steps[0] == new - 1


def test_nan_logits_raise_at_their_step(steps):
    """A NaN in the position of the 7th new token, which the 8th is drawn after: the tokens before it
    come, then the eager forward's ValueError at the same step."""
    model = make(FAMILIES["gpt2"], dtype=torch.float32)
    with torch.no_grad():
        model.pos_emb.weight[11] = float("nan")  # a 5-token prompt: the 7th new token's position
    idx = prompt(2, 5, seed=9)

    def run(**kw) -> list:
        got = []
        with pytest.raises(ValueError, match="NaN"):
            for token in model.stream(idx, 12, temperature=0, **kw):
                got.append(token.tolist())
        return got

    got = run()
    assert steps[0] == 7  # (the 7th step's logits are NaN)
    assert got == run(fast=False) and len(got) == 7


# --------------------------------------------------------------------------------------------
# Past the context, around a ring
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama-gqa"])
def test_past_the_context_and_around_the_ring(family, steps):
    """GPT-2's cache holds its context: once full, each step re-encodes the window (the eager forward);
    a rolling cache wraps, and the eager forward's ring logic writes each new key over the oldest. The
    fast step runs the steps before either: 12 slots, a prompt of 5, 7 steps; the same tokens."""
    model = make({**FAMILIES[family], "context_length": 12}, dtype=torch.float32)
    ref, fast = both(model, prompt(1, 5), 30, temperature=0)
    assert_same(ref, fast, F32)
    assert steps[0] == 7


@pytest.mark.parametrize("overrides", [dict(window=6, sinks=2), dict(window=5), dict(context_length=7)])
def test_a_ring_hands_its_steps_to_the_eager_forward_where_it_would_wrap(overrides, steps):
    """FastDecoder.fits holds while the ring has a free slot; its steps write the slots the eager forward
    would (the same keys, values and positions), so the eager forward goes on from those caches around
    the ring, sinks kept: the same logits as an eager run all along."""
    model = make({**FAMILIES["llama-gqa"], **overrides})
    idx = prompt(2, 4, seed=6)
    ref, fast = both(model, idx, 25, temperature=0)
    assert_same(ref, fast)
    ring = model.new_kv_caches(2)[0].max_length
    assert steps[0] == ring - 4
    held, logits = [], []
    for fast_step in (False, True):
        caches = model.new_kv_caches(2)
        out = []
        with torch.inference_mode():
            model.decode_logits(idx, None, caches)
            decoder = FastDecoder(model, caches)
            assert decoder.plan == DecodePlan(Route.EAGER, 2, ring)
            for t in range(ring - 4):  # up to the last slot
                token = ref[0][:, 4 + t]
                assert decoder.fits()
                out.append(
                    decoder.step(token) if fast_step else model.decode_logits(token[:, None], None, caches)[:, -1]
                )
            assert not decoder.fits() and caches[0].seen == caches[0].length == ring
            held.append([(c.keys.clone(), c.values.clone(), c.positions.clone()) for c in caches])
            for t in range(ring - 4, 17):  # around the ring: the eager forward
                out.append(model.decode_logits(ref[0][:, 4 + t, None], None, caches)[:, -1])
        assert caches[0].seen == 21 > caches[0].max_length == caches[0].length
        logits.append(torch.stack(out, 1))
    for a, b in zip(*held, strict=True):
        assert torch.equal(a[2], b[2])
        torch.testing.assert_close(b[0], a[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(b[1], a[1], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(logits[0].float(), ref[1][:, 1:18], rtol=F32, atol=F32)  # (generate's are float32)


def test_a_padded_batch_runs_eager_with_the_same_tokens(steps):
    model = make(FAMILIES["llama-gqa"], dtype=torch.float32)
    idx = prompt(2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    ref, fast = both(model, idx, 8, temperature=0, attention_mask=mask)
    assert_same(ref, fast, F32)
    assert steps[0] == 0


# --------------------------------------------------------------------------------------------
# When the eager forward takes the steps
# --------------------------------------------------------------------------------------------
def test_the_plan_and_what_is_supported():
    model = make(FAMILIES["llama-gqa"], dtype=torch.float32)
    caches = model.new_kv_caches(3, 16)
    decoder = FastDecoder(model, caches)
    assert decoder.plan == DecodePlan(Route.EAGER, 3, 16) and decoder.fits()
    assert decoder.plan.describe() == "eager step, 3 rows over 16 cache slots"
    compiled = FastDecoder(model, model.new_kv_caches(1, 256), compile=True).plan  # (nothing compiles before a step)
    assert compiled == DecodePlan(Route.COMPILED, 1, 48)  # (a rolling cache: its ring of context_length slots)
    assert compiled.describe() == "compiled step, 1 row over 48 cache slots"
    assert supported(model, caches, None)
    assert not supported(model, None, None)  # no cache
    assert not supported(model, caches, torch.ones(3, 4, dtype=torch.bool))  # a padding mask
    assert not supported(model, caches[:1], None)  # a cache per layer
    assert not supported(model.train(), caches, None)
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not supported(model, caches, None)


def test_hooks_and_forward_hooks_run_eager_and_see_the_eager_values(steps):
    model = make(FAMILIES["llama-gqa"], dtype=torch.float32)
    idx = prompt(1, 4)
    ref = model.generate(idx, 6, temperature=0, fast=False)

    def hooked(fast: bool) -> tuple[torch.Tensor, list]:
        seen = []

        def doubled(x, hook):
            seen.append(x.clone())
            return 2 * x

        with hooks(model, {"blocks.1.hook_mlp_out": doubled}):
            return model.generate(idx, 6, temperature=0, fast=fast), seen

    (tokens, seen), (ref_tokens, ref_seen) = hooked(True), hooked(False)
    assert steps[0] == 0 and torch.equal(tokens, ref_tokens) and not torch.equal(tokens, ref)
    assert len(seen) == len(ref_seen) == 6 and seen[1].shape == (
        1,
        1,
        BASE["emb_dim"],
    )  # (the prompt, then a token a pass)
    for a, b in zip(seen, ref_seen, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    att = model.trf_blocks[0].att
    for register in (
        lambda: att.out_proj.register_forward_pre_hook(lambda m, a: (a[0] * 0,)),
        lambda: att.out_proj.register_forward_hook(lambda m, a, out: out * 0),
        lambda: torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: None),  # global: every module
    ):
        handle = register()
        try:
            got = model.generate(idx, 6, temperature=0, return_logits=True)
            assert steps[0] == 0
            assert_same(model.generate(idx, 6, temperature=0, return_logits=True, fast=False), got, 0)
        finally:
            handle.remove()
    assert torch.equal(model.generate(idx, 6, temperature=0), ref) and steps[0] == 5


def add_hook(stack: contextlib.ExitStack, model: GPT, kind: str) -> None:
    """A hook that zeroes the MLP's output of the last layer: a forward pre-hook or hook on its last
    module, or an attnlab hook (on the block's ``mlp_out``, or on the MLP's neurons, ``mlp.hook_post``),
    removed when ``stack`` closes."""
    last = len(model.trf_blocks) - 1
    module = model.trf_blocks[last].ff.layers[2]
    if kind == "pre_hook":
        stack.callback(module.register_forward_pre_hook(lambda m, a: (a[0] * 0,)).remove)
    elif kind == "hook":
        stack.callback(module.register_forward_hook(lambda m, a, out: out * 0).remove)
    elif kind == "attnlab_mlp_hook":
        stack.enter_context(hooks(model, {f"blocks.{last}.mlp.hook_post": lambda x, hook: 0 * x}))
    elif kind == "attnlab_norm_hook":  # (a torch forward hook on the norm, under attnlab's name)
        stack.enter_context(hooks(model, {f"blocks.{last}.ln2.hook_scale": lambda x, hook: 4 * x}))
    else:
        stack.enter_context(hooks(model, {f"blocks.{last}.hook_mlp_out": lambda x, hook: 0 * x}))


def hooked_at_the_third_token(model: GPT, idx: torch.Tensor, kind: str, **kw) -> tuple[list, torch.Tensor]:
    """``stream(idx, 8, with_logits=True, **kw)``'s tokens and logits, a hook (:func:`add_hook`) set once
    the third token is out."""
    out, logits = [], []
    with contextlib.ExitStack() as stack:
        for i, (token, step_logits) in enumerate(model.stream(idx, 8, temperature=0, with_logits=True, **kw)):
            out.append(token.tolist())
            logits.append(step_logits)
            if i == 2:
                add_hook(stack, model, kind)
    return out, torch.stack(logits)


@pytest.mark.parametrize("kind", ["pre_hook", "hook", "attnlab_hook", "attnlab_mlp_hook", "attnlab_norm_hook"])
def test_a_hook_set_during_a_generation_hands_its_steps_to_the_eager_forward(kind, steps):
    """FastDecoder.fits checks each step for hooks set since the generation started (on any module,
    torch's or attnlab's): the steps after one is set run the eager forward, which runs the hook."""
    model = make(FAMILIES["llama-gqa"])
    idx = prompt(1, 4)
    fast, fast_logits = hooked_at_the_third_token(model, idx, kind)
    assert steps[0] == 2  # tokens 2 and 3 (the first comes from the prefill); none after the hook
    ref, ref_logits = hooked_at_the_third_token(model, idx, kind, fast=False)
    assert fast == ref
    torch.testing.assert_close(fast_logits, ref_logits, rtol=1e-10, atol=1e-10)
    unhooked = model.generate(idx, 8, temperature=0, return_logits=True)[1]  # (1, 8, V)
    assert not torch.allclose(ref_logits[3:].float(), unhooked[0, 3:, None])  # (the hook changed the logits)


def observed_generation(model: GPT, idx: torch.Tensor, n: int, layers=None, **kw):
    """``generate(..., temperature=0, return_logits=True, **kw)`` with ``layers``' attention hook points
    read (default: all): the output and the ``(layer, record)`` pairs in call order, each record the
    copies of what a pass's hooks saw (the tensors, and its positions and mask)."""
    records = []
    chosen = range(len(model.trf_blocks)) if layers is None else layers
    names = set(hook_names(model))

    def keep(x, hook):
        step = hook.name.rsplit("hook_", 1)[1]
        if not records or "z" in records[-1][1]:  # the first of them a pass reaches
            records.append((hook.layer(), {}))
        record = records[-1][1]
        record[step] = x.clone()
        if step == "pattern":  # (the positions may be views of a rolling cache)
            call = hook.call
            record |= {"q_positions": call.q_positions, "k_positions": call.k_positions, "mask": call.mask}
            record |= {k: None if t is None else t.clone() for k, t in record.items() if k.endswith("positions")}
            record["call"] = (call.is_causal, call.scale, call.softcap, call.window, call.sinks)

    fns = {}
    for i in chosen:
        for step in ("rot_q", "rot_k", "v", "pattern", "z"):
            name = f"blocks.{i}.attn.hook_{step}"
            fns[name if name in names else name.replace("rot_", "")] = keep
    with hooks(model, fns):
        out = model.generate(idx, n, temperature=0, return_logits=True, **kw)
    for _, record in records:
        record.setdefault("rot_q", record.pop("q", None))
        record.setdefault("rot_k", record.pop("k", None))
    return out, records


def assert_same_records(ref, got, tol):
    assert len(got) == len(ref) > 0
    for (la, a), (lb, b) in zip(ref, got, strict=True):
        assert la == lb and a["call"] == b["call"]
        for name in FIELDS:
            x, y = a[name], b[name]
            assert (x is None) == (y is None), name
            if x is not None:
                assert y.dtype == x.dtype and y.shape == x.shape, name
                torch.testing.assert_close(y, x, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("family", ["gpt2-window", "llama-gqa", "gemma3"])
def test_hooked_steps_run_eager_and_see_the_eager_forward(family, steps):
    """Hooks on the attention steps (serve's live generation, trace_generation) see what the eager
    forward shows them: queries, keys, values, weights, head outputs, positions, mask. With
    compile=True too, which then compiles nothing (the hooked steps are the eager forward's)."""
    model = make(FAMILIES[family])
    idx = prompt(2, 4)
    (ref, ref_logits), ref_records = observed_generation(model, idx, 7, fast=False)
    before = graphs()
    for kw in ({}, {"compile": True}):
        (ids, logits), records = observed_generation(model, idx, 7, **kw)
        assert torch.equal(ids, ref)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
        assert_same_records(ref_records, records, 1e-10)
    (ids, _), records = observed_generation(model, idx, 7, layers=[1])  # one layer hooked: still eager
    assert torch.equal(ids, ref) and {layer for layer, _ in records} == {1}
    assert len(ref_records) == 7 * 3 and steps[0] == 0 and graphs() == before
    assert model.generate(idx, 7, temperature=0).equal(ref) and steps[0] > 0  # (the hooks gone: fast)


def row_passes(model: GPT, idx: torch.Tensor, n: int, **kw):
    """``generate(..., temperature=0, return_logits=True, **kw)`` under :func:`observe_attention_rows`: the
    output and each pass's ``(rows, q_positions, k_positions)``, copied (positions may be views of a cache)."""
    passes = []

    def keep(rows, q_pos, k_pos):
        passes.append(tuple(None if t is None else t.clone() for t in (rows, q_pos, k_pos)))

    with observe_attention_rows(model, keep):
        out = model.generate(idx, n, temperature=0, return_logits=True, **kw)
    return out, passes


@pytest.mark.parametrize("kw", [{"fast": False}, {}, {"compile": True}])
@pytest.mark.parametrize("sinks", [0, 2])
def test_rows_of_layers_over_different_keys_are_laid_on_the_widest_layers_keys(kw, sinks, steps):
    """Gemma 3's window layers keep fewer keys than its global one once the text is longer than the
    window: each layer's row laid on the global layer's keys by position (its record's weights where it
    holds the key, 0 outside its window), the positions handed the global layer's; the same rows whatever
    ``generate``'s switches (observed, every step is the eager forward's, compiling nothing);
    trace_generation plays such a generation back. With 2 sinks and a context of 8, every layer's ring
    has 8 slots, holding the tokens in other ones."""
    extra = {"sinks": 2, "context_length": 8} if sinks else {}
    model = make({**FAMILIES["gemma3"], **extra})  # window 6 on layers 0 and 1, layer 2 global
    idx = prompt(2, 7 if sinks else 9, seed=8)
    records: list[list] = []

    def record(pattern, hook):
        if hook.layer() == 0:
            records.append([])
        call = hook.call
        records[-1].append((pattern[:, :, -1].clone(), call.k_positions.clone(), call.q_positions.clone()))

    with hooks(model, {f"blocks.{i}.attn.hook_pattern": record for i in range(3)}):
        want = model.generate(idx, 4, temperature=0, fast=False)
    before = graphs()
    (ids, _), passes = row_passes(model, idx, 4, **kw)
    assert torch.equal(ids, want) and len(passes) == len(records) == 4
    assert steps[0] == 0 and graphs() == before
    for (rows, q_pos, k_pos), layers in zip(passes, records, strict=True):
        wide = max(layers, key=lambda t: t[0].shape[-1])
        assert rows.shape == (3, 2, *wide[0].shape[1:]) and torch.equal(k_pos.expand(2, -1), wide[1].expand(2, -1))
        assert torch.equal(q_pos.expand(2, -1), wide[2].expand(2, -1))
        for row, (w, pos, _) in zip(rows, layers, strict=True):
            for b in range(2):
                mine, theirs = pos.expand(2, -1)[b].tolist(), k_pos.expand(2, -1)[b].tolist()
                cols = [theirs.index(p) for p in mine if p >= 0]
                torch.testing.assert_close(row[b][:, cols], w[b][:, [i for i, p in enumerate(mine) if p >= 0]])
                rest = [c for c in range(len(theirs)) if c not in cols]
                assert torch.all(row[b][:, rest] == 0)
            torch.testing.assert_close(row.sum(-1), torch.ones_like(row.sum(-1)))  # every key it attended is there
    played = trace_generation(model, idx, 4, temperature=0)
    assert torch.equal(played.tokens, want)
    for step in played.steps:
        S = step.weights.shape[-1]
        assert step.key_start == step.position - S
        assert torch.equal(step.key_index, torch.arange(step.position - S, step.position).expand(2, S))


def test_lora_runs_eager_and_merged_weights_run_fast(steps):
    from attnlab.training.lora import LoRASettings, apply_lora, merge_lora

    model = make(FAMILIES["llama-gqa"], dtype=torch.float32)
    apply_lora(model, LoRASettings.make(4, targets="q,v,down"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()
    idx = prompt(1, 4)
    ref, fast = both(model, idx, 8, temperature=0)
    assert_same(ref, fast, F32)
    assert steps[0] == 0
    merge_lora(model)
    merged = both(model, idx, 8, temperature=0)
    assert_same(*merged, F32)
    assert steps[0] == 7
    torch.testing.assert_close(merged[1][1][:, 0], fast[1][:, 0], rtol=1e-4, atol=1e-4)  # (the same model)


def test_the_fast_step_follows_the_parameters(steps):
    """In place (an optimizer step), a new tensor (load_state_dict(assign=True)), through ``.data`` (the
    ablation people do by hand, which bumps no version counter): each next generation's fast steps use the
    weights as they are, and the decoder leaves no parameter or buffer on the model."""
    model = make(FAMILIES["llama-gqa"])
    keys = set(model.state_dict())
    idx = prompt(1, 4)
    first = model.generate(idx, 8, temperature=0, return_logits=True)
    with torch.no_grad():
        model.trf_blocks[1].att.W_key.weight.mul_(-1.5)
    assert_same(*both(model, idx, 8, temperature=0))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["trf_blocks.0.att.W_value.weight"].normal_()
    model.load_state_dict(state, assign=True)
    assert_same(*both(model, idx, 8, temperature=0))
    assert set(model.state_dict()) == keys
    before = model.generate(idx, 8, temperature=0, return_logits=True)
    model.trf_blocks[0].att.W_value.weight.data[:, :] = 0.0
    ref, fast = both(model, idx, 8, temperature=0)
    assert_same(ref, fast)
    assert not torch.allclose(before[1], fast[1]) and not torch.allclose(
        first[1], before[1]
    )  # (the edits did change it)
    assert steps[0] == 7 * 5


def test_training_mode_comes_back_and_float32_agrees(steps):
    model = make(FAMILIES["smollm2-like"], dtype=torch.float32).train()
    idx = prompt(4, 6)
    ref, fast = both(model, idx, 10, temperature=0)
    assert_same(ref, fast, F32)
    assert model.training and all(m.training for m in model.modules()) and steps[0] == 9


def test_bad_switches_are_type_errors():
    model = make(FAMILIES["gpt2"])
    with pytest.raises(TypeError, match="fast"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 2, fast="yes")
    with pytest.raises(TypeError, match="compile"):
        model.stream(torch.zeros(1, 2, dtype=torch.long), 2, compile=1)


@pytest.mark.slow
def test_smollm2_fast_steps_equal_eager(smollm2_gguf, steps):
    model = GPT.from_gguf(smollm2_gguf)
    idx = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    ref, fast = both(model, idx, 12, temperature=0)
    assert torch.equal(ref[0], fast[0])
    torch.testing.assert_close(fast[1], ref[1], rtol=1e-4, atol=1e-4)
    assert steps[0] == 11


# --------------------------------------------------------------------------------------------
# The compiled step (slow: two compilations in all, each of a one-layer model)
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    """One layer of SmolLM2's design, float32, a context of 16: its generations' caches (compiled: 256
    slots asked, a ring of 16 given) are one shape, compiled once for the tests that share it."""
    return make({**FAMILIES["smollm2-like"], "n_layers": 1, "emb_dim": 32, "context_length": 16}, dtype=torch.float32)


@pytest.mark.slow
def test_precompile_compiles_ahead_and_the_compiled_step_equals_the_eager_forward(tiny, routes):
    """precompile on scratch caches, in inference mode (as serve's compiling thread): the caches as they
    were, and the generation of that shape afterwards (in inference mode, as a server runs it) compiles
    nothing; its compiled steps give the eager forward's tokens and logits up to the ring's last slot,
    where the eager forward goes on. The compiled graph reads the parameters as they are: an edit made
    through ``.data`` reaches the next generation, without compiling again."""
    idx = prompt(1, 5, seed=3)
    ref = tiny.generate(idx, 20, temperature=0, return_logits=True, fast=False)
    with torch.inference_mode():
        caches = tiny.new_kv_caches(1, cache_length(tiny, 5, 20, compile=True))
        decoder = FastDecoder(tiny, caches, compile=True)
        assert decoder.plan == DecodePlan(Route.COMPILED, 1, 16)
        decoder.precompile()
        assert all(c.seen == c.length == 0 and bool((c.positions == -1).all()) for c in caches)
        assert routes == [Route.COMPILED]  # (precompile's own step)
        before = graphs()
        got = tiny.generate(idx, 20, temperature=0, return_logits=True, compile=True)
    assert graphs() == before > 0
    assert routes[1:] == [Route.COMPILED] * 11  # slots 5 to 15; then the ring would wrap: the eager forward
    assert_same(ref, got, F32)
    weight = tiny.trf_blocks[0].att.W_value.weight
    weight.data.mul_(-1)
    try:
        edited = tiny.generate(idx, 20, temperature=0, return_logits=True, fast=False)
        with torch.inference_mode():
            got = tiny.generate(idx, 20, temperature=0, return_logits=True, compile=True)
    finally:
        weight.data.mul_(-1)
    assert_same(edited, got, F32)
    assert not torch.allclose(edited[1], ref[1]) and graphs() == before and len(routes) == 1 + 2 * 11


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["pre_hook", "attnlab_hook"])
def test_a_hook_set_during_a_compiled_generation_hands_its_steps_to_the_eager_forward(tiny, kind, routes):
    """The compiled step checks for hooks before each step as the eager one does: the steps after one is
    set run the eager forward, which runs it (the graph of the tiny model's shape, shared by both kinds)."""
    idx = prompt(1, 4, seed=4)
    with torch.inference_mode():  # (as a server runs it: one graph for precompile and generations)
        fast, fast_logits = hooked_at_the_third_token(tiny, idx, kind, compile=True)
    assert routes == [Route.COMPILED] * 2
    ref, ref_logits = hooked_at_the_third_token(tiny, idx, kind, fast=False)
    assert fast == ref
    torch.testing.assert_close(fast_logits, ref_logits, rtol=F32, atol=F32)
    unhooked = tiny.generate(idx, 8, temperature=0, return_logits=True, fast=False)[1]  # (1, 8, V)
    assert not torch.allclose(ref_logits[3:], unhooked[0, 3:, None])  # (the hook changed the logits)


@pytest.mark.slow
def test_the_compiled_step_of_a_gpt2_batch_serves_prompts_of_any_length(routes):
    """Learned positions, three rows: the compiled step's tokens and logits are the eager forward's, and
    one graph serves prompts of other lengths on caches of one size (the token fed is a column of the
    generation's token buffer, whose width follows the prompt)."""
    model = make({**FAMILIES["gpt2"], "n_layers": 1, "emb_dim": 32, "context_length": 24}, dtype=torch.float32)
    new = []
    for T in (5, 7):
        idx = prompt(3, T, seed=T)
        ref = model.generate(idx, 12, temperature=0, return_logits=True, fast=False)
        before = graphs()
        got = model.generate(idx, 12, temperature=0, return_logits=True, compile=True)
        new.append(graphs() - before)
        assert_same(ref, got, F32)
    assert new[0] >= 1 and new[1] == 0
    assert routes == [Route.COMPILED] * 2 * 11


@pytest.mark.parametrize(
    "family,kw",
    [("gpt2", {}), ("llama-gqa", {}), ("gemma3", {}), ("phi3-window", {}), ("gemma3", {"compile": True})],
)
def test_a_reading_of_the_rows_inside_the_fast_step_equals_the_eager_forwards(family, kw, routes):
    """``stream(..., reading=attention_rows)``: each step's rows read at the hook points inside the fast
    step (compiled with it under ``compile=True``), laid out by ``rows_of`` (a slot cache's later slots
    cut, layers of other windows laid on the widest layer's keys), equal the rows the eager forward
    shows (observe_attention_rows, fast=False); the prompt's pass read on its last token alone."""
    from attnlab.generation import stream
    from attnlab.interpret import attention_rows, rows_of

    model = make(FAMILIES[family])
    idx = prompt(2, 9, seed=9)
    (want, _), passes = row_passes(model, idx, 12, fast=False)
    unread = list(stream(model, idx, 12, temperature=0, **kw))
    fast, routes[:] = list(routes), []
    # (laid out at once: a ring cache's positions are views, valid until the next step writes it)
    got = [
        (t, rows_of(model, read)) for t, _, read in stream(model, idx, 12, temperature=0, reading=attention_rows, **kw)
    ]
    assert torch.equal(torch.stack([t for t, _ in got], dim=1), want[:, 9:]) and torch.equal(
        torch.stack(unread, 1), want[:, 9:]
    )
    assert routes == fast and set(routes) <= {
        Route.COMPILED if kw else Route.EAGER
    }  # the steps a plain stream runs fast
    assert family == "gemma3" or len(routes) == 11  # (Gemma 3's rings are shorter than the text: the eager steps)
    for (_, (got_rows, got_q, got_k)), (rows, q_pos, k_pos) in zip(got, passes, strict=True):
        assert got_rows.shape == rows.shape
        torch.testing.assert_close(got_rows, rows, rtol=1e-9, atol=1e-9)
        # (a slot cache tells positions where a plain one has none; the prompt's last query read alone)
        for a, b in ((got_q[:, -1:] if got_q is not None else None, q_pos), (got_k, k_pos)):
            assert b is None or torch.equal(a.expand(2, -1), b[:, -a.shape[1] :].expand(2, -1))
