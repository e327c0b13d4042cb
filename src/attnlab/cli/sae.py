"""``attnlab sae``: train, measure and inspect sparse autoencoders and transcoders.

Examples::

    attnlab sae train --model SmolLM2-135M-Instruct.Q4_1.gguf --hook blocks.15.hook_resid_post \\
        --data input.txt --arch topk --k 32 --tokens 2000000 --out runs/sae
    attnlab sae train --model M.gguf --hook blocks.3.hook_resid_mid --hook-out blocks.3.hook_mlp_out \\
        --skip --out runs/transcoder                       # a transcoder: the MLP's input to its output
    attnlab sae eval --sae runs/sae/sae --model M.gguf --data input.txt
    attnlab sae info runs/sae/sae
    attnlab sae dashboard --model M.gguf --sae runs/sae/sae --data input.txt --latents 1000 --out latents.html

An SAE is read from SAELens's directory (cfg.json + sae_weights.safetensors), sparsify's (cfg.json +
sae.safetensors), Gemma Scope's params.npz or a Hugging Face Hub id. Training resumes when --out
holds a run; stop it with Ctrl-C or SIGTERM (it saves first; exit status 130 / 143).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from attnlab.checks import resolve_device
from attnlab.cli.options import MODEL_SOURCES, add_threads_argument, at_most, check_out_file, seed

DEFAULT_CONTEXT = 128
CONTEXT_HELP = f"(default {DEFAULT_CONTEXT}, or the model's context where shorter)"
HELP_TRAIN = "train an SAE (or, with --hook-out, a transcoder) on a model's activations"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Sparse autoencoders and transcoders: train, measure, inspect."
    sub = parser.add_subparsers(dest="sae_command", metavar="ACTION", required=True)

    t = sub.add_parser("train", help=HELP_TRAIN, description=HELP_TRAIN)
    _add_model_source(t, "the model whose activations to learn")
    t.add_argument("--hook", required=True, metavar="NAME", help="the hook point read, e.g. blocks.6.hook_resid_post")
    t.add_argument(
        "--hook-out",
        metavar="NAME",
        help="a transcoder's output hook, e.g. blocks.6.hook_mlp_out (with --hook at resid_mid)",
    )
    t.add_argument("--skip", action="store_true", help="a transcoder with a linear skip connection")
    t.add_argument("--data", metavar="PATH", help="UTF-8 text to read (default: the built-in corpus)")
    t.add_argument(
        "--arch", default="topk", choices=("topk", "batchtopk", "jumprelu"), help="the activation (default topk)"
    )
    t.add_argument(
        "--width", type=at_most(1 << 24), metavar="N", help="number of latents (default: 16 x the hook's width)"
    )
    t.add_argument("--k", type=int, default=32, help="latents kept per token for topk/batchtopk (default 32)")
    t.add_argument("--tokens", type=int, default=1_000_000, metavar="N", help="activations to train on (default 1M)")
    t.add_argument("--batch-rows", type=int, default=1024, metavar="N", help="activations per step (default 1024)")
    t.add_argument(
        "--buffer-rows",
        type=int,
        default=32768,
        metavar="N",
        help="the shuffled buffer's size in activations (default 32768)",
    )
    t.add_argument("--context", type=int, metavar="T", help=f"tokens per window the model reads {CONTEXT_HELP}")
    t.add_argument(
        "--outlier-ratio",
        type=float,
        default=10.0,
        metavar="R",
        help="leave out activations whose norm is above R x the median (massive activations); 0 keeps all (default 10)",
    )
    t.add_argument("--lr", type=float, help="Adam's learning rate (default: 2e-4 / sqrt(width / 16384), sparsify's)")
    t.add_argument(
        "--dead-tokens", type=int, default=250_000, metavar="N", help="a latent silent this long is dead (default 250k)"
    )
    t.add_argument("--seed", type=seed, default=0)
    t.add_argument(
        "--save-every", type=int, default=500, metavar="STEPS", help="steps between checkpoints (default 500)"
    )
    t.add_argument("--out", required=True, metavar="DIR", help="the run directory (resumed when it holds a run)")
    t.add_argument("--device", default="cpu", metavar="DEV", help="cpu (default), cuda, cuda:N or mps")
    t.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the model's weights while it computes the activations (the SAE trains in float32); default "
        "float32, bfloat16 is faster where the CPU computes it natively",
    )
    t.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")

    e = sub.add_parser("eval", help="measure an SAE: L0, explained variance, dead latents, CE recovered, KL")
    e.add_argument("--sae", required=True, metavar="PATH", help="an SAE directory, params.npz or Hub id")
    _add_model_source(e, "the model")
    e.add_argument(
        "--hook", metavar="NAME", help="the hook point (default: the one the SAE's files name; this overrides it)"
    )
    e.add_argument(
        "--hook-out", metavar="NAME", help="a transcoder's output hook (default: its files'; this overrides it)"
    )
    e.add_argument("--data", metavar="PATH", help="UTF-8 text to measure on (default: the built-in corpus)")
    e.add_argument("--tokens", type=int, default=8192, metavar="N", help="tokens to measure on (default 8192)")
    e.add_argument("--context", type=int, metavar="T", help=f"tokens per window {CONTEXT_HELP}")
    e.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    e.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")

    d = sub.add_parser(
        "dashboard",
        help="write an offline page of latent dashboards: top contexts, histogram, density, promoted tokens",
    )
    _add_model_source(d, "the model")
    d.add_argument("--sae", required=True, metavar="PATH", help="an SAE directory, params.npz or Hub id")
    d.add_argument(
        "--hook", metavar="NAME", help="the hook point (default: the one the SAE's files name; this overrides it)"
    )
    d.add_argument(
        "--hook-out", metavar="NAME", help="a transcoder's output hook (default: its files'; this overrides it)"
    )
    d.add_argument("--data", metavar="PATH", help="UTF-8 text to read (default: the built-in corpus)")
    d.add_argument(
        "--latents", type=int, metavar="N", help="the first N latents (default 100, or every one of a smaller SAE)"
    )
    d.add_argument("--tokens", type=int, default=1_000_000, metavar="N", help="tokens to read (default 1M)")
    d.add_argument("--context", type=int, metavar="T", help=f"tokens per window {CONTEXT_HELP}")
    d.add_argument(
        "--top", type=at_most(1000), default=10, metavar="K", help="top-activating contexts per latent (default 10)"
    )
    d.add_argument("--out", required=True, metavar="PAGE", help="the HTML page to write")
    d.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the model's weights (the SAE runs in float32); default float32, bfloat16 is faster where the CPU "
        "computes it natively",
    )
    d.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")

    i = sub.add_parser("info", help="show an SAE's configuration (its files checked)")
    i.add_argument("sae", metavar="PATH", help="an SAE directory, params.npz or Hub id")


def run(args: argparse.Namespace) -> int:
    return {"train": _train, "eval": _eval, "info": _info, "dashboard": _dashboard}[args.sae_command](args)


def _info(args: argparse.Namespace) -> int:
    from attnlab.interpret.sae import SAE, cfg_dict

    sae = SAE.load(args.sae)
    print(json.dumps(cfg_dict(sae.cfg), indent=2))
    return 0


def _train(args: argparse.Namespace) -> int:
    import torch

    from attnlab.data import tokenize_to_cache
    from attnlab.tools.loading import model_name
    from attnlab.training.sae import SAETrainConfig, SAETrainer

    cfg = SAETrainConfig(
        hook=args.hook,
        hook_out=args.hook_out,
        architecture=args.arch,
        width=args.width,
        k=args.k,
        skip=args.skip,
        tokens=args.tokens,
        batch_rows=args.batch_rows,
        buffer_rows=args.buffer_rows,
        context=DEFAULT_CONTEXT if args.context is None else args.context,
        outlier_ratio=args.outlier_ratio,
        lr=args.lr,
        dead_tokens=args.dead_tokens,
        seed=args.seed,
        save_every=args.save_every,
    )  # settings checked before the model is read
    # Dense weights: a matrix kept in a GGUF file's blocks would be dequantized again for every
    # forward into the buffer (most of a fill's time on SmolLM2's Q4_1), as in `sae dashboard`.
    device, dtype = resolve_device(args.device), getattr(torch, args.dtype)
    loaded = _load(args, device=device, dtype=dtype)
    if args.context is None and loaded.model.config.context_length < cfg.context:  # (a small model's context)
        cfg = dataclasses.replace(cfg, context=loaded.model.config.context_length)
    tokens = tokenize_to_cache(args.data, loaded.tokenizer)
    trainer = SAETrainer(loaded.model, tokens, cfg, args.out, model_name=model_name(loaded), progress=args.progress)
    try:
        trainer.fit()
    except KeyboardInterrupt:
        if trainer.stopped is None:  # a second Ctrl-C: aborted at once
            raise
        return 128 + trainer.stopped  # 130 / 143, as attnlab train
    return 0


def _add_model_source(parser: argparse.ArgumentParser, what: str) -> None:
    """``--model NAME | --checkpoint DIR`` (one of them), and ``--threads`` for the model's work."""
    add_threads_argument(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", metavar="NAME", help=f"{what}: {MODEL_SOURCES}")
    source.add_argument(
        "--checkpoint",
        metavar="DIR",
        help=f"or {what} as an attnlab model: a training run's --out (or a step directory), or GPT.save() plus a "
        "tokenizer.json",
    )


def _load(args: argparse.Namespace, device: Any = None, dtype: Any = None) -> Any:
    """The model ``--model`` (in ``dtype``) or ``--checkpoint`` (in the dtype it was saved in) names."""
    from attnlab.tools.loading import load

    return load(args.checkpoint, args.model, device=device, dtype=None if args.checkpoint else dtype)


def _check_positive(args: argparse.Namespace, *names: str) -> None:
    """Each ``--name`` a positive int, or one ValueError naming the flag (before anything is read)."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name} must be a positive int, got {value}")


def _check_context(args: argparse.Namespace, model: Any) -> None:
    """``--context`` within the model's context (as ``sae train`` checks it), or one ValueError; not given:
    the default, or the model's context where shorter."""
    longest = model.config.context_length
    if args.context is None:
        args.context = min(DEFAULT_CONTEXT, longest)
        _check_windows(args)
    elif args.context > longest:
        raise ValueError(f"--context {args.context} is longer than the model's context of {longest} tokens")


def _check_windows(args: argparse.Namespace) -> None:
    """``--context`` and ``--tokens`` (one window at least), where ``--context`` is known."""
    if args.context is None:  # (the model's context decides it: checked once it is read)
        return
    _check_positive(args, "context")
    if args.context < 2:  # (found only after the progress bar had started)
        raise ValueError(f"--context must be at least 2 tokens (a next token to predict), got {args.context}")
    if args.tokens < args.context:  # (it measured one whole window, silently)
        raise ValueError(f"--tokens {args.tokens} is less than one window of --context {args.context}")


def _eval(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from attnlab.data import tokenize_to_cache
    from attnlab.interpret.sae import SAE, evaluate_sae

    _check_positive(args, "tokens")
    _check_windows(args)
    sae = SAE.load(args.sae, hook_name=args.hook, hook_name_out=args.hook_out)  # (before the model is read)
    loaded = _load(args)
    sae.check_model(loaded.model)
    _check_context(args, loaded.model)
    ids = np.asarray(tokenize_to_cache(args.data, loaded.tokenizer))
    n = min(len(ids) // args.context, max(1, args.tokens // args.context))
    if n < 1:
        raise ValueError(f"--data has {len(ids)} tokens, fewer than one window of --context {args.context}")
    windows = torch.from_numpy(ids[: n * args.context].astype(np.int64)).view(n, args.context)
    bar = _bar(windows.numel(), "evaluating") if args.progress else None
    advance = None if bar is None else lambda n: bar.update(n - bar.n)
    try:
        result = evaluate_sae(loaded.model, sae, windows, progress=advance)
    finally:
        if bar is not None:
            bar.close()
    figures = result.as_dict()
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:>20}: {value:.6g}" if isinstance(value, float) else f"{key:>20}: {value}")
    sys.stdout.flush()
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    import torch

    from attnlab.data import tokenize_to_cache
    from attnlab.interpret.sae import SAE
    from attnlab.interpret.sae_view import dashboard_data, save_dashboard

    _check_positive(args, *(["latents"] if args.latents is not None else []), "tokens")  # (--top: its type)
    _check_windows(args)
    check_out_file(args.out, (".html", ".htm"))  # (a page, as viz, patch and circuit write)
    sae = SAE.load(args.sae, hook_name=args.hook, hook_name_out=args.hook_out)  # (before the model is read)
    if args.latents is None:
        args.latents = min(100, sae.cfg.d_sae)
    if args.latents > sae.cfg.d_sae:
        raise ValueError(f"--latents must be at most the SAE's d_sae={sae.cfg.d_sae}, got {args.latents}")
    # Dense weights: a matrix kept in a file's blocks would be dequantized again for every batch.
    loaded = _load(args, dtype=getattr(torch, args.dtype))
    sae.check_model(loaded.model)
    _check_context(args, loaded.model)
    ids = tokenize_to_cache(args.data, loaded.tokenizer)
    if len(ids) < args.context:
        raise ValueError(f"--data has {len(ids)} tokens, fewer than one window of --context {args.context}")
    total = min(len(ids), args.tokens) // args.context * args.context
    bar = _bar(total) if args.progress else None

    def progress(tokens: int) -> None:
        if bar is not None:
            bar.update(tokens - bar.n)

    try:
        data = dashboard_data(
            loaded.model,
            sae,
            ids,
            loaded.tokenizer,
            args.latents,
            max_tokens=args.tokens,
            context=args.context,
            top_k=args.top,
            progress=progress,
        )
    finally:
        if bar is not None:
            bar.close()
    path = save_dashboard(data, args.out)
    print(f"wrote {path}: {args.latents} latents over {data['tokens']:,} tokens")
    return 0


def _bar(total: int, desc: str = "dashboards") -> Any:  # a tqdm bar, or None where tqdm is not installed
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="tok", unit_scale=True, file=sys.stderr, desc=desc)
