"""Tests of shoalrun: the plan, the worker environment, and whole jobs run end to end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shoal.runner.launch import (
    RESERVED_VARS,
    Job,
    LaunchError,
    WorkerSpec,
    main,
    make_job_id,
    parse_forward,
    parse_hosts,
    plan,
    worker_env,
)

ROOT = Path(__file__).resolve().parents[1]
TAG = re.compile(r"^\[(\d+)\]<(stdout|stderr)>: (.*)$")


# ------------------------------------------------------------------------------------ plan


def test_plan_default_all_local() -> None:
    specs = plan(3, default_host="here")
    assert specs == [WorkerSpec(r, r, 3, 0, 1, "here") for r in range(3)]


def test_plan_hosts_fill_in_order_with_slots() -> None:
    specs = plan(3, parse_hosts("localhost:4"))
    assert [(s.rank, s.local_rank, s.local_size, s.cross_size) for s in specs] == [
        (0, 0, 3, 1), (1, 1, 3, 1), (2, 2, 3, 1)]
    specs = plan(3, [("a", 2), ("b", 2), ("c", 2)], emulate_hosts=True)
    assert [(s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for s in specs] == [
        ("a", 0, 2, 0, 2), ("a", 1, 2, 0, 2), ("b", 0, 1, 1, 2)]


def test_plan_too_few_slots() -> None:
    with pytest.raises(LaunchError, match=r"-np 5 needs 5 slots .* only 4"):
        plan(5, [("a", 2), ("b", 2)], emulate_hosts=True)


def test_plan_marks_remote_hosts() -> None:
    specs = plan(3, [("localhost", 1), ("node-b.invalid", 2)])
    assert [(s.host, s.local, s.cross_rank) for s in specs] == [
        ("localhost", True, 0), ("node-b.invalid", False, 1), ("node-b.invalid", False, 1)]
    emulated = plan(2, [("a", 1), ("b", 1)], emulate_hosts=True)
    assert all(s.local for s in emulated)
    with pytest.raises(LaunchError, match="list it once"):
        plan(2, [("localhost", 1), ("127.0.0.1", 1)])


def test_plan_emulated_hosts_cross_ranks() -> None:
    specs = plan(4, parse_hosts("a:2,b:2"), emulate_hosts=True)
    assert [(s.rank, s.host, s.local_rank, s.local_size, s.cross_rank, s.cross_size)
            for s in specs] == [(0, "a", 0, 2, 0, 2), (1, "a", 1, 2, 0, 2),
                                (2, "b", 0, 2, 1, 2), (3, "b", 1, 2, 1, 2)]


def test_parse_hosts() -> None:
    assert parse_hosts("a:2, b ,c:1") == [("a", 2), ("b", 1), ("c", 1)]
    for bad in ("a:0", "a:x", ":2", "a:1,a:2", ","):
        with pytest.raises(LaunchError):
            parse_hosts(bad)


def test_job_id_is_file_name_safe() -> None:
    assert re.fullmatch(r"[0-9a-f]+-4242", make_job_id(pid=4242))
    assert make_job_id().endswith(f"-{os.getpid()}")


# ------------------------------------------------------------------------------ worker_env


def _job(**kw: object) -> Job:
    base: dict[str, object] = dict(job_id="j1-7", secret="ab" * 32, size=4,
                                   rendezvous_addr="127.0.0.1", rendezvous_port=1234,
                                   master_addr="127.0.0.1", master_port=5678,
                                   start_timeout_s=9.5)
    base.update(kw)
    return Job(**base)  # type: ignore[arg-type]


def test_worker_env_is_complete_and_consistent() -> None:
    spec = WorkerSpec(rank=3, local_rank=1, local_size=2, cross_rank=1, cross_size=2, host="b")
    env = worker_env(spec, _job(), {"PATH": "/bin", "RANK": "99"})
    expect = {
        "PATH": "/bin", "PYTHONUNBUFFERED": "1", "SHOAL_START_TIMEOUT_S": "9.5",
        "SHOAL_JOB_ID": "j1-7", "SHOAL_SECRET": "ab" * 32,
        "SHOAL_RENDEZVOUS_ADDR": "127.0.0.1", "SHOAL_RENDEZVOUS_PORT": "1234",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "5678",
    }
    for names, value in [(("SHOAL_RANK", "RANK", "HOROVOD_RANK"), "3"),
                         (("SHOAL_SIZE", "WORLD_SIZE", "HOROVOD_SIZE"), "4"),
                         (("SHOAL_LOCAL_RANK", "LOCAL_RANK", "HOROVOD_LOCAL_RANK"), "1"),
                         (("SHOAL_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE"), "2"),
                         (("SHOAL_CROSS_RANK", "GROUP_RANK", "HOROVOD_CROSS_RANK"), "1"),
                         (("SHOAL_CROSS_SIZE", "HOROVOD_CROSS_SIZE"), "2")]:
        expect.update(dict.fromkeys(names, value))
    assert env == expect  # nothing missing, nothing extra, the stale RANK overridden
    assert set(RESERVED_VARS) <= set(env)
    emulated = worker_env(spec, _job(emulate_hosts=True), {})
    assert emulated["SHOAL_HOSTNAME"] == "b"


def test_forwarded_variables() -> None:
    parent = {"FOO": "from-parent", "BAR": "x"}
    forward = parse_forward(["FOO", "BAZ=a=b", "EMPTY="], parent)
    assert forward == {"FOO": "from-parent", "BAZ": "a=b", "EMPTY": ""}
    env = worker_env(WorkerSpec(0, 0, 1, 0, 1, "h"), _job(forward=forward), {"FOO": "old"})
    assert (env["FOO"], env["BAZ"], env["EMPTY"]) == ("from-parent", "a=b", "")
    assert "BAR" not in env
    with pytest.raises(LaunchError, match="MISSING"):
        parse_forward(["MISSING"], parent)
    with pytest.raises(LaunchError, match="sets this variable itself"):
        parse_forward(["RANK=3"], parent)


def test_main_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-np", "2"]) == 2
    assert "no command" in capsys.readouterr().err
    assert main(["-np", "2", "-H", "far.invalid:2", "true"]) == 2  # no route: nothing started
    assert "far.invalid" in capsys.readouterr().err
    assert main(["-np", "2", "-x", "SHOAL_TEST_SURELY_UNSET", "true"]) == 2
    assert "SHOAL_TEST_SURELY_UNSET" in capsys.readouterr().err


# -------------------------------------------------------------------------------- end to end


def _cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "shoal.runner", *args]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      env.get("PYTHONPATH")]))
    return env


def _run(*args: str, **extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    proc = subprocess.run(_cmd(*args), capture_output=True, text=True, timeout=60,
                          env=_env(**extra), cwd=ROOT)
    return proc, time.monotonic() - start


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    except PermissionError:  # the pid was reused by someone else's process
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _assert_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 5.0  # orphans are reaped by init, give it a moment
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if _alive(p)] == []


def test_output_is_tagged_and_env_received() -> None:
    prog = ("import os, sys\n"
            "e = os.environ\n"
            "print('env', e['SHOAL_RANK'], e['RANK'], e['HOROVOD_CROSS_RANK'],"
            " e['SHOAL_HOSTNAME'], e['SHOAL_FWD'], e['SHOAL_START_TIMEOUT_S'])\n"
            "print('oops', e['LOCAL_RANK'], file=sys.stderr)\n"
            "for i in range(300): print('line', e['RANK'], i, 'x' * 200)\n")
    proc, _ = _run("-np", "4", "-H", "a:2,b:2", "--emulate-hosts", "--start-timeout", "7",
                   "-x", "SHOAL_FWD", sys.executable, "-c", prog, SHOAL_FWD="fwd-ok")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 4 * 301
    tagged = [TAG.match(line) for line in lines]
    assert all(m and m.group(2) == "stdout" for m in tagged)  # whole lines, never interleaved
    envs = sorted(m.group(3) for m in tagged if m and m.group(3).startswith("env"))
    assert envs == [f"env {r} {r} {r // 2} {'ab'[r // 2]} fwd-ok 7.0" for r in range(4)]
    for m in tagged:
        assert m is not None
        if m.group(3).startswith("line"):
            assert m.group(3).split()[1] == m.group(1)
            assert m.group(3).endswith("x" * 200)
    errs = sorted(line for line in proc.stderr.splitlines() if TAG.match(line))
    assert errs == [f"[{r}]<stderr>: oops {r % 2}" for r in range(4)]


# Ranks other than FAIL start a grandchild, record both pids, then sleep; rank FAIL waits for
# them, leaves a shared-memory file behind, then fails as argv[1] says.
WORKER = """
import os, pathlib, signal, subprocess, sys, time
mode, d, fail = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3])
rank, size = int(os.environ["SHOAL_RANK"]), int(os.environ["SHOAL_SIZE"])
if rank != fail:
    if mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kid = subprocess.Popen(["sleep", "60"])
    (d / f"{rank}.tmp").write_text(f"{os.getpid()} {kid.pid}")
    os.replace(d / f"{rank}.tmp", d / f"{rank}.pids")
    time.sleep(60)
    sys.exit(0)
