"""The part of every adapter's ``mpi_ops`` that is the same for all frameworks: the job's
shape, the build queries (but ``nccl_built``, which each adapter answers), the reduction ops
and process sets. Each adapter's ``mpi_ops`` re-exports it and adds its own collectives,
``init``, ``cuda_built`` and ``nccl_built``."""

from shoal.core.api import (
    cross_rank,
    cross_size,
    is_homogeneous,
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
    rocm_built,
)
from shoal.core.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from shoal.core.reduction import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from shoal.core.timeline import start_timeline, stop_timeline

__all__ = [
    "Adasum", "Average", "Max", "Min", "ProcessSet", "Product", "ReduceOp", "Sum",
    "add_process_set", "ccl_built", "cross_rank", "cross_size", "ddl_built",
    "global_process_set", "gloo_built", "gloo_enabled", "is_homogeneous", "is_initialized",
    "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "rank",
    "remove_process_set", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
]
