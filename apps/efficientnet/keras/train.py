"""``--framework tensorflow``: EfficientNet trained by ``model.fit`` through ``shoal.keras``.

Horovod's recipe, as written for Keras: ``hvd.init()``, the learning rate scaled by the global
batch, ``hvd.DistributedOptimizer(opt, compression=...)``, ``BroadcastGlobalVariablesCallback(0)``,
``MetricAverageCallback()``, checkpoints on rank 0 only. ``--use_amp`` is Keras's
``mixed_float16`` policy (Keras adds the loss-scale optimizer), ``--use_xla`` compiles the step
with XLA (``jit_compile``; shoal splits it at the optimizer; with ``--batch_norm syncbn``, whose
reduction no XLA program can hold, TensorFlow's auto-clustering compiles the rest, as the
recipe's ``--use_xla`` does), ``--batch_norm syncbn`` uses shoal's ``SyncBatchNormalization``.
Statistics are logged like the PyTorch application's: loss,
top-1/top-5 accuracy, images per second, latency percentiles; a ``SUMMARY`` line closes the run.

Checkpoints (:mod:`.checkpoint`) go to ``--checkpoint_dir`` every ``--save_checkpoint_freq``
epochs, every ``--save_checkpoint_steps`` steps and at the end; ``--resume auto`` (the default)
continues from the newest intact one on every rank, mid-epoch too, and exactly; a finished
run says so. On SIGTERM every rank stops after the same step, rank 0 checkpoints, and the run
ends normally (:mod:`apps.efficientnet.runtime.preempt`). ``--mode eval`` scores a checkpoint.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from apps.efficientnet.config.flags import LR_BATCH_BASE, peak_lr
from apps.efficientnet.config.variants import training_resolution
from apps.efficientnet.dataloader.index import record_counts
from apps.efficientnet.keras import checkpoint
from apps.efficientnet.keras.comm import Comm, make_comm
from apps.efficientnet.runtime.ckptdir import resume
from apps.efficientnet.runtime.metrics import MetricLogger, latency_percentiles
from apps.efficientnet.runtime.preempt import StopRequest

__all__ = ["evaluate", "run"]


def _keras(backend: str, args: argparse.Namespace) -> tuple[Any, Any, Comm]:
    import tensorflow as tf
    threads = args.intraop_threads or os.environ.get("OMP_NUM_THREADS")
    if threads:  # before the strategy (or anything else) starts TensorFlow's runtime
        tf.config.threading.set_intra_op_parallelism_threads(int(threads))
        tf.config.threading.set_inter_op_parallelism_threads(
            args.interop_threads or min(2, int(threads)))
    comm = make_comm(backend)
    if not threads:  # share the host's cores between its ranks
        share = max(1, (os.cpu_count() or 1) // comm.local_size)
        tf.config.threading.set_intra_op_parallelism_threads(share)
        tf.config.threading.set_inter_op_parallelism_threads(
            args.interop_threads or min(2, share))
    import keras
    return tf, keras, comm


def evaluate(tf: Any, comm: Comm, model: Any, data: Any, jit: bool) -> dict[str, float]:
    """Loss and top-1/top-5 accuracy over every rank's share of ``data`` (exact global
    averages), and latency percentiles."""
    @tf.function(jit_compile=jit, reduce_retracing=True)
    def predict(images: Any) -> Any:
        return model(images, training=False)

    sums, times = np.zeros(4), []
    for images, labels in data:
        t0 = time.perf_counter()
        logits = predict(images)
        loss = tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
        top = [tf.math.in_top_k(labels, logits, k) for k in (1, 5)]
        sums += [float(tf.reduce_sum(loss)), float(tf.reduce_sum(tf.cast(top[0], tf.float32))),
                 float(tf.reduce_sum(tf.cast(top[1], tf.float32))), float(tf.size(labels))]
        times.append(time.perf_counter() - t0)
    total = comm.total(list(sums), name="keras.eval")
    count = max(total[3], 1.0)
    lat = latency_percentiles(times[1:], "eval")
    lat = dict(zip(lat, map(float, comm.average(list(lat.values()), name="keras.eval.lat")),
                   strict=True)) if lat else {}
    return {"eval_loss": total[0] / count, "eval_accuracy_top_1": 100 * total[1] / count,
            "eval_accuracy_top_5": 100 * total[2] / count, **lat}


def _callback(keras: Any, tf: Any, comm: Comm, args: argparse.Namespace, logger: MetricLogger,
              eval_data: Any, summary: dict[str, Any], warmup: int, jit: bool,
              stop: StopRequest, steps: int) -> Any:
    class Progress(keras.callbacks.Callback):
        """Timing, evaluation, checkpoints and logging, once per epoch (and the images/s of
        every ``--log_steps`` steps with ``--time_history``)."""

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            self.times: list[float] = []
            self.epoch = epoch

        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            self.times.append(time.perf_counter() - self.t0)
            n = args.log_steps
            if args.time_history and n and len(self.times) % n == 0:
                rate = n * args.train_batch_size / max(sum(self.times[-n:]), 1e-9)
                rate = float(comm.average([rate], name="keras.window")[0]) * comm.size
                step = self.params["steps"] * self.epoch + len(self.times)
                logger.log((self.epoch + 1, step), {"examples_per_second": rate})

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            if stop.stopped:  # fit ends its epoch early: not an epoch's end
                return
            logs = logs or {}  # averaged over ranks by MetricAverageCallback
            skip = min(warmup, len(self.times) - 1)
            timed = self.times[skip:]
            per_worker = len(timed) * args.train_batch_size / max(sum(timed), 1e-9)
            lat = latency_percentiles(timed, "training")
            avg = comm.average([per_worker, *lat.values()], name="keras.epoch.stats")
            stats = {"training_loss": float(logs.get("loss", np.nan)),
                     "training_accuracy_top_1": 100 * float(logs.get("top1", np.nan)),
                     "training_accuracy_top_5": 100 * float(logs.get("top5", np.nan)),
                     "avg_exp_per_second_training": float(avg[0]) * comm.size,
                     "avg_exp_per_second_training_per_worker": float(avg[0]),
                     "learning_rate": float(self.model.optimizer.learning_rate),
                     **dict(zip(lat, map(float, avg[1:]), strict=True))}
            done = epoch + 1
            if eval_data is not None and (done % args.num_epochs_between_eval == 0
                                          or done == args.max_epochs):
                stats.update(_evaluate_ema(keras, tf, comm, args, self.model, eval_data, jit))
            step = _iterations(self.model)
            logger.log((epoch + 1, step), stats)
            summary.update(stats)
            freq = args.save_checkpoint_freq
            if _checkpoints(args) and comm.rank == 0 and (
                    (freq and (epoch + 1) % freq == 0) or epoch + 1 == args.max_epochs):
                checkpoint.save(self.model, epoch + 1, step, args.checkpoint_dir,
                                args.keep_checkpoints)

    class StepEnd(keras.callbacks.Callback):
        """Every --save_checkpoint_steps steps a checkpoint; after a SIGTERM, the step every
        rank stops after, and its checkpoint."""

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            self.epoch = epoch

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            step = _iterations(self.model)
            if stop():
                self.model.stop_training = True
                logger.print(f"SIGTERM: every rank stopped after step {step}"
                             + ("; checkpointing" if _checkpoints(args) else ""))
                if _checkpoints(args) and comm.rank == 0:
                    # after an epoch's last step its training is done (fit skips the rest
                    # of its end: statistics, evaluation)
                    epoch = self.epoch + (step % steps == 0)
                    where = checkpoint.save(self.model, epoch, step, args.checkpoint_dir,
                                            args.keep_checkpoints)
                    logger.print(f"checkpoint {where} written; the same command continues "
                                 f"the run from step {step}")
                stop.done()
                summary["stopped_at_step"] = step
                return
            every = args.save_checkpoint_steps
            if every and step % every == 0 and step % steps and \
                    _checkpoints(args) and comm.rank == 0:
                checkpoint.save(self.model, self.epoch, step, args.checkpoint_dir,
                                args.keep_checkpoints)

    return [Progress(), StepEnd()]


def _evaluate_ema(keras: Any, tf: Any, comm: Comm, args: argparse.Namespace, model: Any,
                  data: Any, jit: bool) -> dict[str, float]:
    """:func:`evaluate` with the weights' moving averages in place (``--moving_average_decay``),
    as the recipe evaluates."""
    ema = args.moving_average_decay > 0
    swap = keras.callbacks.SwapEMAWeights()
    swap.set_model(model)
    if ema:
        swap._swap_variables()
    try:
        return evaluate(tf, comm, model, data, jit)
    finally:
        if ema:
            swap._swap_variables()


def _iterations(model: Any) -> int:
    """The optimizer steps taken (a plain or a distribution strategy's variable)."""
    return int(np.asarray(model.optimizer.iterations.numpy()))


def _checkpoints(args: argparse.Namespace) -> bool:
    return bool(args.enable_checkpoint_and_export) and args.mode != "training_benchmark"


def _policy(args: argparse.Namespace) -> str | None:
    """Keras's mixed-precision policy: ``--dtype`` when it is 16-bit, else ``mixed_float16``
    with ``--use_amp``."""
    if args.dtype in ("bfloat16", "bf16"):
        return "mixed_bfloat16"
    if args.dtype in ("float16", "fp16") or args.use_amp:
        return "mixed_float16"
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train, evaluate or benchmark ``args.arch`` with Keras through shoal; the summary."""
    tf, keras, comm = _keras(args.backend, args)
    from apps.efficientnet.keras import data as data_
    from apps.efficientnet.keras.model import WarmupDecay, build_model, build_optimizer
    # synchronized BatchNorm reduces inside the model, which one XLA program cannot hold:
    # then XLA compiles what it can around it (TensorFlow's auto-clustering, as the recipe
    # turns XLA on), else the whole step (jit_compile)
    auto_jit = bool(args.use_xla) and args.batch_norm == "syncbn" and not args.run_eagerly
    jit = bool(args.use_xla) and not auto_jit and not args.run_eagerly
    if auto_jit:
        tf.config.optimizer.set_jit("autoclustering")
    keras.utils.set_random_seed(args.seed)
    policy = _policy(args)
    if policy:
        keras.mixed_precision.set_global_policy(policy)
    size, rank = comm.size, comm.rank
    image_size = training_resolution(args.arch, args.image_size)
    global_batch = args.train_batch_size * size
    steps = args.steps_per_epoch
    if not steps and args.train_num_examples:
        steps = max(1, args.train_num_examples // global_batch)
    if not steps:
        steps = 100 if args.synthetic or args.mode == "eval" else max(1, sum(record_counts(
            data_.read_split(args, "train"), comm.team())) // global_batch)
    logger = MetricLogger(Path(args.model_dir) / args.log_filename, enabled=rank == 0)
    logger.log("PARAMETER", {**vars(args), "world_size": size}, echo=False)
    for line in args.ignored:
        logger.print(f"WARNING: {line}")
    logger.of = f"/{args.max_epochs}"
    base_lr = peak_lr(args.lr_init, global_batch)
    schedule = WarmupDecay(base_lr, steps, steps * args.max_epochs,
                           int(args.lr_warmup_epochs * steps), args.lr_decay,
                           args.lr_decay_rate, args.lr_decay_epochs)
    with comm.scope():
        model = build_model(args, image_size)
        model.compile(optimizer=comm.optimizer(build_optimizer(args, schedule),
                                               args.compression),
                      jit_compile=jit, run_eagerly=bool(args.run_eagerly), metrics=[
                          keras.metrics.CategoricalAccuracy(name="top1"),
                          keras.metrics.TopKCategoricalAccuracy(5, name="top5")],
                      loss=keras.losses.CategoricalCrossentropy(
                          from_logits=True, label_smoothing=args.label_smoothing))
    resumed, state = resume(args, checkpoint.keras_checkpoints(args.checkpoint_dir),
                            rank == 0, lambda where: comm.broadcast_object(
                                where, name="keras.ckpt_found"), logger.print)
    start, step = 0, 0
    if resumed is not None:
        start, step = checkpoint.restore(model, state, resumed, comm)
        step = start * steps if step < 0 else step
        logger.print(f"resumed from {resumed}: epoch {start}, step {step}")
    logger.print(f"{args.arch} {args.mode}: {size} ranks (keras, {comm.name})")
    summary: dict[str, Any] = {}
    if args.mode == "eval":
        evaluation = data_.eval_dataset(args, rank, size, args.eval_img_size or image_size)
        summary = _evaluate_ema(keras, tf, comm, args, model, evaluation, jit)
        summary["checkpoint"] = resumed or "none: untrained"
        return _close(logger, comm, summary)
    if start >= args.max_epochs:
        logger.print(f"the run finished already (epoch {start} of {args.max_epochs}, step "
                     f"{step}, {resumed}); nothing to train. Start another with --resume "
                     f"none or a new --checkpoint_dir")
        return _close(logger, comm, {"finished": True, "epoch": start, "step": step})
    xla = "auto-clustering" if auto_jit else "jit_compile" if jit else "off"
    logger.print(f"{image_size} px, global batch {global_batch}, {steps} steps/epoch, amp "
                 f"{policy or 'off'}, xla {xla}")
    logger.print(f"peak lr {base_lr:.4g} = --lr_init {args.lr_init:g} x {global_batch} / "
                 f"{LR_BATCH_BASE} (NVIDIA's rule)")
    evaluation = data_.eval_dataset(args, rank, size, args.eval_img_size or image_size) \
        if args.mode == "train_and_eval" and not args.skip_eval else None
    warmup = args.benchmark_warmup_steps if args.mode == "training_benchmark" else 1
    stop = StopRequest(lambda flag, name: float(comm.average([flag], name=name)[0]),
                       args.stop_grace_s)
    callbacks = [*comm.callbacks(),
                 *_callback(keras, tf, comm, args, logger, evaluation, summary, warmup, jit,
                            stop, steps)]
    batch = comm.dataset_batch(args.train_batch_size)
    t0 = time.perf_counter()
    try:
        done = step - start * steps  # > 0: resumed inside epoch `start`
        if done > 0:  # the rest of that epoch: its data from the step after the checkpoint
            rest = data_.train_dataset(args, rank, size, image_size, steps, start, batch) \
                .skip(done).take(steps - done)
            comm.fit(model, rest, start, start + 1, steps - done, callbacks, jit,
                     args.train_batch_size)
            start += 1
        if start < args.max_epochs and not stop.stopped:
            train = data_.train_dataset(args, rank, size, image_size, steps, start, batch)
            comm.fit(model, train, start, args.max_epochs, steps, callbacks, jit,
                     args.train_batch_size)
    finally:
        stop.close()
    summary["training_time"] = time.perf_counter() - t0
    return _close(logger, comm, summary)


def _close(logger: MetricLogger, comm: Comm, summary: dict[str, Any]) -> dict[str, Any]:
    logger.log("SUMMARY", summary)
    logger.close()
    comm.close()
    return summary
