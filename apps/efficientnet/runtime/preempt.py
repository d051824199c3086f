"""A clean stop on SIGTERM, the way preemptible clusters end a job (SageMaker managed spot,
Kubernetes, SLURM's ``--signal``): they send SIGTERM, wait a grace period, then SIGKILL.

:class:`StopRequest` records the signal instead of dying. At every step boundary the ranks
agree whether any of them was told to stop (one tiny allreduce), so all stop after the same
step and none is left waiting in a collective; then the application checkpoints (rank 0
writes) and every rank returns normally, exit status 0. A rank that reaches no step
boundary within the grace (``--stop_grace_s``) says so and exits 143 without a checkpoint,
before the cluster's SIGKILL can interrupt anything half-written.

DataLoader workers ignore SIGTERM (:func:`ignore_sigterm`, their ``worker_init_fn``): a
scheduler signals the whole process group, and a worker that died of it would end the step
its rank is finishing; they exit with their rank.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["StopRequest", "ignore_sigterm"]


def ignore_sigterm(_worker_id: int = 0) -> None:
    """A DataLoader ``worker_init_fn``: leave SIGTERM to the training process."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


class StopRequest:
    """SIGTERM recorded, and agreed on by the ranks at step boundaries."""

    def __init__(self, agree: Callable[[float, str], float], grace_s: float = 30.0) -> None:
        self.agree, self.grace_s = agree, grace_s
        self.signalled_at: float | None = None
        self.stopped = False
        self._done = threading.Event()
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signalled_at is not None:
            return
        self.signalled_at = time.monotonic()
        threading.Thread(target=self._watchdog, name="stop-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        if not self._done.wait(self.grace_s):
            print(f"SIGTERM: no step boundary within --stop_grace_s {self.grace_s:g}; "
                  f"exiting without a checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signal.SIGTERM)

    def __call__(self) -> bool:
        """Whether every rank stops after this step (every rank calls it at every step
        boundary)."""
        wanted = 1.0 if self.signalled_at is not None else 0.0
        # one name for every step: a name used before completes in one round (the name
        # cache); a new one per step would be negotiated in full every step
        if self.agree(wanted, "efficientnet.stop") > 0:
            self.stopped = True
        return self.stopped

    def done(self) -> None:
        """The checkpoint is written: the watchdog stands down."""
        self._done.set()

    def close(self) -> None:
        """Give SIGTERM back to what handled it before."""
        self._done.set()
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
