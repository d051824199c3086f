"""Horovod's process sets, written once for every adapter: each a sub-communicator of the
default one.

Every rank calls :func:`add_process_set` (or passes ``process_sets=`` to ``init``) with the same
ranks, so ids agree everywhere; the members build a communicator over those ranks
(:meth:`~shoal.core.communicator.Communicator.split`), with its own engine, so collectives of
disjoint sets run at once. As in Horovod, ranks given to collectives (``root_rank``) stay
*global* ranks; :meth:`ProcessSet.rank` is the rank inside the set.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import NotInitializedError, ShoalError
from .runtime import RUNTIME

if TYPE_CHECKING:
    from .communicator import Communicator

__all__ = ["ProcessSet", "add_process_set", "check_static", "communicator_for",
           "global_process_set", "ids_and_ranks", "process_set_by_id", "process_set_ids",
           "remove_process_set", "set_root"]



class ProcessSet:
    """A set of global ranks that run collectives together; registered by
    :func:`add_process_set` (then ``process_set_id`` is set)."""

    def __init__(self, ranks: Iterable[int]) -> None:
        ranks = sorted(ranks)
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError("a ProcessSet is made from a list of integer ranks")
        self.ranks: list[int] = ranks
        self.process_set_id: int | None = None
        self.comm: Communicator | None = None

    def included(self) -> bool | None:
        """Whether this process belongs to the set (None before ``init``)."""
        world = RUNTIME.comm
        if world is None:
            return None
        return world.rank in self._members(world)

    def _members(self, world: Communicator) -> list[int]:
        return self.ranks if self.ranks or self is not global_process_set \
            else list(range(world.size))

    def size(self) -> int | None:
        """Number of ranks in the set (None while it is not registered)."""
        if self.process_set_id is None or RUNTIME.comm is None:
            return None
        return len(self._members(RUNTIME.comm))

    def rank(self) -> int | None:
        """This process's rank inside the set (None if not registered or not a member)."""
        world = RUNTIME.comm
        if self.process_set_id is None or world is None:
            return None
        members = self._members(world)
        return members.index(world.rank) if world.rank in members else None

    def global_rank(self, local: int) -> int:
        """The global rank of the set's rank ``local``."""
        return self._members(RUNTIME.comm)[local]

    def local_rank_of(self, global_rank: int, what: str = "root_rank") -> int:
        """The set's rank of global rank ``global_rank`` (ValueError if not a member)."""
        members = self._members(RUNTIME.comm)
        if global_rank not in members:
            raise ValueError(f"{what} {global_rank} is not a member of {self}")
        return members.index(global_rank)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def bind(world: Communicator, static: Sequence[ProcessSet | Sequence[int]] = ()) -> None:
    """Called by ``init()``: the global set is the new default communicator; ``static`` sets
    are registered at once (every rank passes the same list)."""
    with RUNTIME.sets_lock:
        RUNTIME.next_set = 1
        RUNTIME.sets.clear()
        global_process_set.comm = world
        global_process_set.ranks = list(range(world.size))
        RUNTIME.sets[0] = global_process_set
        for ps in static:
            add_process_set(ps)


def _valid(ranks: Sequence[int], size: int) -> bool:
    """Whether ``ranks`` are distinct ranks of a job of ``size`` (and not none)."""
    return bool(ranks) and len(set(ranks)) == len(ranks) and \
        all(isinstance(r, int) and 0 <= r < size for r in ranks)


def check_static(static: Sequence[ProcessSet | Sequence[int]], size: int, rank: int) -> None:
    """Refuse, before ``init`` builds anything, a list of static sets that :func:`bind` would
    refuse halfway: ranks outside ``0..size-1``, an empty or repeated rank, a set given twice
    or equal to the global set (Horovod's ValueError for "a duplicate")."""
    seen = [list(range(size))]
    for i, ps in enumerate(static):
        ranks = ps.ranks if isinstance(ps, ProcessSet) else sorted(ps)
        if not _valid(ranks, size):
            raise ValueError(f"rank {rank}: process_sets entry {i} ({ranks}) must hold distinct "
                             f"ranks of the job (0..{size - 1})")
        if ranks in seen:
            raise ValueError(f"rank {rank}: process_sets entry {i} ({ranks}) is a duplicate "
                             f"(of the global set or of an earlier entry); pass each set once")
        seen.append(ranks)


