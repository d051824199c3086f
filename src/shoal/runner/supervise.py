"""Running a planned job: start every worker, tag its output, watch the rendezvous, fail fast.

Every worker process (a local worker, or the ssh/netns process standing for a remote one)
leads its own process group. The first to exit non-zero stops the job: every group gets
SIGTERM, then SIGKILL after the grace period; remote hosts get their leftover shared memory
removed; one summary line names the rank, its host and the cause.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .common import ExitCode, err
from .console import StatusLine, split_segments, terminal
from .hosts import WorkerSpec
from .runners import HostRunner

__all__ = ["HELLO_KEY", "Launch", "RendezvousWatch", "Worker", "start_worker", "stop_workers",
           "supervise"]

POLL_S = 0.05
WATCH_EVERY_S = 0.25
HELLO_KEY = "shoal/g1/hello/{rank}"
"""Set by ``shoal.init()`` on each rank when it joins (``store.allgather("shoal/g1/hello")``)."""


class RendezvousWatch:
    """Which ranks have joined the launcher's rendezvous store, seen through a client."""

    def __init__(self, addr: str, port: int, secret: bytes, size: int) -> None:
        from ..core.rendezvous import StoreClient

        self._client = StoreClient(addr, port, secret, timeout=5.0, connect_timeout=5.0)
        self.missing = list(range(size))

    def poll(self) -> list[int]:
        """Ranks that have not joined yet (ascending)."""
        self.missing = [r for r in self.missing
                        if self._client.try_get(HELLO_KEY.format(rank=r)) is None]
        return self.missing

    def close(self) -> None:
        """Drop the connection."""
        self._client.close()


@dataclass
class Launch:
    """Everything :func:`supervise` needs to start and describe the workers."""

    specs: Sequence[WorkerSpec]
    command: Sequence[str]
    runner_of: Callable[[WorkerSpec], HostRunner]
    env_of: Callable[[WorkerSpec], Mapping[str, str]]
    cwd: str
    job_id: str
    kill_grace: float = 5.0
    stop_grace: float = 30.0  # after a SIGTERM to shoalrun: time for workers to checkpoint
    start_timeout_s: float = 120.0
    watch: RendezvousWatch | None = None
    output_dir: Path | None = None
    timestamps: bool = False  # prefix each output line with the time (horovodrun's flag)


@dataclass
class Worker:
    spec: WorkerSpec
    runner: HostRunner
    proc: subprocess.Popen[bytes]
    log: IO[bytes] | None = None
    last_error: list[bytes] = field(default_factory=lambda: [b""])
    threads: list[threading.Thread] = field(default_factory=list)

    def where(self) -> str:
        pid = "" if self.runner.remote else f", pid {self.proc.pid}"
        return f"rank {self.spec.rank} (host {self.spec.host}{pid})"


def _write(out: IO[str], data: bytes) -> None:
    out.flush()
    if hasattr(out, "buffer"):  # bytes as they are: no encoding errors
        out.buffer.write(data)
        out.buffer.flush()
    else:
        out.write(data.decode(errors="replace"))
        out.flush()


def _pump(w: Worker, stream: IO[bytes], name: str, lock: threading.Lock,
          console: StatusLine | None = None, timestamps: bool = False) -> None:
    """Copy one worker stream line by line, tagged, to ``sys.<name>`` (and the rank's log);
    keep draining even when our own output is gone, so that the worker never blocks. With a
    ``console`` (a terminal), carriage-return redraws become its status line; ``timestamps``
    puts the time before each tag, as horovodrun's ``--prefix-output-with-timestamp``."""
    rank_tag = f"[{w.spec.rank}]<{name}>: ".encode()
    out = getattr(sys, name)

    def stamp() -> bytes:
        return time.strftime("%a %b %d %H:%M:%S %Y").encode() + rank_tag if timestamps \
            else rank_tag

    def line(data: bytes) -> None:
        tag = stamp()
        data = data if data.endswith(b"\n") else data + b"\n"
        if name == "stderr" and data.strip():
            w.last_error[0] = data.strip()
        with lock:
            with contextlib.suppress(OSError, ValueError):
                if console is not None:
                    console.line(out, tag + data)
                else:
                    _write(out, tag + data)
            if w.log is not None:
                with contextlib.suppress(OSError, ValueError):
                    w.log.write(data)
                    w.log.flush()

    with stream:
        if console is None:
            for data in iter(stream.readline, b""):
                line(data)
            return
        buf = b""
        while True:
            chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
            buf += chunk
            segments, buf = split_segments(buf, final=not chunk)
            for text, is_line in segments:
                if is_line:
                    line(text)
                else:
                    with lock, contextlib.suppress(OSError, ValueError):
                        console.status(out, stamp() + text)
            if not chunk:
                if buf:
                    line(buf)
                return


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


def _close_stdin(w: Worker) -> None:
    """End of file tells a remote worker's bootstrap that the job is over."""
    if w.proc.stdin is not None:
        with contextlib.suppress(OSError):
            w.proc.stdin.close()


def stop_workers(workers: Sequence[Worker], grace: float,
              hurry: Callable[[], bool] = lambda: False) -> None:
    """SIGTERM every worker's process group, SIGKILL what is left after ``grace`` seconds."""
    for w in workers:
        _signal_group(w.proc.pid, signal.SIGTERM)
        _close_stdin(w)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not hurry():
        if all(w.proc.poll() is not None for w in workers) and \
                not _live_groups([w.proc.pid for w in workers]):
            break
        time.sleep(POLL_S)
    for w in workers:
        _signal_group(w.proc.pid, signal.SIGKILL)
    _finish(workers)


