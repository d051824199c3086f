"""The three AllReduce algorithms of the core: ``shm``, ``ring`` and ``hierarchical``."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from ..ops import ReduceOp, finalize, reduce_into
from . import register
from .ring import ring_allreduce

if TYPE_CHECKING:
    from ..comm import Communicator


def _reducer(op: ReduceOp, dtype: str):
    return partial(reduce_into, op=op, dtype=dtype)


def _finisher(op: ReduceOp, dtype: str, count: int):
    if op != ReduceOp.AVERAGE or count == 1:
        return None
    return partial(finalize, op=op, count=count, dtype=dtype)


def _needs_single_host_shm(comm: Communicator) -> str | None:
    if comm.shm is None:
        return "shared memory is disabled or this host has a single rank"
    if comm.world.cross_size != 1:
        return f"the job spans {comm.world.cross_size} hosts; use hierarchical or ring"
    return None


def _needs_hierarchy(comm: Communicator) -> str | None:
    if comm.world.cross_size < 2:
        return "the job runs on one host"
    if not comm.world.homogeneous:
        return "hosts run different numbers of ranks"
    if comm.world.local_size > 1 and comm.shm is None:
        return "shared memory is disabled"
    return None


@register("shm", requires=_needs_single_host_shm)
def shm_allreduce(comm: Communicator, src: np.ndarray, dst: np.ndarray, op: ReduceOp,
                  dtype: str, what: str) -> None:
    """One host: reduce-scatter and allgather fused in the shared segments, chunk by chunk."""
    comm.shm.allreduce(src, dst, _reducer(op, dtype), finish=_finisher(op, dtype, comm.size),
                       what=what)


@register("ring", requires=lambda comm: None)
def flat_ring_allreduce(comm: Communicator, src: np.ndarray, dst: np.ndarray, op: ReduceOp,
                        dtype: str, what: str) -> None:
    """Every rank in one TCP ring, whatever host it is on."""
    if dst is not src:
        np.copyto(dst, src)
    ring_allreduce(comm.mesh, range(comm.size), dst, _reducer(op, dtype),
                   finish=_finisher(op, dtype, comm.size),
                   block_bytes=comm.cfg.tcp_chunk_bytes, what=what)


@register("hierarchical", requires=_needs_hierarchy)
def hierarchical_allreduce(comm: Communicator, src: np.ndarray, dst: np.ndarray, op: ReduceOp,
                           dtype: str, what: str) -> None:
    """Reduce-scatter on the host, ring across hosts per shard (all local ranks at once),
    allgather on the host: the SMDDP shape, every core and link busy together."""
    reduce = _reducer(op, dtype)
    group = comm.world.cross_peers

    def cross(part: np.ndarray) -> None:
        ring_allreduce(comm.mesh, group, part, reduce, block_bytes=comm.cfg.tcp_chunk_bytes,
                       what=what)

    finish = _finisher(op, dtype, comm.size)
    if comm.shm is None:  # one rank per host: the cross ring is the whole job
        if dst is not src:
            np.copyto(dst, src)
        ring_allreduce(comm.mesh, group, dst, reduce, finish=finish,
                       block_bytes=comm.cfg.tcp_chunk_bytes, what=what)
        return
    comm.shm.allreduce(src, dst, reduce, cross=cross, finish=finish, what=what)
