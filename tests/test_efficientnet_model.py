"""EfficientNet model of the training application (apps.efficientnet): architecture and API."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from apps.efficientnet.config import (
    BASE_BLOCKS,
    VARIANTS,
    Variant,
    get_variant,
    round_filters,
    round_repeats,
    scaled_blocks,
)
from apps.efficientnet.model import (
    EfficientNet,
    MBConv,
    SqueezeExcite,
    drop_connect,
    efficientnet,
    param_shapes,
)

PUBLISHED_PARAMS = {
    "efficientnet-b0": 5_288_548,
    "efficientnet-b1": 7_794_184,
    "efficientnet-b2": 9_109_994,
    "efficientnet-b3": 12_233_232,
    "efficientnet-b4": 19_341_616,
    "efficientnet-b5": 30_389_784,
    "efficientnet-b6": 43_040_704,
    "efficientnet-b7": 66_347_960,
}


def meta_model(arch: str, **kw: object) -> EfficientNet:
    """Build ``arch`` on the meta device: shapes only, no weight memory."""
    with torch.device("meta"):
        return efficientnet(arch, **kw)


@pytest.fixture(scope="module")
def b0() -> EfficientNet:
    torch.manual_seed(0)
    return efficientnet("b0")


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("filters", "width", "expected"),
    [
        (32, 1.0, 32),
        (32, 1.1, 32),
        (16, 1.1, 16),
        (40, 1.2, 48),
        (24, 1.4, 32),
        (112, 1.8, 200),
        (320, 2.0, 640),
        (1280, 1.1, 1408),
        (1280, 1.2, 1536),
        (1280, 1.4, 1792),
        (1280, 1.6, 2048),
        (1280, 1.8, 2304),
        (1280, 2.0, 2560),
        (11, 1.0, 16),  # 8 would be < 90% of 11: one divisor more
        (19, 1.0, 24),  # 16 < 17.1
        (1, 1.0, 8),  # never below the divisor
        (20, 1.0, 24),  # halves round up
    ],
)
def test_round_filters(filters: int, width: float, expected: int) -> None:
    assert round_filters(filters, width) == expected


@pytest.mark.parametrize(
    ("repeats", "depth", "expected"),
    [(1, 1.0, 1), (4, 1.0, 4), (1, 1.1, 2), (2, 1.1, 3), (3, 1.4, 5), (4, 2.6, 11), (3, 3.1, 10)],
)
def test_round_repeats(repeats: int, depth: float, expected: int) -> None:
    assert round_repeats(repeats, depth) == expected


def test_variant_table() -> None:
    assert list(VARIANTS) == [f"efficientnet-b{i}" for i in range(8)]
    assert VARIANTS["efficientnet-b5"] == Variant("efficientnet-b5", 1.6, 2.2, 456, 0.4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        VARIANTS["efficientnet-b0"].width = 2.0  # type: ignore[misc]
    assert len(BASE_BLOCKS) == 7
    assert sum(b.repeats for b in BASE_BLOCKS) == 16
    assert [b.repeats for b in scaled_blocks(get_variant("b7"))] == [4, 7, 7, 10, 10, 13, 4]


@pytest.mark.parametrize("name", ["b0", "efficientnet-b0", "EfficientNet-B0", " b0 "])
def test_get_variant_spellings(name: str) -> None:
    assert get_variant(name) is VARIANTS["efficientnet-b0"]


@pytest.mark.parametrize("name", ["b8", "efficientnet", "resnet50", ""])
def test_get_variant_errors(name: str) -> None:
    with pytest.raises(ValueError, match="valid names") as info:
        get_variant(name)
    assert "efficientnet-b0" in str(info.value) and "efficientnet-b7" in str(info.value)
    with pytest.raises(ValueError):
        efficientnet(name)


# --- architecture ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(PUBLISHED_PARAMS))
def test_published_parameter_counts(arch: str) -> None:
    model = meta_model(arch)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMS[arch]


def test_b0_tensor_count_and_structure(b0: EfficientNet) -> None:
    assert len(list(b0.parameters())) == 213
    blocks = [m for m in b0.modules() if isinstance(m, MBConv)]
    assert len(blocks) == 16
    # No expansion conv when the expand ratio is 1; SE squeezes from the block's input channels.
    assert isinstance(blocks[0].expand, nn.Identity)
    assert blocks[0].se.reduce.out_channels == 8
    assert blocks[1].se.reduce.in_channels == 96 and blocks[1].se.reduce.out_channels == 4
    # Only the SE convs carry a bias.
    for name, m in b0.named_modules():
        if isinstance(m, nn.Conv2d):
            assert (m.bias is not None) == (".se." in f".{name}."), name
    # Identity skip only for stride 1 and in == out; drop-connect rate grows linearly.
    assert [b.has_skip for b in blocks].count(True) == 9
    rates = [b.drop_connect_rate for b in blocks]
    assert rates[0] == 0.0 and rates == sorted(rates) and rates[-1] == pytest.approx(0.2 * 15 / 16)


def test_batchnorm_settings(b0: EfficientNet) -> None:
    bns = [m for m in b0.modules() if isinstance(m, nn.BatchNorm2d)]
    assert bns and all(m.momentum == 0.01 and m.eps == 1e-3 for m in bns)


def test_param_shapes_match_model(b0: EfficientNet) -> None:
    shapes = param_shapes("efficientnet-b0")
    assert shapes == [(n, tuple(p.shape)) for n, p in b0.named_parameters()]
    assert shapes[0] == ("stem.0.weight", (32, 3, 3, 3))
    assert shapes[-2:] == [("classifier.weight", (1000, 1280)), ("classifier.bias", (1000,))]
    assert param_shapes("b0", num_classes=10)[-1] == ("classifier.bias", (10,))
    assert sum(math.prod(s) for _, s in param_shapes("b4")) == PUBLISHED_PARAMS["efficientnet-b4"]


def test_initialisation(b0: EfficientNet) -> None:
    head = b0.head[0]
    std = math.sqrt(2.0 / head.out_channels)  # 1x1 conv: fan_out = out_channels
    assert head.weight.std().item() == pytest.approx(std, rel=0.05)
    dw = b0.blocks[1].depthwise[0]
    assert dw.groups == dw.in_channels
    assert dw.weight.std().item() == pytest.approx(math.sqrt(2.0 / 9), rel=0.1)
    bound = 1.0 / math.sqrt(1000)
    w = b0.classifier.weight
    assert w.abs().max().item() <= bound and w.abs().max().item() > 0.9 * bound
    assert torch.count_nonzero(b0.classifier.bias) == 0
    assert all(
        torch.count_nonzero(m.expand.bias) == 0
        for m in b0.modules()
        if isinstance(m, SqueezeExcite)
    )


def test_norm_layer_swap() -> None:
    calls: list[tuple[int, float, float]] = []

    class RecordingBN(nn.BatchNorm2d):
        def __init__(self, num_features: int, eps: float, momentum: float) -> None:
            calls.append((num_features, eps, momentum))
            super().__init__(num_features, eps=eps, momentum=momentum)

    model = meta_model("b0", norm_layer=RecordingBN, bn_momentum=0.1, bn_eps=1e-5)
    assert len(calls) == sum(isinstance(m, RecordingBN) for m in model.modules()) == 49
    assert all(eps == 1e-5 and mom == 0.1 for _, eps, mom in calls)
    sync = meta_model("b0", norm_layer=nn.SyncBatchNorm)
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in sync.modules()) == 49
    assert sum(p.numel() for p in sync.parameters()) == PUBLISHED_PARAMS["efficientnet-b0"]


# --- forward / backward ---------------------------------------------------------------------


@pytest.mark.parametrize("train", [True, False])
def test_forward_shapes(b0: EfficientNet, train: bool) -> None:
    b0.train(train)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        y = b0(x)
    assert y.shape == (2, 1000) and torch.isfinite(y).all()
    b0.eval()


def test_eval_deterministic(b0: EfficientNet) -> None:
    b0.eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(b0(x), b0(x))


def test_channels_last_matches_contiguous() -> None:
    torch.manual_seed(1)
    model = efficientnet("b0").eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        model = model.to(memory_format=torch.channels_last)
        assert model.stem[0].weight.is_contiguous(memory_format=torch.channels_last)
        out = model(x.contiguous(memory_format=torch.channels_last))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_drop_connect_only_in_training() -> None:
    torch.manual_seed(2)
    no_dropout = dataclasses.replace(get_variant("b0"), dropout=0.0)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        plain = EfficientNet(no_dropout, drop_connect_rate=0.0).train()
        assert torch.equal(plain(x), plain(x))  # train mode itself is deterministic here
        model = EfficientNet(no_dropout, drop_connect_rate=0.5).train()
        assert not torch.equal(model(x), model(x))
        model.eval()
        assert torch.equal(model(x), model(x))


def test_drop_connect_is_per_sample() -> None:
    torch.manual_seed(3)
    x = torch.randn(64, 4, 3, 3) + 5.0
    y = drop_connect(x, 0.5, training=True)
    dropped = (y == 0).flatten(1).all(1)
    kept = torch.isclose(y, x * 2.0).flatten(1).all(1)
    assert torch.all(dropped ^ kept) and 0 < int(dropped.sum()) < 64
    assert drop_connect(x, 0.5, training=False) is x
    assert drop_connect(x, 0.0, training=True) is x


def test_backward_reaches_every_parameter(b0: EfficientNet) -> None:
    b0.train()
    b0.zero_grad(set_to_none=True)
    x = torch.randn(2, 3, 64, 64)
    loss = nn.functional.cross_entropy(b0(x), torch.tensor([1, 7]))
    loss.backward()
    missing = [n for n, p in b0.named_parameters() if p.grad is None]
    assert not missing
    assert all(torch.isfinite(p.grad).all() for p in b0.parameters())
    assert b0.stem[0].weight.grad.abs().sum() > 0 and b0.classifier.weight.grad.abs().sum() > 0
    b0.zero_grad(set_to_none=True)
    b0.eval()


def test_bench_presets_are_the_applications_shapes() -> None:
    """shoal.bench ships EfficientNet shapes as data (it may not import the app)."""
    from shoal.bench.models import MODELS
    from shoal.bench.models import param_shapes as preset

    for arch in MODELS:
        assert preset(arch) == [(n, tuple(s)) for n, s in param_shapes(arch)]


def test_small_cnn_of_the_benchmarks() -> None:
    from apps.efficientnet.config import parse_args
    from apps.efficientnet.model import SmallCNN
    from apps.efficientnet.runtime.trainer import image_size
    torch.manual_seed(0)
    model = SmallCNN(10)
    params = list(model.parameters())
    # 4 convolutions (no bias), 4 BatchNorms (weight, bias), the classifier (weight, bias)
    assert len(params) == 14 and sum(p.numel() for p in params) == 387_936 + 960 + 2_570
    assert sum(isinstance(m, nn.BatchNorm2d) for m in model.modules()) == 4
    synced = SmallCNN(10, norm_layer=nn.SyncBatchNorm)
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in synced.modules()) == 4
    x = torch.randn(3, 3, 32, 32)
    model(x).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    # the application takes it by name, at 32 px unless told otherwise
    args = parse_args(["--arch", "small-cnn"])
    assert args.arch == "small-cnn" and image_size(args) == 32
    assert parse_args(["--arch", "b2"]).arch == "efficientnet-b2"
