"""Data movement through the shared segments of one host, beyond allreduce: reduce-scatter,
allgather (and broadcast, an allgather in which one rank sends) and alltoall.

Mixed into :class:`~shoal.core.transport.shm.ShmGroup`, whose segments, sequence numbers and
waits they use. Each moves a message through the fixed-size slots round by round: a rank
writes what it sends into its own slot, publishes the round, and its peers copy straight out
of that slot into their outputs; a slot is rewritten two rounds later, once every rank has
arrived at the round in between (so has finished reading it). So every byte crosses memory
twice (into the slot, out of it) and never a socket; the loopback TCP these collectives
used before copied it through the kernel twice more, and paid a system call per piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = ["ShmStreams"]


def _u8(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


class ShmStreams:
    """Reduce-scatter, allgather and alltoall over the slots (see the module)."""

    me: int
    n: int
    seq: int
    chunk_bytes: int
    _peers: list[int]
    _slots: list[list[np.ndarray]]

    def _arrive(self, seq: int, what: str) -> None:  # pragma: no cover - ShmGroup's
        raise NotImplementedError

    def _settle(self, seq: int, what: str) -> None:  # pragma: no cover - ShmGroup's
        raise NotImplementedError

    def gather_streams(self, send: np.ndarray, sizes: Sequence[int],
                       recvs: dict[int, np.ndarray], what: str) -> None:
        """Every local rank p sends ``sizes[p]`` bytes (this rank: the contiguous ``send``);
        ``recvs[p]`` (contiguous, ``sizes[p]`` bytes) receives rank p's, for the ranks it
        names. Every rank must pass the same ``sizes``. An allgather names every peer; a
        broadcast has one rank sending and the others naming only it."""
        mine_bytes = _u8(send) if sizes[self.me] else None
        into = {p: _u8(a) for p, a in recvs.items() if sizes[p]}
        step = self.chunk_bytes
        for start in range(0, max(sizes, default=0), step):
            self.seq += 1
            seq = self.seq
            k = seq & 1
            m = min(step, sizes[self.me] - start)
            if m > 0:
                self._slots[self.me][k][:m] = mine_bytes[start:start + m]
            self._arrive(seq, what)
            for p, out in into.items():
                m = min(step, sizes[p] - start)
                if m > 0:
                    out[start:start + m] = self._slots[p][k][:m]

    def alltoall_streams(self, sends: Sequence[np.ndarray], recvs: Sequence[np.ndarray],
                         matrix: Sequence[Sequence[int]], what: str) -> None:
        """Rank p sends ``matrix[p][q]`` bytes to rank q: this rank's ``sends[q]`` into
        ``recvs[p]`` of rank q (contiguous arrays; this rank's own block is the caller's to
        copy). Every rank passes the same ``matrix``. Each slot holds one sub-slot per peer,
        so every pair moves at once."""
        me, n = self.me, self.n
        step = (self.chunk_bytes // max(1, n - 1)) & ~63 or 64
        longest = max((matrix[p][q] for p in range(n) for q in range(n) if p != q), default=0)
        out = [_u8(a) for a in sends]
        into = [_u8(a) for a in recvs]

        def sub(reader: int, writer: int) -> int:  # writer's sub-slot for reader's data
            return (reader - (reader > writer)) * step

        for start in range(0, longest, step):
            self.seq += 1
            seq = self.seq
            k = seq & 1
            mine = self._slots[me][k]
            for q in self._peers:
                m = min(step, matrix[me][q] - start)
                if m > 0:
                    off = sub(q, me)
                    mine[off:off + m] = out[q][start:start + m]
            self._arrive(seq, what)
            for p in self._peers:
                m = min(step, matrix[p][me] - start)
                if m > 0:
                    off = sub(me, p)
                    into[p][start:start + m] = self._slots[p][k][off:off + m]

    def reducescatter(self, src: np.ndarray, dst: np.ndarray, bounds: Sequence[int],
                      reduce: Callable[..., None], what: str = "reducescatter") -> None:
        """Reduce the flat ``src`` (equal size on every rank) and keep only this rank's block
        ``src[bounds[me]:bounds[me + 1]]`` of the result, in ``dst``.

        Each rank moves (n-1)/n of its data: in step k it writes, for every peer, the k-th
        piece of *that peer's* block into a sub-slot of its own segment, and reduces the k-th
        piece of its own block from the peers' sub-slots and its own source straight into
        ``dst`` (no copy-in of its own part, no copy-out of the others'). Every rank works
        on its own block in every step, so the reduction runs on all cores at once.
        """
        me, n = self.me, self.n
        sizes = [bounds[p + 1] - bounds[p] for p in range(n)]
        item = src.itemsize
        step = max(1, self.chunk_bytes // ((n - 1) * item))  # one sub-slot per peer

        def sub(reader: int, writer: int) -> int:  # writer's sub-slot for reader's data
            return (reader - (reader > writer)) * step * item

        for k in range(0, max(sizes), step):
            self.seq += 1
            seq = self.seq
            slots = [slot[seq % 2] for slot in self._slots]
            mine = slots[me]
            for p in self._peers:  # what peer p needs from this rank
                lo, hi = bounds[p] + min(k, sizes[p]), bounds[p] + min(k + step, sizes[p])
                if hi > lo:
                    off = sub(p, me)
                    mine[off:off + (hi - lo) * item].view(src.dtype)[:] = src[lo:hi]
            self._arrive(seq, what)
            lo, hi = min(k, sizes[me]), min(k + step, sizes[me])
            if hi > lo:
                peers = [slots[p][sub(me, p):sub(me, p) + (hi - lo) * item].view(src.dtype)
                         for p in self._peers]
                reduce(dst[lo:hi], peers, first=src[bounds[me] + lo:bounds[me] + hi])
            self._settle(seq, what)
