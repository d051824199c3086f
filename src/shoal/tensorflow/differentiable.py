"""Horovod's public TensorFlow collectives: signatures, compression, ``IndexedSlices`` and
Horovod's gradient rules (``tf.custom_gradient``), over the collectives of :mod:`.collectives`.

Gradient rules, as Horovod registers them: an allreduce's gradient is the same allreduce of
the gradient (op and scaling included); an allgather's, this rank's rows of the averaged
gradient; a broadcast's, the averaged gradient on the root and zeros elsewhere; an
alltoall's, the alltoall back with the received splits; a reduce-scatter's, the allgather of
the gradient (times the set's size for Sum, times the scale factors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from shoal.core import process_sets as ps_
from shoal.core.compression import Compression, user_compressor, wire_codec
from shoal.core.gradients import reducescatter_grad_scale, sparse_scale
from shoal.core.reduction import ReduceOp, resolve_op

from . import collectives

__all__ = ["allgather", "allreduce", "alltoall", "broadcast", "grouped_allgather",
           "grouped_allreduce", "grouped_reducescatter", "reducescatter"]

_global = ps_.global_process_set


def _differentiable(forward: Any, backward: Any, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
    """``forward(tensors)`` with ``backward(upstream grads) -> input grads`` as its gradient;
    integer tensors (no gradient) go straight through ``forward``."""
    if not tensors or not all(t.dtype.is_floating or t.dtype.is_complex for t in tensors):
        return forward(tensors)

    @tf.custom_gradient
    def call(*xs: tf.Tensor) -> Any:
        outs = forward(list(xs))

        def grad(*upstream: tf.Tensor) -> list[tf.Tensor]:
            return backward([tf.zeros_like(o) if g is None else g
                             for g, o in zip(upstream, outs, strict=True)])
        return outs, grad
    return list(call(*tensors))


def _compress(compression: Any, tensors: list[tf.Tensor]) -> tuple[list[tf.Tensor], Any]:
    if not user_compressor(compression):
        return tensors, None
    pairs = [compression.compress(t) for t in tensors]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _decompress(compression: Any, tensors: list[tf.Tensor], ctxs: Any) -> list[tf.Tensor]:
    return tensors if ctxs is None else [compression.decompress(t, c)
                                         for t, c in zip(tensors, ctxs, strict=True)]


def _sparse(t: Any, op: ReduceOp, pre: float, post: float, process_set: Any
            ) -> tf.IndexedSlices:
    """Horovod's reduction of ``IndexedSlices``: allgather the values and indices."""
    size = collectives.set_size(process_set)
    sparse_scale(op, size, what="a tf.IndexedSlices")  # refuses what a gather cannot do
    if pre != 1.0 or post != 1.0:  # (Horovod's TensorFlow refuses them here)
        raise NotImplementedError("prescale_factor/postscale_factor are not supported with "
                                  "tf.IndexedSlices; pass sparse_as_dense=True")
    values, indices = collectives.allgather_n([t.values, t.indices], process_set=process_set)
    if op == ReduceOp.AVERAGE:
        # Horovod divides by the size: integer values come back as floats (true division),
        # where a factor cast to their type would zero them
        values = values / tf.cast(size, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=t.dense_shape)


def grouped_allreduce(tensors: Sequence[Any], average: bool | None = None,
                      device_dense: str = "", device_sparse: str = "",
                      compression: Any = Compression.none, op: ReduceOp | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: Any = _global, ignore_name_scope: bool = False,
                      name: str | None = None) -> list[Any]:
    """Several tensors reduced across the process set (Average by default), fused by the
    engine; ``IndexedSlices`` entries are reduced as Horovod does (two allgathers).
    ``device_*`` and ``ignore_name_scope`` are accepted for Horovod compatibility."""
    op = resolve_op(average, op)
    tensors = list(tensors)
    sparse = {i: _sparse(t, op, prescale_factor, postscale_factor, process_set)
              for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)}
    dense_at = [i for i in range(len(tensors)) if i not in sparse]
    dense, ctxs = _compress(compression, [tf.convert_to_tensor(tensors[i]) for i in dense_at])
    codec = wire_codec(compression)

    def forward(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        return collectives.allreduce_n(xs, op, prescale=prescale_factor, postscale=postscale_factor,
                                       codec=codec, name=name, process_set=process_set)

    def backward(grads: list[tf.Tensor]) -> list[tf.Tensor]:
        return collectives.allreduce_n(grads, op, prescale=prescale_factor,
                                       postscale=postscale_factor, process_set=process_set)

    reduced = _decompress(compression, _differentiable(forward, backward, dense), ctxs)
    out: list[Any] = [None] * len(tensors)
    for i, r in zip(dense_at, reduced, strict=True):
        out[i] = r
    for i, s in sparse.items():
        out[i] = s
    return out


def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "",
              device_sparse: str = "", compression: Any = Compression.none,
              op: ReduceOp | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None,
              process_set: Any = _global, ignore_name_scope: bool = False) -> Any:
    """``tensor`` reduced across the process set (Average by default), as a new tensor."""
    return grouped_allreduce([tensor], average, device_dense, device_sparse, compression, op,
                             prescale_factor, postscale_factor, process_set, name=name)[0]


