"""The rest of Horovod's TensorFlow surface: the ``*_op`` tensors, broadcasting variables
in place, objects, ``join``, SMDDP's ``oob_allreduce`` and the compressors."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

import shoal.core.api as api
from shoal.core import process_sets as ps_
from shoal.core.compression import Compressor as CoreCompressor
from shoal.core.compression import compressors
from shoal.core.reduction import ReduceOp

from . import collectives
from .differentiable import allreduce

__all__ = ["Compression", "Compressor", "allgather_object", "broadcast_", "broadcast_object",
           "broadcast_object_fn", "broadcast_variables", "join", "local_rank_op",
           "local_size_op", "oob_allreduce", "process_set_included_op", "rank_op", "size_op"]


class Compressor(CoreCompressor):
    """A wire codec with Horovod's interface, for TensorFlow tensors."""

    def _logical(self, tensor: Any) -> str:
        return tf.as_dtype(tensor.dtype).name

    def _cast(self, tensor: Any, dtype: str) -> Any:
        return tf.cast(tensor, dtype)


Compression = compressors(Compressor)


def _value_op(value: Callable[[], int], name: str | None) -> tf.Tensor:
    """An int32 scalar read when the op runs (eagerly: now)."""
    if tf.executing_eagerly():
        return tf.constant(value(), tf.int32, name=name)
    out = tf.numpy_function(lambda: np.int32(value()), [], tf.int32, stateful=True,
                            name=name or "shoal_value")
    out.set_shape([])
    return out


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of ranks of a process set, as a tensor read when the op runs."""
    return _value_op(lambda: int(ps_.process_set_by_id(process_set_id).size()), name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this rank belongs to the process set, else 0, as a tensor."""
    return _value_op(lambda: int(bool(ps_.process_set_by_id(process_set_id).included())), name)


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, as a tensor."""
    return _value_op(api.rank, name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its host, as a tensor."""
    return _value_op(api.local_rank, name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of ranks on this host, as a tensor."""
    return _value_op(api.local_size, name)


def broadcast_(variables: Sequence[Any], root_rank: int, name: str | None = None,
               process_set: Any = ps_.global_process_set) -> list[Any]:
    """Horovod's in-place broadcast: ``root_rank``'s values assigned to ``variables`` (all
    travel together); returns the variables' new values."""
    variables = list(variables)
    values = collectives.broadcast_n([tf.convert_to_tensor(v) for v in variables], root_rank,
                                     name=name, process_set=process_set, label="broadcast_")
    return [v.assign(x) for v, x in zip(variables, values, strict=True)]


def broadcast_variables(variables: Sequence[Any], root_rank: int = 0, name: str | None = None,
                        process_set: Any = ps_.global_process_set,
                        inplace: bool = False) -> Any:
    """:func:`broadcast_`, Horovod's older spelling: eagerly the assignment is done on
    return; in a graph the grouped assignment op is returned."""
    assigns = broadcast_(variables, root_rank, name, process_set)
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: Any = ps_.global_process_set) -> Any:
    """A picklable object from global rank ``root_rank`` on every rank (eager code)."""
    return ps_.communicator_for(process_set).broadcast_object(
        obj, ps_.set_root(process_set, root_rank), name=name)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: Any = ps_.global_process_set) -> Callable[[Any], Any]:
    """A function that broadcasts its argument from ``root_rank`` (Horovod's helper)."""
    return lambda obj: broadcast_object(obj, root_rank, session, name, process_set)


def allgather_object(obj: Any, session: Any = None, name: str | None = None,
                     process_set: Any = ps_.global_process_set) -> list[Any]:
    """Every member's picklable object, in rank order (eager code)."""
    return ps_.communicator_for(process_set).allgather_object(obj, name=name)


def join(process_set: Any = ps_.global_process_set) -> tf.Tensor:
    """This rank has no more data: until every rank joined, it contributes neutral values to
    the allreduces the others still run. Returns the last rank to join."""
    return collectives.join(process_set)


def oob_allreduce(tensor: Any, name: str | None = None) -> tf.Tensor:
    """SMDDP's out-of-band allreduce for statistics (loss, accuracy): the average."""
    return allreduce(tf.stop_gradient(tensor), op=ReduceOp.AVERAGE, name=name)
