"""Point-to-point messages (send/recv) between ranks of a communicator.

Every communicator of more than one rank listens for point-to-point connections from the
start (the address travels in its hello, so nothing needs the store afterwards: a rank may
send after the store's host has exited). A rank dials a peer on its first send to it, on a
background thread, and proves the job secret (role ``p2p``); each connection carries one
direction only, so two ranks dialing each other never race. A send never blocks its caller,
and a ring of sends issued before their receives cannot deadlock: every connection has a
reader that drains it, into the posted receive's own buffer when one matches, otherwise into
a held copy until a receive is posted.

Matching follows MPI's rules: a message goes to the earliest-posted receive whose source (or
any source) and tag match it, and messages from one rank with one tag arrive in the order
sent. A receive whose buffer size differs from the message's fails with a :class:`ValueError`
naming both sizes (the message is consumed, the connection stays usable); a peer that exits
fails what waits on it with :class:`~shoal.core.errors.PeerLostError`.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from .errors import PeerLostError, RendezvousError, ShoalTimeoutError
from .liveness import Liveness
from .netutil import admit_all, dial_until, introduce, recv_exact, recv_into_exact, tune_socket

__all__ = ["P2PHandle", "PeerMessages"]

log = logging.getLogger("shoal.p2p")
_ROLE = b"p2p"
_HEAD = struct.Struct("!qQ")  # tag, payload bytes
_SMALL = 1 << 16  # payloads up to this size are copied to go out with their header
_WATCH_S = 0.25  # how often a waiting handle asks the heartbeat about its peer
_HANDSHAKE_S = 10.0  # a connection that has not proved the secret by then is dropped
_MAX_HANDSHAKES = 256  # connections proving themselves at once; more are refused at once
_DISCARD = 1 << 20  # a message no receive can take is read and dropped in pieces this big


class P2PHandle:
    """A pending send or receive. Its result is the peer's rank (for a receive from any
    source, the sender); same interface as :class:`~shoal.core.collectives.Handle`."""

    def __init__(self, watch: Callable[[float], None] | None = None) -> None:
        self._future: Future = Future()
        self.source: int | None = None
        self._withdraw: Callable[[], bool] | None = None
        self._watch = watch  # raises PeerLostError once the peer is lost (its heartbeat)

    def cancel(self) -> bool:
        """Withdraw a receive that no message has matched yet (a later message then waits
        for the next receive); whether it was withdrawn. Sends cannot be cancelled."""
        if self._withdraw is None or not self._withdraw():
            return False
        self._fail(CancelledError("the receive was cancelled"))
        return True

    def _resolve(self, peer: int) -> None:
        self.source = peer
        if not self._future.done():
            self._future.set_result(peer)

    def _fail(self, exc: BaseException) -> None:
        if not self._future.done():
            self._future.set_exception(exc)

    def done(self) -> bool:
        """True once the message has moved (or failed)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> int:
        """Block until done; the peer's rank, or raise the error. A peer that stops sending
        heartbeats (killed, frozen, unreachable) fails the wait with
        :class:`~shoal.core.errors.PeerLostError`, whatever ``timeout`` is."""
        start = time.monotonic()
        while True:
            waited = time.monotonic() - start
            left = None if timeout is None else max(0.0, timeout - waited)
            step = left if self._watch is None else min(_WATCH_S, left if left is not None
                                                         else _WATCH_S)
            try:
                return self._future.result(step)
            except TimeoutError:
                if left is not None and waited + (step or 0.0) >= timeout:
                    raise ShoalTimeoutError(
                        f"point-to-point message not done after {timeout}s (is the peer "
                        f"posting the matching send/recv?)") from None
            if self._watch is not None:
                try:
                    self._watch(time.monotonic() - start)
                except PeerLostError as exc:
                    if self._withdraw is not None:
                        self._withdraw()
                    self._fail(exc)

    def exception(self) -> BaseException | None:
        """The error once done (None if it succeeded)."""
        return self._future.exception() if self._future.done() else None

    def add_done_callback(self, fn) -> None:
        """Call ``fn(handle)`` when done (possibly on a background thread)."""
        self._future.add_done_callback(lambda _f: fn(self))


@dataclass(eq=False)
class _Recv:
    src: int | None
    tag: int
    buffer: memoryview
    handle: P2PHandle = field(default_factory=P2PHandle)


@dataclass
class _Held:
    src: int
    tag: int
    data: bytearray


