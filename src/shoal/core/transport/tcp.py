"""TCP transport between ranks (any hosts): persistent, authenticated, non-blocking.

At set-up every rank listens on its bind address, publishes it through the rendezvous store, and
connects to every lower rank; each connection is authenticated with the job secret (role
``data``) before the peer's rank is believed, and the listener is closed once the mesh is
complete, so nothing stays open to strangers.

Transfers are non-blocking and driven by one ``selectors`` loop, so a rank can send to its right
neighbour and receive from its left one at once without threads and without the deadlock of two
blocking ``sendall`` calls; large buffers go straight from and into numpy memory
(``send``/``recv_into`` on memoryviews, no intermediate copies). A transfer that makes no progress
for ``timeout`` seconds, or a closed connection, is a :class:`PeerLostError` naming the peer.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Sequence

from ..errors import PeerLostError, RendezvousError, ShoalError
from ..liveness import Liveness
from ..netutil import admit_all, dial_until, introduce, tune_socket

__all__ = ["TcpMesh"]

log = logging.getLogger("shoal.transport.tcp")
_ROLE = b"data"


class TcpMesh:
    """Authenticated TCP connections from this rank to every other rank."""

    def __init__(self, rank: int, size: int, secret: bytes, *, timeout: float,
                 buffer_bytes: int, bind_addr: str, liveness: Liveness | None = None) -> None:
        self.rank = rank
        self.liveness = liveness  # None: ``timeout`` bounds every wait
        self.size = size
        self.timeout = timeout
        self._secret = secret
        self._buffer_bytes = buffer_bytes
        self._socks: dict[int, socket.socket] = {}
        self.closing = False  # set from another thread to end a blocked transfer
        self._sel = selectors.DefaultSelector()
        self._listener = socket.create_server((bind_addr, 0), backlog=max(16, size))
        self.address = self._listener.getsockname()[:2]

    # -- set-up ----------------------------------------------------------------------------
    def connect(self, addresses: Sequence[tuple[str, int]], start_timeout: float) -> None:
        """Accept from higher ranks and connect to lower ones; bounded by ``start_timeout``."""
        expected = set(range(self.rank + 1, self.size))
        acceptor = threading.Thread(target=self._accept_all, args=(expected, start_timeout),
                                    daemon=True)
        acceptor.start()
        deadline = time.monotonic() + start_timeout
        for peer in range(self.rank):
            self._socks[peer] = self._dial(peer, addresses[peer], deadline)
        acceptor.join(max(0.0, deadline - time.monotonic()) + 1.0)
        self._listener.close()
        missing = sorted(set(range(self.size)) - {self.rank} - set(self._socks))
        if missing:
            raise RendezvousError(f"rank {self.rank}: ranks {missing} never opened their data "
                                  f"connection within {start_timeout:g}s")
        for sock in self._socks.values():
            sock.setblocking(False)

    def _dial(self, peer: int, addr: tuple[str, int], deadline: float) -> socket.socket:
        sock = dial_until(addr, deadline, self.timeout,
                          f"rank {self.rank}: cannot connect to rank {peer}")
        tune_socket(sock, self._buffer_bytes)
        introduce(sock, self._secret, _ROLE, self.rank)
        return sock

    def _accept_all(self, expected: set[int], start_timeout: float) -> None:
        """Take one proven connection from each higher rank (each proves itself on its own
        thread, so a silent stranger delays none of them), until all came or time is up."""
        deadline = time.monotonic() + start_timeout
        pending = set(expected)
        lock = threading.Lock()

        def admitted(sock: socket.socket, peer: int) -> None:
            with lock:
                if peer not in pending:  # a second connection claiming the same rank
                    log.warning("rank %d: refused a second data connection claiming rank %d",
                                self.rank, peer)
                    sock.close()
                    return
                tune_socket(sock, self._buffer_bytes)
                sock.settimeout(self.timeout)
                self._socks[peer] = sock
                pending.discard(peer)

        admit_all(self._listener, self._secret, _ROLE, rank=self.rank, what="data",
                  valid=lambda peer: peer in expected, on_peer=admitted,
                  stopped=lambda: not pending or time.monotonic() > deadline,
                  handshake_s=min(5.0, self.timeout))

    # -- transfers -------------------------------------------------------------------------
    def exchange(self, sends: Sequence[tuple[int, memoryview]],
                 recvs: Sequence[tuple[int, memoryview]],
                 on_recv: Callable[[int, int, int], None] | None = None,
                 what: str = "transfer") -> None:
        """Send and receive several buffers at once, making progress on all of them.

        ``on_recv(index, done_bytes, total)`` is called as data of ``recvs[index]`` arrives,
        so a reduction can work on the first part while the rest is still on the wire.
        """
        sel = self._sel
        out = [[peer, view.cast("B"), 0] for peer, view in sends if view.nbytes]
        inc = [[peer, view.cast("B"), 0, i] for i, (peer, view) in enumerate(recvs)
               if view.nbytes]
        interest: dict[socket.socket, int] = {}
        for peer, _v, _d in out:
            interest[self._sock(peer)] = interest.get(self._sock(peer), 0) | selectors.EVENT_WRITE
        for peer, _v, _d, _i in inc:
            interest[self._sock(peer)] = interest.get(self._sock(peer), 0) | selectors.EVENT_READ
        if not interest:
            return
        for sock, events in interest.items():
            sel.register(sock, events)
        try:
            last = time.monotonic()
            while out or inc:
                ready = sel.select(timeout=min(self.timeout, 0.2))
                if not ready:
                    if self.closing:
                        raise ShoalError(f"rank {self.rank}: gave up during {what}: this rank "
                                         f"is shutting down")
                    waited = time.monotonic() - last
                    if self.liveness is not None:
                        self.liveness.check(sorted({e[0] for e in out} | {e[0] for e in inc}),
                                            what, waited)
                    elif waited > self.timeout:
                        self._silent(out, inc, what)
                    continue
                last = time.monotonic()
                for key, events in ready:
                    sock = key.fileobj
                    if events & selectors.EVENT_WRITE:
                        out = self._progress_send(sock, out, what)
                    if events & selectors.EVENT_READ:
                        inc = self._progress_recv(sock, inc, on_recv, what)
                for sock, events in interest.items():
                    want = 0
                    if any(self._socks[e[0]] is sock for e in out):
                        want |= selectors.EVENT_WRITE
                    if any(self._socks[e[0]] is sock for e in inc):
                        want |= selectors.EVENT_READ
                    if want != events:
                        interest[sock] = want
                        if want:
                            sel.modify(sock, want)
                        else:
                            sel.unregister(sock)
        finally:
            for sock, events in interest.items():
                if events:
                    sel.unregister(sock)

    def _progress_send(self, sock: socket.socket, out: list, what: str) -> list:
        for entry in out:
            peer, view, done = entry
            if self._socks[peer] is not sock:
                continue
            try:
                entry[2] = done + sock.send(view[done:])
            except BlockingIOError:
                pass
            except OSError as exc:
                raise PeerLostError(f"rank {self.rank}: lost rank {peer} during {what}: {exc}",
                                    rank=peer) from None
            break  # one buffer per socket at a time keeps the byte order of the stream
        return [e for e in out if e[2] < len(e[1])]

    def _progress_recv(self, sock: socket.socket, inc: list,
                       on_recv: Callable[[int, int, int], None] | None, what: str) -> list:
        for entry in inc:
            peer, view, done, index = entry
            if self._socks[peer] is not sock:
                continue
            try:
                n = sock.recv_into(view[done:])
            except BlockingIOError:
                break
            except OSError as exc:
                raise PeerLostError(f"rank {self.rank}: lost rank {peer} during {what}: {exc}",
                                    rank=peer) from None
            if n == 0:
                raise PeerLostError(f"rank {self.rank}: rank {peer} closed its connection during "
                                    f"{what} (it exited or crashed)", rank=peer)
            entry[2] = done + n
            if on_recv is not None:
                on_recv(index, entry[2], len(view))
            break
        return [e for e in inc if e[2] < len(e[1])]

    def _silent(self, out: list, inc: list, what: str) -> None:
        peers = sorted({e[0] for e in out} | {e[0] for e in inc})
        raise PeerLostError(f"rank {self.rank}: no progress from ranks {peers} during {what} for "
                            f"SHOAL_TIMEOUT_S={self.timeout:g}s (stopped or unreachable)",
                            rank=peers[0])

    def _sock(self, peer: int) -> socket.socket:
        try:
            return self._socks[peer]
        except KeyError:
            raise PeerLostError(f"rank {self.rank}: no connection to rank {peer}",
                                rank=peer) from None

    def send(self, peer: int, view: memoryview, what: str = "send") -> None:
        """Send one buffer to ``peer``."""
        self.exchange([(peer, view)], [], what=what)

    def recv_into(self, peer: int, view: memoryview, what: str = "receive") -> None:
        """Fill ``view`` from ``peer``."""
        self.exchange([], [(peer, view)], what=what)

    def close(self) -> None:
        """Close every connection (peers see end-of-stream)."""
        for sock in self._socks.values():
            with contextlib.suppress(OSError):
                sock.close()
        self._socks.clear()
        self._sel.close()
        with contextlib.suppress(OSError):
            self._listener.close()
