"""Training runtime: the train / eval / benchmark loops, optimizers and schedules, losses,
checkpoints, metrics and the data-parallel backends. Everything here but ``metrics`` uses
PyTorch and is imported on first use, so the Keras application shares ``metrics`` without it."""

from __future__ import annotations

import importlib

from apps.efficientnet.runtime.metrics import MetricLogger

_LAZY = {
    "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
    "Dist": "distributed", "init_distributed": "distributed",
    "shutdown_distributed": "distributed",
    "mixup": "losses", "smooth_targets": "losses", "soft_cross_entropy": "losses",
    "topk_correct": "losses",
    "LRSchedule": "optim", "ModelEMA": "optim", "TFRMSprop": "optim",
    "build_optimizer": "optim",
    "run": "runner", "save": "runner", "train_epoch": "runner",
    "Trainer": "trainer", "build_trainer": "trainer", "evaluate": "trainer",
    "restore_trainer": "trainer", "train_step": "trainer", "trainer_state": "trainer",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MetricLogger", *sorted(_LAZY)]
