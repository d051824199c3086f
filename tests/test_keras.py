"""shoal.keras / shoal.tensorflow.keras: DistributedOptimizer inside model.fit, the callbacks,
and the SMDDP walkthrough's Keras snippets, on 2 ranks in one job (Keras is imported in the
ranks only; see test_tensorflow.py)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import numpy as np
import pytest

from harness import keras_for, run_ranks

needs_keras = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None,
    reason="tensorflow/keras are not installed")
#: Keras 3, and Keras 2 through tf_keras (TF_USE_LEGACY_KERAS=1)
FLAVORS = ["keras3", pytest.param("keras2", marks=pytest.mark.skipif(
    importlib.util.find_spec("tf_keras") is None, reason="tf_keras is not installed"))]

B, STEPS, LR = 4, 3, 0.1  # per-rank batch, batches per epoch, learning rate


def _model(keras, seed: int):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


def _shard(rank: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((B * STEPS, 3)).astype("float32")
    return x, (x @ np.array([[1.0], [-2.0], [0.5]], "float32") + 0.1).astype("float32")


def _global(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The single-process data: global batch k is every rank's batch k, in rank order."""
    shards = [_shard(r) for r in range(n)]
    order = [np.concatenate([s[i][k * B:(k + 1) * B] for s in shards])
             for i in (0, 1) for k in range(STEPS)]
    return np.concatenate(order[:STEPS]), np.concatenate(order[STEPS:])


class _Recorder:
    """Collects the learning rate each batch starts with (a callback placed after the
    schedule callbacks)."""

    def __new__(cls, keras):
        class Recorder(keras.callbacks.Callback):
            def __init__(self) -> None:
                super().__init__()
                self.lrs: list[float] = []

            def on_train_batch_begin(self, batch, logs=None):
                self.lrs.append(float(np.asarray(self.model.optimizer.learning_rate)))
        return Recorder()


def _fit_matches_one_process(keras, hvd, rank: int, passes: int, epochs: int = 2,
                             average: bool | None = None, legacy: bool = False) -> dict:
    """2 ranks x batch B through model.fit == 1 process x batch 2B (weights, averaged loss).
    With ``passes`` > 1 the update uses the sum of the passes' gradients (Horovod's default),
    which for SGD is the mean at ``passes`` times the rate; ``average=True``: the mean."""
    n = hvd.size()
    model = _model(keras, seed=rank)  # different until BroadcastGlobalVariablesCallback
    sgd = keras.optimizers.legacy.SGD(lr=LR, momentum=0.9) if legacy else \
        keras.optimizers.SGD(LR, momentum=0.9)  # Keras 2's legacy ones, Horovod-era lr=
    opt = hvd.DistributedOptimizer(sgd,
                                   backward_passes_per_step=passes,
                                   **({} if average is None else
                                      {"average_aggregated_gradients": average}))
    assert isinstance(opt, type(sgd))

    class Custom(type(opt)):  # the distributed class is an ordinary, subclassable class
        def _clip_gradients(self, grads):
            return super()._clip_gradients(grads)

    assert isinstance(Custom.from_config(opt.get_config()), type(sgd))
    model.compile(optimizer=opt, loss="mse")
    x, y = _shard(rank)
    from shoal.core.collectives import Collectives
    submitted = []
    real = Collectives.allreduce_async

    def counting(self, array, op=hvd.Average, name=None, *args, **kwargs):
        submitted.append(name)
        return real(self, array, op, name, *args, **kwargs)

    Collectives.allreduce_async = counting
    try:
        history = model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0,
                            callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                       hvd.callbacks.MetricAverageCallback()])
    finally:
        Collectives.allreduce_async = real
    # one grouped allreduce of the 4 gradients per update: N batches communicate once
    grads = [s for s in submitted if s and s.startswith("DistributedSGD.")]
    assert len(grads) == 4 * epochs * STEPS // passes, submitted
    want_weights, want_loss = _reference(keras, n, passes, average, epochs)
    for mine, theirs in zip(model.get_weights(), want_weights, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    # MetricAverageCallback: the logged loss is the average over ranks, which with equal
    # batches is the single process's loss on the global batches
    np.testing.assert_allclose(history.history["loss"], want_loss, rtol=1e-5)
    return {"weights": model.get_weights(), "loss": history.history["loss"]}


def _reference(keras, n: int, passes: int, average: bool | None, epochs: int
               ) -> tuple[list[np.ndarray], list[float]]:
    """One process on the global batches, by hand: the gradients of ``passes`` batches are
    summed (Horovod's default) or averaged, then applied once; each epoch's loss is the mean
    of its batches' losses before their updates, as Keras logs it."""
    import tensorflow as tf
    ref = _model(keras, seed=0)
    opt = keras.optimizers.SGD(LR, momentum=0.9)
    gx, gy = _global(n)
    acc, count, losses = None, 0, []
    for _ in range(epochs):
        batch_losses = []
        for k in range(STEPS):
            rows = slice(k * n * B, (k + 1) * n * B)
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(ref(gx[rows]) - gy[rows]))
            grads = tape.gradient(loss, ref.trainable_variables)
            batch_losses.append(float(loss))
            acc = grads if acc is None else [a + g for a, g in zip(acc, grads, strict=True)]
            count += 1
            if count % passes == 0:
                scale = 1.0 / passes if average else 1.0
                opt.apply_gradients(zip([a * scale for a in acc], ref.trainable_variables,
                                        strict=True))
                acc = None
        losses.append(float(np.mean(batch_losses)))
    return ref.get_weights(), losses


