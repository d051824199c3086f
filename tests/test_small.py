"""The one-round path for small allreduces (:mod:`shoal.core.engine.small`): against numpy at 2, 3
and 4 ranks for every dtype and op, odd and empty lengths, up to and past the size limit,
results bitwise identical on every rank; and each way a round can fail to agree (another
request pending, a rank late, a changed shape, different names, a joined rank), after
which the request completes the general way and shoal stays usable."""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pytest

from harness import run_ranks
from reference import ALL_DTYPES, FLOATS, assert_matches, dtype_of, rank_input, reference

SHAPES = [(1,), (7,), (33, 3), (0,), (4096,)]


def _ops(dtype: str) -> list[str]:
    if dtype == "bool":
        return ["MIN", "MAX"]
    return ["SUM", "AVERAGE", "MIN", "MAX"] + (["PRODUCT"] if dtype in FLOATS else [])


def _against_numpy(rank: int) -> tuple[str, int]:
    import shoal
    n = shoal.size()
    engine = shoal.communicator().engine
    digest = hashlib.sha256()
    calls = 0
    for dtype in ALL_DTYPES:
        for op in _ops(dtype):
            for shape in SHAPES:
                name = f"{dtype}.{op}.{shape}"
                for step in range(3):  # the first negotiates; the next ones take one round
                    case = f"{name}/{step}"
                    inputs = [rank_input(case, r, shape, dtype, special=op != "PRODUCT")
                              for r in range(n)]
                    got = shoal.allreduce(inputs[rank], op=shoal.ReduceOp[op], name=name,
                                          bf16=dtype == "bfloat16" and
                                          inputs[rank].dtype != dtype_of(dtype))
                    assert_matches(got, reference(inputs, op, dtype), dtype, case, inputs)
                    digest.update(np.ascontiguousarray(got).tobytes())
                    calls += 1
    # in place, and into out=
    x = rank_input("inplace", rank, (5,), "float32")
    want = reference([rank_input("inplace", r, (5,), "float32") for r in range(n)], "SUM",
                     "float32")
    for _ in range(3):
        y = x.copy()
        shoal.allreduce(y, op=shoal.Sum, name="inplace", out=y)
        assert_matches(y, want, "float32", "in place")
    assert calls > 0
    return digest.hexdigest(), engine.small_rounds


@pytest.mark.parametrize("n", [2, 3, 4])
def test_small_allreduce_matches_numpy(n: int) -> None:
    results = run_ranks(_against_numpy, n, timeout=240)
    assert len({digest for digest, _ in results}) == 1  # the same bits on every rank
    rounds = [r for _, r in results]
    assert len(set(rounds)) == 1 and rounds[0] > 100, rounds  # the path was taken


