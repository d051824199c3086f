"""shoalrun's flags and variables, hostfiles, runners, SageMaker parsing and --check-build:
everything that needs no worker process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shoal.core import config
from shoal.runner import options, sagemaker
from shoal.runner.common import ExitCode, LaunchError
from shoal.runner.hosts import interface_address, parse_hostfile, plan
from shoal.runner.launch import Job, main, remote_base_env, worker_env
from shoal.runner.runners import LocalRunner, NetnsRunner, SshRunner, make_runner

# ------------------------------------------------------------------------- flags and variables


def test_every_flag_has_one_variable_and_knobs_exist() -> None:
    variables = [o.variable for o in options.OPTIONS if o.variable]
    # one table; a variable serves two flags only where each sets one of its knob's values
    # (horovodrun's --log-with-timestamp / --log-without-timestamp)
    for var in {v for v in variables if variables.count(v) > 1}:
        assert all((o.knob and o.parse is None) or o.knob == "stall_warning_s"
                   for o in options.OPTIONS if o.variable == var), var
    assert all(v.startswith("SHOAL_") for v in variables)
    # check_build, and horovodrun's flags that shoal takes without acting or refuses
    assert [o.dest for o in options.OPTIONS if not o.variable
            and not (o.noop or o.refuse)] == ["check_build"]
    for o in options.OPTIONS:
        if o.knob:
            assert o.knob in config.KNOBS and o.variable not in options.LAUNCHER_VARS
    flags = [f for o in options.OPTIONS for f in o.flags]
    assert len(flags) == len(set(flags))
    assert {"-np", "-H", "--hostfile", "-p", "-i", "--network-interface", "--start-timeout",
            "--output-filename", "--timeline-filename", "--fusion-threshold-mb",
            "--cycle-time-ms", "--verbose", "--check-build", "-x"} <= set(flags)
    assert "SHOAL_NUM_PROC" in options.describe()


def test_variables_set_options_and_flags_win() -> None:
    env = {"SHOAL_NUM_PROC": "3", "SHOAL_HOSTS": "a:2,b", "SHOAL_VERBOSE": "yes",
           "SHOAL_EXPORT": "A=1 'B=two words'", "SHOAL_KILL_GRACE_S": "0.5"}
    args, settings = options.parse(["python", "x.py"], env)
    assert (args.np, args.hosts, args.verbose, args.kill_grace) == (3, "a:2,b", True, 0.5)
    assert args.forward == ["A=1", "B=two words"]
    assert args.command == ["python", "x.py"] and settings == {}
    args, _ = options.parse(["-np", "2", "-H", "c:2", "-x", "C=3", "--", "prog", "-np"], env)
    assert (args.np, args.hosts, args.forward, args.command) == (2, "c:2", ["C=3"],
                                                                 ["prog", "-np"])
    args, _ = options.parse(["prog"], {})
    assert (args.np, args.kill_grace, args.host_runner, args.forward) == (None, 5.0, "ssh", [])


def test_knob_flags_become_worker_variables() -> None:
    _, settings = options.parse(["--fusion-threshold-mb", "2", "--cycle-time-ms", "3.5",
                                 "--timeline-filename", "/tmp/t.json", "--start-timeout",
                                 "9", "prog"], {})
    assert settings == {"SHOAL_FUSION_THRESHOLD": str(2 << 20), "SHOAL_CYCLE_TIME_MS": "3.5",
                        "SHOAL_TIMELINE": "/tmp/t.json", "SHOAL_START_TIMEOUT_S": "9.0"}
    assert config.load(settings).fusion_threshold == 2 << 20


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--bogus", "prog"], {}, r"^unknown option --bogus \(shoalrun's options go before"),
    (["--start-timout", "3", "prog"], {}, "unknown option --start-timout; did you mean "
                                          "--start-timeout?"),
    (["-np", "x", "prog"], {}, "argument -np/--num-proc: invalid int value: 'x'"),
    (["prog"], {"SHOAL_NUM_PROC": "many"}, "SHOAL_NUM_PROC='many' is not valid for --num-proc"),
    (["prog"], {"SHOAL_VERBOSE": "maybe"}, "SHOAL_VERBOSE='maybe' is not valid"),
])
def test_bad_flags_and_variables(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        options.parse(argv, env)


def test_unknown_flag_is_one_line_and_exit_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "shoal.runner", "-np", "2", "--tieout", "3",
                           "true"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == ExitCode.USAGE
    assert proc.stderr.splitlines() == [
        "shoalrun: error: unknown option --tieout (shoalrun's options go before the command; "
        "see shoalrun --help)"]


def test_unknown_variables_and_launcher_vars_stay_home() -> None:
    found = options.unknown_variables({"SHOAL_NUM_PROCS": "2", "SHOAL_TIMEOUT_S": "1",
                                       "SHOAL_HOSTS": "a", "PATH": "/bin"})
    assert found == ["SHOAL_NUM_PROCS (did you mean SHOAL_NUM_PROC?)"]
    job = Job("j", "s", 1, "127.0.0.1", 1, "127.0.0.1", 2, settings={"SHOAL_TIMELINE": "t"})
    base = {"SHOAL_NUM_PROC": "1", "SHOAL_HOSTS": "a", "SHOAL_TIMEOUT_S": "3", "HOME": "/h",
            "PATH": "/bin", "VIRTUAL_ENV": "/v"}
    env = worker_env(plan(1, default_host="h")[0], job, base)
    assert "SHOAL_NUM_PROC" not in env and "SHOAL_HOSTS" not in env
    assert (env["SHOAL_TIMEOUT_S"], env["SHOAL_TIMELINE"], env["HOME"]) == ("3", "t", "/h")
    assert remote_base_env(base) == {"SHOAL_NUM_PROC": "1", "SHOAL_HOSTS": "a",
                                     "SHOAL_TIMEOUT_S": "3", "PATH": "/bin", "VIRTUAL_ENV": "/v"}


def test_check_build_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check-build"]) == 0
    out = capsys.readouterr().out
    for heading in ("shoal:", "Frameworks:", "Transports:", "Allreduce algorithms:",
                    "GPU support:", "Compression:"):
        assert heading in out
    assert "[X] numpy" in out and "[X] tcp" in out and "[X] ring" in out
    assert "fp16" in out and "bf16" in out and "tensorflow" in out and "CUDA" in out


# ------------------------------------------------------------------------------------ hosts


def test_hostfile(tmp_path: Path) -> None:
    good = tmp_path / "hosts"
    good.write_text("# the cluster\n\nnode-a slots=4\nnode-b   # one slot\n"
                    "node-c slots=2 max_slots=8\n")
    assert parse_hostfile(good) == [("node-a", 4), ("node-b", 1), ("node-c", 2)]
    for line, why in [("node-d slots=0", "slots=N"), ("node-d slots=x", "slots=N"),
                      ("node-d 4", "slots=N"), ("node-d:4", "slots=N"),
                      ("node-a slots=1", "listed twice")]:
        bad = tmp_path / "bad"
        bad.write_text(f"node-a slots=4\n# ok\n{line}\n")
        with pytest.raises(LaunchError, match=f"^{bad}:3: .*{why}"):
            parse_hostfile(bad)
    with pytest.raises(LaunchError, match="cannot read"):
        parse_hostfile(tmp_path / "missing")


def test_bad_hostfile_line_is_one_clear_error(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "hosts"
    bad.write_text("localhost slots=2\nnode-b slots=two\n")
    assert main(["-np", "2", "--hostfile", str(bad), "true"]) == ExitCode.USAGE
    assert capsys.readouterr().err.splitlines() == [
        f"shoalrun: error: {bad}:2: expected 'host slots=N' (N >= 1), got 'node-b slots=two'"]


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-H", "a:1", "--hostfile", "f", "true"]) == ExitCode.USAGE
    assert "not both" in capsys.readouterr().err
    assert main(["true"]) == ExitCode.USAGE
    assert "-np N is required" in capsys.readouterr().err
    assert main(["-np", "1", "--host-runner", "telnet", "true"]) == ExitCode.USAGE
    assert "ssh, netns" in capsys.readouterr().err
    assert main(["-np", "1", "--network-interface", "nope0", "true"]) == ExitCode.USAGE
    assert "no such interface" in capsys.readouterr().err


def test_interface_address() -> None:
    assert interface_address("lo") == "127.0.0.1"


# ---------------------------------------------------------------------------------- runners


def test_ssh_command_line_has_no_secret() -> None:
    runner = make_runner("ssh", ssh_port=2222, ssh_identity_file="/k", connect_timeout=7)
    assert isinstance(runner, SshRunner)
    argv = runner._wrap("node-a", ["python3", "-c", "print('hi there')"])
    assert argv[:-1] == ["ssh", "-T", "-o", "BatchMode=yes", "-o",
                         "StrictHostKeyChecking=accept-new", "-o", "ConnectTimeout=7", "-p",
                         "2222", "-i", "/k", "--", "node-a"]
    assert argv[-1] == "exec python3 -c 'print('\"'\"'hi there'\"'\"')'"
    assert "255: ssh failed" in runner.describe_exit(255)
    assert "killed by SIGKILL on its host" in runner.describe_exit(137)
    assert LocalRunner().describe_exit(-9) == "was killed by SIGKILL"
    assert LocalRunner().describe_exit(137) == "exited with code 137"
    assert isinstance(make_runner("netns"), NetnsRunner)


# -------------------------------------------------------------------------------- SageMaker


def _sm_tree(root: Path, current: str, **extra: object) -> Path:
    conf = root / "input/config"
    conf.mkdir(parents=True)
    conf.joinpath("resourceconfig.json").write_text(json.dumps(
        {"current_host": current, "hosts": ["algo-2", "algo-1"],
         "network_interface_name": "eth7", **extra}))
    conf.joinpath("hyperparameters.json").write_text(json.dumps(
        {"lr": "0.1", "flag": "true", "name": '"x y"', "m": '{"b": 2, "a": 1}'}))
    return root


def test_sagemaker_environment(tmp_path: Path) -> None:
    env = {"SAGEMAKER_BASE_DIR": str(_sm_tree(tmp_path, "algo-1"))}
    assert sagemaker.detected(env) and not sagemaker.detected({"SAGEMAKER_BASE_DIR": "/no"})
    sm = sagemaker.load(env)
    assert (sm.hosts, sm.master, sm.network_interface, sm.num_gpus) == (
        ("algo-1", "algo-2"), "algo-1", "eth7", 1)
    assert sagemaker.hyperparameter_args(sm.hyperparameters) == [
        "--flag", "True", "--lr", "0.1", "-m", "a=1,b=2", "--name", "x y"]
    env.update(SM_HOSTS='["b", "a", "c"]', SM_CURRENT_HOST="c", SM_NUM_GPUS="8",
               SM_HPS='{"epochs": 3, "batch-size": 64}', SM_NETWORK_INTERFACE_NAME="eth0")
    sm = sagemaker.load(env)
    assert (sm.hosts, sm.current_host, sm.num_gpus, sm.network_interface) == (
        ("a", "b", "c"), "c", 8, "eth0")
    assert sagemaker.hyperparameter_args(sm.hyperparameters) == [
        "--batch-size", "64", "--epochs", "3"]
    with pytest.raises(LaunchError, match="not among the hosts"):
        sagemaker.load({**env, "SM_CURRENT_HOST": "z"})


def test_sagemaker_worker_host_waits_for_the_master(tmp_path: Path) -> None:
    assert sagemaker.wait_for_workers(tmp_path, first_timeout=0.2, poll_s=0.05) is False
    # a "bootstrap" that is not our child (as on SageMaker), alive for 0.6 s
    pid = subprocess.run(["sh", "-c", "sleep 0.6 >/dev/null 2>&1 & echo $!"], text=True,
                         capture_output=True, timeout=10).stdout.strip()
    (tmp_path / "job-1.pid").write_text(pid)
    (tmp_path / "old-0.pid").write_text("999999999")  # a dead bootstrap's leftover
    assert sagemaker.wait_for_workers(tmp_path, first_timeout=5, poll_s=0.05) is True
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_readme_lists_every_flag_and_variable() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Launching"):readme.index("\n## ", readme.index(
        "## Launching") + 1)]
    for o in options.OPTIONS:
        assert f"`{o.flags[0]}" in section, o.flags
        assert o.variable is None or f"`{o.variable}`" in section, o.variable


def test_cpu_binding_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.runner.bootstrap import bound, cpu_share
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4})

    def share(rank: int, size: int, mode: str | None = None) -> list[int] | None:
        env = {"SHOAL_LOCAL_RANK": str(rank), "SHOAL_LOCAL_SIZE": str(size)}
        if mode is not None:
            env["SHOAL_CPU_BIND"] = mode
        return cpu_share(env)

    assert [share(r, 2) for r in range(2)] == [[0, 1], [2, 3]]  # equal shares, 1 core spare
    assert [share(r, 5) for r in range(5)] == [[0], [1], [2], [3], [4]]
    assert share(6, 7) is None                        # more workers than cores: unbound
    assert share(6, 7, "core") == [1]                 # ... unless asked: round robin
    assert share(0, 2, "none") is None and share(0, 2, "NONE") is None
    assert cpu_share({}) is None                      # not started by shoalrun
    assert bound({"SHOAL_LOCAL_RANK": "0", "SHOAL_LOCAL_SIZE": "2"}) is not None
    with pytest.raises(config.ConfigError, match="auto, core, none"):
        config.load({"SHOAL_CPU_BIND": "socket"})


def test_workers_run_bound(tmp_path: Path) -> None:
    script = tmp_path / "aff.py"
    script.write_text("import os\nprint('cores', sorted(os.sched_getaffinity(0)))\n")
    available = sorted(__import__("os").sched_getaffinity(0))
    proc = subprocess.run([sys.executable, "-m", "shoal.runner", "-np", "2", sys.executable,
                           str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = sorted(line.split("cores ", 1)[1] for line in proc.stdout.splitlines()
                  if "cores " in line)
    half = len(available) // 2
    if half:
        assert seen == sorted([str(available[:half]), str(available[half:2 * half])]), seen


def test_console_segments_and_status_line() -> None:
    """shoalrun on a terminal: ``\\r`` redraws become one status line, erased around lines."""
    import io
    import threading

    from shoal.runner.console import StatusLine, split_segments

    assert split_segments(b"a\nb\r\nbar 1\rbar 2\rtail") == (
        [(b"a", True), (b"b", True), (b"bar 1", False), (b"bar 2", False)], b"tail")
    assert split_segments(b"bar\r") == ([], b"bar\r")  # may be the start of \r\n
    assert split_segments(b"bar\r", final=True) == ([(b"bar", False)], b"")
    out = io.BytesIO()
    console = StatusLine(threading.Lock(), lambda _o, data: out.write(data))
    err_, out_ = io.StringIO(), io.StringIO()  # which stream: the writer above ignores it
    console.status(err_, b"[0]<stderr>: 50%|##  |")
    console.line(out_, b"[0]<stdout>: epoch 1\n")
    console.status(err_, b"[0]<stderr>:       ")  # the bar closed: nothing is redrawn
    console.line(out_, b"[1]<stdout>: done\n")
    assert out.getvalue() == (b"\r\x1b[K[0]<stderr>: 50%|##  |" + b"\r\x1b[K[0]<stdout>: epoch 1\n"
                              b"\r\x1b[K[0]<stderr>: 50%|##  |" + b"\r\x1b[K"
                              b"[1]<stdout>: done\n")
