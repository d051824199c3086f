"""``smdistributed.dataparallel.torch.distributed``: SMDDP's version-1 API, which mirrors
``torch.distributed``; here it *is* torch.distributed over shoal's backend, plus SMDDP's
``get_local_rank``, ``get_local_size`` and ``get_node_rank``."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as _dist
from torch.distributed import (
    Backend,
    ReduceOp,
    all_gather,
    all_gather_object,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    destroy_process_group,
    get_rank,
    get_world_size,
    is_available,
    is_initialized,
    new_group,
    reduce,
    reduce_scatter,
)

from shoal.core import api
from shoal.torch import backend as _backend

__all__ = ["Backend", "ReduceOp", "all_gather", "all_gather_object", "all_reduce",
           "all_to_all_single", "barrier", "broadcast", "broadcast_object_list",
           "destroy_process_group", "get_local_rank", "get_local_size", "get_node_rank",
           "get_rank", "get_world_size", "init_process_group", "is_available",
           "is_initialized", "new_group", "reduce", "reduce_scatter"]


def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any) -> None:
    """Start the default process group over shoal (SMDDP takes no backend; any given is
    replaced by shoal's). A second call does nothing, as SMDDP's."""
    if _dist.is_initialized():
        return
    _backend.register()
    kwargs.setdefault("init_method", "env://")
    _dist.init_process_group(_backend.BACKEND, *args, **kwargs)


def _job() -> Any:
    """The layout of the default process group's job."""
    if not _dist.is_initialized():
        raise RuntimeError("call init_process_group() first")
    group = _dist.distributed_c10d._get_default_group()
    backend = group._get_backend(torch.device("cpu"))
    if isinstance(backend, _backend.ShoalProcessGroup):
        return backend.communicator.world
    return api.world()


def get_local_rank() -> int:
    """This process's rank on its host."""
    return _job().local_rank


def get_local_size() -> int:
    """Number of processes on this host."""
    return _job().local_size


def get_node_rank() -> int:
    """Index of this host among the job's hosts."""
    return _job().cross_rank
