"""Horovod's Keras pieces beyond model.fit (issue 50), on Keras 3 and Keras 2 (tf_keras) alike,
at 3 ranks: the optimizer's ``_compute_gradients`` and ``register_local_var``,
``PartialDistributedOptimizer``, ``op=Adasum``,
``BroadcastGlobalVariablesCallback(local_variables=)``,
``reducescatter``, ``broadcast_global_variables`` and ``callbacks.BestModelCheckpoint``.

One job per Keras runs every piece (TensorFlow's import dominates); each piece is its own test.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from harness import keras_for, run_ranks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tensorflow") is None or importlib.util.find_spec("keras") is None,
    reason="tensorflow/keras are not installed")

FLAVORS = ["keras3", pytest.param("keras2", marks=pytest.mark.skipif(
    importlib.util.find_spec("tf_keras") is None, reason="tf_keras is not installed"))]
N = 3
LR = 0.5


def _x(rank: int, rows: int = 4) -> np.ndarray:
    return np.random.default_rng(10 + rank).standard_normal((rows, 3)).astype("float32")


def _model(keras, value: float | None = None, seed: int = 0):
    keras.utils.set_random_seed(seed)
    init = {} if value is None else {
        "kernel_initializer": keras.initializers.Constant(value),
        "bias_initializer": keras.initializers.Constant(value)}
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, **init),
                             keras.layers.Dense(1, **init)])


def _local_grads(tf, model, x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x)))
    return [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]


def _compute_gradients(tf, keras, hvd, rank: int) -> dict:
    """``_compute_gradients`` (callable loss; tensor loss with its tape; in a tf.function)
    returns reduced gradients, and ``apply_gradients`` applies them without reducing again
    (op=Sum, so a second reduction would multiply them by the size)."""
    out = {}
    model = _model(keras, seed=0)
    x = _x(rank)
    out["local"] = _local_grads(tf, model, x)
    weights = model.get_weights()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), op=hvd.Sum)

    def loss():
        return tf.reduce_mean(tf.square(model(x)))

    pairs = opt._compute_gradients(loss, var_list=model.trainable_variables)
    out["callable"] = [g.numpy() for g, _ in pairs]
    with tf.GradientTape() as tape:
        value = loss()
    pairs = opt.compute_gradients(value, model.trainable_variables, tape=tape)
    out["tensor"] = [g.numpy() for g, _ in pairs]
    opt.apply_gradients(pairs)
    out["eager_step"] = [w.numpy() if hasattr(w, "numpy") else np.asarray(w)
                         for w in model.trainable_variables]
    model.set_weights(weights)

    @tf.function
    def step():
        grads_and_vars = opt._compute_gradients(loss, var_list=model.trainable_variables)
        if hasattr(keras, "ops"):
            opt.apply_gradients(grads_and_vars)
        else:  # Horovod's tests skip Keras 2's aggregation: the gradients come reduced
            opt.apply_gradients(grads_and_vars, experimental_aggregate_gradients=False)

    step()
    out["graph_step"] = model.get_weights()
    out["start"] = weights
    with pytest.raises(ValueError, match="tape"):
        opt._compute_gradients(value, model.trainable_variables)
    model.set_weights(weights)
    adasum = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), op=hvd.Adasum)
    out["adasum"] = [g.numpy() for g, _ in adasum._compute_gradients(
        loss, var_list=model.trainable_variables)]
    return out


def _fit_sum(keras, hvd, rank: int) -> dict:
    """model.fit with op=Sum: one update by the sum of the ranks' gradients, once."""
    import tensorflow as tf
    model = _model(keras, seed=0)
    x = _x(rank)
    local = _local_grads(tf, model, x)
    start = model.get_weights()
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(LR), op=hvd.Sum),
                  loss="mse")
    model.fit(x, np.zeros((len(x), 1), "float32"), batch_size=len(x), epochs=1, verbose=0)
    return {"start": start, "local": local, "end": model.get_weights()}