def _limit(rank: int) -> list[int]:
    import shoal
    engine = shoal.communicator().engine
    limit = engine.small_bytes
    assert limit == (shoal.communicator().cfg.one_round_bytes or 1 << 20) or \
        engine.small.limit == 0, limit
    counts = []
    for nbytes in (limit, limit + 8):
        before = engine.small_rounds
        x = np.full(nbytes // 8, rank + 1.0)
        for _ in range(3):
            got = shoal.allreduce(x, op=shoal.Sum, name=f"limit{nbytes}")
            assert np.all(got == sum(range(1, shoal.size() + 1)))
        counts.append(engine.small_rounds - before)
    return counts


def test_size_limit_and_knob() -> None:
    assert run_ranks(_limit, 2, timeout=60) == [[2, 0]] * 2  # at the limit: yes; past: no
    assert run_ranks(_limit, 2, timeout=60, one_round_bytes=1024) == [[2, 0]] * 2
    assert run_ranks(_limit, 2, timeout=60, allreduce_algorithm="ring") == [[0, 0]] * 2


def _disagreements(rank: int) -> str:
    import shoal
    n = shoal.size()
    engine = shoal.communicator().engine
    total = float(sum(range(n)))
    mine = np.array([float(rank)])

    def check(name: str) -> None:
        assert shoal.allreduce(mine, op=shoal.Sum, name=name).tolist() == [total], name

    for _ in range(2):
        check("a")
        check("b")
    # another request pending on rank 0 only: its round is a general one, and the small
    # proposals of the others are settled with it
    if rank == 0:
        handle = shoal.allreduce_async(mine, op=shoal.Sum, name="c")
        check("a")
        assert handle.wait().tolist() == [total]
    else:
        check("a")
        check("c")
    # a late rank: the others wait in the round
    if rank == n - 1:
        time.sleep(0.3)
    check("b")
    # a changed shape on one rank: refused on every rank, nothing moved, shoal goes on
    bad = np.zeros(2 if rank == 0 else 1)
    with pytest.raises(shoal.CollectiveMismatchError, match="'a'"):
        shoal.allreduce(bad, op=shoal.Sum, name="a")
    check("a")
    # different cached names on different ranks: every rank learns they cannot match
    with pytest.raises(shoal.CollectiveMismatchError, match="cannot match"):
        shoal.allreduce(mine, op=shoal.Sum, name="a" if rank == 0 else "b")
    check("a")
    check("b")
    # a rank that joined contributes zeros to the others' small allreduces
    if rank == 0:
        assert shoal.join() in range(1, n)
    else:
        got = shoal.allreduce(mine, op=shoal.Sum, name="a")
        assert got.tolist() == [total], got
        shoal.join()
    check("a")
    assert engine.small_rounds > 0
    return "ok"


@pytest.mark.parametrize("n", [2, 3])
def test_disagreeing_rounds_fall_back(n: int) -> None:
    assert run_ranks(_disagreements, n, timeout=90, stall_warning_s=1.0) == ["ok"] * n


def _async_mix(rank: int) -> bool:
    """Small synchronous calls from the main thread while the engine's thread runs
    asynchronous ones: the two paths take turns without mixing up rounds."""
    import shoal
    n = shoal.size()
    ok = True
    for step in range(40):
        handles = [shoal.allreduce_async(np.full(3, float(rank + i)), op=shoal.Sum,
                                         name=f"async{i}") for i in range(3)]
        got = shoal.allreduce(np.array([rank + step], np.int64), op=shoal.Sum, name="sync")
        ok &= got.tolist() == [sum(range(n)) + n * step]
        for i, h in enumerate(handles):
            ok &= h.wait().tolist() == [float(sum(range(n)) + n * i)] * 3
    return ok


def test_small_path_with_async_requests() -> None:
    assert run_ranks(_async_mix, 3, timeout=90) == [True] * 3


def _torch_sync(rank: int) -> tuple[int, int]:
    import torch

    import shoal
    import shoal.torch as st
    n = shoal.size()
    engine = shoal.communicator().engine
    before = engine.small_rounds
    for dtype in (torch.float32, torch.float64, torch.int32, torch.bfloat16):
        for length in (7, 1024):
            inputs = [torch.arange(length, dtype=torch.float64).mul(r + 1).to(dtype)
                      for r in range(n)]
            want = sum(t.double() for t in inputs)
            for _ in range(3):  # the first negotiates, the next ones take one round
                t = inputs[rank].clone()
                assert st.allreduce_(t, op=st.Sum, name=f"t.{dtype}.{length}") is t
                torch.testing.assert_close(t.double(), want, rtol=1e-2, atol=0)
                copy = st.allreduce(inputs[rank], op=st.Sum, name=f"c.{dtype}.{length}")
                assert copy.dtype == dtype and copy.data_ptr() != inputs[rank].data_ptr()
                torch.testing.assert_close(copy.double(), want, rtol=1e-2, atol=0)
    one_round = engine.small_rounds - before
    # scaled, or averaged with a prescale: the general way, still right
    x = torch.full((5,), float(rank + 1))
    for _ in range(3):
        got = st.allreduce(x, op=st.Sum, name="scaled", prescale_factor=0.5,
                           postscale_factor=4.0)
        torch.testing.assert_close(got, torch.full((5,), 2.0 * sum(range(1, n + 1))))
    return one_round, engine.small_rounds - before - one_round


@pytest.mark.parametrize("n", [2, 3])
def test_torch_synchronous_allreduce_takes_the_one_round_path(n: int) -> None:
    results = run_ranks(_torch_sync, n, timeout=180)
    # 4 dtypes x 2 lengths x 2 calls (in place and a copy), each once negotiated, twice in
    # one round; the scaled calls never take it
    assert results == [(4 * 2 * 2 * 2, 0)] * n, results


def _whole_chunk(rank: int) -> tuple[int, str]:
    import shoal
    n = shoal.size()
    engine = shoal.communicator().engine
    before = engine.small_rounds
    digest = hashlib.sha256()
    for dtype in ("float32", "float64", "int32"):
        # odd lengths up to the one-round limit (one chunk): 1 MiB of float32 at the top
        most = engine.small_bytes // np.dtype(dtype).itemsize
        for length in (most // 3 | 1, most - 1, most):
            inputs = [rank_input(f"{dtype}.{length}", r, (length,), dtype) for r in range(n)]
            want = reference(inputs, "SUM", dtype)
            for step in range(3):
                x = inputs[rank].copy()
                if step == 2:  # in place
                    shoal.allreduce(x, op=shoal.Sum, name=f"w.{dtype}.{length}", out=x)
                    got = x
                else:
                    got = shoal.allreduce(x, op=shoal.Sum, name=f"w.{dtype}.{length}")
                    assert x.tobytes() == inputs[rank].tobytes()  # the input is left alone
                assert_matches(got, want, dtype, f"{dtype}.{length}/{step}", inputs)
                digest.update(got.tobytes())
    return engine.small_rounds - before, digest.hexdigest()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_one_round_path_up_to_a_whole_chunk_matches_numpy(n: int) -> None:
    results = run_ranks(_whole_chunk, n, timeout=240)
    assert len({d for _, d in results}) == 1  # the same bits on every rank
    # 3 dtypes x 3 lengths, each negotiated once, then twice in one round
    assert [r for r, _ in results] == [3 * 3 * 2] * n, results


def _across_hosts(rank: int) -> tuple[int, str]:
    import shoal
    n = shoal.size()
    engine = shoal.communicator().engine
    digest = hashlib.sha256()
    for dtype in ("float32", "float64", "int32", "float16", "bfloat16"):
        ops = ["SUM", "AVERAGE", "MIN", "MAX"] if dtype != "int32" else ["SUM", "MAX"]
        for op in ops:
            for shape in ((1,), (7,), (0,), (1001,)):
                name = f"x.{dtype}.{op}.{shape}"
                for step in range(3):
                    case = f"{name}/{step}"
                    inputs = [rank_input(case, r, shape, dtype) for r in range(n)]
                    got = shoal.allreduce(inputs[rank], op=shoal.ReduceOp[op], name=name,
                                          bf16=dtype == "bfloat16" and
                                          inputs[rank].dtype != dtype_of(dtype))
                    assert_matches(got, reference(inputs, op, dtype), dtype, case, inputs)
                    digest.update(np.ascontiguousarray(got).tobytes())
    # a disagreeing round (one rank late, another name pending) still completes everywhere
    x = np.full(3, float(rank + 1))
    for i in range(3):
        if rank == 0:
            time.sleep(0.05)
        assert shoal.allreduce(x, op=shoal.Sum, name="late").tolist() == \
            [float(sum(range(1, n + 1)))] * 3, i
    return engine.small_rounds, digest.hexdigest()


@pytest.mark.parametrize("hosts", [["a", "b"], ["a", "a", "b", "b"], ["a", "b", "c"],
                                   ["a", "a", "b", "b", "c", "c"]])
def test_one_round_path_across_hosts_matches_numpy(hosts: list[str]) -> None:
    results = run_ranks(_across_hosts, len(hosts), hosts=hosts, timeout=240)
    assert len({d for _, d in results}) == 1  # the same bits on every rank
    rounds = [r for r, _ in results]
    assert len(set(rounds)) == 1 and rounds[0] > 50, rounds  # the path was taken


def _broadcast_and_reducescatter(rank: int) -> tuple[int, str]:
    import shoal
    n = shoal.size()
    engine = shoal.communicator().engine
    before = engine.small_rounds
    digest = hashlib.sha256()
    for dtype in ("float32", "float64", "int32", "float16", "bfloat16", "bool"):
        for shape in ((1,), (7, 3), (0,), (1001,)):
            for root in range(n):
                name = f"b.{dtype}.{shape}.{root}"
                for step in range(3):
                    inputs = [rank_input(f"{name}/{step}", r, shape, dtype) for r in range(n)]
                    x = inputs[rank].copy()
                    got = shoal.broadcast(x, root, name=name)
                    assert got is x and x.tobytes() == inputs[root].tobytes(), (name, step)
            if dtype == "bool":
                continue
            for op in ("SUM", "AVERAGE", "MAX"):
                name = f"rs.{dtype}.{op}.{shape}"
                for step in range(3):
                    inputs = [rank_input(f"{name}/{step}", r, shape, dtype) for r in range(n)]
                    got = shoal.reducescatter(inputs[rank], op=shoal.ReduceOp[op], name=name,
                                              bf16=dtype == "bfloat16" and
                                              inputs[rank].dtype != dtype_of(dtype))
                    want = reference(inputs, op, dtype)
                    rows = shape[0]
                    base, extra = divmod(rows, n)
                    lo = rank * base + min(rank, extra)
                    hi = lo + base + (rank < extra)
                    assert_matches(got, want[lo:hi], dtype, f"{name}/{step}",
                                   [i[lo:hi] for i in inputs])
                    digest.update(np.ascontiguousarray(got).tobytes())
    # a late rank: the round does not agree and completes the general way
    x = np.full(4, float(rank))
    for _ in range(3):
        if rank == 0:
            time.sleep(0.05)
        assert shoal.broadcast(x.copy(), n - 1, name="late.b").tolist() == [n - 1.0] * 4
    return engine.small_rounds - before, digest.hexdigest()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_one_round_broadcast_and_reducescatter_match_numpy(n: int) -> None:
    results = run_ranks(_broadcast_and_reducescatter, n, timeout=240)
    rounds = [r for r, _ in results]
    # 6 dtypes x 4 shapes x n roots broadcast, 5 dtypes x 4 shapes x 3 ops reduce-scattered,
    # each negotiated once, then in one round twice
    want = 2 * (6 * 4 * n + 5 * 4 * 3)
    assert all(want <= r <= want + 3 for r in rounds), (rounds, want)


def _prescaled(rank: int) -> int:
    import shoal
    engine = shoal.communicator().engine
    for _ in range(3):
        got = shoal.reducescatter(np.ones(4), op=shoal.Sum, name="pre", prescale_factor=2.0)
        assert got.tolist() == [4.0, 4.0], got
        x = np.full(3, float(rank))
        assert shoal.broadcast(x, 1, name="b").tolist() == [1.0] * 3
    return engine.small_rounds


def test_prescaled_reducescatter_takes_one_round_and_across_hosts_the_general_way() -> None:
    assert run_ranks(_prescaled, 2, timeout=60) == [4, 4]  # each twice after the first
    assert run_ranks(_prescaled, 2, hosts=["a", "b"], timeout=60) == [0, 0]


def _allgathers(rank: int) -> tuple[int, str]:
    import shoal
    n = shoal.size()
    engine = shoal.communicator().engine
    before = engine.small_rounds
    digest = hashlib.sha256()
    for dtype in ("float32", "int32", "float16", "bfloat16", "bool"):
        for trailing in ((), (3,), (2, 0)):
            for rows in (1, 5, 0):
                name = f"g.{dtype}.{trailing}.{rows}"
                for step in range(3):
                    inputs = [rank_input(f"{name}/{step}", r, (rows, *trailing), dtype)
                              for r in range(n)]
                    got = shoal.allgather(inputs[rank], name=name)
                    want = np.concatenate(inputs)
                    assert got.shape == want.shape and got.tobytes() == want.tobytes(), name
                    digest.update(got.tobytes())
    # rows that differ by rank: the round does not agree, the general way gathers them
    for step in range(3):
        mine = np.full((rank + 1, 2), rank, np.int64)
        got = shoal.allgather(mine, name="uneven")
        assert got.tolist() == [[r, r] for r in range(n) for _ in range(r + 1)], step
    return engine.small_rounds - before, digest.hexdigest()


@pytest.mark.parametrize("n", [2, 3])
def test_one_round_allgather_of_equal_rows_and_uneven_rows_the_general_way(n: int) -> None:
    results = run_ranks(_allgathers, n, timeout=240)
    assert len({d for _, d in results}) == 1
    # 5 dtypes x 3 trailing shapes x 3 row counts, twice each in one round; uneven never
    assert [r for r, _ in results] == [5 * 3 * 3 * 2] * n, results
