"""Input pipelines: ImageNet TFRecords (read without TensorFlow, CRC-checked), image folders
and synthetic images; JPEG decoding and AutoAugment / RandAugment with Pillow. The Keras
application's ``tf.data`` pipeline is :mod:`apps.efficientnet.keras.data`."""

from apps.efficientnet.dataloader.example import make_example, parse_example, parse_image_record
from apps.efficientnet.dataloader.files import find_split
from apps.efficientnet.dataloader.tfrecord import (
    TFRecordError,
    TFRecordWriter,
    count_records,
    read_records,
)

# the PyTorch loaders import torch: loaded on first use, so the Keras pipeline runs without it
_LAZY = {"AutoAugment": "augment", "RandAugment": "augment", "make_augmenter": "augment",
         "ImageFolderImages": "datasets", "Preprocess": "datasets",
         "SyntheticImages": "datasets", "TFRecordImages": "datasets",
         "build_dataset": "datasets", "make_loader": "datasets"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AutoAugment",
    "ImageFolderImages",
    "Preprocess",
    "RandAugment",
    "SyntheticImages",
    "TFRecordError",
    "TFRecordImages",
    "TFRecordWriter",
    "build_dataset",
    "count_records",
    "find_split",
    "make_augmenter",
    "make_example",
    "make_loader",
    "parse_example",
    "parse_image_record",
    "read_records",
]
