"""``shoalrun``: start N copies of a command as one shoal job, for example
``shoalrun -np 8 -H node-a:4,node-b:4 -x OMP_NUM_THREADS=2 python train.py``.

Flags (``shoalrun --help``) and the ``SHOAL_*`` variables that set them are listed in one
table, :data:`shoal.runner.options.OPTIONS`. Output lines of the workers reach shoalrun's
stdout/stderr tagged ``[<rank>]<stdout>: `` / ``[<rank>]<stderr>: `` (and, with
``--output-filename DIR``, ``DIR/rank.<rank>.log``). The first worker to exit non-zero stops
the job (:mod:`shoal.runner.supervise`); so does a rank that has not joined the rendezvous
``--start-timeout`` seconds after the start, once another rank has (exit 124). Ctrl-C or
SIGTERM to shoalrun stops the job too (exit 130, 143).

Hosts: without ``-H``/``--hostfile`` every worker runs on this machine; otherwise the hosts
fill in order. This machine (``localhost``, ``127.0.0.1``, its host name) runs its workers
directly; other hosts are reached with ``ssh`` (:mod:`shoal.runner.runners`), and the
rendezvous store then listens on this machine's address towards them, or on
``--network-interface``'s. ``--emulate-hosts`` runs every listed host here as a simulated node.

Environment of each worker: shoalrun's own environment (remote workers: their host's
environment plus shoalrun's ``SHOAL_*`` settings, ``PATH``, ``PYTHONPATH`` and
``VIRTUAL_ENV``), then the ``-x`` variables (``-x NAME=VALUE`` sets, ``-x NAME`` copies
shoalrun's value; before them, under ``--sagemaker``, SageMaker's training environment for the
worker's host, :func:`shoal.runner.sagemaker.worker_environment`), then the knobs set by
flags (``--timeline-filename`` ...), then:

=========================  ========================================================
``SHOAL_RANK``             global rank, ``0 .. SHOAL_SIZE-1``
``SHOAL_SIZE``             number of workers
``SHOAL_LOCAL_RANK``       rank among the workers on the same host
``SHOAL_LOCAL_SIZE``       number of workers on the same host
``SHOAL_CROSS_RANK``       index of the host among the job's hosts (with workers)
``SHOAL_CROSS_SIZE``       number of hosts
``SHOAL_HOSTNAME``         the simulated host (``--emulate-hosts`` only)
``SHOAL_JOB_ID``           job identifier, names the shared-memory segments
``SHOAL_SECRET``           random per-job secret (hex) every connection must prove
``SHOAL_RENDEZVOUS_ADDR``  address of the rendezvous store run by shoalrun
``SHOAL_RENDEZVOUS_PORT``  port of that store
``SHOAL_START_TIMEOUT_S``  longest wait for all ranks to join (``--start-timeout``)
``MASTER_ADDR``            rank 0's host, for ``torch.distributed``'s own store
``MASTER_PORT``            a free port for it (not the shoal store's port)
``PYTHONUNBUFFERED``       ``1``, so output reaches shoalrun as it is printed
``SHOAL_AS``               the import switch (``--as horovod``), with ``shoal.alias``'s
                           ``boot`` directory first on ``PYTHONPATH``
=========================  ========================================================

The same values under the names other launchers use, so their user code runs unchanged:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the cross rank)
like torchrun; ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK``,
``HOROVOD_LOCAL_SIZE``, ``HOROVOD_CROSS_RANK``, ``HOROVOD_CROSS_SIZE`` like horovodrun.
shoalrun's own settings (``SHOAL_NUM_PROC``, ``SHOAL_HOSTS``, ...) are not passed on.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import alias
from ..core import config
from ..core.errors import ConfigError, ShoalError
from . import options, sagemaker
from .common import ExitCode, LaunchError, err
from .console import worker_tty_env
from .hosts import (
    WorkerSpec,
    interface_address,
    local_host_names,
    parse_hostfile,
    parse_hosts,
    plan,
    source_address,
)
from .runners import HostRunner, LocalRunner, SshRunner, make_runner
from .supervise import Launch, RendezvousWatch, supervise

__all__ = [  # noqa: RUF022 (grouped by role, not sorted)
    "LaunchError", "WorkerSpec", "Job", "RESERVED_VARS", "REMOTE_VARS", "parse_hosts",
    "parse_hostfile", "parse_forward", "local_host_names", "plan", "make_job_id",
    "worker_env", "remote_base_env", "launch", "build_parser", "main",
]

LOCAL_ADDR = "127.0.0.1"
_VARS = {  # WorkerSpec or Job attribute -> the variables that carry it
    "rank": ("SHOAL_RANK", "RANK", "HOROVOD_RANK"),
    "size": ("SHOAL_SIZE", "WORLD_SIZE", "HOROVOD_SIZE"),
    "local_rank": ("SHOAL_LOCAL_RANK", "LOCAL_RANK", "HOROVOD_LOCAL_RANK"),
    "local_size": ("SHOAL_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE"),
    "cross_rank": ("SHOAL_CROSS_RANK", "GROUP_RANK", "HOROVOD_CROSS_RANK"),
    "cross_size": ("SHOAL_CROSS_SIZE", "HOROVOD_CROSS_SIZE"),
    "job_id": ("SHOAL_JOB_ID",), "secret": ("SHOAL_SECRET",),
    "rendezvous_addr": ("SHOAL_RENDEZVOUS_ADDR",), "rendezvous_port": ("SHOAL_RENDEZVOUS_PORT",),
    "master_addr": ("MASTER_ADDR",), "master_port": ("MASTER_PORT",),
}
RESERVED_VARS = tuple(name for names in _VARS.values() for name in names)
"""Variables shoalrun always sets itself; ``-x`` may not override them."""
REMOTE_VARS = ("PATH", "PYTHONPATH", "VIRTUAL_ENV")
"""Besides ``SHOAL_*`` and ``-x``, what a remote worker inherits from shoalrun's environment."""
build_parser = options.build_parser


