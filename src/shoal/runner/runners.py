"""How shoalrun starts a process on a host: one small interface, three implementations.

``local`` runs on this machine. ``ssh`` runs on a remote host through the system ``ssh``
client; ``netns`` runs in a network namespace of this machine (``ip netns exec <host>``), so
that tests can build a multi-host job on one machine. Both remote kinds start
:mod:`shoal.runner.bootstrap` and hand it the worker's command, environment and working
directory on stdin: nothing secret is ever on a command line, and a worker whose shoalrun or
ssh connection is gone is stopped by its bootstrap.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import ClassVar

from .bootstrap import bound
from .common import LaunchError

__all__ = ["RUNNERS", "HostRunner", "LocalRunner", "NetnsRunner", "SshRunner", "make_runner"]

_BOOTSTRAP = Path(__file__).with_name("bootstrap.py")
_STUB = "import json,sys;exec(json.loads(sys.stdin.buffer.readline()))"
"""The remote command line: it runs the bootstrap's source, the first line on its stdin."""


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class HostRunner(ABC):
    """Starts processes on hosts of one kind; every process leads its own process group."""

    name: ClassVar[str]
    remote: ClassVar[bool] = True

    @abstractmethod
    def popen(self, host: str, argv: Sequence[str], env: Mapping[str, str],
              cwd: str) -> subprocess.Popen[bytes]:
        """Start ``argv`` on ``host`` with exactly ``env`` (local) or the host's environment
        updated by ``env`` (remote); stdout and stderr are pipes."""

    def address(self, host: str) -> str:
        """How other machines reach ``host`` (a name or an address)."""
        return host

    def cleanup(self, host: str, shell_command: str) -> subprocess.Popen[bytes]:
        """Run a short shell command on ``host`` (output discarded), e.g. to remove files."""
        return subprocess.Popen(self._wrap(host, ["sh", "-c", shell_command]),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)

    def describe_exit(self, code: int) -> str:
        """What an exit status of the process returned by :meth:`popen` means."""
        if code < 0:
            return f"was killed by {_signal_name(-code)}"
        if self.remote and code > 128:
            return f"exited with code {code} (killed by {_signal_name(code - 128)} on its host)"
        return f"exited with code {code}"

    def _wrap(self, host: str, argv: Sequence[str]) -> list[str]:
        """The local command line that runs ``argv`` on ``host``."""
        return list(argv)


class LocalRunner(HostRunner):
    """Runs processes on this machine."""

    name = "local"
    remote = False

    def popen(self, host: str, argv: Sequence[str], env: Mapping[str, str],
              cwd: str) -> subprocess.Popen[bytes]:
        """Start ``argv`` here with exactly ``env``."""
        return subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, preexec_fn=bound(dict(env)))


class _BootstrapRunner(HostRunner):
    """A runner that starts :mod:`shoal.runner.bootstrap` and feeds it the job on stdin."""

    def __init__(self, python: str, grace: float) -> None:
        self.python, self.grace = python, grace

    def popen(self, host: str, argv: Sequence[str], env: Mapping[str, str],
              cwd: str) -> subprocess.Popen[bytes]:
        """Start the bootstrap on ``host``; its stdin stays open for the worker's lifetime."""
        command = self._wrap(host, [self.python, "-c", _STUB])
        local_env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
        proc = subprocess.Popen(command, env=local_env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        payload = {"argv": list(argv), "env": self._env(host, env), "cwd": cwd,
                   "grace": self.grace}
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(_BOOTSTRAP.read_text()).encode() + b"\n"
                             + json.dumps(payload).encode() + b"\n")
            proc.stdin.flush()
        except OSError:
            pass  # it died at once; its exit status and stderr tell why
        return proc

    def _env(self, host: str, env: Mapping[str, str]) -> dict[str, str]:
        return dict(env)


class SshRunner(_BootstrapRunner):
    """Runs processes on remote hosts with the system ``ssh`` client (no password prompts)."""

    name = "ssh"

    def __init__(self, python: str | None = None, grace: float = 5.0, *,
                 port: int | None = None, identity_file: str | None = None,
                 connect_timeout: float = 30.0) -> None:
        super().__init__(python or "python3", grace)
        self.port, self.identity_file = port, identity_file
        self.connect_timeout = max(1, int(connect_timeout))

    def ssh_argv(self, host: str) -> list[str]:
        """``ssh`` and its options, up to and including the host."""
        argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new",
                "-o", f"ConnectTimeout={self.connect_timeout}"]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file:
            argv += ["-i", self.identity_file]
        return [*argv, "--", host]

    def _wrap(self, host: str, argv: Sequence[str]) -> list[str]:
        return [*self.ssh_argv(host), "exec " + shlex.join(argv)]  # one string for the shell

    def describe_exit(self, code: int) -> str:
        """255 is ssh's own failure (host unreachable, authentication refused)."""
        if code == 255:
            return "exited with code 255: ssh failed (see its stderr above)"
        return super().describe_exit(code)


class NetnsRunner(_BootstrapRunner):
    """Runs processes in the network namespace named like the host (root only; for tests).

    Namespaces share this machine's host name, so each worker gets ``SHOAL_HOSTNAME=<host>``
    unless the job sets it.
    """

    name = "netns"

    def __init__(self, python: str | None = None, grace: float = 5.0) -> None:
        super().__init__(python or sys.executable, grace)

    def _wrap(self, host: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", host, *argv]

    def _env(self, host: str, env: Mapping[str, str]) -> dict[str, str]:
        return {"SHOAL_HOSTNAME": host, **env}

    def address(self, host: str) -> str:
        """The first global IPv4 address inside namespace ``host``."""
        try:
            out = subprocess.run(["ip", "-n", host, "-4", "-o", "addr", "show", "scope",
                                  "global"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise LaunchError(f"netns runner: cannot run ip: {exc}") from None
        for line in out.stdout.splitlines():
            words = line.split()
            if "inet" in words:
                return words[words.index("inet") + 1].split("/")[0]
        raise LaunchError(f"netns runner: network namespace {host!r} has no global IPv4 "
                          f"address ({out.stderr.strip() or 'none configured'})")


RUNNERS: dict[str, type[HostRunner]] = {r.name: r for r in (LocalRunner, SshRunner,
                                                             NetnsRunner)}


def make_runner(name: str, *, python: str | None = None, grace: float = 5.0,
                ssh_port: int | None = None, ssh_identity_file: str | None = None,
                connect_timeout: float = 30.0) -> HostRunner:
    """The runner for remote hosts called ``name`` (``ssh`` or ``netns``)."""
    if name == "ssh":
        return SshRunner(python, grace, port=ssh_port, identity_file=ssh_identity_file,
                         connect_timeout=connect_timeout)
    if name == "netns":
        return NetnsRunner(python, grace)
    if name == "local":
        return LocalRunner()
    raise LaunchError(f"--host-runner {name!r}: expected one of {', '.join(RUNNERS)}")
