"""Image preprocessing and AutoAugment / RandAugment with Pillow (no torchvision).

Training: Inception-style random resized crop, random horizontal flip, then the augmenter.
Evaluation: central crop of ``crop_fraction`` of the shorter side, resized. Both return
``uint8`` CHW tensors; normalisation happens on the batch in the training process.

The augmentation ops and their magnitude mappings (levels 0..10) follow the TensorFlow
EfficientNet reference (``autoaugment.py``); the AutoAugment policy is a subset of its "v0"
ImageNet policy.
"""

from __future__ import annotations

import io
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw, ImageEnhance, ImageOps

if TYPE_CHECKING:  # torch only where tensors are made: the Keras path uses the augmenters
    import torch

__all__ = ["AUTOAUGMENT_POLICY", "OPS", "AutoAugment", "RandAugment", "decode", "eval_image",
           "eval_jpeg", "make_augmenter", "open_for_crop", "to_tensor", "train_image",
           "train_jpeg"]

MAX_LEVEL = 10.0
_FILL = (128, 128, 128)
Op = Callable[[Image.Image, float, random.Random], Image.Image]


def _signed(value: float, rng: random.Random) -> float:
    return value if rng.random() < 0.5 else -value


def _affine(img: Image.Image, matrix: tuple[float, ...]) -> Image.Image:
    return img.transform(img.size, Image.Transform.AFFINE, matrix, Image.Resampling.BILINEAR,
                         fillcolor=_FILL)


def _enhance(cls: type) -> Op:
    return lambda img, level, rng: cls(img).enhance(level / MAX_LEVEL * 1.8 + 0.1)


def _solarize_add(img: Image.Image, level: float, rng: random.Random) -> Image.Image:
    a = np.asarray(img, dtype=np.int16)
    added = np.clip(a + int(level / MAX_LEVEL * 110), 0, 255)
    return Image.fromarray(np.where(a < 128, added, a).astype(np.uint8))


def _cutout(img: Image.Image, level: float, rng: random.Random) -> Image.Image:
    half = int(level / MAX_LEVEL * 0.18 * min(img.size) / 2)  # TF: 40 px at 224
    x, y = rng.randrange(img.size[0]), rng.randrange(img.size[1])
    img = img.copy()
    ImageDraw.Draw(img).rectangle((x - half, y - half, x + half, y + half), fill=_FILL)
    return img


#: Every op, called as ``op(image, level, rng)``; ``level`` is in ``[0, MAX_LEVEL]``.
OPS: dict[str, Op] = {
    "AutoContrast": lambda img, level, rng: ImageOps.autocontrast(img),
    "Equalize": lambda img, level, rng: ImageOps.equalize(img),
    "Invert": lambda img, level, rng: ImageOps.invert(img),
    "Rotate": lambda img, level, rng: img.rotate(_signed(level / MAX_LEVEL * 30.0, rng),
                                                 Image.Resampling.BILINEAR, fillcolor=_FILL),
    "Posterize": lambda img, level, rng: ImageOps.posterize(
        img, max(1, int(level / MAX_LEVEL * 4))),
    "Solarize": lambda img, level, rng: ImageOps.solarize(img, int(level / MAX_LEVEL * 256)),
    "SolarizeAdd": _solarize_add,
    "Color": _enhance(ImageEnhance.Color),
    "Contrast": _enhance(ImageEnhance.Contrast),
    "Brightness": _enhance(ImageEnhance.Brightness),
    "Sharpness": _enhance(ImageEnhance.Sharpness),
    "ShearX": lambda img, level, rng: _affine(
        img, (1, _signed(level / MAX_LEVEL * 0.3, rng), 0, 0, 1, 0)),
    "ShearY": lambda img, level, rng: _affine(
        img, (1, 0, 0, _signed(level / MAX_LEVEL * 0.3, rng), 1, 0)),
    # TF translates by up to 100 px at 224: 0.45 of the side
    "TranslateX": lambda img, level, rng: _affine(
        img, (1, 0, _signed(level / MAX_LEVEL * 0.45 * img.size[0], rng), 0, 1, 0)),
    "TranslateY": lambda img, level, rng: _affine(
        img, (1, 0, 0, 0, 1, _signed(level / MAX_LEVEL * 0.45 * img.size[1], rng))),
    "Cutout": _cutout,
}

