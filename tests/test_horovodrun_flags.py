"""Every horovodrun flag of Horovod 0.28.1 on shoalrun: acted on, taken because what it asks
for is so already, or refused by name with the reason; never "unknown option"."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import run_ranks
from shoal.core import config
from shoal.runner import options
from shoal.runner.common import LaunchError
from shoal.runner.elastic import Blacklist, ElasticOptions, parse_discovery

ROOT = Path(__file__).resolve().parents[1]

#: horovodrun 0.28.1's flags (horovod/runner/launch.py), each spelling, with sample values
HOROVODRUN = {
    ("-v", "--version"): None, ("-np", "--num-proc"): ["2"], ("-cb", "--check-build"): [],
    ("--disable-cache",): [], ("--start-timeout",): ["30"], ("--network-interfaces",): ["lo"],
    ("--network-interface",): ["lo"], ("--output-filename",): ["/tmp/o"], ("--verbose",): [],
    ("--config-file",): ["c.yaml"], ("-p", "--ssh-port"): ["22"],
    ("-i", "--ssh-identity-file"): ["k"], ("--fusion-threshold-mb",): ["32"],
    ("--cycle-time-ms",): ["2"], ("--cache-capacity",): ["1024"],
    ("--hierarchical-allreduce",): [], ("--no-hierarchical-allreduce",): [],
    ("--hierarchical-allgather",): [], ("--no-hierarchical-allgather",): [],
    ("--torus-allreduce",): [], ("--no-torus-allreduce",): [], ("--autotune",): [],
    ("--no-autotune",): [], ("--autotune-log-file",): ["a.csv"],
    ("--autotune-warmup-samples",): ["3"], ("--autotune-steps-per-sample",): ["10"],
    ("--autotune-bayes-opt-max-samples",): ["20"],
    ("--autotune-gaussian-process-noise",): ["0.8"], ("--min-np", "--min-num-proc"): ["1"],
    ("--max-np", "--max-num-proc"): ["4"], ("--slots-per-host",): ["2"],
    ("--elastic-timeout",): ["60"], ("--reset-limit",): ["3"],
    ("--blacklist-cooldown-range",): ["10", "100"], ("--timeline-filename",): ["t.json"],
    ("--timeline-mark-cycles",): [], ("--no-timeline-mark-cycles",): [],
    ("--no-stall-check",): [], ("--stall-check",): [],
    ("--stall-check-warning-time-seconds",): ["30"],
    ("--stall-check-shutdown-time-seconds",): ["90"], ("--mpi-threads-disable",): [],
    ("--no-mpi-threads-disable",): [], ("--mpi-args",): ["--bind-to none"], ("--tcp",): [],
    ("--binding-args",): ["-bind-to none"], ("--num-nccl-streams",): ["2"],
    ("--thread-affinity",): ["0"], ("--gloo-timeout-seconds",): ["30"],
    ("--log-level",): ["INFO"], ("--log-with-timestamp",): [],
    ("--log-without-timestamp",): [],
    ("-prefix-timestamp", "--prefix-output-with-timestamp"): [],
    ("--log-hide-timestamp",): [], ("--no-log-hide-timestamp",): [], ("-H", "--hosts"): ["a:2"],
    ("-hostfile", "--hostfile"): ["h.txt"], ("--host-discovery-script",): ["d.sh"],
    ("--gloo",): [], ("--mpi",): [], ("--jsrun",): [],
}
REFUSED = {"--config-file", "--hierarchical-allgather", "--torus-allreduce", "--autotune",
           "--autotune-log-file", "--autotune-warmup-samples", "--autotune-steps-per-sample",
           "--autotune-bayes-opt-max-samples", "--autotune-gaussian-process-noise",
           "--timeline-mark-cycles", "--mpi-args", "--binding-args", "--num-nccl-streams",
           "--thread-affinity", "--mpi", "--jsrun"}


@pytest.mark.parametrize("spelling", [f for flags in HOROVODRUN for f in flags])
def test_every_horovodrun_flag_is_taken_or_refused_by_name(
        spelling: str, capsys: pytest.CaptureFixture[str]) -> None:
    flags = next(k for k in HOROVODRUN if spelling in k)
    values = HOROVODRUN[flags]
    if values is None:  # -v, --version: the version, as horovodrun prints its own
        with pytest.raises(SystemExit) as exit_:
            options.parse([spelling], {})
        assert exit_.value.code == 0 and capsys.readouterr().out.startswith("shoalrun ")
        return
    argv = [spelling, *values, "prog"]
    if set(flags) & REFUSED:
        with pytest.raises(LaunchError) as refused:
            options.parse(argv, {})
        text = str(refused.value)
        assert flags[-1] in text and "is not supported: " in text
        assert len(text.split("is not supported: ")[1]) > 20  # it says why
        return
    args, _settings = options.parse(argv, {})
    assert args.command == ["prog"]


def test_the_flags_act() -> None:
    _, settings = options.parse([
        "--cache-capacity", "7", "--no-hierarchical-allreduce", "--tcp", "--log-level",
        "TRACE", "--gloo-timeout-seconds", "30", "--stall-check-shutdown-time-seconds", "90",
        "--log-with-timestamp", "prog"], {})
    assert settings == {"SHOAL_NAME_CACHE_SIZE": "7", "SHOAL_ALLREDUCE_ALGORITHM": "flat",
                        "SHOAL_SHM_ENABLE": "0", "SHOAL_LOG_LEVEL": "DEBUG",
                        "SHOAL_TIMEOUT_S": "30.0", "SHOAL_STALL_SHUTDOWN_S": "90.0",
                        "SHOAL_LOG_TIMESTAMPS": "1"}
    cfg = config.load(settings)
    assert (cfg.name_cache_size, cfg.shm_enable, cfg.log_timestamps) == (7, False, True)
    _, settings = options.parse(["--no-stall-check", "prog"], {})
    assert config.load(settings).stall_warning_s == float("inf")
    args, _ = options.parse(["--min-num-proc", "2", "--max-num-proc", "5", "-hostfile", "h",
                             "--slots-per-host", "3", "--blacklist-cooldown-range", "5", "9",
                             "-prefix-timestamp", "prog"], {})
    assert (args.min_np, args.max_np, args.hostfile, args.slots_per_host) == (2, 5, "h", 3)
    assert (args.cooldown_range, args.prefix_timestamp) == ([5, 9], True)
    args, _ = options.parse(["prog"], {"SHOAL_BLACKLIST_COOLDOWN_RANGE": "5 9"})
    assert args.cooldown_range == [5, 9]
    with pytest.raises(LaunchError, match=r"network-interface.*name one"):
        options.parse(["--network-interfaces", "eth0,eth1", "prog"], {})
    with pytest.raises(LaunchError, match="not one of TRACE"):
        options.parse(["--log-level", "LOUD", "prog"], {})


def test_slots_per_host_and_the_cooldown() -> None:
    assert parse_discovery("a\nb:3\n", slots_per_host=2) == [("a", 2), ("b", 3)]
    with pytest.raises(LaunchError, match="MIN <= MAX"):
        ElasticOptions(np=1, min_np=1, max_np=1, cooldown_range=(10, 5)).check()
    with pytest.raises(LaunchError, match="3600"):
        ElasticOptions(np=1, min_np=1, max_np=1, cooldown_range=(1, 7200)).check()
    forever = Blacklist()
    assert forever.add("a", 0.0) == float("inf") and forever.active(1e9) == {"a"}
    timed = Blacklist((10, 100), rng=random.Random(0))
    first = timed.add("a", 0.0)  # 10 * 2 + up to 10 of jitter
    assert 20 <= first <= 30 and timed.active(first - 1) == {"a"}
    assert timed.returned(first - 1) == [] and timed.returned(first) == ["a"]
    assert timed.active(first) == set()
    assert 40 <= timed.add("a", 0.0) <= 50  # doubled for the second blacklisting
    timed.add("a", 0.0)
    assert timed.add("a", 0.0) == 100  # capped at MAX


def _shoalrun(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "shoal.runner", *argv], env=env,
                          capture_output=True, text=True, timeout=120)


def test_prefixed_output_and_refusals_end_to_end() -> None:
    proc = _shoalrun("-np", "2", "--prefix-output-with-timestamp", "--gloo",
                     "--no-autotune", sys.executable, "-c", "print('hello')")
    assert proc.returncode == 0, proc.stderr
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    lines = sorted(proc.stdout.splitlines())
    assert len(lines) == 2 and all(re.fullmatch(stamp + rf"\[{r}\]<stdout>: hello", line)
                                   for r, line in enumerate(lines)), lines
    proc = _shoalrun("-np", "2", "--autotune", sys.executable, "-c", "print('ran')")
    assert proc.returncode == 2 and "--autotune is not supported" in proc.stderr
    assert "ran" not in proc.stdout
    proc = _shoalrun("-np", "1", "--slots-per-host", "2", sys.executable, "-c", "print(1)")
    assert proc.returncode == 2 and "elastic jobs only" in proc.stderr


def _flat_and_log_time(rank: int) -> tuple[str, float, bool]:
    import logging

    import numpy as np

    import shoal
    comm = shoal.communicator()
    total = shoal.allreduce(np.full(5, rank + 1.0), op=shoal.Sum)
    timed = any(h.get_name() == "shoal-timestamps" for h in logging.getLogger("shoal").handlers)
    return comm.algorithm, float(total[0]), timed


@pytest.mark.parametrize("hosts", [["n0", "n0"], ["n0", "n1", "n0", "n1"]])
def test_flat_never_takes_the_hierarchical_allreduce(hosts: list[str]) -> None:
    n = len(hosts)
    got = run_ranks(_flat_and_log_time, n, hosts=hosts, allreduce_algorithm="flat",
                    log_timestamps=True, timeout=60)
    want = "shm" if len(set(hosts)) == 1 else "ring"  # auto would take hierarchical here
    assert got == [(want, n * (n + 1) / 2, True)] * n
