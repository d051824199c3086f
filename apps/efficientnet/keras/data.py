"""``tf.data`` input pipelines for the Keras application.

The same TFRecords as the PyTorch loaders (ImageNet layout: ``image/encoded`` JPEG,
``image/class/label`` counted from ``--label_offset``), sharded per rank: training by file when
there are at least as many files as ranks, else by record; evaluation always by record, so
every record is read exactly once. Each epoch is its own pipeline (seeded shuffle, then
stateless crops, flips and mixup, functions of ``(seed, epoch, rank, index)``), so epoch ``e``
of a resumed run sees exactly the batches epoch ``e`` of an uninterrupted run saw. Images
stay in ``[0, 255]``: Keras's EfficientNet rescales and normalizes inside the model.
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import tensorflow as tf

from apps.efficientnet.dataloader.files import find_split
from apps.efficientnet.dataloader.index import assign, record_counts
from apps.efficientnet.dataloader.storage import is_url

__all__ = ["augmented", "decode", "eval_dataset", "eval_image", "eval_jpeg", "parse",
           "read_split", "train_dataset", "train_image", "train_jpeg"]

_AUTOTUNE = tf.data.AUTOTUNE


def _records(files: list[str], rank: int, size: int, by_file: bool) -> tf.data.Dataset:
    """This rank's records: every ``size``-th file when there are enough files (``by_file``),
    else its contiguous range of records (from the record index), reading only the files the
    range touches."""
    if by_file and len(files) >= size:
        return tf.data.Dataset.from_tensor_slices(files).shard(size, rank).interleave(
            tf.data.TFRecordDataset, cycle_length=4, num_parallel_calls=_AUTOTUNE,
            deterministic=True)
    spans = assign(record_counts(files), rank, size, by_file=False)
    parts = [tf.data.TFRecordDataset(files[i]).skip(a).take(b - a) for i, a, b in spans]
    if not parts:
        return tf.data.TFRecordDataset([]).take(0)
    data = parts[0]
    for part in parts[1:]:
        data = data.concatenate(part)
    return data


def parse(record: tf.Tensor, label_offset: int) -> tuple[tf.Tensor, tf.Tensor]:
    """``(encoded JPEG, int32 label)`` of an ImageNet-layout Example."""
    f = tf.io.parse_single_example(record, {
        "image/encoded": tf.io.FixedLenFeature([], tf.string),
        "image/class/label": tf.io.FixedLenFeature([], tf.int64)})
    return f["image/encoded"], tf.cast(f["image/class/label"] - label_offset, tf.int32)


def decode(record: tf.Tensor, label_offset: int) -> tuple[tf.Tensor, tf.Tensor]:
    """``(uint8 HWC image, int32 label)`` of an ImageNet-layout Example (JPEG decoded with
    the accurate integer DCT, as Pillow does)."""
    encoded, label = parse(record, label_offset)
    return tf.io.decode_jpeg(encoded, channels=3, dct_method="INTEGER_ACCURATE"), label


def _decode_crop(encoded: tf.Tensor, top: tf.Tensor, left: tf.Tensor, height: tf.Tensor,
                 width: tf.Tensor) -> tf.Tensor:
    """The window of a JPEG, decoding only the blocks it covers (the same pixels as a full
    decode, then the crop)."""
    return tf.image.decode_and_crop_jpeg(encoded, tf.stack([top, left, height, width]),
                                         channels=3, dct_method="INTEGER_ACCURATE")


def _central(shape: tf.Tensor, crop_fraction: float) -> tuple[tf.Tensor, ...]:
    side = tf.cast(tf.cast(tf.minimum(shape[0], shape[1]), tf.float32) * crop_fraction, tf.int32)
    return (shape[0] - side) // 2, (shape[1] - side) // 2, side, side


def _resized(crop: tf.Tensor, size: int) -> tf.Tensor:
    return tf.clip_by_value(tf.image.resize(crop, [size, size], "bicubic"), 0.0, 255.0)


def eval_image(image: tf.Tensor, size: int, crop_fraction: float) -> tf.Tensor:
    """Central crop of ``crop_fraction`` of the shorter side, resized (bicubic) to ``size``."""
    top, left, h, w = _central(tf.shape(image), crop_fraction)
    return _resized(tf.image.crop_to_bounding_box(image, top, left, h, w), size)


def eval_jpeg(encoded: tf.Tensor, size: int, crop_fraction: float) -> tf.Tensor:
    """:func:`eval_image` of an encoded JPEG, decoding only the crop."""
    return _resized(_decode_crop(encoded, *_central(tf.image.extract_jpeg_shape(encoded),
                                                    crop_fraction)), size)


def _train_box(shape: tf.Tensor, seed: tf.Tensor, min_scale: float
               ) -> tuple[tf.Tensor, tf.Tensor]:
    begin, extent, _ = tf.image.stateless_sample_distorted_bounding_box(
        shape, tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed,
        min_object_covered=0.0, aspect_ratio_range=(3 / 4, 4 / 3),
        area_range=(min_scale, 1.0), max_attempts=10, use_image_if_no_bounding_boxes=True)
    return begin, extent


def _flipped(image: tf.Tensor, seed: tf.Tensor, flip: bool) -> tf.Tensor:
    return tf.image.stateless_random_flip_left_right(image, seed=seed + 1) if flip else image


def train_image(image: tf.Tensor, size: int, seed: tf.Tensor, min_scale: float,
                flip: bool) -> tf.Tensor:
    """Random-area crop (``min_scale``..1 of the image, aspect 3/4..4/3), resized to ``size``,
    optionally flipped; ``seed`` (shape [2]) decides everything."""
    begin, extent = _train_box(tf.shape(image), seed, min_scale)
    return _flipped(_resized(tf.slice(image, begin, extent), size), seed, flip)


def train_jpeg(encoded: tf.Tensor, size: int, seed: tf.Tensor, min_scale: float,
               flip: bool) -> tf.Tensor:
    """:func:`train_image` of an encoded JPEG (the same crop for the same ``seed``), decoding
    only the crop's blocks."""
    begin, extent = _train_box(tf.image.extract_jpeg_shape(encoded), seed, min_scale)
    crop = _decode_crop(encoded, begin[0], begin[1], extent[0], extent[1])
    return _flipped(_resized(crop, size), seed, flip)


