"""Event-level model of one training step: backward compute, gradient readiness, the engine's
negotiation rounds, fusion and collectives.

Every worker is assumed identical, so one worker's timeline stands for all of them:

* forward runs, then backward produces the gradients in :class:`StepProfile` order; each
  becomes ready (is submitted to the engine) when the backward work before it is done;
* the engine (shoal: ``shoal.core.engine.Engine``) wakes on the first pending request, sleeps
  ``cycle_s`` to let more arrive, runs a negotiation round, fuses what was pending at the start
  of the round into buffers of up to ``fusion_bytes`` (one dtype) in agreed order and runs them
  one after another; then, if more is pending, sleeps again. When backward ends, the caller's
  ``synchronize()`` runs rounds itself as soon as the engine is free (``caller_drives``);
* Horovod-style engines tick every ``cycle_s`` (``periodic``), negotiate through a coordinator
  and launch device collectives, which slow the concurrent backward by ``compute_slowdown``;
* the step ends when backward and the last collective are done; the optimizer then runs (not
  modelled). A node's input pipeline may cap throughput (``input_ceiling``, images/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .collectives import allreduce_time, negotiation_time
from .hardware import Hardware
from .models import StepProfile

__all__ = ["STRATEGIES", "ScalingRow", "StepResult", "Strategy", "scaling", "simulate_step",
           "step_time"]


@dataclass(frozen=True)
class Strategy:
    """How a library turns ready gradients into collectives."""

    name: str
    algorithm: str               # see collectives.ALGORITHMS
    negotiation: str             # "decentralized" (shoal) or "coordinator" (Horovod)
    cycle_s: float               # SHOAL_CYCLE_TIME_MS / HOROVOD_CYCLE_TIME
    fusion_bytes: int            # SHOAL_FUSION_THRESHOLD / HOROVOD_FUSION_THRESHOLD
    periodic: bool = False       # rounds start every cycle (Horovod) vs sleep after a round
    caller_drives: bool = True   # after backward the waiting caller runs rounds at once
    pipelined: bool | str = False  # hierarchical: False, "phases" or True (collectives.py)
    nic_efficiency: float = 1.0  # fraction of the node link's bandwidth achieved
    compute_slowdown: float = 0.0  # backward runs 1 + this slower while a device collective
                                   # runs (GPU hardware only; host CPU contention not modelled)
    description: str = ""

    def replace(self, **changes: object) -> Strategy:
        """A copy with some fields changed."""
        return replace(self, **changes)  # type: ignore[arg-type]


STRATEGIES: dict[str, Strategy] = {
    "shoal": Strategy("shoal", "hierarchical", "decentralized", 1e-3, 64 << 20,
                      pipelined="phases",
                      description="shoal today: shm on one node, hierarchical across nodes, "
                                  "the host's phases overlapping the cross-node ring chunk by "
                                  "chunk (1 MiB chunks, one ring at a time)"),
    "shoal-serial": Strategy("shoal-serial", "hierarchical", "decentralized", 1e-3, 64 << 20,
                             description="shoal with its phases one after another per chunk "
                                         "(the serial baseline)"),
    "shoal-pipelined": Strategy("shoal-pipelined", "hierarchical", "decentralized", 1e-3,
                                64 << 20, pipelined=True,
                                description="hierarchical with several chunks in flight across "
                                            "the nodes too (the SMDDP design)"),
    "shoal-ring": Strategy("shoal-ring", "ring", "decentralized", 1e-3, 64 << 20,
                           description="shoal with SHOAL_ALLREDUCE_ALGORITHM=ring"),
    # Horovod >= 0.21: cycle 1 ms, fusion 128 MB (CHANGELOG, PR #2468); NCCL ring on GPUs.
    # compute_slowdown 0.15 is fitted (``shoal sim --calibrate``) to SMDDP's 94% for Horovod
    # with EfficientNet-B0 on 8 p4d nodes; it matches NCCL kernels holding ~16 of an A100's
    # 108 SMs while they overlap backward. Without it the model gives Horovod 97.6% there.
    "horovod": Strategy("horovod", "nccl", "coordinator", 1e-3, 128 << 20, periodic=True,
                        caller_drives=False, compute_slowdown=0.15,
                        description="coordinator negotiation each cycle + flat NCCL-like ring"),
}


@dataclass(frozen=True)
class StepResult:
    """One simulated step of one worker (all workers alike)."""

    step_s: float
    compute_s: float       # forward + backward alone
    comm_s: float          # busy time of negotiation and collectives
    exposed_s: float       # step time beyond compute
    rounds: int
    buffers: int
    images: int            # per step, whole cluster

    @property
    def overlap(self) -> float:
        """Fraction of communication hidden behind backward."""
        if self.comm_s <= 0:
            return 1.0
        return min(1.0, max(0.0, 1.0 - self.exposed_s / self.comm_s))

    @property
    def throughput(self) -> float:
        """Images per second, whole cluster."""
        return self.images / self.step_s


def _fuse(sizes: list[int], threshold: int) -> list[list[int]]:
    """The engine's rule: append while the buffer stays within ``threshold`` bytes."""
    buffers: list[list[int]] = []
    total = 0
    for s in sizes:
        if buffers and total + s <= threshold:
            buffers[-1].append(s)
            total += s
        else:
            buffers.append([s])
            total = s
    return buffers


