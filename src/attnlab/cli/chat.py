"""``attnlab chat``: a conversation with an instruct model in the terminal.

Example::

    attnlab chat --model SmolLM2-135M-Instruct --temperature 0
    >>> What is the capital of France?
    The capital of France is Paris.

The model's own chat template lays the conversation out (``chat_template.jinja`` or
``tokenizer_config.json`` of a Hugging Face directory, the GGUF's ``tokenizer.chat_template``), and
an answer ends at the model's end-of-turn or end-of-text token. Answers stream as they come. The
history is kept within the context window (the oldest turns are dropped, the ``--system`` message
kept, and a note says so). ``/reset`` clears the history, ``/exit`` or Ctrl-D leaves, Ctrl-C stops
an answer. Through a pipe (stdin not a terminal) each input line is one message and each answer is
printed on its own::

    printf 'Hi!\\nWhat did I just say?\\n' | attnlab chat --model DIR --temperature 0

``--checkpoint DIR`` chats with a model fine-tuned from an instruct model (``attnlab train --init-from``):
its checkpoint (or ``--merge`` directory) keeps the chat template and stop ids it was trained with.
"""

from __future__ import annotations

import argparse
import sys

from attnlab.checks import resolve_device
from attnlab.cli.generate import add_generation_arguments, load_from_args, require_chat_template, sampling_from_args
from attnlab.cli.options import MODEL_SOURCES, add_threads_argument, compile_quantized_up_front
from attnlab.tools.chat import HELP, ChatSession, chat_loop
from attnlab.tools.loading import model_name

MAX_ANSWER = 512  # the default longest answer, in tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_threads_argument(parser)
    parser.description = (
        "Chat with an instruct model: its chat template, answers streamed, the history kept within the context "
        f"window. {HELP}. Through a pipe, each input line is one message."
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="MODEL", help=f"an instruct model with a chat template: {MODEL_SOURCES}")
    source.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="an attnlab model fine-tuned from an instruct model (attnlab train --init-from): a training --out "
        "directory, a step directory inside it, or a --merge directory",
    )
    parser.add_argument("--system", metavar="TEXT", help="a system message, kept however long the conversation")
    add_generation_arguments(
        parser,
        max_new_tokens=None,
        max_new_help=f"the longest answer (default: {MAX_ANSWER}, or half the context window where that is less)",
    )


def run(args: argparse.Namespace) -> int:
    sampling = sampling_from_args(args)
    loaded = load_from_args(args, resolve_device(args.device))
    if args.checkpoint is not None:
        require_chat_template(loaded, args.checkpoint)
    what = f"--model {args.model}" if args.model is not None else f"--checkpoint {args.checkpoint}"
    ctx = loaded.model.config.context_length
    max_new_tokens = min(MAX_ANSWER, ctx // 2) if args.max_new_tokens is None else args.max_new_tokens
    try:
        session = ChatSession(
            loaded,
            system=args.system,
            sampling=sampling,
            max_new_tokens=max_new_tokens,
            seed=args.seed,
            use_cache=not args.no_cache,
            what=what,
        )
    except ValueError as exc:
        raise ValueError(str(exc).replace("max_new_tokens", "--max-new-tokens", 1)) from None
    compile_quantized_up_front(loaded.model, None)  # (a chat: turn after turn)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

        print(f"Chatting with {model_name(loaded)} (context window: {ctx} tokens). {HELP}.", file=sys.stderr)
        read_line = input
    else:

        def read_line(prompt: str) -> str:
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            return line.rstrip("\r\n")

    try:
        return chat_loop(session, read_line, sys.stdout, sys.stderr, interactive=interactive)
    except UnicodeDecodeError as exc:  # (the input, read in the locale's encoding: the output escapes its own)
        raise ValueError(
            f"cannot read the input as {sys.stdin.encoding} ({exc.reason} at byte {exc.start}); set "
            "PYTHONIOENCODING=utf-8 or a UTF-8 locale"
        ) from None
