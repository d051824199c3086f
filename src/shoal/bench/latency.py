"""``shoal bench latency``: small allreduces across emulated hosts against the raw TCP round trip.

Two network namespaces (``--nodes``) on a shaped link (:class:`~shoal.bench.netns.
EmulatedCluster`), ``--local`` ranks in each. In one job, alternating trial by trial, each
trial ``--reps`` back-to-back calls: shoal's allreduce (float32 Sum, named, so steady state),
torch's gloo allreduce, and the floor any allreduce across hosts pays: a raw TCP round trip
between rank 0 and the first rank of the next node, the message there and back over one
connection with Nagle off (plain sockets, the same Python). An allreduce across two hosts
needs at least that exchange; shoal / rtt says what the library adds to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .common import worst_over_ranks, write_results
from .netns import ClusterUnavailableError, EmulatedCluster, run_bench_job
from .stats import human_bytes, parse_size

__all__ = ["add_arguments", "format_table", "run", "worker_main"]

_CONNECT_S = 120.0  # longest wait for the round-trip partner, and for any of its messages


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench latency``."""
    p.add_argument("--nodes", type=int, default=2, help="emulated hosts")
    p.add_argument("--local", type=int, default=2, help="ranks per emulated host")
    p.add_argument("--sizes", default="4K,64K")
    p.add_argument("--trials", type=int, default=11)
    p.add_argument("--reps", type=int, default=100, help="calls per trial")
    p.add_argument("--rate", default="1gbit", help="link rate (e.g. 1gbit)")
    p.add_argument("--out", default="benchmarks/latency.json")
    p.add_argument("--timeout", type=float, default=600)


def _read_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if not n:
            raise ConnectionError("the round-trip peer closed its connection")
        got += n


class _RoundTrip:
    """Rank 0 sends ``nbytes`` to its partner, which sends them back: one raw round trip."""

    def __init__(self, conn: socket.socket | None, first: bool, nbytes: int) -> None:
        self.conn, self.first = conn, first
        self.buf = memoryview(bytearray(nbytes))

    def __call__(self) -> None:
        conn = self.conn
        if conn is None:  # not one of the pair
            return
        if self.first:
            conn.sendall(self.buf)
            _read_into(conn, self.buf)
        else:
            _read_into(conn, self.buf)
            conn.sendall(self.buf)


