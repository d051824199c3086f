"""``horovod.torch.mpi_ops``: the basic API and every collective of the torch adapter.

``shoal.torch`` re-exports all of it; scripts and Horovod's tests that import this path
(``from horovod.torch.mpi_ops import synchronize``) get the same objects. ``_basics`` is the
object Horovod binds to its compiled extension (:class:`shoal.common.basics.HorovodBasics`).
"""

from __future__ import annotations

import torch

from shoal.common import api as _common
from shoal.common.api import *  # noqa: F403 - the framework-independent part
from shoal.common.basics import HorovodBasics
from shoal.common.util import get_average_backwards_compatibility_fun
from shoal.core.api import init

from .collectives import (
    allgather_async,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from .differentiable import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    broadcast,
    broadcast_,
    grouped_allgather,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_reducescatter,
    oob_allreduce,
    reducescatter,
)

__all__ = [
    *_common.__all__,
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "cuda_built", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "handle_average_backwards_compatibility", "init", "join",
    "nccl_built", "oob_allreduce", "poll", "reducescatter", "reducescatter_async",
    "sparse_allreduce_async", "synchronize",
]


def cuda_built() -> bool:
    """CUDA tensors are supported (staged through pinned host memory) when torch has CUDA."""
    return torch.cuda.is_available()


def nccl_built() -> int:
    """NCCL's version code (Horovod's encoding: 22105 for 2.21.5; falsy 0 without NCCL) where
    the device path can reduce within a host over torch's NCCL: torch has CUDA and NCCL."""
    if not (torch.cuda.is_available() and torch.distributed.is_available()
            and torch.distributed.is_nccl_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else \
        major * 1000 + minor * 100 + patch


_basics = HorovodBasics(init, cuda_built, nccl_built)
handle_average_backwards_compatibility = get_average_backwards_compatibility_fun(_basics)
