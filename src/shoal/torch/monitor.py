"""gloo's ``monitored_barrier`` for backend "shoal": rank 0 collects a token from every
rank over point-to-point messages, bounded by the timeout, and names the ranks that did not
arrive; and the admission of ``dist.monitored_barrier`` (which refuses every backend not
named gloo) for groups of backend "shoal"."""

from __future__ import annotations

import functools
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist

from shoal.core.communicator import Communicator

from .work import timeout_seconds

__all__ = ["admit_monitored_barrier", "monitored_barrier"]

_MONITOR_TAG = -0x5348  # monitored_barrier's messages (user tags are not negative)


def monitored_barrier(comm: Communicator, round_: int, timeout: Any,
                      group_timeout: float | None, wait_all_ranks: bool = False) -> None:
    """gloo's ``monitored_barrier``, round ``round_`` of the group: rank 0 waits up to
    ``timeout`` for every other rank and raises ``RuntimeError`` naming the first one (every
    one, with ``wait_all_ranks``) that did not arrive; the others wait for rank 0's
    release."""
    if isinstance(timeout, timedelta):  # zero is a deadline already passed, not "none"
        secs = max(0.0, timeout.total_seconds())
    else:
        secs = timeout_seconds(timeout) or group_timeout or 1800.0
    me, n = comm.rank, comm.size
    token = np.array([round_], np.int64)  # tokens of failed rounds are stale

    def receive(src: int, deadline: float) -> bool:
        """The token of this round from ``src`` before ``deadline``; stale ones skipped."""
        while True:
            got = np.zeros(1, np.int64)
            handle = comm.recv(got, src, _MONITOR_TAG)
            try:
                handle.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if handle.cancel():
                    return False
                handle.wait()  # it matched just now
            if got[0] == token[0]:
                return True

    if me != 0:
        comm.send(token, 0, _MONITOR_TAG).wait(secs)
        if not receive(0, time.monotonic() + secs):
            raise RuntimeError(f"Rank {me} successfully reached monitoredBarrier, but "
                               f"received errors while waiting for send/recv from rank "
                               f"0 (no release within {secs * 1000:.0f} ms)")
        return
    deadline = time.monotonic() + secs
    missing: list[int] = []
    for r in range(1, n):
        if deadline - time.monotonic() <= 0 and not missing:
            passed = list(range(1, r))
            raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after "
                               f"{secs * 1000:.0f} ms. Successfully processed ranks: "
                               f"{', '.join(map(str, passed)) or 'none'}")
        if not receive(r, deadline):
            missing.append(r)
            if not wait_all_ranks:
                break
    if missing:
        if wait_all_ranks:
            raise RuntimeError(f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass "
                               f"monitoredBarrier in {secs * 1000:.0f} ms")
        raise RuntimeError(f"[Rank 0]: Rank {missing[0]} failed to pass monitoredBarrier in "
                           f"{secs * 1000:.0f} ms")
    for r in range(1, n):
        comm.send(token, r, _MONITOR_TAG).wait(secs)


_ADMITTED: set[str] = set()


def admit_monitored_barrier(backend: str) -> None:
    """``dist.monitored_barrier`` refuses every backend but gloo by name before it calls the
    group's ``monitored_barrier``; let it through for groups of backend ``backend`` ("shoal",
    or an alias of it; others go to torch's function unchanged)."""
    _ADMITTED.add(backend)
    c10d_module = dist.distributed_c10d
    original = c10d_module.monitored_barrier
    if getattr(original, "_shoal", False):
        return

    @functools.wraps(original)
    def monitored_barrier(group: Any = None, timeout: Any = None,
                          wait_all_ranks: bool = False) -> Any:
        if dist.get_backend(group) not in _ADMITTED:
            return original(group, timeout, wait_all_ranks)
        pg = c10d_module._get_default_group() if group is None else group
        if c10d_module._rank_not_in_group(pg):
            return None
        if isinstance(timeout, float | int):
            timeout = timedelta(seconds=timeout)
        return pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)

    monitored_barrier._shoal = True  # type: ignore[attr-defined]
    c10d_module.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier
