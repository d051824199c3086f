"""What differs between the two Keras modules :mod:`shoal._keras` serves: Keras 3 (``import
keras``, or ``tf.keras`` on TensorFlow 2.16+) and Keras 2 (``tf_keras``, which ``tf.keras`` is
under ``TF_USE_LEGACY_KERAS=1``; its new optimizers and its ``optimizers.legacy`` ones).
Every Keras-specific part asks here instead of branching on versions itself."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["bind_callbacks", "build_optimizer", "is_keras2", "keras_module",
           "loss_scale_class", "optimizer_built", "optimizer_variables", "to_numpy"]


def keras_module() -> ModuleType:
    """The Keras that ``shoal.keras`` serves: Keras 2 (``tf_keras``) where
    ``TF_USE_LEGACY_KERAS`` asks for it, as TensorFlow's ``tf.keras`` does, else ``keras``."""
    import importlib
    import os
    if os.environ.get("TF_USE_LEGACY_KERAS", "").strip().lower() in ("1", "true", "yes"):
        try:
            return importlib.import_module("tf_keras")
        except ModuleNotFoundError:
            pass  # TensorFlow falls back the same way
    return importlib.import_module("keras")


def is_keras2(keras: ModuleType) -> bool:
    """Whether ``keras`` is Keras 2 (``tf_keras``): Keras 3 always has ``keras.ops``."""
    return not hasattr(keras, "ops")


def to_numpy(keras: ModuleType, value: Any) -> np.ndarray:
    """A Keras value (tensor, variable, number) as a numpy array."""
    if not is_keras2(keras):
        return np.asarray(keras.ops.convert_to_numpy(value))
    return np.asarray(value.numpy() if hasattr(value, "numpy") else
                      keras.backend.get_value(value))


def loss_scale_class(keras: ModuleType) -> type:
    """``LossScaleOptimizer``: in ``keras.optimizers`` (3), ``keras.mixed_precision`` (2)."""
    cls = getattr(keras.optimizers, "LossScaleOptimizer", None)
    return cls if cls is not None else keras.mixed_precision.LossScaleOptimizer


def optimizer_variables(optimizer: Any) -> list[Any]:
    """The optimizer's variables (a property in Keras 3, a method in Keras 2)."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def optimizer_built(optimizer: Any) -> bool:
    """Whether the optimizer has made its state variables."""
    if hasattr(optimizer, "built"):  # Keras 3
        return bool(optimizer.built)
    if hasattr(optimizer, "_create_all_weights"):  # Keras 2's legacy optimizers
        return bool(optimizer_variables(optimizer))
    return bool(getattr(optimizer, "_built", False))


def build_optimizer(optimizer: Any, variables: list[Any]) -> None:
    """Make the optimizer's state for ``variables`` now (as its first update would)."""
    if hasattr(optimizer, "_create_all_weights"):
        optimizer._create_all_weights(variables)
    else:
        optimizer.build(variables)


def bind_callbacks(keras: ModuleType, impls: Sequence[type],
                   cache: MutableMapping[type, dict[str, type]]) -> dict[str, type]:
    """Public callback classes for ``keras``: for each ``XImpl`` of ``impls`` a class ``X``
    deriving from it and from ``keras.callbacks.Callback`` (or from the bound class of the
    impl it extends, listed earlier; or from the Keras callback its ``keras_base`` names), with
    ``X.keras`` set; made once per ``Callback`` base."""
    base = keras.callbacks.Callback
    made = cache.get(base)
    if made is not None:
        return made
    made = {}
    for impl in impls:
        name = impl.__name__.removesuffix("Impl")
        parents = [made[b.__name__.removesuffix("Impl")] for b in impl.__bases__
                   if b.__name__.removesuffix("Impl") in made] or [
                       getattr(keras.callbacks, getattr(impl, "keras_base", "Callback"))]

        class Bound(impl, *parents):  # type: ignore[misc,valid-type]
            __doc__ = impl.__doc__

        Bound.__name__ = Bound.__qualname__ = name
        Bound.__module__ = impl.__module__
        Bound.keras = keras  # type: ignore[attr-defined]
        made[name] = Bound
    cache[base] = made
    return made