def _partial(tf, keras, hvd, rank: int) -> dict:
    """PartialDistributedOptimizer: the first layer is each rank's own (its gradient divided
    by the size, Horovod's scaling); the second is averaged, in _compute_gradients and in fit."""
    model = _model(keras, value=float(rank + 1))
    x = _x(rank)
    local = _local_grads(tf, model, x)
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(LR),
                                          local_layers=[model.layers[0]])
    with tf.GradientTape() as tape:
        value = tf.reduce_mean(tf.square(model(x)))
    computed = [g.numpy() for g, _ in opt._compute_gradients(value, model.trainable_variables,
                                                             tape=tape)]
    start = model.get_weights()
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, np.zeros((len(x), 1), "float32"), batch_size=len(x), epochs=1, verbose=0)
    unscaled = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(LR),
                                               local_layers=model.layers[0],
                                               scale_local_gradients=False)
    with tf.GradientTape() as tape:
        value = tf.reduce_mean(tf.square(model(x)))
    raw = [g.numpy() for g, _ in unscaled._compute_gradients(value, model.trainable_variables,
                                                             tape=tape)]
    with pytest.raises(ValueError, match="local layers"):
        hvd.PartialDistributedOptimizer(keras.optimizers.SGD(LR), local_layers=["dense"])
    return {"local": local, "computed": computed, "start": start, "end": model.get_weights(),
            "raw_local": _local_grads(tf, model, x)[:2], "raw": raw[:2]}


def _broadcast_local(keras, hvd, rank: int) -> dict:
    """BroadcastGlobalVariablesCallback(local_variables=): the first layer stays each rank's;
    the others become the root's (the last rank)."""
    model = _model(keras, value=float(rank))
    for layer in model.layers:
        layer.trainable = False
    model.compile(optimizer=keras.optimizers.SGD(LR), loss="mse")
    local = list(model.layers[0].variables)
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=N - 1,
                                                              local_variables=local)
    model.fit(_x(rank), np.zeros((4, 1), "float32"), epochs=1, verbose=0, callbacks=[callback])
    with pytest.raises(ValueError, match="local variables"):
        hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[np.zeros(2)])
    return {"weights": model.get_weights()}


def _values(keras, hvd, rank: int) -> dict:
    """reducescatter on Keras values; broadcast_global_variables refuses eager code."""
    rng = np.random.default_rng(rank)
    a = rng.standard_normal((7, 2)).astype("float32")
    b = rng.standard_normal(5)
    out = {"a": a, "b": b,
           "sum": hvd.reducescatter(keras.Variable(a) if hasattr(keras, "Variable") else a,
                                    op=hvd.Sum, name="rs.a"),
           "avg": hvd.reducescatter(b, name="rs.b"),
           "empty": hvd.reducescatter(np.zeros((0, 3), "float32"), op=hvd.Sum)}
    with pytest.raises(RuntimeError, match="broadcast_variables"):
        hvd.broadcast_global_variables(0)
    return out


def _best_checkpoint(keras, hvd, rank: int, path: str) -> dict:
    """BestModelCheckpoint on rank 0: the model of the epoch with the lowest loss; its path
    can be set after construction, and training without one fails clearly."""
    if rank != 0:
        return {}
    model = _model(keras, seed=1)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    x = _x(0, 16)
    y = (x @ np.array([[1.0], [-1.0], [0.5]], "float32")).astype("float32")
    missing = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    with pytest.raises(ValueError, match="filepath"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[missing])
    best = hvd.callbacks.BestModelCheckpoint(monitor="loss", mode="min")
    best.filepath = path
    history = model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[best])
    return {"loss": history.history["loss"],
            "saved": keras.models.load_model(path).get_weights(),
            "final": model.get_weights()}


def _job(rank: int, flavor: str, path: str) -> dict:
    tf, keras, hvd = keras_for(flavor)
    import shoal.tensorflow.keras as tfk
    assert tfk.PartialDistributedOptimizer.__wrapped__ is \
        hvd.PartialDistributedOptimizer.__wrapped__
    return {"compute": _compute_gradients(tf, keras, hvd, rank),
            "fit_sum": _fit_sum(keras, hvd, rank),
            "partial": _partial(tf, keras, hvd, rank),
            "bcast": _broadcast_local(keras, hvd, rank),
            "values": _values(keras, hvd, rank),
            "best": _best_checkpoint(keras, hvd, rank, path)}


