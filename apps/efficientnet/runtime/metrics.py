"""Metrics as JSON lines in NVIDIA's DLLogger format, plus readable lines on stdout.

Each line of the log file is ``{"timestamp", "elapsedtime", "datetime", "type", ...}``:
``METADATA`` lines first declare each metric's unit (:data:`UNITS`), then ``LOG`` lines carry
``"step": [epoch, step]`` (or ``"PARAMETER"`` / ``"SUMMARY"``) and ``"data": {name: value}``.
Only rank 0 writes; the values it writes were already averaged over the ranks.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["SHOWN", "UNITS", "MetricLogger", "compact", "latency_percentiles", "peak_rss_mib",
           "progress_bar", "summary_table"]

#: Unit of every metric the application reports (None: a plain number).
UNITS: dict[str, str | None] = {
    "avg_exp_per_second_training": "samples/s",
    "avg_exp_per_second_training_per_worker": "samples/s",
    "avg_exp_per_second_eval": "samples/s",
    "training_loss": None,
    "training_accuracy_top_1": "%",
    "training_accuracy_top_5": "%",
    "eval_loss": None,
    "eval_accuracy_top_1": "%",
    "eval_accuracy_top_5": "%",
    "learning_rate": None,
    "training_time": "s",
    "peak_rss_per_worker": "MiB",
    "training_latency_mean": "ms",
    "training_latency_p90": "ms",
    "training_latency_p95": "ms",
    "training_latency_p99": "ms",
    "eval_latency_mean": "ms",
    "eval_latency_p90": "ms",
    "eval_latency_p95": "ms",
    "eval_latency_p99": "ms",
}


def peak_rss_mib() -> float:
    """This process's resident-set high-water mark so far, in MiB: it sees every allocation,
    torch's CPU tensors included (tracemalloc sees only Python's)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def latency_percentiles(seconds: list[float], prefix: str) -> dict[str, float]:
    """``{prefix}_latency_mean/p90/p95/p99`` in milliseconds (nearest-rank percentiles)."""
    if not seconds:
        return {}
    ordered = sorted(seconds)
    out = {f"{prefix}_latency_mean": 1000.0 * sum(ordered) / len(ordered)}
    for p in (90, 95, 99):
        k = max(0, math.ceil(p / 100 * len(ordered)) - 1)
        out[f"{prefix}_latency_p{p}"] = 1000.0 * ordered[k]
    return out


#: What the readable lines show of each metric: (name, format); the rest (losses in eval,
#: top-5, latency percentiles, per-worker throughput) is in the summary and the JSON log.
SHOWN: tuple[tuple[str, str], ...] = (
    ("training_loss", "loss {:.3f}"),
    ("training_accuracy_top_1", "acc {:.1f}%"),
    ("eval_accuracy_top_1", "eval {:.1f}%"),
    ("avg_exp_per_second_training", "{:.0f} img/s"),
    ("learning_rate", "lr {:.2g}"),
)
_SHOWN = {name for name, _ in SHOWN}


def compact(data: dict[str, Any]) -> str:
    """The metrics of :data:`SHOWN` that ``data`` has, short (``loss 1.234 acc 45.6%``: the
    training loss and top-1, ``eval``: the evaluation's top-1),
    then any other value that is not a number (``checkpoint ...``)."""
    parts = [fmt.format(data[name]) for name, fmt in SHOWN
             if isinstance(data.get(name), int | float)]
    if "eval_accuracy_top_1" in data and "training_loss" not in data:  # an eval-only run
        parts += [f"top-5 {data.get('eval_accuracy_top_5', 0.0):.1f}%",
                  f"loss {data.get('eval_loss', 0.0):.3f}"]
    parts += [f"{k} {v}" for k, v in data.items()
              if k not in _SHOWN and not isinstance(v, int | float)]
    return " ".join(parts)  # a line fits 80 columns behind shoalrun's rank tag


def _cell(data: dict[str, Any], key: str, fmt: str, width: int) -> str:
    value = data.get(key)
    return f"{fmt.format(value) if isinstance(value, int | float) else '-':>{width}}"


