"""``shoal bench collectives``: reducescatter and allgather against allreduce, gloo and
Open MPI.

In one job, alternating trial by trial on the same float32 data: shoal's allreduce, shoal's
reducescatter (the same input; each rank keeps 1/n), shoal's allgather (each rank sends 1/n),
and torch gloo's ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` where gloo has them.
Ratios are measured side by side: reducescatter / allreduce, allgather / gloo allgather.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from functools import partial
from typing import Any

import numpy as np

from .common import alternate, init_gloo, worst_over_ranks
from .stats import human_bytes, parse_size

__all__ = ["add_arguments", "format_table", "run", "section", "worker_main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench collectives``."""
    p.add_argument("--np", type=int, nargs="+", default=[2], dest="np_")
    p.add_argument("--sizes", default="1M,16M")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--peers", default="mpi",
                   help="mpi: run the job under Open MPI's mpirun too (scripts/install-peers.sh) "
                        "and time its Allgather / Reduce_scatter_block; none: gloo only")
    p.add_argument("--out", default="benchmarks/collectives.json")
    p.add_argument("--timeout", type=float, default=900)


def worker_main(argv: Sequence[str]) -> None:
    """One rank (started by shoalrun)."""
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", required=True)
    p.add_argument("--trials", type=int, required=True)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    import shoal
    shoal.init()
    gloo = init_gloo()
    try:
        from mpi4py import MPI
        mpi = MPI.COMM_WORLD if MPI.COMM_WORLD.Get_size() == shoal.size() else None
    except ImportError:
        mpi = None
    n, me = shoal.size(), shoal.rank()
    times: dict[int, dict[str, list[float]]] = {}
    for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
        count = nbytes // 4 // n * n
        x = np.random.default_rng(me).standard_normal(count).astype(np.float32)
        part = x[:count // n].copy()
        out = np.empty_like(x)
        methods: dict[str, Any] = {
            "shoal allreduce": lambda x=x, out=out: shoal.allreduce(x, shoal.Sum, "b.ar",
                                                                     out=out),
            "shoal reducescatter": lambda x=x: shoal.reducescatter(x, shoal.Sum, "b.rs"),
            "shoal allgather": lambda part=part: shoal.allgather(part, "b.ag"),
        }
        if gloo is not None:
            torch, dist = gloo
            tx, tpart = torch.from_numpy(x.copy()), torch.from_numpy(part.copy())
            tout, tshard = torch.empty_like(tx), torch.empty_like(tpart)
            methods["gloo allgather"] = partial(dist.all_gather_into_tensor, tout, tpart)
            try:  # gloo has no reduce_scatter in some torch builds
                dist.reduce_scatter_tensor(tshard, tx)
                methods["gloo reducescatter"] = partial(dist.reduce_scatter_tensor, tshard, tx)
            except (RuntimeError, NotImplementedError, ValueError):
                pass
        if mpi is not None:
            shard = np.empty_like(part)
            methods["mpi allreduce"] = partial(mpi.Allreduce, x, out, op=MPI.SUM)
            methods["mpi reducescatter"] = partial(mpi.Reduce_scatter_block, x, shard,
                                                   op=MPI.SUM)
            methods["mpi allgather"] = partial(mpi.Allgather, part, out)
        reps = max(1, min(50, (64 << 20) // max(nbytes, 1)))
        times[nbytes] = alternate(methods, args.trials, reps, shoal.barrier)
    everyone = shoal.allgather_object(times)
    if me == 0:
        result: dict[str, Any] = {"np": n, "sizes": list(times), "methods": {}}
        for name in times[next(iter(times))]:
            result["methods"][name] = {str(b): worst_over_ranks([t[b][name] for t in everyone])
                                       for b in times}
        with open(args.json, "w") as f:
            json.dump(result, f)
    shoal.shutdown()


def _ratio(res: dict[str, Any], a: str, b: str, nbytes: int) -> float | None:
    m = res["methods"]
    if a not in m or b not in m:
        return None
    return m[a][str(nbytes)]["min"] / m[b][str(nbytes)]["min"]


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per (np, size): times and the two ratios."""
    ratios = [("reducescatter / allreduce", "shoal reducescatter", "shoal allreduce"),
              ("allgather / gloo", "shoal allgather", "gloo allgather"),
              ("reducescatter / mpi", "shoal reducescatter", "mpi reducescatter"),
              ("allgather / mpi", "shoal allgather", "mpi allgather")]
    lines = ["np | size | " + " | ".join(results[0]["methods"]) + " | " +
             " | ".join(r[0] for r in ratios)]
    for res in results:
        for nbytes in res["sizes"]:
            cells = [f"{res['methods'][m][str(nbytes)]['min'] * 1e3:.2f} ms"
                     for m in res["methods"]]
            for _title, a, b in ratios:
                r = _ratio(res, a, b, nbytes)
                cells.append("-" if r is None else f"{r:.2f}x")
            lines.append(f"{res['np']} | {human_bytes(nbytes)} | " + " | ".join(cells))
    return "\n".join(lines)


def section(data: dict[str, Any]) -> list[str]:
    """The BENCHMARKS.md section for ``benchmarks/collectives.json``."""
    from .common import markdown_table
    return ["## Reduce-scatter and allgather", "",
            f"`{data.get('command', 'shoal bench collectives')}`. Float32, Sum; times are "
            "per-trial maxima over ranks, min over trials; methods alternate trial by trial. "
            "reducescatter keeps 1/n of the input on each rank; allgather sends 1/n from each.",
            "", *markdown_table(format_table(data["results"])), ""]


def run(args: argparse.Namespace) -> int:
    """Run one job per world size through shoalrun and write the JSON results."""
    from .common import run_and_record, run_job, run_mpi_job
    from .peers import available_peers
    use_mpi = "mpi" in args.peers.split(",") and bool(available_peers().get("mpi"))
    job = ["--sizes", args.sizes, "--trials", str(args.trials)]
    return run_and_record("collectives", args.np_, lambda np_: (
        run_mpi_job(np_, "shoal.bench.collectives", job, args.timeout) if use_mpi else
        run_job(np_, "shoal.bench.collectives", job, timeout=args.timeout)),
        format_table, args.out)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
