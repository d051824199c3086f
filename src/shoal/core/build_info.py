"""Horovod's build queries (``mpi_built()``, ``nccl_built()``...) and timeline controls, the
same for every adapter, answered truthfully for shoal: it needs no MPI, DDL, oneCCL or ROCm,
and it plays gloo's part (collectives and rendezvous without MPI), so the gloo queries say
yes. Adapters answer ``cuda_built()`` from their framework, and the torch adapter
``nccl_built()`` (its device path uses torch's NCCL on hosts with several GPUs)."""

from __future__ import annotations

from .errors import ShoalError

__all__ = ["ccl_built", "ddl_built", "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "rocm_built", "start_timeline",
           "stop_timeline"]


def mpi_enabled() -> bool:
    """shoal does not use MPI (it runs under mpirun, though)."""
    return False


def mpi_built() -> bool:
    """shoal is not built on MPI."""
    return False


def gloo_enabled() -> bool:
    """True: shoal runs as Horovod does under gloo (its own rendezvous and collectives, no
    MPI), so code paths Horovod takes "with gloo" are the ones that fit shoal."""
    return True


def gloo_built() -> bool:
    """True: see :func:`gloo_enabled`."""
    return True


def nccl_built() -> bool:
    """False for the core and the TensorFlow adapter, which reduce on CPUs; the torch
    adapter's answer says whether its device path can use NCCL."""
    return False


def ddl_built() -> bool:
    """No IBM DDL."""
    return False


def ccl_built() -> bool:
    """No oneCCL."""
    return False


def rocm_built() -> bool:
    """No ROCm-specific code paths."""
    return False


def mpi_threads_supported() -> bool:
    """Collectives may be called from any thread."""
    return True


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Not available: shoal's timeline is chosen at ``init`` (``SHOAL_TIMELINE``)."""
    raise ShoalError("start_timeline: shoal writes its timeline from init() on; set "
                     "SHOAL_TIMELINE (or shoalrun --timeline-filename) before init()")


def stop_timeline() -> None:
    """Not available: see :func:`start_timeline`."""
    raise ShoalError("stop_timeline: shoal's timeline runs from init() to shutdown()")
