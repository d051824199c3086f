"""Chrome-trace timeline (``SHOAL_TIMELINE=path.json``), viewable in Perfetto or
chrome://tracing.

Horovod's layout and names: one track per tensor, named ``<kind>.<name>``
(``allreduce.grad0``), shows its phases: ``QUEUE`` (submitted, waiting for a negotiation
round), ``NEGOTIATE_<KIND>`` (the round that found it ready on every rank), then the
collective itself (``ALLREDUCE``, ``BROADCAST``, ``ALLGATHER``, ``ALLTOALL``,
``REDUCESCATTER``) with ``MEMCPY_IN``, ``REDUCE`` and ``MEMCPY_OUT`` and, in its arguments,
the fusion buffer it went into. With ``mark_cycles`` (``SHOAL_TIMELINE_MARK_CYCLES``, or
Horovod's ``HOROVOD_TIMELINE_MARK_CYCLES``) every round that runs collectives is marked by a
``CYCLE_START`` instant. The shared-memory path interleaves those phases chunk by chunk;
the timeline shows each phase's total time, back to back, inside the collective's span. A
``fusion buffers`` track shows every fused collective once.

Events are written and flushed as they happen (the JSON array format, which both viewers
accept even if the process dies before closing it); ``close()`` completes the JSON.

A timeline runs from ``init`` with ``SHOAL_TIMELINE`` (or Horovod's ``HOROVOD_TIMELINE``;
``shoalrun --timeline-filename``), or
between :func:`start_timeline` and :func:`stop_timeline` at run time, as Horovod's. Started at
run time, the one-round path of small allreduces stays on (every rank must agree on it, and a
timeline may be started on some ranks only) and shows each such allreduce as one
``ONE_ROUND_ALLREDUCE`` span.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import IO, Any

__all__ = ["Timeline", "start_timeline", "stop_timeline"]


class Timeline:
    """Append-only Chrome trace writer, safe to call from several threads."""

    def __init__(self, path: str, rank: int, mark_cycles: bool = False) -> None:
        self.path = path.replace("{rank}", str(rank))
        self.rank = rank
        self.mark_cycles = mark_cycles
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._file: IO[str] | None = open(self.path, "w")  # noqa: SIM115 (lives until close)
        self._file.write("[\n")
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}
        self._t0 = time.perf_counter()
        self._first = True
        self._emit({"name": "process_name", "ph": "M", "pid": rank,
                    "args": {"name": f"rank {rank}"}})

    def _us(self, t: float) -> float:
        return round((t - self._t0) * 1e6, 3)

    def _emit(self, event: dict[str, Any]) -> None:
        if self._file is None:
            return
        text = json.dumps(event)
        self._file.write(text if self._first else ",\n" + text)
        self._file.flush()  # readable as it runs (Horovod's tests read it while it does)
        self._first = False

    def _tid(self, track: str) -> int:
        tid = self._tids.get(track)
        if tid is None:
            tid = self._tids[track] = len(self._tids) + 1
            self._emit({"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                        "args": {"name": track}})
        return tid

    def span(self, track: str, name: str, start: float, end: float, **args: Any) -> None:
        """A complete event on ``track`` from ``start`` to ``end`` (perf_counter seconds)."""
        with self._lock:
            self._emit({"name": name, "ph": "X", "pid": self.rank, "tid": self._tid(track),
                        "ts": self._us(start), "dur": max(0.0, self._us(end) - self._us(start)),
                        "args": args})

    @staticmethod
    def track(kind: str, name: str) -> str:
        """The track of collective ``name`` of ``kind`` (``allreduce``): ``kind.name``, as
        Horovod names them (names shoal made up already start with their kind)."""
        return name if name.startswith(kind + ".") else f"{kind}.{name}"

    def cycle(self, t: float) -> None:
        """Mark the start of a round that runs collectives (with ``mark_cycles``)."""
        if self.mark_cycles:
            with self._lock:
                self._emit({"name": "CYCLE_START", "ph": "i", "s": "p", "pid": self.rank,
                            "tid": 0, "ts": self._us(t)})

    def collective(self, track: str, kind: str, start: float, end: float,
                   phases: dict[str, float], **args: Any) -> None:
        """The collective's span (named by its ``kind``) plus its phases' totals laid back to
        back inside it."""
        self.span(track, kind.upper(), start, end, **args)
        t = start
        for phase in ("memcpy_in", "reduce", "memcpy_out"):
            if phase in phases:
                self.span(track, phase.upper(), t, t + phases[phase])
                t += phases[phase]

    def close(self) -> None:
        """Finish the JSON array and close the file."""
        with self._lock:
            if self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
                self._file = None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write the timeline to ``file_path`` from now on (Horovod's ``start_timeline``): on
    rank 0, or on every rank when the path holds ``{rank}``. A timeline already running is
    completed and closed first. ``mark_cycles`` marks every round that runs collectives
    with a ``CYCLE_START`` instant.

    Raises:
        ShoalError: shoal is not initialised.
    """
    from . import api

    engine = api.communicator().engine
    rank = engine.rank
    engine.set_timeline(Timeline(file_path, rank, mark_cycles)
                        if rank == 0 or "{rank}" in file_path else None)


def stop_timeline() -> None:
    """Complete and close the timeline (Horovod's ``stop_timeline``); nothing if none runs.

    Raises:
        ShoalError: shoal is not initialised.
    """
    from . import api

    api.communicator().engine.set_timeline(None)
