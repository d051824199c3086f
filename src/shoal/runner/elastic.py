"""``shoalrun`` in elastic mode: keep a job training while workers come and go.

``shoalrun -np 3 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python train.py``
(horovodrun's flags). The driver here:

* runs the discovery script every ``--discovery-interval`` seconds; each line it prints is
  ``host:slots`` (or ``host``, one slot); without a script the hosts of ``-H`` / this machine
  with ``-np`` slots are the fixed pool. Hosts are this machine's names (workers started
  here, told ``SHOAL_HOSTNAME=<host>`` so that each listed host is a host to shoal) or
  others (reached by ssh, as in a plain job);
* starts one worker per slot, up to ``--max-np`` (``-np`` at first), each with a stable id
  ``host:slot`` (``SHOAL_ELASTIC_ID``), and publishes the world (members in rank order) in its
  rendezvous store (:data:`shoal.core.elastic.WORLD_KEY`); survivors keep the low ranks, so
  rank 0 always holds the state that new workers receive;
* when a worker exits with an error or is killed, or its host leaves discovery (its workers
  are stopped), publishes a smaller world: the survivors, inside ``hvd.elastic.run``, see the
  lost peer, restore the last commit and continue; when slots appear, starts workers and
  publishes a larger world, which running workers notice at their next ``state.commit()``;
* on a worker's failure blacklists its host, as horovodrun does: the host's other workers
  are stopped at once and its slots leave the pool, for good or, with
  ``--blacklist-cooldown-range MIN MAX``, until a cool-down ends (:class:`Blacklist`; the host
  then gets its slots back). ``--blacklist-after N`` (N > 1) is the lenient option: a host
  stays until its workers failed N times, and only the slot of a worker that failed is not
  reused (a new slot in discovery is needed);
* fails the job, saying why, when fewer than ``--min-np`` workers are left for
  ``--elastic-timeout`` seconds, or when more than ``--reset-limit`` resets were needed; ends
  it when the workers exit 0.
"""

from __future__ import annotations

import math
import os
import queue
import random
import secrets
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import alias
from ..core import config
from ..core.auth import secret_bytes
from ..core.elastic import ELASTIC_ID_VAR, FORMED_KEY, WORLD_KEY, WorldPlan
from .common import ExitCode, LaunchError, err
from .hosts import WorkerSpec, local_host_names
from .options import LAUNCHER_VARS
from .runners import HostRunner, LocalRunner
from .supervise import Launch, Worker, start_worker, stop_workers

__all__ = ["COOLDOWN_MAX_S", "Blacklist", "ElasticOptions", "discover", "parse_discovery",
           "run_elastic"]


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


def parse_discovery(text: str, slots_per_host: int = 1) -> list[tuple[str, int]]:
    """``host:slots`` lines (``host`` alone: ``slots_per_host`` slots; blank lines and ``#``
    comments skipped), in order."""
    out: list[tuple[str, int]] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(":")
        if not host or (slots and not slots.strip().isdigit()):
            raise LaunchError(f"host discovery: cannot read {raw!r} (expected host:slots)")
        if any(h == host for h, _ in out):
            continue
        out.append((host, int(slots) if slots else slots_per_host))
    return out


def discover(script: str, timeout: float = 30.0, slots_per_host: int = 1
             ) -> list[tuple[str, int]]:
    """Run the discovery script; its hosts and slots."""
    try:
        proc = subprocess.run([script], capture_output=True, text=True, timeout=timeout,
                              shell=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"host discovery script {script}: {exc}") from None
    if proc.returncode != 0:
        raise LaunchError(f"host discovery script {script} exited with {proc.returncode}: "
                          f"{proc.stderr.strip()[-300:]}")
    return parse_discovery(proc.stdout, slots_per_host)


@dataclass
class _Member:
    id: str
    host: str
    worker: Worker
    joined: int  # the world version it first joined


