"""``shoal bench allreduce``: float32 allreduce time and bandwidth, shoal against its peers.

The driver starts one job per world size through shoalrun. Inside the job every rank
initialises shoal *and* (when torch is installed) ``torch.distributed`` over gloo, and the
methods take turns trial by trial, so machine noise hits all of them alike. A single-process
``numpy.copyto`` of the same size, timed in the same job, is the physical floor (one pass over
memory). Times are the per-trial maximum over ranks (a collective is as slow as its slowest
rank); the table reports the minimum and median over trials, and the spread.

bus bandwidth = bytes / time x 2 (n-1) / n, the traffic a bandwidth-optimal allreduce must move
per rank, as nccl-tests reports it.

Every peer is compared with shoal through the same kind of array: gloo and DeepSpeed with
``shoal-torch`` (shoal's in-place Sum of a torch tensor), MPI with ``shoal`` (a numpy array).
DeepSpeed (``--peers deepspeed``, :mod:`.deepspeed_shm`) needs the peers venv: the job then
runs in that venv's python. ``--repeat N`` runs the job N times in a row and records each run's
median ratios, and their median and worst over the runs (slow modes show there).
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
                        "the peers venv, scripts/install-peers.sh), deepspeed (its C++ "
                        "shared-memory allreduce; one host; the peers venv), or none")
    p.add_argument("--repeat", type=int, default=1,
                   help="jobs per world size, one after another; the runs' median ratios and "
                        "their median and worst are recorded")
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
    deepspeed = _load_deepspeed(shoal, missing) if "deepspeed" in peers else None
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
        if deepspeed is not None:
            import torch

            import shoal.torch as st
            ts, td = torch.from_numpy(x.copy()), torch.from_numpy(x.copy())
            methods["shoal-torch"] = lambda ts=ts: st.allreduce_(ts, op=st.Sum, name="bench")
            methods["deepspeed"] = lambda td=td: deepspeed(td)
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
    if deepspeed is not None:
        from .deepspeed_shm import cleanup
        cleanup()
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


def _load_deepspeed(shoal: Any, missing: dict[str, str]) -> Any:
    """DeepSpeed's in-place shared-memory Sum for this job, or None (the reason in
    ``missing``). Its segments are named after MASTER_ADDR and MASTER_PORT: a name per job."""
    import os
    if shoal.local_size() != shoal.size():
        missing["deepspeed"] = "its shared-memory allreduce works on one host only"
        return None
    tag = shoal.broadcast_object(f"{os.getpid()}", root_rank=0)
    os.environ.update(LOCAL_SIZE=str(shoal.size()), MASTER_ADDR="shoal-bench",
                      MASTER_PORT=tag)
    try:
        from .deepspeed_shm import load
        op = load(shoal.size(), shoal.rank())
    except (ImportError, RuntimeError, OSError) as exc:
        missing["deepspeed"] = f"{type(exc).__name__}: {exc} (scripts/install-peers.sh)"
        return None
    finally:
        shoal.barrier()  # every rank attached (or failed) before anyone times
    return op


#: which shoal method each peer is compared with: the same kind of array through each API
_SHOAL_FOR = {"deepspeed": "shoal-torch"}


def _peers(methods: dict[str, Any]) -> list[str]:
    return [m for m in methods if m not in ("shoal", "shoal-torch", "memcpy")]


def ratios(result: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per peer and size: shoal's median time over the peer's (below 1: shoal is faster),
    shoal taken through the same kind of array as the peer (:data:`_SHOAL_FOR`)."""
    methods = result["methods"]
    out: dict[str, dict[str, float]] = {}
    for p in _peers(methods):
        base = methods[_SHOAL_FOR.get(p, "shoal")]
        out[p] = {key: base[key]["median"] / q["median"] for key, q in methods[p].items()}
    return out


def format_table(result: dict[str, Any]) -> str:
    """One row per size: each method's min / median time and bandwidth, and the ratios of
    the medians (shoal's time over the peer's)."""
    methods = result["methods"]
    peers = _peers(methods)
    ratio = ratios(result)
    head = f"{'size':>8} | {'shoal ms':>9} {'med':>8} {'busbw':>7} |"
    if "shoal-torch" in methods:
        head += f" {'shoal-torch ms':>14} {'med':>8} |"
    for p in peers:
        head += f" {p + ' ms':>12} {'med':>8} | {'shoal/' + p:>14} |"
    head += f" {'memcpy ms':>9} | {'shoal/memcpy':>12}"
    lines = [f"np={result['np']} algorithm={result['algorithm']}"
             + "".join(f"  [{k} missing: {v}]" for k, v in result["missing"].items()),
             head, "-" * len(head)]
    for nbytes in result["sizes"]:
        key = str(nbytes)
        s = methods["shoal"][key]
        row = (f"{human_bytes(nbytes):>8} | {s['min'] * 1e3:9.3f} {s['median'] * 1e3:8.3f} "
               f"{s['busbw_GBps']:6.2f}G |")
        if "shoal-torch" in methods:
            q = methods["shoal-torch"][key]
            row += f" {q['min'] * 1e3:14.3f} {q['median'] * 1e3:8.3f} |"
        for p in peers:
            q = methods[p][key]
            row += f" {q['min'] * 1e3:12.3f} {q['median'] * 1e3:8.3f} | " \
                   f"{ratio[p][key]:13.2f}x |"
        m = methods["memcpy"][key]
        row += f" {m['min'] * 1e3:9.3f} | {s['min'] / m['min']:11.2f}x"
        lines.append(row)
    return "\n".join(lines)


