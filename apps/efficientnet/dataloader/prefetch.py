"""Batches moved to the training device one step ahead (the PyTorch path).

On CUDA the next batch is copied from the loader's pinned memory on a stream of its own while
the current step computes, and the step's stream waits for that copy only when it takes the
batch; elsewhere (CPU training) the batches pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["DevicePrefetcher"]


class DevicePrefetcher:
    """An iterator over ``batches`` (tuples of tensors and other values) whose tensors are
    already on ``device`` when handed out."""

    def __init__(self, batches: Iterable[Any], device: torch.device) -> None:
        self._it: Iterator[Any] = iter(batches)
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._next: Any = None
        self._done = False
        self._load()

    def _load(self) -> None:
        try:
            batch = next(self._it)
        except StopIteration:
            self._done, self._next = True, None
            return
        if self.stream is None:
            self._next = batch
            return
        with torch.cuda.stream(self.stream):
            self._next = tuple(t.to(self.device, non_blocking=True)
                               if isinstance(t, torch.Tensor) else t for t in batch)

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        batch = self._next
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.stream)
            for t in batch:
                if isinstance(t, torch.Tensor):
                    t.record_stream(current)  # the copy's memory is the step's from now on
        self._load()
        return batch