def _loss_scaled(keras, hvd, rank: int) -> dict:
    """mixed_float16 with a LossScaleOptimizer around the distributed one: rank 1's first
    batch overflows, so every rank skips that step and halves its scale, together."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model(keras, seed=rank)
        inner = hvd.DistributedOptimizer(keras.optimizers.SGD(LR))
        scaler = getattr(keras.optimizers, "LossScaleOptimizer", None) or \
            keras.mixed_precision.LossScaleOptimizer
        opt = scaler(inner, initial_scale=8.0) if hasattr(keras, "ops") else \
            scaler(inner, dynamic=True, initial_scale=8.0)
        model.compile(optimizer=opt, loss="mse")
        x, y = _shard(rank)
        if rank == 1:
            x[:B] = 1e30  # inf in float16: this rank's gradients of batch 1 overflow
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0,
                  callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
        scale = getattr(opt, "dynamic_scale", None)
        scale = opt.loss_scale if scale is None else scale
        return {"scale": float(np.asarray(scale)), "weights": model.get_weights()}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def _tape(keras, rank: int) -> dict:
    """DistributedGradientTape on the Keras module's model: the gradients averaged."""
    import tensorflow as tf

    import shoal.tensorflow as sdp
    model = _model(keras, seed=0)
    x, y = _shard(rank)
    with tf.GradientTape(persistent=True) as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    local = tape.gradient(loss, model.trainable_variables)
    reduced = sdp.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    return {"local": [g.numpy() for g in local], "reduced": [g.numpy() for g in reduced]}


def _lr_schedule(keras, hvd) -> list[float]:
    """Warmup over 2 epochs, then LearningRateScheduleCallback halves the rate from epoch 3."""
    model = _model(keras, seed=0)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR)), loss="mse")
    recorder = _Recorder(keras)
    x, y = _shard(hvd.rank())
    history = model.fit(x, y, batch_size=B, epochs=4, shuffle=False, verbose=0, callbacks=[
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=LR, warmup_epochs=2),
        hvd.callbacks.LearningRateScheduleCallback(initial_lr=LR, multiplier=0.5,
                                                   start_epoch=3),
        recorder])
    n, spe = hvd.size(), STEPS
    want = [LR / n * ((e + b / spe + 1 / spe) * (n - 1) / 2 + 1)
            for e in range(2) for b in range(spe)]          # Horovod's warmup formula
    want += [want[-1]] * spe + [LR * 0.5] * spe              # unchanged, then the schedule
    np.testing.assert_allclose(recorder.lrs, want, rtol=1e-6)
    np.testing.assert_allclose(want[2 * spe - 1], LR)       # warmup ends at initial_lr
    np.testing.assert_allclose(history.history["lr"], [want[spe - 1], LR, LR, LR * 0.5],
                               rtol=1e-6)
    return recorder.lrs


