"""Horovod's Keras callbacks for ``tf.keras`` (implemented in :mod:`shoal._keras.callbacks`):
``BroadcastGlobalVariablesCallback``, ``MetricAverageCallback``,
``LearningRateScheduleCallback``, ``LearningRateWarmupCallback``, ``BestModelCheckpoint``."""

from __future__ import annotations

import tensorflow as tf

from shoal._keras import install

__all__ = install(tf.keras, globals(), "callbacks")
