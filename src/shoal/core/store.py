"""The rendezvous interface: a small key-value store with blocking reads.

A communicator meets its peers through a :class:`Store`: it publishes its addresses, learns
theirs, agrees on a secret and synchronises set-up steps. Implementations need five primitive
operations (:meth:`Store.set`, :meth:`Store.get`, :meth:`Store.try_get`, :meth:`Store.add`,
:meth:`Store.delete`); the collective helpers built on them (:meth:`Store.barrier`,
:meth:`Store.allgather`) are written once here and may be overridden by a store that can do
them better (shoal's own :class:`~shoal.core.rendezvous.StoreClient` waits on the server).

shoal's own authenticated store implements this interface; ``shoal.torch`` adapts a torch
``c10d.Store`` (TCPStore, FileStore, HashStore) to it. The core imports no framework.
"""

from __future__ import annotations

import abc

from .errors import RendezvousError

__all__ = ["PrefixStore", "Store"]


class Store(abc.ABC):
    """A key-value store shared by the ranks of a job; values are bytes."""

    @abc.abstractmethod
    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``, replacing any old value."""

    @abc.abstractmethod
    def get(self, key: str, timeout: float | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for it to appear
        (:class:`RendezvousError` after that)."""

    @abc.abstractmethod
    def try_get(self, key: str) -> bytes | None:
        """The value of ``key``, or ``None`` at once if it does not exist."""

    @abc.abstractmethod
    def add(self, key: str, delta: int) -> int:
        """Atomically add ``delta`` to the integer counter at ``key`` (missing: 0); the new
        value."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""

    def close(self) -> None:  # noqa: B027 (optional: most adapters own nothing)
        """Release this handle (the store itself may live on elsewhere)."""

    # -- helpers written once on the primitives --------------------------------------------
    def barrier(self, name: str, size: int, timeout: float | None = None) -> None:
        """Wait until ``size`` callers reached barrier ``name`` (use each name only once)."""
        if self.add(f"{name}/count", 1) == size:
            self.set(f"{name}/done", b"1")
        try:
            self.get(f"{name}/done", timeout)
        except RendezvousError:
            seen = self.try_get(f"{name}/count") or b"?"
            raise RendezvousError(
                f"barrier {name!r}: only {seen.decode(errors='replace')} of {size} ranks "
                f"arrived within {timeout}s (the others are probably slow, stuck or dead)"
            ) from None

    def allgather(self, name: str, rank: int, size: int, value: bytes,
                  timeout: float | None = None) -> list[bytes]:
        """Publish ``value`` as ``rank``'s share of ``name``; every rank's share, by rank."""
        self.set(f"{name}/{rank}", value)
        out = []
        for r in range(size):
            try:
                out.append(self.get(f"{name}/{r}", timeout))
            except RendezvousError:
                missing = [q for q in range(size) if self.try_get(f"{name}/{q}") is None]
                raise RendezvousError(
                    f"allgather {name!r}: ranks {missing} of {size} did not publish within "
                    f"{timeout}s (they are probably slow, stuck or dead)") from None
        return out


class PrefixStore(Store):
    """A view of ``store`` with every key under ``prefix/``: a namespace for one
    communicator. Closing it leaves the underlying store open."""

    def __init__(self, store: Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/")

    def _k(self, key: str) -> str:
        return f"{self.prefix}/{key}"

    def set(self, key: str, value: bytes) -> None:
        self.store.set(self._k(key), value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        return self.store.get(self._k(key), timeout)

    def try_get(self, key: str) -> bytes | None:
        return self.store.try_get(self._k(key))

    def add(self, key: str, delta: int) -> int:
        return self.store.add(self._k(key), delta)

    def delete(self, key: str) -> bool:
        return self.store.delete(self._k(key))

    def barrier(self, name: str, size: int, timeout: float | None = None) -> None:
        self.store.barrier(self._k(name), size, timeout)

    def allgather(self, name: str, rank: int, size: int, value: bytes,
                  timeout: float | None = None) -> list[bytes]:
        return self.store.allgather(self._k(name), rank, size, value, timeout)
