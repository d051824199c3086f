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

    @property
    def variable(self) -> str | None:
        """The ``SHOAL_*`` variable that sets this option, if any."""
        return config.env_name(self.knob) if self.knob else self.env


def _opt(flags: str, dest: str, help: str, **kw: Any) -> Option:
    return Option(tuple(flags.split()), dest, help, **kw)


OPTIONS: tuple[Option, ...] = (
    _opt("-np --num-proc", "np", "number of workers (SageMaker: one per GPU of every host)",
         parse=int, env="SHOAL_NUM_PROC", metavar="N"),
    _opt("-H --hosts", "hosts", "host:slots[,...], filled in order (default: this machine)",
         env="SHOAL_HOSTS", metavar="HOSTS"),
    _opt("--hostfile", "hostfile", "file of 'host slots=N' lines, instead of -H",
         env="SHOAL_HOSTFILE", metavar="FILE"),
    _opt("-p --ssh-port", "ssh_port", "ssh port of the remote hosts", parse=int,
         env="SHOAL_SSH_PORT", metavar="PORT"),
    _opt("-i --ssh-identity-file", "ssh_identity_file", "ssh private key for the remote hosts",
         env="SHOAL_SSH_IDENTITY_FILE", metavar="FILE"),
    _opt("--network-interface", "network_interface", "serve the rendezvous on this "
         "interface's address and advertise it (default: the address towards the remote "
         "hosts, 127.0.0.1 without them)", env="SHOAL_NETWORK_INTERFACE", metavar="IFACE"),
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
    _opt("--min-np", "min_np", "elastic: the fewest workers the job may go on with",
         parse=int, env="SHOAL_MIN_NP", metavar="N"),
    _opt("--max-np", "max_np", "elastic: the most workers the job may grow to",
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
         "longer used", parse=int, env="SHOAL_BLACKLIST_AFTER", default=2, metavar="N",
         advanced=True),
    _opt("-x", "forward", "export NAME=VALUE, or NAME with shoalrun's value, to the workers "
         "(repeatable)", env="SHOAL_EXPORT", repeat=True, metavar="NAME[=VALUE]"),
    _opt("--emulate-hosts", "emulate_hosts", "run every host on this machine as a simulated "
         "node (workers get SHOAL_HOSTNAME=<host>)", parse=None, env="SHOAL_EMULATE_HOSTS"),
    _opt("--sagemaker", "sagemaker", "take hosts, GPUs, interface and hyperparameters from "
         "SageMaker (automatic there when neither -np nor hosts are given)", parse=None,
         env="SHOAL_SAGEMAKER"),
    _opt("-v --verbose", "verbose", "print the plan and the rendezvous address first",
         parse=None, env="SHOAL_VERBOSE"),
    _opt("--check-build", "check_build", "print what this installation supports, then exit",
         parse=None),
    _opt("--kill-grace", "kill_grace", "seconds from SIGTERM to SIGKILL when stopping workers",
         parse=float, env="SHOAL_KILL_GRACE_S", default=5.0, metavar="S", advanced=True),
    _opt("--host-runner", "host_runner", "how remote hosts are reached: ssh, or netns (host "
         "names are network namespaces of this machine; for tests)", env="SHOAL_HOST_RUNNER",
         default="ssh", metavar="NAME", advanced=True),
    _opt("--remote-python", "remote_python", "interpreter that starts workers on remote hosts "
         "(default: python3 over ssh, this one in netns)", env="SHOAL_REMOTE_PYTHON",
         metavar="PATH", advanced=True),
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
        if o.parse is None:
            target.add_argument(*o.flags, dest=o.dest, action="store_true", help=text)
        else:
            target.add_argument(*o.flags, dest=o.dest, type=o.parse, metavar=o.metavar,
                                action="append" if o.repeat else "store", help=text)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    return p


def _from_variable(o: Option, raw: str) -> Any:
    try:
        if o.repeat:
            return shlex.split(raw)
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
