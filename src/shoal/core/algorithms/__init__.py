"""AllReduce algorithms, each a small function registered by name.

An algorithm is ``fn(comm, src, dst, op, dtype, what)`` on flat, contiguous arrays of equal
size; ``src`` and ``dst`` may be the same array. :func:`select` picks one by topology; the
choice can be forced with ``SHOAL_ALLREDUCE_ALGORITHM``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..comm import Transport as Communicator

__all__ = ["ALGORITHMS", "applicable", "register", "select"]

Algorithm = Callable[..., None]
ALGORITHMS: dict[str, Algorithm] = {}
_REQUIRES: dict[str, Callable[[Communicator], str | None]] = {}


def register(name: str, requires: Callable[[Any], str | None]) -> Callable[[Algorithm],
                                                                          Algorithm]:
    """Register an algorithm; ``requires(comm)`` returns why it cannot run there, or None."""
    def deco(fn: Algorithm) -> Algorithm:
        ALGORITHMS[name] = fn
        _REQUIRES[name] = requires
        return fn
    return deco


def applicable(comm: Communicator, name: str) -> str | None:
    """None if ``name`` can run on this communicator, else the reason it cannot."""
    return _REQUIRES[name](comm)


def select(comm: Communicator, requested: str) -> str:
    """Resolve ``auto`` (or check a forced name) for this topology.

    auto: one host -> ``shm`` (memory traffic only); several hosts with the same number of
    ranks each -> ``hierarchical`` (each host's link carries 2(M-1)/M of the data, M hosts);
    otherwise, or without shared memory -> ``ring``. flat: the same, never ``hierarchical``
    (horovodrun's ``--no-hierarchical-allreduce``).
    """
    if requested in ("auto", "flat"):
        for name in ("shm", "hierarchical", "ring"):
            if applicable(comm, name) is None and not (requested == "flat" and
                                                       name == "hierarchical"):
                return name
        raise ConfigError("no allreduce algorithm applies to this topology")  # pragma: no cover
    if requested not in ALGORITHMS:
        raise ConfigError(f"SHOAL_ALLREDUCE_ALGORITHM={requested!r} is not one of "
                          f"{['auto', 'flat', *sorted(ALGORITHMS)]}")
    why = applicable(comm, requested)
    if why:
        raise ConfigError(f"SHOAL_ALLREDUCE_ALGORITHM={requested!r} cannot run here: {why}")
    return requested


# import for their registration side effect
from . import basic  # noqa: E402,F401
