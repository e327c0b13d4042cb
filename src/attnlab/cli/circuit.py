"""``attnlab circuit``: which edges between heads and MLPs carry the answer, by edge attribution.

Example::

    attnlab circuit --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --clean "When Mary and John went to the store, John gave a drink to" \
        --corrupted "When Mary and John went to the store, Mary gave a drink to" \
        --answers " Mary" " John" --method EAP-IG-inputs --budget 5% --out circuit.html

Every edge (a writer's output read by a later head's query, key or value, an MLP or the logits) is
scored by EAP or EAP-IG (:func:`attnlab.interpret.edge_attribution`); printed are the strongest
edges with their sign, and the faithfulness of the circuit of the top edges at MIB's budgets with
its summaries (CPR, CMD); ``--out`` writes an offline page drawing the circuit of ``--budget``'s
top edges, a clicked head's attention on both prompts beside it. ``--pairs FILE`` scores a JSONL of
pairs together and reports the mean over pairs, as the papers do (a pair whose prompts differ in
token length is refused with its line number). ``--sae DIR`` (repeatable) splices an SAE or
transcoder in at its hook, its error term kept: its active latents become nodes of the graph, named
``sae 3.hook_resid_post latent 123`` in the printed edges and on the page (at most ``--max-latents``
of each; what the others write is counted in its error node).
"""

from __future__ import annotations

import argparse

from attnlab.cli.options import (
    add_model_arguments,
    add_threads_argument,
    at_most,
    check_out_file,
    load_from_model_arguments,
)
from attnlab.interpret.circuit_view import parse_budget
from attnlab.tools.circuit import METHODS, circuit_report, circuit_report_pairs, circuit_saes, save_circuit_page
from attnlab.tools.loading import load_saes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_threads_argument(parser)
    parser.description = (
        "Edge attribution patching (EAP, EAP-IG): score every edge between the embeddings, heads, MLPs and the "
        "logits for logit(A) - logit(B), print the strongest edges and the faithfulness of the top edges' "
        "circuits at MIB's budgets (CPR, CMD), and draw the circuit as a page."
    )
    add_model_arguments(parser, what="(refused by circuit: give --clean and --corrupted)")
    parser.add_argument("--clean", metavar="TEXT", help="the prompt whose answer is A")
    parser.add_argument("--corrupted", metavar="TEXT", help="a prompt of as many tokens, answer B")
    parser.add_argument("--answers", nargs=2, metavar=("A", "B"), help="two one-token answers")
    parser.add_argument(
        "--pairs",
        metavar="FILE",
        help='instead of --clean/--corrupted/--answers: a JSONL of pairs, {"clean": ..., "corrupted": ..., '
        '"answers": [A, B]} a line, scored together (the mean over pairs)',
    )
    parser.add_argument("--method", default="EAP", metavar="M", help=f"{', '.join(METHODS)} (default: EAP)")
    parser.add_argument(
        "--ig-steps", type=at_most(1024), default=5, metavar="N", help="integrated-gradient steps of EAP-IG (default 5)"
    )
    parser.add_argument(
        "--budget",
        default="5%",
        metavar="B",
        help="the circuit drawn: its share of all edges, as 5%% or 0.05 (default 5%%)",
    )
    parser.add_argument("--top", type=int, default=20, metavar="K", help="edges listed (default 20)")
    parser.add_argument(
        "--sae",
        action="append",
        default=[],
        metavar="DIR",
        help="an SAE or transcoder (SAELens, sparsify or Gemma Scope files) spliced in at its hook, its "
        "latents nodes of the graph; repeat for several",
    )
    parser.add_argument(
        "--max-latents",
        type=int,
        default=64,
        metavar="N",
        help="the most latents of one SAE that are nodes (default 64): those active on the prompts, the "
        "largest change between them first",
    )
    parser.add_argument("--out", metavar="FILE", help="write the circuit's page (.html, offline)")


def run(args: argparse.Namespace) -> int:
    if args.checkpoint is None and args.model is None:
        raise ValueError("give --checkpoint DIR or --model NAME")
    if args.prompt is not None:
        raise ValueError("attnlab circuit takes --clean and --corrupted, not --prompt")
    one = [args.clean is not None, args.corrupted is not None, args.answers is not None]
    if args.pairs is not None and any(one):
        raise ValueError("give either --pairs FILE or --clean, --corrupted and --answers, not both")
    if args.pairs is None and not all(one):
        raise ValueError("give --clean TEXT, --corrupted TEXT and --answers A B (or --pairs FILE)")
    if args.method not in METHODS:
        raise ValueError(f"--method must be one of {', '.join(METHODS)}, got {args.method!r}")
    if args.ig_steps < 1:
        raise ValueError(f"--ig-steps must be >= 1, got {args.ig_steps}")
    if args.top < 1:
        raise ValueError(f"--top must be >= 1, got {args.top}")
    if args.max_latents < 0:
        raise ValueError(f"--max-latents must be >= 0, got {args.max_latents}")
    if args.sae and args.method == "EAP-IG-activations":
        raise ValueError(
            "--sae works with --method EAP or EAP-IG-inputs (EAP-IG-activations interpolates the model's own writers)"
        )
    check_out_file(args.out, (".html", ".htm"))
    try:
        parse_budget(args.budget)  # before the model loads: a bad budget is known at once
    except ValueError as e:
        raise ValueError(f"--budget: {e}") from None
    read = load_saes(args.sae)  # a missing or bad SAE is refused before the model is read
    loaded = load_from_model_arguments(args)
    options = dict(method=args.method, ig_steps=args.ig_steps, budget=args.budget, max_latents=args.max_latents)
    options["saes"] = circuit_saes(loaded, read)
    if args.pairs is not None:
        report = circuit_report_pairs(loaded, args.pairs, **options)
    else:
        report = circuit_report(loaded, args.clean, args.corrupted, tuple(args.answers), **options)
    print(report.format(top=args.top))
    if args.out:
        print(f"wrote {save_circuit_page(report, args.out)}")
    return 0
