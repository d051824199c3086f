"""shoal.tensorflow against numpy references: Horovod 0.28.1's API at 2 and 3 ranks, eager and
inside ``tf.function``; gradient rules; process sets; IndexedSlices; join; a caught mismatch
followed by working collectives; SyncBatchNormalization against the global-batch statistics.

Each run packs every check into one job per world size (TensorFlow's import costs seconds per
rank); TensorFlow is imported in the ranks only.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from harness import run_ranks, single_threaded_tf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                reason="tensorflow is not installed")


def _tf() -> Any:
    return single_threaded_tf()


def _data(rank: int, i: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1000 * i + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-9, 9, shape).astype(dtype)


def _every(n: int, i: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return np.stack([_data(r, i, shape, dtype) for r in range(n)])


def _blocks(rows: int, n: int) -> list[tuple[int, int]]:
    base, extra = divmod(rows, n)
    starts = [r * base + min(r, extra) for r in range(n + 1)]
    return list(itertools.pairwise(starts))


def _check(got: Any, want: np.ndarray, what: str, rtol: float = 1e-5) -> None:
    got = np.asarray(got)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6, err_msg=what)


def _collectives(tf: Any, hvd: Any, rank: int, n: int, mode: str,
                 call: Callable[..., Any]) -> None:
    refs = {"Sum": np.sum, "Min": np.min, "Max": np.max, "Product": np.prod}
    for i, (shape, dtype) in enumerate([((5, 3), "float32"), ((7,), "float64"),
                                         ((3, 2), "int32"), ((0,), "float32"),
                                         ((), "float32")]):
        mine, every = _data(rank, i, shape, dtype), _every(n, i, shape, dtype)
        total = every.sum(0)
        want = np.trunc(total / n).astype(dtype) if dtype == "int32" else every.mean(0)
        _check(call(lambda t: hvd.allreduce(t), mine), want, f"{mode} average {dtype}")
        for name, ref in refs.items():
            if name == "Product" and dtype != "float64":
                continue
            op = getattr(hvd, name)
            _check(call(lambda t, o=op: hvd.allreduce(t, op=o), mine),
                   ref(every, axis=0), f"{mode} {name} {dtype}")
        if dtype == "float64":
            _check(call(lambda t: hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5,
                                                postscale_factor=3.0), mine),
                   total * 1.5, f"{mode} scaled")
            _check(call(lambda t: hvd.allreduce(t, compression=hvd.Compression.fp16), mine),
                   every.mean(0), f"{mode} fp16", rtol=1e-2)
    # grouped, mixed dtypes
    a, b = _data(rank, 10, (4,), "float32"), _data(rank, 11, (2, 3), "int64")
    got = call(lambda x, y: hvd.grouped_allreduce([x, y], op=hvd.Sum), a, b)
    _check(got[0], _every(n, 10, (4,), "float32").sum(0), f"{mode} grouped 0")
    _check(got[1], _every(n, 11, (2, 3), "int64").sum(0), f"{mode} grouped 1")
    # allgather and grouped_allgather with a different first dimension on every rank
    rows = [r + 1 for r in range(n)]
    g = [_data(r, 12, (rows[r], 3), "float32") for r in range(n)]
    h = [_data(r, 13, (2 * rows[r],), "int32") for r in range(n)]
    _check(call(lambda t: hvd.allgather(t), g[rank]), np.concatenate(g), f"{mode} allgather")
    got = call(lambda x, y: hvd.grouped_allgather([x, y]), g[rank], h[rank])
    _check(got[0], np.concatenate(g), f"{mode} grouped_allgather 0")
    _check(got[1], np.concatenate(h), f"{mode} grouped_allgather 1")
    # broadcast from the last rank
    root = n - 1
    x = _data(rank, 14, (3, 3), "float64")
    _check(call(lambda t: hvd.broadcast(t, root), x), _data(root, 14, (3, 3), "float64"),
           f"{mode} broadcast")
    # alltoall: rank r sends (r + d) % 3 rows to rank d (zeros included)
    send = [[(r + d) % 3 for d in range(n)] for r in range(n)]
    rows_of = [_data(r, 15, (sum(send[r]), 2), "float32") for r in range(n)]
    starts = [np.cumsum([0, *send[r]]) for r in range(n)]
    want = np.concatenate([rows_of[r][starts[r][rank]:starts[r][rank + 1]] for r in range(n)])
    out, received = call(lambda t, s: hvd.alltoall(t, splits=s), rows_of[rank],
                         np.array(send[rank], np.int32))
    _check(out, want, f"{mode} alltoall")
    assert np.asarray(received).tolist() == [send[r][rank] for r in range(n)]
    even = _data(rank, 16, (2 * n, 2), "float32")
    even_want = np.concatenate([_data(r, 16, (2 * n, 2), "float32")[2 * rank:2 * rank + 2]
                                for r in range(n)])
    _check(call(lambda t: hvd.alltoall(t), even), even_want, f"{mode} alltoall even")
    # reducescatter with uneven rows, and grouped
    rs = _data(rank, 17, (2 * n + 1, 2), "float32")
    every = _every(n, 17, (2 * n + 1, 2), "float32")
    lo, hi = _blocks(2 * n + 1, n)[rank]
    _check(call(lambda t: hvd.reducescatter(t, op=hvd.Sum), rs), every.sum(0)[lo:hi],
           f"{mode} reducescatter sum")
    _check(call(lambda t: hvd.reducescatter(t), rs), every.mean(0)[lo:hi],
           f"{mode} reducescatter average")
    got = call(lambda x, y: hvd.grouped_reducescatter([x, y], op=hvd.Sum,
                                                      postscale_factor=2.0), rs, rs * 2)
    _check(got[0], 2 * every.sum(0)[lo:hi], f"{mode} grouped_reducescatter 0")
    _check(got[1], 4 * every.sum(0)[lo:hi], f"{mode} grouped_reducescatter 1")
    # IndexedSlices: two allgathers, as Horovod
    values = _data(rank, 18, (2, 3), "float32")
    idx = np.array([rank, (rank + 1) % 4], np.int64)
    dense = np.zeros((4, 3), np.float32)
    for r in range(n):
        np.add.at(dense, [r, (r + 1) % 4], _data(r, 18, (2, 3), "float32"))

    def sparse(v: Any, k: Any) -> Any:
        s = hvd.allreduce(tf.IndexedSlices(v, k, tf.constant([4, 3], tf.int64)), op=hvd.Average)
        assert isinstance(s, tf.IndexedSlices)
        return tf.convert_to_tensor(s)
    _check(call(sparse, values, idx), dense / n, f"{mode} IndexedSlices")
    # integer values are averaged by true division, as Horovod's: floats, never zeros
    ints = np.arange(6, dtype=np.uint8).reshape(2, 3) + rank
    averaged = call(lambda v, k: hvd.allreduce(tf.IndexedSlices(v, k), op=hvd.Average).values,
                    ints, idx)
    assert np.asarray(averaged).dtype == np.float32, (mode, averaged)
    _check(averaged, np.concatenate([(np.arange(6).reshape(2, 3) + r) / n for r in range(n)]
                                    ).astype(np.float32), f"{mode} IndexedSlices uint8")
    # the *_op tensors
    got = call(lambda: [hvd.rank_op(), hvd.size_op(), hvd.local_rank_op(),
                        hvd.local_size_op(), hvd.process_set_included_op()])
    assert [int(v) for v in got] == [rank, n, hvd.local_rank(), hvd.local_size(), 1], mode


def _gradients(tf: Any, hvd: Any, rank: int, n: int, mode: str,
               call: Callable[..., Any]) -> None:
    def grad_of(fn: Callable[[Any], Any], x: np.ndarray) -> Any:
        def g(t: Any) -> Any:
            with tf.GradientTape() as tape:
                tape.watch(t)
                y = fn(t)
            return tape.gradient(y, t)
        return call(g, x)
    x = _data(rank, 20, (3, 2), "float64")
    w = _data(0, 21, (3, 2), "float64")  # the same weights on every rank
    # allreduce: the same allreduce of the gradient (every rank's upstream gradient is w)
    _check(grad_of(lambda t: tf.reduce_sum(hvd.allreduce(t, op=hvd.Sum) * w), x), n * w,
           f"{mode} allreduce grad")
    _check(grad_of(lambda t: tf.reduce_sum(hvd.allreduce(t) * w), x), w,
           f"{mode} average grad")
    # allgather: this rank's rows of the averaged gradient
    wg = _data(0, 22, (3 * n, 2), "float64")
    _check(grad_of(lambda t: tf.reduce_sum(hvd.allgather(t) * wg), x),
           wg[3 * rank:3 * rank + 3], f"{mode} allgather grad")
    # broadcast: the averaged gradient on the root, zeros elsewhere
    _check(grad_of(lambda t: tf.reduce_sum(hvd.broadcast(t, 0) * w), x),
           w if rank == 0 else 0 * w, f"{mode} broadcast grad")
    # alltoall: the alltoall back (row i of rank r's input went to rank i % ... evenly)
    xe = _data(rank, 23, (2 * n, 2), "float64")
    we = _data(rank, 24, (2 * n, 2), "float64")  # rank-specific upstream weights
    want = np.concatenate([_data(r, 24, (2 * n, 2), "float64")[2 * rank:2 * rank + 2]
                           for r in range(n)])
    _check(grad_of(lambda t: tf.reduce_sum(hvd.alltoall(t) * we), xe), want,
           f"{mode} alltoall grad")
    # reducescatter: the allgather of the gradient (times size for Sum)
    xr = _data(rank, 25, (2 * n, 2), "float64")
    lo, hi = _blocks(2 * n, n)[rank]
    wr = _data(rank, 26, (hi - lo, 2), "float64")
    every_w = np.concatenate([_data(r, 26, (b - a, 2), "float64")
                              for r, (a, b) in enumerate(_blocks(2 * n, n))])
    _check(grad_of(lambda t: tf.reduce_sum(hvd.reducescatter(t, op=hvd.Sum) * wr), xr),
           n * every_w, f"{mode} reducescatter grad")


def _tapes(tf: Any, hvd: Any, rank: int, n: int) -> dict:
    import keras
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                              keras.layers.Dense(2)])
    x = _data(rank, 30, (5, 4), "float32")
    out = {}
    for label, kwargs in [("plain", {}), ("num_groups", {"num_groups": 2}),
                          ("groups", {"groups": [[model.layers[0].kernel,
                                                  model.layers[1].bias]]}),
                          ("predivide", {"gradient_predivide_factor": 2.0}),
                          ("sum", {"op": hvd.Sum})]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x) ** 2)
        grads = hvd.DistributedGradientTape(tape, **kwargs).gradient(
            loss, model.trainable_variables)
        out[label] = [g.numpy() for g in grads]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    local = [g.numpy() for g in tape.gradient(loss, model.trainable_variables)]
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(x) ** 2)
    partial = hvd.PartialDistributedGradientTape(tape, local_layers=[model.layers[1]])
    grads = partial.gradient(loss, model.trainable_variables)
    out["partial"] = [g.numpy() for g in grads]
    out["local"] = local
    # sparse gradients: IndexedSlices through the tape, both ways
    table = tf.Variable(np.arange(12, dtype=np.float32).reshape(6, 2))
    ids = tf.constant([rank, 5 - rank])
    for dense in (False, True):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.gather(table, ids) * float(rank + 1))
        grad = hvd.DistributedGradientTape(tape, sparse_as_dense=dense).gradient(loss, [table])
        assert isinstance(grad[0], tf.IndexedSlices) != dense
        out[f"sparse{dense}"] = tf.convert_to_tensor(grad[0]).numpy()
    return out


def _check_tapes(results: list[dict], n: int) -> None:
    mean = [np.mean([r["local"][i] for r in results], 0) for i in range(4)]
    for r in results:
        for label in ("plain", "num_groups", "groups", "predivide"):
            for got, want in zip(r[label], mean, strict=True):
                _check(got, want, label)
        for got, want in zip(r["sum"], mean, strict=True):
            _check(got, want * n, "sum")
        _check(r["partial"][0], mean[0], "partial shared")
        _check(r["partial"][2], r["local"][2] / n, "partial local (scaled by 1/size)")
    want = np.zeros((6, 2), np.float32)
    for r in range(n):
        want[[r, 5 - r]] += (r + 1) / n
    for r in results:
        _check(r["sparseFalse"], want, "sparse tape")
        _check(r["sparseTrue"], want, "sparse_as_dense tape")


def _process_sets_and_join(tf: Any, hvd: Any, rank: int, n: int) -> dict:
    members = [0, n - 1] if n > 2 else [1]  # a set equal to the global one is refused
    pair = hvd.add_process_set(members)
    out: dict = {}
    if rank in members:
        x = _data(rank, 40, (5,), "float32")
        every = [_data(m, 40, (5,), "float32") for m in members]
        _check(hvd.allreduce(x, op=hvd.Sum, process_set=pair), np.sum(every, 0),
               "set allreduce")
        fn = tf.function(lambda t: hvd.allgather(t, process_set=pair))
        _check(fn(x), np.concatenate(every), "set allgather")
        _check(hvd.broadcast(x, members[-1], process_set=pair), every[-1],
               "set broadcast (global root)")
        assert int(hvd.size_op(pair.process_set_id)) == len(members)
    assert int(hvd.process_set_included_op(pair.process_set_id)) == int(rank in members)
    hvd.remove_process_set(pair)
    # join: rank 0 has one batch more; the others contribute zeros to it
    if rank == 0:
        out["extra"] = hvd.allreduce(tf.ones([3]), op=hvd.Sum, name="extra").numpy()
    out["last"] = int(hvd.join())
    # a mismatch is caught on every rank and the next collective works
    try:
        hvd.allreduce(tf.ones([rank + 2]), name="mismatch")
        out["mismatch"] = None
    except tf.errors.FailedPreconditionError as exc:
        out["mismatch"] = (isinstance(exc, hvd.ShoalError if hasattr(hvd, "ShoalError")
                                      else Exception), str(exc))
    out["after"] = hvd.allreduce(tf.fill([2], float(rank)), op=hvd.Sum).numpy()
    return out


def _sync_bn(tf: Any, hvd: Any, rank: int, n: int) -> dict:
    layer = hvd.SyncBatchNormalization(momentum=0.5, epsilon=1e-3)
    xs = [_data(r, 50, (4, 3), "float32") * (r + 1) for r in range(n)]
    w = _data(rank, 51, (4, 3), "float32")
    x = tf.constant(xs[rank])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x, training=True)
        loss = tf.reduce_sum(y * w)
    gamma, beta, dx = tape.gradient(loss, [layer.gamma, layer.beta, x])
    every = np.concatenate(xs)
    mean, var = every.mean(0), every.var(0)
    xhat = (xs[rank] - mean) / np.sqrt(var + 1e-3)
    _check(y, xhat, "syncbn output", rtol=1e-4)
    _check(layer.moving_mean, 0.5 * mean, "syncbn moving mean", rtol=1e-4)
    _check(beta, w.sum(0), "syncbn beta grad", rtol=1e-4)
    _check(gamma, (w * xhat).sum(0), "syncbn gamma grad", rtol=1e-4)
    return {"dx": dx.numpy(), "w": w, "xhat": xhat, "std": np.sqrt(var + 1e-3)}


def _everything(rank: int) -> dict:
    tf = _tf()
    import shoal.tensorflow as hvd
    n = hvd.size()

    def eager(fn: Callable[..., Any], *args: Any) -> Any:
        out = fn(*[tf.constant(a) for a in args])
        return [np.asarray(o) for o in out] if isinstance(out, list | tuple) else out

    def graph(fn: Callable[..., Any], *args: Any) -> Any:
        out = tf.function(fn)(*[tf.constant(a) for a in args])
        return [np.asarray(o) for o in out] if isinstance(out, list | tuple) else out

    for mode, call in (("eager", eager), ("tf.function", graph)):
        _collectives(tf, hvd, rank, n, mode, call)
        _gradients(tf, hvd, rank, n, mode, call)
    return {"tapes": _tapes(tf, hvd, rank, n), "sets": _process_sets_and_join(tf, hvd, rank, n),
            "bn": _sync_bn(tf, hvd, rank, n)}


@pytest.mark.parametrize("n", [2, 3])
def test_horovod_tensorflow_api(n: int) -> None:
    results = run_ranks(_everything, n, timeout=300)
    _check_tapes([r["tapes"] for r in results], n)
    sets = [r["sets"] for r in results]
    np.testing.assert_array_equal(sets[0]["extra"], np.ones(3))  # only rank 0 contributed
    assert [s["last"] for s in sets] == [0] * n
    for s in sets:
        assert s["mismatch"] is not None and "mismatch" in s["mismatch"][1]
        np.testing.assert_array_equal(s["after"], np.full(2, sum(range(n)), np.float32))
    # SyncBN's input gradient is the global-batch one: dx = (w - mean(w) - xhat *
    # mean(w * xhat)) / std, the means over every rank's rows
    bn = [r["bn"] for r in results]
    w_all, xhat_all = np.concatenate([b["w"] for b in bn]), np.concatenate([b["xhat"] for b in bn])
    for b in bn:
        want = (b["w"] - w_all.mean(0) - b["xhat"] * (w_all * xhat_all).mean(0)) / b["std"]
        _check(b["dx"], want, "syncbn input grad", rtol=1e-3)
