"""The one loader: a trained run (or any directory holding a GPT) -> model, tokenizer, metadata.

Every command that reads a model (``attnlab generate``, ``attnlab viz``, ...) goes through
:func:`load_model`, so they all accept the same directories and say the same thing when one is
wrong. What it accepts:

* a training directory written by ``attnlab train --out DIR`` (follows ``latest.json``);
* one step directory inside it (``checkpoints/step-N``, holding ``checkpoint.json``);
* a :meth:`attnlab.GPT.save` directory with a ``tokenizer.json`` beside the weights (a
  :meth:`attnlab.tokenizers.Tokenizer.to_dict` description).

Weights are safetensors and metadata JSON: nothing is ever unpickled, and the optimizer state a
training checkpoint carries is neither read nor hashed here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnlab.files import read_json
from attnlab.model import CONFIG_NAME, GPT
from attnlab.tokenizers import Tokenizer, tokenizer_from_dict
from attnlab.training.checkpoint import CHECKPOINT_NAME, LATEST_NAME, load_checkpoint

__all__ = ["TOKENIZER_NAME", "LoadedModel", "load_model"]

TOKENIZER_NAME = "tokenizer.json"  # beside GPT.save()'s files: how its token ids are read


@dataclass
class LoadedModel:
    """What :func:`load_model` returns.

    Attributes:
        model: the :class:`~attnlab.GPT`, in eval mode.
        tokenizer: the tokenizer it was trained with.
        path: the directory its weights came from (a step directory for a training run).
        metadata: ``checkpoint.json`` of a training run (step, settings, ...); empty otherwise.
    """

    model: GPT
    tokenizer: Tokenizer
    path: Path
    metadata: dict[str, Any] = field(default_factory=dict)


def load_model(
    directory: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    bpe_dir: str | os.PathLike[str] | None = None,
    what: str = "--checkpoint",
) -> LoadedModel:
    """Load the model and tokenizer in ``directory`` (see the module docstring for what it accepts).

    Args:
        directory: a training ``--out`` directory, one of its step directories, or a ``GPT.save()``
            directory with a ``tokenizer.json``.
        device: where to put the model (default: the CPU).
        bpe_dir: where GPT-2's BPE files are, if not where training found them.
        what: how error messages name ``directory`` (the CLI flag that gave it).

    Raises ``FileNotFoundError`` / ``ValueError`` naming the directory and what is wrong with it.
    """
    d = Path(directory).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"{what} {d}: checkpoint not found (no such directory)")
    # lexists, not is_file: a latest.json that is a FIFO or a link to /dev/zero is reported as such
    # (the readers take regular files only), not taken for "no checkpoint here".
    if os.path.lexists(d / LATEST_NAME) or os.path.lexists(d / CHECKPOINT_NAME):
        ckpt = load_checkpoint(d, device=device, load_optimizer=False)
        if "tokenizer" not in ckpt.metadata:
            raise ValueError(f"{what} {d}: its {CHECKPOINT_NAME} records no tokenizer")
        tokenizer = tokenizer_from_dict(ckpt.metadata["tokenizer"], bpe_dir=bpe_dir)
        return LoadedModel(ckpt.model.eval(), tokenizer, ckpt.path, ckpt.metadata)
    tok_path = d / TOKENIZER_NAME
    if not os.path.lexists(d / CONFIG_NAME) or not os.path.lexists(tok_path):
        raise FileNotFoundError(
            f"{what} {d}: not a checkpoint (expected {LATEST_NAME} or {CHECKPOINT_NAME} as written by "
            f"`attnlab train`, or {CONFIG_NAME} and {TOKENIZER_NAME} beside GPT.save()'s weights)"
        )
    tokenizer = tokenizer_from_dict(read_json(tok_path, "tokenizer description"), bpe_dir=bpe_dir)
    return LoadedModel(GPT.load(d, device=device).eval(), tokenizer, d)
