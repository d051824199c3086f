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


@pytest.mark.parametrize(("n", "hosts"), [(3, ["a", "b", "c"]), (4, ["a", "b", "a", "b"])])
def test_reducescatter_across_hosts_matches_numpy(n: int, hosts) -> None:
    """The TCP ring (one rank a host) and the hierarchical route with hosts interleaved
    (node ranks not contiguous)."""
    assert run_ranks(_scatter, n, hosts=hosts, timeout=90, shm_chunk_bytes=4096) == ["ok"] * n


def _bytes_on_tcp(rank: int) -> tuple[int, int]:
    import shoal
    mesh = shoal.communicator().engine.transport.mesh
    sent = [0]
    exchange = mesh.exchange

    def counting(sends, recvs, **kwargs):
        sent[0] += sum(view.nbytes for _peer, view in sends)
        return exchange(sends, recvs, **kwargs)

    mesh.exchange = counting
    x = np.arange(30000, dtype=np.float32) * (rank + 1)
    shoal.reducescatter(x, op=shoal.Sum, name="warm")  # connections, negotiation
    before = sent[0]
    got = shoal.reducescatter(x, op=shoal.Sum, name="rs")
    n = shoal.size()
    block = 30000 // n
    want = np.arange(30000, dtype=np.float32)[rank * block:(rank + 1) * block] * \
        sum(range(1, n + 1))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    scattered = sent[0] - before
    shoal.allreduce(x, op=shoal.Sum, name="ar")
    return scattered, sent[0] - before - scattered


@pytest.mark.parametrize(("n", "hosts"), [(3, ["a", "b", "c"]), (4, ["a", "a", "b", "b"])])
def test_reducescatter_moves_its_share(n: int, hosts) -> None:
    """Bytes each rank sends over TCP: (n-1)/n of the input on the ring, (H-1)/H of its
    1/L shard with H hosts of L ranks; the allreduce sends twice as much."""
    nbytes = 30000 * 4
    share = nbytes * (n - 1) / n if len(set(hosts)) == n else nbytes / 2 * 1 / 2
    for scattered, reduced in run_ranks(_bytes_on_tcp, n, hosts=hosts, timeout=90):
        assert scattered <= share * 1.05 + 4096, (scattered, share)
        assert reduced >= 1.9 * scattered, (scattered, reduced)


def _half_large(rank: int) -> list:
    import shoal
    out = []
    for dtype in ("float16", "bfloat16"):
        x = np.full(13, 40000.0, np.float32)
        if dtype == "bfloat16":
            import ml_dtypes
            arr = x.astype(ml_dtypes.bfloat16)
        else:
            arr = x.astype(np.float16)
        for op in (shoal.Average, shoal.Sum):
            got = shoal.reducescatter(arr, op=op).astype(np.float32)
            full = shoal.allreduce(arr, op=op).astype(np.float32)
            out.append((dtype, shoal.ReduceOp(op).name, got.tolist(), full[:got.size].tolist(),
                        float(arr[0])))
    return out


def test_half_precision_host_sum_does_not_overflow_across_hosts() -> None:
    """The host stage sums 16-bit blocks in float32: Average 40000 at 2 hosts x 2 ranks is
    40000 (the host's 80000 would be inf in float16), as the allreduce gives."""
    pytest.importorskip("ml_dtypes")
    for rows in run_ranks(_half_large, 4, hosts=["a", "a", "b", "b"], timeout=90):
        for dtype, op, got, full, value in rows:
            assert got == full, (dtype, op, got, full)
            if op == "AVERAGE":
                assert got[0] == value, (dtype, op, got)
