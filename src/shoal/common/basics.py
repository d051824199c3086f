"""``horovod.common.basics``: the object behind each framework's ``mpi_ops._basics``.

Horovod binds one per compiled extension; shoal's answers come from its core (and, for
``nccl_built`` and ``cuda_built``, from the adapter that made it), so every adapter's object
reports the same job. Its underscore methods are the process-set internals that Horovod's
tests call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from shoal.core import api, build_info, timeline
from shoal.core import process_sets as ps_
from shoal.core.reduction import ReduceOp

__all__ = ["HorovodBasics"]


class HorovodBasics:
    """Horovod's basic API as methods. ``cuda_built`` and ``nccl_built`` are the adapter's."""

    Average, Sum, Adasum = ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM
    Min, Max, Product = ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT

    def __init__(self, init: Callable[..., None] = api.init,
                 cuda_built: Callable[[], bool] = lambda: False,
                 nccl_built: Callable[[], bool] = build_info.nccl_built) -> None:
        self.init = init
        self.cuda_built = cuda_built
        self.nccl_built = nccl_built

    shutdown = staticmethod(api.shutdown)
    is_initialized = staticmethod(api.is_initialized)
    size = staticmethod(api.size)
    local_size = staticmethod(api.local_size)
    cross_size = staticmethod(api.cross_size)
    rank = staticmethod(api.rank)
    local_rank = staticmethod(api.local_rank)
    cross_rank = staticmethod(api.cross_rank)
    start_timeline = staticmethod(timeline.start_timeline)
    stop_timeline = staticmethod(timeline.stop_timeline)
    mpi_threads_supported = staticmethod(build_info.mpi_threads_supported)
    mpi_enabled = staticmethod(build_info.mpi_enabled)
    mpi_built = staticmethod(build_info.mpi_built)
    gloo_enabled = staticmethod(build_info.gloo_enabled)
    gloo_built = staticmethod(build_info.gloo_built)
    ddl_built = staticmethod(build_info.ddl_built)
    ccl_built = staticmethod(build_info.ccl_built)
    rocm_built = staticmethod(build_info.rocm_built)

    is_homogeneous = staticmethod(api.is_homogeneous)

    @staticmethod
    def _add_process_set_impl(ranks: Sequence[int]) -> int | None:
        return ps_.add_process_set(list(ranks)).process_set_id

    @staticmethod
    def _remove_process_set_impl(process_set_id: int) -> int | None:
        removed = ps_.remove_process_set(ps_.process_set_by_id(process_set_id))
        return process_set_id if removed else None

    @staticmethod
    def _process_set_rank(process_set_id: int) -> int:
        rank = ps_.process_set_by_id(process_set_id).rank()
        return -1 if rank is None else rank

    @staticmethod
    def _process_set_size(process_set_id: int) -> int:
        size = ps_.process_set_by_id(process_set_id).size()
        return -1 if size is None else size

    @staticmethod
    def _get_process_set_ids_and_ranks() -> dict[int, list[int]]:
        return ps_.ids_and_ranks()

    def __repr__(self) -> str:
        return f"HorovodBasics(init={getattr(self.init, '__module__', '?')}.init)"
