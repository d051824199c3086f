"""The communicator: one per process, owning the transports and running collectives.

Each collective first *agrees* (every rank checks that all ranks are about to run the same
collective on the same name, shape, dtype and op; one shared-memory round on a host, one small
TCP round across hosts) and only then moves data, so a mismatch is a
:class:`CollectiveMismatchError` on every rank instead of a hang or a wrong answer. After any
error the communicator is *broken*: its peers are out of step, so later calls fail at once until
``shutdown()`` and ``init()`` build a new one.
"""

from __future__ import annotations

import json
import logging
import pickle
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import algorithms
from .config import Config
from .errors import CollectiveMismatchError, ShoalError
from .ops import ReduceOp, check_array
from .topology import World
from .transport.shm import ShmGroup, mismatch_message
from .transport.tcp import TcpMesh

__all__ = ["Communicator"]

log = logging.getLogger("shoal.comm")
_LEN = struct.Struct("!q")


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


def _u8(a: np.ndarray) -> memoryview:
    return memoryview(_flat(a).view(np.uint8))


class Communicator:
    """Collectives over numpy arrays for one job; built by :func:`shoal.init`."""

    def __init__(self, cfg: Config, world: World, mesh: TcpMesh | None,
                 shm: ShmGroup | None) -> None:
        self.cfg = cfg
        self.world = world
        self.rank = world.rank
        self.size = world.size
        self.mesh = mesh
        self.shm = shm
        self._broken: BaseException | None = None
        self._counter = 0
        self.algorithm = algorithms.select(self, cfg.allreduce_algorithm) if self.size > 1 \
            else "local"
        log.info("rank %d: allreduce algorithm %s (%d hosts x %d local ranks)", self.rank,
                 self.algorithm, world.cross_size, world.local_size)

    # -- bookkeeping -----------------------------------------------------------------------
    def _name(self, kind: str, name: str | None) -> str:
        if name:
            return name
        self._counter += 1
        return f"{kind}.noname.{self._counter}"

    def _guard(self, fn, *args: Any, **kwargs: Any) -> Any:
        if self._broken is not None:
            raise ShoalError(f"rank {self.rank}: shoal cannot run collectives after an earlier "
                             f"failure ({self._broken.__class__.__name__}: {self._broken}); "
                             f"call shoal.shutdown() and shoal.init() to start again")
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            self._broken = exc
            if self.shm is not None:
                self.shm.abort()
            raise

    def _agree(self, desc: str, what: str) -> None:
        """Every rank checks every other rank is running the same collective.

        On a host the check is one shared-memory round; across hosts each local rank then
        swaps its host's verdict with its peers on the other hosts (a mismatch found on one
        host travels as ``!`` + JSON), so every rank of the job raises the same error.
        """
        if self.size == 1:
            return
        w = self.world
        if self.shm is not None and w.homogeneous:
            local = self.shm.agree(desc, what)
            if w.cross_size == 1:
                if local is not None:
                    raise CollectiveMismatchError(mismatch_message(what, local), local)
                return
            group = w.cross_peers
            verdict = desc if local is None else "!" + json.dumps(local)
        else:
            group, verdict = tuple(range(self.size)), desc
        texts = [b.decode(errors="replace")
                 for b in self._gather_bytes(group, verdict.encode(), what)]
        if len(set(texts)) == 1 and not texts[0].startswith("!"):
            return
        by_node = len(group) != self.size
        descs: dict[int, str] = {}
        for i, (peer, text) in enumerate(zip(group, texts, strict=True)):
            if text.startswith("!"):
                descs.update({int(r): d for r, d in json.loads(text[1:]).items()})
            else:
                descs.update(dict.fromkeys(w.node_ranks(i) if by_node else (peer,), text))
        raise CollectiveMismatchError(mismatch_message(what, descs), descs)

    def _gather_bytes(self, group: Sequence[int], blob: bytes, what: str) -> list[bytes]:
        """Allgather small byte strings among ``group`` over TCP (lengths, then payloads)."""
        peers = [p for p in group if p != self.rank]
        lens = {p: bytearray(_LEN.size) for p in peers}
        mine = _LEN.pack(len(blob))
        self.mesh.exchange([(p, memoryview(mine)) for p in peers],
                           [(p, memoryview(lens[p])) for p in peers], what=what)
        bufs = {p: bytearray(_LEN.unpack(lens[p])[0]) for p in peers}
        self.mesh.exchange([(p, memoryview(blob)) for p in peers],
                           [(p, memoryview(bufs[p])) for p in peers], what=what)
        return [blob if p == self.rank else bytes(bufs[p]) for p in group]

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, array: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE,
                  name: str | None = None, out: np.ndarray | None = None,
                  bf16: bool = False) -> np.ndarray:
        """Reduce ``array`` across ranks into ``out`` (a new array if None; may be ``array``)."""
        op = ReduceOp(op)
        name = self._name("allreduce", name)
        what = f"allreduce of {name!r}"
        dtype = check_array(array, f"allreduce tensor {name!r}", self.rank, op, bf16)
        if out is None:
            out = np.empty_like(array)
        elif out.shape != array.shape or out.dtype != array.dtype or not out.flags.c_contiguous:
            raise ValueError(f"rank {self.rank}: output for {name!r} must be a C-contiguous "
                             f"{array.dtype} array of shape {array.shape}")
        desc = f"allreduce name={name} shape={array.shape} dtype={dtype} op={op.name}"
        return self._guard(self._allreduce, array, out, op, dtype, desc, what)

    def _allreduce(self, array: np.ndarray, out: np.ndarray, op: ReduceOp, dtype: str,
                   desc: str, what: str) -> np.ndarray:
        self._agree(desc, what)
        if self.size == 1 or array.size == 0:
            if out is not array:
                np.copyto(out, array)
            return out
        src, dst = _flat(array), _flat(out)
        if dtype == "bfloat16":  # reduce through the 16-bit words; ops.reduce_into widens them
            src, dst = src.view(np.uint16), dst.view(np.uint16)
        algorithms.ALGORITHMS[self.algorithm](self, src, dst, op, dtype, what)
        return out

    def allgather(self, array: np.ndarray, name: str | None = None) -> np.ndarray:
        """Concatenate every rank's array along the first dimension (lengths may differ)."""
        name = self._name("allgather", name)
        what = f"allgather of {name!r}"
        dtype = check_array(array, f"allgather tensor {name!r}", self.rank)
        if array.ndim == 0:
            raise ValueError(f"rank {self.rank}: allgather tensor {name!r} is a scalar; "
                             f"reshape it to (1,)")
        desc = f"allgather name={name} shape=(*, {', '.join(map(str, array.shape[1:]))}) " \
               f"dtype={dtype}"
        return self._guard(self._allgather, array, desc, what)

    def _allgather(self, array: np.ndarray, desc: str, what: str) -> np.ndarray:
        self._agree(desc, what)
        if self.size == 1:
            return array.copy()
        everyone = range(self.size)
        rows = [_LEN.unpack(b)[0] for b in
                self._gather_bytes(everyone, _LEN.pack(array.shape[0]), what)]
        out = np.empty((sum(rows), *array.shape[1:]), array.dtype)
        offsets = np.cumsum([0, *rows])
        parts = [out[offsets[r]:offsets[r + 1]] for r in everyone]
        np.copyto(parts[self.rank], array)
        peers = [p for p in everyone if p != self.rank]
        self.mesh.exchange([(p, _u8(array)) for p in peers],
                           [(p, _u8(parts[p])) for p in peers], what=what)
        return out

    def broadcast(self, array: np.ndarray, root_rank: int, name: str | None = None) -> np.ndarray:
        """Overwrite ``array`` on every rank with ``root_rank``'s values, in place."""
        name = self._name("broadcast", name)
        what = f"broadcast of {name!r} from rank {root_rank}"
        dtype = check_array(array, f"broadcast tensor {name!r}", self.rank)
        if not 0 <= root_rank < self.size:
            raise ValueError(f"rank {self.rank}: root_rank {root_rank} is not a rank of this job "
                             f"(size {self.size})")
        desc = f"broadcast name={name} shape={array.shape} dtype={dtype} root={root_rank}"
        return self._guard(self._broadcast, array, root_rank, desc, what)

    def _broadcast(self, array: np.ndarray, root: int, desc: str, what: str) -> np.ndarray:
        self._agree(desc, what)
        if self.size == 1 or array.size == 0:
            return array
        if self.rank == root:
            peers = [p for p in range(self.size) if p != root]
            self.mesh.exchange([(p, _u8(array)) for p in peers], [], what=what)
        else:
            self.mesh.exchange([], [(root, _u8(array))], what=what)
        return array

    def reducescatter(self, array: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE,
                      name: str | None = None) -> np.ndarray:
        """Reduce, then keep this rank's block of the first dimension (earlier ranks get the
        extra rows when it does not divide evenly, as in Horovod)."""
        if array.ndim == 0:
            raise ValueError(f"rank {self.rank}: reducescatter needs at least one dimension")
        total = self.allreduce(array, op, name=self._name("reducescatter", name))
        rows = array.shape[0]
        base, extra = divmod(rows, self.size)
        start = self.rank * base + min(self.rank, extra)
        return total[start:start + base + (self.rank < extra)].copy()

    def alltoall(self, array: np.ndarray, splits: Sequence[int] | np.ndarray | None = None,
                 name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Send ``splits[i]`` rows of ``array`` to rank ``i``; return what arrived and its splits.

        Without ``splits`` the first dimension must divide evenly by the number of ranks.
        """
        name = self._name("alltoall", name)
        what = f"alltoall of {name!r}"
        dtype = check_array(array, f"alltoall tensor {name!r}", self.rank)
        if array.ndim == 0:
            raise ValueError(f"rank {self.rank}: alltoall tensor {name!r} is a scalar")
        if splits is None:
            if array.shape[0] % self.size:
                raise ValueError(f"rank {self.rank}: alltoall tensor {name!r} has "
                                 f"{array.shape[0]} rows, not divisible by {self.size} ranks; "
                                 f"pass splits=")
            splits = [array.shape[0] // self.size] * self.size
        splits = [int(s) for s in splits]
        if len(splits) != self.size or min(splits) < 0 or sum(splits) != array.shape[0]:
            raise ValueError(f"rank {self.rank}: alltoall splits {splits} for {name!r} must be "
                             f"{self.size} non-negative counts summing to {array.shape[0]}")
        desc = f"alltoall name={name} shape=(*, {', '.join(map(str, array.shape[1:]))}) " \
               f"dtype={dtype}"
        return self._guard(self._alltoall, array, splits, desc, what)

    def _alltoall(self, array: np.ndarray, splits: list[int], desc: str,
                  what: str) -> tuple[np.ndarray, np.ndarray]:
        self._agree(desc, what)
        everyone = range(self.size)
        blob = json.dumps(splits).encode()
        matrix = [json.loads(b) for b in self._gather_bytes(everyone, blob, what)] \
            if self.size > 1 else [splits]
        recv_splits = [matrix[p][self.rank] for p in everyone]
        out = np.empty((sum(recv_splits), *array.shape[1:]), array.dtype)
        send_off = np.cumsum([0, *splits])
        recv_off = np.cumsum([0, *recv_splits])
        send = [array[send_off[p]:send_off[p + 1]] for p in everyone]
        recv = [out[recv_off[p]:recv_off[p + 1]] for p in everyone]
        np.copyto(recv[self.rank], send[self.rank])
        peers = [p for p in everyone if p != self.rank]
        if peers:
            self.mesh.exchange([(p, _u8(send[p])) for p in peers],
                               [(p, _u8(recv[p])) for p in peers], what=what)
        return out, np.asarray(recv_splits, dtype=np.int64)

    def barrier(self) -> None:
        """Return only when every rank has called barrier."""
        self.allreduce(np.zeros(1, np.int32), ReduceOp.SUM, name="barrier")

    def broadcast_object(self, obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
        """Pickle ``obj`` on the root and unpickle it everywhere (peers are authenticated)."""
        name = self._name("broadcast_object", name)
        payload = np.frombuffer(pickle.dumps(obj), np.uint8) if self.rank == root_rank \
            else np.empty(0, np.uint8)
        length = np.array([payload.size], np.int64)
        self.broadcast(length, root_rank, name=f"{name}.len")
        if self.rank != root_rank:
            payload = np.empty(int(length[0]), np.uint8)
        self.broadcast(payload, root_rank, name=f"{name}.data")
        return obj if self.rank == root_rank else pickle.loads(payload.tobytes())

    def allgather_object(self, obj: Any, name: str | None = None) -> list[Any]:
        """Pickle ``obj`` on every rank and return everyone's, in rank order."""
        name = self._name("allgather_object", name)
        payload = np.frombuffer(pickle.dumps(obj), np.uint8)
        lengths = self.allgather(np.array([payload.size], np.int64), name=f"{name}.len")
        data = self.allgather(payload, name=f"{name}.data")
        offsets = np.cumsum([0, *lengths.tolist()])
        return [pickle.loads(data[offsets[r]:offsets[r + 1]].tobytes())
                for r in range(self.size)]

    def close(self) -> None:
        """Release transports."""
        if self.shm is not None:
            self.shm.close()
        if self.mesh is not None:
            self.mesh.close()
