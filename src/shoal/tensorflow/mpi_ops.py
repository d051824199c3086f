"""``horovod.tensorflow.mpi_ops``: the basic API and the collectives of the TensorFlow adapter.

``shoal.tensorflow`` re-exports all of it. ``_basics`` is the object Horovod binds to its
compiled extension (:class:`shoal.common.basics.HorovodBasics`); Horovod's tests read process
set internals through it.
"""

from __future__ import annotations

import tensorflow as tf

from shoal.common import api as _common
from shoal.common.api import *  # noqa: F403 - the framework-independent part
from shoal.common.basics import HorovodBasics
from shoal.common.util import get_average_backwards_compatibility_fun
from shoal.core.build_info import nccl_built

from .collectives import barrier
from .device import init
from .differentiable import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from .functions import (
    broadcast_,
    join,
    local_rank_op,
    local_size_op,
    process_set_included_op,
    rank_op,
    size_op,
)

__all__ = [
    *_common.__all__,
    "allgather", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_", "cuda_built",
    "grouped_allgather", "grouped_allreduce", "grouped_reducescatter",
    "handle_average_backwards_compatibility", "init", "join", "local_rank_op", "local_size_op",
    "nccl_built", "process_set_included_op", "rank_op", "reducescatter", "size_op",
]


def cuda_built() -> bool:
    """Whether this TensorFlow was built with CUDA (tensors are reduced on the host)."""
    return tf.test.is_built_with_cuda()


_basics = HorovodBasics(init, cuda_built)
handle_average_backwards_compatibility = get_average_backwards_compatibility_fun(_basics)
