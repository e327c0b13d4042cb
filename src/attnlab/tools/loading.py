"""The one loader: a trained run, a GPT-2, or the tutorials' example -> model, tokenizer, metadata.

Every command that reads a model (``attnlab generate``, ``viz``, ``inspect``, ...) goes through this
module, so they all accept the same things and say the same thing when one is wrong.
:func:`load_model` reads attnlab's directories: a training directory (``attnlab train --out DIR``),
one of its step directories, or a :meth:`attnlab.GPT.save` directory with a ``tokenizer.json``
(a :meth:`~attnlab.tokenizers.Tokenizer.to_dict` description) beside the weights.
:func:`load_pretrained` reads published models (GPT-2 and the families ``GPT.from_hf`` reads), from
the Hugging Face cache or a local directory, or a GGUF file. :func:`load` picks one of the two from
command-line style arguments; :func:`load_demo` gives the tutorials' six-word example.

Weights are safetensors and metadata JSON: nothing is ever unpickled, and the optimizer state a
training checkpoint carries is neither read nor hashed here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attnlab import attention, hardware
from attnlab.checks import check_device, is_int
from attnlab.files import read_json
from attnlab.formats.chat import TURN_ENDS, ChatTemplate, read_chat_template
from attnlab.formats.gguf import is_gguf, read_gguf
from attnlab.formats.hf import PRETRAINED, is_local_path, read_pretrained_file
from attnlab.functional import simple_self_attention
from attnlab.model import CONFIG_NAME, GPT
from attnlab.tokenizers import GPT2Tokenizer, HFTokenizer, Tokenizer, tokenizer_from_dict
from attnlab.training.checkpoint import CHECKPOINT_NAME, CHECKPOINTS_DIR, LATEST_NAME, STEP_DIR, load_checkpoint

__all__ = [
    "CHAT_NAME",
    "TOKENIZER_NAME",
    "Demo",
    "LoadedModel",
    "attach_saes",
    "load",
    "load_demo",
    "load_gguf",
    "load_model",
    "load_pretrained",
    "load_saes",
]

TOKENIZER_NAME = "tokenizer.json"  # beside GPT.save()'s files: how its token ids are read
CHAT_NAME = "chat.json"  # beside GPT.save()'s files (--merge): chat_template and stop_ids, where known


@dataclass
class LoadedModel:
    """What :func:`load_model`, :func:`load_pretrained` and :func:`load_gguf` return."""

    model: GPT  # in eval mode
    tokenizer: Tokenizer
    path: Path  # the directory its weights came from (a step directory for a training run)
    metadata: dict[str, Any] = field(default_factory=dict)  # a training run's checkpoint.json; else the source
    chat_template: ChatTemplate | None = None  # an instruct model's conversation format
    stop_ids: tuple[int, ...] = ()  # the end-of-turn / end-of-text ids generation stops at


def load_model(
    directory: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    bpe_dir: str | os.PathLike[str] | None = None,
    what: str = "directory",
) -> LoadedModel:
    """Load the model and tokenizer in ``directory`` (see the module docstring for what it accepts).

    ``device``: where to put the model (default: the CPU); ``bpe_dir``: where GPT-2's BPE files are,
    if not where training found them; ``what``: how errors (``FileNotFoundError`` / ``ValueError``)
    name ``directory`` (the CLI flag that gave it).
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"{what} must be a directory's path (str or os.PathLike), got {type(directory).__name__}")
    d = Path(directory).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"{what} {d}: checkpoint not found (no such directory)")
    # lexists, not is_file: a latest.json that is a FIFO or a link to /dev/zero is reported as such
    # (the readers take regular files only), not taken for "no checkpoint here".
    if os.path.lexists(d / LATEST_NAME) or os.path.lexists(d / CHECKPOINT_NAME):
        ckpt = load_checkpoint(d, device=device, load_optimizer=False, merge_adapters=True)
        if "tokenizer" not in ckpt.metadata:
            raise ValueError(f"{what} {d}: its {CHECKPOINT_NAME} records no tokenizer")
        tokenizer = tokenizer_from_dict(ckpt.metadata["tokenizer"], bpe_dir=bpe_dir, base_dir=ckpt.path)
        template, stops = _saved_chat(ckpt.metadata, tokenizer, f"{what} {d}")
        return LoadedModel(ckpt.model.eval(), tokenizer, ckpt.path, ckpt.metadata, template, stops)
    tok_path = d / TOKENIZER_NAME
    if "model_type" in _config(d):  # Hugging Face's (its tokenizer.json is not attnlab's description of one)
        raise ValueError(
            f"{what} {d}: a Hugging Face model directory (its {CONFIG_NAME} names a model_type): use --model"
        )
    if not os.path.lexists(d / CONFIG_NAME) or not os.path.lexists(tok_path):
        raise FileNotFoundError(
            f"{what} {d}: not a checkpoint (expected {LATEST_NAME} or {CHECKPOINT_NAME} as written by "
            f"`attnlab train`, or {CONFIG_NAME} and {TOKENIZER_NAME} beside GPT.save()'s weights)"
        )
    tokenizer = tokenizer_from_dict(read_json(tok_path, "tokenizer description"), bpe_dir=bpe_dir, base_dir=d)
    saved = read_json(d / CHAT_NAME, "chat settings") if os.path.lexists(d / CHAT_NAME) else {}
    if not isinstance(saved, dict):
        raise ValueError(f"{what} {d}: {CHAT_NAME} must be a JSON object")
    template, stops = _saved_chat(saved, tokenizer, f"{what} {d}")
    model = GPT.load(d, device=device).eval()
    if tokenizer.vocab_size > model.config.vocab_size:  # (a checkpoint's pair was checked when it was trained)
        raise ValueError(
            f"{what} {d}: its {TOKENIZER_NAME} has {tokenizer.vocab_size} ids, more than the model's "
            f"vocab_size={model.config.vocab_size}"
        )
    return LoadedModel(model, tokenizer, d, {}, template, stops)


