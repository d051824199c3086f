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
