"""Training a :class:`~attnlab.GPT`: configuration, the trainer, checkpoints and CPU allocator tuning.

* :mod:`attnlab.training.config` - :class:`TrainConfig` (checked settings, resume rules), :func:`lr_at`;
* :mod:`attnlab.training.trainer` - :class:`Trainer`, :func:`train`;
* :mod:`attnlab.training.optim` - :class:`MuonAdamW`: Muon on the blocks' matrices, AdamW on the rest;
* :mod:`attnlab.training.distributed` - torchrun's environment and process group;
* :mod:`attnlab.training.checkpoint` - fault-proof, self-verifying checkpoints (safetensors + JSON,
  atomic switch, every entry and the optimizer state checked before use);
* :mod:`attnlab.training.rundir` - the ``--out`` directory: attnlab's own only, locked while a run writes;
* :mod:`attnlab.training.memory` - will a run fit? a lower bound of its memory against what is free;
* :mod:`attnlab.training.allocator` - glibc malloc tuning for CPU training steps.
"""

from attnlab.training.config import TrainConfig, default_lr, lr_at
from attnlab.training.trainer import Trainer, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "Trainer", "default_lr", "lr_at", "train"]
