"""The engine's loop: named requests in, fused and ordered collectives out.

Framework hooks and the API ``submit`` requests and get a future back at once. Progress is
made in *rounds*, each a collective of its own: every rank proposes what it has pending, all
ranks see every proposal (:meth:`Transport.gather_all`: one shared-memory round on a host,
one small TCP exchange across hosts), and all compute the same answer: which requests are
ready on every rank, in which order, fused into which buffers. So ranks may submit in
different orders and still agree, and disagreement (same name, other shape, dtype or op) is a
:class:`CollectiveMismatchError` on every rank.

A name is negotiated in full (name and description) only the first time; afterwards it has a
cache id, identical on every rank, and is proposed as one bit. In steady state a training
step's whole control traffic is one bit per gradient riding in the round that starts the
collectives (the rounds are paid anyway to synchronise the shared-memory path).

Rounds run on the background thread (so communication overlaps the caller's computation)
or, for synchronous calls, on the caller's own thread when it is free: no thread hand-off on
the latency path. A request missing on some ranks for ``SHOAL_STALL_WARNING_S`` is reported
with its name and those ranks; with ``SHOAL_STALL_SHUTDOWN_S`` it then fails.

The loop ties the engine's parts together: the :mod:`.negotiator` decides a round, the
:mod:`.names` cache remembers agreed names, the :mod:`.stalls` inspector watches waits, the
:mod:`.executor` fuses and runs what was decided, and the :mod:`.small` path runs a cached
small allreduce in one round. The loop owns what they share: the pending requests, the round
lock, join, and the failure that stops the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from ..config import Config
from ..errors import CollectiveMismatchError, PeerLostError, ShoalError
from ..reduction import ReduceOp
from ..timeline import Timeline
from ..transport import Transport
from .executor import Executor
from .names import NameCache
from .negotiator import JOINED, STUCK, decide, encode
from .neutral import neutral_allreduce, parse_allreduce_desc
from .requests import Kind, Request
from .small import NOT_SENT, SmallPath
from .stalls import StallInspector

__all__ = ["Engine"]

log = logging.getLogger("shoal.engine")


class Engine:
    """Negotiates, orders, fuses and runs this process's collectives."""

    def __init__(self, transport: Transport, cfg: Config,
                 explain: Callable[[PeerLostError, Callable[[], None]], PeerLostError]
                 | None = None, *, timeline: Timeline | None = None) -> None:
        self.transport = transport
        self._explain = explain
        self.cfg = cfg
        self.rank = transport.rank
        self.size = transport.size
        self.timeline = timeline
        self.names = NameCache(cfg.name_cache_size)
        self.stalls = StallInspector(cfg, self.rank)
        self.executor = Executor(transport, cfg, timeline)
        self.small = SmallPath(transport, self.names, cfg, enabled=timeline is None)
        self._cv = threading.Condition()
        self._pending: dict[str, Request] = {}
        self._inflight: list[Request] = []
        self._run = threading.Lock()  # held by the thread running a round
        self._broken: BaseException | None = None
        self._stopping = False
        self.rounds = 0
        self.epoch = 0  # bumped (on every rank alike) when ranks were found diverged
        self._join: Request | None = None  # this rank's join() in progress
        self._join_seen: dict[int, int] = {}  # rank -> round it was first seen joined
        self._thread = threading.Thread(target=self._loop, name="shoal-engine", daemon=True)
        self._thread.start()

    def set_timeline(self, timeline: Timeline | None) -> None:
        """Write the timeline to ``timeline`` from now on (None: stop); the one written
        before is completed and closed. Collectives already running finish in the old one
        or in none."""
        old, self.timeline = self.timeline, timeline
        self.executor.timeline = timeline
        if old is not None and old is not timeline:
            old.close()

    @property
    def small_bytes(self) -> int:
        """The largest allreduce the one-round path takes here (0: none)."""
        return self.small.limit

    @property
    def small_rounds(self) -> int:
        """Collectives completed by the one-round path."""
        return self.small.rounds

    # -- submission ------------------------------------------------------------------------
    def submit(self, req: Request, wake: bool = True) -> Future:
        """Queue a request; its future completes with the output (or the error).

        ``wake=False`` (a caller about to :meth:`wait` on it) leaves the background thread
        asleep, so the caller runs the round itself without a thread hand-off.
        """
        with self._cv:
            self._check_usable()
            if req.name in self._pending:
                raise ValueError(f"rank {self.rank}: a collective named {req.name!r} is already "
                                 f"in flight; wait for it or use another name")
            if (self.size == 1 and req.kind in (Kind.ALLREDUCE, Kind.BROADCAST)
                    and req.out is not None):
                # one rank: every op (and codec) leaves the input as it is, and a broadcast
                # comes from this rank; no round to wait for
                req.make_ready()
                if req.out.ctypes.data != req.array.ctypes.data:
                    np.copyto(req.out, req.array)
                alone = True
            else:
                self._pending[req.name] = req
                alone = False
                if wake:
                    self._cv.notify()
        if alone:  # outside the lock: done-callbacks run here, and may submit
            req.future.set_result(req.out if req.result is None else req.result)
        return req.future

    @property
    def broken(self) -> BaseException | None:
        """The failure that stopped this engine (None while it works)."""
        return self._broken

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise ShoalError(f"rank {self.rank}: shoal cannot run collectives after an earlier "
                             f"failure ({type(self._broken).__name__}: {self._broken}); call "
                             f"shoal.shutdown() and shoal.init() to start again")
        if self._stopping:
            raise ShoalError(f"rank {self.rank}: shoal is shutting down")

    def wait(self, future: Future, timeout: float | None = None,
             drive: bool | None = None) -> Any:
        """Drive rounds on this thread while it is free, until ``future`` is done. With a
        ``timeout`` the engine's thread drives them instead: a round waits for every rank
        to join it, so one driven here could outlast the deadline. ``drive=False`` leaves
        the rounds to the engine's thread in any case: a round runs every pending request's
        device waits and reductions, which a caller such as autograd's thread must not."""
        if future.done():
            return future.result()
        with self.stalls.blocking():
            return self._wait(future, timeout, timeout is None if drive is None else drive)

    def _wait(self, future: Future, timeout: float | None, drive: bool) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not drive:
            with self._cv:
                self._cv.notify()
        while not future.done():
            if drive and self._run.acquire(blocking=False):
                try:
                    if not future.done() and self._broken is None:
                        self._round()
                except BaseException as exc:  # recorded; every future fails with it
                    self._fail(exc)
                finally:
                    self._run.release()
            else:
                try:
                    future.exception(timeout=0.002)
                except TimeoutError:
                    self._check_stalls()
            if self._broken is not None and not future.done():  # failed by another thread
                raise self._broken
            if deadline is not None and time.monotonic() > deadline and not future.done():
                raise TimeoutError(f"rank {self.rank}: collective still running after "
                                   f"{timeout}s")
        return future.result()

    # -- background thread -----------------------------------------------------------------
    def _loop(self) -> None:
        cycle = self.cfg.cycle_time_ms / 1000.0
        progressed = True
        while True:
            with self._cv:
                while not self._pending and self._join is None and not self._stopping:
                    self._cv.wait(1.0)
                if self._stopping:
                    return
                fused = all(r.fused for r in self._pending.values())
            if not (fused and progressed):
                time.sleep(cycle)  # let more tensors arrive, to fuse them
            if not self._run.acquire(timeout=1.0):
                self._check_stalls()
                continue
            try:
                progressed = True
                if (self._pending or self._join is not None) and self._broken is None:
                    progressed = self._round()
                    if not progressed:
                        self._check_stalls()
            except BaseException as exc:
                self._fail(exc)
            finally:
                self._run.release()
            if self._broken is not None:
                return

    def _fail(self, exc: BaseException) -> None:
        if self._broken is None:
            if isinstance(exc, PeerLostError) and self._explain and not self._stopping:
                # name the rank that died, not its messenger (aborts once it has reported)
                exc = self._explain(exc, self.transport.abort)
            self.transport.abort()  # peers waiting on us learn at once
            self._broken = exc
            if not self._stopping:
                log.error("rank %d: collective failed: %s", self.rank, exc)
        else:
            self.transport.abort()
            exc = self._broken
        with self._cv:
            pending, self._pending = list(self._pending.values()), {}
            pending += self._inflight
            self._inflight = []
        for req in pending:
            if not req.future.done():
                req.future.set_exception(exc)

    def close(self) -> None:
        """Stop the thread; pending requests fail; peers waiting on us fail at once."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self.transport.abort()
        self._thread.join(timeout=5.0)
        with self._cv:
            pending, self._pending = list(self._pending.values()), {}
        for req in pending:
            if not req.future.done():
                req.future.set_exception(ShoalError(
                    f"rank {self.rank}: shoal was shut down with {req.name!r} still pending"))
        if self.timeline is not None:
            self.timeline.close()

    # -- one round -------------------------------------------------------------------------
    def _proposal(self, reqs: Sequence[Request]) -> bytes:
        bits, new = self.names.split(reqs)
        flags = STUCK if self.stalls.stuck(reqs) else 0
        if self._join is not None:
            flags |= JOINED
        return encode(bits, new, flags)

    def allreduce_small(self, name: str, desc: str, src: np.ndarray, dst: np.ndarray,
                        op: ReduceOp, dtype: str) -> bool:
        """Run a synchronous allreduce in one round (:mod:`.small`) if it qualifies; False
        (nothing done, nothing sent) if it does not, and the caller takes the general
        path."""
        if src.nbytes > self.small.limit or self._pending or self._join is not None or \
                not self._run.acquire(blocking=False):  # (a round is running)
            return False
        try:
            if self._pending or self._broken is not None or self._stopping:
                return False
            tl, start = self.timeline, time.perf_counter()
            blobs = self.small.run(name, desc, src, dst, op, dtype, self.rounds + 1)
            if blobs is NOT_SENT:
                return False
            self.rounds += 1
            if blobs is None:
                if tl is not None:  # negotiation and data in one round: one span
                    tl.cycle(start)
                    tl.span(tl.track("allreduce", name), "ONE_ROUND_ALLREDUCE", start,
                            time.perf_counter(),
                            round=self.rounds, bytes=src.nbytes)
                return True
            future = self._adopt(Request(Kind.ALLREDUCE, name, src, dst, dtype, desc, op=op),
                                 blobs)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._run.release()
        self.wait(future)  # ran in the round, or pending: the general path from here
        return True

    def small_request(self, req: Request, finish: Callable[[list[np.ndarray]], None],
                      rows: int | None = None) -> bool:
        """:meth:`allreduce_small` for a synchronous broadcast, reduce-scatter or allgather
        on one host (:meth:`SmallPath.run_parts`; ``rows``: an allgather's): True once
        ``req`` completed, in one round or, where the round did not agree, the general way;
        False (nothing done, nothing sent) where it does not qualify."""
        src = req.array
        if src.nbytes > self.small.limit or req.ready is not None or self._pending or \
                self._join is not None or not self._run.acquire(blocking=False):
            return False
        try:
            if self._pending or self._broken is not None or self._stopping:
                return False
            blobs = self.small.run_parts(req.name, req.desc, src, finish, self.rounds + 1,
                                         rows)
            if blobs is NOT_SENT:
                return False
            self.rounds += 1
            if blobs is None:
                req.future.set_result(req.out if req.result is None else req.result)
                return True
            self._adopt(req, blobs)
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            self._run.release()
        return True

    def _adopt(self, req: Request, blobs: list[bytes]) -> Future:
        """The small path's round did not agree: settle it as a general round (the same on
        every rank), with the request now pending like any other."""
        name = req.name
        with self._cv:
            if name in self._pending:
                raise ValueError(f"rank {self.rank}: a collective named {name!r} is already "
                                 f"in flight; wait for it or use another name")
            self._pending[name] = req
        now = time.perf_counter()
        self._settle(blobs, [req], now, now)
        return req.future

    def _round(self) -> bool:
        """One negotiation round and the collectives it agrees on; True if any ran."""
        with self._cv:
            reqs = list(self._pending.values())
        t0 = time.perf_counter()
        blobs = self.transport.gather_all(self._proposal(reqs), "negotiation round")
        self.rounds += 1
        return self._settle(blobs, reqs, t0, time.perf_counter())

    def _settle(self, blobs: list[bytes], reqs: Sequence[Request], t0: float, t1: float
                ) -> bool:
        """Decide on every rank's proposals and run what they agree on."""
        order, extras, refused = self._decide(blobs, reqs)
        mine = {r.name: r for r in reqs}
        runnable = [mine[name] if name in mine else self._neutral(name) for name in order]
        with self._cv:
            for req in runnable:
                if mine.get(req.name) is req:  # not a joined rank's neutral stand-in
                    del self._pending[req.name]
            failed = [self._pending.pop(name) for name in refused if name in self._pending]
            self._inflight = runnable  # failed by _fail if the collectives below fail
        for req in failed:  # found before any data moved: this engine carries on
            req.future.set_exception(refused[req.name])
        self.executor.run(runnable, extras, t0, t1, self.rounds)
        self.names.evict()
        self._inflight = []
        joined = self._join_complete()
        return bool(runnable) or joined

    def _decide(self, blobs: list[bytes], reqs: Sequence[Request]
                ) -> tuple[list[str], dict, dict[str, CollectiveMismatchError]]:
        """The negotiator's decision on every rank's proposals (:func:`.negotiator.decide`,
        the same on all ranks), applied to this engine: the name cache, the use rounds, join
        and the numbering epoch; the names to run in order, their extras and the refused."""
        d = decide(blobs, self.names.by_id, self.names.entries, rank=self.rank,
                   pending=[r.name for r in reqs], stall_warning_s=self.cfg.stall_warning_s)
        for r in d.joined:
            self._join_seen.setdefault(r, self.rounds)
        self.names.apply(d, self.rounds)
        if d.refused:
            # ranks that diverged (or made calls another rank did not, as around join()) have
            # their unnamed collectives numbered out of step: every rank starts a new
            # numbering, all in this same round
            self.epoch += 1
        if d.missing:  # (none in steady state: no per-request Python there)
            for req in reqs:
                if req.name in d.missing:
                    req.missing = d.missing[req.name]
        return d.order, d.extras, d.refused

    # -- join --------------------------------------------------------------------------------
    def join(self) -> Future:
        """This rank has no more work: it takes part in the allreduces the others still run
        with neutral contributions, until every rank has joined. The future resolves to the
        last rank to join (the same on every rank)."""
        req = Request(Kind.JOIN, "shoal.join", np.empty(0, np.int64), None, "int64", "join")
        with self._cv:
            self._check_usable()
            if self._join is not None:
                raise ValueError(f"rank {self.rank}: join() is already in progress")
            if self.size == 1:
                req.future.set_result(self.rank)
                return req.future
            self._join = req
            self._cv.notify()
        return req.future

    def _neutral(self, name: str) -> Request:
        """The request a joined rank contributes to ``name`` (an allreduce)."""
        desc = self.names.desc(name)
        shape, dtype, op, codec = parse_allreduce_desc(desc)  # type: ignore[misc]
        array = neutral_allreduce(shape, dtype, op)
        return Request(Kind.ALLREDUCE, name, array, np.empty_like(array), dtype, desc, op=op,
                       codec=codec)

    def _join_complete(self) -> bool:
        """After a round in which every rank was joined: resolve join() with the last rank to
        join (latest round first seen, then the highest rank)."""
        if len(self._join_seen) < self.size or self._join is None:
            return False
        last = max(self._join_seen, key=lambda r: (self._join_seen[r], r))
        req, self._join, self._join_seen = self._join, None, {}
        req.future.set_result(last)
        return True

    # -- stalls ----------------------------------------------------------------------------
    def _check_stalls(self) -> None:
        with self._cv:
            reqs = list(self._pending.values())
        error = self.stalls.check(reqs)
        if error is not None:
            self._fail(error)
