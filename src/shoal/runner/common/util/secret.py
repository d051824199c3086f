"""``horovod.runner.common.util.secret``: keys and message digests (HMAC-SHA256)."""

from __future__ import annotations

import hashlib
import hmac
import os

__all__ = ["DIGEST_LENGTH", "HOROVOD_SECRET_KEY", "SECRET_LENGTH", "check_digest",
           "compute_digest", "make_secret_key"]

SECRET_LENGTH = 32  # bytes
DIGEST_LENGTH = 32  # bytes
#: the variable Horovod's launcher passes its key in (shoalrun's is SHOAL_SECRET)
HOROVOD_SECRET_KEY = "_HOROVOD_SECRET_KEY"


def make_secret_key() -> bytes:
    """A fresh random key."""
    return os.urandom(SECRET_LENGTH)


def compute_digest(key: bytes, message: bytes) -> bytes:
    """HMAC-SHA256 of ``message`` under ``key``."""
    return hmac.new(key, message, hashlib.sha256).digest()


def check_digest(key: bytes, message: bytes, digest: bytes) -> bool:
    """Whether ``digest`` is ``message``'s under ``key`` (compared in constant time)."""
    return hmac.compare_digest(compute_digest(key, message), digest)
