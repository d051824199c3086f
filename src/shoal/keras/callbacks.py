"""Horovod's Keras callbacks for ``import keras`` (implemented in :mod:`shoal._keras.callbacks`):
``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``,
``LearningRateScheduleCallback``, ``LearningRateWarmupCallback``."""

from __future__ import annotations

import keras

from shoal._keras import install

__all__ = install(keras, globals(), "callbacks")
