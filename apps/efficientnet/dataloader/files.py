"""Where a split's data lives: ImageNet-layout TFRecords or an image folder (no framework
imports, shared by the PyTorch loaders and the Keras ``tf.data`` pipeline)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["find_split"]

_SPLIT_PREFIX = {"train": "train", "eval": "validation"}


def find_split(data_dir: str, split: str) -> tuple[str, Any]:
    """``("tfrecord", files)`` or ``("folder", root)`` for ``split`` ("train" / "eval")."""
    root = Path(data_dir)
    prefix = _SPLIT_PREFIX[split]
    files = sorted(str(p) for p in root.glob(f"{prefix}-*") if p.is_file()
                   and ".tmp-" not in p.name)
    if files:
        return "tfrecord", files
    for name in ((prefix, "val") if split == "eval" else (prefix,)):
        if (root / name).is_dir():
            return "folder", str(root / name)
    if root.is_dir():  # a SageMaker channel: the directory holds this split only
        subdirs = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        files = sorted(str(p) for p in root.iterdir() if p.is_file()
                       and not p.name.startswith("."))
        if subdirs and not files:
            return "folder", str(root)
        if files:
            return "tfrecord", files
    raise FileNotFoundError(
        f"no {split} data in {data_dir!r}: expected TFRecords named {prefix}-*-of-* , an image "
        f"folder {prefix}/<class>/*.jpg, or pass --synthetic")
