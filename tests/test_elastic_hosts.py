"""Elastic jobs whose hosts come and go the way horovodrun's integration tests drive them:
a discovery script that answers by the number of epochs rank 0 has logged, two host names of
this machine (``localhost`` and ``127.0.0.1``) as two hosts, and a script that logs, each
epoch, its ``HOROVOD_RANK`` and ``HOROVOD_HOSTNAME`` as of its start, the world's size and how
many times training (re)started. Checked: hosts added then removed, a failure that blacklists
its whole host at once (horovodrun's default), and workers started for a world that cannot
form any more because training has finished are stopped instead of waiting out their start
timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_elastic import ROOT, _env

torch = pytest.importorskip("torch")

MAIN = r"""
import json, os, sys, time
import torch
import shoal.torch as hvd

log, schedule, fail = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
linger = float(sys.argv[4])
hvd.init()
start_rank, hostname = int(os.environ["HOROVOD_RANK"]), os.environ["HOROVOD_HOSTNAME"]
model = torch.nn.Linear(2, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters())
x, y = torch.randn(8, 2), torch.randint(0, 2, (8,))
hosts_at = {e: h for e, h in schedule if e is not None}
default = schedule[-1][1]
epochs = 3


@hvd.elastic.run
def train(state):
    state.rendezvous += 1
    while state.epoch < epochs:
        while state.batch < 4:
            if [state.epoch, state.batch] == fail[:2] and start_rank in fail[2]:
                raise RuntimeError(f"planned failure of the worker started as rank {start_rank}")
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            state.batch += 1
            state.commit()
        if hvd.rank() == 0:
            with open(log, "a") as f:
                f.write(json.dumps({"epoch": state.epoch, "start_rank": start_rank,
                                    "hostname": hostname, "size": hvd.size(),
                                    "rendezvous": state.rendezvous}) + "\n")
            if state.epoch + 1 < epochs and \
                    hosts_at.get(state.epoch, default) != hosts_at.get(state.epoch + 1, default):
                deadline = time.time() + 20  # the driver's notice of the new hosts
                while state._host_messages.empty():
                    assert time.time() < deadline, "no host notice from the driver"
                    time.sleep(0.05)
        state.epoch, state.batch = state.epoch + 1, 0
        state.commit()


state = hvd.elastic.TorchState(model, opt, epoch=0, batch=0, rendezvous=0)
train(state)
time.sleep(linger)  # finished: still running while discovery may add a host
"""


def _job(tmp: Path, schedule: list, *flags: str, fail: list | None = None,
         linger: float = 0.0) -> tuple[list[dict], str]:
    """Run MAIN under shoalrun with a discovery script that follows ``schedule`` (epoch ->
    hosts, None: every later epoch) by the lines of the log; the log's records and stderr."""
    log = tmp / "log.jsonl"
    cases = "".join(f'  {e}) echo "{chr(10).join(h)}" ;;\n' for e, h in schedule
                    if e is not None)
    script = tmp / "discover.sh"
    script.write_text(f'#!/bin/sh\nn=$(cat {log} 2>/dev/null | wc -l | tr -d " ")\n'
                      f'case "$n" in\n{cases}  *) echo "{chr(10).join(schedule[-1][1])}" ;;\n'
                      f"esac\n")
    script.chmod(0o755)
    main = tmp / "main.py"
    main.write_text(MAIN)
    argv = [sys.executable, "-m", "shoal.runner", *flags, "--host-discovery-script",
            str(script), "--discovery-interval", "0.2", sys.executable, str(main), str(log),
            json.dumps(schedule), json.dumps(fail or [-1, -1, []]), str(linger)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=150, cwd=ROOT,
                              env=_env())
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the elastic job hung:\n{exc.stderr}"[-5000:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = log.read_text().splitlines() if log.exists() else []
    return [json.loads(line) for line in lines], proc.stderr


def _fields(records: list[dict]) -> list[tuple]:
    return [(r["start_rank"], r["size"], r["hostname"], r["rendezvous"]) for r in records]


def test_hosts_added_then_removed(tmp_path: Path) -> None:
    schedule = [[0, ["localhost:2"]], [1, ["localhost:2", "127.0.0.1:2"]],
                [None, ["127.0.0.1:2"]]]
    records, stderr = _job(tmp_path, schedule, "-np", "2", "--min-np", "2", "--max-np", "4")
    # rank 0 stays the first localhost worker until its host leaves; then the first worker
    # of 127.0.0.1, which started as rank 2, holds the state
    assert _fields(records) == [(0, 2, "localhost", 1), (0, 4, "localhost", 2),
                                (2, 2, "127.0.0.1", 3)]
    assert "host localhost left discovery" in stderr


def test_a_failure_blacklists_its_whole_host(tmp_path: Path) -> None:
    schedule = [[None, ["localhost:2", "127.0.0.1:2"]]]
    records, stderr = _job(tmp_path, schedule, "-np", "2", "--min-np", "2", "--max-np", "4",
                           fail=[1, 0, [0]])
    assert _fields(records) == [(0, 4, "localhost", 1), (2, 2, "127.0.0.1", 2),
                                (2, 2, "127.0.0.1", 2)]
    assert "host localhost blacklisted after 1 failure" in stderr
    assert "host localhost is blacklisted: stopping worker localhost:1" in stderr


