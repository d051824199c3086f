"""EfficientNet model: MBConv blocks with squeeze-and-excitation and stochastic depth; and the
small CNN of the benchmarks."""

from apps.efficientnet.model.efficientnet import (
    EfficientNet,
    MBConv,
    NormLayer,
    SqueezeExcite,
    drop_connect,
    efficientnet,
    param_shapes,
)
from apps.efficientnet.model.small_cnn import SmallCNN

__all__ = [
    "EfficientNet",
    "MBConv",
    "NormLayer",
    "SmallCNN",
    "SqueezeExcite",
    "drop_connect",
    "efficientnet",
    "param_shapes",
]
