"""The chat box of ``attnlab serve``: one assistant turn, streamed a token at a time.

The page keeps the conversation and sends it whole with each new message (``POST /api/chat``); the
server renders it with the model's chat template (:mod:`attnlab.tools.chat`: the oldest turns
dropped to fit the context window, the system message kept), then streams the answer as the
generation stream does: one model call per token on the engine's model thread, other requests in
between, a client that leaves stops it (:meth:`Engine.finish <attnlab.tools.serve.engine.Engine.finish>`).
The answer ends at the model's end-of-turn / end-of-text token. What the inspector then opens is the
rendered conversation and the answer (:attr:`ChatRun.inspect_text`): the exact text the model read
and wrote, so its next-token view after the last token shows the end-of-turn the model was about to emit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from attnlab.errors import UserError
from attnlab.generation import SamplingConfig, stream
from attnlab.tokenizers import StreamDecoder
from attnlab.tools.chat import fit_history, prompt_ids
from attnlab.tools.serve.engine import Engine, GenerationRun

__all__ = ["ChatRun", "NoChatTemplate", "advance_chat", "start_chat"]


class NoChatTemplate(UserError):
    """A chat request to a server whose model has no chat template (not an instruct model)."""


@dataclasses.dataclass
class ChatRun(GenerationRun):
    """One assistant turn: the tokens of :class:`GenerationRun`, and the text around them."""

    prompt_text: str = ""  # the rendered conversation (with the assistant's turn opened)
    dropped: int = 0  # messages dropped from the start to fit the context window
    stop_ids: frozenset[int] = frozenset()
    decoder: Any = None  # a StreamDecoder of the answer
    answer_ids: list[int] = dataclasses.field(default_factory=list)

    @property
    def answer(self) -> str:
        return self.decoder.tok.decode(self.answer_ids)

    @property
    def inspect_text(self) -> str:
        """The conversation the model read and the answer it wrote: the inspector's prompt."""
        return self.prompt_text + self.answer


def start_chat(
    engine: Engine,
    messages: Sequence[dict[str, Any]],
    max_new_tokens: int | None,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
) -> ChatRun:
    """The assistant's answer to ``messages`` (the last one the user's), ready to :func:`advance_chat`."""
    loaded = engine.loaded
    if loaded is None or loaded.chat_template is None:
        raise NoChatTemplate(
            "this server's model has no chat template (it is not an instruct model): the chat box needs one"
        )
    if max_new_tokens is None:
        max_new_tokens = min(engine.limits.max_new_tokens, loaded.model.config.context_length // 2)
    engine.check_new_tokens(max_new_tokens)
    if not messages or messages[-1].get("role") != "user":
        raise ValueError("messages must end with the user's message (the one to answer)")
    ctx = loaded.model.config.context_length
    if max_new_tokens >= ctx:
        raise ValueError(f"max_new_tokens must be less than the model's context window ({ctx})")
    encoded: dict[int, list[int]] = {}

    def count(kept: list[dict[str, Any]]) -> int:
        encoded[len(kept)] = prompt_ids(loaded, kept)
        return len(encoded[len(kept)])

    kept, dropped = fit_history(messages, count, ctx - max_new_tokens)
    ids = encoded[len(kept)]
    text = loaded.chat_template.render(kept, add_generation_prompt=True)
    sampling = SamplingConfig(temperature, top_k, top_p)
    model = loaded.model

    def work() -> ChatRun:
        idx = torch.tensor([ids], dtype=torch.long, device=model.device)  # (1, P)
        g = torch.Generator(device=model.device).manual_seed(int(seed))
        stop = loaded.stop_ids or None
        compiled = engine.compiled_step(len(ids), max_new_tokens)  # (no hooks)
        settings = dataclasses.asdict(sampling) | {"eos_id": stop}
        tokens = stream(model, idx, max_new_tokens, **settings, generator=g, compile=compiled)
        engine.count("compiled_generations", int(compiled))
        return ChatRun(
            list(ids),
            len(ids),
            sampling,
            max_new_tokens,
            0,
            tokens,
            prompt_text=text,
            dropped=dropped,
            stop_ids=frozenset(loaded.stop_ids),
            decoder=StreamDecoder(loaded.tokenizer),
        )

    run = engine.run(work)
    engine.count("generations_started")
    engine.count("generations_active")
    return run


def advance_chat(engine: Engine, run: ChatRun) -> dict[str, Any] | None:
    """The next token of the answer and the text it completes (``{"token", "text"}``), or None when
    the answer is over (``run.end_reason``: "stop" at a stop token, "length", "shutdown")."""
    if engine.ended(run):
        return None
    token = engine.run(lambda: next(run.tokens, None))
    if token is None:
        run.end_reason = run.end_reason or "length"
        return None
    t = int(token[0])
    if t in run.stop_ids:
        run.end_reason = "stop"
        return None
    run.produced += 1
    run.ids.append(t)
    run.answer_ids.append(t)
    engine.count("generation_steps")
    return {"token": t, "text": run.decoder.push(t)}
