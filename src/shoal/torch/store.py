"""A torch ``c10d.Store`` (TCPStore, FileStore, HashStore, PrefixStore) as a shoal
:class:`~shoal.core.store.Store`, so a communicator can meet its peers wherever
``torch.distributed`` was initialised."""

from __future__ import annotations

from datetime import timedelta

from torch._C import _distributed_c10d as c10d

from shoal.core.errors import RendezvousError
from shoal.core.store import Store

__all__ = ["C10dStore"]


class C10dStore(Store):
    """Adapts ``store`` (a ``c10d.Store``); ``timeout`` bounds waits that give none."""

    def __init__(self, store: c10d.Store, timeout: float = 300.0) -> None:
        self.store = store
        self.timeout = timeout

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        wait = self.timeout if timeout is None else timeout
        try:
            self.store.wait([key], timedelta(seconds=wait))
        except RuntimeError as exc:  # c10d raises DistStoreError (a RuntimeError) on timeout
            raise RendezvousError(f"key {key!r} did not appear in the torch store within "
                                  f"{wait:g}s (whoever sets it is slow, stuck or dead): "
                                  f"{exc}") from None
        return bytes(self.store.get(key))

    def try_get(self, key: str) -> bytes | None:
        return bytes(self.store.get(key)) if self.store.check([key]) else None

    def add(self, key: str, delta: int) -> int:
        return int(self.store.add(key, int(delta)))

    def delete(self, key: str) -> bool:
        return bool(self.store.delete_key(key))
