"""Emulated hosts on one machine: Linux network namespaces joined by shaped veth links.

``EmulatedCluster(nodes=2, rate="1gbit")`` creates one namespace per node. Two nodes are joined
by a single veth pair; more by a star: a hub namespace holding a bridge (the switch), one veth
pair from each node to it. Addresses are in 127.10.0.0/24 (kept inside the namespaces;
``route_localnet`` lets 127/8 addresses travel over a real link), and a ``tc tbf`` qdisc
shapes every veth end, so each node's link carries ``rate`` each way (``netem`` is missing from
this kernel, so latency cannot be added). Everything is torn down on exit. Root only.

``flow_cap="250mbit"`` adds what clouds do on top of the link: every TCP connection leaving a
node is held to ``flow_cap`` while all of them together still share ``rate``. This kernel has no
``fq`` or ``sfq`` to tell flows apart, so the namespace's netfilter does it: each new TCP
connection on the link (seen leaving, or arriving) is given the next of 64 connection marks in
turn (``statistic --mode nth``, ``CONNMARK``), every packet leaving is sent by its
connection's mark (``CLASSIFY``) to a class of its own in an ``htb`` tree on the node's end of
the link, whose ceiling is ``flow_cap``, under one parent class at ``rate``. Connections 64
apart share a class (and a cap); a job opens far fewer across one link. Needs ``iptables``
(Debian's package).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["ClusterUnavailableError", "EmulatedCluster", "run_bench_job"]


class ClusterUnavailableError(RuntimeError):
    """This machine cannot build the emulated cluster (not root, no ip/tc, no netns)."""


FLOW_CLASSES = 64  # connection marks dealt in turn under a per-flow cap


def _run(*argv: str, stdin: str | None = None) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False,
                          input=stdin)
    if proc.returncode != 0:
        raise ClusterUnavailableError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")


def rate_bits(rate: str) -> float:
    """``1gbit``, ``250mbit``, ``800kbit`` in bits per second."""
    text = rate.strip().lower()
    for unit, factor in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    raise ValueError(f"rate {rate!r}: use e.g. 1gbit or 500mbit")


class EmulatedCluster:
    """``nodes`` namespaces, each behind a link shaped to ``rate`` each way."""

    def __init__(self, nodes: int = 2, rate: str = "1gbit", tag: str | None = None, *,
                 drop_udp: bool = False, flow_cap: str | None = None) -> None:
        if nodes < 2:
            raise ValueError("the emulated cluster needs at least 2 nodes")
        if flow_cap is not None:
            if drop_udp:
                raise ValueError("flow_cap and drop_udp cannot be combined")
            if rate_bits(flow_cap) > rate_bits(rate):
                raise ValueError(f"flow_cap {flow_cap} is above the link rate {rate}")
            if shutil.which("iptables") is None:
                raise ClusterUnavailableError("a per-flow cap needs iptables (apt-get install "
                                              "iptables)")
        if os.geteuid() != 0:
            raise ClusterUnavailableError("building network namespaces needs root; run as root or "
                                     "skip the emulated-cluster benchmark")
        tag = tag or str(os.getpid())
        self.rate = rate
        self.drop_udp = drop_udp  # a network that passes TCP only (a security group, a policy)
        self.flow_cap = flow_cap
        self.namespaces = [f"shoal{tag}n{i}" for i in range(nodes)]
        self.devices = [f"sh{tag}v{i}"[:15] for i in range(nodes)]
        self.addresses = [f"127.10.0.{i + 1}" for i in range(nodes)]
        self.hub = f"shoal{tag}hub" if nodes > 2 else None
        self._created: list[str] = []

    def _cap_flows(self, ns: str, dev: str) -> None:
        """The link at ``rate``, each TCP connection leaving on it at ``flow_cap``."""
        share = f"{max(8.0, rate_bits(self.rate) / (FLOW_CLASSES + 1)):.0f}bit"
        cap, link = self.flow_cap, self.rate
        lines = [f"qdisc add dev {dev} root handle 1: htb default 2",
                 f"class add dev {dev} parent 1: classid 1:1 htb rate {link} ceil {link} "
                 f"quantum 60000",
                 f"class add dev {dev} parent 1:1 classid 1:2 htb rate {share} ceil {cap} "
                 f"quantum 60000"]
        lines += [f"class add dev {dev} parent 1:1 classid 1:{0x100 + mark:x} htb rate "
                  f"{share} ceil {cap} quantum 60000" for mark in range(1, FLOW_CLASSES + 1)]
        _run("ip", "netns", "exec", ns, "tc", "-batch", "-", stdin="\n".join(lines) + "\n")
        # this kernel's u32 cannot match marks (no CLS_U32_MARK) and it has no fw classifier,
        # so netfilter picks the class itself: CLASSIFY sets the priority htb reads first
        rules = ["*mangle", ":SHOALFLOW - [0:0]", ":SHOALCLASS - [0:0]"]
        rules += [f"-A SHOALFLOW -m statistic --mode nth --every {FLOW_CLASSES} --packet "
                  f"{i} -j CONNMARK --set-mark {i + 1}" for i in range(FLOW_CLASSES)]
        rules += [f"-A SHOALCLASS -m connmark --mark {mark} -j CLASSIFY --set-class "
                  f"1:{0x100 + mark:x}" for mark in range(1, FLOW_CLASSES + 1)]
        rules += [f"-A OUTPUT -o {dev} -p tcp -m conntrack --ctstate NEW -j SHOALFLOW",
                  f"-A PREROUTING -i {dev} -p tcp -m conntrack --ctstate NEW -j SHOALFLOW",
                  f"-A POSTROUTING -o {dev} -p tcp -j SHOALCLASS", "COMMIT"]
        _run("ip", "netns", "exec", ns, "iptables-restore", "--noflush",
             stdin="\n".join(rules) + "\n")

    def _shape(self, ns: str, dev: str, node_end: bool = True) -> None:
        tc = ("ip", "netns", "exec", ns, "tc")
        if self.flow_cap is not None and node_end:
            self._cap_flows(ns, dev)
            return
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
                    self._shape(self.hub, port, node_end=False)  # the node's inbound side
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

    def run_ranks(self, module: str, size: int, local: int, common: Sequence[str],
                  timeout: float,
                  extra: Callable[[int], Sequence[str]] = lambda node: ()) -> list[int]:
        """Run ``python -m module`` as ranks ``0..size-1``, ``local`` per node, each inside its
        node's namespace with ``--rank``, ``--host node<i>``, ``--device`` (its link end),
        ``extra(node)`` and ``common``; wait for all of them, at most ``timeout`` seconds in
        all, and return their exit codes. Raises ``subprocess.TimeoutExpired`` once the
        workers still running are killed."""
        procs = []
        try:
            for rank in range(size):
                node = rank // local
                argv = [sys.executable, "-m", module, "--rank", str(rank), "--host",
                        f"node{node}", "--device", self.devices[node], *extra(node), *common]
                procs.append(subprocess.Popen(self.command(node, argv)))
            deadline = time.monotonic() + timeout
            return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()

    def rate_bytes_per_s(self) -> float:
        """The configured link rate in bytes per second."""
        return rate_bits(self.rate) / 8


def run_bench_job(cluster: EmulatedCluster, bench: str, size: int, local: int,
                  common: Sequence[str], out: str, timeout: float,
                  extra: Callable[[int], Sequence[str]] = lambda node: (),
                  before: Callable[[], None] = lambda: None) -> dict[str, Any] | None:
    """Build ``cluster``, run ``before()`` in it (the link's own measurements), then the ranks
    of ``shoal.bench.<bench>`` (:meth:`EmulatedCluster.run_ranks`), and tear it down; what
    rank 0 wrote to ``out`` (then removed), or None once the failure is said on stderr as
    ``shoal bench <bench>: ...``."""
    try:
        with cluster:
            before()
            codes = cluster.run_ranks(f"shoal.bench.{bench}", size, local, common, timeout,
                                      extra)
    except (ClusterUnavailableError, RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"shoal bench {bench}: {exc}", file=sys.stderr)
        return None
    if any(codes):
        print(f"shoal bench {bench}: workers exited with {codes}", file=sys.stderr)
        return None
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result
