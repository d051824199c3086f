"""Elastic training through ``shoalrun``'s elastic mode: a worker killed with SIGKILL
mid-epoch (the others restore the last commit and finish), a worker that arrives through
host discovery (it receives the state and takes its share), the job failing below
``--min-np``, with ``shoal.torch.elastic`` as a Horovod user writes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_launch_remote import netns as netns_fixture

netns = netns_fixture  # the fixture (root: network namespaces), under its name here

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]

# 48 samples, batch 2, one commit per batch; every rank appends the indices it committed to
# <out>/<worker id>.jsonl (rank 0 also those of the whole step: every rank's batch), and
# prints a digest of the final weights.
TRAIN = r"""
import hashlib, json, os, signal, sys, time
from pathlib import Path

import torch
import shoal.torch as hvd

out, epochs = Path(sys.argv[1]), int(sys.argv[2])
kill_id, kill_at = os.environ.get("KILL_ID"), int(os.environ.get("KILL_AT", "-1"))
pause = float(os.environ.get("STEP_PAUSE", "0"))
me = os.environ["SHOAL_ELASTIC_ID"]
hvd.init()
torch.manual_seed(hvd.rank())  # different initial weights: the first sync makes them rank 0's
x = torch.randn(48, 4, generator=torch.Generator().manual_seed(0))
y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                               named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(range(48), shuffle=True, seed=1)


@hvd.elastic.run
def train(state):
    opt_ = opt
    while state.epoch < epochs:
        loader = torch.utils.data.DataLoader(range(48), batch_size=2, sampler=sampler)
        for batch_idx, idx in enumerate(loader):
            opt_.zero_grad()
            loss = ((model(x[idx]).squeeze(1) - y[idx]) ** 2).mean()
            loss.backward()
            opt_.step()
            sampler.record_batch(batch_idx, 2)
            if me == kill_id and state.epoch == 0 and batch_idx == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-epoch, after a step, before commit
            state.save()  # state.commit(), with the committed step written down between
            with open(out / f"{me}.jsonl", "a") as f:  # this rank's samples, and on rank 0
                f.write(json.dumps({"epoch": state.epoch, "idx": idx.tolist(),  # the step's
                                    "step": [i for shard in sampler.shards  # (all ranks')
                                             for i in shard[2 * batch_idx:2 * batch_idx + 2]]
                                    if hvd.rank() == 0 else None}) + "\n")
            state.check_host_updates()
            time.sleep(pause)
        state.epoch += 1
        sampler.set_epoch(state.epoch)
        state.commit()


state = hvd.elastic.TorchState(model, opt, train_sampler=sampler, epoch=0)
train(state)
w = torch.cat([p.detach().flatten() for p in model.parameters()])
print("final", hvd.rank(), hvd.size(), hashlib.sha256(w.numpy().tobytes()).hexdigest())
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "SM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"),
               SHOAL_HEARTBEAT_TIMEOUT_S="3")
    return env


def _discovery(tmp: Path, text: str) -> Path:
    hosts = tmp / "hosts.txt"
    hosts.write_text(text)
    script = tmp / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {hosts}\n")
    script.chmod(0o755)
    return hosts


def _shoalrun(tmp: Path, *flags: str, epochs: int = 2, env: dict[str, str] | None = None,
              wait: bool = True, timeout: float = 150) -> subprocess.Popen[str] | \
        subprocess.CompletedProcess[str]:
    (tmp / "out").mkdir(exist_ok=True)
    script = tmp / "train.py"
    script.write_text(TRAIN)
    argv = [sys.executable, "-m", "shoal.runner", *flags, sys.executable, str(script),
            str(tmp / "out"), str(epochs)]
    if wait:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                                  env={**_env(), **(env or {})}, cwd=ROOT)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"the elastic job hung:\n{exc.stdout}\n{exc.stderr}"[-5000:])
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**_env(), **(env or {})}, cwd=ROOT)


def _committed(out: Path, whole_steps: bool = True) -> dict[int, list[int]]:
    """The samples of every committed step by epoch (``whole_steps``: as rank 0 of each
    world wrote them), or every rank's own committed samples."""
    seen: dict[int, list[int]] = {}
    for f in out.glob("*.jsonl"):
        for line in f.read_text().splitlines():
            d = json.loads(line)
            if whole_steps and d["step"] is None:
                continue
            seen.setdefault(d["epoch"], []).extend(d["step"] if whole_steps else d["idx"])
    return seen


def _after_steps(tmp: Path, proc: subprocess.Popen[str], lines: int) -> Path:
    """Wait until the job has written ``lines`` committed steps; the output folder."""
    out = tmp / "out"
    deadline = time.monotonic() + 60
    while sum(len(f.read_text().splitlines()) for f in out.glob("*.jsonl")) < lines:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    return out


def _rediscover(tmp: Path, hosts_after: str, *flags: str, pause: str
                ) -> tuple[Path, str, str]:
    """3 local slots, then, after 6 committed steps, discovery says ``hosts_after``; the job
    must end well: (output folder, stdout, stderr)."""
    hosts = _discovery(tmp, "localhost:3\n")
    proc = _shoalrun(tmp, "-np", "3", "--min-np", "2", *flags, "--host-discovery-script",
                     str(tmp / "discover.sh"), "--discovery-interval", "0.2",
                     env={"STEP_PAUSE": pause}, wait=False)
    out = _after_steps(tmp, proc, 6)
    hosts.write_text(hosts_after + "\n")
    stdout, stderr = proc.communicate(timeout=150)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return out, stdout, stderr


def _finals(stdout: str) -> list[tuple[int, int, str]]:
    """``(rank, size, weights digest)`` of every worker that finished."""
    out = []
    for line in stdout.splitlines():
        if "final " in line:
            r, n, digest = line.split("final ", 1)[1].split()[:3]
            out.append((int(r), int(n), digest))
    return sorted(out)


