"""Small GGUF files written by the tests, the way llama.cpp's converter writes them.

:func:`tiny_llama` is a transformers ``LlamaForCausalLM`` built from a small config (no download);
:func:`write_gguf` writes it as llama.cpp's ``convert_hf_to_gguf.py`` does: llama.cpp's tensor names,
the query and key rows permuted (:func:`permute`, a copy of the converter's ``LlamaModel.permute``),
dimensions listed fastest first, the metadata under llama.cpp's keys, and a byte-level BPE
tokenizer with a chat template. ``meta=`` and ``tensors=`` change what is written, for the hostile
files of ``tests/test_hostile_models.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a"]
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's 256 printable stand-ins for bytes, in byte order (written independently of attnlab's)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def tokens() -> list[str]:
    """The tiny vocabulary: three control tokens, the 256 bytes, then one token per merge."""
    return SPECIALS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]


VOCAB = len(tokens())


def tiny_llama(
    seed: int = 0,
    *,
    tie: bool = False,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = VOCAB,
    rope: Any = None,
    **config: Any,
) -> Any:
    """A random transformers Llama: width 32, 2 layers, grouped-query heads, eval mode (``rope``:
    its ``rope_parameters``, default RoPE with base 500; ``config``: more of its config, e.g. biases)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 500.0},
        tie_word_embeddings=tie,
        **config,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms away from 1, so a mixed-up norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: Hugging Face's rotate-half rows of a
    query/key projection into llama.cpp's interleaved pairs."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    **{f"self_attn.{p}_proj.bias": f"attn_{p}.bias" for p in "qkv"},
    "self_attn.o_proj.bias": "attn_output.bias",
    **{f"mlp.{p}_proj.bias": f"ffn_{p}.bias" for p in ("gate", "up", "down")},
}


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """``{llama.cpp name: float32 array}`` of a transformers Llama, q/k permuted as the converter does."""
    cfg = model.config
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        parts = name.split(".")
        layer = parts[1] == "layers"
        gguf_name = f"blk.{parts[2]}." + HF_TO_GGUF[".".join(parts[3:])] if layer else HF_TO_GGUF[name]
        w = t.detach().float().numpy().copy()
        if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            w = permute(w, cfg.num_attention_heads, cfg.num_attention_heads)
        elif gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            w = permute(w, cfg.num_attention_heads, cfg.num_key_value_heads)
        out[gguf_name] = w
    return out


def llama_metadata(model: Any, arch: str = "llama") -> dict[str, Any]:
    """The metadata llama.cpp's converter writes for a Llama (and the tiny tokenizer's)."""
    cfg = model.config
    return {
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": cfg.num_attention_heads,
        f"{arch}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{arch}.rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        f"{arch}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{arch}.vocab_size": cfg.vocab_size,
        f"{arch}.rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads,
    } | tokenizer_metadata()


def tokenizer_metadata() -> dict[str, Any]:
    """The tiny byte-level BPE tokenizer and chat template, under llama.cpp's keys."""
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens(),
        "tokenizer.ggml.token_type": [3] * len(SPECIALS) + [1] * (len(tokens()) - len(SPECIALS)),
        "tokenizer.ggml.merges": list(MERGES),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": TEMPLATE,
    }


