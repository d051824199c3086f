"""The engine: fusion, per-rank submission order, compression, timeline, negotiation size."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from harness import run_ranks
from reference import BF16, assert_matches, rank_input, reference

LAYOUTS = {
    "1host-2": dict(n=2),
    "1host-3": dict(n=3),
    "1host-4": dict(n=4),
    "2x2-hierarchical": dict(n=4, hosts=["a", "a", "b", "b"]),
    "3-ring": dict(n=3, allreduce_algorithm="ring"),
}
DTYPES = ["float32", "float64", "float16", "int32", "int64", "uint8"] + (
    ["bfloat16"] if BF16 is not None else [])


def _plan(seed: int) -> list[tuple[str, tuple[int, ...], str, str]]:
    """The same random set of requests on every rank: name, shape, dtype, op."""
    rng = np.random.default_rng(seed)
    plan = []
    for i in range(int(rng.integers(20, 60))):
        shape = tuple(int(d) for d in rng.integers(0, 40, size=int(rng.integers(1, 3))))
        if rng.random() < 0.1:
            shape = (int(rng.integers(20_000, 70_000)),)  # several shm chunks
        dtype = str(rng.choice(DTYPES))
        op = str(rng.choice(["AVERAGE", "SUM", "MAX"]))
        plan.append((f"t{i}", shape, dtype, op))
    return plan


def _shuffled(rank: int, seeds: list[int]) -> int:
    import shoal
    n = shoal.size()
    checked = 0
    for seed in seeds:
        plan = _plan(seed)
        order = np.random.default_rng(zlib.crc32(f"{seed}/{rank}".encode())).permutation(
            len(plan))
        handles = {}
        for i in order:  # every rank submits in its own order
            name, shape, dtype, op = plan[i]
            x = rank_input(f"{seed}/{name}", rank, shape, dtype)
            handles[name] = shoal.allreduce_async(x, op=shoal.ReduceOp[op],
                                                  name=f"{seed}/{name}")
        for name, shape, dtype, op in plan:
            inputs = [rank_input(f"{seed}/{name}", r, shape, dtype) for r in range(n)]
            got = handles[name].wait(timeout=60)
            assert_matches(got, reference(inputs, op, dtype), dtype, f"{seed}/{name}",
                           inputs if op != "MAX" else None)
            checked += 1
    return checked


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_shuffled_submission_orders_match_reference(layout: str) -> None:
    spec = dict(LAYOUTS[layout])
    n = spec.pop("n")
    counts = run_ranks(_shuffled, n, [1, 2, 3], timeout=120, shm_chunk_bytes=64 << 10,
                       fusion_threshold=256 << 10, **spec)
    assert counts[0] > 60 and len(set(counts)) == 1


def _fusion(rank: int) -> tuple[int, int]:
    import shoal
    engine = shoal.communicator().engine
    xs = [np.full(100 + i, rank + 1.0, np.float32) for i in range(50)]
    before = engine.executor.buffers
    handles = [shoal.allreduce_async(x, name=f"g{i}", op=shoal.Sum) for i, x in enumerate(xs)]
    for i, h in enumerate(handles):
        np.testing.assert_array_equal(h.wait(), np.full(100 + i, 3.0, np.float32))
    return engine.executor.buffers - before, engine.rounds


def test_ready_tensors_are_fused() -> None:
    """50 tensors submitted together travel in a few fused buffers, not 50 collectives."""
    (buffers, _rounds), _ = run_ranks(_fusion, 2, cycle_time_ms=20)
    assert 1 <= buffers <= 5, buffers


def _compressed(rank: int, codec_name: str) -> None:
    import shoal
    from shoal.core.compression import Compression
    codec = Compression.by_name(codec_name)
    n = shoal.size()
    tol = {"fp16": 2e-3, "bf16": 1.6e-2}[codec_name]
    for dtype in ("float32", "float64"):
        for length in (1, 1001, 70_001):
            case = f"c/{codec_name}/{dtype}/{length}"
            inputs = [rank_input(case, r, (length,), dtype, special=False) for r in range(n)]
            got = shoal.allreduce(inputs[rank], name=case, compression=codec)
            want = reference(inputs, "AVERAGE", dtype)
            assert got.dtype == want.dtype
            bound = tol * (np.abs(want) + sum(np.abs(x) for x in inputs) / n) + 1e-6
            assert np.all(np.abs(got - want) <= bound), (case, np.max(np.abs(got - want)))
    # integers are never compressed
    x = rank_input("c/int", rank, (77,), "int64")
    got = shoal.allreduce(x, name="c/int", op=shoal.Sum, compression=codec)
    want = reference([rank_input("c/int", r, (77,), "int64") for r in range(n)], "SUM", "int64")
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
@pytest.mark.parametrize("layout", ["1host-3", "2x2-hierarchical", "3-ring"])
def test_compression_error_within_rounding(codec: str, layout: str) -> None:
    spec = dict(LAYOUTS[layout])
    n = spec.pop("n")
    run_ranks(_compressed, n, codec, shm_chunk_bytes=64 << 10, **spec)


def _traced(rank: int, path: str) -> None:
    import shoal
    hs = [shoal.allreduce_async(np.ones(1000 * (i + 1), np.float32), name=f"grad{i}")
          for i in range(4)]
    for h in hs:
        h.wait()
    shoal.broadcast(np.ones(3), 0, name="weights")


def test_timeline_is_chrome_trace_with_every_phase(tmp_path) -> None:
    path = str(tmp_path / "trace-{rank}.json")
    run_ranks(_traced, 2, path, timeline=path, cycle_time_ms=20)
    for rank in (0, 1):
        events = json.loads((tmp_path / f"trace-{rank}.json").read_text())
        tracks = {e["args"]["name"]: e["tid"] for e in events if e.get("name") == "thread_name"}
        # Horovod's names: <kind>.<name> tracks, NEGOTIATE_<KIND>, the kind's span
        assert {"allreduce.grad0", "allreduce.grad3", "broadcast.weights",
                "fusion buffers"} <= set(tracks)
        phases = {e["name"] for e in events if e.get("tid") == tracks["allreduce.grad2"]}
        assert {"QUEUE", "NEGOTIATE_ALLREDUCE", "ALLREDUCE", "MEMCPY_IN", "REDUCE",
                "MEMCPY_OUT"} <= phases
        assert {"QUEUE", "NEGOTIATE_BROADCAST", "BROADCAST"} <= {
            e["name"] for e in events if e.get("tid") == tracks["broadcast.weights"]}
        fused = [e for e in events if e.get("name") == "ALLREDUCE" and
                 e.get("tid") == tracks["allreduce.grad0"]]
        assert fused and "fusion_buffer" in fused[0]["args"]
        assert all(e["dur"] >= 0 for e in events if e.get("ph") == "X")
        assert not any(e.get("name") == "CYCLE_START" for e in events)  # not asked for


def _traced_horovod_env(rank: int, path: str) -> None:
    import os

    import shoal
    from harness import INIT_ARGS
    shoal.shutdown()  # the harness's job, joined again with Horovod's variables set
    os.environ.update(HOROVOD_TIMELINE=path, HOROVOD_TIMELINE_MARK_CYCLES="1")
    try:
        shoal.init(**INIT_ARGS)
        shoal.allreduce(np.ones(3, np.float32), name="test_allreduce")
    finally:
        del os.environ["HOROVOD_TIMELINE"], os.environ["HOROVOD_TIMELINE_MARK_CYCLES"]


def test_timeline_from_horovods_variables_marks_cycles(tmp_path) -> None:
    path = str(tmp_path / "hvd.json")
    run_ranks(_traced_horovod_env, 2, path)
    events = json.loads((tmp_path / "hvd.json").read_text())  # rank 0 writes it
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert "allreduce.test_allreduce" in tracks
    assert any(e.get("name") == "CYCLE_START" and e.get("ph") == "i" for e in events)
    assert any(e.get("name") in ("NEGOTIATE_ALLREDUCE", "ONE_ROUND_ALLREDUCE") for e in events)


def _big_negotiation(rank: int) -> list[int]:
    import shoal
    transport = shoal.communicator().transport
    blob = bytes([rank]) * [0, 10, 10_000, 5][rank]  # up to 2.5 slots of 4 KiB
    got = transport.gather_all(blob, "test")
    return [len(b) for b in got] + [int(all(set(b) <= {r} for r, b in enumerate(got)))]


@pytest.mark.parametrize("hosts", [None, ["a", "a", "b", "b"]])
def test_negotiation_blobs_larger_than_a_slot(hosts) -> None:
    results = run_ranks(_big_negotiation, 4, hosts=hosts, shm_chunk_bytes=4096)
    assert all(r == [0, 10, 10_000, 5, 1] for r in results), results


def _fused(rank: int) -> tuple[float, float]:
    import time

    import shoal
    n = shoal.size()
    shoal.barrier()
    inputs = [rank_input("bucket", r, (1001,), "float32") for r in range(n)]
    start = time.monotonic()
    handle = shoal.allreduce_async(inputs[rank], name="bucket", fused=True)
    while not handle.done():  # the engine's own thread runs it: no caller drives rounds
        time.sleep(0.001)
        assert time.monotonic() - start < 30, "fused request not started"
    fused_s = time.monotonic() - start
    assert_matches(handle.wait(), reference(inputs, "AVERAGE", "float32"), "float32", "bucket")
    start = time.monotonic()
    handle = shoal.allreduce_async(inputs[rank], name="tensor")
    while not handle.done():
        time.sleep(0.001)
    return fused_s, time.monotonic() - start


def test_fused_requests_skip_the_cycle_wait() -> None:
    # a 3 s cycle: a plain request waits for it, a caller-fused one (a bucket) starts at once
    for fused_s, plain_s in run_ranks(_fused, 2, cycle_time_ms=3000, timeout=60):
        assert fused_s < 2.5 <= plain_s, (fused_s, plain_s)


def _started_and_stopped(rank: int, folder: str) -> None:
    import shoal
    from shoal.common.api import start_timeline, stop_timeline
    x = np.ones(100_000, np.float32)
    shoal.allreduce(x, name="before")
    shoal.allreduce(np.ones(4, np.float32), name="small")  # cached: the one-round path next
    for i in (1, 2):  # start, stop, and again into another file
        start_timeline(f"{folder}/run{i}-{{rank}}.json", mark_cycles=i == 2)
        shoal.allreduce(x, name=f"during{i}")
        shoal.allreduce(np.ones(4, np.float32), name="small")
        shoal.broadcast(np.ones(3), 0, name=f"weights{i}")
        stop_timeline()
        shoal.allreduce(x, name=f"after{i}")
    stop_timeline()  # none running: nothing to do


def test_timeline_starts_and_stops_at_run_time(tmp_path) -> None:
    run_ranks(_started_and_stopped, 2, str(tmp_path))
    for i in (1, 2):
        for rank in (0, 1):
            events = json.loads((tmp_path / f"run{i}-{rank}.json").read_text())  # complete
            tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
            assert {f"allreduce.during{i}", f"broadcast.weights{i}", "allreduce.small"} <= tracks
            assert not {"allreduce.before", f"allreduce.after{i}",
                        "allreduce.during1" if i == 2 else "allreduce.during2"} & tracks
            assert any(e.get("name") == "CYCLE_START" for e in events) == (i == 2)
            assert any(e.get("name") == "ONE_ROUND_ALLREDUCE" for e in events)
            assert any(e.get("name") == "MEMCPY_IN" for e in events)  # the general path's


def test_start_timeline_before_init_is_an_error(tmp_path) -> None:
    from shoal.common.api import start_timeline
    from shoal.core.errors import ShoalError
    with pytest.raises(ShoalError, match="init"):
        start_timeline(str(tmp_path / "t.json"))