def _late_broadcast(keras, hvd, rank: int) -> list[np.ndarray]:
    """A model that its first batch builds is broadcast after that batch (Horovod's way)."""
    keras.utils.set_random_seed(rank)
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                                     backward_passes_per_step=2), loss="mse")
    x, y = _shard(rank)
    model.fit(x, y, batch_size=B, epochs=1, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    return model.get_weights()


def _walkthrough(keras, rank: int, checkpoint_dir: str) -> float:
    """The SMDDP walkthrough's Keras snippets, as written."""
    import tensorflow as tf

    import shoal.tensorflow as sdp
    sdp.init()
    model = _model(keras, seed=rank)
    optimizer = keras.optimizers.Adam(0.001 * sdp.size())
    optimizer = sdp.keras.DistributedOptimizer(optimizer, compression=sdp.Compression.fp16)
    model.compile(loss="mse", optimizer=optimizer, metrics=["mae"])
    callbacks = [sdp.keras.callbacks.BroadcastGlobalVariablesCallback(0)]
    if sdp.rank() == 0:
        callbacks.append(keras.callbacks.ModelCheckpoint(
            os.path.join(checkpoint_dir, "checkpoint-{epoch}.keras")))
    x, y = _shard(rank)
    history = model.fit(x, y, batch_size=B, epochs=2, callbacks=callbacks, verbose=0)
    loss = float(sdp.oob_allreduce(tf.constant(history.history["loss"][-1], dtype=tf.float32)))
    if sdp.rank() == 0:  # the checkpoint loads with plain Keras, and distributed with shoal
        path = os.path.join(checkpoint_dir, "checkpoint-2.keras")
        plain = keras.models.load_model(path, compile=False)
        restored = sdp.keras.load_model(path)
        assert type(restored.optimizer).__name__ == "DistributedAdam"
        assert int(restored.optimizer.iterations) == int(optimizer.iterations) == 2 * STEPS
        for a, b, c in zip(plain.get_weights(), restored.get_weights(), model.get_weights(),
                           strict=True):
            np.testing.assert_array_equal(a, c)
            np.testing.assert_array_equal(b, c)
    return loss, model.get_weights()


def _everything(rank: int, checkpoint_dir: str, flavor: str) -> dict:
    _, keras, hvd = keras_for(flavor)
    import shoal.tensorflow.keras as tfk
    # one implementation on both import paths, bound to the same Keras
    assert tfk.DistributedOptimizer.__wrapped__ is hvd.DistributedOptimizer.__wrapped__
    assert tfk.callbacks.MetricAverageCallback is hvd.callbacks.MetricAverageCallback
    out = {"fit": _fit_matches_one_process(keras, hvd, rank, passes=1),
           "fit2": _fit_matches_one_process(keras, tfk, rank, passes=2),
           "fit2avg": _fit_matches_one_process(keras, hvd, rank, passes=2, average=True),
           "lrs": _lr_schedule(keras, hvd), "late": _late_broadcast(keras, hvd, rank),
           "amp": _loss_scaled(keras, hvd, rank), "tape": _tape(keras, rank)}
    if flavor == "keras2":
        out["fit2legacy"] = _fit_matches_one_process(keras, hvd, rank, passes=2, legacy=True)
    out["walkthrough"] = _walkthrough(keras, rank, checkpoint_dir)
    return out


@needs_keras
@pytest.mark.parametrize("flavor", FLAVORS)
def test_keras_two_ranks(tmp_path, flavor: str) -> None:
    results = run_ranks(_everything, 2, str(tmp_path), flavor, timeout=150)
    keys = ["fit", "fit2", "fit2avg", *(["fit2legacy"] if flavor == "keras2" else [])]
    for key in keys:  # every rank ends with the same weights and loss
        for a, b in zip(results[0][key]["weights"], results[1][key]["weights"], strict=True):
            np.testing.assert_array_equal(a, b)
        assert results[0][key]["loss"] == results[1][key]["loss"]
        assert results[0][key]["loss"][-1] < results[0][key]["loss"][0]
    assert results[0]["lrs"] == results[1]["lrs"]
    for a, b in zip(results[0]["late"], results[1]["late"], strict=True):
        np.testing.assert_array_equal(a, b)
    amp = [r["amp"] for r in results]
    assert amp[0]["scale"] == amp[1]["scale"] == 4.0  # one skipped step, on both ranks
    for a, b in zip(amp[0]["weights"], amp[1]["weights"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(np.any(w != 0) for w in amp[0]["weights"][1::2])  # the other steps applied
    tapes = [r["tape"] for r in results]
    for g0, g1, l0, l1 in zip(tapes[0]["reduced"], tapes[1]["reduced"], tapes[0]["local"],
                              tapes[1]["local"], strict=True):
        np.testing.assert_array_equal(g0, g1)
        np.testing.assert_allclose(g0, (l0 + l1) / 2, rtol=1e-6, atol=1e-7)
    (loss0, w0), (loss1, w1) = results[0]["walkthrough"], results[1]["walkthrough"]
    assert loss0 == loss1
    for a, b in zip(w0, w1, strict=True):
        np.testing.assert_array_equal(a, b)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1.keras", "checkpoint-2.keras"]


def test_missing_keras_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "shoal.keras" or
                 m.startswith(("shoal.keras.", "keras"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "keras", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'shoal\[tensorflow\]'"):
        importlib.import_module("shoal.keras")
