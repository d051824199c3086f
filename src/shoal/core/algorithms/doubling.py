"""Recursive-doubling AllReduce for small messages: log2(n) exchanges instead of 2(n-1).

Every rank swaps its whole buffer with partners at distance 1, 2, 4, ... and reduces, so after
log2(n) rounds everyone holds the result. It moves more bytes than a ring (the whole buffer each
round) but pays far fewer latencies, which is what matters below a few tens of KiB. With a
world size that is not a power of two, the ranks past the largest power of two first fold
their data into a partner and receive the result at the end. All reductions are commutative
pairwise combinations, so every rank ends with bitwise identical values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..transport import Transport

__all__ = ["doubling_allreduce", "doubling_rounds"]


def _bytes(a: np.ndarray) -> memoryview:
    return memoryview(a.view(np.uint8))


def doubling_allreduce(transport: Transport, group: Sequence[int], buf: np.ndarray,
                       reduce: Callable[..., None],
                       finish: Callable[[np.ndarray], None] | None = None,
                       what: str = "allreduce") -> None:
    """Allreduce the flat array ``buf`` in place among the global ranks ``group``."""
    tmp = np.empty_like(buf)

    def combine() -> None:
        reduce(buf, [tmp])

    def done() -> None:
        if finish is not None:
            finish(buf)

    doubling_rounds(transport, group, lambda: buf, tmp, buf, combine, combine, done, what)


def doubling_rounds(transport: Transport, group: Sequence[int],
                    outgoing: Callable[[], np.ndarray], incoming: np.ndarray,
                    result: np.ndarray, fold: Callable[[], None],
                    combine: Callable[[], None], done: Callable[[], None], what: str) -> None:
    """The rounds of recursive doubling, whatever the accumulator: ``outgoing()`` is what this
    rank sends (its current value on the wire), ``incoming`` what a partner's lands in,
    ``fold()`` adds a folded rank's ``incoming`` and ``combine()`` a partner's, ``done()``
    leaves the result in ``result`` (which a folded rank receives)."""
    n = len(group)
    me = list(group).index(transport.rank)
    p2 = 1 << (n.bit_length() - 1)
    if me >= p2:  # fold into a partner, then wait for the answer
        partner = group[me - p2]
        transport.send(partner, _bytes(outgoing()), what)
        transport.recv_into(partner, _bytes(result), what)
        return
    if me + p2 < n:
        transport.recv_into(group[me + p2], _bytes(incoming), what)
        fold()
    mask = 1
    while mask < p2:
        partner = group[me ^ mask]
        transport.exchange([(partner, _bytes(outgoing()))], [(partner, _bytes(incoming))],
                           what=what)
        combine()
        mask <<= 1
    done()
    if me + p2 < n:
        transport.send(group[me + p2], _bytes(result), what)
