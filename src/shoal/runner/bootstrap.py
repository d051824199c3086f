"""The remote end of shoalrun's ssh and netns runners. Standard library only: it runs on the
worker's host, where shoal may not be importable.

shoalrun starts ``<python> -c 'import json,sys;exec(json.loads(sys.stdin.buffer.readline()))'``
there and writes two JSON lines to its stdin: this file's source, then the job,
``{"argv": [...], "env": {...}, "cwd": "...", "grace": 5.0}``. The job's environment and
secret therefore never appear on a command line. The bootstrap

1. leads its own process group (unless it already does) and starts the worker in it, in
   ``cwd``, with its own environment updated by ``env``;
2. keeps reading stdin: end of file means shoalrun or the ssh connection is gone, so the
   group gets SIGTERM, then SIGKILL after ``grace`` seconds (SIGTERM/SIGINT/SIGHUP to the
   bootstrap do the same);
3. exits with the worker's exit code, or 128 + N when signal N ended it (ssh reports no
   signals), 126/127 when the worker could not be started.

While the worker runs, ``<tmp>/shoal-workers/<job_id>-<rank>.pid`` holds the bootstrap's pid:
a SageMaker host that is not the master waits for these files to go away.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

__all__ = ["MARKER_DIR", "main", "switch_path"]

MARKER_DIR = os.path.join(tempfile.gettempdir(), "shoal-workers")


def _stopper(grace: float) -> Callable[..., None]:
    """A function that stops the process group once: SIGTERM now, SIGKILL after ``grace``."""
    started = threading.Event()

    def kill_later() -> None:
        time.sleep(grace)
        os.killpg(0, signal.SIGKILL)  # the bootstrap goes too: nothing is left to report

    def stop(*_: object) -> None:
        if started.is_set():
            return
        started.set()
        os.killpg(0, signal.SIGTERM)  # reaches this process too: handled, and ignored now
        threading.Thread(target=kill_later, daemon=True).start()

    return stop


def _marker(env: dict[str, str]) -> str | None:
    job, rank = env.get("SHOAL_JOB_ID"), env.get("SHOAL_RANK")
    if not job or not rank or "/" in job + rank:
        return None
    try:
        os.makedirs(MARKER_DIR, exist_ok=True)
        path = os.path.join(MARKER_DIR, f"{job}-{rank}.pid")
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        return path
    except OSError:
        return None


def cpu_share(env: dict[str, str]) -> list[int] | None:
    """The cores a worker is bound to (``SHOAL_CPU_BIND``): ``auto`` (the default) gives local
    rank r of L the r-th of L equal shares of the cores this process may use, so workers
    never trade cores with each other (on 2 cores, 2 workers bound so waited 5-15% longer
    for SyncBatchNorm's per-layer statistics than unbound ones, which the scheduler moved
    about: 45%); nothing when they outnumber the cores. ``core``: one core each even then,
    round robin. ``none``: leave placement to the kernel. An elastic worker's local rank
    changes with the world, so it is bound by its slot instead (``SHOAL_CPU_SLOT`` = ``s/S``,
    slot s of the S its host offers): a replacement takes the share its slot had."""
    mode = env.get("SHOAL_CPU_BIND", "auto").strip().lower()
    if mode not in ("auto", "core") or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        if "SHOAL_CPU_SLOT" in env:  # an elastic worker: slot s of the host's S, as "s/S"
            local_rank, local_size = (int(x) for x in env["SHOAL_CPU_SLOT"].split("/"))
        else:
            local_rank, local_size = int(env["SHOAL_LOCAL_RANK"]), int(env["SHOAL_LOCAL_SIZE"])
    except (KeyError, ValueError):
        return None
    cores = sorted(os.sched_getaffinity(0))
    share = len(cores) // max(1, local_size)
    if share >= 1:
        return cores[local_rank * share:(local_rank + 1) * share]
    return [cores[local_rank % len(cores)]] if mode == "core" else None


def bound(env: dict[str, str]) -> Callable[[], None] | None:
    """A ``preexec_fn`` that applies :func:`cpu_share` in the child, or None."""
    cores = cpu_share(env)
    if not cores:
        return None
    return lambda: os.sched_setaffinity(0, cores)


def switch_path(env: dict[str, str]) -> None:
    """Under the import switch (``SHOAL_AS``) the worker needs shoal's ``alias/boot`` directory
    on ``PYTHONPATH``: where shoalrun's path to it does not exist on this host, this host's
    shoal's (found, not imported) takes its place."""
    if not env.get("SHOAL_AS"):
        return
    paths = env.get("PYTHONPATH", "").split(os.pathsep)
    tail = os.path.join("shoal", "alias", "boot")
    if any(p.endswith(tail) and os.path.isdir(p) for p in paths):
        return
    import importlib.util
    spec = importlib.util.find_spec("shoal")
    if spec is None or not spec.submodule_search_locations:
        return  # the worker's own interpreter says that the switch is off
    here = os.path.join(next(iter(spec.submodule_search_locations)), "alias", "boot")
    env["PYTHONPATH"] = os.pathsep.join([here, *(p for p in paths if p and not p.endswith(tail))])


def main() -> int:
    """Run the worker described on stdin; its exit code."""
    payload = json.loads(sys.stdin.buffer.readline() or b"{}")
    argv, grace = payload.get("argv"), float(payload.get("grace", 5.0))
    env = {**os.environ, **payload.get("env", {})}
    switch_path(env)
    where = f"shoalrun bootstrap on {os.uname().nodename}"
    if not argv:
        print(f"{where}: no command received on stdin", file=sys.stderr, flush=True)
        return 126
    if os.getpgrp() != os.getpid():
        os.setsid()
    try:
        os.chdir(payload.get("cwd") or ".")
    except OSError as exc:
        print(f"{where}: cannot enter the working directory: {exc}", file=sys.stderr,
              flush=True)
        return 126
    try:
        child = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                 preexec_fn=bound(env))
    except OSError as exc:
        print(f"{where}: cannot start {argv[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    stop = _stopper(grace)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)

    def watch_stdin() -> None:
        while sys.stdin.buffer.read1(4096):
            pass
        stop()

    threading.Thread(target=watch_stdin, daemon=True).start()
    marker = _marker(env)
    try:
        code = child.wait()
    finally:
        if marker:
            os.unlink(marker)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    status = main()
    sys.stderr.flush()
    os._exit(status)  # not sys.exit: the stdin reader thread must not block the shutdown