#: A subset of TF EfficientNet's AutoAugment "v0" policy: pairs of (op, probability, level).
AUTOAUGMENT_POLICY: tuple[tuple[tuple[str, float, int], ...], ...] = (
    (("Equalize", 0.8, 1), ("ShearY", 0.8, 4)),
    (("Color", 0.4, 9), ("Equalize", 0.6, 3)),
    (("Color", 0.4, 1), ("Rotate", 0.6, 8)),
    (("Solarize", 0.8, 3), ("Equalize", 0.4, 7)),
    (("Solarize", 0.4, 2), ("Solarize", 0.6, 2)),
    (("Color", 0.2, 0), ("Equalize", 0.8, 8)),
    (("Equalize", 0.4, 8), ("SolarizeAdd", 0.8, 3)),
    (("ShearX", 0.2, 9), ("Rotate", 0.6, 8)),
    (("Color", 0.6, 1), ("Equalize", 1.0, 2)),
    (("Invert", 0.4, 9), ("Rotate", 0.6, 0)),
    (("Equalize", 1.0, 9), ("ShearY", 0.6, 3)),
    (("Posterize", 0.4, 6), ("AutoContrast", 0.4, 7)),
    (("Solarize", 0.2, 4), ("Rotate", 0.8, 9)),
    (("Rotate", 1.0, 7), ("TranslateY", 0.8, 9)),
    (("ShearY", 0.4, 7), ("SolarizeAdd", 0.6, 7)),
    (("Color", 0.8, 6), ("Rotate", 0.4, 5)),
)


class AutoAugment:
    """Apply one randomly chosen sub-policy of :data:`AUTOAUGMENT_POLICY`."""

    def __call__(self, img: Image.Image, rng: random.Random) -> Image.Image:
        """The augmented image."""
        for name, prob, level in rng.choice(AUTOAUGMENT_POLICY):
            if rng.random() < prob:
                img = OPS[name](img, float(level), rng)
        return img


class RandAugment:
    """Apply ``num_layers`` ops drawn uniformly from :data:`OPS`, each with probability 0.5,
    all at ``magnitude`` (0..10)."""

    def __init__(self, num_layers: int = 2, magnitude: float = 10.0) -> None:
        self.num_layers = num_layers
        self.magnitude = magnitude
        self._names = sorted(OPS)

    def __call__(self, img: Image.Image, rng: random.Random) -> Image.Image:
        """The augmented image."""
        for _ in range(self.num_layers):
            name = rng.choice(self._names)
            if rng.random() < 0.5:
                img = OPS[name](img, self.magnitude, rng)
        return img


Augmenter = Callable[[Image.Image, random.Random], Image.Image]


def make_augmenter(name: str, num_layers: int = 2, magnitude: float = 10.0
                   ) -> Augmenter | None:
    """``"autoaugment"``, ``"randaugment"`` or ``"none"`` (returns None)."""
    if name == "autoaugment":
        return AutoAugment()
    if name == "randaugment":
        return RandAugment(num_layers, magnitude)
    if name in ("none", "", None):
        return None
    raise ValueError(f"unknown augmenter {name!r}; use autoaugment, randaugment or none")


def decode(data: bytes) -> Image.Image:
    """Decode JPEG (or any Pillow format) bytes into an RGB image."""
    img = Image.open(io.BytesIO(data))
    return img.convert("RGB")


def to_tensor(img: Image.Image) -> torch.Tensor:
    """``uint8`` CHW tensor of an RGB image."""
    import torch
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


