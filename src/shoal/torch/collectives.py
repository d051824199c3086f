"""Horovod's PyTorch collectives over shoal's communicators.

Naming rule, stated once (Horovod's): a trailing ``_`` works in place, ``_async`` returns a
handle at once (``synchronize(handle)`` waits and returns the result, ``poll(handle)`` says
whether it is done), ``grouped_`` takes a list. Everything framework-agnostic (process sets,
join, scaling, reduce-scatter, negotiation) is the core's; this module maps tensors to numpy
views and back, and adds autograd with Horovod's gradient rules (:mod:`.differentiable`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from shoal.core import process_sets as ps_
from shoal.core.collectives import Handle
from shoal.core.gradients import sparse_scale
from shoal.core.reduction import ReduceOp, check_rows, resolve_op

from .compression import Compression, wire_codec
from .tensors import Staged, reduce_now, result_tensor, stage

__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "ReduceOp", "Sum", "TorchHandle",
    "allgather_async", "allreduce_async", "allreduce_async_", "allreduce_now",
    "alltoall_async", "barrier",
    "broadcast_async", "broadcast_async_", "grouped_allgather_async",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter_async",
    "join", "poll", "reducescatter_async", "sparse_allreduce_async", "synchronize",
]

Average, Sum, Min, Max, Product, Adasum = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.MIN,
                                           ReduceOp.MAX, ReduceOp.PRODUCT, ReduceOp.ADASUM)


class TorchHandle:
    """What the ``_async`` functions return; pass it to :func:`synchronize` / :func:`poll`."""

    def __init__(self, handles: Sequence[Handle], finish: Callable[[list[Any]], Any]) -> None:
        self.handles = list(handles)
        self._finish = finish
        self._result: Any = None
        self._done = False

    def done(self) -> bool:
        """True once every part has completed (results are written back by :meth:`wait`)."""
        return all(h.done() for h in self.handles)

    def wait(self) -> Any:
        """Wait, write results back; return the tensor(s)."""
        if not self._done:
            self._result = self._finish([h.wait() for h in self.handles])
            self._done = True
        return self._result


def _results(results: list[np.ndarray], tensors: Sequence[torch.Tensor],
             staged: Sequence[Staged], grouped: bool) -> Any:
    """New result arrays from the core as tensors on their inputs' devices."""
    out = [result_tensor(r, t, s.bf16) for r, t, s in zip(results, tensors, staged, strict=True)]
    return out if grouped else out[0]


def _parts(name: str | None, count: int) -> list[str | None]:
    return [None if name is None else f"{name}.{i}" for i in range(count)] if count > 1 \
        else [name]


# -- allreduce -----------------------------------------------------------------------------------
def _allreduce_async(tensors: Sequence[torch.Tensor], inplace: bool, name: str | None,
                     op: ReduceOp, prescale: float, postscale: float, compression: Any,
                     process_set: Any, grouped: bool) -> TorchHandle:
    comm = ps_.communicator_for(process_set)
    codec = wire_codec(compression)
    staged, handles = [], []
    for t, part in zip(tensors, _parts(name, len(tensors)) if grouped else [name],
                       strict=True):
        s = stage(t, copy=not inplace)
        handles.append(comm.allreduce_async(s.array, op, part, out=s.array, compression=codec,
                                            bf16=s.bf16, prescale_factor=prescale,
                                            postscale_factor=postscale, ready=s.ready))
        staged.append(s)

    def finish(_: list[Any]) -> Any:
        out = [s.finish() for s in staged]
        return out if grouped else out[0]
    return TorchHandle(handles, finish)


def allreduce_now(tensor: torch.Tensor, inplace: bool, name: str | None, op: ReduceOp,
                  prescale: float = 1.0, postscale: float = 1.0, process_set: Any = None,
                  compression: Any = Compression.none) -> torch.Tensor:
    """Reduce ``tensor`` (in place, or a copy) and return the result: the synchronous calls.
    A named host tensor on one host, unscaled and uncompressed, takes the core's one-round
    path of small messages (its handle and the engine thread's hand-offs cost a 4 KiB
    allreduce 60 us against 5); anything else goes the asynchronous way and waits."""
    if prescale != 1.0 or postscale != 1.0 or op == ReduceOp.ADASUM or \
            wire_codec(compression).name != "none":
        return _allreduce_async([tensor], inplace, name, op, prescale, postscale,
                                compression, process_set, False).wait()
    staged = stage(tensor, copy=not inplace)
    reduce_now(ps_.communicator_for(process_set), staged, op, name)
    return staged.finish()


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: ReduceOp | None = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0, process_set: Any = None,
                    compression: Any = Compression.none) -> TorchHandle:
    """Start reducing a copy of ``tensor`` across ranks (Average by default)."""
    return _allreduce_async([tensor], False, name, resolve_op(average, op), prescale_factor,
                            postscale_factor, compression, process_set, False)


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: ReduceOp | None = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, process_set: Any = None,
                     compression: Any = Compression.none) -> TorchHandle:
    """Start reducing ``tensor`` in place."""
    return _allreduce_async([tensor], True, name, resolve_op(average, op), prescale_factor,
                            postscale_factor, compression, process_set, False)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None,
                            name: str | None = None, op: ReduceOp | None = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = None,
                            compression: Any = Compression.none) -> TorchHandle:
    """Start reducing copies of several tensors together (they are fused)."""
    return _allreduce_async(list(tensors), False, name, resolve_op(average, op),
                            prescale_factor, postscale_factor, compression, process_set, True)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: ReduceOp | None = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None,
                             compression: Any = Compression.none) -> TorchHandle:
    """Start reducing several tensors in place, together."""
    return _allreduce_async(list(tensors), True, name, resolve_op(average, op),
                            prescale_factor, postscale_factor, compression, process_set, True)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: ReduceOp | None,
                           process_set: Any = None) -> Callable[[], torch.Tensor]:
    """Reduce a sparse COO tensor as Horovod does: allgather its indices and values (the
    result is uncoalesced; duplicates sum). Returns a function that waits and returns it."""
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    comm = ps_.communicator_for(process_set)
    scale = sparse_scale(resolve_op(None, op), comm.size, rank=comm.rank)
    name = name or None
    indices = allgather_async(t.indices().transpose(0, 1).contiguous(),
                              None if name is None else f"{name}.indices", process_set)
    values = allgather_async(t.values().contiguous(),
                             None if name is None else f"{name}.values", process_set)

    def result() -> torch.Tensor:
        vals, idx = synchronize(values), synchronize(indices)
        if scale != 1.0:
            vals = vals * scale
        return torch.sparse_coo_tensor(idx.transpose(0, 1), vals, t.size())
    return result


