"""The process-wide state behind ``shoal.init()`` and the Horovod-shaped functions.

``init()`` reads the launcher's environment (:mod:`shoal.core.topology`), meets the other ranks
at the authenticated rendezvous store (served by shoalrun, or by rank 0 under other launchers),
learns which ranks share a host, opens the TCP mesh and the shared-memory segments, and builds
the :class:`~shoal.core.comm.Communicator` that every collective below uses.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import numpy as np

from . import config, topology
from .auth import secret_bytes
from .comm import Communicator
from .compression import Codec, Compression
from .engine import Engine, Kind, Request
from .errors import NotInitializedError, PeerLostError
from .ops import ReduceOp, check_array
from .rendezvous import StoreClient, StoreServer
from .transport.shm import ShmGroup
from .transport.tcp import TcpMesh

__all__ = [
    "Handle",
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_async",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "communicator",
    "cross_rank",
    "cross_size",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "shutdown",
    "size",
    "timeline_range",
    "world",
]

log = logging.getLogger("shoal")
_lock = threading.RLock()
_state: dict[str, Any] = {"comm": None, "engine": None, "store": None, "server": None,
                          "generation": 0, "counter": 0}


def _local_address(remote: str, port: int) -> str:
    """The address of the interface that routes to ``remote`` (no packet is sent)."""
    if remote in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((remote, port or 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def init(*, rank: int | None = None, size: int | None = None, local_rank: int | None = None,
         local_size: int | None = None, rendezvous_addr: str | None = None,
         rendezvous_port: int | None = None, hostname: str | None = None,
         secret: str | None = None, job_id: str | None = None,
         serve_store: bool | None = None, **settings: Any) -> None:
    """Join the job. Safe to call twice (the second call does nothing).

    With no arguments the launcher's environment says who this process is (shoalrun,
    torchrun, mpirun, srun, SageMaker; a lone process is rank 0 of 1). Explicit arguments win
    over the environment; other keyword arguments override ``SHOAL_*`` settings by knob name
    (``timeout_s=5``, ``allreduce_algorithm="ring"``). ``serve_store`` says whether rank 0
    serves the rendezvous store (default: unless shoalrun, which serves it, started the job;
    a store outside the workers survives any of them, which lets survivors name the dead).
    """
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
            world = topology.World.single(info.hostname)
            comm = Communicator(cfg, world, None, None)
            _state.update(comm=comm, engine=Engine(comm, cfg), counter=0)
            return
        if info.secret_is_derived:
            log.warning("SHOAL_SECRET is not set: connections are checked against a secret "
                        "derived from the job id, which keeps jobs apart but not strangers "
                        "out; start with shoalrun or set SHOAL_SECRET on every rank")
        key = secret_bytes(info.secret)
        _state["generation"] += 1
        gen = f"shoal/g{_state['generation']}"
        server = None
        if serve_store is None:
            serve_store = info.launcher != "shoalrun"
        if info.rank == 0 and serve_store:
            bind = cfg.bind_addr or info.rendezvous_addr
            server = StoreServer(key, host=bind, port=info.rendezvous_port).start()
        try:
            store = StoreClient(info.rendezvous_addr, info.rendezvous_port, key,
                                timeout=cfg.start_timeout_s,
                                connect_timeout=cfg.start_timeout_s, rank=info.rank)
        except BaseException:
            if server is not None:
                server.close()
            raise
        _state.update(store=store, server=server)
        bind = cfg.bind_addr or _local_address(info.rendezvous_addr, info.rendezvous_port)
        mesh = TcpMesh(info.rank, info.size, key, timeout=cfg.timeout_s,
                       buffer_bytes=cfg.tcp_buffer_bytes, bind_addr=bind)
        hello = json.dumps({"host": info.hostname, "addr": mesh.address[0],
                            "port": mesh.address[1], "pid": os.getpid()}).encode()
        peers = [json.loads(b) for b in store.allgather(f"{gen}/hello", info.rank, info.size,
                                                         hello, timeout=cfg.start_timeout_s)]
        world = topology.World.from_hostnames(info.rank, [p["host"] for p in peers])
        topology.check_consistent(info, world)
        mesh.connect([(p["addr"], p["port"]) for p in peers], cfg.start_timeout_s)
        shm = None
        if cfg.shm_enable and world.local_size > 1:
            def barrier(tag: str) -> None:
                store.barrier(f"{gen}/node{world.cross_rank}/{tag}", world.local_size,
                              timeout=cfg.start_timeout_s)
            shm = ShmGroup(info.job_id, world.cross_rank, world.local_rank, world.local_ranks,
                           cfg.shm_chunk_bytes, cfg.timeout_s, barrier)
        comm = Communicator(cfg, world, mesh, shm)
        explain = functools.partial(explain_loss, store, f"{gen}/lost", info.rank, info.size)
        _state.update(comm=comm, engine=Engine(comm, cfg, explain), counter=0)
        store.barrier(f"{gen}/ready", info.size, timeout=cfg.start_timeout_s)


def explain_loss(store: StoreClient, prefix: str, rank: int, size: int,
                 exc: PeerLostError, abort: Callable[[], None],
                 grace: float = 1.0, settle: float = 0.2) -> PeerLostError:
    """Turn "my neighbour left" into "rank r died".

    A rank that gives up because *its* peer died closes its connections too, so the error a
    rank sees first often names a messenger. So every failing rank reports at the store whom
    it blames *before* it lets its own peers go (``abort``); the lost ranks are those blamed
    by someone that never report themselves. Without a reachable store, ``exc`` is kept.
    """
    import time
    found: list[list[int]] = []
    reported = threading.Event()

    def ask() -> None:  # in a thread: a stopped store host must not stop us too
        try:
            store.set(f"{prefix}/{rank}", str(exc.rank).encode())
            reported.set()
            start = time.monotonic()
            while True:
                blamed, silent = set(), []
                for r in range(size):
                    said = store.try_get(f"{prefix}/{r}")
                    if said is None:
                        silent.append(r)
                    elif said != b"None":
                        blamed.add(int(said))
                lost = [r for r in silent if r in blamed]
                waited = time.monotonic() - start
                if (lost and waited > settle) or waited > grace:
                    found.append(lost)
                    return
                time.sleep(0.05)
        except Exception:
            return

    asker = threading.Thread(target=ask, name="shoal-explain-loss", daemon=True)
    asker.start()
    reported.wait(0.5)
    abort()
    asker.join(grace + 2.0)
    if not found or not found[0] or found[0] == [exc.rank]:
        return exc
    lost = found[0]
    return PeerLostError(f"rank {rank}: lost rank{'s' if len(lost) > 1 else ''} "
                         f"{', '.join(map(str, lost))} (it stopped answering; seen here as: "
                         f"{exc})", rank=lost[0])


def shutdown() -> None:
    """Leave the job and release sockets and shared memory. ``init()`` may be called again."""
    with _lock:
        comm, store, server = _state["comm"], _state["store"], _state["server"]
        engine = _state["engine"]
        _state.update(comm=None, engine=None, store=None, server=None)
        if engine is not None:
            engine.close()
        if comm is not None:
            comm.close()
        if store is not None:
            store.close()
        if server is not None:
            server.close()


atexit.register(shutdown)


def is_initialized() -> bool:
    """Whether ``init()`` has run (and ``shutdown()`` has not)."""
    return _state["comm"] is not None


@contextlib.contextmanager
def timeline_range(name: str, track: str = "training") -> Iterator[None]:
    """Mark a stretch of the caller's work (``"BACKWARD"``, ``"STEP"``) on the timeline, on
    its own ``track``, so the reductions can be seen against it. Does nothing when shoal is not
    initialised or no timeline is being written (``SHOAL_TIMELINE``)."""
    engine = _state["engine"]
    timeline = engine.timeline if engine is not None else None
    if timeline is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        timeline.span(track, name, start, time.perf_counter())


def communicator() -> Communicator:
    """The current communicator; :class:`NotInitializedError` before ``init()``."""
    comm = _state["comm"]
    if comm is None:
        raise NotInitializedError("shoal is not initialized: call shoal.init() first")
    return comm


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


def _engine() -> Engine:
    engine = _state["engine"]
    if engine is None:
        raise NotInitializedError("shoal is not initialized: call shoal.init() first")
    return engine


class Handle:
    """The pending result of an asynchronous collective."""

    def __init__(self, engine: Engine, future: Future) -> None:
        self._engine = engine
        self._future = future

    def done(self) -> bool:
        """True once the result (or error) is ready."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the result or raise the collective's error."""
        return self._engine.wait(self._future, timeout)

    def exception(self) -> BaseException | None:
        """The collective's error once it is done (None if it succeeded)."""
        return self._future.exception() if self._future.done() else None

    def add_done_callback(self, fn: Callable[[Handle], None]) -> None:
        """Call ``fn(handle)`` when the collective completes. It may run on the engine's
        thread: keep it short, and never wait on another collective inside it."""
        self._future.add_done_callback(lambda _f: fn(self))