@dataclass
class _Driver:
    opts: ElasticOptions
    command: list[str]
    environ: Mapping[str, str]
    remote: HostRunner
    store_addr: str
    store_port: int
    secret: str
    job_id: str
    start_timeout_s: float
    kill_grace: float
    settings: Mapping[str, str] = field(default_factory=dict)
    members: dict[str, _Member] = field(default_factory=dict)
    failures: Counter[str] = field(default_factory=Counter)
    blacklist: Blacklist = field(default_factory=Blacklist)
    retired: set[str] = field(default_factory=set)  # slots whose worker failed: not reused
    version: int = 0
    resets: int = 0
    serial: int = 0
    local: HostRunner = field(default_factory=LocalRunner)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: queue.Queue[Worker] = field(default_factory=queue.Queue)
    names: set[str] = field(default_factory=local_host_names)

    def pool(self) -> list[tuple[str, int]]:
        hosts = (discover(self.opts.discovery_script, slots_per_host=self.opts.slots_per_host)
                 if self.opts.discovery_script else list(self.opts.hosts))
        now = time.monotonic()
        for host in self.blacklist.returned(now):  # a second chance, its slots included
            self.failures[host] = 0
            self.retired = {m for m in self.retired if not m.startswith(f"{host}:")}
            err(f"elastic: host {host} is back after its cool-down")
        out = self.blacklist.active(now)
        return [(h, n) for h, n in hosts if h not in out]

    def env_of(self, spec: WorkerSpec, member_id: str) -> dict[str, str]:
        local = spec.local
        base = dict(self.environ) if local else {
            k: v for k, v in self.environ.items()
            if k.startswith("SHOAL_") or k in ("PATH", "PYTHONPATH", "VIRTUAL_ENV")}
        for k in ("SHOAL_RANK", "SHOAL_SIZE", "SHOAL_LOCAL_RANK", "SHOAL_LOCAL_SIZE",
                  "RANK", "WORLD_SIZE", "LOCAL_RANK", "HOROVOD_RANK", "HOROVOD_SIZE",
                  *LAUNCHER_VARS):  # shoalrun's own settings stay with shoalrun
            base.pop(k, None)
        base.update(self.settings)  # knobs set by flags (--timeline-filename ...)
        base.update({
            "SHOAL_RENDEZVOUS_ADDR": self.store_addr, "SHOAL_RENDEZVOUS_PORT": str(self.store_port),
            "SHOAL_SECRET": self.secret, "SHOAL_JOB_ID": self.job_id,
            ELASTIC_ID_VAR: member_id, "SHOAL_HOSTNAME": spec.host,
            "SHOAL_ELASTIC_TIMEOUT_S": str(self.opts.elastic_timeout_s),
            config.env_name("start_timeout_s"): str(self.start_timeout_s),
            "PYTHONUNBUFFERED": "1"})
        return alias.worker_environment(base)  # the import switch, where --as asks for it

    def start(self, host: str, slot: int) -> None:
        member_id = f"{host}:{slot}"
        local = host in self.names or host in ("localhost", "127.0.0.1") or (
            not self.opts.discovery_script and not self.opts.hosts)
        local = local or self.remote is None
        spec = WorkerSpec(rank=self.serial, local_rank=slot, local_size=1, cross_rank=0,
                          cross_size=1, host=host, local=local)
        self.serial += 1
        env = self.env_of(spec, member_id)
        job = Launch([spec], list(self.command),
                     runner_of=lambda s: self.local if s.local else self.remote,
                     env_of=lambda s: env, cwd=os.getcwd(), job_id=self.job_id,
                     kill_grace=self.kill_grace, start_timeout_s=self.start_timeout_s,
                     timestamps=self.opts.timestamps)
        worker = start_worker(job, spec, self.lock, self.done)
        self.members[member_id] = _Member(member_id, host, worker, self.version + 1)

    def publish(self, store: object, added: bool) -> None:
        self.version += 1
        order = sorted(self.members.values(), key=lambda m: (m.joined, m.worker.spec.rank))
        plan = WorldPlan(self.version, tuple(m.id for m in order),
                         tuple(m.host for m in order), added)
        store.set(WORLD_KEY, plan.to_json())  # type: ignore[attr-defined]
        err(f"elastic: world {self.version}: {len(order)} workers "
            f"({', '.join(plan.members)})")


def run_elastic(opts: ElasticOptions, command: Sequence[str], *, remote: HostRunner,
                environ: Mapping[str, str] | None = None, start_timeout_s: float = 120.0,
                kill_grace: float = 5.0, network_interface: str | None = None,
                settings: Mapping[str, str] | None = None) -> int:
    """Run an elastic job (see the module docstring); its exit code. ``settings``: the knobs
    that flags set, for every worker."""
    from ..core.rendezvous import StoreClient, StoreServer
    from .hosts import interface_address

    opts.check()
    env = dict(os.environ if environ is None else environ)
    addr = interface_address(network_interface) if network_interface else "127.0.0.1"
    if opts.discovery_script or opts.hosts:
        pool_hosts = [h for h, _ in (opts.hosts or ())]
        if any(h not in local_host_names() for h in pool_hosts) and not network_interface:
            addr = socket.gethostbyname(socket.gethostname())
    secret, job_id = secrets.token_hex(32), f"{int(time.time() * 1000):x}-{os.getpid()}"
    server = StoreServer(secret_bytes(secret), host=addr, port=0).start()
    store = StoreClient(addr, int(server.address[1]), secret_bytes(secret), timeout=10.0)
    d = _Driver(opts, list(command), env, remote, addr, int(server.address[1]), secret, job_id,
                start_timeout_s, kill_grace, dict(settings or {}),
                blacklist=Blacklist(opts.cooldown_range))
    try:
        return _loop(d, store)
    finally:
        stop_workers([m.worker for m in d.members.values()], kill_grace)
        store.close()
        server.close()
        for path in Path("/dev/shm").glob(f"shoal-{job_id}-*"):
            path.unlink(missing_ok=True)


