"""The second round of ``shoal bench faults`` scenarios (what an audit found untried): UDP
dropped between hosts, strangers on every port a rank's own sockets listen on, a replayed
heartbeat, a peer frozen during a receive, a request held while computing, a bad argument on
one rank, and kill -9 / SIGSTOP at 2 emulated hosts x 2 ranks during a hierarchical
allreduce and during a sharded-optimizer step. Each action runs inside one rank, as
:mod:`shoal.bench.faults` runs the first round's."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .faults_common import fault_now, record, wait_for_loss

__all__ = ["ACTIONS", "own_ports"]

Action = Callable[[Any, str, int, Any], None]


def own_ports() -> list[tuple[str, str, int]]:
    """Every TCP port listening and every UDP port bound by a socket of this process, found
    from ``/proc`` (not from shoal's own bookkeeping): ``(protocol, address, port)``."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = []
    for proto, path in (("TCP", "/proc/self/net/tcp"), ("UDP", "/proc/self/net/udp")):
        with open(path) as f:
            rows = f.read().splitlines()[1:]
        for row in rows:
            cols = row.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if inode in inodes and (proto == "UDP" or state == "0A"):
                ip_hex, port_hex = local.split(":")
                ip = socket.inet_ntoa(bytes.fromhex(ip_hex)[::-1])
                found.append((proto, ip, int(port_hex, 16)))
    return sorted(set(found))


def _strangers_everywhere(shoal: Any, folder: str, rank: int, args: Any) -> None:
    comm = shoal.communicator()
    shoal.barrier()
    ports = own_ports()
    silent: list[socket.socket] = []
    tried = []
    for proto, ip, port in ports:
        addr = (ip, port)
        if proto == "UDP":
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                for size in (0, 1, 36, 37, 4096):
                    s.sendto(os.urandom(size), addr)
            tried.append(f"UDP {port}: 5 garbage datagrams")
            continue
        with contextlib.suppress(OSError):
            silent.append(socket.create_connection(addr, timeout=2))  # held, says nothing
        for payload in (b"GET / HTTP/1.0\r\n\r\n", os.urandom(4096)):
            with contextlib.suppress(OSError), socket.create_connection(addr, timeout=2) as s:
                s.sendall(payload)
                s.settimeout(2)
                with contextlib.suppress(OSError):
                    s.recv(64)
        tried.append(f"TCP {port}: a silent connection (held), HTTP, 4 KiB of garbage")
    shoal.barrier()
    n = shoal.size()
    ok = True
    for i in range(20):
        got = shoal.allreduce(np.full(100, float(rank + i)), shoal.Sum, name="after.strangers")
        ok &= bool(np.all(got == sum(range(n)) + n * i))
    start = time.monotonic()  # point-to-point, the silent strangers still connected
    out = np.zeros(8)
    recv = comm.recv(out, (rank - 1) % n, tag=9)
    comm.send(np.full(8, float(rank)), (rank + 1) % n, tag=9).wait(60)
    recv.wait(60)
    p2p_s = time.monotonic() - start
    ok &= bool(np.all(out == (rank - 1) % n)) and p2p_s < 5.0
    for s in silent:
        s.close()
    record(folder, rank, outcome="continued" if ok else "wrong", tried=tried,
           ports=len(ports), p2p_s=p2p_s, next_collective_ok=ok)


_REPLAYER = """
import socket, sys, time
packets = [bytes.fromhex(h) for h in sys.argv[1].split(",")]
peers = [(a.split(":")[0], int(a.split(":")[1])) for a in sys.argv[2].split(",")]
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
end = time.monotonic() + 40
while time.monotonic() < end:
    for p in packets:
        for a in peers:
            s.sendto(p, a)
    time.sleep(0.1)
"""


def _replayed_heartbeat(shoal: Any, folder: str, rank: int, args: Any) -> None:
    victim = shoal.size() - 1
    shoal.barrier()
    if rank == victim:
        live = shoal.communicator().liveness
        time.sleep(1.5)
        sent = [live._packet(s).hex() for s in range(max(1, live.sent - 5), live.sent + 1)]
        peers = ",".join(f"{a}:{p}" for a, p in live._peers.values())
        subprocess.Popen([sys.executable, "-c", _REPLAYER, ",".join(sent), peers],
                         start_new_session=True)  # recorded datagrams, played back
        fault_now(folder)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)
    wait_for_loss(shoal, folder, rank)