def ids_and_ranks() -> dict[int, list[int]]:
    """Every registered set's id and ranks, the global set (0) included (Horovod's
    ``_get_process_set_ids_and_ranks``)."""
    world = _world()
    with RUNTIME.sets_lock:
        return {pid: list(ps._members(world)) for pid, ps in sorted(RUNTIME.sets.items())}


def unbind() -> None:
    """Called by ``shutdown()``: close every set's communicator and invalidate the sets."""
    with RUNTIME.sets_lock:
        for pid, ps in list(RUNTIME.sets.items()):
            if pid != 0 and ps.comm is not None:
                ps.comm.close()
            ps.comm = None
            if pid != 0:
                ps.process_set_id = None
        RUNTIME.sets.clear()
        global_process_set.comm = None


def _world() -> Communicator:
    world = RUNTIME.comm
    if world is None:
        raise NotInitializedError("shoal is not initialized: call init() first")
    return world


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (every rank calls this, with the same ranks); returns it with
    its id set. Members build its communicator now."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    with RUNTIME.sets_lock:
        world = _world()
        if not _valid(ps.ranks, world.size):
            raise ValueError(f"rank {world.rank}: process set ranks {ps.ranks} must be distinct "
                             f"ranks of the job (0..{world.size - 1})")
        if any(other.ranks == ps.ranks for other in RUNTIME.sets.values()):
            raise ValueError(f"rank {world.rank}: a process set with ranks {ps.ranks} exists "
                             f"already; reuse it or remove it first")
        ps.process_set_id = RUNTIME.next_set
        RUNTIME.next_set += 1
        ps.comm = world.split(ps.ranks)
        RUNTIME.sets[ps.process_set_id] = ps
        return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set and close its communicator; False if it was not registered (the
    global set cannot be removed)."""
    with RUNTIME.sets_lock:
        pid = process_set.process_set_id
        if pid in (None, 0) or RUNTIME.sets.get(pid) is not process_set:
            return False
        del RUNTIME.sets[pid]
        if process_set.comm is not None:
            process_set.comm.close()
        process_set.comm = None
        process_set.process_set_id = None
        return True


def process_set_by_id(process_set_id: int) -> ProcessSet:
    """The registered set with id ``process_set_id`` (ValueError if there is none)."""
    with RUNTIME.sets_lock:
        ps = RUNTIME.sets.get(process_set_id)
    if ps is None:
        raise ValueError(f"process set {process_set_id} is not registered")
    return ps


def process_set_ids() -> list[int]:
    """The ids of the registered sets, the global one (0) included."""
    with RUNTIME.sets_lock:
        return sorted(RUNTIME.sets)


def set_root(process_set: ProcessSet | None, root_rank: Any) -> int:
    """The rank inside ``process_set`` (None: the global set) of the *global* rank
    ``root_rank`` that collectives name as their root, as Horovod's do; ValueError, naming
    this rank, for a root that is not a rank of the job or not a member of the set."""
    world = _world()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int | np.integer) or \
            not 0 <= root_rank < world.size:
        raise ValueError(f"rank {world.rank}: root_rank {root_rank!r} is not a rank of this "
                         f"job (0..{world.size - 1})")
    ps = global_process_set if process_set is None else process_set
    try:
        return ps.local_rank_of(int(root_rank))
    except ValueError as exc:
        raise ValueError(f"rank {world.rank}: {exc}") from None


def communicator_for(process_set: ProcessSet | None) -> Communicator:
    """The communicator a collective on ``process_set`` runs on (the default one for None
    or the global set); a clear error when this rank is not a member or the set is not
    registered."""
    world = _world()
    if process_set is None or process_set is global_process_set:
        return world
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, not {type(process_set).__name__}")
    if process_set.process_set_id is None or RUNTIME.sets.get(process_set.process_set_id) is not \
            process_set:
        raise ValueError(f"rank {world.rank}: {process_set} is not registered; call "
                         f"add_process_set() on every rank first")
    if process_set.comm is None:
        raise ShoalError(f"rank {world.rank} is not a member of {process_set}; only its "
                         f"members may run collectives on it")
    return process_set.comm
