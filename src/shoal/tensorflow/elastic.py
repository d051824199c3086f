"""``shoal.tensorflow.elastic``: Horovod's ``horovod.tensorflow.elastic`` for Keras models
(``run``, ``TensorFlowKerasState``, the commit / batch-state / epoch-state callbacks), bound to
``tf.keras``: the same objects as :mod:`shoal.tensorflow.keras.elastic`."""

from shoal.tensorflow.keras import elastic as _impl

__all__ = list(_impl.__all__)
globals().update({name: getattr(_impl, name) for name in __all__})
