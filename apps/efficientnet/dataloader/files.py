"""Where a split's data lives: ImageNet-layout TFRecords or an image folder (no framework
imports, shared by the PyTorch loaders and the Keras ``tf.data`` pipeline)."""

from __future__ import annotations

from typing import Any

from .storage import is_url, list_dir, name_of

__all__ = ["find_split"]

_SPLIT_PREFIX = {"train": "train", "eval": "validation"}
INDEX_NAME = ".shoal-index.json"  # the record index beside the data (dataloader.index)


def find_split(data_dir: str, split: str) -> tuple[str, Any]:
    """``("tfrecord", files)`` or ``("folder", root)`` for ``split`` ("train" / "eval");
    ``data_dir`` may be a URL (``s3://bucket/prefix``, TFRecords only)."""
    prefix = _SPLIT_PREFIX[split]
    entries = list_dir(data_dir)
    files = [p for p, is_dir, _ in entries if not is_dir and name_of(p).startswith(f"{prefix}-")
             and ".tmp-" not in name_of(p)]
    if files:
        return "tfrecord", files
    subdirs = {name_of(p): p for p, is_dir, _ in entries
               if is_dir and not name_of(p).startswith(".")}
    for name in ((prefix, "val") if split == "eval" else (prefix,)):
        if name in subdirs and not is_url(data_dir):
            return "folder", subdirs[name]
    # a SageMaker channel: the directory holds this split only
    plain = [p for p, is_dir, _ in entries if not is_dir and not name_of(p).startswith(".")
             and ".tmp-" not in name_of(p)]
    if subdirs and not plain and not is_url(data_dir):
        return "folder", str(data_dir)
    if plain:
        return "tfrecord", plain
    raise FileNotFoundError(
        f"no {split} data in {data_dir!r}: expected TFRecords named {prefix}-*-of-* , an image "
        f"folder {prefix}/<class>/*.jpg, or pass --synthetic")
