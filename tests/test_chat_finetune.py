"""Chat fine-tuning: the loss mask is the assistant's tokens, as the chat template's prefixes say."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attnlab import GPT, GPTConfig
from attnlab.cli import main
from attnlab.formats.chat import ChatTemplate
from attnlab.tokenizers import ByteTokenizer
from attnlab.training.chat_data import (
    MaskedWindowBatches,
    encode_conversation,
    encode_conversations,
    read_conversations,
)
from attnlab.training.config import TrainConfig
from attnlab.training.trainer import Trainer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "chat_example.jsonl"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is attention?"},
    {"role": "assistant", "content": "A weighted average."},
    {"role": "user", "content": "Of what?"},
    {"role": "assistant", "content": "Of value vectors."},
]


def check_mask_against_prefixes(template: ChatTemplate, tok, messages) -> None:
    """The masked tokens decode to exactly the text each assistant turn adds to the rendering of the
    conversation before it (with the generation prompt), and the rest to everything else."""
    ids, mask = encode_conversation(template, tok, messages)
    assert tok.decode(ids) == template.render(messages, add_generation_prompt=False)
    spans, current, in_span = [], [], False
    for t, m in zip(ids, mask, strict=True):
        if m:
            current.append(t)
        elif current:
            spans.append(tok.decode(current))
            current = []
        in_span = m
    if current or in_span:
        spans.append(tok.decode(current))
    want = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            before = template.render(messages[:i], add_generation_prompt=True)
            through = template.render(messages[: i + 1], add_generation_prompt=False)
            answer = through[len(before) :]
            end = answer.rfind("<|im_end|>") + len("<|im_end|>")  # (the newline after it is the template's)
            want.append(answer[:end] if end >= len("<|im_end|>") and not answer[end:].strip() else answer)
    assert spans == want
    for s, m in zip(spans, [m for m in messages if m["role"] == "assistant"], strict=True):
        assert m["content"] in s  # the answer itself is trained on


def test_the_mask_is_the_assistants_tokens_chatml_bytes() -> None:
    template = ChatTemplate(CHATML)
    check_mask_against_prefixes(template, ByteTokenizer(), CONVERSATION)
    ids, mask = encode_conversation(template, ByteTokenizer(), CONVERSATION)
    text = bytes(t for t, m in zip(ids, mask, strict=True) if m).decode()
    assert text == "A weighted average.<|im_end|>Of value vectors.<|im_end|>"


@pytest.mark.slow
def test_the_mask_is_the_assistants_tokens_with_smollm2s_template(smollm2_hf_dir) -> None:
    from attnlab.tokenizers import HFTokenizer
    from attnlab.training.chat_data import template_from_hf_dir

    template, tok = template_from_hf_dir(smollm2_hf_dir), HFTokenizer(smollm2_hf_dir)
    assert template is not None
    for messages in [CONVERSATION, CONVERSATION[1:], *read_conversations(EXAMPLE)[:3]]:
        check_mask_against_prefixes(template, tok, messages)
    # the end-of-turn token is the assistant's: the model learns to stop
    ids, mask = encode_conversation(template, tok, CONVERSATION)
    im_end = tok._tok.token_to_id("<|im_end|>")
    ends = [m for t, m in zip(ids, mask, strict=True) if t == im_end]
    assert ends.count(True) == 2 and ends.count(False) == 3


def test_windows_score_only_assistant_tokens_and_always_some() -> None:
    template = ChatTemplate(CHATML)
    ids, mask = encode_conversations(template, ByteTokenizer(), [CONVERSATION] * 4)
    batches = MaskedWindowBatches(ids, mask, batch_size=16, context_length=24, seed=0)
    for step in range(5):
        starts = batches.global_starts(step)
        x, y = batches.batch(step)
        for row, s in enumerate(starts):
            targets = ids[s + 1 : s + 25]
            keep = mask[s + 1 : s + 25]
            assert torch.equal(x[row], torch.from_numpy(ids[s : s + 24]))
            assert torch.equal(y[row], torch.from_numpy(np.where(keep, targets, -100)))
            assert keep.any()
    assert torch.equal(batches.batch(3)[1], batches.batch(3)[1])  # a pure function of (seed, step)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"text": "hi"}', 'has no "messages" list'),
        (
            '{"messages": [{"role": "wizard", "content": "x"}]}',
            "role 'wizard'; expected one of system, user, assistant",
        ),
        ('{"messages": [{"role": "user", "content": "x"}]}', "has no assistant message"),
        ("not json", "is not a JSON object"),
    ],
)
def test_bad_chat_lines_are_one_line_naming_the_line(tmp_path, capsys, line, message) -> None:
    data = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": CONVERSATION})
    data.write_text(f"{good}\n{line}\n")
    base = tmp_path / "base"
    GPT(GPTConfig(vocab_size=256, context_length=32, emb_dim=16, n_heads=2, n_layers=1)).save(base)
    (base / "tokenizer.json").write_text(json.dumps(ByteTokenizer().to_dict()))
    (base / "chat_template.jinja").write_text(CHATML)  # what an instruct model's directory has
    with pytest.raises(ValueError, match=r"chat\.jsonl:2"):
        read_conversations(data)
    code = main(
        ["train", "--init-from", str(base), "--data", str(data), "--out", str(tmp_path / "o"), "--max-steps", "1"]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err and "chat.jsonl:2" in err, err


def test_chat_training_on_the_example_data(tmp_path) -> None:
    """A small model fine-tuned on the example conversations (byte tokens, ChatML): the loss counts the
    assistant's tokens only, and the checkpoint records the template so the run resumes the same."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, context_length=128, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0,
                          pos="rope", norm="rmsnorm", mlp="swiglu", bias=False))  # fmt: skip
    init = SimpleNamespace(model=model, tokenizer=ByteTokenizer(), chat_template=ChatTemplate(CHATML))
    cfg = TrainConfig(init_from="tiny-chat", data=str(EXAMPLE), out=str(tmp_path / "run"), max_steps=4,
                      batch_size=4, context_length=64, eval_every=2, eval_batches=1, checkpoint_every=2,
                      sample_tokens=0, progress=False, device="cpu", precision="fp32", optimizer="adamw",
                      lr=3e-3, warmup_steps=1)  # fmt: skip
    trainer = Trainer(cfg, init=init)
    try:
        # every validation batch's loss is a mean over the assistant's targets alone
        _, y = trainer.val_batches.batch(0)
        assert (y == -100).any() and (y != -100).any()
        result = trainer.fit(sample=False)
    finally:
        trainer.close()
    assert result.step == 4 and result.history[-1]["loss"] < result.history[0]["loss"]
    meta = json.loads((result.checkpoint / "checkpoint.json").read_text())
    assert meta["chat_template"]["source"] == CHATML
    # resumed without the init object: the template comes from the checkpoint
    resumed = Trainer(TrainConfig(out=str(tmp_path / "run"), resume=True, max_steps=5, device="cpu", progress=False))
    try:
        assert resumed.chat_template.source == CHATML and resumed.fit(sample=False).step == 5
    finally:
        resumed.close()


