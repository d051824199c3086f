"""shoalrun's command line: every flag and the ``SHOAL_*`` variable that sets it, in one table.

A flag beats its variable, which beats the default. Two kinds of variables:

* launcher settings (``SHOAL_NUM_PROC``, ``SHOAL_HOSTS``, ...) are read by shoalrun only and
  never reach the workers;
* worker settings (``--start-timeout`` is ``SHOAL_START_TIMEOUT_S``, ``--timeline-filename`` is
  ``SHOAL_TIMELINE``, ...) are knobs of :mod:`shoal.core.config`: a flag sets the knob in every
  worker's environment, and the variable, set in shoalrun's environment, reaches the workers
  as it is (remote ones too).

``-x``, as a variable, is ``SHOAL_EXPORT="NAME=VALUE NAME2"`` (split like a shell would).
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ..core import config
from .common import LaunchError

__all__ = ["LAUNCHER_VARS", "OPTIONS", "Option", "build_parser", "describe", "parse",
           "unknown_variables"]


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected 1/0, true/false, got {text!r}")


def _mb_to_bytes(mb: float) -> str:
    return str(int(mb * (1 << 20)))


_HOROVOD_LOG_LEVELS = {"TRACE": "DEBUG", "DEBUG": "DEBUG", "INFO": "INFO",
                       "WARNING": "WARNING", "ERROR": "ERROR", "FATAL": "CRITICAL"}


def _log_level(text: str) -> str:
    level = _HOROVOD_LOG_LEVELS.get(text.strip().upper())
    if level is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of "
                                         f"{', '.join(_HOROVOD_LOG_LEVELS)}")
    return level


def _one_interface(text: str) -> str:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if len(names) != 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: shoal serves and advertises the address of one interface; name one "
            f"(the workers' TCP connections follow the routes to their peers)")
    return names[0]


def _switch_to(value: str) -> Callable[[Any], str]:
    """``to_knob`` of a switch that sets its knob to ``value``."""
    return lambda _given: value


def _import_switch(text: str) -> str:
    from shoal.alias import parse_kinds
    try:
        return ",".join(parse_kinds(text))
    except ValueError as exc:
        raise LaunchError(f"--as {text}: {exc}") from None


@dataclass(frozen=True)
class Option:
    """One flag of shoalrun: its spellings, where its value goes, and its variable."""

    flags: tuple[str, ...]
    dest: str
    help: str
    parse: Callable[[str], Any] | None = str  # None: a switch, present or not
    env: str | None = None  # the launcher variable; None for knobs (see ``knob``) and actions
    knob: str | None = None  # a worker knob of shoal.core.config that the flag sets
    to_knob: Callable[[Any], str] = str  # flag value -> the knob variable's text
    metavar: str | None = None
    default: Any = None
    repeat: bool = False  # may be given several times (-x)
    advanced: bool = False  # listed under "advanced" in --help
    nargs: int | None = None  # values taken at once (--blacklist-cooldown-range MIN MAX)
    #: horovodrun's flags shoal takes without acting, because what they ask for is already so
    noop: str | None = None
    #: horovodrun's flags shoal refuses: why, said when one is given
    refuse: str | None = None

    @property
    def variable(self) -> str | None:
        """The ``SHOAL_*`` variable that sets this option, if any."""
        return config.env_name(self.knob) if self.knob else self.env


def _opt(flags: str, dest: str, help: str, **kw: Any) -> Option:
    return Option(tuple(flags.split()), dest, help, **kw)


_NO_AUTOTUNE = ("shoal has no autotuner: set --fusion-threshold-mb and --cycle-time-ms "
                "(shoal bench measures them)")
_NO_MPI = ("shoal starts no MPI job; run the script under mpirun yourself (shoal reads Open "
           "MPI's and MPICH's environment) or under shoalrun without MPI")

#: horovodrun's flags (Horovod 0.28.1) that shoal's own set above does not cover: each sets a
#: knob, is taken because what it asks for is so already (``noop``), or is refused (``refuse``)
_HOROVODRUN: tuple[Option, ...] = (
    _opt("--disable-cache", "disable_cache", "horovodrun's cache of host checks", parse=None,
         noop="shoalrun caches no host checks", advanced=True),
    _opt("--config-file", "config_file", "horovodrun's YAML parameter file", advanced=True,
         refuse="shoalrun takes its settings from flags and SHOAL_* variables (shoalrun "
                "--help lists them); give them there", metavar="FILE"),
    _opt("--cache-capacity", "cache_capacity", "collective names the engine remembers "
         "(Horovod's response cache)", parse=int, knob="name_cache_size", metavar="N",
         advanced=True),
    _opt("--hierarchical-allreduce", "hierarchical_allreduce", "allreduce hierarchically "
         "across hosts", parse=None, advanced=True,
         noop="shoal's automatic choice already takes the hierarchical allreduce wherever "
              "it applies (several hosts with equal numbers of workers)"),
    _opt("--no-hierarchical-allreduce", "no_hierarchical_allreduce", "never the "
         "hierarchical allreduce: shared memory on one host, one ring across hosts",
         parse=None, knob="allreduce_algorithm", to_knob=_switch_to("flat"), advanced=True),
    _opt("--hierarchical-allgather", "hierarchical_allgather", "Horovod's hierarchical "
         "allgather", parse=None, advanced=True,
         refuse="shoal's allgather has one algorithm per topology (shared memory on a host, "
                "a ring across hosts)"),
    _opt("--no-hierarchical-allgather", "no_hierarchical_allgather", "a flat allgather",
         parse=None, noop="shoal's allgather is never hierarchical", advanced=True),
    _opt("--torus-allreduce", "torus_allreduce", "Horovod's torus allreduce", parse=None,
         refuse="shoal has no torus allreduce; its hierarchical one (chosen automatically "
                "across hosts) has the same shape", advanced=True),
    _opt("--no-torus-allreduce", "no_torus_allreduce", "no torus allreduce", parse=None,
         noop="shoal has no torus allreduce", advanced=True),
    _opt("--autotune", "autotune", "Horovod's autotuner", parse=None, refuse=_NO_AUTOTUNE,
         advanced=True),
    _opt("--no-autotune", "no_autotune", "no autotuning", parse=None,
         noop="shoal does not autotune", advanced=True),
    *(_opt(flag, flag[2:].replace("-", "_"), "Horovod's autotuner", advanced=True,
           refuse=_NO_AUTOTUNE, metavar="VALUE")
      for flag in ("--autotune-log-file", "--autotune-warmup-samples",
                   "--autotune-steps-per-sample", "--autotune-bayes-opt-max-samples",
                   "--autotune-gaussian-process-noise")),
    _opt("--timeline-mark-cycles", "timeline_mark_cycles", "mark engine cycles on the "
         "timeline", parse=None, advanced=True,
         refuse="shoal's timeline has no cycle marks: each collective's phases are on it"),
    _opt("--no-timeline-mark-cycles", "no_timeline_mark_cycles", "no cycle marks",
         parse=None, noop="shoal's timeline has no cycle marks", advanced=True),
    _opt("--no-stall-check", "no_stall_check", "no warnings of tensors waiting for other "
         "ranks (nor the mismatch errors they lead to)", parse=None, knob="stall_warning_s",
         to_knob=_switch_to("inf"), advanced=True),
    _opt("--stall-check", "stall_check", "warn of tensors waiting for other ranks",
         parse=None, noop="shoal checks for stalls unless told not to", advanced=True),
    _opt("--stall-check-warning-time-seconds", "stall_warning_s", "warn when a tensor waited "
         "this long for other ranks", parse=float, knob="stall_warning_s", metavar="S",
         advanced=True),
    _opt("--stall-check-shutdown-time-seconds", "stall_shutdown_s", "fail a tensor that "
         "waited this long for other ranks", parse=float, knob="stall_shutdown_s",
         metavar="S", advanced=True),
    _opt("--mpi-threads-disable", "mpi_threads_disable", "MPI without threads", parse=None,
         noop="shoal uses no MPI", advanced=True),
    _opt("--no-mpi-threads-disable", "no_mpi_threads_disable", "MPI with threads",
         parse=None, noop="shoal uses no MPI", advanced=True),
    _opt("--mpi-args", "mpi_args", "extra mpirun arguments", refuse=_NO_MPI, metavar="ARGS",
         advanced=True),
    _opt("--binding-args", "binding_args", "mpirun's binding arguments", metavar="ARGS",
         refuse="shoalrun binds workers itself: use --bind-to", advanced=True),
    _opt("--mpi", "use_mpi", "run with mpirun", parse=None, refuse=_NO_MPI, advanced=True),
    _opt("--jsrun", "use_jsrun", "run with LSF's jsrun", parse=None, advanced=True,
         refuse="shoalrun starts workers over ssh; under LSF, start them with jsrun and "
                "python -m shoal.as (shoal reads jsrun's MPI environment)"),
    _opt("--gloo", "use_gloo", "run without MPI", parse=None,
         noop="shoal always runs without MPI, as horovodrun --gloo does", advanced=True),
    _opt("--tcp", "tcp", "TCP between all workers, shared memory off", parse=None,
         knob="shm_enable", to_knob=_switch_to("0"), advanced=True),
    _opt("--num-nccl-streams", "num_nccl_streams", "Horovod's NCCL streams", metavar="N",
         refuse="shoal's device path runs its NCCL work on torch's process group, one "
                "stream per group", advanced=True),
    _opt("--thread-affinity", "thread_affinity", "Horovod's background thread affinity",
         metavar="CORES", refuse="shoalrun binds whole workers to cores: use --bind-to",
         advanced=True),
    _opt("--gloo-timeout-seconds", "gloo_timeout_s", "hard limit on any wait inside a "
         "collective", parse=float, knob="timeout_s", metavar="S", advanced=True),
    _opt("--log-level", "log_level", "level of shoal's log lines: TRACE (= DEBUG), DEBUG, "
         "INFO, WARNING, ERROR, FATAL", parse=_log_level, knob="log_level", metavar="LEVEL",
         advanced=True),
    _opt("--log-with-timestamp --no-log-hide-timestamp", "log_with_timestamp", "shoal's log "
         "lines carry the time", parse=None, knob="log_timestamps", to_knob=_switch_to("1"),
         advanced=True),
    _opt("--log-without-timestamp --log-hide-timestamp", "log_hide_timestamp", "shoal's "
         "log lines carry no time (the default)", parse=None, knob="log_timestamps",
         to_knob=_switch_to("0"), advanced=True),
    _opt("-prefix-timestamp --prefix-output-with-timestamp", "prefix_timestamp", "prefix "
         "every output line of the workers with the time", parse=None,
         env="SHOAL_PREFIX_TIMESTAMP"),
)

OPTIONS: tuple[Option, ...] = (
    _opt("-np --num-proc", "np", "number of workers (SageMaker: one per GPU of every host)",
         parse=int, env="SHOAL_NUM_PROC", metavar="N"),
    _opt("-H --hosts", "hosts", "host:slots[,...], filled in order (default: this machine)",
         env="SHOAL_HOSTS", metavar="HOSTS"),
    _opt("-hostfile --hostfile", "hostfile", "file of 'host slots=N' lines, instead of -H",
         env="SHOAL_HOSTFILE", metavar="FILE"),
    _opt("-p --ssh-port", "ssh_port", "ssh port of the remote hosts", parse=int,
         env="SHOAL_SSH_PORT", metavar="PORT"),
    _opt("-i --ssh-identity-file", "ssh_identity_file", "ssh private key for the remote hosts",
         env="SHOAL_SSH_IDENTITY_FILE", metavar="FILE"),
    _opt("--network-interface --network-interfaces", "network_interface", "serve the "
         "rendezvous on this interface's address and advertise it (default: the address "
         "towards the remote hosts, 127.0.0.1 without them)", parse=_one_interface,
         env="SHOAL_NETWORK_INTERFACE", metavar="IFACE"),
    _opt("--start-timeout", "start_timeout", "seconds for all ranks to join the rendezvous; "
         "ranks missing then end the job", parse=float, knob="start_timeout_s", metavar="S"),
    _opt("--output-filename", "output_filename", "also write each rank's output to "
         "DIR/rank.<rank>.log", env="SHOAL_OUTPUT_FILENAME", metavar="DIR"),
    _opt("--timeline-filename", "timeline_filename", "write a Chrome-trace timeline there",
         knob="timeline", metavar="FILE"),
    _opt("--fusion-threshold-mb", "fusion_threshold_mb", "fusion buffer size in MiB",
         parse=float, knob="fusion_threshold", to_knob=_mb_to_bytes, metavar="MB"),
    _opt("--cycle-time-ms", "cycle_time_ms", "how long the engine waits for tensors to fuse",
         parse=float, knob="cycle_time_ms", metavar="MS"),
    _opt("--bind-to", "bind_to", "bind each worker to its share of the host's cores: auto "
         "(default; not when workers outnumber cores), core, none", knob="cpu_bind",
         metavar="MODE"),
    _opt("--min-np --min-num-proc", "min_np", "elastic: the fewest workers the job may go on with",
         parse=int, env="SHOAL_MIN_NP", metavar="N"),
    _opt("--max-np --max-num-proc", "max_np", "elastic: the most workers the job may grow to",
         parse=int, env="SHOAL_MAX_NP", metavar="N"),
    _opt("--host-discovery-script", "host_discovery_script", "elastic: a script printing "
         "host:slots lines, re-run to find hosts that came or went",
         env="SHOAL_HOST_DISCOVERY_SCRIPT", metavar="FILE"),
    _opt("--elastic-timeout", "elastic_timeout", "elastic: seconds to wait for --min-np "
         "workers (and a worker for its world) before failing", parse=float,
         knob="elastic_timeout_s", metavar="S"),
    _opt("--reset-limit", "reset_limit", "elastic: fail after this many resets",
         parse=int, env="SHOAL_RESET_LIMIT", metavar="N"),
    _opt("--discovery-interval", "discovery_interval", "elastic: seconds between runs of the "
         "discovery script", parse=float, env="SHOAL_DISCOVERY_INTERVAL_S", default=1.0,
         metavar="S", advanced=True),
    _opt("--blacklist-after", "blacklist_after", "elastic: failures after which a host is no "
         "longer used (default 1, horovodrun's: its other workers stop at once; above 1 only "
         "the failed slot is dropped until then)", parse=int, env="SHOAL_BLACKLIST_AFTER",
         default=1, metavar="N", advanced=True),
    _opt("--blacklist-cooldown-range", "cooldown_range", "elastic: a blacklisted host may be "
         "used again after a cool-down of MIN..MAX seconds (growing with each blacklisting; "
         "default: never)", parse=int, nargs=2, env="SHOAL_BLACKLIST_COOLDOWN_RANGE",
         metavar="S", advanced=True),
    _opt("--slots-per-host", "slots_per_host", "elastic: slots of a discovered host whose "
         "line gives none (default 1)", parse=int, env="SHOAL_SLOTS_PER_HOST", metavar="N"),
    _opt("-x", "forward", "export NAME=VALUE, or NAME with shoalrun's value, to the workers "
         "(repeatable)", env="SHOAL_EXPORT", repeat=True, metavar="NAME[=VALUE]"),
    _opt("--emulate-hosts", "emulate_hosts", "run every host on this machine as a simulated "
         "node (workers get SHOAL_HOSTNAME=<host>)", parse=None, env="SHOAL_EMULATE_HOSTS"),
    _opt("--sagemaker", "sagemaker", "take hosts, GPUs, interface and hyperparameters from "
         "SageMaker (automatic there when neither -np nor hosts are given)", parse=None,
         env="SHOAL_SAGEMAKER"),
    _opt("--verbose", "verbose", "print the plan and the rendezvous address first",
         parse=None, env="SHOAL_VERBOSE"),
    _opt("--as", "import_as", "run a Horovod (horovod) or SMDDP (smddp) script unchanged: "
         "their imports resolve to shoal's modules in every worker", knob="as",
         to_knob=_import_switch, metavar="KIND[,KIND]"),
    _opt("-cb --check-build", "check_build", "print what this installation supports, then exit",
         parse=None),
    _opt("--kill-grace", "kill_grace", "seconds from SIGTERM to SIGKILL when stopping workers "
         "after a failure", parse=float, env="SHOAL_KILL_GRACE_S", default=5.0, metavar="S",
         advanced=True),
    _opt("--stop-grace", "stop_grace", "seconds from SIGTERM to SIGKILL when shoalrun itself "
         "is told to stop (SIGTERM): time for the workers to checkpoint", parse=float,
         env="SHOAL_STOP_GRACE_S", default=30.0, metavar="S", advanced=True),
    _opt("--host-runner", "host_runner", "how remote hosts are reached: ssh, or netns (host "
         "names are network namespaces of this machine; for tests)", env="SHOAL_HOST_RUNNER",
         default="ssh", metavar="NAME", advanced=True),
    _opt("--remote-python", "remote_python", "interpreter that starts workers on remote hosts "
         "(default: python3 over ssh, this one in netns)", env="SHOAL_REMOTE_PYTHON",
         metavar="PATH", advanced=True),
    *_HOROVODRUN,
)

LAUNCHER_VARS = frozenset(o.env for o in OPTIONS if o.env)
"""Variables only shoalrun reads; they are removed from the workers' environment."""


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one :class:`LaunchError`, not usage + exit."""

    def error(self, message: str) -> NoReturn:
        raise LaunchError(f"{message} (see shoalrun --help)")


def build_parser() -> argparse.ArgumentParser:
    """The ``shoalrun`` command line, built from :data:`OPTIONS`."""
    p = _Parser(prog="shoalrun", allow_abbrev=False,
                usage="shoalrun -np N [-H host:slots,... | --hostfile FILE] [options] "
                      "command [args...]",
                description="Start N workers of a shoal job. Every option can also be set by "
                            "the variable shown (a flag wins). Worker environment: pydoc "
                            "shoal.runner.launch.")
    advanced = p.add_argument_group("advanced")
    for o in OPTIONS:
        target = advanced if o.advanced else p
        text = f"{o.help} [${o.variable}]" if o.variable else o.help
        if o.refuse:
            text = f"{text} (refused: {o.refuse})"
        elif o.noop:
            text = f"{text} (taken; nothing to do: {o.noop})"
        if o.parse is None:
            target.add_argument(*o.flags, dest=o.dest, action="store_true", help=text)
        else:
            target.add_argument(*o.flags, dest=o.dest, type=o.parse, metavar=o.metavar,
                                action="append" if o.repeat else "store", help=text,
                                nargs=o.nargs)
    p.add_argument("-v", "--version", action="version", version=f"shoalrun {_version()}")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("shoal")
    except PackageNotFoundError:  # run from a source tree
        return "(not installed)"


def _from_variable(o: Option, raw: str) -> Any:
    try:
        if o.repeat:
            return shlex.split(raw)
        if o.nargs:
            values = [(o.parse or str)(v) for v in shlex.split(raw)]
            if len(values) != o.nargs:
                raise ValueError(f"expected {o.nargs} values")
            return values
        return (_bool if o.parse is None else o.parse)(raw)
    except ValueError as exc:
        raise LaunchError(f"{o.variable}={raw!r} is not valid for {o.flags[-1]}: {exc}") \
            from None


def _unknown_flag(flag: str) -> LaunchError:
    known = [f for o in OPTIONS for f in o.flags] + ["--help"]
    close = difflib.get_close_matches(flag.split("=", 1)[0], known, n=1, cutoff=0.7)
    hint = f"; did you mean {close[0]}?" if close else ""
    return LaunchError(f"unknown option {flag}{hint} (shoalrun's options go before the "
                       "command; see shoalrun --help)")


def parse(argv: Sequence[str], environ: Mapping[str, str] | None = None
          ) -> tuple[argparse.Namespace, dict[str, str]]:
    """Parse a command line; returns the options and the knob variables for the workers.

    Options not given on the command line take their ``SHOAL_*`` variable from ``environ``
    (default ``os.environ``). Raises :class:`LaunchError` on an unknown flag or a bad value.
    ``--help`` raises ``SystemExit(0)`` after printing.
    """
    env = os.environ if environ is None else environ
    args, unknown = build_parser().parse_known_args(list(argv))
    if unknown:
        raise _unknown_flag(unknown[0])
    settings: dict[str, str] = {}
    for o in OPTIONS:
        value = getattr(args, o.dest)
        given = value not in (None, False)
        if given and o.refuse:
            raise LaunchError(f"{o.flags[-1]} is not supported: {o.refuse}")
        if o.knob:
            if given:
                text = o.to_knob(value)
                try:
                    config.KNOBS[o.knob].parse(text)
                except ValueError as exc:
                    raise LaunchError(f"{o.flags[-1]} {value}: {exc}") from None
                settings[config.env_name(o.knob)] = text
        elif not given and o.env and env.get(o.env, "").strip():
            setattr(args, o.dest, _from_variable(o, env[o.env]))
        elif value is None:
            setattr(args, o.dest, [] if o.repeat else o.default)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    return args, settings


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """``SHOAL_*`` variables that are neither a knob nor a shoalrun setting, with a hint."""
    known = LAUNCHER_VARS | {config.env_name(k) for k in config.KNOBS}
    out = []
    for var in sorted(v for v in environ if v.startswith("SHOAL_") and v not in known):
        close = difflib.get_close_matches(var, known, n=1)
        out.append(f"{var} (did you mean {close[0]}?)" if close else var)
    return out


def describe() -> str:
    """The flag/variable table as text (for the README and docs)."""
    rows = [(", ".join(o.flags), o.variable or "-") for o in OPTIONS]
    width = max(len(f) for f, _ in rows)
    return "\n".join(f"{f:{width}}  {v}" for f, v in rows)
