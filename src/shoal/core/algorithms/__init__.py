"""Reduction algorithms over a :class:`~shoal.core.transport.Transport`.

An allreduce algorithm is ``fn(transport, srcs, dsts, op, dtype, codec, what, phases)`` on
flat, contiguous arrays (the fused request), registered by name, returning the dtype its
bytes took over TCP (None if none did); a source and its destination
may be the same array. :func:`select` picks one by topology (the choice can be forced with
``SHOAL_ALLREDUCE_ALGORITHM``), :func:`choose` records it on the transport, and
:func:`allreduce` runs the chosen one. :func:`reducescatter` picks its route by topology
(:mod:`.scatter`). The algorithms reach shared memory and TCP through the transport only, and
the transport never imports them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..compression import Codec
from ..errors import ConfigError
from ..reduction import ReduceOp
from ..transport import Transport

__all__ = ["ALGORITHMS", "allreduce", "applicable", "choose", "reducescatter", "register",
           "select"]

log = logging.getLogger("shoal.algorithms")

Algorithm = Callable[..., None]
ALGORITHMS: dict[str, Algorithm] = {}
_REQUIRES: dict[str, Callable[[Transport], str | None]] = {}


def register(name: str, requires: Callable[[Any], str | None]) -> Callable[[Algorithm],
                                                                          Algorithm]:
    """Register an algorithm; ``requires(transport)`` returns why it cannot run there, or
    None."""
    def deco(fn: Algorithm) -> Algorithm:
        ALGORITHMS[name] = fn
        _REQUIRES[name] = requires
        return fn
    return deco


def applicable(transport: Transport, name: str) -> str | None:
    """None if ``name`` can run on this transport, else the reason it cannot."""
    return _REQUIRES[name](transport)


def select(transport: Transport, requested: str) -> str:
    """Resolve ``auto`` (or check a forced name) for this topology.

    auto: one host -> ``shm`` (memory traffic only); several hosts with the same number of
    ranks each -> ``hierarchical`` (each host's link carries 2(M-1)/M of the data, M hosts);
    otherwise, or without shared memory -> ``ring``. flat: the same, never ``hierarchical``
    (horovodrun's ``--no-hierarchical-allreduce``).
    """
    if requested in ("auto", "flat"):
        for name in ("shm", "hierarchical", "ring"):
            if applicable(transport, name) is None and not (requested == "flat" and
                                                       name == "hierarchical"):
                return name
        raise ConfigError("no allreduce algorithm applies to this topology")  # pragma: no cover
    if requested not in ALGORITHMS:
        raise ConfigError(f"SHOAL_ALLREDUCE_ALGORITHM={requested!r} is not one of "
                          f"{['auto', 'flat', *sorted(ALGORITHMS)]}")
    why = applicable(transport, requested)
    if why:
        raise ConfigError(f"SHOAL_ALLREDUCE_ALGORITHM={requested!r} cannot run here: {why}")
    return requested


def choose(transport: Transport, requested: str) -> str:
    """Select the allreduce algorithm for ``transport``'s topology and record it there."""
    if transport.size > 1:
        transport.algorithm = select(transport, requested)
        w = transport.world
        log.info("rank %d: allreduce algorithm %s (%d hosts x %d local ranks)", transport.rank,
                 transport.algorithm, w.cross_size, w.local_size)
    return transport.algorithm


def allreduce(transport: Transport, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray],
              op: ReduceOp, dtype: str, codec: Codec, what: str,
              phases: dict[str, float] | None = None) -> str | None:
    """Reduce the flat arrays ``srcs`` (one logical dtype) into ``dsts`` as one fused
    buffer, with the transport's chosen algorithm; the dtype its bytes took over TCP (a
    half-precision sum may take float32: :mod:`.wire16`), None if none crossed TCP."""
    if transport.size == 1:
        for s, d in zip(srcs, dsts, strict=True):
            if s is not d:
                np.copyto(d, s)
        return None
    return ALGORITHMS[transport.algorithm](transport, srcs, dsts, op, dtype, codec, what,
                                           phases)


# import for their registration side effect
from . import basic  # noqa: E402,F401
from .scatter import reducescatter  # noqa: E402
