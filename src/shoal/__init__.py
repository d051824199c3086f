"""shoal: fast data-parallel training.

The framework-agnostic API works on numpy arrays::

    import shoal
    shoal.init()
    grads = shoal.allreduce(grads)            # average across all ranks

Framework adapters live in ``shoal.torch``, ``shoal.tensorflow`` and ``shoal.keras``; the
launcher is ``shoalrun``.
"""

from __future__ import annotations

import importlib
from typing import Any

# The names below are loaded on first use (PEP 562): ``import shoal`` is then cheap, so that
# torch can run shoal's backend hook (:mod:`shoal._torch_hook`) at every ``import torch``
# without bringing in the core.
_LAZY = {
    "core.api": ("Handle", "allgather", "allgather_async", "allgather_object", "allreduce",
                 "allreduce_async", "alltoall", "alltoall_async", "barrier", "broadcast",
                 "broadcast_async", "broadcast_object", "communicator", "cross_rank",
                 "cross_size", "init", "is_homogeneous", "is_initialized", "join", "local_rank",
                 "local_size", "rank", "reducescatter", "reducescatter_async", "shutdown",
                 "size", "timeline_range", "world"),
    "core.errors": ("CollectiveMismatchError", "PeerLostError", "RendezvousError",
                    "ShoalError", "ShoalTimeoutError"),
    "core.reduction": ("Adasum", "Average", "Max", "Min", "Product", "ReduceOp", "Sum"),
    "core.process_sets": ("ProcessSet", "add_process_set", "global_process_set",
                          "remove_process_set"),
    "runner.func": ("run",),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"shoal.{module}"), name)
    globals()[name] = value  # found once; later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__version__ = "0.1.0"

__all__ = [
    "Adasum",
    "Average",
    "CollectiveMismatchError",
    "Handle",
    "Max",
    "Min",
    "PeerLostError",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "RendezvousError",
    "ShoalError",
    "ShoalTimeoutError",
    "Sum",
    "__version__",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_async",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_async",
    "broadcast_object",
    "communicator",
    "cross_rank",
    "cross_size",
    "global_process_set",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "shutdown",
    "size",
    "timeline_range",
    "world",
]