def _auto_name(kind: str, name: str | None) -> str:
    if name:
        return name
    _state["counter"] += 1
    return f"{kind}.noname.{_state['counter']}"


def _storage(array: np.ndarray, dtype: str) -> np.ndarray:
    flat = array.reshape(-1)
    return flat.view(np.uint16) if dtype == "bfloat16" else flat


def _shape(array: np.ndarray) -> str:
    return "(" + ", ".join(map(str, array.shape)) + ")"


def _chain(engine: Engine, req: Request, result: Any, wake: bool) -> Handle:
    """Submit ``req``; the handle resolves to ``result`` (the caller's own array, not the
    flat storage view the engine works on)."""
    req.result = result
    return Handle(engine, engine.submit(req, wake=wake))


def allreduce_async(array: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE,
                    name: str | None = None, out: np.ndarray | None = None,
                    compression: Codec = Compression.none, *, bf16: bool = False,
                    fused: bool = False, _wake: bool = True) -> Handle:
    """Start combining ``array`` across ranks; returns a :class:`Handle` at once.

    Requests are fused and ordered by the engine: ranks may submit them in any order, but
    every rank must submit the same names with the same shapes, dtypes and ops. ``bf16=True``
    marks a 16-bit integer array as holding bfloat16 words (how adapters hand over bfloat16
    tensors when ``ml_dtypes`` is not installed). ``fused=True`` says the caller has fused
    its tensors already (a gradient bucket): the engine starts it at once instead of waiting
    ``cycle_time_ms`` for more requests to fuse it with.
    """
    engine = _engine()
    op = ReduceOp(op)
    name = _auto_name("allreduce", name)
    dtype = check_array(array, f"allreduce tensor {name!r}", engine.rank, op, bf16)
    if out is None:
        out = np.empty_like(array)
    elif out.shape != array.shape or out.dtype != array.dtype or not out.flags.c_contiguous:
        raise ValueError(f"rank {engine.rank}: output for {name!r} must be a C-contiguous "
                         f"{array.dtype} array of shape {array.shape}")
    desc = (f"allreduce shape={_shape(array)} dtype={dtype} op={op.name.capitalize()} "
            f"compression={compression.name}")
    req = Request(Kind.ALLREDUCE, name, _storage(array, dtype), _storage(out, dtype), dtype,
                  desc, op=op, codec=compression, fused=fused)
    return _chain(engine, req, out, _wake)


