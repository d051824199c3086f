"""Photographs at ImageNet's size, for measuring the input pipeline on real JPEG work.

``python -m apps.efficientnet.dataloader.photos --out .cache/photo-tfrecords --count 3000``
cuts scikit-learn's two sample photographs (``china.jpg`` and ``flower.jpg``, 640x427) into
``count`` distinct JPEGs of about ImageNet's mean size (500x375 landscape or 375x500 portrait):
each a random crop (40-100% of the area) resized, randomly flipped and saved at a random
quality (75-95), so that no two records are alike and the decoder does real work on each. They
are written as ImageNet-layout TFRecords (``train-0000i-of-0000n``, labels 1..1000), generated
on demand and never committed. Writing is skipped when the files are already there.
"""

from __future__ import annotations

import argparse
import io
import random
from pathlib import Path

import numpy as np
from PIL import Image

from .digits import write_imagenet_layout

__all__ = ["main", "photo_jpegs", "write_photo_records"]

#: ImageNet's photographs average about 400x350 (most are 500 on the long side)
LONG_SIDE, SHORT_SIDE = 500, 375


def photo_jpegs(count: int, seed: int = 0) -> tuple[list[bytes], list[int]]:
    """``count`` distinct JPEGs cut from scikit-learn's sample photographs, and labels
    0..999."""
    from sklearn.datasets import load_sample_images

    sources = [Image.fromarray(np.asarray(img)) for img in load_sample_images().images]
    rng = random.Random(seed)
    jpegs, labels = [], []
    for _ in range(count):
        src = rng.choice(sources)
        w, h = src.size
        portrait = rng.random() < 0.25
        aspect = SHORT_SIDE / LONG_SIDE if portrait else LONG_SIDE / SHORT_SIDE
        area = w * h * rng.uniform(0.4, 1.0)
        cw = min(w, round((area * aspect) ** 0.5))
        ch = min(h, round(cw / aspect))
        x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
        out = (SHORT_SIDE, LONG_SIDE) if portrait else (LONG_SIDE, SHORT_SIDE)
        img = src.resize(out, Image.Resampling.BICUBIC, box=(x, y, x + cw, y + ch))
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=rng.randint(75, 95))
        jpegs.append(buf.getvalue())
        labels.append(rng.randrange(1000))
    return jpegs, labels


def write_photo_records(out: str | Path, count: int, num_shards: int = 8, seed: int = 0
                        ) -> list[Path]:
    """The ``train`` shards of ``count`` photographs in ``out`` (written unless there)."""
    out = Path(out)
    existing = sorted(out.glob(f"train-*-of-{num_shards:05d}"))
    marker = out / f".count-{count}-seed-{seed}"
    if len(existing) == num_shards and marker.exists():
        return existing
    for stale in [*out.glob("train-*"), *out.glob(".count-*")]:  # another count's shards
        stale.unlink()
    jpegs, labels = photo_jpegs(count, seed)
    paths = write_imagenet_layout(out, jpegs, labels, "train", num_shards)
    marker.write_text("")
    return paths


def main(argv: list[str] | None = None) -> None:
    """Command line: write the photograph TFRecords unless they exist."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".cache/photo-tfrecords")
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paths = write_photo_records(args.out, args.count, args.shards, args.seed)
    size = sum(p.stat().st_size for p in paths)
    print(f"photos: {args.count} JPEGs of about {LONG_SIDE}x{SHORT_SIDE} in {len(paths)} "
          f"shards, {size / 2**20:.0f} MiB, in {args.out}")


if __name__ == "__main__":
    main()
