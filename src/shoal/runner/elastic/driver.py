"""The elastic driver: keep a job training while workers come and go.

What it does, whoever starts the workers (shoalrun's processes, :mod:`.processes`; Ray
actors, :mod:`shoal.ray.elastic_v2`):

* looks at the hosts every discovery interval; starts one worker per slot, up to ``max_np``
  (``np`` at first), each with a stable id ``host:slot`` (``SHOAL_ELASTIC_ID``), and
  publishes the world (members in rank order) in the job's store
  (:data:`shoal.core.elastic.WORLD_KEY`); survivors keep the low ranks, so rank 0 always
  holds the state that new workers receive;
* when a worker fails or its host leaves discovery, publishes a smaller world: the
  survivors, inside ``hvd.elastic.run``, see the lost peer, restore the last commit and
  continue; when slots appear, starts workers and publishes a larger world, which running
  workers notice at their next ``state.commit()``;
* on a worker's failure blacklists its host, as horovodrun does: the host's other workers
  are stopped at once and its slots leave the pool, for good or, with a cool-down range,
  until a cool-down ends (:class:`Blacklist`; the host then gets its slots back).
  ``blacklist_after`` N (N > 1) is the lenient option: a host stays until its workers
  failed N times, and only the slot of a worker that failed is not reused;
* fails the job, saying why, when fewer than ``min_np`` workers are left for
  ``elastic_timeout_s``, or when more than ``reset_limit`` resets were needed; ends it when
  the workers finish, stopping workers started for a world that can no longer form.
"""

from __future__ import annotations

import abc
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...core.elastic import FORMED_KEY, WORLD_KEY, WorldPlan
from ..common import ExitCode, LaunchError, err

__all__ = ["COOLDOWN_MAX_S", "DISCOVER_HOSTS_FREQUENCY_SECS", "Blacklist", "Driver",
           "ElasticOptions", "Member", "drive"]

#: how often drivers without a discovery interval of their own (Ray's) look at the hosts
#: (Horovod's name)
DISCOVER_HOSTS_FREQUENCY_SECS = 1.0


@dataclass(frozen=True)
class ElasticOptions:
    """The elastic flags of shoalrun."""

    np: int
    min_np: int
    max_np: int
    discovery_script: str | None = None
    discovery_interval_s: float = 1.0
    elastic_timeout_s: float = 600.0
    reset_limit: int | None = None
    blacklist_after: int = 1  # horovodrun's: the first failure blacklists the host
    hosts: tuple[tuple[str, int], ...] = ()  # the fixed pool without a script
    slots_per_host: int = 1  # of a discovered host whose line gives none
    cooldown_range: tuple[int, int] | None = None  # blacklisted for good without one
    timestamps: bool = False  # prefix each output line with the time

    def check(self) -> None:
        """:class:`LaunchError` for impossible settings."""
        if not 1 <= self.min_np <= self.np <= self.max_np:
            raise LaunchError(f"elastic: need 1 <= --min-np ({self.min_np}) <= -np ({self.np}) "
                              f"<= --max-np ({self.max_np})")
        if self.discovery_interval_s <= 0 or self.elastic_timeout_s <= 0:
            raise LaunchError("elastic: --discovery-interval and --elastic-timeout must be > 0")
        if self.blacklist_after < 1:
            raise LaunchError("elastic: --blacklist-after must be >= 1")
        if self.slots_per_host < 1:
            raise LaunchError("elastic: --slots-per-host must be >= 1")
        if self.cooldown_range is not None:
            low, high = self.cooldown_range
            if not 1 <= low <= high <= COOLDOWN_MAX_S:
                raise LaunchError(f"elastic: --blacklist-cooldown-range {low} {high}: need "
                                  f"1 <= MIN <= MAX <= {COOLDOWN_MAX_S} seconds")


#: the longest cool-down horovodrun allows (an hour)
COOLDOWN_MAX_S = 3600


