"""How the Keras application talks across workers: shoal (the product), or TensorFlow's own
``MultiWorkerMirroredStrategy`` (``--backend mwms``, the comparison run of
``shoal bench train --framework tensorflow``).

Both give the application the same few things: rank and size, averages and sums of Python
numbers, the optimizer wrapping, the callbacks, the scope to build the model in, and how a
worker's dataset must be batched (``MultiWorkerMirroredStrategy`` re-batches each worker's
dataset to the global batch divided by the replicas, so it is handed global batches).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from apps.efficientnet.dataloader.index import Team

__all__ = ["Comm", "make_comm"]


class Comm:
    """shoal through ``shoal.keras``: ``hvd.init()``, ``DistributedOptimizer`` and callbacks."""

    name = "shoal"

    def __init__(self) -> None:
        import shoal.keras as hvd
        hvd.init()
        self.hvd = hvd
        self.rank, self.size, self.local_size = hvd.rank(), hvd.size(), hvd.local_size()

    def average(self, values: list[float], name: str) -> np.ndarray:
        """The mean of ``values`` over the workers (elementwise)."""
        return np.asarray(self.hvd.allreduce(np.asarray(values, np.float64), name=name))

    def total(self, values: list[float], name: str) -> np.ndarray:
        """The sum of ``values`` over the workers (elementwise)."""
        return np.asarray(self.hvd.allreduce(np.asarray(values, np.float64), op=self.hvd.Sum,
                                             name=name))

    def broadcast_object(self, obj: Any, name: str) -> Any:
        """Rank 0's ``obj`` on every worker."""
        return self.hvd.broadcast_object(obj, 0, name=name)

    def team(self) -> Team:
        """The workers, to share out counting the records (:mod:`...dataloader.index`)."""
        return Team(self.rank, self.size,
                    lambda obj: self.hvd.broadcast_object(obj, 0, name="efficientnet.known"),
                    lambda obj: self.hvd.allgather_object(obj, name="efficientnet.counted"))

    def optimizer(self, opt: Any, compression: str) -> Any:
        """``opt`` made data-parallel."""
        return self.hvd.DistributedOptimizer(opt, compression=self.hvd.Compression.by_name(
            compression))

    def callbacks(self) -> list[Any]:
        """Horovod's two callbacks: rank 0's start everywhere, logged metrics averaged."""
        return [self.hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                self.hvd.callbacks.MetricAverageCallback()]

    def scope(self) -> contextlib.AbstractContextManager[None]:
        """Where the model and optimizer are built."""
        return contextlib.nullcontext()

    def dataset_batch(self, per_worker: int) -> int:
        """The batch size a worker's dataset must have for ``per_worker`` images per step."""
        return per_worker

    def close(self) -> None:
        """Leave the job (shoal's communicator closes at exit)."""

    def fit(self, model: Any, dataset: Any, start: int, epochs: int, steps: int,
            callbacks: list[Any], jit: bool, batch: int) -> None:
        """``model.fit``: epochs ``start`` to ``epochs`` of ``steps`` steps (XLA as the model
        was compiled; shoal splits the step at the optimizer)."""
        model.fit(dataset, epochs=epochs, initial_epoch=start, steps_per_epoch=steps,
                  callbacks=callbacks, verbose=0)


