"""The inspector page of a language model: ``attnlab viz --checkpoint DIR | --model NAME --out page.html``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from attnlab.interpret import inspector_data, trace, trace_generation
from attnlab.tools.loading import LoadedModel

__all__ = ["encode_prompt", "model_inspector"]


def encode_prompt(loaded: LoadedModel, prompt: str) -> torch.Tensor:
    """``(1, T)`` token ids of ``prompt``, checked against the model's context window."""
    ids = list(loaded.tokenizer.encode(prompt))
    if not ids:
        raise ValueError("the prompt encodes to no tokens; give a longer --prompt")
    ctx = loaded.model.config.context_length
    if len(ids) > ctx:
        raise ValueError(f"--prompt is {len(ids)} tokens long, more than the model's context_length={ctx}; shorten it")
    return torch.tensor([ids], dtype=torch.long, device=loaded.model.device)


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
) -> dict[str, Any]:
    """Trace ``prompt`` through the model (with the stages), generate ``generate`` tokens after it
    (sampled with ``seed``), and gather the page's data (:func:`attnlab.interpret.inspector_data`)."""
    idx = encode_prompt(loaded, prompt)
    tr = trace(loaded.model, idx, stages=True, tokenizer=loaded.tokenizer)
    gen = None
    if generate:
        g = torch.Generator(device=loaded.model.device).manual_seed(int(seed))
        gen = trace_generation(
            loaded.model, idx, generate, temperature=temperature, top_k=top_k, top_p=top_p, generator=g, prefix=tr
        )
    name = str(loaded.metadata.get("name") or loaded.path.name or type(loaded.model).__name__)
    shown = dict(steps=steps, layers=layers, heads=heads, precision=precision)
    return inspector_data(tr, generation=gen, title=prompt, text=prompt, model_name=name, **shown)
