"""``shoal.tensorflow.keras.elastic``: Horovod's ``horovod.tensorflow.keras.elastic`` for
``tf.keras`` (Keras 3, or Keras 2 under ``TF_USE_LEGACY_KERAS=1``); see
:mod:`shoal._keras.elastic`."""

import tensorflow as tf

from shoal._keras.elastic import install

__all__ = install(tf.keras, globals())
