"""Every knob of shoal in one typed registry.

Each knob has a ``SHOAL_<NAME>`` environment variable and an in-process override for tests::

    with shoal.core.config.override(timeout_s=2.0):
        ...

Nothing here reads the environment at import time: :func:`load` takes a snapshot when it is
called (``shoal.init()`` calls it once). Unknown ``SHOAL_*`` variables are reported with the
closest known name, because a typo in a tuning variable otherwise silently does nothing.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .runtime import RUNTIME

__all__ = ["KNOBS", "Config", "Knob", "describe", "env_name", "load", "override",
           "parse_bytes"]

log = logging.getLogger("shoal.config")


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


def _cpu_bind(text: str) -> str:
    value = text.strip().lower()
    if value not in ("auto", "core", "none"):
        raise ValueError(f"{text!r} is not one of auto, core, none")
    return value


def _streams(text: str) -> int:
    value = text.strip().lower()
    if value in ("auto", "0", ""):
        return 0
    count = int(value)
    if count < 1:
        raise ValueError(f"{text!r}: use auto or a count of at least 1")
    return count


def _auto_bytes(text: str) -> int:
    return 0 if text.strip().lower() in ("auto", "") else parse_bytes(text)


def parse_bytes(text: str) -> int:
    """Parse ``64MiB``, ``4k``, ``1048576``: binary units, case-insensitive."""
    units = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
             "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
    low = text.strip().lower()
    num = low.rstrip("kmgib")
    unit = low[len(num):]
    if unit not in units:
        raise ValueError(f"unknown size unit {unit!r} in {text!r}")
    return int(float(num) * units[unit])


@dataclass(frozen=True)
class Knob:
    """One setting: its name, parser, default and what it does."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    #: Horovod's variable for the same setting, read when ``SHOAL_<NAME>`` is unset
    horovod: str | None = None


def _knobs(*items: Knob) -> dict[str, Knob]:
    return {k.name: k for k in items}


