"""``shoal.keras.elastic``: Horovod's ``horovod.tensorflow.keras.elastic`` (``run``,
``KerasState``, the commit / batch-state / epoch-state callbacks); see
:mod:`shoal._keras.elastic`."""

from shoal._keras.elastic import (
    CommitStateCallback,
    HostsUpdatedInterrupt,
    KerasState,
    ObjectState,
    State,
    TensorFlowKerasState,
    UpdateBatchStateCallback,
    UpdateEpochStateCallback,
    run,
)

__all__ = ["CommitStateCallback", "HostsUpdatedInterrupt", "KerasState", "ObjectState",
           "State", "TensorFlowKerasState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]