def _saved_chat(saved: dict[str, Any], tokenizer: Tokenizer, what: str) -> tuple[ChatTemplate | None, tuple[int, ...]]:
    """A fine-tuned model's chat template and stop ids, as its checkpoint metadata or ``chat.json`` records
    them (an ``--init-from`` run keeps its base model's); none recorded: no template, the tokenizer's eos."""
    from attnlab.training.chat_data import template_from_dict

    template = None
    if saved.get("chat_template") is not None:
        try:
            template = template_from_dict(saved["chat_template"])
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
    stops = saved.get("stop_ids") or []
    if not isinstance(stops, list) or not all(is_int(i) and 0 <= i < tokenizer.vocab_size for i in stops):
        raise ValueError(f"{what}: its stop_ids must be a list of token ids in [0, {tokenizer.vocab_size})")
    return template, _with_eot(stops, tokenizer)


def _turn_ends(tokenizer: HFTokenizer) -> list[int]:
    """The ids of the tokenizer's special tokens among :data:`TURN_ENDS`, found by their text as llama.cpp
    finds them: its converter leaves tokenizer.ggml.eot_token_id out of Gemma's and Phi-3's files."""
    return [i for i, text in tokenizer.special_tokens().items() if text in TURN_ENDS]


def _with_eot(ids: list[int], tokenizer: Tokenizer) -> tuple[int, ...]:
    """``ids`` and the tokenizer's end-of-text id, each once."""
    eot = [] if tokenizer.eot_id is None else [tokenizer.eot_id]
    return tuple(dict.fromkeys(int(i) for i in [*ids, *eot]))


