"""One rank's training state and its single steps: build, train step, evaluate, checkpoint.

:func:`build_trainer` makes the model (with ``hvd.SyncBatchNorm`` for ``--batch_norm
syncbn``), the optimizer (peak learning rate ``lr_init * global_batch / 128``, NVIDIA's
rule), the data-parallel wrapping of the chosen backend, the weight EMA and the AMP scaler.
:func:`train_step` runs one
step on a batch of ``uint8`` images; :func:`evaluate` one pass over an evaluation loader,
averaged over the ranks. :func:`trainer_state` / :func:`restore_trainer` turn the whole state
into a checkpoint and back.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from apps.efficientnet.config.flags import peak_lr
from apps.efficientnet.config.variants import SMALL_CNN, training_resolution
from apps.efficientnet.model import SmallCNN, efficientnet
from apps.efficientnet.runtime.checkpoint import capture_rng, restore_rng
from apps.efficientnet.runtime.distributed import Dist, accumulating, average, unwrap, wrap
from apps.efficientnet.runtime.losses import (
    mix_batch,
    smooth_targets,
    soft_cross_entropy,
    topk_correct,
)
from apps.efficientnet.runtime.metrics import latency_percentiles
from apps.efficientnet.runtime.optim import Lookahead, LRSchedule, ModelEMA, build_optimizer
from shoal import timeline_range

__all__ = ["LATENCY_NAMES", "StepStats", "Trainer", "amp_dtype", "build_trainer", "evaluate",
           "image_size",
           "restore_trainer", "resume_stream", "stream_state", "train_step", "trainer_state"]

LATENCY_NAMES = {kind: [f"{kind}_latency_{s}" for s in ("mean", "p90", "p95", "p99")]
              for kind in ("training", "eval")}
_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


@dataclass
class StepStats:
    """What one training step measured on this rank."""

    loss: float
    correct_top1: int
    correct_top5: int
    count: int
    lr: float


@dataclass
class Trainer:
    """Everything one rank trains with; ``step`` counts optimizer steps since the start."""

    args: argparse.Namespace
    dist: Dist
    model: nn.Module  # wrapped for the backend (DDP) or the plain model
    forward: nn.Module  # what the training step calls: ``model`` or its compiled version
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    steps_per_epoch: int
    ema: ModelEMA | None = None
    scaler: Any = None
    lookahead: Lookahead | None = None
    np_rng: np.random.Generator = field(default_factory=np.random.default_rng)
    step: int = 0
    epoch: int = 0
    data_state: dict[str, int] | None = None  # the stream position a checkpoint recorded

    @property
    def global_batch(self) -> int:
        """Images per optimizer step over all ranks (accumulated batches included)."""
        return self.args.train_batch_size * self.dist.size * self.args.grad_accum_steps


def amp_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype | None:
    """The autocast type: ``--dtype`` when it is 16-bit, else with ``--use_amp`` float16 on
    CUDA and bfloat16 on the CPU; None: full precision."""
    named = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16}.get(args.dtype)
    if named is not None:
        return named
    if args.use_amp:
        return torch.float16 if device.type == "cuda" else torch.bfloat16
    return None


def image_size(args: argparse.Namespace) -> int:
    """``--image_size`` or the variant's resolution."""
    return training_resolution(args.arch, args.image_size)


def build_trainer(args: argparse.Namespace, dist: Dist, steps_per_epoch: int) -> Trainer:
    """Model, optimizer, schedule, EMA and scaler for ``args``; every rank starts from rank
    0's weights."""
    torch.manual_seed(args.seed)
    norm = dist.hvd.SyncBatchNorm if args.batch_norm == "syncbn" else None
    bn = {"bn_momentum": 1.0 - args.bn_momentum, "bn_eps": args.bn_epsilon, "norm_layer": norm}
    model = (SmallCNN(args.num_classes, **bn) if args.arch == SMALL_CNN else
             efficientnet(args.arch, num_classes=args.num_classes,
                          drop_connect_rate=args.drop_connect_rate, activation=args.activation,
                          weight_init=args.weight_init, **bn)).to(dist.device)
    global_batch = args.train_batch_size * dist.size * args.grad_accum_steps
    base_lr = peak_lr(args.lr_init, global_batch)
    optimizer = build_optimizer(args.optimizer, model, base_lr, args.weight_decay,
                                momentum=args.momentum, rho=args.rmsprop_decay,
                                eps=args.epsilon, nesterov=args.nesterov,
                                betas=(args.beta_1, args.beta_2))
    model, optimizer = wrap(model, optimizer, dist, args.compression,
                            sharded=args.optimizer_sharding,
                            backward_passes=args.grad_accum_steps)
    schedule = LRSchedule(base_lr, steps_per_epoch, steps_per_epoch * args.max_epochs,
                          args.lr_warmup_epochs, args.lr_decay, args.lr_decay_rate,
                          args.lr_decay_epochs)
    ema = (ModelEMA(unwrap(model), args.moving_average_decay)
           if args.moving_average_decay > 0 else None)
    # float16 needs its loss scaled so that small gradients survive; bfloat16 does not
    scaler = (torch.amp.GradScaler(dist.device.type)
              if amp_dtype(args, dist.device) == torch.float16 else None)
    lookahead = Lookahead(unwrap(model)) if args.lookahead else None
    forward = torch.compile(model) if args.use_xla else model
    torch.manual_seed(args.seed + 1000 * dist.rank)  # dropout and drop-connect differ per rank
    return Trainer(args, dist, model, forward, optimizer, schedule, steps_per_epoch, ema,
                   scaler, lookahead, np.random.default_rng([args.seed, dist.rank]))


