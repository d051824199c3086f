"""shoal.tensorflow: collectives eager and in tf.function, DistributedGradientTape equivalence.

TensorFlow is imported inside the forked ranks only (never in the test process: a process
that imported TensorFlow does not fork cleanly), and each multi-process run packs many checks
into one job, because importing TensorFlow costs seconds per rank.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

import shoal
from harness import run_ranks

needs_tf = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                              reason="tensorflow is not installed")


def _tf():
    """Import TensorFlow in a rank, with one thread per pool (2 shared cores here)."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def _data(rank: int, i: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(100 * i + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-50, 50, shape).astype(dtype)


_REFS = {"Sum": np.sum, "Min": np.min, "Max": np.max, "Product": np.prod}


def _collectives(rank: int) -> dict:
    tf = _tf()
    import shoal.tensorflow as hvd
    n = hvd.size()
    out: dict = {}
    cases = [(0, (5, 3), "float32"), (1, (7,), "float64"), (2, (4, 2), "int32"),
             (3, (), "float32")]
    for i, shape, dtype in cases:
        mine = tf.constant(_data(rank, i, shape, dtype))
        every = np.stack([_data(r, i, shape, dtype) for r in range(n)])
        got = hvd.allreduce(mine).numpy()
        total = every.sum(0)
        want = np.trunc(total / n).astype(total.dtype) if dtype == "int32" else every.mean(0)
        np.testing.assert_allclose(got, want, rtol=1e-6)
        for op_name, ref in _REFS.items():
            if op_name == "Product" and dtype != "float64":
                continue
            got = hvd.allreduce(mine, op=getattr(hvd, op_name)).numpy()
            np.testing.assert_allclose(got, ref(every, axis=0), rtol=1e-6, err_msg=op_name)
    x = tf.constant(_data(rank, 9, (64,), "float32"))
    every = np.stack([_data(r, 9, (64,), "float32") for r in range(n)])
    for codec, tol in ((hvd.Compression.fp16, 2e-3), (hvd.Compression.bf16, 2e-2)):
        got = hvd.allreduce(x, compression=codec).numpy()
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, every.mean(0), rtol=tol, atol=tol)
    for half in (tf.float16, tf.bfloat16):  # 16-bit tensors (accumulated in float32)
        got = hvd.allreduce(tf.cast(x, half))
        assert got.dtype == half
        np.testing.assert_allclose(tf.cast(got, tf.float32).numpy(), every.mean(0), atol=3e-2)
    np.testing.assert_allclose(hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5,
                                             postscale_factor=3.0).numpy(),
                               every.sum(0) * 1.5, rtol=1e-5)
    # allgather with a different length on every rank; broadcast from the last rank
    rows = [_data(r, 10, (r + 1, 2), "float32") for r in range(n)]
    np.testing.assert_array_equal(hvd.allgather(tf.constant(rows[rank])).numpy(),
                                  np.concatenate(rows))
    np.testing.assert_array_equal(hvd.broadcast(tf.constant(rows[rank][:1]), n - 1).numpy(),
                                  rows[n - 1][:1])
    variables = [tf.Variable(_data(rank, 11, (3,), "float32")), tf.Variable(rank)]
    assert hvd.broadcast_variables(variables, root_rank=1) is None
    np.testing.assert_array_equal(variables[0].numpy(), _data(1, 11, (3,), "float32"))
    assert int(variables[1].numpy()) == 1
    assert hvd.broadcast_object({"from": rank}, root_rank=n - 1) == {"from": n - 1}
    assert hvd.allgather_object(rank * 10) == [r * 10 for r in range(n)]
    hvd.barrier()
    # the walkthrough's statistic
    out["oob"] = float(hvd.oob_allreduce(tf.constant(float(rank), dtype=tf.float32)))
    assert out["oob"] == pytest.approx((n - 1) / 2)
    _graph_collectives(tf, hvd, rank, n)
    return out


