"""Which launcher started this process, and what it says about the job's shape.

:func:`detect` looks at explicit ``shoal.init()`` arguments, then at the variables of shoalrun,
torchrun, Open MPI, MPICH/PMI, SLURM and SageMaker (first one present wins) and returns a
validated :class:`LaunchInfo`. Nothing is read at import time: every function takes the
environment as an argument. After the rendezvous, :meth:`World.from_hostnames` derives the
node layout from the host names all ranks reported, and :func:`check_consistent` compares it
with what the launcher claimed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, partial
from itertools import product
from pathlib import Path
from types import MappingProxyType
from typing import NamedTuple, TypeVar

from . import config
from .config import Config
from .errors import TopologyError

__all__ = ["DEFAULT_PORT", "SAGEMAKER_RESOURCE_CONFIG", "LaunchInfo", "World",
           "check_consistent", "detect", "expand_hostlist", "parse_tasks_per_node"]

DEFAULT_PORT = 29400
SAGEMAKER_RESOURCE_CONFIG = Path("/opt/ml/input/config/resourceconfig.json")

_FIELDS = ("rank", "size", "local_rank", "local_size", "cross_rank", "cross_size")
_FIX_ADDR = "set SHOAL_RENDEZVOUS_ADDR (or MASTER_ADDR) to the host of rank 0"
_ADDR_HINTS = {  # how to fix a missing rendezvous address, per launcher
    "explicit": "pass rendezvous_addr= to shoal.init() or set SHOAL_RENDEZVOUS_ADDR",
    "torchrun": "set MASTER_ADDR (torchrun normally does) or SHOAL_RENDEZVOUS_ADDR",
    "openmpi": "pass -x MASTER_ADDR=<host of rank 0> to mpirun (or -x SHOAL_RENDEZVOUS_ADDR)",
    "mpich": "pass -genv MASTER_ADDR <host of rank 0> to mpiexec (or SHOAL_RENDEZVOUS_ADDR)",
}
_T = TypeVar("_T")


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher says about this process; ``None`` where the launcher does not say."""

    launcher: str
    rank: int
    size: int
    local_rank: int | None
    local_size: int | None
    cross_rank: int | None
    cross_size: int | None
    hostname: str
    rendezvous_addr: str
    rendezvous_port: int
    job_id: str
    secret: str
    secret_is_derived: bool
    #: where each topology value came from (variable names), for error messages
    origins: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)


def _get(env: Mapping[str, str], var: str) -> str | None:
    """The stripped value of ``var``, or None when it is unset or empty."""
    return env.get(var, "").strip() or None


def _env_int(env: Mapping[str, str], var: str) -> int | None:
    if (raw := _get(env, var)) is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise TopologyError(f"{var}={raw!r} is not an integer; fix or unset it") from None


