"""TCP transport between ranks (any hosts): persistent, authenticated, non-blocking, striped.

At set-up every rank listens on its bind address, publishes it through the rendezvous store, and
connects to every lower rank; each connection is authenticated with the job secret (role
``data``) before the peer's rank is believed, and the listener is closed once the mesh is
complete, so nothing stays open to strangers.

Between ranks on different hosts there may be several connections (*streams*, agreed per pair
at set-up: :func:`choose_streams`). Cloud networks cap each TCP flow far below the NIC (EC2: 5
Gbit/s per flow outside a cluster placement group, 10 inside, on NICs of 100-400 Gbit/s), so one
connection per peer would leave most of the link idle. A message of at least two stripes is cut
into pieces dealt round-robin over the streams (:func:`stripe_plan`, a function of the length and
the stream count only, so both ends cut alike); a smaller one travels on the first stream. Each
stream is a FIFO, so pieces keep their order on it and no header is needed.

Transfers are non-blocking and driven by one ``selectors`` loop, so a rank can send to its right
neighbour and receive from its left one at once without threads and without the deadlock of two
blocking ``sendall`` calls; large buffers go straight from and into numpy memory
(``send``/``recv_into`` on memoryviews, no intermediate copies). A transfer that makes no progress
for ``timeout`` seconds, or a closed connection (any one stream), is a :class:`PeerLostError`
naming the peer.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from ..errors import PeerLostError, RendezvousError, ShoalError
from ..liveness import Liveness
from ..netutil import admit_all, dial_until, introduce, tune_socket

__all__ = ["AUTO_STREAMS", "TcpMesh", "choose_streams", "stripe_plan"]

log = logging.getLogger("shoal.transport.tcp")
_ROLE = b"data"
#: streams per cross-host peer under ``SHOAL_TCP_STREAMS=auto``. On the emulated cluster
#: (BENCHMARKS.md, 64 MiB) with every flow capped at a quarter of the link, 4 streams reach
#: 0.93x of the link floor on 2 nodes and 0.90x on 4, where one gets 0.47x; uncapped they
#: cost 7% (0.93x against 1.00x; 4 nodes 0.84x against 0.91x), so an uncapped private network
#: is faster with ``SHOAL_TCP_STREAMS=1``. Clouds cap flows: auto assumes one.
AUTO_STREAMS = 4
#: ``auto`` keeps a rank's data sockets under this many (file descriptors, kernel memory)
_SOCKET_BUDGET = 1024
_MAX_PIECE = 1 << 20  # pieces of a long message: the receiver's contiguous prefix grows by this


def choose_streams(setting: int, largest_message: int, stripe_bytes: int,
                   remote_peers: int) -> int:
    """Streams per peer on another host: ``setting`` when it is set (> 0), else
    :data:`AUTO_STREAMS`, fewer when the largest message the engine sends across hosts
    (``largest_message`` bytes) cannot fill them with stripes of ``stripe_bytes``, and fewer
    when ``remote_peers`` would make the rank hold more than 1024 sockets."""
    if setting > 0:
        return setting
    fill = max(1, largest_message // max(1, stripe_bytes))
    budget = max(1, _SOCKET_BUDGET // max(1, remote_peers))
    return max(1, min(AUTO_STREAMS, fill, budget))


def stripe_plan(nbytes: int, streams: int, stripe_bytes: int) -> list[tuple[int, int, int]]:
    """How a message of ``nbytes`` crosses ``streams`` connections: ``(stream, start, end)``
    pieces in order. Below two stripes it is one piece on stream 0; above, pieces of
    ``stripe_bytes`` to 1 MiB (a quarter of an even share each, so the receiver's contiguous
    prefix keeps growing while all streams are busy), dealt round-robin."""
    if streams <= 1 or nbytes < 2 * stripe_bytes:
        return [(0, 0, nbytes)]
    piece = min(max(stripe_bytes, -(-nbytes // (4 * streams))), max(stripe_bytes, _MAX_PIECE))
    return [(k % streams, start, min(start + piece, nbytes))
            for k, start in enumerate(range(0, nbytes, piece))]


def _claim(rank: int, stream: int, size: int) -> int:
    """The number a dialling rank names for one of its streams (rank + stream x size)."""
    return rank + stream * size


class _Recv:
    """One receive buffer spread over pieces: tracks the contiguous prefix that arrived."""

    __slots__ = ("done", "index", "lengths", "next", "reported", "starts", "total")

    def __init__(self, index: int, total: int, plan: list[tuple[int, int, int]]) -> None:
        self.index = index
        self.total = total
        self.starts = [lo for _s, lo, _h in plan]
        self.lengths = [hi - lo for _s, lo, hi in plan]
        self.done = [0] * len(plan)  # bytes in each piece so far
        self.next = 0  # first piece not complete
        self.reported = 0

    def prefix(self) -> int:
        """Bytes from the start that have all arrived."""
        while self.next < len(self.done) and self.done[self.next] == self.lengths[self.next]:
            self.next += 1
        if self.next == len(self.done):
            return self.total
        return self.starts[self.next] + self.done[self.next]


class TcpMesh:
    """Authenticated TCP connections from this rank to every other rank (one or several
    streams per peer); ``sent``/``received`` count the payload bytes moved per peer (control
    rounds apart, in ``control_sent``/``control_received``)."""

    def __init__(self, rank: int, size: int, secret: bytes, *, timeout: float,
                 buffer_bytes: int, bind_addr: str, liveness: Liveness | None = None,
                 stripe_bytes: int = 64 << 10) -> None:
        self.rank = rank
        self.liveness = liveness  # None: ``timeout`` bounds every wait
        self.size = size
        self.timeout = timeout
        self.stripe_bytes = stripe_bytes
        self._secret = secret
        self._buffer_bytes = buffer_bytes
        self._counts = [1] * size
        self._socks: dict[int, list[socket.socket]] = {}
        self._owner: dict[socket.socket, tuple[int, int]] = {}  # socket -> (peer, stream)
        self.sent = [0] * size
        self.received = [0] * size
        self.control_sent = [0] * size
        self.control_received = [0] * size
        self.closing = False  # set from another thread to end a blocked transfer
        self._sel = selectors.DefaultSelector()
        self._listener = socket.create_server((bind_addr, 0), backlog=max(16, size))
        self.address = self._listener.getsockname()[:2]

    # -- set-up ----------------------------------------------------------------------------
    def streams(self, peer: int) -> int:
        """How many connections lead to ``peer``."""
        return len(self._socks.get(peer, ())) or 1

    def connect(self, addresses: Sequence[tuple[str, int]], start_timeout: float,
                streams: Sequence[int] | None = None) -> None:
        """Accept from higher ranks and connect to lower ones, ``streams[peer]`` connections
        each (both ends must pass the same counts; one each by default); bounded by
        ``start_timeout``."""
        counts = list(streams) if streams is not None else [1] * self.size
        self._counts = counts
        expected = {_claim(peer, s, self.size) for peer in range(self.rank + 1, self.size)
                    for s in range(counts[peer])}
        slots: dict[int, list[socket.socket | None]] = {
            peer: [None] * counts[peer] for peer in range(self.size) if peer != self.rank}
        acceptor = threading.Thread(target=self._accept_all,
                                    args=(expected, slots, start_timeout), daemon=True)
        acceptor.start()
        deadline = time.monotonic() + start_timeout
        for peer in range(self.rank):
            for s in range(counts[peer]):
                slots[peer][s] = self._dial(peer, s, addresses[peer], deadline)
        acceptor.join(max(0.0, deadline - time.monotonic()) + 1.0)
        self._listener.close()
        missing = sorted(p for p, got in slots.items() if any(x is None for x in got))
        if missing:
            for got in slots.values():
                for sock in got:
                    if sock is not None:
                        sock.close()
            raise RendezvousError(f"rank {self.rank}: ranks {missing} never opened their data "
                                  f"connections within {start_timeout:g}s")
        for peer, got in slots.items():
            self._socks[peer] = [s for s in got if s is not None]
            for stream, sock in enumerate(self._socks[peer]):
                sock.setblocking(False)
                self._owner[sock] = (peer, stream)

    def _stream_buffer(self, peer: int) -> int:
        """Kernel buffer of each connection to ``peer``: the setting is per peer, shared by
        its streams (4 streams of 4 MiB each queued 4x the data in a shaper and slowed every
        ring step: 0.88x of the link floor against 0.91-0.92x at 1 MiB, 4 emulated nodes
        under a per-flow cap), at least 256 KiB."""
        return max(256 << 10, self._buffer_bytes // max(1, self._counts[peer]))

    def _dial(self, peer: int, stream: int, addr: tuple[str, int],
              deadline: float) -> socket.socket:
        sock = dial_until(addr, deadline, self.timeout,
                          f"rank {self.rank}: cannot connect to rank {peer}")
        tune_socket(sock, self._stream_buffer(peer))
        introduce(sock, self._secret, _ROLE, _claim(self.rank, stream, self.size))
        return sock

    def _accept_all(self, expected: set[int], slots: dict[int, list[socket.socket | None]],
                    start_timeout: float) -> None:
        """Take one proven connection for each expected (rank, stream) of the higher ranks
        (each proves itself on its own thread, so a silent stranger delays none of them),
        until all came or time is up."""
        deadline = time.monotonic() + start_timeout
        pending = set(expected)
        lock = threading.Lock()

        def admitted(sock: socket.socket, claim: int) -> None:
            peer, stream = claim % self.size, claim // self.size
            with lock:
                if claim not in pending:  # a second connection claiming the same stream
                    log.warning("rank %d: refused a second data connection claiming rank %d "
                                "stream %d", self.rank, peer, stream)
                    sock.close()
                    return
                tune_socket(sock, self._stream_buffer(peer))
                sock.settimeout(self.timeout)
                slots[peer][stream] = sock
                pending.discard(claim)

        admit_all(self._listener, self._secret, _ROLE, rank=self.rank, what="data",
                  valid=lambda claim: claim in expected, on_peer=admitted,
                  stopped=lambda: not pending or time.monotonic() > deadline,
                  handshake_s=min(5.0, self.timeout))

    # -- transfers -------------------------------------------------------------------------
    def exchange(self, sends: Sequence[tuple[int, memoryview]],
                 recvs: Sequence[tuple[int, memoryview]],
                 on_recv: Callable[[int, int, int], None] | None = None,
                 what: str = "transfer", control: bool = False) -> None:
        """Send and receive several buffers at once, making progress on all of them.

        ``on_recv(index, done_bytes, total)`` is called as the contiguous prefix of
        ``recvs[index]`` grows, so a reduction can work on the first part while the rest is
        still on the wire. ``control`` counts the bytes as control traffic (negotiation)
        and keeps them to the peer's first stream.
        """
        out: dict[socket.socket, deque] = {}
        inc: dict[socket.socket, deque] = {}
        # control frames keep to the first stream: a frame's head and body may be sent as
        # one buffer and read as two, which only one stream keeps in order
        for peer, view in sends:
            view = view.cast("B")
            if not view.nbytes:
                continue
            socks = self._sock(peer)
            plan = stripe_plan(view.nbytes, 1 if control else len(socks), self.stripe_bytes)
            for stream, lo, hi in plan:
                out.setdefault(socks[stream], deque()).append([view[lo:hi], 0])
            (self.control_sent if control else self.sent)[peer] += view.nbytes
        for i, (peer, view) in enumerate(recvs):
            view = view.cast("B")
            if not view.nbytes:
                continue
            socks = self._sock(peer)
            plan = stripe_plan(view.nbytes, 1 if control else len(socks), self.stripe_bytes)
            track = _Recv(i, view.nbytes, plan)
            for k, (stream, lo, hi) in enumerate(plan):
                inc.setdefault(socks[stream], deque()).append([view[lo:hi], 0, track, k])
            (self.control_received if control else self.received)[peer] += view.nbytes
        # try first, before the selector: small sends leave at once and a peer's data that
        # already arrived is read at once (the latency path of small collectives: 2 x 7 us of
        # register, select and unregister per round saved where nothing needs waiting for)
        for sock in list(out):
            self._progress_send(sock, out, what)
        for sock in list(inc):
            self._progress_recv(sock, inc, on_recv, what)
        if not out and not inc:
            return
        sel = self._sel
        interest: dict[socket.socket, int] = {}
        for sock in set(out) | set(inc):
            interest[sock] = (selectors.EVENT_WRITE if sock in out else 0) | \
                (selectors.EVENT_READ if sock in inc else 0)
            sel.register(sock, interest[sock])
        try:
            last = time.monotonic()
            while out or inc:
                ready = sel.select(timeout=min(self.timeout, 0.2))
                if not ready:
                    if self.closing:
                        raise ShoalError(f"rank {self.rank}: gave up during {what}: this rank "
                                         f"is shutting down")
                    waited = time.monotonic() - last
                    peers = sorted({self._owner[s][0] for s in (*out, *inc)})
                    if self.liveness is not None:
                        self.liveness.check(peers, what, waited)
                    elif waited > self.timeout:
                        self._silent(peers, what)
                    continue
                last = time.monotonic()
                for key, events in ready:
                    sock = key.fileobj
                    if events & selectors.EVENT_WRITE and sock in out:
                        self._progress_send(sock, out, what)
                    if events & selectors.EVENT_READ and sock in inc:
                        self._progress_recv(sock, inc, on_recv, what)
                    want = (selectors.EVENT_WRITE if sock in out else 0) | \
                        (selectors.EVENT_READ if sock in inc else 0)
                    if want != interest[sock]:
                        interest[sock] = want
                        if want:
                            sel.modify(sock, want)
                        else:
                            sel.unregister(sock)
        finally:
            for sock, events in interest.items():
                if events:
                    sel.unregister(sock)

    def _lost(self, sock: socket.socket, what: str, why: str) -> PeerLostError:
        peer, stream = self._owner[sock]
        on = f" (stream {stream + 1} of {len(self._socks[peer])})" \
            if len(self._socks[peer]) > 1 else ""
        return PeerLostError(f"rank {self.rank}: {why.format(peer=peer)} during {what}{on}",
                             rank=peer)

    def _progress_send(self, sock: socket.socket, out: dict[socket.socket, deque],
                       what: str) -> None:
        """Send on ``sock`` until its kernel buffer is full or its queue is empty (measured
        against one send per wake-up on the emulated cluster: no difference, 0.76x and 0.77x
        of the link floor; it saves a select round per queued piece)."""
        queue = out[sock]
        while queue:
            entry = queue[0]  # one buffer per socket at a time keeps the stream's byte order
            view, done = entry
            try:
                entry[1] = done = done + sock.send(view[done:])
            except BlockingIOError:
                return
            except OSError as exc:
                raise self._lost(sock, what, f"lost rank {{peer}}: {exc}") from None
            if done < len(view):
                return  # the buffer is full
            queue.popleft()
        del out[sock]

    def _progress_recv(self, sock: socket.socket, inc: dict[socket.socket, deque],
                       on_recv: Callable[[int, int, int], None] | None, what: str) -> None:
        """Receive on ``sock`` until it has nothing more or its queue is empty."""
        queue = inc[sock]
        while queue:
            entry = queue[0]
            view, done, track, k = entry
            try:
                n = sock.recv_into(view[done:])
            except BlockingIOError:
                return
            except OSError as exc:
                raise self._lost(sock, what, f"lost rank {{peer}}: {exc}") from None
            if n == 0:
                raise self._lost(sock, what, "rank {peer} closed its connection (it exited "
                                             "or crashed)")
            entry[1] = done = done + n
            track.done[k] = done
            if done == len(view):
                queue.popleft()
            if on_recv is not None and k == track.next:
                now = track.prefix()
                if now > track.reported:
                    track.reported = now
                    on_recv(track.index, now, track.total)
            if done < len(view):
                return  # drained what had arrived
        del inc[sock]

    def _silent(self, peers: list[int], what: str) -> None:
        raise PeerLostError(f"rank {self.rank}: no progress from ranks {peers} during {what} for "
                            f"SHOAL_TIMEOUT_S={self.timeout:g}s (stopped or unreachable)",
                            rank=peers[0])

    def _sock(self, peer: int) -> list[socket.socket]:
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
        for socks in self._socks.values():
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.close()
        self._socks.clear()
        self._owner.clear()
        self._sel.close()
        with contextlib.suppress(OSError):
            self._listener.close()
