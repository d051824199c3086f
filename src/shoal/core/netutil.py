"""Socket helpers shared by the rendezvous store and the TCP transport."""

from __future__ import annotations

import socket

from .errors import PeerLostError

__all__ = ["connect", "recv_exact", "recv_into_exact", "tune_socket"]


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
