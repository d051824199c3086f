"""A small convolutional network, the communication-bound reference model of the benchmarks.

Four 3x3 convolution blocks (BatchNorm, ReLU) with 32, 64, 128 and 256 channels, each halving
the resolution, then global average pooling and a linear classifier: about 0.65 M parameters
(2.6 MB of float32 gradients in 14 tensors) for a few MFLOPs per 32x32 image, so a data-parallel
step spends a large share of its time exchanging gradients. ``--arch small-cnn`` trains it with
the rest of the application unchanged.
"""

from __future__ import annotations

from torch import Tensor, nn

from apps.efficientnet.model.efficientnet import NormLayer

__all__ = ["SmallCNN"]

_CHANNELS = (32, 64, 128, 256)


class SmallCNN(nn.Module):
    """Conv-BN-ReLU x 4 (stride 2), global pooling, linear classifier.

    Args:
        num_classes: classifier outputs.
        bn_momentum: BatchNorm momentum in PyTorch terms.
        bn_eps: BatchNorm epsilon.
        norm_layer: normalisation class (``nn.BatchNorm2d`` when ``None``), as for
            :class:`~apps.efficientnet.model.efficientnet.EfficientNet`.
    """

    def __init__(self, num_classes: int = 1000, bn_momentum: float = 0.01, bn_eps: float = 1e-3,
                 norm_layer: NormLayer | None = None) -> None:
        super().__init__()
        norm = nn.BatchNorm2d if norm_layer is None else norm_layer
        layers: list[nn.Module] = []
        cin = 3
        for cout in _CHANNELS:
            layers += [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                       norm(cout, eps=bn_eps, momentum=bn_momentum), nn.ReLU(inplace=True)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Class logits of shape ``(batch, num_classes)``."""
        return self.classifier(self.pool(self.features(x)).flatten(1))
