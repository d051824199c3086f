"""Shared-memory transport for the ranks of one host.

Every local rank owns one segment: a 4 KiB header of flags (one cache line each, so that ranks
never write the same line) and two data slots of ``chunk_bytes`` for double buffering. Data is
packed straight into the owner's slot and reduced with numpy directly on the peers' slots, so a
reduction moves each byte through memory about three times (copy in, reduce, copy out) and never
through a socket. Large messages stream through the fixed-size slots chunk by chunk, which keeps
the working set in cache and the segment small.

Synchronisation is by monotonically increasing sequence numbers: a rank publishes ``arrive`` when
its chunk is in its slot and ``reduced`` when its share of the chunk holds the result. Waiters
spin briefly, then yield, then sleep (measured here: a spin round costs about 5 us, and with more
ranks than cores pure spinning starves the very peer being waited for). Every wait has a deadline
and checks, every few milliseconds, that the awaited peers are still alive and have not aborted.

Segments are unlinked as soon as every local rank has mapped them, so a crash leaks nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import tempfile
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..errors import PeerLostError

__all__ = ["ShmGroup", "segment_dir", "segment_path"]

_HEADER = 4096
_LINE = 8  # int64 words per cache line
_ARRIVE, _REDUCED, _PID, _ABORT, _SIG0, _SIG1 = (i * _LINE for i in range(6))
_DESC = 1024  # byte offset of the descriptor text (read only to explain a mismatch)
_DESC_MAX = _HEADER - _DESC - 8
_LIVENESS_EVERY_S = 0.02


def segment_dir() -> str:
    """``/dev/shm`` where it exists (Linux), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def segment_path(job_id: str, node: int, local_rank: int) -> str:
    """Name of a segment; shoalrun removes ``shoal-<job_id>-*`` after a crash."""
    return os.path.join(segment_dir(), f"shoal-{job_id}-n{node}-l{local_rank}")


def signature(desc: str) -> int:
    """64-bit digest of a collective's description (kind, name, shape, dtype, op)."""
    return int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=8).digest(), "little",
                          signed=True)


