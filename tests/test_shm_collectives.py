"""allgather, broadcast and alltoall through shared memory between the ranks of one host,
against numpy at 2, 3 and 4 ranks: uneven and empty parts, several dtypes and trailing
shapes, messages of many slot-fulls (a 4 KiB chunk); on one host no byte goes over TCP, and
across two simulated hosts the TCP path still gives the same answers."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from harness import run_ranks

DTYPES = ["float32", "float64", "int8", "uint16", "int64", "bool", "float16"]


def _data(tag: str, rank: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    rng = np.random.default_rng([zlib.crc32(tag.encode()), rank])
    if dtype == "bool":
        return rng.random(shape) < 0.5
    return (rng.standard_normal(shape) * 50).astype(dtype)


def _collectives(rank: int, forbid_tcp: bool) -> str:
    import shoal
    n = shoal.size()
    transport = shoal.communicator().engine.transport
    if forbid_tcp and transport.mesh is not None:
        def no_tcp(*_a, **_k):
            raise AssertionError("data went over TCP on one host")
        transport.mesh.exchange = no_tcp
    for i, dtype in enumerate(DTYPES):
        trailing = [(), (3,), (2, 5)][i % 3]
        # allgather: rank r has a different number of rows, one rank none
        rows = [(7 * r + 3 * i) % 11 if r != 1 else 0 for r in range(n)]
        rows[0] += 1500 if i == 0 else 0  # many slot-fulls
        parts = [_data(f"ag{i}", r, (rows[r], *trailing), dtype) for r in range(n)]
        got = shoal.allgather(parts[rank], name=f"ag{i}")
        np.testing.assert_array_equal(got, np.concatenate(parts), err_msg=f"allgather {dtype}")
        # broadcast from every root, one larger than a slot
        for root in range(n):
            size = 2000 if root == n - 1 else 5 + root
            want = _data(f"bc{i}.{root}", root, (size, *trailing), dtype)
            x = want.copy() if rank == root else np.zeros_like(want)
            shoal.broadcast(x, root_rank=root, name=f"bc{i}.{root}")
            np.testing.assert_array_equal(x, want, err_msg=f"broadcast {dtype} root {root}")
        # alltoall with uneven splits, some empty, one pair of many sub-slots
        splits = [[(p * 3 + q * 5 + i) % 7 for q in range(n)] for p in range(n)]
        splits[0][n - 1] += 900 if i == 1 else 0
        splits[n - 1][0] = 0
        sends = [_data(f"a2a{i}", p, (sum(splits[p]), *trailing), dtype) for p in range(n)]
        data, recv = shoal.alltoall(sends[rank], splits=splits[rank], name=f"a2a{i}")
        offsets = [np.cumsum([0, *splits[p]]) for p in range(n)]
        want = np.concatenate([sends[p][offsets[p][rank]:offsets[p][rank + 1]]
                               for p in range(n)])
        np.testing.assert_array_equal(data, want, err_msg=f"alltoall {dtype}")
        assert recv.tolist() == [splits[p][rank] for p in range(n)]
    # empty everywhere, and objects (allgather of lengths, then bytes)
    assert shoal.allgather(np.zeros((0, 4)), name="empty").shape == (0, 4)
    assert shoal.allgather_object({"rank": rank}) == [{"rank": r} for r in range(n)]
    assert shoal.broadcast_object(list(range(rank + 3)), root_rank=n - 1) == list(range(n + 2))
    return "ok"


@pytest.mark.parametrize("n", [2, 3, 4])
def test_shm_collectives_match_numpy(n: int) -> None:
    assert run_ranks(_collectives, n, True, timeout=180, shm_chunk_bytes=4096) == ["ok"] * n


def test_two_hosts_use_tcp_and_agree() -> None:
    assert run_ranks(_collectives, 4, False, hosts=["a", "a", "b", "b"], timeout=180,
                     shm_chunk_bytes=4096) == ["ok"] * 4
