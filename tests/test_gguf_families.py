"""GGUF files of the eight families after Llama, written as llama.cpp's converter writes them.

For each llama.cpp architecture (qwen2, qwen3, gemma, gemma2, gemma3, phi3, olmo2, gptneox) a
transformers model built from a small config (``tests/test_families.py``'s, vocabulary of the
tiny tokenizer) is written to a GGUF file by ``tests/gguf_files.py`` (the converter's metadata, the
``gguf`` package's own tensor names, Gemma's norms stored as ``1 + w``, GPT-NeoX's q/k/v
reordered) and loaded with ``GPT.from_gguf``: logits within 1e-4 of the transformers model, the
same greedy tokens. Where transformers reads the architecture from GGUF itself (qwen2, qwen3,
phi3, gemma2, gemma3) it loads the same file too, and the two loadings must agree: that guards
against writing the file wrongly here and reading it back with the same mistake. The
hyperparameters its GGUF reader leaves at its own defaults (soft-caps, Gemma 3's local RoPE base,
Phi-3's partial rotary and window) are passed to it from the original config.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from attnlab import GPT  # noqa: E402
from attnlab.formats.gguf import read_gguf  # noqa: E402
from attnlab.tools.loading import load_pretrained  # noqa: E402
from gguf_files import LLAMA_CPP_ARCH, VOCAB, family_tensors, write_family_gguf  # noqa: E402
from test_families import CASES, build  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")

_GEMMA3_ROPE = CASES["gemma3"][2]["rope_parameters"]
# case -> (test_families case, config overrides, what transformers' GGUF reader must be told (None:
# it does not read the architecture), the GPTConfig switches the overrides change)
GGUF_CASES = {
    "qwen2": ("qwen2", {}, {}, {}),
    # transformers' reader assumes Qwen3's head_dim=128
    "qwen3": ("qwen3", dict(head_dim=128), {}, dict(head_size=128)),
    "gemma": ("gemma", {}, None, {}),
    # llama.cpp skips Gemma 2's lm_head (tied) and scales queries by the head size (not 27B)
    "gemma2": (
        "gemma2",
        dict(tie_word_embeddings=True, query_pre_attn_scalar=8),
        dict(query_pre_attn_scalar=8, attn_logit_softcapping=1.0, final_logit_softcapping=4.0),
        dict(tie_embeddings=True),
    ),
    # the converter writes no window pattern: llama.cpp's default, five window layers in six
    "gemma3": (
        "gemma3",
        dict(num_hidden_layers=7, layer_types=None),
        dict(query_pre_attn_scalar=8, rope_parameters=_GEMMA3_ROPE),
        dict(window_layers=[0, 1, 2, 3, 4, 6]),
    ),
    "phi3": (
        "phi3",
        {},
        dict(pad_token_id=0, sliding_window=6, rope_parameters=CASES["phi3"][2]["rope_parameters"]),
        {},
    ),
    "olmo2": ("olmo2", {}, None, {}),
    # written as olmo2 with a window, which llama.cpp's loader gives to three layers in four
    "olmo3": ("olmo3", {}, None, {}),
    "gptneox": ("gpt_neox", {}, None, {}),
    # the file records no activation: llama.cpp's NeoX MLP is GELU
    "gptneox_serial": ("gpt_neox_serial", dict(hidden_act="gelu"), None, dict(activation="gelu")),
}


@pytest.fixture(scope="module", params=list(GGUF_CASES))
def written(request, tmp_path_factory):
    name = request.param
    case, overrides, _, _ = GGUF_CASES[name]
    hf = build(case, seed=1, vocab_size=VOCAB, **overrides)
    path = write_family_gguf(tmp_path_factory.mktemp(name) / f"{name}.gguf", hf)
    return name, hf, path, GPT.from_gguf(path)


@pytest.mark.slow
def test_logits_and_greedy_tokens_match_transformers(written):
    name, hf, path, ours = written
    assert read_gguf(path).architecture == LLAMA_CPP_ARCH[hf.config.model_type]
    case, _, _, changed = GGUF_CASES[name]
    want_switches = CASES[case][3] | changed
    assert {k: getattr(ours.config, k) for k in want_switches} == want_switches
    idx = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = hf(idx).logits
        got = ours(idx)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert want.std() > 0.3  # varied distributions: the check has teeth
    prompt = idx[:, :5]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        tokens = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False, pad_token_id=0
        )
    assert torch.equal(ours.generate(prompt, 8, temperature=0), tokens)


def test_the_file_holds_what_llama_cpp_writes(written):
    """The test's writer really changes what the converter changes (so reading it back tests the undoing)."""
    name, hf, _, _ = written
    arrays = family_tensors(hf)
    sd = hf.state_dict()
    if name.startswith("gemma"):
        np.testing.assert_array_equal(arrays["blk.0.attn_norm.weight"], sd["model.layers.0.input_layernorm.weight"] + 1)
        assert "output.weight" not in arrays or name == "gemma3"
    if name.startswith("gptneox"):
        fused = sd["gpt_neox.layers.0.attention.query_key_value.weight"]
        assert not np.array_equal(arrays["blk.0.attn_qkv.weight"], fused.numpy())
    if name == "phi3":
        assert "blk.0.attn_qkv.weight" in arrays and "blk.0.ffn_gate.weight" not in arrays


