"""The transports of a communicator: its shared-memory group (:mod:`.shm`, peers on this
host) and its TCP mesh (:mod:`.tcp`, peers on other hosts), behind one door,
:class:`Transport`.

The engine and the algorithms reach shared memory and TCP only through a :class:`Transport`.
Its methods are *execution* primitives: they assume every rank calls the same one with
matching arguments. Deciding that (negotiation, mismatch detection, ordering, fusion) is the
engine's job (:mod:`shoal.core.engine`); reducing is the algorithms'
(:mod:`shoal.core.algorithms`), which build on this layer and are never imported by it.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..config import Config
from ..errors import ShoalError
from ..topology import World
from .cross_round import CrossRound, FrameSwap
from .shm import ShmGroup
from .tcp import TcpMesh

__all__ = ["Transport", "pack_blobs", "unpack_blobs"]

log = logging.getLogger("shoal.transport")
_LEN = struct.Struct("!q")


def _u8(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8))


def pack_blobs(blobs: Sequence[bytes]) -> bytes:
    """Length-prefixed concatenation of byte strings."""
    head = struct.pack(f"!q{len(blobs)}q", len(blobs), *map(len, blobs))
    return head + b"".join(blobs)


def unpack_blobs(data: bytes) -> list[bytes]:
    """Inverse of :func:`pack_blobs`; a ``data`` that is not one is a :class:`ShoalError`."""
    (count,) = _LEN.unpack_from(data) if len(data) >= _LEN.size else (-1,)
    pos = _LEN.size * (count + 1)
    if count < 0 or pos > len(data):
        raise ShoalError(f"packed proposals of {len(data)} bytes claim {count} entries")
    lengths = struct.unpack_from(f"!{count}q", data, _LEN.size)
    if min(lengths, default=0) < 0 or pos + sum(lengths) != len(data):
        raise ShoalError(f"packed proposals of {len(data)} bytes claim entries of {lengths}")
    out = []
    for n in lengths:
        out.append(data[pos:pos + n])
        pos += n
    return out


class Transport:
    """Data movement for one communicator (:class:`shoal.core.communicator.Communicator`
    builds it and owns it). ``algorithm`` names the allreduce algorithm chosen for its
    topology (:func:`shoal.core.algorithms.choose`; ``local`` on one rank)."""

    def __init__(self, cfg: Config, world: World, mesh: TcpMesh | None,
                 shm: ShmGroup | None) -> None:
        self.cfg = cfg
        self.world = world
        self.rank = world.rank
        self.size = world.size
        self.mesh = mesh
        self.shm = shm
        self._local_ranks = world.local_ranks
        self.algorithm = "local"
        self._cross_round: Any = None  # the one-round primitive across hosts (_cross)
        self._frames: FrameSwap | None = None  # the negotiation frames across hosts

    # -- control ---------------------------------------------------------------------------
    def gather_all(self, blob: bytes, what: str) -> list[bytes]:
        """Every rank's ``blob``, indexed by global rank.

        On a host this is one shared-memory round; across hosts each local rank then swaps
        its host's blobs with its peers on the other hosts (all local ranks at once), in the
        frames the one-round path also sends (:mod:`.cross_round`).
        """
        if self.size == 1:
            return [blob]
        if self._host_frames:
            return self.gather_hosts(self.shm.allgather_bytes(blob, what), what)
        return self.frames().gather(blob, what)

    def gather_hosts(self, local: Sequence[bytes], what: str) -> list[bytes]:
        """Every rank's blob, indexed by global rank, from this host's ``local`` blobs (in
        local order, the same on every local rank): swapped with this local index's peers
        on the other hosts (homogeneous worlds)."""
        if self.world.cross_size == 1:
            out: list[bytes] = [b""] * self.size
            for r, b in zip(self._local_ranks, local, strict=True):
                out[r] = b
            return out
        return self.unpack_hosts(self.frames().gather(self.pack_host(local), what))

    @property
    def _host_frames(self) -> bool:
        """Whether a frame across hosts carries a whole host's blobs (shared memory
        gathered them first), not one rank's."""
        return self.shm is not None and self.world.homogeneous

    def frames(self) -> FrameSwap:
        """The negotiation frames of this rank's group across hosts: the ranks of its local
        index (one a host) where hosts gather through shared memory first, else every
        rank."""
        if self._frames is None:
            group = self.world.cross_peers if self._host_frames else range(self.size)
            self._frames = FrameSwap(self.mesh, self.rank, group,
                                     self.cfg.small_message_bytes)
        return self._frames

    def pack_host(self, local: Sequence[bytes]) -> bytes:
        """A frame's body of this host's blobs (in local order)."""
        return pack_blobs(local) if self._host_frames else local[0]

    def unpack_hosts(self, bodies: Sequence[bytes]) -> list[bytes]:
        """Every rank's blob, by rank, from the bodies of :meth:`frames`' group members."""
        if not self._host_frames:
            return list(bodies)
        out: list[bytes] = [b""] * self.size
        for node, data in enumerate(bodies):
            ranks = self.world.node_ranks(node)
            blobs = unpack_blobs(data)
            if len(blobs) != len(ranks):
                raise ShoalError(f"rank {self.rank}: host {node} sent {len(blobs)} proposals "
                                 f"for its {len(ranks)} ranks")
            for r, b in zip(ranks, blobs, strict=True):
                out[r] = b
        return out

    # -- point to point and the host stage (the algorithms' primitives) -------------------
    @property
    def has_shm(self) -> bool:
        """Whether this rank shares memory with the other ranks of its host."""
        return self.shm is not None

    def send(self, peer: int, view: memoryview, what: str) -> None:
        """Send ``view`` to ``peer`` over TCP."""
        self.mesh.send(peer, view, what)

    def recv_into(self, peer: int, view: memoryview, what: str) -> None:
        """Receive ``view.nbytes`` from ``peer`` over TCP into ``view``."""
        self.mesh.recv_into(peer, view, what)

    def exchange(self, sends: Sequence[tuple[int, memoryview]],
                 recvs: Sequence[tuple[int, memoryview]],
                 on_recv: Callable[[int, int, int], None] | None = None,
                 what: str = "transfer") -> None:
        """Send and receive several buffers over TCP at once (:meth:`TcpMesh.exchange`:
        ``on_recv`` sees each receive's progress)."""
        self.mesh.exchange(sends, recvs, on_recv=on_recv, what=what)

    def host_allreduce(self, srcs: Sequence[np.ndarray], dsts: Sequence[np.ndarray],
                       wire: np.dtype, reduce: Callable[..., None], **stages: Any) -> None:
        """Allreduce among this host's ranks through shared memory, chunk by chunk, with the
        optional ``encode``/``decode``/``cross``/``finish`` stages and ``phases``/``what``
        of :meth:`ShmGroup.allreduce` (``cross`` reduces each chunk across hosts)."""
        self.shm.allreduce(srcs, dsts, wire, reduce, **stages)

    def host_reducescatter(self, src: np.ndarray, dst: np.ndarray, bounds: Sequence[int],
                           reduce: Callable[..., None], what: str) -> None:
        """Reduce-scatter among this host's ranks through shared memory (local ranks' blocks
        by ``bounds``)."""
        self.shm.reducescatter(src, dst, bounds, reduce, what)

    # -- the one-round path (:mod:`shoal.core.engine.small`) -------------------------------
    @property
    def one_round_ready(self) -> bool:
        """Whether a payload can ride with a negotiation round: every rank on this host
        reducing through shared memory (local order is then rank order), or several hosts
        each reducing its own first (:mod:`.cross_round`)."""
        return self.algorithm == "shm" or self.crosses_hosts

    @property
    def crosses_hosts(self) -> bool:
        """Whether the one-round path runs across hosts (:mod:`.cross_round`)."""
        return self.algorithm in ("hierarchical", "ring") and self.mesh is not None and \
            (self.world.cross_size or 1) > 1

    def one_round_limit(self, setting: int) -> int:
        """The largest payload of a one-round collective: on one host ``setting`` or one
        chunk; across hosts also at most ``small_message_bytes`` and one TCP stripe's
        frame."""
        if not self.crosses_hosts:
            return setting or self.shm.chunk_bytes
        limit = min(self.cfg.small_message_bytes, 2 * self.cfg.tcp_stripe_bytes - 64)
        if self.shm is not None and self.shm.n > 1:
            # every local rank sends its host's whole partial across: n times the general
            # path's bytes on the link (2 x 2 ranks on 1 Gbit/s: 64 KiB took 1.07 ms in one
            # round, 0.84 the general way; 4 KiB 0.29 against 0.71)
            limit = min(limit // (2 * self.shm.n), setting or self.shm.chunk_bytes)
        return limit

    @property
    def one_round_slot(self) -> int:
        """This rank's place among the parts a one-round collective returns where its part
        is its own payload (one host; one rank per host), else -1 (parts are hosts')."""
        if not self.crosses_hosts:
            return self.shm.me
        return -1 if self.shm is not None and self.shm.n > 1 else self._cross().me

    def one_round_room(self, head_bytes: int) -> int:
        """The payload bytes that fit behind a proposal of ``head_bytes``."""
        if self.shm is None:
            return 1 << 62  # (across hosts alone: the limit bounds it)
        return self.shm.slot_bytes - self.shm.payload_offset(head_bytes)

    def _cross(self) -> Any:
        if self._cross_round is None:  # (made on first use: one-host jobs never need it)
            self._cross_round = CrossRound(self)
        return self._cross_round

    def one_round_primitive(self) -> Callable[[bytes, int, np.ndarray, str],
                                              list[np.ndarray] | None]:
        """``round(blob, token, payload, what)``: a negotiation round carrying ``payload``;
        every rank's payload (by rank) when every rank proposed the same ``blob`` (named by
        ``token``), else None, and the round must be finished with :meth:`one_round_blobs`.
        Returned once and called directly: it is the latency path of small allreduces.
        Across hosts it also takes ``partial(views)``, which reduces a host's payloads, and
        returns the hosts' partials (:mod:`.cross_round`)."""
        if self.crosses_hosts:
            return self._cross()
        return self.shm.small_round

    def one_round_blobs(self, blob: bytes, what: str) -> list[bytes]:
        """Every rank's proposal of a one-round attempt that did not agree."""
        if self.crosses_hosts:
            return self._cross().blobs()
        return self.shm.round_blobs(blob, what)

    # -- data movement ---------------------------------------------------------------------
    @property
    def one_host_shm(self) -> bool:
        """Whether every rank is on this host and shares memory with it."""
        return self.shm is not None and self.world.cross_size == 1

    def allgather(self, array: np.ndarray, rows: Sequence[int], out: np.ndarray,
                  what: str) -> None:
        """Concatenate every rank's ``array`` (``rows[r]`` rows from rank r) into ``out``:
        through shared memory on one host, else over TCP."""
        offsets = np.cumsum([0, *rows])
        parts = [out[offsets[r]:offsets[r + 1]] for r in range(self.size)]
        np.copyto(parts[self.rank], array)
        if self.size == 1:
            return
        if self.one_host_shm:
            self.shm.gather_streams(array, [p.nbytes for p in parts],
                                    {p: parts[p] for p in range(self.size) if p != self.rank},
                                    what)
            return
        peers = [p for p in range(self.size) if p != self.rank]
        self.mesh.exchange([(p, _u8(array)) for p in peers],
                           [(p, _u8(parts[p])) for p in peers], what=what)

    def broadcast(self, array: np.ndarray, root: int, what: str) -> None:
        """Overwrite ``array`` with the root's, in place: through shared memory on one host
        (the root writes each piece once, every other rank copies it out), else over TCP."""
        if self.size == 1 or array.size == 0:
            return
        if self.one_host_shm:
            sizes = [array.nbytes if r == root else 0 for r in range(self.size)]
            self.shm.gather_streams(array, sizes, {} if self.rank == root else {root: array},
                                    what)
        elif self.rank == root:
            peers = [p for p in range(self.size) if p != root]
            self.mesh.exchange([(p, _u8(array)) for p in peers], [], what=what)
        else:
            self.mesh.exchange([], [(root, _u8(array))], what=what)

    def alltoall(self, array: np.ndarray, splits: Sequence[int], recv_splits: Sequence[int],
                 out: np.ndarray, what: str,
                 matrix: Sequence[Sequence[int]] | None = None) -> None:
        """Send ``splits[i]`` rows to rank i; receive ``recv_splits[i]`` rows from it.
        ``matrix[p][q]``, the rows rank p sends rank q (every rank's splits), lets ranks of
        one host move them through shared memory; without it they go over TCP."""
        send_off = np.cumsum([0, *splits])
        recv_off = np.cumsum([0, *recv_splits])
        everyone = range(self.size)
        send = [array[send_off[p]:send_off[p + 1]] for p in everyone]
        recv = [out[recv_off[p]:recv_off[p + 1]] for p in everyone]
        np.copyto(recv[self.rank], send[self.rank])
        if self.size == 1:
            return
        if matrix is not None and self.one_host_shm:
            row = int(np.prod(array.shape[1:], dtype=np.int64)) * array.itemsize
            self.shm.alltoall_streams(send, recv, [[int(c) * row for c in r] for r in matrix],
                                      what)
            return
        peers = [p for p in everyone if p != self.rank]
        self.mesh.exchange([(p, _u8(send[p])) for p in peers],
                           [(p, _u8(recv[p])) for p in peers], what=what)

    def abort(self) -> None:
        """Tell same-host peers we are gone, so their waits fail at once, and end this
        rank's own blocked waits."""
        if self.shm is not None:
            self.shm.abort()
        if self.mesh is not None:
            self.mesh.closing = True

    def close(self) -> None:
        """Release transports (peers see this rank leave)."""
        self.abort()
        if self.shm is not None:
            self.shm.close()
        if self.mesh is not None:
            self.mesh.close()
