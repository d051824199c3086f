"""Horovod's Keras callbacks, written once and bound to a Keras module by :func:`make_callbacks`.

The ``*Impl`` classes hold the behaviour and know nothing of which Keras they serve; the
public classes are ``class X(XImpl, keras.callbacks.Callback)`` for the Keras module they are
made for (``keras`` or ``tf.keras``: one set per distinct ``Callback`` class). They run in
eager callback code and work on values through ``keras.ops`` and the numpy core, without
TensorFlow of their own (tested with the TensorFlow backend only).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

import shoal
from shoal.core.reduction import ReduceOp

from .compat import bind_callbacks, build_optimizer, optimizer_built, optimizer_variables, to_numpy
from .values import broadcast_variables

__all__ = [
    "BestModelCheckpointImpl",
    "BroadcastGlobalVariablesCallbackImpl",
    "LearningRateScheduleCallbackImpl",
    "LearningRateWarmupCallbackImpl",
    "MetricAverageCallbackImpl",
    "make_callbacks",
]


class _Bound:
    """What the public classes add: the Keras module they were made for."""

    keras: ModuleType
    model: Any
    params: dict[str, Any]


class BroadcastGlobalVariablesCallbackImpl(_Bound):
    """Start every rank from ``root_rank``'s model weights and optimizer state.

    Runs in ``on_train_begin``, so that the first step already starts from the same state
    everywhere. Keras's TensorFlow trainer would build the optimizer only when it traces the
    first step, so the callback builds it first, on the model's trainable variables, as
    Keras itself does under a distribution strategy. A model that only its first batch
    builds is broadcast after that batch instead, as Horovod does (then without the
    optimizer's gradient accumulators, which hold each rank's own first gradients).
    """

    def __init__(self, root_rank: int = 0, device: str = "",
                 local_variables: Any = None) -> None:
        super().__init__()
        self.root_rank = root_rank
        self.broadcast_done = False
        self.broadcast_late = False  # the model was not built when training began
        self._local_vars: set[Any] = set()
        if local_variables is None:
            local_variables = []
        elif _is_variable(local_variables):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        bad = [type(v).__name__ for v in local_variables if not _is_variable(v)]
        if bad:
            raise ValueError(f"All local variables must be variables (tf.Variable or Keras "
                             f"Variable), not {', '.join(bad)}")
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Leave ``var`` as it is on every rank (it is this rank's own)."""
        from shoal.tensorflow.tape import local_key
        self._local_vars.add(local_key(var))

    def _broadcast(self) -> None:
        from shoal.tensorflow.tape import local_key
        variables = [v for v in self.model.variables if local_key(v) not in self._local_vars]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer_built(optimizer):
            local = {id(v) for v in getattr(optimizer, "_accumulated_gradients", None) or ()
                     if v is not None and self.broadcast_late}
            variables += [v for v in optimizer_variables(optimizer) if id(v) not in local]
        broadcast_variables(self.keras, variables, self.root_rank, name="keras.bcast")
        self.broadcast_done = True

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.broadcast_late = not self.model.built
        if self.broadcast_done or self.broadcast_late:
            return
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer_built(optimizer):
            build_optimizer(optimizer, self.model.trainable_variables)
        self._broadcast()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if not self.broadcast_done:
            self._broadcast()


def _is_variable(value: Any) -> bool:
    return hasattr(value, "assign") and hasattr(value, "dtype") and hasattr(value, "shape")


class MetricAverageCallbackImpl(_Bound):
    """Average the epoch's logged metrics over all ranks (in place, for the callbacks after
    it: put it before ``ModelCheckpoint``, ``ReduceLROnPlateau``, ``EarlyStopping``)."""

    def __init__(self, device: str = "") -> None:
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        values = {}
        for key, value in logs.items():
            try:
                array = to_numpy(self.keras, value)
            except (TypeError, ValueError):  # not a number: left as it is
                continue
            if array.size == 1 and array.dtype.kind in "fiub":
                values[key] = float(array.reshape(()))
        keys = sorted(values)  # every rank reduces the same names in the same order
        mean = shoal.allreduce(np.array([values[k] for k in keys], np.float64),
                               op=ReduceOp.AVERAGE, name="keras.metrics." + ",".join(keys))
        logs.update(zip(keys, mean.tolist(), strict=True))


