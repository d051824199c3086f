"""Communicators as values: several per process, sub-communicators, any store, and
init/shutdown cycles that leave nothing behind."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import threading
import traceback
import zlib

import numpy as np
import pytest

from harness import INIT_ARGS, free_port, run_ranks


def _data(tag: str, rank: int, n: int, dtype=np.float64) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(f"{tag}/{rank}".encode()))
    return rng.standard_normal(n).astype(dtype)


def _two_subsets(rank: int) -> str:
    import shoal
    world = shoal.communicator()
    a = world.split([0, 1, 2])
    b = world.split([3, 2, 1])  # order given is rank order: world rank 3 is b's rank 0
    assert (a is None) == (rank == 3) and (b is None) == (rank == 0)
    if b is not None:
        assert b.rank == [3, 2, 1].index(rank) and b.size == 3
    handles = []
    for i in range(6):  # interleaved, all in flight at once, odd lengths, two dtypes
        for comm, members, tag in ((a, [0, 1, 2], "a"), (b, [3, 2, 1], "b")):
            if comm is None:
                continue
            dtype = np.float32 if i % 2 else np.float64
            x = _data(f"{tag}{i}", rank, 1001 + i, dtype)
            want = sum(_data(f"{tag}{i}", r, 1001 + i, dtype).astype(np.float64)
                       for r in members)
            handles.append((comm.allreduce_async(x, shoal.Sum, name=f"x{i}"), want, dtype))
    # the parent stays usable while children have work in flight
    total = shoal.allreduce(np.array([rank], np.int64), shoal.Sum, name="parent")
    assert total.tolist() == [6]
    for handle, want, dtype in handles:
        tol = 1e-4 if dtype == np.float32 else 1e-10
        np.testing.assert_allclose(handle.wait(), want, rtol=tol, atol=tol)
    if b is not None:
        got = b.allgather(np.array([rank, rank], np.int32).reshape(1, 2))
        assert got[:, 0].tolist() == [3, 2, 1]
        obj = b.broadcast_object({"from": rank} if b.rank == 0 else None, root_rank=0)
        assert obj == {"from": 3}
    for comm in (a, b):
        if comm is not None:
            comm.close()
            comm.close()  # idempotent
    return "ok"


def test_two_subset_communicators_concurrently() -> None:
    assert run_ranks(_two_subsets, 4, timeout=60) == ["ok"] * 4


def _threads_at_once(rank: int) -> str:
    import shoal
    world = shoal.communicator()
    child = world.split(list(range(world.size)))
    errors: list[str] = []

    def work(comm, tag: str) -> None:
        try:
            for i in range(20):
                x = _data(f"{tag}{i}", rank, 257)
                want = sum(_data(f"{tag}{i}", r, 257) for r in range(comm.size))
                np.testing.assert_allclose(comm.allreduce(x, shoal.Sum, name=f"{tag}{i}"),
                                           want, rtol=1e-10)
        except Exception:
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=work, args=(c, t)) for c, t in
               ((world, "parent"), (child, "child"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    child.close()
    assert not errors, errors[0]
    return "ok"


@pytest.mark.parametrize("n", [2, 3])
def test_parent_and_child_from_two_threads(n: int) -> None:
    assert run_ranks(_threads_at_once, n, timeout=60) == ["ok"] * n


def _resources() -> tuple[int, int]:
    """This process's Python threads and open file descriptors."""
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def _cycles(rank: int, cycles: int, serve_port: int | None) -> str:
    import shoal
    shoal.shutdown()
    args = dict(INIT_ARGS)
    job = args["job_id"]
    if serve_port:  # rank 0 serves the store itself, anew each cycle
        args.update(serve_store=True, rendezvous_port=serve_port)
    before = _resources()
    for i in range(cycles):
        shoal.init(**args)
        got = shoal.allreduce(np.array([rank, i], np.int64), shoal.Sum, name="cycle")
        assert got.tolist() == [sum(range(shoal.size())), i * shoal.size()]
        shoal.shutdown()
    after = _resources()
    shoal.init(**INIT_ARGS)
    shoal.barrier()
    left = glob.glob(f"/dev/shm/shoal-{job}*")
    assert after == before, f"threads/fds before {before}, after {after}"
    assert left == [], left
    return "ok"


def test_init_shutdown_50_times_leaves_nothing() -> None:
    assert run_ranks(_cycles, 3, 50, None, timeout=120) == ["ok"] * 3


@pytest.mark.slow
@pytest.mark.soak
def test_init_shutdown_200_times_leaves_nothing() -> None:
    """The soak (``pytest -m soak``; the README's command leaves it out)."""
    assert run_ranks(_cycles, 3, 200, None, timeout=240) == ["ok"] * 3


def test_init_shutdown_with_rank0_serving_the_store() -> None:
    assert run_ranks(_cycles, 2, 15, free_port(), timeout=120) == ["ok"] * 2


# -- torch stores, no launcher ---------------------------------------------------------------
def _torch_rank(kind: str, where: str, rank: int, n: int, queue) -> None:
    try:
        for var in [v for v in os.environ if v.startswith(("SHOAL_", "MASTER_", "RANK"))]:
            del os.environ[var]
        import torch.distributed as dist

        from shoal.core.communicator import Communicator
        from shoal.torch.store import C10dStore
        if kind == "tcp":
            store = dist.TCPStore("127.0.0.1", int(where), n, is_master=rank == 0)
        else:
            store = dist.FileStore(where, n)
        import shoal
        with Communicator.create(C10dStore(store, 30.0), rank, n) as comm:
            x = _data("t", rank, 333)
            want = sum(_data("t", r, 333) for r in range(n)) / n
            np.testing.assert_allclose(comm.allreduce(x), want, rtol=1e-10)
            b = comm.broadcast(np.full(5, float(rank)), root_rank=n - 1)
            assert b.tolist() == [float(n - 1)] * 5
            assert not shoal.is_initialized()
        queue.put((rank, "ok"))
    except BaseException:
        queue.put((rank, traceback.format_exc()))


@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_communicator_over_torch_store(kind: str, tmp_path) -> None:
    pytest.importorskip("torch")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    n = 3 if kind == "tcp" else 2
    where = str(free_port()) if kind == "tcp" else str(tmp_path / "store")
    procs = [ctx.Process(target=_torch_rank, args=(kind, where, r, n, queue))
             for r in range(n)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=90) for _ in range(n))
    for p in procs:
        p.join(10)
    assert results == dict.fromkeys(range(n), "ok"), results