def test_workers_of_a_world_that_cannot_form_are_stopped(tmp_path: Path) -> None:
    # a host appears once training is over (3 epochs logged): its workers are started, but
    # the finished workers will never join their world
    schedule = [[0, ["localhost:2"]], [1, ["localhost:2"]], [2, ["localhost:2"]],
                [None, ["localhost:2", "127.0.0.1:1"]]]
    records, stderr = _job(tmp_path, schedule, "-np", "2", "--min-np", "2", "--max-np", "3",
                           linger=3.0)
    assert _fields(records) == [(0, 2, "localhost", 1)] * 3
    assert "training finished before world 2 formed: stopping worker 127.0.0.1:0" in stderr
    assert "job finished (2 workers exited 0)" in stderr


HOP = r"""
import os, sys, time
from pathlib import Path
import shoal.torch as hvd

marker, me = Path(sys.argv[1]), os.environ["SHOAL_ELASTIC_ID"]
if me == "localhost:0":
    marker.write_text("1")  # discovery now says 3 slots: a third world is coming
elif me == "localhost:1":
    time.sleep(3)  # still starting when the world it was named in is replaced
hvd.init()
print("joined", me, hvd.rank(), hvd.size(), flush=True)
hvd.shutdown()
"""


def test_a_world_replaced_while_its_members_meet(tmp_path: Path) -> None:
    """Worker 0 waits for worker 1 in world 1 when discovery grows the job: it gives up on
    world 1 and meets everyone in world 2 (before, it waited out its start timeout)."""
    marker = tmp_path / "grown"
    script = tmp_path / "discover.sh"
    script.write_text(f'#!/bin/sh\nif [ -f {marker} ]; then echo localhost:3; '
                      f'else echo localhost:2; fi\n')
    script.chmod(0o755)
    main = tmp_path / "hop.py"
    main.write_text(HOP)
    proc = subprocess.run([sys.executable, "-m", "shoal.runner", "-np", "2", "--min-np", "2",
                           "--max-np", "3", "--host-discovery-script", str(script),
                           "--discovery-interval", "0.2", sys.executable, str(main),
                           str(marker)], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**_env(), "SHOAL_START_TIMEOUT_S": "60"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    joined = sorted(line.split()[-3:] for line in proc.stdout.splitlines() if "joined" in line)
    assert joined == [["localhost:0", "0", "3"], ["localhost:1", "1", "3"],
                      ["localhost:2", "2", "3"]], proc.stdout + proc.stderr


def test_a_lone_worker_that_fails_ends_the_job_and_names_the_way_out(tmp_path: Path) -> None:
    """horovodrun's default: a failure blacklists the host, so a one-host job whose worker
    fails has no slot left and ends; the message says which flags keep such a job going."""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o755)
    proc = subprocess.run([sys.executable, "-m", "shoal.runner", "-np", "1", "--min-np", "1",
                           "--max-np", "1", "--host-discovery-script", str(script),
                           sys.executable, "-c", "import sys; sys.exit(3)"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=_env())
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "every worker failed and no slot is left to start one (1 failure; blacklisted: " \
           "localhost): stopping the job" in last, proc.stderr
    assert "--blacklist-after N" in last and "--blacklist-cooldown-range MIN MAX" in last


BOUND = r"""
import json, os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
me = os.environ["SHOAL_ELASTIC_ID"]
with open(out / "cores.jsonl", "a") as f:
    f.write(json.dumps({"id": me, "cores": sorted(os.sched_getaffinity(0))}) + "\n")
if me.endswith(":1") and not (out / "killed").exists():
    (out / "killed").touch()
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(3 if not (out / "killed").exists() or me.endswith(":0") else 0.5)
"""


def test_elastic_workers_are_bound_by_slot_and_replacements_keep_the_share(
        tmp_path: Path) -> None:
    """Each elastic worker holds its slot's share of the cores, as a plain job's local rank
    does: the shares of a host's slots are disjoint and cover the cores, at the start and
    for the worker started in a failed one's place."""
    script = tmp_path / "bound.py"
    script.write_text(BOUND)
    proc = subprocess.run([sys.executable, "-m", "shoal.runner", "-np", "2", "--min-np", "1",
                           "--blacklist-cooldown-range", "1", "1", sys.executable,
                           str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "cores.jsonl").read_text().splitlines()]
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // 2
    want = {f"localhost:{s}": cores[s * share:(s + 1) * share] for s in range(2)}
    assert share >= 1 and not set(want["localhost:0"]) & set(want["localhost:1"])
    assert [r for r in rows if r["cores"] != want[r["id"]]] == [], rows
    assert [r["id"] for r in rows].count("localhost:1") >= 2, (rows, proc.stderr[-2000:])