KNOBS: dict[str, Knob] = _knobs(
    # identity and launch (set by shoalrun; read by topology when no other launcher is found)
    Knob("rank", int, None, "global rank of this process"),
    Knob("size", int, None, "number of processes in the job"),
    Knob("local_rank", int, None, "rank among the processes on this host"),
    Knob("local_size", int, None, "number of processes on this host"),
    Knob("cross_rank", int, None, "index of this host among the job's hosts"),
    Knob("cross_size", int, None, "number of hosts in the job"),
    Knob("hostname", str, None, "host identity; processes with equal values share memory "
         "(override it to split one machine into simulated nodes)"),
    Knob("job_id", str, None, "job identifier, names shared-memory segments"),
    Knob("as", str, None, "the import switch: horovod and/or smddp (comma-separated) resolve "
         "Horovod's or SMDDP's imports to shoal's modules (shoalrun --as; shoal.alias)"),
    Knob("secret", str, None, "job secret every connection must prove (hex); shoalrun sets it"),
    Knob("secret_file", str, None, "a file holding the job secret (a mounted Kubernetes or "
         "SageMaker secret), read when SHOAL_SECRET is unset: it stays out of the environment"),
    Knob("rendezvous_addr", str, None, "address of the rendezvous store"),
    Knob("rendezvous_port", int, None, "port of the rendezvous store"),
    Knob("bind_addr", str, None, "address the data and store ports listen on "
         "(default: the address peers were told to use, never all interfaces)"),
    # time limits
    Knob("timeout_s", float, 0.0, "hard limit on any wait inside a collective, even for a live "
         "peer (0: none; a dead, frozen or unreachable peer is found by heartbeats)"),
    Knob("heartbeat_interval_s", float, 1.0, "how often every rank tells its peers it is alive"),
    Knob("elastic_id", str, None, "this worker's id (host:slot) in an elastic job; set by "
         "shoalrun's elastic mode"),
    Knob("cpu_slot", str, None, "an elastic worker's slot of its host's slots (s/S), whose "
         "share of the cores it is bound to; set by shoalrun's elastic mode"),
    Knob("run_func_addr", str, None, "where a shoal.run (horovod.run) rank fetches its "
         "function and leaves its result (host:port); set by shoal.run"),
    Knob("run_func_secret", str, None, "the secret of that store (hex); set by shoal.run"),
    Knob("elastic_timeout_s", float, 600.0, "elastic job: the longest wait for a world that "
         "names this worker, and for enough workers (--elastic-timeout)"),
    Knob("heartbeat", str, "auto", "how heartbeats travel: auto (UDP, probed at start; TCP "
         "where UDP does not pass, said once) | udp | tcp"),
    Knob("p2p_held_bytes", parse_bytes, 256 << 20, "point-to-point: bytes of messages that "
         "arrived before their receive held at once; past it a sender waits"),
    Knob("heartbeat_timeout_s", float, 10.0, "a peer silent this long is lost (killed, frozen "
         "or unreachable); a live, busy peer is waited for"),
    Knob("start_timeout_s", float, 120.0, "longest wait for every rank to join the rendezvous"),
    # transports and algorithms
    Knob("allreduce_algorithm", str, "auto", "auto | shm | ring | hierarchical | flat (never "
         "hierarchical: shm on one host, else ring)"),
    Knob("shm_chunk_bytes", _auto_bytes, 0, "pipeline chunk of the shared-memory path: auto "
         "(0: 1 MiB; across hosts over several TCP streams, grown until each stream carries "
         "512 KiB per ring step, at most 32 MiB) or a size"),
    Knob("shm_enable", _parse_bool, True, "use shared memory between ranks on one host"),
    Knob("tcp_buffer_bytes", parse_bytes, 4 << 20, "socket send/receive buffer size"),
    Knob("tcp_chunk_bytes", parse_bytes, 4 << 20, "pipeline chunk of the TCP ring"),
    Knob("tcp_streams", _streams, 0, "TCP connections to each peer on another host: auto "
         "(0: 4, fewer for small fusion buffers or many peers) or a count; messages of two "
         "stripes or more are striped over them (clouds cap each flow below the NIC)"),
    Knob("tcp_stripe_bytes", parse_bytes, 64 << 10, "smallest piece of a message striped over "
         "several TCP streams; shorter messages travel on one"),
    Knob("small_message_bytes", parse_bytes, 64 << 10, "across hosts, messages up to this "
         "size use recursive doubling (log2 n latencies) instead of the ring (2(n-1)), and "
         "synchronous allreduces up to it (a 2 x local ranks share of it) take one round"),
    Knob("one_round_bytes", _auto_bytes, 0, "on one host, a synchronous allreduce of a name "
         "seen before carries its data in the negotiation round and every rank reduces it "
         "whole: one synchronisation instead of three; up to this size (auto, 0: one "
         "shared-memory chunk, 1 MiB) or a size"),
    # engine (fusion, timeline)
    Knob("fusion_threshold", parse_bytes, 64 << 20, "fusion buffer size in bytes",
         horovod="HOROVOD_FUSION_THRESHOLD"),
    Knob("bucket_bytes", parse_bytes, 0, "gradient bucket of the framework optimizers "
         "(DistributedOptimizer): one reduction per bucket, submitted when it is full; 0: "
         "2 MiB, or one fusion buffer when CPU workers already use every core"),
    Knob("cycle_time_ms", float, 1.0, "how long the engine waits for more tensors to fuse",
         horovod="HOROVOD_CYCLE_TIME"),
    Knob("cpu_bind", _cpu_bind, "auto", "shoalrun binds each worker to its share of the "
         "cores: auto (when they do not outnumber the cores), core (round robin even then) "
         "or none"),
    Knob("stall_warning_s", float, 60.0, "warn when a tensor waits this long for other ranks; "
         "ranks that all wait this long on collectives that cannot match get "
         "CollectiveMismatchError"),
    Knob("name_cache_size", int, 4096, "collective names the engine remembers (least recently "
         "used ones are forgotten, by every rank alike)"),
    Knob("stall_shutdown_s", float, 0.0, "fail a stalled tensor after this long (0: never)"),
    Knob("device_stage_cpu", _parse_bool, False, "stage CPU tensors through the torch "
         "device stage's host stand-in as CUDA tensors are (separate host buffers, copies "
         "deferred to the engine thread): gpu-check.sh --dry-run walks the GPU path with it"),
    Knob("device_group", str, "auto", "auto | on | off: the intra-node device path (reduce-scatter "
         "over torch's NCCL among a host's GPUs, the shards reduced across hosts on the CPUs, "
         "then an NCCL allgather); auto takes it where each local rank has a GPU of its own"),
    Knob("device_group_backend", str, "nccl", "torch backend of that intra-node group (gloo "
         "stands in for NCCL on CPU machines)"),
    Knob("timeline", str, None, "write a Chrome-trace timeline to this path",
         horovod="HOROVOD_TIMELINE"),
    Knob("timeline_mark_cycles", _parse_bool, False, "mark each round that runs collectives "
         "on the timeline (CYCLE_START)", horovod="HOROVOD_TIMELINE_MARK_CYCLES"),
    Knob("log_level", str, "WARNING", "logging level of the shoal loggers"),
    Knob("log_timestamps", _parse_bool, False, "shoal's log lines carry the time (they go to "
         "stderr through a handler of their own then)"),
)