def _add(writer: Any, key: str, value: Any) -> None:
    import gguf

    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        (writer.add_uint32 if 0 <= value < 1 << 32 else writer.add_int64)(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        if value and isinstance(value[0], int) and not isinstance(value[0], bool):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        else:
            writer.add_array(key, value)
    else:
        raise TypeError(f"no GGUF type for {key}={value!r}")


def write_gguf(
    path: Path,
    model: Any = None,
    *,
    qtype: str = "F32",
    arch: str = "llama",
    meta: dict[str, Any] | None = None,
    tensors: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
) -> Path:
    """Write ``model`` (default: :func:`tiny_llama`) to ``path`` as llama.cpp would.

    ``qtype`` quantizes the 2-D weights (``F16``, ``BF16``, ``Q8_0``, ``Q4_0``, ...; the norms stay
    F32, as llama.cpp keeps them); ``meta`` overrides metadata (a value of None drops the key);
    ``tensors`` edits the ``{name: array}`` dict before it is written."""

    model = tiny_llama() if model is None else model
    values = llama_metadata(model, arch) | (meta or {})
    arrays = gguf_tensors(model)
    if tensors is not None:
        arrays = tensors(arrays)
    return _write(path, arch, values, arrays, qtype)


# ---------------------------------------------------------------------------------------------
# The families after Llama, as llama.cpp's converter (convert_hf_to_gguf.py) writes each
# ---------------------------------------------------------------------------------------------
# Hugging Face model_type -> llama.cpp architecture (general.architecture)
LLAMA_CPP_ARCH = {
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "phi3": "phi3",
    "olmo2": "olmo2",
    "olmo3": "olmo2",  # (llama.cpp's converter writes OLMo 3 as olmo2 with a sliding window)
    "gpt_neox": "gptneox",
}


def family_metadata(model: Any) -> dict[str, Any]:
    """The metadata the converter's ``set_gguf_parameters`` writes for ``model``'s family, plus the
    tiny tokenizer's (the keys it leaves out are what llama.cpp assumes: Gemma's RoPE base, ...)."""
    cfg = model.config
    mt, arch = cfg.model_type, LLAMA_CPP_ARCH[cfg.model_type]
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    rope = dict(cfg.rope_parameters or {})  # transformers 5's (Gemma 3: one dict per layer type)
    if mt == "olmo3":  # (one per layer type too; the converter writes the full layers')
        rope = dict(rope["full_attention"])
    out: dict[str, Any] = {
        f"{arch}.context_length": cfg.max_position_embeddings,
        f"{arch}.embedding_length": cfg.hidden_size,
        f"{arch}.block_count": cfg.num_hidden_layers,
        f"{arch}.feed_forward_length": cfg.intermediate_size,
        f"{arch}.attention.head_count": heads,
    }
    if mt == "gpt_neox":  # GPTNeoXModel.set_gguf_parameters: no RoPE base, no kv heads
        out[f"{arch}.rope.dimension_count"] = int(rope.get("partial_rotary_factor", 1.0) * head_dim)
        out[f"{arch}.use_parallel_residual"] = bool(cfg.use_parallel_residual)
        out[f"{arch}.attention.layer_norm_epsilon"] = float(cfg.layer_norm_eps)
    else:
        out[f"{arch}.attention.head_count_kv"] = cfg.num_key_value_heads
        out[f"{arch}.attention.layer_norm_rms_epsilon"] = float(cfg.rms_norm_eps)
    if mt in ("qwen2", "qwen3", "olmo2", "olmo3", "phi3"):  # TextModel's (Phi3MiniModel writes its own, alike)
        out[f"{arch}.rope.freq_base"] = float(rope["rope_theta"])
    if mt in ("qwen3", "gemma", "gemma2", "gemma3_text"):
        out[f"{arch}.attention.key_length"] = head_dim
        out[f"{arch}.attention.value_length"] = head_dim
    if mt == "phi3":
        rot = int(rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size) // heads
        out[f"{arch}.rope.dimension_count"] = rot
        out[f"{arch}.rope.scaling.original_context_length"] = cfg.original_max_position_embeddings
        out[f"{arch}.attention.sliding_window"] = cfg.sliding_window or 0
    if mt == "olmo3":
        out[f"{arch}.attention.sliding_window"] = cfg.sliding_window
    if mt == "gemma2":
        out[f"{arch}.attn_logit_softcapping"] = float(cfg.attn_logit_softcapping)
        out[f"{arch}.final_logit_softcapping"] = float(cfg.final_logit_softcapping)
        out[f"{arch}.attention.sliding_window"] = cfg.sliding_window
    if mt == "gemma3_text":
        full, local = rope["full_attention"], rope["sliding_attention"]
        out[f"{arch}.rope.freq_base"] = float(full["rope_theta"])
        out[f"{arch}.rope.freq_base_swa"] = float(local["rope_theta"])
        if full.get("rope_type") == "linear":
            out[f"{arch}.rope.scaling.type"] = "linear"
            out[f"{arch}.rope.scaling.factor"] = float(full["factor"])
        if cfg.final_logit_softcapping:
            out[f"{arch}.final_logit_softcapping"] = float(cfg.final_logit_softcapping)
        out[f"{arch}.attention.sliding_window"] = cfg.sliding_window
    return out | tokenizer_metadata()


def family_tensors(model: Any) -> dict[str, np.ndarray]:
    """``{llama.cpp name: float32 array}`` of ``model`` as the converter writes it: names by the
    ``gguf`` package's own ``TensorNameMap`` (what the converter uses), Gemma's norms stored as
    ``1 + w``, GPT-NeoX's per-head fused q/k/v reordered as all q, all k, all v, Gemma 1/2's
    ``lm_head`` skipped (they are tied)."""
    import gguf

    cfg = model.config
    mt, arch = cfg.model_type, LLAMA_CPP_ARCH[cfg.model_type]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    heads = cfg.num_attention_heads
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or mt in ("gemma", "gemma2")):
            continue
        w = t.detach().float()
        if mt.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1
        if mt == "gpt_neox" and "query_key_value" in name:  # GPTNeoXModel.modify_tensors
            w = w.reshape(heads, 3, -1, *w.shape[1:]).transpose(0, 1).reshape(w.shape)
        base, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise KeyError(f"the converter has no name for {name} in {arch}")
        out[f"{gguf_name}.{suffix}"] = w.numpy().copy()
    return out


