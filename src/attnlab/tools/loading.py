"""The one loader: a trained run, a GPT-2, or the tutorials' example -> model, tokenizer, metadata.

Every command that reads a model (``attnlab generate``, ``attnlab viz``, ``attnlab inspect``, ...)
goes through this module, so they all accept the same things and say the same thing when one is
wrong. :func:`load_model` reads a directory of attnlab's:

* a training directory written by ``attnlab train --out DIR`` (follows ``latest.json``);
* one step directory inside it (``checkpoints/step-N``, holding ``checkpoint.json``);
* a :meth:`attnlab.GPT.save` directory with a ``tokenizer.json`` beside the weights (a
  :meth:`attnlab.tokenizers.Tokenizer.to_dict` description).

:func:`load_pretrained` reads published models: OpenAI's GPT-2 (``gpt2``, ``gpt2-medium``, ...) or a
Llama-family model (Llama, Mistral), from the Hugging Face cache (downloading once when online) or a
local Hugging Face directory (``config.json`` + safetensors weights, as ``save_pretrained`` writes),
with the model's own ``tokenizer.json`` or, for a GPT-2 without one, GPT-2's byte-pair tokenizer. :func:`load` picks one
of the two from command-line style arguments. :func:`load_demo` gives the tutorials' six-word
example: "Your journey starts with one step" and the modules of "A simple self-attention mechanism"
under the tutorial's seeds.

Weights are safetensors and metadata JSON: nothing is ever unpickled, and the optimizer state a
training checkpoint carries is neither read nor hashed here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnlab import attention
from attnlab.files import read_json
from attnlab.formats.chat import ChatTemplate
from attnlab.formats.hf import PRETRAINED, read_pretrained_file
from attnlab.functional import simple_self_attention
from attnlab.model import CONFIG_NAME, GPT
from attnlab.tokenizers import GPT2Tokenizer, HFTokenizer, Tokenizer, tokenizer_from_dict
from attnlab.training.checkpoint import CHECKPOINT_NAME, LATEST_NAME, load_checkpoint

__all__ = ["TOKENIZER_NAME", "Demo", "LoadedModel", "load", "load_demo", "load_model", "load_pretrained"]

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
    chat_template: ChatTemplate | None = None  # attnlab.formats.chat.ChatTemplate, with bos/eos tokens set
    stop_ids: tuple[int, ...] = ()  # end-of-turn / end-of-text token ids generation stops at


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
        ckpt = load_checkpoint(d, device=device, load_optimizer=False, merge_adapters=True)
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


def load_pretrained(
    name: str,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    bpe_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    what: str = "--model",
) -> LoadedModel:
    """A published model and its tokenizer, through :meth:`GPT.from_pretrained`.

    ``name`` is OpenAI's GPT-2 (``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``), another Hub
    repository of a GPT-2 or a Llama-family model, or a local Hugging Face directory. The weights come
    from the Hugging Face cache (``$HF_HOME``; downloaded once when online; set ``HF_HUB_OFFLINE=1`` to
    never try the network). The tokenizer is, in this order: GPT-2's byte-pair tokenizer when
    ``bpe_dir`` is given; the model's ``tokenizer.json`` through the ``tokenizers`` library
    (end-of-text from ``tokenizer_config.json``, ``generation_config.json`` or ``config.json``);
    for a GPT-2 without one, GPT-2's byte-pair tokenizer from the model's directory (when it holds
    ``encoder.json`` and ``vocab.bpe``), ``$ATTNLAB_GPT2_BPE_DIR`` or tiktoken's cache.

    ``dtype`` defaults to float32 on the CPU (bfloat16 weights run slowly there) and to the weights'
    own dtype elsewhere.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(
            f"{what} must name a published model ({', '.join(PRETRAINED)}, ...) or a directory, got {name!r}"
        )
    local = Path(name).expanduser()
    is_local = name.lower() not in PRETRAINED and local.is_dir()  # a published name always means the Hub's
    if not is_local and name.lower() not in PRETRAINED and (os.sep in name or name.startswith(".")):
        raise FileNotFoundError(f"{what} {name}: no such directory")
    device = torch.device("cpu") if device is None else torch.device(device)
    if dtype is None and device.type == "cpu":
        dtype = torch.float32
    model = GPT.from_pretrained(name, cache_dir=cache_dir, device=device, dtype=dtype).eval()
    tok_path = None if bpe_dir is not None else read_pretrained_file(name, "tokenizer.json", cache_dir=cache_dir)
    if tok_path is not None:
        for extra in ("tokenizer_config.json", "generation_config.json"):  # into the same folder (the cache's)
            read_pretrained_file(name, extra, cache_dir=cache_dir)
        tokenizer: Tokenizer = HFTokenizer(tok_path)
    elif model.config.pos == "learned":  # a GPT-2: its byte-pair encoding
        if bpe_dir is None and is_local and (local / "encoder.json").is_file() and (local / "vocab.bpe").is_file():
            bpe_dir = local
        tokenizer = GPT2Tokenizer(bpe_dir=bpe_dir)
    else:
        raise FileNotFoundError(f"{what} {name}: no tokenizer.json beside the weights (a Hugging Face tokenizer)")
    if tokenizer.vocab_size > model.config.vocab_size:
        if isinstance(tokenizer, GPT2Tokenizer):
            raise ValueError(
                f"{what} {name}: the model has {model.config.vocab_size} token ids, fewer than GPT-2's tokenizer "
                f"({tokenizer.vocab_size}); only GPT-2-vocabulary models can be read with it"
            )
        raise ValueError(
            f"{what} {name}: its tokenizer has {tokenizer.vocab_size} ids, more than the model's "
            f"vocab_size={model.config.vocab_size}"
        )
    source = "local" if is_local else "huggingface"
    return LoadedModel(model, tokenizer, local.resolve() if is_local else Path(name), {"source": source, "name": name})


