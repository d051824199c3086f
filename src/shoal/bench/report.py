"""``shoal bench report``: BENCHMARKS.md and its plots, regenerated from the JSON results.

The numbers and plots come only from the JSON files the benchmarks wrote (``benchmarks/``);
the reading of them lives in ``benchmarks/notes.md`` and is included as written. Nothing in
BENCHMARKS.md is edited by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
from typing import Any

from .common import load_results, markdown_table
from .reliability import build as build_reliability
from .stats import human_bytes
from .train import BACKENDS as _TRAIN_ORDER

__all__ = ["add_arguments", "build", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench report``."""
    p.add_argument("--results", default="benchmarks", help="folder of result JSON files")
    p.add_argument("--out", default="BENCHMARKS.md")


def _machine(data: dict[str, Any]) -> str:
    m = data.get("machine", {})
    return ", ".join(f"{k} {v}" for k, v in m.items()) or "not recorded"


def _plot_allreduce(data: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = data["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        sizes = res["sizes"]
        for name, per in res["methods"].items():
            bw = [s / per[str(s)]["min"] / 1e9 for s in sizes]
            ax.plot(sizes, bw, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message bytes (float32)")
        ax.set_ylabel("algorithm bandwidth, GB/s (higher is better)")
        ax.set_title(f"allreduce, {res['np']} ranks, one host")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _allreduce_section(data: dict[str, Any], plots: str) -> list[str]:
    out = ["## AllReduce on one host", "", f"Command: `{data['command']}`", ""]
    for res in data["results"]:
        methods = res["methods"]
        peers = [m for m in methods if m not in ("shoal", "memcpy")]
        head = "| size | shoal ms (min / median) |" + "".join(
            f" {p} ms | shoal / {p} |" for p in peers) + " memcpy ms | shoal / memcpy |"
        out += [f"{res['np']} ranks, algorithm `{res['algorithm']}`" + "".join(
            f"; {k} missing: {v}" for k, v in res.get("missing", {}).items()), "", head,
            "|" + "---:|" * (head.count("|") - 1)]
        for size in res["sizes"]:
            k = str(size)
            s = methods["shoal"][k]
            row = f"| {human_bytes(size)} | {s['min'] * 1e3:.3f} / {s['median'] * 1e3:.3f} |"
            for p in peers:
                q = methods[p][k]
                row += f" {q['min'] * 1e3:.3f} | {s['min'] / q['min']:.2f}x |"
            m = methods["memcpy"][k]
            row += f" {m['min'] * 1e3:.3f} | {s['min'] / m['min']:.2f}x |"
            out.append(row)
        out.append("")
    if _plot_allreduce(data, os.path.join(plots, "allreduce.png")):
        out += [f"![allreduce bandwidth]({plots}/allreduce.png)", ""]
    return out


def _exchange_section(data: dict[str, Any]) -> list[str]:
    out = ["## Gradient exchange of a real model", "", f"Command: `{data['command']}`", ""]
    for res in data["results"]:
        out += [f"{res['model']}: {res['tensors']} tensors, {res['values']:,} float32 values, "
                f"{res['np']} ranks, algorithm `{res['algorithm']}`, compression "
                f"{res['compression']}" + (f"; measured in a separate job right after: "
                                           f"{', '.join(res['separate_job'])}"
                                           if res.get("separate_job") else "") +
                "".join(f"; {k} missing: {v}" for k, v in res.get("missing", {}).items()),
                "", "| method | min ms | median ms | shoal / method (min) |",
                "|---|---:|---:|---:|"]
        s = res["methods"]["shoal"]["min"]
        for name, st in res["methods"].items():
            out.append(f"| {name} | {st['min'] * 1e3:.2f} | {st['median'] * 1e3:.2f} | "
                       f"{s / st['min']:.2f}x |")
        out.append("")
    return out


def _cluster_section(data: dict[str, Any]) -> list[str]:
    from .cluster import format_table
    res = data["results"][0]
    capped = " under a per-flow cap" if res.get("flow_cap") else ""
    first, _, table = format_table(res).partition("\n")
    return [f"## Emulated cluster: {res['nodes']} network namespaces on shaped links{capped}",
            "", f"Command: `{data['command']}`", "",
            f"{first}, in the same run. `streams`: TCP connections per cross-host peer; "
            "floor / it: the link-bound floor 2(M-1)/M x bytes / measured link over the "
            "method's median (1.00x is the link); gloo / it: gloo's median over the "
            "method's.", "", *markdown_table(table), ""]




def _train_table(data: dict[str, Any]) -> list[str]:
    rows: dict[tuple[str, str, str, int], dict[str, dict[str, Any]]] = {}
    for r in data["results"]:
        rows.setdefault((r["arch"], r["setting"], r["variant"], r["np"]), {})[r["backend"]] = r
    backends = [b for b in _TRAIN_ORDER if any(b in per for per in rows.values())]
    peers = [b for b in ("ddp-gloo", "horovod", "mwms", "independent")
             if b in backends and "shoal" in backends]
    head = ["model", "size : batch", "variant", "workers",
            *[f"{b} img/s (eff.)" for b in backends], *[f"shoal / {p}" for p in peers]]
    out = ["| " + " | ".join(head) + " |",
           "|---|---|---|---:|" + "---:|" * (len(backends) + len(peers))]
    for (arch, setting, variant, n), per in rows.items():
        cells = []
        for b in backends:
            r = per.get(b)
            eff = f" ({r['efficiency']:.0%})" if r and r.get("efficiency") else ""
            cells.append(f"{r['median']:.1f}{eff}" if r else "n/a")
        for p in peers:
            a, c = per.get("shoal"), per.get(p)
            cells.append(f"{a['median'] / c['median']:.2f}x" if a and c else "n/a")
        over = " (oversubscribed)" if any(r["oversubscribed"] for r in per.values()) else ""
        out.append(f"| {arch.replace('efficientnet-', '')} | {setting} | {variant} | {n}{over} | "
                   + " | ".join(cells) + " |")
    return out + _memory_table(data)


def _memory_table(data: dict[str, Any]) -> list[str]:
    """Each job's peak resident set per worker (the process's high-water mark: torch's CPU
    tensors included), with the throughput's spread beside it."""
    rows = [r for r in data["results"] if r.get("peak_rss_mib")]
    if not rows:
        return []
    out = ["", "Peak resident set per worker (`ru_maxrss`, median over trials) and the spread "
           "of both ((p90 - p10) / median):", "",
           "| model | size : batch | variant | workers | backend | img/s | spread | trials "
           "| peak RSS MiB | spread |", "|---|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r["peak_rss_mib"]
        out.append(f"| {r['arch'].replace('efficientnet-', '')} | {r['setting']} | "
                   f"{r['variant']} | {r['np']} | {r['backend']} | {r['median']:.1f} | "
                   f"{r['spread']:.0%} | {r['n']} | {m['median']:.0f} | {m['spread']:.1%} |")
    return out


def _train_plots(data: dict[str, Any], plots: str, name: str) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for r in data["results"]:
        key = f"{r['arch'].replace('efficientnet-', '')} {r['setting']} {r['variant']}"
        panels.setdefault(key, {}).setdefault(r["backend"], []).append((r["np"], r["median"]))
    out = []
    cols = min(3, len(panels))
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols,
                             figsize=(4.2 * cols, 3.2 * ((len(panels) + cols - 1) // cols)),
                             squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels.items(), strict=False):
        for backend in [b for b in _TRAIN_ORDER if b in series]:
            xs, ys = zip(*sorted(series[backend]), strict=True)
            ax.plot(xs, ys, marker="o", label=backend)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("workers")
        ax.set_ylabel("images / s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(os.path.join(plots, f"{name}.png"), dpi=100)
    plt.close(fig)
    out += ["", f"![training throughput]({plots}/{name}.png)"]
    shown = [o for o in data.get("overlap", []) if o.get("excerpt")]
    if shown:
        from .overlap import plot_excerpt
        fig, axes = plt.subplots(len(shown), 1, figsize=(8, 1.9 * len(shown)), squeeze=False)
        for ax, o in zip(axes.flat, shown, strict=True):
            plot_excerpt(ax, o["excerpt"], f"{o['arch']} {o['setting']}, {o['np']} workers, "
                         f"shoal DistributedOptimizer, {o.get('buckets', 'auto')} buckets: "
                         f"one step")
        fig.tight_layout()
        fig.savefig(os.path.join(plots, f"{name}-overlap.png"), dpi=100)
        plt.close(fig)
        out += ["", f"![overlap of communication with backward]({plots}/{name}-overlap.png)"]
    return out


def _train_section(data: dict[str, Any], plots: str, name: str = "train") -> list[str]:
    title = data.get("title") or "End-to-end training throughput"
    m = data.get("machine", {})
    out = [f"## {title}", "", f"Command: `{data['command']}` (measured {m.get('date', '?')} "
           f"at commit {m.get('commit', '?')})", "",
           f"Synthetic data, {data['threads']} intra-op thread(s) per worker on "
           f"{data.get('cores', '?')} cores, {data['steps']} timed steps per job after "
           f"{data['warmup']} warm-up steps; images/s over all workers (median over trials); "
           f"efficiency = throughput(N) / (N x throughput(1)). `independent` is the ceiling: "
           f"N single-worker jobs at once that never communicate, throughputs added up, so "
           f"shoal / independent is the share of the machine's N-worker throughput that shoal "
           f"keeps. " + (
               "Variants: `amp` = autocast (bf16 on CPU), `xla` = `torch.compile`."
               if data.get("framework", "torch") == "torch" else
               "TensorFlow 2 + Keras 3: `shoal` is `model.fit` with shoal's "
               "`DistributedOptimizer` under `shoalrun`; `mwms` is TensorFlow's "
               "`MultiWorkerMirroredStrategy` (ring all-reduce over gRPC), a real `TF_CONFIG` "
               "cluster on loopback, one process per worker, in the custom loop TensorFlow "
               "documents for it (Keras 3.15's `fit` fails under it). Variants: `amp` = "
               "`mixed_float16`, `xla` = `jit_compile=True` (shoal splits the step at the "
               "optimizer; the `mwms` loop compiles forward and backward)."), ""]
    for backend, why in data.get("missing", {}).items():
        out += [f"**{backend}: missing** ({why}).", ""]
    for f in data.get("failed", []):
        last = f["error"].strip().splitlines()[-1] if f["error"].strip() else "no message"
        out += [f"**Failed:** {f['arch']} {f['setting']} {f['variant']}, {f['np']} workers, "
                f"{f['backend']}: `{last}`", ""]
    out += _train_table(data)
    if data.get("overlap"):
        out += ["", "Communication hidden behind backward (from timeline runs of shoal's "
                "`DistributedOptimizer`, with its automatic bucket size and with 2 MiB buckets; "
                "per-step medians; the wait after backward includes waiting for the slower "
                "rank):", "",
                "| model | size : batch | workers | buckets | images/s | step ms | backward ms "
                "| communication ms | hidden behind backward | waited after backward ms |",
                "|---|---|---:|---|---:|---:|---:|---:|---:|---:|"]
        for o in data["overlap"]:
            out.append(f"| {o['arch'].replace('efficientnet-', '')} | {o['setting']} | "
                       f"{o['np']} | {o.get('buckets', 'auto')} | "
                       f"{o.get('images_per_s', float('nan')):.1f} | {o['step_ms']:.1f} | "
                       f"{o['backward_ms']:.1f} | "
                       f"{o['comm_ms']:.1f} | {o['hidden_share']:.0%} | "
                       f"{o['exposed_ms']:.1f} |")
    with contextlib.suppress(ImportError):
        out += _train_plots(data, plots, name)
    return [*out, ""]


def _generic_section(title: str, path: str) -> list[str]:
    with open(path) as f:
        text = f.read().rstrip()
    return [f"## {title}", "", "```", text, "```", ""]


def build(folder: str) -> str:
    """The Markdown text of BENCHMARKS.md from the results in ``folder``."""
    plots = os.path.join(folder, "plots")
    os.makedirs(plots, exist_ok=True)
    lines = ["# Benchmarks", "",
             "Generated by `shoal bench report` from the JSON files in `benchmarks/`; do not "
             "edit by hand (rerun the commands shown, then the report). Every comparison is a "
             "ratio measured side by side in one run, methods alternating trial by trial; "
             "times are per-trial maxima over ranks, min (and median) over trials.", ""]
    first = None
    for name, section in (("allreduce", _allreduce_section), ("exchange", _exchange_section),
                          ("cluster", _cluster_section), ("cluster-4nodes", _cluster_section),
                          ("cluster-capped", _cluster_section),
                          ("cluster-4nodes-capped", _cluster_section)):
        data = load_results(folder, name)
        if data is None:
            continue
        first = first or data
        lines += section(data, plots) if name == "allreduce" else section(data)
    for path in sorted(glob.glob(os.path.join(folder, "allreduce-deepspeed*.json")),
                       key=lambda p: (len(p), p)):  # 2 ranks, then further files
        from .allreduce import section as deepspeed_section
        lines += deepspeed_section(load_results(folder, os.path.basename(path)[:-5]))
    for path in sorted(glob.glob(os.path.join(folder, "latency*.json")), key=lambda p: (len(p), p)):
        from .latency import section as latency_section
        lines += latency_section(load_results(folder, os.path.basename(path)[:-5]))
    data = load_results(folder, "collectives")
    if data is not None:
        from .collectives import section as collectives_section
        lines += collectives_section(data)
    data = load_results(folder, "fsdp")
    if data is not None:
        from .fsdp import section as fsdp_section
        lines += fsdp_section(data)
    data = load_results(folder, "ddp")
    if data is not None:
        from .ddp import section as ddp_section
        lines += ddp_section(data)
    data = load_results(folder, "elastic")
    if data is not None:
        from .elastic import section as elastic_section
        lines += elastic_section(data)
    data = load_results(folder, "loader")
    if data is not None:
        from .loader import section as loader_section
        lines += loader_section(data)
    # train.json, then any train-*.json (further training comparisons), each its own section
    for path in sorted(glob.glob(os.path.join(folder, "train*.json")),
                       key=lambda p: (os.path.basename(p) != "train.json", p)):
        name = os.path.splitext(os.path.basename(path))[0]
        data = load_results(folder, name)
        first = first or data
        lines += _train_section(data, plots, name)
    gpu = os.path.join(folder, "gpu-check.json")
    if os.path.exists(gpu):  # written by scripts/gpu-check.sh on a GPU machine
        from .gpucheck.main import section as gpu_section
        with open(gpu) as f:
            report = json.load(f)
        if not report.get("dry_run"):
            lines += gpu_section(report)
    for path in sorted(glob.glob(os.path.join(folder, "*.txt"))):
        title = os.path.splitext(os.path.basename(path))[0].replace("-", " ").capitalize()
        lines += _generic_section(title, path)
    if first is not None:
        lines[6:6] = [f"Machine: {_machine(first)}.", ""]
    notes = os.path.join(folder, "notes.md")
    if os.path.exists(notes):
        with open(notes) as f:
            lines += ["## Reading", "", f.read().rstrip(), ""]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """Write BENCHMARKS.md (and the plots) from ``--results``, and RELIABILITY.md beside it
    when fault or soak results are there."""
    text = build(args.results)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    reliability = build_reliability(args.results)
    if reliability is not None:
        path = os.path.join(os.path.dirname(os.path.abspath(args.out)), "RELIABILITY.md")
        with open(path, "w") as f:
            f.write(reliability)
        print(f"wrote {path}")
    return 0
