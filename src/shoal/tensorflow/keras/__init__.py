"""shoal for ``tf.keras``: the same API and implementation as :mod:`shoal.keras`
(:mod:`shoal._keras`), bound to ``tf.keras``; ``import shoal.tensorflow as sdp`` then
``sdp.keras.DistributedOptimizer(...)`` and ``sdp.keras.callbacks.*``."""

from __future__ import annotations

import tensorflow as tf

from shoal._keras import install

from . import callbacks, elastic

__all__ = [*install(tf.keras, globals()), "callbacks", "elastic"]