class ShmGroup:
    """The ranks of one host, synchronised and reducing through shared memory.

    ``ranks`` are the global ranks of the group in local-rank order; ``me`` is this process's
    local rank. ``barrier`` is a callable that synchronises the group out of band (the
    rendezvous store) during set-up only.
    """

    def __init__(self, job_id: str, node: int, me: int, ranks: Sequence[int],
                 chunk_bytes: int, timeout: float, barrier: Callable[[str], None]) -> None:
        self.me = me
        self.ranks = tuple(ranks)
        self.n = len(self.ranks)
        self.chunk_bytes = max(4096, chunk_bytes - chunk_bytes % 64)
        self.timeout = timeout
        self.seq = 0
        self._yield_first = self.n > (os.cpu_count() or 1)
        size = _HEADER + 2 * self.chunk_bytes
        path = segment_path(job_id, node, me)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            own = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._maps: list[mmap.mmap] = []
        try:
            barrier("shm-created")
            for peer in range(self.n):
                if peer == me:
                    self._maps.append(own)
                    continue
                pfd = os.open(segment_path(job_id, node, peer), os.O_RDWR)
                try:
                    self._maps.append(mmap.mmap(pfd, size))
                finally:
                    os.close(pfd)
            barrier("shm-attached")
        finally:
            os.unlink(path)
        self._hdr = [np.ndarray((_HEADER // 8,), np.int64, buffer=m) for m in self._maps]
        self._desc = [np.ndarray((_HEADER - _DESC,), np.uint8, buffer=m, offset=_DESC)
                      for m in self._maps]
        self._slots = [[np.ndarray((self.chunk_bytes,), np.uint8, buffer=m,
                                   offset=_HEADER + s * self.chunk_bytes) for s in (0, 1)]
                       for m in self._maps]
        self._hdr[me][_PID] = os.getpid()
        barrier("shm-ready")
        self._pids = [int(h[_PID]) for h in self._hdr]
        self._peers = [p for p in range(self.n) if p != me]

    # -- synchronisation ---------------------------------------------------------------
    def _wait(self, slot: int, seq: int, what: str) -> None:
        hdr = self._hdr
        pending = [p for p in self._peers if hdr[p][slot] < seq]
        if not pending:
            return
        spins = 0
        start = time.monotonic()
        next_check = start + _LIVENESS_EVERY_S
        while True:
            pending = [p for p in pending if hdr[p][slot] < seq]
            if not pending:
                return
            spins += 1
            if spins > 50 or self._yield_first:
                if spins < 5000:
                    os.sched_yield()
                else:
                    time.sleep(0.0002)
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + _LIVENESS_EVERY_S
                    self._check_peers(pending, what, now - start)

    def _check_peers(self, pending: list[int], what: str, waited: float) -> None:
        for p in pending:
            if self._hdr[p][_ABORT]:
                raise PeerLostError(
                    f"rank {self.ranks[p]} aborted {what} after an error of its own; see its "
                    f"log for the cause", rank=self.ranks[p])
            try:
                os.kill(self._pids[p], 0)
            except ProcessLookupError:
                raise PeerLostError(
                    f"rank {self.ranks[p]} (pid {self._pids[p]}, same host) died during {what}",
                    rank=self.ranks[p]) from None
            except PermissionError:
                pass
        if waited > self.timeout:
            ranks = [self.ranks[p] for p in pending]
            raise PeerLostError(
                f"ranks {ranks} did not reach {what} within SHOAL_TIMEOUT_S={self.timeout:g}s "
                f"(stopped, deadlocked or still computing; raise the timeout if they are slow)",
                rank=ranks[0])

    def abort(self) -> None:
        """Tell the peers this rank gave up, so they fail at once instead of timing out."""
        self._hdr[self.me][_ABORT] = 1

    def agree(self, desc: str, what: str) -> dict[int, str] | None:
        """Check every local rank is about to run the same collective; one sync round.

        Returns None when all agree, else every local rank's description by global rank
        (the same on every local rank, so they can all report it, or pass it on to the
        other hosts first).
        """
        self.seq += 1
        seq = self.seq
        mine = self._hdr[self.me]
        sig_slot = _SIG0 if seq % 2 == 0 else _SIG1
        sig = signature(desc)
        raw = desc.encode()[:_DESC_MAX]
        text = self._desc[self.me]
        text[:8].view(np.int64)[0] = len(raw)
        text[8:8 + len(raw)] = np.frombuffer(raw, np.uint8)
        mine[sig_slot] = sig
        mine[_ARRIVE] = seq
        self._wait(_ARRIVE, seq, what)
        mine[_REDUCED] = seq
        if any(self._hdr[p][sig_slot] != sig for p in self._peers):
            return {self.ranks[p]: self._read_desc(p) for p in range(self.n)}
        return None

    def _read_desc(self, p: int) -> str:
        text = self._desc[p]
        n = int(text[:8].view(np.int64)[0])
        return bytes(text[8:8 + n]).decode(errors="replace")

    # -- data movement -------------------------------------------------------------------
    def part(self, m: int, p: int) -> tuple[int, int]:
        """Element range of chunk length ``m`` that local rank ``p`` reduces."""
        return m * p // self.n, m * (p + 1) // self.n

    def allreduce(self, src: np.ndarray, dst: np.ndarray, reduce: Callable[..., None],
                  cross: Callable[[np.ndarray], None] | None = None,
                  finish: Callable[[np.ndarray], None] | None = None,
                  what: str = "allreduce") -> None:
        """Stream flat ``src`` through the segments into flat ``dst`` (may be the same array).

        ``reduce(dst_part, [peer parts])`` combines in place; ``cross(part)`` (hierarchical
        algorithm) reduces this rank's part with the other nodes; ``finish(part)`` (averages)
        runs once on the final value before the others copy it out.
        """
        itemsize = src.dtype.itemsize
        step = self.chunk_bytes // itemsize
        total = src.size
        me, n = self.me, self.n
        for start in range(0, total, step):
            m = min(step, total - start)
            self.seq += 1
            seq = self.seq
            s = seq % 2
            views = [slot[s][: m * itemsize].view(src.dtype) for slot in self._slots]
            chunk = src[start:start + m]
            lo, hi = self.part(m, me)
            # the peers reduce every part but ours; ours is reduced straight from ``src``
            if lo:
                np.copyto(views[me][:lo], chunk[:lo])
            if hi < m:
                np.copyto(views[me][hi:], chunk[hi:])
            self._hdr[me][_ARRIVE] = seq
            self._wait(_ARRIVE, seq, what)
            if hi > lo:
                mine = views[me][lo:hi]
                reduce(mine, [views[p][lo:hi] for p in self._peers], first=chunk[lo:hi])
                if cross is not None:
                    cross(mine)
                if finish is not None:
                    finish(mine)
            self._hdr[me][_REDUCED] = seq
            self._wait(_REDUCED, seq, what)
            out = dst[start:start + m]
            for p in range(n):
                plo, phi = self.part(m, p)
                if phi > plo:
                    np.copyto(out[plo:phi], views[p][plo:phi])

    def close(self) -> None:
        """Unmap the segments (they were unlinked at set-up)."""
        self._hdr = self._desc = []
        self._slots = []
        for m in self._maps:
            # a view may still be alive somewhere; then the mapping goes with the process
            with contextlib.suppress(BufferError):
                m.close()
        self._maps = []


def mismatch_message(what: str, descs: dict[int, str]) -> str:
    """Explain which ranks disagree and how."""
    groups: dict[str, list[int]] = {}
    for rank, desc in sorted(descs.items()):
        groups.setdefault(desc, []).append(rank)
    lines = [f"ranks disagree on {what}:"]
    lines += [f"  ranks {ranks}: {desc}" for desc, ranks in groups.items()]
    lines.append("every rank must call the same collectives in the same order with the same "
                 "name, shape, dtype and op")
    return "\n".join(lines)
