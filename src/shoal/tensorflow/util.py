"""Horovod's ``horovod.tensorflow.util`` helpers that scripts and tests import."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["_executing_eagerly"]


def _executing_eagerly() -> bool:
    """Whether TensorFlow runs eagerly here (not inside a graph being built)."""
    return tf.executing_eagerly()