def _graph_collectives(tf, hvd, rank: int, n: int) -> None:
    """The same collectives traced into tf.function: static shapes kept, names per call site
    (so a retrace for a new shape still matches), several independent collectives in one
    graph run in one agreed order, a collective inside tf.cond."""
    traces = []

    @tf.function
    def step(a, b, flag):
        traces.append(a.shape)
        s = hvd.allreduce(a, op=hvd.Sum)
        m = hvd.allreduce(b)  # independent of s: must not deadlock against it
        g = hvd.allgather(a)
        c = hvd.broadcast(b, root_rank=0)
        assert s.shape == a.shape and g.shape[1:] == a.shape[1:] and g.shape[0] is None
        z = tf.cond(flag, lambda: hvd.allreduce(b, op=hvd.Max), lambda: b * 0)
        return s, m, g, c, z, hvd.grouped_allreduce([a, b], compression=hvd.Compression.fp16)

    for k, rows in enumerate((3, 3, 5)):  # the third call retraces
        a = [_data(r, 20 + k, (rows, 4), "float32") for r in range(n)]
        b = [_data(r, 30 + k, (6,), "float64") for r in range(n)]
        s, m, g, c, z, grouped = step(tf.constant(a[rank]), tf.constant(b[rank]),
                                      tf.constant(k % 2 == 0))
        np.testing.assert_allclose(s.numpy(), np.sum(a, 0), rtol=1e-5)
        np.testing.assert_allclose(m.numpy(), np.mean(b, 0), rtol=1e-12)
        np.testing.assert_array_equal(g.numpy(), np.concatenate(a))
        np.testing.assert_array_equal(c.numpy(), b[0])
        np.testing.assert_array_equal(z.numpy(), np.max(b, 0) if k % 2 == 0 else 0 * b[rank])
        np.testing.assert_allclose(grouped[0].numpy(), np.mean(a, 0), atol=2e-3)
        np.testing.assert_allclose(grouped[1].numpy(), np.mean(b, 0), atol=2e-3)
    assert len(traces) == 2

    v = tf.Variable(_data(rank, 40, (2, 2), "float32"))

    @tf.function
    def sync():  # the returned op need not be returned: tf.function runs stateful ops
        hvd.broadcast_variables([v], root_rank=n - 1)

    sync()
    np.testing.assert_array_equal(v.numpy(), _data(n - 1, 40, (2, 2), "float32"))

    # a sparse gradient (tf.gather), with the tape wrapped before recording
    table = tf.Variable(np.ones((5, 2), "float32"))
    with hvd.DistributedGradientTape(tf.GradientTape()) as tape:
        loss = tf.reduce_sum(tf.gather(table, [rank % 5, 4]))
    grad = tape.gradient(loss, table)
    want = np.zeros((5, 2), "float32")
    for r in range(n):
        want[[r % 5, 4]] += 1.0 / n
    assert isinstance(grad, tf.IndexedSlices)  # Horovod's default: sparse_as_dense=False
    np.testing.assert_allclose(tf.convert_to_tensor(grad).numpy(), want, rtol=1e-6)

    with pytest.raises(shoal.ShoalError, match=r"xla\.compiled_step"):
        tf.function(hvd.allreduce, jit_compile=True, autograph=False)(tf.constant([1.0]))


