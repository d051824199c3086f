"""Horovod's build queries (``mpi_built()``, ``nccl_built()``...), the same for every adapter,
answered truthfully for shoal: it needs no MPI, DDL, oneCCL or ROCm, and it plays gloo's part
(collectives and rendezvous without MPI), so the gloo queries say yes. Adapters answer
``cuda_built()`` from their framework, and the torch adapter ``nccl_built()`` (its device path
uses torch's NCCL on hosts with several GPUs)."""

from __future__ import annotations

__all__ = ["ccl_built", "ddl_built", "gloo_built", "gloo_enabled", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "rocm_built"]


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
