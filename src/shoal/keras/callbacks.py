"""Horovod's Keras callbacks for ``shoal.keras``'s Keras (implemented in
:mod:`shoal._keras.callbacks`):
``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``,
``LearningRateScheduleCallback``, ``LearningRateWarmupCallback``, ``BestModelCheckpoint``."""

from __future__ import annotations

from shoal._keras import install
from shoal._keras.compat import keras_module

keras = keras_module()

__all__ = install(keras, globals(), "callbacks")
