"""Unchanged client code on backend "shoal": PyTorch Lightning's DDP strategy with its
subprocess and spawn launchers, Hugging Face Accelerate on CPU processes, and torchrun
restarting a job after a worker died. Each runs the client's own launcher in a subprocess;
Lightning and Accelerate also run on gloo, and the trained weights must match exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from harness import free_port_pair, port_clash  # noqa: E402

CLIENTS = Path(__file__).parent / "fixtures" / "clients"
BIN = Path(sys.executable).parent


def _run(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHOAL_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env["OMP_NUM_THREADS"] = "1"
    for _attempt in range(3):  # a torchrun port taken between our pick and its bind: again
        proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode == 0 or "--master_port" not in args or \
                not port_clash(proc.stdout + proc.stderr):
            break
        args = list(args)
        args[args.index("--master_port") + 1] = str(free_port_pair())
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = torch.load(a), torch.load(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_lightning_ddp_strategy(tmp_path: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    runs = [("gloo", "subprocess"), ("shoal", "subprocess"), ("shoal", "spawn")]
    for backend, launcher in runs:
        _run([sys.executable, str(CLIENTS / "lightning_fit.py"), backend, launcher,
              str(tmp_path / f"{backend}-{launcher}.pt")], tmp_path)
    for backend, launcher in runs[1:]:
        _same_weights(tmp_path / f"{backend}-{launcher}.pt", tmp_path / "gloo-subprocess.pt")


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
            "--master_port", str(_port()), *args]


def _port() -> int:
    return free_port_pair()


def test_accelerate_on_cpu_processes(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    for backend in ("shoal", "gloo"):
        _run(_torchrun(str(CLIENTS / "accelerate_train.py"), backend,
                       str(tmp_path / f"{backend}.pt")), tmp_path)
    _same_weights(tmp_path / "shoal.pt", tmp_path / "gloo.pt")


def test_torchrun_restarts_after_a_worker_dies(tmp_path: Path) -> None:
    proc = _run(_torchrun("--max-restarts", "1", str(CLIENTS / "torchrun_restart.py"),
                          "shoal"), tmp_path)
    out = proc.stdout + proc.stderr
    assert "attempt 1 rank 0 finished" in out and "attempt 1 rank 1 finished" in out
    assert "attempt 0 rank 0 finished" not in out
