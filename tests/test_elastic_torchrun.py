"""torchrun's elastic agent restarting a worker group (``--max-restarts=1``) on shoal: a
worker killed once brings the group down and up again, the restarted group trains to the end
on shoal (through ``shoal.torch`` and through the ``"shoal"`` torch.distributed backend), and
nothing of the killed group stays behind: no shared memory, no process."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
    if restart == 0 and rank == 1 and step == 2:
        os.kill(os.getpid(), signal.SIGKILL)
# one write: both workers share torchrun's stdout
sys.stdout.write(f"done {restart} {rank} {size} {[round(float(v), 4) for v in w]}\n")
sys.stdout.flush()
"""


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
