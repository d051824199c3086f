"""One round for small allreduces across hosts: the payload rides with the negotiation.

Each host first runs its shared-memory round (:meth:`ShmGroup.small_round`): where every
local rank proposed the same, each of them reduces the host's payloads, in local order, into
the host's partial (all of them get the same bits). Then every rank swaps a frame with its
peers of the same local index on the other hosts (every other rank, without shared memory):
a 16-byte head, the host's token (0 where the host did not agree) and the partial's length,
then the partial. The head is read first and the partial after it, so frames of any length
cross in one exchange, one round trip. Where every host's token is this rank's, the round is
done: the partials, in host order, are what the caller reduces (every rank the same bits).
Otherwise the round is an ordinary negotiation round on every rank alike (every rank saw the
same heads): the hosts' proposals are gathered the general way and :meth:`blobs` returns
them, indexed by rank.

A frame never spans two TCP stripes (the caller's limit keeps it under two), so the head and
the partial arrive in order on one stream.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from . import Transport

__all__ = ["CrossRound"]


class CrossRound:
    """The one-round primitive of a job on several hosts, for one transport."""

    def __init__(self, transport: Transport) -> None:
        self.t = transport
        w = transport.world
        self.shm = transport.shm if w.homogeneous else None
        # (without shared memory every rank is a host of its own: the same as gather_all)
        self.group: Sequence[int] = w.cross_peers if self.shm is not None else \
            range(transport.size)
        self.me = list(self.group).index(transport.rank)
        self.peers = [p for p in self.group if p != transport.rank]
        self._blobs: list[bytes] = []

    def __call__(self, blob: bytes, token: int, payload: np.ndarray, what: str,
                 partial: Callable[[list[np.ndarray]], np.ndarray]) -> list[np.ndarray] | None:
        """Run one round; every host's partial in host order when every rank proposed
        ``token``, else None (then :meth:`blobs`). ``partial(views)`` reduces a host's
        payloads, in local order, into a new array."""
        shm = self.shm
        agreed = True
        if shm is not None:
            views = shm.small_round(blob, token, payload, what)
            agreed = views is not None
            mine = partial(views) if agreed else payload
        else:
            mine = payload
        frame = np.empty(16 + mine.nbytes, np.uint8)
        frame[:16].view(np.int64)[:] = (token if agreed else 0, mine.nbytes)
        frame[16:] = mine.view(np.uint8).reshape(-1)
        heads = {p: np.empty(2, np.int64) for p in self.peers}
        mesh = self.t.mesh
        mesh.exchange([(p, memoryview(frame)) for p in self.peers],
                      [(p, memoryview(h).cast("B")) for p, h in heads.items()], what=what,
                      control=True)
        bodies = {p: np.empty(int(h[1]), np.uint8) for p, h in heads.items()}
        mesh.exchange([], [(p, memoryview(b)) for p, b in bodies.items() if b.nbytes],
                      what=what, control=True)
        if agreed and all(int(h[0]) == token for h in heads.values()):
            return [mine if p == self.t.rank else bodies[p].view(payload.dtype)
                    for p in self.group]
        # every rank's proposal of the round just run, by rank, as a general round sees it
        self._blobs = self.t.gather_all(blob, what) if shm is None else \
            self.t.gather_hosts(shm.round_blobs(blob, what), what)
        return None

    def blobs(self) -> list[bytes]:
        """Every rank's proposal of the last round that did not agree, by rank."""
        return self._blobs
