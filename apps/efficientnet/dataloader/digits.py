"""The bundled data set: scikit-learn's handwritten digits as ImageNet-layout TFRecords.

``python -m apps.efficientnet.dataloader.digits --out .cache/digits-tfrecords`` writes the
1,797 8x8 digit images, upscaled to 32x32 RGB JPEGs, into ``train-0000i-of-0000n`` and
``validation-...`` files with labels stored 1-based as ImageNet's are (0 is "background").
A seeded split keeps ``eval_fraction`` of the images for validation. Writing is skipped when
the files are already there.
"""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import numpy as np
from PIL import Image

from .example import make_example
from .tfrecord import TFRecordWriter

__all__ = ["digits_jpegs", "main", "write_imagenet_layout"]


def digits_jpegs(size: int = 32, quality: int = 95) -> tuple[list[bytes], list[int]]:
    """scikit-learn's digits as RGB JPEGs of ``size`` x ``size`` and their labels 0..9."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    jpegs = []
    for img in digits.images:
        gray = Image.fromarray((img * (255.0 / 16.0)).astype(np.uint8), "L")
        rgb = gray.resize((size, size), Image.Resampling.BICUBIC).convert("RGB")
        buf = io.BytesIO()
        rgb.save(buf, format="JPEG", quality=quality)
        jpegs.append(buf.getvalue())
    return jpegs, [int(t) for t in digits.target]


def write_imagenet_layout(out: str | Path, jpegs: list[bytes], labels: list[int],
                          split: str, num_shards: int, label_offset: int = 1) -> list[Path]:
    """Write ``split-0000i-of-0000n`` TFRecord shards of ``(jpeg, label + label_offset)``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for shard in range(num_shards):
        path = out / f"{split}-{shard:05d}-of-{num_shards:05d}"
        with TFRecordWriter(path) as w:
            for jpeg, label in list(zip(jpegs, labels, strict=True))[shard::num_shards]:
                w.write(make_example({"image/encoded": jpeg,
                                      "image/class/label": label + label_offset,
                                      "image/format": b"JPEG"}))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    """Command line: write the digits TFRecords unless they exist."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".cache/digits-tfrecords")
    parser.add_argument("--train_shards", type=int, default=8)
    parser.add_argument("--eval_shards", type=int, default=2)
    parser.add_argument("--eval_fraction", type=float, default=0.2)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    done = out / ".complete"
    if done.exists():
        print(f"digits: {out} already prepared")
        return
    jpegs, labels = digits_jpegs(args.image_size)
    order = np.random.default_rng(args.seed).permutation(len(jpegs))
    n_eval = int(len(jpegs) * args.eval_fraction)
    split = {"validation": order[:n_eval], "train": order[n_eval:]}
    for name, idx in split.items():
        shards = args.eval_shards if name == "validation" else args.train_shards
        write_imagenet_layout(out, [jpegs[i] for i in idx], [labels[i] for i in idx], name,
                              shards)
    done.touch()
    print(f"digits: wrote {len(split['train'])} train and {n_eval} validation images "
          f"to {out}")


if __name__ == "__main__":
    main()