def _expand_ranges(body: str) -> list[str]:
    """``01-03,07`` -> ``01 02 03 07`` (the width of the lower bound is kept)."""
    out: list[str] = []
    for piece in body.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", piece)
        if not match:
            raise ValueError(f"bad range {piece!r}")
        lo, hi = int(match[1]), int(match[2] or match[1])
        if hi < lo:
            raise ValueError(f"range {piece!r} runs backwards")
        out += [str(i).zfill(len(match[1])) for i in range(lo, hi + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list: ``node[01-02],gpu5`` -> ``['node01', 'node02', 'gpu5']``.

    Several bracket groups in one name expand as a product (``r[1-2]-n[3-4]`` gives four
    names, the last group varying fastest). Raises :class:`ValueError` when malformed.
    """
    hosts: list[str] = []
    for item in re.split(r",(?![^\[]*\])", text.strip()):  # commas outside [...]
        if not item:
            raise ValueError("empty host name")
        choices: list[list[str]] = []
        for part in re.split(r"(\[[^\[\]]*\])", item):
            if part.startswith("["):
                choices.append(_expand_ranges(part[1:-1]))
            elif "[" in part or "]" in part:
                raise ValueError(f"nested or unbalanced brackets in {item!r}")
            elif part:
                choices.append([part])
        hosts += ["".join(combo) for combo in product(*choices)]
    return hosts


def parse_tasks_per_node(text: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE``: ``2(x3),1`` -> ``[2, 2, 2, 1]``; ValueError if bad."""
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", item)
        if not match or int(match[1]) < 1 or int(match[2] or 1) < 1:
            raise ValueError(f"cannot parse {item!r} (expected N or N(xM), N, M >= 1)")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _sanitize(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


@dataclass
class _Claim:
    """What one launcher says, before validation."""

    launcher: str
    values: dict[str, int | None]
    names: dict[str, str]  # field -> where it came from (for messages)
    default_addr: Callable[[], str] | None = None  # used when size > 1 and nothing is set
    default_port: Callable[[], int] = lambda: DEFAULT_PORT
    master_port_offset: int = 0
    job_id: str | None = None


class _EnvSource(NamedTuple):
    """A launcher described by a table of variables and an optional refinement step."""

    launcher: str
    variables: Mapping[str, str]  # LaunchInfo field -> environment variable
    refine: Callable[[Mapping[str, str], _Claim], None] | None = None


def _refine_torchrun(env: Mapping[str, str], claim: _Claim) -> None:
    values = claim.values
    size, local_size = values["size"], values["local_size"]
    if values["cross_size"] is None and local_size and size and size % local_size == 0:
        values["cross_size"] = size // local_size
        claim.names["cross_size"] = "WORLD_SIZE/LOCAL_WORLD_SIZE"
    claim.master_port_offset = 1  # torch's own store may already sit on MASTER_PORT
    run_id = _get(env, "TORCHELASTIC_RUN_ID")
    claim.job_id = run_id if run_id != "none" else None  # torchrun's default is the text "none"


def _parsed(parse: Callable[[str], list[_T]], var: str, raw: str, fix: str) -> list[_T]:
    try:
        return parse(raw)
    except ValueError as exc:
        raise TopologyError(f"{var}={raw!r} is malformed ({exc}); {fix}") from None


def _refine_slurm(env: Mapping[str, str], claim: _Claim) -> None:
    tasks = ("SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if var := next((v for v in tasks if _get(env, v)), None):
        counts = _parsed(parse_tasks_per_node, var, env[var], "fix or unset it")
        node = claim.values["cross_rank"]
        if len(counts) > 1 and (node is None or node >= len(counts)):
            raise TopologyError(f"{var}={env[var]!r} has no entry for SLURM_NODEID={node}")
        claim.values["local_size"] = counts[0 if len(counts) == 1 else node]
        claim.names["local_size"] = var
    var = "SLURM_STEP_NODELIST" if _get(env, "SLURM_STEP_NODELIST") else "SLURM_JOB_NODELIST"
    if (nodelist := _get(env, var)) is not None:  # expanded only if no address is set
        claim.default_addr = lambda: _parsed(expand_hostlist, var, nodelist, _FIX_ADDR)[0]
    if (job := _get(env, "SLURM_JOB_ID")) is not None:
        step = _get(env, "SLURM_STEP_ID") or _get(env, "SLURM_STEPID")
        claim.job_id = f"{job}.{step}" if step else job
        # spread concurrent jobs over 1000 ports so they do not collide on a shared node
        claim.default_port = lambda: DEFAULT_PORT + (_env_int(env, "SLURM_JOB_ID") or 0) % 1000


def _table(variables: str) -> dict[str, str]:
    """Map :data:`_FIELDS` in order to the given variable names ("-": the launcher has none)."""
    return {f: v for f, v in zip(_FIELDS, variables.split(), strict=False) if v != "-"}


_ENV_SOURCES = (
    _EnvSource("torchrun", _table("RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK "
                                  "GROUP_WORLD_SIZE"), _refine_torchrun),
    _EnvSource("openmpi", _table("OMPI_COMM_WORLD_RANK OMPI_COMM_WORLD_SIZE "
                                 "OMPI_COMM_WORLD_LOCAL_RANK OMPI_COMM_WORLD_LOCAL_SIZE")),
    _EnvSource("mpich", _table("PMI_RANK PMI_SIZE MPI_LOCALRANKID MPI_LOCALNRANKS")),
    # SLURM's local size comes from the tasks-per-node list, so "-" skips it here
    _EnvSource("slurm", _table("SLURM_PROCID SLURM_NTASKS SLURM_LOCALID - SLURM_NODEID "
                               "SLURM_NNODES"), _refine_slurm),
)


def _from_env(source: _EnvSource, env: Mapping[str, str]) -> _Claim | None:
    if _get(env, source.variables["rank"]) is None:
        return None
    values = {f: _env_int(env, var) for f, var in source.variables.items()}
    claim = _Claim(source.launcher, {f: values.get(f) for f in _FIELDS},
                   {f: source.variables.get(f, f) for f in _FIELDS})
    if source.refine:
        source.refine(env, claim)
    return claim


def _from_explicit(args: Mapping[str, int | None]) -> _Claim | None:
    if all(v is None for v in args.values()):
        return None
    for name, value in args.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TopologyError(f"shoal.init({name}={value!r}): expected an integer")
    return _Claim("explicit", {f: args.get(f) for f in _FIELDS},
                  {f: f"{f}= argument of shoal.init()" for f in _FIELDS})


def _from_config(cfg: Config) -> _Claim | None:
    if cfg.rank is None:
        return None
    return _Claim("shoalrun", {f: getattr(cfg, f) for f in _FIELDS},
                  {f: config.env_name(f) for f in _FIELDS})


def _from_sagemaker(env: Mapping[str, str], path: Path) -> _Claim | None:
    hosts_raw, current = _get(env, "SM_HOSTS"), _get(env, "SM_CURRENT_HOST")
    if hosts_raw is not None or current is not None:
        hosts_name, current_name = "SM_HOSTS", "SM_CURRENT_HOST"
        if hosts_raw is None or current is None:
            raise TopologyError(f"SageMaker launch: SM_HOSTS and SM_CURRENT_HOST must be set "
                                f"together (only {'SM_HOSTS' if hosts_raw else current_name} is)")
        try:
            hosts = json.loads(hosts_raw)
        except ValueError:
            hosts = None  # reported below
    elif path.is_file():
        hosts_name, current_name = f"'hosts' in {path}", f"'current_host' in {path}"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise TopologyError(f"cannot read SageMaker resource config {path}: {exc}") from None
        hosts, current = (data.get("hosts"), data.get("current_host")) if isinstance(
            data, dict) else (None, None)
    else:
        return None
    if (not isinstance(hosts, list) or not hosts
            or not all(isinstance(h, str) and h for h in hosts) or len(set(hosts)) != len(hosts)):
        raise TopologyError(f"SageMaker launch: {hosts_name} must be a non-empty JSON list of "
                            f"distinct host names, got {hosts_raw if hosts is None else hosts!r}")
    ordered = sorted(hosts)
    if current not in ordered:
        raise TopologyError(f"SageMaker launch: {current_name}={current!r} is not in "
                            f"{hosts_name}={hosts!r}")
    rank, size = ordered.index(current), len(ordered)
    return _Claim("sagemaker", dict(zip(_FIELDS, (rank, size, 0, 1, rank, size), strict=True)),
                  {f: f"{hosts_name}/{current_name}" for f in _FIELDS},
                  default_addr=lambda: ordered[0])


def _validate(claim: _Claim) -> None:
    values, names, who = claim.values, claim.names, claim.launcher
    for key in ("rank", "size"):
        if values[key] is None:
            raise TopologyError(f"{who} launch detected but {names[key]} is missing; "
                                f"{names['rank']} and {names['size']} must be given together")
    pairs = (("local_rank", "local_size"), ("cross_rank", "cross_size"))
    lr, ls = pairs[0]
    if (values[lr] is None) != (values[ls] is None):
        raise TopologyError(f"{who}: {names[lr]} and {names[ls]} must be given together "
                            f"(only {names[lr] if values[lr] is not None else names[ls]} is set)")
    for key in _FIELDS:
        value, least = values[key], (1 if key.endswith("size") else 0)
        if value is not None and value < least:
            raise TopologyError(f"{who}: {names[key]}={value} must be >= {least}")
    limits = (("rank", "size"), *pairs, ("local_size", "size"), ("cross_size", "size"))
    for low, high in limits:  # a rank must be below its size, a size may equal the job size
        a, b, equal_ok = values[low], values[high], low.endswith("size")
        if a is not None and b is not None and (a > b or (a == b and not equal_ok)):
            raise TopologyError(f"{who}: {names[low]}={a} must be "
                                f"{'at most' if equal_ok else 'smaller than'} {names[high]}={b}")


def _rendezvous(claim: _Claim, env: Mapping[str, str], cfg: Config) -> tuple[str, int]:
    size = claim.values["size"]
    addr = cfg.rendezvous_addr or _get(env, "MASTER_ADDR")
    if addr is None:
        if size == 1:
            addr = "127.0.0.1"
        elif claim.default_addr is not None:
            addr = claim.default_addr()
        else:
            raise TopologyError(f"{claim.launcher}: {size} processes but no rendezvous address "
                                f"(SHOAL_RENDEZVOUS_ADDR and MASTER_ADDR are unset); "
                                f"{_ADDR_HINTS.get(claim.launcher, _FIX_ADDR)}")
    if cfg.rendezvous_port is not None:
        port, origin = cfg.rendezvous_port, "SHOAL_RENDEZVOUS_PORT"
    elif (master_port := _env_int(env, "MASTER_PORT")) is not None:
        port = master_port + claim.master_port_offset
        origin = "MASTER_PORT" + ("+1" if claim.master_port_offset else "")
    else:
        port, origin = (0 if size == 1 else claim.default_port()), "default port"
    if not 0 <= port <= 65535:
        raise TopologyError(f"rendezvous port {port} (from {origin}) is outside 0..65535")
    if port == 0 and size > 1:
        raise TopologyError(f"rendezvous port 0 (from {origin}) only works for a single process; "
                            f"set SHOAL_RENDEZVOUS_PORT to a port every rank can reach")
    return addr, port


def detect(environ: Mapping[str, str] | None = None, cfg: Config | None = None, *,
           sagemaker_config: str | Path | None = None,
           rank: int | None = None, size: int | None = None,
           local_rank: int | None = None, local_size: int | None = None,
           rendezvous_addr: str | None = None, rendezvous_port: int | None = None,
           hostname: str | None = None, secret: str | None = None,
           job_id: str | None = None) -> LaunchInfo:
    """Work out this process's place in the job from ``shoal.init()`` arguments and launcher.

    Keyword arguments mirror ``shoal.init()``; ``None`` means "not given". Explicit
    ``rendezvous_addr/port``, ``hostname``, ``secret`` and ``job_id`` beat their ``SHOAL_*``
    variables, which beat launcher variables. Raises :class:`TopologyError` when the launcher
    environment is incomplete or contradicts itself.
    """
    env = os.environ if environ is None else environ
    cfg = config.load(env) if cfg is None else cfg
    given = {"rendezvous_addr": rendezvous_addr, "rendezvous_port": rendezvous_port,
             "hostname": hostname, "secret": secret, "job_id": job_id}
    cfg = cfg.replace(**{k: v for k, v in given.items() if v is not None})
    explicit = {"rank": rank, "size": size, "local_rank": local_rank, "local_size": local_size}
    if sagemaker_config is not None:
        sm_path = Path(sagemaker_config)
    elif base := _get(env, "SAGEMAKER_BASE_DIR"):  # a fake /opt/ml tree (tests)
        sm_path = Path(base) / "input/config/resourceconfig.json"
    else:
        sm_path = SAGEMAKER_RESOURCE_CONFIG
    sources: list[Callable[[], _Claim | None]] = [
        partial(_from_explicit, explicit),
        partial(_from_config, cfg),
        *(partial(_from_env, source, env) for source in _ENV_SOURCES),
        partial(_from_sagemaker, env, sm_path),
    ]
    claim = next((c for c in (source() for source in sources) if c is not None), None)
    if claim is None:
        claim = _Claim("single", dict(zip(_FIELDS, (0, 1, 0, 1, 0, 1), strict=True)),
                       {f: "single process" for f in _FIELDS})
    _validate(claim)
    addr, port = _rendezvous(claim, env, cfg)
    # port 0 means a single rank, so the pid can keep concurrent one-process jobs apart
    job = _sanitize(cfg.job_id or claim.job_id
                    or f"{addr}-{port}" + (f"-{os.getpid()}" if port == 0 else ""))
    derived = hashlib.sha256(f"shoal-unauthenticated:{job}:{addr}:{port}".encode()).hexdigest()
    return LaunchInfo(
        launcher=claim.launcher, **claim.values, hostname=cfg.hostname or socket.gethostname(),
        rendezvous_addr=addr, rendezvous_port=port, job_id=job,
        secret=cfg.secret or derived, secret_is_derived=not cfg.secret,
        origins=MappingProxyType(dict(claim.names)),
    )


@dataclass(frozen=True)
class World:
    """The job's layout implied by every rank's host name; nodes are numbered by lowest rank."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    hosts: tuple[str, ...]  # host identity of every global rank, indexed by rank

    @cached_property
    def _nodes(self) -> tuple[tuple[int, ...], ...]:
        """Global ranks of each node, nodes ordered by their lowest rank."""
        by_host: dict[str, list[int]] = {}
        for r, host in enumerate(self.hosts):
            by_host.setdefault(host, []).append(r)
        return tuple(tuple(ranks) for ranks in by_host.values())

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """Global ranks on my host, ascending."""
        return tuple(r for r, host in enumerate(self.hosts) if host == self.hosts[self.rank])

    def node_ranks(self, cross_rank: int) -> tuple[int, ...]:
        """Global ranks on node ``cross_rank``, ascending."""
        if not 0 <= cross_rank < len(self._nodes):
            raise IndexError(f"node {cross_rank} out of range 0..{len(self._nodes) - 1}")
        return self._nodes[cross_rank]

    @property
    def homogeneous(self) -> bool:
        """Whether every node runs the same number of ranks."""
        return len({len(ranks) for ranks in self._nodes}) == 1

    @property
    def cross_peers(self) -> tuple[int, ...]:
        """Global ranks with my local_rank, one per node, in node order (nodes with too few
        ranks are skipped, so this is only meaningful when :attr:`homogeneous`)."""
        return tuple(ranks[self.local_rank] for ranks in self._nodes
                     if self.local_rank < len(ranks))

    @classmethod
    def from_hostnames(cls, rank: int, hostnames: Sequence[str]) -> World:
        """Build the world from every rank's host name (indexed by global rank)."""
        hosts = tuple(hostnames)
        if not 0 <= rank < len(hosts):
            raise TopologyError(f"rank {rank} is outside the {len(hosts)} gathered host names")
        order = list(dict.fromkeys(hosts))  # hosts in order of their lowest rank
        mine = [r for r, host in enumerate(hosts) if host == hosts[rank]]
        return cls(rank=rank, size=len(hosts), local_rank=mine.index(rank),
                   local_size=len(mine), cross_rank=order.index(hosts[rank]),
                   cross_size=len(order), hosts=hosts)

    @classmethod
    def single(cls, hostname: str = "localhost") -> World:
        """The world of a one-process job."""
        return cls.from_hostnames(0, [hostname])


def _summarize(world: World, limit: int = 8) -> str:
    nodes = [f"{world.hosts[ranks[0]]!r} (ranks {', '.join(map(str, ranks[:4]))}"
             f"{', ...' if len(ranks) > 4 else ''})" for ranks in world._nodes[:limit]]
    more = len(world._nodes) - limit
    return "; ".join(nodes) + (f"; and {more} more node(s)" if more > 0 else "")


def check_consistent(info: LaunchInfo, world: World) -> None:
    """Raise :class:`TopologyError` when the launcher's layout contradicts the host names."""
    said = {k: getattr(info, k) for k in _FIELDS}
    wrong = [k for k, v in said.items() if v is not None and v != getattr(world, k)]
    if not wrong:
        return
    claims = ", ".join(f"{info.origins.get(k, k)}={said[k]}" for k in wrong)
    implied = ", ".join(f"{k}={getattr(world, k)}" for k in wrong)
    raise TopologyError(
        f"launcher {info.launcher!r} says {claims}, but the host names gathered from all "
        f"{world.size} ranks imply {implied} (rank {world.rank} is on "
        f"{world.hosts[world.rank]!r}; nodes: {_summarize(world)}). If machines share a host "
        f"name (containers often do) or one machine should act as several nodes, set "
        f"SHOAL_HOSTNAME to a distinct name per node.")