def _finish(workers: Sequence[Worker]) -> None:
    for w in workers:
        w.proc.wait()
        _close_stdin(w)
        for t in w.threads:  # readers end at EOF, once every process holding the pipe is gone
            t.join(timeout=5.0)
        if w.log is not None:
            w.log.close()


def _clean_remote(workers: Sequence[Worker], job_id: str, timeout: float = 10.0) -> None:
    """Remove ``/dev/shm/shoal-<job_id>-*`` on every remote host of the job (bounded)."""
    hosts = {(w.spec.host, w.runner) for w in workers if w.runner.remote}
    procs = []
    for host, runner in hosts:
        with contextlib.suppress(OSError):
            procs.append(runner.cleanup(host, f"rm -f /dev/shm/shoal-{job_id}-*"))
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(p.pid, signal.SIGKILL)
            p.wait()


def _install_handlers(caught: list[int]) -> dict[int, object]:
    """Record SIGINT/SIGTERM instead of dying; returns the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, lambda signum, _frame: caught.append(signum))
            for sig in (signal.SIGINT, signal.SIGTERM)}


def start_worker(job: Launch, spec: WorkerSpec, lock: threading.Lock,
           done: queue.Queue[Worker], console: StatusLine | None = None) -> Worker:
    runner = job.runner_of(spec)
    proc = runner.popen(spec.host, job.command, job.env_of(spec), job.cwd)
    log = None
    if job.output_dir is not None:
        log = (job.output_dir / f"rank.{spec.rank}.log").open("wb")
    w = Worker(spec, runner, proc, log)
    assert proc.stdout is not None and proc.stderr is not None
    for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
        w.threads.append(threading.Thread(target=_pump, args=(w, stream, name, lock, console,
                                                              job.timestamps), daemon=True))

    def report() -> None:
        proc.wait()
        done.put(w)  # in the order the workers exit: the first failure is the one reported

    w.threads.append(threading.Thread(target=report, daemon=True))
    for t in w.threads:
        t.start()
    return w


def _ranks(ranks: Sequence[int], specs: Sequence[WorkerSpec]) -> str:
    hosts = sorted({specs[r].host for r in ranks})
    return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (host"
            f"{'s' if len(hosts) > 1 else ''} {', '.join(hosts)})")


def supervise(job: Launch) -> int:
    """Start the workers and wait for them; the job's exit code (see the module docstring)."""
    lock = threading.Lock()
    console = StatusLine(lock, _write) if terminal() else None
    done: queue.Queue[Worker] = queue.Queue()
    workers: list[Worker] = []
    caught: list[int] = []
    saved = _install_handlers(caught)
    try:
        for spec in job.specs:
            if caught:
                break
            try:
                workers.append(start_worker(job, spec, lock, done, console))
            except OSError as exc:
                stop_workers(workers, job.kill_grace)
                err(f"cannot start rank {spec.rank} on host {spec.host}: {exc}; stopped "
                    f"{len(workers)} workers")
                return ExitCode.CANNOT_START
        failed: Worker | None = None
        late: list[int] = []  # ranks that did not join within the start timeout
        finished, started, next_watch = 0, time.monotonic(), 0.0
        watch = job.watch
        while not caught and finished < len(workers):
            try:
                w = done.get(timeout=POLL_S)
                finished += 1
                if w.proc.returncode != 0:
                    failed = w
                    break
            except queue.Empty:
                pass
            if watch is not None and watch.missing and time.monotonic() >= next_watch:
                next_watch = time.monotonic() + WATCH_EVERY_S
                missing = watch.poll()
                # only a job that uses shoal (some rank joined) can miss ranks
                if 0 < len(missing) < len(job.specs) and \
                        time.monotonic() - started > job.start_timeout_s:
                    late = missing
                    break
        if failed is not None and watch is not None and watch.missing:
            missing = watch.poll()
            if len(missing) < len(job.specs):  # some rank joined: the others are late
                late = [r for r in missing if r != failed.spec.rank]
        running = sum(1 for w in workers if w is not failed and w.proc.poll() is None)
        plural = "" if running == 1 else "s"
        if failed is None and not caught and not late:
            _finish(workers)
            return ExitCode.OK
        # a job told to stop (a scheduler's SIGTERM) gets time to checkpoint; a failed one
        # is stopped fast
        stopping = bool(caught) and caught[0] == signal.SIGTERM and failed is None
        stop_workers(workers, max(job.kill_grace, job.stop_grace) if stopping else job.kill_grace,
                  hurry=lambda: len(caught) > 1)
        _clean_remote(workers, job.job_id)
        if failed is not None:
            code = failed.proc.returncode
            line = failed.last_error[0].decode(errors="replace")[:300]
            err(f"{failed.where()} {failed.runner.describe_exit(code)}; stopped {running} "
                f"other worker{plural}"
                + (f"; {_ranks(late, job.specs)} had not joined the rendezvous" if late else "")
                + (f"; its last stderr line: {line}" if line else ""))
            return code if code > 0 else 128 - code
        if late:
            err(f"{_ranks(late, job.specs)} did not join the rendezvous within "
                f"{job.start_timeout_s:g}s (stuck before shoal.init(), or unable to reach "
                f"the rendezvous address); stopped the job ({running} running worker{plural})")
            return ExitCode.START_TIMEOUT
        sig = signal.Signals(caught[0])
        clean = all(w.proc.returncode == 0 for w in workers)
        err(f"received {sig.name}; stopped the job ({running} running worker{plural}"
            + (", every one exited 0" if clean and running else "") + ")")
        return 128 + sig.value
    except BaseException:  # a bug of ours: never leave workers behind
        stop_workers(workers, 0.0)
        raise
    finally:
        for sig, old in saved.items():
            signal.signal(sig, signal.SIG_DFL if old is None else old)  # type: ignore[arg-type]