class PeerMessages:
    """The point-to-point endpoint of one rank of a communicator."""

    def __init__(self, rank: int, size: int, secret: bytes, *, bind_addr: str,
                 timeout: float | None, connect_timeout: float,
                 buffer_bytes: int | None = None, liveness: Liveness | None = None,
                 held_bytes: int = 256 << 20) -> None:
        self.rank, self.size = rank, size
        self._liveness = liveness
        self._held_limit = held_bytes  # unexpected messages held at once, in bytes
        self._held_now = 0
        self._secret = secret
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._buffer_bytes = buffer_bytes
        self._listener = socket.create_server((bind_addr, 0), backlog=max(16, size))
        self._listener.settimeout(0.25)  # the accept loop polls, so close() never races it
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._peers: list[tuple[str, int]] = []
        self._lock = threading.Condition()
        self._posted: list[_Recv] = []
        self._held: list[_Held] = []
        self._out: dict[int, socket.socket] = {}
        self._senders: dict[int, ThreadPoolExecutor] = {}
        self._readers: list[socket.socket] = []
        self._lost: dict[int, BaseException] = {}
        self._closed = False
        self._acceptor: threading.Thread | None = None

    def start(self, addresses: Sequence[tuple[str, int]]) -> None:
        """Learn every rank's point-to-point address and start accepting connections."""
        self._peers = list(addresses)
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"shoal-p2p-accept-{self.rank}")
        self._acceptor.start()

    # -- receiving -------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        admit_all(self._listener, self._secret, _ROLE, rank=self.rank, what="point-to-point",
                  valid=lambda peer: 0 <= peer < self.size and peer != self.rank,
                  on_peer=self._admitted, stopped=lambda: self._closed,
                  handshake_s=min(self._connect_timeout, _HANDSHAKE_S),
                  max_pending=_MAX_HANDSHAKES)

    def _admitted(self, sock: socket.socket, peer: int) -> None:
        tune_socket(sock, self._buffer_bytes)
        sock.settimeout(None)  # a receive may legitimately wait long for its message
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._readers.append(sock)
        self._read_loop(sock, peer)

    def _match_posted(self, src: int, tag: int) -> _Recv | None:
        for i, r in enumerate(self._posted):  # the earliest-posted receive that matches
            if r.tag == tag and r.src in (None, src):
                return self._posted.pop(i)
        return None

    def _read_loop(self, sock: socket.socket, src: int) -> None:
        what = f"rank {src} (point-to-point)"
        try:
            while True:
                tag, nbytes = _HEAD.unpack(recv_exact(sock, _HEAD.size, what, src))
                with self._lock:
                    # hold no more than the limit of unexpected bytes: past it, stop reading
                    # (TCP then slows the sender) until a receive is posted or one is taken
                    while (recv := self._match_posted(src, tag)) is None and \
                            self._held_now + nbytes > self._held_limit and not self._closed:
                        self._lock.wait(_WATCH_S)
                    if self._closed:  # never take a message (nor its memory) after close
                        return
                    if recv is None:
                        self._held_now += nbytes
                if recv is not None and recv.buffer.nbytes == nbytes:
                    if nbytes:
                        recv_into_exact(sock, recv.buffer, what, src)
                    recv.handle._resolve(src)
                    continue
                if recv is not None:  # sizes differ: the message is read, dropped, refused
                    _discard(sock, nbytes, what, src)
                    recv.handle._fail(_size_error(self.rank, src, tag, nbytes,
                                                  recv.buffer.nbytes))
                    continue
                data = bytearray(nbytes)
                if nbytes:
                    recv_into_exact(sock, memoryview(data), what, src)
                with self._lock:  # a receive posted while the payload was arriving
                    recv = self._match_posted(src, tag)
                    if recv is None:
                        self._held.append(_Held(src, tag, data))
                    else:
                        self._held_now -= nbytes
                if recv is not None:
                    self._deliver(recv, _Held(src, tag, data))
        except BaseException as exc:
            lost = exc if isinstance(exc, PeerLostError) else PeerLostError(
                f"rank {self.rank}: point-to-point connection from rank {src} failed: {exc}",
                rank=src)
            with self._lock:
                self._lost[src] = lost
                waiting = [r for r in self._posted if r.src == src]
                self._posted = [r for r in self._posted if r.src != src]
            for r in waiting:
                r.handle._fail(lost)
            with contextlib.suppress(OSError):
                sock.close()

    def _deliver(self, recv: _Recv, msg: _Held) -> None:
        if len(msg.data) != recv.buffer.nbytes:
            recv.handle._fail(_size_error(self.rank, msg.src, msg.tag, len(msg.data),
                                          recv.buffer.nbytes))
            return
        recv.buffer[:] = msg.data
        recv.handle._resolve(msg.src)

    def recv(self, out: np.ndarray, src: int | None = None, tag: int = 0) -> P2PHandle:
        """Receive into ``out`` (contiguous) from ``src``, or from any rank when None."""
        if src is not None:
            self._check(src, "receive from")
        recv = _Recv(src, int(tag), _bytes(out), P2PHandle(self._watch(src, "receive from")))
        recv.handle._withdraw = lambda: self._remove(recv)
        with self._lock:
            self._open()
            held = next((i for i, m in enumerate(self._held)
                         if m.tag == recv.tag and src in (None, m.src)), None)
            msg = self._held.pop(held) if held is not None else None
            if msg is not None:
                self._held_now -= len(msg.data)
            self._lock.notify_all()  # a reader held back by the limit may match it now
            lost = self._lost.get(src) if src is not None and msg is None else None
            if msg is None and lost is None:
                self._posted.append(recv)
        if msg is not None:
            self._deliver(recv, msg)
        elif lost is not None:
            recv.handle._fail(lost)
        return recv.handle

    def _remove(self, recv: _Recv) -> bool:
        with self._lock:
            if recv in self._posted:
                self._posted.remove(recv)
                return True
        return False

    # -- sending ---------------------------------------------------------------------------
    def send(self, data: np.ndarray, dst: int, tag: int = 0,
             ready: Callable[[], None] | None = None) -> P2PHandle:
        """Send the bytes of ``data`` (contiguous; keep it unchanged until done) to ``dst``;
        ``ready`` runs on the sending thread before the bytes are read."""
        self._check(dst, "send to")
        view = _bytes(data)
        handle = P2PHandle(self._watch(dst, "send to"))
        with self._lock:
            self._open()
            sender = self._senders.get(dst)
            if sender is None:
                sender = self._senders[dst] = ThreadPoolExecutor(
                    1, thread_name_prefix=f"shoal-p2p-send-{self.rank}>{dst}")
        sender.submit(self._send_now, handle, view, dst, int(tag), ready)
        return handle

    def _send_now(self, handle: P2PHandle, view: memoryview, dst: int, tag: int,
                  ready: Callable[[], None] | None = None) -> None:
        try:
            if ready is not None:
                ready()
            sock = self._out.get(dst) or self._dial(dst)
            head = _HEAD.pack(tag, view.nbytes)
            if view.nbytes <= _SMALL:  # one segment on the wire
                sock.sendall(head + view.tobytes())
            else:
                sock.sendall(head)
                sock.sendall(view)
        except BaseException as exc:
            handle._fail(exc if isinstance(exc, PeerLostError | RendezvousError) else
                         PeerLostError(f"rank {self.rank}: sending to rank {dst} failed: "
                                       f"{exc}", rank=dst))
            return
        handle._resolve(dst)

    def _dial(self, dst: int) -> socket.socket:
        sock = dial_until(self._peers[dst], time.monotonic() + self._connect_timeout,
                          self._connect_timeout, f"rank {self.rank}: cannot open a "
                          f"point-to-point connection to rank {dst}")
        tune_socket(sock, self._buffer_bytes)
        introduce(sock, self._secret, _ROLE, self.rank)
        sock.settimeout(self._timeout)
        with self._lock:
            if self._closed:
                sock.close()
                raise PeerLostError(f"rank {self.rank}: the communicator is closed")
            self._out[dst] = sock
        return sock

    # -- bookkeeping -----------------------------------------------------------------------
    def _watch(self, peer: int | None, what: str) -> Callable[[float], None] | None:
        """What a handle waiting on ``peer`` asks while it waits: the heartbeat's verdict."""
        liveness = self._liveness
        if liveness is None or peer is None:  # any source: another rank may still send
            return None
        label = f"point-to-point {what} rank {peer}"
        return lambda waited: liveness.check([peer], label, waited)

    def _check(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise ValueError(f"rank {self.rank}: cannot {what} rank {peer}: it must be another "
                             f"rank of this communicator (size {self.size})")

    def _open(self) -> None:
        if self._closed:
            raise PeerLostError(f"rank {self.rank}: the communicator is closed")

    def close(self) -> None:
        """Close every connection; pending receives fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
            socks = [*self._out.values(), *self._readers]
            posted, self._posted = self._posted, []
            senders = list(self._senders.values())
        self._listener.close()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for sender in senders:
            sender.shutdown(wait=False, cancel_futures=True)
        for r in posted:
            r.handle._fail(PeerLostError(f"rank {self.rank}: the communicator closed while a "
                                         f"receive was pending"))
        if self._acceptor is not None and self._acceptor is not threading.current_thread():
            self._acceptor.join(1.0)


def _size_error(rank: int, src: int, tag: int, nbytes: int, room: int) -> ValueError:
    return ValueError(f"rank {rank}: the message from rank {src} with tag {tag} has {nbytes} "
                      f"bytes but the receive buffer has {room}; post a receive of the size "
                      f"sent")


def _discard(sock: socket.socket, nbytes: int, what: str, src: int) -> None:
    """Read ``nbytes`` and drop them, never holding more than a piece at once."""
    scratch = memoryview(bytearray(min(nbytes, _DISCARD)))
    while nbytes > 0:
        piece = min(nbytes, len(scratch))
        recv_into_exact(sock, scratch[:piece], what, src)
        nbytes -= piece


def _bytes(array: np.ndarray) -> memoryview:
    if not array.flags.c_contiguous:
        raise ValueError("point-to-point buffers must be contiguous")
    return memoryview(array.reshape(-1).view(np.uint8))
