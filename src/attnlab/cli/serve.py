"""``attnlab serve``: the inspector as a live local web app (see :mod:`attnlab.tools.serve`)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from attnlab.cli.options import add_model_arguments, load_from_model_arguments
from attnlab.cli.viz import add_sae_arguments
from attnlab.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve the inspector as a live local web page: type a prompt and watch every head, the tutorials' steps, "
        "next-token probabilities (temperature/top-k/top-p), rollout, the logit lens and head roles follow; "
        "stream a generation token by token with its attention; ablate heads from the grid; patch activations "
        "(type a corrupted prompt, pick two answers: which heads and positions restore the answer); chat with an "
        "instruct model (its chat template) and open an answer in the inspector; with --sae, a token's strongest "
        "SAE latents, a latent's dashboard and steering. Binds 127.0.0.1 "
        "(this machine only) unless --host says otherwise. Needs: pip install 'attnlab[serve]'."
    )
    source = add_model_arguments(parser, what="the page opens with (default: 'Your journey starts with one step')")
    source.add_argument(
        "--demo",
        action="store_true",
        help="the tutorials' six-word example, 'Your journey starts with one step' (not a language model: no "
        "prompt box, generation or ablation)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (default: 8000)")
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, metavar="N", help="most tokens one generation may stream (256)"
    )
    parser.add_argument(
        "--max-body", type=int, default=256 << 10, metavar="BYTES", help="largest request body (default: 262144)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads for the model (default: one less than torch's default, at least 1: the browser and "
        "the server's event loop share the machine; on a busy machine with few cores, a thread per core makes "
        "requests many times slower)",
    )
    parser.add_argument(
        "--no-compile",
        action="store_true",
        help="decode generations with the eager fast path only (default: the compiled step, compiled in the "
        "background once the server listens: tens of seconds of CPU; generations run the fast path until then)",
    )
    add_sae_arguments(parser)
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's logging; info and debug also log each request (default: warning)",
    )


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_body < 1024:
        raise ValueError(f"--max-body must be at least 1024 bytes, got {args.max_body}")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    if args.checkpoint is None and args.model is None and not args.demo:
        raise ValueError("give the model to serve: --checkpoint DIR, --model NAME, or --demo")
    if args.demo and args.prompt is not None:
        raise ValueError("--prompt needs a language model (--checkpoint DIR or --model NAME), not --demo")
    if args.demo and args.sae:
        raise ValueError("--sae needs a language model (--checkpoint DIR or --model NAME), not --demo")
    if args.sae_data is not None and not args.sae:
        raise ValueError("--sae-data needs --sae DIR (the SAE whose latents' dashboards read it)")
    if args.sae_tokens < 1:
        raise ValueError(f"--sae-tokens must be a positive int, got {args.sae_tokens}")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError("attnlab serve needs FastAPI and uvicorn: pip install 'attnlab[serve]'") from None
    import torch

    from attnlab import hardware
    from attnlab.tools.loading import attach_saes, load_saes, model_name
    from attnlab.tools.serve import Engine, Limits, serve
    from attnlab.tools.viz import demo_view, view_to_dict
    from attnlab.tools.viz.inspector import check_sae_data, sae_corpus

    saes = load_saes(args.sae)  # a missing or bad SAE is refused before the model is read
    check_sae_data(args.sae_data)

    torch.set_num_threads(args.threads or max(1, torch.get_num_threads() - 1))
    limits = Limits(max_new_tokens=args.max_new_tokens, max_body_bytes=args.max_body)
    if args.demo:
        engine = Engine(demo=view_to_dict(demo_view()), limits=limits)
    else:

        def prepare() -> tuple[Any, Any]:
            loaded = load_from_model_arguments(args)
            attach_saes(saes, loaded.model)  # each SAE's hook point and width checked before serving
            corpus = None if args.sae_data is None else sae_corpus(loaded, args.sae_data, args.sae_tokens)
            return loaded, corpus

        # (on a thread that ends: the engine's model thread is then the one thread keeping OpenMP workers)
        loaded, corpus = hardware.on_own_thread(prepare)
        name = model_name(loaded)
        features = dict(saes=saes, sae_corpus=corpus, sae_corpus_name=Path(args.sae_data or "").name)
        try:
            engine = Engine(
                loaded, name=name, limits=limits, prompt=args.prompt, compile=not args.no_compile, **features
            )
        except ValueError as exc:
            raise ValueError(f"--prompt: {exc}") from None
    serve(engine, host=args.host, port=args.port, log_level=args.log_level)
    return 0
