"""``shoal bench ddp``: stock DDP over backend "shoal" and over gloo, side by side in the same
processes.

``shoal bench train`` starts one job per backend and trial; on a machine whose speed drifts
within minutes (a shared cloud VM), jobs a minute apart see different machines, and a 10%
difference between backends drowns in the drift. Here both DDP models live in the same worker
processes, built from one seed on a ``"shoal"`` group and on a gloo group, and take turns
trial by trial (who goes first rotates), so each pair of trials sees the same machine. A trial
is ``--steps`` training steps (forward, backward with DDP's bucketed allreduces, SGD with
momentum) on a fixed batch of random images; per trial the slowest rank counts. The ratio is
taken per pair of trials and its median reported, with the medians of the step times. After
the trials the two models' weights are compared: same data, same model, the same training.

Needs the EfficientNet application's models (``apps/efficientnet``, a source checkout).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from .common import report_section, worst_over_ranks
from .stats import stats

__all__ = ["add_arguments", "format_table", "run", "section", "worker_main"]

BACKENDS = ("shoal", "gloo")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench ddp``."""
    p.add_argument("--np", type=int, nargs="+", default=[2], dest="np_")
    p.add_argument("--archs", default="small-cnn,efficientnet-b0",
                   help="comma-separated: small-cnn and EfficientNet variants")
    p.add_argument("--settings", default="32:16",
                   help="comma-separated image_size:per-worker-batch pairs")
    p.add_argument("--trials", type=int, default=15)
    p.add_argument("--steps", type=int, default=10, help="training steps per trial")
    p.add_argument("--breakdown", action="store_true",
                   help="also time, in the same turns, the model without DDP (computation "
                        "only) and DDP over each backend without its buffer broadcast")
    p.add_argument("--out", default="benchmarks/ddp.json")
    p.add_argument("--timeout", type=float, default=3600)


def _model(torch: Any, arch: str) -> Any:
    """``arch`` without randomness in training (no dropout, no stochastic depth): the two
    models draw from one generator in turns, and their weights must agree at the end."""
    from apps.efficientnet.config.variants import SMALL_CNN
    from apps.efficientnet.model.efficientnet import efficientnet
    from apps.efficientnet.model.small_cnn import SmallCNN
    torch.manual_seed(0)
    model = (SmallCNN(1000) if arch == SMALL_CNN
             else efficientnet(arch, num_classes=1000, drop_connect_rate=0.0))
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def _buffer_sync(torch: Any, forward: bool) -> dict[str, bool]:
    """DDP's argument for syncing buffers before each forward (renamed in torch 2.13)."""
    import inspect
    ddp = torch.nn.parallel.DistributedDataParallel
    name = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(ddp).parameters
            else "broadcast_buffers")
    return {name: forward}


#: ``--breakdown``'s further methods: (backend or None for no DDP, whether DDP broadcasts
#: its buffers before each forward)
BREAKDOWN = {"local": (None, False), "shoal-no-buffer-sync": ("shoal", False),
             "gloo-no-buffer-sync": ("gloo", False)}


def _one(torch: Any, dist: Any, groups: dict[str, Any], arch: str, size: int, batch: int,
         args: argparse.Namespace) -> dict[str, Any]:
    """The methods' trials of one model and setting; this rank's times and weights."""
    from .common import alternate
    me = dist.get_rank()
    methods = {name: (name, True) for name in BACKENDS}
    if args.breakdown:
        methods.update(BREAKDOWN)
    runs = {}
    for name, (backend, buffers) in methods.items():
        model = _model(torch, arch)
        if backend is not None:
            model = torch.nn.parallel.DistributedDataParallel(
                model, process_group=groups[backend], **_buffer_sync(torch, buffers))
        runs[name] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    g = torch.Generator().manual_seed(me)
    x = torch.randn(batch, 3, size, size, generator=g)
    y = torch.randint(0, 1000, (batch,), generator=g)
    loss = torch.nn.CrossEntropyLoss()

    def step(name: str) -> None:
        model, opt = runs[name]
        opt.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        opt.step()

    times = alternate({name: lambda n=name: step(n) for name in runs}, args.trials,
                      args.steps, dist.barrier)
    flat = {name: torch.cat([p.detach().reshape(-1) for p in runs[name][0].parameters()])
            for name in runs}
    diff = float((flat["shoal"] - flat["gloo"]).abs().max())
    return {"times": times, "diff": diff}


