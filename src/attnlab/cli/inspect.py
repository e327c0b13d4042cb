"""``attnlab inspect``: what a model's attention does on a prompt, as a text report.

Example::

    attnlab inspect --model gpt2 --prompt "The cat sat on the mat. The cat" --ablate 5.1,5.5

Per layer and head the role scores (previous-token, first-token, self, duplicate-token, induction),
the strongest heads of each role, the logit lens at one position, the rollout row of one token and,
with ``--ablate``, the change in loss and in the next-token distribution when those heads are removed;
with ``--sae DIR``, each token's strongest latents of that SAE (``attnlab viz --sae`` draws them, with
each latent's dashboard, in the inspector page's Features view).
"""

from __future__ import annotations

import argparse

from attnlab.cli.options import add_model_arguments, add_threads_argument, load_from_model_arguments, seed
from attnlab.cli.viz import add_sae_arguments
from attnlab.tools.loading import attach_saes, load_saes
from attnlab.tools.viz.report import inspect_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_threads_argument(parser)
    parser.description = (
        "Look inside a model on a prompt: head roles per layer and head, the strongest heads of each role, the "
        "logit lens at one position, the rollout row of one token; --ablate removes heads and reports the change."
    )
    add_model_arguments(parser, what="to run through the model (required)")
    parser.add_argument(
        "--position",
        type=int,
        default=-1,
        metavar="N",
        help="token position for the logit lens (default: -1, the last)",
    )
    parser.add_argument(
        "--token", type=int, default=-1, metavar="N", help="token whose rollout row to show (default: -1, the last)"
    )
    parser.add_argument("--top", type=int, default=5, metavar="K", help="candidates shown per row (default: 5)")
    parser.add_argument(
        "--fusion", choices=("mean", "max", "min"), default="mean", help="how rollout fuses heads (default: mean)"
    )
    parser.add_argument(
        "--ablate", metavar="L.H[,L.H...]", help="remove these heads (layer.head, from 0) and report the change"
    )
    parser.add_argument(
        "--ablate-mode",
        choices=("zero", "mean"),
        default="zero",
        help="replace a removed head's output by zeros or by its mean over the prompt (default: zero)",
    )
    parser.add_argument("--role-seed", type=seed, default=0, metavar="S", help="seed of the role-score sequence")
    add_sae_arguments(parser, page=False)


def run(args: argparse.Namespace) -> int:
    if args.checkpoint is None and args.model is None:
        raise ValueError(
            "give --checkpoint DIR or --model NAME (the tutorials' six-word example is not a language model: "
            "see `attnlab viz` and `attnlab explain`)"
        )
    if not args.prompt:
        raise ValueError("--prompt TEXT is required (the text to run through the model)")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if args.ablate is not None and not args.ablate.strip():
        raise ValueError("--ablate needs heads as layer.head, e.g. --ablate 0.1,3.2")
    saes = load_saes(args.sae)  # a missing or bad SAE is refused before the model is read
    loaded = load_from_model_arguments(args)
    attach_saes(saes, loaded.model)  # its hook point and width, before any work
    report = inspect_report(
        loaded,
        args.prompt,
        position=args.position,
        token=args.token,
        top=args.top,
        fusion=args.fusion,
        ablate=args.ablate,
        ablate_mode=args.ablate_mode,
        role_seed=args.role_seed,
        saes=saes,
    )
    print(report.format(top=args.top))
    return 0