def augmented(images: tf.Tensor, seed: tf.Tensor, name: str, num_layers: int,
              magnitude: float) -> tf.Tensor:
    """``--augmenter_name``'s AutoAugment or RandAugment on one ``[0, 255]`` image, the
    application's own (Pillow) implementation, seeded by ``seed``: the same ops and
    magnitudes as the PyTorch path. It runs as a Python op (holding the GIL)."""
    import random

    from PIL import Image

    from apps.efficientnet.dataloader.augment import make_augmenter
    augmenter = make_augmenter(name, num_layers, magnitude)
    if augmenter is None:
        return images

    def apply(image: np.ndarray, key: np.ndarray) -> np.ndarray:
        rng = random.Random(int(key[0]) * 1_000_003 + int(key[1]))
        out = augmenter(Image.fromarray(image), rng)
        return np.asarray(out, dtype=np.uint8)

    pixels = tf.cast(tf.round(images), tf.uint8)
    out = tf.numpy_function(apply, [pixels, seed], tf.uint8, stateful=False)
    return tf.cast(tf.ensure_shape(out, images.shape), tf.float32)


def _mixup(images: tf.Tensor, labels: tf.Tensor, alpha: float, seed: tf.Tensor
           ) -> tuple[tf.Tensor, tf.Tensor]:
    """Mix each example with the batch reversed, ``lambda ~ Beta(alpha, alpha)`` per batch."""
    g = tf.random.stateless_gamma([2], seed=seed, alpha=alpha)
    lam = g[0] / (g[0] + g[1])
    return (lam * images + (1 - lam) * tf.reverse(images, [0]),
            lam * labels + (1 - lam) * tf.reverse(labels, [0]))