def summarize_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over repeated jobs of one world size: every run's median ratios, and per peer and size
    their median and worst (the largest: shoal's slowest run against the peer)."""
    per_run = [ratios(r) for r in runs]
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for p in per_run[0]:
        summary[p] = {}
        for key in per_run[0][p]:
            values = sorted(r[p][key] for r in per_run)
            summary[p][key] = {"median": float(np.median(values)), "worst": values[-1],
                               "best": values[0]}
    return {"np": runs[0]["np"], "runs": per_run, "summary": summary}


def format_summary(rep: dict[str, Any]) -> str:
    """The repeated runs' ratios: per peer and size the median, best and worst over runs."""
    lines = [f"np={rep['np']}: shoal's median time over the peer's, {len(rep['runs'])} runs"]
    for p, sizes in rep["summary"].items():
        for key, s in sizes.items():
            lines.append(f"  {p:>10} {human_bytes(int(key)):>8}: median {s['median']:.2f}x  "
                         f"best {s['best']:.2f}x  worst {s['worst']:.2f}x")
    return "\n".join(lines)


def section(data: dict[str, Any]) -> list[str]:
    """BENCHMARKS.md's section of a ``--peers deepspeed --repeat N`` results file: each
    world size's ratios over the runs, then its last run in full."""
    from .common import markdown_table
    ranks = " and ".join(str(r["np"]) for r in data["results"])
    out = [f"## AllReduce on one host against DeepSpeed's C++ shared-memory allreduce, "
           f"{ranks} ranks", "",
           f"Command: `{data['command']}`. float32 Sum of torch tensors in place, through "
           "each library's API (`shoal.torch.allreduce_(t, op=Sum, name=...)`, "
           "`torch.ops.deepspeed.inference_all_reduce_(t)`), in the same processes, "
           "alternating trial by trial; shoal / deepspeed is shoal's median time over "
           "DeepSpeed's (below 1: shoal is faster).", ""]
    for rep in data.get("repeats", []):
        rows = [f"size | median over {len(rep['runs'])} runs | best run | worst run"]
        for key, s in rep["summary"].get("deepspeed", {}).items():
            rows.append(f"{human_bytes(int(key))} | {s['median']:.2f}x | {s['best']:.2f}x | "
                        f"{s['worst']:.2f}x")
        out += [f"{rep['np']} ranks, shoal / deepspeed per run:", "",
                *markdown_table("\n".join(rows)), ""]
    for res in data["results"]:
        first, _, table = format_table(res).partition("\n")
        rows = [table.splitlines()[0], *table.splitlines()[2:]]
        out += [f"Last run, {first}:", "", *markdown_table("\n".join(rows)), ""]
    return out


def run(args: argparse.Namespace) -> int:
    """Driver: ``--repeat`` shoalrun jobs per world size; print the tables and write the JSON
    file (the last run's full results per world size, and every run's ratios)."""
    from .peers import available_peers, peer_python
    results, repeats = [], []
    peers = [p for p in args.peers.split(",") if p and p != "none"]
    use_mpi = "mpi" in peers and bool(available_peers().get("mpi"))
    python = peer_python() if "deepspeed" in peers else None
    for n in args.np:
        job_args = ["--sizes", args.sizes, "--trials", str(args.trials), "--peers",
                    ",".join(peers) or "none"]
        runs = []
        for _ in range(max(1, args.repeat)):
            try:
                if use_mpi:
                    runs.append(run_mpi_job(n, "shoal.bench.allreduce", job_args,
                                            args.timeout))
                else:
                    runs.append(run_job(n, "shoal.bench.allreduce", job_args, args.timeout,
                                        python=python))
                    if "mpi" in peers:
                        runs[-1]["missing"]["mpi"] = "not installed (scripts/install-peers.sh)"
                    if "deepspeed" in peers and python is None:
                        runs[-1]["missing"]["deepspeed"] = \
                            "no peers venv (scripts/install-peers.sh)"
            except RuntimeError as exc:
                print(f"shoal bench allreduce: {exc}", file=sys.stderr)
                return 1
            print(format_table(runs[-1]), flush=True)
        results.append(runs[-1])
        if len(runs) > 1:
            repeats.append(summarize_runs(runs))
            print(format_summary(repeats[-1]), flush=True)
    write_results(args.out, {"results": results, **({"repeats": repeats} if repeats else {})})
    return 0


if __name__ == "__main__":
    worker_main(sys.argv[1:])
