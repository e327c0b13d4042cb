"""Greedy decoding's screened head (:class:`attnlab.decoding.ScreenedHead`): the argmax of a float32
head found from a bfloat16 screen and an exact score of the best few. Against the float64 argmax
(hypothesis), with ties, NaN, a flat head the screen cannot be sure of, and in generation: the eager
forward's tokens, the screen used only where greedy tokens without logits are asked for."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import decoding, hardware
from attnlab.model import GPT, GPTConfig

V = decoding.SCREEN_MIN_VOCAB + 3  # past the threshold, not a multiple of any block size
native = pytest.mark.skipif(
    not hardware.bf16_native("cpu"), reason="the screen runs where bfloat16 matmuls are native (this CPU emulates them)"
)


def float64_argmax(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The argmax of ``h @ w.T`` in float64 ``(B,)``, and each row's gap from the best to the second ``(B,)``."""
    logits = h.double() @ w.double().T  # (B, V)
    top = logits.topk(2, dim=-1)
    return top.indices[:, 0], top.values[:, 0] - top.values[:, 1]


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 9),
    width=st.sampled_from([16, 64, 96]),
    h_scale=st.sampled_from([0.1, 1.0, 30.0]),
    outliers=st.integers(0, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_screened_argmax_is_the_float64_argmax(rows, width, h_scale, outliers, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, width, generator=g) * 0.05
    h = torch.randn(rows, width, generator=g) * h_scale
    h[:, :outliers] *= 20  # the residual stream's outlier dimensions, as in real models
    head = decoding.ScreenedHead(w, rows)
    got = head.argmax(h)
    want, gap = float64_argmax(h, w)
    close = gap < 1e-5 * (h.norm(dim=-1) * w.norm(dim=-1).max())  # float32's own rounding may choose either
    assert torch.equal(got[~close], want[~close])
    assert head.screened == rows


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 9),
    vocab=st.one_of(st.integers(16, 1100), st.integers(decoding.SCREEN_MIN_VOCAB, decoding.SCREEN_MIN_VOCAB + 130)),
    levels=st.sampled_from([3, 50, 10_000]),
    tail_best=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_candidates_are_a_topk_of_the_screen(rows, vocab, levels, tail_best, seed):
    """The block search's candidates hold the same values as a top-k over the whole row (ties included:
    few levels), each at its own id, the tail's ids too."""
    g = torch.Generator().manual_seed(seed)
    screen = torch.randint(0, levels, (rows, vocab), generator=g).to(torch.bfloat16)  # (B, V)
    if tail_best:
        screen[:, -1] = levels + 1  # the row's best in the ids past the last whole block
    head = decoding.ScreenedHead(torch.randn(vocab, 16, generator=g), rows)
    values, ids = head._candidates(screen)
    want = screen.float().topk(decoding.SCREEN_CANDIDATES, dim=-1).values
    assert torch.equal(values.float().sort(-1).values, want.sort(-1).values)
    assert torch.equal(screen.gather(1, ids), values)
    assert all(len(set(r)) == decoding.SCREEN_CANDIDATES for r in ids.tolist())  # distinct ids


