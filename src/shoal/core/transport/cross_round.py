"""Negotiation rounds across hosts: one frame format for the general round and the one-round
path, so ranks that chose differently still make one round.

A rank decides alone whether a synchronous small collective tries the one-round path (its
engine is idle) or goes the general way (its engine thread still held the round lock), so in
one round some ranks may send a one-round frame and others a general one. Both are the same
frame, read the same way: a 24-byte head (a magic word, the *token*, the body's length) and
the body. A general round's token is 0 and its body is the host's proposals (packed, one per
local rank); a one-round frame's token names the one cached collective its host agreed on
and its body is the host's partial (the host's payloads reduced in local order).

Every rank of the group (the ranks of one local index, one per host) sends its frame to every
other and reads theirs: head first, then the body of the length the head gave, so frames of
any length cross in one exchange, one round trip. The heads are checked before anything is
trusted: a frame that is not shoal's, or a length past what the protocol allows, is a
:class:`ShoalError` naming the peer and what was read, never an allocation of that size.

Every rank then sees the same heads and decides alike: where every token is the same and not
0, the round is done and the partials, in host order, are what the caller reduces (every rank
the same bits). Otherwise the round is an ordinary negotiation round on every rank: each rank
that sent a partial now sends its host's proposals (a second frame, token 0), and each rank
reads them from exactly those peers whose head carried a token.

Control frames travel on a peer's first TCP stream only (:meth:`TcpMesh.exchange` with
``control``), so the head and the body arrive in order whatever their lengths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ShoalError

if TYPE_CHECKING:
    from . import Transport
    from .tcp import TcpMesh

__all__ = ["MAGIC", "MAX_PROPOSALS", "CrossRound", "FrameSwap", "read_head"]

#: the first word of every negotiation frame ("shoalneg", little-endian)
MAGIC = int.from_bytes(b"shoalneg", "little")
#: the longest body of a general frame: a host's proposals (new names, in full, at most a
#: few hundred bytes each: a model of 100,000 tensors proposes some 20 MB once)
MAX_PROPOSALS = 256 << 20
_HEAD_BYTES = 24
#: body bytes sent with the head: a one-round partial or a steady-state proposal leaves in
#: one send; a longer body's rest follows once the heads are read (the first send fits the
#: kernel's buffers, at least 256 KiB a connection, so it never waits for the peer to read)
_EAGER = 64 << 10


def read_head(head: np.ndarray, rank: int, peer: int, what: str, partial_cap: int
              ) -> tuple[int, int]:
    """``(token, body length)`` of the frame head ``head`` (three int64 words) that ``rank``
    read from ``peer``, checked: the magic word, and a length within what the protocol
    allows (``partial_cap`` for a one-round partial, :data:`MAX_PROPOSALS` for a host's
    proposals). Anything else is a :class:`ShoalError` naming both ranks and the words."""
    magic, token, length = (int(x) for x in head[:3])
    if magic != MAGIC:
        raise ShoalError(
            f"rank {rank}: read a frame from rank {peer} during {what} that is not a shoal "
            f"negotiation frame (words {magic:#x}, {token:#x}, {length:#x}): the two ranks' "
            f"streams are out of step, which is a bug in shoal; please report it with both "
            f"ranks' logs")
    cap = partial_cap if token else MAX_PROPOSALS
    if not 0 <= length <= cap:
        kind = "one-round partial" if token else "host's proposals"
        raise ShoalError(
            f"rank {rank}: rank {peer} announced a {kind} of {length} bytes during {what}, "
            f"past the {cap} bytes the protocol allows (token {token:#x}); check that every "
            f"rank runs the same shoal version with the same SHOAL_SMALL_MESSAGE_BYTES")
    return token, length


class FrameSwap:
    """Frames between this rank and the other ranks of ``group`` over ``mesh``."""

    def __init__(self, mesh: TcpMesh, rank: int, group: Sequence[int],
                 partial_cap: int) -> None:
        self.mesh = mesh
        self.rank = rank
        self.group = list(group)
        self.me = self.group.index(rank)
        self.peers = [p for p in self.group if p != rank]
        self.partial_cap = partial_cap

    def swap(self, to: Sequence[int], frm: Sequence[int], token: int, body: memoryview,
             what: str) -> dict[int, tuple[int, np.ndarray]]:
        """Send the frame (``token``, ``body``) to the ranks ``to`` and read one from each of
        ``frm``: ``{peer: (token, body bytes)}``, checked (:func:`read_head`)."""
        body = body.cast("B")
        eager = body[:_EAGER]
        first = bytearray(_HEAD_BYTES + eager.nbytes)  # one send: the head and what fits
        first[:_HEAD_BYTES] = np.array([MAGIC, token, body.nbytes], np.int64).tobytes()
        first[_HEAD_BYTES:] = eager
        heads = {p: np.empty(3, np.int64) for p in frm}
        mesh = self.mesh
        mesh.exchange([(p, memoryview(first)) for p in to],
                      [(p, memoryview(h).cast("B")) for p, h in heads.items()],
                      what=what, control=True)
        got = {}
        for p, h in heads.items():
            tok, length = read_head(h, self.rank, p, what, self.partial_cap)
            got[p] = tok, np.empty(length, np.uint8)
        rest = body[_EAGER:]
        sends = [(p, rest) for p in to] if rest.nbytes else []
        recvs = [(p, memoryview(b)) for p, (_t, b) in got.items() if b.nbytes]
        if sends or recvs:
            mesh.exchange(sends, recvs, what=what, control=True)
        return got

    def gather(self, blob: bytes, what: str) -> list[bytes]:
        """Every group member's ``blob``, in group order: a general round."""
        return self.settle(0, lambda: blob,
                           self.swap(self.peers, self.peers, 0, memoryview(blob), what), what)

    def settle(self, token: int, mine: Callable[[], bytes],
               got: dict[int, tuple[int, np.ndarray]], what: str) -> list[bytes]:
        """Finish a round that did not agree, as a general one: this rank sent ``token`` (a
        partial where not 0; ``mine()`` is its host's proposals) and read ``got``. The ranks
        that sent partials now send their proposals; returns every member's, in group
        order."""
        late = [p for p, (t, _b) in got.items() if t]
        blob = mine()
        second = {}
        if token or late:
            second = self.swap(self.peers if token else [], late, 0, memoryview(blob), what)
        for p, (t, _b) in second.items():
            if t:  # (a proposals frame carries no token: the streams are out of step)
                raise ShoalError(f"rank {self.rank}: rank {p} sent a one-round frame where its "
                                 f"host's proposals were due during {what}")
        return [blob if p == self.rank else (second[p][1] if p in second else got[p][1]).tobytes()
                for p in self.group]