def simulate_step(profile: StepProfile, hw: Hardware, strategy: Strategy, nodes: int, *,
                  local: int | None = None, phase: float = 0.0,
                  input_ceiling: float | None = None) -> StepResult:
    """Simulate one step on ``nodes`` x ``local`` workers (default ``hw.workers_per_node``).

    ``phase`` (0..1) places a periodic engine's cycle grid relative to the start of backward.
    """
    g = hw.workers_per_node if local is None else local
    n = nodes * g
    grads = profile.gradients
    neg = negotiation_time(strategy.negotiation, hw, nodes, g) if n > 1 else 0.0
    on_device = hw.gpu and strategy.algorithm == "nccl"  # host paths leave the GPU alone
    slow = 1.0 + (strategy.compute_slowdown if on_device else 0.0)
    t = 0.0
    i, work = 0, grads[0].backward_s if grads else 0.0
    pending: list[int] = []
    state, until = "idle", 0.0       # idle | sleep (until) | busy (until)
    busy: list[tuple[float, float]] = []  # collective intervals of the running round
    origin = -phase * strategy.cycle_s  # periodic grid: last cycle start
    period = max(strategy.cycle_s, neg)
    comm = 0.0
    rounds = buffers = 0
    bwd_end = math.inf if grads else 0.0

    def next_tick(at: float) -> float:
        return origin + math.ceil(max(0.0, at - origin) / period - 1e-12) * period

    def start_round(at: float) -> None:
        nonlocal state, until, busy, pending, rounds, buffers, comm, origin
        take, pending = sorted(pending), []
        rounds += 1
        origin = at
        tt = at + neg
        busy = []
        for buf in _fuse([grads[k].nbytes for k in take], strategy.fusion_bytes):
            d = hw.per_collective + hw.per_tensor * len(buf) + allreduce_time(
                strategy.algorithm, hw, sum(buf), nodes, g,
                nic_efficiency=strategy.nic_efficiency, pipelined=strategy.pipelined)
            busy.append((tt, tt + d))
            tt += d
            buffers += 1
        comm += tt - at
        state, until = "busy", tt

    if n == 1:  # one worker: nothing to communicate
        bwd_end = profile.backward_s
        grads = ()
    while grads and (i < len(grads) or pending or state == "busy"):
        rate = 1.0 / slow if any(a <= t < b for a, b in busy) else 1.0
        edges = [e for a, b in busy for e in (a, b) if e > t]
        t_compute = t + work / rate if i < len(grads) else math.inf
        t_engine = until if state in ("sleep", "busy") else math.inf
        t_next = min(t_compute, t_engine, min(edges, default=math.inf))
        if t_next == t_compute:
            work = 0.0
        elif i < len(grads):
            work = max(0.0, work - (t_next - t) * rate)
        t = t_next
        if t == t_compute:  # gradient i (and any that need no further work) ready
            while i < len(grads) and work <= 0.0:
                pending.append(i)
                i += 1
                work = grads[i].backward_s if i < len(grads) else 0.0
            if i == len(grads):
                bwd_end = t
            if state == "idle":
                state = "sleep"
                until = next_tick(t) if strategy.periodic else t + strategy.cycle_s
            if bwd_end <= t and strategy.caller_drives and state == "sleep":
                start_round(t)
        elif t == t_engine:
            if state == "busy":
                busy = []
                if not pending:
                    state = "idle"
                elif bwd_end <= t and strategy.caller_drives:
                    start_round(t)
                else:  # Horovod starts at once when the round outlasted its cycle
                    state = "sleep"
                    until = max(origin + strategy.cycle_s, t) if strategy.periodic else \
                        t + strategy.cycle_s
            elif pending:  # sleep over
                start_round(t)
            else:  # pragma: no cover - a sleep is only entered with something pending
                state = "idle"
    end = max(bwd_end, t if grads else 0.0)
    step = profile.forward_s + end
    images = n * profile.batch
    if input_ceiling:
        step = max(step, g * profile.batch / input_ceiling)
    return StepResult(step, profile.compute_s, comm, step - profile.compute_s, rounds,
                      buffers, images)


def step_time(profile: StepProfile, hw: Hardware, strategy: Strategy, nodes: int, *,
              local: int | None = None, input_ceiling: float | None = None,
              phases: int = 4) -> StepResult:
    """:func:`simulate_step`, averaged over ``phases`` cycle phases for periodic engines."""
    if not strategy.periodic:
        return simulate_step(profile, hw, strategy, nodes, local=local,
                             input_ceiling=input_ceiling)
    runs = [simulate_step(profile, hw, strategy, nodes, local=local, phase=k / phases,
                          input_ceiling=input_ceiling) for k in range(phases)]
    mean = sum(r.step_s for r in runs) / phases
    return StepResult(mean, runs[0].compute_s, sum(r.comm_s for r in runs) / phases,
                      mean - runs[0].compute_s, round(sum(r.rounds for r in runs) / phases),
                      round(sum(r.buffers for r in runs) / phases), runs[0].images)


@dataclass(frozen=True)
class ScalingRow:
    """One row of a scaling table: a strategy on ``nodes`` nodes."""

    strategy: str
    nodes: int
    workers: int
    result: StepResult
    efficiency: float      # throughput / (nodes x throughput on one node)


def scaling(profile: StepProfile, hw: Hardware, strategies: list[Strategy],
            nodes: list[int] | None = None, *, local: int | None = None,
            input_ceiling: float | None = None) -> list[ScalingRow]:
    """Step results for every strategy and node count (default 1, 2, 4, ..., 64)."""
    counts = nodes or [2 ** k for k in range(7)]
    g = hw.workers_per_node if local is None else local
    rows = []
    for s in strategies:
        base = step_time(profile, hw, s, 1, local=g, input_ceiling=input_ceiling).throughput
        for m in counts:
            r = step_time(profile, hw, s, m, local=g, input_ceiling=input_ceiling)
            rows.append(ScalingRow(s.name, m, m * g, r, r.throughput / (m * base)))
    return rows