def _autocast(tr: Trainer) -> contextlib.AbstractContextManager:
    dtype = amp_dtype(tr.args, tr.dist.device)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(tr.dist.device.type, dtype=dtype)


def _normalize(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    x = images.to(device, non_blocking=True).float()
    return (x - _MEAN.to(device)) / _STD.to(device)


def train_step(tr: Trainer, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
               ) -> StepStats:
    """One optimizer step on this rank's ``batches`` (``--grad_accum_steps`` of them, of
    ``uint8`` NCHW images and int labels): their gradients are averaged, then clipped to
    ``--grad_clip_norm`` when asked, then applied."""
    args, opt = tr.args, tr.optimizer
    tr.model.train()
    lr = tr.schedule.apply(opt, tr.step)
    opt.zero_grad()  # Horovod's optimizer takes no set_to_none (the default: True)
    loss_sum, top1, top5, count = 0.0, 0, 0, 0
    for i, (images, labels) in enumerate(batches):
        labels = labels.to(tr.dist.device)
        x = _normalize(images, tr.dist.device)
        targets = smooth_targets(labels, args.num_classes, args.label_smoothing)
        x, targets = mix_batch(x, targets, args.mixup_alpha, args.cutmix_alpha, tr.np_rng)
        with accumulating(tr.model, last=i == len(batches) - 1):
            with timeline_range("FORWARD"):
                with _autocast(tr):
                    logits = tr.forward(x)
                loss = soft_cross_entropy(logits, targets)
            with timeline_range("BACKWARD"):
                scaled = loss / len(batches)
                (scaled if tr.scaler is None else tr.scaler.scale(scaled)).backward()
        loss_sum += float(loss.detach()) * int(labels.shape[0])
        a, b = topk_correct(logits.detach(), labels)
        top1, top5, count = top1 + a, top5 + b, count + int(labels.shape[0])
    with timeline_range("STEP"):
        _apply(tr)
    if (tr.lookahead is not None or tr.ema is not None) and hasattr(opt, "wait_params"):
        opt.wait_params()  # a sharded step leaves the updated weights in flight
    if tr.lookahead is not None:
        tr.lookahead.update(unwrap(tr.model))
    if tr.ema is not None:
        tr.ema.update(unwrap(tr.model))
    tr.step += 1
    return StepStats(loss_sum / max(count, 1), top1, top5, count, lr)


def _apply(tr: Trainer) -> None:
    """The optimizer step after the backward passes: gradients unscaled (AMP) and clipped
    when asked, after they are averaged over the ranks."""
    opt, scaler, clip = tr.optimizer, tr.scaler, tr.args.grad_clip_norm
    if scaler is None and not clip:
        opt.step()
        return
    # torch's stock recipe: backward returned with the averaged gradients (shoal's optimizers
    # and DDP alike)
    if scaler is not None:
        scaler.unscale_(opt)
    if clip:
        if hasattr(opt, "clip_grad_norm_"):  # sharded: each rank holds only its shard
            opt.clip_grad_norm_(clip)
        else:
            torch.nn.utils.clip_grad_norm_(unwrap(tr.model).parameters(), clip)
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()


@torch.no_grad()
def evaluate(tr: Trainer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
             ) -> dict[str, float]:
    """Loss, top-1/top-5 accuracy (%), throughput and latencies over ``batches``, with the EMA
    weights when there are some; counts are combined over the ranks."""
    model = tr.ema.module if tr.ema is not None else unwrap(tr.model)
    model.eval()
    loss_sum, c1, c5, n, times = 0.0, 0, 0, 0, []
    start = time.perf_counter()
    for images, labels in batches:
        t0 = time.perf_counter()
        labels = labels.to(tr.dist.device)
        with _autocast(tr):
            logits = model(_normalize(images, tr.dist.device))
        loss_sum += float(nn.functional.cross_entropy(logits.float(), labels, reduction="sum"))
        a, b = topk_correct(logits, labels)
        c1, c5, n = c1 + a, c5 + b, n + int(labels.shape[0])
        times.append(time.perf_counter() - t0)
    elapsed = time.perf_counter() - start
    lat = latency_percentiles(times, "eval")
    names = LATENCY_NAMES["eval"]
    avg = average([loss_sum, c1, c5, n, n / max(elapsed, 1e-9)] +
                  [lat.get(k, 0.0) for k in names],
                  name=f"efficientnet.eval.{tr.step}")
    total = max(avg[3], 1e-12)
    out = {"eval_loss": avg[0] / total, "eval_accuracy_top_1": 100.0 * avg[1] / total,
           "eval_accuracy_top_5": 100.0 * avg[2] / total,
           "avg_exp_per_second_eval": avg[4] * tr.dist.size}
    out.update(zip(names, avg[5:], strict=True))
    return out


def trainer_state(tr: Trainer) -> dict[str, Any]:
    """A checkpoint of ``tr`` (every rank must call it: RNG states are gathered)."""
    rng = tr.dist.hvd.allgather_object(capture_rng(tr.np_rng), name=f"efficientnet.rng.{tr.step}")
    opt = tr.optimizer
    if hasattr(opt, "consolidate_state_dict"):  # torch's ZeroRedundancyOptimizer: on rank 0
        opt.consolidate_state_dict(to=0)
        optimizer = opt.state_dict() if tr.dist.rank == 0 else None
    else:  # an ordinary one, or shoal's sharded one (consolidated on every rank)
        optimizer = opt.state_dict()
    return {"model": unwrap(tr.model).state_dict(), "optimizer": optimizer,
            "ema": tr.ema.state_dict() if tr.ema is not None else None,
            "scaler": tr.scaler.state_dict() if tr.scaler is not None else None,
            "lookahead": tr.lookahead.state_dict() if tr.lookahead is not None else None,
            "epoch": tr.epoch, "step": tr.step, "rng": rng, "args": vars(tr.args),
            "data": stream_state(tr)}


def stream_state(tr: Trainer) -> dict[str, int]:
    """The training data stream's position: batches consumed (one per step) and what the
    stream's layout depends on (batch size, DataLoader workers, ranks, seed)."""
    return {"batches": tr.step * tr.args.grad_accum_steps,
            "batch_size": tr.args.train_batch_size,
            "workers": tr.args.num_workers, "world_size": tr.dist.size, "seed": tr.args.seed,
            "epoch": tr.epoch}


def resume_stream(tr: Trainer, dataset: Any) -> str:
    """Point ``dataset`` (before its DataLoader is made) at the position the restored
    checkpoint recorded; what was done, as a line for the log."""
    saved = tr.data_state
    if not saved:
        dataset.first_pass = tr.epoch
        return ("data: the checkpoint has no stream position (an older one); the stream "
                f"starts afresh at pass {tr.epoch}")
    now = stream_state(tr)
    layout = ("batch_size", "workers", "world_size", "seed")
    changed = [f"{k} {saved[k]} -> {now[k]}" for k in layout if saved.get(k) != now[k]]
    if changed:
        dataset.first_pass = tr.epoch
        return (f"data: cannot continue the stream exactly ({', '.join(changed)}); it starts "
                f"afresh at pass {tr.epoch}, a new shuffle")
    dataset.resume(saved["batches"], saved["batch_size"])
    return f"data: the stream continues after batch {saved['batches']} (exact resume)"


def restore_trainer(tr: Trainer, state: dict[str, Any] | None) -> None:
    """Load a checkpoint that rank 0 read (``state`` may be None elsewhere) on every rank."""
    if tr.dist.size > 1:
        state = tr.dist.hvd.broadcast_object(state, root_rank=0, name="efficientnet.resume")
    if state is None:
        raise ValueError("restore_trainer: rank 0 has no checkpoint to send")
    unwrap(tr.model).load_state_dict(state["model"])
    tr.optimizer.load_state_dict(state["optimizer"])
    if tr.ema is not None and state.get("ema"):
        tr.ema.load_state_dict(state["ema"])
    if tr.scaler is not None and state.get("scaler"):
        tr.scaler.load_state_dict(state["scaler"])
    if tr.lookahead is not None and state.get("lookahead"):
        tr.lookahead.load_state_dict(state["lookahead"])
    tr.epoch, tr.step = int(state["epoch"]), int(state["step"])
    tr.data_state = state.get("data")
    rngs = state.get("rng") or []
    if tr.dist.rank < len(rngs):
        restore_rng(rngs[tr.dist.rank], tr.np_rng)