@dataclass(frozen=True)
class Job:
    """What every worker of one job shares."""

    job_id: str
    secret: str
    size: int
    rendezvous_addr: str
    rendezvous_port: int
    master_addr: str
    master_port: int
    start_timeout_s: float = 120.0
    emulate_hosts: bool = False
    forward: Mapping[str, str] = field(default_factory=dict)  # -x
    settings: Mapping[str, str] = field(default_factory=dict)  # knobs set by flags
    host_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # SageMaker's
    tty: Mapping[str, str] = field(default_factory=dict)  # on a terminal: SHOALRUN_TTY, COLUMNS


def parse_forward(items: Sequence[str], parent_env: Mapping[str, str]) -> dict[str, str]:
    """``-x NAME=VALUE`` sets a variable, ``-x NAME`` copies it from ``parent_env``."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not name:
            raise LaunchError(f"-x {item!r}: expected NAME or NAME=VALUE")
        if name in RESERVED_VARS:
            raise LaunchError(f"-x {name}: shoalrun sets this variable itself")
        if not sep and name not in parent_env:
            raise LaunchError(f"-x {name}: not set in shoalrun's environment (use -x NAME=VALUE)")
        out[name] = value if sep else parent_env[name]
    return out


def make_job_id(now: float | None = None, pid: int | None = None) -> str:
    """A short, file-name safe id: milliseconds since the epoch in hex, then the pid."""
    ms = int((time.time() if now is None else now) * 1000)
    return f"{ms:x}-{os.getpid() if pid is None else pid}"


def worker_env(spec: WorkerSpec, job: Job, base_env: Mapping[str, str]) -> dict[str, str]:
    """The complete environment of one worker (see the module docstring)."""
    env = {k: v for k, v in base_env.items() if k not in options.LAUNCHER_VARS}
    env.update(job.host_env.get(spec.host, {}))
    env.update(job.forward)
    env.update(job.settings)
    for attr, names in _VARS.items():
        value = getattr(spec if hasattr(spec, attr) else job, attr)
        env.update({name: str(value) for name in names})
    env[config.env_name("start_timeout_s")] = str(job.start_timeout_s)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(job.tty)
    env = alias.worker_environment(env)  # the import switch, where --as asks for it
    if job.emulate_hosts:
        env[config.env_name("hostname")] = spec.host
    return env


def remote_base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What of shoalrun's environment a remote worker gets: ``SHOAL_*`` and REMOTE_VARS."""
    return {k: v for k, v in environ.items() if k.startswith("SHOAL_") or k in REMOTE_VARS}


def _advertised_address(specs: Sequence[WorkerSpec], remote: HostRunner,
                        network_interface: str | None) -> str:
    """The address the store listens on and the workers are told (never all interfaces)."""
    if network_interface:
        return interface_address(network_interface)
    hosts = list(dict.fromkeys(s.host for s in specs if not s.local))
    if not hosts:
        return LOCAL_ADDR
    routes = {h: source_address(remote.address(h)) for h in hosts}
    if len(set(routes.values())) > 1:
        via = ", ".join(f"{h} via {a}" for h, a in routes.items())
        raise LaunchError(f"the remote hosts are reached through different addresses of this "
                          f"machine ({via}); choose one with --network-interface")
    return next(iter(routes.values()))