def worker_main(argv: Sequence[str]) -> None:
    """One rank (started by shoalrun)."""
    p = argparse.ArgumentParser()
    p.add_argument("--archs", required=True)
    p.add_argument("--settings", required=True)
    for flag in ("--trials", "--steps"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--breakdown", action="store_true")
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)
    import json

    import shoal
    import shoal.torch.backend as backend

    from .common import init_gloo
    shoal.init()
    torch, dist = init_gloo()  # the default group: gloo, over env://
    backend.register()
    groups = {name: dist.new_group(backend=name) for name in BACKENDS}
    rows = []
    for arch in args.archs.split(","):
        for setting in args.settings.split(","):
            size, batch = (int(v) for v in setting.split(":"))
            mine = _one(torch, dist, groups, arch, size, batch, args)
            every = shoal.allgather_object(mine)
            n = dist.get_world_size()
            worst = {name: np.max([r["times"][name] for r in every], axis=0)
                     for name in every[0]["times"]}
            ratios = worst["gloo"] / worst["shoal"]
            extra = {"breakdown_ms_over_local": {  # per trial, then the median over trials
                name: float(np.median(worst[name] - worst["local"])) * 1e3
                for name in worst if name != "local"}} if "local" in worst else {}
            rows.append({**extra,"arch": arch, "image_size": size, "batch": batch, "np": n,
                         "step_s": {name: worst_over_ranks([r["times"][name] for r in every])
                                    for name in BACKENDS},
                         "images_per_s": {name: batch * n / float(np.median(worst[name]))
                                          for name in BACKENDS},
                         "ratio_gloo_over_shoal": stats(ratios),
                         "max_weight_diff": max(r["diff"] for r in every)})
    if dist.get_rank() == 0:
        with open(args.json, "w") as f:
            json.dump({"np": dist.get_world_size(), "trials": args.trials,
                       "steps_per_trial": args.steps, "rows": rows}, f)
    dist.destroy_process_group()
    shoal.shutdown()


def _breakdown_cell(row: dict[str, Any]) -> str:
    over = row.get("breakdown_ms_over_local")
    if not over:
        return "-"
    return ", ".join(f"{over[name]:.1f} ms" for name in (
        "shoal", "gloo", "shoal-no-buffer-sync", "gloo-no-buffer-sync"))


def format_table(results: list[dict[str, Any]]) -> str:
    """One row per world size, model and setting."""
    lines = ["workers | model | image px, batch | DDP over shoal: images/s (step spread) | "
             "DDP over gloo: images/s (step spread) | gloo / shoal: median of trials "
             "(spread) | max weight difference | per step over the model without DDP: "
             "shoal, gloo; without the buffer broadcast: shoal, gloo"]
    for res in results:
        for r in res["rows"]:
            s, g = r["step_s"]["shoal"], r["step_s"]["gloo"]
            ratio = r["ratio_gloo_over_shoal"]
            lines.append(f"{r['np']} | {r['arch']} | {r['image_size']}, {r['batch']} | "
                         f"{r['images_per_s']['shoal']:.0f} ({s['spread']:.0%}) | "
                         f"{r['images_per_s']['gloo']:.0f} ({g['spread']:.0%}) | "
                         f"{ratio['median']:.2f}x ({ratio['spread']:.0%}) | "
                         f"{r['max_weight_diff']:.1e} | {_breakdown_cell(r)}")
    return "\n".join(lines)


def section(data: dict[str, Any]) -> list[str]:
    """The BENCHMARKS.md section for ``benchmarks/ddp.json``."""
    first = data["results"][0]
    return report_section(
        "Stock DDP over shoal and over gloo, in the same processes", data, "shoal bench ddp",
        f"both DDP models in the same workers, taking turns trial by trial "
        f"({first['trials']} trials of {first['steps_per_trial']} steps, SGD with momentum, "
        f"1 thread per worker), so each pair of trials sees the same machine; per trial the "
        f"slowest rank; the ratio is the median over pairs of trials (> 1: DDP over shoal is "
        f"faster). With `--breakdown` the same turns also time the model without DDP "
        f"(computation only) and DDP without its buffer broadcast before each forward "
        f"(`forward_sync_buffers=False`; `broadcast_buffers=False` before torch 2.13); the "
        f"last column is each one's step time minus the computation's, per trial, median "
        f"over trials.", format_table)


def run(args: argparse.Namespace) -> int:
    """Run one job per world size through shoalrun and write the JSON results."""
    from .common import run_jobs
    job = ["--archs", args.archs, "--settings", args.settings, "--trials", str(args.trials),
           "--steps", str(args.steps), *(["--breakdown"] if args.breakdown else [])]
    return run_jobs("ddp", args, job, format_table)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
