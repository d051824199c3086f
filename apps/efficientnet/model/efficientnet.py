"""EfficientNet b0..b7 in plain PyTorch (Tan & Le, 2019).

The network follows the reference TensorFlow / NVIDIA implementation so that the parameter
counts match the published ones exactly:

* stem: 3x3 stride-2 conv, BatchNorm, swish;
* MBConv blocks: optional 1x1 expansion (absent when the expand ratio is 1), depthwise conv,
  squeeze-and-excitation whose bottleneck is ``max(1, int(block_input_channels * se_ratio))``,
  1x1 projection without activation, and an identity skip with per-sample stochastic depth
  ("drop connect") when the stride is 1 and input and output channels agree;
* head: 1x1 conv, BatchNorm, swish, global average pooling, dropout, dense classifier.

Convolutions carry no bias except the two SE convolutions. Padding is symmetric
(``kernel // 2``) rather than TF's asymmetric "same" padding for stride 2.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from apps.efficientnet.config.variants import (
    HEAD_CHANNELS,
    STEM_CHANNELS,
    Variant,
    get_variant,
    round_filters,
    scaled_blocks,
)

__all__ = [
    "ACTIVATIONS",
    "EfficientNet",
    "MBConv",
    "NormLayer",
    "SqueezeExcite",
    "drop_connect",
    "efficientnet",
    "param_shapes",
    "set_activation",
]

#: ``norm_layer(num_features, eps=..., momentum=...)``, e.g. nn.BatchNorm2d or nn.SyncBatchNorm.
NormLayer = Callable[..., nn.Module]


def drop_connect(x: Tensor, rate: float, training: bool) -> Tensor:
    """Per-sample stochastic depth: zero whole samples with probability ``rate``, rescale the rest.

    Identity when not ``training`` or ``rate`` is 0.
    """
    if not training or rate <= 0.0:
        return x
    keep = 1.0 - rate
    mask = torch.empty((x.shape[0], 1, 1, 1), dtype=x.dtype, device=x.device).bernoulli_(keep)
    return x * mask / keep


class SqueezeExcite(nn.Module):
    """Squeeze-and-excitation: channel gates from a pooled, bottlenecked, sigmoid-ed descriptor."""

    def __init__(self, channels: int, squeeze_channels: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeeze_channels, 1, bias=True)
        self.act = nn.SiLU(inplace=True)
        self.expand = nn.Conv2d(squeeze_channels, channels, 1, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        """Scale ``x`` channel-wise by its gates."""
        s = x.mean((2, 3), keepdim=True)
        s = self.expand(self.act(self.reduce(s)))
        return x * torch.sigmoid(s)


class MBConv(nn.Module):
    """Mobile inverted bottleneck block with squeeze-and-excitation and stochastic depth."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel: int,
        stride: int,
        expand_ratio: int,
        se_ratio: float,
        drop_connect_rate: float,
        norm_layer: NormLayer,
    ) -> None:
        super().__init__()
        mid = in_channels * expand_ratio
        self.has_skip = stride == 1 and in_channels == out_channels
        self.drop_connect_rate = drop_connect_rate
        if expand_ratio != 1:
            self.expand = nn.Sequential(
                nn.Conv2d(in_channels, mid, 1, bias=False),
                norm_layer(mid),
                nn.SiLU(inplace=True),
            )
        else:
            self.expand = nn.Identity()
        self.depthwise = nn.Sequential(
            nn.Conv2d(mid, mid, kernel, stride, padding=kernel // 2, groups=mid, bias=False),
            norm_layer(mid),
            nn.SiLU(inplace=True),
        )
        self.se = SqueezeExcite(mid, max(1, int(in_channels * se_ratio)))
        self.project = nn.Sequential(
            nn.Conv2d(mid, out_channels, 1, bias=False),
            norm_layer(out_channels),
        )

    def forward(self, x: Tensor) -> Tensor:
        """Block output; adds the (stochastically dropped) residual when shapes allow."""
        y = self.project(self.se(self.depthwise(self.expand(x))))
        if self.has_skip:
            y = drop_connect(y, self.drop_connect_rate, self.training) + x
        return y


class EfficientNet(nn.Module):
    """EfficientNet for one :class:`~apps.efficientnet.config.variants.Variant`.

    Args:
        variant: width/depth/dropout of the network (resolution is the data pipeline's concern).
        num_classes: classifier outputs.
        drop_connect_rate: stochastic-depth rate of the last block; block ``i`` of ``n`` uses
            ``drop_connect_rate * i / n``.
        bn_momentum: BatchNorm momentum in PyTorch terms (0.01 == TF's decay 0.99).
        bn_eps: BatchNorm epsilon.
        norm_layer: normalisation class called as ``norm_layer(num_features, eps=, momentum=)``;
            ``nn.BatchNorm2d`` when ``None`` (pass e.g. ``nn.SyncBatchNorm`` for synced statistics).
    """

    def __init__(
        self,
        variant: Variant,
        num_classes: int = 1000,
        drop_connect_rate: float = 0.2,
        bn_momentum: float = 0.01,
        bn_eps: float = 1e-3,
        norm_layer: NormLayer | None = None,
        activation: str = "swish",
        weight_init: str = "fan_out",
    ) -> None:
        super().__init__()
        self.variant = variant
        self.weight_init = weight_init
        base_norm = nn.BatchNorm2d if norm_layer is None else norm_layer

        def norm(num_features: int) -> nn.Module:
            return base_norm(num_features, eps=bn_eps, momentum=bn_momentum)

        stem = round_filters(STEM_CHANNELS, variant.width)
        self.stem = nn.Sequential(
            nn.Conv2d(3, stem, 3, stride=2, padding=1, bias=False),
            norm(stem),
            nn.SiLU(inplace=True),
        )

        stages = scaled_blocks(variant)
        total = sum(s.repeats for s in stages)
        blocks: list[nn.Module] = []
        for stage in stages:
            for r in range(stage.repeats):
                blocks.append(
                    MBConv(
                        in_channels=stage.in_channels if r == 0 else stage.out_channels,
                        out_channels=stage.out_channels,
                        kernel=stage.kernel,
                        stride=stage.stride if r == 0 else 1,
                        expand_ratio=stage.expand_ratio,
                        se_ratio=stage.se_ratio,
                        drop_connect_rate=drop_connect_rate * len(blocks) / total,
                        norm_layer=norm,
                    )
                )
        self.blocks = nn.Sequential(*blocks)

        head = round_filters(HEAD_CHANNELS, variant.width)
        self.head = nn.Sequential(
            nn.Conv2d(stages[-1].out_channels, head, 1, bias=False),
            norm(head),
            nn.SiLU(inplace=True),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.dropout = nn.Dropout(variant.dropout)
        self.classifier = nn.Linear(head, num_classes)
        set_activation(self, activation)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """TF-style initialisation (the recipe's variance scaling, ``weight_init`` picking
        the fan).

        Convolutions: normal with std ``sqrt(2 / fan)``, ``fan_out = k*k*out/groups`` (so
        ``k*k`` for depthwise, as TF counts it), ``fan_in = k*k*in/groups``; conv biases zero.
        Normalisation: weight 1, bias 0. Classifier: uniform(-1/sqrt(fan), 1/sqrt(fan)) with
        ``fan`` the classes (fan_out) or the features (fan_in), bias zero.
        """
        fan_in = self.weight_init == "fan_in"
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                kh, kw = m.kernel_size
                fan = kh * kw * (m.in_channels if fan_in else m.out_channels) // m.groups
                nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan))
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.modules.batchnorm._NormBase | nn.GroupNorm):
                if m.weight is not None:
                    nn.init.ones_(m.weight)
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                bound = 1.0 / math.sqrt(m.in_features if fan_in else m.out_features)
                nn.init.uniform_(m.weight, -bound, bound)
                nn.init.zeros_(m.bias)

    def features(self, x: Tensor) -> Tensor:
        """Feature map after the head convolution, before pooling."""
        return self.head(self.blocks(self.stem(x)))

    def forward(self, x: Tensor) -> Tensor:
        """Class logits of shape ``(batch, num_classes)``."""
        x = self.pool(self.features(x)).flatten(1)
        return self.classifier(self.dropout(x))