def _random_crop_box(w: int, h: int, rng: random.Random, min_scale: float
                     ) -> tuple[int, int, int, int]:
    """Inception crop: area in ``[min_scale, 1]``, aspect ratio in ``[3/4, 4/3]``."""
    area = w * h
    for _ in range(10):
        target = area * rng.uniform(min_scale, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
            return x, y, x + cw, y + ch
    side = min(w, h)
    return (w - side) // 2, (h - side) // 2, (w + side) // 2, (h + side) // 2


Box = tuple[float, float, float, float]


def open_for_crop(data: bytes, box_of: Callable[[int, int], Box], size: int,
                  reduce: bool = True) -> tuple[Image.Image, Box, Box]:
    """Decode ``data`` for a crop resized to ``size``: ``(image, box in its pixels, box in
    the full image's pixels)``, where ``box_of(width, height)`` picks the crop on the full
    image. With ``reduce`` a JPEG is decoded at the smallest of its scales (1/1, 1/2, 1/4,
    1/8: libjpeg's DCT scaling, a fraction of the work) that still leaves the crop at least
    ``size`` pixels a side; the crop is the same region either way."""
    img = Image.open(io.BytesIO(data))
    w, h = img.size
    box = box_of(w, h)
    factor = 1
    if reduce and img.format == "JPEG":
        scale = min(box[2] - box[0], box[3] - box[1]) / size
        if scale >= 2:
            img.draft("RGB", (math.ceil(w / scale), math.ceil(h / scale)))
            # scaling by 1/d maps pixel x to x/d (the last row and column round up)
            factor = max(1, round(w / img.size[0]))
    img = img.convert("RGB")
    return img, tuple(v / factor for v in box), box  # type: ignore[return-value]


def _finish(img: Image.Image, size: int, box: Box, rng: random.Random | None, flip: bool,
            augmenter: Augmenter | None) -> torch.Tensor:
    img = img.resize((size, size), Image.Resampling.BICUBIC, box=box)
    if rng is not None and flip and rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if rng is not None and augmenter is not None:
        img = augmenter(img, rng)
    return to_tensor(img)


def train_image(img: Image.Image, size: int, rng: random.Random, min_scale: float = 0.08,
                flip: bool = True, augmenter: Augmenter | None = None) -> torch.Tensor:
    """Random resized crop to ``size``, random flip, augmenter: a ``uint8`` CHW tensor."""
    box = _random_crop_box(img.width, img.height, rng, min_scale)
    return _finish(img, size, box, rng, flip, augmenter)


def train_jpeg(data: bytes, size: int, rng: random.Random, min_scale: float = 0.08,
               flip: bool = True, augmenter: Augmenter | None = None,
               reduce: bool = True) -> torch.Tensor:
    """:func:`train_image` of encoded ``data`` (the same crop for the same ``rng``), decoded
    at a reduced scale where the crop allows (:func:`open_for_crop`)."""
    img, box, _ = open_for_crop(
        data, lambda w, h: _random_crop_box(w, h, rng, min_scale), size, reduce)
    return _finish(img, size, box, rng, flip, augmenter)


def _central_box(fraction: float) -> Callable[[int, int], Box]:
    def box(w: int, h: int) -> Box:
        side = min(w, h) * fraction
        left, top = (w - side) / 2, (h - side) / 2
        return left, top, left + side, top + side
    return box


def eval_image(img: Image.Image, size: int, crop_fraction: float = 0.875) -> torch.Tensor:
    """Central crop of ``crop_fraction`` of the shorter side, resized to ``size``."""
    return _finish(img, size, _central_box(crop_fraction)(img.width, img.height), None,
                   False, None)


def eval_jpeg(data: bytes, size: int, crop_fraction: float = 0.875,
              reduce: bool = True) -> torch.Tensor:
    """:func:`eval_image` of encoded ``data``, decoded at a reduced scale where it can."""
    img, box, _ = open_for_crop(data, _central_box(crop_fraction), size, reduce)
    return _finish(img, size, box, None, False, None)