def _frozen_during_receive(shoal: Any, folder: str, rank: int, args: Any) -> None:
    victim = shoal.size() - 1
    comm = shoal.communicator()
    shoal.barrier()
    if rank == victim:
        time.sleep(0.5)
        fault_now(folder)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)
    try:
        comm.recv(np.zeros(4), victim).wait()  # no timeout: only the heartbeat can end it
        record(folder, rank, outcome="received")
    except shoal.ShoalError as exc:
        record(folder, rank, outcome="raised", error=type(exc).__name__, message=str(exc))


def _held_while_computing(shoal: Any, folder: str, rank: int, args: Any) -> None:
    shoal.barrier()
    a, b = np.full(5, rank + 1.0), np.full(3, 10.0 * (rank + 1))
    try:
        if rank == 0:
            handle = shoal.allreduce_async(a, name="A")
            time.sleep(3.0)  # computing past SHOAL_STALL_WARNING_S, holding A
            rb = shoal.allreduce(b, name="B")
            ra = handle.wait()
        else:
            rb = shoal.allreduce(b, name="B")
            ra = shoal.allreduce(a, name="A")
        n = shoal.size()
        ok = bool(np.all(ra == (n + 1) / 2) and np.all(rb == 10 * (n + 1) / 2))
        record(folder, rank, outcome="continued", next_collective_ok=ok)
    except shoal.ShoalError as exc:
        record(folder, rank, outcome="raised", error=type(exc).__name__, message=str(exc),
               next_collective_ok=False)


def _bad_argument(shoal: Any, folder: str, rank: int, args: Any) -> None:
    shoal.barrier()
    message = ""
    if rank == 1:
        try:
            shoal.allreduce(np.ones(3, dtype=object))
        except (TypeError, ValueError) as exc:
            message = str(exc)
    n = shoal.size()
    start = time.monotonic()
    ok = shoal.allreduce(np.full(4, float(rank)), shoal.Sum).tolist() == [n * (n - 1) / 2] * 4
    ok &= shoal.broadcast(np.full(2, float(rank)), root_rank=0).tolist() == [0.0, 0.0]
    record(folder, rank, outcome="continued", message=message,
           next_collective_ok=bool(ok) and time.monotonic() - start < 5.0)


def _during(work: str, sig: int) -> Action:
    """The last rank dies (or freezes) in the middle of ``work`` at 2 hosts x 2 ranks."""
    def act(shoal: Any, folder: str, rank: int, args: Any) -> None:
        step = _workload(shoal, work, rank)
        step()
        shoal.barrier()
        if rank == shoal.size() - 1:
            def fault() -> None:
                fault_now(folder)
                os.kill(os.getpid(), sig)
            threading.Timer(0.5, fault).start()
        try:
            deadline = time.time() + 90
            while time.time() < deadline:
                step()
            record(folder, rank, outcome="no error within 90 s")
        except shoal.ShoalError as exc:
            record(folder, rank, outcome="raised", error=type(exc).__name__, message=str(exc))
    return act


def _workload(shoal: Any, work: str, rank: int) -> Callable[[], None]:
    if work == "hierarchical":
        x = np.ones(1 << 20, np.float32)
        assert shoal.communicator().algorithm == "hierarchical"
        return lambda: shoal.allreduce(x, name="grad")
    import torch

    import shoal.torch as hvd
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    opt = hvd.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3),
                               named_parameters=model.named_parameters())
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return step


def _idle_past_timeout(shoal: Any, folder: str, rank: int, args: Any) -> None:
    """UDP dropped between the hosts: one rank idles past the heartbeat timeout while the
    others wait; heartbeats over TCP keep it alive."""
    shoal.barrier()
    start = time.time()
    if rank == shoal.size() - 1:
        time.sleep(1.5 * shoal.communicator().cfg.heartbeat_timeout_s)
    try:
        n = shoal.size()
        ok = shoal.allreduce(np.ones(4), shoal.Sum, name="after.idle").tolist() == [n] * 4
        record(folder, rank, outcome="continued", waited=time.time() - start,
               heartbeat=shoal.communicator().liveness.mode, next_collective_ok=ok)
    except shoal.ShoalError as exc:
        record(folder, rank, outcome="raised", error=type(exc).__name__, message=str(exc),
               next_collective_ok=False)


ACTIONS: dict[str, Action] = {
    "udp-dropped": _idle_past_timeout,
    "strangers-every-port": _strangers_everywhere,
    "replayed-heartbeat": _replayed_heartbeat,
    "sigstop-during-recv": _frozen_during_receive,
    "async-held-computing": _held_while_computing,
    "bad-argument": _bad_argument,
    **{f"{name}-{work}": _during(work, sig)
       for name, sig in (("kill9", signal.SIGKILL), ("sigstop", signal.SIGSTOP))
       for work in ("hierarchical", "sharded")},
}
