"""Every collective against a numpy reference, on several world sizes and layouts.

Each layout is one job that runs the whole matrix (dtypes x ops x lengths, plus the other
collectives), because starting processes is the expensive part on a 2-core machine. Each rank
regenerates every rank's input from a seed, so it checks its own result against the reference.
"""

from __future__ import annotations

import numpy as np
import pytest

from harness import run_ranks
from reference import ALL_DTYPES, FLOATS, assert_matches, dtype_of, rank_input, reference

LENGTHS = [0, 1, 7, 1001, 40_003]  # 40_003 x 8 bytes streams through several 64 KiB chunks
OPS = ["AVERAGE", "SUM", "MIN", "MAX", "PRODUCT"]

LAYOUTS = {
    "1host-2": dict(n=2),
    "1host-3": dict(n=3),
    "1host-4": dict(n=4),
    "2x2-hierarchical": dict(n=4, hosts=["a", "a", "b", "b"]),
    "2x2-interleaved": dict(n=4, hosts=["a", "b", "a", "b"]),
    "3-ring": dict(n=3, allreduce_algorithm="ring"),
    "2x2-ring": dict(n=4, hosts=["a", "a", "b", "b"], allreduce_algorithm="ring"),
}


def allreduce_matrix(rank: int) -> list[str]:
    import shoal
    n = shoal.size()
    checked = 0
    for dtype in ALL_DTYPES:
        for op in OPS:
            if dtype == "bool" and op in ("SUM", "AVERAGE"):
                continue
            for length in LENGTHS:
                if op == "PRODUCT" and length > 1001:
                    continue
                case = f"ar/{dtype}/{op}/{length}"
                inputs = [rank_input(case, r, (length,), dtype, special=op != "PRODUCT")
                          for r in range(n)]
                got = shoal.allreduce(inputs[rank], op=shoal.ReduceOp[op], name=case)
                assert_matches(got, reference(inputs, op, dtype), dtype, f"rank {rank} {case}",
                               inputs if op in ("SUM", "AVERAGE") else None)
                checked += 1
    # multi-dimensional, in place
    x = rank_input("nd", rank, (3, 5, 7), "float32")
    want = reference([rank_input("nd", r, (3, 5, 7), "float32") for r in range(n)], "SUM",
                     "float32")
    same = shoal.allreduce(x, op=shoal.Sum, name="nd", out=x)
    assert same is x
    assert_matches(x, want, "float32", "in-place 3-d")
    return [f"{checked} allreduces"]


