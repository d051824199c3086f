"""Images per second of one loader worker of the application's training input pipeline.

``python -m apps.efficientnet.loader_throughput --framework torch --data DIR --images 400``
prints one JSON line: ``{"framework", "augmenter", "image_size", "images", "seconds",
"images_per_s"}``. One worker: for ``torch``, a ``DataLoader`` with ``num_workers=1`` (one
process decoding and augmenting, the training process only collating); for ``tensorflow``,
the Keras path's ``tf.data`` pipeline with ``num_parallel_calls=1`` and one TensorFlow
thread. Pin the process to one core (``taskset -c 0``, as ``shoal bench loader`` does) to
measure per core. The first two batches (worker start, first reads) are not timed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

__all__ = ["main", "tensorflow_rate", "torch_rate"]


def torch_rate(data: str, image_size: int, augmenter: str, images: int, batch: int
               ) -> tuple[int, float]:
    """``(images, seconds)`` of one DataLoader worker over the TFRecords in ``data``."""
    import torch
    torch.set_num_threads(1)

    from .dataloader import Preprocess, build_dataset, make_loader
    pre = Preprocess(image_size, training=True, augmenter=augmenter)
    dataset = build_dataset(data, "train", pre, rank=0, size=1, seed=0, num_classes=1000,
                            shuffle_buffer=256)
    it = iter(make_loader(dataset, batch, num_workers=1, drop_last=True))
    for _ in range(2):
        next(it)
    done, start = 0, time.perf_counter()
    while done < images:
        x, _ = next(it)
        done += len(x)
    return done, time.perf_counter() - start


def tensorflow_rate(data: str, image_size: int, augmenter: str, images: int, batch: int
                    ) -> tuple[int, float]:
    """``(images, seconds)`` of the Keras path's pipeline with one parallel call."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    from .config import parse_args
    from .keras.data import train_dataset
    args = parse_args(["--framework", "tensorflow", "--data_dir", data,
                       "--augmenter_name", augmenter, "--train_batch_size", str(batch),
                       "--max_epochs", "1"], environ={})
    steps = images // batch + 2
    options = tf.data.Options()
    options.threading.private_threadpool_size = 1
    options.threading.max_intra_op_parallelism = 1
    options.autotune.enabled = False
    ds = train_dataset(args, 0, 1, image_size, steps, 0, parallel=1).with_options(options)
    it = iter(ds)
    for _ in range(2):
        next(it)
    done, start = 0, time.perf_counter()
    while done < images:
        x, _ = next(it)
        done += int(x.shape[0])
    return done, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    """Command line: measure and print one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("torch", "tensorflow"), default="torch")
    parser.add_argument("--data", required=True, help="a directory of train-* TFRecords")
    parser.add_argument("--augmenter", default="none",
                        choices=("none", "autoaugment", "randaugment"))
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    rate = torch_rate if args.framework == "torch" else tensorflow_rate
    done, seconds = rate(args.data, args.image_size, args.augmenter, args.images, args.batch)
    print(json.dumps({"framework": args.framework, "augmenter": args.augmenter,
                      "image_size": args.image_size, "images": done, "seconds": seconds,
                      "images_per_s": done / seconds, "cpus": len(os.sched_getaffinity(0))}),
          flush=True)


if __name__ == "__main__":
    main()
