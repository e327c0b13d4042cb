"""Training a :class:`~attnlab.GPT`: configuration, the trainer, checkpoints and CPU allocator tuning.

* :mod:`attnlab.training.trainer` - :class:`TrainConfig`, :class:`Trainer`, :func:`train`;
* :mod:`attnlab.training.checkpoint` - fault-proof checkpoints (safetensors + JSON, atomic switch);
* :mod:`attnlab.training.allocator` - glibc malloc tuning for CPU training steps.
"""

from attnlab.training.trainer import TrainConfig, Trainer, TrainResult, default_lr, lr_at, train

__all__ = ["TrainConfig", "TrainResult", "Trainer", "default_lr", "lr_at", "train"]
