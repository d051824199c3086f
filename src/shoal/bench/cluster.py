"""``shoal bench cluster``: allreduce across emulated hosts joined by a shaped link.

Network namespaces act as nodes (``--nodes``, 2 by default, joined by a veth pair; more
around an emulated switch), each link shaped with ``tc tbf`` (1 Gbit/s by default), with 2
ranks in each. In one job, alternating trial by trial: shoal's
``hierarchical`` algorithm, shoal's flat ``ring`` over TCP, and torch's gloo ring. The physical
limit is measured in the same run (one TCP stream across the link) and every method is shown
as a ratio to the link-bound floor ``2 (M-1)/M x bytes / link bandwidth`` (M nodes): the bytes
each host's link must carry in each direction for any allreduce.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .common import alternate, worst_over_ranks, write_results
from .netns import ClusterUnavailableError, EmulatedCluster
from .stats import human_bytes, parse_size, stats

__all__ = ["add_arguments", "format_table", "run", "worker_main"]

LOCAL = 2  # ranks per emulated node


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench cluster``."""
    p.add_argument("--nodes", type=int, default=2, help="emulated hosts (2 ranks each)")
    p.add_argument("--sizes", default="4M,16M,64M")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--rate", default="1gbit", help="link rate for tc tbf (e.g. 1gbit)")
    p.add_argument("--out", default="benchmarks/cluster.json")
    p.add_argument("--timeout", type=float, default=900)


def worker_main(argv: Sequence[str]) -> None:
    """One rank, inside its node's namespace."""
    p = argparse.ArgumentParser()
    for flag in ("--rank", "--size", "--port", "--gloo-port"):
        p.add_argument(flag, type=int, required=True)
    for flag in ("--host", "--addr", "--secret", "--job", "--device", "--sizes", "--json"):
        p.add_argument(flag, required=True)
    p.add_argument("--trials", type=int, required=True)
    args = p.parse_args(argv)
    import shoal
    from shoal.core import algorithms
    shoal.init(rank=args.rank, size=args.size, rendezvous_addr=args.addr,
               rendezvous_port=args.port, hostname=args.host, secret=args.secret,
               job_id=args.job)
    transport = shoal.communicator().transport
    methods_names = ["hierarchical", "ring"]
    gloo = None
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR=args.addr, MASTER_PORT=str(args.gloo_port),
                          GLOO_SOCKET_IFNAME=args.device)
        dist.init_process_group("gloo", rank=args.rank, world_size=args.size)
        gloo = dist
    except ImportError:
        pass
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    results: dict[str, Any] = {"times": {}, "link": []}
    # the physical limit, measured now: one stream from node 0 to node 1
    probe = np.ones(16 << 20, np.uint8)
    for _ in range(3):
        shoal.barrier()
        t0 = time.perf_counter()
        if args.rank == 0:
            transport.mesh.send(LOCAL, memoryview(probe))
        elif args.rank == LOCAL:
            transport.mesh.recv_into(0, memoryview(probe))
        shoal.barrier()
        results["link"].append(probe.nbytes / (time.perf_counter() - t0))
    for nbytes in sizes:
        x = np.random.default_rng(args.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        methods = {}
        for name in methods_names:
            def run_algo(name: str = name, x: np.ndarray = x, out: np.ndarray = out) -> None:
                algorithms.choose(transport, name)
                shoal.allreduce(x, op=shoal.Sum, name="cluster", out=out)
            methods[f"shoal-{name}"] = run_algo
        if gloo is not None:
            t = torch.from_numpy(x.copy())
            methods["gloo-ring"] = lambda t=t: gloo.all_reduce(t)
        results["times"][str(nbytes)] = alternate(methods, args.trials, 1, shoal.barrier)
    everyone = shoal.allgather_object(results)
    if args.rank == 0:
        link = max(max(r["link"]) for r in everyone if r["link"])
        summary = {"np": args.size, "nodes": args.size // LOCAL, "link_Bps": link,
                   "sizes": sizes, "methods": {}}
        for key in results["times"]:
            for name in results["times"][key]:
                st = worst_over_ranks([r["times"][key][name] for r in everyone])
                m = summary["nodes"]
                st["floor_s"] = 2 * (m - 1) / m * int(key) / link
                summary["methods"].setdefault(name, {})[key] = st
        with open(args.json, "w") as f:
            json.dump(summary, f)
    shoal.shutdown()


def format_table(result: dict[str, Any]) -> str:
    """Per size: each method's time and its ratio to the link-bound floor and to gloo."""
    methods = result["methods"]
    lines = [f"{result['nodes']} emulated nodes x {LOCAL} ranks, link measured "
             f"{result['link_Bps'] * 8 / 1e9:.2f} Gbit/s",
             f"{'size':>8} | {'method':>18} | {'min ms':>9} | {'median ms':>9} | "
             f"{'/ floor':>8} | {'gloo / it':>9}"]
    for nbytes in result["sizes"]:
        key = str(nbytes)
        gloo = methods.get("gloo-ring", {}).get(key)
        for name, per in methods.items():
            st = per[key]
            vs = f"{gloo['min'] / st['min']:8.2f}x" if gloo else "   n/a"
            lines.append(f"{human_bytes(nbytes):>8} | {name:>18} | {st['min'] * 1e3:9.1f} | "
                         f"{st['median'] * 1e3:9.1f} | {st['min'] / st['floor_s']:7.2f}x | "
                         f"{vs}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Build the namespaces, run the 4-rank job inside them, tear everything down."""
    from .common import free_port
    try:
        cluster = EmulatedCluster(args.nodes, args.rate)
    except ClusterUnavailableError as exc:
        print(f"shoal bench cluster: {exc}", file=sys.stderr)
        return 2
    size = args.nodes * LOCAL
    out = os.path.abspath(args.out) + ".part"
    common = ["--size", str(size), "--port", str(free_port()), "--gloo-port",
              str(free_port()), "--addr", cluster.addresses[0], "--secret",
              secrets.token_hex(16), "--job", f"cluster{os.getpid()}", "--sizes", args.sizes,
              "--trials", str(args.trials), "--json", out]
    try:
        with cluster:
            procs = []
            for rank in range(size):
                node = rank // LOCAL
                argv = [sys.executable, "-m", "shoal.bench.cluster", "--rank", str(rank),
                        "--host", f"node{node}", "--device", cluster.devices[node], *common]
                procs.append(subprocess.Popen(cluster.command(node, argv)))
            deadline = time.monotonic() + args.timeout
            codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except (ClusterUnavailableError, subprocess.TimeoutExpired) as exc:
        print(f"shoal bench cluster: {exc}", file=sys.stderr)
        return 1
    if any(codes):
        print(f"shoal bench cluster: workers exited with {codes}", file=sys.stderr)
        return 1
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    print(format_table(result))
    write_results(args.out, {"results": [result], "rate": args.rate,
                             "link": stats([result["link_Bps"]])})
    return 0


if __name__ == "__main__":
    worker_main(sys.argv[1:])
