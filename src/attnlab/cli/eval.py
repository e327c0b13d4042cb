"""``attnlab eval``: how well a model predicts a text (loss per token, perplexity, bits per byte).

Examples::

    attnlab eval --model ./SmolLM2-135M --data ../shared/data/the-verdict.txt
    attnlab eval --checkpoint runs/attnlab --data input.txt --stride 32

The text is scored in windows of ``--context-length`` tokens every ``--stride`` tokens (see
:mod:`attnlab.training.eval`); every token but the first is scored once, so the figures are those of
the whole text. A Hugging Face model's text starts with its beginning-of-text token, as Hugging Face's
tokenizer would put it; without one the first token is context only, and bits per byte counts the
bytes after it.
"""

from __future__ import annotations

import argparse
import json

from attnlab.cli.options import MODEL_SOURCES, add_dtype_argument, add_threads_argument, load_from_model_arguments
from attnlab.data import load_text
from attnlab.tokenizers import bos_prefix, prompt_tokens
from attnlab.tools.loading import model_name
from attnlab.training.eval import evaluate_tokens, windows

DEFAULT_CONTEXT = 1024  # at most the model's own context


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_threads_argument(parser)
    parser.description = "Measure a model's next-token loss, perplexity and bits per byte on a text file."
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--checkpoint", metavar="DIR", help="an attnlab model: a training --out directory or a step directory"
    )
    source.add_argument("--model", metavar="NAME", help=f"a published model: {MODEL_SOURCES}")
    parser.add_argument("--data", metavar="PATH", required=True, help="UTF-8 text file to score")
    parser.add_argument(
        "--context-length",
        type=int,
        metavar="T",
        help=f"tokens the model reads per window (default: the model's context, at most {DEFAULT_CONTEXT})",
    )
    parser.add_argument(
        "--stride",
        type=int,
        metavar="S",
        help="tokens between window starts; smaller gives each token more context (default: T, disjoint windows)",
    )
    parser.add_argument("--device", default="auto", metavar="DEV", help="auto, cpu, cuda, cuda:N or mps")
    add_dtype_argument(parser)
    parser.add_argument(
        "--bpe-dir", metavar="DIR", help="where GPT-2's BPE files are, if not where training found them"
    )
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar (default: on)"
    )


def run(args: argparse.Namespace) -> int:
    text = load_text(args.data)
    loaded = load_from_model_arguments(args)
    model, tok = loaded.model, loaded.tokenizer
    ids = prompt_tokens(tok, text)
    # Bits per byte over the bytes scored: all of them after a BOS; else the first token's are context only.
    n_bytes = len(text.encode("utf-8"))
    if ids and not bos_prefix(tok):  # (decoded as the text's start, as a SentencePiece decoder renders it)
        first = tok.decode([ids[0]])
        part = "\ufffd" in first and hasattr(tok, "decode_bytes")  # (part of a character: its bytes)
        n_bytes -= min(len(tok.decode_bytes([ids[0]]) if part else first.encode("utf-8")), n_bytes)
    T = args.context_length if args.context_length is not None else min(model.config.context_length, DEFAULT_CONTEXT)
    if not 1 <= T <= model.config.context_length and model.config.pos == "learned":
        raise ValueError(f"--context-length must be in [1, {model.config.context_length}] (the model's), got {T}")
    stride = T if args.stride is None else args.stride
    plan = windows(len(ids), T, stride)  # checks --context-length and --stride first
    bar = None
    if args.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(s for *_, s in plan), desc="eval", unit="tok", dynamic_ncols=True)
    try:
        result = evaluate_tokens(
            model, ids, context_length=T, stride=stride, n_bytes=n_bytes, on_window=bar and bar.update
        )
    finally:
        if bar is not None:
            bar.close()
    if args.json:
        figures = {
            "loss": result.loss,
            "perplexity": result.perplexity,
            "bits_per_byte": result.bits_per_byte,
            "tokens": result.tokens,
            "bytes": result.bytes,
            "context_length": T,
            "stride": stride,
        }
        print(json.dumps(figures))
        return 0
    scored = f"{result.tokens:,} tokens scored ({len(plan)} windows of <= {T}, stride {stride})"
    print(f"{model_name(loaded)} on {args.data}: {scored}")
    print(f"loss        {result.loss:.4f} nats/token")
    print(f"perplexity  {result.perplexity:.3f}")
    print(f"bits/byte   {result.bits_per_byte:.4f}")
    return 0
