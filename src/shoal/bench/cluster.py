"""``shoal bench cluster``: allreduce across emulated hosts joined by a shaped link.

Network namespaces act as nodes (``--nodes``, 2 by default, joined by a veth pair; more
around an emulated switch), each link shaped to ``--rate`` (1 Gbit/s by default), with 2
ranks in each; ``--flow-cap`` also holds every TCP connection to that rate, as clouds do
(:class:`~shoal.bench.netns.EmulatedCluster`). In one job, alternating trial by trial: shoal's
``hierarchical`` algorithm at each of ``--streams`` TCP connections per cross-host peer
(the job is rebuilt between methods of different stream counts, outside the timing), shoal's
flat ``ring`` at the most streams, ``hierarchical`` with ``Compression.fp16`` (an Average: 16-bit
words between hosts, :mod:`shoal.core.algorithms.wire16`) at the most streams, and torch's
gloo ring. The physical limits are measured in
the same run with raw TCP (:func:`~shoal.bench.flows.probe`): one connection (a per-flow cap
shows here) and 16 together (the link). Every method is shown as a ratio to the link-bound
floor ``2 (M-1)/M x bytes / link bandwidth`` (M nodes): the bytes each host's link must carry
in each direction for any allreduce.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .common import worst_over_ranks, write_results
from .flows import probe
from .netns import ClusterUnavailableError, EmulatedCluster, run_bench_job
from .stats import human_bytes, parse_size, stats

__all__ = ["add_arguments", "format_table", "run", "worker_main"]

LOCAL = 2  # ranks per emulated node
LINK_FLOWS = 16  # raw connections that together measure the link under any per-flow cap


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench cluster``."""
    p.add_argument("--nodes", type=int, default=2, help="emulated hosts (2 ranks each)")
    p.add_argument("--sizes", default="4M,16M,64M")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--rate", default="1gbit", help="link rate (e.g. 1gbit)")
    p.add_argument("--flow-cap", default=None,
                   help="also cap every TCP connection at this rate (e.g. 250mbit)")
    p.add_argument("--streams", default="1,auto",
                   help="TCP streams per cross-host peer to compare (counts or auto)")
    p.add_argument("--out", default="benchmarks/cluster.json")
    p.add_argument("--timeout", type=float, default=900)


def _streams_setting(text: str) -> int:
    return 0 if text == "auto" else int(text)


