"""Hostile input to the library (issue "Hostile run directories and checkpoints"): each case is one
line of the issue, and ends in a clear error or the right result, never a crash or a silent wrong one.

The fixes to modules owned by other work (model, generation, functional, the viz/explain commands,
the loader) were each made as a small separate commit; their tests are here, beside each other.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from attnlab.checks import MODEL_LIMITS
from attnlab.model import GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # one torch thread (conftest.py)


def within(seconds: float, fn):
    """``fn()``'s result, or a test failure when it has not returned after ``seconds`` (a blocked
    read): it runs in a daemon thread, which a hang cannot keep the test process alive for."""
    result: list = []
    t = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: blocked"
    return result[0]


# ---------------------------------------------------------------------------------------------
# GPTConfig: sane limits before anything is built
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n_layers", 1_000_000),
        ("n_layers", MODEL_LIMITS["n_layers"] + 1),
        ("vocab_size", 10**9),
        ("context_length", 10**8),
        ("emb_dim", 2**20),
        ("ff_dim", 10**7),
    ],
)
def test_gpt_config_past_sane_limits_is_refused_at_once(field: str, value: int) -> None:
    base = dict(vocab_size=8, context_length=8, emb_dim=8, n_heads=1, n_layers=1)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=rf"{field}={value} is past attnlab's limit"):
        GPTConfig(**{**base, field: value})
    assert time.perf_counter() - t0 < 1.0  # refused before anything is built


def test_gpt_config_limits_cover_the_parameter_count_and_keep_real_models() -> None:
    # Each size within its limit, together a model of ~2e12 parameters: refused.
    with pytest.raises(ValueError, match="parameters, past attnlab's limit"):
        GPTConfig(vocab_size=1000, context_length=1000, emb_dim=2**15, n_heads=64, n_layers=512)
    for name in GPTConfig.presets():  # GPT-2's sizes up to gpt2-xl, and the largest limits, are fine
        GPTConfig.preset(name)
    GPTConfig(vocab_size=8, context_length=8, emb_dim=8, n_heads=1, n_layers=MODEL_LIMITS["n_layers"])


# ---------------------------------------------------------------------------------------------
# GPT.load: a config.json that is not a configuration
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "named"),
    [
        ([1], "config.json"),
        (None, "config.json"),
        ("gpt2", "config.json"),
        ({"n_layers": "x"}, "n_layers"),
        ({"n_layers": 1_000_000}, "n_layers"),
        ({"qkv_bias": "yes"}, "qkv_bias"),
    ],
)
def test_gpt_load_refuses_a_config_that_is_not_one_in_one_line(tmp_path, capsys, config, named: str) -> None:
    """GPT.load, and the CLI on a GPT.save() directory (the loader's third kind of directory)."""
    import json

    from attnlab.cli import main
    from attnlab.model import GPT

    torch.manual_seed(0)
    GPT(GPTConfig(vocab_size=256, context_length=8, emb_dim=8, n_heads=1, n_layers=1)).save(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"name": "byte"}')
    saved = json.loads((tmp_path / "config.json").read_text())
    edited = {**saved, **config} if isinstance(config, dict) else config
    (tmp_path / "config.json").write_text(json.dumps(edited))
    with pytest.raises(ValueError, match=named):
        GPT.load(tmp_path)
    assert main(["generate", "--checkpoint", str(tmp_path), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("attnlab generate: error:") and named in err[0], err


# ---------------------------------------------------------------------------------------------
# Generation: no preallocation for max_new_tokens
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_new_tokens", [10**10, 99999999999999999999])
@pytest.mark.parametrize("use_cache", [True, False])
def test_stream_allocates_for_what_it_generates_not_for_what_was_asked(make_gpt, max_new_tokens, use_cache) -> None:
    """``GPT.stream(idx, 10**10)`` used to preallocate 80 GB per row (and 99999999999999999999 was
    an overflow TypeError); now it yields tokens at once, the same as a small request."""
    model = make_gpt(1)
    idx = torch.randint(0, 37, (2, 5))
    g = torch.Generator().manual_seed(0)
    it = model.stream(idx, max_new_tokens, temperature=1.0, generator=g, use_cache=use_cache)
    got = torch.stack([next(it) for _ in range(20)], dim=1)  # 20 tokens: past the 16-token window
    it.close()
    want = model.generate(idx, 20, temperature=1.0, generator=torch.Generator().manual_seed(0), use_cache=use_cache)
    assert torch.equal(got, want[:, 5:])


def test_generation_through_buffer_growth_equals_the_uncached_reference(make_gpt, monkeypatch) -> None:
    """The token buffer grows (and drops what left the window) in chunks; with tiny chunks it does
    so many times, with padding rows too, and generation still equals the uncached path token for
    token (which re-runs the last window every step, the definition of the result)."""
    import attnlab.generation as gen

    monkeypatch.setattr(gen, "_CHUNK", 3)
    model = make_gpt(2)
    idx = torch.randint(0, 37, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, :3] = False  # left padding on the second row
    kw = dict(temperature=0.0, attention_mask=mask)
    cached = model.generate(idx, 50, use_cache=True, **kw)
    uncached = model.generate(idx, 50, use_cache=False, **kw)
    assert cached.shape == (2, 57) and torch.equal(cached, uncached)
    assert torch.equal(cached[:, :7], idx)
    streamed = torch.stack(list(model.stream(idx, 50, use_cache=True, **kw)), dim=1)
    assert torch.equal(streamed, cached[:, 7:])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("use_cache", [True, False])
def test_nan_logits_are_refused_greedy_or_not(make_gpt, temperature: float, use_cache: bool) -> None:
    """A model with a NaN weight: greedy decoding used to return token 0 forever."""
    model = make_gpt(3)
    with torch.no_grad():
        model.final_norm.weight[0] = float("nan")
    idx = torch.randint(0, 37, (1, 4))
    with pytest.raises(ValueError, match="logits hold NaN"):
        model.generate(idx, 3, temperature=temperature, use_cache=use_cache)
    with pytest.raises(ValueError, match="logits hold NaN"):
        next(model.stream(idx, 3, temperature=temperature, use_cache=use_cache))


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention: masked keys never contribute, on every path
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", ["key", "value", "both"])
@pytest.mark.parametrize("float_mask", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_poison_in_masked_keys_never_reaches_the_output(ref, poison, where, float_mask, gqa, is_causal) -> None:
    """NaN in a key that a padding mask hides: the fused path returned all NaN, the reference path
    finite values. Now every backend agrees with the float64 loop, which never looks at a masked key."""
    from attnlab.functional import scaled_dot_product_attention as sdpa

    torch.manual_seed(0)
    B, Hq, Hkv, L, S, E = 2, 4, 2 if gqa else 4, 3, 6, 8
    q = torch.randn(B, Hq, L, E)
    k, v = torch.randn(B, Hkv, S, E), torch.randn(B, Hkv, S, E)
    allowed = torch.ones(B, 1, 1, S, dtype=torch.bool)
    allowed[0, ..., :2] = False  # left padding of row 0
    allowed[1, ..., -1] = False  # and a hidden last key of row 1
    hidden = ~allowed[:, :, 0, :, None]  # (B, 1, S, 1)
    if where in ("key", "both"):
        k = k.masked_fill(hidden, poison)
    if where in ("value", "both"):
        v = v.masked_fill(hidden, poison)
    mask = allowed if not float_mask else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    outs = {
        b: sdpa(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa, backend=b)
        for b in ("auto", "fused", "reference")
    }
    with torch.no_grad():  # flex_attention runs on the CPU without a backward
        outs["flex"] = sdpa(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=gqa, backend="flex")
    # The reference: the float64 loop on keys/values expanded to the query heads, causal bottom-right.
    kx, vx = (t.repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))
    full = allowed.expand(B, Hq, L, S) & (torch.ones(L, S, dtype=torch.bool).tril(S - L) if is_causal else True)
    # (its weighted sum multiplies every value, hidden ones by 0: give it the hidden ones as zeros)
    want, _ = ref.loop_attention_nd(q, kx.nan_to_num(0.0, 0.0, 0.0), vx.nan_to_num(0.0, 0.0, 0.0), allowed=full)
    for b, out in outs.items():
        assert torch.isfinite(out).all(), b
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5, msg=b)


def test_gradients_stay_finite_with_poison_in_masked_keys() -> None:
    from attnlab.functional import scaled_dot_product_attention as sdpa

    torch.manual_seed(1)
    q = torch.randn(2, 2, 3, 4, requires_grad=True)
    k = torch.randn(2, 2, 5, 4).masked_fill(torch.tensor([1, 0, 0, 0, 0], dtype=torch.bool)[:, None], float("nan"))
    v = torch.randn(2, 2, 5, 4).masked_fill(torch.tensor([1, 0, 0, 0, 0], dtype=torch.bool)[:, None], float("inf"))
    k.requires_grad_(True)
    v.requires_grad_(True)
    mask = torch.tensor([False, True, True, True, True])  # key 0 hidden from every query
    for backend in ("auto", "reference"):
        q.grad = k.grad = v.grad = None
        sdpa(q, k, v, attn_mask=mask, backend=backend).sum().backward()
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
        assert (k.grad[..., 0, :] == 0).all() and (v.grad[..., 0, :] == 0).all(), backend


# ---------------------------------------------------------------------------------------------
# The commands: an empty value is not "the default"
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["", "  "])
def test_viz_out_empty_is_an_error_not_text(capsys, value: str) -> None:
    from attnlab.cli import main

    assert main(["viz", "--out", value]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab viz: error: --out") and captured.out == "", captured


@pytest.mark.parametrize("value", ["", ",", " , "])
def test_explain_lesson_empty_is_an_error_not_every_lesson(capsys, value: str) -> None:
    from attnlab.cli import main

    assert main(["explain", "--lesson", value]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnlab explain: error: --lesson") and captured.out == "", captured


# ---------------------------------------------------------------------------------------------
# The loader: regular files only
# ---------------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs mkfifo() (POSIX)")
@pytest.mark.parametrize("what", ["fifo", "dev-zero"])
@pytest.mark.parametrize("name", ["latest.json", "checkpoint.json", "tokenizer.json"])
def test_loader_reads_regular_files_only_and_never_blocks(tmp_path, capsys, what: str, name: str) -> None:
    """latest.json as a FIFO blocked `attnlab generate` forever; linked to /dev/zero it ate the
    memory. Every file the loader reads is now opened without blocking and refused unless regular."""
    from attnlab.cli import main
    from attnlab.model import GPT

    torch.manual_seed(0)
    GPT(GPTConfig(vocab_size=256, context_length=8, emb_dim=8, n_heads=1, n_layers=1)).save(tmp_path)
    if name != "tokenizer.json":
        (tmp_path / "tokenizer.json").write_text('{"name": "byte"}')
    target = tmp_path / name
    if what == "fifo":
        os.mkfifo(target)
    else:
        target.symlink_to("/dev/zero")
    assert within(30, lambda: main(["generate", "--checkpoint", str(tmp_path), "--max-new-tokens", "1"])) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and name in lines[0], lines
    assert ("FIFO" if what == "fifo" else "not a regular file") in lines[0], lines


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention: the smaller cases of the issue (fixed before; kept here with it)
# ---------------------------------------------------------------------------------------------
def test_numpy_scalars_are_taken_where_python_ones_are() -> None:
    """is_causal=np.bool_(True) was refused as "must be a bool, got bool"; scale=np.float32 refused."""
    import numpy as np

    from attnlab.functional import scaled_dot_product_attention as sdpa

    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    want = sdpa(q, k, v, is_causal=True, scale=0.25)
    for is_causal, scale in ((np.bool_(True), 0.25), (True, np.float32(0.25)), (np.True_, np.float64(0.25))):
        torch.testing.assert_close(sdpa(q, k, v, is_causal=is_causal, scale=scale), want)


def test_zero_width_and_two_dimensional_gqa_are_clear_errors() -> None:
    """A query width of 0 was a ZeroDivisionError; 2-D inputs with enable_gqa=True an IndexError."""
    from attnlab.functional import scaled_dot_product_attention as sdpa

    with pytest.raises(ValueError, match="width E = 0"):
        sdpa(torch.randn(2, 3, 0), torch.randn(2, 4, 0), torch.randn(2, 4, 5))
    out = sdpa(torch.randn(2, 3, 0), torch.randn(2, 4, 0), torch.randn(2, 4, 5), scale=1.0)  # uniform weights
    assert out.shape == (2, 3, 5) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="enable_gqa=True query needs a heads dimension"):
        sdpa(torch.randn(3, 4), torch.randn(4, 4), torch.randn(4, 5), enable_gqa=True)
