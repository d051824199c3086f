"""Optimizers, learning-rate schedule and weight EMA of the EfficientNet recipe.

* :class:`TFRMSprop`: TensorFlow 1's RMSProp, which the EfficientNet recipe was tuned with.
  It differs from ``torch.optim.RMSprop`` in three ways: epsilon sits *inside* the square
  root, the mean square starts at one (not zero), and the learning rate multiplies the update
  before it enters the momentum buffer::

      ms  = rho * ms + (1 - rho) * g**2            (ms starts at 1)
      mom = momentum * mom + lr * g / sqrt(ms + eps)
      p  -= mom

* weight decay (L2, added to the gradient; decoupled for AdamW) on convolution and dense
  weights only, never on BatchNorm parameters or biases;
* :class:`LRSchedule`: linear warmup, then staircase exponential decay or cosine;
* :class:`ModelEMA`: TF's ``ExponentialMovingAverage`` with ``num_updates``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["LRSchedule", "Lookahead", "ModelEMA", "TFRMSprop", "build_optimizer", "param_groups"]


class TFRMSprop(torch.optim.Optimizer):
    """TensorFlow-style RMSprop (see the module docstring); ``weight_decay`` is L2."""

    def __init__(self, params: Iterable[Any], lr: float = 0.01, rho: float = 0.9,
                 momentum: float = 0.9, eps: float = 1e-3, weight_decay: float = 0.0) -> None:
        if lr < 0 or eps < 0 or not 0 <= rho < 1 or momentum < 0:
            raise ValueError(f"invalid TFRMSprop settings: lr={lr} rho={rho} "
                             f"momentum={momentum} eps={eps}")
        super().__init__(params, {"lr": lr, "rho": rho, "momentum": momentum, "eps": eps,
                                  "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, rho, mom, eps = group["lr"], group["rho"], group["momentum"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if group["weight_decay"]:
                    g = g.add(p, alpha=group["weight_decay"])
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["square_avg"] = torch.ones_like(p)
                    state["momentum_buffer"] = torch.zeros_like(p)
                state["step"] += 1
                ms, buf = state["square_avg"], state["momentum_buffer"]
                ms.mul_(rho).addcmul_(g, g, value=1 - rho)
                update = g / ms.add(eps).sqrt_()
                if mom > 0:
                    buf.mul_(mom).add_(update, alpha=lr)
                    p.sub_(buf)
                else:
                    p.sub_(update, alpha=lr)
        return loss


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: weights of convolutions and dense layers (decayed), and BatchNorm
    parameters and biases (never decayed)."""
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            is_norm = isinstance(module, nn.modules.batchnorm._NormBase | nn.GroupNorm |
                                 nn.LayerNorm)
            (no_decay if is_norm or name == "bias" or p.ndim <= 1 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(name: str, model: nn.Module, lr: float, weight_decay: float,
                    momentum: float = 0.9, rho: float = 0.9, eps: float = 1e-3,
                    nesterov: bool = False, betas: tuple[float | None, float | None] = (None, None)
                    ) -> torch.optim.Optimizer:
    """``rmsprop`` (TF-style), ``sgd``/``momentum`` (SGD with ``momentum``, Nesterov's with
    ``nesterov``), ``adam`` or ``adamw`` (``betas``: None keeps 0.9 / 0.999)."""
    groups = param_groups(model, weight_decay)
    if name == "rmsprop":
        return TFRMSprop(groups, lr=lr, rho=rho, momentum=momentum, eps=eps)
    if name in ("sgd", "momentum"):
        return torch.optim.SGD(groups, lr=lr, momentum=momentum,
                               nesterov=nesterov and momentum > 0)
    b1, b2 = (0.9 if betas[0] is None else betas[0]), (0.999 if betas[1] is None else betas[1])
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=(b1, b2), eps=eps)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(b1, b2), eps=eps)
    raise ValueError(f"unknown optimizer {name!r}; use rmsprop, sgd, momentum, adam or adamw")


class Lookahead:
    """Lookahead (Zhang et al. 2019, as TensorFlow Addons' ``Lookahead``, which the recipe's
    ``--lookahead`` wraps around its optimizer): every ``sync_period`` steps the slow weights
    move ``slow_step_size`` of the way to the fast ones, and the fast ones restart there."""

    def __init__(self, model: nn.Module, sync_period: int = 6, slow_step_size: float = 0.5
                 ) -> None:
        self.sync_period, self.alpha = sync_period, slow_step_size
        self.slow = [p.detach().clone() for p in model.parameters()]
        self.steps = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Call after each optimizer step."""
        self.steps += 1
        if self.steps % self.sync_period:
            return
        for slow, p in zip(self.slow, model.parameters(), strict=True):
            slow.lerp_(p.detach(), self.alpha)
            p.copy_(slow)

    def state_dict(self) -> dict[str, Any]:
        """Slow weights and the step count."""
        return {"slow": self.slow, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        for slow, saved in zip(self.slow, state["slow"], strict=True):
            slow.copy_(saved)
        self.steps = int(state["steps"])


class LRSchedule:
    """Learning rate per step: linear warmup from 0 over ``warmup_steps``, then

    * ``exponential``: ``base * decay_rate ** floor(epoch / decay_epochs)`` (staircase);
    * ``cosine``: ``base * (1 + cos(pi * t)) / 2``, ``t`` going from 0 to 1 after warmup.
    """

    def __init__(self, base_lr: float, steps_per_epoch: int, total_steps: int,
                 warmup_epochs: float = 0.0, decay: str = "exponential",
                 decay_rate: float = 0.97, decay_epochs: float = 2.4) -> None:
        if decay not in ("exponential", "cosine"):
            raise ValueError(f"unknown lr_decay {decay!r}; use exponential or cosine")
        self.base_lr, self.steps_per_epoch = base_lr, max(1, steps_per_epoch)
        self.total_steps = max(1, total_steps)
        self.warmup_steps = int(warmup_epochs * self.steps_per_epoch)
        self.decay, self.decay_rate, self.decay_epochs = decay, decay_rate, decay_epochs

    def __call__(self, step: int) -> float:
        """Learning rate of (0-based) ``step``."""
        if step < self.warmup_steps:
            return self.base_lr * (step + 1) / self.warmup_steps
        if self.decay == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            t = min(1.0, (step - self.warmup_steps) / span)
            return self.base_lr * 0.5 * (1 + math.cos(math.pi * t))
        epoch = (step - self.warmup_steps) / self.steps_per_epoch
        return self.base_lr * self.decay_rate ** math.floor(epoch / self.decay_epochs)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set the learning rate of every group of ``optimizer``; return it."""
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


class ModelEMA:
    """Exponential moving average of a model's weights (buffers are copied as they are).

    ``decay`` is capped at ``(1 + n) / (10 + n)`` after ``n`` updates, as TF does, so the
    average follows the weights closely early in training.
    """

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.module = copy.deepcopy(model).eval()
        for p in self.module.parameters():
            p.requires_grad_(False)
        self.updates = 0

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the average towards ``model``'s current weights."""
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (10 + self.updates))
        for avg, p in zip(self.module.parameters(), model.parameters(), strict=True):
            avg.lerp_(p.detach(), 1.0 - d)
        for avg, b in zip(self.module.buffers(), model.buffers(), strict=True):
            avg.copy_(b)

    def state_dict(self) -> dict[str, Any]:
        """Averaged weights and the update count."""
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])