def _cutmix(images: tf.Tensor, labels: tf.Tensor, alpha: float, seed: tf.Tensor
            ) -> tuple[tf.Tensor, tf.Tensor]:
    """Paste into each example a box of the batch reversed, of area about ``1 - lambda``
    (``lambda ~ Beta(alpha, alpha)`` per batch, clipped at the border), the labels mixed by
    the area pasted (the PyTorch application's ``cutmix``)."""
    g = tf.random.stateless_gamma([2], seed=seed, alpha=alpha)
    lam = g[0] / (g[0] + g[1])
    h, w = tf.shape(images)[1], tf.shape(images)[2]
    cut = tf.sqrt(1.0 - lam)
    ch = tf.cast(tf.cast(h, tf.float32) * cut, tf.int32)
    cw = tf.cast(tf.cast(w, tf.float32) * cut, tf.int32)
    centre = tf.random.stateless_uniform([2], seed=seed + 1, minval=0, maxval=1 << 30,
                                         dtype=tf.int32)
    cy, cx = centre[0] % h, centre[1] % w
    y0, y1 = tf.maximum(cy - ch // 2, 0), tf.minimum(cy + ch // 2, h)
    x0, x1 = tf.maximum(cx - cw // 2, 0), tf.minimum(cx + cw // 2, w)
    rows = tf.logical_and(tf.range(h) >= y0, tf.range(h) < y1)
    cols = tf.logical_and(tf.range(w) >= x0, tf.range(w) < x1)
    box = tf.logical_and(rows[:, None], cols[None, :])[None, :, :, None]
    mixed = tf.where(box, tf.reverse(images, [0]), images)
    kept = 1.0 - tf.cast((y1 - y0) * (x1 - x0), tf.float32) / tf.cast(h * w, tf.float32)
    return mixed, kept * labels + (1.0 - kept) * tf.reverse(labels, [0])


def mix_batch(images: tf.Tensor, labels: tf.Tensor, mixup_alpha: float, cutmix_alpha: float,
              seed: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Mixup or CutMix of a batch, as the flags ask: with both, each batch takes one of the
    two at even odds."""
    if cutmix_alpha <= 0:
        return _mixup(images, labels, mixup_alpha, seed)
    if mixup_alpha <= 0:
        return _cutmix(images, labels, cutmix_alpha, seed)
    coin = tf.random.stateless_uniform([], seed=seed + 2)
    return tf.cond(coin < 0.5, lambda: _cutmix(images, labels, cutmix_alpha, seed),
                   lambda: _mixup(images, labels, mixup_alpha, seed))


def read_split(args: argparse.Namespace, split: str) -> list[str]:
    """The TFRecord files of ``split`` ("train" / "eval") under the flags' data directory."""
    where = args.train_data_dir if split == "train" else args.eval_data_dir
    if where is None:
        raise FileNotFoundError(f"no {split} data: pass --data_dir, or --synthetic")
    if is_url(where):
        raise NotImplementedError(f"--framework tensorflow reads local files; {where!r} is a "
                                  f"URL (tf.data reads s3:// only through tensorflow-io): "
                                  f"mount it (FSx, EFS, SageMaker FastFile) or use --framework "
                                  f"torch")
    kind, found = find_split(where, split)
    if kind != "tfrecord":
        raise NotImplementedError(f"--framework tensorflow reads TFRecords; {found!r} is an "
                                  f"image folder (convert it, or use --framework torch)")
    return list(found)


def _synthetic(args: argparse.Namespace, rank: int, size: int, batch: int) -> tf.data.Dataset:
    rng = np.random.default_rng(args.seed * 1009 + rank)
    images = rng.integers(0, 256, (batch, size, size, 3)).astype(np.float32)
    labels = tf.one_hot(rng.integers(0, args.num_classes, batch), args.num_classes)
    return tf.data.Dataset.from_tensors((images, labels)).repeat()


def train_dataset(args: argparse.Namespace, rank: int, size: int, image_size: int,
                  steps_per_epoch: int, start_epoch: int, batch: int | None = None,
                  parallel: int = _AUTOTUNE) -> tf.data.Dataset:
    """Batches of ``(float images, one-hot labels)`` for epochs ``start_epoch`` onwards,
    ``steps_per_epoch`` per epoch; ``batch`` defaults to ``--train_batch_size``;
    ``parallel`` images are prepared at once (tf.data's choice by default)."""
    batch = batch or args.train_batch_size
    per_epoch = steps_per_epoch * batch
    epochs = max(0, args.max_epochs - start_epoch)
    if args.synthetic:
        data = _synthetic(args, rank, image_size, batch).take(epochs * steps_per_epoch)
        options = tf.data.Options()  # each worker makes its own (MultiWorkerMirrored too)
        options.experimental_distribute.auto_shard_policy = \
            tf.data.experimental.AutoShardPolicy.OFF
        return data.with_options(options)
    records = _records(read_split(args, "train"), rank, size, by_file=True)
    num_classes, offset = args.num_classes, args.label_offset

    def epoch(e: int) -> tf.data.Dataset:
        base = tf.constant(args.seed * 1_000_003 + e * 1009 + rank, tf.int64)
        data = records.shuffle(4096, seed=args.seed * 1_000_003 + e * 1009 + rank) \
            .repeat().take(per_epoch).enumerate()

        def prepare(i: tf.Tensor, record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            encoded, label = parse(record, offset)
            seed = tf.stack([base, i])
            image = train_jpeg(encoded, image_size, seed, args.crop_min_scale,
                               args.random_flip)
            image = augmented(image, seed + 2, args.augmenter_name, args.raug_num_layers,
                              args.raug_magnitude)
            return image, tf.one_hot(label, num_classes)
        data = data.map(prepare, num_parallel_calls=parallel, deterministic=True)
        data = data.batch(batch, drop_remainder=True)
        if args.mixup_alpha > 0 or args.cutmix_alpha > 0:
            data = data.enumerate().map(
                lambda j, xy: mix_batch(*xy, args.mixup_alpha, args.cutmix_alpha,
                                        tf.stack([base, -1 - j])),
                num_parallel_calls=_AUTOTUNE, deterministic=True)
        return data

    return _concatenate([epoch(e) for e in range(start_epoch, start_epoch + epochs)]) \
        .prefetch(_AUTOTUNE)


def _concatenate(parts: list[tf.data.Dataset]) -> tf.data.Dataset:
    """The datasets one after another, joined as a balanced tree (hundreds of epochs)."""
    if not parts:
        raise ValueError("no epochs left to train: --max_epochs is reached")
    while len(parts) > 1:
        parts = [parts[i].concatenate(parts[i + 1]) if i + 1 < len(parts) else parts[i]
                 for i in range(0, len(parts), 2)]
    return parts[0]


def eval_dataset(args: argparse.Namespace, rank: int, size: int, image_size: int
                 ) -> tf.data.Dataset:
    """This rank's share of the evaluation set, one pass: ``(float images, int labels)``."""
    if args.synthetic:
        count = max(1, math.ceil(10 * args.eval_batch_size / size))
        data = _synthetic(args, rank + size, image_size, args.eval_batch_size).take(count)
        return data.map(lambda x, y: (x, tf.argmax(y, -1, output_type=tf.int32)))
    offset, crop = args.label_offset, args.eval_crop_fraction
    records = _records(read_split(args, "eval"), rank, size, by_file=False)
    if args.eval_num_examples:  # --eval_num_examples over all ranks
        records = records.take(max(1, args.eval_num_examples // size))

    def prepare(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        encoded, label = parse(record, offset)
        return eval_jpeg(encoded, image_size, crop), label
    return records.map(prepare, num_parallel_calls=_AUTOTUNE, deterministic=True) \
        .batch(args.eval_batch_size).prefetch(_AUTOTUNE)
