"""Property: any sequence of collectives, with or without an injected mismatch, either
matches the numpy reference on every rank or fails cleanly on every rank; never hangs."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from harness import run_ranks
from reference import assert_matches, rank_input, reference

KINDS = ["allreduce", "broadcast", "allgather"]
DTYPES = ["float32", "float64", "int32", "float16"]
OPS = ["SUM", "AVERAGE", "MIN", "MAX"]

step = st.tuples(st.sampled_from(KINDS), st.integers(0, 300), st.sampled_from(DTYPES),
                 st.sampled_from(OPS))
plans = st.tuples(st.lists(step, min_size=1, max_size=8),
                  st.none() | st.tuples(st.integers(0, 7), st.integers(0, 2),
                                        st.sampled_from(["shape", "dtype", "op"])),
                  st.integers(2, 3))


def _run(rank: int, steps: list, fault: tuple | None) -> str:
    import shoal
    n = shoal.size()
    for i, (kind, length, dtype, op) in enumerate(steps):
        name = f"s{i}"
        shape, my_dtype, my_op = (length,), dtype, op
        if fault is not None and fault[0] == i and fault[1] % n == rank:
            what = fault[2]
            if what == "shape":
                shape = (length + 1,)
            elif what == "dtype":
                my_dtype = "float64" if dtype != "float64" else "float32"
            else:
                my_op = "PRODUCT" if op != "PRODUCT" else "SUM"
                if kind != "allreduce":  # an op means nothing to other kinds
                    shape = (length + 1,)
        x = rank_input(name, rank, shape, my_dtype)
        if kind == "allreduce":
            got = shoal.allreduce(x, op=shoal.ReduceOp[my_op], name=name)
            inputs = [rank_input(name, r, (length,), dtype) for r in range(n)]
            assert_matches(got, reference(inputs, op, dtype), dtype, name,
                           inputs if op in ("SUM", "AVERAGE") else None)
        elif kind == "broadcast":
            shoal.broadcast(x, 0, name=name)
            assert_matches(x, rank_input(name, 0, (length,), dtype), dtype, name)
        else:
            rows = x.reshape(-1, 1) if x.size else x.reshape(0, 1)
            got = shoal.allgather(rows, name=name)
            want = np.concatenate([rank_input(name, r, (length,), dtype).reshape(-1, 1)
                                   for r in range(n)])
            if fault is None or fault[0] != i:
                assert_matches(got, want, dtype, name)
    return "ok"


@settings(max_examples=10, deadline=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.too_slow])
@given(plans)
def test_random_collectives_match_or_fail_cleanly(plan) -> None:
    steps, fault, n = plan
    if fault is not None and fault[0] >= len(steps):
        fault = None
    if fault is not None and steps[fault[0]][0] == "allgather" and fault[2] != "dtype":
        fault = None  # allgather rows may differ per rank by design, and it has no op
    outcomes = run_ranks(_run, n, steps, fault, expect_errors=True, timeout=60, timeout_s=15)
    assert all(o is not None for o in outcomes), f"a rank hung: {outcomes}"
    if fault is None:
        assert all(o == ("ok", "ok") for o in outcomes), outcomes
    else:
        for o in outcomes:
            assert o[0] == "err" and o[1][0] == "CollectiveMismatchError", (plan, o)
