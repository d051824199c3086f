"""The pipelined hierarchical allreduce (host phases overlapping the cross-host ring) against
numpy on simulated hosts: many chunks, several dtypes and ops, hosts of 2 ranks, and the
pipelined path demonstrably taken."""

from __future__ import annotations

import numpy as np
import pytest

from harness import run_ranks
from reference import assert_matches, rank_input, reference

CASES = [("float32", "SUM", 50_001), ("float64", "AVERAGE", 9_999), ("int32", "AVERAGE", 7_001),
         ("int64", "MAX", 3_001), ("float32", "MIN", 2_049), ("float16", "SUM", 4_099)]


def _hierarchical(rank: int) -> int:
    import shoal
    from shoal.core.transport.shm import ShmGroup
    n = shoal.size()
    calls = [0]
    original = ShmGroup._allreduce_pipelined

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    ShmGroup._allreduce_pipelined = counting
    assert shoal.communicator().algorithm == "hierarchical"
    for step in range(2):
        for dtype, op, length in CASES:
            case = f"h/{dtype}/{op}/{length}/{step}"
            inputs = [rank_input(case, r, (length,), dtype) for r in range(n)]
            got = shoal.allreduce(inputs[rank], op=shoal.ReduceOp[op], name=case[:-2])
            assert_matches(got, reference(inputs, op, dtype), dtype, case,
                           inputs if op in ("SUM", "AVERAGE") else None)
    # fused requests of mixed lengths, asynchronously
    xs = [np.full(3000 + i, float(rank + i), np.float32) for i in range(4)]
    handles = [shoal.allreduce_async(x, op=shoal.Sum, name=f"f{i}") for i, x in enumerate(xs)]
    for i, h in enumerate(handles):
        assert np.all(h.wait() == sum(r + i for r in range(n)))
    return calls[0]


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b", "c", "c"], ["a", "b", "a", "b"]])
def test_pipelined_hierarchical_matches_numpy(hosts) -> None:
    calls = run_ranks(_hierarchical, len(hosts), hosts=hosts, timeout=180,
                      shm_chunk_bytes=4096)
    assert min(calls) > 0 and len(set(calls)) == 1, calls
