"""``horovod.torch.elastic.sampler``: a sampler that survives resets."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sized
from typing import Any

import torch

from shoal.core import api

__all__ = ["ElasticSampler"]


class ElasticSampler(torch.utils.data.Sampler[int]):
    """A distributed sampler that survives resets, as Horovod's: it counts the samples of the
    epoch processed by all workers together (``processed_num``, advanced by ``record_batch``),
    and after a reset shares the rest of the epoch's order out over the new set of workers,
    so each sample of an epoch is processed once.

    The epoch's order is the same on every worker (shuffled by ``seed + epoch``); worker r of
    n takes every n-th remaining index from the r-th, so the first ``k`` batches of every
    worker together are the first ``k * batch_size * n`` indices of the order, and a count
    says exactly which samples are done. Every shard is padded (by wrapping) to the same
    length, so the workers run the same number of steps. Call ``set_epoch`` at the *end* of
    an epoch: it clears the count.
    """

    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas, self.rank = 1, 0
        self.remaining_indices: list[int] = []
        self.num_samples = self.total_size = 0
        self._padded_order: list[int] | None = None
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: nothing processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one more batch of ``batch_size`` on every worker as processed: the workers
        step together, so when this one has stepped on its batch, every worker's batch went
        into that step. (``batch_idx`` is Horovod's argument; the count does not need it.)"""
        self.processed_num += batch_size * self.num_replicas

    @property
    def processed_indices(self) -> list[int]:
        """The dataset indices processed so far this epoch (across all workers)."""
        return self._order()[:self.processed_num]

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """The dataset indices of the ``batch_idx``-th batch of this worker's shard."""
        start = batch_idx * batch_size
        return self.indices[start:start + batch_size]

    @property
    def shards(self) -> list[list[int]]:
        """Every worker's shard of the rest of the epoch, in rank order."""
        padded = self._padded()
        return [padded[r:self.total_size:self.num_replicas] for r in range(self.num_replicas)]

    @property
    def indices(self) -> list[int]:
        """This worker's shard of the rest of the epoch."""
        return self._padded()[self.rank:self.total_size:self.num_replicas]

    def state_dict(self) -> dict[str, Any]:
        """Epoch and processed count (Horovod's keys: what a commit keeps)."""
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go back to ``state`` and re-shard the rest of the epoch."""
        self.epoch = int(state["epoch"])
        self.processed_num = int(state["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Share the rest of the epoch out over the current workers."""
        self.num_replicas, self.rank = ((api.size(), api.rank()) if api.is_initialized()
                                        else (1, 0))
        self.remaining_indices = self._order()[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self._padded_order = None

    def _order(self) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def _padded(self) -> list[int]:
        """The rest of the epoch's order, wrapped to ``total_size`` (made once per reset)."""
        if self._padded_order is None:
            remaining = self.remaining_indices
            self._padded_order = ((remaining * math.ceil(self.total_size / len(remaining)))
                                  [:self.total_size] if remaining else [])
        return self._padded_order

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