def load(
    checkpoint: str | os.PathLike[str] | None = None,
    model: str | None = None,
    *,
    device: torch.device | str | None = None,
    bpe_dir: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """``--checkpoint DIR`` (:func:`load_model`) or ``--model NAME`` (:func:`load_pretrained`): exactly one."""
    if (checkpoint is None) == (model is None):
        raise ValueError("give one of --checkpoint DIR (an attnlab model) or --model NAME (gpt2, or a directory)")
    if checkpoint is not None:
        return load_model(checkpoint, device=device, bpe_dir=bpe_dir)
    return load_pretrained(model, device=device, bpe_dir=bpe_dir)


@dataclass
class Demo:
    """The tutorials' six-word example (:func:`load_demo`).

    Attributes:
        words: "Your journey starts with one step", one word per token.
        inputs: ``(6, 3)`` their embeddings, as printed in "A simple self-attention mechanism".
        modules: ``(name, module)`` rows: parameter-free attention (``simple_self_attention``),
            ``SelfAttention_v2`` (seed 789), ``CausalAttention`` with the same weights (seed 789), the
            stacked-heads wrapper and the weight-split ``MultiHeadAttention`` (seed 123, ``d_out=2``,
            two heads), each in eval mode.
    """

    words: list[str]
    inputs: torch.Tensor
    modules: list[tuple[str, Any]]


def load_demo() -> Demo:
    """The six words of "A simple self-attention mechanism" and its modules, built under its seeds.

    The global random state is left as it was."""
    from attnlab.tutorial_code import INPUTS, WORDS

    T, d_in, d_out = INPUTS.shape[0], INPUTS.shape[1], 2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(789)
        sa = attention.SelfAttention_v2(d_in, d_out)
        torch.manual_seed(789)  # the same draws as SelfAttention_v2: the tutorial masks those weights
        ca = attention.CausalAttention(d_in, d_out, T, 0.0).eval()
        torch.manual_seed(123)
        wrap = attention.MultiHeadAttentionWrapper(d_in, d_out, T, 0.0, num_heads=2).eval()
        torch.manual_seed(123)
        mha = attention.MultiHeadAttention(d_in, d_out, T, 0.0, num_heads=2).eval()
    modules = [
        ("simple self-attention: softmax(x·xᵀ)", simple_self_attention),
        ("SelfAttention_v2 (seed 789)", sa),
        ("CausalAttention (seed 789)", ca),
        ("MultiHeadAttentionWrapper (seed 123)", wrap),
        ("MultiHeadAttention (seed 123)", mha),
    ]
    return Demo(list(WORDS), INPUTS.clone(), modules)
