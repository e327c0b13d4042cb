"""Chat with an instruct model: its own template, a history kept within the context window, answers streamed.

An instruct model answers well only in the conversation format it was fine-tuned on. So every turn
the whole conversation is rendered with the model's chat template (:attr:`LoadedModel.chat_template
<attnlab.tools.loading.LoadedModel>`), the assistant's turn opened, and continued until one of the
model's stop ids (:attr:`LoadedModel.stop_ids`) or ``max_new_tokens``::

    session = ChatSession(load_pretrained("SmolLM2-dir"), sampling=SamplingConfig(temperature=0))
    answer = session.ask("What is the capital of France?")
    for piece in answer:  # text as it comes (whole characters)
        print(piece, end="", flush=True)
    session.messages  # [..., {"role": "user", ...}, {"role": "assistant", "content": answer.text}]

The window. The rendered conversation plus ``max_new_tokens`` must fit the model's context: when it
does not, the oldest turns are dropped (:func:`fit_history`; :attr:`Answer.dropped` says how many
messages went). Each turn is re-encoded from scratch: simple, and the prefill is a small part of a turn.

:func:`chat_loop` is the terminal conversation of ``attnlab chat``: a prompt and streamed answers on
a terminal, one answer per input line through a pipe, ``/reset`` and ``/exit``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import IO, Any

import torch

from attnlab.errors import UserError
from attnlab.files import safe_write
from attnlab.formats.chat import ChatTemplate
from attnlab.generation import SamplingConfig
from attnlab.tokenizers import StreamDecoder
from attnlab.tools.loading import LoadedModel

__all__ = ["Answer", "ChatSession", "chat_loop", "chat_template_of", "fit_history", "prompt_ids"]

Message = dict[str, Any]


def chat_template_of(loaded: LoadedModel, what: str = "the model") -> ChatTemplate:
    """The model's chat template, or a :class:`~attnlab.errors.UserError` saying it has none."""
    if loaded.chat_template is None:
        raise UserError(
            f"{what} has no chat template (chat_template.jinja, tokenizer_config.json's chat_template or the "
            "GGUF's tokenizer.chat_template): it is not an instruct model; continue a text instead (attnlab generate, "
            "without --chat)"
        )
    return loaded.chat_template


