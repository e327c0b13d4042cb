"""Fine-tuning settings: how a run that starts from a pretrained model (``--init-from``) differs
from one that starts from random weights.

* The model and its tokenizer are the pretrained model's (``--tokenizer`` may only name the same one).
* Training windows are ``--context-length`` tokens (default :data:`FINETUNE_CONTEXT`), shorter than
  the model's own context: the model keeps its context (its positions, its sliding window).
* AdamW by default (the optimizer these models were pretrained with; LoRA only trains with it), at a
  learning rate for fine-tuning: :data:`FINETUNE_LR` for every weight, :data:`LORA_LR` for adapters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from attnlab.training.config import TrainConfig

__all__ = ["FINETUNE_CONTEXT", "FINETUNE_LR", "LORA_LR", "finetune_config", "finetune_lr"]

FINETUNE_CONTEXT = 256
FINETUNE_LR = 5e-5  # every weight trains: small steps, or the pretrained knowledge is overwritten
LORA_LR = 1e-3  # the adapters start at zero and are small: larger steps (alpha / r scales them too)


def finetune_config(config: TrainConfig, init: Any, given: set[str]) -> TrainConfig:
    """``config`` for a new run from the pretrained ``init`` (``.model``, ``.tokenizer``): its
    tokenizer, AdamW unless ``--optimizer`` was given, the windows within the model's context."""
    if init is None or not hasattr(init, "model") or not hasattr(init, "tokenizer"):
        raise ValueError(
            f"--init-from {config.init_from}: pass the loaded model "
            "(Trainer(config, init=attnlab.tools.loading.load(...)))"
        )
    name = init.tokenizer.name
    for flag, what in (("preset", "its architecture"), ("dropout", "its dropout")):
        if flag in given:  # (the pretrained model is trained as it is: these would be recorded, not used)
            raise ValueError(
                f"--{flag} does not go with --init-from {config.init_from}: a pretrained model keeps {what} "
                f"(drop --{flag})"
            )
    if "tokenizer" in given and config.tokenizer != name:
        raise ValueError(
            f"--tokenizer {config.tokenizer} disagrees with --init-from {config.init_from}, whose tokenizer is "
            f"{name!r}: a pretrained model reads only its own tokens (drop --tokenizer)"
        )
    T = config.context_length or min(FINETUNE_CONTEXT, init.model.config.context_length)
    if init.model.config.pos == "learned" and init.model.config.context_length < T:
        raise ValueError(
            f"--context-length {T} is longer than the context of --init-from {config.init_from} "
            f"({init.model.config.context_length} positions)"
        )
    changes: dict[str, Any] = {"tokenizer": name, "context_length": T}
    if "optimizer" not in given:
        changes["optimizer"] = "adamw"
    out = dataclasses.replace(config, **changes)
    if out.lora_rank and out.optimizer != "adamw":
        raise ValueError("--lora-rank trains the adapters with AdamW: --optimizer adamw (its default with --init-from)")
    out.validate()
    return out


def finetune_lr(config: TrainConfig) -> float | None:
    """The default peak learning rate of a fine-tuning run (None for a run from scratch)."""
    if not config.init_from:
        return None
    return LORA_LR if config.lora_rank else FINETUNE_LR
