"""``shoalrun``: start N copies of a command as one shoal job, for example
``shoalrun -np 4 -H node-a:2,node-b:2 --emulate-hosts -x OMP_NUM_THREADS=2 python train.py``.

Every worker runs in its own session (process group). Its output lines reach shoalrun's
stdout/stderr tagged ``[<rank>]<stdout>: `` / ``[<rank>]<stderr>: ``. The first worker to exit
non-zero or by a signal stops the job: the others get SIGTERM, then SIGKILL after
``--kill-grace`` seconds; leftover shared memory ``/dev/shm/shoal-<job_id>-*`` is removed, one
summary line goes to stderr and shoalrun exits with that worker's code (128 + the signal
number for a signal). Ctrl-C or SIGTERM to shoalrun stops the job the same way (exit 130, 143).

Hosts: without ``-H`` every worker runs on this machine. ``-H host:slots,...`` fills the hosts
in order. Only this machine (``localhost``, ``127.0.0.1``, its host name) can be launched on
for now; ``--emulate-hosts`` runs every listed host here as a simulated node (its workers get
``SHOAL_HOSTNAME=<host>``, so shared memory is grouped by the simulated host).

Environment of each worker: shoalrun's own environment, then the ``-x`` variables
(``-x NAME=VALUE`` sets, ``-x NAME`` copies shoalrun's value), then:

=========================  ========================================================
``SHOAL_RANK``             global rank, ``0 .. SHOAL_SIZE-1``
``SHOAL_SIZE``             number of workers
``SHOAL_LOCAL_RANK``       rank among the workers on the same host
``SHOAL_LOCAL_SIZE``       number of workers on the same host
``SHOAL_CROSS_RANK``       index of the host among the job's hosts (with workers)
``SHOAL_CROSS_SIZE``       number of hosts
``SHOAL_HOSTNAME``         the simulated host (``--emulate-hosts`` only)
``SHOAL_JOB_ID``           job identifier, names the shared-memory segments
``SHOAL_SECRET``           random per-job secret (hex) every connection must prove
``SHOAL_RENDEZVOUS_ADDR``  address of the rendezvous store run by shoalrun
``SHOAL_RENDEZVOUS_PORT``  port of that store
``SHOAL_START_TIMEOUT_S``  longest wait for all ranks to join (``--start-timeout``)
``MASTER_ADDR``            address for ``torch.distributed``'s own store
``MASTER_PORT``            a free port for it (not the shoal store's port)
``PYTHONUNBUFFERED``       ``1``, so output reaches shoalrun as it is printed
=========================  ========================================================

The same values under the names other launchers use, so their user code runs unchanged:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the cross rank)
like torchrun; ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``,
``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE`` like horovodrun.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from ..core import config
from ..core.errors import ShoalError

__all__ = [  # noqa: RUF022 (grouped by role, not sorted)
    "LaunchError", "WorkerSpec", "Job", "RESERVED_VARS", "parse_hosts", "parse_forward",
    "local_host_names", "plan", "make_job_id", "worker_env", "launch", "build_parser", "main",
]

POLL_S = 0.05
LOCAL_ADDR = "127.0.0.1"
_VARS = {  # WorkerSpec or Job attribute -> the variables that carry it
    "rank": ("SHOAL_RANK", "RANK", "HOROVOD_RANK"),
    "size": ("SHOAL_SIZE", "WORLD_SIZE", "HOROVOD_SIZE"),
    "local_rank": ("SHOAL_LOCAL_RANK", "LOCAL_RANK", "HOROVOD_LOCAL_RANK"),
    "local_size": ("SHOAL_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE"),
    "cross_rank": ("SHOAL_CROSS_RANK", "GROUP_RANK", "HOROVOD_CROSS_RANK"),
    "cross_size": ("SHOAL_CROSS_SIZE", "HOROVOD_CROSS_SIZE"),
    "job_id": ("SHOAL_JOB_ID",), "secret": ("SHOAL_SECRET",),
    "rendezvous_addr": ("SHOAL_RENDEZVOUS_ADDR",), "rendezvous_port": ("SHOAL_RENDEZVOUS_PORT",),
    "master_addr": ("MASTER_ADDR",), "master_port": ("MASTER_PORT",),
}
RESERVED_VARS = tuple(name for names in _VARS.values() for name in names)
"""Variables shoalrun always sets itself; ``-x`` may not override them."""


class LaunchError(ShoalError):
    """The command line asks for a job shoalrun cannot launch."""


@dataclass(frozen=True)
class WorkerSpec:
    """Where one worker runs and its place in the job."""

    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host: str


@dataclass(frozen=True)
class Job:
    """What every worker of one job shares."""

    job_id: str
    secret: str
    size: int
    rendezvous_addr: str
    rendezvous_port: int
    master_addr: str
    master_port: int
    start_timeout_s: float = 120.0
    emulate_hosts: bool = False
    forward: Mapping[str, str] = field(default_factory=dict)


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """``"a:2,b"`` -> ``[("a", 2), ("b", 1)]``; a host without ``:slots`` has one slot."""
    hosts: list[tuple[str, int]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, count = item.rpartition(":") if ":" in item else (item, ":", "1")
        slots = int(count) if count.isdigit() else 0
        if not name or slots < 1:
            raise LaunchError(f"-H {item!r}: expected host:slots with slots >= 1")
        if any(name == seen for seen, _ in hosts):
            raise LaunchError(f"-H lists host {name!r} twice; give it once with all its slots")
        hosts.append((name, slots))
    if not hosts:
        raise LaunchError(f"-H {text!r} names no host")
    return hosts


def parse_forward(items: Sequence[str], parent_env: Mapping[str, str]) -> dict[str, str]:
    """``-x NAME=VALUE`` sets a variable, ``-x NAME`` copies it from ``parent_env``."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not name:
            raise LaunchError(f"-x {item!r}: expected NAME or NAME=VALUE")
        if name in RESERVED_VARS:
            raise LaunchError(f"-x {name}: shoalrun sets this variable itself")
        if not sep and name not in parent_env:
            raise LaunchError(f"-x {name}: not set in shoalrun's environment (use -x NAME=VALUE)")
        out[name] = value if sep else parent_env[name]
    return out


