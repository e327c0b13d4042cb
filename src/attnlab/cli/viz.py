"""``attnlab viz``: heatmaps, the offline inspector page, or the weights as text (see :mod:`attnlab.tools.viz`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnlab.cli.options import (
    add_model_arguments,
    add_sampling_arguments,
    add_threads_argument,
    at_most,
    check_out_file,
    check_sampling,
    index_list,
    load_from_model_arguments,
)
from attnlab.interpret import token_strings
from attnlab.tools.loading import attach_saes, load_saes
from attnlab.tools.viz import demo_view, format_text, model_inspector, model_view, save_html, save_png
from attnlab.tools.viz.inspector import check_sae_data, encode_prompt, sae_corpus

SUFFIXES = (".png", ".svg", ".pdf", ".html", ".htm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_threads_argument(parser)
    parser.description = (
        "Show attention: heatmaps (PNG/SVG/PDF), an offline HTML inspector, or numbers in the terminal. "
        "Without --checkpoint or --model: the tutorials' six-word example, 'Your journey starts with one step'. "
        "With a model, the HTML page is the full inspector: the tutorials' steps on its heads, next-token "
        "probabilities under temperature/top-k/top-p, rollout, the logit lens, head roles and generation."
    )
    add_model_arguments(parser, what="whose attention to show (needs --checkpoint or --model)")
    parser.add_argument(
        "--layer", type=index_list, metavar="N[,N...]", help="layer(s) to show, from 0; -1 is the last (default: all)"
    )
    parser.add_argument(
        "--head", type=index_list, metavar="N[,N...]", help="head(s) to show, from 0; -1 is the last (default: all)"
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="write FILE.png (or .svg/.pdf): a grid of heatmaps; or FILE.html: an interactive page "
        "that works offline. Without --out the weights are printed.",
    )
    page = parser.add_argument_group("the HTML inspector of a model")
    page.add_argument(
        "--steps",
        metavar="L.H[,L.H...]",
        help="heads whose tutorials' steps (q·kᵀ, scaled, masked, softmax, weighted values) the page stores "
        "(default: every head when they fit in 12 MiB, else 0.0 and the strongest head of each role)",
    )
    page.add_argument(
        "--generate",
        type=at_most(4096, least=0),
        default=8,
        metavar="N",
        help="tokens to generate and play back (default: 8)",
    )
    add_sampling_arguments(page)
    page.add_argument(
        "--corrupted",
        metavar="TEXT",
        help="add the patching view: activation patching of --prompt (clean) and TEXT (as many tokens), every "
        "head and every position, computed now (the page is static); needs --answers",
    )
    page.add_argument("--answers", nargs=2, metavar=("A", "B"), help="the patching view's answers: one token each")
    add_sae_arguments(page)


def add_sae_arguments(parser: argparse.ArgumentParser, *, page: bool = True) -> None:
    """``--sae DIR`` (repeatable), and for a page ``--sae-data FILE``, ``--sae-tokens N`` (viz, serve)."""
    parser.add_argument(
        "--sae",
        action="append",
        default=[],
        metavar="DIR",
        help="an SAE (or transcoder) of the model: its directory, params.npz or Hub id (repeatable)"
        + (
            "; adds the Features view: each token's strongest latents, a latent's dashboard (its top contexts, "
            "activation histogram, density, promoted and suppressed tokens)"
            if page
            else "; the report lists each token's strongest latents"
        ),
    )
    if not page:
        return
    parser.add_argument(
        "--sae-data",
        metavar="FILE",
        help="UTF-8 text whose first --sae-tokens tokens the latents' dashboards also read (default: the prompt's)",
    )
    parser.add_argument(
        "--sae-tokens",
        type=int,
        default=65_536,
        metavar="N",
        help="tokens of --sae-data the dashboards read (default: 65536)",
    )


def run(args: argparse.Namespace) -> int:
    check_out_file(args.out, SUFFIXES)
    out = None if args.out is None else Path(args.out)
    has_model = args.checkpoint is not None or args.model is not None
    flag = "--checkpoint" if args.checkpoint is not None else "--model"
    if not has_model and args.prompt is not None:
        raise ValueError("--prompt needs --checkpoint DIR or --model NAME (the model to run it through)")
    if has_model and not args.prompt:
        raise ValueError(f"{flag} needs --prompt TEXT (the text whose attention to show)")
    if args.generate < 0:
        raise ValueError(f"--generate must be >= 0, got {args.generate}")
    check_sampling(args)
    html = out is not None and out.suffix.lower() in (".html", ".htm")
    check_patching(args, html, has_model)
    if (args.sae or args.sae_data is not None) and not (html and has_model):
        raise ValueError(
            "--sae adds the Features view to a model's page: give --model or --checkpoint, --prompt and --out FILE.html"
        )
    if args.sae_data is not None and not args.sae:
        raise ValueError("--sae-data needs --sae DIR (the SAE whose latents' dashboards read it)")
    if args.sae_tokens < 1:
        raise ValueError(f"--sae-tokens must be a positive int, got {args.sae_tokens}")
    saes = load_saes(args.sae)  # a missing or bad SAE is refused before the model is read
    check_sae_data(args.sae_data)
    if not has_model:
        view = demo_view().select(args.layer, args.head)
    else:
        loaded = load_from_model_arguments(args)
        if html:
            attach_saes(saes, loaded.model)  # its hook point and width checked before any work
            corpus = None if args.sae_data is None else sae_corpus(loaded, args.sae_data, args.sae_tokens)
            data = model_inspector(
                loaded,
                args.prompt,
                steps="auto" if args.steps is None else args.steps,
                generate=args.generate,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed,
                layers=args.layer,
                heads=args.head,
                saes=saes,
                sae_corpus=corpus,
                sae_options=None if args.sae_data is None else {"corpus_name": Path(args.sae_data).name},
            )
            if args.corrupted is not None:
                from attnlab.tools.patch import patching_view

                data["patching"] = patching_view(loaded, args.prompt, args.corrupted, tuple(args.answers))
            save_html(data, out)
            n = sum(len(layer["heads"]) for layer in data["layers"])
            print(
                f"wrote {out}: {n} attention map{'s' * (n != 1)} in {len(data['layers'])} rows, "
                f"{len(data['tokens'])} tokens; the inspector: the tutorials' steps of "
                f"{len(data['steps']['heads'])} heads, next-token probabilities, rollout, logit lens, head roles"
                + (f", {len(data['generation']['steps'])} generated tokens" if data["generation"] else "")
                + (", activation patching (the Patching tab)" if data.get("patching") else "")
                + (f", the latents of {len(saes)} SAE{'s' * (len(saes) != 1)} (the Features tab)" if saes else "")
            )
            return 0
        ids = encode_prompt(loaded, args.prompt)[0].tolist()
        tokens = token_strings(loaded.tokenizer, ids)
        view = model_view(loaded.model, ids, tokens, title=args.prompt, text=args.prompt).select(args.layer, args.head)
    if out is None:
        print(format_text(view))
        print("(--out FILE.png draws heatmaps; --out FILE.html writes a page to explore)")
        return 0
    if html:
        save_html(view, out)
    else:
        save_png(view, out)
    n = sum(layer.weights.shape[0] for layer in view.layers)
    rows = len(view.layers)
    print(f"wrote {out}: {n} attention map{'s' * (n != 1)} in {rows} row{'s' * (rows != 1)}, {len(view.tokens)} tokens")
    if n > 64 and not html:
        print("(a big grid: --layer and --head pick a few panels to see them larger)")
    return 0


def check_patching(args: argparse.Namespace, html: bool, has_model: bool) -> None:
    """--corrupted and --answers come together, on a model's HTML page."""
    if (args.corrupted is None) != (args.answers is None):
        given, missing = ("--corrupted", "--answers A B") if args.answers is None else ("--answers", "--corrupted TEXT")
        raise ValueError(f"{given} needs {missing} (the patching view takes both)")
    if args.corrupted is not None and not (html and has_model):
        raise ValueError(
            "--corrupted and --answers add the patching view to a model's page: give --model or "
            "--checkpoint, --prompt and --out FILE.html"
        )
