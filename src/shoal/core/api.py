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
import dataclasses
import functools
import logging
import os
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
from .runtime import RUNTIME
from .store import PrefixStore, Store

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
    "is_homogeneous",
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


def init(comm: Sequence[int] | Any = None,
         process_sets: Sequence[process_sets_.ProcessSet | Sequence[int]] | str | None = (), *,
         rank: int | None = None, size: int | None = None, local_rank: int | None = None,
         local_size: int | None = None, rendezvous_addr: str | None = None,
         rendezvous_port: int | None = None, hostname: str | None = None,
         secret: str | None = None, job_id: str | None = None,
         serve_store: bool | None = None,
         store_prefix: str | None = None, **settings: Any) -> None:
    """Join the job: build the default communicator. Safe to call twice (the second call does
    nothing); after ``shutdown()`` it builds a fresh one.

    With no arguments the launcher's environment says who this process is (shoalrun,
    torchrun, mpirun, srun, SageMaker; a lone process is rank 0 of 1). Explicit arguments win
    over the environment; other keyword arguments override ``SHOAL_*`` settings by knob name
    (``timeout_s=5``, ``allreduce_algorithm="ring"``). ``serve_store`` says whether rank 0
    serves the rendezvous store (default: unless shoalrun, which serves it, started the job;
    a store outside the workers survives any of them, which lets survivors name the dead).
    ``process_sets`` are registered at once (Horovod's static process sets; ``"dynamic"``,
    Horovod's switch for :func:`~shoal.core.process_sets.add_process_set` later, is shoal's
    normal state).
    ``store_prefix`` names this communicator's keys in the store (default: per process and
    generation); an elastic world sets it, the same on every member.

    ``comm`` (Horovod's first argument) makes the job of some of the launched processes only:
    a list of the launcher's ranks (position i becomes rank i), or an mpi4py communicator
    (``MPI.COMM_WORLD.Split(...)``: each part trains on its own). Processes of several such
    jobs meet at one store, so the process that serves it (the launcher's rank 0, unless
    shoalrun serves it) must call ``init`` too.

    In a worker of shoalrun's elastic mode (``SHOAL_ELASTIC_ID`` set) and without an explicit
    ``rank``, it joins the driver's current world (:func:`shoal.core.elastic.join_world`).
    """
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise ValueError(f"init(process_sets={process_sets!r}): pass a list of process sets "
                             f"or 'dynamic'")
        process_sets = ()
    process_sets = list(process_sets or ())
    if rank is None and os.environ.get("SHOAL_ELASTIC_ID") and RUNTIME.comm is None:
        from . import elastic

        elastic.join_world()
        return
    with RUNTIME.lock:
        if RUNTIME.comm is not None:
            return
        cfg = config.load(**settings)
        _configure_logging(cfg)
        info = topology.detect(cfg=cfg, rank=rank, size=size, local_rank=local_rank,
                               local_size=local_size, rendezvous_addr=rendezvous_addr,
                               rendezvous_port=rendezvous_port, hostname=hostname,
                               secret=secret, job_id=job_id)
        if serve_store is None:
            serve_store = info.launcher != "shoalrun"
        serving = info.rank == 0 and serve_store
        members = _members(comm, info)
        if members is not None:
            info = dataclasses.replace(info, rank=members.index(info.rank), size=len(members))
            store_prefix = store_prefix or f"shoal/comm/{'.'.join(map(str, members))}"
        process_sets_.check_static(process_sets, info.size, info.rank)
        # a part of one (``comm``) whose process serves the store goes on serving it
        if info.size == 1 and not (serving and members is not None):
            RUNTIME.comm = Communicator.create(None, 0, 1, cfg=cfg, hostname=info.hostname)
            process_sets_.bind(RUNTIME.comm, process_sets)
            return
        RUNTIME.generation += 1
        deadline = time.monotonic() + cfg.start_timeout_s
        closed_handshakes = 0
        while True:
            try:
                comm = _join(info, cfg, serving,
                             store_prefix or f"shoal/g{RUNTIME.generation}")
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
            if members is None:
                topology.check_consistent(info, comm.world)
        except BaseException:
            comm.close()
            raise
        RUNTIME.comm = comm
        process_sets_.bind(comm, process_sets)


