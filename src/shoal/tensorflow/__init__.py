"""shoal for TensorFlow 2: ``import shoal.tensorflow as hvd`` (or ``as sdp``).

Horovod's TensorFlow API (0.28.1) for eager code and ``tf.function`` alike: ``allreduce``,
``grouped_allreduce``, ``allgather``, ``grouped_allgather``, ``broadcast``, ``broadcast_``,
``alltoall``, ``reducescatter``, ``grouped_reducescatter``, ``join``, process sets,
``IndexedSlices``, Horovod's gradient rules, ``DistributedGradientTape``,
``PartialDistributedGradientTape``, ``SyncBatchNormalization``, the ``*_op`` tensors and
``*_built`` queries, ``Compression``; plus SMDDP's ``oob_allreduce``, ``get_worker_comm``
(an mpi4py-style communicator) and, for XLA, :mod:`shoal.tensorflow.xla`.
``shoal.tensorflow.keras`` is Keras's side (the same implementation as ``shoal.keras``); it,
``SyncBatchNormalization`` and ``xla`` are imported on first use (Keras's import costs
seconds).
"""

from __future__ import annotations

import importlib
from typing import Any

try:
    import tensorflow as tf
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError("shoal.tensorflow needs TensorFlow: "
                              "pip install 'shoal[tensorflow]' (or 'shoal[tensorflow-cpu]' "
                              "on machines without GPUs)") from exc

from shoal.core.errors import PeerLostError as HorovodInternalError
from shoal.core.worker_comm import get_worker_comm

from . import mpi_ops, util
from .device import pin_gpu
from .functions import (
    Compression,
    Compressor,
    allgather_object,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    oob_allreduce,
)
from .mpi_ops import *  # noqa: F403 - Horovod's layout: the basic API and collectives live there
from .tape import DistributedGradientTape, PartialDistributedGradientTape
from .util import _executing_eagerly  # noqa: F401 - Horovod's scripts call hvd._executing_eagerly

_LAZY = {"keras": (".keras", None), "xla": (".xla", None), "elastic": (".elastic", None),
         "SyncBatchNormalization": (".sync_batch_norm", "SyncBatchNormalization")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        loaded = importlib.import_module(module, __name__)
        return loaded if attr is None else getattr(loaded, attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graph code: the op that broadcasts every global variable from ``root_rank``."""
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables() does not support eager execution; "
                           "call broadcast_variables(model.variables, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


__all__ = [
    *mpi_ops.__all__,
    "Compression",
    "Compressor",
    "DistributedGradientTape",
    "HorovodInternalError",
    "PartialDistributedGradientTape",
    "SyncBatchNormalization",  # noqa: F405 - loaded on first use (__getattr__)
    "allgather_object",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "get_worker_comm",
    "broadcast_variables",
    "mpi_ops",
    "oob_allreduce",
    "pin_gpu",
    "util",
]
