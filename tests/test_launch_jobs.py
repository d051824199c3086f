"""Whole shoalrun jobs of real shoal workers on this machine: 1, 2 and 4 ranks, a crash, a
rank that never joins, per-rank logs, the knob flags, and ``--sagemaker``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TAG = re.compile(r"^\[(\d+)\]<(stdout|stderr)>: (.*)$")

# Each rank allreduces rank+1 (sum: n(n+1)/2) and prints what it learnt about the job.
ALLREDUCE = """
import json, os, sys
import numpy as np
import shoal
shoal.init()
w = shoal.world()
total = shoal.allreduce(np.full(1000, shoal.rank() + 1.0, np.float32), op=shoal.Sum)
keys = ("SHOAL_TIMELINE", "SHOAL_FUSION_THRESHOLD", "SHOAL_CYCLE_TIME_MS")
print("result", json.dumps({"rank": w.rank, "size": w.size, "local": w.local_rank,
                            "cross": w.cross_rank, "host": w.hosts[w.rank],
                            "sum": float(total[0]), "argv": sys.argv[1:],
                            "env": {k: os.environ.get(k) for k in keys}}))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHOAL_", "SM_", "OMPI_", "PMI_", "SLURM_"))}
    env.update(extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      env.get("PYTHONPATH")]))
    return env


def shoalrun(*args: str, timeout: float = 60,
             **extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``python -m shoal.runner *args``; (result, seconds)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "shoal.runner", *args], capture_output=True,
                          text=True, timeout=timeout, env=_env(**extra), cwd=ROOT)
    return proc, time.monotonic() - start


def results(stdout: str) -> list[dict[str, object]]:
    """The ``result`` lines of the workers, by rank; checks the tag matches the rank."""
    out = []
    for line in stdout.splitlines():
        m = TAG.match(line)
        assert m, line
        if m.group(3).startswith("result "):
            data = json.loads(m.group(3)[len("result "):])
            assert data["rank"] == int(m.group(1))
            out.append(data)
    return sorted(out, key=lambda d: int(d["rank"]))  # type: ignore[call-overload]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_local_job_allreduces(n: int) -> None:
    proc, took = shoalrun("-np", str(n), sys.executable, "-c", ALLREDUCE)
    assert proc.returncode == 0, proc.stderr
    got = results(proc.stdout)
    assert [d["rank"] for d in got] == list(range(n))
    assert all(d["sum"] == n * (n + 1) / 2 and d["size"] == n for d in got)
    assert [d["local"] for d in got] == list(range(n))
    assert took < 30


def test_emulated_hosts_flags_and_logs(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    proc, _ = shoalrun("-np", "4", "-H", "a:2,b:2", "--emulate-hosts", "--output-filename",
                       str(logs), "--fusion-threshold-mb", "1", "--cycle-time-ms", "2.5",
                       sys.executable, "-c", ALLREDUCE + "print('to stderr', file=sys.stderr)",
                       SHOAL_TIMELINE=str(tmp_path / "tl.json"))  # the variable reaches them
    assert proc.returncode == 0, proc.stderr
    got = results(proc.stdout)
    assert [(d["host"], d["local"], d["cross"]) for d in got] == [
        ("a", 0, 0), ("a", 1, 0), ("b", 0, 1), ("b", 1, 1)]
    assert all(d["sum"] == 10.0 for d in got)
    assert got[0]["env"] == {"SHOAL_TIMELINE": str(tmp_path / "tl.json"),
                             "SHOAL_FUSION_THRESHOLD": str(1 << 20),
                             "SHOAL_CYCLE_TIME_MS": "2.5"}
    assert sorted(p.name for p in logs.iterdir()) == [f"rank.{r}.log" for r in range(4)]
    for r in range(4):
        text = (logs / f"rank.{r}.log").read_text().splitlines()
        assert sorted(text) == sorted([f"result {json.dumps(got[r])}", "to stderr"])


def test_crashing_worker_ends_the_job_fast() -> None:
    crash = ("import time, shoal\nshoal.init()\nif shoal.rank() == 2:\n"
             "    raise RuntimeError('boom on rank 2')\ntime.sleep(60)\n")
    proc, took = shoalrun("-np", "3", sys.executable, "-c", crash)
    assert proc.returncode == 1
    assert took < 15
    summary = proc.stderr.splitlines()[-1]
    assert re.fullmatch(r"shoalrun: rank 2 \(host .+, pid \d+\) exited with code 1; stopped 2 "
                        r"other workers; its last stderr line: RuntimeError: boom on rank 2",
                        summary), proc.stderr


def test_rank_that_never_joins_times_out() -> None:
    hang = ("import os, time, shoal\nif os.environ['SHOAL_RANK'] == '1':\n"
            "    time.sleep(60)\nshoal.init()\n")
    proc, took = shoalrun("-np", "3", "--start-timeout", "2", "--kill-grace", "1",
                          sys.executable, "-c", hang)
    assert took < 15
    last = proc.stderr.splitlines()[-1]
    if proc.returncode == 124:  # shoalrun noticed first (the usual case)
        assert re.fullmatch(r"shoalrun: rank 1 \(host .+\) did not join the rendezvous within "
                            r"2s .*; stopped the job \(3 running workers\)", last), proc.stderr
    else:  # a waiting rank gave up first: the summary still names the missing rank
        assert "rank 1 (host" in last and "had not joined the rendezvous" in last, proc.stderr


@pytest.mark.xdist_group("sagemaker-port")  # SageMaker's rendezvous is on a fixed port
def test_sagemaker_job(tmp_path: Path) -> None:
    conf = tmp_path / "input/config"
    conf.mkdir(parents=True)
    conf.joinpath("resourceconfig.json").write_text(json.dumps(
        {"current_host": "algo-1", "hosts": ["algo-2", "algo-1"],
         "network_interface_name": "lo"}))
    proc, _ = shoalrun("--sagemaker", "--emulate-hosts", "--verbose", sys.executable, "-c",
                       ALLREDUCE,
                       SAGEMAKER_BASE_DIR=str(tmp_path), SM_NUM_GPUS="2",
                       SM_HPS=json.dumps({"lr": 0.1, "epochs": 3}))
    assert proc.returncode == 0, proc.stderr
    got = results(proc.stdout)
    assert [(d["host"], d["local"]) for d in got] == [("algo-1", 0), ("algo-1", 1),
                                                      ("algo-2", 0), ("algo-2", 1)]
    assert all(d["argv"] == ["--epochs", "3", "--lr", "0.1"] and d["sum"] == 10 for d in got)
    assert "rendezvous 127.0.0.1:" in proc.stderr  # network_interface_name "lo"
    # the same tree seen from algo-2: it only waits for the master's workers (none come)
    conf.joinpath("resourceconfig.json").write_text(json.dumps(
        {"current_host": "algo-2", "hosts": ["algo-2", "algo-1"]}))
    proc, _ = shoalrun("--sagemaker", "--start-timeout", "0.3", "true",
                       SAGEMAKER_BASE_DIR=str(tmp_path), SHOAL_START_TIMEOUT_S="0.3")
    assert proc.returncode == 124
    assert "waiting for the workers that algo-1 starts here" in proc.stderr
    assert "no worker was started here within 0.3s" in proc.stderr
