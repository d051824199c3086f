"""How much of a training step's communication hides behind backward, read off a timeline.

The training application marks ``FORWARD``, ``BACKWARD`` and ``STEP`` on the ``training``
track (:func:`shoal.timeline_range`) and the engine writes every fused reduction as an
``ALLREDUCE`` span on the ``fusion buffers`` track. Per step (``FORWARD`` start to ``STEP``
end) the reductions' time is split into the part inside ``BACKWARD`` (hidden: the worker was
computing meanwhile) and the rest (exposed: ``step()`` waited for it, or it ran before
backward). ``exposed_ms`` is what the step actually waits: the time from backward's end to the
last reduction's end.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

__all__ = ["analyse", "excerpt", "load_events", "plot_excerpt"]

_PHASES = ("FORWARD", "BACKWARD", "STEP")


def load_events(path: str) -> list[dict[str, Any]]:
    """The events of a Chrome-trace timeline, even one whose writer died before closing it."""
    with open(path) as f:
        text = f.read().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return json.loads(text)


def _spans(events: list[dict[str, Any]]) -> tuple[list[tuple[str, float, float]],
                                                   list[tuple[float, float]]]:
    """(phase, start, end) of the training track and (start, end) of every fused reduction,
    in milliseconds."""
    tracks = {e["tid"]: e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    phases, comms = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        track = tracks.get(e["tid"])
        start, end = e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3
        if track == "training" and e["name"] in _PHASES:
            phases.append((e["name"], start, end))
        elif track == "fusion buffers" and e["name"] == "ALLREDUCE":
            comms.append((start, end))
    return sorted(phases, key=lambda p: p[1]), sorted(comms)


def _steps(phases: list[tuple[str, float, float]]) -> list[dict[str, tuple[float, float]]]:
    steps, current = [], {}
    for name, start, end in phases:
        if name == "FORWARD" and current:
            steps.append(current)
            current = {}
        current[name] = (start, end)
    if current:
        steps.append(current)
    return [s for s in steps if set(s) == set(_PHASES)]


def analyse(events: list[dict[str, Any]], skip: int = 2) -> dict[str, float]:
    """Per-step medians (ms) of the step, backward and communication time, the communication
    hidden behind backward and the wait after it, over the steps after the first ``skip``."""
    phases, comms = _spans(events)
    steps = _steps(phases)[skip:]
    if not steps:
        raise ValueError("the timeline holds no complete FORWARD/BACKWARD/STEP step to analyse")
    rows = []
    for s in steps:
        t0, t1 = s["FORWARD"][0], s["STEP"][1]
        b0, b1 = s["BACKWARD"]
        mine = [(a, b) for a, b in comms if t0 <= a < t1]
        total = sum(b - a for a, b in mine)
        hidden = sum(max(0.0, min(b, b1) - max(a, b0)) for a, b in mine)
        last = max((b for _a, b in mine), default=b1)
        rows.append((t1 - t0, b1 - b0, total, hidden, max(0.0, last - b1), len(mine)))
    a = np.median(np.asarray(rows), axis=0)
    return {"steps": len(rows), "step_ms": float(a[0]), "backward_ms": float(a[1]),
            "comm_ms": float(a[2]), "hidden_ms": float(a[3]), "exposed_ms": float(a[4]),
            "buffers": float(a[5]),
            "hidden_share": float(a[3] / a[2]) if a[2] > 0 else 0.0}


def excerpt(events: list[dict[str, Any]], index: int = -1) -> list[list[Any]]:
    """One step's spans as ``[track, name, start_ms, duration_ms]`` from the step's start (the
    last complete step by default): small enough to keep in a results file and plot later."""
    phases, comms = _spans(events)
    steps = _steps(phases)
    if not steps:
        return []
    s = steps[index]
    t0, t1 = s["FORWARD"][0], s["STEP"][1]
    out = [["training", name, s[name][0] - t0, s[name][1] - s[name][0]] for name in _PHASES]
    out += [["fusion buffers", "ALLREDUCE", a - t0, b - a] for a, b in comms if t0 <= a < t1]
    return [[track, name, round(x, 3), round(d, 3)] for track, name, x, d in out]


def plot_excerpt(ax: Any, spans: list[list[Any]], title: str) -> None:
    """Draw an :func:`excerpt` on a matplotlib axis: compute phases above, reductions below."""
    colours = {"FORWARD": "#9ecae1", "BACKWARD": "#3182bd", "STEP": "#fdae6b",
               "ALLREDUCE": "#31a354"}
    rows = {"training": 1, "fusion buffers": 0}
    for track, name, start, dur in spans:
        ax.broken_barh([(start, dur)], (rows[track] - 0.35, 0.7), facecolors=colours[name],
                       edgecolor="white", linewidth=0.5, label=name)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=7, loc="upper left", ncol=4)
    ax.set_yticks([0, 1], ["reductions", "compute"])
    ax.set_ylim(-0.6, 1.9)
    ax.set_xlabel("ms from the step's start")
    ax.set_title(title, fontsize=9)
