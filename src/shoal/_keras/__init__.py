"""One Keras implementation, served under both ``shoal.keras`` and ``shoal.tensorflow.keras``.

Horovod's arrangement: everything Keras-specific is written once, in this package, and
parametrised by the Keras module it serves (``import keras``, or ``tf.keras``, which is the
same Keras 3 under TensorFlow 2.16+). :func:`install` fills an import path's namespace with
that module's API; the two public packages are a few lines each.

* ``optimizer``: ``DistributedOptimizer`` (a real subclass of the wrapped optimizer's class)
  and ``PartialDistributedOptimizer``,
* ``callbacks``: Horovod's four callbacks, bound to the module's ``Callback`` base,
* ``values``: eager collectives on Keras values, returning numpy arrays.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, MutableMapping
from types import ModuleType
from typing import Any

import shoal.core.api as _api
from shoal.core import process_sets as _process_sets
from shoal.core import reduction as _reduction
from shoal.core.compression import Compression
from shoal.tensorflow import device as _tf_device

from . import values
from .callbacks import make_callbacks
from .optimizer import (
    create_distributed_optimizer,
    create_partial_distributed_optimizer,
    load_model,
)

__all__ = ["bind", "install"]

_SHARED: dict[str, Any] = {  # the same objects on every import path
    "Compression": Compression,
    **{name: getattr(_reduction, name) for name in ("Adasum", "Average", "Max", "Min", "Product",
                                               "ReduceOp", "Sum")},
    **{name: getattr(_api, name) for name in (
        "allgather_object", "broadcast_object", "cross_rank", "cross_size",
        "is_initialized", "local_rank", "local_size", "rank", "shutdown", "size")},
    **{name: getattr(_process_sets, name) for name in (
        "ProcessSet", "add_process_set", "global_process_set", "remove_process_set")},
    "init": _tf_device.init,  # joins the job, then one GPU per process (Horovod's recipe)
}


def _bound(fn: Callable[..., Any], keras: ModuleType, name: str | None = None
           ) -> Callable[..., Any]:
    """``fn`` with its first parameter (the Keras module) filled in, keeping its name, doc
    and (shortened) signature for ``help()``."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(keras, *args, **kwargs)

    sig = inspect.signature(fn)
    call.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
    if name:
        call.__name__ = call.__qualname__ = name
    return call


@functools.cache
def bind(keras: ModuleType) -> dict[str, dict[str, Any]]:
    """The API for one Keras module: ``{"api": {...}, "callbacks": {...}}``."""
    api = dict(_SHARED)
    api["DistributedOptimizer"] = _bound(create_distributed_optimizer, keras,
                                         "DistributedOptimizer")
    api["PartialDistributedOptimizer"] = _bound(create_partial_distributed_optimizer, keras,
                                                "PartialDistributedOptimizer")
    for fn in (values.allreduce, values.allgather, values.broadcast, values.reducescatter,
               values.broadcast_variables, values.broadcast_global_variables, load_model):
        api[fn.__name__] = _bound(fn, keras)
    return {"api": api, "callbacks": dict(make_callbacks(keras))}


def install(keras: ModuleType, namespace: MutableMapping[str, Any], part: str = "api"
            ) -> list[str]:
    """Put ``keras``'s API (``part``: ``"api"`` or ``"callbacks"``) into a module's
    namespace; returns the names, for its ``__all__``."""
    names = bind(keras)[part]
    namespace.update(names)
    return sorted(names)
