"""The modes of the application: train, eval, train_and_eval, training_benchmark.

Every rank runs the same number of steps per epoch (the training stream repeats forever),
logs statistics averaged over all ranks with ``hvd.oob_allreduce`` every ``--log_steps`` steps
and at the end of each epoch, evaluates after each epoch in ``train_and_eval``, and saves a
checkpoint every ``--save_checkpoint_freq`` epochs and at the end (rank 0 writes it). Rank 0
shows a progress bar (on a terminal), prints the metrics, and appends them to
``<model_dir>/<log_filename>`` as JSON lines; a ``SUMMARY`` line closes the run.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from apps.efficientnet.config.flags import LR_BATCH_BASE
from apps.efficientnet.dataloader import Preprocess, build_dataset, make_loader
from apps.efficientnet.dataloader.index import Team
from apps.efficientnet.runtime.checkpoint import CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from apps.efficientnet.runtime.distributed import (
    Dist,
    average,
    init_distributed,
    shutdown_distributed,
)
from apps.efficientnet.runtime.metrics import MetricLogger, latency_percentiles, progress_bar
from apps.efficientnet.runtime.trainer import (
    LATENCY_NAMES,
    Trainer,
    amp_dtype,
    build_trainer,
    evaluate,
    image_size,
    restore_trainer,
    resume_stream,
    train_step,
    trainer_state,
)

__all__ = ["build_datasets", "run", "save", "train_epoch"]


def build_datasets(args: argparse.Namespace, dist: Dist) -> tuple[Any, Any]:
    """Training and (for modes that evaluate) evaluation datasets of this rank."""
    size = image_size(args)
    team = Team(dist.rank, dist.size,
                lambda obj: dist.hvd.broadcast_object(obj, root_rank=0,
                                                      name="efficientnet.index.known"),
                lambda obj: dist.hvd.allgather_object(obj, name="efficientnet.index.counted"))
    common = dict(rank=dist.rank, size=dist.size, seed=args.seed, num_classes=args.num_classes,
                  synthetic=args.synthetic, label_offset=args.label_offset, team=team)
    train_pp = Preprocess(size, True, args.crop_min_scale, args.random_flip,
                          args.augmenter_name, args.raug_num_layers, args.raug_magnitude)
    train = None
    if args.mode != "eval":
        train = build_dataset(args.train_data_dir, "train", train_pp,
                              synthetic_length=100 * args.train_batch_size * dist.size,
                              **common)
    evaluation = None
    if args.mode in ("eval", "train_and_eval"):
        eval_pp = Preprocess(args.eval_img_size or size, False,
                             crop_fraction=args.eval_crop_fraction)
        evaluation = build_dataset(args.eval_data_dir, "eval", eval_pp,
                                   synthetic_length=10 * args.eval_batch_size * dist.size,
                                   **common)
    return train, evaluation


def train_epoch(tr: Trainer, batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
                logger: MetricLogger, warmup_steps: int = 1) -> dict[str, float]:
    """``tr.steps_per_epoch`` steps; the epoch's statistics averaged over the ranks (the
    first ``warmup_steps`` are left out of throughput and latency)."""
    args, dist = tr.args, tr.dist
    window = [0.0, 0.0, 0.0, 0.0, 0.0]  # loss * count, top-1, top-5, count, seconds
    total = [0.0, 0.0, 0.0, 0.0]
    times: list[float] = []
    bar = progress_bar(tr.steps_per_epoch, f"epoch {tr.epoch + 1}/{args.max_epochs}",
                       dist.is_root)
    lr = 0.0
    for i in range(tr.steps_per_epoch):
        t0 = time.perf_counter()
        s = train_step(tr, [next(batches) for _ in range(args.grad_accum_steps)])
        took = time.perf_counter() - t0
        if i >= warmup_steps:
            times.append(took)
        lr = s.lr
        window[4] += took
        for acc in (window, total):
            acc[0] += s.loss * s.count
            acc[1] += s.correct_top1
            acc[2] += s.correct_top5
            acc[3] += s.count
        bar.update(1)
        if times:  # images/s of the job, as this rank sees it
            rate = dist.size * s.count * len(times) / sum(times)
            bar.set_postfix_str(f"loss {s.loss:.3f}, {rate:.1f} img/s", refresh=False)
        if args.log_steps and tr.step % args.log_steps == 0:
            w = average(window, name=f"efficientnet.window.{tr.step}")
            record = {"training_loss": w[0] / w[3], "training_accuracy_top_1": 100 * w[1] / w[3],
                      "learning_rate": lr}
            if args.time_history:  # the recipe's TimeHistory: the window's images/s
                record["examples_per_second"] = w[3] * dist.size / max(w[4], 1e-9)
            logger.log((tr.epoch + 1, tr.step), record)
            window = [0.0, 0.0, 0.0, 0.0, 0.0]
    bar.close()
    per_worker = len(times) * tr.global_batch / dist.size / max(sum(times), 1e-9)
    lat = latency_percentiles(times, "training")
    names = LATENCY_NAMES["training"]
    avg = average(total + [per_worker] + [lat.get(k, 0.0) for k in names],
                  name=f"efficientnet.epoch.{tr.step}")
    stats = {"training_loss": avg[0] / avg[3], "training_accuracy_top_1": 100 * avg[1] / avg[3],
             "training_accuracy_top_5": 100 * avg[2] / avg[3],
             "avg_exp_per_second_training": avg[4] * dist.size,
             "avg_exp_per_second_training_per_worker": avg[4], "learning_rate": lr}
    stats.update(zip(names, avg[5:], strict=True))
    return stats


def save(tr: Trainer, model_dir: str | os.PathLike[str]) -> Path | None:
    """Checkpoint ``tr`` into ``model_dir`` (every rank calls; rank 0 writes)."""
    state = trainer_state(tr)
    if tr.dist.is_root:
        return save_checkpoint(Path(model_dir) / CHECKPOINT_NAME, state)
    return None


def _model_dir_checkpoint(dist: Dist, model_dir: str) -> str | None:
    """The checkpoint in ``model_dir`` as rank 0 sees it (the one that writes them), on every
    rank; None when there is none."""
    found = Path(model_dir) / CHECKPOINT_NAME
    where = str(found) if dist.is_root and found.is_file() else None
    if dist.size > 1:
        where = dist.hvd.broadcast_object(where, root_rank=0, name="efficientnet.ckpt_found")
    return where


def _eval_checkpoint(args: argparse.Namespace, dist: Dist, logger: MetricLogger) -> str | None:
    """The checkpoint ``--mode eval`` scores: ``--model_dir``'s when there is one (rank 0
    looks), else none with ``--eval_untrained``, else an error on every rank."""
    where = _model_dir_checkpoint(dist, args.model_dir)
    if where is not None:
        logger.print(f"eval: scoring the checkpoint in --model_dir ({where})")
        return where
    if not args.eval_untrained:
        raise SystemExit(f"--mode eval needs a trained model: give --resume_checkpoint "
                         f"FILE_OR_DIR (there is no {CHECKPOINT_NAME} in --model_dir "
                         f"{args.model_dir}); to score a freshly initialised model on purpose, "
                         f"add --eval_untrained")
    logger.print("WARNING: --eval_untrained: scoring an UNTRAINED, randomly initialised model "
                 "(no checkpoint); expect chance accuracy")
    return None


def _resume_from(args: argparse.Namespace, dist: Dist, logger: MetricLogger) -> str | None:
    """What to resume from: ``--resume_checkpoint PATH``; bare, ``--model_dir``'s checkpoint
    when it has one (else a fresh start, said so)."""
    if not getattr(args, "resume_optional", False) or args.mode == "eval":
        return args.resume_checkpoint
    where = _model_dir_checkpoint(dist, args.model_dir)
    if where is None:
        logger.print(f"--resume_checkpoint: no checkpoint in --model_dir {args.model_dir} "
                     f"yet; starting fresh")
    return where


def _run(args: argparse.Namespace, dist: Dist) -> dict[str, Any]:
    if args.intraop_threads:
        torch.set_num_threads(args.intraop_threads)
    elif dist.device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.local_size))
    if args.interop_threads:
        try:
            torch.set_num_interop_threads(args.interop_threads)
        except RuntimeError as e:  # torch allows it once, before any inter-op work
            args.ignored.append(f"--interop_threads could not be set: {e}")
    logger = MetricLogger(Path(args.model_dir) / args.log_filename, enabled=dist.is_root)
    logger.log("PARAMETER", {**vars(args), "world_size": dist.size}, echo=False)
    for line in args.ignored:
        logger.print(f"WARNING: {line}")
    logger.of = f"/{args.max_epochs}"
    train_ds, eval_ds = build_datasets(args, dist)
    global_batch = args.train_batch_size * dist.size * args.grad_accum_steps
    examples = args.train_num_examples or (train_ds.num_examples() if train_ds else 0)
    steps = args.steps_per_epoch or (max(1, examples // global_batch)
                                     if train_ds is not None else 1)
    tr = build_trainer(args, dist, steps)
    logger.print(f"{args.arch} {args.mode}: {dist.size} ranks ({args.backend}, {dist.device})")
    logger.print(f"{image_size(args)} px, global batch {global_batch}, {steps} steps/epoch, "
                 f"amp {amp_dtype(args, dist.device) or 'off'}, "
                 f"{'torch.compile' if args.use_xla else 'eager'}")
    logger.print(f"peak lr {tr.schedule.base_lr:.4g} = --lr_init {args.lr_init:g} x "
                 f"{global_batch} / {LR_BATCH_BASE} (NVIDIA's rule)")
    args.resume_checkpoint = _resume_from(args, dist, logger)
    if args.mode == "eval" and not args.resume_checkpoint:
        args.resume_checkpoint = _eval_checkpoint(args, dist, logger)
    if args.resume_checkpoint:
        restore_trainer(tr, load_checkpoint(args.resume_checkpoint) if dist.is_root else None)
        logger.print(f"resumed from {args.resume_checkpoint}: epoch {tr.epoch}, step {tr.step}")
        if train_ds is not None:
            logger.print(resume_stream(tr, train_ds))

    def eval_loader() -> Any:
        loader = make_loader(eval_ds, args.eval_batch_size, args.num_workers, drop_last=False)
        if not args.eval_num_examples:
            return loader
        return _first_examples(loader, max(1, args.eval_num_examples // dist.size))

    summary: dict[str, Any] = {}
    if args.mode == "eval":
        summary = evaluate(tr, eval_loader())
        summary["checkpoint"] = args.resume_checkpoint or "none: untrained"
    else:
        batches = iter(make_loader(train_ds, args.train_batch_size, args.num_workers,
                                   drop_last=True, pin_memory=dist.device.type == "cuda"))
        benchmark = args.mode == "training_benchmark"
        start, first = time.perf_counter(), tr.epoch
        for _ in range(tr.epoch, args.max_epochs):
            warmup = args.benchmark_warmup_steps if benchmark and tr.epoch == first else 1
            stats = train_epoch(tr, batches, logger, min(warmup, tr.steps_per_epoch - 1))
            tr.epoch += 1
            evaluating = args.mode == "train_and_eval" and not args.skip_eval and (
                tr.epoch % args.num_epochs_between_eval == 0 or tr.epoch == args.max_epochs)
            logger.log((tr.epoch, tr.step), stats, echo=not evaluating)
            summary.update(stats)
            if evaluating:  # one line for the epoch: training, then evaluation
                ev = evaluate(tr, eval_loader())
                logger.log((tr.epoch, tr.step), ev, echo=False)
                logger.echo((tr.epoch, tr.step), {**stats, **ev})
                summary.update(ev)
            freq = args.save_checkpoint_freq
            if not benchmark and args.enable_checkpoint_and_export and (
                    (freq and tr.epoch % freq == 0) or tr.epoch == args.max_epochs):
                save(tr, args.model_dir)
        del batches
        summary["training_time"] = time.perf_counter() - start
    logger.log("SUMMARY", summary)
    logger.close()
    return summary


def _first_examples(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], limit: int
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The batches of ``batches`` up to ``limit`` examples (the last one cut)."""
    for images, labels in batches:
        if limit <= 0:
            return
        yield images[:limit], labels[:limit]
        limit -= int(labels.shape[0])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Join the job, run ``args.mode``, leave the job; the final summary (on every rank)."""
    dist = init_distributed(args.backend)
    try:
        return _run(args, dist)
    finally:
        shutdown_distributed(dist)
