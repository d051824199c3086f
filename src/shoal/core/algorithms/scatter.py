"""Reduce-scatter on every topology, each rank moving (n-1)/n of the data.

- one host: through the shared segments (:meth:`ShmGroup.reducescatter`);
- several hosts with shared memory on each (``hierarchical``): the host's ranks first
  reduce-scatter through shared memory so that local rank l holds the host's sum of the
  blocks of every host's local rank l (the input permuted once so that those blocks lie
  together), then each local rank l reduce-scatters that across the hosts in its own TCP
  ring, all local ranks at once; each host link carries (H-1)/H of the data, H hosts;
- no shared memory (``ring``): one TCP ring over every rank.

Half-precision sums are summed in float32 on each host (the host stage reads 16-bit words)
and cross hosts as 16-bit words added in float32 at every hop (:mod:`.wire16`: averages
divided first; a float16 sum that could overflow crosses as float32), as the allreduce's do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from ..reduction import ReduceOp, finalize, narrow, reduce_into, widen
from ..transport import Transport
from . import wire16
from .ring import ring_reducescatter

__all__ = ["reducescatter"]

_HALF = ("float16", "bfloat16")


def _over_ring(transport: Transport, group: Sequence[int], work: np.ndarray,
               bounds: Sequence[int], op: ReduceOp, dtype: str, wire: str | None,
               what: str) -> np.ndarray:
    """Reduce-scatter ``work`` (a scratch buffer, reduced in place) around ``group``; returns
    this rank's reduced block. ``wire``: the 16-bit dtype of a half-precision sum's words on
    the wire (:mod:`.wire16`; ``work`` is then the float32 accumulator, an average already
    divided), or None for ``dtype`` on the wire."""
    if wire is not None:
        return wire16.reducescatter(transport, group, work, bounds, wire, what)
    me = group.index(transport.rank)
    ring_reducescatter(transport, group, work, bounds,
                       functools.partial(reduce_into, op=op, dtype=dtype),
                       block_bytes=transport.cfg.tcp_chunk_bytes, what=what)
    return work[bounds[me]:bounds[me + 1]]


def _plan(transport: Transport, src: np.ndarray, op: ReduceOp, dtype: str,
          what: str) -> tuple[str | None, int]:
    """A half-precision sum's 16-bit wire (None: the data's own dtype, or float32 for a float16
    sum that could overflow) and what the result is still to be divided by."""
    n = transport.size
    if not wire16.applies(op, dtype):
        return None, n
    half = wire16.choose(transport, [src], dtype, op, dtype, what)
    return (half, 1) if half == dtype else (None, n)


def _wide_sum(wire: str) -> Callable[..., None]:
    """The host stage's reduction of half-precision blocks into a float32 block: 16-bit words
    cross shared memory, the host's sum is float32 and is not rounded before the hop."""
    def reduce(out: np.ndarray, peers: Sequence[np.ndarray], first: np.ndarray) -> None:
        out[:] = widen(first, wire)
        for peer in peers:
            out += widen(peer, wire)
    return reduce


def _finish(block: np.ndarray, dst: np.ndarray, op: ReduceOp, dtype: str, count: int) -> None:
    if dtype in _HALF and block.dtype == np.float32:
        finalize(block, op, count, "float32")
        narrow(block, dst, dtype)
    else:
        finalize(block, op, count, dtype)
        if block is not dst:
            np.copyto(dst, block)


def reducescatter(transport: Transport, src: np.ndarray, dst: np.ndarray, bounds: Sequence[int],
                  op: ReduceOp, dtype: str, what: str) -> None:
    """Reduce the flat ``src`` over every rank; keep ``[bounds[rank], bounds[rank + 1])`` of
    the result in ``dst`` (see the module for the route taken)."""
    me, n, world = transport.rank, transport.size, transport.world
    if n == 1:
        np.copyto(dst, src[bounds[me]:bounds[me + 1]])
        return
    if transport.one_host_shm:
        divide = n if op == ReduceOp.AVERAGE else 0
        transport.host_reducescatter(src, dst, bounds,
                                     functools.partial(reduce_into, op=op, dtype=dtype,
                                                       divide_by=divide), what)
        return
    half, count = _plan(transport, src, op, dtype, what)
    if not transport.has_shm or not world.homogeneous:
        if half is not None:
            work = wire16.start(src, dtype, op, n)
        elif dtype in _HALF:
            work = widen(src, dtype)
        else:
            work = src.copy()
        block = _over_ring(transport, range(n), work, bounds, op,
                           "float32" if dtype in _HALF else dtype, half, what)
        _finish(block, dst, op, dtype, count)
        return
    # hierarchical: blocks regrouped by local rank, then by host
    hosts, local = world.cross_size, world.local_size
    owner = [[world.node_ranks(h)[lr] for h in range(hosts)] for lr in range(local)]
    order = [g for lr in range(local) for g in owner[lr]]
    perm = np.concatenate([src[bounds[g]:bounds[g + 1]] for g in order]) if src.size else \
        src.copy()
    sizes = [bounds[g + 1] - bounds[g] for g in order]
    starts = np.cumsum([0, *sizes]).tolist()
    local_bounds = [starts[lr * hosts] for lr in range(local)] + [starts[-1]]
    lr = world.local_rank
    wide = dtype in _HALF and op in (ReduceOp.SUM, ReduceOp.AVERAGE)
    mine = np.empty(local_bounds[lr + 1] - local_bounds[lr], np.float32 if wide else src.dtype)
    transport.host_reducescatter(perm, mine, local_bounds, _wide_sum(dtype) if wide else
                                 functools.partial(reduce_into, op=op, dtype=dtype), what)
    if half is not None and op == ReduceOp.AVERAGE:  # divided before the wire
        np.divide(mine, n, out=mine)
    cross_bounds = [s - local_bounds[lr] for s in starts[lr * hosts:(lr + 1) * hosts + 1]]
    block = _over_ring(transport, world.cross_peers, mine, cross_bounds, op,
                       "float32" if wide else dtype, half, what)
    _finish(block, dst, op, dtype, count)
