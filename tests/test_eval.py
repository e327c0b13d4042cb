"""``attnlab eval``: the loss of a model on a text equals transformers' on the same windows."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from attnlab import GPT, GPTConfig
from attnlab.cli import main
from attnlab.training.eval import evaluate_tokens, windows

TEXT = (
    "I had always thought Jack Gisburn rather a cheap genius--though a good fellow enough--so it was no "
    "great surprise to me to hear that, in the height of his glory, he had dropped his painting. "
) * 3


@given(n=st.integers(2, 200), T=st.integers(1, 40), data=st.data())
def test_every_token_but_the_first_is_scored_once_with_at_most_T_tokens_of_context(n, T, data) -> None:
    stride = data.draw(st.integers(1, T))
    plan = windows(n, T, stride)
    scored = []
    for begin, end, k in plan:
        assert 1 <= k <= end - begin - 1 and end - 1 - begin <= T  # the model reads tokens[begin:end-1]
        scored += range(end - k, end)
    assert scored == list(range(1, n))


def test_bad_windows_name_the_flag() -> None:
    with pytest.raises(ValueError, match="--stride 5 is larger than --context-length 4"):
        windows(10, 4, 5)
    with pytest.raises(ValueError, match="--context-length must be a positive integer"):
        windows(10, 0, 1)


def _hf_loss(hf_model, ids: list[int], T: int, stride: int) -> float:
    """transformers' mean loss over the same windows (its own labels with -100 on the context)."""
    total = count = 0.0
    for begin, end, k in windows(len(ids), T, stride):
        x = torch.tensor([ids[begin:end]])
        labels = x.clone()
        labels[:, :-k] = -100
        with torch.no_grad():
            out = hf_model(input_ids=x[:, :-1]).logits.double()  # (1, W, V)
        total += torch.nn.functional.cross_entropy(out[0], labels[0, 1:], reduction="sum", ignore_index=-100).item()
        count += k
    return total / count


@pytest.mark.parametrize("stride", [16, 6])
def test_tiny_llama_equals_transformers(stride) -> None:
    transformers = pytest.importorskip("transformers")
    from attnlab import GPT

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg).eval()
    model = GPT.from_hf(hf).eval()
    ids = torch.randint(0, 61, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = evaluate_tokens(model, ids, context_length=16, stride=stride)
    assert ours.tokens == 89
    assert ours.loss == pytest.approx(_hf_loss(hf, ids, 16, stride), rel=1e-5)


@pytest.mark.slow
def test_smollm2_equals_transformers_and_the_cli_prints_it(smollm2_hf_dir, capsys) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_hf_dir)
    text_file = smollm2_hf_dir.parent / "verdict.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    assert main(["eval", "--model", str(smollm2_hf_dir), "--data", str(text_file), "--context-length", "32",
                 "--stride", "24", "--device", "cpu", "--no-progress", "--json"]) == 0  # fmt: skip
    got = json.loads(capsys.readouterr().out)
    encoded = tok(TEXT, return_offsets_mapping=True)
    ids = encoded["input_ids"]  # what Hugging Face's tokenizer makes of the text (its BOS, if any)
    assert got["tokens"] == len(ids) - 1
    want = _hf_loss(hf, ids, 32, 24)
    assert got["loss"] == pytest.approx(want, rel=1e-4)
    assert got["perplexity"] == pytest.approx(math.exp(want), rel=1e-4)
    # The bytes scored: the text's after the first token (context only; a BOS covers none of the text)
    scored = len(TEXT.encode()) - len(TEXT[: encoded["offset_mapping"][0][1]].encode())
    assert got["bytes"] == scored < len(TEXT.encode())  # (SmolLM2 adds no BOS: its first token is text)
    assert got["bits_per_byte"] == pytest.approx(want * got["tokens"] / math.log(2) / scored, rel=1e-4)
    assert 0.3 < got["bits_per_byte"] < 3  # a real model on English prose


def test_cli_bad_stride_is_one_line(tmp_path, capsys, make_gpt) -> None:
    from attnlab.tokenizers import ByteTokenizer

    model = make_gpt(vocab_size=256)
    model.save(tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").write_text(json.dumps(ByteTokenizer().to_dict()))
    (tmp_path / "t.txt").write_text(TEXT)
    args = ["eval", "--checkpoint", str(tmp_path / "m"), "--data", str(tmp_path / "t.txt"), "--no-progress"]
    assert main([*args, "--stride", "99"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--stride 99 is larger than --context-length 16" in err
    assert main([*args, "--context-length", "8", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    ids = torch.tensor(list(TEXT.encode()))
    want = evaluate_tokens(model, ids, context_length=8)
    assert got["loss"] == pytest.approx(want.loss) and got["tokens"] == len(ids) - 1


@pytest.mark.parametrize(
    ("tokens", "kw", "match"),
    [
        ([0.5, 1.7, 2.2], {}, "1-D sequence of token ids, got torch.float64"),  # (once truncated to 0, 1, 2)
        ([[1, 2, 3], [4, 5, 6]], {}, r"of shape \(2, 3\)"),  # (once flattened and scored across the rows)
        ([1, 2, 300], {}, r"ids in \[0, 50\), got values in \[1, 300\]"),  # (once an IndexError)
        ([-1, 2, 3], {}, r"got values in \[-1, 3\]"),
        ([1, 2, 3], {"n_bytes": -5}, "n_bytes must be None or a non-negative int"),  # (once -3.17 bits a byte)
    ],
)
def test_evaluate_tokens_checks_its_input(tokens, kw, match):
    model = GPT(GPTConfig(vocab_size=50, context_length=8, emb_dim=16, n_heads=2, n_layers=1))
    with pytest.raises(ValueError, match=match):
        evaluate_tokens(model, tokens, context_length=8, **kw)
    # a token cache's uint16 array is taken as it is
    ids = np.arange(20, dtype=np.uint16) % 50
    assert (
        evaluate_tokens(model, ids, context_length=8).loss
        == evaluate_tokens(model, ids.tolist(), context_length=8).loss
    )
