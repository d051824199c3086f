"""EfficientNet configuration: variants b0..b7, the compound-scaling rules, and the flags."""

from apps.efficientnet.config.flags import MODES, build_parser, parse_args, str2bool
from apps.efficientnet.config.variants import (
    BASE_BLOCKS,
    HEAD_CHANNELS,
    SE_RATIO,
    STEM_CHANNELS,
    VARIANTS,
    BlockArgs,
    Variant,
    get_variant,
    round_filters,
    round_repeats,
    scaled_blocks,
)

__all__ = [
    "BASE_BLOCKS",
    "HEAD_CHANNELS",
    "MODES",
    "SE_RATIO",
    "STEM_CHANNELS",
    "VARIANTS",
    "BlockArgs",
    "Variant",
    "build_parser",
    "get_variant",
    "parse_args",
    "round_filters",
    "round_repeats",
    "scaled_blocks",
    "str2bool",
]
