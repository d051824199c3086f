"""Training runtime: the train / eval / benchmark loops, optimizers and schedules, losses,
checkpoints, metrics and the data-parallel backends."""

from apps.efficientnet.runtime.checkpoint import load_checkpoint, save_checkpoint
from apps.efficientnet.runtime.distributed import Dist, init_distributed, shutdown_distributed
from apps.efficientnet.runtime.losses import (
    mixup,
    smooth_targets,
    soft_cross_entropy,
    topk_correct,
)
from apps.efficientnet.runtime.metrics import MetricLogger
from apps.efficientnet.runtime.optim import LRSchedule, ModelEMA, TFRMSprop, build_optimizer
from apps.efficientnet.runtime.runner import run, save, train_epoch
from apps.efficientnet.runtime.trainer import (
    Trainer,
    build_trainer,
    evaluate,
    restore_trainer,
    train_step,
    trainer_state,
)

__all__ = [
    "Dist",
    "LRSchedule",
    "MetricLogger",
    "ModelEMA",
    "TFRMSprop",
    "Trainer",
    "build_optimizer",
    "build_trainer",
    "evaluate",
    "init_distributed",
    "load_checkpoint",
    "mixup",
    "restore_trainer",
    "run",
    "save",
    "save_checkpoint",
    "shutdown_distributed",
    "smooth_targets",
    "soft_cross_entropy",
    "topk_correct",
    "train_epoch",
    "train_step",
    "trainer_state",
]
