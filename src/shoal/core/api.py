"""The module-level API: the default communicator behind ``shoal.init()``.

``init()`` reads the launcher's environment (:mod:`shoal.core.topology`), meets the other ranks
at the authenticated rendezvous store (served by shoalrun, or by rank 0 under other launchers)
and builds a :class:`~shoal.core.communicator.Communicator` from it. ``shoal.allreduce(...)``
and the framework adapters use that default communicator unless told otherwise;
``shutdown()`` closes it and ``init()`` makes a fresh one, as often as needed.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from . import config, topology
from . import process_sets as process_sets_
from .auth import secret_bytes
from .collectives import Handle
from .communicator import Communicator, local_address
from .errors import AuthenticationError, NotInitializedError
from .rendezvous import StoreClient, StoreClosedError, StoreServer
from .store import PrefixStore

__all__ = [
    "Handle",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_async",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_async",
    "broadcast_object",
    "communicator",
    "cross_rank",
    "cross_size",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "shutdown",
    "size",
    "timeline_range",
    "world",
]

log = logging.getLogger("shoal")
_lock = threading.RLock()
_state: dict[str, Any] = {"comm": None, "generation": 0}


def init(*, rank: int | None = None, size: int | None = None, local_rank: int | None = None,
         local_size: int | None = None, rendezvous_addr: str | None = None,
         rendezvous_port: int | None = None, hostname: str | None = None,
         secret: str | None = None, job_id: str | None = None,
         serve_store: bool | None = None,
         process_sets: Sequence[process_sets_.ProcessSet | Sequence[int]] = (),
         store_prefix: str | None = None, **settings: Any) -> None:
    """Join the job: build the default communicator. Safe to call twice (the second call does
    nothing); after ``shutdown()`` it builds a fresh one.

    With no arguments the launcher's environment says who this process is (shoalrun,
    torchrun, mpirun, srun, SageMaker; a lone process is rank 0 of 1). Explicit arguments win
    over the environment; other keyword arguments override ``SHOAL_*`` settings by knob name
    (``timeout_s=5``, ``allreduce_algorithm="ring"``). ``serve_store`` says whether rank 0
    serves the rendezvous store (default: unless shoalrun, which serves it, started the job;
    a store outside the workers survives any of them, which lets survivors name the dead).
    ``process_sets`` are registered at once (Horovod's static process sets).
    ``store_prefix`` names this communicator's keys in the store (default: per process and
    generation); an elastic world sets it, the same on every member.

    In a worker of shoalrun's elastic mode (``SHOAL_ELASTIC_ID`` set) and without an explicit
    ``rank``, it joins the driver's current world (:func:`shoal.core.elastic.join_world`).
    """
    if rank is None and os.environ.get("SHOAL_ELASTIC_ID") and _state["comm"] is None:
        from . import elastic

        elastic.join_world()
        return
    with _lock:
        if _state["comm"] is not None:
            return
        cfg = config.load(**settings)
        logging.getLogger("shoal").setLevel(cfg.log_level.upper())
        info = topology.detect(cfg=cfg, rank=rank, size=size, local_rank=local_rank,
                               local_size=local_size, rendezvous_addr=rendezvous_addr,
                               rendezvous_port=rendezvous_port, hostname=hostname,
                               secret=secret, job_id=job_id)
        if info.size == 1:
            _state["comm"] = Communicator.create(None, 0, 1, cfg=cfg, hostname=info.hostname)
            process_sets_.bind(_state["comm"], process_sets)
            return
        _state["generation"] += 1
        if serve_store is None:
            serve_store = info.launcher != "shoalrun"
        serving = info.rank == 0 and serve_store
        deadline = time.monotonic() + cfg.start_timeout_s
        closed_handshakes = 0
        while True:
            try:
                comm = _join(info, cfg, serving,
                             store_prefix or f"shoal/g{_state['generation']}")
                break
            except (StoreClosedError, AuthenticationError) as exc:
                # the store of an earlier generation was still up and went away under us
                # (rank 0 re-initialising): meet again at the new one. A handshake cut short
                # is that too, or a wrong secret: two more tries tell them apart.
                again = isinstance(exc, StoreClosedError) or (
                    getattr(exc, "closed", False) and closed_handshakes < 2)
                if serving or not again or time.monotonic() > deadline:
                    raise
                closed_handshakes += isinstance(exc, AuthenticationError)
                time.sleep(0.1)
        try:
            topology.check_consistent(info, comm.world)
        except BaseException:
            comm.close()
            raise
        _state["comm"] = comm
        process_sets_.bind(comm, process_sets)


def _join(info: topology.LaunchInfo, cfg: config.Config, serving: bool,
          prefix: str) -> Communicator:
    """Meet at the store (served here when ``serving``) and build the communicator; the
    communicator closes the client (then the server) when it closes."""
    key = secret_bytes(info.secret)
    closers: list[Callable[[], None]] = []  # run in order: client first, then server
    if serving:
        bind = cfg.bind_addr or info.rendezvous_addr
        closers.append(StoreServer(key, host=bind, port=info.rendezvous_port).start().close)
    try:
        store = StoreClient(info.rendezvous_addr, info.rendezvous_port, key,
                            timeout=cfg.start_timeout_s, connect_timeout=cfg.start_timeout_s,
                            rank=info.rank)
        closers.insert(0, store.close)
        bind = cfg.bind_addr or local_address(info.rendezvous_addr, info.rendezvous_port)
        # a derived secret (none was given) only keeps jobs apart at the store: the data
        # ports get one agreed through it instead, never written there readable
        return Communicator.create(PrefixStore(store, prefix), info.rank, info.size, cfg=cfg,
                                   hostname=info.hostname,
                                   secret=None if info.secret_is_derived else info.secret,
                                   job_id=info.job_id, bind_addr=bind, closers=closers)
    except BaseException:
        for release in closers:
            release()
        raise


def shutdown() -> None:
    """Close the default communicator: its threads, sockets and shared memory. ``init()``
    may be called again."""
    with _lock:
        comm, _state["comm"] = _state["comm"], None
        process_sets_.unbind()
        if comm is not None:
            comm.close()


atexit.register(shutdown)


def default_communicator() -> Communicator | None:
    """The default communicator, or None before ``init()`` (no error)."""
    return _state["comm"]


def is_initialized() -> bool:
    """Whether ``init()`` has run (and ``shutdown()`` has not)."""
    return _state["comm"] is not None


def communicator() -> Communicator:
    """The default communicator; :class:`NotInitializedError` before ``init()``."""
    comm = _state["comm"]
    if comm is None:
        raise NotInitializedError("shoal is not initialized: call shoal.init() first")
    return comm


@contextlib.contextmanager
def timeline_range(name: str, track: str = "training") -> Iterator[None]:
    """Mark a stretch of the caller's work (``"BACKWARD"``, ``"STEP"``) on the timeline, on
    its own ``track``, so the reductions can be seen against it. Does nothing when shoal is not
    initialised or no timeline is being written (``SHOAL_TIMELINE``)."""
    comm = _state["comm"]
    timeline = comm.timeline if comm is not None else None
    if timeline is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        timeline.span(track, name, start, time.perf_counter())


def world() -> topology.World:
    """This job's layout: ranks, hosts, local and cross ranks."""
    return communicator().world