def local_host_names() -> set[str]:
    """Names under which a host in ``-H`` means this machine."""
    name = socket.gethostname()
    return {"localhost", "127.0.0.1", "::1", name, name.split(".")[0]}


def plan(np: int, hosts: Sequence[tuple[str, int]] | None = None, *,
         emulate_hosts: bool = False, local_names: Collection[str] | None = None,
         default_host: str | None = None) -> list[WorkerSpec]:
    """Place ``np`` workers: on this host, or filling ``hosts`` (name, slots) in order."""
    if np < 1:
        raise LaunchError(f"-np must be at least 1, got {np}")
    if not hosts:
        host = default_host or socket.gethostname()
        return [WorkerSpec(r, r, np, 0, 1, host) for r in range(np)]
    total = sum(slots for _, slots in hosts)
    if total < np:
        listing = ",".join(f"{h}:{s}" for h, s in hosts)
        raise LaunchError(f"-np {np} needs {np} slots but -H {listing} offers only {total}")
    used: list[tuple[str, int]] = []  # (host, workers on it), hosts left empty dropped
    for host, slots in hosts:
        left = np - sum(n for _, n in used)
        if left > 0:
            used.append((host, min(slots, left)))
    if not emulate_hosts:
        names = local_host_names() if local_names is None else set(local_names)
        remote = [h for h, _ in used if h not in names]
        if remote:
            raise LaunchError(
                f"host(s) {', '.join(remote)} are not this machine: remote (ssh) launch is not "
                "supported yet; use --emulate-hosts to simulate them on this machine")
        if len(used) > 1:
            raise LaunchError(f"{', '.join(h for h, _ in used)} are all this machine; list it "
                              "once, or use --emulate-hosts to simulate separate hosts")
    specs: list[WorkerSpec] = []
    for cross_rank, (host, count) in enumerate(used):
        for local_rank in range(count):
            specs.append(WorkerSpec(len(specs), local_rank, count, cross_rank, len(used), host))
    return specs


def make_job_id(now: float | None = None, pid: int | None = None) -> str:
    """A short, file-name safe id: milliseconds since the epoch in hex, then the pid."""
    ms = int((time.time() if now is None else now) * 1000)
    return f"{ms:x}-{os.getpid() if pid is None else pid}"


def worker_env(spec: WorkerSpec, job: Job, base_env: Mapping[str, str]) -> dict[str, str]:
    """The complete environment of one worker (see the module docstring)."""
    env = {**base_env, **job.forward}
    for attr, names in _VARS.items():
        value = getattr(spec if hasattr(spec, attr) else job, attr)
        env.update({name: str(value) for name in names})
    env[config.env_name("start_timeout_s")] = str(job.start_timeout_s)
    env["PYTHONUNBUFFERED"] = "1"
    if job.emulate_hosts:
        env[config.env_name("hostname")] = spec.host
    return env



