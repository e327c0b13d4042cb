"""answer_ranks: TransformerLens's utils.test_prompt as numbers, against a float64 loop over the logits."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.interpret import AnswerRank, answer_ranks


def reference(model, prompt, answer, top_k):
    """Each answer token's rank, logit, probability and top-k, one float64 forward per answer token
    (the prompt and the answer's tokens before it), by sorting every logit and summing exp by hand."""
    model = model.double()
    rows = []
    for i, token in enumerate(answer):
        idx = torch.tensor([prompt + answer[:i]])
        logits = model(idx)[0, -1].tolist()  # the next token's
        order = sorted(range(len(logits)), key=lambda t: -logits[t])
        total = sum(math.exp(v - max(logits)) for v in logits)
        prob = [math.exp(v - max(logits)) / total for v in logits]
        rank = sum(v > logits[token] for v in logits)
        rows.append((rank, logits[token], prob[token], [(t, logits[t], prob[t]) for t in order[:top_k]]))
    return rows


@pytest.mark.parametrize("top_k", [1, 5, 100])
def test_each_answer_token_against_a_float64_loop(make_gpt, top_k):
    model = make_gpt().double()
    prompt, answer = [3, 14, 15, 9, 2], [6, 5, 35]
    got = answer_ranks(model, torch.tensor(prompt), torch.tensor([answer]), top_k=top_k)
    want = reference(model, prompt, answer, top_k)
    assert [r.token for r in got] == answer and [r.position for r in got] == [4, 5, 6]
    for row, (rank, logit, prob, top) in zip(got, want, strict=True):
        assert row.rank == rank
        assert row.logit == pytest.approx(logit, abs=1e-9) and row.probability == pytest.approx(prob, abs=1e-9)
        assert len(row.top) == min(top_k, 37)
        assert [t for t, _, _ in row.top] == [t for t, _, _ in top]
        assert [x for _, v, p in row.top for x in (v, p)] == pytest.approx(
            [x for _, v, p in top for x in (v, p)], abs=1e-9
        )


def test_the_first_choice_has_rank_zero_and_heads_its_top(make_gpt):
    model = make_gpt()
    prompt = torch.tensor([1, 2, 3, 4])
    best = int(model(prompt[None])[0, -1].argmax())
    (row,) = answer_ranks(model, prompt, torch.tensor([best]), top_k=3)
    assert row.rank == 0 and row.top[0][0] == best and row.top[0][2] == pytest.approx(row.probability)


def test_a_model_in_training_mode_is_ranked_without_dropout_and_stays_training(make_gpt):
    model = make_gpt(drop_rate=0.5).train()
    prompt, answer = torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6])
    got = answer_ranks(model, prompt, answer)
    assert model.training
    assert got == answer_ranks(model.eval(), prompt, answer)


def test_lists_of_ids_as_tokenizer_encode_gives_them(make_gpt):
    # The guide passes tokenizer.encode's lists; they were refused as "not token ids of one sequence".
    model = make_gpt()
    assert answer_ranks(model, [1, 2, 3, 4], [5, 6]) == answer_ranks(
        model, torch.tensor([1, 2, 3, 4]), torch.tensor([5, 6])
    )


def test_describe_prints_transformerlens_lines():
    row = AnswerRank(token=7, position=3, rank=2, logit=1.5, probability=0.25, top=((4, 2.0, 0.5), (7, 1.5, 0.25)))
    lines = row.describe(lambda t: f" tok{t}").splitlines()
    assert lines[0].split() == ["Rank:", "2", "Logit:", "1.50", "Prob:", "25.00%", "Token:", "|", "tok7|"]
    assert lines[1] == "Top 0th token. Logit:  2.00 Prob: 50.00% Token: | tok4|"
    assert len(lines) == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(answer=torch.tensor([], dtype=torch.long)), ValueError, "answer must hold at least one token"),
        (dict(prompt=[1, "a"]), ValueError, "prompt must be the token ids of one sequence"),
        (dict(answer=torch.ones(2, 2, dtype=torch.long)), ValueError, r"answer .* got shape \(2, 2\)"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(prompt=torch.tensor([1.0, 2.0])), TypeError, "idx must hold integer token ids"),
        (dict(answer=torch.arange(20) % 37), ValueError, "context"),
    ],
)
def test_bad_input_is_named(make_gpt, kwargs, error, message):
    args = dict(prompt=torch.tensor([1, 2, 3]), answer=torch.tensor([4]), top_k=5) | kwargs
    with pytest.raises(error, match=message):
        answer_ranks(make_gpt(), args["prompt"], args["answer"], top_k=args["top_k"])
