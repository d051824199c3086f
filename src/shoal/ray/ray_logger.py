"""Values a training function hands to the driver's callbacks (Horovod's
``horovod.ray.ray_logger``): ``ray_logger.log({"loss": ...})`` in a worker puts the dict on
the queue the executor gave the worker; the executor calls each callback with every value
rank 0 logged."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["configure", "log"]

_queue: Any = None
_warned = False


def configure(queue: Any) -> None:
    """Send logged values to ``queue`` (a ``ray.util.queue.Queue``; None: nowhere)."""
    global _queue
    _queue = queue


def log(info_dict: dict[str, Any]) -> None:
    """Send ``info_dict`` (picklable values) to the driver's callbacks."""
    global _warned
    if _queue is not None:
        _queue.put(info_dict)
    elif not _warned:
        warnings.warn("ray_logger.log called where no executor listens (run the function "
                      "through RayExecutor.run/execute with callbacks=)", stacklevel=2)
        _warned = True
