"""shoal for PyTorch: ``import shoal.torch as hvd`` runs a Horovod PyTorch script unchanged.

Also registers the ``"shoal"`` backend with ``torch.distributed``, so
``torch.distributed.init_process_group(backend="shoal")`` lets stock DDP run over shoal.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401 - for the friendly error below
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError("shoal.torch needs PyTorch: pip install 'shoal[torch]'") from exc

from shoal.core.errors import PeerLostError as HorovodInternalError

from . import elastic, mpi_ops
from .compression import Compression, Compressor
from .mpi_ops import *  # noqa: F403 - Horovod's layout: the basic API and collectives live there
from .optimizer import DistributedOptimizer
from .sharded import ShardedOptimizer
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


__all__ = [
    *mpi_ops.__all__,
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "HorovodInternalError",
    "ShardedOptimizer",
    "SyncBatchNorm",
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "convert_sync_batchnorm",
    "elastic",
    "mpi_ops",
]
