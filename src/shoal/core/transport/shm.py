"""Shared-memory transport for the ranks of one host.

Every local rank owns one segment: a 4 KiB header of flags (one cache line each, so that ranks
never write the same line) and two data slots for double buffering, each ``chunk_bytes`` and a
page more (a negotiation blob rides ahead of a whole chunk's payload in one round). Data is
packed straight into the owner's slot and reduced with numpy directly on the peers' slots, so a
reduction moves each byte through memory about three times (copy in, reduce, copy out) and never
through a socket. Large messages stream through the fixed-size slots chunk by chunk, which keeps
the working set in cache and the segment small.

Synchronisation is by monotonically increasing sequence numbers: a rank publishes ``arrive`` when
its chunk is in its slot and ``reduced`` when its share of the chunk holds the result. Waiters
spin briefly, then sleep on the peer's flag word (a futex, :mod:`.futex`) until the peer, having
published, wakes them; a waiter says which word it sleeps on in its own header, so a publisher
makes the wake-up call only when someone sleeps. Spinning longer, or yielding, costs a training
worker dearly: its engine waits for a peer's gradients on the very core that computes backward,
and each spin or ``sched_yield`` is time taken from backward (EfficientNet-B0 at 32 px over DDP,
two workers: the engine thread sampled in its waits ten times as often as in its copies and
reductions). Without futexes (not Linux), or with more ranks than cores (where a yield hands
the core to the very peer awaited), the wait yields, then naps. Every wait has a deadline and
checks, every few milliseconds, that the awaited peers are still alive and have not aborted.

Segments are unlinked as soon as every local rank has mapped them, so a crash leaks nothing.
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..errors import PeerLostError, ShoalError
from ..liveness import Liveness
from . import futex
from .shm_streams import ShmStreams

__all__ = ["ShmGroup", "segment_dir", "segment_path"]

_HEADER = 4096
_LINE = 8  # int64 words per cache line
_ARRIVE, _REDUCED, _PID, _ABORT, _COPIED, _SLEEP = (i * _LINE for i in range(6))
_TOKEN = _ARRIVE + 1  # 2 words: what a negotiation round proposes, in brief (small_round)
_LIVENESS_EVERY_S = 0.02
_SPINS = 50  # polls before sleeping: covers a peer in lockstep (small messages), a few tens of us
_NAP_S = 0.002  # longest futex sleep: bounds a wake-up lost to the flag and sleeper-mark race
_SLACK = 4096  # bytes of a slot past the chunk: room for the blob ahead of a one-round payload


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (killed, not yet reaped by its parent) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): trust kill()
    return state not in (b"Z", b"X")


def _copy(src: np.ndarray, dst: np.ndarray) -> None:
    np.copyto(dst, src)


def _done() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


class _Layout:
    """Element offsets of several flat arrays viewed as one concatenated buffer."""

    def __init__(self, sizes: Sequence[int]) -> None:
        self.starts = [0]
        for size in sizes:
            self.starts.append(self.starts[-1] + size)
        self.total = self.starts[-1]

    def pieces(self, a: int, b: int) -> list[tuple[int, int, int, int]]:
        """``(array index, start, stop, global position)`` of every array overlapping [a, b)."""
        out = []
        i = bisect.bisect_right(self.starts, a) - 1
        while a < b:
            while self.starts[i + 1] <= a:
                i += 1
            stop = min(b, self.starts[i + 1])
            out.append((i, a - self.starts[i], stop - self.starts[i], a))
            a = stop
        return out

    def single(self, a: int, b: int) -> tuple[int, int] | None:
        """``(array index, start)`` if [a, b) lies inside one array, else None."""
        i = bisect.bisect_right(self.starts, a) - 1
        return (i, a - self.starts[i]) if b <= self.starts[i + 1] else None


def segment_dir() -> str:
    """``/dev/shm`` where it exists (Linux), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def segment_path(job_id: str, node: int, local_rank: int) -> str:
    """Name of a segment; shoalrun removes ``shoal-<job_id>-*`` after a crash."""
    return os.path.join(segment_dir(), f"shoal-{job_id}-n{node}-l{local_rank}")