def _stop_stranded(d: _Driver, store: object) -> None:
    """Training finished: workers started for a world that never formed wait to join it
    (its rank 0 has exited); stop them, as horovodrun ends a job once the workers of its last
    rendezvous are done."""
    try:
        formed = int(store.try_get(FORMED_KEY) or b"0")  # type: ignore[attr-defined]
    except Exception:  # the store is ours and local: a failure here is not the job's
        return
    for m in [m for m in d.members.values() if m.joined > formed]:
        err(f"elastic: training finished before world {m.joined} formed: stopping worker "
            f"{m.id}, which never trained")
        stop_workers([m.worker], d.kill_grace)
        del d.members[m.id]


def _loop(d: _Driver, store: object) -> int:
    opts = d.opts
    want = opts.np
    below_since: float | None = None
    next_discovery = 0.0
    first = True
    finished: list[str] = []
    while True:
        changed, added = False, False
        for m in list(d.members.values()):  # exits
            rc = m.worker.proc.poll()
            if rc is None or m.id not in d.members:  # running, or stopped with its host
                continue
            for t in m.worker.threads:  # its last output lines, then forget it
                t.join(timeout=1.0)
            del d.members[m.id]
            if rc == 0:
                finished.append(m.id)
                continue
            d.failures[m.host] += 1
            d.retired.add(m.id)
            why = f"signal {-rc}" if rc < 0 else f"exit code {rc}"
            err(f"elastic: worker {m.id} failed ({why}); {len(d.members)} left")
            if d.failures[m.host] >= opts.blacklist_after and \
                    m.host not in d.blacklist.active(time.monotonic()):
                out_for = d.blacklist.add(m.host, time.monotonic())
                err(f"elastic: host {m.host} blacklisted after {d.failures[m.host]} "
                    f"failure{'s' if d.failures[m.host] > 1 else ''}"
                    + ("" if math.isinf(out_for) else f", for {out_for:.0f}s"))
                for other in [o for o in d.members.values() if o.host == m.host]:
                    err(f"elastic: host {m.host} is blacklisted: stopping worker {other.id}")
                    stop_workers([other.worker], d.kill_grace)
                    del d.members[other.id]
            changed = True
        if finished:
            _stop_stranded(d, store)
            if not d.members:
                err(f"elastic: job finished ({len(finished)} workers exited 0)")
                return ExitCode.OK
            time.sleep(0.05)
            continue
        now = time.monotonic()
        pool: list[tuple[str, int]] | None = None
        if now >= next_discovery:
            next_discovery = now + opts.discovery_interval_s
            try:
                pool = d.pool()
            except LaunchError as exc:
                err(f"elastic: {exc}")
                pool = None
            if pool is not None:
                slots = [(h, s) for h, n in pool for s in range(n)]
                ids = {f"{h}:{s}" for h, s in slots}
                for m in [m for m in d.members.values() if m.id not in ids]:
                    err(f"elastic: host {m.host} left discovery: stopping worker {m.id}")
                    stop_workers([m.worker], d.kill_grace)
                    del d.members[m.id]
                    changed = True
                limit = want if first else opts.max_np
                for h, s in slots:
                    if len(d.members) >= limit:
                        break
                    if f"{h}:{s}" not in d.members and f"{h}:{s}" not in d.retired:
                        d.start(h, s)
                        changed = added = True
        if not d.members and d.failures and pool is not None and not any(
                f"{h}:{s}" not in d.retired for h, n in pool for s in range(n)):
            err(f"elastic: every worker failed and no slot is left to start one "
                f"({sum(d.failures.values())} failures; blacklisted: "
                f"{', '.join(sorted(d.blacklist.active(now))) or 'none'}): stopping the job")
            return ExitCode.ERROR
        if len(d.members) < opts.min_np:
            below_since = below_since or now
            if now - below_since > opts.elastic_timeout_s or (first and now - below_since >
                                                             opts.elastic_timeout_s):
                err(f"elastic: only {len(d.members)} workers (below --min-np {opts.min_np}) "
                    f"for {opts.elastic_timeout_s:g}s: stopping the job")
                return ExitCode.ERROR
            time.sleep(0.05)
            continue
        below_since = None
        if changed or first:
            if not first:
                d.resets += 1
                if opts.reset_limit is not None and d.resets > opts.reset_limit:
                    err(f"elastic: reset limit {opts.reset_limit} reached ({d.resets} resets):"
                        f" stopping the job")
                    return ExitCode.ERROR
            d.publish(store, added and not first)
            first = False
        time.sleep(0.05)

