"""The modes of the application: train, eval, train_and_eval, training_benchmark.

Every rank runs the same number of steps per epoch (the training stream repeats forever),
logs statistics averaged over all ranks with ``hvd.oob_allreduce`` every ``--log_steps`` steps
and at the end of each epoch, evaluates after each epoch in ``train_and_eval``, and saves a
checkpoint every ``--save_checkpoint_freq`` epochs, every ``--save_checkpoint_steps`` steps
and at the end (rank 0 writes it into ``--checkpoint_dir``, keeping ``--keep_checkpoints``).
``--resume auto`` (the default) continues from the newest intact one; a run that finished
says so and trains no more. On SIGTERM every rank stops after the same step, rank 0
checkpoints, and the run ends normally (:mod:`.preempt`); the same command then continues
it. Rank 0 shows a progress bar (on a terminal), prints the metrics, and appends them to
``<model_dir>/<log_filename>`` as JSON lines; a ``SUMMARY`` line closes the run.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from apps.efficientnet.config.flags import LR_BATCH_BASE
from apps.efficientnet.dataloader import Preprocess, build_dataset, make_loader
from apps.efficientnet.dataloader.index import Team
from apps.efficientnet.dataloader.prefetch import DevicePrefetcher
from apps.efficientnet.runtime.checkpoint import checkpoint_dir
from apps.efficientnet.runtime.ckptdir import resume
from apps.efficientnet.runtime.distributed import (
    Dist,
    average,
    init_distributed,
    shutdown_distributed,
)
from apps.efficientnet.runtime.metrics import (
    MetricLogger,
    latency_percentiles,
    peak_rss_mib,
    progress_bar,
)
from apps.efficientnet.runtime.preempt import StopRequest
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
                logger: MetricLogger, warmup_steps: int = 1,
                stop: StopRequest | None = None) -> dict[str, float]:
    """The rest of the epoch's ``tr.steps_per_epoch`` steps (all of them, unless a resumed
    checkpoint was taken inside it); its statistics averaged over the ranks (the first
    ``warmup_steps`` are left out of throughput and latency). Checkpoints every
    ``--save_checkpoint_steps`` steps; returns early when ``stop`` says every rank stops."""
    args, dist = tr.args, tr.dist
    window = [0.0, 0.0, 0.0, 0.0, 0.0]  # loss * count, top-1, top-5, count, seconds
    total = [0.0, 0.0, 0.0, 0.0]
    times: list[float] = []
    first = tr.step - tr.epoch * tr.steps_per_epoch  # > 0: resumed inside this epoch
    bar = progress_bar(tr.steps_per_epoch, f"epoch {tr.epoch + 1}/{args.max_epochs}",
                       dist.is_root)
    bar.update(first)
    lr = 0.0
    for i in range(first, tr.steps_per_epoch):
        if stop is not None and stop():
            break
        t0 = time.perf_counter()
        s = train_step(tr, [next(batches) for _ in range(args.grad_accum_steps)])
        took = time.perf_counter() - t0
        if i - first >= warmup_steps:
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
        every = args.save_checkpoint_steps
        if every and tr.step % every == 0 and i + 1 < tr.steps_per_epoch and \
                args.enable_checkpoint_and_export and args.mode != "training_benchmark":
            save(tr)
    bar.close()
    per_worker = len(times) * tr.global_batch / dist.size / max(sum(times), 1e-9)
    lat = latency_percentiles(times, "training")
    names = LATENCY_NAMES["training"]
    avg = average(total + [per_worker, peak_rss_mib()] + [lat.get(k, 0.0) for k in names],
                  name=f"efficientnet.epoch.{tr.step}")
    seen = max(avg[3], 1e-12)  # a stop before the epoch's first step saw nothing
    stats = {"training_loss": avg[0] / seen, "training_accuracy_top_1": 100 * avg[1] / seen,
             "training_accuracy_top_5": 100 * avg[2] / seen,
             "avg_exp_per_second_training": avg[4] * dist.size,
             "avg_exp_per_second_training_per_worker": avg[4], "learning_rate": lr,
             "peak_rss_per_worker": avg[5]}
    stats.update(zip(names, avg[6:], strict=True))
    return stats


def save(tr: Trainer) -> Path | None:
    """Checkpoint ``tr`` into ``--checkpoint_dir`` (every rank calls; rank 0 writes and keeps
    the newest ``--keep_checkpoints``)."""
    state = trainer_state(tr)
    if tr.dist.is_root:
        return checkpoint_dir(tr.args.checkpoint_dir, tr.args.keep_checkpoints).save(state,
                                                                                      tr.step)
    return None


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
    resumed, state = resume(
        args, checkpoint_dir(args.checkpoint_dir), dist.is_root,
        lambda where: dist.hvd.broadcast_object(where, root_rank=0,
                                                name="efficientnet.ckpt_found")
        if dist.size > 1 else where, logger.print)
    if resumed is not None:
        restore_trainer(tr, state)
        logger.print(f"resumed from {resumed}: epoch {tr.epoch}, step {tr.step}")
        if train_ds is not None:
            logger.print(resume_stream(tr, train_ds))
    if args.mode != "eval" and tr.epoch >= args.max_epochs:
        logger.print(f"the run finished already (epoch {tr.epoch} of {args.max_epochs}, step "
                     f"{tr.step}, {resumed}); nothing to train. Start another with --resume "
                     f"none or a new --checkpoint_dir")
        summary = {"finished": True, "epoch": tr.epoch, "step": tr.step}
        logger.log("SUMMARY", summary)
        logger.close()
        return summary

    def eval_loader() -> Any:
        loader = make_loader(eval_ds, args.eval_batch_size, args.num_workers, drop_last=False)
        if not args.eval_num_examples:
            return loader
        return _first_examples(loader, max(1, args.eval_num_examples // dist.size))

    summary: dict[str, Any] = {}
    if args.mode == "eval":
        summary = evaluate(tr, eval_loader())
        summary["checkpoint"] = resumed or "none: untrained"
    else:
        batches = DevicePrefetcher(make_loader(train_ds, args.train_batch_size,
                                               args.num_workers, drop_last=True,
                                               pin_memory=dist.device.type == "cuda"),
                                   dist.device)
        benchmark = args.mode == "training_benchmark"
        start = time.perf_counter()
        stop = StopRequest(lambda flag, name: average([flag], name=name)[0],
                           args.stop_grace_s)
        try:
            summary = _train(args, tr, batches, logger, benchmark, eval_loader, stop)
        finally:
            stop.close()
        del batches
        summary["training_time"] = time.perf_counter() - start
    logger.log("SUMMARY", summary)
    logger.close()
    return summary


def _train(args: argparse.Namespace, tr: Trainer, batches: Iterator[Any],
           logger: MetricLogger, benchmark: bool, eval_loader: Callable[[], Any],
           stop: StopRequest) -> dict[str, Any]:
    """The epochs from ``tr.epoch`` on; after a SIGTERM, a checkpoint ends them."""
    summary: dict[str, Any] = {}
    checkpoints = args.enable_checkpoint_and_export and not benchmark
    first = tr.epoch
    for _ in range(tr.epoch, args.max_epochs):
        warmup = args.benchmark_warmup_steps if benchmark and tr.epoch == first else 1
        stats = train_epoch(tr, batches, logger, min(warmup, tr.steps_per_epoch - 1), stop)
        if stop.stopped:
            logger.print(f"SIGTERM: every rank stopped after step {tr.step}"
                         + ("; checkpointing" if checkpoints else ""))
            if checkpoints:
                where = save(tr)
                if where is not None:
                    logger.print(f"checkpoint {where} written; the same command continues "
                                 f"the run from step {tr.step}")
            stop.done()
            summary.update(stats, stopped_at_step=tr.step)
            return summary
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
        if checkpoints and ((freq and tr.epoch % freq == 0) or tr.epoch == args.max_epochs):
            save(tr)
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
