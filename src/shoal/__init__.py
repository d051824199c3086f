"""shoal: fast data-parallel training.

The framework-agnostic API works on numpy arrays::

    import shoal
    shoal.init()
    grads = shoal.allreduce(grads)            # average across all ranks

Framework adapters live in ``shoal.torch``, ``shoal.tensorflow`` and ``shoal.keras``; the
launcher is ``shoalrun``.
"""

from __future__ import annotations

from .core.api import (
    Handle,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    broadcast_object,
    communicator,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    rank,
    reducescatter,
    reducescatter_async,
    shutdown,
    size,
    timeline_range,
    world,
)
from .core.errors import (
    CollectiveMismatchError,
    PeerLostError,
    RendezvousError,
    ShoalError,
    ShoalTimeoutError,
)
from .core.ops import Average, Max, Min, Product, ReduceOp, Sum
from .core.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)

__version__ = "0.1.0"

__all__ = [
    "Average",
    "CollectiveMismatchError",
    "Handle",
    "Max",
    "Min",
    "PeerLostError",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "RendezvousError",
    "ShoalError",
    "ShoalTimeoutError",
    "Sum",
    "__version__",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_async",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_async",
    "broadcast_object",
    "communicator",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "shutdown",
    "size",
    "timeline_range",
    "world",
]
