"""Bringing every rank to the same state: parameters, optimizer state, Python objects."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from shoal.core.process_sets import communicator_for, set_root
from shoal.core.reduction import ReduceOp

from .collectives import broadcast_async_

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

    A new optimizer has no state yet; as in Horovod, state of the same structure is created
    everywhere first (a step on zero gradients), but here it stays fresh: step counts and
    moments back at their start, so the first real step is a first step."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state (its state is not a "
                         "tensor structure); rebuild it on every rank instead")
    inner = getattr(optimizer, "_inner", optimizer)  # the step of the wrapped optimizer only
    if not inner.state_dict()["state"]:
        _create_fresh_state(inner, model)
    from .sharded import ShardedOptimizer  # its state_dict() is the consolidated one
    if not isinstance(optimizer, ShardedOptimizer) and \
            _broadcast_state_in_place(inner, root_rank, process_set):
        return
    state = broadcast_object(optimizer.state_dict(), root_rank,
                             name="shoal.torch.optimizer_state", process_set=process_set)
    optimizer.load_state_dict(state)


def _layout(optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
            ) -> list[tuple[int, list[tuple[Any, ...]]]]:
    """Each stateful parameter's index and its state's keys, tensors as (shape, dtype) and
    other values as themselves (a sparse tensor: None, which no rank can match)."""
    out = []
    for i, p in enumerate(params):
        state = optimizer.state.get(p)
        if not state:
            continue
        entries = []
        for key, value in sorted(state.items(), key=lambda kv: str(kv[0])):
            if isinstance(value, torch.Tensor):
                entries.append((key, "tensor", None) if value.is_sparse else
                               (key, "tensor", (tuple(value.shape), str(value.dtype))))
            else:
                entries.append((key, "value", value))
        out.append((i, entries))
    return out


def _broadcast_state_in_place(optimizer: torch.optim.Optimizer, root_rank: int,
                              process_set: Any) -> bool:
    """The root's optimizer state written into every rank's own state tensors, each
    broadcast in place, when every rank's state has the root's structure (the usual case:
    the same optimizer over the same model): no pickled copy of the state on any rank, so a
    large model's peak memory is not several times its optimizer state. Only the structure,
    the non-tensor values and the hyper-parameters travel as an object. False (and nothing
    changed) when some rank's structure differs; every rank agrees on it."""
    comm = communicator_for(process_set)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    mine = _layout(optimizer, params)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    root_layout, root_groups = broadcast_object((mine, groups), root_rank,
                                                name="shoal.torch.optimizer_state.layout",
                                                process_set=process_set)

    def shape(layout: list[tuple[int, list[tuple[Any, ...]]]]) -> list[Any]:
        return [(i, [(k, kind, v if kind == "tensor" else None) for k, kind, v in entries])
                for i, entries in layout]

    fits = shape(mine) == shape(root_layout) and len(root_groups) == len(groups) and \
        all(kind != "tensor" or v is not None for _, e in mine for _, kind, v in e)
    agreed = comm.allreduce(np.array([1 if fits else 0], dtype=np.int32), op=ReduceOp.MIN,
                            name="shoal.torch.optimizer_state.fits")
    if not int(np.asarray(agreed)[0]):
        return False
    handles = []
    for i, entries in root_layout:
        state = optimizer.state[params[i]]
        for key, kind, value in entries:
            if kind == "tensor":
                handles.append(broadcast_async_(state[key], root_rank,
                                                name=f"shoal.torch.optimizer_state.{i}.{key}",
                                                process_set=process_set))
            else:
                state[key] = value
    for h in handles:
        h.wait()
    for group, theirs in zip(optimizer.param_groups, root_groups, strict=True):
        group.update(theirs)
    return True


# A state tensor created by a step on zero gradients goes back to its value before any step:
# zero, except these (by key), which a fresh optimizer starts elsewhere.
_START = {
    "mu_product": lambda group: 1.0,                                  # NAdam
    "mu": lambda group: 1.0,                                          # ASGD
    "eta": lambda group: group["lr"],                                 # ASGD
    "step_size": lambda group: group["lr"],                           # Rprop
    "sum": lambda group: group.get("initial_accumulator_value", 0.0),  # Adagrad
}


def _create_fresh_state(inner: torch.optim.Optimizer, model: torch.nn.Module | None) -> None:
    """Give a new optimizer state of the right structure that still acts fresh: one step on
    zero gradients (sparse ones for ``SparseAdam`` and for sparse embeddings of ``model``
    under SGD), then every created value put back to where a fresh optimizer starts (step
    counts 0, moments 0, SGD's momentum buffer absent), and the parameters restored (weight
    decay must not move them). As in Horovod, a parameter that had no gradient keeps the
    zero one; one that had a gradient gets it back."""
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
            if grad is not None:
                p.grad = grad
        for group in inner.param_groups:
            for p in group["params"]:
                _reset(inner.state.get(p), group, isinstance(inner, torch.optim.SGD))


def _reset(state: dict[str, Any] | None, group: dict[str, Any], sgd: bool) -> None:
    for key, value in list((state or {}).items()):
        if sgd and key == "momentum_buffer":
            state[key] = None  # absent: the first real step starts it from the gradient
        elif isinstance(value, torch.Tensor):
            start = _START[key](group) if key in _START else 0.0
            if value.numel():
                value.fill_(start)
        elif key == "step" and isinstance(value, (int, float)):
            state[key] = type(value)(0)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None) -> Any:
    """Send a picklable object (tensors included) from global rank ``root_rank`` to every
    rank of the process set."""
    return communicator_for(process_set).broadcast_object(
        obj, set_root(process_set, root_rank), name=name)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every rank's picklable object, in rank order."""
    return communicator_for(process_set).allgather_object(obj, name=name)
