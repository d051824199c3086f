"""Keras-level collectives on values (arrays, tensors, variables of any Keras backend).

Horovod's ``hvd.keras.allreduce(value)`` and friends evaluate eagerly and return numpy
arrays; here each value is read as numpy (:func:`.compat.to_numpy`) and handed to the core.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

import shoal
from shoal.core.compression import Codec, Compression
from shoal.core.reduction import ReduceOp

from .compat import to_numpy

__all__ = ["allgather", "allreduce", "broadcast", "broadcast_global_variables",
           "broadcast_variables", "reducescatter"]


def _array(keras: ModuleType, value: Any) -> np.ndarray:
    array = to_numpy(keras, value)
    return array if array.flags.c_contiguous else array.copy()  # keeps 0-d arrays 0-d


def allreduce(keras: ModuleType, value: Any, name: str | None = None,
              average: bool | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: ReduceOp | None = None,
              compression: Codec = Compression.none) -> np.ndarray:
    """``value`` reduced over all ranks (Average by default), as a numpy array."""
    if average is not None and op is not None:
        raise ValueError("pass either average= (deprecated) or op=, not both")
    if op is None:
        op = ReduceOp.SUM if average is False else ReduceOp.AVERAGE
    array = _array(keras, value)
    if prescale_factor != 1.0:
        array = array * prescale_factor
    out = shoal.allreduce(array, op=ReduceOp(op), name=name, compression=compression)
    return out * postscale_factor if postscale_factor != 1.0 else out


def allgather(keras: ModuleType, value: Any, name: str | None = None) -> np.ndarray:
    """Every rank's ``value`` concatenated along dimension 0, as a numpy array."""
    return shoal.allgather(_array(keras, value), name=name)


def broadcast(keras: ModuleType, value: Any, root_rank: int,
              name: str | None = None) -> np.ndarray:
    """``root_rank``'s ``value``, as a numpy array on every rank."""
    return shoal.broadcast(np.array(_array(keras, value)), root_rank, name=name)


def reducescatter(keras: ModuleType, value: Any, name: str | None = None,
                  op: ReduceOp = ReduceOp.AVERAGE) -> np.ndarray:
    """``value`` reduced over all ranks (Average by default) and split along dimension 0:
    this rank's part, as a numpy array (the first ranks get one row more when the rows do not
    divide evenly)."""
    return shoal.reducescatter(_array(keras, value), op=ReduceOp(op), name=name)


def broadcast_global_variables(keras: ModuleType, root_rank: int) -> None:
    """Keras 2 graph code (``tf.compat.v1.disable_eager_execution()``): assign
    ``root_rank``'s values to every global variable, in the Keras session. Eager code keeps no
    global variables (Horovod refuses it too): broadcast the model's and optimizer's variables
    with ``broadcast_variables``, or use ``callbacks.BroadcastGlobalVariablesCallback``."""
    import tensorflow as tf
    if tf.executing_eagerly():
        raise RuntimeError("broadcast_global_variables() needs graph mode (Keras 2 with "
                           "tf.compat.v1.disable_eager_execution()); eagerly, call "
                           "broadcast_variables(model.variables, root_rank) or use "
                           "callbacks.BroadcastGlobalVariablesCallback(root_rank)")
    from shoal.tensorflow import broadcast_global_variables as graph_op
    # Keras 2 keeps its session in the v1 API (tf.compat.v1.keras is tf_keras's then)
    session = getattr(keras.backend, "get_session", None) or \
        tf.compat.v1.keras.backend.get_session
    session().run(graph_op(root_rank))


def broadcast_variables(keras: ModuleType, variables: Sequence[Any], root_rank: int = 0,
                        name: str | None = None) -> None:
    """Assign ``root_rank``'s values to ``variables`` (Keras variables); all travel at once.
    With ``name``, the collectives are named ``<name>.<index>``."""
    arrays = [np.array(_array(keras, v)) for v in variables]
    handles = [shoal.broadcast_async(a, root_rank, name=None if name is None else f"{name}.{i}")
               for i, a in enumerate(arrays)]
    for variable, handle in zip(variables, handles, strict=True):
        variable.assign(handle.wait())
