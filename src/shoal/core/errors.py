"""One error hierarchy for all of shoal.

Every message says what happened, on which rank, to which tensor, and what to do about it.
Elastic training catches :class:`PeerLostError` (the recoverable "collective failed").
"""

from __future__ import annotations

__all__ = [
    "AuthenticationError",
    "CollectiveMismatchError",
    "ConfigError",
    "NotInitializedError",
    "PeerLostError",
    "RendezvousError",
    "ShoalError",
    "ShoalTimeoutError",
    "TopologyError",
]


class ShoalError(RuntimeError):
    """Base class of every error shoal raises on purpose."""


class ConfigError(ShoalError, ValueError):
    """A ``SHOAL_*`` setting is unknown or has a value that cannot be parsed."""


class TopologyError(ShoalError):
    """The launcher environment is incomplete or contradicts itself."""


class NotInitializedError(ShoalError):
    """A collective was called before ``shoal.init()`` (or after ``shoal.shutdown()``)."""


class RendezvousError(ShoalError):
    """The rendezvous store could not be reached, or a key never appeared in time."""


class AuthenticationError(RendezvousError):
    """A peer failed to prove it knows the job secret (or we failed to prove it to them)."""


class CollectiveMismatchError(ShoalError):
    """Ranks disagree on a collective's name, kind, shape, dtype or op.

    Raised on every rank taking part, with the per-rank descriptions in :attr:`details`.
    """

    def __init__(self, message: str, details: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.details = details or {}


class PeerLostError(ShoalError):
    """A peer died, closed its connection or stopped responding within the timeout.

    :attr:`rank` is the lost peer's global rank when it is known.
    """

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class ShoalTimeoutError(ShoalError, TimeoutError):
    """A wait ran past its timeout without any evidence that a peer died."""
