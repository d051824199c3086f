"""Ring AllReduce over point-to-point links: reduce-scatter, then allgather.

Each of the ``n`` ranks sends and receives ``2 (n-1)/n`` of the buffer, the bandwidth optimum for
a ring. Received segments are reduced as their bytes arrive (in blocks of ``block_bytes``), so the
reduction of one part overlaps the transfer of the next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..transport import Transport

__all__ = ["ring_allreduce", "ring_reducescatter"]

Reduce = Callable[[np.ndarray, list[np.ndarray]], None]


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(a.view(np.uint8))


def _reduce_pass(transport: Transport, right: int, left: int, send: np.ndarray, dst: np.ndarray,
                 tmp: np.ndarray, reduce: Reduce, block_bytes: int, what: str) -> None:
    """One ring step: ``send`` goes right while the left neighbour's segment arrives and is
    reduced into ``dst`` block by block as its bytes come in."""
    itemsize = dst.dtype.itemsize
    block = max(1, block_bytes // itemsize)
    incoming = tmp[: dst.size]
    reduced = 0

    def on_recv(_i: int, done: int, total: int) -> None:
        nonlocal reduced
        ready = done // itemsize
        if ready - reduced >= block or done == total:
            reduce(dst[reduced:ready], [incoming[reduced:ready]])
            reduced = ready

    transport.exchange([(right, _bytes(send))], [(left, _bytes(incoming))], on_recv=on_recv,
                  what=what)


def ring_reducescatter(transport: Transport, group: Sequence[int], buf: np.ndarray,
                       bounds: Sequence[int], reduce: Reduce, block_bytes: int = 1 << 20,
                       what: str = "reducescatter") -> None:
    """Reduce-scatter the flat array ``buf`` in place among the global ranks ``group``: at
    the end ``buf[bounds[i]:bounds[i + 1]]`` on ``group[i]`` holds the reduction of that
    block over the group (other blocks hold partial sums). Each rank sends and receives
    (n-1)/n of the buffer: the first half of a ring allreduce, with the blocks where the
    caller wants them (they may differ in size)."""
    n = len(group)
    if n == 1:
        return
    me = group.index(transport.rank)
    right, left = group[(me + 1) % n], group[(me - 1) % n]

    def seg(i: int) -> np.ndarray:
        return buf[bounds[i]:bounds[i + 1]]

    tmp = np.empty(max(bounds[i + 1] - bounds[i] for i in range(n)), buf.dtype)
    for step in range(n - 1):  # the last step brings block ``me`` its final contribution
        _reduce_pass(transport, right, left, seg((me - step - 1) % n), seg((me - step - 2) % n),
                     tmp, reduce, block_bytes, what)


def ring_allreduce(transport: Transport, group: Sequence[int], buf: np.ndarray, reduce: Reduce,
                   finish: Callable[[np.ndarray], None] | None = None,
                   block_bytes: int = 1 << 20, what: str = "allreduce") -> None:
    """Allreduce the flat array ``buf`` in place among the global ranks ``group``."""
    n = len(group)
    if n == 1:
        if finish is not None and buf.size:
            finish(buf)
        return
    me = group.index(transport.rank)
    right, left = group[(me + 1) % n], group[(me - 1) % n]
    bounds = [buf.size * i // n for i in range(n + 1)]

    def seg(i: int) -> np.ndarray:
        return buf[bounds[i]:bounds[i + 1]]

    tmp = np.empty(max(bounds[i + 1] - bounds[i] for i in range(n)), buf.dtype)
    for step in range(n - 1):
        _reduce_pass(transport, right, left, seg((me - step) % n), seg((me - step - 1) % n), tmp,
                     reduce, block_bytes, what)
    if finish is not None:
        owned = seg((me + 1) % n)
        if owned.size:
            finish(owned)
    for step in range(n - 1):
        transport.exchange([(right, _bytes(seg((me - step + 1) % n)))],
                      [(left, _bytes(seg((me - step) % n)))], what=what)
