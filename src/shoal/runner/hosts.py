"""Hosts: ``-H`` lists, hostfiles, the placement of ranks, and the addresses to advertise."""

from __future__ import annotations

import fcntl
import socket
import struct
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from .common import LaunchError

__all__ = [
    "WorkerSpec", "interface_address", "local_host_names", "parse_hostfile", "parse_hosts",
    "plan", "source_address",
]

_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface


@dataclass(frozen=True)
class WorkerSpec:
    """Where one worker runs and its place in the job (``local``: on this machine)."""

    rank: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    host: str
    local: bool = True


def _add_host(hosts: list[tuple[str, int]], name: str, slots: int, where: str) -> None:
    if any(name == seen for seen, _ in hosts):
        raise LaunchError(f"{where}: host {name!r} is listed twice; give it once with all its "
                          "slots")
    hosts.append((name, slots))


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """``"a:2,b"`` -> ``[("a", 2), ("b", 1)]``; a host without ``:slots`` has one slot."""
    hosts: list[tuple[str, int]] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, count = item.rpartition(":") if ":" in item else (item, ":", "1")
        slots = int(count) if count.isdigit() else 0
        if not name or slots < 1:
            raise LaunchError(f"-H {item!r}: expected host:slots with slots >= 1")
        _add_host(hosts, name, slots, "-H")
    if not hosts:
        raise LaunchError(f"-H {text!r} names no host")
    return hosts


def parse_hostfile(path: str | Path) -> list[tuple[str, int]]:
    """Read ``host slots=N`` lines (``slots`` defaults to 1; ``#`` starts a comment).

    A bad line raises one :class:`LaunchError` naming ``file:line``.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise LaunchError(f"--hostfile {path}: cannot read it ({exc.strerror or exc})") from None
    hosts: list[tuple[str, int]] = []
    for number, raw in enumerate(lines, 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        where = f"{path}:{number}"
        slots = 1
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key == "slots" and value.isdigit() and int(value) >= 1:
                slots = int(value)
            elif key != "max_slots" or not value.isdigit():  # Open MPI's max_slots is allowed
                raise LaunchError(f"{where}: expected 'host slots=N' (N >= 1), got "
                                  f"{raw.strip()!r}")
        if ":" in words[0] or "=" in words[0]:
            raise LaunchError(f"{where}: expected 'host slots=N', got {raw.strip()!r}")
        _add_host(hosts, words[0], slots, where)
    if not hosts:
        raise LaunchError(f"--hostfile {path}: names no host")
    return hosts


def local_host_names() -> set[str]:
    """Names under which a host in ``-H`` means this machine."""
    name = socket.gethostname()
    return {"localhost", "127.0.0.1", "::1", name, name.split(".")[0]}


def plan(np: int, hosts: Sequence[tuple[str, int]] | None = None, *,
         emulate_hosts: bool = False, local_names: Collection[str] | None = None,
         default_host: str | None = None) -> list[WorkerSpec]:
    """Place ``np`` workers: on this host, or filling ``hosts`` (name, slots) in order.

    Hosts not named in ``local_names`` (default: :func:`local_host_names`) are remote,
    unless ``emulate_hosts`` simulates every host on this machine.
    """
    if np < 1:
        raise LaunchError(f"-np must be at least 1, got {np}")
    if not hosts:
        host = default_host or socket.gethostname()
        return [WorkerSpec(r, r, np, 0, 1, host) for r in range(np)]
    total = sum(slots for _, slots in hosts)
    if total < np:
        listing = ",".join(f"{h}:{s}" for h, s in hosts)
        raise LaunchError(f"-np {np} needs {np} slots but the hosts ({listing}) offer only "
                          f"{total}")
    used: list[tuple[str, int]] = []  # (host, workers on it), hosts left empty dropped
    for host, slots in hosts:
        left = np - sum(n for _, n in used)
        if left > 0:
            used.append((host, min(slots, left)))
    names = local_host_names() if local_names is None else set(local_names)
    here = [h for h, _ in used if h in names]
    if not emulate_hosts and len(here) > 1:
        raise LaunchError(f"{', '.join(here)} are all this machine; list it once, or use "
                          "--emulate-hosts to simulate separate hosts")
    specs: list[WorkerSpec] = []
    for cross_rank, (host, count) in enumerate(used):
        local = emulate_hosts or host in names
        for local_rank in range(count):
            specs.append(WorkerSpec(len(specs), local_rank, count, cross_rank, len(used), host,
                                    local))
    return specs


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` (``--network-interface``)."""
    known = [n for _, n in socket.if_nameindex()]
    if name not in known:
        raise LaunchError(f"--network-interface {name}: no such interface (this machine has "
                          f"{', '.join(known)})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        except OSError as exc:
            raise LaunchError(f"--network-interface {name}: it has no IPv4 address "
                              f"({exc.strerror})") from None
    return socket.inet_ntoa(packed[20:24])


def source_address(host: str) -> str:
    """This machine's address on the interface that routes to ``host`` (no packet is sent)."""
    try:
        family, _, _, _, dest = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(dest)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise LaunchError(f"cannot find the route to host {host!r} ({exc}); check the name, or "
                          "choose the address to advertise with --network-interface") from None
