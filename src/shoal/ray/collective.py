"""Backend ``"shoal"`` of ``ray.util.collective``: Ray actors call shoal's collectives.

::

    import ray.util.collective as col
    import shoal.ray.collective  # registers the backend in this process

    @ray.remote
    class Worker:
        def __init__(self):
            import shoal.ray.collective  # and in every actor
        def setup(self, world_size, rank):
            col.init_collective_group(world_size, rank, backend="shoal", group_name="g")
        def step(self, x):
            col.allreduce(x, group_name="g")  # in place, numpy arrays or torch CPU tensors
            return x

Ray asks every process that makes a group to know the backend, so import this module in the
driver and in every actor before ``init_collective_group`` (or
``create_collective_group``). Each group is a shoal communicator of its own: its ranks meet
through Ray's internal key-value store (the GCS) under ``shoal-collective/<group>/``. Its
connections prove ``SHOAL_SECRET`` where the actors have one; else a secret rank 0 makes,
handed over in the GCS only when Ray authenticates its clients (token authentication, Ray's
default for ``ray start``); else one agreed by Diffie-Hellman through the GCS, never readable
there. Each actor's Ray node is its shoal host (shared memory within a node, TCP between).
Ray's collectives map as: ``allreduce``, ``reduce`` (the result on the root only),
``broadcast``, ``allgather`` (into a list of one tensor per rank), ``reducescatter`` (a list
of one input per rank, this rank's sum into the output), ``send``/``recv`` and
``barrier``; ops SUM, PRODUCT, MIN and MAX.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import Any

import numpy as np
import ray
from ray.util.collective.collective_group.base_collective_group import BaseGroup
from ray.util.collective.types import ReduceOp as RayOp

from shoal.core.errors import RendezvousError
from shoal.core.reduction import ReduceOp
from shoal.core.store import Store

from .runner import host_name

__all__ = ["BACKEND", "RayKVStore", "ShoalGroup", "register"]

#: the name to pass as ``backend=`` (Ray compares names case-insensitively)
BACKEND = "shoal"
_OPS = {RayOp.SUM: ReduceOp.SUM, RayOp.PRODUCT: ReduceOp.PRODUCT, RayOp.MIN: ReduceOp.MIN,
        RayOp.MAX: ReduceOp.MAX}


def _kv() -> Any:
    import ray.experimental.internal_kv as kv
    return kv


class RayKVStore(Store):
    """shoal's rendezvous interface on Ray's internal key-value store (keys under
    ``prefix``). Counters are made of put-if-absent slots, the one atomic step the store
    has."""

    def __init__(self, prefix: str, poll_s: float = 0.01) -> None:
        self.prefix = prefix.rstrip("/") + "/"
        self.poll_s = poll_s

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: bytes) -> None:
        _kv()._internal_kv_put(self._k(key), value, overwrite=True)

    def try_get(self, key: str) -> bytes | None:
        return _kv()._internal_kv_get(self._k(key))

    def get(self, key: str, timeout: float | None = None) -> bytes:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            value = self.try_get(key)
            if value is not None:
                return value
            if deadline is not None and time.monotonic() > deadline:
                raise RendezvousError(f"key {key!r} did not appear in Ray's key-value store "
                                      f"under {self.prefix!r} within {timeout}s (a peer is "
                                      f"slow, stuck or dead, or was given another group)")
            time.sleep(self.poll_s)

    def add(self, key: str, delta: int) -> int:
        if delta < 0:
            raise ValueError("RayKVStore counters only grow")
        slot = 0
        for _ in range(delta):  # claim the next free slots; the count is the last one + 1
            while _kv()._internal_kv_put(self._k(f"{key}#{slot}"), b"1", overwrite=False):
                slot += 1
            slot += 1
        while delta == 0 and self.try_get(f"{key}#{slot}") is not None:
            slot += 1
        return slot

    def delete(self, key: str) -> bool:
        return bool(_kv()._internal_kv_del(self._k(key)))

    def clear(self) -> None:
        """Remove every key under the prefix."""
        _kv()._internal_kv_del(self.prefix, del_by_prefix=True)


def _array(tensor: Any) -> tuple[np.ndarray, Any]:
    """A numpy view of a numpy array or torch CPU tensor (contiguous), and the tensor."""
    if isinstance(tensor, np.ndarray):
        if not tensor.flags.c_contiguous:
            raise ValueError("shoal's Ray collectives take contiguous arrays")
        return tensor, tensor
    if type(tensor).__module__.startswith("torch"):
        if tensor.device.type != "cpu":
            raise ValueError(f"shoal's Ray collectives take CPU tensors, not "
                             f"{tensor.device} ones: move it with .cpu(), or use backend "
                             f"'nccl' for GPU tensors")
        if not tensor.is_contiguous():
            raise ValueError("shoal's Ray collectives take contiguous tensors")
        return tensor.detach().numpy(), tensor
    raise ValueError(f"shoal's Ray collectives take numpy arrays or torch CPU tensors, not "
                     f"{type(tensor).__name__}")


def _one(tensors: Any, what: str) -> np.ndarray:
    if not isinstance(tensors, list) or len(tensors) != 1:
        raise ValueError(f"{what}: one tensor per process (Ray wraps it in a list)")
    return _array(tensors[0])[0]


def _token_auth() -> bool:
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication
        return False
    return bool(is_token_auth_enabled())


def _group_secret(store: RayKVStore, rank: int, size: int, given: str | None,
                  timeout_s: float) -> str | None:
    """The secret every connection of the group proves: ``SHOAL_SECRET`` where every actor
    has it; else one rank 0 makes, handed over in Ray's store only when Ray authenticates
    every client of it (token authentication); else none, and the communicator agrees one
    by Diffie-Hellman through the store, so it is never readable there."""
    if given or size == 1:
        return given
    if not _token_auth():
        return None
    if rank == 0:
        store.set("secret", secrets.token_hex(32).encode())
    return store.get("secret", timeout_s).decode()


class ShoalGroup(BaseGroup):
    """One ``ray.util.collective`` group on a shoal communicator of its own."""

    def __init__(self, world_size: int, rank: int, group_name: str,
                 timeout_s: float = 120.0) -> None:
        from shoal.core import config
        from shoal.core.communicator import Communicator
        super().__init__(world_size, rank, group_name)
        self._store = RayKVStore(f"shoal-collective/{group_name}")
        node = ray.get_runtime_context().get_node_id()
        cfg = config.load(start_timeout_s=timeout_s)
        self._comm = Communicator.create(
            self._store, rank, world_size, cfg=cfg, hostname=host_name(node),
            secret=_group_secret(self._store, rank, world_size, cfg.secret, timeout_s),
            job_id=f"raycol-{secrets.token_hex(6)}",  # rank 0's names the shared memory
            bind_addr=cfg.bind_addr or ray.util.get_node_ip_address())

    @classmethod
    def backend(cls) -> str:
        return BACKEND.upper()

    @classmethod
    def check_backend_availability(cls) -> bool:
        return True

    def destroy_group(self) -> None:
        """Close the communicator; rank 0 removes the group's keys."""
        self._comm.close()
        if self._rank == 0:
            with contextlib.suppress(Exception):
                self._store.clear()

    def allreduce(self, tensor: Any, allreduce_options: Any = None) -> None:
        a = _one(tensor, "allreduce")
        op = _OPS[allreduce_options.reduceOp] if allreduce_options else ReduceOp.SUM
        a[...] = self._comm.allreduce(a, op).reshape(a.shape)

    def barrier(self, barrier_options: Any = None) -> None:
        self._comm.barrier()

    def reduce(self, tensor: Any, reduce_options: Any = None) -> None:
        a = _one(tensor, "reduce")
        op = _OPS[reduce_options.reduceOp] if reduce_options else ReduceOp.SUM
        out = self._comm.allreduce(a, op)
        if self._rank == (reduce_options.root_rank if reduce_options else 0):
            a[...] = out.reshape(a.shape)

    def broadcast(self, tensor: Any, broadcast_options: Any = None) -> None:
        a = _one(tensor, "broadcast")
        root = broadcast_options.root_rank if broadcast_options else 0
        a[...] = self._comm.broadcast(a, root).reshape(a.shape)

    def allgather(self, tensor_list: Any, tensor: Any, allgather_options: Any = None) -> None:
        a = _one(tensor, "allgather")
        if not isinstance(tensor_list, list) or len(tensor_list) != 1 or \
                len(tensor_list[0]) != self._world_size:
            raise ValueError(f"allgather: a list of {self._world_size} output tensors")
        outs = [_array(t)[0] for t in tensor_list[0]]
        gathered = self._comm.allgather(a.reshape(1, *a.shape))
        for out, part in zip(outs, gathered, strict=True):
            out[...] = part.reshape(out.shape)

    def reducescatter(self, tensor: Any, tensor_list: Any,
                      reducescatter_options: Any = None) -> None:
        out = _one(tensor, "reducescatter")
        if not isinstance(tensor_list, list) or len(tensor_list) != 1 or \
                len(tensor_list[0]) != self._world_size:
            raise ValueError(f"reducescatter: a list of {self._world_size} input tensors")
        parts = [_array(t)[0] for t in tensor_list[0]]
        op = _OPS[reducescatter_options.reduceOp] if reducescatter_options else ReduceOp.SUM
        mine = self._comm.reducescatter(np.stack([p.reshape(out.shape) for p in parts]), op)
        out[...] = mine.reshape(out.shape)

    def send(self, tensor: Any, send_options: Any) -> None:
        a = _one(tensor, "send")
        self._comm.send(a, send_options.dst_rank).wait()

    def recv(self, tensor: Any, recv_options: Any) -> None:
        a = _one(tensor, "recv")
        self._comm.recv(a, recv_options.src_rank).wait()


_registered = False


def register() -> None:
    """Register the backend in this process (done on import; repeated calls do nothing)."""
    global _registered
    if _registered:
        return
    from ray.util.collective.backend_registry import _global_registry, register_collective_backend
    if not _global_registry.is_registered(BACKEND):
        register_collective_backend(BACKEND, ShoalGroup)
    _registered = True


register()