end = time.time() + 30
while len(list(d.glob("*.pids"))) < size - 1 and time.time() < end:
    time.sleep(0.02)
shm = pathlib.Path(f"/dev/shm/shoal-{os.environ['SHOAL_JOB_ID']}-test")
shm.write_bytes(b"x")
(d / "shm").write_text(str(shm))
if mode == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
sys.exit(3)
"""


def _recorded_pids(d: Path) -> list[int]:
    return [int(p) for f in sorted(d.glob("*.pids")) for p in f.read_text().split()]


def _no_leftover_shm(d: Path) -> None:
    shm = Path((d / "shm").read_text())
    assert shm.name.startswith("shoal-")
    assert not shm.exists()


def test_failure_stops_the_job_fast(tmp_path: Path) -> None:
    proc, took = _run("-np", "3", sys.executable, "-c", WORKER, "exit", str(tmp_path), "1")
    assert proc.returncode == 3, proc.stderr
    assert took < 15
    assert re.search(r"shoalrun: rank 1 \(host .+, pid \d+\) exited with code 3; "
                     r"stopped 2 other workers", proc.stderr), proc.stderr
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 4
    _assert_gone(pids)
    _no_leftover_shm(tmp_path)


def test_worker_killed_by_signal(tmp_path: Path) -> None:
    proc, took = _run("-np", "2", sys.executable, "-c", WORKER, "sigkill", str(tmp_path), "0")
    assert proc.returncode == 137, proc.stderr
    assert took < 15
    assert re.search(r"rank 0 \(host .+\) was killed by SIGKILL; stopped 1 other worker\b",
                     proc.stderr), proc.stderr
    _assert_gone(_recorded_pids(tmp_path))


def test_worker_ignoring_sigterm_is_killed(tmp_path: Path) -> None:
    proc, took = _run("-np", "2", "--kill-grace", "0.5", sys.executable, "-c", WORKER,
                      "ignore", str(tmp_path), "0")
    assert proc.returncode == 3, proc.stderr
    assert 0.5 <= took < 15
    assert "rank 0 (host" in proc.stderr and "stopped 1 other worker" in proc.stderr
    pids = _recorded_pids(tmp_path)
    assert len(pids) == 2
    _assert_gone(pids)
    _no_leftover_shm(tmp_path)


def _signal_when_ready(d: Path, ready: str, sig: signal.Signals, *args: str
                      ) -> tuple[subprocess.Popen[str], str]:
    """Start shoalrun with ``args``; once both workers wrote a ``ready`` file in ``d``, send
    it ``sig``; the process and its stderr when it has ended."""
    proc = subprocess.Popen(_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while len(list(d.glob(ready))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    return proc, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_shoalrun_stops_the_job(tmp_path: Path, sig: signal.Signals) -> None:
    proc, err = _signal_when_ready(tmp_path, "*.pids", sig, "-np", "2", sys.executable, "-c",
                                   WORKER, "sleep", str(tmp_path), "-1")
    assert proc.returncode == 128 + sig, err
    assert f"shoalrun: received {sig.name}; stopped the job (2 running workers)" in err
    _assert_gone(_recorded_pids(tmp_path))


CHECKPOINTING = """
import os, pathlib, signal, sys, time
d = pathlib.Path(sys.argv[1])
rank = os.environ["SHOAL_RANK"]
def stop(signum, frame):  # a scheduler's SIGTERM: write a checkpoint, slower than --kill-grace
    time.sleep(float(sys.argv[2]))
    (d / f"ckpt-{rank}").write_text("done")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(d / f"ready-{rank}").write_text("")
time.sleep(60)
"""


def test_sigterm_to_shoalrun_leaves_time_to_checkpoint(tmp_path: Path) -> None:
    """--stop-grace (30 s), not --kill-grace (5 s), when shoalrun itself is told to stop."""
    proc, err = _signal_when_ready(tmp_path, "ready-*", signal.SIGTERM, "-np", "2",
                                   "--kill-grace", "0.5", sys.executable, "-c", CHECKPOINTING,
                                   str(tmp_path), "2")
    assert proc.returncode == 143, err
    assert "received SIGTERM; stopped the job (2 running workers, every one exited 0)" in err
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-0", "ckpt-1"]
