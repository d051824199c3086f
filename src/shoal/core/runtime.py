"""This process's shoal state, in one object (as torch keeps c10d's in one ``_World``).

Everything that lives from ``init()`` to ``shutdown()`` and beyond, and that several rooms
read, is a field of :data:`RUNTIME`: the default communicator, the registered process sets,
the elastic worker's store connection and the world version it joined, settings overridden
in-process, and the warnings said once per process. The module API (:mod:`.api`), the
process sets (:mod:`.process_sets`), elastic training (:mod:`.elastic`) and the settings
(:mod:`.config`) read and change these fields and keep no copies, so the default
communicator has one registry, not one per room kept in step by hand.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .communicator import Communicator
    from .process_sets import ProcessSet

__all__ = ["RUNTIME", "Runtime"]


@dataclass(eq=False)
class Runtime:
    """The process's shoal state (one instance: :data:`RUNTIME`)."""

    #: serialises init() and shutdown() (held through a rendezvous)
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: the default communicator, between init() and shutdown()
    comm: Communicator | None = None
    #: inits that met at a store, which names each one's keys apart
    generation: int = 0
    #: guards the process-set registry (apart from ``lock``: queries answer during an init)
    sets_lock: threading.RLock = field(default_factory=threading.RLock)
    #: registered process sets by id (0: the global set), and the next id to give
    sets: dict[int, ProcessSet] = field(default_factory=dict)
    next_set: int = 1
    #: an elastic worker's connection to the driver's store, and the world version it joined
    elastic_store: Any = None
    elastic_version: int = -1
    #: wraps the store an init meets at (an elastic worker's gives up on a superseded world)
    store_guard: Any = None
    #: settings overridden in this process (:func:`shoal.core.config.override`)
    overrides: dict[str, Any] = field(default_factory=dict)
    #: what was said once per process (warnings that would repeat on every init)
    said: set[str] = field(default_factory=set)

    def say_once(self, key: str) -> bool:
        """True the first time ``key`` is given in this process, False after."""
        if key in self.said:
            return False
        self.said.add(key)
        return True


RUNTIME = Runtime()
