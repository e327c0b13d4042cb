"""Run under torchrun (2 CPU processes, Gloo) by test_chat_finetune.py: one chat fine-tuning step of the
test's model; rank 0 saves the loss, the validation loss and the (all-reduced) gradients to argv[1]."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from test_chat_finetune import _chat_model, _chat_trainer

out = Path(sys.argv[1])
trainer = _chat_trainer(out.parent, _chat_model(), "ddp", grad_accum=1)
try:
    grads = {}
    trainer.optimizer.register_step_pre_hook(
        lambda *_a: grads.update({n: p.grad.clone() for n, p in trainer.raw_model.named_parameters()})
    )
    val_loss = trainer.evaluate()
    loss, _, grad_norm = trainer._train_step()
    if trainer.dist.is_main:
        torch.save(dict(loss=loss, val_loss=val_loss, grad_norm=grad_norm, grads=grads), out)
finally:
    trainer.close()
