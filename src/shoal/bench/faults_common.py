"""What every ``shoal bench faults`` rank writes: its outcome, the fault's moment, and the
survivors' wait for the loss."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

__all__ = ["fault_now", "record", "wait_for_loss"]


def record(folder: str, rank: int, **values: Any) -> None:
    """This rank's outcome, for the orchestrator."""
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
        json.dump({"t": time.time(), **values}, f)


def fault_now(folder: str) -> None:
    """The moment the fault happens (detection times count from it)."""
    with open(os.path.join(folder, "fault.json"), "w") as f:
        json.dump({"t": time.time()}, f)


def wait_for_loss(shoal: Any, folder: str, rank: int) -> None:
    """A survivor: run collectives until shoal raises (90 s at most); record what it said."""
    start = time.time()
    try:
        while time.time() - start < 90:
            shoal.allreduce(np.ones(1024, np.float32), name="after.fault")
            time.sleep(0.01)
        record(folder, rank, outcome="no error within 90 s")
    except shoal.ShoalError as exc:
        record(folder, rank, outcome="raised", error=type(exc).__name__, message=str(exc))