class CrossRound:
    """The one-round primitive of a job on several hosts, for one transport."""

    def __init__(self, transport: Transport) -> None:
        self.t = transport
        w = transport.world
        self.shm = transport.shm if w.homogeneous else None
        self.frames = transport.frames()
        self.group = self.frames.group
        self.me = self.frames.me
        self._blobs: list[bytes] = []

    def __call__(self, blob: bytes, token: int, payload: np.ndarray, what: str,
                 partial: Callable[[list[np.ndarray]], np.ndarray]) -> list[np.ndarray] | None:
        """Run one round; every host's partial in host order when every rank proposed
        ``token``, else None (then :meth:`blobs`). ``partial(views)`` reduces a host's
        payloads, in local order, into a new array."""
        shm = self.shm
        if shm is not None:
            views = shm.small_round(blob, token, payload, what)
            if views is None:  # this host did not agree: a general frame, at once
                got = self.frames.gather(self.t.pack_host(shm.round_blobs(blob, what)), what)
                self._blobs = self.t.unpack_hosts(got)
                return None
            mine = partial(views)
        else:
            mine = payload
        frames = self.frames
        got = frames.swap(frames.peers, frames.peers, token, memoryview(mine.reshape(-1)), what)
        if all(t == token for t, _b in got.values()):
            for p, (_t, b) in got.items():
                if b.nbytes != mine.nbytes:
                    raise ShoalError(f"rank {self.t.rank}: rank {p} sent a one-round partial of "
                                     f"{b.nbytes} bytes for this rank's {mine.nbytes} during "
                                     f"{what}")
            return [mine if p == self.t.rank else got[p][1].view(payload.dtype)
                    for p in self.group]
        # every rank's proposal of the round just run, as a general round sees it
        host = (lambda: self.t.pack_host(shm.round_blobs(blob, what))) if shm is not None \
            else (lambda: blob)
        self._blobs = self.t.unpack_hosts(frames.settle(token, host, got, what))
        return None

    def blobs(self) -> list[bytes]:
        """Every rank's proposal of the last round that did not agree, by rank."""
        return self._blobs
