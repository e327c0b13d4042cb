"""The inspector page of a language model: ``attnlab viz --checkpoint DIR | --model NAME --out page.html``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from attnlab.files import check_text_file
from attnlab.interpret import inspector_data, trace, trace_generation
from attnlab.tokenizers import prompt_tokens
from attnlab.tools.loading import LoadedModel, model_name

__all__ = ["check_sae_data", "encode_prompt", "model_inspector", "sae_corpus"]


def encode_prompt(loaded: LoadedModel, prompt: str) -> torch.Tensor:
    """``(1, T)`` token ids of ``prompt`` (after the model's BOS, where it expects one), checked against
    the model's context window."""
    ids = prompt_tokens(loaded.tokenizer, prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give a longer --prompt")
    ctx = loaded.model.config.context_length
    if len(ids) > ctx:
        raise ValueError(f"--prompt is {len(ids)} tokens long, more than the model's context_length={ctx}; shorten it")
    return torch.tensor([ids], dtype=torch.long, device=loaded.model.device)


def check_sae_data(path: str | None, flag: str = "--sae-data") -> None:
    """A text file is there to read (checked before the model is read), or one line naming the flag."""
    if path is None:
        return
    try:
        check_text_file(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag}: {exc}") from None


def sae_corpus(loaded: LoadedModel, path: str, tokens: int, flag: str = "--sae-data") -> Any:
    """The first ``tokens`` token ids of the text file ``path`` (1-D), for the latents' dashboards."""
    from attnlab.data import tokenize_to_cache

    if tokens < 1:
        raise ValueError(f"--sae-tokens must be a positive int, got {tokens}")
    try:
        ids = tokenize_to_cache(path, loaded.tokenizer)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag}: {str(exc).splitlines()[0]}") from None
    if len(ids) == 0:
        raise ValueError(f"{flag} {path} holds no tokens")
    return ids[:tokens]


def model_inspector(
    loaded: LoadedModel,
    prompt: str,
    *,
    steps: object = "auto",
    generate: int = 0,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    precision: str = "auto",
    saes: dict[str, Any] | None = None,
    sae_corpus: Any = None,
    sae_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Trace ``prompt`` through the model (with the stages), generate ``generate`` tokens after it
    (sampled with ``seed``), and gather the page's data (:func:`attnlab.interpret.inspector_data`); with
    ``saes`` (name -> SAE, on the model's device) the Features view, its dashboards also over
    ``sae_corpus`` (1-D token ids) when given."""
    idx = encode_prompt(loaded, prompt)
    tr = trace(loaded.model, idx, stages=True, tokenizer=loaded.tokenizer)
    gen = None
    if generate:
        g = torch.Generator(device=loaded.model.device).manual_seed(int(seed))
        gen = trace_generation(
            loaded.model, idx, generate, temperature=temperature, top_k=top_k, top_p=top_p, generator=g, prefix=tr
        )
    name = model_name(loaded)
    shown = dict(steps=steps, layers=layers, heads=heads, precision=precision)
    data = inspector_data(tr, generation=gen, title=prompt, text=prompt, model_name=name, **shown)
    if saes:
        from attnlab.interpret.sae_view import features_sections

        data["features"] = features_sections(
            loaded.model, saes, idx[0], loaded.tokenizer, corpus=sae_corpus, **(sae_options or {})
        )
    return data