@pytest.fixture(scope="module", params=FLAVORS)
def ranks(request, tmp_path_factory) -> list[dict]:
    path = str(tmp_path_factory.mktemp(request.param) / "best.keras")
    return run_ranks(_job, N, request.param, path, timeout=240)


def _close(a, b) -> None:
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_compute_gradients_reduce_once(ranks) -> None:
    total = [sum(r["compute"]["local"][i] for r in ranks) for i in range(4)]
    for r in ranks:
        c = r["compute"]
        for i in range(4):
            _close(c["callable"][i], total[i])
            _close(c["tensor"][i], total[i])
            _close(c["eager_step"][i], c["start"][i] - LR * total[i])
            _close(c["graph_step"][i], c["start"][i] - LR * total[i])


def test_optimizer_adasum_matches_the_reference(ranks) -> None:
    from test_adasum import _reference
    for i in range(4):
        shape = ranks[0]["compute"]["local"][i].shape
        want = _reference([r["compute"]["local"][i].ravel() for r in ranks]).reshape(shape)
        for r in ranks:
            np.testing.assert_allclose(r["compute"]["adasum"][i], want, rtol=1e-4, atol=1e-6)


def test_fit_reduces_once(ranks) -> None:
    total = [sum(r["fit_sum"]["local"][i] for r in ranks) for i in range(4)]
    for r in ranks:
        for i in range(4):
            _close(r["fit_sum"]["end"][i], r["fit_sum"]["start"][i] - LR * total[i])


def test_partial_distributed_optimizer(ranks) -> None:
    mean = [sum(r["partial"]["local"][i] for r in ranks) / N for i in range(4)]
    for r in ranks:
        p = r["partial"]
        for i in range(4):
            want = p["local"][i] / N if i < 2 else mean[i]  # the first layer is local
            _close(p["computed"][i], want)
            _close(p["end"][i], p["start"][i] - LR * want)
        for raw, own in zip(p["raw"], p["raw_local"], strict=True):
            _close(raw, own)  # scale_local_gradients=False: the rank's own gradient
    assert not np.allclose(ranks[0]["partial"]["end"][0], ranks[1]["partial"]["end"][0])


def test_broadcast_callback_keeps_local_variables(ranks) -> None:
    for rank, r in enumerate(ranks):
        for i, w in enumerate(r["bcast"]["weights"]):
            np.testing.assert_array_equal(w, np.full_like(w, rank if i < 2 else N - 1))


def test_reducescatter_matches_numpy(ranks) -> None:
    a = sum(r["values"]["a"] for r in ranks)
    b = sum(r["values"]["b"] for r in ranks) / N
    for rank, r in enumerate(ranks):
        rows_a = np.array_split(np.arange(7), N)[rank]  # the first ranks get the extra rows
        rows_b = np.array_split(np.arange(5), N)[rank]
        _close(r["values"]["sum"], a[rows_a])
        _close(r["values"]["avg"], b[rows_b])
        assert r["values"]["sum"].dtype == np.float32
        assert r["values"]["empty"].shape == (0, 3)


def test_best_model_checkpoint(ranks) -> None:
    best = ranks[0]["best"]
    assert best["loss"][-1] == min(best["loss"])  # the last epoch was the best: saved last
    for saved, final in zip(best["saved"], best["final"], strict=True):
        np.testing.assert_array_equal(saved, final)


def _graph_mode(rank: int) -> list[float]:
    tf, keras, hvd = keras_for("keras2")
    tf.compat.v1.disable_eager_execution()  # Keras 2 graph code: a session, global variables
    model = keras.Sequential([keras.layers.Dense(
        2, input_shape=(3,), kernel_initializer=keras.initializers.Constant(rank + 1.0))])
    model.compile(optimizer="sgd", loss="mse")
    hvd.broadcast_global_variables(1)
    return model.get_weights()[0].ravel().tolist()


@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None,
                    reason="tf_keras is not installed")
def test_broadcast_global_variables_in_graph_mode() -> None:
    for weights in run_ranks(_graph_mode, 2, timeout=120):
        assert weights == [2.0] * 6  # rank 1's
