"""SMDDP's ``get_worker_comm()``: the job's workers as an mpi4py-style communicator (objects
gathered, broadcast, scattered and reduced; a barrier), checked against what each rank sent."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def _use(rank: int) -> dict:
    from shoal.core.worker_comm import get_worker_comm
    comm = get_worker_comm()
    mine = {"rank": rank, "boxes": list(range(rank + 1)), "tag": "r" * rank}
    out = {"rank": (comm.rank, comm.Get_rank()), "size": (comm.size, comm.Get_size()),
           "gather": comm.gather(mine, root=0), "gather1": comm.gather(rank, root=1),
           "allgather": comm.allgather(rank * 10),
           "bcast": comm.bcast({"from": rank} if rank == comm.size - 1 else None,
                               root=comm.size - 1),
           "scatter": comm.scatter([f"item{r}" for r in range(comm.size)] if rank == 0
                                   else None, root=0),
           "sum": comm.allreduce(rank + 1), "concat": comm.allreduce([rank]),
           "max": comm.reduce(rank, op=max, root=0)}
    # the barrier holds every rank until the last, which arrives late, has come
    if rank == comm.size - 1:
        time.sleep(0.5)
        out["arrived"] = time.time()
    comm.Barrier()
    out["after"] = time.time()
    comm.barrier()
    try:
        comm.gather(1, root=comm.size)
    except ValueError as exc:
        out["bad_root"] = str(exc)
    try:
        comm.scatter([1], root=0)
    except ValueError as exc:
        out["bad_scatter"] = str(exc)
    out["still"] = comm.allgather(rank)  # a refusal moved no data: the comm goes on
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_worker_comm_moves_objects_like_mpi4py(n: int) -> None:
    got = run_ranks(_use, n)
    sent = [{"rank": r, "boxes": list(range(r + 1)), "tag": "r" * r} for r in range(n)]
    for r, out in enumerate(got):
        assert out["rank"] == (r, r) and out["size"] == (n, n)
        assert out["gather"] == (sent if r == 0 else None)
        assert out["gather1"] == (list(range(n)) if r == 1 else None)
        assert out["allgather"] == [10 * k for k in range(n)]
        assert out["bcast"] == {"from": n - 1}
        assert out["scatter"] == f"item{r}"
        assert out["sum"] == n * (n + 1) // 2 and out["concat"] == list(range(n))
        assert out["max"] == (n - 1 if r == 0 else None)
        assert f"rank {r}: gather(root={n})" in out["bad_root"] and "0 to" in out["bad_root"]
        assert out["still"] == list(range(n))
    for r, out in enumerate(got):  # every rank learns the root's mistake
        assert out["bad_scatter"] == (f"rank {r}: scatter(root=0) needs a sequence of {n} "
                                      f"items (one per rank) on rank 0, got 1")
    assert all(out["after"] >= got[-1]["arrived"] for out in got)  # none left before it came


def test_smddp_tensorflow_has_get_worker_comm() -> None:
    """``smdistributed.dataparallel.tensorflow.get_worker_comm`` under the switch."""
    pytest.importorskip("tensorflow")
    code = ("import smdistributed.dataparallel.tensorflow as sdp\n"
            "from shoal.core.worker_comm import get_worker_comm\n"
            "assert sdp.get_worker_comm is get_worker_comm\nprint('ok')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(PYTHONPATH=str(ROOT / "src"), TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run([sys.executable, "-m", "shoal.as", "smddp", "-c", code], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
