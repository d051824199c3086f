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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .augment import eval_jpeg, make_augmenter, train_jpeg
from .example import parse_image_record
from .files import find_split
from .index import Span, Team, assign, record_counts
from .tfrecord import RecordRef, read_records

__all__ = ["ImageFolderImages", "Preprocess", "SyntheticImages", "TFRecordImages",
           "build_dataset", "make_loader", "stream_position"]

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
    #: decode JPEGs at a reduced scale where the crop allows (augment.open_for_crop)
    reduced_decode: bool = True

    @functools.cached_property
    def _augmenter(self) -> Any:
        return make_augmenter(self.augmenter, self.raug_num_layers, self.raug_magnitude)

    def __call__(self, data: bytes, rng: random.Random) -> torch.Tensor:
        """Decode ``data`` and crop / augment it into a ``uint8`` CHW tensor (a JPEG at the
        smallest scale its crop allows)."""
        if not self.training:
            return eval_jpeg(data, self.image_size, self.crop_fraction, self.reduced_decode)
        return train_jpeg(data, self.image_size, rng, self.min_scale, self.flip,
                          self._augmenter, self.reduced_decode)


def stream_position(worker: int, workers: int, batches: int, batch_size: int
                    ) -> tuple[int, int]:
    """Where DataLoader worker ``worker`` of ``workers`` picks up after ``batches`` batches
    of ``batch_size`` were consumed: ``(role, samples)``. A DataLoader takes batch ``j`` from
    worker ``j % workers``, each worker making whole batches from its own stream; a new
    DataLoader starts again at worker 0, so its worker ``w`` continues the stream of the old
    worker ``(w + batches) % workers`` (its role), which had delivered ``samples`` samples."""
    role = (worker + batches) % workers
    done = batches // workers + (1 if role < batches % workers else 0)
    return role, done * batch_size


class _Sharded(IterableDataset):
    """Shared machinery: units (files or items) split over consumers, shuffled, repeated,
    resumable at any batch."""

    def __init__(self, units: list[Any], counts: list[int], preprocess: Preprocess, rank: int,
                 size: int, seed: int, repeat: bool, shuffle_buffer: int) -> None:
        super().__init__()
        if not units:
            raise ValueError(f"{type(self).__name__}: nothing to read")
        if len(counts) != len(units):
            raise ValueError(f"{len(counts)} record counts for {len(units)} units")
        self.units, self.counts, self.preprocess = units, list(counts), preprocess
        self.rank, self.size, self.seed = rank, size, seed
        self.repeat, self.shuffle_buffer = repeat, shuffle_buffer
        self.batches, self.batch_size, self.first_pass = 0, 1, 0

    def resume(self, batches: int, batch_size: int) -> None:
        """Start where a stream of ``batch_size`` batches stood after ``batches`` of them
        (the DataLoader must have the same number of workers as the one that consumed them)."""
        self.batches, self.batch_size = int(batches), int(batch_size)

    def _items(self, unit: Any, start: int, stop: int, lazy: Callable[[], bool]
               ) -> Iterator[Any]:
        """Records ``start..stop`` of ``unit``, as data, or as a reference while ``lazy()``."""
        raise NotImplementedError

    def _load(self, item: Any) -> tuple[bytes, int]:
        """``(encoded image, label)`` of an item of :meth:`_items`."""
        raise NotImplementedError

    def num_examples(self) -> int:
        """Records in the whole dataset (all ranks)."""
        return sum(self.counts)

    def parts(self, consumers: int) -> list[list[Span]]:
        """Every consumer's spans (see :func:`.index.assign`)."""
        return [assign(self.counts, c, consumers) for c in range(consumers)]

    def _pass(self, spans: list[Span], consumer: int, number: int, skip: int
              ) -> Iterator[tuple[torch.Tensor, int]]:
        training = self.preprocess.training
        rng = random.Random(f"{self.seed}/{consumer}/{number}")
        order = list(spans)
        if training:
            rng.shuffle(order)
        lazy = [skip > 0]  # passed-over records are located, not read

        def source() -> Iterator[Any]:
            for i, a, b in order:
                yield from self._items(self.units[i], a, b, lambda: lazy[0])

        stream = source()
        if training and self.shuffle_buffer > 1:
            stream = _shuffled(stream, self.shuffle_buffer, rng)
        for k, item in enumerate(stream):
            if k < skip:
                lazy[0] = k + 1 < skip
                continue
            data, label = self._load(item)
            sample_rng = random.Random(f"{self.seed}/{consumer}/{number}/{k}")
            yield self.preprocess(data, sample_rng), label

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = get_worker_info()
        wid, workers = (info.id, info.num_workers) if info else (0, 1)
        role, done = stream_position(wid, workers, self.batches, self.batch_size)
        consumer, consumers = self.rank * workers + role, self.size * workers
        spans = assign(self.counts, consumer, consumers)
        length = sum(b - a for _, a, b in spans)
        if length == 0:
            if self.repeat:
                raise ValueError(f"{type(self).__name__}: {sum(self.counts)} records for "
                                 f"{consumers} data-loading workers ({self.size} ranks x "
                                 f"{workers}): worker {wid} of rank {self.rank} has none; "
                                 f"lower --num_workers")
            return
        number, skip = self.first_pass + done // length, done % length
        while True:
            yield from self._pass(spans, consumer, number, skip)
            if not self.repeat:
                return
            number, skip = number + 1, 0


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
    """ImageNet-layout TFRecord files (``image/encoded`` JPEG, ``image/class/label``), local
    or at a URL; ``counts`` (records per file) from :func:`.index.record_counts` by default."""

    def __init__(self, files: list[str], preprocess: Preprocess, rank: int = 0, size: int = 1,
                 seed: int = 0, repeat: bool = True, shuffle_buffer: int = 1024,
                 label_offset: int = 1, counts: list[int] | None = None) -> None:
        files = sorted(files)
        super().__init__(files, record_counts(files) if counts is None else counts,
                         preprocess, rank, size, seed, repeat, shuffle_buffer)
        self.label_offset = label_offset

    def _items(self, unit: str, start: int, stop: int, lazy: Callable[[], bool]
               ) -> Iterator[bytes | RecordRef]:
        return read_records(unit, start=start, stop=stop, lazy=lazy)

    def _load(self, item: bytes | RecordRef) -> tuple[bytes, int]:
        data = item.load() if isinstance(item, RecordRef) else item
        return parse_image_record(data, self.label_offset)


