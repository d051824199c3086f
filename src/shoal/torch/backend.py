"""``torch.distributed`` backend ``"shoal"``: c10d collectives on shoal's engine.

::

    import shoal.torch.backend
    shoal.torch.backend.register()
    torch.distributed.init_process_group("shoal")      # under torchrun or shoalrun
    model = torch.nn.parallel.DistributedDataParallel(model)

Each c10d call becomes named shoal collectives ``torch.<group>.<kind>.<place>.<i>``: the
call's kind and its place among the calls of that kind in the current training step, steps
being found from the calls' signatures (:class:`shoal.core.callnames.CallNames`). c10d has
every rank issue a group's calls in the same order, so ranks agree on names, and a training
loop's calls carry the same names every step: the engine's name cache applies (one bit per
collective in a negotiation round). Ranks that disagree on a call's shape or dtype propose
one name with different descriptions: :class:`shoal.CollectiveMismatchError` on every rank.

Every collective is asynchronous: the call submits shoal collectives and returns a Work at
once; the engine runs them in the order all ranks agree on, so groups never wait on each
other (two groups' all_gathers issued in opposite orders on two ranks both complete), and
FSDP's prefetched all-gathers overlap compute. Every wait is bounded by the group's timeout
(or the one ``wait`` gets), and raises ``DistBackendError`` saying "Timed out", as gloo
does. Futures are completed on a small pool, never on shoal's engine thread, so callbacks
(DDP comm hooks) may issue and wait on collectives (a work done at submission, in a group of
one, completes on the caller's thread). Every group (the default one, ``new_group`` subsets)
is its own shoal communicator, met through the c10d store torch hands over, so any
``init_method`` and any launcher (or none) works; under torchrun each restart meets on keys
of its own. send/recv (any source too) go over the group's own point-to-point connections
(see :mod:`shoal.core.p2p`). ``register()`` also lets ``dist.monitored_barrier``, which
refuses every backend not named gloo, through to groups of this backend.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as c10d

import shoal
from shoal.core import config
from shoal.core.auth import secret_bytes
from shoal.core.callnames import CallNames
from shoal.core.communicator import Communicator, local_address
from shoal.core.gradients import sparse_scale

from .meet import meet_fresh
from .monitor import admit_monitored_barrier, monitored_barrier
from .store import C10dStore
from .tensors import Staged, copy_back, fill_bytes, result_tensor, stage
from .work import ShoalWork, stage_bytes, timeout_seconds

__all__ = ["BACKEND", "ShoalProcessGroup", "ShoalWork", "register"]

BACKEND = "shoal"
_PLACES = 256  # places per kind and step (calls that form no steps take them in turn)
_OPS = {dist.ReduceOp.RedOpType.SUM: shoal.Sum, dist.ReduceOp.RedOpType.AVG: shoal.Average,
        dist.ReduceOp.RedOpType.MIN: shoal.Min, dist.ReduceOp.RedOpType.MAX: shoal.Max,
        dist.ReduceOp.RedOpType.PRODUCT: shoal.Product,
        dist.ReduceOp.RedOpType.BAND: shoal.ReduceOp.BAND,
        dist.ReduceOp.RedOpType.BOR: shoal.ReduceOp.BOR,
        dist.ReduceOp.RedOpType.BXOR: shoal.ReduceOp.BXOR}
_BOOL_OPS = {shoal.Sum: shoal.Max, shoal.Product: shoal.Min}  # c10d's bool semantics
_SCATTER_OPS = {shoal.Sum, shoal.Average, shoal.Min, shoal.Max, shoal.Product}
_RS = c10d.ReduceScatterOptions()  # c10d's defaults, never modified here
_Tensors = list[torch.Tensor]
_registered: set[str] = set()
class ShoalProcessGroup(dist.ProcessGroup):
    """A c10d process group: its own shoal communicator, built from the store torch gave."""

    #: torch's ``split_group`` asks the group's backend; this group is its own backend
    supports_splitting = True
    options = None  # no backend options: ``split_group`` copies them to the child as-is

    def __init__(self, comm: Communicator, group: str = "0",
                 timeout: float | None = None, store: Any = None) -> None:
        super().__init__(comm.rank, comm.size)
        self._comm = comm
        # each c10d call is a collective of its own (DDP's buckets, buffers, FSDP's gathers):
        # started at once, never held back a cycle to fuse
        comm.start_at_once = True
        self._group = group
        self._timeout = timeout
        self._store = store
        self._seq = 0
        self._alone = comm.size == 1  # a group of one: reductions and broadcasts are no-ops
        self._calls = CallNames(f"torch.{group}", _PLACES,
                                finished=lambda work: work.is_completed())
        self._monitor = 0  # monitored_barrier rounds
        self._lock = threading.Lock()

    @property
    def communicator(self) -> Communicator:
        """The shoal communicator behind this group."""
        return self._comm

    def shutdown(self) -> None:
        """Close the group's communicator (``destroy_process_group`` calls this)."""
        self._comm.close()

    def abort(self) -> None:
        """Close the communicator at once: pending works fail on this rank, and peers
        waiting on it learn so (``torch.distributed.distributed_c10d._abort_process_group``)."""
        self._comm.close()

    # -- what c10d asks of a group's backend (this group is its own) ----------------------
    def _get_backend(self, device: Any = None) -> ShoalProcessGroup:
        """The backend behind this group for ``device``: the group itself (torch 2.13's
        ``c10d.Backend`` has no Python constructor, so a Python backend cannot be held by a
        C++ ProcessGroup; a Python ProcessGroup is its own backend)."""
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        """The devices this group serves (the backend's registered ones, as for gloo)."""
        return [torch.device(d) for d in dist.Backend.backend_capability.get(BACKEND, ["cpu"])]

    def _get_sequence_number_for_group(self) -> int:
        """How many collectives this group has issued (the same on every rank)."""
        return self._seq

    def _set_sequence_number_for_group(self) -> None:
        """Numbering starts at 0 on every rank when the group is made: nothing to agree."""

    def get_group_store(self) -> Any:
        """The c10d store this group met through."""
        return self._store

    def set_timeout(self, timeout: Any) -> None:
        """Bound every later wait of this group's works by ``timeout``."""
        self._timeout = timeout_seconds(timeout)

    def split_group(self, ranks: Sequence[int], timeout: Any = None, opts: Any = None,
                    group_name: str | None = None, group_desc: str | None = None,
                    device_types: Any = None) -> ShoalProcessGroup | None:
        """A group of ``ranks`` (ranks of this group) that only its members call, for
        ``torch.distributed.split_group``; None on the others. Made through this group's
        communicator, so no new store is needed."""
        members = sorted(int(r) for r in ranks)
        child = self._comm.split(members)
        if child is None:
            return None
        name = group_name or f"{self.group_name}:split:{'.'.join(map(str, members))}"
        store = dist.PrefixStore(name, self._store) if self._store is not None else None
        pg = ShoalProcessGroup(child, name, timeout_seconds(timeout) or self._timeout, store)
        pg._set_group_name(name)
        if group_desc:
            pg._set_group_desc(group_desc)
        weakref.finalize(pg, child.close)
        return pg

    def _set_group_name(self, name: str) -> None:
        """c10d names the group after creating it (kept here: this group has no C++ backend
        to hold it)."""
        self._group_name = name

    @property
    def group_name(self) -> str:
        """The name c10d gave this group (``destroy_process_group(group)`` looks it up)."""
        return getattr(self, "_group_name", None) or f"shoal-{self._group}"

    def getBackendName(self) -> str:  # noqa: N802 (c10d's name)
        """``"shoal"``."""
        return BACKEND

    def __repr__(self) -> str:
        return f"ShoalProcessGroup(rank={self.rank()}, size={self.size()}, group={self._group})"

    # -- naming and work -------------------------------------------------------------------
    def _names(self, kind: str, signature: str, count: int) -> tuple[str, list[str]]:
        """The next call's name and its ``count`` collective names (the same on every rank),
        once the call that last used that name has finished."""
        with self._lock:
            self._seq += 1
            call = self._calls.next(kind, signature)
            previous = self._calls.take(call)
        if previous is not None:  # the name is reused: its last user must be finished
            with contextlib.suppress(Exception):  # its error surfaces through its own work
                previous.handles_done(self._timeout)
        return call, [f"{call}.{i}" for i in range(count)]

    def _done(self, value: Any) -> ShoalWork:
        """A call of a group of one, complete at once (it still counts in the sequence)."""
        with self._lock:
            self._seq += 1
        return ShoalWork.completed(value, self._timeout)

    def _work(self, call: str, handles: Sequence[shoal.Handle], finish: Callable[[], Any],
              tensors: Sequence[torch.Tensor] = ()) -> ShoalWork:
        work = ShoalWork(handles, finish, [t.device for t in tensors], self._timeout)
        if handles:
            with self._lock:
                self._calls.hold(call, work)
        return work

    # -- reductions ------------------------------------------------------------------------
    @staticmethod
    def _op(op: dist.ReduceOp) -> tuple[Any, float | torch.Tensor]:
        """c10d's op as (its kind, a prescale factor): PREMUL_SUM is a SUM of factor * x. A
        factor on a device stays a tensor (reading it would make the host wait for the
        device): the caller multiplies on the device, see :func:`_premultiplied`."""
        kind = op.op if hasattr(op, "op") else op
        prescale: float | torch.Tensor = 1.0
        if kind == dist.ReduceOp.RedOpType.PREMUL_SUM:
            factor = op.factor
            if isinstance(factor, torch.Tensor) and factor.device.type != "cpu":
                prescale = factor
            else:
                prescale = float(factor.item() if isinstance(factor, torch.Tensor) else factor)
            kind = dist.ReduceOp.RedOpType.SUM
        if kind not in _OPS:
            raise NotImplementedError(f"shoal backend: reduce op {kind} is not supported (use "
                                      f"SUM, AVG, MIN, MAX, PRODUCT, PREMUL_SUM, BAND, BOR or "
                                      f"BXOR)")
        return kind, prescale

    def _reduce_async(self, tensors: Sequence[torch.Tensor], op: dist.ReduceOp,
                      copy: Sequence[bool] = ()) -> tuple[str, list[Staged], list[Any]]:
        kind, factor = self._op(op)
        call, names = self._names("allreduce", _signature("allreduce", tensors, kind),
                                  len(tensors))
        staged, handles = [], []
        for i, (tensor, name) in enumerate(zip(tensors, names, strict=True)):
            sop = _OPS[kind]
            if tensor.dtype == torch.bool:
                sop = _BOOL_OPS.get(sop, sop)
            out_of_place = bool(copy and copy[i])
            src, prescale = _premultiplied(tensor, factor, in_place=not out_of_place)
            st = stage(src, copy=out_of_place and src is tensor)
            staged.append(st)
            # each torch.distributed call is its own collective (DDP's are buckets already):
            # started at once, not held back a cycle for fusion
            handles.append(self._comm.allreduce_async(st.array, sop, name=name, out=st.array,
                                                      bf16=st.bf16, fused=True,
                                                      prescale_factor=prescale,
                                                      ready=st.ready))
        return call, staged, handles

    def allreduce(self, tensors: list[torch.Tensor],
                  opts: c10d.AllreduceOptions = c10d.AllreduceOptions()) -> ShoalWork:  # noqa: B008
        """Reduce each tensor across ranks, in place (a list is reduced tensor by tensor)."""
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, opts.reduceOp)
        if self._alone:  # every op leaves one rank's tensor as it is; PREMUL_SUM scales it
            _, factor = self._op(opts.reduceOp)
            for tensor in tensors:
                if isinstance(factor, torch.Tensor) or factor != 1.0:
                    tensor.mul_(factor.to(tensor.device, tensor.dtype)
                                if isinstance(factor, torch.Tensor) else factor)
            return self._done(list(tensors))
        call, staged, handles = self._reduce_async(tensors, opts.reduceOp)

        def finish() -> list[torch.Tensor]:
            for st in staged:
                st.finish()
            return list(tensors)
        return self._work(call, handles, finish, tensors)

    def _sparse_allreduce(self, tensors: _Tensors, op: dist.ReduceOp) -> ShoalWork:
        """Sparse COO tensors (gloo's sparse allreduce): every rank's indices and values are
        gathered and summed, the result coalesced into the tensor in place."""
        kind, prescale = self._op(op)
        scale = sparse_scale(_OPS[kind], self.size(), prescale, rank=self.rank(),
                             what=f"a sparse all_reduce ({kind})")
        call, names = self._names("sparse", _signature(
            "sparse", [], kind, *[(tuple(t.size()), t.dtype) for t in tensors]),
            2 * len(tensors))
        parts, handles = [], []
        for i, tensor in enumerate(tensors):
            t = tensor.coalesce()
            idx = t.indices().t().contiguous()
            vals = t.values().contiguous()
            for j, part in enumerate((idx, vals)):
                st = stage(part)
                parts.append((part, st.bf16))
                handles.append(self._comm.allgather_async(st.array, name=names[2 * i + j],
                                                          ready=st.ready))

        def finish() -> list[torch.Tensor]:
            for i, tensor in enumerate(tensors):
                (idx, _), (vals, bf16) = parts[2 * i], parts[2 * i + 1]
                got_idx = result_tensor(handles[2 * i].wait(0), idx, False)
                got_vals = result_tensor(handles[2 * i + 1].wait(0), vals, bf16)
                total = torch.sparse_coo_tensor(got_idx.t(), got_vals * scale,
                                                tensor.size()).coalesce()
                with torch.no_grad():  # (a sparse tensor's .data does not share it)
                    tensor.copy_(total)
            return list(tensors)
        return self._work(call, handles, finish, tensors)

    def allreduce_coalesced(self, tensors: _Tensors, opts: Any = None) -> ShoalWork:
        """Same as :meth:`allreduce` (shoal fuses the tensors itself)."""
        return self.allreduce(tensors, opts or c10d.AllreduceOptions())

    def reduce(self, tensors: list[torch.Tensor],
               opts: c10d.ReduceOptions = c10d.ReduceOptions()) -> ShoalWork:  # noqa: B008
        """Reduce onto ``opts.rootRank``; other ranks' tensors are left unchanged."""
        root = opts.rootRank
        copy = [self.rank() != root] * len(tensors)
        call, staged, handles = self._reduce_async(tensors, opts.reduceOp, copy)

        def finish() -> list[torch.Tensor]:
            if self.rank() == root:
                for st in staged:
                    st.finish()
            return list(tensors)
        return self._work(call, handles, finish, tensors)

    def reduce_scatter(self, output_tensors: _Tensors, input_tensors: list[_Tensors],
                       opts: c10d.ReduceScatterOptions = _RS, *,
                       _flats: _Tensors | None = None) -> ShoalWork:
        """Reduce ``input_tensors[i]`` (one tensor per rank) and keep this rank's part: a
        real reduce-scatter (each rank receives only its block) when the parts are equal;
        uneven parts, bool tensors and bitwise ops go through a full reduction."""
        kind, factor = self._op(opts.reduceOp)
        me, n = self.rank(), self.size()
        even = _OPS[kind] in _SCATTER_OPS and all(
            len(parts) == n and len({p.numel() for p in parts}) == 1 and
            p.dtype != torch.bool for parts in input_tensors for p in parts[:1])
        if _flats is None or not even:  # a full reduction works in place: on a copy
            _flats = [torch.cat([t.reshape(-1) for t in parts]) for parts in input_tensors]
        flats = _flats
        if not even:
            call, staged, handles = self._reduce_async(flats, opts.reduceOp)

            def finish() -> list[torch.Tensor]:
                for out, st, parts in zip(output_tensors, staged, input_tensors, strict=True):
                    start = sum(p.numel() for p in parts[:me])
                    copy_back(st.host.reshape(-1)[start:start + out.numel()], out)
                return list(output_tensors)
            return self._work(call, handles, finish, output_tensors)
        call, names = self._names("reducescatter", _signature("reducescatter", flats, kind),
                                  len(flats))
        handles, results = [], []
        for flat, out, name in zip(flats, output_tensors, names, strict=True):
            flat, prescale = _premultiplied(flat, factor, in_place=False)
            st = stage(flat)
            got = stage(out, fetch=False)  # an output only: this rank's block lands in it
            results.append(got)
            handles.append(self._comm.reducescatter_async(
                st.array.reshape(n, -1), _OPS[kind], name=name, bf16=st.bf16,
                prescale_factor=prescale, out=got.array.reshape(1, -1), ready=st.ready))

        def scattered() -> list[torch.Tensor]:
            for got in results:
                got.finish()
            return list(output_tensors)
        return self._work(call, handles, scattered, output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: c10d.ReduceScatterOptions = _RS) -> ShoalWork:
        """``reduce_scatter_tensor``: reduce ``input`` and keep block ``rank`` of it."""
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(self, outputs: _Tensors, inputs: _Tensors,
                                        opts: c10d.ReduceScatterOptions = _RS) -> ShoalWork:
        """:meth:`reduce_scatter_single` for several pairs of tensors."""
        for out, inp in zip(outputs, inputs, strict=True):
            if inp.numel() != out.numel() * self.size():
                raise ValueError(f"rank {self.rank()}: reduce_scatter input has {inp.numel()} "
                                 f"elements, expected {self.size()} x {out.numel()}")
        parts = [list(inp.reshape(-1).chunk(self.size())) for inp in inputs]
        # the inputs as they are (reduce-scatter reads its input, never writes it): no copy
        return self.reduce_scatter(outputs, parts, opts,
                                   _flats=[inp.reshape(-1) for inp in inputs])

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement ---------------------------------------------------------------------
    def broadcast(self, tensors: list[torch.Tensor],
                  opts: c10d.BroadcastOptions = c10d.BroadcastOptions()) -> ShoalWork:  # noqa: B008
        """Overwrite each tensor with ``opts.rootRank``'s."""
        if self._alone and opts.rootRank == 0:  # from this rank to itself
            return self._done(list(tensors))
        call, names = self._names("broadcast", _signature("broadcast", tensors, opts.rootRank),
                                  len(tensors))
        staged, handles = [], []
        for tensor, name in zip(tensors, names, strict=True):
            st, raw = stage_bytes(tensor)
            staged.append(st)
            handles.append(self._comm.broadcast_async(raw, opts.rootRank, name=name,
                                                      ready=st.ready))

        def finish() -> list[torch.Tensor]:
            for st in staged:
                st.finish()
            return list(tensors)
        return self._work(call, handles, finish, tensors)

    def barrier(self, opts: c10d.BarrierOptions = c10d.BarrierOptions()) -> ShoalWork:  # noqa: B008
        """Complete once every rank has reached the barrier (``opts.timeout``, when set,
        bounds the wait instead of the group's timeout)."""
        if self._alone:
            return self._done([])
        call, (name,) = self._names("barrier", "barrier", 1)
        handle = self._comm.allreduce_async(np.zeros(1, np.int32), shoal.Sum, name=name)
        work = self._work(call, [handle], list)
        work._timeout = timeout_seconds(opts.timeout) or work._timeout
        return work

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        """gloo's ``monitored_barrier`` (see :func:`shoal.torch.monitor.monitored_barrier`)."""
        with self._lock:
            self._monitor += 1
            round_ = self._monitor
        monitored_barrier(self._comm, round_, timeout, self._timeout, wait_all_ranks)

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor],
                  opts: c10d.AllgatherOptions = c10d.AllgatherOptions()) -> ShoalWork:  # noqa: B008
        """Every rank's ``input_tensors[i]`` into ``output_tensors[i]`` (sizes may differ)."""
        return self._gathers(output_tensors, input_tensors, list(output_tensors))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: c10d.AllgatherOptions = c10d.AllgatherOptions()) -> ShoalWork:  # noqa: B008
        """``all_gather_into_tensor``: every rank's ``input`` concatenated into ``output``."""
        return self.all_gather_single_coalesced([output], [input], opts)

    def all_gather_single_coalesced(self, outputs: _Tensors, inputs: _Tensors,
                                    opts: Any = None) -> ShoalWork:
        """:meth:`all_gather_single` for several pairs of tensors."""
        return self._gathers([[out] for out in outputs], inputs, list(outputs))

    def allgather_coalesced(self, output_lists: list[_Tensors], input_tensors: _Tensors,
                            opts: Any = None) -> ShoalWork:
        """``all_gather_coalesced``: ``output_lists[r][i]`` receives rank r's
        ``input_tensors[i]``."""
        per_tensor = [[outs[i] for outs in output_lists] for i in range(len(input_tensors))]
        return self._gathers(per_tensor, input_tensors, list(output_lists))

    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _gathers(self, outputs: list[_Tensors], inputs: _Tensors, value: Any) -> ShoalWork:
        """Every rank's ``inputs[i]`` (as bytes) into ``outputs[i]``, one allgather each,
        started at once; the work completes off the caller's thread."""
        # (the ranks' input shapes may differ: the dtypes and the count are the signature)
        call, names = self._names("allgather",
                                  "allgather " + " ".join(str(t.dtype) for t in inputs),
                                  len(inputs))
        handles, landed = [], []
        for tensor, name, outs in zip(inputs, names, outputs, strict=True):
            st, raw = stage_bytes(tensor)
            into = None  # one output tensor (all_gather_into_tensor): the bytes land in it
            if len(outs) == 1 and outs[0].is_contiguous():
                into, into_raw = stage_bytes(outs[0], fetch=False)
            handles.append(self._comm.allgather_async(
                raw, name=name, ready=st.ready, out=None if into is None else into_raw))
            landed.append(into)

        def finish() -> Any:
            for outs, handle, into in zip(outputs, handles, landed, strict=True):
                got = handle.wait(0)
                if into is None:
                    fill_bytes(outs, got)
                else:
                    into.finish()
            return value
        return self._work(call, handles, finish, [t for outs in outputs for t in outs])

    def _exchange(self, data: np.ndarray, splits: list[int], outs: _Tensors, value: Any,
                  ready: Callable[[], None] | None = None,
                  check: Callable[[np.ndarray], None] | None = None) -> ShoalWork:
        """Send ``splits[r]`` consecutive bytes of ``data`` to rank ``r``; the bytes
        received fill ``outs`` when the work completes (``check`` sees them first)."""
        call, (name,) = self._names("alltoall", "alltoall", 1)
        handle = self._comm.alltoall_async(data, splits, name=name, ready=ready)

        def finish() -> Any:
            got = handle.wait(0)[0]
            if check is not None:
                check(got)
            fill_bytes(outs, got)
            return value
        return self._work(call, [handle], finish, outs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: c10d.AllToAllOptions = c10d.AllToAllOptions()) -> ShoalWork:  # noqa: B008
        """Rows ``input_split_sizes[r]`` of ``input`` to rank ``r`` (even split if empty)."""
        n = self.size()
        rows = input.shape[0] if input.dim() else input.numel()
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        if not input_split_sizes:
            if rows % n:
                raise ValueError(f"rank {self.rank()}: all_to_all_single input has {rows} rows, "
                                 f"not divisible by {n} ranks; pass input_split_sizes")
            input_split_sizes = [rows // n] * n
        st, raw = stage_bytes(input)

        def check(got: np.ndarray) -> None:
            if output_split_sizes and sum(output_split_sizes) * row_bytes != got.nbytes:
                raise ValueError(f"rank {self.rank()}: output_split_sizes "
                                 f"{output_split_sizes} do not match the "
                                 f"{got.nbytes // max(row_bytes, 1)} rows received")
        return self._exchange(raw, [int(s) * row_bytes for s in input_split_sizes], [output],
                              [output], st.ready, check)

    alltoall_base = all_to_all_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: c10d.AllToAllOptions = c10d.AllToAllOptions()) -> ShoalWork:  # noqa: B008
        """``input_tensors[r]`` to rank ``r``; ``output_tensors[r]`` from rank ``r``."""
        data, splits, ready = _packed(input_tensors)
        return self._exchange(data, splits, list(output_tensors), list(output_tensors), ready)

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor],
               opts: c10d.GatherOptions = c10d.GatherOptions()) -> ShoalWork:  # noqa: B008
        """Every rank's ``input_tensors[0]`` into ``output_tensors[0]`` on ``opts.rootRank``."""
        st, raw = stage_bytes(input_tensors[0])
        splits = [raw.nbytes if r == opts.rootRank else 0 for r in range(self.size())]
        outs = output_tensors[0] if self.rank() == opts.rootRank else []
        return self._exchange(raw, splits, outs, list(output_tensors), st.ready)

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]],
                opts: c10d.ScatterOptions = c10d.ScatterOptions()) -> ShoalWork:  # noqa: B008
        """``input_tensors[0][r]`` on ``opts.rootRank`` into ``output_tensors[0]`` on rank r."""
        ready = None
        if self.rank() == opts.rootRank:
            data, splits, ready = _packed(input_tensors[0])
        else:
            data, splits = np.empty(0, np.uint8), [0] * self.size()
        return self._exchange(data, splits, output_tensors[:1], list(output_tensors), ready)

    # -- point to point -------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> ShoalWork:
        """Send ``tensors[0]`` to rank ``dst`` (matched in order with ``dst``'s receives of
        the same tag)."""
        (tensor,) = tensors
        st, raw = stage_bytes(tensor)
        # the sending thread waits for a device tensor's copy before it reads the bytes
        handle = self._comm.send(raw, dst, tag, ready=st.ready)
        return self._p2p_work(handle, lambda: [st.tensor], tensor)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> ShoalWork:
        """Receive ``tensors[0]`` from rank ``src`` (its size must match the send's)."""
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> ShoalWork:
        """Receive ``tensors[0]`` from whichever rank sends first with ``tag``."""
        return self._recv(tensors, None, tag)

    def _recv(self, tensors: list[torch.Tensor], src: int | None, tag: int) -> ShoalWork:
        (tensor,) = tensors
        st, raw = stage_bytes(tensor, fetch=False)
        handle = self._comm.recv(raw, src, tag)

        def finish() -> list[torch.Tensor]:
            st.finish()
            return [tensor]
        return self._p2p_work(handle, finish, tensor)

    def _p2p_work(self, handle: Any, finish: Callable[[], Any],
                  tensor: torch.Tensor) -> ShoalWork:
        return ShoalWork([handle], finish, [tensor.device], self._timeout,
                         source=lambda: handle.source)


