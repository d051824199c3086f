"""What the engine works on: named requests of a few kinds, and how a disagreement about
them is explained."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..compression import Codec, Compression
from ..reduction import ReduceOp

__all__ = ["PER_CALL", "Kind", "Request", "mismatch_message"]


class Kind(enum.Enum):
    """What a request does."""

    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    ALLTOALL = "alltoall"
    REDUCESCATTER = "reducescatter"
    JOIN = "join"


PER_CALL = (Kind.ALLGATHER, Kind.ALLTOALL)  # carry per-rank sizes every time


@dataclass(eq=False)
class Request:
    """One named collective submitted by this rank."""

    kind: Kind
    name: str
    array: np.ndarray            # flat storage view of the input
    out: np.ndarray | None       # flat storage view of the output (allreduce, broadcast)
    dtype: str                   # logical dtype
    desc: str                    # what every rank must agree on
    op: ReduceOp = ReduceOp.AVERAGE
    codec: Codec = Compression.none
    root: int = 0
    extra: Any = None            # allgather: my rows; alltoall: my splits
    trailing: tuple[int, ...] = ()
    result: Any = None           # what the future resolves to (default: ``out``)
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    warned: bool = False
    missing: tuple[int, ...] = ()
    fused: bool = False          # the caller fused it already (a bucket): no cycle wait
    ready: Callable[[], None] | None = None  # waits until ``array`` may be read (see below)

    def make_ready(self) -> None:
        """Wait, on the thread that is about to read the input, until its producer has
        finished writing it (a device stage's copy to host), once. The engine calls this
        just before the data moves, never at submission, so the submitting thread (autograd)
        never waits for it."""
        ready, self.ready = self.ready, None
        if ready is not None:
            ready()


def mismatch_message(what: str, descs: dict[int, str]) -> str:
    """Explain which ranks disagree and how."""
    groups: dict[str, list[int]] = {}
    for rank, desc in sorted(descs.items()):
        groups.setdefault(desc, []).append(rank)
    lines = [f"ranks disagree on {what}:"]
    lines += [f"  ranks {ranks}: {desc}" for desc, ranks in groups.items()]
    lines.append("every rank must submit collectives with the same name, shape, dtype and op")
    return "\n".join(lines)
