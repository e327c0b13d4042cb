"""Chat: an instruct model's template, stop tokens, the history within the context window.

A tiny Llama as a Hugging Face directory, built here (transformers' LlamaForCausalLM from a small
config, a ``tokenizers`` byte-level BPE with ChatML's special tokens, a ``chat_template.jinja``,
save_pretrained): the rendering and the token ids must equal transformers' ``apply_chat_template``,
greedy answers transformers' ``generate`` with the same stop ids. Then the terminal loop (fake
stdin/stdout, a pipe through a child process, tmux), ``attnlab generate --chat``, templates that fail
or try to leave the sandbox, and ``attnlab serve``'s chat endpoint with its bad requests.
"""

from __future__ import annotations

import io
import itertools
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab.cli import main
from attnlab.generation import SamplingConfig
from attnlab.tools.chat import ChatSession, chat_loop, fit_history, prompt_ids
from attnlab.tools.loading import load_pretrained

transformers = pytest.importorskip("transformers")
hf_tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

pytestmark = pytest.mark.usefixtures("one_thread_module")

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXT = (
    "I had always thought Jack Gisburn rather a cheap genius--though a good fellow enough--so it "
    "was no great surprise to me to hear that, in the height of his glory, he had dropped his painting. "
) * 3
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONTEXT = 160


def write_tokenizer(path: Path) -> hf_tokenizers.Tokenizer:
    tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.BPE())
    tok.pre_tokenizer = hf_tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = hf_tokenizers.decoders.ByteLevel()
    trainer = hf_tokenizers.trainers.BpeTrainer(
        vocab_size=360, special_tokens=SPECIAL, initial_alphabet=hf_tokenizers.pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([TEXT], trainer)
    tok.save(str(path / "tokenizer.json"))
    return tok


def write_model_dir(path: Path, *, eos_ids: list[int] | None = None, template: str | None = CHATML) -> Path:
    """A tiny ChatML Llama directory as save_pretrained writes one; ``eos_ids``: generation_config's stops."""
    path.mkdir(parents=True, exist_ok=True)
    tok = write_tokenizer(path)
    ids = {t: tok.token_to_id(t) for t in SPECIAL}
    cfg = transformers.LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        bos_token_id=ids["<|im_start|>"],
        eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights than the init: peaked, varied next-token distributions
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p)) if "norm" in name else p.mul_(6)
    model.generation_config.eos_token_id = eos_ids if eos_ids is not None else [ids["<|im_end|>"]]
    model.save_pretrained(path)
    config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (path / "chat_template.jinja").write_text(template)
    return path


def with_files(src: Path, dst: Path, **files: str) -> Path:
    """A copy of the model directory ``src`` with some files replaced (name with '_' for '.')."""
    shutil.copytree(src, dst)
    for name, text in files.items():
        (dst / name.replace("__", ".")).write_text(text)
    return dst


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("chat") / "tiny")


@pytest.fixture(scope="module")
def hf(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return load_pretrained(str(model_dir), device="cpu")


def greedy(loaded, **kw) -> ChatSession:
    return ChatSession(loaded, sampling=SamplingConfig(temperature=0), **kw)


CONVERSATION = [
    {"role": "user", "content": "Jack Gisburn?"},
    {"role": "assistant", "content": "a cheap genius"},
    {"role": "user", "content": "héllo — the height of his glory 😀"},
]


# --------------------------------------------------------------------------------------------
# The template and the stop ids, as transformers reads them
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("system", [None, "Be brief."])
def test_rendering_and_ids_equal_apply_chat_template(loaded, hf, system):
    _, tok = hf
    messages = ([{"role": "system", "content": system}] if system else []) + CONVERSATION
    for gen in (True, False):
        want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert loaded.chat_template.render(messages, add_generation_prompt=gen) == want
        want_ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=False)
        assert prompt_ids(loaded, messages, add_generation_prompt=gen) == list(want_ids)
    assert loaded.chat_template.bos_token == "<|im_start|>" and loaded.chat_template.eos_token == "<|im_end|>"


