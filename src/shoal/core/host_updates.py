"""Telling an elastic worker's states that the driver changed the hosts, as Horovod does.

Horovod's driver pushes each change of hosts to every worker, which queues it on every
elastic state (``State.on_hosts_updated(timestamp, result)``, read from
``state._host_messages``); ``commit()`` then drains the queue and raises
``HostsUpdatedInterrupt`` on every rank at once. Scripts rely on that queue (Horovod's own
elastic tests wait on ``state._host_messages`` for the driver's notice). Here the driver
publishes each new world in its store; a daemon thread per worker polls it and queues each
newer world on the registered states, with the world's version as the timestamp.
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["HostUpdateResult", "Notifier", "update_result"]

POLL_S = 0.5


class HostUpdateResult(enum.IntFlag):
    """What a change of hosts did (Horovod's values)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


def update_result(before: Sequence[str], after: Sequence[str], added: bool) -> HostUpdateResult:
    """The flags of going from the members ``before`` to ``after`` (``added``: the driver
    says some member is new, which a reused worker id would not show)."""
    result = HostUpdateResult.no_update
    if set(before) - set(after):
        result |= HostUpdateResult.removed
    if added or set(after) - set(before):
        result |= HostUpdateResult.added
    return result


class Notifier:
    """Polls for newer worlds and queues each on every registered state, once.

    ``newer()`` returns ``(version, result)`` of a world newer than this worker's, or None.
    """

    def __init__(self, newer: Callable[[], tuple[int, HostUpdateResult] | None]) -> None:
        self._newer = newer
        self._states: weakref.WeakSet[Any] = weakref.WeakSet()
        self._told = 0  # the newest version queued
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def register(self, state: Any) -> None:
        """Queue later changes on ``state`` (held weakly); starts the polling thread."""
        with self._lock:
            self._states.add(state)
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=self._loop, name="shoal-host-updates",
                                                daemon=True)
                self._thread.start()

    def poll(self) -> None:
        """Look for a newer world now and queue it (the polling thread does this too)."""
        try:
            found = self._newer()
        except Exception:  # the store is unreachable for a moment: the next poll retries
            return
        if found is None:
            return
        version, result = found
        with self._lock:
            if version <= self._told:
                return
            self._told = version
            states = list(self._states)
        for state in states:
            state.on_hosts_updated(version, result)

    def stop(self) -> None:
        """End the polling thread (the process is leaving the job)."""
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()
