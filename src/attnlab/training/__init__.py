"""Training a :class:`~attnlab.GPT`: configuration, the trainer, checkpoints and CPU allocator tuning.

* :mod:`attnlab.training.config` - :class:`TrainConfig` (checked settings, resume rules), :func:`lr_at`;
* :mod:`attnlab.training.trainer` - :class:`Trainer`, :func:`train`;
* :mod:`attnlab.training.distributed` - torchrun's environment and process group;
* :mod:`attnlab.training.checkpoint` - fault-proof checkpoints (safetensors + JSON, atomic switch);
* :mod:`attnlab.training.allocator` - glibc malloc tuning for CPU training steps.
"""

from attnlab.training.config import TrainConfig, default_lr, lr_at
from attnlab.training.trainer import Trainer, TrainResult, train

__all__ = ["TrainConfig", "TrainResult", "Trainer", "default_lr", "lr_at", "train"]
