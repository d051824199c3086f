"""``shoal bench allreduce``: float32 allreduce time and bandwidth, shoal vs torch gloo.

The driver starts one job per world size through shoalrun. Inside the job every rank
initialises shoal *and* (when torch is installed) ``torch.distributed`` over gloo, and the
methods take turns trial by trial, so machine noise hits all of them alike. A single-process
``numpy.copyto`` of the same size, timed in the same job, is the physical floor (one pass over
memory). Times are the per-trial maximum over ranks (a collective is as slow as its slowest
rank); the table reports the minimum and median over trials, and the spread.

bus bandwidth = bytes / time x 2 (n-1) / n, the traffic a bandwidth-optimal allreduce must move
per rank, as nccl-tests reports it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .common import (
    alternate,
    init_gloo,
    run_job,
    run_mpi_job,
    worst_over_ranks,
    write_results,
)
from .stats import human_bytes, parse_size

__all__ = ["add_arguments", "format_table", "run", "worker_main"]

DEFAULT_SIZES = "4K,64K,1M,16M,64M"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench allreduce``."""
    p.add_argument("--np", type=int, nargs="+", default=[2, 4], help="world sizes to run")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="message sizes, e.g. 4K,1M,64M")
    p.add_argument("--trials", type=int, default=15, help="timed trials per method and size")
    p.add_argument("--peers", default="gloo,mpi",
                   help="comma list of peers: gloo, mpi (mpi runs the job under mpirun from "
                        "the peers venv, scripts/install-peers.sh), or none")
    p.add_argument("--out", default="benchmarks/allreduce.json", help="JSON results file")
    p.add_argument("--timeout", type=float, default=900, help="seconds per world size")


def _reps(nbytes: int) -> int:
    """Back-to-back operations per trial: enough that small messages outlast timer noise."""
    return max(1, min(200, (4 << 20) // max(nbytes, 1)))


def worker_main(argv: Sequence[str]) -> None:
    """Runs inside every rank of the job (started by shoalrun)."""
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", required=True)
    p.add_argument("--trials", type=int, required=True)
    p.add_argument("--peers", default="")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    import shoal
    shoal.init()
    peers = args.peers.split(",")
    gloo = init_gloo() if "gloo" in peers else None
    missing = {"gloo": "torch is not installed (pip install 'shoal[torch]')"} \
        if "gloo" in peers and gloo is None else {}
    mpi = None
    if "mpi" in peers:
        try:
            from mpi4py import MPI
            mpi = MPI
        except ImportError:
            missing["mpi"] = "mpi4py is not importable here (scripts/install-peers.sh)"
    rng = np.random.default_rng(shoal.rank())
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    times: dict[int, dict[str, list[float]]] = {}
    for nbytes in sizes:
        x = rng.standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        methods = {"shoal": lambda x=x, out=out: shoal.allreduce(x, op=shoal.Sum, name="bench",
                                                                  out=out)}
        if gloo is not None:
            torch, dist = gloo
            t = torch.from_numpy(x.copy())
            methods["gloo"] = lambda t=t, dist=dist: dist.all_reduce(t)
        if mpi is not None:
            mout = np.empty_like(x)
            methods["mpi"] = lambda x=x, mout=mout: mpi.COMM_WORLD.Allreduce(x, mout,
                                                                          op=mpi.SUM)
        times[nbytes] = alternate(methods, args.trials, _reps(nbytes), shoal.barrier)
        floor = []  # one process, one pass over memory, while the others wait
        for _ in range(args.trials):
            shoal.barrier()
            if shoal.rank() == 0:
                t0 = time.perf_counter()
                for _ in range(_reps(nbytes)):
                    np.copyto(out, x)
                floor.append((time.perf_counter() - t0) / _reps(nbytes))
        times[nbytes]["memcpy"] = floor
    everyone = shoal.allgather_object(times)
    if shoal.rank() == 0:
        n = shoal.size()
        result: dict[str, Any] = {"np": n, "missing": missing, "sizes": sizes, "methods": {},
                                  "algorithm": shoal.communicator().algorithm}
        for name in times[sizes[0]]:
            per_size = {}
            for nbytes in sizes:
                s = worst_over_ranks([t[nbytes][name] for t in everyone if t[nbytes][name]])
                s["algbw_GBps"] = nbytes / s["min"] / 1e9
                s["busbw_GBps"] = s["algbw_GBps"] * 2 * (n - 1) / n
                per_size[str(nbytes)] = s
            result["methods"][name] = per_size
        with open(args.json, "w") as f:
            import json
            json.dump(result, f)
    shoal.shutdown()


def format_table(result: dict[str, Any]) -> str:
    """One row per size: each method's min / median time and bandwidth, and the ratios."""
    methods = result["methods"]
    peers = [m for m in methods if m not in ("shoal", "memcpy")]
    head = f"{'size':>8} | {'shoal ms':>9} {'med':>8} {'busbw':>7} |"
    for p in peers:
        head += f" {p + ' ms':>9} {'med':>8} | {'shoal/' + p:>10} |"
    head += f" {'memcpy ms':>9} | {'shoal/memcpy':>12}"
    lines = [f"np={result['np']} algorithm={result['algorithm']}"
             + "".join(f"  [{k} missing: {v}]" for k, v in result["missing"].items()),
             head, "-" * len(head)]
    for nbytes in result["sizes"]:
        key = str(nbytes)
        s = methods["shoal"][key]
        row = (f"{human_bytes(nbytes):>8} | {s['min'] * 1e3:9.3f} {s['median'] * 1e3:8.3f} "
               f"{s['busbw_GBps']:6.2f}G |")
        for p in peers:
            q = methods[p][key]
            row += f" {q['min'] * 1e3:9.3f} {q['median'] * 1e3:8.3f} | " \
                   f"{s['min'] / q['min']:9.2f}x |"
        m = methods["memcpy"][key]
        row += f" {m['min'] * 1e3:9.3f} | {s['min'] / m['min']:11.2f}x"
        lines.append(row)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Driver: one shoalrun job per world size; print the tables and write the JSON file."""
    from .peers import available_peers
    results = []
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    use_mpi = "mpi" in peers and bool(available_peers().get("mpi"))
    for n in args.np:
        job_args = ["--sizes", args.sizes, "--trials", str(args.trials), "--peers",
                    ",".join(peers) or "none"]
        try:
            if use_mpi:
                results.append(run_mpi_job(n, "shoal.bench.allreduce", job_args, args.timeout))
            else:
                results.append(run_job(n, "shoal.bench.allreduce", job_args, args.timeout))
                if "mpi" in peers:
                    results[-1]["missing"]["mpi"] = "not installed (scripts/install-peers.sh)"
        except RuntimeError as exc:
            print(f"shoal bench allreduce: {exc}", file=sys.stderr)
            return 1
        print(format_table(results[-1]), flush=True)
    write_results(args.out, {"results": results})
    return 0


if __name__ == "__main__":
    worker_main(sys.argv[1:])
