"""Horovod's TensorFlow collectives over shoal's engine, for eager code and ``tf.function``.

Every collective is one numpy function handed to :func:`shoal.tensorflow.bridge.run`, which
runs it eagerly or as a graph op with a name fixed per call site. ``grouped_allreduce``
submits all its tensors before waiting for any, so the engine fuses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import shoal
from shoal.core.compression import Codec, Compression
from shoal.core.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    no_process_sets,
    resolve_op,
)

from .bridge import run

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Max",
    "Min",
    "Product",
    "ReduceOp",
    "Sum",
    "allgather",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "grouped_allreduce",
    "oob_allreduce",
    "reduction",
]


def reduction(op: ReduceOp | None, average: bool | None = None,
              gradient_predivide_factor: float = 1.0) -> tuple[ReduceOp, float, float]:
    """``(op, prescale, postscale)`` for Horovod's ways of asking for a reduction: ``op=``,
    the deprecated ``average=``, and ``gradient_predivide_factor`` (divide by ``f`` before
    summing and by ``size / f`` after, to keep half-precision sums in range)."""
    op = resolve_op(average, op)
    if gradient_predivide_factor == 1.0:
        return op, 1.0, 1.0
    if op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor only applies to op=Average")
    return ReduceOp.SUM, 1.0 / gradient_predivide_factor, \
        gradient_predivide_factor / shoal.size()


def _scale(tensors: Sequence[Any], factor: float) -> list[tf.Tensor]:
    return [t if factor == 1.0 else t * tf.cast(factor, t.dtype) for t in tensors]


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: Codec = Compression.none, op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, process_set: Any = None) -> list[tf.Tensor]:
    """Reduce several tensors across ranks (Average by default), fused by the engine.

    ``IndexedSlices`` are reduced as dense tensors. ``device_*`` are accepted for Horovod
    compatibility and ignored (reductions run on the host).
    """
    no_process_sets(process_set)
    op, pre, post = reduction(op, average)
    pre, post = pre * prescale_factor, post * postscale_factor
    grouped = len(tensors) != 1

    def reduce(base: str | None, arrays: list[np.ndarray]) -> list[np.ndarray]:
        handles = [shoal.allreduce_async(a, op=op, compression=compression,
                                         name=f"{base}.{i}" if base and grouped else base)
                   for i, a in enumerate(arrays)]
        return [h.wait() for h in handles]

    tensors = _scale([tf.convert_to_tensor(t) for t in tensors], pre)
    return _scale(run(reduce, tensors, label="allreduce", name=name), post)


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Codec = Compression.none,
              op: ReduceOp | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: Any = None) -> tf.Tensor:
    """``tensor`` reduced across all ranks (Average by default), as a new tensor."""
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op,
                             prescale_factor, postscale_factor, name, process_set)[0]


def oob_allreduce(tensor: Any, name: str | None = None) -> tf.Tensor:
    """SMDDP's out-of-band allreduce for statistics (loss, accuracy): the average."""
    return allreduce(tensor, op=ReduceOp.AVERAGE, name=name)


def allgather(tensor: Any, name: str | None = None, process_set: Any = None) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0 (lengths may differ)."""
    no_process_sets(process_set)
    tensor = tf.convert_to_tensor(tensor)
    if tensor.shape.rank == 0:
        raise ValueError("allgather needs a tensor with at least one dimension; reshape a "
                         "scalar to [1]")

    def gather(base: str | None, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return [shoal.allgather(np.ascontiguousarray(arrays[0]), name=base)]

    shape = tf.TensorShape([None]).concatenate(tensor.shape[1:])
    return run(gather, [tensor], label="allgather", name=name, out_shapes=[shape])[0]


def _broadcast_all(tensors: Sequence[Any], root_rank: int, name: str | None,
                   label: str) -> list[tf.Tensor]:
    grouped = len(tensors) != 1

    def bcast(base: str | None, arrays: list[np.ndarray]) -> list[np.ndarray]:
        copies = [np.array(a) for a in arrays]  # the inputs are read-only views
        handles = [shoal.broadcast_async(c, root_rank,
                                         name=f"{base}.{i}" if base and grouped else base)
                   for i, c in enumerate(copies)]
        return [h.wait() for h in handles]

    return run(bcast, tensors, label=label, name=name)


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              process_set: Any = None) -> tf.Tensor:
    """``root_rank``'s ``tensor``, on every rank."""
    no_process_sets(process_set)
    return _broadcast_all([tensor], root_rank, name, "broadcast")[0]


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0,
                        name: str | None = None, process_set: Any = None) -> Any:
    """Overwrite ``variables`` with ``root_rank``'s values; all travel together.

    Eagerly the assignment is done on return; in a graph the grouped assignment op is
    returned (``tf.function`` runs it).
    """
    no_process_sets(process_set)
    variables = list(variables)
    values = _broadcast_all([tf.convert_to_tensor(v) for v in variables], root_rank, name,
                            "broadcast_variables")
    assigns = [v.assign(x) for v, x in zip(variables, values, strict=True)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None) -> Any:
    """A picklable object sent from ``root_rank`` to every rank (eager code only)."""
    no_process_sets(process_set)
    return shoal.broadcast_object(obj, root_rank, name=name)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every rank's picklable object, in rank order (eager code only)."""
    no_process_sets(process_set)
    return shoal.allgather_object(obj, name=name)


def barrier(process_set: Any = None) -> None:
    """Wait until every rank arrives (eager code only)."""
    no_process_sets(process_set)
    shoal.barrier()

