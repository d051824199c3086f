"""Allreduce real gradient-sized buffers across the job, check them, and print bandwidth.

Run with ``shoalrun -np 2 python examples/allreduce_demo.py`` (``scripts/main.sh`` does).
Every rank fills its buffer with values it can predict for every other rank, so the result is
checked exactly, not just timed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import shoal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[0.004, 1, 16, 64])
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    shoal.init()
    rank, size = shoal.rank(), shoal.size()
    if rank == 0:
        print(f"shoal demo: {size} ranks on {shoal.cross_size()} host(s), algorithm "
              f"{shoal.communicator().algorithm}", flush=True)
    for mib in args.sizes_mib:
        n = max(1, int(mib * (1 << 20)) // 4)
        base = np.random.default_rng(7).standard_normal(n).astype(np.float32)
        x = base * (rank + 1)  # rank r holds (r+1) * base
        out = np.empty_like(x)
        shoal.allreduce(x, name="demo", out=out)  # warm-up
        times = []
        for _ in range(args.iters):
            shoal.barrier()
            t0 = time.perf_counter()
            shoal.allreduce(x, name="demo", out=out)
            times.append(time.perf_counter() - t0)
        want = base * ((size + 1) / 2)  # average of 1..size
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        best = min(times)
        if rank == 0:
            busbw = x.nbytes / best * 2 * (size - 1) / size / 1e9
            print(f"  {x.nbytes / (1 << 20):8.3f} MiB  {best * 1e3:8.3f} ms  "
                  f"bus bandwidth {busbw:6.2f} GB/s  (result checked)", flush=True)
    shoal.shutdown()


if __name__ == "__main__":
    main()