def allreduce(array: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE, name: str | None = None,
              out: np.ndarray | None = None, compression: Codec = Compression.none, *,
              bf16: bool = False) -> np.ndarray:
    """Combine ``array`` across all ranks (average by default); returns a new array unless
    ``out`` is given (``out=array`` reduces in place)."""
    return allreduce_async(array, op, name, out, compression, bf16=bf16, _wake=False).wait()


def _rows_request(kind: Kind, array: np.ndarray, name: str | None, extra_of) -> Request:
    engine = _engine()
    name = _auto_name(kind.value, name)
    dtype = check_array(array, f"{kind.value} tensor {name!r}", engine.rank)
    if array.ndim == 0:
        raise ValueError(f"rank {engine.rank}: {kind.value} tensor {name!r} is a scalar; "
                         f"reshape it to (1,)")
    trailing = tuple(array.shape[1:])
    desc = f"{kind.value} shape=(*, {', '.join(map(str, trailing))}) dtype={dtype}"
    return Request(kind, name, _storage(array, dtype), None, dtype, desc,
                   extra=extra_of(name, engine), trailing=trailing)


def allgather(array: np.ndarray, name: str | None = None) -> np.ndarray:
    """Concatenate every rank's array along dimension 0 (lengths may differ per rank)."""
    req = _rows_request(Kind.ALLGATHER, array, name, lambda n, e: int(array.shape[0]))
    engine = _engine()
    flat = engine.wait(engine.submit(req, wake=False))
    return flat.view(array.dtype) if array.dtype != flat.dtype else flat