def write_family_gguf(
    path: Path,
    model: Any,
    *,
    qtype: str = "F32",
    meta: dict[str, Any] | None = None,
    tensors: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None,
) -> Path:
    """Write a transformers model of one of the families to ``path`` as llama.cpp's converter
    would (``qtype``, ``meta`` and ``tensors`` as for :func:`write_gguf`)."""

    arch = LLAMA_CPP_ARCH[model.config.model_type]
    values = family_metadata(model) | (meta or {})
    arrays = family_tensors(model)
    if tensors is not None:
        arrays = tensors(arrays)
    return _write(path, arch, values, arrays, qtype)


def _write(path, arch: str, values: dict, arrays: dict, qtype: str):
    """The GGUF file: ``values`` as metadata (None: left out), ``arrays`` as tensors, the 2-D ones
    quantized to ``qtype``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in values.items():
        if value is not None:
            _add(writer, key, value)
    kind = gguf.GGMLQuantizationType[qtype]
    for name, w in arrays.items():
        if w.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------------------------------------
# SentencePiece vocabularies (tokenizer.ggml.model "llama"), as the converter writes them
# ---------------------------------------------------------------------------------------------
# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# What the tiny vocabularies learn their pieces from: English, digits, accents, Cyrillic and CJK,
# so that some non-ASCII text is in the vocabulary and emoji, Arabic, ... are not (byte fallback).
SP_CORPUS = (
    "the cat sat on the mat and the dog sat on the log\n"
    "there is the theory of the thing that the other one thought\n"
    "in 2024 the price was 3.14 and then 42 or 1000 times more\n"
    "un café naïve à la crème, résumé déjà vu, über schön\n"
    "привет мир, привет\n"
    "日本語の本を読む。東京は日本の首都\n"
)

SP_CHAT_TEMPLATES = {
    "llama": (
        "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
        "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}"
        "{% endif %}{% endfor %}"
    ),
    "gemma": (
        "{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + message['role'] + '\n' + "
        "message['content'] + '<end_of_turn>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
    ),
    "phi3": (
        "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
    ),
}


def learn_pieces(text: str, merges: int, *, prefix: bool) -> tuple[list[str], list[str]]:
    """SentencePiece-style BPE training, small and plain: each line's spaces become "▁" (one before
    the line when ``prefix``, SentencePiece's ``add_dummy_prefix``), words start at a "▁", and the
    most frequent adjacent pair inside a word is merged ``merges`` times (ties: the smaller pair).
    Returns (the merged pieces in the order they were learned, the characters by frequency)."""
    import itertools
    from collections import Counter

    words: Counter[tuple[str, ...]] = Counter()
    for line in text.splitlines():
        line = ("▁" if prefix else "") + line.replace(" ", "▁")
        for word in line.replace("▁", "\0▁").split("\0"):
            if word:
                words[tuple(word)] += 1
    chars: Counter[str] = Counter()
    for word, n in words.items():
        for c in word:
            chars[c] += n
    learned = []
    for _ in range(merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, n in words.items():
            for a, b in itertools.pairwise(word):
                pairs[a, b] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        learned.append(best[0] + best[1])
        merged: Counter[tuple[str, ...]] = Counter()
        for word, n in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return learned, [c for c, _ in sorted(chars.items(), key=lambda kv: (-kv[1], kv[0]))]


def byte_tokens() -> list[str]:
    """SentencePiece's 256 byte-fallback pieces, ``<0x00>`` ... ``<0xFF>``."""
    return [f"<0x{b:02X}>" for b in range(256)]


