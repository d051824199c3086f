"""The Keras application's checkpoints, in a :class:`~apps.efficientnet.runtime.ckptdir.
CheckpointDir` of ``ckpt-<step>.npz`` files (rank 0 writes them, atomically, the newest
``--keep_checkpoints`` kept; ``keras_checkpoint.npz``, the single file of earlier versions, is
found as the oldest).

A checkpoint holds every model variable (BatchNorm statistics and dropout seeds included),
every optimizer variable (its step count, so the learning-rate schedule, and the EMA), the
epoch and the step. The data pipeline is a function of the epoch and the position in it, so a
run resumed from it, even mid-epoch, continues exactly as the uninterrupted one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO, Any

import numpy as np

from apps.efficientnet.keras.comm import Comm
from apps.efficientnet.runtime.ckptdir import CheckpointDir

__all__ = ["LEGACY", "keras_checkpoints", "restore", "save", "variables"]

#: the file name earlier versions wrote into --model_dir
LEGACY = "keras_checkpoint.npz"


def _write(state: dict[str, np.ndarray], f: IO[bytes]) -> None:
    np.savez(f, **state)


def _read(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def keras_checkpoints(root: str | os.PathLike[str], keep: int = 3) -> CheckpointDir:
    """The Keras checkpoints in ``root``."""
    return CheckpointDir(root, keep, _write, _read, ".npz", LEGACY)


def variables(model: Any) -> list[Any]:
    """What a checkpoint holds of ``model``: its variables, then its optimizer's."""
    optimizer = model.optimizer.variables
    return [*model.variables, *(optimizer() if callable(optimizer) else optimizer)]


def save(model: Any, epoch: int, step: int, root: str, keep: int) -> Path:
    """Write ``model``'s and its optimizer's variables, ``epoch`` and ``step`` (on rank 0)."""
    state = {f"v{i:05d}": np.asarray(v.numpy()) for i, v in enumerate(variables(model))}
    return keras_checkpoints(root, keep).save(
        {"epoch": np.int64(epoch), "step": np.int64(step), **state}, step)


def restore(model: Any, state: dict[str, np.ndarray] | None, where: str,
            comm: Comm) -> tuple[int, int]:
    """Assign rank 0's ``state`` (read from ``where``) on every rank; ``(epoch, step)`` to
    continue from (an earlier version's checkpoint has no step: the epoch's start)."""
    state = comm.broadcast_object(state, name="keras.resume")
    if state is None:
        raise ValueError(f"rank 0 could not read the checkpoint {where!r}")
    if not getattr(model.optimizer, "built", True):
        model.optimizer.build(model.trainable_variables)
    values = variables(model)
    held = sorted(k for k in state if k.startswith("v"))
    if len(held) != len(values):
        raise ValueError(f"checkpoint {where!r} holds {len(held)} variables, this model and "
                         f"optimizer {len(values)}: other flags than the run that wrote it?")
    for var, key in zip(values, held, strict=True):
        var.assign(state[key])
    epoch = int(state["epoch"])
    return epoch, int(state["step"]) if "step" in state else -1