def alltoall(array: np.ndarray, splits: Any = None,
             name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Send ``splits[i]`` rows of ``array`` to rank ``i`` and gather what every rank sent
    here; returns ``(data, received splits)``. Without ``splits`` the rows divide evenly."""
    def check(name: str, engine: Engine) -> list[int]:
        rows, n = array.shape[0], engine.size
        if splits is None:
            if rows % n:
                raise ValueError(f"rank {engine.rank}: alltoall tensor {name!r} has {rows} "
                                 f"rows, not divisible by {n} ranks; pass splits=")
            return [rows // n] * n
        got = [int(s) for s in splits]
        if len(got) != n or min(got) < 0 or sum(got) != rows:
            raise ValueError(f"rank {engine.rank}: alltoall splits {got} for {name!r} must be "
                             f"{n} non-negative counts summing to {rows}")
        return got
    req = _rows_request(Kind.ALLTOALL, array, name, check)
    engine = _engine()
    data, recv = engine.wait(engine.submit(req, wake=False))
    return (data.view(array.dtype) if array.dtype != data.dtype else data), recv


def broadcast_async(array: np.ndarray, root_rank: int, name: str | None = None, *,
                    _wake: bool = True) -> Handle:
    """Start overwriting ``array`` with ``root_rank``'s values; returns a :class:`Handle`."""
    engine = _engine()
    name = _auto_name("broadcast", name)
    dtype = check_array(array, f"broadcast tensor {name!r}", engine.rank)
    if not 0 <= root_rank < engine.size:
        raise ValueError(f"rank {engine.rank}: root_rank {root_rank} is not a rank of this job "
                         f"(size {engine.size})")
    flat = _storage(array, dtype)
    desc = f"broadcast shape={_shape(array)} dtype={dtype} root={root_rank}"
    req = Request(Kind.BROADCAST, name, flat, flat, dtype, desc, root=root_rank)
    return _chain(engine, req, array, _wake)


def broadcast(array: np.ndarray, root_rank: int, name: str | None = None) -> np.ndarray:
    """Overwrite ``array`` with ``root_rank``'s values on every rank, in place; returns it."""
    return broadcast_async(array, root_rank, name, _wake=False).wait()


def reducescatter(array: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE,
                  name: str | None = None) -> np.ndarray:
    """Reduce, then keep this rank's block of the first dimension (earlier ranks get the
    extra rows when it does not divide evenly, as in Horovod)."""
    engine = _engine()
    if getattr(array, "ndim", 1) == 0:
        raise ValueError(f"rank {engine.rank}: reducescatter needs at least one dimension")
    total = allreduce(array, op, name=_auto_name("reducescatter", name))
    base, extra = divmod(array.shape[0], engine.size)
    start = engine.rank * base + min(engine.rank, extra)
    return total[start:start + base + (engine.rank < extra)].copy()


def barrier() -> None:
    """Wait until every rank reaches the barrier."""
    allreduce(np.zeros(1, np.int32), ReduceOp.SUM, name="shoal.barrier")


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Send a picklable object from ``root_rank`` to every rank (peers are authenticated)."""
    name = _auto_name("broadcast_object", name)
    payload = np.frombuffer(pickle.dumps(obj), np.uint8) if rank() == root_rank \
        else np.empty(0, np.uint8)
    length = broadcast(np.array([payload.size], np.int64), root_rank, name=f"{name}.len")
    if rank() != root_rank:
        payload = np.empty(int(length[0]), np.uint8)
    broadcast(payload, root_rank, name=f"{name}.data")
    return obj if rank() == root_rank else pickle.loads(payload.tobytes())


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's picklable object, in rank order."""
    name = _auto_name("allgather_object", name)
    payload = np.frombuffer(pickle.dumps(obj), np.uint8)
    lengths = allgather(np.array([payload.size], np.int64), name=f"{name}.len")
    data = allgather(payload, name=f"{name}.data")
    offsets = np.cumsum([0, *lengths.tolist()])
    return [pickle.loads(data[offsets[r]:offsets[r + 1]].tobytes()) for r in range(size())]
