"""Emulated hosts on one machine: Linux network namespaces joined by shaped veth links.

``EmulatedCluster(nodes=2, rate="1gbit")`` creates one namespace per node. Two nodes are joined
by a single veth pair; more by a star: a hub namespace holding a bridge (the switch), one veth
pair from each node to it. Addresses are in 127.10.0.0/24 (kept inside the namespaces;
``route_localnet`` lets 127/8 addresses travel over a real link), and a ``tc tbf`` qdisc
shapes every veth end, so each node's link carries ``rate`` each way (``netem`` is missing from
this kernel, so latency cannot be added). Everything is torn down on exit. Root only.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

__all__ = ["ClusterUnavailableError", "EmulatedCluster"]


class ClusterUnavailableError(RuntimeError):
    """This machine cannot build the emulated cluster (not root, no ip/tc, no netns)."""


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if proc.returncode != 0:
        raise ClusterUnavailableError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")


class EmulatedCluster:
    """``nodes`` namespaces, each behind a link shaped to ``rate`` each way."""

    def __init__(self, nodes: int = 2, rate: str = "1gbit", tag: str | None = None, *,
                 drop_udp: bool = False) -> None:
        if nodes < 2:
            raise ValueError("the emulated cluster needs at least 2 nodes")
        if os.geteuid() != 0:
            raise ClusterUnavailableError("building network namespaces needs root; run as root or "
                                     "skip the emulated-cluster benchmark")
        tag = tag or str(os.getpid())
        self.rate = rate
        self.drop_udp = drop_udp  # a network that passes TCP only (a security group, a policy)
        self.namespaces = [f"shoal{tag}n{i}" for i in range(nodes)]
        self.devices = [f"sh{tag}v{i}"[:15] for i in range(nodes)]
        self.addresses = [f"127.10.0.{i + 1}" for i in range(nodes)]
        self.hub = f"shoal{tag}hub" if nodes > 2 else None
        self._created: list[str] = []

    def _shape(self, ns: str, dev: str) -> None:
        tc = ("ip", "netns", "exec", ns, "tc")
        if not self.drop_udp:
            _run(*tc, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst",
                 "256kb", "latency", "100ms")
            return
        # htb at the rate for everything; UDP is sent to a class whose tbf has a burst too
        # small for any datagram, so it drops them all (no netem or gact on this kernel)
        _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
             "rate", self.rate)
        _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb",
             "rate", "8bit", "ceil", "8bit")
        _run(*tc, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "tbf",
             "rate", "8bit", "burst", "10", "limit", "10")
        _run(*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
             "u32", "match", "ip", "protocol", "17", "0xff", "flowid", "1:20")

    def __enter__(self) -> EmulatedCluster:
        try:
            for ns in self.namespaces + ([self.hub] if self.hub else []):
                _run("ip", "netns", "add", ns)
                self._created.append(ns)
            if self.hub is None:  # two nodes: one veth pair between them
                a, b = self.devices
                _run("ip", "link", "add", a, "netns", self.namespaces[0], "type", "veth",
                     "peer", "name", b, "netns", self.namespaces[1])
            else:  # a star around a bridge in the hub namespace
                hub = ("ip", "netns", "exec", self.hub)
                _run(*hub, "ip", "link", "add", "br0", "type", "bridge")
                _run(*hub, "ip", "link", "set", "br0", "up")
                for i, (ns, dev) in enumerate(zip(self.namespaces, self.devices,
                                                  strict=True)):
                    port = f"{dev[:-len(str(i))]}p{i}"[:15]
                    _run("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer",
                         "name", port, "netns", self.hub)
                    _run(*hub, "ip", "link", "set", port, "master", "br0")
                    _run(*hub, "ip", "link", "set", port, "up")
                    self._shape(self.hub, port)  # the node's inbound direction
            for ns, dev, addr in zip(self.namespaces, self.devices, self.addresses,
                                     strict=True):
                ex = ("ip", "netns", "exec", ns)
                _run(*ex, "ip", "link", "set", "lo", "up")
                _run(*ex, "sysctl", "-q", "-w", "net.ipv4.conf.all.route_localnet=1")
                _run(*ex, "sysctl", "-q", "-w", f"net.ipv4.conf.{dev}.route_localnet=1")
                _run(*ex, "ip", "addr", "add", f"{addr}/24", "dev", dev)
                _run(*ex, "ip", "link", "set", dev, "up")
                self._shape(ns, dev)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for ns in self._created:
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30,
                           check=False)
        self._created.clear()

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def rate_bytes_per_s(self) -> float:
        """The configured link rate in bytes per second."""
        text = self.rate.lower()
        scale = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}
        for unit, factor in scale.items():
            if text.endswith(unit):
                return float(text[: -len(unit)]) * factor / 8
        raise ValueError(f"rate {self.rate!r}: use e.g. 1gbit or 500mbit")