class ImageFolderImages(_Sharded):
    """``root/<class>/*.jpg``: classes are the sorted subdirectory names."""

    def __init__(self, root: str, preprocess: Preprocess, rank: int = 0, size: int = 1,
                 seed: int = 0, repeat: bool = True, shuffle_buffer: int = 1024) -> None:
        classes = sorted(d.name for d in Path(root).iterdir() if d.is_dir())
        items = [(str(p), label) for label, c in enumerate(classes)
                 for p in sorted((Path(root) / c).iterdir()) if p.suffix.lower() in _IMAGE_EXTS]
        super().__init__(items, [1] * len(items), preprocess, rank, size, seed, repeat,
                         shuffle_buffer)
        self.classes = classes

    def _items(self, unit: tuple[str, int], start: int, stop: int, lazy: Callable[[], bool]
               ) -> Iterator[tuple[str, int]]:
        yield unit  # read when it is used

    def _load(self, item: tuple[str, int]) -> tuple[bytes, int]:
        return Path(item[0]).read_bytes(), item[1]


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
        self.batches, self.batch_size, self.first_pass = 0, 1, 0

    def num_examples(self) -> int:
        """The nominal epoch size."""
        return self.length

    def resume(self, batches: int, batch_size: int) -> None:
        """Start after ``batches`` batches of ``batch_size`` (see ``_Sharded.resume``)."""
        self.batches, self.batch_size = int(batches), int(batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int]]:
        info = get_worker_info()
        wid, workers = (info.id, info.num_workers) if info else (0, 1)
        role, done = stream_position(wid, workers, self.batches, self.batch_size)
        consumer, consumers = self.rank * workers + role, self.size * workers
        i = consumer + (done + self.first_pass * self.length) * consumers
        while self.repeat or i < self.length:
            k = i % len(self.images)
            yield self.images[k], self.labels[k]
            i += consumers


def build_dataset(data_dir: str | None, split: str, preprocess: Preprocess, *, rank: int,
                  size: int, seed: int, num_classes: int, synthetic: bool = False,
                  synthetic_length: int = 1024, label_offset: int = 1,
                  shuffle_buffer: int = 1024, team: Team | None = None
                  ) -> TFRecordImages | ImageFolderImages | SyntheticImages:
    """The dataset of ``split`` ("train" repeats forever, "eval" makes one pass); TFRecord
    counts come from the record index, shared out over ``team`` (default: this process)."""
    repeat = split == "train"
    if synthetic or data_dir is None:
        return SyntheticImages(preprocess.image_size, num_classes, synthetic_length, rank,
                               size, seed + (split == "eval"), repeat)
    kind, where = find_split(os.fspath(data_dir), split)
    if kind == "tfrecord":
        files = sorted(where)
        return TFRecordImages(files, preprocess, rank, size, seed, repeat, shuffle_buffer,
                              label_offset, counts=record_counts(files, team))
    return ImageFolderImages(where, preprocess, rank, size, seed, repeat, shuffle_buffer)


def make_loader(dataset: IterableDataset, batch_size: int, num_workers: int,
                drop_last: bool, pin_memory: bool = False) -> DataLoader:
    """A DataLoader over ``dataset`` (workers forked, two batches prefetched per worker)."""
    kw: dict[str, Any] = {}
    if num_workers > 0:
        from apps.efficientnet.runtime.preempt import ignore_sigterm
        kw.update(prefetch_factor=2, multiprocessing_context="fork",
                  worker_init_fn=ignore_sigterm)  # SIGTERM is the training process's
    return DataLoader(dataset, batch_size=batch_size, num_workers=num_workers,
                      drop_last=drop_last, pin_memory=pin_memory, **kw)
