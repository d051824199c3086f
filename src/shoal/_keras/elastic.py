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

__all__ = ["CommitStateCallback", "HostsUpdatedInterrupt", "KerasState", "ObjectState",
           "State", "TensorFlowKerasState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]


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
        if opt is not None and not getattr(opt, "built", True):
            opt.build(self.model.trainable_variables)
        return [*self.model.variables, *(opt.variables if opt is not None else [])]

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


def _callback_base() -> type:
    import keras
    return keras.callbacks.Callback


class CommitStateCallback(_callback_base()):  # type: ignore[misc]
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



class UpdateBatchStateCallback(_callback_base()):  # type: ignore[misc]
    """Keep ``state.batch`` at the last batch done (0 after each epoch)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch + 1

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(_callback_base()):  # type: ignore[misc]
    """Count finished epochs in ``state.epoch`` and commit (so ``fit(epochs=total -
    state.epoch)`` resumes after the last finished epoch)."""

    def __init__(self, state: State) -> None:
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch += 1
        self.state.batch = 0
        self.state.commit()