def other_collectives(rank: int) -> None:
    import shoal
    n = shoal.size()
    for dtype in ["float32", "int64", "bool", "float16"] + (["bfloat16"] if
                                                            "bfloat16" in FLOATS else []):
        # allgather: rank r contributes r+1 rows, except the last rank, which has none
        rows = [0 if r == n - 1 else r + 1 for r in range(n)]
        parts = [rank_input(f"ag/{dtype}", r, (rows[r], 3), dtype) for r in range(n)]
        got = shoal.allgather(parts[rank], name=f"ag/{dtype}")
        assert_matches(got, np.concatenate(parts), dtype, f"allgather {dtype}")
        # broadcast from every root
        for root in range(n):
            mine = rank_input(f"bc/{dtype}/{root}", rank, (11,), dtype)
            want = rank_input(f"bc/{dtype}/{root}", root, (11,), dtype)
            out = shoal.broadcast(mine, root, name=f"bc/{dtype}/{root}")
            assert out is mine
            assert_matches(mine, want, dtype, f"broadcast {dtype} root {root}")
        # alltoall with uneven splits, some empty
        splits = [(rank + dst) % 3 for dst in range(n)]
        data = rank_input(f"a2a/{dtype}", rank, (sum(splits), 2), dtype)
        got, got_splits = shoal.alltoall(data, splits, name=f"a2a/{dtype}")
        want_parts = []
        for src in range(n):
            src_splits = [(src + d) % 3 for d in range(n)]
            src_data = rank_input(f"a2a/{dtype}", src, (sum(src_splits), 2), dtype)
            off = sum(src_splits[:rank])
            want_parts.append(src_data[off:off + src_splits[rank]])
        assert got_splits.tolist() == [(src + rank) % 3 for src in range(n)]
        assert_matches(got, np.concatenate(want_parts), dtype, f"alltoall {dtype}")
    # reducescatter: 2n+1 rows, earlier ranks get the extra one
    inputs = [rank_input("rs", r, (2 * n + 1, 4), "float64") for r in range(n)]
    got = shoal.reducescatter(inputs[rank], op=shoal.Sum, name="rs")
    full = reference(inputs, "SUM", "float64")
    start = rank * 2 + min(rank, 1)
    assert_matches(got, full[start:start + 2 + (rank < 1)], "float64", "reducescatter")
    # objects and barrier
    assert shoal.broadcast_object({"from": rank, "list": [1, 2]}, root_rank=n - 1) == \
        {"from": n - 1, "list": [1, 2]}
    assert shoal.allgather_object(("r", rank)) == [("r", r) for r in range(n)]
    shoal.barrier()
    # async handles complete in order and match the synchronous result
    xs = [rank_input(f"async/{i}", rank, (1000 + i,), "float32") for i in range(5)]
    handles = [shoal.allreduce_async(x, name=f"async/{i}") for i, x in enumerate(xs)]
    for i, h in enumerate(handles):
        want = reference([rank_input(f"async/{i}", r, (1000 + i,), "float32")
                          for r in range(n)], "AVERAGE", "float32")
        assert_matches(h.wait(timeout=30), want, "float32", f"async {i}")
        assert h.done()


def whole_matrix(rank: int) -> list[str]:
    out = allreduce_matrix(rank)
    other_collectives(rank)
    import shoal
    return [*out, shoal.communicator().algorithm] if hasattr(shoal, "communicator") else out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_collectives_match_numpy(layout: str) -> None:
    spec = dict(LAYOUTS[layout])
    n = spec.pop("n")
    results = run_ranks(whole_matrix, n, timeout=150, shm_chunk_bytes=64 << 10, **spec)
    assert all(r[0] == results[0][0] for r in results)


def _single(rank: int) -> None:
    import shoal
    x = rank_input("single", 0, (9,), "float32")
    assert_matches(shoal.allreduce(x), x, "float32", "size-1 allreduce")
    assert shoal.allgather(x).shape == (9,)
    assert shoal.broadcast_object("hi") == "hi"
    assert (shoal.size(), shoal.rank(), shoal.local_size(), shoal.cross_size()) == \
        (1, 0, 1, 1)
    # alone, an allreduce is its input: done when submitted, for every op, in place or not
    import numpy as np
    for op in (shoal.Average, shoal.Sum, shoal.Min, shoal.Max, shoal.Product):
        out = np.empty_like(x)
        handle = shoal.allreduce_async(x, op, name=f"alone.{op}", out=out)
        assert handle.done() and handle.wait() is out
        np.testing.assert_array_equal(out, x)
    b = x.copy()
    handle = shoal.broadcast_async(b, 0, name="alone.broadcast")
    assert handle.done() and handle.wait() is b
    np.testing.assert_array_equal(b, x)
    y = x.copy()
    seen = []
    handle = shoal.allreduce_async(y, name="alone.inplace", out=y)
    handle.add_done_callback(lambda h: seen.append(h.wait()))
    assert seen and seen[0] is y
    np.testing.assert_array_equal(y, x)


def test_single_process_world() -> None:
    run_ranks(_single, 1)


def test_bfloat16_rounds_like_ml_dtypes() -> None:
    pytest.importorskip("ml_dtypes")
    from shoal.core.reduction import bf16_to_f32, f32_to_bf16
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(10_000) * 1e3).astype(np.float32)
    x[:4] = [np.nan, np.inf, -np.inf, 0.0]
    out = np.empty(x.size, np.uint16)
    f32_to_bf16(x, out)
    want = x.astype(dtype_of("bfloat16"))
    np.testing.assert_array_equal(bf16_to_f32(out), want.astype(np.float32))
