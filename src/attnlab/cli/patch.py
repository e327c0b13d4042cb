"""``attnlab patch``: which heads and positions carry the answer, by activation patching.

Example::

    attnlab patch --model DIR --clean "When Mary and John went to the store, John gave a drink to" \
        --corrupted "When Mary and John went to the store, Mary gave a drink to" --answers " Mary" " John" \
        --out patch.html

The corrupted prompt runs with one clean activation at a time (a head's output, or the residual
stream at one position); printed are the patches of largest effect on the logit difference, either
way, with its sign (a patch that moves it away from the clean run's matters too), and ``--out``
writes the heatmaps (an HTML page, or a PNG of the first site).
"""

from __future__ import annotations

import argparse

from attnlab.cli.options import add_model_arguments, add_threads_argument, check_out_file, load_from_model_arguments
from attnlab.interpret import SITES
from attnlab.tools.patch import patch_report, save_patch_picture
from attnlab.training.allocator import tune_cpu_allocator


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_threads_argument(parser)
    parser.description = (
        "Activation patching: run the corrupted prompt with one activation of the clean prompt at a time and "
        "print the heads (L.H) and positions whose patch moves logit(A) - logit(B) the most, either way, with its sign."
    )
    add_model_arguments(parser, what="(refused by patch: give --clean and --corrupted)")
    parser.add_argument("--clean", metavar="TEXT", required=True, help="the prompt whose answer is A")
    parser.add_argument("--corrupted", metavar="TEXT", required=True, help="a prompt of as many tokens, answer B")
    parser.add_argument("--answers", nargs=2, metavar=("A", "B"), required=True, help="two one-token answers")
    parser.add_argument(
        "--site",
        action="append",
        choices=list(SITES),
        help="what to patch (repeatable; default: head_out and resid_pre)",
    )
    parser.add_argument("--top", type=int, default=10, metavar="K", help="patches listed per site (default 10)")
    parser.add_argument("--out", metavar="FILE", help="write the heatmaps: page.html (every site) or a .png")


def run(args: argparse.Namespace) -> int:
    if args.checkpoint is None and args.model is None:
        raise ValueError("give --checkpoint DIR or --model NAME")
    if args.prompt is not None:
        raise ValueError("attnlab patch takes --clean and --corrupted, not --prompt")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    check_out_file(args.out, (".html", ".htm", ".png"))
    # A site's thousands of reruns allocate and free the same activation-sized buffers: keep them for
    # reuse (see attnlab.training.allocator; ATTNLAB_MALLOC_TUNING=0 leaves glibc as it is).
    tune_cpu_allocator()
    loaded = load_from_model_arguments(args)
    sites = args.site or ["head_out", "resid_pre"]
    report = patch_report(loaded, args.clean, args.corrupted, tuple(args.answers), sites, progress=True)
    print(report.format(top=args.top))
    if args.out:
        print(f"wrote {save_patch_picture(report, args.out, top=args.top)}")
    return 0
