"""One synchronisation round for small allreduces: the payload rides with the negotiation.

A synchronous allreduce of at most ``SHOAL_ONE_ROUND_BYTES`` on one host whose name the
engine has negotiated before (steady state: a training loop's statistics, SyncBatchNorm's
per-layer sums, a barrier) is proposed *with its data*, in the same shared-memory round that
negotiates it. When every rank's proposal is byte-identical (each proposed exactly this one
cached name, with a payload), every rank reduces all the payloads itself, straight from the
peers' slots in rank order, so every rank gets the same bits, and the collective is done:
one round, where the general path pays a negotiation round and then a data round. Measured
here before this path: a 4 KiB allreduce at 2 ranks took 160-180 us, most of it the Python
of two rounds and of the general machinery (futures, fusion buckets, the algorithm table).

When proposals differ (another rank has other requests pending, has not submitted this one
yet, has joined, or its cache moved on), the round counts as an ordinary negotiation round
on every rank alike, and the request goes on the general way from there.

The path is a collaborator of the engine's loop: it reads the name cache and moves data
through the transport; the loop decides when it may run (nothing else pending, the round
lock free) and settles a round that did not agree.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..config import Config
from ..reduction import ReduceOp, reduce_into
from ..transport import Transport
from .names import NameCache
from .negotiator import FAST, encode

__all__ = ["NOT_SENT", "SmallPath"]

# two ranks, an op that is one ufunc on the dtype itself: reduce with that ufunc alone
_DIRECT: dict[tuple[ReduceOp, str], Callable[..., object]] = {
    (op, dtype): ufunc for op, ufunc in ((ReduceOp.SUM, np.add), (ReduceOp.MIN, np.minimum),
                                         (ReduceOp.MAX, np.maximum),
                                         (ReduceOp.PRODUCT, np.multiply))
    for dtype in ("float32", "float64", "int32", "int64")}

#: names the one-round tokens can tell apart: a token is (names << 40 | id << 20 | salt)
_MAX_NAMES = 1 << 20

#: the outcome of a one-round attempt that was not done in one round: nothing was sent
NOT_SENT: list[bytes] = []


class SmallPath:
    """One-round allreduces of cached names, for one engine."""

    def __init__(self, transport: Transport, names: NameCache, cfg: Config,
                 enabled: bool = True) -> None:
        self.transport = transport
        self.names = names
        # the largest payload here: none on one rank (no round carries the whole job), nor
        # with a timeline (it records general rounds)
        self.limit = transport.one_round_limit(cfg.one_round_bytes) \
            if enabled and transport.one_round_ready else 0
        self._cross = bool(self.limit) and transport.crosses_hosts
        self.rounds = 0  # collectives completed by this path (for tests and diagnostics)
        self._heads: dict[int, tuple[bytes, int]] = {}  # token -> (proposal, payload room)
        # the transport's one-round primitive, bound once: this is the latency path
        self._round = transport.one_round_primitive() if self.limit else None
        self._me = transport.one_round_slot if self.limit else 0

    def run(self, name: str, desc: str, src: np.ndarray, dst: np.ndarray, op: ReduceOp,
            dtype: str, round_: int) -> list[bytes] | None:
        """Try round ``round_`` as one proposing exactly the cached ``name`` with ``src``'s
        payload riding along. None: done, every rank proposed the same and ``dst`` holds the
        result, reduced from the payloads in rank order (the same bits on every rank).
        :data:`NOT_SENT`: the request does not qualify (a new or changed name, a payload
        too large) and nothing was sent. Otherwise every rank's proposal, for the loop to
        settle as a general round. The caller holds the round lock."""
        proposal = self._proposal(name, desc, src.nbytes, None)
        if proposal is None:
            return NOT_SENT
        blob, token, cache_id = proposal
        if self._cross:  # each host reduces its own payloads first (the same bits on each)
            def partial(views: list[np.ndarray]) -> np.ndarray:
                acc = np.empty_like(views[0])
                reduce_into(acc, views[1:], op, dtype, first=views[0])
                return acc
            parts = self._round(blob, token, src, "negotiation round", partial)
        else:
            parts = self._round(blob, token, src, "negotiation round")
        if parts is None:
            return self.transport.one_round_blobs(blob, "negotiation round")
        fast = _DIRECT.get((op, dtype)) if len(parts) == 2 else None
        if fast is not None and self._me >= 0:  # the common case, without the generality
            # this rank's term read from its source, hot in cache and, in place, the output
            # itself (a third faster than from the slot); the same values in the same order
            if self._me:
                fast(parts[0], src, out=dst)
            else:
                fast(src, parts[1], out=dst)
        elif fast is not None:
            fast(parts[0], parts[1], out=dst)
        else:
            reduce_into(dst, parts[1:], op, dtype, first=parts[0],
                        divide_by=self.transport.size if op == ReduceOp.AVERAGE else 0)
        self.names.last[cache_id] = round_  # as a general round records its use
        self.rounds += 1
        return None

    def run_parts(self, name: str, desc: str, payload: np.ndarray,
                  finish: Callable[[list[np.ndarray]], None], round_: int,
                  rows: int | None = None) -> list[bytes] | None:
        """:meth:`run` for any collective on one host: ``payload`` rides along and
        ``finish(parts)`` makes this rank's result from every rank's payload, in rank order,
        read at once. Payloads are the same size on every rank where the description fixes
        it; where it does not (an allgather's ``rows``, < 2**20), the proposal is the full
        one a general round sends (the rows are per call) and the token carries the rows,
        so a round agrees only where every rank's are the same. The same outcomes as
        :meth:`run`; across hosts always :data:`NOT_SENT` (the hosts' partials are an
        allreduce's)."""
        proposal = None if self._cross else self._proposal(name, desc, payload.nbytes, rows)
        if proposal is None:
            return NOT_SENT
        blob, token, cache_id = proposal
        parts = self._round(blob, token, payload, "negotiation round")
        if parts is None:
            return self.transport.one_round_blobs(blob, "negotiation round")
        finish(parts)
        self.names.last[cache_id] = round_
        self.rounds += 1
        return None

    def _proposal(self, name: str, desc: str, nbytes: int, rows: int | None
                  ) -> tuple[bytes, int, int] | None:
        """``(proposal, token, cache id)`` of a one-round attempt at the cached ``name``
        with ``nbytes`` riding along, or None where it does not qualify (a new or changed
        name, a payload too large, rows or names past what a token tells apart). The
        token is ``names << 40 | id << 20 | rows`` (names > id >= 0: never zero)."""
        names = self.names
        cached = names.entries.get(name)
        salt = 0 if rows is None else rows
        if cached is None or cached[1] != desc or not 0 <= salt < 1 << 20:
            return None  # new or changed: negotiated in full first
        cache_id, count = cached[0], len(names.by_id)
        if count >= _MAX_NAMES:
            return None
        if rows is None:
            head = (count << 32) | cache_id
            known = self._heads.get(head)
            blob, room = known if known is not None else self._head(head, cache_id)
        else:  # (json of one entry: a few microseconds, as a general round pays)
            blob = encode(np.zeros(count, bool), [[name, desc, rows]], FAST)
            room = self.transport.one_round_room(len(blob))
        if nbytes > room:
            return None
        return blob, (count << 40) | (cache_id << 20) | salt, cache_id

    def _head(self, token: int, cache_id: int) -> tuple[bytes, int]:
        """The proposal of exactly the cached name ``cache_id`` with a payload riding along
        (the same bytes on every rank that proposes it), and the payload bytes that fit."""
        if len(self._heads) > 4096:
            self._heads.clear()
        bits = np.zeros(token >> 32, bool)
        bits[cache_id] = True
        blob = encode(bits, [], FAST)
        known = self._heads[token] = blob, self.transport.one_round_room(len(blob))
        return known
