"""``shoal bench report``: BENCHMARKS.md and its plots, regenerated from the JSON results.

The numbers and plots come only from the JSON files the benchmarks wrote (``benchmarks/``);
the reading of them lives in ``benchmarks/notes.md`` and is included as written. Nothing in
BENCHMARKS.md is edited by hand.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Any

from .stats import human_bytes

__all__ = ["add_arguments", "build", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``shoal bench report``."""
    p.add_argument("--results", default="benchmarks", help="folder of result JSON files")
    p.add_argument("--out", default="BENCHMARKS.md")


def _load(folder: str, name: str) -> dict[str, Any] | None:
    path = os.path.join(folder, f"{name}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


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
    res = data["results"][0]
    out = ["## Emulated cluster: two network namespaces on a shaped link", "",
           f"Command: `{data['command']}`", "",
           f"{res['nodes']} nodes x {res['np'] // res['nodes']} ranks; link rate set "
           f"{data.get('rate')}, measured {res['link_Bps'] * 8 / 1e9:.2f} Gbit/s in the same "
           f"run. Floor = 2(M-1)/M x bytes / measured link bandwidth.", "",
           "| size | method | min ms | median ms | / floor | gloo / method |",
           "|---:|---|---:|---:|---:|---:|"]
    for size in res["sizes"]:
        k = str(size)
        gloo = res["methods"].get("gloo-ring", {}).get(k)
        for name, per in res["methods"].items():
            st = per[k]
            vs = f"{gloo['min'] / st['min']:.2f}x" if gloo else "n/a"
            out.append(f"| {human_bytes(size)} | {name} | {st['min'] * 1e3:.1f} | "
                       f"{st['median'] * 1e3:.1f} | {st['min'] / st['floor_s']:.2f}x | {vs} |")
    return [*out, ""]


def _train_section(data: dict[str, Any], plots: str) -> list[str]:
    res = data["results"][0]
    out = ["## End-to-end training throughput", "", f"Command: `{data['command']}`", "",
           f"{res['arch']}, synthetic data, 1 intra-op thread per worker, {res['steps']} timed "
           f"steps per job; images/s over all workers (median over trials); efficiency = "
           f"throughput(N) / (N x throughput(1)).", "",
           "| image size : batch/worker | backend | workers | images/s | efficiency |",
           "|---|---|---:|---:|---:|"]
    series = {}
    for setting, per in res["settings"].items():
        for backend, by_np in per.items():
            one = by_np.get("1", {}).get("median")
            for n, st in by_np.items():
                eff = f"{st['median'] / (int(n) * one):.1%}" if one else "n/a"
                out.append(f"| {setting} | {backend} | {n} | {st['median']:.1f} | {eff} |")
                series.setdefault(f"{backend} @ {setting}", []).append((int(n), st["median"]))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, points in series.items():
            xs, ys = zip(*sorted(points), strict=True)
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xlabel("workers")
        ax.set_ylabel("images / second")
        ax.set_title("EfficientNet training throughput")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(plots, "train.png"), dpi=100)
        plt.close(fig)
        out += ["", f"![training throughput]({plots}/train.png)"]
    except ImportError:
        pass
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
                          ("cluster", _cluster_section), ("train", _train_section)):
        data = _load(folder, name)
        if data is None:
            continue
        first = first or data
        lines += section(data, plots) if name in ("allreduce", "train") else section(data)
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
    """Write BENCHMARKS.md (and the plots) from ``--results``."""
    text = build(args.results)
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")
    return 0