#: The recipe's ``--activation`` names (TensorFlow's) and the modules they stand for.
ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "swish": nn.SiLU, "silu": nn.SiLU, "simple_swish": nn.SiLU, "relu": nn.ReLU,
    "relu6": nn.ReLU6, "hard_swish": nn.Hardswish, "gelu": nn.GELU, "elu": nn.ELU,
    "selu": nn.SELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "identity": nn.Identity,
    "linear": nn.Identity,
}


def set_activation(model: nn.Module, name: str) -> None:
    """Put the activation ``name`` (:data:`ACTIVATIONS`) wherever ``model`` has swish."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; use one of {', '.join(ACTIVATIONS)}")
    if ACTIVATIONS[name] is nn.SiLU:
        return
    for module in list(model.modules()):
        for child, sub in list(module.named_children()):
            if isinstance(sub, nn.SiLU):
                setattr(module, child, ACTIVATIONS[name]())


def efficientnet(arch: str, **kw: object) -> EfficientNet:
    """Build the variant named ``arch`` (``"efficientnet-b3"`` or ``"b3"``).

    ``kw`` are passed to :class:`EfficientNet` (``num_classes``, ``drop_connect_rate``, ...).
    """
    return EfficientNet(get_variant(arch), **kw)  # type: ignore[arg-type]


def param_shapes(arch: str, num_classes: int = 1000) -> list[tuple[str, tuple[int, ...]]]:
    """Named parameter shapes of ``arch`` in registration order, without allocating weights.

    The model is built on the ``meta`` device (falls back to CPU if that fails).
    """
    try:
        with torch.device("meta"):
            model = efficientnet(arch, num_classes=num_classes)
    except (RuntimeError, NotImplementedError):
        model = efficientnet(arch, num_classes=num_classes)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]
