"""Scaling tables (text, JSON-ready dicts) and plots (PNG through matplotlib's Agg canvas)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .engine_model import ScalingRow

__all__ = ["format_table", "plot", "rows_to_dicts"]


def format_table(rows: Sequence[ScalingRow], title: str = "") -> str:
    """One line per (strategy, node count): step, compute, communication, overlap,
    throughput and scaling efficiency."""
    head = (f"{'strategy':>16} | {'nodes':>5} | {'workers':>7} | {'step ms':>9} | "
            f"{'comm ms':>8} | {'exposed ms':>10} | {'overlap':>7} | {'rounds':>6} | "
            f"{'images/s':>11} | {'efficiency':>10}")
    lines = [title] if title else []
    lines += [head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and r.strategy != last:
            lines.append("")
        last = r.strategy
        s = r.result
        lines.append(f"{r.strategy:>16} | {r.nodes:5d} | {r.workers:7d} | "
                     f"{s.step_s * 1e3:9.2f} | {s.comm_s * 1e3:8.2f} | "
                     f"{s.exposed_s * 1e3:10.2f} | {s.overlap:7.1%} | {s.rounds:6d} | "
                     f"{s.throughput:11,.1f} | {r.efficiency:10.1%}")
    return "\n".join(lines)


def rows_to_dicts(rows: Sequence[ScalingRow]) -> list[dict[str, Any]]:
    """The table as plain dicts (for JSON)."""
    return [{"strategy": r.strategy, "nodes": r.nodes, "workers": r.workers,
             "step_s": r.result.step_s, "compute_s": r.result.compute_s,
             "comm_s": r.result.comm_s, "exposed_s": r.result.exposed_s,
             "overlap": r.result.overlap, "rounds": r.result.rounds,
             "buffers": r.result.buffers, "images_per_s": r.result.throughput,
             "efficiency": r.efficiency} for r in rows]


def plot(rows: Sequence[ScalingRow], path: str | Path, title: str = "") -> Path:
    """Throughput (against linear scaling) and efficiency over node count, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax_thr, ax_eff = fig.subplots(1, 2)
    by: dict[str, list[ScalingRow]] = {}
    for r in rows:
        by.setdefault(r.strategy, []).append(r)
    for name, rs in by.items():
        nodes = [r.nodes for r in rs]
        ax_thr.plot(nodes, [r.result.throughput for r in rs], marker="o", label=name)
        ax_eff.plot(nodes, [100 * r.efficiency for r in rs], marker="o", label=name)
    if by:
        first = next(iter(by.values()))
        base = first[0].result.throughput / first[0].nodes
        best = max(r[0].result.throughput / r[0].nodes for r in by.values())
        base = max(base, best)
        ax_thr.plot([r.nodes for r in first], [base * r.nodes for r in first], "k--",
                    linewidth=0.8, label="linear")
    ax_thr.set(xscale="log", yscale="log", xlabel="nodes", ylabel="images/s",
               title="throughput")
    ax_eff.set(xscale="log", xlabel="nodes", ylabel="% of linear (vs one node)",
               title="scaling efficiency")
    for ax in (ax_thr, ax_eff):
        ax.set_xticks([r.nodes for r in rows[: len(rows) // max(1, len(by))]])
        ax.get_xaxis().set_major_formatter("{x:g}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
