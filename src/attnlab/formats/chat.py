"""Chat templates: an instruct model's conversation format, rendered as its authors wrote it.

An instruct model was fine-tuned on conversations laid out in one exact text format (role markers,
end-of-turn tokens); its files carry that format as a Jinja template: ``chat_template.jinja`` or the
``chat_template`` key of ``tokenizer_config.json`` in a Hugging Face directory, the
``tokenizer.chat_template`` metadata of a GGUF file. :class:`ChatTemplate` renders it the way
transformers' ``apply_chat_template`` does (same Jinja options, same globals), inside jinja2's
immutable sandbox: a template is code from a file the user handed us, so it may not reach Python
attributes or change its inputs, and any error it raises comes out as one ``ValueError``.

    template = ChatTemplate(source, bos_token="<|im_start|>", eos_token="<|im_end|>")
    text = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from attnlab.files import read_json

__all__ = ["TURN_ENDS", "ChatTemplate", "check_messages", "read_chat_template"]

# The special tokens that end a turn in the chat formats of the families attnlab reads (llama.cpp finds
# them by these texts too, where a GGUF file names no end-of-turn id).
TURN_ENDS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>", "<EOT>")
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


class ChatTemplate:
    """A compiled chat template and the special tokens it refers to (``bos_token``, ``eos_token``, and
    by name in ``tokens`` the others the model has: ``unk_token``, ``pad_token``, ...).

    ``source`` is the template's Jinja text; ``name`` says where it came from, for error messages."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        name: str = "chat template",
        tokens: Mapping[str, str] | None = None,
    ) -> None:
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{name} must be a non-empty Jinja template string, got {source!r:.60}")
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols

        # transformers' options: blocks eat their newline and leading spaces, {% break %} allowed.
        # {% generation %}: transformers' tag around the assistant's text (what training counts).
        extensions = [loopcontrols, _generation_tag()]
        env = _bounded_environment()(trim_blocks=True, lstrip_blocks=True, extensions=extensions)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"{name} does not compile: {e}") from None
        self.source, self.name = source, name
        self.bos_token, self.eos_token = bos_token, eos_token
        self.tokens = dict(tokens or {})

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """The conversation as the model's text; ``add_generation_prompt`` appends the opening of
        the assistant's turn (what generation continues from). ``extra`` reaches the template as
        variables (e.g. ``tools``, ``enable_thinking``)."""
        messages = check_messages(messages)
        from jinja2 import TemplateError
        from jinja2.exceptions import SecurityError

        _BUDGET.steps = 0
        try:
            # As apply_chat_template: tools and documents are None unless given, the special tokens by name.
            context = {"tools": None, "documents": None, **self.tokens}
            context |= {"bos_token": self.bos_token, "eos_token": self.eos_token}
            return self._template.render(
                messages=messages, add_generation_prompt=bool(add_generation_prompt), **(context | extra)
            )
        except TemplateBounds as e:
            raise ValueError(f"{self.name} was stopped: {e}") from None
        except SecurityError as e:
            raise ValueError(f"{self.name} tried to leave the sandbox: {e}") from None
        except TemplateError as e:
            raise ValueError(f"{self.name} failed: {e}") from None
        except Exception as e:  # (code from a file: whatever it raises, a recursion or a range too long)
            raise ValueError(f"{self.name} failed: {type(e).__name__}: {e}") from None


def check_messages(messages: object) -> list[dict[str, Any]]:
    """``messages`` as a list of ``{"role": str, "content": str, ...}`` dicts, or a ValueError/
    TypeError naming the first one that is not. As transformers takes them: a ``content`` may be a
    list of parts (``[{"type": "text", "text": ...}]``), a key whose value is None is left out (an
    assistant's tool call has no content), and a turn's reasoning under any of ``reasoning_content``,
    ``thinking`` and ``reasoning`` is given as ``reasoning_content`` and ``thinking``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]['role'] must be a string, got {m.get('role')!r:.60}")
        if not isinstance(m.get("content"), (str, list, type(None))):
            got = f"{m['content']!r:.60}"
            raise ValueError(f"messages[{i}]['content'] must be a string, a list of parts or None, got {got}")
        m = {k: v for k, v in m.items() if v is not None}
        # A turn's reasoning, under any of transformers' names for it, as both the standard name and
        # gpt-oss's (its templates read "thinking"), the first name given winning, as transformers does.
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def read_chat_template(directory: str | os.PathLike[str]) -> str | None:
    """The chat template of a Hugging Face model directory (``chat_template.jinja``, else the
    ``chat_template`` of ``tokenizer_config.json``; a list of named templates gives ``default``),
    or None when it has none."""
    directory = Path(directory)
    path = directory / TEMPLATE_FILE
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    path = directory / TOKENIZER_CONFIG
    if not path.is_file():
        return None
    cfg = read_json(path, "tokenizer config")
    template = cfg.get("chat_template") if isinstance(cfg, dict) else None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {
            t.get("name"): t.get("template") for t in template if isinstance(t, dict) and isinstance(t.get("name"), str)
        }
        template = named.get("default")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: chat_template must be a string, got {type(template).__name__}")
    return template


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping (a chat is not a web page), Unicode kept unless asked.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# What one render may build: a template is code from a file the user handed us, and jinja2's sandbox
# bounds each range() (100,000) but not nested loops, nor a string or list multiplied by a number.
MAX_LOOP_STEPS = 1_000_000  # range() steps in all, one render
MAX_PRODUCT = 1 << 20  # items (characters) of a sequence times a number
_BUDGET = threading.local()


class TemplateBounds(RuntimeError):
    """A template went past what one render may build (see :data:`MAX_LOOP_STEPS`)."""


def _bounded_environment() -> type:
    """jinja2's immutable sandbox with the bounds above."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

    def counted_range(*args: int) -> range:
        r = safe_range(*args)
        _BUDGET.steps = getattr(_BUDGET, "steps", 0) + len(r)
        if _BUDGET.steps > MAX_LOOP_STEPS:
            raise TemplateBounds(f"its loops take more than {MAX_LOOP_STEPS:,} steps")
        return r

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**"])

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.globals["range"] = counted_range

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**" and isinstance(right, int) and abs(right) > 64:
                raise TemplateBounds(f"it raises a number to the power {right}")
            if operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_PRODUCT:
                    raise TemplateBounds(f"it builds a sequence of {len(seq) * n:,} items")
            return super().call_binop(context, operator, left, right)

    return Bounded


def _generation_tag() -> type:
    """The jinja2 extension of ``{% generation %}...{% endgeneration %}``: its body rendered as it is
    (transformers marks the assistant's tokens with it; rendering text, there is nothing to mark)."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return Generation
