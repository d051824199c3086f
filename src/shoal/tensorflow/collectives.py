"""Horovod's TensorFlow collectives over the core's communicators, without gradients.

Each function here maps tensors to numpy arrays, hands them to the communicator of the
process set (resolved when the op *runs*, so a traced function survives ``shutdown()`` and
``init()``) and maps the results back, through :func:`shoal.tensorflow.bridge.run`: eagerly
now, inside ``tf.function`` as one ordered graph op named per call site. Grouped functions
submit every tensor before waiting for any, so the engine fuses them. Scaling, reduce-scatter
blocks, alltoall splits and the negotiation are the core's. :mod:`.differentiable` adds
Horovod's gradient rules and compression on top.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from shoal.core import process_sets as ps_
from shoal.core.compression import Codec, Compression
from shoal.core.reduction import ReduceOp, check_rows

from .bridge import run

__all__ = ["allgather_n", "allreduce_n", "alltoall_1", "barrier", "broadcast_n", "join",
           "reducescatter_n", "set_size"]


def _c(array: np.ndarray) -> np.ndarray:
    """``array`` C-contiguous (``np.ascontiguousarray`` would turn a scalar into shape (1,))."""
    return array if array.flags.c_contiguous else array.copy(order="C")


def _parts(base: str | None, count: int) -> list[str | None]:
    return [base] if count == 1 else [None if base is None else f"{base}.{i}"
                                      for i in range(count)]


def set_size(process_set: Any) -> int:
    """The number of ranks in ``process_set`` (this rank must be a member)."""
    return ps_.communicator_for(process_set).size


def allreduce_n(tensors: Sequence[Any], op: ReduceOp, *, prescale: float = 1.0,
                postscale: float = 1.0, codec: Codec = Compression.none,
                name: str | None = None, process_set: Any = None) -> list[tf.Tensor]:
    """Reduce dense tensors across the set, fused; Horovod's scaling."""
    def reduce(base: str | None, arrays: list[np.ndarray]) -> list[np.ndarray]:
        comm = ps_.communicator_for(process_set)
        handles = [comm.allreduce_async(_c(a), op, part, compression=codec,
                                        prescale_factor=prescale, postscale_factor=postscale)
                   for a, part in zip(arrays, _parts(base, len(arrays)), strict=True)]
        return [h.wait() for h in handles]
    return run(reduce, tensors, label="allreduce", name=name)


def allgather_n(tensors: Sequence[Any], *, name: str | None = None,
                process_set: Any = None) -> list[tf.Tensor]:
    """Each tensor concatenated along dim 0 over the set (lengths may differ)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        check_rows(t.shape.rank, "allgather", name, ps_.communicator_for(process_set).rank)

    def gather(base: str | None, arrays: list[np.ndarray]) -> list[np.ndarray]:
        comm = ps_.communicator_for(process_set)
        handles = [comm.allgather_async(_c(a), part)
                   for a, part in zip(arrays, _parts(base, len(arrays)), strict=True)]
        return [h.wait() for h in handles]
    shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in tensors]
    return run(gather, tensors, label="allgather", name=name, out_shapes=shapes)


def broadcast_n(tensors: Sequence[Any], root_rank: int, *, name: str | None = None,
                process_set: Any = None, label: str = "broadcast") -> list[tf.Tensor]:
    """Global rank ``root_rank``'s tensors, on every member of the set."""
    root = ps_.set_root(process_set, root_rank)

    def bcast(base: str | None, arrays: list[np.ndarray]) -> list[np.ndarray]:
        comm = ps_.communicator_for(process_set)
        copies = [np.array(a) for a in arrays]  # the inputs are read-only views
        handles = [comm.broadcast_async(c, root, part)
                   for c, part in zip(copies, _parts(base, len(copies)), strict=True)]
        return [h.wait() for h in handles]
    return run(bcast, tensors, label=label, name=name)


def alltoall_1(tensor: Any, splits: Any = None, *, name: str | None = None,
               process_set: Any = None) -> tuple[tf.Tensor, tf.Tensor]:
    """``(output, received_splits)``: ``splits[i]`` rows of ``tensor`` went to rank ``i``
    of the set (even division without ``splits``)."""
    tensor = tf.convert_to_tensor(tensor)
    check_rows(tensor.shape.rank, "alltoall", name, ps_.communicator_for(process_set).rank)
    inputs = [tensor]
    if splits is not None:
        splits = tf.convert_to_tensor(splits)
        if splits.dtype not in (tf.int32, tf.int64):
            raise TypeError(f"rank {ps_.communicator_for(process_set).rank}: alltoall splits "
                            f"must be int32 or int64, not {splits.dtype.name}")
        inputs.append(splits)

    def exchange(base: str | None, arrays: list[np.ndarray]) -> list[np.ndarray]:
        comm = ps_.communicator_for(process_set)
        counts = arrays[1].reshape(-1).tolist() if len(arrays) > 1 else None
        data, received = comm.alltoall(_c(arrays[0]), counts, base)
        return [data, np.asarray(received, np.int32)]
    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])
    data, received = run(exchange, inputs, label="alltoall", name=name,
                         out_dtypes=[tensor.dtype, tf.int32],
                         out_shapes=[shape, tf.TensorShape([None])])
    return data, received


def reducescatter_n(tensors: Sequence[Any], op: ReduceOp, *, prescale: float = 1.0,
                    postscale: float = 1.0, name: str | None = None,
                    process_set: Any = None) -> list[tf.Tensor]:
    """This rank's block of dim 0 of each reduction (earlier ranks get the extra rows)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        check_rows(t.shape.rank, "reducescatter", name,
                   ps_.communicator_for(process_set).rank)

    def scatter(base: str | None, arrays: list[np.ndarray]) -> list[np.ndarray]:
        comm = ps_.communicator_for(process_set)
        handles = [comm.reducescatter_async(_c(a), op, part,
                                            prescale_factor=prescale,
                                            postscale_factor=postscale)
                   for a, part in zip(arrays, _parts(base, len(arrays)), strict=True)]
        return [h.wait() for h in handles]
    shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in tensors]
    return run(scatter, tensors, label="reducescatter", name=name, out_shapes=shapes)


def join(process_set: Any = None) -> tf.Tensor:
    """This rank has no more data; until every rank joined it contributes neutral values to
    the allreduces others still run. The last rank to join (the same on every rank)."""
    def joined(base: str | None, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [np.array(ps_.communicator_for(process_set).join(), np.int32)]
    return run(joined, [tf.constant(0, tf.int32)], label="join", name=None)[0]


def barrier(process_set: Any = None) -> None:
    """Wait until every rank of the set arrives (eager code only)."""
    ps_.communicator_for(process_set).barrier()
