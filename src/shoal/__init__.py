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
    allgather_object,
    allreduce,
    allreduce_async,
    alltoall,
    barrier,
    broadcast,
    broadcast_async,
    broadcast_object,
    communicator,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    reducescatter,
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

__version__ = "0.1.0"

__all__ = [
    "Average", "CollectiveMismatchError", "Handle", "Max", "Min", "PeerLostError", "Product",
    "ReduceOp", "RendezvousError", "ShoalError", "ShoalTimeoutError", "Sum", "__version__",
    "allgather", "allgather_object", "allreduce", "allreduce_async", "alltoall", "barrier",
    "broadcast", "broadcast_async", "broadcast_object", "communicator", "cross_rank",
    "cross_size", "init", "is_initialized", "local_rank", "local_size", "rank", "reducescatter",
    "shutdown", "size", "timeline_range", "world",
]
