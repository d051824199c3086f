"""The stall inspector: which requests have waited too long, and whether this rank is stuck.

Only a rank *blocked* on a collective is stuck: one that holds a pending request while it
computes is not. So the inspector keeps the threads blocked in a wait (and since when), and
a rank's proposal says "stuck" only when both its oldest request and its oldest blocked
wait are older than ``SHOAL_STALL_WARNING_S``; when every rank says so about collectives that
cannot match, the negotiator calls it a mismatch rather than a hang. A request missing on
some ranks past the same limit is reported once, with its name and those ranks; past
``SHOAL_STALL_SHUTDOWN_S`` (when set) it fails the engine.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ..config import Config
from ..errors import ShoalTimeoutError
from .requests import Request

__all__ = ["StallInspector"]

log = logging.getLogger("shoal.engine")


class StallInspector:
    """Blocked waits and overdue requests of one engine."""

    def __init__(self, cfg: Config, rank: int) -> None:
        self.cfg = cfg
        self.rank = rank
        self._blocked: dict[int, float] = {}  # thread blocked in a wait -> since when

    @contextmanager
    def blocking(self) -> Iterator[None]:
        """Mark the calling thread blocked for the duration (a done-callback waiting inside
        another wait of the same thread keeps the outer wait's start)."""
        token = threading.get_ident()
        outer = token in self._blocked
        if not outer:
            self._blocked[token] = time.perf_counter()
        try:
            yield
        finally:
            if not outer:
                self._blocked.pop(token, None)

    def stuck(self, reqs: Sequence[Request]) -> bool:
        """Whether this rank has been blocked, with these requests pending, past the
        warning limit."""
        oldest = min((r.enqueued for r in reqs), default=math.inf)
        since = min(self._blocked.values(), default=math.inf)
        limit = time.perf_counter() - self.cfg.stall_warning_s
        return oldest < limit and since < limit

    def check(self, reqs: Sequence[Request]) -> ShoalTimeoutError | None:
        """Warn (once per request) about those waiting past the warning limit; the error to
        fail the engine with when one waited past the shutdown limit, else None."""
        warn, fail = self.cfg.stall_warning_s, self.cfg.stall_shutdown_s
        now = time.perf_counter()
        for req in reqs:
            age = now - req.enqueued
            if age > warn and not req.warned:
                req.warned = True
                who = f"ranks {list(req.missing)} have not submitted it" if req.missing else \
                    "the negotiation round has not completed (some rank submitted nothing)"
                log.warning("rank %d: %s %r has waited %.1fs: %s (stalled or diverged ranks; "
                            "every rank must submit the same collectives)", self.rank,
                            req.kind.value, req.name, age, who)
            if fail and age > fail:
                return ShoalTimeoutError(
                    f"rank {self.rank}: {req.kind.value} {req.name!r} stalled for {age:.1f}s "
                    f"(SHOAL_STALL_SHUTDOWN_S={fail:g}); missing on ranks {list(req.missing)}")
        return None