def env_name(knob: str) -> str:
    """``timeout_s`` -> ``SHOAL_TIMEOUT_S``."""
    return "SHOAL_" + knob.upper()


_ENV_TO_KNOB = {env_name(k): k for k in KNOBS}


@dataclass(frozen=True)
class Config:
    """An immutable snapshot of every knob; attribute access by knob name."""

    values: Mapping[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(f"no shoal setting named {name!r}") from None

    def replace(self, **changes: Any) -> Config:
        """A copy with some knobs changed (names are checked)."""
        _check_names(changes)
        return Config({**self.values, **changes})


def _check_names(names: Mapping[str, Any]) -> None:
    for name in names:
        if name not in KNOBS:
            close = difflib.get_close_matches(name, KNOBS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown shoal setting {name!r}{hint}")


def _read_secret(path: str) -> str:
    """The job secret in ``path`` (surrounding whitespace dropped)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except OSError as exc:
        raise ConfigError(f"SHOAL_SECRET_FILE={path!r} cannot be read: {exc}") from None
    if not text:
        raise ConfigError(f"SHOAL_SECRET_FILE={path!r} is empty; put the job secret in it")
    return text


def load(environ: Mapping[str, str] | None = None, **explicit: Any) -> Config:
    """Snapshot the configuration: explicit arguments > overrides > ``SHOAL_*`` > Horovod's
    variable for the knob (``HOROVOD_TIMELINE``...) > defaults."""
    env = os.environ if environ is None else environ
    _check_names(explicit)
    values: dict[str, Any] = {}
    for name, knob in KNOBS.items():
        var = env_name(name)
        raw = env.get(var)
        if (raw is None or raw == "") and knob.horovod:
            var, raw = knob.horovod, env.get(knob.horovod)
        value = knob.default
        if raw is not None and raw != "":
            try:
                value = knob.parse(raw)
            except ValueError as exc:
                raise ConfigError(f"{var}={raw!r} is not valid: {exc}") from None
        values[name] = value
    values.update(RUNTIME.overrides)
    values.update({k: v for k, v in explicit.items() if v is not None})
    if not values.get("secret") and values.get("secret_file"):
        values["secret"] = _read_secret(values["secret_file"])
    for var in env:
        if var.startswith("SHOAL_") and var not in _ENV_TO_KNOB:
            close = difflib.get_close_matches(var, _ENV_TO_KNOB, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            log.warning("ignoring unknown environment variable %s%s", var, hint)
    return Config(values)


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Temporarily override knobs in this process (for tests)."""
    _check_names(values)
    saved = dict(RUNTIME.overrides)
    RUNTIME.overrides.update(values)
    try:
        yield
    finally:
        RUNTIME.overrides.clear()
        RUNTIME.overrides.update(saved)


def describe() -> str:
    """A table of every knob, its variable, default and meaning (for docs and --help)."""
    rows = [f"{env_name(k.name):32} {k.default!s:>10}  {k.doc}" for k in KNOBS.values()]
    return "\n".join(rows)