TEMPLATES = {
    # transformers' {% generation %} tag (the assistant's text, for training on it alone)
    "generation tag": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
    "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}",
    # tools and documents are None unless given; the other special tokens by name
    "tools, documents": "{% if tools is not none %}[TOOLS]{% endif %}{% if documents is none %}[NO DOCS]{% endif %}"
    "{% if tools is defined %}[DEF]{% endif %}{{ messages[-1].content }}",
    "special tokens": "{{ unk_token }}|{{ bos_token }}|{{ messages[0].content }}{{ eos_token }}",
    # tojson's arguments (GLM's templates pass ensure_ascii=False)
    "tojson": "{{ messages[-1] | tojson(ensure_ascii=True, sort_keys=True) }}{{ messages[0] | tojson("
    "separators=(',', ':')) }}{{ messages[0] | tojson(indent=2) }}",
}


TOOL_TURN = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "w", "arguments": {"c": "P"}}}]},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": [{"type": "text", "text": "It is"}, {"type": "text", "text": " sunny."}]},
    {"role": "assistant", "content": "ok", "thinking": "brief"},
    {"role": "assistant", "content": "yes", "reasoning_content": "because"},  # (gpt-oss reads m.thinking)
    {"role": "assistant", "content": "so", "thinking": "T", "reasoning": "R"},  # (the first name wins)
]
TOOL_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}]{% if m.content is string %}{{ m.content }}{% elif m.content %}"
    "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% if m.content is not defined %}(no content)"
    "{% endif %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.thinking %}[thinking: {{ m.thinking }}]{% endif %}{% endfor %}"
)


def test_tool_calls_content_parts_and_reasoning_render_as_apply_chat_template(tmp_path, model_dir):
    """A tool call's None content (left out, as transformers leaves it), content as a list of parts and
    reasoning under its other names: once refused ("content must be a string") or dropped."""
    d = with_files(model_dir, tmp_path / "m", chat_template__jinja=TOOL_TEMPLATE)
    want = transformers.AutoTokenizer.from_pretrained(d).apply_chat_template(TOOL_TURN, tokenize=False)
    assert load_pretrained(str(d)).chat_template.render(TOOL_TURN) == want


@pytest.mark.parametrize(
    "template",
    ["{% for i in range(200000) %}x{% endfor %}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
     "{{ messages[0].content.split('') }}"],
)  # fmt: skip
def test_whatever_a_template_raises_is_one_value_error_naming_it(template):
    # (a sandbox's range limit, a recursion, a bare ValueError: once tracebacks, or lines not naming it)
    from attnlab.formats.chat import ChatTemplate

    with pytest.raises(ValueError, match="tpl failed"):
        ChatTemplate(template, name="tpl").render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loops take more"),
        ("{{ 'a' * 10**10 }}", "builds a sequence of 10,000,000,000 items"),
        ("{{ [0] * 10**8 }}", "builds a sequence"),
        ("{{ 2 ** 100000000 }}", "to the power"),
    ],
)
def test_a_template_is_stopped_before_it_runs_for_ever_or_fills_the_memory(template, match):
    # A model file's template once ran 10^10 loop steps (hours; serve kept a thread spinning per request)
    # or built a 10 GB string; jinja2's sandbox bounds each range() alone. Ordinary templates pass.
    from attnlab.formats.chat import ChatTemplate

    with pytest.raises(ValueError, match=f"tpl was stopped: .*{match}"):
        ChatTemplate(template, name="tpl").render([{"role": "user", "content": "hi"}])
    ok = "{% for i in range(1000) %}{% for j in range(900) %}{% endfor %}{% endfor %}{{ 'ab' * 1000 }}"
    assert ChatTemplate(ok).render([{"role": "user", "content": "hi"}]) == "ab" * 1000


def test_stop_ids_come_from_config_json_without_a_generation_config(tmp_path, model_dir):
    # transformers reads config.json's eos_token_id list where generation_config.json is missing.
    d = with_files(model_dir, tmp_path / "m")
    (d / "generation_config.json").unlink()
    tok = hf_tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"eos_token_id": [end, eot]}))
    assert set(load_pretrained(str(d)).stop_ids) == {end, eot}


