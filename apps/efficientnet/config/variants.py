"""EfficientNet variants b0..b7 and the compound-scaling rules of Tan & Le (2019).

Every variant scales the same EfficientNet-B0 backbone: channel counts by ``width``
(rounded to a multiple of 8 by :func:`round_filters`), the number of blocks per stage by
``depth`` (rounded up by :func:`round_repeats`), plus its own input ``resolution`` and
classifier ``dropout``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "BASE_BLOCKS",
    "HEAD_CHANNELS",
    "SE_RATIO",
    "SMALL_CNN",
    "SMALL_CNN_RESOLUTION",
    "STEM_CHANNELS",
    "VARIANTS",
    "BlockArgs",
    "Variant",
    "get_variant",
    "round_filters",
    "round_repeats",
    "scaled_blocks",
    "training_resolution",
]

#: Squeeze-and-excitation ratio, relative to a block's *input* channels.
SE_RATIO = 0.25
#: Stem output channels of B0 (before width scaling).
STEM_CHANNELS = 32
#: Head (final 1x1 conv) channels of B0 (before width scaling).
HEAD_CHANNELS = 1280
#: The one architecture besides the EfficientNets: a small CNN, the communication-bound
#: reference model of the benchmarks (:mod:`apps.efficientnet.model.small_cnn`).
SMALL_CNN = "small-cnn"
#: Its input resolution when ``--image_size`` is not given.
SMALL_CNN_RESOLUTION = 32


@dataclass(frozen=True)
class Variant:
    """One EfficientNet variant: width/depth multipliers, input resolution, dropout."""

    name: str
    width: float
    depth: float
    resolution: int
    dropout: float


@dataclass(frozen=True)
class BlockArgs:
    """One stage of MBConv blocks (B0 values, or scaled by :func:`scaled_blocks`).

    The first block of a stage maps ``in_channels`` to ``out_channels`` with ``stride``;
    the remaining ``repeats - 1`` blocks map ``out_channels`` to itself with stride 1.
    """

    expand_ratio: int
    kernel: int
    stride: int
    in_channels: int
    out_channels: int
    repeats: int
    se_ratio: float = SE_RATIO


#: The seven stages of EfficientNet-B0.
BASE_BLOCKS: tuple[BlockArgs, ...] = (
    BlockArgs(expand_ratio=1, kernel=3, stride=1, in_channels=32, out_channels=16, repeats=1),
    BlockArgs(expand_ratio=6, kernel=3, stride=2, in_channels=16, out_channels=24, repeats=2),
    BlockArgs(expand_ratio=6, kernel=5, stride=2, in_channels=24, out_channels=40, repeats=2),
    BlockArgs(expand_ratio=6, kernel=3, stride=2, in_channels=40, out_channels=80, repeats=3),
    BlockArgs(expand_ratio=6, kernel=5, stride=1, in_channels=80, out_channels=112, repeats=3),
    BlockArgs(expand_ratio=6, kernel=5, stride=2, in_channels=112, out_channels=192, repeats=4),
    BlockArgs(expand_ratio=6, kernel=3, stride=1, in_channels=192, out_channels=320, repeats=1),
)

#: Compound-scaling table of the paper: (width, depth, resolution, dropout).
VARIANTS: dict[str, Variant] = {
    f"efficientnet-{key}": Variant(f"efficientnet-{key}", w, d, r, p)
    for key, (w, d, r, p) in {
        "b0": (1.0, 1.0, 224, 0.2),
        "b1": (1.0, 1.1, 240, 0.2),
        "b2": (1.1, 1.2, 260, 0.3),
        "b3": (1.2, 1.4, 300, 0.3),
        "b4": (1.4, 1.8, 380, 0.4),
        "b5": (1.6, 2.2, 456, 0.4),
        "b6": (1.8, 2.6, 528, 0.5),
        "b7": (2.0, 3.1, 600, 0.5),
    }.items()
}


def round_filters(filters: int, width: float, divisor: int = 8) -> int:
    """Scale a channel count by ``width`` and round it to the nearest multiple of ``divisor``.

    The result is never below ``divisor`` and never below 90% of the scaled value (one more
    ``divisor`` is added in that case), as in the reference implementation.
    """
    scaled = filters * width
    rounded = max(divisor, int(scaled + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * scaled:
        rounded += divisor
    return int(rounded)


def round_repeats(repeats: int, depth: float) -> int:
    """Scale a stage's block count by ``depth``, rounding up."""
    return math.ceil(depth * repeats)


def scaled_blocks(variant: Variant) -> list[BlockArgs]:
    """The seven stages of ``variant``: channels and repeats scaled from :data:`BASE_BLOCKS`."""
    return [
        BlockArgs(
            expand_ratio=b.expand_ratio,
            kernel=b.kernel,
            stride=b.stride,
            in_channels=round_filters(b.in_channels, variant.width),
            out_channels=round_filters(b.out_channels, variant.width),
            repeats=round_repeats(b.repeats, variant.depth),
            se_ratio=b.se_ratio,
        )
        for b in BASE_BLOCKS
    ]


def get_variant(arch: str) -> Variant:
    """Look up a variant by name: ``"efficientnet-b0"`` or ``"b0"`` (case-insensitive).

    Raises:
        ValueError: ``arch`` names no variant; the message lists the valid names.
    """
    key = arch.strip().lower()
    if not key.startswith("efficientnet-"):
        key = f"efficientnet-{key}"
    try:
        return VARIANTS[key]
    except KeyError:
        valid = ", ".join(VARIANTS)
        raise ValueError(
            f"unknown EfficientNet variant {arch!r}; valid names: {valid} "
            f"(or the short forms b0..b7)"
        ) from None


def training_resolution(arch: str, image_size: int | None) -> int:
    """The training resolution: ``--image_size`` when given, else ``arch``'s own."""
    if image_size:
        return int(image_size)
    return SMALL_CNN_RESOLUTION if arch == SMALL_CNN else get_variant(arch).resolution