class LearningRateScheduleCallbackImpl(_Bound):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` up
    to (not including) ``end_epoch``.

    ``multiplier`` is a constant or a function of the epoch; with ``staircase=False`` it is
    called every batch with a fractional epoch (``epoch + batch / steps_per_epoch``).
    ``momentum_correction`` scales a variable ``momentum`` by ``new_lr / old_lr`` for the
    batch where the rate changes (Goyal et al., 2017); Keras 3's built-in optimizers keep
    momentum as a Python float compiled into the train step, which cannot be corrected, and
    is left alone.
    """

    def __init__(self, initial_lr: float, multiplier: float | Callable[[float], float],
                 start_epoch: int = 0, end_epoch: int | None = None, staircase: bool = True,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None) -> None:
        super().__init__()
        if initial_lr is None:
            raise ValueError("initial_lr is required")
        self.initial_lr = initial_lr
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase if callable(multiplier) else True
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = 0
        self._restore_momentum: Any = None

    def _lr(self) -> float:
        return float(to_numpy(self.keras, self.model.optimizer.learning_rate))

    def _adjust_learning_rate(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old_lr = self._lr()
        new_lr = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new_lr
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and hasattr(momentum, "assign") and old_lr:
            self._restore_momentum = to_numpy(self.keras, momentum)
            momentum.assign(self._restore_momentum * new_lr / old_lr)

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self.params.get("steps")
            if not self.steps_per_epoch:
                raise ValueError(f"{type(self).__name__} cannot tell the number of steps per "
                                 f"epoch; pass steps_per_epoch=")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.current_epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.current_epoch < self.start_epoch or (
                self.end_epoch is not None and self.current_epoch >= self.end_epoch):
            return
        if self.staircase:
            if batch == 0:
                self._adjust_learning_rate(self.current_epoch)
        else:
            self._adjust_learning_rate(self.current_epoch + batch / self.steps_per_epoch)

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = self._lr()


class LearningRateWarmupCallbackImpl(LearningRateScheduleCallbackImpl):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over
    ``warmup_epochs`` epochs, every batch (Goyal et al., 2017; Horovod's formula).

    ``initial_lr`` is the rate to reach, usually the single-worker rate times ``size()``.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5,
                 momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            # shifted by one batch so that the rate is round at the end of each epoch
            epoch += 1.0 / self.steps_per_epoch
            n = shoal.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs,
                         staircase=False, momentum_correction=momentum_correction,
                         steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{self._lr():g}.")


class BestModelCheckpointImpl(_Bound):
    """Keras's ``ModelCheckpoint`` that keeps only the best model (``save_best_only=True``;
    Horovod's). ``filepath`` may come later: set ``callback.filepath`` before training, as
    Horovod's estimators do. Every rank that has it saves: give it to rank 0 only, or give
    each rank its own path, and put ``MetricAverageCallback`` before it so that every rank
    judges the same (averaged) metric."""

    keras_base = "ModelCheckpoint"

    def __init__(self, monitor: str = "val_loss", verbose: int = 0,
                 save_weights_only: bool = False, mode: str = "auto",
                 save_freq: str | int = "epoch", filepath: str | None = None) -> None:
        # Keras 3 checks the path's extension at once: a stand-in passes the check
        stand_in = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(filepath=filepath or stand_in, monitor=monitor,  # type: ignore[call-arg]
                         verbose=verbose, save_best_only=True,
                         save_weights_only=save_weights_only, mode=mode, save_freq=save_freq)
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if not self.filepath:
            raise ValueError("BestModelCheckpoint has no filepath: pass filepath=, or set "
                             "callback.filepath before training")
        super().on_train_begin(logs)  # type: ignore[misc]


_MADE: dict[type, dict[str, type]] = {}


def make_callbacks(keras: ModuleType) -> dict[str, type]:
    """The public callback classes for ``keras`` (made once per ``Callback`` base class)."""
    return bind_callbacks(keras, (BroadcastGlobalVariablesCallbackImpl,
                                  MetricAverageCallbackImpl, LearningRateScheduleCallbackImpl,
                                  LearningRateWarmupCallbackImpl, BestModelCheckpointImpl),
                          _MADE)
