"""An mpi4py-style communicator over shoal's workers, for code written against one.

SMDDP's ``get_worker_comm()`` hands scripts an object they use as ``mpi4py.MPI.COMM_WORLD``
(SMDDP's Mask-RCNN evaluation gathers its detections with ``comm.gather(obj, root=0)`` and
waits with ``comm.Barrier()``). :class:`WorkerComm` is that object on shoal: mpi4py's
lower-case methods move picklable Python objects (over the job's authenticated collectives),
``Barrier`` waits for every rank; ``rank``/``size`` and ``Get_rank()``/``Get_size()`` as
mpi4py spells them. No MPI is involved.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

from .api import communicator

__all__ = ["WorkerComm", "get_worker_comm"]


class WorkerComm:
    """The job's workers as an mpi4py-style intracommunicator (objects, not buffers)."""

    def __init__(self, comm: Any = None) -> None:
        self._comm = comm if comm is not None else communicator()

    @property
    def rank(self) -> int:
        """This worker's rank."""
        return int(self._comm.rank)

    @property
    def size(self) -> int:
        """How many workers there are."""
        return int(self._comm.size)

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
        """This worker's rank (mpi4py's spelling)."""
        return self.rank

    def Get_size(self) -> int:  # noqa: N802 - mpi4py's name
        """How many workers there are (mpi4py's spelling)."""
        return self.size

    def _root(self, root: int, what: str) -> int:
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise ValueError(f"rank {self.rank}: {what}(root={root!r}): root must be a rank "
                             f"of this communicator, 0 to {self.size - 1}")
        return root

    def Barrier(self) -> None:  # noqa: N802 - mpi4py's name
        """Wait until every worker has reached the barrier."""
        self._comm.barrier()

    barrier = Barrier

    def bcast(self, obj: Any = None, root: int = 0) -> Any:
        """``root``'s object on every worker."""
        return self._comm.broadcast_object(obj, self._root(root, "bcast"))

    def allgather(self, obj: Any) -> list[Any]:
        """Every worker's object, in rank order, on every worker."""
        return self._comm.allgather_object(obj)

    def gather(self, obj: Any, root: int = 0) -> list[Any] | None:
        """Every worker's object, in rank order, on ``root``; None on the others."""
        root = self._root(root, "gather")
        objs = self._comm.allgather_object(obj)
        return objs if self.rank == root else None

    def scatter(self, objs: Sequence[Any] | None = None, root: int = 0) -> Any:
        """Item ``r`` of ``root``'s sequence on rank ``r``. A root without one item per rank
        fails on every rank (the others learn it from the root), and nothing is moved."""
        root = self._root(root, "scatter")
        payload: tuple[str, Any] | None = None
        if self.rank == root:
            if objs is None or len(objs) != self.size:
                got = "None" if objs is None else str(len(objs))
                payload = ("error", f"scatter(root={root}) needs a sequence of {self.size} "
                                    f"items (one per rank) on rank {root}, got {got}")
            else:
                payload = ("items", list(objs))
        kind, value = self._comm.broadcast_object(payload, root)
        if kind == "error":
            raise ValueError(f"rank {self.rank}: {value}")
        return value[self.rank]

    def allreduce(self, obj: Any, op: Callable[[Any, Any], Any] | None = None) -> Any:
        """Every worker's object combined by ``op`` (a function of two, ``+`` by default) in
        rank order, on every worker."""
        return functools.reduce(op or operator.add, self._comm.allgather_object(obj))

    def reduce(self, obj: Any, op: Callable[[Any, Any], Any] | None = None,
               root: int = 0) -> Any:
        """:meth:`allreduce`'s result on ``root``; None on the others."""
        root = self._root(root, "reduce")
        value = self.allreduce(obj, op)
        return value if self.rank == root else None


def get_worker_comm() -> WorkerComm:
    """SMDDP's ``get_worker_comm()``: every worker of the job as an mpi4py-style
    communicator (after ``init()``)."""
    return WorkerComm()
