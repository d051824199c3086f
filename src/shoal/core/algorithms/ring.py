"""Ring AllReduce over point-to-point links: reduce-scatter, then allgather.

Each of the ``n`` ranks sends and receives ``2 (n-1)/n`` of the buffer, the bandwidth optimum for
a ring. Received segments are reduced as their bytes arrive (in blocks of ``block_bytes``), so the
reduction of one part overlaps the transfer of the next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..transport.tcp import TcpMesh

__all__ = ["ring_allreduce"]

Reduce = Callable[[np.ndarray, list[np.ndarray]], None]


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(a.view(np.uint8))


def ring_allreduce(mesh: TcpMesh, group: Sequence[int], buf: np.ndarray, reduce: Reduce,
                   finish: Callable[[np.ndarray], None] | None = None,
                   block_bytes: int = 1 << 20, what: str = "allreduce") -> None:
    """Allreduce the flat array ``buf`` in place among the global ranks ``group``."""
    n = len(group)
    if n == 1:
        if finish is not None and buf.size:
            finish(buf)
        return
    me = group.index(mesh.rank)
    right, left = group[(me + 1) % n], group[(me - 1) % n]
    bounds = [buf.size * i // n for i in range(n + 1)]

    def seg(i: int) -> np.ndarray:
        return buf[bounds[i]:bounds[i + 1]]

    itemsize = buf.dtype.itemsize
    tmp = np.empty(max(bounds[i + 1] - bounds[i] for i in range(n)), buf.dtype)
    block = max(1, block_bytes // itemsize)
    for step in range(n - 1):
        dst = seg((me - step - 1) % n)
        incoming = tmp[: dst.size]
        state = {"reduced": 0}

        def on_recv(_i: int, done: int, total: int, dst: np.ndarray = dst,
                    incoming: np.ndarray = incoming, state: dict = state) -> None:
            ready = done // itemsize
            if ready - state["reduced"] >= block or done == total:
                lo = state["reduced"]
                reduce(dst[lo:ready], [incoming[lo:ready]])
                state["reduced"] = ready

        mesh.exchange([(right, _bytes(seg((me - step) % n)))], [(left, _bytes(incoming))],
                      on_recv=on_recv, what=what)
    if finish is not None:
        owned = seg((me + 1) % n)
        if owned.size:
            finish(owned)
    for step in range(n - 1):
        mesh.exchange([(right, _bytes(seg((me - step + 1) % n)))],
                      [(left, _bytes(seg((me - step) % n)))], what=what)
