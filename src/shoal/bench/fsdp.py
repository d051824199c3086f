"""``shoal bench fsdp``: FSDP2 (``fully_shard``) training steps over backend "shoal" and over
gloo, side by side in the same processes.

One job per world size; the same small transformer (4 encoder layers, width 256, 4 heads,
feed-forward 1024, batch 8 x 64 tokens per rank), each layer its own FSDP unit, built twice
from one seed: once on a mesh of a ``"shoal"`` group and once on a mesh of a gloo group. The
two take turns trial by trial (who goes first rotates); a trial is a few optimizer steps
(forward with its all-gathers, backward with its reduce-scatters, Adam) after a barrier. Per
trial the slowest rank counts; medians and spreads over the trials. After the trials the two
models' weights are compared (they train on the same data, so they must agree).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from .common import report_section, worst_over_ranks

__all__ = ["add_arguments", "format_table", "run", "section", "worker_main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench fsdp``."""
    p.add_argument("--np", type=int, nargs="+", default=[2], dest="np_")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--steps", type=int, default=3, help="optimizer steps per trial")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--out", default="benchmarks/fsdp.json")
    p.add_argument("--timeout", type=float, default=1800)


def _model(torch: Any, layers: int, width: int) -> Any:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[
        torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        for _ in range(layers)])


def worker_main(argv: Sequence[str]) -> None:
    """One rank (started by shoalrun)."""
    p = argparse.ArgumentParser()
    for flag in ("--trials", "--steps", "--layers", "--width"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    import json

    import shoal
    import shoal.torch.backend as backend

    from .common import init_gloo
    shoal.init()
    torch, dist = init_gloo()  # the default group: gloo, over env://
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    backend.register()
    groups = {"shoal": dist.new_group(backend="shoal"), "gloo": dist.new_group(backend="gloo")}
    me = dist.get_rank()
    runs = {}
    for name, group in groups.items():
        model = _model(torch, args.layers, args.width)
        mesh = DeviceMesh.from_group(group, "cpu")
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        runs[name] = (model, torch.optim.Adam(model.parameters(), lr=1e-4), group)
    step_no = {name: 0 for name in runs}

    def step(name: str) -> None:
        model, opt, _ = runs[name]
        g = torch.Generator().manual_seed(1000 * step_no[name] + me)
        x = torch.randn(8, 64, args.width, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        step_no[name] += 1

    names = list(runs)
    for name in names:  # warm-up: connections, allocations
        step(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for trial in range(args.trials):
        k = trial % len(names)
        for name in names[k:] + names[:k]:
            dist.barrier(group=runs[name][2])
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(name)
            times[name].append((time.perf_counter() - t0) / args.steps)
    from shoal.torch.work import ShoalWork

    from .fsdp_overlap import measure
    overlap = {}
    for name in names:  # apart from the timed trials: the instrumentation costs a little
        dist.barrier(group=runs[name][2])
        overlap[name] = measure(dist, (dist.Work, ShoalWork), lambda n=name: step(n), args.steps)
    weights = {name: torch.cat([p.full_tensor().reshape(-1) for p in runs[name][0].parameters()])
               for name in names}
    diff = float((weights["shoal"] - weights["gloo"]).detach().abs().max())
    every = shoal.allgather_object({"times": times, "diff": diff, "overlap": overlap})
    if me == 0:
        result = {"np": dist.get_world_size(), "layers": args.layers, "width": args.width,
                  "steps_per_trial": args.steps, "trials": args.trials,
                  "step_s": {name: worst_over_ranks([r["times"][name] for r in every])
                             for name in names},
                  "max_weight_diff": max(r["diff"] for r in every),
                  # per field the largest over the ranks (the smallest share hidden)
                  "overlap": {name: {k: (min if k == "hidden" else max)(
                      r["overlap"][name][k] for r in every) for k in overlap[name]}
                      for name in names},
                  "overlap_per_rank": [r["overlap"] for r in every]}
        result["ratio_gloo_over_shoal"] = (result["step_s"]["gloo"]["median"]
                                           / result["step_s"]["shoal"]["median"])
        with open(args.json, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()
    shoal.shutdown()


def _overlap_cell(o: dict[str, float] | None) -> str:
    if not o:
        return "-"
    return (f"{o['alone_s'] * 1e3:.1f} ms, {o['exposed_s'] * 1e3:.1f} ms "
            f"({o['hidden']:.0%})")


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per world size."""
    lines = ["ranks | shoal step (median, spread) | gloo step (median, spread) | "
             "gloo / shoal | shoal communication: alone, exposed (hidden) | "
             "gloo communication: alone, exposed (hidden) | max weight difference"]
    for r in results:
        s, g = r["step_s"]["shoal"], r["step_s"]["gloo"]
        comm = [_overlap_cell(r.get("overlap", {}).get(name)) for name in ("shoal", "gloo")]
        lines.append(f"{r['np']} | {s['median'] * 1e3:.0f} ms ({s['spread']:.0%}) | "
                     f"{g['median'] * 1e3:.0f} ms ({g['spread']:.0%}) | "
                     f"{r['ratio_gloo_over_shoal']:.2f}x | {comm[0]} | {comm[1]} | "
                     f"{r['max_weight_diff']:.1e}")
    return "\n".join(lines)


def section(data: dict[str, Any]) -> list[str]:
    """The BENCHMARKS.md section for ``benchmarks/fsdp.json``."""
    first = data["results"][0]
    return report_section(
        "FSDP2 over shoal and over gloo", data, "shoal bench fsdp",
        f"`fully_shard` per layer on a {first['layers']}-layer transformer of width "
        f"{first['width']} (batch 8 x 64 tokens per rank), the same model over a \"shoal\" "
        f"group and a gloo group in the same processes, taking turns trial by trial; "
        f"{first['trials']} trials of {first['steps_per_trial']} steps, per trial the "
        f"slowest rank; gloo / shoal > 1 means shoal's step is shorter. Communication per "
        f"step, measured apart from the trials: *alone* is the step's all-gathers and "
        f"reduce-scatters replayed back to back with no computation, *exposed* the training "
        f"thread's time in the issuing calls and blocked in `Work.wait` during real steps; "
        f"*hidden* = 1 - exposed / alone, what prefetching and asynchronous reduce-scatters "
        f"overlap with computation (`shoal.bench.fsdp_overlap`).", format_table)


def run(args: argparse.Namespace) -> int:
    """Run one job per world size through shoalrun and write the JSON results."""
    from .common import run_jobs
    job = ["--trials", str(args.trials), "--steps", str(args.steps),
           "--layers", str(args.layers), "--width", str(args.width)]
    return run_jobs("fsdp", args, job, format_table)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
