"""The one loader: a trained run (or any directory holding a GPT) -> model, tokenizer, metadata.

Every command that reads a model (``attnlab generate``, ``attnlab viz``, ...) goes through
:func:`load_model`, so they all accept the same directories and say the same thing when one is
wrong. What it accepts:

* a training directory written by ``attnlab train --out DIR`` (follows ``latest.json``);
* one step directory inside it (``checkpoints/step-N``, holding ``checkpoint.json``);
* a :meth:`attnlab.GPT.save` directory with a ``tokenizer.json`` beside the weights (a
  :meth:`attnlab.tokenizers.Tokenizer.to_dict` description).

:func:`load_pretrained` reads published models instead (``attnlab generate --model``): a Hugging
Face GPT-2 or Llama-family model, from a directory or the Hub (its cache when offline), with its
own ``tokenizer.json``.

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
from attnlab.hf import read_pretrained_file
from attnlab.model import CONFIG_NAME, GPT
from attnlab.tokenizers import HFTokenizer, Tokenizer, tokenizer_from_dict
from attnlab.training.checkpoint import CHECKPOINT_NAME, LATEST_NAME, load_checkpoint

__all__ = ["TOKENIZER_NAME", "LoadedModel", "load_model", "load_pretrained"]

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
    if (d / LATEST_NAME).is_file() or (d / CHECKPOINT_NAME).is_file():
        ckpt = load_checkpoint(d, device=device, load_optimizer=False)
        if "tokenizer" not in ckpt.metadata:
            raise ValueError(f"{what} {d}: its {CHECKPOINT_NAME} records no tokenizer")
        tokenizer = tokenizer_from_dict(ckpt.metadata["tokenizer"], bpe_dir=bpe_dir)
        return LoadedModel(ckpt.model.eval(), tokenizer, ckpt.path, ckpt.metadata)
    tok_path = d / TOKENIZER_NAME
    if not (d / CONFIG_NAME).is_file() or not tok_path.is_file():
        raise FileNotFoundError(
            f"{what} {d}: not a checkpoint (expected {LATEST_NAME} or {CHECKPOINT_NAME} as written by "
            f"`attnlab train`, or {CONFIG_NAME} and {TOKENIZER_NAME} beside GPT.save()'s weights)"
        )
    tokenizer = tokenizer_from_dict(read_json(tok_path, "tokenizer description"), bpe_dir=bpe_dir)
    return LoadedModel(GPT.load(d, device=device).eval(), tokenizer, d)


def load_pretrained(
    name: str,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    what: str = "--model",
) -> LoadedModel:
    """A published model and its tokenizer: :meth:`GPT.from_pretrained` (GPT-2 or Llama-family,
    a directory or a Hub repository id) and the model's ``tokenizer.json`` as an
    :class:`~attnlab.tokenizers.HFTokenizer` (end-of-text from its ``tokenizer_config.json``,
    ``generation_config.json`` or ``config.json``, fetched beside it).

    ``dtype`` defaults to float32 on the CPU (bfloat16 weights run slowly there) and to the weights'
    own dtype elsewhere.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    if dtype is None and device.type == "cpu":
        dtype = torch.float32
    model = GPT.from_pretrained(name, device=device, dtype=dtype)
    tok_path = read_pretrained_file(name, "tokenizer.json")
    if tok_path is None:
        raise FileNotFoundError(f"{what} {name}: no tokenizer.json beside the weights (a Hugging Face tokenizer)")
    for extra in ("tokenizer_config.json", "generation_config.json"):  # into the same folder (the cache's)
        read_pretrained_file(name, extra)
    tokenizer = HFTokenizer(tok_path)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"{what} {name}: its tokenizer has {tokenizer.vocab_size} ids, more than the model's "
            f"vocab_size={model.config.vocab_size}"
        )
    return LoadedModel(model.eval(), tokenizer, Path(tok_path).parent)