#: the chunk of the shared-memory pipeline on one host, or across hosts over one TCP stream
DEFAULT_CHUNK = 1 << 20
#: across hosts over several streams, what each stream carries in one ring step of the
#: hierarchical allreduce: every step ends in a wait for all of its pieces, so a step must be
#: long against a stream's round trip (emulated cluster under a per-flow cap, 64 MiB, 4
#: streams: 256 KiB steps 0.60x of the link floor, 1 MiB 0.77-0.89x, 2 MiB 0.89-0.90x)
STREAM_STEP_BYTES = 512 << 10
_MAX_AUTO_CHUNK = 32 << 20


def pipeline_chunk(setting: int, local_size: int, cross_size: int, streams: int) -> int:
    """The shared-memory chunk: ``setting`` when set (> 0); else 1 MiB, grown across hosts
    over several streams until each ring step gives every stream :data:`STREAM_STEP_BYTES`
    (a chunk is cut into ``local_size`` shards, each crossing in ``cross_size`` steps), at most
    32 MiB. Every rank of a host must pass the same values."""
    if setting > 0:
        return setting
    if streams <= 1 or cross_size <= 1:
        return DEFAULT_CHUNK
    want = local_size * cross_size * streams * STREAM_STEP_BYTES
    return max(DEFAULT_CHUNK, min(_MAX_AUTO_CHUNK, want))


