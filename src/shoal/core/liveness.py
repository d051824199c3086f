"""Liveness apart from progress: heartbeats among the ranks of one communicator.

A rank that computes for an hour is alive; a rank that was killed, frozen (SIGSTOP) or whose
host became unreachable is not. Progress cannot tell the two apart, so every communicator runs
a small thread that sends an authenticated heartbeat to each peer every
``SHOAL_HEARTBEAT_INTERVAL_S`` and records when each peer was last heard. Waits inside
collectives ask :meth:`Liveness.check`: a peer silent for ``SHOAL_HEARTBEAT_TIMEOUT_S`` is lost
(:class:`PeerLostError`, naming it); a live one is waited for without limit, with a periodic
stall warning that names it (``SHOAL_STALL_WARNING_S``). ``SHOAL_TIMEOUT_S``, when set above 0,
still bounds any single wait.

Heartbeats are UDP datagrams where UDP passes, and ride on TCP where it does not
(``SHOAL_HEARTBEAT``: ``auto``, the default, probes UDP at start and falls back to TCP, saying
so once; ``udp``; ``tcp``). Over TCP each pair of ranks holds one authenticated connection
(role ``heartbeat``) that carries the same packets both ways.

A packet is ``uid, sender rank, sequence`` and an HMAC of them under a key derived from the job
secret. A packet whose sequence is not above the sender's last is dropped, so a recorded
heartbeat replayed later keeps no dead rank alive.
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
from collections.abc import Callable, Sequence

from .errors import AuthenticationError, PeerLostError
from .netutil import admit_all, introduce, recv_exact

__all__ = ["MODES", "PACKET_BYTES", "Liveness"]

log = logging.getLogger("shoal.liveness")
_PACKET = struct.Struct("!8sIQ")  # communicator uid, sender rank, sequence number
_TAG = 16
PACKET_BYTES = _PACKET.size + _TAG
MODES = ("auto", "udp", "tcp")
_ROLE = b"heartbeat"
_HANDSHAKE_S = 5.0


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
        self._secret = secret
        self._key = hashlib.sha256(b"shoal-heartbeat:" + secret).digest()
        self._uid = uid[:8].ljust(8, b"\0")
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((bind_addr, 0))
        self._sock.setblocking(False)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._listener = socket.create_server((bind_addr, 0), backlog=64)
        self._listener.setblocking(False)
        self.tcp_address: tuple[str, int] = self._listener.getsockname()[:2]
        self.mode = "udp"
        self.sent = 0
        self._peers: dict[int, tuple[str, int]] = {}
        self._seen: dict[int, float] = {}
        self._seq: dict[int, int] = {}  # the highest sequence accepted from each peer
        self._heard: set[int] = set()
        self._links: dict[int, socket.socket] = {}  # tcp mode: rank -> connection
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._warned: dict[tuple[str, tuple[int, ...]], float] = {}

    # -- packets ---------------------------------------------------------------------------
    def _packet(self, seq: int) -> bytes:
        body = _PACKET.pack(self._uid, self.rank, seq)
        return body + hmac.new(self._key, body, "sha256").digest()[:_TAG]

    def accept(self, data: bytes, claimed: int | None = None) -> bool:
        """Take one packet (from a datagram, or from the connection of rank ``claimed``):
        whether it was a fresh heartbeat of a peer. Anything else (wrong length or key,
        another communicator, an unknown rank, a sequence seen before) changes nothing."""
        if len(data) != PACKET_BYTES:
            return False
        body, tag = data[:_PACKET.size], data[_PACKET.size:]
        if not hmac.compare_digest(tag, hmac.new(self._key, body, "sha256").digest()[:_TAG]):
            return False  # a stranger, garbage, or another job's heartbeat
        uid, rank, seq = _PACKET.unpack(body)
        if uid != self._uid or rank not in self._seen or claimed not in (None, rank):
            return False
        with self._lock:
            if seq <= self._seq.get(rank, 0):
                return False  # replayed or reordered: not news of life
            self._seq[rank] = seq
            self._seen[rank] = time.monotonic()
            self._heard.add(rank)
        return True

    # -- start -----------------------------------------------------------------------------
    def start(self, peers: dict[int, tuple[str, int]],
              tcp_peers: dict[int, tuple[str, int]] | None = None, mode: str = "udp") -> None:
        """Begin sending to and listening for ``peers`` (rank -> UDP address; over TCP,
        ``tcp_peers``' addresses). ``mode`` ``auto`` starts with UDP: :meth:`udp_heard_all`
        and :meth:`use_tcp` then settle it."""
        self._peers = {r: a for r, a in peers.items() if r != self.rank}
        self._tcp_peers = {r: a for r, a in (tcp_peers or {}).items() if r != self.rank}
        now = time.monotonic()
        self._seen = dict.fromkeys(self._peers, now)
        if not self._peers:
            return
        self._spawn(self._loop, "shoal-heartbeat")
        if mode == "tcp":
            self.use_tcp()
        elif mode == "udp":
            self.keep_udp()

    def keep_udp(self) -> None:
        """UDP it is: close the TCP heartbeat port, so no unused port stays open."""
        with contextlib.suppress(OSError):
            self._listener.close()

    def udp_heard_all(self, within: float) -> list[int]:
        """Wait up to ``within`` seconds to hear every peer over UDP; the peers not heard."""
        deadline = time.monotonic() + within
        while True:
            missing = sorted(set(self._peers) - self._heard)
            if not missing or time.monotonic() > deadline or self._stop.is_set():
                return missing
            time.sleep(0.01)

    def use_tcp(self) -> None:
        """Switch to heartbeats over TCP: accept from higher ranks, dial lower ones."""
        self.mode = "tcp"
        with contextlib.suppress(OSError):
            self._sock.close()
        self._spawn(self._accept_loop, "shoal-heartbeat-accept")
        for r, addr in self._tcp_peers.items():
            if r < self.rank:
                self._spawn(lambda r=r, addr=addr: self._dial(r, addr), "shoal-heartbeat-dial",
                            joined=False)

    def _spawn(self, target: Callable[[], None], name: str, joined: bool = True) -> None:
        """Start a daemon thread; :meth:`close` joins the ``joined`` ones (the loops)."""
        thread = threading.Thread(target=target, name=name, daemon=True)
        if joined:
            self._threads.append(thread)
        thread.start()

    # -- udp and sending -------------------------------------------------------------------
    def _loop(self) -> None:
        seq, next_send = 0, 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_send:
                seq += 1
                self.sent = seq  # the last sequence number sent (the replay scenario reads it)
                packet = self._packet(seq)
                if self.mode == "udp":
                    for addr in self._peers.values():
                        with contextlib.suppress(OSError):  # unreachable: the peer's problem
                            self._sock.sendto(packet, addr)
                else:
                    with self._lock:
                        links = list(self._links.items())
                    for r, link in links:
                        try:  # never blocks: a peer frozen for hours only fills its buffer
                            whole = link.send(packet, socket.MSG_DONTWAIT) == len(packet)
                        except OSError:  # gone, or its buffer is full
                            whole = False
                        if not whole:
                            self._drop(r, link)
                next_send = now + self.interval
            if self.mode != "udp":
                self._stop.wait(max(0.0, next_send - time.monotonic()))
                continue
            try:
                ready, _, _ = select.select([self._sock], [], [], max(0.0, next_send - now))
            except (OSError, ValueError):
                if self.mode == "udp":
                    return  # closed
                continue
            if ready:
                self._drain()

    def _drain(self) -> None:
        while True:
            try:
                data = self._sock.recv(256)
            except OSError:  # nothing more (BlockingIOError), or closed
                return
            self.accept(data)

    # -- tcp -------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        admit_all(self._listener, self._secret, _ROLE, rank=self.rank, what="heartbeat",
                  valid=lambda peer: peer in self._tcp_peers and peer > self.rank,
                  on_peer=lambda sock, peer: self._serve(peer, sock),
                  stopped=self._stop.is_set, handshake_s=_HANDSHAKE_S)

    def _dial(self, peer: int, addr: tuple[str, int]) -> None:
        delay = 0.05
        while not self._stop.is_set():
            try:
                sock = socket.create_connection(addr, timeout=_HANDSHAKE_S)
                introduce(sock, self._secret, _ROLE, self.rank)
            except (OSError, AuthenticationError, PeerLostError) as exc:
                log.debug("rank %d: heartbeat connection to rank %d: %s", self.rank, peer, exc)
                self._stop.wait(delay)
                delay = min(2 * delay, self.interval)
                continue
            self._serve(peer, sock)
            return

    def _serve(self, peer: int, sock: socket.socket) -> None:
        sock.settimeout(None)  # reads block until a packet or close(); sends never block
        with self._lock:
            if self._stop.is_set():
                sock.close()
                return
            old = self._links.pop(peer, None)
            self._links[peer] = sock
        if old is not None:
            old.close()
        while not self._stop.is_set():
            try:
                data = recv_exact(sock, PACKET_BYTES, "peer")
            except (OSError, PeerLostError):
                break
            self.accept(data, peer)
        self._drop(peer, sock)

    def _drop(self, peer: int, sock: socket.socket) -> None:
        with self._lock:
            if self._links.get(peer) is sock:
                del self._links[peer]
        with contextlib.suppress(OSError):
            sock.close()

    # -- verdicts --------------------------------------------------------------------------
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
                f"(SHOAL_HEARTBEAT_TIMEOUT_S={self.timeout:g}, over {self.mode.upper()}) "
                f"during {what}: killed, frozen (SIGSTOP) or its host is unreachable",
                rank=lost[0])
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
        """Stop the threads and close the sockets."""
        self._stop.set()
        with contextlib.suppress(OSError):  # wake the thread's select at once
            self._sock.sendto(b"", self.address)
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        for sock in links:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self.interval + 2.0)
        self._sock.close()
        self._listener.close()
