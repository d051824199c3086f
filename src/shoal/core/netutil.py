"""Socket helpers shared by the rendezvous store and the TCP transport."""

from __future__ import annotations

import socket
import time

from .errors import PeerLostError, RendezvousError

__all__ = ["connect", "dial_until", "recv_exact", "recv_into_exact", "tune_socket"]


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
