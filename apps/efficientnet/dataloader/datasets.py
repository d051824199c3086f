"""Datasets: ImageNet TFRecords, image folders and synthetic images, sharded by rank.

Every dataset is an ``IterableDataset`` of ``(uint8 CHW image, int label)``. Work is split over
``size`` ranks times ``num_workers`` DataLoader workers ("consumers"): by file when there are
at least as many files as consumers, otherwise by record index. Training streams repeat
forever, reshuffled every pass (file order plus a shuffle buffer, as ``tf.data`` does); the
training loop takes a fixed number of steps per epoch on every rank, so ranks never disagree
on how many collectives to run. Evaluation streams make one pass: every record exactly once.
JPEG decoding and augmentation run in the DataLoader workers.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .augment import decode, eval_image, make_augmenter, train_image
from .example import parse_image_record
from .files import find_split
from .tfrecord import count_records, read_records

__all__ = ["ImageFolderImages", "Preprocess", "SyntheticImages", "TFRecordImages",
           "build_dataset", "make_loader"]

_IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".bmp", ".webp"}


@dataclass(frozen=True)
class Preprocess:
    """How images become tensors: size, crop, flip and augmenter settings."""

    image_size: int
    training: bool
    min_scale: float = 0.08
    flip: bool = True
    augmenter: str = "none"
    raug_num_layers: int = 2
    raug_magnitude: float = 10.0
    crop_fraction: float = 0.875

    @functools.cached_property
    def _augmenter(self) -> Any:
        return make_augmenter(self.augmenter, self.raug_num_layers, self.raug_magnitude)

    def __call__(self, data: bytes, rng: random.Random) -> torch.Tensor:
        """Decode ``data`` and crop / augment it into a ``uint8`` CHW tensor."""
        img = decode(data)
        if not self.training:
            return eval_image(img, self.image_size, self.crop_fraction)
        return train_image(img, self.image_size, rng, self.min_scale, self.flip,
                           self._augmenter)


class _Sharded(IterableDataset):
    """Shared machinery: units (files or items) split over consumers, shuffled, repeated."""

    def __init__(self, units: list[Any], preprocess: Preprocess, rank: int, size: int,
                 seed: int, repeat: bool, shuffle_buffer: int) -> None:
        super().__init__()
        if not units:
            raise ValueError(f"{type(self).__name__}: nothing to read")
        self.units, self.preprocess = units, preprocess
        self.rank, self.size, self.seed = rank, size, seed
        self.repeat, self.shuffle_buffer = repeat, shuffle_buffer

    def _records(self, unit: Any) -> Iterator[tuple[bytes, int]]:
        raise NotImplementedError

    def num_examples(self) -> int:
        """Records in the whole dataset (all ranks)."""
        raise NotImplementedError

    def _stream(self, units: list[Any], consumer: int, consumers: int
                ) -> Iterator[tuple[bytes, int]]:
        if len(self.units) >= consumers:
            for unit in units:
                yield from self._records(unit)
            return
        index = 0
        for unit in units:
            for record in self._records(unit):
                if index % consumers == consumer:
                    yield record
                index += 1

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = get_worker_info()
        wid, workers = (info.id, info.num_workers) if info else (0, 1)
        consumer, consumers = self.rank * workers + wid, self.size * workers
        mine = (self.units[consumer::consumers] if len(self.units) >= consumers
                else list(self.units))
        training = self.preprocess.training
        epoch = 0
        while True:
            rng = random.Random(f"{self.seed}/{consumer}/{epoch}")
            units = list(mine)
            if training:
                rng.shuffle(units)
            stream = self._stream(units, consumer, consumers)
            if training and self.shuffle_buffer > 1:
                stream = _shuffled(stream, self.shuffle_buffer, rng)
            for data, label in stream:
                yield self.preprocess(data, rng), label
            epoch += 1
            if not self.repeat:
                return


def _shuffled(stream: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    buf: list[Any] = []
    for item in stream:
        if len(buf) < size:
            buf.append(item)
            continue
        j = rng.randrange(size)
        yield buf[j]
        buf[j] = item
    rng.shuffle(buf)
    yield from buf


class TFRecordImages(_Sharded):
    """ImageNet-layout TFRecord files (``image/encoded`` JPEG, ``image/class/label``)."""

    def __init__(self, files: list[str], preprocess: Preprocess, rank: int = 0, size: int = 1,
                 seed: int = 0, repeat: bool = True, shuffle_buffer: int = 1024,
                 label_offset: int = 1) -> None:
        super().__init__(sorted(files), preprocess, rank, size, seed, repeat, shuffle_buffer)
        self.label_offset = label_offset

    def _records(self, unit: str) -> Iterator[tuple[bytes, int]]:
        for data in read_records(unit):
            yield parse_image_record(data, self.label_offset)

    def num_examples(self) -> int:
        """Records in all files (headers walked, data skipped)."""
        return sum(count_records(f) for f in self.units)


class ImageFolderImages(_Sharded):
    """``root/<class>/*.jpg``: classes are the sorted subdirectory names."""

    def __init__(self, root: str, preprocess: Preprocess, rank: int = 0, size: int = 1,
                 seed: int = 0, repeat: bool = True, shuffle_buffer: int = 1024) -> None:
        classes = sorted(d.name for d in Path(root).iterdir() if d.is_dir())
        items = [(str(p), label) for label, c in enumerate(classes)
                 for p in sorted((Path(root) / c).iterdir()) if p.suffix.lower() in _IMAGE_EXTS]
        super().__init__(items, preprocess, rank, size, seed, repeat, shuffle_buffer)
        self.classes = classes

    def _records(self, unit: tuple[str, int]) -> Iterator[tuple[bytes, int]]:
        yield Path(unit[0]).read_bytes(), unit[1]

    def num_examples(self) -> int:
        """Images found."""
        return len(self.units)


class SyntheticImages(IterableDataset):
    """Random images and labels from a fixed pool (the throughput benchmark's input)."""

    def __init__(self, image_size: int, num_classes: int, length: int = 1024,
                 rank: int = 0, size: int = 1, seed: int = 0, repeat: bool = True,
                 pool: int = 64) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (pool, 3, image_size, image_size), generator=g,
                                    dtype=torch.uint8)
        self.labels = torch.randint(0, num_classes, (pool,), generator=g).tolist()
        self.length, self.rank, self.size, self.repeat = length, rank, size, repeat

    def num_examples(self) -> int:
        """The nominal epoch size."""
        return self.length

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = get_worker_info()
        wid, workers = (info.id, info.num_workers) if info else (0, 1)
        consumer, consumers = self.rank * workers + wid, self.size * workers
        i = consumer
        while self.repeat or i < self.length:
            k = i % len(self.images)
            yield self.images[k], self.labels[k]
            i += consumers


def build_dataset(data_dir: str | None, split: str, preprocess: Preprocess, *, rank: int,
                  size: int, seed: int, num_classes: int, synthetic: bool = False,
                  synthetic_length: int = 1024, label_offset: int = 1,
                  shuffle_buffer: int = 1024) -> TFRecordImages | ImageFolderImages | \
        SyntheticImages:
    """The dataset of ``split`` ("train" repeats forever, "eval" makes one pass)."""
    repeat = split == "train"
    if synthetic or data_dir is None:
        return SyntheticImages(preprocess.image_size, num_classes, synthetic_length, rank,
                               size, seed + (split == "eval"), repeat)
    kind, where = find_split(os.fspath(data_dir), split)
    if kind == "tfrecord":
        return TFRecordImages(where, preprocess, rank, size, seed, repeat, shuffle_buffer,
                              label_offset)
    return ImageFolderImages(where, preprocess, rank, size, seed, repeat, shuffle_buffer)


def make_loader(dataset: IterableDataset, batch_size: int, num_workers: int,
                drop_last: bool, pin_memory: bool = False) -> DataLoader:
    """A DataLoader over ``dataset`` (workers forked, two batches prefetched per worker)."""
    kw: dict[str, Any] = {}
    if num_workers > 0:
        kw.update(prefetch_factor=2, multiprocessing_context="fork")
    return DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                      drop_last=drop_last, pin_memory=pin_memory, **kw)
