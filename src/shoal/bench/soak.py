"""``shoal bench soak``: many mixed collectives, every result checked against numpy.

Every rank draws the same sequence of operations from one seed (kind, size 0 to 4 MiB, dtype,
op, name style, sync or async, and now and then an injected clean error: one rank submits a
different shape), and its data from a seed of its own rank, so each rank can rebuild every
other rank's input and compute the numpy reference. The job reports mismatches, errors,
resident memory and the engine's name-cache size after the warm-up and at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["add_arguments", "format_table", "run", "worker_main"]

_RSS_LIMIT = 5 << 20  # resident memory may grow this much after the warm-up, no more
_DTYPES = ["float16", "float32", "float64", "int32", "int64", "uint8", "bool"]
_OPS = ["Sum", "Average", "Min", "Max", "Product"]
_FIXED = [1, 3, 100, 1001, 4096]  # element counts of the recurring fixed-signature names
_KINDS = ["allreduce", "allreduce", "allreduce_async", "broadcast", "allgather", "alltoall",
          "reducescatter", "broadcast_object", "error"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench soak``."""
    p.add_argument("--np", type=int, default=3, dest="np_")
    p.add_argument("--ops", type=int, default=10_000)
    p.add_argument("--max-bytes", default="4M", help="largest message")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="benchmarks/soak.json")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--hosts", type=int, default=1,
                   help="emulated hosts (network namespaces, root): the ranks split evenly")
    p.add_argument("--name-cache", type=int, default=512,
                   help="SHOAL_NAME_CACHE_SIZE of the run (small: evictions are exercised)")


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


_LIBC = _libc()  # glibc, loaded once; None elsewhere (then samples include freed heap)