# -- allgather -----------------------------------------------------------------------------------
def _allgather_async(tensors: Sequence[torch.Tensor], name: str | None, process_set: Any,
                     grouped: bool) -> TorchHandle:
    comm = ps_.communicator_for(process_set)
    staged: list[Staged] = [stage(t) for t in tensors]
    for t in tensors:
        check_rows(t.dim(), "allgather", name, comm.rank)
    handles = [comm.allgather_async(s.array, part, ready=s.ready) for s, part in
               zip(staged, _parts(name, len(tensors)) if grouped else [name], strict=True)]

    return TorchHandle(handles, lambda results: _results(results, tensors, staged, grouped))


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: Any = None) -> TorchHandle:
    """Start concatenating every rank's tensor along dim 0 (sizes may differ)."""
    return _allgather_async([tensor], name, process_set, False)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: Any = None) -> TorchHandle:
    """Start allgathering several tensors."""
    return _allgather_async(list(tensors), name, process_set, True)


# -- broadcast -----------------------------------------------------------------------------------
def _broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None, process_set: Any,
                     inplace: bool) -> TorchHandle:
    comm = ps_.communicator_for(process_set)
    root = ps_.set_root(process_set, root_rank)
    s = stage(tensor, copy=not inplace)
    return TorchHandle([comm.broadcast_async(s.array, root, name, ready=s.ready)],
                       lambda _: s.finish())


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = None) -> TorchHandle:
    """Start broadcasting ``root_rank``'s ``tensor`` into a copy (``root_rank`` is global)."""
    return _broadcast_async(tensor, root_rank, name, process_set, False)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = None) -> TorchHandle:
    """Start overwriting ``tensor`` with ``root_rank``'s values, in place."""
    return _broadcast_async(tensor, root_rank, name, process_set, True)


# -- alltoall and reducescatter --------------------------------------------------------------
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = None) -> TorchHandle:
    """Start an alltoall; resolves to ``(output, received_splits)``."""
    comm = ps_.communicator_for(process_set)
    if isinstance(splits, torch.Tensor):
        if splits.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"rank {comm.rank}: alltoall splits must be an int32 or int64 "
                             f"tensor, not {splits.dtype}")
        splits = splits.tolist()
    check_rows(tensor.dim(), "alltoall", name, comm.rank)
    s = stage(tensor)

    def finish(results: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        data, recv = results[0]
        return result_tensor(data, tensor, s.bf16), torch.from_numpy(recv.astype(np.int32))
    return TorchHandle([comm.alltoall_async(s.array, splits, name, ready=s.ready)], finish)


def _reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None, op: ReduceOp,
                         process_set: Any, prescale: float, postscale: float,
                         grouped: bool) -> TorchHandle:
    comm = ps_.communicator_for(process_set)
    staged = [stage(t) for t in tensors]
    handles = [comm.reducescatter_async(s.array, op, part, bf16=s.bf16, prescale_factor=prescale,
                                        postscale_factor=postscale, ready=s.ready)
               for s, part in zip(staged, _parts(name, len(tensors)) if grouped else [name],
                                  strict=True)]

    return TorchHandle(handles, lambda results: _results(results, tensors, staged, grouped))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: ReduceOp = Average,
                        process_set: Any = None, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> TorchHandle:
    """Start a reduce-scatter: this rank's block of dim 0 of the reduction."""
    return _reducescatter_async([tensor], name, op, process_set, prescale_factor,
                                postscale_factor, False)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                                op: ReduceOp = Average, process_set: Any = None,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> TorchHandle:
    """Start reduce-scattering several tensors."""
    return _reducescatter_async(list(tensors), name, op, process_set, prescale_factor,
                                postscale_factor, True)


# -- waiting, joining, barriers ----------------------------------------------------------------
def synchronize(handle: TorchHandle) -> Any:
    """Wait for an ``_async`` handle; return its result."""
    return handle.wait()


def poll(handle: TorchHandle) -> bool:
    """Whether an ``_async`` handle has completed (then :func:`synchronize` does not block)."""
    return handle.done()


def barrier(process_set: Any = None) -> None:
    """Wait until every rank of the process set arrives."""
    ps_.communicator_for(process_set).barrier()


def join(device: int = -1) -> int:
    """This rank has no more data: until every rank has joined, it contributes zeros to the
    allreduces the others still run. Returns the last rank to join (the same everywhere)."""
    return ps_.communicator_for(None).join()