def grouped_allgather(tensors: Sequence[Any], name: str | None = None,
                      ignore_name_scope: bool = False,
                      process_set: Any = _global) -> list[tf.Tensor]:
    """Each tensor concatenated along dim 0 across the set (lengths may differ)."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]

    def forward(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        return collectives.allgather_n(xs, name=name, process_set=process_set)

    def backward(grads: list[tf.Tensor]) -> list[tf.Tensor]:
        reduced = [collectives.allreduce_n([g], ReduceOp.AVERAGE, process_set=process_set)[0]
                   for g in grads]
        rows = tf.stack([tf.shape(t, out_type=tf.int64)[0] for t in tensors])
        every = tf.reshape(collectives.allgather_n([tf.reshape(rows, [1, -1])],
                                                   process_set=process_set)[0], [-1, len(tensors)])
        me = ps_.communicator_for(process_set).rank
        start = tf.reduce_sum(every[:me], axis=0)
        return [r[start[i]:start[i] + rows[i]] for i, r in enumerate(reduced)]

    return _differentiable(forward, backward, tensors)


def allgather(tensor: Any, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = _global) -> tf.Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 (lengths may differ)."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]


def broadcast(tensor: Any, root_rank: int, name: str | None = None,
              ignore_name_scope: bool = False, process_set: Any = _global) -> tf.Tensor:
    """Global rank ``root_rank``'s ``tensor`` on every member of the set."""
    def forward(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        return collectives.broadcast_n(xs, root_rank, name=name, process_set=process_set)

    def backward(grads: list[tf.Tensor]) -> list[tf.Tensor]:
        reduced = collectives.allreduce_n(grads, ReduceOp.AVERAGE, process_set=process_set)
        on_root = ps_.communicator_for(None).rank == root_rank
        return reduced if on_root else [r * 0 for r in reduced]

    return _differentiable(forward, backward, [tf.convert_to_tensor(tensor)])[0]


def alltoall(tensor: Any, splits: Any = None, name: str | None = None,
             ignore_name_scope: bool = False, process_set: Any = _global) -> Any:
    """``splits[i]`` rows of ``tensor`` go to rank ``i`` of the set; returns
    ``(output, received_splits)``, or without ``splits`` (an even division) the output alone,
    as Horovod does; differentiable."""
    tensor = tf.convert_to_tensor(tensor)
    received: list[tf.Tensor] = []

    def forward(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        data, recv = collectives.alltoall_1(xs[0], splits, name=name, process_set=process_set)
        received.append(recv)
        return [data]

    def backward(grads: list[tf.Tensor]) -> list[tf.Tensor]:
        return [collectives.alltoall_1(grads[0], received[-1], process_set=process_set)[0]]

    data = _differentiable(forward, backward, [tensor])[0]
    return data if splits is None else (data, received[-1])


def grouped_reducescatter(tensors: Sequence[Any], device_dense: str = "",
                          compression: Any = Compression.none,
                          op: ReduceOp = ReduceOp.AVERAGE, name: str | None = None,
                          process_set: Any = _global, ignore_name_scope: bool = False,
                          prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[tf.Tensor]:
    """This rank's block of dim 0 of each reduction (earlier ranks get the extra rows)."""
    op = ReduceOp(op)
    tensors, ctxs = _compress(compression, [tf.convert_to_tensor(t) for t in tensors])

    def forward(xs: list[tf.Tensor]) -> list[tf.Tensor]:
        return collectives.reducescatter_n(xs, op, prescale=prescale_factor,
                                           postscale=postscale_factor, name=name,
                                           process_set=process_set)

    def backward(grads: list[tf.Tensor]) -> list[tf.Tensor]:
        factor = reducescatter_grad_scale(op, collectives.set_size(process_set), prescale_factor,
                                          postscale_factor)
        grads = [g if factor == 1 else g * tf.cast(factor, g.dtype) for g in grads]
        return [collectives.allgather_n([g], process_set=process_set)[0] for g in grads]

    return _decompress(compression, _differentiable(forward, backward, tensors), ctxs)


def reducescatter(tensor: Any, device_dense: str = "", compression: Any = Compression.none,
                  op: ReduceOp = ReduceOp.AVERAGE, name: str | None = None,
                  process_set: Any = _global, ignore_name_scope: bool = False,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> tf.Tensor:
    """This rank's block of dim 0 of ``tensor`` reduced across the set."""
    return grouped_reducescatter([tensor], device_dense, compression, op, name, process_set,
                                 ignore_name_scope, prescale_factor, postscale_factor)[0]