def summary_table(data: dict[str, Any]) -> list[str]:
    """The final summary as a small table (about 60 columns): loss, top-1, top-5 and
    images/s of training and evaluation, then the latencies (ms)."""
    rows = []
    cols = (("loss", "{:.4f}", 8), ("top-1", "{:.2f}%", 8), ("top-5", "{:.2f}%", 8),
            ("img/s", "{:.1f}", 9))
    for title, prefix in (("training", "training_"), ("eval", "eval_")):
        keys = (f"{prefix}loss", f"{prefix}accuracy_top_1", f"{prefix}accuracy_top_5",
                f"avg_exp_per_second_{prefix.rstrip('_')}")
        if not any(isinstance(data.get(k), int | float) for k in keys):
            continue
        row = f"  {title:<10}" + "".join(_cell(data, k, f, w)
                                         for k, (_, f, w) in zip(keys, cols, strict=True))
        if prefix == "training_" and "training_time" in data:
            row += f"   ({data['training_time']:.0f} s)"
        rows.append(row)
    if rows:
        rows.insert(0, f"  {'summary':<10}" + "".join(f"{n:>{w}}" for n, _, w in cols))
    lat = [(title, kind) for title, kind in (("training", "training"), ("eval", "eval"))
           if isinstance(data.get(f"{kind}_latency_mean"), int | float)]
    if lat:
        rows.append(f"  {'latency ms':<10}" + "".join(f"{n:>8}" for n in ("mean", "p90", "p99")))
        rows += [f"  {title:<10}" + "".join(_cell(data, f"{kind}_latency_{p}", "{:.1f}", 8)
                                           for p in ("mean", "p90", "p99"))
                 for title, kind in lat]
    rows += [f"  {k:<10} {v}" for k, v in data.items() if not isinstance(v, int | float)]
    return rows


def progress_bar(total: int, desc: str, enabled: bool) -> tqdm:
    """A per-epoch progress bar on stderr, shown on a terminal only: when stderr is one, or
    when shoalrun's is (it sets ``SHOALRUN_TTY=1`` and draws rank 0's bar as a status line).
    In a log (a pipe or a file) it stays silent, so logs hold the plain lines only."""
    tty = sys.stderr.isatty() or os.environ.get("SHOALRUN_TTY") == "1"
    columns = os.environ.get("COLUMNS", "")
    return tqdm(total=total, desc=desc, leave=False, disable=not (enabled and tty),
                file=sys.stderr, ncols=int(columns) if columns.isdigit() else None,
                dynamic_ncols=not columns.isdigit(), mininterval=0.5,
                bar_format="{desc}: {percentage:3.0f}%|{bar}| {n}/{total} [{elapsed}<{remaining}"
                           "{postfix}]")


class MetricLogger:
    """JSON-lines log file (``path``) and stdout lines, active on rank 0 only (``enabled``)."""

    def __init__(self, path: str | os.PathLike[str] | None, enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.of = ""  # "/N": the number of epochs, once known
        self._start = time.time()
        self._file: TextIO | None = None
        if enabled and path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            for name, unit in UNITS.items():
                self._write({"type": "METADATA", "metric": name, "metadata": {"unit": unit}})

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        now = time.time()
        line = {"timestamp": now, "elapsedtime": now - self._start,
                "datetime": datetime.datetime.now().isoformat(timespec="milliseconds"),
                **record}
        self._file.write(json.dumps(line, default=str) + "\n")
        self._file.flush()

    def log(self, step: str | tuple[int, ...], data: dict[str, Any], echo: bool = True) -> None:
        """Record ``data`` at ``step`` (``(epoch, step)``, ``"PARAMETER"`` or ``"SUMMARY"``)."""
        if not self.enabled:
            return
        self._write({"type": "LOG", "step": list(step) if isinstance(step, tuple) else step,
                     "data": data})
        if not echo:
            return
        if step == "SUMMARY":
            for line in summary_table(data):
                tqdm.write(line, file=self.stream)
            return
        self.echo(step, data)

    def echo(self, step: str | tuple[int, ...], data: dict[str, Any]) -> None:
        """The readable line of ``data`` at ``step`` on stdout only (rank 0)."""
        if not self.enabled:
            return
        where = str(step)
        if isinstance(step, tuple) and len(step) == 2:  # epoch lines leave the step out
            where = f"epoch {step[0]}{self.of}" + (
                "" if "avg_exp_per_second_training" in data else f" step {step[1]}")
        text = compact(data)
        if text:
            tqdm.write(f"{where}  {text}", file=self.stream)

    def print(self, text: str) -> None:
        """A plain line on stdout (rank 0 only)."""
        if self.enabled:
            tqdm.write(text, file=self.stream)

    def close(self) -> None:
        """Close the log file."""
        if self._file is not None:
            self._file.close()
            self._file = None
