"""Every rank of a round takes the same path, whichever each chose (issue 63).

A synchronous collective of a cached name tries the one-round path (:mod:`shoal.core.engine.
small`) only where the engine is idle: a rank whose round lock is still held (its engine
thread just finished the previous collective) goes the general way while its peers go the
one-round way. The frames the two send must still make one round, on one host and across
hosts. Here the timing is forced, not left to load: a helper thread holds the round lock on
one rank at the moment of the choice, every other iteration, so the ranks choose apart. The
cross-host frame reader is fuzzed: no bytes a peer sends make it allocate what a length
claims or trust a frame that is not shoal's."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import run_ranks
from shoal.core.errors import ShoalError
from shoal.core.transport import pack_blobs, unpack_blobs
from shoal.core.transport.cross_round import MAGIC, MAX_PROPOSALS, FrameSwap, read_head
from shoal.core.transport.tcp import TcpMesh

FUZZ = settings(max_examples=300, deadline=None)
CAP = 64 << 10


def _hold_round_lock(engine) -> threading.Thread:
    """Hold ``engine``'s round lock from another thread until a collective of this rank has
    seen it held (50 ms), as the engine's thread does just after a round."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with engine._run:
            held.set()
            release.wait(0.05)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    held.wait(5.0)
    return thread


def _large_barrier_small(rank: int, iterations: int, forced: int) -> tuple[int, int]:
    """The user's loop: a large allreduce, a barrier, a small one; rank ``forced`` has its
    round lock held at the small one's choice every other iteration."""
    import shoal
    engine = shoal.communicator().engine
    n = shoal.size()
    big = np.full(1 << 16, float(rank + 1), np.float32)  # 256 KiB: the general path
    want_big = float(sum(range(1, n + 1)))
    for i in range(iterations):
        out = shoal.allreduce(big, op=shoal.Sum, name="big")
        assert out[0] == want_big and out[-1] == want_big, (i, out[:3])
        holder = _hold_round_lock(engine) if rank == forced and i % 2 else None
        shoal.barrier()
        small = shoal.allreduce(np.array([rank, i], np.int64), op=shoal.Sum, name="small")
        if holder is not None:
            holder.join()
        assert small.tolist() == [n * (n - 1) // 2, n * i], (i, small)
    return engine.small_rounds, engine.rounds


@pytest.mark.parametrize("hosts", [["a", "a", "b", "b"], ["a", "b", "c", "d"], ["a"] * 4])
def test_ranks_that_choose_apart_still_make_one_round(hosts: list[str]) -> None:
    results = run_ranks(_large_barrier_small, len(hosts), 40, 1, hosts=hosts, timeout=120)
    small_rounds = [s for s, _ in results]
    assert min(small_rounds) > 0, results  # the one-round path was taken, and not taken


def _every_kind(rank: int, iterations: int) -> int:
    """Broadcast, reduce-scatter and allgather of cached names, with one rank's lock held
    at the choice in turn: the same results as numpy on every rank."""
    import shoal
    engine = shoal.communicator().engine
    n = shoal.size()
    rows = [np.arange(6, dtype=np.float64) + 10 * r for r in range(n)]
    for i in range(iterations):
        holder = _hold_round_lock(engine) if rank == i % n and i % 3 else None
        got = shoal.broadcast(rows[rank].copy(), root_rank=i % n, name="bcast")
        assert got.tolist() == rows[i % n].tolist(), (i, got)
        block = shoal.reducescatter(np.tile(rows[rank], n), op=shoal.Sum, name="rs")
        assert block.tolist() == sum(rows).tolist(), (i, block)
        gathered = shoal.allgather(rows[rank], name="ag")
        assert gathered.tolist() == np.concatenate(rows).tolist(), (i, gathered)
        if holder is not None:
            holder.join()
    return engine.small_rounds


@pytest.mark.parametrize("hosts", [["a"] * 3, ["a", "a", "b", "b"]])
def test_every_kind_with_ranks_choosing_apart(hosts: list[str]) -> None:
    rounds = run_ranks(_every_kind, len(hosts), 12, hosts=hosts, timeout=120)
    if len(set(hosts)) == 1:  # (across hosts these kinds go the general way)
        assert min(rounds) > 0, rounds


# -- the frame reader ---------------------------------------------------------------------------
@FUZZ
@given(st.binary(min_size=24, max_size=24))
def test_frame_head_of_arbitrary_bytes_is_refused_or_bounded(raw: bytes) -> None:
    head = np.frombuffer(raw, np.int64)
    try:
        token, length = read_head(head, 0, 1, "negotiation round", CAP)
    except ShoalError as exc:
        assert "rank 1" in str(exc) and "rank 0" in str(exc)
        return
    assert int(head[0]) == MAGIC and 0 <= length <= (CAP if token else MAX_PROPOSALS)


@FUZZ
@given(st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-(1 << 63), (1 << 63) - 1))
def test_frame_head_with_the_magic_checks_its_length(token: int, length: int) -> None:
    head = np.array([MAGIC, token, length], np.int64)
    cap = CAP if token else MAX_PROPOSALS
    if 0 <= length <= cap:
        assert read_head(head, 2, 3, "x", CAP) == (token, length)
    else:
        with pytest.raises(ShoalError, match=f"rank 3 announced .* {length} bytes"):
            read_head(head, 2, 3, "x", CAP)


