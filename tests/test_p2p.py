"""Point-to-point messages: send/recv between ranks of a communicator, in order per tag, from
any source, without deadlock while pairs are set up, and with typed errors."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from harness import run_ranks


def _data(tag: str, rank: int, n: int, dtype=np.float64) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(f"{tag}/{rank}".encode()))
    return (rng.standard_normal(n) * 100).astype(dtype)


def _ring(rank: int) -> str:
    """Every rank sends to the next before receiving from the previous (set-up included)."""
    import shoal
    comm = shoal.communicator()
    n = comm.size
    sends, recvs = [], []
    for i, (length, dtype) in enumerate([(1001, np.float64), (0, np.float32), (7, np.int32)]):
        x = _data(f"m{i}", rank, length, dtype)
        sends.append((comm.send(x, (rank + 1) % n, tag=i), x))
        out = np.full(length, -1, dtype)
        recvs.append((comm.recv(out, (rank - 1) % n, tag=i), out,
                      _data(f"m{i}", (rank - 1) % n, length, dtype)))
    for handle, out, want in recvs:
        assert handle.wait(20) == (rank - 1) % n
        np.testing.assert_array_equal(out, want)
    for handle, _ in sends:
        assert handle.wait(20) == (rank + 1) % n
    return "ok"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_of_sends_before_receives(n: int) -> None:
    assert run_ranks(_ring, n) == ["ok"] * n


def _ordered_and_any(rank: int) -> list[int]:
    """Messages of one tag arrive in posting order; receives from any source name the
    sender; tags are independent."""
    import shoal
    comm = shoal.communicator()
    if rank != 0:
        handles = [comm.send(np.array([rank, k], np.int64), 0, tag=5) for k in range(3)]
        handles.append(comm.send(np.array([rank * 10], np.int64), 0, tag=9))
        for h in handles:
            h.wait(20)
        return []
    got = []
    # tag 9 first, though it was sent last: tags do not block each other
    for _ in range(comm.size - 1):
        out = np.zeros(1, np.int64)
        src = comm.recv(out, None, tag=9).wait(20)
        assert out[0] == src * 10
        got.append(src)
    # a specific receive, then any-source receives: the specific one takes rank 1's first
    out = np.zeros(2, np.int64)
    assert comm.recv(out, 1, tag=5).wait(20) == 1 and out.tolist() == [1, 0]
    seen: dict[int, list[int]] = {}
    for _ in range(3 * (comm.size - 1) - 1):
        out = np.zeros(2, np.int64)
        src = comm.recv(out, None, tag=5).wait(20)
        assert out[0] == src
        seen.setdefault(src, []).append(int(out[1]))
    assert seen == {1: [1, 2], **{r: [0, 1, 2] for r in range(2, comm.size)}}
    return sorted(got)


@pytest.mark.parametrize("n", [2, 3])
def test_order_tags_and_any_source(n: int) -> None:
    assert run_ranks(_ordered_and_any, n)[0] == list(range(1, n))


def _mismatch(rank: int) -> str:
    import shoal
    comm = shoal.communicator()
    with pytest.raises(ValueError, match="another rank"):
        comm.send(np.zeros(3), rank)
    if rank == 0:
        assert comm.send(np.zeros(3), 1).wait(20) == 1  # sent: the receiver finds the mismatch
    else:
        with pytest.raises(ValueError, match="24 bytes but the receive buffer has 32"):
            comm.recv(np.zeros(4), 0).wait(20)
    # the pair stays usable after the refusal
    if rank == 0:
        comm.send(np.arange(4.0), 1).wait(20)
    else:
        out = np.zeros(4)
        comm.recv(out, 0).wait(20)
        assert out.tolist() == [0, 1, 2, 3]
    with pytest.raises(shoal.ShoalTimeoutError):
        comm.recv(np.zeros(1), None, tag=77).wait(0.3)
    return "ok"


def test_size_mismatch_is_typed_and_recoverable() -> None:
    assert run_ranks(_mismatch, 2) == ["ok", "ok"]