@dataclass
class _Worker:
    spec: WorkerSpec
    proc: subprocess.Popen[bytes]
    threads: list[threading.Thread] = field(default_factory=list)


def _err(message: str) -> None:
    print(f"shoalrun: {message}", file=sys.stderr, flush=True)


def _pump(stream: IO[bytes], tag: bytes, target: str, lock: threading.Lock) -> None:
    """Copy one worker stream line by line, tagged, to ``sys.<target>``; drain even on errors."""
    with stream:
        for line in iter(stream.readline, b""):
            data = tag + (line if line.endswith(b"\n") else line + b"\n")
            # If our own output is gone, keep draining so that the worker never blocks.
            with lock, contextlib.suppress(OSError, ValueError):
                out = getattr(sys, target)
                out.flush()
                if hasattr(out, "buffer"):  # bytes as they are: no encoding errors
                    out.buffer.write(data)
                    out.buffer.flush()
                else:
                    out.write(data.decode(errors="replace"))
                    out.flush()


def _signal_group(pid: int, sig: int) -> bool:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _live_groups(pgids: Collection[int]) -> set[int]:
    """Those process groups with a member that is not a zombie (init may reap them late)."""
    if not os.path.isdir("/proc"):
        return {g for g in pgids if _signal_group(g, 0)}
    live: set[int] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError, ValueError), \
                open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, ...
            if fields[0] != "Z":
                live.add(int(fields[2]))
    return live.intersection(pgids)