@pytest.mark.parametrize("name", TEMPLATES)
def test_templates_render_as_apply_chat_template_does(tmp_path, model_dir, name):
    """Once refused or rendered otherwise: the {% generation %} tag did not compile (and took the whole model
    with it), tojson took indent alone, tools/documents were undefined, unk_token/pad_token were missing."""
    d = with_files(model_dir, tmp_path / "m", chat_template__jinja=TEMPLATES[name])
    tok = transformers.AutoTokenizer.from_pretrained(d)
    want = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=False)
    assert load_pretrained(str(d)).chat_template.render(CONVERSATION, add_generation_prompt=False) == want


def test_stop_ids_come_from_generation_config_and_the_tokenizer(tmp_path, model_dir):
    tok = hf_tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert load_pretrained(str(model_dir)).stop_ids == (end,)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    for eos, want in [([eot, end], (eot, end)), (eot, (eot, end)), (None, (end,)), ([], (end,))]:
        d = with_files(model_dir, tmp_path / f"g{len(list(tmp_path.iterdir()))}")
        (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": eos}))
        assert load_pretrained(str(d)).stop_ids == want, eos
    for eos in [10**9, [end, -1], "x", True, [1.5]]:  # out of the vocabulary, not ids: the file is wrong
        (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": eos}))
        with pytest.raises(ValueError, match=r"generation_config.json's eos_token_id must be a token id in \[0, "):
            load_pretrained(str(d))
    # special_tokens_map.json when tokenizer_config.json names no tokens; a template in tokenizer_config.json
    d = with_files(model_dir, tmp_path / "map", tokenizer_config__json=json.dumps({"chat_template": "{{ eos_token }}"}))
    (d / "chat_template.jinja").unlink()
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    template = load_pretrained(str(d)).chat_template
    assert template.render([{"role": "user", "content": "x"}]) == "<|endoftext|>" and template.bos_token == ""


# --------------------------------------------------------------------------------------------
# Answers: transformers' greedy generate, stopped at any stop id
# --------------------------------------------------------------------------------------------
def test_a_greedy_answer_equals_transformers_and_ends_at_a_stop_id(tmp_path, model_dir, hf):
    model, tok = hf
    ids = torch.tensor([tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_dict=False)])
    free = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    free = free[0, ids.shape[1] :].tolist()
    assert len(set(free)) > 2, free  # a varied answer: picking stops from it means something
    # Stop ids the answer first meets at token 3 or later (a token met earlier would end it sooner: an
    # empty or one-token answer compares nothing): the last such, alone, then with the first such.
    later = [i for i, t in enumerate(free) if t not in free[:i] and i >= 3]
    assert len(later) >= 2, free
    for stops in ([free[later[-1]]], [free[later[-1]], free[later[0]]]):
        d = with_files(model_dir, tmp_path / f"s{len(stops)}")
        gen = json.loads((d / "generation_config.json").read_text())
        (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": stops}))
        loaded = load_pretrained(str(d))
        first = min(free.index(s) for s in stops)
        want = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=stops, pad_token_id=0)
        want = want[0, ids.shape[1] :].tolist()
        assert want[-1] in stops and len(want) == first + 1 and first >= 3  # an answer of a few tokens
        session = greedy(loaded, max_new_tokens=12)
        session.messages = CONVERSATION[:-1]
        answer = session.ask(CONVERSATION[-1]["content"])
        pieces = list(answer)
        assert answer.prompt == ids[0].tolist()
        assert answer.ids == want[:-1] and answer.stopped  # the stop token is not part of the answer
        assert "".join(pieces) == answer.text == loaded.tokenizer.decode(want[:-1])
        assert session.messages[-1] == {"role": "assistant", "content": answer.text}
    # No stop met: max_new_tokens tokens, not stopped.
    answer = greedy(load_pretrained(str(model_dir)), max_new_tokens=5).ask(CONVERSATION[0]["content"])
    answer.read()
    assert len(answer.ids) <= 5 and (answer.stopped or len(answer.ids) == 5)


def test_several_stop_ids_end_model_generate_too(loaded):
    idx = torch.tensor([prompt_ids(loaded, CONVERSATION)])
    free = loaded.model.generate(idx, 10, temperature=0)[0, idx.shape[1] :].tolist()
    first, second = [i for i, t in enumerate(free) if t not in free[:i] and i >= 2][:2]  # two new tokens
    stops = (free[second], free[first])  # two distinct ids, the one met first listed last
    out = loaded.model.generate(idx, 10, temperature=0, eos_id=stops)[0, idx.shape[1] :].tolist()
    assert out == free[: first + 1]  # ends at the first stop met (kept); later positions are not generated
    assert list(loaded.model.stream(idx, 10, temperature=0, eos_id=list(stops))) == free[: first + 1]
    for bad in [(), (1, -1), (loaded.model.config.vocab_size,), ("a",)]:
        with pytest.raises(ValueError, match="eos_id"):
            loaded.model.generate(idx, 2, eos_id=bad)


# --------------------------------------------------------------------------------------------
# The history within the context window
# --------------------------------------------------------------------------------------------
def words(messages) -> int:
    return sum(2 + len(m["content"].split()) for m in messages)


turns = st.lists(
    st.tuples(st.integers(0, 6), st.lists(st.integers(0, 6), min_size=0, max_size=2)), min_size=0, max_size=6
)


@settings(max_examples=200, deadline=None)
@given(system=st.one_of(st.none(), st.integers(0, 4)), history=turns, last=st.integers(0, 5), budget=st.integers(0, 60))
def test_fit_history_drops_the_fewest_oldest_turns(system, history, last, budget):
    msgs = [] if system is None else [{"role": "system", "content": "s " * system}]
    for user, answers in history:  # a user message, then answers (maybe none, maybe two)
        msgs.append({"role": "user", "content": "u " * user})
        msgs += [{"role": "assistant", "content": "a " * n} for n in answers]
    msgs.append({"role": "user", "content": "new " * last})
    head = msgs[:1] if system is not None else []
    if words([*head, msgs[-1]]) > budget:
        with pytest.raises(ValueError, match="too long") as error:
            fit_history(msgs, words, budget)
        assert ("with the system message" in str(error.value)) == (system is not None)  # (only where one is)
        return
    kept, dropped = fit_history(msgs, words, budget)
    assert words(kept) <= budget and len(kept) + dropped == len(msgs)
    assert kept[: len(head)] == head and kept[-1] == msgs[-1]  # the system message and the new one stay
    rest = kept[len(head) :]
    assert rest == msgs[len(msgs) - len(rest) :] and rest[0]["role"] == "user"  # the newest, from a user turn
    # The fewest: keeping the turn dropped last would not fit.
    starts = [i for i, m in enumerate(msgs) if m["role"] == "user" and i >= len(head)]
    earlier = [i for i in starts if i < len(msgs) - len(rest)]
    if earlier:
        assert words(head + msgs[earlier[-1] :]) > budget


def test_fit_history_counts_a_long_history_a_few_times():
    # serve's /api/chat rendered and tokenized a 1,000-message history once per dropped turn: 40 s.
    calls = []

    def counted(messages) -> int:
        calls.append(len(messages))
        return words(messages)

    msgs = [{"role": r, "content": "x " * 5} for _ in range(500) for r in ("user", "assistant")]
    msgs.append({"role": "user", "content": "new"})
    kept, dropped = fit_history(msgs, counted, 100)
    assert len(calls) <= 2 + 10 and words(kept) <= 100 < words(msgs[dropped - 2 :])  # (the fewest dropped)


def test_a_long_conversation_drops_old_turns_and_says_so(loaded):
    session = greedy(loaded, system="Be brief.", max_new_tokens=6)
    out, err = io.StringIO(), io.StringIO()
    lines = iter([f"message {i}: Jack Gisburn rather a cheap genius" for i in range(12)] + ["/exit", "never read"])
    assert chat_loop(session, lambda p: next(lines), out, err, interactive=False) == 0
    assert next(lines) == "never read"  # /exit left the loop
    assert "to keep the conversation within the context window" in err.getvalue()
    assert session.messages[0] == {"role": "system", "content": "Be brief."}
    assert len(prompt_ids(loaded, session.messages)) <= CONTEXT  # the history and the last answer fit
    assert session.messages[-2]["content"].startswith("message 11")
    assert not any(m["content"].startswith("message 0") for m in session.messages)
    # A message that alone does not fit: an error (a pipe: exit status 2), the history unchanged.
    before = list(session.messages)
    with pytest.raises(ValueError, match="too long"):
        session.ask("Jack " * CONTEXT)
    assert session.messages == before
    err = io.StringIO()
    lines = iter(["Jack " * CONTEXT, "hi"])
    assert chat_loop(session, lambda p: next(lines), io.StringIO(), err, interactive=False) == 2
    assert err.getvalue().count("\n") == 1 and "the message is too long" in err.getvalue()


# --------------------------------------------------------------------------------------------
# The loop: /reset, /exit, end of input, Ctrl-C
# --------------------------------------------------------------------------------------------
def reader(lines, prompts=None):
    """A ``read_line`` giving ``lines`` one by one, then EOFError (the end of input)."""
    it = iter(lines)

    def read_line(prompt: str) -> str:
        if prompts is not None:
            prompts.append(prompt)
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read_line


def answers_of(loaded, questions, **kw) -> list[str]:
    session = greedy(loaded, **kw)
    return [session.ask(q).read() for q in questions]


def test_the_interactive_loop_resets_and_exits(loaded):
    a1, a2 = answers_of(loaded, ["Jack?", "the painting"], max_new_tokens=8)
    assert a1 and a2 and a1 != a2  # (empty or equal answers would not show which question was answered)
    session = greedy(loaded, max_new_tokens=8)
    prompts = []
    read_line = reader(["Jack?", "", "the painting", "/reset", "Jack?", "/exit", "not read"], prompts)
    out, err = io.StringIO(), io.StringIO()
    assert chat_loop(session, read_line, out, err, interactive=True) == 0
    assert out.getvalue() == f"{a1}\n\n{a2}\n\n{a1}\n\n"  # after /reset the first answer again
    assert prompts == [">>> "] * 6 and "(history cleared)" in err.getvalue()
    assert [m["role"] for m in session.messages] == ["user", "assistant"]


def test_end_of_input_and_ctrl_c_leave_cleanly(loaded):
    session = greedy(loaded, max_new_tokens=8)
    for stop in (EOFError, KeyboardInterrupt):

        def read_line(prompt, stop=stop):
            raise stop

        out = io.StringIO()
        assert chat_loop(session, read_line, out, io.StringIO(), interactive=True) == 0 and out.getvalue() == "\n"
    with pytest.raises(KeyboardInterrupt):  # through a pipe Ctrl-C ends the command (exit 130)
        chat_loop(
            session, lambda p: (_ for _ in ()).throw(KeyboardInterrupt), io.StringIO(), io.StringIO(), interactive=False
        )

    class Interrupting(io.StringIO):  # Ctrl-C while an answer streams: it stops, the conversation goes on
        def write(self, text):
            if text and text not in ("\n", "\n\n") and not getattr(self, "done", False):
                self.done = True
                raise KeyboardInterrupt
            return super().write(text)

    err, out = io.StringIO(), Interrupting()
    session = greedy(loaded, max_new_tokens=8)
    a1 = answers_of(loaded, ["Jack?"], max_new_tokens=8)[0]
    assert a1, "the first answer is empty: nothing to interrupt"
    assert chat_loop(session, reader(["Jack?", "the painting"]), out, err, interactive=True) == 0
    assert err.getvalue() == "\n(interrupted)\n"
    assert [m["role"] for m in session.messages] == ["user", "assistant"] * 2
    assert session.messages[1]["content"] != a1  # cut short: only what was said (nothing, here) stays


# --------------------------------------------------------------------------------------------
# The commands
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_chat_through_a_pipe_answers_each_line(model_dir, loaded, subprocess_env):
    questions = ["Jack Gisburn?", "and the painting?"]
    want = answers_of(loaded, questions, max_new_tokens=10)
    assert all(want), want
    cmd = [sys.executable, "-m", "attnlab", "chat", "--model", str(model_dir), "--device", "cpu"]
    cmd += ["--temperature", "0", "--max-new-tokens", "10"]
    r = subprocess.run(
        cmd, input="\n".join(questions) + "\n", capture_output=True, text=True, env=subprocess_env, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == "".join(a + "\n" for a in want) and r.stderr == ""


@pytest.mark.slow
def test_chat_in_a_terminal(model_dir, loaded, subprocess_env, tmp_path):
    """The interactive conversation in a real terminal (tmux): prompt, streamed answer, /reset, Ctrl-D."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    want = answers_of(loaded, ["Jack?"], max_new_tokens=6)[0]
    session = f"attnlab-chat-{time.time_ns()}"
    env = " ".join(f"{k}={v}" for k, v in [("PYTHONUNBUFFERED", "1"), ("OMP_NUM_THREADS", "1")])
    cmd = f"{env} {sys.executable} -m attnlab chat --model {model_dir} --device cpu --temperature 0 --max-new-tokens 6"
    status = tmp_path / "status"
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", session, "-x", "200", "-y", "50", f"{cmd}; echo $? > {status}; sleep 30"],
        check=True,
        env=subprocess_env,
    )

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    def wait_for(pred, timeout=120):
        end = time.time() + timeout
        while time.time() < end:
            if pred(screen()):
                return
            time.sleep(0.3)
        raise AssertionError(f"the terminal never showed it:\n{screen()}")

    try:
        wait_for(lambda s: s.rstrip().endswith(">>>"))
        assert "Chatting with" in screen() and "/reset clears the history" in screen()
        subprocess.run(["tmux", "send-keys", "-t", session, "Jack?", "Enter"], check=True)
        wait_for(lambda s: s.count(">>>") == 2)
        text = screen()
        shown = "".join(itertools.takewhile(str.isprintable, want))  # a random model's answer: up to a control
        assert len(shown) >= 2 and f">>> Jack?\n{shown}" in text, (text, want)
        subprocess.run(["tmux", "send-keys", "-t", session, "/reset", "Enter"], check=True)
        wait_for(lambda s: "(history cleared)" in s)
        subprocess.run(["tmux", "send-keys", "-t", session, "C-d"], check=True)
        end = time.time() + 60
        while not status.exists() and time.time() < end:
            time.sleep(0.2)
        assert status.read_text().strip() == "0"
        assert "Traceback" not in screen()
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def test_generate_chat_prints_the_answer(model_dir, loaded, hf, capsys):
    model, tok = hf
    prompt = "Jack Gisburn?"
    want = answers_of(loaded, [prompt], max_new_tokens=12)[0]
    ids = torch.tensor(
        [tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=False)]
    )
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, ids.shape[1] :].tolist()
    ref = ref[: ref.index(tok.eos_token_id)] if tok.eos_token_id in ref else ref
    assert len(ref) >= 3, ref  # a few tokens: an empty answer would equal any other empty one
    assert want == loaded.tokenizer.decode(ref)
    argv = ["generate", "--model", str(model_dir), "--chat", "--prompt", prompt, "--temperature", "0"]
    assert main([*argv, "--max-new-tokens", "12", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == want + "\n"


def one_line_error(capsys, argv, stdin, monkeypatch, match) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and match in err, err


def test_generate_chat_with_a_message_past_the_context_is_one_line(model_dir, capsys, monkeypatch):
    """The rendered template longer than the context would slide its start out unseen: refused, as chat does."""
    argv = ["generate", "--model", str(model_dir), "--chat", "--prompt", "Jack " * CONTEXT, "--device", "cpu"]
    one_line_error(capsys, argv, "", monkeypatch, f"past the model's context of {CONTEXT}: shorten it")
    # A message that fits, but not with the answer: refused too (it once ran, the template sliding out).
    argv = ["generate", "--model", str(model_dir), "--chat", "--prompt", "hi", "--device", "cpu"]
    one_line_error(capsys, [*argv, "--max-new-tokens", str(CONTEXT)], "", monkeypatch, "lower --max-new-tokens")


def test_input_the_locale_cannot_read_is_one_line(model_dir, capsys, monkeypatch):
    # Regression: the codec's own message came alone, not saying it was the input being read.
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("héllo\n".encode()), encoding="ascii"))
    assert main(["chat", "--model", str(model_dir), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot read the input as ascii" in err and "PYTHONIOENCODING" in err, err


BAD_TEMPLATES = [
    ("{{ raise_exception('only user messages, please') }}", "only user messages, please"),
    ("{{ messages[0].__class__.__mro__[1].__subclasses__() }}", "tried to leave the sandbox"),
    ("{{ ''.__class__.__base__ }}", "tried to leave the sandbox"),
    ("{% set _ = messages.append({'role': 'x'}) %}x", "tried to leave the sandbox"),
    ("{{ messages[7]['content'] + 1 }}", "failed"),
    ("{% for m in messages %}", "does not compile"),
]


@pytest.mark.parametrize(("template", "match"), BAD_TEMPLATES)
def test_a_bad_template_is_one_line_and_exit_2(tmp_path, model_dir, capsys, monkeypatch, template, match):
    d = with_files(model_dir, tmp_path / "bad", chat_template__jinja=template)
    one_line_error(capsys, ["chat", "--model", str(d), "--device", "cpu"], "hi\n", monkeypatch, match)
    argv = ["generate", "--model", str(d), "--chat", "--prompt", "hi", "--device", "cpu"]
    one_line_error(capsys, argv, "", monkeypatch, match)


@pytest.mark.parametrize(
    ("files", "match"),
    [
        ({"tokenizer_config.json": "{not json"}, "tokenizer_config.json"),
        ({"tokenizer_config.json": '{"chat_template": 7}', "chat_template.jinja": None}, "must be a string"),
        ({"generation_config.json": "["}, "generation_config.json"),
        ({"special_tokens_map.json": '{"eos_token": '}, "special_tokens_map.json"),
    ],
)
def test_corrupt_chat_files_are_one_line_and_exit_2(tmp_path, model_dir, capsys, monkeypatch, files, match):
    d = with_files(model_dir, tmp_path / "bad")
    for name, text in files.items():
        (d / name).unlink(missing_ok=True) if text is None else (d / name).write_text(text)
    one_line_error(capsys, ["chat", "--model", str(d), "--device", "cpu"], "hi\n", monkeypatch, match)


def test_a_model_without_a_template_cannot_chat(tmp_path, model_dir, capsys, monkeypatch):
    d = with_files(model_dir, tmp_path / "plain")
    (d / "chat_template.jinja").unlink()
    assert load_pretrained(str(d)).chat_template is None
    one_line_error(capsys, ["chat", "--model", str(d)], "hi\n", monkeypatch, "has no chat template")
    one_line_error(
        capsys, ["generate", "--model", str(d), "--chat", "--prompt", "x"], "", monkeypatch, "no chat template"
    )
    one_line_error(
        capsys,
        ["chat", "--model", str(model_dir), "--max-new-tokens", str(CONTEXT)],
        "",
        monkeypatch,
        "--max-new-tokens must be in [1, 160)",
    )
    one_line_error(capsys, ["chat", "--model", str(model_dir), "--top-p", "2"], "", monkeypatch, "--top-p")
    # (generate --checkpoint --chat takes a checkpoint fine-tuned from an instruct model: tests/test_finetune.py)


# --------------------------------------------------------------------------------------------
# attnlab serve: the chat endpoint
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(loaded):
    pytest.importorskip("fastapi", reason="attnlab serve needs the serve extra (pip install 'attnlab[serve]')")
    pytest.importorskip("httpx", reason="the serve tests need httpx (pip install 'attnlab[dev]')")
    from fastapi.testclient import TestClient

    from attnlab.tools.serve import Engine, Limits, create_app

    with TestClient(create_app(Engine(loaded, name="tiny", limits=Limits(max_new_tokens=40)))) as c:
        yield c


def sse(lines) -> list[tuple[str, dict]]:
    out, name = [], None
    for line in lines:
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            out.append((name, json.loads(line[5:])))
    return out


def test_serve_chat_streams_the_answer_and_opens_in_the_inspector(client, loaded):
    assert client.get("/api/info").json()["chat"] is True
    system = {"role": "system", "content": "Be brief."}
    messages = [system, *CONVERSATION]
    session = greedy(loaded, system="Be brief.", max_new_tokens=12)
    session.messages = [system, *CONVERSATION[:-1]]
    want = session.ask(CONVERSATION[-1]["content"])
    want.read()
    assert len(want.ids) >= 3, want.ids  # a few tokens to compare with the stream
    body = {"messages": messages, "max_new_tokens": 12, "temperature": 0}
    with client.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        got = sse(r.iter_lines())
    names = [n for n, _ in got]
    assert names[0] == "start" and names[-1] == "done" and set(names[1:-1]) <= {"token"}
    start, done = got[0][1], got[-1][1]
    rendered = loaded.chat_template.render(messages)
    assert start == {"prompt": rendered, "prompt_length": len(want.prompt), "dropped": 0}
    assert [d["token"] for n, d in got if n == "token"] == want.ids
    assert "".join(d["text"] for n, d in got if n == "token") == want.text == done["answer"]
    assert done["generated"] == len(want.ids) and done["reason"] == ("stop" if want.stopped else "length")
    assert done["inspect"] == rendered + want.text
    # "open in the inspector": the conversation and its answer as the inspected prompt
    r = client.post("/api/inspect", json={"prompt": done["inspect"], "sections": ["layers"]})
    assert r.status_code == 200 and r.json()["ids"] == loaded.tokenizer.encode(done["inspect"])
    # A conversation longer than the window: the oldest turns dropped, the system message kept.
    long = [system] + [{"role": r, "content": "Jack Gisburn rather a cheap genius"} for r in ["user", "assistant"] * 10]
    with client.stream("POST", "/api/chat", json={**body, "messages": long[:-1], "max_new_tokens": 30}) as r:
        start = sse(r.iter_lines())[0][1]
    assert start["dropped"] > 0 and start["prompt"].startswith("<|im_start|>system\nBe brief.")


BAD_CHATS = [
    ({"messages": []}, 422, "messages: List should have at least 1 item"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 41}, 422, "more than this server allows"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 0}, 422, "max_new_tokens"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 422, "messages.0.role"),
    ({"messages": [{"role": "user"}]}, 422, "messages.0.content: Field required"),
    ({"messages": [{"role": "user", "content": "hi", "name": "x"}]}, 422, "Extra inputs are not permitted"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, 422, "must end with the user's message"),
    ({"messages": [{"role": "user", "content": "Jack " * 200}]}, 422, "the message is too long"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 422, "temperature"),
    ({"messages": "hi"}, 422, "messages"),
]


@pytest.mark.parametrize(("body", "status", "detail"), BAD_CHATS)
def test_serve_chat_bad_requests_get_a_one_line_4xx(client, body, status, detail):
    before = client.get("/api/stats").json()["generations_started"]
    r = client.post("/api/chat", json=body)
    assert r.status_code == status and detail in r.json()["detail"] and "\n" not in r.json()["detail"], r.text
    assert client.get("/api/stats").json()["generations_started"] == before


def test_serve_chat_needs_a_template(tmp_path, model_dir):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from attnlab.tools.serve import Engine, create_app

    d = with_files(model_dir, tmp_path / "plain")
    (d / "chat_template.jinja").unlink()
    with TestClient(create_app(Engine(load_pretrained(str(d))))) as c:
        assert c.get("/api/info").json()["chat"] is False
        r = c.post("/api/chat", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 409 and "no chat template" in r.json()["detail"]
    d = with_files(model_dir, tmp_path / "escape", chat_template__jinja=BAD_TEMPLATES[1][0])
    with TestClient(create_app(Engine(load_pretrained(str(d))))) as c:
        r = c.post("/api/chat", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 422 and "tried to leave the sandbox" in r.json()["detail"]


def test_a_token_past_the_tokenizers_vocabulary_is_no_text_and_the_turn_is_kept(model_dir, monkeypatch):
    """Qwen's and Phi-3's embeddings have rows past their tokenizers' ids (padding): a sampled one ended
    the chat with "ids must lie in [0, V)" and lost the turn; it is no text, as transformers decodes it."""
    loaded = load_pretrained(str(model_dir))
    V, end = loaded.tokenizer.vocab_size, loaded.stop_ids[0]
    word = loaded.tokenizer.encode(" genius")

    def stream(idx, max_new_tokens, **kw):  # the model's choices: a word, a padding row, the turn's end
        yield from (torch.tensor([t]) for t in [*word, V + 3, end])

    monkeypatch.setattr(loaded.model, "stream", stream)
    session = greedy(loaded, max_new_tokens=12)
    answer = session.ask("hi")
    assert "".join(answer) == " genius" and answer.stopped and V + 3 not in answer.ids
    assert session.messages[-1] == {"role": "assistant", "content": " genius"}
