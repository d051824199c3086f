"""``shoal sim``: predict step time, overlap, throughput and scaling efficiency.

Examples::

    shoal sim                                   # EfficientNet-B0 on p4d.24xlarge, 1..64 nodes
    shoal sim --hardware p3dn.24xlarge --model efficientnet-b4 --plot b4.png
    shoal sim --timeline /tmp/tl.json --hardware this-machine --batch 16
    shoal sim --calibrate                       # against NVIDIA's and SMDDP's published numbers
    shoal sim --validate                        # against shoal bench cluster's measurement
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from shoal.bench.models import param_shapes

from .calibration import MEASURED_CLUSTER, calibrate, validate
from .engine_model import STRATEGIES, scaling
from .hardware import PRESETS, Hardware, get_hardware
from .models import MODELS, load_timeline, model_profile
from .report import format_table, plot, rows_to_dicts

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal sim``."""
    p.add_argument("--hardware", default="p4d.24xlarge", choices=sorted(PRESETS))
    p.add_argument("--model", default="efficientnet-b0", choices=MODELS)
    p.add_argument("--timeline", help="a SHOAL_TIMELINE trace to take the backward profile "
                                      "from (tensor sizes from --model when names match)")
    p.add_argument("--batch", type=int, help="per-worker batch (default: the calibration's)")
    p.add_argument("--time-per-image", type=float,
                   help="forward+backward seconds per image per worker (overrides presets)")
    p.add_argument("--workers", type=int, help="workers per node (default: the hardware's)")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64")
    p.add_argument("--flow-cap", type=float, default=None,
                   help="Gbit/s one TCP connection may carry (0: no cap; default: the "
                        "hardware's)")
    p.add_argument("--streams", type=int, default=None,
                   help="shoal's TCP streams per cross-node peer (default: auto's 4)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated, from {', '.join(STRATEGIES)}")
    p.add_argument("--cycle-ms", type=float, help="override every strategy's cycle time")
    p.add_argument("--fusion-mb", type=float, help="override every strategy's fusion threshold")
    p.add_argument("--input-ceiling", default=None,
                   help="images/s one node's input pipeline can feed, or 'auto' for the "
                        "calibration's (default: unbounded)")
    p.add_argument("--plot", default="results/sim-{hardware}-{model}.png",
                   help="PNG to write ('' for none)")
    p.add_argument("--json", default="", help="also write the table as JSON here")
    p.add_argument("--calibrate", action="store_true",
                   help="report the model against published numbers and exit")
    p.add_argument("--validate", action="store_true",
                   help="report predicted vs measured allreduce on the emulated cluster")
    p.add_argument("--measured", help="a results JSON of shoal bench cluster (for --validate)")


def _measured(path: str) -> dict:
    """MEASURED_CLUSTER's shape from a ``shoal bench cluster`` results file (first size)."""
    res = json.loads(Path(path).read_text())["results"][0]
    key = str(res["sizes"][0])
    pick = {}
    for a in ("hierarchical", "ring"):  # one stream where measured (the model's link)
        names = sorted((n for n in res["methods"] if n.split("@")[0] == f"shoal-{a}"),
                       key=lambda n: not n.endswith("@1"))
        st = res["methods"][names[0]][key]
        pick[a] = (st["min"], st["median"])
    return {"nbytes": int(key), "nodes": res["nodes"], "local": res["np"] // res["nodes"],
            "link_Bps": res["link_Bps"], **pick}


def streams_line(hw: Hardware, local: int) -> str:
    """What the per-flow cap asks of shoal's TCP streams on ``hw`` with ``local`` workers per
    node crossing at once (hierarchical: every local rank has its own peers)."""
    nic = hw.nic.bandwidth * 8 / 1e9
    if hw.flow_cap is None:
        return f"TCP across nodes: {nic:g} Gbit/s NIC, no per-flow cap: 1 stream per peer fills it"
    need = hw.streams_needed(local)
    reach = hw.cross_bandwidth(local) * local / hw.nic.bandwidth
    return (f"TCP across nodes: {nic:g} Gbit/s NIC, {hw.flow_cap * 8 / 1e9:g} Gbit/s per "
            f"flow, {local} workers crossing at once: {need} stream(s) per peer fill it "
            f"(SHOAL_TCP_STREAMS={need}); at {hw.streams}, shoal's TCP gets {reach:.0%} of it")


def run(args: argparse.Namespace) -> int:
    """Run ``shoal sim`` with parsed ``args``; returns the exit code."""
    if args.calibrate:
        print("\n".join(calibrate(args.hardware if args.hardware != "this-machine"
                                  else "p4d.24xlarge", args.model)))
        return 0
    if args.validate:
        measured = _measured(args.measured) if args.measured else MEASURED_CLUSTER
        print(f"emulated cluster: {measured['nodes']} nodes x {measured['local']} ranks, "
              f"{measured['nbytes'] >> 20} MiB, link {measured['link_Bps'] * 8 / 1e9:.2f} "
              f"Gbit/s")
        worst = 0.0
        for v in validate(measured):
            worst = max(worst, abs(v.error))
            print(f"  {v.algorithm:>12}: predicted {v.predicted_s * 1e3:7.1f} ms, measured "
                  f"min {v.measured_min_s * 1e3:7.1f} ms (median "
                  f"{v.measured_median_s * 1e3:7.1f}), error {v.error:+.1%}")
        return 0 if worst <= 0.2 else 1
    hw = get_hardware(args.hardware)
    if args.flow_cap is not None:
        hw = hw.replace(flow_cap=args.flow_cap * 1e9 / 8 if args.flow_cap > 0 else None)
    if args.streams is not None:
        hw = hw.replace(streams=args.streams)
    print(streams_line(hw, args.workers or hw.workers_per_node))
    profile, ceiling = model_profile(args.model, hw, batch=args.batch,
                                     time_per_image=args.time_per_image)
    if args.timeline:
        sizes = {name: math.prod(shape) * 4 for name, shape in param_shapes(args.model)}
        profile = load_timeline(args.timeline, batch=args.batch or 1, sizes=sizes)
    if args.input_ceiling == "auto":
        cap = ceiling
    else:
        cap = float(args.input_ceiling) if args.input_ceiling else None
    strategies = []
    for name in args.strategies.split(","):
        if name not in STRATEGIES:
            print(f"shoal sim: unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
            return 2
        s = STRATEGIES[name]
        if args.cycle_ms is not None:
            s = s.replace(cycle_s=args.cycle_ms / 1e3)
        if args.fusion_mb is not None:
            s = s.replace(fusion_bytes=int(args.fusion_mb * (1 << 20)))
        strategies.append(s)
    nodes = [int(x) for x in args.nodes.split(",")]
    rows = scaling(profile, hw, strategies, nodes, local=args.workers, input_ceiling=cap)
    g = args.workers or hw.workers_per_node
    title = (f"{profile.name} on {hw.name} ({g} workers/node, batch {profile.batch}/worker, "
             f"compute {profile.compute_s * 1e3:.1f} ms/step, "
             f"{profile.grad_bytes / 1e6:.1f} MB gradients"
             + (f", input ceiling {cap:,.0f} img/s/node" if cap else "") + ")")
    print(format_table(rows, title))
    if args.plot:
        path = plot(rows, args.plot.format(hardware=hw.name, model=profile.name), title)
        print(f"plot written to {path}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"title": title, "rows": rows_to_dicts(rows)},
                                              indent=1))
        print(f"table written to {args.json}")
    return 0
