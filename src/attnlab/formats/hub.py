"""Hugging Face models on disk: a local directory (what ``save_pretrained`` writes) or a Hub repository,
downloaded through ``huggingface_hub`` (its cache when offline); safetensors only, nothing is unpickled.

The weights' names and layouts are :mod:`attnlab.formats.families`'s; this module only finds the files.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import urllib.parse
from pathlib import Path
from typing import Any

from torch import Tensor

from attnlab.files import import_safetensors, read_json

__all__ = ["PRETRAINED", "is_local_path", "read_pretrained", "read_pretrained_config", "read_pretrained_file"]

# attnlab names -> Hugging Face Hub repositories of OpenAI's GPT-2 weights.
PRETRAINED = {
    "gpt2": "openai-community/gpt2",
    "gpt2-small": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
}
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


def read_pretrained_config(
    name: str, *, cache_dir: str | os.PathLike[str] | None = None, revision: str | None = None
) -> dict[str, Any]:
    """The ``config.json`` of ``name`` (a local directory, a known GPT-2 name or a Hub repository), as a dict."""
    local = _local_dir(name)
    if local is None and is_local_path(name):  # a path, not a Hub id: never sent to the Hub
        what = "a file, not a model directory" if Path(name).expanduser().exists() else "no such file or directory"
        raise FileNotFoundError(f"{name}: {what} (a Hugging Face model directory, or a Hub id such as owner/name)")
    path = local / "config.json" if local is not None else _download(_repo(name), "config.json", cache_dir, revision)
    if not Path(path).is_file():
        raise FileNotFoundError(f"{path} not found: a model directory needs config.json and safetensors weights")
    cfg = read_json(path, "config")  # (a regular file of bounded size: one planted as /dev/zero is refused)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return cfg


def read_pretrained(
    name: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    revision: str | None = None,
) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """``(config.json as a dict, state dict)`` of a Hugging Face model: a local directory (what
    ``save_pretrained`` writes) or a Hub repository, read from the cache when offline.

    The weights are ``model.safetensors`` or shards listed in ``model.safetensors.index.json``
    (the layout of large models); safetensors only, nothing is unpickled. A name in
    :data:`PRETRAINED` always means that published model, even if a folder of that name exists.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a model name or directory like 'gpt2', got {name!r}")
    cfg = read_pretrained_config(name, cache_dir=cache_dir, revision=revision)
    local = _local_dir(name)
    if local is not None:
        if (local / WEIGHTS).is_file():
            files = [local / WEIGHTS]
        elif (local / WEIGHTS_INDEX).is_file():
            files = [local / f for f in _shards(local / WEIGHTS_INDEX)]
        else:
            raise FileNotFoundError(f"{local} holds neither {WEIGHTS} nor {WEIGHTS_INDEX} (safetensors weights)")
    else:
        repo = _repo(name)
        try:
            files = [Path(_download(repo, WEIGHTS, cache_dir, revision, quiet=True))]
        except FileNotFoundError:
            index = Path(_download(repo, WEIGHTS_INDEX, cache_dir, revision))
            files = [Path(_download(repo, f, cache_dir, revision)) for f in _shards(index)]
    safetensors = import_safetensors()
    state: dict[str, Tensor] = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} not found: the weights' index lists it")
        try:
            state.update(safetensors.torch.load_file(str(f)))
        except safetensors.SafetensorError as e:  # truncated, corrupt header, ...: not a ValueError
            raise ValueError(f"{f} is not a readable safetensors file ({e})") from None
    return cfg, state


def read_pretrained_file(
    name: str, filename: str, *, cache_dir: str | os.PathLike[str] | None = None, revision: str | None = None
) -> Path | None:
    """The path of ``filename`` in a model directory or Hub repository (the cache when offline), or
    None when the model has no such file (e.g. an optional ``tokenizer_config.json``)."""
    local = _local_dir(name)
    if local is not None:
        path = local / filename
        return path if path.is_file() else None
    try:
        return Path(_download(_repo(name), filename, cache_dir, revision, quiet=True))
    except FileNotFoundError:
        return None


# What huggingface_hub accepts as a repository id: a name or "owner/name" of letters, digits, "-", "_" and
# "." (and neither "--" nor ".."). Anything else can only be a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?")


def is_local_path(name: str) -> bool:
    """Whether ``name`` can only be a local path, never a Hub repository id: an absolute path, one
    starting with ``.`` or ``~``, one of more than two parts, a ``.gguf`` file name, ... Such a name is
    never sent to the Hugging Face Hub: when nothing is there, the answer is "no such file or directory"."""
    if name.lower() in PRETRAINED:
        return False
    return (
        _HUB_ID.fullmatch(name) is None
        or ".." in name
        or "--" in name
        or name.lower().endswith(".gguf")
        or Path(name).expanduser().exists()
    )


def _local_dir(name: str) -> Path | None:
    local = Path(name).expanduser()
    # A known model name always means that model: a ./gpt2 folder in the working directory must
    # not silently stand in for from_pretrained("gpt2").
    return local if name.lower() not in PRETRAINED and local.is_dir() else None


def _repo(name: str) -> str:
    return PRETRAINED.get(name.lower(), name)


def _shards(index: Path) -> list[str]:
    """The shard files ``model.safetensors.index.json`` lists (plain file names beside it)."""
    data = read_json(index, "safetensors index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index} is not a safetensors index with a 'weight_map' object")
    files = sorted({f if isinstance(f, str) else repr(f) for f in weight_map.values()})
    for f in files:
        if not isinstance(f, str) or Path(f).name != f or not f.endswith(".safetensors"):
            raise ValueError(f"{index} lists {f!r}: shards must be .safetensors files beside the index")
    return files


@functools.lru_cache(maxsize=1)
def _hub_unresolvable() -> bool:
    """Whether the Hub's host name does not resolve (no network): huggingface_hub would then try each
    file six times over 23 s, a warning a try, before it reads its cache anyway."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False  # (huggingface_hub reads only its cache already)
    try:
        socket.getaddrinfo(urllib.parse.urlparse(constants.ENDPOINT).hostname, 443)
    except (OSError, UnicodeError):
        return True
    return False


def _download(
    repo_id: str,
    filename: str,
    cache_dir: str | os.PathLike[str] | None,
    revision: str | None,
    *,
    quiet: bool = False,
) -> str:
    """One file of a Hub repository, through ``huggingface_hub`` (its cache first when offline).
    ``quiet``: a missing file is a bare FileNotFoundError (the caller tries another layout)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise ImportError(
            "GPT.from_pretrained needs the 'huggingface_hub' package: pip install 'attnlab[hf]'"
        ) from None
    offline = _hub_unresolvable()
    try:
        return hf_hub_download(repo_id, filename, cache_dir=cache_dir, revision=revision, local_files_only=offline)
    except Exception as e:  # offline, no such repository, HTTP errors: all end in the same advice
        if quiet:
            raise FileNotFoundError(filename) from None
        # (an id is also a relative path, 'models/foo': say that no such folder is here either)
        path_like = "/" in repo_id and repo_id not in PRETRAINED.values()
        local = f" (there is no local folder {repo_id!r} here either)" if path_like else ""
        raise FileNotFoundError(
            f"could not get the weights of {repo_id!r} ({filename}) from the Hugging Face Hub or its local cache "
            f"({'no network: the Hub does not resolve' if offline else type(e).__name__}){local}; "
            "connect to the internet once so they are downloaded into the cache "
            f"(~/.cache/huggingface, or $HF_HOME), or pass a local directory holding config.json and "
            f"model.safetensors"
        ) from None
