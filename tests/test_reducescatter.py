"""Reduce-scatter against numpy: dtypes, ops, uneven and empty blocks, several pipeline steps
(a small shared-memory chunk), one host (shared memory, (n-1)/n of the data moved) and two
simulated hosts (allreduce and slice)."""

from __future__ import annotations

import numpy as np
import pytest

from harness import run_ranks
from reference import assert_matches, reference

CASES = [("float32", "SUM", (2049, 3)), ("float64", "AVERAGE", (7,)),
         ("float16", "AVERAGE", (301, 2)), ("int32", "AVERAGE", (9, 5)),
         ("int64", "MAX", (5,)), ("uint8", "MIN", (3, 4)), ("float32", "PRODUCT", (2, 2)),
         ("float32", "SUM", (0, 3)), ("float64", "SUM", (1,))]


def _data(rank: int, i: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng([rank, i])
    if dtype.startswith(("int", "uint")):
        low = 0 if dtype == "uint8" else -40
        return rng.integers(low, 40, shape).astype(dtype)
    return rng.uniform(-2, 2, shape).astype(dtype)


def _scatter(rank: int) -> str:
    import shoal
    n = shoal.size()
    for i, (dtype, op, shape) in enumerate(CASES):
        inputs = [_data(r, i, shape, dtype) for r in range(n)]
        want = reference(inputs, op, dtype)
        base, extra = divmod(shape[0], n)
        start = rank * base + min(rank, extra)
        got = shoal.reducescatter(inputs[rank], op=shoal.ReduceOp[op], name=f"rs{i}")
        mine = slice(start, start + base + (rank < extra))
        assert_matches(got, want[mine], dtype, f"{dtype} {op} {shape}",
                       [x[mine] for x in inputs])
    handle = shoal.reducescatter_async(np.ones((n, 2)), op=shoal.Sum, postscale_factor=0.5)
    assert handle.wait().tolist() == [[n / 2, n / 2]]
    return "ok"


@pytest.mark.parametrize(("n", "hosts"), [(2, None), (3, None), (4, ["a", "a", "b", "b"])])
def test_reducescatter_matches_numpy(n: int, hosts) -> None:
    assert run_ranks(_scatter, n, hosts=hosts, timeout=90, shm_chunk_bytes=4096) == ["ok"] * n
