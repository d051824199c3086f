"""Mutual HMAC challenge-response: both ends prove they know the job secret.

The secret itself never crosses the wire. Each side contributes a fresh 32-byte nonce, so a
recorded exchange cannot be replayed. ``role`` separates the rendezvous store from the data
ports, so a proof for one cannot be reused on the other.

Wire (server speaks first)::

    server -> MAGIC + nonce_s
    client -> MAGIC + nonce_c + HMAC(secret, "C" + role + nonce_s + nonce_c)
    server -> HMAC(secret, "S" + role + nonce_s + nonce_c)          (only if the client proved)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket

from .errors import AuthenticationError, PeerLostError
from .netutil import recv_exact

__all__ = ["MAGIC", "client_handshake", "secret_bytes", "server_handshake"]

MAGIC = b"SHOAL\x00\x01\x00"
_NONCE = 32
_MAC = 32


def secret_bytes(secret: str) -> bytes:
    """The key used for HMAC: the hex secret decoded, or the UTF-8 text if it is not hex."""
    try:
        return bytes.fromhex(secret)
    except ValueError:
        return secret.encode()


def _mac(secret: bytes, side: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, side + role + nonce_s + nonce_c, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, secret: bytes, role: bytes) -> None:
    """Challenge a client that just connected; raise :class:`AuthenticationError` if it fails."""
    nonce_s = os.urandom(_NONCE)
    sock.sendall(MAGIC + nonce_s)
    try:
        reply = recv_exact(sock, len(MAGIC) + _NONCE + _MAC, "client")
    except (PeerLostError, TimeoutError) as exc:
        raise AuthenticationError(f"client did not answer the challenge: {exc}") from None
    if reply[: len(MAGIC)] != MAGIC:
        raise AuthenticationError("client is not speaking the shoal protocol (bad magic bytes)")
    nonce_c = reply[len(MAGIC): len(MAGIC) + _NONCE]
    proof = reply[len(MAGIC) + _NONCE:]
    if not hmac.compare_digest(proof, _mac(secret, b"C", role, nonce_s, nonce_c)):
        raise AuthenticationError("client does not know the job secret (wrong SHOAL_SECRET?)")
    sock.sendall(_mac(secret, b"S", role, nonce_s, nonce_c))


def _closed(message: str) -> AuthenticationError:
    """The server closed the connection during the handshake: it refused our proof, or it
    was shutting down at that moment (``closed`` is set: a caller may retry once or twice to
    tell which)."""
    exc = AuthenticationError(message)
    exc.closed = True  # type: ignore[attr-defined]
    return exc


def client_handshake(sock: socket.socket, secret: bytes, role: bytes) -> None:
    """Answer a server's challenge and check that the server knows the secret too."""
    what = "server"
    try:
        hello = recv_exact(sock, len(MAGIC) + _NONCE, what)
    except PeerLostError as exc:
        raise _closed(f"server closed the connection before the challenge: {exc}") from None
    if hello[: len(MAGIC)] != MAGIC:
        raise AuthenticationError("server is not a shoal endpoint (bad magic bytes)")
    nonce_s = hello[len(MAGIC):]
    nonce_c = os.urandom(_NONCE)
    sock.sendall(MAGIC + nonce_c + _mac(secret, b"C", role, nonce_s, nonce_c))
    try:
        proof = recv_exact(sock, _MAC, what)
    except PeerLostError:
        raise _closed(
            "server refused our proof: this process and the server hold different job secrets "
            "(SHOAL_SECRET must be the same on every rank; shoalrun sets it)") from None
    if not hmac.compare_digest(proof, _mac(secret, b"S", role, nonce_s, nonce_c)):
        raise AuthenticationError("server does not know the job secret; refusing to talk to it")