def _signature(kind: str, tensors: Sequence[torch.Tensor], *extra: Any) -> str:
    """What every rank agrees on about a call: its kind, each tensor's shape and dtype, and
    ``extra`` (the op, a root)."""
    return " ".join([kind, *map(str, extra),
                     *(f"{tuple(t.shape)}{t.dtype}" for t in tensors)])


def _premultiplied(tensor: torch.Tensor, factor: float | torch.Tensor, in_place: bool
                   ) -> tuple[torch.Tensor, float]:
    """PREMUL_SUM's factor applied: a number becomes the core's prescale; a tensor on a
    device multiplies ``tensor`` there (in place where the collective overwrites it anyway,
    else on a copy), so the host never reads it."""
    if not isinstance(factor, torch.Tensor):
        return tensor, factor
    f = factor.to(device=tensor.device, dtype=tensor.dtype)
    return (tensor.mul_(f) if in_place else tensor.mul(f)), 1.0


def _packed(tensors: Sequence[torch.Tensor]
            ) -> tuple[np.ndarray, list[int], Callable[[], None]]:
    """One buffer for the bytes of all ``tensors`` back to back, their sizes, and the
    ``ready`` that fills it: the engine thread calls it before it reads the buffer, so the
    caller neither waits for a device copy nor copies the bytes itself."""
    parts = [stage_bytes(t) for t in tensors]
    splits = [b.nbytes for _, b in parts]
    data = np.empty(sum(splits), np.uint8)

    def ready() -> None:
        at = 0
        for st, b in parts:
            if st.ready is not None:
                st.ready()
            data[at:at + b.nbytes] = b
            at += b.nbytes
    return data, splits, ready