class Blacklist:
    """Hosts kept out of the pool: for good, or, with a cool-down range (horovodrun's
    ``--blacklist-cooldown-range MIN MAX``), until a cool-down ends that doubles with each
    blacklisting of the host (``MIN * 2**n`` plus up to ``MIN`` of jitter, within
    ``MIN..MAX``)."""

    def __init__(self, cooldown_range: tuple[int, int] | None = None,
                 rng: random.Random | None = None) -> None:
        self.cooldown_range = cooldown_range
        self.until: dict[str, float] = {}  # host -> end of its cool-down (inf: never)
        self.times: Counter[str] = Counter()
        self._rng = rng or random.Random()

    def add(self, host: str, now: float) -> float:
        """Blacklist ``host`` from ``now``; returns the seconds it stays out (inf: for good)."""
        self.times[host] += 1
        if self.cooldown_range is None:
            delay = math.inf
        else:
            low, high = self.cooldown_range
            delay = low * (1 << self.times[host]) + self._rng.uniform(0, 1) * low
            delay = max(low, min(high, delay))
        self.until[host] = now + delay
        return delay

    def active(self, now: float) -> set[str]:
        """The hosts out of the pool at ``now``."""
        return {h for h, end in self.until.items() if end > now}

    def returned(self, now: float) -> list[str]:
        """Hosts whose cool-down has ended since the last call (each is said once)."""
        back = [h for h, end in self.until.items() if end <= now]
        for h in back:
            del self.until[h]
        return back


@dataclass
class Member:
    """A worker of the job: its id (``host:slot``), host, handle (the driver's), the world
    version it first joined and its start order."""

    id: str
    host: str
    handle: Any
    joined: int
    serial: int


class Driver(abc.ABC):
    """The state of an elastic job's workers and the world they form; :func:`drive` runs the
    loop. Subclasses start, watch and stop workers: processes (:mod:`.processes`, shoalrun)
    or Ray actors (:mod:`shoal.ray.elastic_v2`)."""

    def __init__(self, opts: ElasticOptions, job_id: str, blacklist: Blacklist | None = None
                 ) -> None:
        self.opts = opts
        self.job_id = job_id
        self.members: dict[str, Member] = {}
        self.failures: Counter[str] = Counter()
        self.blacklist = blacklist or Blacklist(opts.cooldown_range)
        self.retired: set[str] = set()  # slots whose worker failed: not reused
        self.version = 0
        self.resets = 0
        self.serial = 0

    @abc.abstractmethod
    def discover(self) -> list[tuple[str, int]]:
        """The hosts and slots the job may use now (:class:`LaunchError` if unknown)."""

    @abc.abstractmethod
    def launch(self, host: str, slot: int, member_id: str) -> Any:
        """Start the worker of ``host``'s ``slot``; its handle."""

    @abc.abstractmethod
    def exit_code(self, member: Member) -> int | None:
        """The worker's exit code (negative: the signal), None while it runs."""

    @abc.abstractmethod
    def stop(self, members: Sequence[Member]) -> None:
        """Stop these workers (they are no longer members)."""

    def reap(self, member: Member) -> None:  # noqa: B027 (optional)
        """Collect what an exited worker leaves (its last output)."""

    def say(self, message: str) -> None:
        """Tell the user (stderr, under shoalrun's name)."""
        err(message)

    def tick(self) -> None:  # noqa: B027 (optional)
        """Called once per turn of the loop (a driver's own chores: its workers' logs)."""

    def discovery_interval(self) -> float:
        """Seconds between two looks at the hosts."""
        return self.opts.discovery_interval_s

    def pool(self) -> list[tuple[str, int]]:
        """The usable hosts and slots: discovery's, less the blacklisted hosts."""
        hosts = self.discover()
        now = time.monotonic()
        for host in self.blacklist.returned(now):  # a second chance, its slots included
            self.failures[host] = 0
            self.retired = {m for m in self.retired if not m.startswith(f"{host}:")}
            self.say(f"elastic: host {host} is back after its cool-down")
        out = self.blacklist.active(now)
        return [(h, n) for h, n in hosts if h not in out]

    def start(self, host: str, slot: int) -> None:
        member_id = f"{host}:{slot}"
        handle = self.launch(host, slot, member_id)
        self.members[member_id] = Member(member_id, host, handle, self.version + 1,
                                         self.serial)
        self.serial += 1

    def publish(self, store: object, added: bool) -> None:
        self.version += 1
        order = sorted(self.members.values(), key=lambda m: (m.joined, m.serial))
        plan = WorldPlan(self.version, tuple(m.id for m in order),
                         tuple(m.host for m in order), added)
        store.set(WORLD_KEY, plan.to_json())  # type: ignore[attr-defined]
        self.say(f"elastic: world {self.version}: {_count(len(order))} "
            f"({', '.join(plan.members)})")


def _count(n: int, noun: str = "worker") -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _stop_stranded(d: Driver, store: object) -> None:
    """Training finished: workers started for a world that never formed wait to join it
    (its rank 0 has exited); stop them, as horovodrun ends a job once the workers of its last
    rendezvous are done."""
    try:
        formed = int(store.try_get(FORMED_KEY) or b"0")  # type: ignore[attr-defined]
    except Exception:  # the store is ours and local: a failure here is not the job's
        return
    for m in [m for m in d.members.values() if m.joined > formed]:
        d.say(f"elastic: training finished before world {m.joined} formed: stopping worker "
            f"{m.id}, which never trained")
        d.stop([m])
        del d.members[m.id]