@FUZZ
@given(st.lists(st.binary(max_size=40), max_size=5), st.binary(max_size=64),
       st.integers(0, 80))
def test_packed_proposals_unpack_or_are_refused(blobs: list[bytes], noise: bytes,
                                                cut: int) -> None:
    packed = pack_blobs(blobs)
    assert unpack_blobs(packed) == blobs
    for data in (packed[:cut], packed + noise[:1], noise):
        try:
            got = unpack_blobs(data)
        except ShoalError:
            continue
        assert pack_blobs(got) == data  # whatever unpacks is a packing


def _pair() -> list[TcpMesh]:
    meshes = [TcpMesh(r, 2, b"s" * 32, timeout=2.0, buffer_bytes=1 << 18,
                      bind_addr="127.0.0.1") for r in range(2)]
    threads = [threading.Thread(target=m.connect, args=([x.address for x in meshes], 10,
                                                        [2, 2])) for m in meshes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    return meshes


@pytest.mark.parametrize("words", [(0, 0, 4), (MAGIC, 7, CAP + 1), (MAGIC, 0, -5),
                                   (MAGIC, 0, 1 << 57), (MAGIC, 9, 1 << 57)])
def test_a_frame_past_the_protocol_is_an_error_naming_the_peer(words: tuple) -> None:
    """Rank 1 sends a bad head where a frame is due: rank 0 refuses it at once, naming rank
    1, and allocates nothing of the length it claims."""
    meshes = _pair()
    try:
        frames = FrameSwap(meshes[0], 0, [0, 1], CAP)
        meshes[1].exchange([(0, memoryview(np.array(words, np.int64)).cast("B"))], [],
                           control=True)
        start = time.monotonic()
        with pytest.raises(ShoalError, match=r"rank 0: .*rank 1") as info:
            frames.swap([], [1], 0, memoryview(b""), "negotiation round")
        assert time.monotonic() - start < 1.0 and "negotiation round" in str(info.value)
    finally:
        for m in meshes:
            m.close()


def test_frames_longer_than_the_eager_part_cross_both_ways() -> None:
    """Proposals of any length, both ranks at once, on meshes of two streams: the head and
    the body arrive in order, and a round where one rank sent a partial settles as a general
    one on both."""
    meshes = _pair()
    rng = np.random.default_rng(5)
    blobs = [rng.integers(0, 255, n, np.uint8).tobytes() for n in (300_001, 17)]
    got: list = [None, None]

    def run(r: int) -> None:
        frames = FrameSwap(meshes[r], r, [0, 1], CAP)
        gathered = frames.gather(blobs[r], "x")
        token = 5 if r else 0  # rank 1 tries one round with a partial, rank 0 does not
        partial = np.arange(9, dtype=np.float32)
        first = frames.swap([1 - r], [1 - r], token,
                            memoryview(partial if r else blobs[r]).cast("B"), "y")
        got[r] = gathered, frames.settle(token, lambda: blobs[r], first, "y")
    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for m in meshes:
        m.close()
    assert got[0] == got[1] == (blobs, blobs)
