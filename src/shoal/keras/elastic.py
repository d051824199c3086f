"""``shoal.keras.elastic``: Horovod's ``horovod.tensorflow.keras.elastic`` (``run``,
``KerasState``, the commit / batch-state / epoch-state callbacks) for ``shoal.keras``'s Keras;
see :mod:`shoal._keras.elastic`."""

from shoal._keras.compat import keras_module
from shoal._keras.elastic import install

keras = keras_module()

__all__ = install(keras, globals())
