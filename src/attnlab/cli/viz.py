"""``attnlab viz``: heatmaps, an offline HTML viewer, or the weights as text (see :mod:`attnlab.tools.viz`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from attnlab.tools.viz import demo_view, format_text, load_model_view, save_html, save_png


# --------------------------------------------------------------------------------------------
def _index_list(text: str) -> list[int]:
    try:
        out = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an index or a comma-separated list like 0,2, got {text!r}"
        ) from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one index")
    return out


SUFFIXES = (".png", ".svg", ".pdf", ".html", ".htm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Show attention weights: heatmaps (PNG/SVG/PDF), an offline HTML viewer, or numbers in the "
        "terminal. Without --checkpoint: the tutorials' six-word example, 'Your journey starts with "
        "one step'."
    )
    parser.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="a directory written by `attnlab train --out` (or one of its step directories)",
    )
    parser.add_argument("--prompt", metavar="TEXT", help="the text whose attention to show (needs --checkpoint)")
    parser.add_argument(
        "--bpe-dir", metavar="DIR", help="where GPT-2's BPE files are, if not where training found them"
    )
    parser.add_argument(
        "--layer", type=_index_list, metavar="N[,N...]", help="layer(s) to show, from 0; -1 is the last (default: all)"
    )
    parser.add_argument(
        "--head", type=_index_list, metavar="N[,N...]", help="head(s) to show, from 0; -1 is the last (default: all)"
    )
    parser.add_argument(
        "--out",
        metavar="FILE",
        help="write FILE.png (or .svg/.pdf): a grid of heatmaps; or FILE.html: an interactive page "
        "that works offline. Without --out the weights are printed.",
    )


def run(args: argparse.Namespace) -> int:
    if args.out is not None and not args.out.strip():  # "" must not quietly mean "print the text"
        raise ValueError(f"--out must name a file ending in one of {', '.join(SUFFIXES)}, got {args.out!r}")
    out = Path(args.out) if args.out else None
    if out is not None and out.suffix.lower() not in SUFFIXES:
        raise ValueError(f"--out must end in one of {', '.join(SUFFIXES)}, got {str(out)!r}")
    if args.checkpoint is None and args.prompt is not None:
        raise ValueError("--prompt needs --checkpoint DIR (the model to run it through)")
    if args.checkpoint is not None and not args.prompt:
        raise ValueError("--checkpoint needs --prompt TEXT (the text whose attention to show)")
    view = (
        demo_view() if args.checkpoint is None else load_model_view(args.checkpoint, args.prompt, bpe_dir=args.bpe_dir)
    )
    view = view.select(args.layer, args.head)
    if out is None:
        print(format_text(view))
        print("(--out FILE.png draws heatmaps; --out FILE.html writes a page to explore)")
        return 0
    if out.suffix.lower() in (".html", ".htm"):
        save_html(view, out)
    else:
        save_png(view, out)
    n = sum(layer.weights.shape[0] for layer in view.layers)
    rows = len(view.layers)
    print(f"wrote {out}: {n} attention map{'s' * (n != 1)} in {rows} row{'s' * (rows != 1)}, {len(view.tokens)} tokens")
    if n > 64 and out.suffix.lower() not in (".html", ".htm"):
        print("(a big grid: --layer and --head pick a few panels to see them larger)")
    return 0
