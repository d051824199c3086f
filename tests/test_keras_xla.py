"""XLA and loss scaling through shoal: ``model.fit(jit_compile=True)`` and ``mixed_float16``
with a shoal ``DistributedOptimizer`` at 2 ranks match one process on the global batch, keep
ranks bitwise identical, and keep the forward and backward XLA-compiled (the compiled half
holds no Python op and XLA lowers it); custom loops through ``xla.compiled_step``; a
reduction reached inside a compiled function names the way out.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

from harness import keras_for, run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                reason="tensorflow is not installed")
#: Keras 3, and Keras 2 through tf_keras (TF_USE_LEGACY_KERAS=1)
FLAVORS = ["keras3", pytest.param("keras2", marks=pytest.mark.skipif(
    importlib.util.find_spec("tf_keras") is None, reason="tf_keras is not installed"))]


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.standard_normal((16, 5)).astype("float32"),
            rng.standard_normal((16, 3)).astype("float32"))


def _model(keras: Any) -> Any:
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(3)])


def _fit(rank: int, jit: bool, policy: str, flavor: str) -> dict:
    tf, keras, hvd = keras_for(flavor)
    keras.mixed_precision.set_global_policy(policy)
    x, y = _data()
    n = hvd.size()
    model = _model(keras)
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse",
                  jit_compile=jit)
    # two global batches of 8 rows; this rank gets its quarter of each
    xs = x.reshape(2, n, 8 // n, 5)[:, rank].reshape(-1, 5)
    ys = y.reshape(2, n, 8 // n, 3)[:, rank].reshape(-1, 3)
    model.fit(xs, ys, batch_size=8 // n, epochs=3, shuffle=False, verbose=0)
    out: dict = {"w": [w.numpy() for w in model.weights],
                 "optimizer": type(model.optimizer).__name__}
    split = model._shoal_split
    batch = (tf.constant(xs[:8 // n]), tf.constant(ys[:8 // n]))
    graph = split.compute.get_concrete_function(batch).graph
    out["python_ops"] = sorted({op.type for op in graph.get_operations()
                                if "PyFunc" in op.type})
    out["jit"] = split.compute._jit_compile
    if jit:
        out["hlo"] = len(split.compute.experimental_get_compiler_ir(batch)(stage="hlo"))
    if rank == 0:  # the same training in one process, on the global batches, float32
        keras.mixed_precision.set_global_policy("float32")
        ref = _model(keras)
        ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=jit)
        ref.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
        out["ref"] = [w.numpy() for w in ref.weights]
    return out


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize(("jit", "policy"), [(True, "float32"), (True, "mixed_float16")])
def test_fit_split_matches_one_process(jit: bool, policy: str, flavor: str) -> None:
    results = run_ranks(_fit, 2, jit, policy, flavor, timeout=200)
    for a, b in zip(results[0]["w"], results[1]["w"], strict=True):
        np.testing.assert_array_equal(a, b)  # ranks stay identical
    tol = 1e-5 if policy == "float32" else 2e-3  # float16 compute against float32
    for a, b in zip(results[0]["w"], results[0]["ref"], strict=True):
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol)
    assert results[0]["python_ops"] == []  # the compiled half holds no Python op
    assert results[0]["jit"] is True and results[0]["hlo"] > 0
    want = "LossScaleOptimizer" if policy == "mixed_float16" else "DistributedSGD"
    assert results[0]["optimizer"].startswith(want)  # Keras 2's is LossScaleOptimizerV3


def _custom_loop(rank: int, flavor: str) -> dict:
    tf, keras, _ = keras_for(flavor)

    import shoal.tensorflow as hvd
    x, y = _data()
    n = hvd.size()
    model = _model(keras)
    opt = keras.optimizers.SGD(0.1)
    model.build((None, 5))
    opt.build(model.trainable_variables)

    def compute(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb) - yb) ** 2)
        return tape.gradient(loss, model.trainable_variables), loss

    def apply(grads: Any, loss: Any) -> Any:
        if flavor == "keras2":
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        else:
            opt.apply(grads, model.trainable_variables)
        return loss

    step = hvd.xla.compiled_step(compute, apply)
    for b in range(2):
        rows = slice(8 * b + rank * (8 // n), 8 * b + (rank + 1) * (8 // n))
        step(tf.constant(x[rows]), tf.constant(y[rows]))
    out: dict = {"w": [w.numpy() for w in model.weights]}

    @tf.function(jit_compile=True)
    def inside(xb: Any, yb: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(xb) - yb) ** 2)
        return hvd.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    try:
        inside(tf.constant(x[:2]), tf.constant(y[:2]))
    except Exception as exc:  # autograph re-raises it as a StagingError
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["after"] = hvd.allreduce(tf.constant([float(rank)]), op=hvd.Sum).numpy()
    return out


@pytest.mark.parametrize("flavor", FLAVORS)
def test_compiled_step_and_the_error_inside_xla(flavor: str) -> None:
    results = run_ranks(_custom_loop, 2, flavor, timeout=200)
    for a, b in zip(results[0]["w"], results[1]["w"], strict=True):
        np.testing.assert_array_equal(a, b)
    for r in results:
        assert "ShoalError: shoal allreduce cannot run inside XLA" in r["error"]
        assert "xla.compiled_step" in r["error"]
        np.testing.assert_array_equal(r["after"], [1.0])


def _optimizer_arguments(rank: int, flavor: str) -> dict:
    """Keras's DistributedOptimizer with Horovod's arguments, against one process."""
    _, keras, hvd = keras_for(flavor)
    n = hvd.size()
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 7, (16, 3))
    y = rng.standard_normal((16, 2)).astype("float32")

    def model() -> Any:  # an embedding: its gradient is IndexedSlices
        keras.utils.set_random_seed(2)
        return keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(7, 4),
                                 keras.layers.Flatten(), keras.layers.Dense(2)])
    rows = ids.reshape(2, n, 8 // n, 3)[:, rank].reshape(-1, 3)
    ys = y.reshape(2, n, 8 // n, 2)[:, rank].reshape(-1, 2)
    out: dict = {}
    for label, kwargs in [("num_groups", {"num_groups": 2}),
                          ("predivide", {"gradient_predivide_factor": 2.0}),
                          ("sparse", {"sparse_as_dense": False}),
                          ("dense", {"sparse_as_dense": True}),
                          ("process_set", {"process_set": hvd.global_process_set}),
                          ("groups", "layers")]:
        m = model()
        if kwargs == "layers":
            kwargs = {"groups": [m.layers[0].trainable_weights]}
        m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kwargs),
                  loss="mse")
        m.fit(rows, ys, batch_size=8 // n, epochs=2, shuffle=False, verbose=0)
        out[label] = [w.numpy() for w in m.weights]
    ref = model()
    ref.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ref.fit(ids, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    out["ref"] = [w.numpy() for w in ref.weights]
    return out


@pytest.mark.parametrize("flavor", FLAVORS)
def test_distributed_optimizer_takes_horovods_arguments(flavor: str) -> None:
    results = run_ranks(_optimizer_arguments, 2, flavor, timeout=200)
    for label in ("num_groups", "predivide", "sparse", "dense", "process_set", "groups"):
        for a, b in zip(results[0][label], results[1][label], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=label)
        for a, b in zip(results[0][label], results[0]["ref"], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=label)
