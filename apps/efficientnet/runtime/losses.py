"""Targets and loss: label smoothing, mixup, soft-target cross entropy, top-k accuracy.

With smoothing ``s`` over ``K`` classes the target of label ``y`` is
``(1 - s) * onehot(y) + s / K``. Mixup (Zhang et al.) blends each sample with its partner in
the reversed batch, as the TF EfficientNet reference does: ``x' = lam * x + (1 - lam) *
x[::-1]`` and the same for the targets, with ``lam ~ Beta(alpha, alpha)`` drawn once a batch.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812

__all__ = ["mixup", "sample_mixup_lambda", "smooth_targets", "soft_cross_entropy",
           "topk_correct"]


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