class ShmGroup(ShmStreams):
    """The ranks of one host, synchronised and reducing through shared memory.

    ``ranks`` are the global ranks of the group in local-rank order; ``me`` is this process's
    local rank. ``barrier`` is a callable that synchronises the group out of band (the
    rendezvous store) during set-up only. With ``liveness`` a wait on a live peer has no limit
    (heartbeats tell a busy peer from a frozen one); without it ``timeout`` bounds each wait.
    """

    def __init__(self, job_id: str, node: int, me: int, ranks: Sequence[int],
                 chunk_bytes: int, timeout: float, barrier: Callable[[str], None],
                 liveness: Liveness | None = None) -> None:
        self.me = me
        self.liveness = liveness
        self.ranks = tuple(ranks)
        self.n = len(self.ranks)
        self.chunk_bytes = max(4096, chunk_bytes - chunk_bytes % 64)
        self.slot_bytes = slot = self.chunk_bytes + _SLACK
        self.timeout = timeout
        self.seq = 0
        self._yield_first = self.n > (os.cpu_count() or 1)
        # with more ranks than cores, yielding hands the core to the very peer being waited for
        # and sleeping on a futex was slower (4 ranks on 2 cores: 4 KiB 0.045 ms against 0.03,
        # 16 MiB 10 ms against 8); otherwise yielding takes the core from the backward pass
        self._futex = futex.AVAILABLE and not self._yield_first
        size = _HEADER + 2 * slot
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
        self._slots = [[np.ndarray((slot,), np.uint8, buffer=m, offset=_HEADER + s * slot)
                        for s in (0, 1)] for m in self._maps]
        self._hdr[me][_PID] = os.getpid()
        barrier("shm-ready")
        self._pids = [int(h[_PID]) for h in self._hdr]
        self._peers = [p for p in range(self.n) if p != me]
        # each slot's first word: the length of the blob in it
        # the same memory as memoryviews: whole segments as int64 words, slots as bytes
        self._words = [memoryview(m).cast("q") for m in self._maps]
        self._bytes = [[memoryview(m)[_HEADER + s * slot:_HEADER + (s + 1) * slot]
                        for s in (0, 1)] for m in self._maps]
        self._views: dict[tuple, list[np.ndarray]] = {}
        self._crosser: ThreadPoolExecutor | None = None  # the pipelined allreduce's helper
        self._length_word = [(_HEADER + s * slot) // 8 for s in (0, 1)]
        self._address = [h.ctypes.data for h in self._hdr]  # for the futex calls

    # -- synchronisation ---------------------------------------------------------------
    def _publish(self, slot: int, seq: int) -> None:
        """Set this rank's flag ``slot`` to ``seq`` and wake the peers sleeping on it."""
        words = self._words
        words[self.me][slot] = seq
        mark = self.me * _HEADER + slot + 1
        for p in self._peers:
            if words[p][_SLEEP] == mark:
                futex.wake(self._address[self.me] + 8 * slot)
                return

    def _sleep(self, p: int, slot: int, seq: int) -> None:
        """Sleep until peer ``p`` publishes flag ``slot`` (or :data:`_NAP_S` passes)."""
        own = self._words[self.me]
        own[_SLEEP] = p * _HEADER + slot + 1
        value = self._words[p][slot]
        if value < seq:  # re-read after the mark: a publisher that missed the mark set it first
            futex.wait(self._address[p] + 8 * slot, value, _NAP_S)
        own[_SLEEP] = 0

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
            if spins > _SPINS or self._yield_first:
                if self._futex:
                    self._sleep(pending[0], slot, seq)
                elif spins < 5000:
                    os.sched_yield()
                else:
                    time.sleep(0.0002)
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + _LIVENESS_EVERY_S
                    # re-read the flags first: a peer that finished this step and then left
                    # (or exited) in the meantime owes us nothing
                    pending = [p for p in pending if hdr[p][slot] < seq]
                    if pending:
                        self._check_peers(pending, what, now - start)

    def _arrive(self, seq: int, what: str) -> None:
        """Publish round ``seq`` (this rank's slot is written) and wait for every peer's."""
        self._publish(_ARRIVE, seq)
        self._wait(_ARRIVE, seq, what)

    def _settle(self, seq: int, what: str) -> None:
        """Publish that this rank's share of round ``seq`` is done; wait for every peer's."""
        self._publish(_REDUCED, seq)
        self._wait(_REDUCED, seq, what)

    def _check_peers(self, pending: list[int], what: str, waited: float) -> None:
        if self._hdr[self.me][_ABORT]:
            raise ShoalError(f"rank {self.ranks[self.me]}: gave up waiting during {what}: "
                             f"this rank is shutting down or failed")
        for p in pending:
            if self._hdr[p][_ABORT]:
                raise PeerLostError(
                    f"rank {self.ranks[p]} left the job (shut down, or gave up after an error of "
                    f"its own: see its log) during {what}", rank=self.ranks[p])
            if not _alive(self._pids[p]):
                raise PeerLostError(
                    f"rank {self.ranks[p]} (pid {self._pids[p]}, same host) died during {what}",
                    rank=self.ranks[p])
        if self.liveness is not None:
            self.liveness.check([self.ranks[p] for p in pending], what, waited)
        elif waited > self.timeout:
            ranks = [self.ranks[p] for p in pending]
            raise PeerLostError(
                f"ranks {ranks} did not reach {what} within SHOAL_TIMEOUT_S={self.timeout:g}s "
                f"(stopped, deadlocked or still computing; raise the timeout if they are slow)",
                rank=ranks[0])

    def abort(self) -> None:
        """Tell the peers this rank left or gave up, so they fail at once, not at a timeout."""
        if self._hdr:
            self._hdr[self.me][_ABORT] = 1
            for slot in (_ARRIVE, _REDUCED, _COPIED):  # sleepers notice at once
                futex.wake(self._address[self.me] + 8 * slot)

    def allgather_bytes(self, blob: bytes, what: str) -> list[bytes]:
        """Every local rank's ``blob``, in local-rank order; one sync round per slot-full.

        Used for agreement and negotiation: small, but not bounded by a header field.
        """
        cap = self.slot_bytes - 8
        if len(blob) <= cap:  # the usual case: one round
            self.seq += 1
            seq = self.seq
            slots = [slot[seq % 2] for slot in self._slots]
            mine = slots[self.me]
            mine[:8].view(np.int64)[0] = len(blob)
            mine[8:8 + len(blob)] = np.frombuffer(blob, np.uint8)
            self._hdr[self.me][_TOKEN + (seq & 1)] = 0
            self._publish(_ARRIVE, seq)
            self._wait(_ARRIVE, seq, what)
            sizes = [int(s[:8].view(np.int64)[0]) for s in slots]
            if max(sizes) <= cap:
                return [s[8:8 + n].tobytes() for s, n in zip(slots, sizes, strict=True)]
            self.seq -= 1  # a peer's blob is bigger: redo it the long way, from this round
            return self._allgather_long(blob, what, cap, resume=True)
        return self._allgather_long(blob, what, cap, resume=False)

    @staticmethod
    def payload_offset(blob_bytes: int) -> int:
        """Where :meth:`small_round` puts the payload behind a blob of ``blob_bytes``
        (64-byte aligned)."""
        return (8 + blob_bytes + 63) & ~63

    def small_round(self, blob: bytes, token: int, payload: np.ndarray,
                    what: str) -> list[np.ndarray] | None:
        """A round of :meth:`allgather_bytes` with ``payload`` (flat, fitting the slot behind
        the blob: see :meth:`payload_offset`) riding along, and ``token`` (non-zero, a
        function of the blob, given as uint8) beside the arrival flag. If every rank
        published the same token: every rank's payload, viewed in its slot with the
        payload's dtype, in local-rank order (views kept for the next round of the same
        shape: read them now); their data stays valid until this rank starts its next round
        but one (a peer rewrites a slot only after every rank arrived at the round in
        between). Otherwise None, and :meth:`round_blobs` reads the round as an ordinary
        one.

        The latency path of every small collective, measured call by call: memoryviews for
        flags and bytes (a numpy scalar store costs three times as much), typed views made
        once per shape, no allocation."""
        self.seq = seq = self.seq + 1
        k = seq & 1
        me = self.me
        n = len(blob)
        off = (8 + n + 63) & ~63
        key = (k, off, payload.size, payload.dtype)
        views = self._views.get(key)
        if views is None:  # typed views of every slot at this place, made once
            if len(self._views) > 1024:
                self._views.clear()
            views = self._views[key] = [
                np.ndarray(payload.size, payload.dtype, buffer=m, offset=_HEADER + k *
                           self.slot_bytes + off) for m in self._maps]
        mine = self._bytes[me][k]
        mine[8:8 + n] = blob
        views[me][...] = payload
        words = self._words
        own = words[me]
        own[self._length_word[k]] = n  # the slot's first word: its blob's length
        word = _TOKEN + k  # one per slot: a peer a round ahead must not overwrite it
        own[word] = token
        self._publish(_ARRIVE, seq)
        for p in self._peers:
            if words[p][_ARRIVE] < seq:
                self._wait(_ARRIVE, seq, what)
                break
        for p in self._peers:
            if words[p][word] != token:
                return None
        return views

    def round_blobs(self, blob: bytes, what: str) -> list[bytes]:
        """Every local rank's blob of the :meth:`small_round` just run (``blob`` is this
        rank's), finishing it the long way if a peer's did not fit one slot."""
        k = self.seq & 1
        sizes = [words[self._length_word[k]] for words in self._words]
        if max(sizes) <= self.slot_bytes - 8:
            return [s[k][8:8 + n].tobytes() for s, n in zip(self._slots, sizes, strict=True)]
        self.seq -= 1
        return self._allgather_long(blob, what, self.slot_bytes - 8, resume=True)

    def _allgather_long(self, blob: bytes, what: str, cap: int, resume: bool) -> list[bytes]:
        out = [bytearray() for _ in range(self.n)]
        sizes = [0] * self.n
        offset, first = 0, True
        while first or any(len(out[p]) < sizes[p] for p in range(self.n)):
            self.seq += 1
            seq = self.seq
            slots = [slot[seq % 2] for slot in self._slots]
            piece = blob[offset:offset + cap]
            offset += len(piece)
            if not resume:  # (resuming: this round's slots are already written and read)
                self._hdr[self.me][_TOKEN + (seq & 1)] = 0
                slots[self.me][:8].view(np.int64)[0] = len(blob)
                slots[self.me][8:8 + len(piece)] = np.frombuffer(piece, np.uint8)
                self._publish(_ARRIVE, seq)
                self._wait(_ARRIVE, seq, what)
            resume = False
            for p in range(self.n):
                if first:
                    sizes[p] = int(slots[p][:8].view(np.int64)[0])
                take = min(cap, sizes[p] - len(out[p]))
                out[p] += slots[p][8:8 + take].tobytes()
            first = False
        return [bytes(b) for b in out]

    # -- data movement -------------------------------------------------------------------
    def part(self, m: int, p: int) -> tuple[int, int]:
        """Element range of chunk length ``m`` that local rank ``p`` reduces."""
        return m * p // self.n, m * (p + 1) // self.n

    def allreduce(self, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray],
                  wire: np.dtype, reduce: Callable[..., None], *,
                  encode: Callable[[np.ndarray, np.ndarray], None] | None = None,
                  decode: Callable[[np.ndarray, np.ndarray], None] | None = None,
                  cross: Callable[[np.ndarray], None] | None = None,
                  finish: Callable[[np.ndarray], None] | None = None,
                  phases: dict[str, float] | None = None, what: str = "allreduce") -> None:
        """Stream the flat arrays ``srcs`` through the segments into ``dsts`` (pairwise equal
        sizes; a pair may be the same array), as if they were one concatenated buffer.

        The segments *are* the fusion buffer: tensors are packed straight into the slots and
        unpacked straight out of them, so fusing many tensors costs no extra copy.
        ``encode``/``decode`` convert to and from the ``wire`` dtype on the way (compression);
        ``reduce(part, [peer parts], first=None)`` combines in place; ``cross(part)``
        (hierarchical) reduces this rank's part with the other hosts; ``finish(part)``
        (averages) runs once on the final value. ``phases`` accumulates seconds spent copying
        in, reducing and copying out, for the timeline.
        """
        if len(srcs) == 1 and encode is None and srcs[0].size * wire.itemsize <= \
                self.chunk_bytes and phases is None:
            self._allreduce_small(srcs[0], dsts[0], wire, reduce, cross, finish, what)
            return
        if cross is not None and phases is None and \
                sum(s.size for s in srcs) * wire.itemsize > self.chunk_bytes:
            self._allreduce_pipelined(srcs, dsts, wire, reduce, encode or _copy,
                                      decode or _copy, cross, finish, what)
            return
        layout = _Layout([s.size for s in srcs])
        encode = encode or _copy
        decode = decode or _copy
        plain = encode is _copy
        step = self.chunk_bytes // wire.itemsize
        me, n = self.me, self.n
        clock = time.perf_counter if phases is not None else None
        for start in range(0, layout.total, step):
            m = min(step, layout.total - start)
            self.seq += 1
            seq = self.seq
            views = [slot[seq % 2][: m * wire.itemsize].view(wire) for slot in self._slots]
            mine = views[me]
            lo, hi = self.part(m, me)
            t0 = clock() if clock else 0.0
            # the peers reduce every part but ours; ours is reduced straight from the source
            # when it lies inside one array and needs no conversion
            direct = layout.single(start + lo, start + hi) if plain and hi > lo else None
            for a, b in ((0, lo), (hi, m)) if direct is not None else ((0, m),):
                for i, alo, ahi, pos in layout.pieces(start + a, start + b):
                    encode(srcs[i][alo:ahi], mine[pos - start:pos - start + ahi - alo])
            self._publish(_ARRIVE, seq)
            self._wait(_ARRIVE, seq, what)
            t1 = clock() if clock else 0.0
            if hi > lo:
                part = mine[lo:hi]
                first = None
                if direct is not None:
                    i, alo = direct
                    first = srcs[i][alo:alo + hi - lo]
                reduce(part, [views[p][lo:hi] for p in self._peers], first=first)
                if cross is not None:
                    cross(part)
                if finish is not None:
                    finish(part)
            self._publish(_REDUCED, seq)
            self._wait(_REDUCED, seq, what)
            t2 = clock() if clock else 0.0
            for p in range(n):
                plo, phi = self.part(m, p)
                for i, alo, ahi, pos in layout.pieces(start + plo, start + phi):
                    decode(views[p][pos - start:pos - start + ahi - alo], dsts[i][alo:ahi])
            if clock:
                t3 = clock()
                phases["memcpy_in"] = phases.get("memcpy_in", 0.0) + t1 - t0
                phases["reduce"] = phases.get("reduce", 0.0) + t2 - t1
                phases["memcpy_out"] = phases.get("memcpy_out", 0.0) + t3 - t2

    def _allreduce_pipelined(self, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray],
                             wire: np.dtype, reduce: Callable[..., None],
                             encode: Callable[[np.ndarray, np.ndarray], None],
                             decode: Callable[[np.ndarray, np.ndarray], None],
                             cross: Callable[[np.ndarray], None],
                             finish: Callable[[np.ndarray], None] | None, what: str) -> None:
        """The hierarchical allreduce with its phases overlapped: while chunk k crosses
        hosts (``cross`` on a helper thread, which alone uses the TCP links meanwhile), this
        thread copies chunk k+1 in and reduces it on the host, and copies chunk k-1 out.

        Chunk k's slot is rewritten by chunk k+2, so before copying k+2 in every rank waits
        for its peers' ``COPIED`` flag of chunk k (copying out now trails copying in by a
        chunk, so the arrival of k+1 no longer implies it)."""
        layout = _Layout([s.size for s in srcs])
        step = self.chunk_bytes // wire.itemsize
        me = self.me
        first = self.seq + 1
        if self._crosser is None:
            self._crosser = ThreadPoolExecutor(1, thread_name_prefix="shoal-cross")

        def views(seq: int, m: int) -> list[np.ndarray]:
            return [slot[seq % 2][: m * wire.itemsize].view(wire) for slot in self._slots]

        def drain(seq: int, start: int, m: int, crossing: Future) -> None:
            crossing.result()  # the helper's error, if it failed
            parts = views(seq, m)
            lo, hi = self.part(m, me)
            if hi > lo and finish is not None:
                finish(parts[me][lo:hi])
            self._settle(seq, what)
            for p in range(self.n):
                plo, phi = self.part(m, p)
                for i, alo, ahi, pos in layout.pieces(start + plo, start + phi):
                    decode(parts[p][pos - start:pos - start + ahi - alo], dsts[i][alo:ahi])
            self._publish(_COPIED, seq)

        # (a failure unwinds at once: the engine then aborts, which ends the helper's wait)
        behind: tuple[int, int, int, Future] | None = None
        for start in range(0, layout.total, step):
            m = min(step, layout.total - start)
            self.seq += 1
            seq = self.seq
            if seq - 2 >= first:  # peers done reading this slot's previous chunk
                self._wait(_COPIED, seq - 2, what)
            parts = views(seq, m)
            for i, alo, ahi, pos in layout.pieces(start, start + m):
                encode(srcs[i][alo:ahi], parts[me][pos - start:pos - start + ahi - alo])
            self._arrive(seq, what)
            lo, hi = self.part(m, me)
            if hi > lo:
                reduce(parts[me][lo:hi], [parts[p][lo:hi] for p in self._peers])
            crossing = self._crosser.submit(cross, parts[me][lo:hi]) if hi > lo else _done()
            if behind is not None:
                drain(*behind)
            behind = (seq, start, m, crossing)
        if behind is not None:
            drain(*behind)

    def _allreduce_small(self, src: np.ndarray, dst: np.ndarray, wire: np.dtype,
                         reduce: Callable[..., None], cross: Callable[[np.ndarray], None] | None,
                         finish: Callable[[np.ndarray], None] | None, what: str) -> None:
        """One array that fits one slot: the same steps with the least Python per call."""
        m = src.size
        self.seq += 1
        seq = self.seq
        nbytes = m * wire.itemsize
        views = [slot[seq % 2][:nbytes].view(wire) for slot in self._slots]
        me = self.me
        lo, hi = self.part(m, me)
        mine = views[me]
        if lo:
            mine[:lo] = src[:lo]
        if hi < m:
            mine[hi:] = src[hi:]
        self._publish(_ARRIVE, seq)
        self._wait(_ARRIVE, seq, what)
        if hi > lo:
            part = mine[lo:hi]
            reduce(part, [views[p][lo:hi] for p in self._peers], first=src[lo:hi])
            if cross is not None:
                cross(part)
            if finish is not None:
                finish(part)
        self._publish(_REDUCED, seq)
        self._wait(_REDUCED, seq, what)
        for p in range(self.n):
            plo, phi = self.part(m, p)
            dst[plo:phi] = views[p][plo:phi]

    def close(self) -> None:
        """Unmap the segments (they were unlinked at set-up)."""
        if self._crosser is not None:
            self._crosser.shutdown(wait=False)
        self._hdr = []
        self._slots = []
        for views in (self._words, *self._bytes):
            for view in views:
                view.release()
        self._words, self._bytes, self._views = [], [], {}
        for m in self._maps:
            # a view may still be alive somewhere; then the mapping goes with the process
            with contextlib.suppress(BufferError):
                m.close()
        self._maps = []
