"""Input pipelines: ImageNet TFRecords (read without TensorFlow, CRC-checked), image folders
and synthetic images; JPEG decoding and AutoAugment / RandAugment with Pillow."""

from apps.efficientnet.dataloader.augment import AutoAugment, RandAugment, make_augmenter
from apps.efficientnet.dataloader.datasets import (
    ImageFolderImages,
    Preprocess,
    SyntheticImages,
    TFRecordImages,
    build_dataset,
    make_loader,
)
from apps.efficientnet.dataloader.example import make_example, parse_example, parse_image_record
from apps.efficientnet.dataloader.tfrecord import (
    TFRecordError,
    TFRecordWriter,
    count_records,
    read_records,
)

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
    "make_augmenter",
    "make_example",
    "make_loader",
    "parse_example",
    "parse_image_record",
    "read_records",
]
