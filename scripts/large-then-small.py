"""The loop that crashed across hosts (issue 63), run as a user runs it: an 8 MiB allreduce,
``barrier()``, a 2-element int64 allreduce, ``--iterations`` times, on ranks split into
emulated hosts on loopback (``--hosts a,a,b,b``), with ``--busy`` spinning processes beside
them, ``--runs`` jobs in a row. Every result is checked; the first failure ends it.

    .venv/bin/python scripts/large-then-small.py --hosts a,a,b,b --busy 2 --runs 10
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from harness import run_ranks  # noqa: E402


def _loop(rank: int, iterations: int, nbytes: int) -> tuple[int, int]:
    import shoal
    n = shoal.size()
    big = np.full(nbytes // 4, float(rank + 1), np.float32)
    want = float(sum(range(1, n + 1)))
    for i in range(iterations):
        out = shoal.allreduce(big, op=shoal.Sum, name="big")
        if out[0] != want or out[-1] != want:
            raise AssertionError(f"rank {rank} iteration {i}: large allreduce gave {out[:3]}")
        shoal.barrier()
        small = shoal.allreduce(np.array([rank, i], np.int64), op=shoal.Sum, name="small")
        if small.tolist() != [n * (n - 1) // 2, n * i]:
            raise AssertionError(f"rank {rank} iteration {i}: small allreduce gave {small}")
    engine = shoal.communicator().engine
    return engine.small_rounds, engine.rounds


def _spin(stop: float) -> None:
    while time.time() < stop:
        pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default="a,a,b,b", help="each rank's host, comma-separated")
    p.add_argument("--iterations", type=int, default=1000)
    p.add_argument("--bytes", type=int, default=8 << 20)
    p.add_argument("--busy", type=int, default=2, help="spinning processes beside the job")
    p.add_argument("--runs", type=int, default=10)
    args = p.parse_args()
    hosts = args.hosts.split(",")
    for run in range(args.runs):
        spinners = [mp.Process(target=_spin, args=(time.time() + 3600,), daemon=True)
                    for _ in range(args.busy)]
        for s in spinners:
            s.start()
        start = time.monotonic()
        try:
            results = run_ranks(_loop, len(hosts), args.iterations, args.bytes, hosts=hosts,
                                timeout=3600, timeout_s=60.0)
        finally:
            for s in spinners:
                s.kill()
        print(f"run {run + 1}/{args.runs} hosts={args.hosts}: {args.iterations} iterations in "
              f"{time.monotonic() - start:.1f} s, one-round collectives per rank "
              f"{[r for r, _ in results]}, rounds {[t for _, t in results]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
