"""Several TCP streams per peer between hosts: the striping plan, striped transfers against the
bytes sent, a stream closed mid-message, and the collectives over 2 and 3 streams against numpy
on simulated hosts (one machine, ``SHOAL_HOSTNAME`` per rank)."""

from __future__ import annotations

import itertools
import socket
import threading

import numpy as np
import pytest

from harness import run_ranks
from reference import assert_matches, rank_input, reference
from shoal.core.errors import PeerLostError
from shoal.core.transport.shm import DEFAULT_CHUNK, STREAM_STEP_BYTES, pipeline_chunk
from shoal.core.transport.tcp import AUTO_STREAMS, TcpMesh, choose_streams, stripe_plan

SECRET = b"s" * 32


@pytest.mark.parametrize("nbytes", [1, 1000, 128 << 10, (128 << 10) + 7, 5_000_001, 64 << 20])
@pytest.mark.parametrize("streams", [1, 2, 3, 4])
def test_stripe_plan_covers_the_message_in_order(nbytes: int, streams: int) -> None:
    plan = stripe_plan(nbytes, streams, 64 << 10)
    assert plan[0][1] == 0 and plan[-1][2] == nbytes
    assert all(a[2] == b[1] for a, b in itertools.pairwise(plan))  # contiguous, in order
    assert all(hi > lo for _s, lo, hi in plan)
    used = {s for s, _lo, _hi in plan}
    if streams == 1 or nbytes < 128 << 10:
        assert plan == [(0, 0, nbytes)]
    else:
        assert used == set(range(min(streams, len(plan))))  # each stream a share
        assert [s for s, _lo, _hi in plan] == [k % streams for k in range(len(plan))]
        assert max(hi - lo for _s, lo, hi in plan) <= 1 << 20


def test_auto_streams_follow_the_settings() -> None:
    assert choose_streams(3, 64 << 20, 64 << 10, 6) == 3  # a count is taken as it is
    assert choose_streams(0, 64 << 20, 64 << 10, 6) == AUTO_STREAMS
    assert choose_streams(0, 128 << 10, 64 << 10, 6) == 2  # small fusion buffers: fewer
    assert choose_streams(0, 64 << 20, 64 << 10, 600) == 1  # many peers: a socket budget