def prompt_ids(loaded: LoadedModel, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
    """The token ids of ``messages`` rendered with the model's template (what transformers'
    ``apply_chat_template(messages, add_generation_prompt=True)`` gives: the template writes any
    beginning-of-text token itself, so none is added)."""
    text = chat_template_of(loaded).render(messages, add_generation_prompt=add_generation_prompt)
    return loaded.tokenizer.encode(text)


def fit_history(
    messages: Sequence[Message], count: Callable[[list[Message]], int], budget: int
) -> tuple[list[Message], int]:
    """Drop the oldest turns of ``messages`` until ``count(kept) <= budget``; returns ``(kept, dropped)``.

    Leading system messages are always kept, and so is the last message (the new one). A turn is a
    user message and whatever follows it up to the next user message, so the kept conversation
    still starts with the user (templates insist). ``dropped`` counts the messages removed. A
    ValueError when even the system messages and the last message alone exceed ``budget``.
    """
    messages = list(messages)
    if not messages:
        raise ValueError("messages must hold at least the new message")
    head = 0
    while head < len(messages) - 1 and messages[head].get("role") == "system":
        head += 1
    system, rest = messages[:head], messages[head:]
    cuts = [0]  # where the kept messages may start: each turn's user message, and the last message
    while cuts[-1] < len(rest) - 1:
        cut = cuts[-1] + 1
        while cut < len(rest) - 1 and rest[cut].get("role") != "user":
            cut += 1
        cuts.append(cut)
    if count(system + rest) <= budget:
        return system + rest, 0
    if (n := count(system + rest[cuts[-1] :])) > budget:
        with_system = "with the system message " if system else ""
        raise ValueError(
            f"the message is too long: {with_system}it takes {n} tokens, more than the {budget} "
            "the context window leaves beside the answer; shorten it (or lower --max-new-tokens)"
        )
    # The fewest turns dropped that fit, by bisection: fewer messages never take more tokens (one count a
    # dropped turn rendered and tokenized a long history a thousand times).
    lo, hi = 1, len(cuts) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if count(system + rest[cuts[mid] :]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return system + rest[cuts[lo] :], cuts[lo]


@dataclasses.dataclass
class Answer:
    """One answer as it streams: iterate for text pieces; afterwards :attr:`text` and :attr:`ids`.

    The turn (the user's message and this answer) joins the session's history when the iteration
    ends, also when it is cut short (Ctrl-C, ``close()``): the history holds what was said."""

    session: ChatSession
    user: Message
    kept: list[Message]  # the history it was answered in (after dropping old turns)
    dropped: int  # messages dropped to fit the context window
    prompt: list[int]  # the rendered conversation's token ids
    ids: list[int] = dataclasses.field(default_factory=list)  # the answer's tokens, without the stop token
    text: str = ""
    stopped: bool = False  # ended by a stop token (not by max_new_tokens or an interruption)
    done: bool = False

    def __iter__(self) -> Iterator[str]:
        if self.done:
            raise RuntimeError("an Answer streams once")
        s = self.session
        model, tok = s.loaded.model, s.loaded.tokenizer
        stop = set(s.stop_ids)
        dec = StreamDecoder(tok)
        idx = torch.tensor([self.prompt], dtype=torch.long, device=model.device)  # (1, P)
        settings = dataclasses.asdict(s.sampling) | {"eos_id": s.stop_ids or None}
        tokens = model.stream(idx, s.max_new_tokens, **settings, use_cache=s.use_cache, generator=s.generator)
        try:
            for token in tokens:  # (1,)
                t = int(token[0])
                if t in stop:
                    self.stopped = True
                    break
                if t >= tok.vocab_size:  # a padding row of the embedding (Qwen's, Phi-3's): no text, as transformers
                    continue
                self.ids.append(t)
                if piece := dec.push(t):
                    yield piece
            if rest := dec.flush():
                yield rest
        finally:
            tokens.close()
            self.done = True
            self.text = tok.decode(self.ids)
            s.messages = [*self.kept[:-1], self.user, {"role": "assistant", "content": self.text}]

    def read(self) -> str:
        """The whole answer (streams it to the end)."""
        for _ in self:
            pass
        return self.text


class ChatSession:
    """A conversation with ``loaded`` (which must carry a chat template).

    ``system``: a system message kept at the start of the history (None: the template's default);
    ``sampling``'s ``eos_id`` is ignored (the model's stop ids are used); ``max_new_tokens``: the
    longest answer, the history kept within the rest of the context; ``seed``: seeds the sampling
    generator (again at :meth:`reset`; None: torch's global one).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        system: str | None = None,
        sampling: SamplingConfig | None = None,
        max_new_tokens: int = 512,
        seed: int | None = None,
        use_cache: bool = True,
        what: str = "the model",
    ) -> None:
        self.template = chat_template_of(loaded, what)
        self.loaded = loaded
        ctx = loaded.model.config.context_length
        if not isinstance(max_new_tokens, int) or not 1 <= max_new_tokens < ctx:
            raise ValueError(
                f"max_new_tokens must be in [1, {ctx}) (the context window holds the history and the answer), "
                f"got {max_new_tokens!r}"
            )
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a string or None, got {type(system).__name__}")
        self.system = system
        self.sampling = dataclasses.replace(sampling or SamplingConfig(), eos_id=None)
        self.stop_ids = tuple(loaded.stop_ids)
        self.max_new_tokens, self.seed, self.use_cache = max_new_tokens, seed, use_cache
        self.budget = ctx - max_new_tokens  # prompt tokens a turn may take
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and re-seed the sampling."""
        self.messages: list[Message] = [] if self.system is None else [{"role": "system", "content": self.system}]
        device = self.loaded.model.device
        self.generator = None if self.seed is None else torch.Generator(device=device).manual_seed(self.seed)

    def ask(self, text: str) -> Answer:
        """Add the user's message ``text`` and return the :class:`Answer` to stream (the history is
        first cut to fit the context window: :attr:`Answer.dropped`)."""
        if not isinstance(text, str):
            raise TypeError(f"the message must be a string, got {type(text).__name__}")
        user = {"role": "user", "content": text}
        encoded: dict[int, list[int]] = {}

        def count(messages: list[Message]) -> int:
            encoded[len(messages)] = prompt_ids(self.loaded, messages)
            return len(encoded[len(messages)])

        kept, dropped = fit_history([*self.messages, user], count, self.budget)
        return Answer(self, user, kept, dropped, encoded[len(kept)])


# -- The terminal conversation -------------------------------------------------------------------
HELP = "/reset clears the history, /exit (or Ctrl-D) leaves; Ctrl-C stops an answer"


def chat_loop(
    session: ChatSession, read_line: Callable[[str], str], out: IO[str], err: IO[str], *, interactive: bool
) -> int:
    """The conversation of ``attnlab chat``; returns the exit status.

    ``read_line(prompt)`` returns one line of input without its newline (``input`` on a terminal)
    and raises EOFError at the end. ``interactive``: a prompt is shown, answers stream to ``out``
    followed by a blank line, Ctrl-C stops an answer (or, at the prompt, leaves), a message that
    fails is reported and the conversation goes on. Otherwise (a pipe): each line is one message and
    its answer one paragraph on ``out`` (then a newline); the first failing message ends the loop
    with status 2. Notices (turns dropped, history cleared) go to ``err``.
    """

    def note(text: str) -> None:
        err.write(text + "\n")
        err.flush()

    while True:
        try:
            line = read_line(">>> " if interactive else "")
        except (EOFError, KeyboardInterrupt) as exc:
            if not interactive and isinstance(exc, KeyboardInterrupt):
                raise
            if interactive:
                out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/reset":
            session.reset()
            note("(history cleared)")
            continue
        if text in ("/help", "/?"):
            note(HELP)
            continue
        try:
            answer = session.ask(line)
        except ValueError as exc:
            note(f"attnlab chat: error: {exc}")
            if interactive:
                continue
            return 2
        if answer.dropped:
            s = "s" if answer.dropped != 1 else ""
            note(f"(dropped the {answer.dropped} oldest message{s} to keep the conversation within the context window)")
        pieces = iter(answer)
        try:
            for piece in pieces:
                safe_write(out, piece)
                out.flush()
        except KeyboardInterrupt:
            if not interactive:
                raise
            pieces.close()
            note("\n(interrupted)")
        out.write("\n\n" if interactive else "\n")
        out.flush()