def launch(specs: Sequence[WorkerSpec], command: Sequence[str], *,
           forward: Mapping[str, str] | None = None, emulate_hosts: bool = False,
           start_timeout_s: float = 120.0, kill_grace: float = 5.0, verbose: bool = False,
           settings: Mapping[str, str] | None = None, remote: HostRunner | None = None,
           network_interface: str | None = None, output_dir: str | Path | None = None,
           environ: Mapping[str, str] | None = None,
           host_env: Mapping[str, Mapping[str, str]] | None = None,
           timestamps: bool = False, stop_grace: float = 30.0) -> int:
    """Run one job: start the store, the workers, wait; the job's exit code.

    ``remote`` starts the workers of hosts that are not this machine (default: ssh);
    ``host_env`` adds variables to the workers of each host (by host name); ``timestamps``
    prefixes every output line with the time.
    Raises :class:`LaunchError` before starting anything when the job cannot run.
    """
    from ..core.auth import secret_bytes
    from ..core.rendezvous import StoreServer

    env = os.environ if environ is None else environ
    remote = remote or SshRunner(grace=kill_grace, connect_timeout=start_timeout_s)
    local = LocalRunner()
    addr = _advertised_address(specs, remote, network_interface)
    out_dir = Path(output_dir) if output_dir else None
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LaunchError(f"--output-filename {out_dir}: {exc.strerror or exc}") from None
    secret, job_id = secrets.token_hex(32), make_job_id()
    store = StoreServer(secret_bytes(secret), host=addr, port=0).start()
    watch = None
    try:
        port = int(store.address[1])
        with socket.socket() as sock:  # a free port for torch.distributed's own store
            sock.bind((addr, 0))
            master_port = int(sock.getsockname()[1])
        master_addr = addr if specs[0].local else remote.address(specs[0].host)
        job = Job(job_id=job_id, secret=secret, size=len(specs), rendezvous_addr=addr,
                  rendezvous_port=port, master_addr=master_addr, master_port=master_port,
                  start_timeout_s=start_timeout_s, emulate_hosts=emulate_hosts,
                  forward=dict(forward or {}), settings=dict(settings or {}),
                  host_env=dict(host_env or {}), tty=worker_tty_env())
        bases = {True: dict(env), False: remote_base_env(env)}
        if verbose:
            err(f"job {job_id}: rendezvous {addr}:{port}, MASTER_ADDR {master_addr}:"
                f"{master_port}")
            for s in specs:
                how = "here" if s.local else f"via {remote.name}"
                err(f"  rank {s.rank} -> host {s.host} ({how}; local rank {s.local_rank}/"
                    f"{s.local_size}, cross rank {s.cross_rank}/{s.cross_size})")
        watch = RendezvousWatch(addr, port, secret_bytes(secret), len(specs))
        return supervise(Launch(
            specs, list(command), runner_of=lambda s: local if s.local else remote,
            env_of=lambda s: worker_env(s, job, bases[s.local]), cwd=os.getcwd(),
            job_id=job_id, kill_grace=kill_grace, start_timeout_s=start_timeout_s,
            watch=watch, output_dir=out_dir, timestamps=timestamps, stop_grace=stop_grace))
    finally:
        if watch is not None:
            watch.close()
        store.close()
        for path in Path("/dev/shm").glob(f"shoal-{job_id}-*"):  # left by a crash
            path.unlink(missing_ok=True)


def _sagemaker(args: object, env: Mapping[str, str]) -> sagemaker.SageMaker | None:
    wanted = getattr(args, "sagemaker", False)
    implicit = not any(getattr(args, k) for k in ("np", "hosts", "hostfile"))
    return sagemaker.load(env) if wanted or (implicit and sagemaker.detected(env)) else None


