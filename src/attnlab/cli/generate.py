"""``attnlab generate``: continue a prompt with a trained checkpoint, streaming tokens to stdout.

Example::

    attnlab generate --checkpoint runs/attnlab --prompt "The " --max-new-tokens 300 --temperature 0.8

``--checkpoint`` is a training directory (its latest checkpoint is used) or one step directory.
The text is decoded with the checkpoint's own tokenizer, so generation reads tokens exactly the way
training wrote them. Multi-byte characters (``byte`` tokenizer) and BPE pieces are printed as soon
as they are complete, each flushed at once; characters the terminal's encoding cannot show (an
ASCII-only locale) are printed as backslash escapes rather than ending the command.

``--model`` reads a published model instead (the architectures ``--help`` lists): a GGUF file, with
the tokenizer it stores, or a Hugging Face repository or directory (from the cache when offline),
with its own ``tokenizer.json``; the prompt starts with the model's beginning-of-text token, and
generation stops at its end::

    attnlab generate --model meta-llama/Llama-3.2-1B --prompt "The capital of France is" --temperature 0

``--chat`` sends the prompt to an instruct model as one user message, in the model's own chat
template (with the opening of the assistant's turn), and prints the answer, which ends at the
model's end-of-turn token (see ``attnlab chat`` for a conversation)::

    attnlab generate --model SmolLM2-135M-Instruct --chat --prompt "What is the capital of France?" --temperature 0

``--steer SAE_DIR:LATENT:STRENGTH`` (repeatable) adds ``STRENGTH`` times the SAE's decoder direction of
latent ``LATENT`` to the activation at the SAE's hook point, at every position, while generating
(:func:`attnlab.interpret.steer`)::

    attnlab generate --model M.gguf --prompt "I think" --steer runs/sae/sae:123:8 --temperature 0
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
from typing import Any

import torch

from attnlab.checks import resolve_device
from attnlab.cli.options import (
    MODEL_SOURCES,
    add_dtype_argument,
    add_threads_argument,
    compile_quantized_up_front,
    model_dtype,
)
from attnlab.files import safe_write
from attnlab.generation import SamplingConfig
from attnlab.tokenizers import StreamDecoder, prompt_tokens
from attnlab.tools.chat import prompt_ids
from attnlab.tools.loading import LoadedModel, attach_saes, load, load_saes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_threads_argument(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a training --out directory (uses its latest checkpoint) or a step directory inside it",
    )
    source.add_argument("--model", metavar="MODEL", help=f"a published model: {MODEL_SOURCES}")
    parser.add_argument("--prompt", default="\n", metavar="TEXT", help="text to continue (default: a newline)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is one user message, laid out by the model's chat template (an instruct --model, or a "
        "--checkpoint fine-tuned from one); prints the answer, which ends at the model's end-of-turn token",
    )
    parser.add_argument(
        "--bpe-dir", metavar="DIR", help="where GPT-2's BPE files are, if not where training found them"
    )
    add_generation_arguments(parser, max_new_tokens=200)
    parser.add_argument(
        "--steer",
        action="append",
        default=[],
        metavar="SAE_DIR:LATENT:STRENGTH",
        help="add STRENGTH x the decoder direction of an SAE's latent at its hook point while generating "
        "(repeatable; the SAE's directory, params.npz or Hub id)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="decode with a step compiled by torch.compile: faster per token, but the first token waits for the "
        "compilation (tens of seconds on a small CPU)",
    )


def add_generation_arguments(
    parser: argparse.ArgumentParser, *, max_new_tokens: int | None, max_new_help: str | None = None
) -> None:
    """``--dtype``, ``--max-new-tokens``, the sampling flags, ``--seed``, ``--device``, ``--no-cache``
    (``attnlab generate`` and ``attnlab chat``)."""
    add_dtype_argument(parser)
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        metavar="N",
        help=max_new_help or f"tokens to generate (default: {max_new_tokens})",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.8, metavar="T", help="softmax temperature; 0 = greedy (default: 0.8)"
    )
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K likeliest tokens")
    parser.add_argument(
        "--top-p",
        type=float,
        default=None,
        metavar="P",
        help="nucleus sampling: the likeliest tokens up to probability P",
    )
    parser.add_argument("--seed", type=int, default=None, metavar="S", help="seed for reproducible samples")
    parser.add_argument(
        "--device",
        default="auto",
        metavar="DEV",
        help="auto (cuda, else mps, else cpu), cpu, cuda, mps (default: auto)",
    )
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole window per token (no KV cache)")


def load_from_args(args: argparse.Namespace, device: torch.device) -> LoadedModel:
    """``--model`` (in ``--dtype``, where given) or ``--checkpoint`` (``attnlab generate`` and ``attnlab chat``)."""
    bpe_dir = getattr(args, "bpe_dir", None)
    return load(args.checkpoint, args.model, device=device, bpe_dir=bpe_dir, dtype=model_dtype(args))


def require_chat_template(loaded: LoadedModel, checkpoint: str) -> None:
    """A checkpoint to chat with must keep a chat template (one fine-tuned from an instruct model)."""
    if loaded.chat_template is None:
        raise ValueError(
            f"--checkpoint {checkpoint} has no chat template: it was not fine-tuned from an instruct model "
            "(attnlab train --init-from MODEL with one); use attnlab generate without --chat"
        )


SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds below it
# More tokens than anyone can wait for (days at any speed): a typo, refused before any work.
MAX_NEW_TOKENS = 2**31 - 1
_FLAGS = {"temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p"}


def sampling_from_args(args: argparse.Namespace) -> SamplingConfig:
    """The sampling flags as one :class:`SamplingConfig`, after the other flags' range checks;
    every error names its flag."""
    if args.max_new_tokens is not None and not 0 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens must be in [0, {MAX_NEW_TOKENS:,}], got {args.max_new_tokens}")
    if args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
        raise ValueError(f"--seed must be in [0, 2**64), got {args.seed}")
    try:
        return SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    except ValueError as exc:  # "top_k must be ...": name the flag instead of the field
        field, _, rest = str(exc).partition(" ")
        raise ValueError(f"{_FLAGS.get(field, field)} {rest}") from None


def parse_steer(spec: str) -> tuple[str, int, float]:
    """``SAE_DIR:LATENT:STRENGTH`` -> (path, latent, strength); the path may hold colons of its own."""
    path, latent, strength = ([None, None, *spec.rsplit(":", 2)])[-3:]
    try:
        if not path:
            raise ValueError
        return path, int(latent), float(strength)
    except (TypeError, ValueError):
        raise ValueError(f"--steer must be SAE_DIR:LATENT:STRENGTH (an int latent, a number), got {spec!r}") from None


def load_steering(specs: list[str]) -> tuple[list[tuple[Any, int, float]], dict[str, Any]]:
    """Each ``--steer`` spec's SAE (on the CPU), latent and strength, checked before the model is read;
    and the SAEs by path (for :func:`attach_saes`)."""
    parsed = [(spec, *parse_steer(spec)) for spec in specs]
    saes = load_saes([path for _, path, _, _ in parsed], flag="--steer")  # (a path given twice is read once)
    out = []
    for spec, path, latent, strength in parsed:
        sae = saes[path]
        if not 0 <= latent < sae.cfg.d_sae:
            raise ValueError(f"--steer {spec}: latent must be in [0, {sae.cfg.d_sae}), got {latent}")
        if not math.isfinite(strength):
            raise ValueError(f"--steer {spec}: strength must be a finite number, got {strength}")
        out.append((sae, latent, strength))
    return out, saes


def run(args: argparse.Namespace) -> int:
    sampling = sampling_from_args(args)
    steering, saes = load_steering(args.steer)  # a bad spec or SAE is refused before the model is read
    device = resolve_device(args.device)
    loaded = load_from_args(args, device)
    # Stop where the model ends a text (an instruct model: a turn); a checkpoint fine-tuned from one
    # stops where its base does.
    if args.model is not None or loaded.stop_ids:
        sampling = dataclasses.replace(sampling, eos_id=loaded.stop_ids or loaded.tokenizer.eot_id)
    tok, model = loaded.tokenizer, loaded.model
    attach_saes(saes, model, flag="--steer")  # each hook point checked, on the model's device and dtype
    if args.chat:  # the message in the model's conversation format, the assistant's turn opened
        if args.checkpoint is not None:
            require_chat_template(loaded, args.checkpoint)
        ids = prompt_ids(loaded, [{"role": "user", "content": args.prompt}])
        ctx = model.config.context_length
        if len(ids) + args.max_new_tokens > ctx:  # (else the template's start would slide out of the window unseen)
            raise ValueError(
                f"--prompt in the chat template takes {len(ids)} tokens and --max-new-tokens {args.max_new_tokens} "
                f"more, past the model's context of {ctx}: shorten it or lower --max-new-tokens"
            )
    else:
        ids = prompt_tokens(tok, args.prompt)
    if not ids:
        raise ValueError("--prompt encodes to no tokens; give at least one character")
    idx = torch.tensor([ids], dtype=torch.long, device=device)  # (1, P)
    gen = None if args.seed is None else torch.Generator(device=device).manual_seed(args.seed)

    def write(text: str) -> None:  # each piece shown as soon as it is decoded
        safe_write(sys.stdout, text)
        sys.stdout.flush()

    if args.compile:
        print("compiling the decoding step (tens of seconds; minutes with an empty inductor cache)", file=sys.stderr)
    else:
        compile_quantized_up_front(model, args.max_new_tokens)
    if not args.chat:  # a continuation is printed after its prompt, an answer alone
        write(args.prompt)
    dec = StreamDecoder(tok)
    with contextlib.ExitStack() as stack:
        if steering:
            from attnlab.interpret.sae import steer
        for sae, latent, strength in steering:  # hooks for the whole stream (it runs lazily, token by token)
            stack.enter_context(steer(model, sae, latent, strength))
        settings = dict(use_cache=not args.no_cache, generator=gen, compile=args.compile)
        stream = model.stream(idx, args.max_new_tokens, **dataclasses.asdict(sampling), **settings)
        for token in stream:
            if int(token[0]) in sampling.stop_ids:
                break  # the end-of-text token is not text
            if int(token[0]) >= tok.vocab_size:  # an embedding row past the tokenizer's (padding): no text
                continue
            piece = dec.push(int(token[0]))  # token: (1,)
            if piece:
                write(piece)
    write(dec.flush() + "\n")
    return 0
