"""Plumbing shared by the benchmarks: start a job, alternate methods, summarise across ranks."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .stats import stats

__all__ = ["alternate", "free_port", "init_gloo", "load_results", "machine", "markdown_table",
           "report_section",
           "run_job", "run_jobs", "run_mpi_job", "worst_over_ranks", "write_results"]


def free_port() -> int:
    """A TCP port that was free a moment ago (for a job about to start)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(np_: int, module: str, args: Sequence[str], timeout: float,
            launcher_args: Sequence[str] = (), python: str | None = None) -> dict[str, Any]:
    """Run ``python -m module args --json FILE`` on ``np_`` ranks through shoalrun and return
    what rank 0 wrote to FILE; ``python`` (default: this one) runs the launcher and the ranks.
    Raises ``RuntimeError`` if the job fails."""
    python = python or sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [python, "-m", "shoal.runner", "-np", str(np_), *launcher_args,
               python, "-m", module, *args, "--json", out]
        proc = subprocess.run(cmd, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"the np={np_} job of {module} failed (exit {proc.returncode})")
        with open(out) as f:
            return json.load(f)


def alternate(methods: dict[str, Callable[[], Any]], trials: int, reps: int,
              barrier: Callable[[], None]) -> dict[str, list[float]]:
    """Time every method ``trials`` times, taking turns (rotating who goes first), each trial
    ``reps`` back-to-back calls after a barrier; seconds per call."""
    names = list(methods)
    for name in names:  # warm up: connections, page faults, caches
        methods[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for trial in range(trials):
        k = trial % len(names)
        for name in names[k:] + names[:k]:
            barrier()
            fn = methods[name]
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append((time.perf_counter() - t0) / reps)
    return times


def markdown_table(table: str) -> list[str]:
    """A ``format_table`` text (a header line, then rows, cells split by `` | ``) as the lines
    of a Markdown table."""
    rows = table.splitlines()
    return ["| " + rows[0] + " |", "|" + "---|" * (rows[0].count("|") + 1),
            *["| " + r + " |" for r in rows[1:]]]


def report_section(title: str, data: dict[str, Any], command: str, text: str,
                   table: Callable[[list[dict[str, Any]]], str]) -> list[str]:
    """A BENCHMARKS.md section: ``title``, the command that made ``data`` (else ``command``)
    with ``text`` after it, and ``table`` of ``data["results"]`` as a Markdown table."""
    return [f"## {title}", "", f"`{data.get('command', command)}`: {text}", "",
            *markdown_table(table(data["results"])), ""]


def worst_over_ranks(per_rank: Sequence[Sequence[float]]) -> dict[str, float]:
    """Per trial the slowest rank counts (a collective is as slow as its slowest member)."""
    return stats(np.max(np.asarray(per_rank, dtype=np.float64), axis=0))


def run_jobs(bench: str, args: Any, job: Sequence[str],
             table: Callable[[list[dict[str, Any]]], str]) -> int:
    """One shoalrun job of ``shoal.bench.<bench>`` per world size in ``args.np_``, with the
    worker arguments ``job``; results to ``args.out`` (:func:`run_and_record`)."""
    return run_and_record(bench, args.np_, lambda np_: run_job(
        np_, f"shoal.bench.{bench}", job, timeout=args.timeout), table, args.out)


def run_and_record(bench: str, sizes: Sequence[int], job: Callable[[int], dict[str, Any]],
                   table: Callable[[list[dict[str, Any]]], str], out: str) -> int:
    """``job(np)`` for each world size in turn, then the table printed and the results
    written to ``out``; the exit code (1, the failure said on stderr as ``shoal bench
    <bench>: ...``, as soon as one job fails)."""
    results = []
    for np_ in sizes:
        try:
            results.append(job(np_))
        except (RuntimeError, TimeoutError) as exc:
            print(f"shoal bench {bench}: {exc}", file=sys.stderr)
            return 1
    print(table(results))
    write_results(out, {"results": results})
    return 0


def run_mpi_job(np_: int, module: str, args: Sequence[str], timeout: float) -> dict[str, Any]:
    """Like :func:`run_job`, but started by Open MPI's ``mpirun`` with the peers venv's python
    (where shoal, torch and mpi4py all import), so shoal and MPI share the same processes."""
    import secrets

    from .peers import mpirun_command, peer_python
    python = peer_python()
    if python is None:
        raise RuntimeError("no peers venv (scripts/install-peers.sh)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "SHOAL_RENDEZVOUS_PORT": str(free_port()), "SHOAL_SECRET": secrets.token_hex(16),
               "SHOAL_JOB_ID": f"mpi{os.getpid()}", "OMP_NUM_THREADS": "1"}
        cmd = [*mpirun_command(np_)]
        for key, value in env.items():
            cmd += ["-x", f"{key}={value}"]
        cmd += [python, "-m", module, *args, "--json", out]
        proc = subprocess.run(cmd, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"the np={np_} mpirun job of {module} failed "
                               f"(exit {proc.returncode})")
        with open(out) as f:
            return json.load(f)


def init_gloo() -> tuple[Any, Any] | None:
    """``torch`` and ``torch.distributed`` over gloo for this job, or None without torch."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return None
    torch.set_num_threads(1)
    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:  # under mpirun
        os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
        os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="env://")
    return torch, dist


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    import platform

    import numpy
    info = {"cpu": platform.processor() or platform.machine(), "cores": str(os.cpu_count())}
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f
                               if line.startswith("model name"))
        with open("/proc/meminfo") as f:
            kib = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
        info["memory"] = f"{kib / (1 << 20):.0f} GiB"
    except (OSError, StopIteration):
        pass
    info["python"] = platform.python_version()
    info["numpy"] = numpy.__version__
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        pass
    info["date"] = time.strftime("%Y-%m-%d")
    with contextlib.suppress(OSError):
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                        capture_output=True, text=True, timeout=5,
                                        check=False).stdout.strip() or "unknown"
    return info


def load_results(folder: str, name: str) -> dict[str, Any] | None:
    """``folder/name.json`` as written by :func:`write_results`, or None if it is absent."""
    path = os.path.join(folder, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_results(path: str, payload: dict[str, Any]) -> None:
    """Write a results JSON file (creating its folder) and say where it went."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"command": shlex.join(["shoal", *sys.argv[1:]]), "machine": machine(),
                   **payload}, f, indent=1)
    print(f"results written to {path}")