@pytest.mark.parametrize("vocab", [96, 100, 143])
def test_the_bfloat16_panels_hold_the_rounded_head_and_zeros_past_it(vocab):
    w = torch.randn(vocab, 8)
    panels = decoding._bf16_panels(w)  # (ceil(V / 48), 8, 48)
    assert panels.shape == (-(-vocab // 48), 8, 48) and panels.dtype == torch.bfloat16
    rows = panels.transpose(1, 2).reshape(-1, 8)  # (48 ceil(V / 48), 8)
    assert torch.equal(rows[:vocab], w.to(torch.bfloat16))
    assert not rows[vocab:].any()


def test_ties_go_to_the_smallest_id_as_argmax():
    torch.manual_seed(0)
    w = torch.randn(V, 32) * 0.05
    w[2] *= 5
    w[3000] = w[17] = w[2]  # the same row three times, far above the rest
    h = w[2:3] * 10
    head = decoding.ScreenedHead(w, 1)
    assert head.argmax(h).tolist() == [2] == (h @ w.T).argmax(-1).tolist()


def test_a_flat_head_the_screen_cannot_be_sure_of_takes_the_float32_logits():
    """Rows too close for bfloat16 to tell apart: every row is taken from all of w (and is still right)."""
    torch.manual_seed(1)
    w = torch.randn(1, 64).repeat(V, 1) + torch.randn(V, 64) * 1e-4  # (V, 64) nearly one row
    h = torch.randn(3, 64)
    head = decoding.ScreenedHead(w, 3)
    got = head.argmax(h)
    assert head.unsure == 3
    assert torch.equal(got, (h @ w.T).argmax(-1))


def test_a_peaked_head_is_sure_of_every_row():
    torch.manual_seed(2)
    w = torch.randn(V, 64)
    h = w[[5, 4000, 77]] * 3  # each row's own token far above the rest
    head = decoding.ScreenedHead(w, 3)
    assert head.argmax(h).tolist() == [5, 4000, 77]
    assert head.unsure == 0


def test_subnormal_weights_flushed_to_zero_by_the_kernel_are_not_sure():
    """A CPU's bfloat16 kernel may read entries below 2^-126 as 0 and flush such results: the screen is
    then all zeros, and the bound must not call its first 16 ids sure (a review found it did)."""
    torch.manual_seed(3)
    w = torch.randn(V, 32) * 1e-39  # subnormal float32 entries
    h = torch.randn(2, 32)
    head = decoding.ScreenedHead(w, 2)
    assert torch.equal(head.argmax(h), (h.double() @ w.double().T).argmax(-1))
    assert head.unsure == 2


def test_nan_raises_as_the_logits_check_does():
    w = torch.randn(V, 16)
    h = torch.randn(2, 16)
    h[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        decoding.ScreenedHead(w, 2).argmax(h)


def test_screens_only_a_float32_head_of_a_large_vocabulary_without_a_soft_cap():
    def model(**kw):
        cfg = dict(vocab_size=V, context_length=16, emb_dim=32, n_heads=2, n_layers=1, drop_rate=0.0)
        return GPT(GPTConfig(**{**cfg, **kw}))

    cpu = torch.device("cpu")
    assert decoding.screens(model(), cpu) == hardware.bf16_native(cpu)
    assert not decoding.screens(model(vocab_size=decoding.SCREEN_MIN_VOCAB - 1), cpu)
    assert not decoding.screens(model().to(torch.bfloat16), cpu)
    assert not decoding.screens(model(logit_softcap=30.0), cpu)
    assert not decoding.screens(model(), torch.device("meta"))
    with torch.backends.mkldnn.flags(enabled=False):  # (no oneDNN: F.linear's bfloat16 product costs more)
        assert not decoding.screens(model(), cpu)


FAMILIES = {
    "gpt2": dict(qkv_bias=True),
    "llama": dict(pos="rope", norm="rmsnorm", mlp="swiglu", bias=False, n_kv_heads=2, tie_embeddings=False),
}


def make(family: str, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = dict(vocab_size=V, context_length=64, emb_dim=64, n_heads=4, n_layers=2, drop_rate=0.0)
    model = GPT(GPTConfig(**{**cfg, **FAMILIES[family], **kw})).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4)  # peaked logits, varied tokens
    return model


@pytest.fixture
def screened(monkeypatch):
    """Rows the screen decided (a spy on ScreenedHead.argmax)."""
    count = [0]
    argmax = decoding.ScreenedHead.argmax

    def spy(self, h):
        count[0] += h.shape[0]
        return argmax(self, h)

    monkeypatch.setattr(decoding.ScreenedHead, "argmax", spy)
    return count


@native
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_through_the_screen_gives_the_eager_forwards_tokens(family, rows, screened):
    """A batch through the screen, one row through the whole head (see FastDecoder): the same tokens."""
    model = make(family)
    n = decoding.SCREEN_MIN_STEPS
    idx = torch.randint(0, V, (rows, 7), generator=torch.Generator().manual_seed(rows))
    ref = model.generate(idx, n, temperature=0, fast=False)
    assert torch.equal(model.generate(idx, n, temperature=0), ref)
    assert screened[0] == (rows * (n - 1) if rows > 1 else 0)  # a batch's every step after the prompt's; one row: none
    assert len(set(ref[:, 7:].flatten().tolist())) > 3  # varied tokens, not one repeated
    # With stop ids: rows that stop keep emitting the first, as without the screen
    stop = (int(ref[0, 12]), V - 1)
    assert torch.equal(
        model.generate(idx, n, temperature=0, eos_id=stop),
        model.generate(idx, n, temperature=0, eos_id=stop, fast=False),
    )
    screened[0] = 0
    model.generate(idx, n - 1, temperature=0)  # too short to pay for the copy
    assert screened[0] == 0


@native
def test_logits_asked_for_or_sampling_keep_the_full_head(screened):
    model = make("gpt2")
    idx = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(0))
    n = decoding.SCREEN_MIN_STEPS
    ids, logits = model.generate(idx, n, temperature=0, return_logits=True)
    assert torch.equal(logits.argmax(-1), ids[:, 5:])
    list(model.stream(idx, n, temperature=0, with_logits=True))
    model.generate(idx, n, temperature=0.8, generator=torch.Generator().manual_seed(0))
    assert screened[0] == 0
    model.generate(idx, n, temperature=0)
    assert screened[0] == 2 * (n - 1)


@native
@pytest.mark.slow
def test_the_compiled_step_through_the_screen_gives_the_eager_forwards_tokens(screened, monkeypatch):
    """13 layers (a compiled call a layer, the head apart) and 1 (the head in the layers' call; a step to a
    call, not the chunks of greedy steps a small model runs, which keep their argmax in the graph)."""
    monkeypatch.setattr(decoding, "_CHUNK", 1)
    for layers in (13, 1):
        model = make("llama", n_layers=layers, emb_dim=32, n_heads=2, n_kv_heads=1)
        idx = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(layers))
        ref = model.generate(idx, decoding.SCREEN_MIN_STEPS, temperature=0, fast=False)
        screened[0] = 0
        assert torch.equal(model.generate(idx, decoding.SCREEN_MIN_STEPS, temperature=0, compile=True), ref)
        assert screened[0] > 0
