"""EfficientNet model: MBConv blocks with squeeze-and-excitation and stochastic depth."""

from apps.efficientnet.model.efficientnet import (
    EfficientNet,
    MBConv,
    NormLayer,
    SqueezeExcite,
    drop_connect,
    efficientnet,
    param_shapes,
)

__all__ = [
    "EfficientNet",
    "MBConv",
    "NormLayer",
    "SqueezeExcite",
    "drop_connect",
    "efficientnet",
    "param_shapes",
]
