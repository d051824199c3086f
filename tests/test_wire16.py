"""The 16-bit wire of half-precision sums and averages between hosts: the payload bytes each
rank sends over TCP, counted (half of float32's on every hop), the float16 sum that could
overflow taking a float32 wire on every rank (and the timeline saying so), and the results
against numpy, bitwise the same on every rank."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness import run_ranks
from reference import assert_matches, rank_input, reference

LENGTH = 3 * 4 * 5 * 7 * 64 * 16  # divides evenly at every group size used here


def _payload(rank: int) -> dict[str, int]:
    """Payload bytes this rank sent over TCP for each way of reducing LENGTH numbers."""
    import shoal
    from shoal.core.compression import Compression
    mesh = shoal.communicator().transport.mesh
    x = np.random.default_rng(rank).standard_normal(LENGTH).astype(np.float32)
    cases = {
        "float32": lambda: shoal.allreduce(x, shoal.Average, name="a32"),
        "fp16": lambda: shoal.allreduce(x, shoal.Average, name="a16",
                                        compression=Compression.fp16),
        "bf16": lambda: shoal.allreduce(x, shoal.Sum, name="s16",
                                        compression=Compression.bf16),
        "fp16-sum": lambda: shoal.allreduce(x, shoal.Sum, name="f16s",
                                            compression=Compression.fp16),
        "fp16-big-sum": lambda: shoal.allreduce(x * 10000, shoal.Sum, name="f16b",
                                                compression=Compression.fp16),
        "rs-float32": lambda: shoal.reducescatter(x, shoal.Sum, name="r32"),
        "rs-float16": lambda: shoal.reducescatter(x.astype(np.float16), shoal.Average,
                                                  name="r16"),
    }
    out = {}
    for name, run in cases.items():
        run()  # negotiation and name caches settle first
        before = sum(mesh.sent)
        run()
        out[name] = sum(mesh.sent) - before
    return out


@pytest.mark.parametrize(("algorithm", "hosts"), [
    ("hierarchical", ["a", "a", "b", "b"]), ("hierarchical", ["a", "b", "c"]),
    ("ring", ["a", "a", "b", "b"])])
def test_the_16_bit_wire_halves_every_hop(algorithm: str, hosts: list[str]) -> None:
    results = run_ranks(_payload, len(hosts), hosts=hosts, timeout=180,
                        allreduce_algorithm=algorithm, fusion_threshold=1 << 20)
    for rank, sent in enumerate(results):
        assert sent["float32"] > 0, sent
        assert sent["fp16"] * 2 == sent["float32"], (rank, sent)
        assert sent["bf16"] * 2 == sent["float32"], (rank, sent)
        assert sent["fp16-sum"] * 2 == sent["float32"], (rank, sent)  # |x| small: 16 bits
        # 10000 x a normal sample fits float16, its sum over the ranks could pass 65504:
        # float32 on the wire
        assert sent["fp16-big-sum"] == sent["float32"], (rank, sent)
        assert sent["rs-float16"] * 2 == sent["rs-float32"] > 0, (rank, sent)


CASES = [("float16", "SUM", 70_001), ("float16", "AVERAGE", 3_001), ("bfloat16", "SUM", 99_999),
         ("bfloat16", "AVERAGE", 17), ("float16", "SUM", 0)]


def _results(rank: int) -> dict[str, list[int]]:
    import shoal
    from shoal.core.compression import Compression
    n = shoal.size()
    digests = {}
    for dtype, op, length in CASES:
        case = f"w16/{dtype}/{op}/{length}"
        inputs = [rank_input(case, r, (length,), dtype) for r in range(n)]
        got = shoal.allreduce(inputs[rank], op=shoal.ReduceOp[op], name=case)
        assert_matches(got, reference(inputs, op, dtype), dtype, case, inputs)
        digests[case] = got.view(np.uint16).tolist()
    x = [np.random.default_rng(r).standard_normal(40_003).astype(np.float32) for r in range(n)]
    got = shoal.allreduce(x[rank], shoal.Average, name="w16/fp16", compression=Compression.fp16)
    want = sum(v.astype(np.float16).astype(np.float64) for v in x) / n
    np.testing.assert_allclose(got, want, atol=2e-3 * n)
    digests["fp16"] = got.view(np.uint32).tolist()
    rows = [np.random.default_rng(r).standard_normal(6 * n).astype(np.float16) for r in range(n)]
    block = shoal.reducescatter(rows[rank], shoal.Sum, name="w16/rs")
    want = sum(r.astype(np.float64) for r in rows)[rank * 6:(rank + 1) * 6]
    np.testing.assert_allclose(block.astype(np.float64), want, atol=2e-2)
    return digests


@pytest.mark.parametrize(("algorithm", "hosts", "small"), [
    ("hierarchical", ["a", "a", "b", "b"], 64 << 10), ("hierarchical", ["a", "b", "c"], 0),
    ("hierarchical", ["a", "b", "c"], 1 << 20), ("ring", ["a", "a", "b"], 64 << 10)])
def test_16_bit_results_match_numpy_and_agree_bitwise(algorithm: str, hosts: list[str],
                                                       small: int) -> None:
    pytest.importorskip("ml_dtypes")
    results = run_ranks(_results, len(hosts), hosts=hosts, timeout=180,
                        allreduce_algorithm=algorithm, small_message_bytes=small,
                        shm_chunk_bytes=64 << 10)
    for rank in range(1, len(hosts)):
        assert results[rank] == results[0], f"rank {rank} differs from rank 0"


def _traced_wires(rank: int) -> None:
    import shoal
    from shoal.core.compression import Compression
    x = np.full(1000, 20000.0 if rank == 0 else 1.0, np.float32)
    shoal.allreduce(x, shoal.Sum, name="safe", compression=Compression.fp16)
    x = np.full(1000, 40000.0, np.float32)  # 80000 does not fit float16
    got = shoal.allreduce(x, shoal.Sum, name="overflow", compression=Compression.fp16)
    assert np.isinf(got).all()  # the sum itself is past float16: inf, on either wire
    y = np.full(1000, 40000.0 if rank == 0 else -30000.0, np.float16)  # partials to 70000
    got = shoal.allreduce(y, shoal.Sum, name="partial")
    assert (got == np.float16(10000.0)).all()


def test_the_timeline_names_the_wire_each_rank_picked(tmp_path) -> None:
    path = str(tmp_path / "trace-{rank}.json")
    run_ranks(_traced_wires, 2, hosts=["a", "b"], timeout=90, timeline=path)
    for rank in (0, 1):
        events = json.loads((tmp_path / f"trace-{rank}.json").read_text())
        tracks = {e["args"]["name"]: e["tid"] for e in events if e.get("name") == "thread_name"}
        wires = {}
        for name in ("safe", "overflow", "partial"):
            spans = [e for e in events if e.get("name") == "ALLREDUCE" and
                     e.get("tid") == tracks[f"allreduce.{name}"]]
            wires[name] = spans[0]["args"]["wire"]
        assert wires == {"safe": "float16", "overflow": "float32", "partial": "float32"}, \
            (rank, wires)