def test_transformers_reads_the_same_file_the_same(written):
    name, hf, path, ours = written
    extra = GGUF_CASES[name][2]
    if extra is None:  # no second reference here: transformers refuses the architecture
        with pytest.raises(ValueError, match="not supported"):
            transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
        return
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **extra).eval()
    idx = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = theirs(idx).logits
        torch.testing.assert_close(ours(idx), want, atol=1e-4, rtol=0)
        torch.testing.assert_close(want, hf(idx).logits, atol=1e-4, rtol=0)  # the file is the model


def test_a_quantized_qwen2_reads_as_transformers_reads_it(tmp_path):
    """Q8_0 weights (norms and biases stay F32, as llama.cpp keeps them): attnlab's dequantized
    model equals transformers' loading of the same file, and stays near the float model."""
    hf = build("qwen2", seed=3, vocab_size=VOCAB, intermediate_size=64)  # Q8_0 rows: multiples of 32
    path = write_family_gguf(tmp_path / "q8.gguf", hf, qtype="Q8_0")
    read = read_gguf(path)
    assert read.quantization["Q8_0"] == 2 + 4 * 7  # embeddings and head, q/k/v/o and gate/up/down a layer
    ours = GPT.from_gguf(read)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q8.gguf").eval()
    idx = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, want, exact = ours(idx), theirs(idx).logits, hf(idx).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert 1e-4 < (got - exact).abs().max() < 0.05 * exact.abs().max()  # quantized: near, not equal


def test_model_file_loads_with_its_tokenizer(written):
    """``--model FILE.gguf``'s loader: the family's model and the file's tokenizer together."""
    _, hf, path, ours = written
    loaded = load_pretrained(str(path))
    assert loaded.metadata["architecture"] == LLAMA_CPP_ARCH[hf.config.model_type]
    assert loaded.tokenizer.vocab_size == VOCAB
    for a, b in zip(loaded.model.state_dict().values(), ours.state_dict().values(), strict=True):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# What is refused: one clear ValueError naming the file, never a silently wrong model
# ---------------------------------------------------------------------------------------------
def _refused(tmp_path, case, overrides, match, **kw):
    hf = build(case, seed=0, vocab_size=VOCAB, **overrides)
    path = write_family_gguf(tmp_path / f"{case}.gguf", hf, **kw)
    with pytest.raises(ValueError, match=match) as e:
        GPT.from_gguf(path)
    assert str(e.value).startswith(str(path))


def test_refused_olmo3_rope_scaling_other_than_yarn(tmp_path):
    meta = {"olmo2.rope.scaling.type": "linear", "olmo2.rope.scaling.factor": 2.0}
    _refused(tmp_path, "olmo3", {}, "RoPE scaling 'linear' in an olmo2 file with a sliding window", meta=meta)


OLMO3_YARN = {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "original_max_position_embeddings": 16,
              "attention_factor": 1.25}  # fmt: skip


@pytest.mark.slow
def test_an_olmo3_yarn_file_computes_transformers_olmo3(tmp_path):
    """OLMo 3's long context: YaRN on the full layers only, plain RoPE of the same base on the window
    layers (transformers' Olmo3 model; llama.cpp's olmo2 graph alike). Written as llama.cpp's converter
    writes an Olmo3 config (``rope.scaling.type``, ``factor``, ``attn_factor``, ``original_context_length``
    and the window pattern one boolean a layer, here with the full layer first): logits and greedy
    tokens past the original context equal transformers'. Scaling every layer, or none, differs."""
    rope = {"full_attention": OLMO3_YARN, "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}
    types = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]
    hf = build("olmo3", seed=3, vocab_size=VOCAB, rope_parameters=rope, layer_types=types)
    meta = {"olmo2.rope.scaling.type": "yarn", "olmo2.rope.scaling.factor": 4.0,
            "olmo2.rope.scaling.attn_factor": 1.25, "olmo2.rope.scaling.original_context_length": 16,
            "olmo2.attention.sliding_window_pattern": [t == "sliding_attention" for t in types]}  # fmt: skip
    ours = GPT.from_gguf(write_family_gguf(tmp_path / "olmo3.gguf", hf, meta=meta))
    assert ours.config.window_layers == [1, 2, 3]
    written = ("rope_type", "factor", "original_max_position_embeddings", "attention_factor")  # (ramp: defaults)
    assert ours.config.rope_scaling == {k: OLMO3_YARN[k] for k in written}
    idx = torch.randint(0, VOCAB, (1, 48), generator=torch.Generator().manual_seed(6))  # 3x the original context
    plain = {"rope_type": "default", "rope_theta": 500.0}
    with torch.no_grad():
        want, got = hf(idx).logits, ours(idx)
        others = [build("olmo3", seed=3, vocab_size=VOCAB, rope_parameters=r, layer_types=types)(idx).logits
                  for r in ({"full_attention": plain, "sliding_attention": plain},
                            {"full_attention": OLMO3_YARN, "sliding_attention": OLMO3_YARN})]  # fmt: skip
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-5 * scale
    assert all(float((o - want).abs().max()) > 1e-3 * scale for o in others)
    tokens = ours.generate(idx[:, :16], 24, temperature=0)
    assert torch.equal(tokens, hf.generate(idx[:, :16], max_new_tokens=24, do_sample=False, pad_token_id=0))