def sentencepiece_vocab(family: str = "llama", merges: int = 80) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a tiny SentencePiece BPE vocabulary laid out as ``family``'s
    (``llama``: Llama 1/2, Mistral, TinyLlama; ``gemma``; ``phi3``): the special tokens, the 256 byte
    tokens, the learned pieces (score -rank: the earlier merge wins), then the single characters.

    Gemma's files store runs of spaces as real spaces and its scores do not give the merge order
    (the file's order does): they are written as 0 here, so that a reader trusting them shows."""
    if family not in ("llama", "gemma", "phi3"):
        raise ValueError(f"family must be llama, gemma or phi3, got {family!r}")
    learned, chars = learn_pieces(SP_CORPUS, merges, prefix=family != "gemma")
    if family == "gemma":
        head = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN), ("<mask>", CONTROL)]
        head += [("<unused0>", UNUSED), ("<start_of_turn>", CONTROL), ("<end_of_turn>", CONTROL)]
        head += [("\n", USER_DEFINED), ("\n\n", USER_DEFINED), ("  ", USER_DEFINED), ("   ", USER_DEFINED)]
        chars = [c for c in chars if c != "\n"]
    else:
        head = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]
    toks = [t for t, _ in head] + byte_tokens() + learned + [c for c in chars if c not in learned]
    types = [k for _, k in head] + [BYTE] * 256 + [NORMAL] * (len(toks) - len(head) - 256)
    scores = [0.0] * len(head) + [0.0] * 256 + [-float(i) for i in range(len(toks) - len(head) - 256)]
    if family == "gemma":
        scores = [0.0] * len(toks)
    if family == "phi3":  # Phi-3's chat tokens follow the SentencePiece vocabulary
        tail = [("<|endoftext|>", CONTROL), ("<|assistant|>", CONTROL), ("<|placeholder1|>", USER_DEFINED)]
        tail += [("<|end|>", CONTROL), ("<|user|>", CONTROL)]
        toks += [t for t, _ in tail]
        types += [k for _, k in tail]
        scores += [0.0] * len(tail)
    return toks, scores, types


def sentencepiece_metadata(family: str = "llama", merges: int = 80) -> dict[str, Any]:
    """The tokenizer metadata the converter writes for a SentencePiece ``family`` (see
    :func:`sentencepiece_vocab`), replacing every key of :func:`tokenizer_metadata` (None drops the
    byte-level ones). Llama's files leave ``add_space_prefix`` out (llama.cpp then prepends a
    space), Gemma's say False."""
    toks, scores, types = sentencepiece_vocab(family, merges)
    ids = {t: i for i, t in enumerate(toks)}
    out: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.merges": None,
        "tokenizer.ggml.tokens": toks,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.unknown_token_id": ids["<unk>"],
        "tokenizer.ggml.add_bos_token": family != "phi3",
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.chat_template": SP_CHAT_TEMPLATES[family],
    }
    if family == "gemma":
        out |= {"tokenizer.ggml.bos_token_id": ids["<bos>"], "tokenizer.ggml.eos_token_id": ids["<eos>"]}
        out |= {"tokenizer.ggml.padding_token_id": ids["<pad>"], "tokenizer.ggml.add_space_prefix": False}
        out["tokenizer.ggml.eot_token_id"] = ids["<end_of_turn>"]
    elif family == "phi3":
        out |= {"tokenizer.ggml.bos_token_id": ids["<s>"], "tokenizer.ggml.eos_token_id": ids["<|endoftext|>"]}
        out |= {"tokenizer.ggml.padding_token_id": ids["<|endoftext|>"], "tokenizer.ggml.eot_token_id": ids["<|end|>"]}
    else:
        out |= {"tokenizer.ggml.bos_token_id": ids["<s>"], "tokenizer.ggml.eos_token_id": ids["</s>"]}
    return out


def trained_sentencepiece(*, prefix: bool = True, vocab_size: int = 400) -> tuple[Any, dict[str, Any]]:
    """A real SentencePiece BPE model trained by the ``sentencepiece`` library on :data:`SP_CORPUS`
    (byte fallback, no normalization, ``add_dummy_prefix=prefix``), and the tokenizer metadata
    llama.cpp's converter writes for it (``_create_vocab_sentencepiece``: each piece, its score and
    its type as the model says; ``add_space_prefix`` only where it is off, as Gemma's converter does).
    Returns ``(SentencePieceProcessor, metadata)``: the processor is the reference encoder."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(SP_CORPUS.splitlines() * 5),
        model_writer=buf,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",  # no NFKC: the text's characters stay as they are
        add_dummy_prefix=prefix,
        remove_extra_whitespaces=False,  # Llama's setting: runs of spaces are kept
        hard_vocab_limit=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    toks, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        toks.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        kind = NORMAL
        if sp.is_unknown(i):
            kind = UNKNOWN
        elif sp.is_control(i):
            kind = CONTROL
        elif sp.is_unused(i):
            kind = UNUSED
        elif sp.is_byte(i):
            kind = BYTE
        types.append(kind)
    meta = sentencepiece_metadata("llama") | {
        "tokenizer.ggml.tokens": toks,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.add_space_prefix": None if prefix else False,
    }
    return sp, meta
