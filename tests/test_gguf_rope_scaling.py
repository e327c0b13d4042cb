"""RoPE scaling as llama.cpp stores it in GGUF files: Llama 3.1's and 3.2's as the tensor
``rope_freqs.weight``, YaRN as ``rope.scaling.*`` metadata.

llama.cpp's converter does not write the four ``llama3`` parameters into the file; it writes each
feature pair's divisor of its rotation speed. attnlab reads the parameters back
(:func:`attnlab.positions.llama3_scaling_from_factors`). The references:

* the divisors computed here as the converter computes them (``convert_hf_to_gguf.py``, written out in
  :func:`converter`), and the speeds they give against those of the parameters read back, for the
  published Llama 3.1 and 3.2 configurations and, by ``hypothesis``, for any parameters;
* a tiny transformers Llama built from a ``llama3`` config, written to a GGUF file with its divisors,
  and one built from a ``yarn`` config, written with the metadata llama.cpp's converter writes for it:
  the loaded model's logits and greedy tokens against transformers' own.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from attnlab.positions import llama3_scaling_from_factors, rope_inv_freq

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from attnlab import GPT  # noqa: E402
from gguf_files import VOCAB, tiny_llama, write_gguf  # noqa: E402


def converter(head_dim: int, theta: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's converter computes it for a ``llama3`` rope_scaling:
    ``(head_dim / 2,)`` float32."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def speeds_of_divisors(head_dim: int, theta: float, divisors: np.ndarray) -> torch.Tensor:
    """What llama.cpp rotates by: the default speeds over the divisors, float64."""
    return rope_inv_freq(head_dim, theta).double() / torch.from_numpy(divisors).double()


# (head_dim, theta, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
PUBLISHED = {
    "Llama 3.1 8B/70B": (128, 500000.0, 8.0, 1.0, 4.0, 8192),
    "Llama 3.2 1B": (64, 500000.0, 32.0, 1.0, 4.0, 8192),
    "Llama 3.2 3B": (128, 500000.0, 32.0, 1.0, 4.0, 8192),
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_the_published_configurations_come_back_from_their_divisors(name):
    head_dim, theta, factor, low, high, original = PUBLISHED[name]
    scaling = llama3_scaling_from_factors(torch.from_numpy(converter(*PUBLISHED[name])), head_dim, theta)
    assert scaling == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


@settings(max_examples=60, deadline=None)
@given(
    head_dim=st.sampled_from([32, 64, 128, 256]),
    theta=st.floats(1e3, 1e7),
    factor=st.floats(1.5, 64.0),
    low=st.floats(0.5, 2.0),
    width=st.floats(0.5, 8.0),
    original=st.integers(128, 1 << 17),
)
def test_the_speeds_read_back_are_the_divisors_speeds(head_dim, theta, factor, low, width, original):
    """Parameters read back give the divisors' speeds whenever they are read;
    divisors that tell them (two pairs or more interpolated, one slowed by the whole factor) always are."""
    divisors = converter(head_dim, theta, factor, low, low + width, original)
    assume(not np.all(divisors == 1))
    interpolated = int(((divisors > 1) & (divisors < np.float32(factor))).sum())
    tells = interpolated >= 2 and bool((divisors == np.float32(factor)).any())
    try:
        scaling = llama3_scaling_from_factors(torch.from_numpy(divisors), head_dim, theta)
    except ValueError as e:
        assert not tells, e
        assert "Llama 3's scaling" in str(e)
        return
    got = rope_inv_freq(head_dim, theta, scaling).double()
    # (1e-4: a pair just inside the band's edge turns the divisors' float32 rounding into more than that)
    torch.testing.assert_close(got, speeds_of_divisors(head_dim, theta, divisors), rtol=1e-4, atol=0)


def test_divisors_of_one_are_no_scaling():
    assert llama3_scaling_from_factors(torch.ones(64), 128, 500000.0) is None


@pytest.mark.parametrize(
    ("divisors", "match"),
    [
        (np.ones(63), "must be 64 positive numbers"),
        (np.r_[np.ones(63), np.nan], "must be 64 positive numbers"),
        (np.r_[np.ones(63), 0.0], "must be 64 positive numbers"),
        (np.r_[np.full(32, 8.0), np.ones(32)], "kept, then interpolated, then slowed"),  # slowed first
        (np.r_[np.ones(40), 2.0, np.full(23, 8.0)], "at least two interpolated"),
        (np.r_[np.ones(40), 3.0, 2.0, 5.0, np.full(21, 8.0)], "do not follow Llama 3's scaling"),  # not on a line
    ],
    ids=["short", "nan", "zero", "slowed-first", "one-interpolated", "not-llama3"],
)
def test_divisors_of_another_shape_are_refused_by_name(divisors, match):
    with pytest.raises(ValueError, match=match):
        llama3_scaling_from_factors(torch.as_tensor(divisors), 128, 500000.0)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip


def test_a_llama_3_file_computes_transformers_llama_3_model(tmp_path):
    """A tiny Llama built by transformers from a ``llama3`` config (one head of 32: 16 pairs, three of them
    interpolated), written as llama.cpp writes it: attnlab reads the config back, and its logits and
    greedy tokens are transformers'. The same model without the scaling differs (the test can fail)."""
    hf = tiny_llama(heads=1, kv_heads=1, rope=LLAMA3)
    head_dim, theta = hf.config.hidden_size, LLAMA3["rope_theta"]
    divisors = converter(head_dim, theta, 8.0, 1.0, 4.0, 64)
    assert int(((divisors > 1) & (divisors < 8)).sum()) == 3
    path = write_gguf(tmp_path / "llama3.gguf", hf, tensors=lambda a: a | {"rope_freqs.weight": divisors})
    model = GPT.from_gguf(path, dtype=torch.float32)
    assert model.config.rope_scaling == {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    idx = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = hf(idx).logits, model(idx)
        unscaled = tiny_llama(heads=1, kv_heads=1, rope={"rope_type": "default", "rope_theta": theta})(idx).logits
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-5 * scale
    assert float((unscaled - want).abs().max()) > 1e-3 * scale
    tokens = model.generate(idx[:1, :16], 16, temperature=0)
    want_tokens = hf.generate(idx[:1, :16], max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, want_tokens)


def test_a_file_with_divisors_of_one_loads_as_the_file_without_them(tmp_path):
    hf = tiny_llama(heads=1, kv_heads=1)
    ones = np.ones(hf.config.hidden_size // 2, np.float32)
    path = write_gguf(tmp_path / "ones.gguf", hf, tensors=lambda a: a | {"rope_freqs.weight": ones})
    model = GPT.from_gguf(path, dtype=torch.float32)
    assert model.config.rope_scaling is None
    idx = torch.randint(0, VOCAB, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, rtol=1e-5, atol=1e-5)


YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("beta", [None, (16.0, 2.0)], ids=["default-ramp", "given-ramp"])
def test_a_yarn_file_computes_transformers_yarn_model(tmp_path, beta):
    """A tiny Llama built by transformers from a ``yarn`` config (slow pairs slowed 4x, cosines and sines
    scaled by 0.1 ln 4 + 1), written with the ``rope.scaling.*`` keys llama.cpp's converter writes:
    attnlab reads the config back, and its logits and greedy tokens are transformers'. The same model
    without the scaling differs (the test can fail)."""
    params = YARN | ({} if beta is None else {"beta_fast": beta[0], "beta_slow": beta[1]})
    hf = tiny_llama(heads=1, kv_heads=1, rope=params)
    meta = {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
            "llama.rope.scaling.original_context_length": 16}  # fmt: skip
    if beta is not None:
        meta |= {"llama.rope.scaling.yarn_beta_fast": beta[0], "llama.rope.scaling.yarn_beta_slow": beta[1]}
    model = GPT.from_gguf(write_gguf(tmp_path / "yarn.gguf", hf, meta=meta), dtype=torch.float32)
    assert model.config.rope_scaling == {k: v for k, v in params.items() if k != "rope_theta"}
    idx = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = hf(idx).logits, model(idx)
        unscaled = tiny_llama(heads=1, kv_heads=1, rope={"rope_type": "default", "rope_theta": 500.0})(idx).logits
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-5 * scale
    assert float((unscaled - want).abs().max()) > 1e-3 * scale
    tokens = model.generate(idx[:1, :16], 16, temperature=0)
    assert torch.equal(tokens, hf.generate(idx[:1, :16], max_new_tokens=16, do_sample=False, pad_token_id=0))
