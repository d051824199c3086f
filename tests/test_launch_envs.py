"""shoal under other launchers, end to end: two real processes get the environment that
torchrun, Open MPI, MPICH, SLURM or SageMaker would give them (no shoalrun), call
``shoal.init()`` and allreduce. Where ``torchrun`` or ``mpirun`` is installed, it runs too."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from harness import free_port_pair, mpirun, port_clash

ROOT = Path(__file__).resolve().parents[1]
WORKER = """
import json, sys, numpy as np, shoal
from shoal.core import topology
shoal.init()
total = shoal.allreduce(np.full(8, shoal.rank() + 1.0), op=shoal.Sum)
line = json.dumps({"launcher": topology.detect().launcher, "rank": shoal.rank(),
                   "size": shoal.size(), "local": shoal.local_rank(),
                   "cross": shoal.cross_rank(), "sum": float(total[0])})
sys.stdout.write(line + "\\n")  # one write: ranks may share the launcher's pipe
sys.stdout.flush()
"""
_OTHERS = ("SHOAL_", "SM_", "OMPI_", "PMI_", "MPI_LOCAL", "SLURM_", "RANK", "WORLD_SIZE",
           "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_", "MASTER_", "TORCHELASTIC_")


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_OTHERS)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      env.get("PYTHONPATH")]))
    return env


def _free_port(start: int = 0, stop: int = 0) -> int:
    """A free TCP port on 127.0.0.1 (in [start, stop) when given)."""
    for port in range(start, stop) if stop else [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    pytest.skip(f"no free port in {start}..{stop}")


def _parse(stdout: str) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda d: int(d["rank"]))  # type: ignore[call-overload]


def _run_ranks(env_of: Callable[[int], dict[str, str]], n: int = 2) -> list[dict[str, object]]:
    procs = [subprocess.Popen([sys.executable, "-c", WORKER], env={**_base_env(), **env_of(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    outs = []
    try:
        for p in procs:
            out, errs = p.communicate(timeout=60)
            assert p.returncode == 0, errs
            outs.append(out)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return _parse("".join(outs))


def _check(rows: list[dict[str, object]], launcher: str, n: int = 2) -> None:
    assert [r["rank"] for r in rows] == list(range(n)), rows
    assert all(r["launcher"] == launcher and r["size"] == n and r["sum"] == n * (n + 1) / 2
               for r in rows), rows


SECRET = secrets.token_hex(16)


def test_torchrun_environment() -> None:
    port = free_port_pair()  # shoal's store sits on MASTER_PORT + 1 under torchrun
    rows = _run_ranks(lambda r: dict(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                     LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                     MASTER_PORT=str(port), TORCHELASTIC_RUN_ID="t1",
                                     SHOAL_SECRET=SECRET))
    _check(rows, "torchrun")
    assert [r["local"] for r in rows] == [0, 1]


def test_openmpi_environment() -> None:
    port = _free_port()
    rows = _run_ranks(lambda r: dict(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2",
                                     OMPI_COMM_WORLD_LOCAL_RANK=str(r),
                                     OMPI_COMM_WORLD_LOCAL_SIZE="2", MASTER_ADDR="127.0.0.1",
                                     MASTER_PORT=str(port), SHOAL_SECRET=SECRET))
    _check(rows, "openmpi")


def test_mpich_environment() -> None:
    port = _free_port()
    rows = _run_ranks(lambda r: dict(PMI_RANK=str(r), PMI_SIZE="2", MPI_LOCALRANKID=str(r),
                                     MPI_LOCALNRANKS="2", MASTER_ADDR="127.0.0.1",
                                     MASTER_PORT=str(port), SHOAL_SECRET=SECRET))
    _check(rows, "mpich")


def test_slurm_environment() -> None:
    # no address or port given: the first node of the list, port 29400 + job id % 1000
    port = _free_port(29400, 30400)
    job_id = str(7000 + port - 29400)
    rows = _run_ranks(lambda r: dict(SLURM_PROCID=str(r), SLURM_NTASKS="2",
                                     SLURM_LOCALID=str(r), SLURM_NODEID="0", SLURM_NNODES="1",
                                     SLURM_TASKS_PER_NODE="2", SLURM_JOB_NODELIST="localhost",
                                     SLURM_JOB_ID=job_id, SLURM_STEP_ID="0",
                                     SHOAL_SECRET=SECRET))
    _check(rows, "slurm")


@pytest.mark.xdist_group("sagemaker-port")  # SageMaker's rendezvous is on a fixed port
def test_sagemaker_environment(tmp_path: Path) -> None:
    """One process per SageMaker "host", each with its own fake /opt/ml tree."""
    for host in ("algo-1", "algo-2"):
        conf = tmp_path / host / "input/config"
        conf.mkdir(parents=True)
        conf.joinpath("resourceconfig.json").write_text(json.dumps(
            {"current_host": host, "hosts": ["algo-2", "algo-1"],
             "network_interface_name": "lo"}))
    port = _free_port()
    rows = _run_ranks(lambda r: dict(SAGEMAKER_BASE_DIR=str(tmp_path / f"algo-{r + 1}"),
                                     SHOAL_HOSTNAME=f"algo-{r + 1}", MASTER_ADDR="127.0.0.1",
                                     MASTER_PORT=str(port), SHOAL_SECRET=SECRET))
    _check(rows, "sagemaker")
    assert [r["cross"] for r in rows] == [0, 1]


def _run_launcher(argv: list[str], env: dict[str, str]) -> list[dict[str, object]]:
    for _attempt in range(3):  # a port taken between our pick and the launcher's bind: again
        proc = subprocess.run(argv, env={**_base_env(), **env}, capture_output=True,
                              text=True, timeout=90, cwd=ROOT)
        if proc.returncode == 0 or "--master-port" not in argv or \
                not port_clash(proc.stdout + proc.stderr):
            break
        argv = list(argv)
        argv[argv.index("--master-port") + 1] = str(free_port_pair())
    assert proc.returncode == 0, proc.stderr
    return _parse(proc.stdout)


def test_real_torchrun(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port_pair()  # torchrun binds it, shoal's store the next one
    rows = _run_launcher([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--master-port", str(port), str(script)],
                         {"SHOAL_SECRET": SECRET, "OMP_NUM_THREADS": "1"})
    _check(rows, "torchrun")


@pytest.mark.skipif(mpirun() is None, reason="Open MPI's mpirun is not installed")
def test_real_mpirun() -> None:
    version = subprocess.run([mpirun(), "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    if "Open MPI" not in version:
        pytest.skip("mpirun is not Open MPI's")
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    rows = _run_launcher([mpirun(), *as_root, "--oversubscribe", "-np", "2",
                          "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={_free_port()}",
                          "-x", "SHOAL_SECRET", "-x", "PYTHONPATH",
                          sys.executable, "-c", WORKER], {"SHOAL_SECRET": SECRET})
    _check(rows, "openmpi")