_TIMED = "shoal-timestamps"  # the name of the handler log_timestamps adds


def _configure_logging(cfg: config.Config) -> None:
    """The shoal loggers' level, and with ``log_timestamps`` a stderr handler of their own
    whose lines carry the time (Horovod's ``--log-with-timestamp``)."""
    logger = logging.getLogger("shoal")
    logger.setLevel(cfg.log_level.upper())
    handler = next((h for h in logger.handlers if h.get_name() == _TIMED), None)
    if cfg.log_timestamps and handler is None:
        handler = logging.StreamHandler()
        handler.set_name(_TIMED)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: "
                                               "%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    elif not cfg.log_timestamps and handler is not None:
        logger.removeHandler(handler)
        logger.propagate = True


def _members(comm: Sequence[int] | Any, info: topology.LaunchInfo) -> list[int] | None:
    """The launcher's ranks that make this job, from Horovod's ``comm`` argument (None: all
    of them). A ValueError, before anything is built, for a rank list without this process
    or with ranks the launcher did not start."""
    if comm is None:
        return None
    if hasattr(comm, "Get_group") and hasattr(comm, "Get_size"):  # an mpi4py communicator
        from mpi4py import MPI
        ranks = MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())),
                                          MPI.COMM_WORLD.Get_group())
        if MPI.COMM_WORLD.Get_size() != info.size:
            raise ValueError(f"rank {info.rank}: init(comm=...) got an MPI communicator, but "
                             f"the job was not started as MPI's world (size "
                             f"{MPI.COMM_WORLD.Get_size()} here, {info.size} launched); start "
                             f"it with mpirun, or pass a list of ranks")
    elif isinstance(comm, str) or not hasattr(comm, "__iter__"):
        raise ValueError(f"init(comm=...) takes a list of ranks or an mpi4py communicator, "
                         f"not {type(comm).__name__}")
    else:
        ranks = list(comm)
    if not ranks:
        return None  # Horovod's "all of MPI_COMM_WORLD"
    if any(not isinstance(r, int) for r in ranks) or len(set(ranks)) != len(ranks) or \
            not all(0 <= r < info.size for r in ranks):
        raise ValueError(f"rank {info.rank}: init(comm={ranks}) must list distinct ranks of "
                         f"the {info.size} launched processes")
    if info.rank not in ranks:
        raise ValueError(f"rank {info.rank}: init(comm={ranks}) does not include this "
                         f"process; pass each process a list that contains its own rank")
    return [int(r) for r in ranks]


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
        met: Store = PrefixStore(store, prefix)
        if RUNTIME.store_guard is not None:
            met = RUNTIME.store_guard(met)
        return Communicator.create(met, info.rank, info.size, cfg=cfg,
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
    with RUNTIME.lock:
        comm, RUNTIME.comm = RUNTIME.comm, None
        process_sets_.unbind()
        if comm is not None:
            comm.close()


atexit.register(shutdown)


def default_communicator() -> Communicator | None:
    """The default communicator, or None before ``init()`` (no error)."""
    return RUNTIME.comm


def is_initialized() -> bool:
    """Whether ``init()`` has run (and ``shutdown()`` has not)."""
    return RUNTIME.comm is not None


def communicator() -> Communicator:
    """The default communicator; :class:`NotInitializedError` before ``init()``."""
    comm = RUNTIME.comm
    if comm is None:
        raise NotInitializedError("shoal is not initialized: call shoal.init() first")
    return comm


@contextlib.contextmanager
def timeline_range(name: str, track: str = "training") -> Iterator[None]:
    """Mark a stretch of the caller's work (``"BACKWARD"``, ``"STEP"``) on the timeline, on
    its own ``track``, so the reductions can be seen against it. Does nothing when shoal is not
    initialised or no timeline is being written (``SHOAL_TIMELINE``)."""
    comm = RUNTIME.comm
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


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    return communicator().world.homogeneous


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