def test_worker_killed_mid_epoch(tmp_path: Path) -> None:
    """3 workers; one SIGKILLs itself after its 4th step of epoch 0, before committing it:
    the other 2 restore the last commit, re-shard the rest of the epoch and finish."""
    _discovery(tmp_path, "localhost:3\n")
    # one host: the lenient policy keeps it (by default its failure would blacklist it)
    proc = _shoalrun(tmp_path, "-np", "3", "--min-np", "2", "--max-np", "3",
                     "--blacklist-after", "2",
                     "--host-discovery-script", str(tmp_path / "discover.sh"),
                     env={"KILL_ID": "localhost:1", "KILL_AT": "3"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "worker localhost:1 failed (signal 9)" in proc.stderr
    seen = _committed(tmp_path / "out")
    assert sorted(seen[0]) == list(range(48))  # epoch 0: every sample once, none lost
    assert sorted(seen[1]) == list(range(48))
    finals = _finals(proc.stdout)
    assert [(r, n) for r, n, _ in finals] == [(0, 2), (1, 2)]
    assert finals[0][2] == finals[1][2]  # identical weights


def test_below_min_np_fails_with_reason(tmp_path: Path) -> None:
    _discovery(tmp_path, "localhost:2\n")
    proc = _shoalrun(tmp_path, "-np", "2", "--min-np", "2", "--max-np", "2",
                     "--blacklist-after", "2",
                     "--host-discovery-script", str(tmp_path / "discover.sh"),
                     "--elastic-timeout", "2",
                     env={"KILL_ID": "localhost:1", "KILL_AT": "2"})
    assert proc.returncode != 0
    assert "only 1 worker (below --min-np 2) for 2s: stopping the job" in proc.stderr


def test_worker_added_through_discovery(tmp_path: Path) -> None:
    """A fourth slot appears in discovery: a new worker starts, the others reset at their
    next commit, it receives the state and takes a share of the rest of the epoch."""
    out, stdout, _ = _rediscover(tmp_path, "localhost:4", "--max-np", "4", pause="0.15")
    new = out / "localhost:3.jsonl"
    assert new.is_file() and new.read_text().strip()  # the new worker took a share
    assert set(_committed(out, whole_steps=False)[1]) == set(range(48))
    seen = _committed(out)
    for epoch in (0, 1):
        assert set(seen[epoch]) == set(range(48))  # padding may repeat up to 3 samples
        assert len(seen[epoch]) - 48 <= 3
    finals = _finals(stdout)
    assert [(r, n) for r, n, _ in finals] == [(r, 4) for r in range(4)]
    assert len({h for _, _, h in finals}) == 1


def test_reset_limit_stops_the_job(tmp_path: Path) -> None:
    _discovery(tmp_path, "localhost:3\n")
    proc = _shoalrun(tmp_path, "-np", "3", "--min-np", "2", "--reset-limit", "0",
                     "--blacklist-after", "2",
                     "--host-discovery-script", str(tmp_path / "discover.sh"),
                     env={"KILL_ID": "localhost:1", "KILL_AT": "1"})
    assert proc.returncode != 0
    assert "reset limit 0 reached (1 resets): stopping the job" in proc.stderr


def test_slot_removed_from_discovery(tmp_path: Path) -> None:
    """Discovery drops a slot: its worker is stopped, the others go on with 2 workers and
    every sample of the epoch is still processed."""
    out, stdout, stderr = _rediscover(tmp_path, "localhost:2", pause="0.1")
    assert "left discovery: stopping worker localhost:2" in stderr
    seen = _committed(out)
    assert sorted(seen[0]) == list(range(48)) and sorted(seen[1]) == list(range(48))
    assert [(r, n) for r, n, _ in _finals(stdout)] == [(0, 2), (1, 2)]


def test_emulated_hosts_lose_a_worker(netns: tuple[str, str, str, str], tmp_path: Path) -> None:
    """Hosts that are network namespaces (root): 2 workers on one, 1 on the other, reached
    through the netns runner; the lone worker of the second host is killed."""
    a, b, bridge, _ = netns
    _discovery(tmp_path, f"{a}:2\n{b}:1\n")
    proc = _shoalrun(tmp_path, "-np", "3", "--min-np", "2", "--host-runner", "netns",
                     "--network-interface", bridge, "--host-discovery-script",
                     str(tmp_path / "discover.sh"), env={"KILL_ID": f"{b}:0", "KILL_AT": "3"},
                     timeout=40)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"worker {b}:0 failed" in proc.stderr
    seen = _committed(tmp_path / "out")
    assert sorted(seen[0]) == list(range(48)) and sorted(seen[1]) == list(range(48))
    finals = _finals(proc.stdout)
    assert [(r, n) for r, n, _ in finals] == [(0, 2), (1, 2)]
    assert finals[0][2] == finals[1][2]


def test_flags_reach_elastic_workers_and_launcher_settings_do_not(tmp_path: Path) -> None:
    script = tmp_path / "env.py"
    script.write_text("import os\nprint('env', os.environ['SHOAL_ELASTIC_ID'], "
                      "os.environ.get('SHOAL_CYCLE_TIME_MS'), os.environ.get('SHOAL_MIN_NP'))\n")
    proc = subprocess.run([sys.executable, "-m", "shoal.runner", "-np", "2",
                           "--cycle-time-ms", "7", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=60,
                          env={**_env(), "SHOAL_MIN_NP": "1"}, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = sorted(line.split("env ", 1)[1] for line in proc.stdout.splitlines() if "env " in line)
    assert got == ["localhost:0 7.0 None", "localhost:1 7.0 None"], proc.stdout
