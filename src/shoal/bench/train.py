"""``shoal bench train``: end-to-end EfficientNet training throughput, shoal vs DDP.

Runs the training application (``apps/efficientnet``, from a source checkout) in its
``training_benchmark`` mode on synthetic data, once per backend, world size and setting, the
jobs taking turns trial by trial: shoal's ``DistributedOptimizer``, stock DDP over
``backend="shoal"`` and stock DDP over gloo. Every worker runs one intra-op thread
(``OMP_NUM_THREADS=1``), so the per-worker compute is the same at every world size; scaling
efficiency = throughput(N) / (N x throughput(1)). On a 2-core machine, N > 2 oversubscribes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from .common import write_results
from .stats import stats

__all__ = ["add_arguments", "format_table", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench train``."""
    p.add_argument("--np", type=int, nargs="+", default=[1, 2])
    p.add_argument("--backends", default="shoal,ddp-shoal,ddp-gloo")
    p.add_argument("--settings", default="64:16,128:32",
                   help="image_size:per-worker-batch pairs (communication-heavy, compute-heavy)")
    p.add_argument("--arch", default="efficientnet-b0")
    p.add_argument("--steps", type=int, default=30, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--out", default="benchmarks/train.json")
    p.add_argument("--timeout", type=float, default=900)


def _job(n: int, backend: str, size: int, batch: int, args: argparse.Namespace) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "shoal.runner", "-np", str(n), sys.executable, "-m",
               "apps.efficientnet.main", "--mode", "training_benchmark", "--synthetic",
               "--arch", args.arch, "--image_size", str(size), "--train_batch_size",
               str(batch), "--max_epochs", "1", "--steps_per_epoch",
               str(args.steps + args.warmup), "--benchmark_warmup_steps", str(args.warmup),
               "--backend", backend, "--model_dir", tmp, "--num_workers", "0",
               "--log_steps", "0", "--log_filename", "log.json"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True,
                              env=env, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{backend} np={n} failed: {proc.stderr[-500:]}")
        with open(os.path.join(tmp, "log.json")) as f:
            lines = [json.loads(line) for line in f if line.strip()]
    summary = next(x for x in lines if x.get("step") == "SUMMARY")["data"]
    return float(summary["avg_exp_per_second_training"])


def format_table(result: dict[str, Any]) -> str:
    """Images/second per backend and world size, scaling efficiency and ratios."""
    lines = [f"{result['arch']} training throughput (images/s, all workers), synthetic data, "
             f"1 thread per worker"]
    for setting, per in result["settings"].items():
        lines.append(f"setting {setting} (image size : per-worker batch)")
        for backend, by_np in per.items():
            cells = [f"np={n}: {st['median']:.1f}" for n, st in by_np.items()]
            one = by_np.get("1", {}).get("median")
            eff = [f"eff(np={n}) {st['median'] / (int(n) * one):.1%}"
                   for n, st in by_np.items() if one and n != "1"]
            lines.append(f"  {backend:>10} | " + " | ".join(cells + eff))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Driver: every (setting, np) runs each backend in turn, ``--trials`` times."""
    backends = args.backends.split(",")
    result: dict[str, Any] = {"arch": args.arch, "steps": args.steps, "settings": {}}
    for setting in args.settings.split(","):
        size, batch = (int(v) for v in setting.split(":"))
        samples: dict[str, dict[str, list[float]]] = {b: {} for b in backends}
        for n in args.np:
            for trial in range(args.trials):
                k = trial % len(backends)
                for backend in backends[k:] + backends[:k]:
                    try:
                        tput = _job(n, backend, size, batch, args)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        print(f"shoal bench train: {exc}", file=sys.stderr)
                        return 1
                    samples[backend].setdefault(str(n), []).append(tput)
                    print(f"{setting} np={n} {backend}: {tput:.1f} images/s", flush=True)
        result["settings"][setting] = {b: {n: stats(v) for n, v in per.items()}
                                       for b, per in samples.items()}
    print(format_table(result))
    write_results(args.out, {"results": [result]})
    return 0