def test_without_context_length_a_short_chat_file_trains_on_windows_that_fit(tmp_path, capsys) -> None:
    """docs/training.md's command on a small file: the default windows (256 tokens) are longer than
    the validation split, so the run trains on the longest power of two that fits and says so; a
    --context-length the user gave is kept, and refused with the one-line error."""
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CONVERSATION}) + "\n" for _ in range(10)))
    base = tmp_path / "base"
    GPT(GPTConfig(vocab_size=256, context_length=512, emb_dim=16, n_heads=2, n_layers=1, pos="rope")).save(base)
    (base / "tokenizer.json").write_text(json.dumps(ByteTokenizer().to_dict()))
    (base / "chat_template.jinja").write_text(CHATML)
    common = ["train", "--init-from", str(base), "--data", str(data), "--max-steps", "1", "--batch-size", "2",
              "--sample-tokens", "0", "--no-progress", "--device", "cpu"]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert "note: the validation split has" in err and "training on windows of 128 tokens" in err, err
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step-00000001" / "checkpoint.json").read_text())
    assert meta["train_config"]["context_length"] == 128
    assert main([*common, "--out", str(tmp_path / "given"), "--context-length", "256"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--context-length" in err and "fewer than context length + 1 = 257" in err, err


def _chat_trainer(tmp_path: Path, model: GPT, name: str, **kw) -> Trainer:
    init = SimpleNamespace(model=model, tokenizer=ByteTokenizer(), chat_template=ChatTemplate(CHATML))
    cfg = TrainConfig(init_from="tiny-chat", data=str(EXAMPLE), out=str(tmp_path / name), max_steps=2,
                      batch_size=4, context_length=64, eval_every=100, eval_batches=2, checkpoint_every=100,
                      sample_tokens=0, progress=False, device="cpu", precision="fp32", optimizer="adamw",
                      lr=3e-3, warmup_steps=0, grad_clip=0.0, **kw)  # fmt: skip
    return Trainer(cfg, init=init)


def _chat_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, context_length=128, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0,
                         pos="rope", norm="rmsnorm", mlp="swiglu", bias=False))  # fmt: skip