def load_pretrained(
    name: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    bpe_dir: str | os.PathLike[str] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    what: str = "model",
) -> LoadedModel:
    """A published model and its tokenizer, through :meth:`GPT.from_pretrained`.

    ``name`` is OpenAI's GPT-2 (``gpt2``, ``gpt2-medium``, ...), another Hub repository of a family
    :meth:`GPT.from_hf` reads, a local Hugging Face directory, or a GGUF file (:func:`load_gguf`).
    The weights come from the Hugging Face cache (downloaded once when online; ``HF_HUB_OFFLINE=1``
    never tries the network). The tokenizer: GPT-2's byte-pair tokenizer when ``bpe_dir`` is given,
    else the model's ``tokenizer.json``, else (a GPT-2) GPT-2's from the model's directory,
    ``$ATTNLAB_GPT2_BPE_DIR`` or tiktoken's cache. ``dtype`` defaults to
    :func:`attnlab.hardware.inference_dtype` (half precision where the device computes it natively).
    An instruct model's chat template and stop ids fill ``chat_template`` and ``stop_ids``.
    """
    name = os.fspath(name) if isinstance(name, os.PathLike) else name
    if not isinstance(name, str) or not name.strip():
        raise ValueError(
            f"{what} must name a published model ({', '.join(PRETRAINED)}, ...), a directory or a GGUF file, "
            f"got {name!r}"
        )
    device = check_device("device", device)  # (before anything is read)
    local, published = Path(name).expanduser(), name.lower() in PRETRAINED  # a published name means the Hub's
    if not published and is_gguf(local):
        return load_gguf(local, device=device, dtype=dtype, what=what)
    is_local = not published and local.is_dir()
    if not published and local.is_file():  # (not a Hub name to try)
        raise ValueError(f"{what} {name}: a file that is not a GGUF file; give a GGUF file or a model's directory")
    if not is_local and is_local_path(name):  # a path (never a Hub id such as owner/name): not sent to the Hub
        raise FileNotFoundError(f"{what} {name}: no such directory")
    if is_local and is_attnlab_directory(local):  # (its config.json has no model_type: not a GPT-2's either)
        raise ValueError(
            f"{what} {name}: an attnlab model directory (a checkpoint, GPT.save, --merge): use --checkpoint"
        )
    device = torch.device("cpu") if device is None else torch.device(device)
    model = GPT.from_pretrained(name, cache_dir=cache_dir, device=device, dtype=dtype).eval()
    if dtype is None:
        model.to(hardware.inference_dtype(device, model.dtype))
    tok_path = None if bpe_dir is not None else read_pretrained_file(name, "tokenizer.json", cache_dir=cache_dir)
    if tok_path is not None:
        for extra in CHAT_FILES:  # into the same folder (the cache's)
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
    files = tok_path.parent if tok_path is not None else local if is_local else None
    template, stop_ids = chat_files(files, tokenizer, what=f"{what} {name}")
    path = local.resolve() if is_local else Path(name)
    shown = directory_name(local) if is_local else name
    return LoadedModel(model, tokenizer, path, {"source": source, "name": shown}, template, stop_ids)


CHAT_FILES = ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json", "chat_template.jinja")


def chat_files(
    directory: Path | None, tokenizer: Tokenizer, *, what: str
) -> tuple[ChatTemplate | None, tuple[int, ...]]:
    """A Hugging Face directory's chat template (bos/eos token strings from ``tokenizer_config.json``,
    else ``special_tokens_map.json``) and the ids generation stops at: ``generation_config.json``'s
    ``eos_token_id`` (an int or a list) and the tokenizer's end-of-text. A template that does not
    compile is a ValueError naming the model ``what``. No directory: no template, the tokenizer's eos."""
    if directory is None:
        return None, _with_eot([], tokenizer)
    configs = [_json_or_empty(directory / n) for n in ("tokenizer_config.json", "special_tokens_map.json")]

    def special(key: str) -> str:
        for cfg in configs:
            value = cfg.get(key)
            value = value.get("content") if isinstance(value, dict) else value  # {"content": "</s>", ...}
            if isinstance(value, str):
                return value
        return ""

    template = None
    source = read_chat_template(directory)  # a malformed tokenizer_config.json: an error naming it
    if source is not None:
        name = f"{what}: its chat template"
        others = {k: special(k) for k in ("unk_token", "pad_token", "sep_token", "cls_token", "mask_token")}
        template = ChatTemplate(
            source,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            name=name,
            tokens={k: v for k, v in others.items() if v},
        )
    V = tokenizer.vocab_size
    # generation_config.json's stops, else config.json's (transformers reads them in that order)
    source = "generation_config.json"
    ids = _json_or_empty(directory / source).get("eos_token_id")
    if ids is None:  # (config.json's are its defaults as often as its choice: those the tokenizer has)
        ids = _json_or_empty(directory / "config.json").get("eos_token_id")
        ids = [i for i in (ids if isinstance(ids, list) else [ids]) if is_int(i) and 0 <= i < V]
    ids = [] if ids is None else ids if isinstance(ids, list) else [ids]
    if not all(is_int(i) and 0 <= i < V for i in ids):
        raise ValueError(
            f"{what}: {source}'s eos_token_id must be a token id in [0, {V}) or a list of them, got {ids!r:.80}"
        )
    return template, _with_eot(ids, tokenizer)


