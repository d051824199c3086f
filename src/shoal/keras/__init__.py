"""shoal for Keras: ``import shoal.keras as hvd`` (Keras 3's ``import keras``, or Keras 2's
``tf_keras`` under ``TF_USE_LEGACY_KERAS=1``, as TensorFlow picks).

Horovod's Keras API: ``DistributedOptimizer(optimizer, compression=..., op=...,
backward_passes_per_step=...)``, ``callbacks.BroadcastGlobalVariablesCallback``,
``callbacks.MetricAverageCallback``, ``callbacks.LearningRateWarmupCallback``,
``callbacks.LearningRateScheduleCallback``, eager ``allreduce``/``allgather``/``broadcast``
on values (numpy results), ``broadcast_variables``, ``broadcast_object``, ``init``, ``rank``,
``size``... The implementation is :mod:`shoal._keras`, shared with ``shoal.tensorflow.keras``.
"""

from __future__ import annotations

from shoal._keras import install
from shoal._keras.compat import keras_module

try:
    keras = keras_module()
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError("shoal.keras needs Keras 3 with TensorFlow: "
                              "pip install 'shoal[tensorflow]' (or 'shoal[tensorflow-cpu]' "
                              "on machines without GPUs)") from exc

from . import callbacks, elastic

__all__ = [*install(keras, globals()), "callbacks", "elastic"]