def rank() -> int:
    """This process's global rank."""
    return communicator().world.rank


def size() -> int:
    """Number of processes in the job."""
    return communicator().world.size


def local_rank() -> int:
    """Rank among the processes on this host."""
    return communicator().world.local_rank


def local_size() -> int:
    """Number of processes on this host."""
    return communicator().world.local_size


def cross_rank() -> int:
    """Index of this host among the job's hosts."""
    return communicator().world.cross_rank


def cross_size() -> int:
    """Number of hosts in the job."""
    return communicator().world.cross_size


_F = TypeVar("_F", bound=Callable[..., Any])


def _on_default(method: _F) -> _F:
    """The module-level form of a :class:`Communicator` method: it runs on the default
    communicator (same signature and docstring)."""
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        return method(communicator(), *args, **kwargs)
    return call  # type: ignore[return-value]


allreduce_async = _on_default(Communicator.allreduce_async)
allreduce = _on_default(Communicator.allreduce)
allgather = _on_default(Communicator.allgather)
allgather_async = _on_default(Communicator.allgather_async)
alltoall = _on_default(Communicator.alltoall)
alltoall_async = _on_default(Communicator.alltoall_async)
broadcast_async = _on_default(Communicator.broadcast_async)
broadcast = _on_default(Communicator.broadcast)
reducescatter = _on_default(Communicator.reducescatter)
reducescatter_async = _on_default(Communicator.reducescatter_async)
barrier = _on_default(Communicator.barrier)
join = _on_default(Communicator.join)
broadcast_object = _on_default(Communicator.broadcast_object)
allgather_object = _on_default(Communicator.allgather_object)
