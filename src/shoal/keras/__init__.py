"""shoal for Keras 3: ``import shoal.keras as hvd``.

Horovod's Keras API: ``DistributedOptimizer(optimizer, compression=..., op=...,
backward_passes_per_step=...)``, ``callbacks.BroadcastGlobalVariablesCallback``,
``callbacks.MetricAverageCallback``, ``callbacks.LearningRateWarmupCallback``,
``callbacks.LearningRateScheduleCallback``, eager ``allreduce``/``allgather``/``broadcast``
on values (numpy results), ``broadcast_variables``, ``broadcast_object``, ``init``, ``rank``,
``size``... The implementation is :mod:`shoal._keras`, shared with ``shoal.tensorflow.keras``.
"""

from __future__ import annotations

try:
    import keras
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError("shoal.keras needs Keras 3 with TensorFlow: "
                              "pip install 'shoal[tensorflow]' (or 'shoal[tensorflow-cpu]' "
                              "on machines without GPUs)") from exc

from shoal._keras import install

from . import callbacks, elastic

__all__ = [*install(keras, globals()), "callbacks", "elastic"]
