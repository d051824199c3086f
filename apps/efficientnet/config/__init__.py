"""EfficientNet configuration: variants b0..b7 and the compound-scaling rules."""

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
    "SE_RATIO",
    "STEM_CHANNELS",
    "VARIANTS",
    "BlockArgs",
    "Variant",
    "get_variant",
    "round_filters",
    "round_repeats",
    "scaled_blocks",
]