def _batch(step: int, rank: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    return _data(rank, 50 + step, (b, 4), "float32"), _data(rank, 70 + step, (b, 2), "float32")


def _init(tf, seed: int) -> list:
    return [tf.Variable(_data(seed, 90, (4, 2), "float32")), tf.Variable(np.zeros(2, "float32"))]


def _loss(tf, w, x, y):
    return tf.reduce_mean(tf.square(tf.tanh(tf.matmul(x, w[0]) + w[1]) - y))


def _tape_training(rank: int, compression: str, graph: bool, steps: int = 3,
                   b: int = 4) -> list[np.ndarray]:
    """n ranks with batch b each must match 1 process with batch n*b (SGD)."""
    tf = _tf()
    import shoal.tensorflow as hvd
    n, lr = hvd.size(), 0.5
    codec = hvd.Compression.by_name(compression)
    w = _init(tf, seed=rank)  # different on every rank until the broadcast
    hvd.broadcast_variables(w, root_rank=0)
    ref = _init(tf, seed=0)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = _loss(tf, w, x, y)
        grads = hvd.DistributedGradientTape(tape, compression=codec).gradient(loss, w)
        for v, g in zip(w, grads, strict=True):
            v.assign_sub(lr * g)
        return hvd.oob_allreduce(loss)

    step = tf.function(step) if graph else step
    for s in range(steps):
        x, y = _batch(s, rank, b)
        step(tf.constant(x), tf.constant(y))
        xs, ys = zip(*[_batch(s, r, b) for r in range(n)], strict=True)
        with tf.GradientTape() as tape:
            loss = _loss(tf, ref, tf.constant(np.concatenate(xs)), tf.constant(np.concatenate(ys)))
        for v, g in zip(ref, tape.gradient(loss, ref), strict=True):
            v.assign_sub(lr * g)
    tol = 1e-3 if compression != "none" else 1e-6
    for mine, theirs in zip(w, ref, strict=True):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=tol, atol=tol)
    return [v.numpy() for v in w]


def _walkthrough_loop(rank: int) -> list[float]:
    """The SMDDP walkthrough's TF2 custom loop, as written (Keras 3 spells opt.variables
    without the call)."""
    tf = _tf()
    import keras

    import shoal.tensorflow as sdp
    sdp.init()
    keras.utils.set_random_seed(rank)
    mnist_model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, "relu"),
                                    keras.layers.Dense(3)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.Adam(0.01 * sdp.size())

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = mnist_model(images, training=True)
            loss_value = loss(labels, probs)
        tape = sdp.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, mnist_model.trainable_variables)
        opt.apply_gradients(zip(grads, mnist_model.trainable_variables))  # noqa: B905
        if first_batch:
            sdp.broadcast_variables(mnist_model.variables, root_rank=0)
            sdp.broadcast_variables(opt.variables, root_rank=0)
        loss_value = sdp.oob_allreduce(loss_value)
        return loss_value

    rng = np.random.default_rng(rank)
    for batch in range(4):
        images = rng.standard_normal((8, 8)).astype("float32")
        labels = rng.integers(0, 3, 8)
        loss_value = training_step(images, labels, batch == 0)
    return [float(loss_value)] + [float(np.sum(v.numpy())) for v in mnist_model.variables]


def _everything(rank: int) -> dict:
    out = _collectives(rank)
    out["tape"] = {(c, g): _tape_training(rank, c, g)
                   for c, g in (("none", False), ("none", True), ("fp16", True))}
    out["walkthrough"] = _walkthrough_loop(rank)
    return out


def _same_everywhere(results: list[dict], key: str) -> None:
    for theirs in results[1:]:
        for a, b in zip(results[0][key], theirs[key], strict=True):
            np.testing.assert_array_equal(a, b)


@needs_tf
def test_tensorflow_two_ranks() -> None:
    results = run_ranks(_everything, 2, timeout=100)
    for variant in results[0]["tape"]:  # every rank ends bitwise identical
        for theirs in results[1:]:
            for a, b in zip(results[0]["tape"][variant], theirs["tape"][variant], strict=True):
                np.testing.assert_array_equal(a, b)
    _same_everywhere(results, "walkthrough")


@needs_tf
def test_tensorflow_collectives_three_ranks() -> None:
    results = run_ranks(_collectives, 3, timeout=100)
    assert [r["oob"] for r in results] == [1.0] * 3


def test_missing_tensorflow_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "shoal.tensorflow" or
                 m.startswith(("shoal.tensorflow.", "tensorflow"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # what a missing package looks like
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'shoal\[tensorflow\]'"):
        importlib.import_module("shoal.tensorflow")
