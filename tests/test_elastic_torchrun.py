"""torchrun's elastic agent restarting a worker group (``--max-restarts=1``) on shoal: a
worker killed once brings the group down and up again, the restarted group trains to the end
on shoal (through ``shoal.torch`` and through the ``"shoal"`` torch.distributed backend), and
nothing of the killed group stays behind: no shared memory, no process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from harness import free_port_pair  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import os, signal, sys
import torch
mode = sys.argv[1]
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if mode == "hvd":
    import shoal.torch as hvd
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    def reduce(t):
        return hvd.allreduce(t, name="grad")
else:
    import torch.distributed as dist
    import shoal.torch  # registers the "shoal" backend
    dist.init_process_group("shoal")
    rank, size = dist.get_rank(), dist.get_world_size()
    def reduce(t):
        dist.all_reduce(t)
        return t / size
w = torch.zeros(4)
for step in range(6):
    g = torch.full((4,), float(rank + 1 + step))
    w -= 0.1 * reduce(g)
    if rank == 1 and step == 2 and not os.path.exists("killed-once"):
        open("killed-once", "w").close()  # one kill in the job (the cwd is shared)
        os.kill(os.getpid(), signal.SIGKILL)
# one write: both workers share torchrun's stdout
sys.stdout.write(f"done {restart} {rank} {size} {[round(float(v), 4) for v in w]}\n")
sys.stdout.flush()
"""


@pytest.mark.serial  # it reads /dev/shm, which every test on the machine writes
@pytest.mark.parametrize("mode", ["hvd", "backend"])
def test_torchrun_restart_after_a_killed_worker(tmp_path: Path, mode: str) -> None:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this interpreter")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "MASTER_"))}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
               SHOAL_SECRET="ab" * 32)
    before = set(os.listdir("/dev/shm"))
    port = free_port_pair()
    proc = subprocess.run([torchrun, "--nnodes=1:1", "--nproc-per-node=2", "--max-restarts=1",
                           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                           "--monitor-interval=0.2", str(script), mode],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done = sorted(line.split(" ", 4) for line in proc.stdout.splitlines()
                  if line.startswith("done "))
    assert [(d[1], d[2], d[3]) for d in done] == [("1", "0", "2"), ("1", "1", "2")], (
        proc.stdout[-2000:] + proc.stderr[-2000:])
    assert done[0][4] == done[1][4]  # the restarted group agrees
    left = [n for n in set(os.listdir("/dev/shm")) - before if n.startswith("shoal-")]
    assert left == [], left


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.parametrize("mode", ["hvd", "backend"])
def test_torchrun_two_nodes_restart_after_a_killed_worker(tmp_path: Path, mode: str) -> None:
    """``torchrun --nnodes 2 --max-restarts 1`` on 2 emulated nodes (network namespaces): the
    worker on node b is killed; both agents restart their groups, the new world meets again
    across the nodes, and it trains to the end."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this interpreter")
    from shoal.bench.common import free_port
    from shoal.bench.netns import ClusterUnavailableError, EmulatedCluster
    try:
        cluster = EmulatedCluster(2, "1gbit", tag=f"r{os.getpid() % 10000}")
        cluster.__enter__()
    except ClusterUnavailableError as exc:
        pytest.skip(str(exc))
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    procs = []
    try:
        for node in range(2):
            env = {k: v for k, v in os.environ.items()
                   if not k.startswith(("SHOAL_", "MASTER_"))}
            env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1",
                       SHOAL_SECRET="ab" * 32, SHOAL_HOSTNAME=f"node-{'ab'[node]}")
            procs.append(subprocess.Popen(cluster.command(node, [
                torchrun, "--nnodes=2", "--nproc-per-node=1", "--max-restarts=1",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={cluster.addresses[0]}:{port}",
                "--rdzv-id=shoal-two-nodes", f"--local-addr={cluster.addresses[node]}",
                "--monitor-interval=0.2", str(script), mode]),
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                cwd=tmp_path))
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        cluster.__exit__(None, None, None)
    logs = "\n".join(o[-2000:] + e[-3000:] for o, e in outs)
    assert [p.returncode for p in procs] == [0, 0], logs
    done = sorted(line.split(" ", 4) for o, _ in outs for line in o.splitlines()
                  if line.startswith("done "))
    # the agent whose worker died restarts (count 1); the other may restart on the new
    # member (torch keeps its count at 0 then): either way one new world of 2 finishes
    assert len(done) == 2 and {d[3] for d in done} == {"2"} and "1" in {d[1] for d in done}, logs
    assert sorted(d[2] for d in done) == ["0", "1"], logs
    assert done[0][4] == done[1][4], logs  # the restarted world agrees across the nodes


def _two_rounds(rank: int, port: int) -> list[float]:
    """Two rounds of a group on one torch store that outlives them (as torchrun's does), the
    second with the ranks' restart counts disagreeing (as torchrun's agents may)."""
    import torch.distributed as dist

    import shoal.torch.backend as backend
    backend.register()
    os.environ.update(TORCHELASTIC_RUN_ID="two-rounds", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)
    got = []
    for restarts in ("0", str(rank)):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = restarts
        dist.init_process_group("shoal", rank=rank, world_size=2, store=store)
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t)
        got.append(float(t[0]))
        dist.destroy_process_group()
    return got


def test_a_store_that_outlives_its_rounds_and_disagreeing_restart_counts() -> None:
    from harness import free_port, run_ranks
    assert run_ranks(_two_rounds, 2, free_port(), timeout=90) == [[3.0, 3.0]] * 2


def test_meet_fresh_skips_a_beacon_of_an_earlier_round() -> None:
    import threading

    from shoal.core.rendezvous import StoreClient, StoreServer
    from shoal.torch.meet import meet_fresh
    key = b"k" * 32
    lasting = StoreServer(key).start()  # the store that outlives rounds
    views = [StoreClient("127.0.0.1", lasting.address[1], key, timeout=20) for _ in range(2)]
    dead = StoreServer(key).start()
    views[0].set("shoal/fresh-store", f"127.0.0.1 {dead.address[1]} 0badc0de".encode())
    dead.close()  # the earlier round's rank 0 is gone
    out: dict[int, object] = {}

    def member(rank: int) -> None:
        if rank == 0:
            time.sleep(0.5)  # rank 1 reads the stale beacon first
        out[rank] = meet_fresh(views[rank], rank, "127.0.0.1", key, 20.0)
    threads = [threading.Thread(target=member, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    (c0, close0), (c1, close1) = out[0], out[1]
    c1.set("from-1", b"fresh")
    assert c0.get("from-1", 5) == b"fresh"
    for release in (*close1, *close0):
        release()
    for v in views:
        v.close()
    lasting.close()