def _rss_bytes() -> int:
    """Resident bytes after handing freed heap back (glibc ``malloc_trim``), so that a
    sample measures what is held, not what the allocator keeps for the next 4 MiB op."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def floor_growth(samples: list[int]) -> int:
    """How far the floor of the resident size rose: the lowest sample of the last third
    minus the lowest of the first third. A leak lifts the floor; the transient buffers of
    the op in flight when a sample is taken lift single samples only."""
    third = max(1, len(samples) // 3)
    return min(samples[-third:]) - min(samples[:third])


def _data(seed: int, rank: int, step: int, count: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng([seed, rank, step])
    if dtype == "bool":
        return rng.random(count) < 0.5
    if dtype.startswith(("int", "uint")):
        return rng.integers(0 if dtype == "uint8" else -3, 4, count).astype(dtype)
    return rng.uniform(-2, 2, count).astype(dtype)


def _reference(inputs: list[np.ndarray], op: str, dtype: str) -> np.ndarray:
    wide = np.stack([x.astype(np.float64) for x in inputs])
    if dtype == "bool":
        return (wide.min(0) if op in ("Min", "Product") else wide.max(0)).astype(bool)
    ref = {"Sum": wide.sum(0), "Average": wide.mean(0), "Min": wide.min(0),
           "Max": wide.max(0), "Product": wide.prod(0)}[op]
    if op == "Average" and dtype.startswith(("int", "uint")):  # truncated, as Horovod's
        ref = np.trunc(wide.sum(0) / len(inputs))
    return ref


def _close(got: np.ndarray, want: np.ndarray, dtype: str) -> bool:
    if dtype == "bool" or dtype.startswith(("int", "uint")):
        return bool(np.array_equal(got.astype(np.float64), want.astype(np.float64)))
    tol = 1e-2 if dtype == "float16" else 1e-5
    return bool(np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol * 4))


class _Soak:
    """One rank's run; ``step`` draws the operation every rank performs next."""

    def __init__(self, seed: int, max_bytes: int) -> None:
        import shoal
        self.shoal = shoal
        self.rank, self.size = shoal.rank(), shoal.size()
        self.seed = seed
        self.plan = np.random.default_rng(seed)
        self.max_bytes = max_bytes
        self.mismatches: list[str] = []
        self.errors_seen = 0
        self.counts: dict[str, int] = {}
        self.pending: list[tuple[Any, np.ndarray, str, str]] = []

    def _count(self) -> int:
        # log-uniform sizes with empty tensors now and then: most small, some up to max_bytes
        if self.plan.random() < 0.05:
            return 0
        return int(np.exp(self.plan.uniform(0, np.log(self.max_bytes // 8))))

    def _inputs(self, step: int, count: int, dtype: str) -> list[np.ndarray]:
        return [_data(self.seed, r, step, count, dtype) for r in range(self.size)]

    def _check(self, step: int, what: str, ok: bool) -> None:
        if not ok:
            self.mismatches.append(f"step {step}: {what}")

    def flush(self) -> None:
        for handle, want, dtype, what in self.pending:
            self._check(-1, what, _close(handle.wait(), want, dtype))
        self.pending = []

    def step(self, i: int) -> None:
        shoal, plan = self.shoal, self.plan
        kind = _KINDS[plan.integers(len(_KINDS))]
        dtype = _DTYPES[plan.integers(len(_DTYPES))]
        op = _OPS[plan.integers(len(_OPS))]
        # 0: unnamed, 1: a name per call, 2: a recurring name, 3: a recurring name with one
        # signature (what a training loop does: the one-round small path, after a first)
        style = plan.integers(4)
        name = None if style == 0 else (f"soak.{i}" if style == 1 else
                                        f"soak.r{plan.integers(50)}")
        count = self._count()
        if style == 3:
            kind = "allreduce" if kind not in ("broadcast", "reducescatter") else kind
            count = int(_FIXED[plan.integers(len(_FIXED))])
            name = f"soak.f.{kind}.{dtype}.{op}.{count}"
        size = np.dtype(dtype).itemsize
        count = min(count, self.max_bytes // size)
        if dtype == "bool" and op in ("Sum", "Average"):
            op = "Max"
        if op == "Product" and dtype in ("float16", "uint8"):
            op = "Sum"  # products of many values leave these ranges; covered by the others
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if kind != "allreduce_async":
            self.flush()
        inputs = self._inputs(i, count, dtype)
        mine = inputs[self.rank]
        what = f"{kind} {dtype} {op} x{count} name={name}"
        if kind in ("allreduce", "allreduce_async"):
            want = _reference(inputs, op, dtype)
            if kind == "allreduce":
                self._check(i, what, _close(shoal.allreduce(mine, getattr(shoal, op), name),
                                            want, dtype))
            else:
                name = name if style != 2 else f"soak.async.{i}"  # no duplicate in flight
                handle = shoal.allreduce_async(mine, getattr(shoal, op), name)
                self.pending.append((handle, want, dtype, what))
                if len(self.pending) >= 4:
                    self.flush()
        elif kind == "broadcast":
            root = int(plan.integers(self.size))
            got = shoal.broadcast(mine.copy(), root, name)
            self._check(i, what, np.array_equal(got, inputs[root]))
        elif kind == "allgather":
            rows = [int(plan.integers(0, 5)) for _ in range(self.size)]
            parts = [_data(self.seed, r, i, rows[r] * 3, dtype).reshape(-1, 3)
                     for r in range(self.size)]
            got = shoal.allgather(parts[self.rank], name)
            self._check(i, what, np.array_equal(got, np.concatenate(parts)))
        elif kind == "alltoall":
            splits = plan.integers(0, 4, (self.size, self.size))
            sent = [_data(self.seed, r, i, int(splits[r].sum()) * 2, dtype).reshape(-1, 2)
                    for r in range(self.size)]
            got, recv = shoal.alltoall(sent[self.rank], splits[self.rank].tolist(), name)
            offs = [np.cumsum([0, *splits[r]]) for r in range(self.size)]
            want = np.concatenate([sent[r][offs[r][self.rank]:offs[r][self.rank + 1]]
                                   for r in range(self.size)])
            self._check(i, what, np.array_equal(got, want)
                        and recv.tolist() == splits[:, self.rank].tolist())
        elif kind == "reducescatter":
            rows = max(1, count // 4)
            inputs = [x[:rows * 4].reshape(-1, 4) if x.size >= rows * 4 else
                      np.resize(x, (rows, 4)) for x in inputs]
            want = _reference(inputs, op, dtype)
            base, extra = divmod(want.shape[0], self.size)
            start = self.rank * base + min(self.rank, extra)
            got = shoal.reducescatter(inputs[self.rank], getattr(shoal, op), name)
            self._check(i, what, _close(got, want[start:start + base + (self.rank < extra)],
                                        dtype))
        elif kind == "broadcast_object":
            obj = {"step": i, "from": self.rank, "blob": "x" * int(plan.integers(0, 4096))}
            root = int(plan.integers(self.size))
            got = shoal.broadcast_object(obj, root, name)
            self._check(i, what, got == {**obj, "from": root})
        else:  # an injected clean error: the last rank submits another shape
            bad = np.ones(3 + (self.rank == self.size - 1), np.float32)
            try:
                shoal.allreduce(bad, name=f"soak.bad.{i % 7}")
                self._check(i, "injected mismatch did not raise", False)
            except shoal.CollectiveMismatchError:
                self.errors_seen += 1


def worker_main(argv: Sequence[str]) -> None:
    """One rank of the soak (started by shoalrun)."""
    from .stats import parse_size
    p = argparse.ArgumentParser()
    p.add_argument("--ops", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--max-bytes", required=True)
    p.add_argument("--json", required=True)
    for flag in ("--rank", "--size", "--port"):  # started directly (emulated hosts)
        p.add_argument(flag, type=int, default=None)
    for flag in ("--addr", "--host", "--secret"):
        p.add_argument(flag, default=None)
    args = p.parse_args(argv)
    import shoal
    if args.rank is None:
        shoal.init()
    else:
        shoal.init(rank=args.rank, size=args.size, rendezvous_addr=args.addr,
                   rendezvous_port=args.port, hostname=args.host, secret=args.secret,
                   job_id="soak")
    soak = _Soak(args.seed, parse_size(args.max_bytes))
    engine = shoal.communicator().engine
    warm = max(1, min(1000, args.ops // 10))
    t0 = time.perf_counter()
    start: dict[str, int] = {}
    samples: list[int] = []
    for i in range(args.ops):
        soak.step(i)
        if i + 1 == warm:
            soak.flush()
            start = {"rss": _rss_bytes(), "cache": len(engine.names)}
        if i + 1 >= warm and (i + 1 - warm) % max(1, (args.ops - warm) // 10) == 0:
            samples.append(_rss_bytes())  # the trend after the warm-up, eleven points
    soak.flush()
    shoal.barrier()
    seconds = time.perf_counter() - t0
    mine = {"rank": soak.rank, "mismatches": soak.mismatches[:20],
            "mismatch_count": len(soak.mismatches), "errors_injected": soak.errors_seen,
            "rss_start": start.get("rss", 0), "rss_end": _rss_bytes(), "rss_samples": samples,
            "cache_start": start.get("cache", 0), "cache_end": len(engine.names),
            "cache_limit": engine.cfg.name_cache_size, "counts": soak.counts,
            "small_rounds": engine.small_rounds, "rounds": engine.rounds,
            "algorithm": shoal.communicator().algorithm}
    ranks = shoal.allgather_object(mine)
    if soak.rank == 0:
        with open(args.json, "w") as f:
            json.dump({"ops": args.ops, "warmup_ops": warm, "seconds": seconds,
                       "size": soak.size, "seed": args.seed, "max_bytes": args.max_bytes,
                       "hosts": shoal.communicator().world.cross_size,
                       "ranks": ranks}, f, indent=1)
    shoal.shutdown()


def format_table(result: dict[str, Any]) -> str:
    """The console summary of one soak."""
    lines = [f"soak: {result['ops']} ops on {result['size']} ranks in {result['seconds']:.0f} s"
             f" (seed {result['seed']}, up to {result['max_bytes']})",
             " rank | mismatches | injected errors | RSS after warm-up -> end (MiB) | "
             "name cache -> end (limit)"]
    for r in result["ranks"]:
        lines.append(f" {r['rank']:4} | {r['mismatch_count']:10} | {r['errors_injected']:15} | "
                     f"{r['rss_start'] / 2**20:8.1f} -> {r['rss_end'] / 2**20:8.1f}"
                     f"{'':14} | {r['cache_start']} -> {r['cache_end']} ({r['cache_limit']})")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the soak through shoalrun and write the JSON results."""
    from .common import run_job, write_results
    os.environ["SHOAL_NAME_CACHE_SIZE"] = str(args.name_cache)
    common = ["--ops", str(args.ops), "--seed", str(args.seed), "--max-bytes", args.max_bytes]
    try:
        if args.hosts > 1:
            result = _run_emulated(args, common)
        else:
            result = run_job(args.np_, "shoal.bench.soak", common, timeout=args.timeout)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"shoal bench soak: {exc}", file=sys.stderr)
        return 1
    print(format_table(result))
    growth = max(floor_growth(r["rss_samples"] or [r["rss_start"], r["rss_end"]])
                 for r in result["ranks"])
    bad = sum(r["mismatch_count"] for r in result["ranks"])
    result["name_cache_size"] = args.name_cache
    result["verdict"] = {"mismatches": bad, "max_rss_growth_bytes": growth,
                         "pass": bad == 0 and growth < _RSS_LIMIT}
    print(f"mismatches {bad}, largest rise of the RSS floor {growth / 2**20:.1f} MiB: "
          f"{'PASS' if result['verdict']['pass'] else 'FAIL'}")
    write_results(args.out, result)
    return 0 if result["verdict"]["pass"] else 1


def _run_emulated(args: argparse.Namespace, common: list[str]) -> dict[str, Any]:
    """The ranks started directly inside ``args.hosts`` network namespaces (rank 0 serves
    the store), ``np / hosts`` each."""
    from .common import free_port
    from .netns import EmulatedCluster
    per = args.np_ // args.hosts
    if per * args.hosts != args.np_:
        raise RuntimeError(f"--np {args.np_} does not split evenly over {args.hosts} hosts")
    with EmulatedCluster(args.hosts, "10gbit") as cluster, \
            tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        port, secret = free_port(), secrets.token_hex(16)
        procs = []
        for rank in range(args.np_):
            node = rank // per
            argv = [sys.executable, "-m", "shoal.bench.soak", *common, "--json", out,
                    "--rank", str(rank), "--size", str(args.np_), "--port", str(port),
                    "--addr", cluster.addresses[0], "--host", f"node{node}",
                    "--secret", secret]
            procs.append(subprocess.Popen(cluster.command(node, argv)))
        codes = [p.wait(args.timeout) for p in procs]
        if any(codes):
            raise RuntimeError(f"the emulated-host soak failed (exit codes {codes})")
        with open(out) as f:
            return json.load(f)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
