"""Bringing every rank to the same state: parameters, optimizer state, Python objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

import shoal

from .ops import broadcast_async_

__all__ = [
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
]


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, Any]],
                         root_rank: int = 0) -> None:
    """Overwrite parameters (a ``state_dict()`` or ``named_parameters()``) with the root's,
    in place; all tensors travel at once."""
    items = params.items() if isinstance(params, Mapping) else params
    handles = []
    for name, p in sorted(items, key=lambda kv: kv[0]):
        if p is None or not isinstance(p, torch.Tensor):
            continue
        tensor = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(broadcast_async_(tensor, root_rank, name=f"bcast.param.{name}"))
    for h in handles:
        h.wait()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Make every rank's optimizer state (moments, steps, hyper-parameters) the root's."""
    state = broadcast_object(optimizer.state_dict(), root_rank,
                             name="shoal.torch.optimizer_state")
    optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """Send a picklable object (tensors included) from ``root_rank`` to every rank."""
    return shoal.broadcast_object(obj, root_rank, name=name)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's picklable object, in rank order."""
    return shoal.allgather_object(obj, name=name)