def _elastic(args: object, command: list[str], cfg: config.Config,
             env: Mapping[str, str], settings: Mapping[str, str]) -> int:
    """shoalrun's elastic mode (:mod:`shoal.runner.elastic`)."""
    from .elastic import ElasticOptions, discover, run_elastic

    a: Any = args
    hosts = parse_hosts(a.hosts) if a.hosts else parse_hostfile(a.hostfile) \
        if a.hostfile else []
    np_ = a.np or a.min_np or (sum(n for _, n in discover(a.host_discovery_script,
                                                          slots_per_host=a.slots_per_host or 1))
                               if a.host_discovery_script else sum(n for _, n in hosts))
    if not np_:
        raise LaunchError("elastic: give -np (or --min-np)")
    if not hosts and not a.host_discovery_script:
        hosts = [("localhost", max(np_, a.max_np or np_))]
    opts = ElasticOptions(np=np_, min_np=a.min_np or np_, max_np=a.max_np or max(np_, 1 << 20),
                          discovery_script=a.host_discovery_script,
                          discovery_interval_s=a.discovery_interval,
                          elastic_timeout_s=cfg.elastic_timeout_s,
                          reset_limit=a.reset_limit, blacklist_after=a.blacklist_after,
                          hosts=tuple(hosts), slots_per_host=a.slots_per_host or 1,
                          cooldown_range=tuple(a.cooldown_range) if a.cooldown_range else None,
                          timestamps=a.prefix_timestamp)
    remote = make_runner(a.host_runner, python=a.remote_python, grace=a.kill_grace,
                         ssh_port=a.ssh_port, ssh_identity_file=a.ssh_identity_file,
                         connect_timeout=cfg.start_timeout_s)
    return run_elastic(opts, command, remote=remote, environ=env,
                       start_timeout_s=cfg.start_timeout_s, kill_grace=a.kill_grace,
                       network_interface=a.network_interface, settings=settings)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shoalrun``; returns the job's exit code."""
    env = os.environ
    try:
        args, settings = options.parse(sys.argv[1:] if argv is None else argv, env)
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else ExitCode.USAGE
    except LaunchError as exc:
        err(f"error: {exc}")
        return ExitCode.USAGE
    if args.check_build:
        from .checkbuild import check_build

        return check_build()
    for var in options.unknown_variables(env):
        err(f"warning: ignoring unknown variable {var}")
    command = list(args.command)
    names = local_host_names()
    try:
        knobs = {config.env_name(k) for k in config.KNOBS}
        cfg = config.load({k: v for k, v in {**env, **settings}.items() if k in knobs})
        sm = _sagemaker(args, env)
        hosts, host_env = None, None
        if sm is not None:
            if args.hosts or args.hostfile:
                raise LaunchError("--sagemaker takes its hosts from SageMaker; drop -H/--hostfile")
            if sm.current_host != sm.master:
                err(f"SageMaker host {sm.current_host}: waiting for the workers that "
                    f"{sm.master} starts here")
                from .bootstrap import MARKER_DIR

                if sagemaker.wait_for_workers(Path(MARKER_DIR), cfg.start_timeout_s):
                    return ExitCode.OK
                err(f"no worker was started here within {cfg.start_timeout_s:g}s")
                return ExitCode.START_TIMEOUT
            hosts = [(h, sm.num_gpus) for h in sm.hosts]
            args.np = args.np or sum(n for _, n in hosts)
            args.network_interface = args.network_interface or sm.network_interface
            command += sagemaker.hyperparameter_args(sm.hyperparameters)
            host_env = {h: sagemaker.worker_environment(sm, env, h) for h in sm.hosts}
            names |= {sm.current_host}
        if not command:
            raise LaunchError("no command to run")
        if args.min_np or args.max_np or args.host_discovery_script:
            return _elastic(args, command, cfg, env, settings)
        for flag, given in (("--slots-per-host", args.slots_per_host),
                            ("--blacklist-cooldown-range", args.cooldown_range)):
            if given:
                raise LaunchError(f"{flag} applies to elastic jobs only (give --min-np, "
                                  f"--max-np or --host-discovery-script)")
        if args.hosts and args.hostfile:
            raise LaunchError("give the hosts with -H or --hostfile, not both")
        if args.hosts:
            hosts = parse_hosts(args.hosts)
        elif args.hostfile:
            hosts = parse_hostfile(args.hostfile)
        if args.np is None:
            raise LaunchError("-np N is required (the number of workers)")
        if args.kill_grace < 0 or args.stop_grace < 0:
            raise LaunchError("--kill-grace and --stop-grace must be >= 0")
        specs = plan(args.np, hosts, emulate_hosts=args.emulate_hosts, local_names=names)
        forward = parse_forward(args.forward, env)
        remote = make_runner(args.host_runner, python=args.remote_python,
                             grace=args.kill_grace, ssh_port=args.ssh_port,
                             ssh_identity_file=args.ssh_identity_file,
                             connect_timeout=cfg.start_timeout_s)
        return launch(specs, command, forward=forward, emulate_hosts=args.emulate_hosts,
                      start_timeout_s=cfg.start_timeout_s, kill_grace=args.kill_grace,
                      verbose=args.verbose, settings=settings, remote=remote,
                      network_interface=args.network_interface,
                      output_dir=args.output_filename, environ=env, host_env=host_env,
                      timestamps=args.prefix_timestamp, stop_grace=args.stop_grace)
    except (LaunchError, ConfigError) as exc:
        err(f"error: {exc}")
        return ExitCode.USAGE
    except ShoalError as exc:
        err(f"error: {exc}")
        return ExitCode.ERROR


if __name__ == "__main__":
    sys.exit(main())