class MirroredComm(Comm):
    """``tf.distribute.MultiWorkerMirroredStrategy`` (ring all-reduce), from ``TF_CONFIG``."""

    name = "mwms"

    def __init__(self) -> None:  # the strategy must exist before other TensorFlow ops
        import tensorflow as tf
        if "TF_CONFIG" not in os.environ:
            raise RuntimeError("--backend mwms needs TF_CONFIG (a MultiWorkerMirroredStrategy "
                               "cluster); shoal bench train --framework tensorflow sets it")
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        self.tf = tf
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=options)
        self.rank = int(self.strategy.cluster_resolver.task_id)
        self.size = int(self.strategy.num_replicas_in_sync)
        self.local_size = 1

    def _reduce(self, values: list[float], op: Any) -> np.ndarray:
        tf = self.tf
        value = tf.constant(np.asarray(values, np.float64))
        per_replica = self.strategy.run(lambda: tf.identity(value))
        return np.asarray(self.strategy.reduce(op, per_replica, axis=None))

    def average(self, values: list[float], name: str) -> np.ndarray:
        return self._reduce(values, self.tf.distribute.ReduceOp.MEAN)

    def total(self, values: list[float], name: str) -> np.ndarray:
        return self._reduce(values, self.tf.distribute.ReduceOp.SUM)

    def broadcast_object(self, obj: Any, name: str) -> Any:
        raise NotImplementedError("--backend mwms is a benchmark backend: --resume_checkpoint "
                                  "is shoal's")

    def team(self) -> Team:
        """This worker alone: each counts what the index lacks (the index is written
        atomically, so concurrent writers are harmless)."""
        return Team()

    def optimizer(self, opt: Any, compression: str) -> Any:
        if compression != "none":
            raise NotImplementedError("--backend mwms has no gradient compression")
        return opt

    def callbacks(self) -> list[Any]:
        return []  # the strategy mirrors the initial weights and aggregates the metrics

    def scope(self) -> contextlib.AbstractContextManager[None]:
        return self.strategy.scope()

    def dataset_batch(self, per_worker: int) -> int:
        return per_worker * self.size

    def close(self) -> None:
        """Meet every worker once more, then exit at once. Left to interpreter teardown,
        the workers leave TensorFlow's coordination service seconds apart, and the chief
        reports the first to go as crashed ("tasks are unhealthy") and exits with status 1."""
        import sys
        self.average([0.0], name="close")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def fit(self, model: Any, dataset: Any, start: int, epochs: int, steps: int,
            callbacks: list[Any], jit: bool, batch: int) -> None:
        """A custom loop, the way TensorFlow documents ``MultiWorkerMirroredStrategy`` for
        custom training: each replica computes its gradients (XLA-compiled with ``jit``),
        the optimizer sums them across workers (ring all-reduce) and applies them. (Keras
        3.15's ``model.fit`` under this strategy fails: its first-batch build reduces the
        data with ``strategy.reduce`` and its per-replica metric reduction sums over a
        scalar's axis 0.)"""
        tf = self.tf
        variables = model.trainable_variables
        loss_fn = model.loss
        global_batch = float(batch * self.size)

        @tf.function(jit_compile=jit, reduce_retracing=True)
        def gradients(images: Any, labels: Any) -> Any:
            with tf.GradientTape() as tape:
                logits = model(images, training=True)
                per_example = loss_fn(labels, logits)
                loss = tf.reduce_sum(tf.cast(per_example, tf.float32)) / global_batch
            return tape.gradient(loss, variables), loss

        def replica(images: Any, labels: Any) -> Any:
            grads, loss = gradients(images, labels)
            model.optimizer.apply_gradients(zip(grads, variables, strict=True))
            return loss

        @tf.function
        def step(batch: Any) -> Any:
            losses = self.strategy.run(replica, args=batch)
            return self.strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

        for cb in callbacks:
            cb.set_model(model)
            cb.set_params({"epochs": epochs, "steps": steps, "verbose": 0})
        batches = iter(self.strategy.experimental_distribute_dataset(dataset))
        for epoch in range(start, epochs):
            for cb in callbacks:
                cb.on_epoch_begin(epoch)
            total = 0.0
            for i in range(steps):
                data = next(batches)
                for cb in callbacks:
                    cb.on_train_batch_begin(i)
                total += float(step(data))
                for cb in callbacks:
                    cb.on_train_batch_end(i)
            for cb in callbacks:
                cb.on_epoch_end(epoch, {"loss": total / steps})


def make_comm(backend: str) -> Comm:
    """The communicator for ``--backend``: ``shoal`` or ``mwms``."""
    if backend == "mwms":
        return MirroredComm()
    if backend != "shoal":
        raise ValueError(f"--framework tensorflow runs --backend shoal or mwms, not {backend!r}")
    return Comm()

