"""shoal for TensorFlow 2: ``import shoal.tensorflow as hvd`` (or ``as sdp``).

Horovod's TensorFlow API (``allreduce``, ``grouped_allreduce``, ``allgather``, ``broadcast``,
``broadcast_variables``, ``broadcast_object``, ``DistributedGradientTape``, ``Compression``,
``Average``/``Sum``/...) plus SMDDP's ``oob_allreduce``, for eager code and inside
``tf.function`` alike. ``shoal.tensorflow.keras`` is Keras's side (``DistributedOptimizer``
and callbacks), the same implementation as ``shoal.keras``; it is imported on first use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

try:
    import tensorflow as tf  # noqa: F401
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError("shoal.tensorflow needs TensorFlow: "
                              "pip install 'shoal[tensorflow]'") from exc

from shoal.core.api import (
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

from .ops import (
    Adasum,
    Average,
    Compression,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
    oob_allreduce,
)
from .tape import DistributedGradientTape


def __getattr__(name: str) -> ModuleType:
    if name == "keras":  # Keras's import costs seconds: only for scripts that use it
        return importlib.import_module(".keras", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Adasum", "Average", "Compression", "DistributedGradientTape", "Max", "Min", "Product",
    "ReduceOp", "Sum", "allgather", "allgather_object", "allreduce", "barrier", "broadcast",
    "broadcast_object", "broadcast_variables", "cross_rank", "cross_size",
    "grouped_allreduce", "init", "is_initialized", "local_rank", "local_size",
    "oob_allreduce", "rank", "shutdown", "size",
]
