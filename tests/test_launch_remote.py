"""Remote hosts: jobs whose hosts are network namespaces of this machine (the ``netns``
runner, root only) and jobs through a stand-in ``ssh`` that runs its command here in a bare
environment (the ``ssh`` runner, with the same bootstrap a real ssh would start)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_launch_jobs import ALLREDUCE, ROOT, TAG, _env, results, shoalrun

# -------------------------------------------------------------------- network namespaces


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def netns() -> Iterator[tuple[str, str, str, str]]:
    """Two namespaces on a bridge: (namespace a, namespace b, bridge, bridge address)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = str(os.getpid() % 100000)
    net = f"10.213.{os.getpid() % 250}"
    bridge, names = f"shbr{tag}", [f"shoal-{tag}-{x}" for x in "ab"]
    steps = [("link", "add", bridge, "type", "bridge"),
             ("addr", "add", f"{net}.254/24", "dev", bridge), ("link", "set", bridge, "up")]
    for i, ns in enumerate(names):
        outer, inner = f"sh{tag}{'ab'[i]}0", f"sh{tag}{'ab'[i]}1"
        steps += [("netns", "add", ns), ("link", "add", outer, "type", "veth", "peer", "name",
                                         inner),
                  ("link", "set", inner, "netns", ns), ("link", "set", outer, "master", bridge),
                  ("link", "set", outer, "up"),
                  ("-n", ns, "addr", "add", f"{net}.{i + 1}/24", "dev", inner),
                  ("-n", ns, "link", "set", inner, "up"), ("-n", ns, "link", "set", "lo", "up")]

    def teardown() -> None:
        for args in [("netns", "del", ns) for ns in names] + [("link", "del", bridge)]:
            subprocess.run(["ip", *args], capture_output=True, timeout=10)

    try:
        for step in steps:
            _ip(*step)
    except (subprocess.CalledProcessError, OSError, subprocess.TimeoutExpired) as exc:
        teardown()
        pytest.skip(f"cannot build network namespaces here: {exc}")
    try:
        yield names[0], names[1], bridge, f"{net}.254"
    finally:
        teardown()


@pytest.mark.parametrize("how", ["route", "interface"])
def test_job_across_namespaces(netns: tuple[str, str, str, str], how: str) -> None:
    a, b, bridge, addr = netns
    extra = ["--network-interface", bridge] if how == "interface" else []
    proc, took = shoalrun("-np", "4", "-H", f"{a}:2,{b}:2", "--host-runner", "netns",
                          "--verbose", *extra, sys.executable, "-c", ALLREDUCE)
    assert proc.returncode == 0, proc.stderr
    got = results(proc.stdout)
    assert [(d["host"], d["local"], d["cross"]) for d in got] == [
        (a, 0, 0), (a, 1, 0), (b, 0, 1), (b, 1, 1)]
    assert all(d["sum"] == 10.0 for d in got)
    assert f"rendezvous {addr}:" in proc.stderr  # the bridge, not 0.0.0.0 or loopback
    assert took < 30


# Every rank records its pid, then the crashing rank fails; the others sleep.
SLEEPERS = """
import os, pathlib, sys, time
import shoal
d, crash = pathlib.Path(sys.argv[1]), int(sys.argv[2])
shoal.init()
(d / f"{shoal.rank()}.pid").write_text(str(os.getpid()))
if shoal.rank() == crash:
    while len(list(d.glob("*.pid"))) < shoal.size():
        time.sleep(0.02)
    pathlib.Path(f"/dev/shm/shoal-{os.environ['SHOAL_JOB_ID']}-test").write_bytes(b"x")
    sys.exit(5)
time.sleep(60)
"""


