"""``shoal.keras.elastic``: Horovod's ``horovod.tensorflow.keras.elastic`` (``run``,
``KerasState``, the commit / batch-state / epoch-state callbacks) for ``import keras``; see
:mod:`shoal._keras.elastic`."""

import keras

from shoal._keras.elastic import install

__all__ = install(keras, globals())