def _json_or_empty(path: Path) -> dict[str, Any]:
    """An optional JSON object beside the weights; {} when absent (a malformed one is an error)."""
    if not path.is_file():
        return {}
    data = read_json(path, path.name)
    return data if isinstance(data, dict) else {}


def load_gguf(
    path: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    what: str = "model",
) -> LoadedModel:
    """A GGUF file (llama.cpp, Ollama, LM Studio): the model (float32 unless ``dtype`` says
    otherwise), the tokenizer and chat template the file stores, and its stop ids (end-of-text and,
    when the file names one, end-of-turn). Every defect of the file is a ValueError naming it."""
    p = Path(path).expanduser()
    try:
        return _load_gguf(p, device, dtype)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{what} {e}") from None
    except ValueError as e:
        raise ValueError(f"{what} {e}") from None


def _load_gguf(p: Path, device: torch.device | str | None, dtype: torch.dtype | None) -> LoadedModel:
    made: dict[str, HFTokenizer] = {}

    def build_tokenizer(reader: Any) -> None:
        made["tokenizer"] = HFTokenizer(p, reader=reader)

    # The tokenizer is built from the parsed header (a Python object per token), which then goes
    # before the weights load: the peak is the larger of the two, not their sum.
    read = read_gguf(p, dtype=dtype, keep_reader=False, before_weights=build_tokenizer)  # (dtype None: quantized)
    tokenizer = made["tokenizer"]
    vocab = read.fields["vocab_size"]
    if tokenizer.vocab_size != vocab:
        raise ValueError(f"{p}: its tokenizer has {tokenizer.vocab_size} tokens, its model {vocab}")
    meta = read.metadata
    keys = ("bos_token_id", "eos_token_id", "eot_token_id", "unknown_token_id", "padding_token_id")
    special = {k: meta.get(f"tokenizer.ggml.{k}") for k in keys}
    text = lambda i: tokenizer.decode([i]) if is_int(i) and 0 <= i < vocab else ""
    template = None
    if isinstance(meta.get("tokenizer.chat_template"), str):
        template = ChatTemplate(
            meta["tokenizer.chat_template"],
            bos_token=text(special["bos_token_id"]),
            eos_token=text(special["eos_token_id"]),
            name=f"{p}'s chat template",
            tokens={
                k: t
                for k, i in (("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))
                if (t := text(special[i]))
            },
        )
    named = (special["eos_token_id"], special["eot_token_id"], meta.get("tokenizer.ggml.eom_token_id"))
    stops = tuple(dict.fromkeys([*(i for i in named if text(i)), *_turn_ends(tokenizer)]))
    model = GPT.from_gguf(read, device=device)
    name = gguf_name(meta, read.quantization, p)
    metadata = {"source": "gguf", "name": name, "architecture": read.architecture, "quantization": read.quantization}
    return LoadedModel(model.eval(), tokenizer, p.resolve(), metadata, template, stops)


def model_name(loaded: LoadedModel) -> str:
    """How the command line, pages and ``serve``'s title name a loaded model, never by its path: a GGUF
    file or a Hugging Face model by the name its files give (:func:`gguf_name`, :func:`directory_name`),
    a training run's step by the run's directory (``out/checkpoints/step-N``: ``out``), else by its
    directory's name."""
    if loaded.metadata.get("name"):
        return str(loaded.metadata["name"])
    p = loaded.path
    if STEP_DIR.fullmatch(p.name) and p.parent.name == CHECKPOINTS_DIR and p.parent.parent.name:
        return p.parent.parent.name
    return p.name or type(loaded.model).__name__


def gguf_name(meta: dict[str, Any], quantization: dict[str, int], path: Path) -> str:
    """How pages, ``serve``'s title and the command line name a GGUF model: its ``general.name`` (else
    the file's stem), its size label where the name lacks it, and the type of most of its matrices
    (``"Smollm2 135M 8k Lc100K Mix1 Ep2 · Q4_1"``), never the file's path."""
    name = str(meta.get("general.name") or path.stem).strip() or path.stem
    parts = [name]
    size = meta.get("general.size_label")
    if isinstance(size, str) and size and size.lower() not in name.lower():
        parts.append(size)
    matrices = {t: n for t, n in quantization.items() if t not in ("F32",)}  # (norms and biases stay F32)
    if matrices:
        parts.append(max(matrices, key=matrices.get))
    return " · ".join(parts)


def directory_name(d: Path) -> str:
    """How pages and ``serve``'s title name a Hugging Face model directory: the name its ``config.json``
    was saved under (``_name_or_path``) or the directory's own, and its family (``model_type``)."""
    config = _config(d)
    saved = config.get("_name_or_path")
    name = saved if isinstance(saved, str) and saved.strip() and not is_local_path(saved) else d.name
    kind = config.get("model_type")
    return f"{name} ({kind})" if isinstance(kind, str) and kind and kind not in name.lower() else name


def _config(d: Path) -> dict[str, Any]:
    """``d``'s ``config.json`` ({} where it is missing or not a JSON object): a Hugging Face model's
    names a ``model_type``, ``GPT.save``'s holds GPTConfig fields (``emb_dim``)."""
    try:
        config = read_json(d / CONFIG_NAME, "config")  # (bounded: a FIFO or /dev/zero is refused, not read)
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def is_attnlab_directory(d: Path) -> bool:
    """Whether ``d`` holds an attnlab model (``checkpoint.json``/``latest`` as ``attnlab train`` writes, or
    ``GPT.save``'s ``config.json`` of GPTConfig fields) rather than a Hugging Face one (False for a file).
    lexists: a damaged pointer is load_model's to report, not taken for a Hugging Face directory."""
    if os.path.lexists(d / CHECKPOINT_NAME) or os.path.lexists(d / LATEST_NAME):
        return True
    config = _config(d)
    return "model_type" not in config and "emb_dim" in config


def load(
    checkpoint: str | os.PathLike[str] | None = None,
    model: str | None = None,
    *,
    device: torch.device | str | None = None,
    bpe_dir: str | os.PathLike[str] | None = None,
    dtype: torch.dtype | None = None,
) -> LoadedModel:
    """``--checkpoint DIR`` (:func:`load_model`) or ``--model NAME`` (:func:`load_pretrained`, in ``dtype``
    where given: ``torch.float32`` makes a GGUF file's quantized matrices dense): exactly one."""
    if (checkpoint is None) == (model is None):
        raise ValueError("give one of --checkpoint DIR (an attnlab model) or --model NAME (gpt2, or a directory)")
    if checkpoint is not None:
        if dtype is not None:
            raise ValueError("--dtype goes with --model (a checkpoint keeps the dtype it was trained in)")
        return load_model(checkpoint, device=device, bpe_dir=bpe_dir, what="--checkpoint")
    return load_pretrained(model, device=device, dtype=dtype, bpe_dir=bpe_dir, what="--model")


@dataclass
class Demo:
    """The tutorials' six-word example (:func:`load_demo`)."""

    words: list[str]  # "Your journey starts with one step", one word per token
    inputs: torch.Tensor  # (6, 3): their embeddings, as printed in "A simple self-attention mechanism"
    modules: list[tuple[str, Any]]  # (name, module) rows, each in eval mode


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


def load_saes(paths: Sequence[str], flag: str = "--sae") -> dict[str, Any]:
    """Each ``--sae`` path's SAE (on the CPU), by its path: read before the model is (a missing or bad
    file costs no model load); every error is one line naming the flag and the path."""
    from attnlab.interpret.sae import SAE

    saes: dict[str, Any] = {}
    for path in paths:
        try:
            saes[path] = SAE.load(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{flag} {path}: {str(exc).splitlines()[0]}") from None
    return saes


def attach_saes(saes: dict[str, Any], model: torch.nn.Module, flag: str = "--sae") -> dict[str, Any]:
    """The SAEs on the model's device, in its dtype, each checked against the model (its hook point and
    width) before any work: ValueError naming the flag and the path."""
    param = next(model.parameters())
    dtype = param.dtype if param.is_floating_point() else None
    for path, sae in saes.items():
        try:
            sae.check_model(model)
        except ValueError as exc:
            raise ValueError(f"{flag} {path}: {exc}") from None
        sae.to(device=param.device, dtype=dtype or sae.dtype)
    return saes