def _pair(streams: int, timeout: float = 5.0) -> list[TcpMesh]:
    meshes = [TcpMesh(r, 2, SECRET, timeout=timeout, buffer_bytes=1 << 18,
                      bind_addr="127.0.0.1") for r in range(2)]
    addresses = [m.address for m in meshes]
    threads = [threading.Thread(target=m.connect, args=(addresses, 10, [streams, streams]))
               for m in meshes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert all(m.streams(1 - m.rank) == streams for m in meshes)
    return meshes


@pytest.mark.parametrize("streams", [2, 3])
def test_striped_exchange_moves_the_right_bytes(streams: int) -> None:
    """Both directions at once, several buffers per call (odd sizes, one empty, one below a
    stripe), the receiver's progress reported as a growing contiguous prefix."""
    meshes = _pair(streams)
    rng = np.random.default_rng(streams)
    sizes = [3_000_017, 0, 999, (1 << 20) + 5]
    data = [[rng.integers(0, 255, n, dtype=np.uint8) for n in sizes] for _ in range(2)]
    got = [[np.zeros(n, np.uint8) for n in sizes] for _ in range(2)]
    progress: list[list[tuple[int, int, int]]] = [[], []]
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            meshes[r].exchange([(1 - r, memoryview(a)) for a in data[r]],
                               [(1 - r, memoryview(b)) for b in got[r]],
                               on_recv=lambda i, d, t, r=r: progress[r].append((i, d, t)))
        except BaseException as exc:
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for r in range(2):
        for want, have in zip(data[1 - r], got[r], strict=True):
            np.testing.assert_array_equal(have, want)
        for i, n in enumerate(sizes):
            seen = [d for j, d, t in progress[r] if j == i]
            assert seen == sorted(seen) and (n == 0 or seen[-1] == n)
        assert meshes[r].sent[1 - r] == meshes[r].received[1 - r] == sum(sizes)
    for m in meshes:
        m.close()


def test_a_stream_closed_mid_message_is_a_lost_peer() -> None:
    """One of three streams ends while a striped message is on the wire: both ends raise
    PeerLostError naming the peer, the sender's write and the receiver's read alike."""
    meshes = _pair(3)
    payload = np.ones(24 << 20, np.uint8)
    sink = np.empty_like(payload)
    outcome: dict[int, BaseException | None] = {}

    def send() -> None:
        try:
            meshes[0].exchange([(1, memoryview(payload))], [])
            outcome[0] = None
        except BaseException as exc:
            outcome[0] = exc

    def recv() -> None:
        try:
            meshes[1].exchange([], [(0, memoryview(sink))],
                               on_recv=lambda i, d, t: d > (1 << 20) and cut.set())
            outcome[1] = None
        except BaseException as exc:
            outcome[1] = exc
    cut = threading.Event()
    threads = [threading.Thread(target=send), threading.Thread(target=recv)]
    for t in threads:
        t.start()
    assert cut.wait(20), "no data arrived"
    meshes[0]._socks[1][2].shutdown(socket.SHUT_RDWR)  # the third stream ends
    for t in threads:
        t.join(20)
    assert isinstance(outcome[0], PeerLostError) and outcome[0].rank == 1, outcome
    assert isinstance(outcome[1], PeerLostError) and outcome[1].rank == 0, outcome
    assert "stream 3 of 3" in str(outcome[0]) and "stream 3 of 3" in str(outcome[1])
    for m in meshes:
        m.close()


CASES = [("float32", "SUM", 300_001), ("float64", "AVERAGE", 70_003), ("int32", "MAX", 65_537),
         ("float16", "SUM", 99_999), ("bfloat16", "AVERAGE", 33_333), ("float32", "SUM", 0),
         ("int64", "SUM", 1)]


def _striped(rank: int, algorithm: str, streams: int) -> dict:
    import shoal
    comm = shoal.communicator()
    mesh = comm.transport.mesh
    n = shoal.size()
    for dtype, op, length in CASES:
        case = f"st/{algorithm}/{dtype}/{op}/{length}"
        inputs = [rank_input(case, r, (length,), dtype) for r in range(n)]
        got = shoal.allreduce(inputs[rank], op=shoal.ReduceOp[op], name=case)
        assert_matches(got, reference(inputs, op, dtype), dtype, case,
                       inputs if op in ("SUM", "AVERAGE") else None)
    x = [np.arange(40_006, dtype=np.float32) * (r + 1) for r in range(n)]
    rows = [10_000 + r for r in range(n)]
    bounds = np.cumsum([0, *rows]).tolist()
    out = shoal.reducescatter(x[rank], op=shoal.Sum, name="st/rs", splits=rows)
    gathered = shoal.allgather(np.full(1000 + rank, rank, np.int32), name="st/ag")
    assert gathered.tolist() == [r for r in range(n) for _ in range(1000 + r)]
    np.testing.assert_allclose(out, sum(x)[bounds[rank]:bounds[rank + 1]], rtol=1e-6)
    counts = {p: mesh.streams(p) for p in range(n) if p != rank}
    return {"algorithm": comm.transport.algorithm, "streams": counts}


@pytest.mark.parametrize("streams", [2, 3])
@pytest.mark.parametrize("algorithm", ["hierarchical", "ring"])
def test_collectives_over_striped_streams_match_numpy(algorithm: str, streams: int) -> None:
    hosts = ["a", "a", "b", "b"]
    results = run_ranks(_striped, 4, algorithm, streams, hosts=hosts, timeout=180,
                        tcp_streams=streams, tcp_stripe_bytes=16 << 10,
                        allreduce_algorithm=algorithm)
    for rank, res in enumerate(results):
        assert res["algorithm"] == algorithm
        for peer, count in res["streams"].items():
            assert count == (streams if hosts[peer] != hosts[rank] else 1), res


def _three_hosts(rank: int) -> list[int]:
    import shoal
    case = "st3"
    inputs = [rank_input(case, r, (200_003,), "float32") for r in range(shoal.size())]
    got = shoal.allreduce(inputs[rank], op=shoal.Sum, name=case)
    assert_matches(got, reference(inputs, "SUM", "float32"), "float32", case, inputs)
    mesh = shoal.communicator().transport.mesh
    return [mesh.streams(p) for p in range(shoal.size())]


def test_ends_with_different_settings_agree_on_the_fewer_streams() -> None:
    hosts = ["a", "b", "c"]
    results = run_ranks(_three_hosts, 3, hosts=hosts, timeout=120, tcp_stripe_bytes=16 << 10,
                        rank_settings={0: {"tcp_streams": 3}, 1: {"tcp_streams": 2},
                                       2: {"tcp_streams": 3}})
    assert results[0][1] == results[1][0] == 2
    assert results[0][2] == results[2][0] == 3
    assert results[1][2] == results[2][1] == 2


def test_the_shared_memory_chunk_grows_for_several_streams() -> None:
    assert pipeline_chunk(0, 2, 1, 4) == DEFAULT_CHUNK  # one host
    assert pipeline_chunk(0, 2, 2, 1) == DEFAULT_CHUNK  # one stream across hosts
    assert pipeline_chunk(0, 2, 2, 4) == 2 * 2 * 4 * STREAM_STEP_BYTES  # 8 MiB
    assert pipeline_chunk(0, 8, 16, 4) == 32 << 20  # at most 32 MiB
    assert pipeline_chunk(3 << 20, 2, 2, 4) == 3 << 20  # a setting wins
