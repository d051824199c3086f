"""The name cache: every name negotiated in full once gets an id, the same on every rank.

A proposal then names a cached collective with one bit (:mod:`.negotiator`), so a training
step's control traffic is one bit per gradient. Every rank applies the same decisions in the
same order, so every rank holds the same cache: the same names under the same ids, and the
round each was last used in. The cache is bounded (``SHOAL_NAME_CACHE_SIZE``): past its size
it forgets the least recently used names, every rank alike after the same round, and a
forgotten name is simply negotiated in full again.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .negotiator import Decision
from .requests import PER_CALL, Request

__all__ = ["NameCache"]


class NameCache:
    """Names by id, their agreed descriptions, and the round each was last used in."""

    def __init__(self, limit: int) -> None:
        self.limit = max(16, limit)
        self.entries: dict[str, tuple[int, str]] = {}  # name -> (id, desc)
        self.by_id: list[str] = []
        # per id: the round the name last ran in (the one-round path records its own use)
        self.last = np.zeros(0, np.int64)
        self.negotiated = 0  # names negotiated in full (new or changed), for diagnostics

    def __len__(self) -> int:
        return len(self.by_id)

    def desc(self, name: str) -> str:
        """The description every rank agreed on for a cached ``name``."""
        return self.entries[name][1]

    def split(self, reqs: Sequence[Request]) -> tuple[np.ndarray, list[list]]:
        """The parts of a proposal for ``reqs``: one bit per cached id (set for the requests
        whose name is cached with the same description), and ``[name, desc, extra]`` for
        the others, which are negotiated in full. A request that carries per-call sizes
        (allgather, alltoall) is always sent in full: its extra changes from call to call."""
        bits = np.zeros(len(self.by_id), bool)
        new = []
        for req in reqs:
            cached = self.entries.get(req.name)
            if cached is not None and cached[1] == req.desc and req.kind not in PER_CALL:
                bits[cached[0]] = True
            else:
                new.append([req.name, req.desc, req.extra])
        return bits, new

    def apply(self, decision: Decision, round_: int) -> None:
        """Take in a round's decision: descriptions every rank changed, new names (ids in
        the decision's order), and the round in which the decided names ran."""
        for name, desc in decision.adopted.items():
            self.entries[name] = (self.entries[name][0], desc)
        for name, desc in decision.fresh:
            self.entries[name] = (len(self.by_id), desc)
            self.by_id.append(name)
        self.negotiated += len(decision.adopted) + len(decision.fresh)
        if decision.fresh:
            self.last = np.concatenate([self.last, np.zeros(len(decision.fresh), np.int64)])
        self.last[decision.ran_ids] = round_  # vectorised: no per-name Python in steady state

    def evict(self) -> None:
        """Forget the least recently used names once over the limit, down to three quarters
        of it. Every rank holds the same cache and use rounds and evicts after the same
        round, so the caches stay identical."""
        if len(self.by_id) <= self.limit:
            return
        ids = np.arange(len(self.by_id))
        # most recently used last, ties by id: the same order on every rank
        keep = np.sort(np.lexsort((ids, self.last))[-(self.limit * 3 // 4):])
        self.by_id = [self.by_id[i] for i in keep]
        self.entries = {nm: (i, self.entries[nm][1]) for i, nm in enumerate(self.by_id)}
        self.last = self.last[keep]
