"""The synchronous collectives of ``shoal.torch``, differentiable with Horovod's gradient
rules: the gradient of an allreduce is the same allreduce of the gradient; of an allgather,
this rank's rows of the averaged gradient; of a broadcast, the averaged gradient on the root
and zeros elsewhere; of an alltoall, the alltoall back; of a reduce-scatter, the allgather of
the (scaled) gradient."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shoal.core.gradients import reducescatter_grad_scale
from shoal.core.process_sets import communicator_for
from shoal.core.reduction import ReduceOp, resolve_op

from . import collectives
from .compression import Compression, user_compressor

__all__ = ["allgather", "allreduce", "allreduce_", "alltoall", "broadcast", "broadcast_",
           "grouped_allgather", "grouped_allreduce", "grouped_allreduce_",
           "grouped_reducescatter", "oob_allreduce", "reducescatter"]


def _size(process_set: Any) -> int:
    return communicator_for(process_set).size


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, name, pre, post, process_set, compression):
        ctx.args = (op, pre, post, process_set, compression)
        return collectives.allreduce_now(tensor, False, name, op, pre, post, process_set,
                                         compression)

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, process_set, compression = ctx.args
        return (allreduce(grad, None, None, compression, op, pre, post, process_set),
                *[None] * 6)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, pre, post, process_set, *tensors):
        ctx.args = (op, pre, post, process_set)
        return tuple(collectives.grouped_allreduce_async(tensors, None, name, op, pre, post,
                                                         process_set).wait())

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, process_set = ctx.args
        return (*[None] * 5, *grouped_allreduce(list(grads), None, None, Compression.none, op,
                                                pre, post, process_set))


def _rows_before(dims: torch.Tensor, rank: int) -> int:
    return int(dims[:rank].sum()) if rank else 0


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        # (a scalar is refused by the allgather itself, with the fix)
        ctx.dim, ctx.process_set = tensor.shape[0] if tensor.dim() else 0, process_set
        return collectives.allgather_async(tensor, name, process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=ReduceOp.AVERAGE, process_set=ctx.process_set)
        dims = allgather(torch.tensor([ctx.dim], dtype=torch.int64),
                         process_set=ctx.process_set)
        me = communicator_for(ctx.process_set).rank
        return reduced.narrow(0, _rows_before(dims, me), ctx.dim), None, None


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(collectives.grouped_allgather_async(tensors, name, process_set).wait())

    @staticmethod
    def backward(ctx, *grads):
        reduced = grouped_allreduce(list(grads), op=ReduceOp.AVERAGE,
                                    process_set=ctx.process_set)
        dims = allgather(torch.tensor([ctx.dims], dtype=torch.int64),
                         process_set=ctx.process_set)
        me = communicator_for(ctx.process_set).rank
        return (None, None, *[r.narrow(0, _rows_before(dims[:, i], me), d)
                              for i, (r, d) in enumerate(zip(reduced, ctx.dims, strict=True))])


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root, ctx.process_set = root_rank, process_set
        return collectives.broadcast_async(tensor, root_rank, name, process_set).wait()

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=ReduceOp.AVERAGE, process_set=ctx.process_set)
        if communicator_for(None).rank != ctx.root:
            reduced = reduced * 0
        return reduced, None, None, None


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = collectives.alltoall_async(tensor, splits, name, process_set).wait()
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad, _dead):
        back, _ = collectives.alltoall_async(grad.contiguous(), ctx.received, None,
                                             ctx.process_set).wait()
        return back, None, None, None


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op, name, process_set, pre, post, *tensors):
        ctx.args = (op, process_set, pre, post)
        return tuple(collectives.grouped_reducescatter_async(tensors, name, op, process_set, pre,
                                                             post).wait())

    @staticmethod
    def backward(ctx, *grads):
        op, process_set, pre, post = ctx.args
        factor = reducescatter_grad_scale(op, _size(process_set), pre, post)
        grads = [g * factor if factor != 1 else g for g in grads]
        return (*[None] * 5, *grouped_allgather(grads, process_set=process_set))


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: ReduceOp | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> torch.Tensor:
    """A reduced copy of ``tensor`` (Average by default); differentiable."""
    op = resolve_op(average, op)
    if user_compressor(compression):
        squeezed, ctx = compression.compress(tensor)
        out = _Allreduce.apply(squeezed, op, name, prescale_factor, postscale_factor,
                               process_set, Compression.none)
        return compression.decompress(out, ctx)
    return _Allreduce.apply(tensor, op, name, prescale_factor, postscale_factor, process_set,
                            compression)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: ReduceOp | None = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Any = None) -> torch.Tensor:
    """Reduce ``tensor`` in place and return it."""
    return collectives.allreduce_now(tensor, True, name, resolve_op(average, op),
                                     prescale_factor, postscale_factor, process_set)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: ReduceOp | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: Any = None) -> list[torch.Tensor]:
    """Reduced copies of several tensors, fused; differentiable."""
    op = resolve_op(average, op)
    ctxs = None
    if user_compressor(compression):
        pairs = [compression.compress(t) for t in tensors]
        tensors, ctxs = [p[0] for p in pairs], [p[1] for p in pairs]
    out = list(_GroupedAllreduce.apply(op, name, prescale_factor, postscale_factor,
                                       process_set, *tensors))
    return out if ctxs is None else [compression.decompress(t, c)
                                     for t, c in zip(out, ctxs, strict=True)]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: ReduceOp | None = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = None) -> list[torch.Tensor]:
    """Reduce several tensors in place."""
    return collectives.grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set).wait()


def oob_allreduce(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """SMDDP's out-of-band allreduce for statistics (loss, accuracy): the average, as a copy."""
    return collectives.allreduce_async(tensor.detach(), op=ReduceOp.AVERAGE, name=name).wait()


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0 (sizes may differ); differentiable."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: Any = None) -> list[torch.Tensor]:
    """:func:`allgather` of several tensors."""
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = None) -> torch.Tensor:
    """A copy of global rank ``root_rank``'s ``tensor``; differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = None) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s values and return it."""
    return collectives.broadcast_async_(tensor, root_rank, name, process_set).wait()


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = None) -> Any:
    """Send ``splits[i]`` rows to rank i, receive theirs; ``(output, received_splits)`` when
    ``splits`` is given, else the output alone (Horovod's return); differentiable."""
    output, received = _Alltoall.apply(tensor, splits, name, process_set)
    return output if splits is None else (output, received)


def reducescatter(tensor: torch.Tensor, name: str | None = None,
                  compression: Any = Compression.none, op: ReduceOp = ReduceOp.AVERAGE,
                  process_set: Any = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's block of dim 0 of the reduction; differentiable."""
    return grouped_reducescatter([tensor], name, compression, op, process_set,
                                 prescale_factor, postscale_factor)[0]


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: Any = Compression.none,
                          op: ReduceOp = ReduceOp.AVERAGE, process_set: Any = None,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` of several tensors."""
    ctxs = None
    if user_compressor(compression):
        pairs = [compression.compress(t) for t in tensors]
        tensors, ctxs = [p[0] for p in pairs], [p[1] for p in pairs]
    out = list(_Reducescatter.apply(op, name, process_set, prescale_factor, postscale_factor,
                                    *tensors))
    return out if ctxs is None else [compression.decompress(t, c)
                                     for t, c in zip(out, ctxs, strict=True)]
