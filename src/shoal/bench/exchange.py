"""``shoal bench exchange``: a training step's gradient exchange for a real model.

Every parameter's gradient (EfficientNet-B0: 213 float32 tensors, 5,288,548 values) is
allreduced the way a training step does it, handed over in reverse registration order as
backward produces them. Methods, alternating trial by trial in one job:

- ``shoal``: every gradient submitted asynchronously, then all waited for (the engine fuses);
- ``gloo-per-tensor``: ``torch.distributed.all_reduce`` on each gradient in turn;
- ``gloo-flat``: gradients copied into one flat buffer, one ``all_reduce``, copied back (what
  DDP's buckets do, with a single bucket).

The floor is one memcpy of the whole gradient set on one process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .common import alternate, init_gloo, run_job, worst_over_ranks, write_results
from .models import MODELS, param_shapes
from .stats import stats

__all__ = ["add_arguments", "format_table", "run", "worker_main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench exchange``."""
    p.add_argument("--model", default="efficientnet-b0", choices=MODELS)
    p.add_argument("--np", type=int, nargs="+", default=[2, 4], help="world sizes to run")
    p.add_argument("--trials", type=int, default=15)
    p.add_argument("--compression", default="none", choices=["none", "fp16", "bf16"])
    p.add_argument("--out", default="benchmarks/exchange.json")
    p.add_argument("--timeout", type=float, default=900)


def worker_main(argv: Sequence[str]) -> None:
    """Runs inside every rank of the job."""
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--trials", type=int, required=True)
    p.add_argument("--compression", default="none")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    import shoal
    from shoal.core.compression import Compression
    shoal.init()
    codec = Compression.by_name(args.compression)
    shapes = param_shapes(args.model)
    rng = np.random.default_rng(shoal.rank())
    grads = [rng.standard_normal(s).astype(np.float32) for _, s in shapes]
    names = [n for n, _ in shapes]
    outs = [np.empty_like(g) for g in grads]
    order = list(range(len(grads)))[::-1]  # backward produces the last layer's first

    def shoal_step() -> None:
        hs = [shoal.allreduce_async(grads[i], name=names[i], out=outs[i], compression=codec)
              for i in order]
        for h in hs:
            h.wait()

    methods: dict[str, Any] = {"shoal": shoal_step}
    gloo = init_gloo()
    if gloo is not None:
        torch, dist = gloo
        tgrads = [torch.from_numpy(g.copy()) for g in grads]
        flat = torch.empty(sum(g.size for g in grads))

        def per_tensor() -> None:
            for i in order:
                dist.all_reduce(tgrads[i])

        def flat_buffer() -> None:
            torch.cat([tgrads[i].view(-1) for i in order], out=flat)
            dist.all_reduce(flat)
            pos = 0
            for i in order:
                n = tgrads[i].numel()
                tgrads[i].view(-1).copy_(flat[pos:pos + n])
                pos += n

        methods["gloo-per-tensor"] = per_tensor
        methods["gloo-flat"] = flat_buffer
    times = alternate(methods, args.trials, 1, shoal.barrier)
    everything = np.concatenate([g.reshape(-1) for g in grads])
    copy = np.empty_like(everything)
    times["memcpy"] = []
    for _ in range(args.trials):
        t0 = time.perf_counter()
        np.copyto(copy, everything)
        times["memcpy"].append(time.perf_counter() - t0)
    everyone = shoal.allgather_object(times)
    if shoal.rank() == 0:
        result = {"np": shoal.size(), "model": args.model, "tensors": len(grads),
                  "values": int(everything.size), "compression": args.compression,
                  "algorithm": shoal.communicator().algorithm,
                  "missing": {} if gloo else {"gloo": "torch is not installed"},
                  "methods": {m: worst_over_ranks([t[m] for t in everyone]) for m in times}}
        with open(args.json, "w") as f:
            json.dump(result, f)
    shoal.shutdown()


def format_table(result: dict[str, Any]) -> str:
    """Min / median per method and shoal's ratio to each."""
    m = result["methods"]
    s = m["shoal"]["min"]
    lines = [f"{result['model']} gradient exchange: {result['tensors']} tensors, "
             f"{result['values']:,} values, np={result['np']}, algorithm "
             f"{result['algorithm']}, compression {result['compression']}",
             f"{'method':>18} | {'min ms':>8} | {'median ms':>9} | {'shoal / method':>14}"]
    for name, st in m.items():
        lines.append(f"{name:>18} | {st['min'] * 1e3:8.2f} | {st['median'] * 1e3:9.2f} | "
                     f"{s / st['min']:13.2f}x")
    lines += [f"{name:>18} | missing: {why}" for name, why in result["missing"].items()]
    return "\n".join(lines)


def _horovod(n: int, model: str, trials: int, timeout: float) -> dict[str, Any] | str:
    """Horovod's figures from a horovodrun job in the peers venv, or why there are none."""
    from importlib import resources

    from .peers import available_peers, peer_python
    if not available_peers().get("horovod"):
        return "not installed (scripts/install-peers.sh)"
    python = peer_python()
    horovodrun = os.path.join(os.path.dirname(python), "horovodrun")
    shapes = resources.files("shoal.bench").joinpath(f"data/{model.replace('-', '_')}.json")
    script = resources.files("shoal.bench").joinpath("peer_workers/horovod_exchange.py")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "horovod.json")
        cmd = [horovodrun, "-np", str(n), "-H", f"localhost:{n}", "--gloo", python,
               str(script), "--shapes", str(shapes), "--trials", str(trials), "--json", out]
        proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0 or not os.path.exists(out):
            return f"horovodrun failed (exit {proc.returncode}): {proc.stderr[-300:]}"
        with open(out) as f:
            return {name: stats(v) for name, v in json.load(f).items()}


def run(args: argparse.Namespace) -> int:
    """Driver: per world size, the shoal/gloo job, then Horovod's job right after it."""
    results = []
    for n in args.np:
        try:
            results.append(run_job(n, "shoal.bench.exchange",
                                   ["--model", args.model, "--trials", str(args.trials),
                                    "--compression", args.compression], args.timeout))
        except RuntimeError as exc:
            print(f"shoal bench exchange: {exc}", file=sys.stderr)
            return 1
        hvd = _horovod(n, args.model, args.trials, args.timeout)
        if isinstance(hvd, str):
            results[-1]["missing"]["horovod"] = hvd
        else:
            results[-1]["methods"].update(hvd)
            results[-1]["separate_job"] = sorted(hvd)
        print(format_table(results[-1]), flush=True)
    write_results(args.out, {"results": results})
    return 0


if __name__ == "__main__":
    worker_main(sys.argv[1:])
