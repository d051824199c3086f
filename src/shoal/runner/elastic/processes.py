"""``shoalrun`` in elastic mode: the elastic driver (:mod:`.driver`) with workers that are
processes, started on this machine or by ssh.

``shoalrun -np 3 --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh python train.py``
(horovodrun's flags). The discovery script runs every ``--discovery-interval`` seconds; each
line it prints is ``host:slots`` (or ``host``, one slot); without a script the hosts of
``-H`` / this machine with ``-np`` slots are the fixed pool. Hosts are this machine's names
(workers started here, told ``SHOAL_HOSTNAME=<host>`` so that each listed host is a host to
shoal) or others (reached by ssh, as in a plain job).
"""

from __future__ import annotations

import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from ... import alias
from ...core import config
from ...core.auth import secret_bytes
from ...core.elastic import ELASTIC_ID_VAR
from ..hosts import WorkerSpec, local_host_names
from ..options import LAUNCHER_VARS
from ..runners import HostRunner, LocalRunner
from ..supervise import Launch, Worker, start_worker, stop_workers
from .discovery import discover
from .driver import Blacklist, Driver, ElasticOptions, Member, drive

__all__ = ["ProcessDriver", "run_elastic"]


class ProcessDriver(Driver):
    """Workers that are processes: started here or by ssh (shoalrun's elastic mode)."""

    def __init__(self, opts: ElasticOptions, command: list[str], environ: Mapping[str, str],
                 remote: HostRunner | None, store_addr: str, store_port: int, secret: str,
                 job_id: str, start_timeout_s: float, kill_grace: float,
                 settings: Mapping[str, str] | None = None,
                 blacklist: Blacklist | None = None) -> None:
        super().__init__(opts, job_id, blacklist)
        self.command, self.environ, self.remote = command, environ, remote
        self.store_addr, self.store_port, self.secret = store_addr, store_port, secret
        self.start_timeout_s, self.kill_grace = start_timeout_s, kill_grace
        self.settings = dict(settings or {})
        self.local: HostRunner = LocalRunner()
        self.lock = threading.Lock()
        self.done: queue.Queue[Worker] = queue.Queue()
        self.names = local_host_names()
        self.spawned = 0
        self.slots: dict[str, int] = {}

    def discover(self) -> list[tuple[str, int]]:
        if self.opts.discovery_script:
            found = discover(self.opts.discovery_script, slots_per_host=self.opts.slots_per_host)
        else:
            found = list(self.opts.hosts)
        self.slots.update(found)  # a host's slot count, for binding its workers to cores
        return found

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
            "SHOAL_CPU_SLOT": f"{spec.local_rank}/{self.slots.get(spec.host, 1)}",
            config.env_name("start_timeout_s"): str(self.start_timeout_s),
            "PYTHONUNBUFFERED": "1"})
        return alias.worker_environment(base)  # the import switch, where --as asks for it

    def launch(self, host: str, slot: int, member_id: str) -> Worker:
        local = host in self.names or host in ("localhost", "127.0.0.1") or (
            not self.opts.discovery_script and not self.opts.hosts)
        local = local or self.remote is None
        spec = WorkerSpec(rank=self.spawned, local_rank=slot, local_size=1, cross_rank=0,
                          cross_size=1, host=host, local=local)
        self.spawned += 1
        env = self.env_of(spec, member_id)
        job = Launch([spec], list(self.command),
                     runner_of=lambda s: self.local if s.local else self.remote,
                     env_of=lambda s: env, cwd=os.getcwd(), job_id=self.job_id,
                     kill_grace=self.kill_grace, start_timeout_s=self.start_timeout_s,
                     timestamps=self.opts.timestamps)
        return start_worker(job, spec, self.lock, self.done)

    def exit_code(self, member: Member) -> int | None:
        return member.handle.proc.poll()

    def reap(self, member: Member) -> None:
        for t in member.handle.threads:  # its last output lines
            t.join(timeout=1.0)

    def stop(self, members: Sequence[Member]) -> None:
        stop_workers([m.handle for m in members], self.kill_grace)

def run_elastic(opts: ElasticOptions, command: Sequence[str], *, remote: HostRunner,
                environ: Mapping[str, str] | None = None, start_timeout_s: float = 120.0,
                kill_grace: float = 5.0, network_interface: str | None = None,
                settings: Mapping[str, str] | None = None) -> int:
    """Run an elastic job (see the module docstring); its exit code. ``settings``: the knobs
    that flags set, for every worker."""
    from ...core.rendezvous import StoreClient, StoreServer
    from ..hosts import interface_address

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
    d = ProcessDriver(opts, list(command), env, remote, addr, int(server.address[1]), secret,
                      job_id, start_timeout_s, kill_grace, settings)
    try:
        return drive(d, store)
    finally:
        stop_workers([m.handle for m in d.members.values()], kill_grace)
        store.close()
        server.close()
        for path in Path("/dev/shm").glob(f"shoal-{job_id}-*"):
            path.unlink(missing_ok=True)


