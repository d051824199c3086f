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
import secrets
import socket

from .errors import AuthenticationError, PeerLostError
from .netutil import recv_exact

__all__ = ["MAGIC", "KeyAgreement", "client_handshake", "secret_bytes", "server_handshake",
           "unwrap_secret", "wrap_secret"]

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


# RFC 3526 group 14: the 2048-bit MODP prime, generator 2
_P = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A0879"
    "8E3404DDEF9519B3CD3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B"
    "0BFF5CB6F406B7EDEE386BFB5A899FA5AE9F24117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA4836"
    "1C55D39A69163FA8FD24CF5F83655D23DCA3AD961C62F356208552BB9ED529077096966D670C354E4ABC9804"
    "F1746C08CA18217C32905E462E36CE3BE39E772C180E86039B2783A2EC07A28FB5C55DF06F4C52C9DE2BCBF6"
    "955817183995497CEA956AE515D2261898FA051015728E5A8AACAA68FFFFFFFFFFFFFFFF", 16)
_G = 2
_WRAP_TAG = 16


class KeyAgreement:
    """One side of a Diffie-Hellman exchange (RFC 3526 group 14, 256-bit exponents): lets
    rank 0 hand the job secret to each rank through a store that does not authenticate,
    without the secret ever lying in it readable. It keeps out whoever only reads the store
    or watches the network; one who can write to the store while the job starts could still
    stand in the middle, which only a shared ``SHOAL_SECRET`` prevents."""

    def __init__(self) -> None:
        self._x = secrets.randbits(256) | (1 << 255)
        self.public = pow(_G, self._x, _P)

    def shared(self, peer_public: int) -> bytes:
        """The key both sides derive from the other's public value."""
        if not 1 < peer_public < _P - 1:
            raise AuthenticationError("a key-exchange value in the store is out of range "
                                      "(tampered with, or not a shoal rank's)")
        z = pow(peer_public, self._x, _P)
        return hashlib.sha256(b"shoal-dh:" + z.to_bytes(256, "big")).digest()


def wrap_secret(secret: bytes, key: bytes, rank: int) -> bytes:
    """``secret`` (32 bytes) sealed for ``rank`` under ``key``: pad and tag."""
    pad = hashlib.sha256(b"shoal-wrap:%d:" % rank + key).digest()
    body = bytes(a ^ b for a, b in zip(secret, pad, strict=True))
    return body + hmac.new(key, b"shoal-seal:%d:" % rank + body, "sha256").digest()[:_WRAP_TAG]


def unwrap_secret(sealed: bytes, key: bytes, rank: int) -> bytes:
    """The secret :func:`wrap_secret` sealed; :class:`AuthenticationError` if it was not
    sealed under ``key`` for ``rank``."""
    body, tag = sealed[:-_WRAP_TAG], sealed[-_WRAP_TAG:]
    want = hmac.new(key, b"shoal-seal:%d:" % rank + body, "sha256").digest()[:_WRAP_TAG]
    if len(body) != 32 or not hmac.compare_digest(tag, want):
        raise AuthenticationError(f"rank {rank}: the job secret sealed for this rank in the "
                                  f"store does not open with the agreed key (the store was "
                                  f"tampered with while the job started?)")
    pad = hashlib.sha256(b"shoal-wrap:%d:" % rank + key).digest()
    return bytes(a ^ b for a, b in zip(body, pad, strict=True))