def test_refused_phi3_longrope_factors_without_their_pair(tmp_path):
    extra = {"rope_factors_long.weight": np.ones(2, np.float32)}
    _refused(tmp_path, "phi3", {}, "LongRoPE needs both 'rope_factors_short.weight'", tensors=lambda a: a | extra)


def test_refused_phi3_longrope_scaling(tmp_path):
    _refused(tmp_path, "phi3", {}, "'longrope'.*not supported", meta={"phi3.rope.scaling.type": "longrope"})


def test_refused_a_tensor_the_family_does_not_have(tmp_path):
    # Qwen3 has no q/k/v biases: a file with them is not read as if they were not there
    extra = {"blk.0.attn_q.bias": np.zeros(64, np.float32)}
    _refused(tmp_path, "qwen3", {}, "unexpected tensor 'blk.0.attn_q.bias'", tensors=lambda a: a | extra)


def test_refused_odd_rotary_dimensions(tmp_path):
    meta = {"gptneox.rope.dimension_count": 3}
    _refused(tmp_path, "gpt_neox", {}, "rope.dimension_count must be an even integer", meta=meta)


def test_refused_a_window_pattern_of_the_wrong_length(tmp_path):
    meta = {"gemma2.attention.sliding_window_pattern": [True, False]}
    _refused(tmp_path, "gemma2", dict(tie_word_embeddings=True), "sliding_window_pattern must be 4 booleans", meta=meta)


def test_refused_an_architecture_attnlab_does_not_read(tmp_path):
    hf = build("qwen2", seed=0, vocab_size=VOCAB)
    path = write_family_gguf(tmp_path / "x.gguf", hf)
    data = path.read_bytes().replace(b"qwen2", b"mamba")  # general.architecture and its keys alike
    (tmp_path / "mamba.gguf").write_bytes(data)
    with pytest.raises(ValueError, match=r"'mamba' is not supported yet.*qwen2, qwen3, gemma, gemma2, gemma3"):
        GPT.from_gguf(tmp_path / "mamba.gguf")


def test_a_window_pattern_given_per_layer(tmp_path):
    """``attention.sliding_window_pattern`` as one boolean a layer (what newer converters write
    when the layers do not follow the family's period): test_families' three-layer Gemma 3."""
    hf = build("gemma3", seed=2, vocab_size=VOCAB)  # layer_types: sliding, sliding, full
    meta = {"gemma3.attention.sliding_window_pattern": [True, True, False]}
    ours = GPT.from_gguf(write_family_gguf(tmp_path / "g3.gguf", hf, meta=meta))
    assert ours.config.window_layers == [0, 1]
    idx = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-4, rtol=0)
        plain = GPT.from_gguf(write_family_gguf(tmp_path / "plain.gguf", hf))  # the default: all three slide
        assert plain.config.window_layers is None and plain.config.window == 5
        assert (plain(idx) - hf(idx).logits).abs().max() > 1e-3  # the pattern matters on this input


@pytest.mark.slow  # 46 layers: 3 s
def test_gemma2_27b_query_scale_by_its_layer_count(tmp_path):
    """The file does not record Gemma's query scale: llama.cpp uses the head size, but width / heads
    for Gemma 2 27B, which it knows by its 46 layers. A tiny 46-layer Gemma 2 whose head size (16)
    is not width / heads (8) reads with the 27B's scale, as transformers' 27B config has it."""
    hf = build("gemma2", seed=4, vocab_size=VOCAB, num_hidden_layers=46, head_dim=16, query_pre_attn_scalar=8,
               tie_word_embeddings=True, hidden_size=32, intermediate_size=32)  # fmt: skip
    ours = GPT.from_gguf(write_family_gguf(tmp_path / "g2.gguf", hf))
    assert ours.config.attn_scale == 8**-0.5
    idx = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-4, rtol=0)
