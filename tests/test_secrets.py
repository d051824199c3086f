"""Secrets (issue 30, item 6): never readable in a store that does not authenticate; the
exposure of a job without one said plainly; SHOAL_SECRET_FILE."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest

from shoal.core import config
from shoal.core.communicator import Communicator
from shoal.core.errors import AuthenticationError, ConfigError, RendezvousError
from shoal.core.store import Store


class _OpenStore(Store):
    """An in-process store that authenticates nobody and keeps every value ever set."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self.history: list[bytes] = []
        self._cv = threading.Condition()
        self.tamper: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        with self._cv:
            value = self.tamper.get(key.rsplit("/", 2)[-2] if "/" in key else key, value)
            self._data[key] = bytes(value)
            self.history.append(bytes(value))
            self._cv.notify_all()

    def get(self, key: str, timeout: float | None = None) -> bytes:
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._data, timeout or 30):
                raise RendezvousError(f"no {key!r}")
            return self._data[key]

    def try_get(self, key: str) -> bytes | None:
        with self._cv:
            return self._data.get(key)

    def add(self, key: str, delta: int) -> int:
        with self._cv:
            value = int(self._data.get(key, b"0")) + delta
            self._data[key] = str(value).encode()
            self._cv.notify_all()
            return value

    def delete(self, key: str) -> bool:
        with self._cv:
            return self._data.pop(key, None) is not None


def _meet(store: Store, size: int, hosts: list[str]) -> list:
    out: list = [None] * size

    def one(r: int) -> None:
        try:
            out[r] = Communicator.create(store, r, size, hostname=hosts[r],
                                         cfg=config.load(start_timeout_s=10))
        except BaseException as exc:  # reported below
            out[r] = exc
    threads = [threading.Thread(target=one, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_no_secret_is_ever_readable_in_an_open_store(caplog) -> None:
    store = _OpenStore()
    with caplog.at_level(logging.WARNING, logger="shoal"):
        comms = _meet(store, 3, ["a", "b", "b"])
    try:
        assert all(isinstance(c, Communicator) for c in comms), comms
        secret = comms[0].secret
        assert {c.secret for c in comms} == {secret} and len(secret) == 64
        raw = bytes.fromhex(secret)
        for value in store.history:
            assert secret.encode() not in value and raw not in value
        # and the secret works: a collective across the three
        results = [None] * 3

        def run(r: int) -> None:
            results[r] = comms[r].allreduce(np.full(3, r + 1.0))
        threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert all(np.allclose(x, 2.0) for x in results)
    finally:
        for c in comms:
            if isinstance(c, Communicator):
                c.close()
    said = [r.getMessage() for r in caplog.records if "no SHOAL_SECRET" in r.getMessage()]
    assert len(said) <= 1  # once per process (a test before may have said it already)


def test_a_tampered_sealed_secret_is_refused() -> None:
    store = _OpenStore()
    store.tamper["sealed"] = b"\0" * 48  # someone rewrote rank 1's sealed secret
    comms = _meet(store, 2, ["a", "a"])
    try:
        assert isinstance(comms[1], AuthenticationError), comms
        assert "tampered" in str(comms[1])
    finally:
        for c in comms:
            if isinstance(c, Communicator):
                c.close()


def test_secret_file_is_read(tmp_path) -> None:
    path = tmp_path / "secret"
    path.write_text("ab" * 32 + "\n")
    cfg = config.load({"SHOAL_SECRET_FILE": str(path)})
    assert cfg.secret == "ab" * 32
    assert config.load({"SHOAL_SECRET_FILE": str(path), "SHOAL_SECRET": "cd"}).secret == "cd"
    with pytest.raises(ConfigError, match="cannot be read"):
        config.load({"SHOAL_SECRET_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        config.load({"SHOAL_SECRET_FILE": str(tmp_path / "empty")})


def test_a_job_without_a_secret_on_several_hosts_says_so(caplog) -> None:
    from shoal.core.runtime import RUNTIME
    RUNTIME.said.discard("exposed")
    store = _OpenStore()
    with caplog.at_level(logging.WARNING, logger="shoal"):
        comms = _meet(store, 2, ["a", "b"])
    for c in comms:
        c.close()
    said = [r.getMessage() for r in caplog.records if "no SHOAL_SECRET" in r.getMessage()]
    assert len(said) == 1 and "2 hosts" in said[0] and "stand in the middle" in said[0]
