"""Liveness apart from progress: UDP heartbeats among the ranks of one communicator.

A rank that computes for an hour is alive; a rank that was killed, frozen (SIGSTOP) or whose
host became unreachable is not. Progress cannot tell the two apart, so every communicator runs
a small thread that sends an authenticated datagram to each peer every
``SHOAL_HEARTBEAT_INTERVAL_S`` and records when each peer was last heard. Waits inside
collectives ask :meth:`Liveness.check`: a peer silent for ``SHOAL_HEARTBEAT_TIMEOUT_S`` is lost
(:class:`PeerLostError`, naming it); a live one is waited for without limit, with a periodic
stall warning that names it (``SHOAL_STALL_WARNING_S``). ``SHOAL_TIMEOUT_S``, when set above 0,
still bounds any single wait.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence

from .errors import PeerLostError

__all__ = ["Liveness"]

log = logging.getLogger("shoal.liveness")
_PACKET = struct.Struct("!8sIQ")  # communicator uid, sender rank, sequence number
_TAG = 16


class Liveness:
    """Heartbeats of one communicator; ``rank`` numbers are the communicator's own."""

    def __init__(self, rank: int, secret: bytes, uid: bytes, bind_addr: str, *,
                 interval: float, timeout: float, stall_warning: float,
                 hard_timeout: float = 0.0) -> None:
        self.rank = rank
        self.interval = interval
        self.timeout = timeout
        self.stall_warning = stall_warning
        self.hard_timeout = hard_timeout
        self._key = hashlib.sha256(b"shoal-heartbeat:" + secret).digest()
        self._uid = uid[:8].ljust(8, b"\0")
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((bind_addr, 0))
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._peers: dict[int, tuple[str, int]] = {}
        self._seen: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: dict[tuple[str, tuple[int, ...]], float] = {}

    def start(self, peers: dict[int, tuple[str, int]]) -> None:
        """Begin sending to and listening for ``peers`` (rank -> UDP address)."""
        self._peers = {r: a for r, a in peers.items() if r != self.rank}
        now = time.monotonic()
        self._seen = dict.fromkeys(self._peers, now)
        if self._peers:
            self._thread = threading.Thread(target=self._loop, name="shoal-heartbeat",
                                            daemon=True)
            self._thread.start()

    def _packet(self, seq: int) -> bytes:
        body = _PACKET.pack(self._uid, self.rank, seq)
        return body + hmac.new(self._key, body, "sha256").digest()[:_TAG]

    def _loop(self) -> None:
        seq, next_send = 0, 0.0
        sock = self._sock
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_send:
                seq += 1
                packet = self._packet(seq)
                for addr in self._peers.values():
                    with contextlib.suppress(OSError):  # unreachable now: the peer's problem
                        sock.sendto(packet, addr)
                next_send = now + self.interval
            try:
                ready, _, _ = select.select([sock], [], [], max(0.0, next_send - now))
            except (OSError, ValueError):
                return  # closed
            if ready:
                self._drain()

    def _drain(self) -> None:
        while True:
            try:
                data = self._sock.recv(256)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(data) != _PACKET.size + _TAG:
                continue
            body, tag = data[:_PACKET.size], data[_PACKET.size:]
            if not hmac.compare_digest(tag, hmac.new(self._key, body, "sha256").digest()[:_TAG]):
                continue  # a stranger, garbage, or another job's heartbeat
            uid, rank, _seq = _PACKET.unpack(body)
            if uid == self._uid and rank in self._seen:
                self._seen[rank] = time.monotonic()

    def silent_for(self, rank: int) -> float:
        """Seconds since ``rank`` was last heard (0 for this rank or unknown ones)."""
        seen = self._seen.get(rank)
        return 0.0 if seen is None else time.monotonic() - seen

    def check(self, ranks: Sequence[int], what: str, waited: float) -> None:
        """Called while waiting ``waited`` seconds on ``ranks``: raise :class:`PeerLostError`
        for a peer that stopped sending heartbeats; warn (periodically) about live but slow
        ones; raise after ``hard_timeout`` when one is set."""
        lost = [r for r in ranks if self.silent_for(r) > self.timeout]
        if lost:
            age = self.silent_for(lost[0])
            raise PeerLostError(
                f"rank {self.rank}: rank{'s' if len(lost) > 1 else ''} "
                f"{', '.join(map(str, lost))} sent no heartbeat for {age:.1f}s "
                f"(SHOAL_HEARTBEAT_TIMEOUT_S={self.timeout:g}) during {what}: killed, frozen "
                f"(SIGSTOP) or its host is unreachable", rank=lost[0])
        if self.hard_timeout and waited > self.hard_timeout:
            raise PeerLostError(
                f"rank {self.rank}: ranks {list(ranks)} did not progress in {what} within "
                f"SHOAL_TIMEOUT_S={self.hard_timeout:g}s (alive, but stuck or too slow; raise "
                f"or unset the timeout if they are just slow)", rank=ranks[0] if ranks else None)
        if self.stall_warning and waited > self.stall_warning:
            key = (what, tuple(ranks))
            last = self._warned.get(key, 0.0)
            now = time.monotonic()
            if now - last > self.stall_warning:
                if len(self._warned) > 64:
                    self._warned.clear()
                self._warned[key] = now
                log.warning("rank %d: waited %.0fs in %s for ranks %s; they are alive "
                            "(heartbeats arrive) but busy or waiting on something else",
                            self.rank, waited, what, list(ranks))

    def close(self) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        with contextlib.suppress(OSError):  # wake the thread's select at once
            self._sock.sendto(b"", self.address)
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 2.0)
        self._sock.close()