def drive(d: Driver, store: object) -> int:
    """Run ``d``'s job to its end (see the package docstring); the exit code. ``store``
    holds the published worlds."""
    opts = d.opts
    want = opts.np
    below_since: float | None = None
    next_discovery = 0.0
    first = True
    finished: list[str] = []
    while True:
        changed, added = False, False
        d.tick()
        for m in list(d.members.values()):  # exits
            rc = d.exit_code(m)
            if rc is None or m.id not in d.members:  # running, or stopped with its host
                continue
            d.reap(m)
            del d.members[m.id]
            if rc == 0:
                finished.append(m.id)
                continue
            d.failures[m.host] += 1
            d.retired.add(m.id)
            why = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
            d.say(f"elastic: worker {m.id} failed ({why}); {len(d.members)} left")
            if d.failures[m.host] >= opts.blacklist_after and \
                    m.host not in d.blacklist.active(time.monotonic()):
                out_for = d.blacklist.add(m.host, time.monotonic())
                d.say(f"elastic: host {m.host} blacklisted after {d.failures[m.host]} "
                    f"failure{'s' if d.failures[m.host] > 1 else ''}"
                    + ("" if math.isinf(out_for) else f", for {out_for:.0f}s"))
                for other in [o for o in d.members.values() if o.host == m.host]:
                    d.say(f"elastic: host {m.host} is blacklisted: stopping worker {other.id}")
                    d.stop([other])
                    del d.members[other.id]
            changed = True
        if finished:
            _stop_stranded(d, store)
            if not d.members:
                d.say(f"elastic: job finished ({_count(len(finished))} exited 0)")
                return ExitCode.OK
            time.sleep(0.05)
            continue
        now = time.monotonic()
        pool: list[tuple[str, int]] | None = None
        if now >= next_discovery:
            next_discovery = now + d.discovery_interval()
            try:
                pool = d.pool()
            except LaunchError as exc:
                d.say(f"elastic: {exc}")
                pool = None
            if pool is not None:
                slots = [(h, s) for h, n in pool for s in range(n)]
                ids = {f"{h}:{s}" for h, s in slots}
                for m in [m for m in d.members.values() if m.id not in ids]:
                    d.say(f"elastic: host {m.host} left discovery: stopping worker {m.id}")
                    d.stop([m])
                    del d.members[m.id]
                    changed = True
                limit = want if first else opts.max_np
                for h, s in slots:
                    if len(d.members) >= limit:
                        break
                    if f"{h}:{s}" not in d.members and f"{h}:{s}" not in d.retired:
                        d.start(h, s)
                        changed = added = True
        cooling = any(end != math.inf for end in d.blacklist.until.values())
        if not d.members and d.failures and pool is not None and not cooling and not any(
                f"{h}:{s}" not in d.retired for h, n in pool for s in range(n)):
            blacklisted = sorted(d.blacklist.active(now))
            d.say(f"elastic: every worker failed and no slot is left to start one "
                f"({_count(sum(d.failures.values()), 'failure')}; blacklisted: "
                f"{', '.join(blacklisted) or 'none'}): stopping the job"
                + ("; to give a host's slots another worker after a failure, as horovodrun "
                   "does not by default: --blacklist-after N (a host leaves at its Nth "
                   "failure) or --blacklist-cooldown-range MIN MAX (it comes back after "
                   "MIN to MAX seconds)" if blacklisted else ""))
            return ExitCode.ERROR
        if len(d.members) < opts.min_np:
            below_since = below_since or now
            if now - below_since > opts.elastic_timeout_s or (first and now - below_since >
                                                             opts.elastic_timeout_s):
                d.say(f"elastic: only {_count(len(d.members))} (below --min-np {opts.min_np}) "
                    f"for {opts.elastic_timeout_s:g}s: stopping the job")
                return ExitCode.ERROR
            time.sleep(0.05)
            continue
        below_since = None
        if changed or first:
            if not first:
                d.resets += 1
                if opts.reset_limit is not None and d.resets > opts.reset_limit:
                    d.say(f"elastic: reset limit {opts.reset_limit} reached ({d.resets} resets):"
                        f" stopping the job")
                    return ExitCode.ERROR
            d.publish(store, added and not first)
            first = False
        time.sleep(0.05)

