"""Elastic training for Keras (``shoal.keras.elastic`` and ``shoal.tensorflow.elastic``), as
Horovod spells it::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [hvd.elastic.CommitStateCallback(state),
                 hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.UpdateEpochStateCallback(state)]

    @hvd.elastic.run
    def train(state):
        state.model.fit(data, steps_per_epoch=steps, epochs=epochs - state.epoch,
                        callbacks=callbacks)

    train(state)

The reset loop is the core's (:mod:`shoal.core.elastic`); this module maps Keras objects
onto it. A lost peer inside ``fit`` reaches Python as TensorFlow's error around shoal's; it is
recognised by the state of the communicator it broke.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from shoal.core import api
from shoal.core.elastic import (
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    reset,
    run_fn,
)

from .compat import bind_callbacks, build_optimizer, optimizer_built, optimizer_variables

__all__ = ["HostsUpdatedInterrupt", "KerasState", "ObjectState", "State",
           "TensorFlowKerasState", "install", "make_elastic_callbacks", "run"]


def _bcast(obj: Any) -> Any:
    return api.communicator().broadcast_object(obj, 0, name="shoal.elastic.keras")


def run(func: Any) -> Any:
    """Decorate ``func(state, ...)`` with the elastic reset loop (Horovod's
    ``hvd.elastic.run``); a lost peer inside ``fit`` comes wrapped in TensorFlow's error and
    is known by the broken communicator."""
    return run_fn(func, reset)


class KerasState(ObjectState):
    """The state of a Keras training: the model's variables, its optimizer's variables, and
    picklable attributes (``epoch=0``, ``batch=0``). ``sync()`` builds the optimizer if a
    new worker has not yet, then sends rank 0's values of all of them."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer",
                                                                          None)
        self._saved_values: list[np.ndarray] = []
        super().__init__(_bcast, api.rank, **kwargs)

    def _variables(self) -> list[Any]:
        opt = self.optimizer
        if opt is not None and not optimizer_built(opt):
            build_optimizer(opt, self.model.trainable_variables)
        return [*self.model.variables, *(optimizer_variables(opt) if opt is not None else [])]

    def save(self) -> None:
        """Copy every variable's value and the attributes."""
        self._saved_values = [np.array(v.numpy()) for v in self._variables()]
        super().save()

    def restore(self) -> None:
        """Back to the last commit."""
        for v, value in zip(self._variables(), self._saved_values, strict=False):
            v.assign(value)
        super().restore()

    def sync(self) -> None:
        """Rank 0's variables and attributes everywhere."""
        variables = self._variables()
        values = _bcast([np.array(v.numpy()) for v in variables])
        if len(values) != len(variables):
            raise ValueError(f"rank {api.rank()}: {len(variables)} variables here, rank 0 has "
                             f"{len(values)}: every worker must build the same model and "
                             f"optimizer")
        for v, value in zip(variables, values, strict=True):
            v.assign(value)
        super().sync()
        self._saved_values = [np.array(v) for v in values]


TensorFlowKerasState = KerasState


class CommitStateCallbackImpl:
    """Commit the state every ``batches_per_commit`` batches."""

    def __init__(self, state: State, batches_per_commit: int = 1) -> None:
        super().__init__()
        self.state, self.batches_per_commit = state, max(1, int(batches_per_commit))
        self._left = self.batches_per_commit

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self._left -= 1
        if self._left == 0:
            self.state.commit()
            self._left = self.batches_per_commit


class UpdateBatchStateCallbackImpl:
    """Keep ``state.batch`` at the last batch done (0 after each epoch)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallbackImpl:
    """Count finished epochs in ``state.epoch`` and commit (so ``fit(epochs=total -
    state.epoch)`` resumes after the last finished epoch)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch += 1
        self.state.batch = 0
        self.state.commit()


_MADE: dict[type, dict[str, type]] = {}


def make_elastic_callbacks(keras: ModuleType) -> dict[str, type]:
    """The elastic callback classes for ``keras`` (made once per ``Callback`` base)."""
    return bind_callbacks(keras, (CommitStateCallbackImpl, UpdateBatchStateCallbackImpl,
                                  UpdateEpochStateCallbackImpl), _MADE)


def install(keras: ModuleType, namespace: dict[str, Any]) -> list[str]:
    """Fill an import path's ``elastic`` module for ``keras``: the state classes, ``run``,
    and the callbacks bound to that Keras; returns the names, for its ``__all__``."""
    names = {"HostsUpdatedInterrupt": HostsUpdatedInterrupt, "KerasState": KerasState,
             "ObjectState": ObjectState, "State": State,
             "TensorFlowKerasState": TensorFlowKerasState, "run": run,
             **make_elastic_callbacks(keras)}
    namespace.update(names)
    return sorted(names)