def _pair(args: argparse.Namespace, partner: int, token: bytes) -> socket.socket | None:
    """The raw connection between rank 0 and ``partner`` (None elsewhere); the dialler proves
    it belongs to the job with the job's token before anything is timed."""
    if args.rank not in (0, partner):
        return None
    if args.rank == 0:
        with socket.create_server((args.bind, args.rtt_port)) as server:
            server.settimeout(_CONNECT_S)
            while True:
                conn, _ = server.accept()
                conn.settimeout(_CONNECT_S)
                seen = bytearray(len(token))
                try:
                    _read_into(conn, memoryview(seen))
                except (OSError, ConnectionError):
                    conn.close()
                    continue
                if bytes(seen) == token:
                    break
                conn.close()  # a stranger: not ours
    else:
        deadline = time.monotonic() + _CONNECT_S
        while True:
            try:
                conn = socket.create_connection((args.addr, args.rtt_port), timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        conn.settimeout(_CONNECT_S)
        conn.sendall(token)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def worker_main(argv: Sequence[str]) -> None:
    """One rank, inside its node's namespace."""
    p = argparse.ArgumentParser()
    for flag in ("--rank", "--size", "--local", "--port", "--gloo-port", "--rtt-port",
                 "--trials", "--reps"):
        p.add_argument(flag, type=int, required=True)
    for flag in ("--host", "--addr", "--bind", "--secret", "--job", "--device", "--sizes",
                 "--json"):
        p.add_argument(flag, required=True)
    args = p.parse_args(argv)
    import shoal
    shoal.init(rank=args.rank, size=args.size, rendezvous_addr=args.addr,
               rendezvous_port=args.port, hostname=args.host, secret=args.secret,
               job_id=args.job)
    gloo = None
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR=args.addr, MASTER_PORT=str(args.gloo_port),
                          GLOO_SOCKET_IFNAME=args.device)
        dist.init_process_group("gloo", rank=args.rank, world_size=args.size,
                                timeout=datetime.timedelta(seconds=300))
        gloo = dist
    except ImportError:
        pass
    conn = _pair(args, args.local, args.secret.encode())
    times: dict[str, dict[str, list[float]]] = {}
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        x = np.random.default_rng(args.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        methods: dict[str, Callable[[], Any]] = {
            "shoal": lambda x=x, out=out: shoal.allreduce(x, op=shoal.Sum, name="lat", out=out),
            "rtt": _RoundTrip(conn, args.rank == 0, nbytes)}
        if gloo is not None:
            t = torch.from_numpy(x.copy())
            methods["gloo"] = lambda t=t: gloo.all_reduce(t)
        times[str(nbytes)] = _alternate(methods, args.trials, args.reps, shoal.barrier)
    engine = shoal.communicator().engine
    everyone = shoal.allgather_object(times)
    if args.rank == 0:
        summary: dict[str, Any] = {"np": args.size, "nodes": args.size // args.local,
                                   "local": args.local, "reps": args.reps,
                                   "algorithm": shoal.communicator().algorithm,
                                   # rounds of the job, and those that carried their data
                                   "rounds": engine.rounds, "one_round": engine.small_rounds,
                                   "sizes": [int(k) for k in times], "methods": {}}
        for key, per in times.items():
            for name in per:
                # the round trip is timed by its two ends only; the others' zeros are no time
                rows = [r[key][name] for r in everyone if any(r[key][name])]
                summary["methods"].setdefault(name, {})[key] = worst_over_ranks(rows)
        with open(args.json, "w") as f:
            json.dump(summary, f)
    if conn is not None:
        conn.close()
    shoal.shutdown()


def _alternate(methods: dict[str, Callable[[], Any]], trials: int, reps: int,
               barrier: Callable[[], None]) -> dict[str, list[float]]:
    """Seconds per call, ``trials`` trials of ``reps`` calls each, methods taking turns; a
    rank outside the round trip records 0 for it."""
    names = list(methods)
    for name in names:
        for _ in range(3):
            methods[name]()
    out: dict[str, list[float]] = {name: [] for name in names}
    for trial in range(trials):
        k = trial % len(names)
        for name in names[k:] + names[:k]:
            fn = methods[name]
            barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            elapsed = (time.perf_counter() - t0) / reps
            idle = isinstance(fn, _RoundTrip) and fn.conn is None
            out[name].append(0.0 if idle else elapsed)
    return out


def format_table(result: dict[str, Any]) -> str:
    """Per size: each method's min and median time per call, and its ratio to the round trip
    (medians)."""
    methods = result["methods"]
    lines = [f"{result['nodes']} emulated nodes x {result['local']} ranks, link "
             f"{result['rate']}, algorithm {result['algorithm']}, {result['reps']} calls a "
             f"trial",
             f"{'size':>8} | {'method':>6} | {'min us':>8} | {'median us':>9} | "
             f"{'spread':>6} | {'it / rtt':>8}"]
    for nbytes in result["sizes"]:
        key = str(nbytes)
        rtt = methods["rtt"][key]["median"]
        for name, per in methods.items():
            st = per[key]
            lines.append(f"{human_bytes(nbytes):>8} | {name:>6} | {st['min'] * 1e6:8.1f} | "
                         f"{st['median'] * 1e6:9.1f} | {st['spread']:5.0%} | "
                         f"{st['median'] / rtt:7.2f}x")
    return "\n".join(lines)


def section(data: dict[str, Any]) -> list[str]:
    """BENCHMARKS.md's section of a latency results file."""
    from .common import markdown_table
    res = data["results"][0]
    first, _, table = format_table(res).partition("\n")
    return [f"## Small allreduces across emulated hosts against the raw TCP round trip, "
            f"{res['nodes']} x {res['local']}", "",
            f"Command: `{data['command']}`: {first}; per-trial maxima over ranks, methods "
            "alternating; rtt is a 4 KiB (or the size's) message there and back between two "
            "hosts over one raw connection, Nagle off; it / rtt compares medians.", "",
            *markdown_table(table), ""]


def run(args: argparse.Namespace) -> int:
    """Build the namespaces, run the job inside them, tear them down; print and record."""
    from .common import free_port
    try:
        cluster = EmulatedCluster(args.nodes, args.rate)
    except (ClusterUnavailableError, ValueError) as exc:
        print(f"shoal bench latency: {exc}", file=sys.stderr)
        return 2
    size = args.nodes * args.local
    out = os.path.abspath(args.out) + ".part"
    common = ["--size", str(size), "--local", str(args.local), "--port", str(free_port()),
              "--gloo-port", str(free_port()), "--rtt-port", str(free_port()),
              "--addr", cluster.addresses[0], "--secret", secrets.token_hex(16),
              "--job", f"latency{os.getpid()}", "--sizes", args.sizes, "--trials",
              str(args.trials), "--reps", str(args.reps), "--json", out]
    result = run_bench_job(cluster, "latency", size, args.local, common, out, args.timeout,
                           lambda node: ["--bind", cluster.addresses[node]])
    if result is None:
        return 1
    result["rate"] = args.rate
    print(format_table(result))
    write_results(args.out, {"results": [result]})
    return 0


if __name__ == "__main__":
    worker_main(sys.argv[1:])
