"""shoal for TensorFlow 2: ``import shoal.tensorflow as hvd`` (or ``as sdp``).

Horovod's TensorFlow API (0.28.1) for eager code and ``tf.function`` alike: ``allreduce``,
``grouped_allreduce``, ``allgather``, ``grouped_allgather``, ``broadcast``, ``broadcast_``,
``alltoall``, ``reducescatter``, ``grouped_reducescatter``, ``join``, process sets,
``IndexedSlices``, Horovod's gradient rules, ``DistributedGradientTape``,
``PartialDistributedGradientTape``, ``SyncBatchNormalization``, the ``*_op`` tensors and
``*_built`` queries, ``Compression``; plus SMDDP's ``oob_allreduce`` and, for XLA,
:mod:`shoal.tensorflow.xla`. ``shoal.tensorflow.keras`` is Keras's side (the same
implementation as ``shoal.keras``); it, ``SyncBatchNormalization`` and ``xla`` are imported on
first use (Keras's import costs seconds).
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

from shoal.core.api import (
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from shoal.core.build_info import (
    ccl_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
    start_timeline,
    stop_timeline,
)
from shoal.core.errors import PeerLostError as HorovodInternalError
from shoal.core.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from shoal.core.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

from . import util
from .collectives import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from .device import init, pin_gpu
from .functions import (
    Compression,
    Compressor,
    allgather_object,
    broadcast_,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    join,
    local_rank_op,
    local_size_op,
    oob_allreduce,
    process_set_included_op,
    rank_op,
    size_op,
)
from .ops import barrier
from .tape import DistributedGradientTape, PartialDistributedGradientTape
from .util import _executing_eagerly  # noqa: F401 - Horovod's scripts call hvd._executing_eagerly

_LAZY = {"keras": (".keras", None), "xla": (".xla", None),
         "SyncBatchNormalization": (".sync_batch_norm", "SyncBatchNormalization")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        loaded = importlib.import_module(module, __name__)
        return loaded if attr is None else getattr(loaded, attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cuda_built() -> bool:
    """Whether this TensorFlow was built with CUDA (tensors are reduced on the host)."""
    return tf.test.is_built_with_cuda()


def broadcast_global_variables(root_rank: int) -> Any:
    """TF1 graph code: the op that broadcasts every global variable from ``root_rank``."""
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables() does not support eager execution; "
                           "call broadcast_variables(model.variables, root_rank) instead")
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


__all__ = [
    "Adasum", "Average", "Compression", "Compressor", "DistributedGradientTape",
    "HorovodInternalError", "Max", "Min", "PartialDistributedGradientTape", "ProcessSet",
    "Product", "ReduceOp", "Sum", "SyncBatchNormalization", "add_process_set", "allgather",
    "allgather_object", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_",
    "broadcast_global_variables", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "ccl_built", "cross_rank", "cross_size", "cuda_built",
    "ddl_built", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allreduce", "grouped_reducescatter", "init", "is_initialized", "join",
    "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "oob_allreduce", "pin_gpu",
    "process_set_included_op", "rank", "rank_op", "reducescatter", "remove_process_set",
    "rocm_built", "shutdown", "size", "size_op", "start_timeline", "stop_timeline", "util",
]
