"""Socket helpers shared by the rendezvous store, the TCP transport, point-to-point and the
heartbeat."""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable

from .errors import PeerLostError, RendezvousError

__all__ = ["admit_all", "connect", "dial_until", "recv_exact", "recv_into_exact",
           "tune_socket"]

log = logging.getLogger("shoal.net")
_RANK = struct.Struct("!I")  # the rank a connecting peer names after the handshake


def recv_into_exact(sock: socket.socket, view: memoryview, what: str = "peer",
                    rank: int | None = None) -> None:
    """Fill ``view`` completely from ``sock``; a closed connection is :class:`PeerLostError`."""
    got = 0
    total = len(view)
    while got < total:
        try:
            n = sock.recv_into(view[got:], total - got)
        except TimeoutError:
            raise
        except OSError as exc:
            raise PeerLostError(f"connection to {what} failed while receiving: {exc}",
                                rank=rank) from exc
        if n == 0:
            raise PeerLostError(f"{what} closed the connection (it probably exited or crashed)",
                                rank=rank)
        got += n


def recv_exact(sock: socket.socket, n: int, what: str = "peer",
               rank: int | None = None) -> bytes:
    """Receive exactly ``n`` bytes."""
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf), what, rank)
    return bytes(buf)


def tune_socket(sock: socket.socket, buffer_bytes: int | None = None) -> None:
    """Low latency (no Nagle) and, for bulk data, large kernel buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def connect(addr: str, port: int, timeout: float) -> socket.socket:
    """Open a TCP connection (IPv4 or IPv6) with a connect timeout."""
    sock = socket.create_connection((addr, port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def dial_until(addr: tuple[str, int], deadline: float, timeout: float, what: str) -> socket.socket:
    """Connect to ``addr``, retrying with back-off while it refuses, until the monotonic
    ``deadline``; :class:`RendezvousError` naming ``what`` after that."""
    delay = 0.01
    while True:
        try:
            return socket.create_connection(addr, timeout=timeout)
        except OSError as exc:
            if time.monotonic() + delay > deadline:
                raise RendezvousError(f"{what} at {addr[0]}:{addr[1]}: {exc}") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def admit_all(listener: socket.socket, secret: bytes, role: bytes, *, rank: int, what: str,
              valid: Callable[[int], bool], on_peer: Callable[[socket.socket, int], None],
              stopped: Callable[[], bool], handshake_s: float = 10.0,
              max_pending: int = 256) -> None:
    """Accept on ``listener`` until ``stopped()`` or it closes, proving each connection on a
    thread of its own: the peer must show the job secret under ``role`` and then name a rank
    for which ``valid`` holds, within ``handshake_s``; ``on_peer(sock, rank)`` then owns the
    socket (on that thread). A stranger that connects and stays silent, or sends garbage,
    holds only its own thread for at most ``handshake_s``; beyond ``max_pending`` connections
    proving themselves at once, new ones are closed unread. Refusals are logged."""
    from .auth import server_handshake
    from .errors import AuthenticationError
    pending = threading.BoundedSemaphore(max_pending)

    def prove(sock: socket.socket, addr: object) -> None:
        try:
            sock.setblocking(True)
            sock.settimeout(handshake_s)
            server_handshake(sock, secret, role)
            (peer,) = _RANK.unpack(recv_exact(sock, _RANK.size, "peer"))
            if not valid(peer):
                raise AuthenticationError(f"claimed rank {peer}")
        except (AuthenticationError, PeerLostError, OSError) as exc:
            if not stopped():
                log.warning("rank %d: refused %s connection from %s: %s", rank, what, addr, exc)
            sock.close()
            return
        finally:
            pending.release()
        on_peer(sock, peer)

    while not stopped():
        try:
            ready, _, _ = select.select([listener], [], [], 0.25)
            if not ready:
                continue
            sock, addr = listener.accept()
        except (BlockingIOError, InterruptedError, TimeoutError):
            continue
        except (OSError, ValueError):
            return  # the listener was closed
        if not pending.acquire(blocking=False):
            log.warning("rank %d: refused %s connection from %s: %d connections are already "
                        "proving themselves", rank, what, addr, max_pending)
            sock.close()
            continue
        threading.Thread(target=prove, args=(sock, addr), daemon=True,
                         name=f"shoal-{what.replace(' ', '-')}-admit-{rank}").start()


def introduce(sock: socket.socket, secret: bytes, role: bytes, rank: int) -> None:
    """The dialling side of :func:`admit_all`: prove the secret under ``role``, then name
    this rank."""
    from .auth import client_handshake
    client_handshake(sock, secret, role)
    sock.sendall(_RANK.pack(rank))
