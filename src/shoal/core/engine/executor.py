"""The executor: runs a decided round's collectives, fusing allreduces into buffers.

Given the names every rank agreed to run, in the agreed order, it packs consecutive
allreduces of one (dtype, op, compression) into fusion buffers of at most
``SHOAL_FUSION_THRESHOLD`` bytes (Horovod's tensor fusion), runs each buffer and every other
collective through the transport, completes the requests' futures and, with a timeline,
records each request's phases. Every rank runs the same decision, so every rank forms the
same buffers in the same order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import algorithms
from ..config import Config
from ..timeline import Timeline
from ..transport import Transport
from .requests import Kind, Request

__all__ = ["Executor"]


class Executor:
    """Fusion and execution of decided collectives for one engine."""

    def __init__(self, transport: Transport, cfg: Config,
                 timeline: Timeline | None = None) -> None:
        self.transport = transport
        self.cfg = cfg
        self.rank = transport.rank
        self.size = transport.size
        self.timeline = timeline
        self.buffers = 0  # fusion buffers run so far
        self.round = 0  # the negotiation round being run (for the timeline)

    def run(self, reqs: Sequence[Request], extras: dict, t0: float, t1: float,
            round_: int = 0) -> None:
        """Run ``reqs`` in order; ``extras`` holds each per-call request's every-rank extras;
        ``t0``/``t1`` bound the negotiation round ``round_`` that decided them."""
        self.round = round_
        tl = self.timeline
        if tl is not None:
            tl.cycle(t0)
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
        self.buffers += 1
        what = f"allreduce of {first.name!r}" + (f" and {len(bucket) - 1} more fused"
                                                 if len(bucket) > 1 else "")
        tl = self.timeline  # read once: start_timeline/stop_timeline may swap it meanwhile
        phases: dict[str, float] | None = {} if tl else None
        for req in bucket:
            req.make_ready()
        start = time.perf_counter()
        wire = algorithms.allreduce(self.transport, [r.array for r in bucket],
                                    [r.out for r in bucket], first.op, first.dtype,
                                    first.codec, what, phases)
        end = time.perf_counter()
        for req in bucket:
            req.future.set_result(req.out if req.result is None else req.result)
        if tl is not None:
            nbytes = sum(r.array.nbytes for r in bucket)
            facts = {"wire": wire} if wire is not None else {}  # the dtype on TCP
            for req in bucket:
                self._trace(tl, req, t0, t1, start, end, phases, fusion_buffer=self.buffers,
                            tensors=len(bucket), bytes=nbytes, **facts)
            tl.span("fusion buffers", "ALLREDUCE", start, end,
                               buffer=self.buffers, tensors=[r.name for r in bucket],
                               bytes=nbytes)

    def _run_single(self, req: Request, extra: dict[int, Any], t0: float, t1: float) -> None:
        what = f"{req.kind.value} of {req.name!r}"
        req.make_ready()
        start = time.perf_counter()
        transport = self.transport
        if req.kind is Kind.BROADCAST:
            if req.out is not req.array:
                np.copyto(req.out, req.array)
            transport.broadcast(req.out, req.root, what)
            result: Any = req.out if req.result is None else req.result
        elif req.kind is Kind.REDUCESCATTER:
            algorithms.reducescatter(transport, req.array, req.out, req.extra, req.op,
                                     req.dtype, what)
            result = req.out if req.result is None else req.result
        elif req.kind is Kind.ALLGATHER:
            rows = [int(extra[r]) for r in range(self.size)]
            misfit = req.out is not None and req.out.shape[0] != sum(rows)
            out = req.out if req.out is not None and not misfit else \
                np.empty((sum(rows), *req.trailing), req.array.dtype)
            transport.allgather(req.array.reshape(rows[self.rank], *req.trailing), rows, out,
                                what)
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
            transport.alltoall(req.array.reshape(sum(req.extra), *req.trailing), req.extra,
                               recv, out, what, [extra[r] for r in range(self.size)])
            result = (out, np.asarray(recv, np.int64))
        req.future.set_result(result)
        tl = self.timeline
        if tl is not None:
            self._trace(tl, req, t0, t1, start, time.perf_counter(), {})

    def _trace(self, tl: Timeline, req: Request, t0: float, t1: float, start: float,
               end: float, phases: dict[str, float] | None, **args: Any) -> None:
        kind = req.kind.value
        track = tl.track(kind, req.name)
        tl.span(track, "QUEUE", req.enqueued, max(req.enqueued, t0))
        tl.span(track, f"NEGOTIATE_{kind.upper()}", t0, t1, round=self.round)
        tl.collective(track, kind, start, end, phases or {}, **args)