def _advertised_host(store: Any) -> str:
    """The address peers can reach this process at: towards MASTER_ADDR, or towards the host
    of the TCPStore under ``store``; loopback for stores of one machine (FileStore,
    HashStore)."""
    host = os.environ.get("SHOAL_RENDEZVOUS_ADDR") or os.environ.get("MASTER_ADDR")
    while host is None and store is not None:
        host = getattr(store, "host", None)
        store = getattr(store, "underlying_store", None)
    return local_address(host, 0) if host else "127.0.0.1"


def _create(opts: Any, backend_options: Any = None) -> ShoalProcessGroup:
    """c10d's creator (extended API): a communicator for this group, met through the store
    torch hands over (whatever ``init_method`` or launcher made it)."""
    rank, size = int(opts.group_rank), int(opts.group_size)
    timeout = timeout_seconds(opts.timeout)
    cfg = config.load()
    if timeout:
        cfg = cfg.replace(start_timeout_s=min(cfg.start_timeout_s, timeout))
    group = str(opts.group_id or "0")
    host = cfg.hostname
    if shoal.is_initialized():  # the job's own host identities (simulated nodes in tests)
        default = shoal.communicator()
        members = [int(r) for r in opts.global_ranks_in_group] or list(range(size))
        if default.size > max(members):
            host = default.world.hosts[members[rank]]
    store: Any = C10dStore(opts.store, timeout or cfg.start_timeout_s)
    bind = cfg.bind_addr or _advertised_host(opts.store)
    closers: list[Callable[[], None]] = []
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is not None:  # torchrun's store outlives restarts: meet in a fresh one
        key = secret_bytes(cfg.secret) if cfg.secret else hashlib.sha256(
            f"shoal-torchrun:{run_id}:{os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')}".encode()).digest()  # keeps jobs apart only
        store, closers = meet_fresh(store, rank, bind, key, cfg.start_timeout_s)
    try:
        comm = Communicator.create(store, rank, size, cfg=cfg, secret=cfg.secret,
                                   hostname=host, job_id=cfg.job_id or f"torch{os.getpid()}",
                                   bind_addr=bind, closers=closers)
    except BaseException:
        for release in closers:
            release()
        raise
    pg = ShoalProcessGroup(comm, group, timeout, opts.store)
    weakref.finalize(pg, comm.close)
    return pg


def register(name: str = BACKEND) -> None:
    """Make ``name`` (``"shoal"``; the import switch adds SMDDP's ``"smddp"``) a
    ``torch.distributed`` backend name for shoal's process group (safe to call again)."""
    if name in _registered:
        return
    if name.upper() not in getattr(dist.Backend, "_plugins", {}):  # else: torch's hook
        dist.Backend.register_backend(name, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    admit_monitored_barrier(name)
    _registered.add(name)
