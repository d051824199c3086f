"""Targets and loss: label smoothing, mixup, soft-target cross entropy, top-k accuracy.

With smoothing ``s`` over ``K`` classes the target of label ``y`` is
``(1 - s) * onehot(y) + s / K``. Mixup (Zhang et al.) blends each sample with its partner in
the reversed batch, as the TF EfficientNet reference does: ``x' = lam * x + (1 - lam) *
x[::-1]`` and the same for the targets, with ``lam ~ Beta(alpha, alpha)`` drawn once a batch.
CutMix (Yun et al.) pastes a box of the partner instead, the targets mixed by its area.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

__all__ = ["cutmix", "mix_batch", "mixup", "sample_mixup_lambda", "smooth_targets",
           "soft_cross_entropy", "topk_correct"]


def smooth_targets(labels: torch.Tensor, num_classes: int, smoothing: float = 0.0
                   ) -> torch.Tensor:
    """Soft targets of shape ``(batch, num_classes)``."""
    onehot = F.one_hot(labels.long(), num_classes).float()
    return onehot * (1.0 - smoothing) + smoothing / num_classes


def sample_mixup_lambda(alpha: float, rng: np.random.Generator) -> float:
    """``lam ~ Beta(alpha, alpha)``; 1.0 (no mixing) when ``alpha`` <= 0."""
    return float(rng.beta(alpha, alpha)) if alpha > 0 else 1.0


def mixup(images: torch.Tensor, targets: torch.Tensor, lam: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Blend every sample (and its soft target) with the one at the mirrored batch position."""
    if lam >= 1.0:
        return images, targets
    return (images * lam + images.flip(0) * (1.0 - lam),
            targets * lam + targets.flip(0) * (1.0 - lam))


def cutmix(images: torch.Tensor, targets: torch.Tensor, lam: float, rng: np.random.Generator
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Paste into every sample a box of the one at the mirrored batch position, of area about
    ``1 - lam`` (clipped at the border), and mix the targets by the area actually pasted."""
    if lam >= 1.0:
        return images, targets
    h, w = images.shape[-2:]
    cut = float(np.sqrt(1.0 - lam))
    ch, cw = int(h * cut), int(w * cut)
    cy, cx = int(rng.integers(h)), int(rng.integers(w))
    y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
    x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
    mixed = images.clone()
    mixed[..., y0:y1, x0:x1] = images.flip(0)[..., y0:y1, x0:x1]
    kept = 1.0 - (y1 - y0) * (x1 - x0) / (h * w)
    return mixed, targets * kept + targets.flip(0) * (1.0 - kept)


def mix_batch(images: torch.Tensor, targets: torch.Tensor, mixup_alpha: float,
              cutmix_alpha: float, rng: np.random.Generator
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixup or CutMix of a batch, as the flags ask: with both, each batch takes one of the
    two at even odds."""
    use_cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or rng.random() < 0.5)
    if use_cutmix:
        return cutmix(images, targets, sample_mixup_lambda(cutmix_alpha, rng), rng)
    return mixup(images, targets, sample_mixup_lambda(mixup_alpha, rng))


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over the batch of ``-sum(targets * log_softmax(logits))`` (computed in float32)."""
    return -(targets * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


def topk_correct(logits: torch.Tensor, labels: torch.Tensor, ks: tuple[int, ...] = (1, 5)
                 ) -> list[int]:
    """How many samples have their label among the top ``k`` logits, for each ``k``."""
    kmax = min(max(ks), logits.shape[-1])
    top = logits.topk(kmax, dim=-1).indices
    hit = top == labels.view(-1, 1)
    return [int(hit[:, :min(k, kmax)].any(-1).sum()) for k in ks]
