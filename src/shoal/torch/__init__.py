"""shoal for PyTorch: ``import shoal.torch as hvd`` runs a Horovod PyTorch script unchanged.

Also registers the ``"shoal"`` backend with ``torch.distributed``, so
``torch.distributed.init_process_group(backend="shoal")`` lets stock DDP run over shoal.
"""

from __future__ import annotations

try:
    import torch
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError("shoal.torch needs PyTorch: pip install 'shoal[torch]'") from exc

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
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    join,
    oob_allreduce,
    poll,
    reducescatter,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .state import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from .sync_batch_norm import SyncBatchNorm, convert_sync_batchnorm


def _register_backend() -> None:
    try:
        from .backend import register
    except ImportError:  # pragma: no cover - backend module missing in a partial install
        return
    register()


_register_backend()


def mpi_enabled() -> bool:
    """shoal does not use MPI (it runs under mpirun, though)."""
    return False


def gloo_enabled() -> bool:
    """shoal does not use gloo."""
    return False


def nccl_built() -> bool:
    """shoal reduces on CPUs; no NCCL."""
    return False


def cuda_built() -> bool:
    """CUDA tensors are supported (staged through pinned host memory) when torch has CUDA."""
    return torch.cuda.is_available()


def mpi_threads_supported() -> bool:
    """Collectives may be called from any thread."""
    return True


__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "Max", "Min", "Product",
    "ReduceOp", "Sum", "SyncBatchNorm", "allgather", "allgather_async", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
    "broadcast_optimizer_state", "broadcast_parameters", "convert_sync_batchnorm",
    "cross_rank", "cross_size", "cuda_built", "gloo_enabled", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "init",
    "is_initialized", "join", "local_rank", "local_size", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "oob_allreduce", "poll", "rank",
    "reducescatter", "shutdown", "size", "synchronize",
]