def _pids(d: Path, n: int, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(list(d.glob("*.pid"))) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return [int(p.read_text()) for p in d.glob("*.pid")]


def _gone(pids: list[int], timeout: float = 10) -> list[int]:
    """The pids still running after ``timeout`` seconds (zombies count as gone)."""
    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    deadline = time.monotonic() + timeout
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def test_remote_crash_stops_every_namespace(netns: tuple[str, str, str, str],
                                            tmp_path: Path) -> None:
    a, b, _, _ = netns
    proc, took = shoalrun("-np", "4", "-H", f"{a}:2,{b}:2", "--host-runner", "netns",
                          sys.executable, "-c", SLEEPERS, str(tmp_path), "3")
    assert proc.returncode == 5, proc.stderr
    assert took < 20
    assert re.fullmatch(rf"shoalrun: rank 3 \(host {b}\) exited with code 5; stopped 3 other "
                        r"workers", proc.stderr.splitlines()[-1]), proc.stderr
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 4 and _gone(pids) == []
    assert not list(Path("/dev/shm").glob("shoal-*-test"))


def test_killed_launcher_leaves_no_remote_worker(netns: tuple[str, str, str, str],
                                                 tmp_path: Path) -> None:
    a, b, _, _ = netns
    proc = subprocess.Popen([sys.executable, "-m", "shoal.runner", "-np", "2", "-H",
                             f"{a}:1,{b}:1", "--host-runner", "netns", "--kill-grace", "1",
                             sys.executable, "-c", SLEEPERS, str(tmp_path), "-1"],
                            env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        pids = _pids(tmp_path, 2)
        assert len(pids) == 2
    finally:
        proc.kill()  # SIGKILL: shoalrun cannot clean up; the bootstraps see their stdin close
        proc.wait()
    assert _gone(pids) == []


# --------------------------------------------------------------------- a stand-in for ssh

FAKE_SSH = """#!/bin/sh
# Runs the remote command here, as host "$host", in a bare environment like sshd's.
printf '%s\\n' "$*" >> "$FAKE_SSH_LOG"
while [ "$1" != "--" ]; do shift; done; shift
host=$1; shift
if [ "$host" = unreachable ]; then
    echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255
fi
exec env -i HOME=/ SHOAL_HOSTNAME="$host" sh -c "$*"
"""


@pytest.fixture
def fake_ssh(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """Environment variables that put the stand-in ``ssh`` first on PATH, and its log."""
    bindir, log = tmp_path / "bin", tmp_path / "ssh.log"
    bindir.mkdir()
    (bindir / "ssh").write_text(FAKE_SSH)
    (bindir / "ssh").chmod(0o755)
    return {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
            "FAKE_SSH_LOG": str(log)}, log


def test_ssh_job(fake_ssh: tuple[dict[str, str], Path], tmp_path: Path) -> None:
    env, log = fake_ssh
    key = tmp_path / "id_test"
    proc, _ = shoalrun("-np", "4", "-H", "node-a:2,node-b:2", "--network-interface", "lo",
                       "-p", "2222", "-i", str(key), "--remote-python", sys.executable,
                       "-x", "FORWARDED=yes", sys.executable, "-c",
                       ALLREDUCE + "import os; print('env', os.environ['FORWARDED'], os.getcwd())",
                       **env)
    assert proc.returncode == 0, proc.stderr
    got = results(proc.stdout)
    assert [(d["host"], d["cross"]) for d in got] == [("node-a", 0), ("node-a", 0),
                                                      ("node-b", 1), ("node-b", 1)]
    assert all(d["sum"] == 10.0 for d in got)
    assert proc.stdout.count(f"env yes {ROOT}") == 4  # -x and the working directory arrive
    lines = log.read_text().splitlines()
    assert len(lines) == 4
    for line in lines:  # the command lines that ssh saw: options, host, the short stub
        assert line.startswith(f"-T -o BatchMode=yes -o StrictHostKeyChecking=accept-new "
                               f"-o ConnectTimeout=120 -p 2222 -i {key} -- node-")
        assert "SHOAL" not in line and not re.search(r"[0-9a-f]{32}", line)  # no secret


def test_ssh_failure_names_rank_and_host(fake_ssh: tuple[dict[str, str], Path]) -> None:
    env, _ = fake_ssh
    proc, took = shoalrun("-np", "2", "-H", "node-a:1,unreachable:1", "--network-interface",
                          "lo", "--remote-python", sys.executable, sys.executable, "-c",
                          "import time, shoal; shoal.init(); time.sleep(60)", **env)
    assert proc.returncode == 255
    assert took < 20
    assert proc.stderr.splitlines()[-1] == (
        "shoalrun: rank 1 (host unreachable) exited with code 255: ssh failed (see its stderr "
        "above); stopped 1 other worker; its last stderr line: ssh: connect to host "
        "unreachable port 22: Connection refused")


# ----------------------------------------------------------------------- a real sshd


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[tuple[dict[str, str], str, int, Path]]:
    """A private sshd on 127.0.0.2 whose sessions see host name ``sshd-host``.

    Yields (environment for shoalrun, host, port, identity file). ``ssh`` on PATH is a
    wrapper that keeps known host keys in ``tmp_path``, away from ``~/.ssh``.
    """
    sshd_bin, keygen = Path("/usr/sbin/sshd"), shutil.which("ssh-keygen")
    if os.geteuid() != 0 or not sshd_bin.exists() or not keygen or not shutil.which("unshare") \
            or not shutil.which("ssh"):
        pytest.skip("needs root, sshd, ssh, ssh-keygen and unshare")
    for name in ("hostkey", "id_test"):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)],
                       check=True, timeout=30)
    (tmp_path / "authorized_keys").write_text((tmp_path / "id_test.pub").read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    (tmp_path / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.2\nHostKey {tmp_path}/hostkey\n"
        f"AuthorizedKeysFile {tmp_path}/authorized_keys\nPermitRootLogin prohibit-password\n"
        f"PasswordAuthentication no\nStrictModes no\nUsePAM no\nPidFile none\n")
    Path("/run/sshd").mkdir(exist_ok=True)
    server = subprocess.Popen(["unshare", "--uts", "sh", "-c", f"hostname sshd-host && exec "
                               f"{sshd_bin} -D -e -f {tmp_path}/sshd_config"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -o "
                                f"UserKnownHostsFile={tmp_path}/known_hosts \"$@\"\n")
    (bindir / "ssh").chmod(0o755)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.2", port)) == 0:
                    break
            if server.poll() is not None:
                pytest.skip("sshd did not start")
            time.sleep(0.05)
        env = {"PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}
        yield env, "127.0.0.2", port, tmp_path / "id_test"
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_real_ssh(sshd: tuple[dict[str, str], str, int, Path], tmp_path: Path) -> None:
    env, host, port, key = sshd
    ssh = ["-p", str(port), "-i", str(key), "--remote-python", sys.executable]
    proc, _ = shoalrun("-np", "3", "-H", f"localhost:1,{host}:2", *ssh, sys.executable, "-c",
                       ALLREDUCE, **env)
    assert proc.returncode == 0, proc.stderr
    got = results(proc.stdout)
    assert [(d["host"], d["cross"]) for d in got] == [
        (socket.gethostname(), 0), ("sshd-host", 1), ("sshd-host", 1)]
    assert all(d["sum"] == 6.0 for d in got)
    pids = tmp_path / "pids"
    pids.mkdir()
    proc, took = shoalrun("-np", "3", "-H", f"localhost:1,{host}:2", *ssh, sys.executable,
                          "-c", SLEEPERS, str(pids), "0", **env)
    assert proc.returncode == 5 and took < 20, proc.stderr
    assert "rank 0 (host localhost, pid" in proc.stderr.splitlines()[-1]
    assert _gone([int(p.read_text()) for p in pids.glob("*.pid")]) == []


# ------------------------------------------------------- SageMaker across two hosts by ssh

SM_WORKER = ALLREDUCE + """
print("smenv", json.dumps({"rank": shoal.rank(), "argv": sys.argv[1:],
                           "sm": {k: v for k, v in os.environ.items()
                                  if k.startswith(("SM_", "SAGEMAKER_", "AWS_"))}}))
"""


def _sagemaker_tree(base: Path, current: str) -> None:
    """``/opt/ml`` as SageMaker lays it out for a 2-host job (``input/config/*.json``, the
    hyperparameters JSON-encoded as strings, the channels' directories)."""
    conf = base / "input/config"
    conf.mkdir(parents=True, exist_ok=True)
    conf.joinpath("resourceconfig.json").write_text(json.dumps({
        "current_host": current, "current_instance_type": "ml.p4d.24xlarge",
        "current_group_name": "homogeneousCluster", "hosts": ["algo-2", "algo-1"],
        "instance_groups": [{"instance_group_name": "homogeneousCluster",
                             "instance_type": "ml.p4d.24xlarge",
                             "hosts": ["algo-2", "algo-1"]}],
        "network_interface_name": "lo"}))
    conf.joinpath("hyperparameters.json").write_text(json.dumps({
        "max_epochs": "3", "lr_init": "0.016", "use_amp": "true",
        "sagemaker_program": '"train.py"', "sagemaker_region": '"us-west-2"',
        "sagemaker_submit_directory": '"s3://bucket/job/source/sourcedir.tar.gz"',
        "sagemaker_job_name": '"job-1"', "sagemaker_container_log_level": "20"}))
    conf.joinpath("inputdataconfig.json").write_text(json.dumps({
        name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
               "RecordWrapperType": "None"} for name in ("train", "eval")}))
    for d in ("input/data/train", "input/data/eval", "model", "output/data"):
        (base / d).mkdir(parents=True, exist_ok=True)


@pytest.mark.xdist_group("sagemaker-port")  # SageMaker's rendezvous is on a fixed port
@pytest.mark.parametrize("toolkit", [False, True])
def test_sagemaker_two_hosts(fake_ssh: tuple[dict[str, str], Path], tmp_path: Path,
                             toolkit: bool) -> None:
    """algo-1 (the master, this machine) starts 2 workers here and 2 on algo-2 through ssh
    (a bare environment there): every worker sees SageMaker's whole environment, naming its
    own host, and the script's arguments carry no reserved sagemaker_* hyperparameter. With
    ``toolkit``, shoalrun itself runs under the training toolkit's SM_* variables (a FastFile
    channel path among them), which reach algo-2 as they are."""
    env, _ = fake_ssh
    base = tmp_path / "opt/ml"
    _sagemaker_tree(base, "algo-1")
    extra = {"SAGEMAKER_BASE_DIR": str(base), "SM_NUM_GPUS": "2",
             "AWS_REGION": "us-west-2", "TRAINING_JOB_NAME": "job-1"}
    if toolkit:
        extra.update(SM_CHANNEL_TRAIN="/fsx/imagenet/train", SM_CHANNELS='["eval","train"]',
                     SM_LOG_LEVEL="20", SM_HPS=json.dumps({"max_epochs": 3, "lr_init": 0.016,
                                                           "use_amp": True}))
    proc, _ = shoalrun("--sagemaker", "--remote-python", sys.executable, sys.executable, "-c",
                       SM_WORKER, **env, **extra)
    assert proc.returncode == 0, proc.stderr
    got = results(proc.stdout)
    # algo-1's workers run here, under this machine's own name
    assert [(d["cross"], d["local"]) for d in got] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [d["host"] for d in got][2:] == ["algo-2", "algo-2"]
    assert all(d["sum"] == 10.0 for d in got)
    seen = {}
    for line in proc.stdout.splitlines():
        text = TAG.match(line).group(3)
        if text.startswith("smenv "):
            item = json.loads(text[len("smenv "):])
            seen[item["rank"]] = item
    assert sorted(seen) == [0, 1, 2, 3]
    train = "/fsx/imagenet/train" if toolkit else str(base / "input/data/train")
    for rank, item in seen.items():
        host, sm = ("algo-1", "algo-2")[rank // 2], item["sm"]
        assert item["argv"] == ["--lr_init", "0.016", "--max_epochs", "3", "--use_amp",
                                "True"], item["argv"]
        assert sm["SM_CURRENT_HOST"] == host
        assert json.loads(sm["SM_HOSTS"]) == ["algo-1", "algo-2"]
        assert sm["SM_CHANNEL_TRAIN"] == train
        assert sm["SM_CHANNEL_EVAL"] == str(base / "input/data/eval")
        assert json.loads(sm["SM_CHANNELS"]) == ["eval", "train"]
        assert sm["SM_MODEL_DIR"] == str(base / "model")
        assert sm["SM_OUTPUT_DATA_DIR"] == str(base / "output/data")
        assert json.loads(sm["SM_HPS"]) == {"max_epochs": 3, "lr_init": 0.016, "use_amp": True}
        assert sm["SM_HP_LR_INIT"] == "0.016" and "SM_HP_SAGEMAKER_PROGRAM" not in sm
        assert json.loads(sm["SM_FRAMEWORK_PARAMS"])["sagemaker_region"] == "us-west-2"
        assert json.loads(sm["SM_RESOURCE_CONFIG"])["current_host"] == host
        training_env = json.loads(sm["SM_TRAINING_ENV"])
        assert training_env["current_host"] == host
        assert training_env["is_master"] == (host == "algo-1")
        assert sm["SM_NUM_GPUS"] == "2" and sm["SM_NETWORK_INTERFACE_NAME"] == "lo"
        assert sm["SAGEMAKER_BASE_DIR"] == str(base) and sm["AWS_REGION"] == "us-west-2"
