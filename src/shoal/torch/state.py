"""Bringing every rank to the same state: parameters, optimizer state, Python objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from shoal.core.process_sets import communicator_for

from .ops import broadcast_async_

__all__ = [
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
]


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[tuple[str, Any]],
                         root_rank: int = 0, process_set: Any = None) -> None:
    """Overwrite parameters (a ``state_dict()`` or ``named_parameters()``) with the root's,
    in place; all tensors travel at once."""
    items = params.items() if isinstance(params, Mapping) else params
    handles = []
    for name, p in sorted(items, key=lambda kv: kv[0]):
        if p is None or not isinstance(p, torch.Tensor):
            continue
        tensor = p.data if isinstance(p, torch.nn.Parameter) else p
        handles.append(broadcast_async_(tensor, root_rank, name=f"bcast.param.{name}",
                                        process_set=process_set))
    for h in handles:
        h.wait()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: torch.nn.Module | None = None,
                              process_set: Any = None) -> None:
    """Make every rank's optimizer state (moments, steps, hyper-parameters) the root's.

    A new optimizer has no state yet; as Horovod does, it gets zero gradients (sparse ones
    for ``SparseAdam`` and for sparse embeddings of ``model`` under SGD) and one step of the
    wrapped optimizer, so that the state exists and has the same structure everywhere."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state (its state is not a "
                         "tensor structure); rebuild it on every rank instead")
    inner = getattr(optimizer, "_inner", optimizer)  # the step of the wrapped optimizer only
    if not inner.state_dict()["state"]:
        # one step on zero gradients creates the state; the parameters and the gradients are
        # put back afterwards (a leftover gradient, or weight decay, must not move them)
        sparse = {id(p) for m in (model.modules() if model is not None else ())
                  if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
        kept = []
        for group in inner.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    kept.append((p, p.detach().clone(), p.grad))
                    p.grad = torch.zeros_like(p)
                    if isinstance(inner, torch.optim.SparseAdam) or (
                            isinstance(inner, torch.optim.SGD) and id(p) in sparse):
                        p.grad = p.grad.to_sparse()
        inner.step()
        with torch.no_grad():
            for p, data, grad in kept:
                p.copy_(data)
                p.grad = grad
    state = broadcast_object(optimizer.state_dict(), root_rank,
                             name="shoal.torch.optimizer_state", process_set=process_set)
    optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None) -> Any:
    """Send a picklable object (tensors included) from global rank ``root_rank`` to every
    rank of the process set."""
    root = root_rank if process_set is None else process_set.local_rank_of(root_rank)
    return communicator_for(process_set).broadcast_object(obj, root, name=name)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every rank's picklable object, in rank order."""
    return communicator_for(process_set).allgather_object(obj, name=name)