def _token_sum(model: GPT, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")


def test_chat_loss_and_gradients_do_not_depend_on_grad_accum(tmp_path) -> None:
    """The objective is the mean over every assistant token of the global batch, whatever the number of
    micro-batches: with micro-batches holding different numbers of counted tokens, grad_accum=1 and 2 give
    the loss and gradients of that mean computed on the whole batch at once, and evaluate() is the
    token-weighted mean of the validation batches."""
    model = _chat_model()
    reference = copy.deepcopy(model)
    results = {}
    for k in (1, 2):
        trainer = _chat_trainer(tmp_path, copy.deepcopy(model), f"ga{k}", grad_accum=k)
        try:
            micro = [trainer.train_batches.batch(0, m) for m in range(k)]
            grads = {}

            def capture(_grads=grads, _model=trainer.raw_model):
                _grads.update({n: p.grad.clone() for n, p in _model.named_parameters()})

            trainer.optimizer.register_step_pre_hook(lambda *_a, _c=capture: _c())
            val = [trainer.val_batches.batch(i, m) for i in range(2) for m in range(k)]
            val_loss = trainer.evaluate()
            loss, _, grad_norm = trainer._train_step()
        finally:
            trainer.close()
        results[k] = dict(micro=micro, grads=grads, loss=loss, grad_norm=grad_norm, val=val, val_loss=val_loss)
    x = torch.cat([b[0] for b in results[2]["micro"]])
    y = torch.cat([b[1] for b in results[2]["micro"]])
    assert torch.equal(x, results[1]["micro"][0][0]) and torch.equal(y, results[1]["micro"][0][1])
    counts = [int((b[1] != -100).sum()) for b in results[2]["micro"]]
    assert counts[0] != counts[1], counts  # otherwise a mean per micro-batch would be right by accident
    # the reference: the sum over the whole batch's counted tokens over their number, in float64
    ref = reference.double()
    ref_loss = _token_sum(ref, x, y) / (y != -100).sum()
    ref_loss.backward()
    for k in (1, 2):
        assert results[k]["loss"] == pytest.approx(ref_loss.item(), abs=1e-6), k
        for n, p in ref.named_parameters():
            torch.testing.assert_close(results[k]["grads"][n].double(), p.grad, rtol=1e-4, atol=1e-7, msg=n)
    assert results[2]["grad_norm"] == pytest.approx(results[1]["grad_norm"], rel=1e-5)
    # evaluate(): every validation token weighs the same, whatever batch it falls in
    with torch.no_grad():
        for k in (1, 2):
            total = sum(_token_sum(ref, vx, vy) for vx, vy in results[k]["val"])
            n = sum(int((vy != -100).sum()) for _, vy in results[k]["val"])
            assert results[k]["val_loss"] == pytest.approx(total.item() / n, abs=1e-6), k
    assert results[2]["val_loss"] == pytest.approx(results[1]["val_loss"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(), reason="Gloo")
def test_chat_loss_and_gradients_do_not_depend_on_the_number_of_processes(tmp_path) -> None:
    """2 processes (DDP over Gloo), whose shares of the batch count different numbers of assistant tokens,
    give the loss, gradients and validation loss of 1 process with the same global batch."""
    trainer = _chat_trainer(tmp_path, _chat_model(), "one")
    try:
        _, y = trainer.train_batches.batch(0)
        assert int((y[:2] != -100).sum()) != int((y[2:] != -100).sum())  # the two processes' shares
        grads = {}
        trainer.optimizer.register_step_pre_hook(
            lambda *_a: grads.update({n: p.grad.clone() for n, p in trainer.raw_model.named_parameters()})
        )
        val_loss = trainer.evaluate()
        loss, _, grad_norm = trainer._train_step()
    finally:
        trainer.close()
    out = tmp_path / "ddp" / "result.pt"
    out.parent.mkdir()
    here = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(here / "chat_ddp_step.py"), str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    two = torch.load(out)
    assert two["loss"] == pytest.approx(loss, abs=1e-6)
    assert two["val_loss"] == pytest.approx(val_loss, abs=1e-6)
    assert two["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    for n, g in grads.items():
        torch.testing.assert_close(two["grads"][n], g, rtol=1e-4, atol=1e-7, msg=n)


@pytest.mark.slow
def test_the_mask_is_transformers_assistant_mask_on_smollm2s_template(smollm2_gguf) -> None:
    # transformers' return_assistant_tokens_mask, on SmolLM2's template with {% generation %} around each
    # answer and its <|im_end|> (the newline after it is the template's separator, not the model's to learn).
    from transformers import PreTrainedTokenizerFast

    from attnlab.tools.loading import load_pretrained

    loaded = load_pretrained(str(smollm2_gguf))
    source = loaded.chat_template.source
    turn = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    assert turn in source
    marked = source.replace(
        turn,
        "{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant\\n'}}{% generation %}"
        "{{message['content'] + '<|im_end|>'}}{% endgeneration %}{{'\\n'}}{% else %}" + turn + "{% endif %}",
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=loaded.tokenizer._tok, eos_token="<|im_end|>")
    user, assistant = ({"role": r, "content": c} for r, c in (("user", "What is a key?"), ("assistant", "4")))
    # (an answer that starts with whitespace: its first newline and the template's make one token of the
    # whole render, which the pieces tokenized apart had split)
    spaced = [[user, {**assistant, "content": c}] for c in ("\n\nSure", " Sure", "\n")]
    for messages in [CONVERSATION, [user, assistant], [user, {**assistant, "content": ""}, user, assistant], *spaced]:
        ids, mask = encode_conversation(loaded.chat_template, loaded.tokenizer, messages)
        ref = hf.apply_chat_template(
            messages, chat_template=marked, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids == ref["input_ids"]
        assert mask == [bool(m) for m in ref["assistant_masks"]]


def test_a_template_that_ends_a_conversation_with_its_eos_trains_on_every_turn() -> None:
    # Phi-3's templates write eos_token after the last turn (without a generation prompt): a second
    # answer was refused ("does not render a conversation prefix by prefix"), and a last one trained
    # on the separator and that end-of-text after its <|end|>.
    template = ChatTemplate(
        "{% for m in messages %}{{ '<|' + m.role + '|>\n' + m.content + '<|end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}",
        eos_token="<|endoftext|>",
    )
    turns = [("user", "hi"), ("assistant", "hello"), ("user", "bye"), ("assistant", "ciao")]
    messages = [{"role": r, "content": c} for r, c in turns]
    ids, mask = encode_conversation(template, ByteTokenizer(), messages)
    assert bytes(ids).decode() == template.render(messages, add_generation_prompt=False)
    assert bytes(t for t, m in zip(ids, mask, strict=True) if m).decode() == "hello<|end|>ciao<|end|>"


def test_a_conversation_may_open_with_the_assistant() -> None:
    # SmolLM2's template adds its default system prompt only to a conversation with messages, so the
    # render of no messages is not where the first answer starts: the answer is found by its content.
    template = ChatTemplate(
        "{% for m in messages %}{% if loop.first and m.role != 'system' %}<|im_start|>system\nBe kind.<|im_end|>\n"
        "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    messages = [{"role": "assistant", "content": "Hello."}, *CONVERSATION[1:3]]
    check_mask_against_prefixes_by_content(template, messages)


def check_mask_against_prefixes_by_content(template: ChatTemplate, messages) -> None:
    ids, mask = encode_conversation(template, ByteTokenizer(), messages)
    assert bytes(ids).decode() == template.render(messages, add_generation_prompt=False)
    text = bytes(t for t, m in zip(ids, mask, strict=True) if m).decode()
    assert text == "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")


def test_a_template_that_hides_the_answer_is_refused_naming_the_conversation() -> None:
    template = ChatTemplate(
        "{{ messages | length }}{% for m in messages %}|{{ m.role }}: {{ m.content | upper }}{% endfor %}"
    )
    with pytest.raises(ValueError, match=r"conversation 2: .*does not render a conversation prefix by prefix"):
        encode_conversations(template, ByteTokenizer(), [CONVERSATION[1:2], CONVERSATION[1:3]])
