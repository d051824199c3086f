"""SMDDP's intra-node device path, orchestrated over torch's own collectives.

Where a host has two or more GPUs, one per local rank, a gradient bucket is reduced in the
shape of the Herring paper (the SMDDP design)::

    reduce_scatter over the host's device group (NCCL: NVLink)   -> this rank's shard
      -> device-to-host copy of the shard (the copy lane, engine thread waits)
      -> shoal's cross-host allreduce of the shard on the CPUs (ranks of this local rank)
      -> host-to-device copy (the consumer stream waits on its event)
      -> all_gather over the device group                     -> the whole reduced bucket

shoal writes no NCCL code: the device group is any torch process group (``ProcessGroupNCCL``
built from shoal's own authenticated store, or one the user made); CI runs the same
orchestration with ``ProcessGroupGloo`` on CPU tensors. :func:`device_group_for` decides once
per communicator, on every rank alike, and says once why it falls back to the host-staged
path (one GPU per host, ranks sharing a GPU, NCCL missing).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from shoal.core.communicator import Communicator
from shoal.core.compression import Codec, Compression
from shoal.core.reduction import ReduceOp
from shoal.core.store import PrefixStore, Store

from ..tensors import stage
from .streams import lane_for

__all__ = ["C10dView", "DeviceGroup", "GroupReduction", "device_group_for",
           "make_device_group"]

log = logging.getLogger("shoal.torch.device")


class C10dView(dist.Store):
    """A shoal :class:`~shoal.core.store.Store` as a torch ``c10d.Store``, so torch's process
    groups (NCCL's unique id included) meet through shoal's authenticated store."""

    def __init__(self, store: Store, timeout: float) -> None:
        super().__init__()
        self._store = store
        self._timeout = timeout

    def set(self, key: str, value: Any) -> None:
        self._store.set(key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return self._store.get(key, self._timeout)

    def add(self, key: str, value: int) -> int:
        return self._store.add(key, value)

    def check(self, keys: list[str]) -> bool:
        return all(self._store.try_get(k) is not None for k in keys)

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        secs = timeout.total_seconds() if isinstance(timeout, timedelta) else self._timeout
        for key in keys:
            self._store.get(key, secs)

    def delete_key(self, key: str) -> bool:
        return self._store.delete(key)


class GroupReduction:
    """One bucket's reduction in flight along the intra-node path: :meth:`wait` waits for
    the cross-host part, :meth:`finish` brings the shard back and allgathers it."""

    def __init__(self, group: DeviceGroup, flat: torch.Tensor, padded: torch.Tensor,
                 shard: torch.Tensor, staged: Any, handle: Any, scale: float) -> None:
        self._group, self._flat, self._padded = group, flat, padded
        self._shard, self._staged, self._handle, self._scale = shard, staged, handle, scale

    def done(self) -> bool:
        """Whether the cross-host reduction has completed."""
        return self._handle.done()

    def wait(self, timeout: float | None = None, *, drive: bool | None = None) -> Any:
        """Wait for the shard's cross-host reduction (on the CPUs; ``drive`` as
        :meth:`Handle.wait`'s)."""
        return self._handle.wait(timeout, drive=drive)

    def order_after_copy(self) -> None:
        """Order the current stream after the shard's copy to the host."""
        self._staged.order_after_copy()

    def finish(self) -> torch.Tensor:
        """Shard to the device (the consumer stream waits on it), scale, allgather over the
        device group into the bucket; returns the bucket."""
        self._staged.finish()
        if self._scale != 1.0:
            self._shard.mul_(self._scale)
        self._group.local._allgather_base(self._padded, self._shard).wait()
        if self._padded is not self._flat:
            self._flat.copy_(self._padded[:self._flat.numel()])
        return self._flat


class DeviceGroup:
    """A host's device group (any torch process group over its local ranks, local rank =
    group rank) and the shoal communicator across hosts (this local rank on every host)."""

    def __init__(self, local: Any, cross: Communicator, local_size: int, size: int,
                 store: dist.Store | None = None) -> None:
        self.local = local
        self.cross = cross
        # torch's group holds only the C++ half of a Python store; NCCL (and gloo with
        # TORCH_GLOO_LAZY_INIT) calls it at the first collective, so the Python half must
        # live as long as the group
        self.store = store
        self.local_size = local_size
        self.size = size

    def padded_numel(self, numel: int) -> int:
        """``numel`` rounded up to a multiple of the local size (every rank gets a shard)."""
        return -(-numel // self.local_size) * self.local_size

    def allreduce_async(self, flat: torch.Tensor, op: ReduceOp, name: str,
                        compression: Codec = Compression.none,
                        padded: torch.Tensor | None = None,
                        reuse: Any = None) -> GroupReduction:
        """Start reducing the 1-D ``flat`` across every rank (Sum or Average). ``padded``: a
        buffer of :meth:`padded_numel` elements whose head is ``flat`` (buckets allocate
        their buffer so), else one is made. ``reuse``: the last reduction of this bucket,
        whose pinned shard buffer is used again."""
        if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
            raise ValueError(f"the intra-node device path reduces with Sum or Average, not "
                             f"{op.name}")
        n = flat.numel()
        if padded is None:
            padded = flat
            if self.padded_numel(n) != n:
                padded = torch.zeros(self.padded_numel(n), dtype=flat.dtype, device=flat.device)
                padded[:n].copy_(flat)
        shard = torch.empty(padded.numel() // self.local_size, dtype=flat.dtype,
                            device=flat.device)
        work = self.local._reduce_scatter_base(shard, padded, dist.ReduceScatterOptions())
        # NCCL: the stream current in wait() waits on it (the host does not). That is the
        # copy stream, which takes the shard to the host next; the compute stream, which
        # still runs backward, does not queue behind this or the slowest local rank
        with lane_for(flat.device).consumer_context():
            work.wait()
        staged = stage(shard, reuse=getattr(reuse, "_staged", None))
        handle = self.cross.allreduce_async(staged.array, ReduceOp.SUM, name, out=staged.array,
                                            compression=compression, bf16=staged.bf16,
                                            fused=True, ready=staged.ready)
        scale = 1.0 / self.size if op is ReduceOp.AVERAGE else 1.0
        return GroupReduction(self, flat, padded, shard, staged, handle, scale)

    def close(self) -> None:
        """Shut torch's group down (NCCL's communicators and their threads) and release the
        cross-host communicator."""
        shutdown = getattr(self.local, "shutdown", None) or getattr(self.local, "abort", None)
        try:
            if shutdown is not None:
                shutdown()
        finally:
            self.cross.close()


_groups: dict[int, DeviceGroup | None] = {}
_lock = threading.Lock()


def _qualifies(comm: Communicator, device: torch.device, backend: str) -> tuple[bool, str]:
    """Whether this rank can join a device group, and why not."""
    if backend == "nccl":
        if device.type != "cuda":
            return False, "the tensors are not on a GPU"
        if not dist.is_nccl_available():
            return False, "torch was built without NCCL"
    elif backend == "gloo" and not dist.is_gloo_available():
        return False, "torch was built without gloo"
    return True, ""


def device_group_for(comm: Communicator, device: torch.device) -> DeviceGroup | None:
    """The intra-node device group of ``comm`` for tensors on ``device``, made once per
    communicator (a collective: every rank calls it alike), or None where the host-staged
    path is taken (said once, with the reason)."""
    mode = comm.cfg.device_group
    if device.type == "cpu" and mode != "on":
        return None  # host tensors: the CPU path is the only one (nothing to say)
    key = id(comm)
    with _lock:
        if key in _groups and not comm.closed:
            return _groups[key]
    backend = comm.cfg.device_group_backend
    group: DeviceGroup | None = None
    reason = ""
    world = comm.world
    if mode == "off":
        reason = "SHOAL_DEVICE_GROUP=off"
    elif comm.size == 1 or world.local_size < 2:
        reason = "one rank per host"
    else:
        ok, why = _qualifies(comm, device, backend)
        uuid = str(torch.cuda.get_device_properties(device).uuid) \
            if ok and device.type == "cuda" else f"{world.hosts[comm.rank]}/{world.local_rank}"
        seen = comm.allgather_object((ok, why, uuid, world.local_size),
                                     name="shoal.torch.device.group")
        if not all(s[0] for s in seen):
            reason = next(s[1] for s in seen if not s[0])
        elif not world.homogeneous:
            reason = "hosts run different numbers of ranks"
        elif backend == "nccl" and any(len({seen[r][2] for r in world.node_ranks(c)}) <
                                       len(world.node_ranks(c))
                                       for c in range(world.cross_size)):
            reason = "local ranks share a GPU"
        else:
            group = _build(comm, device, backend)
    if comm.rank == 0:
        if group is not None:
            log.warning("shoal: intra-node device path: reduce-scatter over %s among %d "
                        "local ranks, then across %d host(s) on the CPUs", backend,
                        world.local_size, world.cross_size)
        else:
            log.warning("shoal: host-staged device path (%s)", reason)
    with _lock:
        _groups[key] = group
    if group is not None:
        weakref.finalize(comm, _forget, key)
    return group


def _forget(key: int) -> None:
    with _lock:
        group = _groups.pop(key, None)
    if group is not None:
        group.close()


def _build(comm: Communicator, device: torch.device, backend: str) -> DeviceGroup:
    world = comm.world
    return make_device_group(comm, device, backend, world.local_rank, world.local_size,
                             world.cross_peers, f"device-group/{world.cross_rank}")


def make_device_group(comm: Communicator, device: torch.device, backend: str,
                      local_rank: int, local_size: int, cross_ranks: Sequence[int],
                      key: str) -> DeviceGroup:
    """A device group of ``local_size`` ranks over torch's ``backend`` (this rank is
    ``local_rank`` in it), meeting under ``key`` in ``comm``'s store, and the communicator
    over ``cross_ranks`` of ``comm`` that reduces its shards on the CPUs. Every member calls
    it alike. (:func:`device_group_for` makes the host's one; the GPU check makes a one-rank
    NCCL group with it, so that NCCL's lazy connect runs even on a machine with one GPU.)"""
    timeout = comm.cfg.start_timeout_s
    store = C10dView(PrefixStore(comm.store, key), timeout)
    if backend == "nccl":
        torch.cuda.set_device(device)
        local = dist.ProcessGroupNCCL(store, local_rank, local_size,
                                      dist.ProcessGroupNCCL.Options())
    elif backend == "gloo":
        local = dist.ProcessGroupGloo(store, local_rank, local_size,
                                      timedelta(seconds=timeout))
    else:
        raise ValueError(f"SHOAL_DEVICE_GROUP_BACKEND={backend!r}: use nccl or gloo")
    cross = comm.split(cross_ranks)
    assert cross is not None
    return DeviceGroup(local, cross, local_size, comm.size, store)
