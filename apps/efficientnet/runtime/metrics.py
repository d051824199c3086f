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
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["UNITS", "MetricLogger", "latency_percentiles"]

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
    "training_latency_mean": "ms",
    "training_latency_p90": "ms",
    "training_latency_p95": "ms",
    "training_latency_p99": "ms",
    "eval_latency_mean": "ms",
    "eval_latency_p90": "ms",
    "eval_latency_p95": "ms",
    "eval_latency_p99": "ms",
}


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


def _fmt(name: str, value: Any) -> str:
    unit = UNITS.get(name)
    text = (f"{value:.2f}" if unit else f"{value:.5g}") if isinstance(value, float) else value
    return f"{name} {text}" + ("%" if unit == "%" else f" {unit}" if unit else "")


class MetricLogger:
    """JSON-lines log file (``path``) and stdout lines, active on rank 0 only (``enabled``)."""

    def __init__(self, path: str | os.PathLike[str] | None, enabled: bool = True,
                 stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stdout
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
        if echo:
            where = (f"epoch {step[0]} step {step[1]}" if isinstance(step, tuple)
                     and len(step) == 2 else str(step))
            tqdm.write(f"{where} | " + " | ".join(_fmt(k, v) for k, v in data.items()),
                       file=self.stream)

    def print(self, text: str) -> None:
        """A plain line on stdout (rank 0 only)."""
        if self.enabled:
            tqdm.write(text, file=self.stream)

    def close(self) -> None:
        """Close the log file."""
        if self._file is not None:
            self._file.close()
            self._file = None
