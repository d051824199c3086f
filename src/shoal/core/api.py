"""The process-wide state behind ``shoal.init()`` and the Horovod-shaped functions.

``init()`` reads the launcher's environment (:mod:`shoal.core.topology`), meets the other ranks
at the authenticated rendezvous store (served by shoalrun, or by rank 0 under other launchers),
learns which ranks share a host, opens the TCP mesh and the shared-memory segments, and builds
the :class:`~shoal.core.comm.Communicator` that every collective below uses.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from . import config, topology
from .auth import secret_bytes
from .comm import Communicator
from .errors import NotInitializedError
from .ops import ReduceOp
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
    "world",
]

log = logging.getLogger("shoal")
_lock = threading.RLock()
_state: dict[str, Any] = {"comm": None, "store": None, "server": None, "executor": None,
                          "generation": 0}


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
         secret: str | None = None, job_id: str | None = None, **settings: Any) -> None:
    """Join the job. Safe to call twice (the second call does nothing).

    With no arguments the launcher's environment says who this process is (shoalrun,
    torchrun, mpirun, srun, SageMaker; a lone process is rank 0 of 1). Explicit arguments win
    over the environment; other keyword arguments override ``SHOAL_*`` settings by knob name
    (``timeout_s=5``, ``allreduce_algorithm="ring"``).
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
            _state["comm"] = Communicator(cfg, world, None, None)
            return
        if info.secret_is_derived:
            log.warning("SHOAL_SECRET is not set: connections are checked against a secret "
                        "derived from the job id, which keeps jobs apart but not strangers "
                        "out; start with shoalrun or set SHOAL_SECRET on every rank")
        key = secret_bytes(info.secret)
        _state["generation"] += 1
        gen = f"shoal/g{_state['generation']}"
        server = None
        if info.rank == 0 and info.launcher != "shoalrun":
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
        _state["comm"] = Communicator(cfg, world, mesh, shm)
        store.barrier(f"{gen}/ready", info.size, timeout=cfg.start_timeout_s)


def shutdown() -> None:
    """Leave the job and release sockets and shared memory. ``init()`` may be called again."""
    with _lock:
        comm, store, server = _state["comm"], _state["store"], _state["server"]
        executor = _state["executor"]
        _state.update(comm=None, store=None, server=None, executor=None)
        if executor is not None:
            executor.shutdown(wait=True)
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


def allreduce(array: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE, name: str | None = None,
              out: np.ndarray | None = None) -> np.ndarray:
    """Combine ``array`` across all ranks (average by default); returns a new array unless
    ``out`` is given (``out=array`` reduces in place)."""
    return communicator().allreduce(array, op, name=name, out=out)


class Handle:
    """The pending result of an asynchronous collective."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def done(self) -> bool:
        """True once the result (or error) is ready."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until done; return the result or raise the collective's error."""
        try:
            return self._future.result(timeout)
        except FutureTimeout:
            raise TimeoutError(f"collective still running after {timeout}s") from None


def allreduce_async(array: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE,
                    name: str | None = None, out: np.ndarray | None = None) -> Handle:
    """Start an allreduce and return a :class:`Handle` at once.

    Asynchronous collectives run one at a time in submission order on a background thread,
    so every rank must submit them in the same order.
    """
    comm = communicator()
    with _lock:
        if _state["executor"] is None:
            _state["executor"] = ThreadPoolExecutor(1, thread_name_prefix="shoal-async")
        executor = _state["executor"]
    return Handle(executor.submit(comm.allreduce, array, op, name=name, out=out))


def allgather(array: np.ndarray, name: str | None = None) -> np.ndarray:
    """Concatenate every rank's array along dimension 0 (lengths may differ per rank)."""
    return communicator().allgather(array, name=name)


def broadcast(array: np.ndarray, root_rank: int, name: str | None = None) -> np.ndarray:
    """Return ``root_rank``'s values on every rank (the array is overwritten in place)."""
    return communicator().broadcast(array, root_rank, name=name)


def reducescatter(array: np.ndarray, op: ReduceOp = ReduceOp.AVERAGE,
                  name: str | None = None) -> np.ndarray:
    """Reduce across ranks and return this rank's block of dimension 0."""
    return communicator().reducescatter(array, op, name=name)


def alltoall(array: np.ndarray, splits: Any = None,
             name: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Scatter row blocks to every rank and gather theirs; returns (data, received splits)."""
    return communicator().alltoall(array, splits, name=name)


def barrier() -> None:
    """Wait until every rank reaches the barrier."""
    communicator().barrier()


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Send a picklable object from ``root_rank`` to every rank."""
    return communicator().broadcast_object(obj, root_rank, name=name)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's picklable object, in rank order."""
    return communicator().allgather_object(obj, name=name)
