"""``SyncBatchNormalization``: Keras batch normalization whose batch statistics are computed
over the global batch (every rank's), as Horovod's is.

In training, each rank sums its inputs, their squares and its count per channel (in float32,
also under ``mixed_float16``); one fused allreduce adds them across ranks; mean and variance
follow. The allreduce's gradient rule (the gradient summed over ranks) makes the backward pass
the synchronized one too. Inference, and a job of one rank, are plain batch normalization.
A reduction cannot run inside XLA-compiled code: train with ``jit_compile=False`` or use
Keras's ``BatchNormalization``.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from shoal.core import process_sets as ps_
from shoal.core.reduction import ReduceOp

from .differentiable import grouped_allreduce

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="shoal")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with statistics over every rank's batch (Horovod's arguments)."""

    def __init__(self, *args: Any, process_set: Any = None, **kwargs: Any) -> None:
        kwargs.pop("fused", None)  # Horovod's Keras 2 argument; Keras 3 decides itself
        super().__init__(*args, **kwargs)
        self._process_set = process_set

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if mask is not None or ps_.communicator_for(self._process_set).size == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        x = tf.cast(inputs, tf.float32)
        local_sum = tf.reduce_sum(x, axis=axes)
        local_sq = tf.reduce_sum(tf.square(x), axis=axes)
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), tf.float32)
        total, total_sq, total_count = grouped_allreduce(
            [local_sum, local_sq, tf.reshape(count, [1])], op=ReduceOp.SUM,
            process_set=self._process_set or ps_.global_process_set)
        mean = tf.math.divide_no_nan(total, total_count)
        variance = tf.maximum(tf.math.divide_no_nan(total_sq, total_count) - tf.square(mean),
                              0.0)
        return tf.cast(mean, inputs.dtype), tf.cast(variance, inputs.dtype)
