"""The background engine: named requests in, fused and ordered collectives out.

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
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from .comm import Transport
from .config import Config
from .errors import CollectiveMismatchError, PeerLostError, ShoalError, ShoalTimeoutError
from .negotiator import FAST, JOINED, STUCK, decide, encode
from .neutral import neutral_allreduce, parse_allreduce_desc
from .ops import ReduceOp
from .requests import _PER_CALL, Kind, Request, mismatch_message
from .small import SmallPath
from .timeline import Timeline

__all__ = ["Engine", "Kind", "Request", "mismatch_message"]

log = logging.getLogger("shoal.engine")


class Engine(SmallPath):
    """Negotiates, orders, fuses and runs this process's collectives."""

    def __init__(self, comm: Transport, cfg: Config,
                 explain: Callable[[PeerLostError, Callable[[], None]], PeerLostError]
                 | None = None, *, timeline: Timeline | None = None) -> None:
        self.comm = comm
        self._explain = explain
        self.cfg = cfg
        self.rank = comm.rank
        self.size = comm.size
        self.timeline = timeline
        self._cv = threading.Condition()
        self._pending: dict[str, Request] = {}
        self._inflight: list[Request] = []
        self._cache: dict[str, tuple[int, str]] = {}  # name -> (id, desc), same on all ranks
        self._by_id: list[str] = []
        # per cache id: the round the name last ran in (same on all ranks), for eviction
        self._last = np.zeros(0, np.int64)
        self._run = threading.Lock()
        self._broken: BaseException | None = None
        self._stopping = False
        self._buffers = 0
        self.rounds = 0
        self.epoch = 0  # bumped (on every rank alike) when ranks were found diverged
        self._join: Request | None = None  # this rank's join() in progress
        self._join_seen: dict[int, int] = {}  # rank -> round it was first seen joined
        self._small_heads: dict[int, tuple[bytes, int]] = {}
        # threads blocked in wait() -> since when: only a rank blocked on a collective is
        # stuck; one holding a pending request while it computes is not
        self._blocked: dict[int, float] = {}
        self.small_bytes = self.small_limit()
        self.small_rounds = 0
        self._thread = threading.Thread(target=self._loop, name="shoal-engine", daemon=True)
        self._thread.start()

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
        token = threading.get_ident()
        outer = token in self._blocked  # a done-callback waiting inside a wait
        if not outer:
            self._blocked[token] = time.perf_counter()
        try:
            return self._wait(future, timeout, timeout is None if drive is None else drive)
        finally:
            if not outer:
                self._blocked.pop(token, None)

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
                exc = self._explain(exc, self.comm.abort)
            self.comm.abort()  # peers waiting on us learn at once
            self._broken = exc
            if not self._stopping:
                log.error("rank %d: collective failed: %s", self.rank, exc)
        else:
            self.comm.abort()
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
        self.comm.abort()
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
        bits = np.zeros(len(self._by_id), bool)
        new = []
        oldest = math.inf  # when the longest-waiting request was submitted
        for req in reqs:
            oldest = min(oldest, req.enqueued)
            cached = self._cache.get(req.name)
            if cached is not None and cached[1] == req.desc and req.kind not in _PER_CALL:
                bits[cached[0]] = True
            else:
                new.append([req.name, req.desc, req.extra])
        since = min(self._blocked.values(), default=math.inf)
        limit = time.perf_counter() - self.cfg.stall_warning_s
        flags = STUCK if oldest < limit and since < limit else 0
        if self._join is not None:
            flags |= JOINED
        return encode(bits, new, flags)

    def _proposal_of(self, cache_id: int, token: int) -> tuple[bytes, int]:
        """The proposal of exactly the cached name ``cache_id`` with a payload riding along
        (the small path's; its ``token`` says which: (cache size << 32) | id), and the
        payload bytes that fit behind it; the same on every rank that proposes the same."""
        n_cached = token >> 32
        if len(self._small_heads) > 4096:
            self._small_heads.clear()
        bits = np.zeros(n_cached, bool)
        bits[cache_id] = True
        blob = encode(bits, [], FAST)
        room = self.comm.shm.chunk_bytes - self.comm.shm.payload_offset(len(blob))
        self._small_heads[token] = blob, room
        return blob, room

    def _adopt(self, name: str, src: np.ndarray, dst: np.ndarray, dtype: str, desc: str,
               op: ReduceOp, blobs: list[bytes]) -> Future:
        """The small path's round did not agree: settle it as a general round (the same on
        every rank), with the request now pending like any other."""
        req = Request(Kind.ALLREDUCE, name, src, dst, dtype, desc, op=op)
        with self._cv:
            if name in self._pending:
                raise ValueError(f"rank {self.rank}: a collective named {name!r} is already "
                                 f"in flight; wait for it or use another name")
            self._pending[name] = req
        now = time.perf_counter()  # (for a timeline, which the small path never runs with)
        self._settle(blobs, [req], now, now)
        return req.future

    def _round(self) -> bool:
        """One negotiation round and the collectives it agrees on; True if any ran."""
        with self._cv:
            reqs = list(self._pending.values())
        t0 = time.perf_counter()
        blobs = self.comm.gather_all(self._proposal(reqs), "negotiation round")
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
        self._execute(runnable, extras, t0, t1)
        self._evict()
        self._inflight = []
        joined = self._join_complete()
        return bool(runnable) or joined

    def _decide(self, blobs: list[bytes], reqs: Sequence[Request]
                ) -> tuple[list[str], dict, dict[str, CollectiveMismatchError]]:
        """The negotiator's decision on every rank's proposals (:func:`.negotiator.decide`,
        the same on all ranks), applied to this engine: the name cache, the use rounds, join
        and the numbering epoch; the names to run in order, their extras and the refused."""
        d = decide(blobs, self._by_id, self._cache, rank=self.rank,
                   pending=[r.name for r in reqs], stall_warning_s=self.cfg.stall_warning_s)
        for r in d.joined:
            self._join_seen.setdefault(r, self.rounds)
        for name, desc in d.adopted.items():
            self._cache[name] = (self._cache[name][0], desc)
        for name, desc in d.fresh:
            self._cache[name] = (len(self._by_id), desc)
            self._by_id.append(name)
        if d.fresh:
            self._last = np.concatenate([self._last, np.zeros(len(d.fresh), np.int64)])
        if d.refused:
            # ranks that diverged (or made calls another rank did not, as around join()) have
            # their unnamed collectives numbered out of step: every rank starts a new
            # numbering, all in this same round
            self.epoch += 1
        self._last[d.ran_ids] = self.rounds  # vectorised: no per-tensor Python in steady state
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
        desc = self._cache[name][1]
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

    # -- the bounded name cache ------------------------------------------------------------
    def _evict(self) -> None:
        """Forget the least recently used names once the cache is over its size, down to
        three quarters of it. Every rank holds the same cache and the same use rounds, and
        evicts here after the same round, so the caches stay identical; a forgotten name is
        simply negotiated in full again."""
        limit = max(16, self.cfg.name_cache_size)
        if len(self._by_id) <= limit:
            return
        ids = np.arange(len(self._by_id))
        # most recently used last, ties by id: the same order on every rank
        keep = np.sort(np.lexsort((ids, self._last))[-(limit * 3 // 4):])
        self._by_id = [self._by_id[i] for i in keep]
        self._cache = {nm: (i, self._cache[nm][1]) for i, nm in enumerate(self._by_id)}
        self._last = self._last[keep]

    # -- execution -------------------------------------------------------------------------
    def _execute(self, reqs: Sequence[Request], extras: dict, t0: float, t1: float) -> None:
        threshold = self.cfg.fusion_threshold
        buckets: dict[tuple, list[Request]] = {}  # open fusion buffer per (dtype, op, codec)
        filled: dict[tuple, int] = {}
        for req in reqs:
            if req.kind is not Kind.ALLREDUCE:
                self._run_single(req, extras.get(req.name, {}), t0, t1)
                continue
            key = (req.dtype, req.op, req.codec.name)
            if key in buckets and filled[key] + req.array.nbytes > threshold:
                self._run_fused(buckets.pop(key), t0, t1)
            if key not in buckets:
                buckets[key], filled[key] = [], 0
            buckets[key].append(req)
            filled[key] += req.array.nbytes
        for bucket in buckets.values():
            self._run_fused(bucket, t0, t1)

    def _run_fused(self, bucket: list[Request], t0: float, t1: float) -> None:
        first = bucket[0]
        self._buffers += 1
        what = f"allreduce of {first.name!r}" + (f" and {len(bucket) - 1} more fused"
                                                 if len(bucket) > 1 else "")
        phases: dict[str, float] | None = {} if self.timeline else None
        for req in bucket:
            req.make_ready()
        start = time.perf_counter()
        self.comm.allreduce([r.array for r in bucket], [r.out for r in bucket], first.op,
                            first.dtype, first.codec, what, phases)
        end = time.perf_counter()
        for req in bucket:
            req.future.set_result(req.out if req.result is None else req.result)
        if self.timeline is not None:
            nbytes = sum(r.array.nbytes for r in bucket)
            for req in bucket:
                self._trace(req, t0, t1, start, end, phases, fusion_buffer=self._buffers,
                            tensors=len(bucket), bytes=nbytes)
            self.timeline.span("fusion buffers", "ALLREDUCE", start, end,
                               buffer=self._buffers, tensors=[r.name for r in bucket],
                               bytes=nbytes)

    def _run_single(self, req: Request, extra: dict[int, Any], t0: float, t1: float) -> None:
        what = f"{req.kind.value} of {req.name!r}"
        req.make_ready()
        start = time.perf_counter()
        comm = self.comm
        if req.kind is Kind.BROADCAST:
            if req.out is not req.array:
                np.copyto(req.out, req.array)
            comm.broadcast(req.out, req.root, what)
            result: Any = req.out if req.result is None else req.result
        elif req.kind is Kind.REDUCESCATTER:
            comm.reducescatter(req.array, req.out, req.extra, req.op, req.dtype, what)
            result = req.out if req.result is None else req.result
        elif req.kind is Kind.ALLGATHER:
            rows = [int(extra[r]) for r in range(self.size)]
            misfit = req.out is not None and req.out.shape[0] != sum(rows)
            out = req.out if req.out is not None and not misfit else \
                np.empty((sum(rows), *req.trailing), req.array.dtype)
            comm.allgather(req.array.reshape(rows[self.rank], *req.trailing), rows, out, what)
            result = out
            if misfit:  # found once every rank's rows were known: the data moved anyway (the
                # others need this rank's rows), but only into a buffer of its own
                req.future.set_exception(ValueError(
                    f"rank {self.rank}: allgather output for {req.name!r} has "
                    f"{req.out.shape[0]} rows; the ranks sent {sum(rows)} ({rows})"))
                return
        else:  # ALLTOALL
            recv = [int(extra[r][self.rank]) for r in range(self.size)]
            out = np.empty((sum(recv), *req.trailing), req.array.dtype)
            comm.alltoall(req.array.reshape(sum(req.extra), *req.trailing), req.extra, recv, out,
                          what, [extra[r] for r in range(self.size)])
            result = (out, np.asarray(recv, np.int64))
        req.future.set_result(result)
        if self.timeline is not None:
            self._trace(req, t0, t1, start, time.perf_counter(), {})

    def _trace(self, req: Request, t0: float, t1: float, start: float, end: float,
               phases: dict[str, float] | None, **args: Any) -> None:
        tl = self.timeline
        tl.span(req.name, "QUEUE", req.enqueued, max(req.enqueued, t0))
        tl.span(req.name, "NEGOTIATE", t0, t1, round=self.rounds)
        tl.collective(req.name, start, end, phases or {}, kind=req.kind.value, **args)

    # -- stalls ----------------------------------------------------------------------------
    def _check_stalls(self) -> None:
        warn, fail = self.cfg.stall_warning_s, self.cfg.stall_shutdown_s
        now = time.perf_counter()
        with self._cv:
            reqs = list(self._pending.values())
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
                self._fail(ShoalTimeoutError(
                    f"rank {self.rank}: {req.kind.value} {req.name!r} stalled for {age:.1f}s "
                    f"(SHOAL_STALL_SHUTDOWN_S={fail:g}); missing on ranks {list(req.missing)}"))
                return