def worker_main(argv: Sequence[str]) -> None:
    """One rank, inside its node's namespace."""
    p = argparse.ArgumentParser()
    for flag in ("--rank", "--size", "--port", "--gloo-port"):
        p.add_argument(flag, type=int, required=True)
    for flag in ("--host", "--addr", "--secret", "--job", "--device", "--sizes", "--json",
                 "--streams"):
        p.add_argument(flag, required=True)
    p.add_argument("--trials", type=int, required=True)
    args = p.parse_args(argv)
    import shoal
    from shoal.core import algorithms
    from shoal.core.compression import Compression
    joined: dict[str, int] = {}

    def join(streams: int) -> None:
        if joined.get("streams") == streams:
            return
        if joined:
            shoal.shutdown()
        shoal.init(rank=args.rank, size=args.size, rendezvous_addr=args.addr,
                   rendezvous_port=args.port, hostname=args.host, secret=args.secret,
                   job_id=f"{args.job}s{streams}", tcp_streams=streams)
        joined["streams"] = streams
        joined["chosen"] = shoal.communicator().transport.mesh.streams(
            (args.rank + LOCAL) % args.size)

    settings = {s: _streams_setting(s) for s in args.streams.split(",")}
    join(next(iter(settings.values())))
    gloo = None
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR=args.addr, MASTER_PORT=str(args.gloo_port),
                          GLOO_SOCKET_IFNAME=args.device)
        dist.init_process_group("gloo", rank=args.rank, world_size=args.size,
                                timeout=datetime.timedelta(seconds=300))  # not 30 minutes
        gloo = dist
    except ImportError:
        pass
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    results: dict[str, Any] = {"times": {}, "streams": {}}
    most = max(settings.values(), key=lambda v: v or 1 << 30)
    for nbytes in sizes:
        x = np.random.default_rng(args.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        methods: dict[str, tuple[int | None, Callable[[], Any]]] = {}
        plan = [("hierarchical", label, v) for label, v in settings.items()]
        plan += [("ring", label, v) for label, v in settings.items() if v == most]
        plan += [("hierarchical+fp16", label, v) for label, v in settings.items() if v == most]
        for method, label, streams in plan:
            algo, _, codec = method.partition("+")

            def run_algo(algo: str = algo, codec: str = codec, x: np.ndarray = x,
                         out: np.ndarray = out) -> None:
                algorithms.choose(shoal.communicator().transport, algo)
                if codec:  # the 16-bit wire: what Compression.fp16 sends between hosts
                    shoal.allreduce(x, op=shoal.Average, name="cluster16", out=out,
                                    compression=Compression.fp16)
                else:
                    shoal.allreduce(x, op=shoal.Sum, name="cluster", out=out)
            methods[f"shoal-{method}@{label}"] = (streams, run_algo)
        if gloo is not None:
            t = torch.from_numpy(x.copy())
            methods["gloo-ring"] = (None, lambda t=t: gloo.all_reduce(t))

        def setup(name: str, methods: dict = methods) -> None:
            streams, fn = methods[name]
            if streams is not None and joined["streams"] != streams:
                join(streams)
                fn()  # the new connections warmed up outside the timing
            if streams is not None:
                results["streams"][name] = joined["chosen"]

        results["times"][str(nbytes)] = _alternate(methods, args.trials, setup, shoal.barrier)
    everyone = shoal.allgather_object(results)
    if args.rank == 0:
        summary = {"np": args.size, "nodes": args.size // LOCAL, "sizes": sizes,
                   "streams": results["streams"], "methods": {}}
        for key in results["times"]:
            for name in results["times"][key]:
                summary["methods"].setdefault(name, {})[key] = worst_over_ranks(
                    [r["times"][key][name] for r in everyone])
        with open(args.json, "w") as f:
            json.dump(summary, f)
    shoal.shutdown()


def _alternate(methods: dict[str, tuple[int | None, Callable[[], Any]]], trials: int,
               setup: Callable[[str], None], barrier: Callable[[], None]
               ) -> dict[str, list[float]]:
    """Each method once untimed, then ``trials`` timed calls each, taking turns (who goes first
    rotates); ``setup(name)`` runs before a method's barrier, outside its time. ``methods``
    maps a name to (its stream count or None, the call)."""
    names = list(methods)
    for name in names:
        setup(name)
        methods[name][1]()
    # methods on the same connections stay together (gloo's with the last group), so a trial
    # rebuilds the job once, not at every turn; the groups and the methods in them take turns
    groups: dict[int | None, list[str]] = {}
    for name in names:
        groups.setdefault(methods[name][0], []).append(name)
    order = [g for key, g in groups.items() if key is not None]
    order[-1] += groups.get(None, [])
    times: dict[str, list[float]] = {name: [] for name in names}
    for trial in range(trials):
        k = trial % len(order)
        turn = [g[trial % len(g):] + g[:trial % len(g)] for g in order[k:] + order[:k]]
        for name in (name for g in turn for name in g):
            setup(name)
            barrier()
            t0 = time.perf_counter()
            methods[name][1]()
            times[name].append(time.perf_counter() - t0)
    return times


def format_table(result: dict[str, Any]) -> str:
    """Per size: each method's time and its ratio to the link-bound floor and to gloo."""
    methods = result["methods"]
    cap = f", per-flow cap {result['flow_cap']}" if result.get("flow_cap") else ""
    lines = [f"{result['nodes']} emulated nodes x {LOCAL} ranks, link {result['rate']}{cap}: "
             f"measured {result['link_Bps'] * 8 / 1e9:.3f} Gbit/s over {LINK_FLOWS} "
             f"connections, {result['flow_Bps'] * 8 / 1e9:.3f} Gbit/s over one",
             f"{'size':>8} | {'method':>29} | {'streams':>7} | {'min ms':>9} | "
             f"{'median ms':>9} | {'spread':>7} | {'floor / it':>10} | {'gloo / it':>9}"]
    m = result["nodes"]
    for nbytes in result["sizes"]:
        key = str(nbytes)
        floor = 2 * (m - 1) / m * nbytes / result["link_Bps"]
        gloo = methods.get("gloo-ring", {}).get(key)
        for name, per in methods.items():
            st = per[key]
            vs = f"{gloo['median'] / st['median']:8.2f}x" if gloo else "   n/a"
            streams = result["streams"].get(name, "")
            lines.append(f"{human_bytes(nbytes):>8} | {name:>29} | {streams!s:>7} | "
                         f"{st['min'] * 1e3:9.1f} | {st['median'] * 1e3:9.1f} | "
                         f"{st['spread']:6.0%} | "
                         f"{floor / st['median']:9.2f}x | {vs}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Build the namespaces, measure the link, run the job inside them, tear it all down."""
    from .common import free_port
    try:
        cluster = EmulatedCluster(args.nodes, args.rate, flow_cap=args.flow_cap)
    except (ClusterUnavailableError, ValueError) as exc:
        print(f"shoal bench cluster: {exc}", file=sys.stderr)
        return 2
    size = args.nodes * LOCAL
    out = os.path.abspath(args.out) + ".part"
    common = ["--size", str(size), "--port", str(free_port()), "--gloo-port",
              str(free_port()), "--addr", cluster.addresses[0], "--secret",
              secrets.token_hex(16), "--job", f"cluster{os.getpid()}", "--sizes", args.sizes,
              "--trials", str(args.trials), "--streams", args.streams, "--json", out]
    probe_bytes = max(4 << 20, int(cluster.rate_bytes_per_s() / 2))  # about 1/2 s at the link
    flow: list[float] = []
    link: list[float] = []

    def measure_link() -> None:
        flow.extend(probe(cluster, 0, 1, 1, probe_bytes) for _ in range(3))
        link.extend(probe(cluster, 0, 1, LINK_FLOWS, probe_bytes) for _ in range(3))
    result = run_bench_job(cluster, "cluster", size, LOCAL, common, out, args.timeout,
                           before=measure_link)
    if result is None:
        return 1
    result.update(rate=args.rate, flow_cap=args.flow_cap, link_Bps=max(link),
                  flow_Bps=float(np.median(flow)))
    print(format_table(result))
    write_results(args.out, {"results": [result], "rate": args.rate, "flow_cap": args.flow_cap,
                             "link": stats(link), "flow": stats(flow)})
    return 0


if __name__ == "__main__":
    worker_main(sys.argv[1:])
