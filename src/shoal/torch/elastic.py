"""Elastic training for PyTorch, as ``horovod.torch.elastic`` spells it::

    import shoal.torch as hvd

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch, (x, y) in enumerate(loader, start=state.batch):  # noqa
                ...
                state.train_sampler.record_batch(state.batch, batch_size)
                if state.batch % 10 == 0:
                    state.commit()
            state.batch = 0
            state.train_sampler.set_epoch(state.epoch + 1)

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, batch=0)
    train(state)

The reset loop, the host-update check and the worker's side of the driver are shoal's core
(:mod:`shoal.core.elastic`); this module maps torch objects onto it: model and optimizer
state, samplers, and picklable attributes.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch

from shoal.core import api
from shoal.core.elastic import (
    HostsUpdatedInterrupt,
    ObjectState,
    State,
    reset,
    run_fn,
)

from .state import broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState",
           "run"]


def _bcast(obj: Any) -> Any:
    return broadcast_object(obj, 0, name="shoal.elastic.state")


def run(func: Any) -> Any:
    """Decorate the training function ``func(state, ...)``: on a lost worker it restores the
    last commit, on added or removed hosts it keeps the state; then it joins the new world,
    syncs from rank 0 and calls ``func`` again (Horovod's ``hvd.elastic.run``)."""
    return run_fn(func, reset)


class ElasticSampler(torch.utils.data.Sampler[int]):
    """A distributed sampler that survives resets: it remembers which indices of the epoch
    were processed (``record_batch``), and after a reset shares the remaining ones out over
    the new set of workers, so each sample of an epoch is processed once.

    Like Horovod's, every rank's shard of the remaining indices is padded (by wrapping) to
    the same length, so the ranks run the same number of steps.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark the ``batch_idx``-th batch of every rank's current shard as processed: the
        ranks step together, so when this rank has stepped on its batch, every rank's batch
        went into that step (a worker lost right after it is not processed twice)."""
        start = batch_idx * batch_size
        for shard in self.shards:
            self.processed_indices.update(shard[start:start + batch_size])

    def record_indices(self, indices: list[int]) -> None:
        """Mark ``indices`` (dataset indices) as processed."""
        self.processed_indices.update(indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices of the ``batch_idx``-th batch of this rank's shard."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    def state_dict(self) -> dict[str, Any]:
        """Epoch and processed indices (the state a commit keeps)."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go back to ``state`` and re-shard the rest of the epoch."""
        self.epoch = int(state["epoch"])
        self.processed_indices = set(state["processed_indices"])
        self.reset()

    def reset(self) -> None:
        """Share the epoch's unprocessed indices out over the current workers."""
        rank, size = (api.rank(), api.size()) if api.is_initialized() else (0, 1)
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        remaining = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(remaining) / size) if remaining else 0
        total = self.num_samples * size
        padded = (remaining * math.ceil(total / len(remaining)))[:total] if remaining else []
        self.shards = [padded[r:total:size] for r in range(size)]
        self.indices = self.shards[rank]
        self.remaining_indices = remaining

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


class TorchState(ObjectState):
    """The state of a torch training: ``model`` (its ``state_dict``), ``optimizer`` (its
    ``state_dict``), samplers given as keywords (:class:`ElasticSampler`, any object with
    ``state_dict``/``load_state_dict``), and other picklable attributes (``epoch=0``).

    ``sync()`` broadcasts the parameters, the optimizer state and the attributes from rank 0
    and makes samplers agree on what was processed (the union over the ranks)."""

    def __init__(self, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self._stateful = {k: v for k, v in kwargs.items()
                          if hasattr(v, "state_dict") and hasattr(v, "load_state_dict")}
        plain = {k: v for k, v in kwargs.items() if k not in self._stateful}
        for name, obj in self._stateful.items():
            setattr(self, name, obj)
        self._saved_objects: dict[str, Any] = {}
        super().__init__(_bcast, api.rank, **plain)
        self._save_objects()

    def _save_objects(self) -> None:
        saved: dict[str, Any] = {}
        if self.model is not None:
            saved["model"] = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            saved["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        for name, obj in self._stateful.items():
            saved[name] = copy.deepcopy(obj.state_dict())
        self._saved_objects = saved

    def save(self) -> None:
        """Copy the model, optimizer and sampler state and the attributes (in memory)."""
        self._save_objects()
        super().save()

    def restore(self) -> None:
        """Back to the last commit."""
        saved = self._saved_objects
        if self.model is not None and "model" in saved:
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None and "optimizer" in saved:
            self.optimizer.load_state_dict(saved["optimizer"])
        for name, obj in self._stateful.items():
            if name in saved:
                obj.load_state_dict(saved[name])
        super().restore()

    def sync(self) -> None:
        """Rank 0's model, optimizer and attributes everywhere; samplers merged, then
        re-sharded over the current workers."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0, model=self.model)
        for name, obj in self._stateful.items():
            states = api.communicator().allgather_object(obj.state_dict(),
                                                         name=f"shoal.elastic.{name}")
            merged = states[0]
            if isinstance(merged, dict) and "processed_indices" in merged:
                done = set().union(*(s["processed_indices"] for s in states))
                merged = {**merged, "processed_indices": sorted(done)}
            obj.load_state_dict(merged)
        super().sync()
        self._save_objects()
