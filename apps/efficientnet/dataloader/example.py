"""``tf.train.Example`` protos without TensorFlow or protoc.

The message classes are built at first use from a descriptor written here in Python
(``descriptor_pb2`` + ``message_factory``), equivalent to TensorFlow's ``example.proto`` and
``feature.proto``::

    message BytesList { repeated bytes value = 1; }
    message FloatList { repeated float value = 1 [packed = true]; }
    message Int64List { repeated int64 value = 1 [packed = true]; }
    message Feature { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                                   Int64List int64_list = 3; } }
    message Features { map<string, Feature> feature = 1; }
    message Example { Features features = 1; }

They live in a private descriptor pool, so they never clash with TensorFlow's own classes
when both are imported in one process.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["Feature", "make_example", "message_classes", "parse_example",
           "parse_image_record"]

Feature = bytes | int | float | Sequence[bytes] | Sequence[int] | Sequence[float]

_PACKAGE = "tensorflow"
_F = descriptor_pb2.FieldDescriptorProto


def _file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(name="shoal_apps/example.proto", package=_PACKAGE,
                                            syntax="proto3")
    for name, kind in (("BytesList", _F.TYPE_BYTES), ("FloatList", _F.TYPE_FLOAT),
                       ("Int64List", _F.TYPE_INT64)):
        fd.message_type.add(name=name).field.add(name="value", number=1, type=kind,
                                                 label=_F.LABEL_REPEATED)
    feature = fd.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, (field, type_name) in enumerate((("bytes_list", "BytesList"),
                                                 ("float_list", "FloatList"),
                                                 ("int64_list", "Int64List")), start=1):
        feature.field.add(name=field, number=number, type=_F.TYPE_MESSAGE,
                          type_name=f".{_PACKAGE}.{type_name}", label=_F.LABEL_OPTIONAL,
                          oneof_index=0)
    features = fd.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=_F.TYPE_MESSAGE,
                    type_name=f".{_PACKAGE}.Feature", label=_F.LABEL_OPTIONAL)
    features.field.add(name="feature", number=1, type=_F.TYPE_MESSAGE,
                       type_name=f".{_PACKAGE}.Features.FeatureEntry", label=_F.LABEL_REPEATED)
    fd.message_type.add(name="Example").field.add(
        name="features", number=1, type=_F.TYPE_MESSAGE, type_name=f".{_PACKAGE}.Features",
        label=_F.LABEL_OPTIONAL)
    return fd


@functools.cache
def message_classes() -> dict[str, type[Any]]:
    """The generated classes by name: Example, Features, Feature, BytesList, FloatList,
    Int64List."""
    pool = descriptor_pool.DescriptorPool()
    pool.Add(_file_descriptor())
    names = ("Example", "Features", "Feature", "BytesList", "FloatList", "Int64List")
    return {n: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{n}"))
            for n in names}


def make_example(features: Mapping[str, Feature]) -> bytes:
    """Serialize a ``tf.train.Example``; bytes go to bytes_list, ints to int64_list, floats to
    float_list (scalars or sequences of one kind)."""
    example = message_classes()["Example"]()
    for key, value in features.items():
        values = list(value) if isinstance(value, list | tuple) else [value]
        feature = example.features.feature[key]
        if all(isinstance(v, bytes) for v in values):
            feature.bytes_list.value.extend(values)
        elif all(isinstance(v, int) for v in values):
            feature.int64_list.value.extend(values)
        elif all(isinstance(v, int | float) for v in values):
            feature.float_list.value.extend(float(v) for v in values)
        else:
            raise TypeError(f"feature {key!r}: values must all be bytes, ints or floats "
                            f"(got {[type(v).__name__ for v in values]})")
    return example.SerializeToString()


def parse_example(data: bytes) -> dict[str, list[Any]]:
    """Every feature of a serialized ``tf.train.Example`` as a list of its values."""
    example = message_classes()["Example"]()
    example.ParseFromString(data)
    out: dict[str, list[Any]] = {}
    for key, feature in example.features.feature.items():
        kind = feature.WhichOneof("kind")
        out[key] = list(getattr(feature, kind).value) if kind else []
    return out


def parse_image_record(data: bytes, label_offset: int = 1) -> tuple[bytes, int]:
    """``(image/encoded, image/class/label - label_offset)`` of an ImageNet-layout Example.

    ImageNet TFRecords number classes 1..1000 (0 is "background"), hence ``label_offset=1``.

    Raises:
        KeyError: a feature is missing (the message lists those present).
    """
    features = parse_example(data)
    try:
        image, label = features["image/encoded"][0], features["image/class/label"][0]
    except (KeyError, IndexError):
        raise KeyError(f"Example lacks image/encoded or image/class/label; it has "
                       f"{sorted(features)}") from None
    return image, int(label) - label_offset