def _stop_all(workers: Sequence[_Worker], grace: float,
              hurry: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM every worker's process group, SIGKILL what is left after ``grace`` seconds."""
    for w in workers:
        _signal_group(w.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not hurry():
        if all(w.proc.poll() is not None for w in workers) and \
                not _live_groups([w.proc.pid for w in workers]):
            break
        time.sleep(POLL_S)
    for w in workers:
        _signal_group(w.proc.pid, signal.SIGKILL)
    for w in workers:
        w.proc.wait()
        for t in w.threads:  # readers end at EOF, once every process holding the pipe is gone
            t.join(timeout=5.0)


def _describe_exit(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    names = {s.value: s.name for s in signal.Signals}
    return f"was killed by {names.get(-code, f'signal {-code}')}"


def _install_handlers(caught: list[int]) -> dict[int, object]:
    """Record SIGINT/SIGTERM instead of dying; returns the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, lambda signum, _frame: caught.append(signum))
            for sig in (signal.SIGINT, signal.SIGTERM)}


def _wait_and_report(w: _Worker, exits: queue.Queue[_Worker]) -> None:
    w.proc.wait()
    exits.put(w)  # in the order the workers exit: the first failure is the one reported


def _supervise(specs: Sequence[WorkerSpec], job: Job, command: Sequence[str],
               kill_grace: float) -> int:
    lock = threading.Lock()
    done: queue.Queue[_Worker] = queue.Queue()
    workers: list[_Worker] = []
    caught: list[int] = []
    saved = _install_handlers(caught)
    try:
        for spec in specs:
            if caught:
                break
            try:
                proc = subprocess.Popen(list(command), env=worker_env(spec, job, os.environ),
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, start_new_session=True)
            except OSError as exc:
                _stop_all(workers, kill_grace)
                _err(f"cannot start rank {spec.rank}: {exc}; stopped {len(workers)} workers")
                return 127
            w = _Worker(spec, proc)
            assert proc.stdout is not None and proc.stderr is not None
            for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                tag = f"[{spec.rank}]<{name}>: ".encode()
                w.threads.append(threading.Thread(
                    target=_pump, args=(stream, tag, name, lock), daemon=True))
            w.threads.append(threading.Thread(target=_wait_and_report, args=(w, done), daemon=True))
            for t in w.threads:
                t.start()
            workers.append(w)
        failed: _Worker | None = None
        finished = 0
        while not caught and finished < len(workers):
            try:
                w = done.get(timeout=POLL_S)
            except queue.Empty:
                continue
            finished += 1
            if w.proc.returncode != 0:
                failed = w
                break
        running = sum(1 for w in workers if w is not failed and w.proc.poll() is None)
        signals_seen = len(caught)  # one more signal while stopping: SIGKILL at once
        _stop_all(workers, kill_grace, hurry=lambda: len(caught) > signals_seen)
        plural = "" if running == 1 else "s"
        if failed is not None:
            code = failed.proc.returncode
            spec = failed.spec
            _err(f"rank {spec.rank} (host {spec.host}, pid {failed.proc.pid}) "
                 f"{_describe_exit(code)}; stopped {running} other worker{plural}")
            return code if code > 0 else 128 - code
        if caught:
            sig = signal.Signals(caught[0])
            _err(f"received {sig.name}; stopped the job ({running} running worker{plural})")
            return 128 + sig.value
        return 0
    except BaseException:  # a bug of ours: never leave workers behind
        _stop_all(workers, 0.0)
        raise
    finally:
        for sig, old in saved.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)  # type: ignore[arg-type]


def launch(specs: Sequence[WorkerSpec], command: Sequence[str], *,
           forward: Mapping[str, str] | None = None, emulate_hosts: bool = False,
           start_timeout_s: float = 120.0, kill_grace: float = 5.0,
           verbose: bool = False) -> int:
    """Run one job on this machine: start the store, the workers, wait; the job's exit code."""
    from ..core.auth import secret_bytes
    from ..core.rendezvous import StoreServer

    secret = secrets.token_hex(32)
    job_id = make_job_id()
    store = StoreServer(secret_bytes(secret), host=LOCAL_ADDR, port=0)
    store.start()
    try:
        addr, port = store.address
        with socket.socket() as sock:  # a free port for torch.distributed's own store
            sock.bind((LOCAL_ADDR, 0))
            master_port = int(sock.getsockname()[1])
        job = Job(job_id=job_id, secret=secret, size=len(specs), rendezvous_addr=str(addr),
                  rendezvous_port=int(port), master_addr=LOCAL_ADDR,
                  master_port=master_port, start_timeout_s=start_timeout_s,
                  emulate_hosts=emulate_hosts, forward=dict(forward or {}))
        if verbose:
            _err(f"job {job_id}: rendezvous {addr}:{port}, MASTER_PORT {master_port}")
            for s in specs:
                _err(f"  rank {s.rank} -> host {s.host} (local rank {s.local_rank}/"
                     f"{s.local_size}, cross rank {s.cross_rank}/{s.cross_size})")
        return _supervise(specs, job, command, kill_grace)
    finally:
        store.close()
        for path in glob.glob(f"/dev/shm/shoal-{glob.escape(job_id)}-*"):  # left by a crash
            with contextlib.suppress(OSError):
                os.unlink(path)


def build_parser() -> argparse.ArgumentParser:
    """The ``shoalrun`` command line."""
    p = argparse.ArgumentParser(
        prog="shoalrun", allow_abbrev=False,
        usage="shoalrun -np N [-H host:slots,...] [options] command [args...]",
        description="Start N workers of a shoal job (worker environment: pydoc "
                    "shoal.runner.launch).")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, metavar="N",
                   help="number of workers")
    p.add_argument("-H", "--hosts", help="host:slots[,...], filled in order (default: here)")
    p.add_argument("--emulate-hosts", action="store_true",
                   help="run every -H host on this machine as a simulated node")
    p.add_argument("--start-timeout", type=float, metavar="S",
                   help="longest wait for all ranks to join (default $SHOAL_START_TIMEOUT_S/120)")
    p.add_argument("--kill-grace", type=float, default=5.0, metavar="S",
                   help="seconds from SIGTERM to SIGKILL when stopping workers (default 5)")
    p.add_argument("-x", dest="forward", action="append", default=[], metavar="NAME[=VALUE]",
                   help="export a variable to the workers (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the plan first")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shoalrun``; returns the job's exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed
        return exc.code if isinstance(exc.code, int) else 2
    command = args.command[1:] if args.command[:1] == ["--"] else list(args.command)
    try:
        if not command:
            raise LaunchError("no command to run")
        if args.kill_grace < 0:
            raise LaunchError("--kill-grace must be >= 0")
        start_timeout = (config.load().start_timeout_s if args.start_timeout is None
                         else args.start_timeout)
        hosts = parse_hosts(args.hosts) if args.hosts else None
        specs = plan(args.np, hosts, emulate_hosts=args.emulate_hosts)
        forward = parse_forward(args.forward, os.environ)
    except ShoalError as exc:
        parser.print_usage(sys.stderr)
        _err(f"error: {exc}")
        return 2
    try:
        return launch(specs, command, forward=forward, emulate_hosts=args.emulate_hosts,
                      start_timeout_s=start_timeout, kill_grace=args.kill_grace,
                      verbose=args.verbose)
    except ShoalError as exc:
        _err(f"error: {exc}")
        return 1
