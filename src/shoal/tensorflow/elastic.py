"""``shoal.tensorflow.elastic``: Horovod's ``horovod.tensorflow.elastic`` for Keras models
(``run``, ``TensorFlowKerasState``, the commit / batch-state / epoch-state callbacks); the
same objects as :mod:`shoal.keras.elastic` (:mod:`shoal._keras.elastic`)."""

from shoal._keras import elastic as _impl

__all__ = list(_impl.__all__)
globals().update({name: getattr(_impl, name) for name in __all__})
