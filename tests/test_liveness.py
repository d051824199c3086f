"""Heartbeats where only TCP passes, frozen peers seen over TCP, replayed heartbeats refused
(issue 30, items 1 and 6)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from harness import run_ranks

UDP_DROPPED_WORKER = """
import sys, time, numpy as np, shoal
rank, port, secret, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
shoal.init(rank=rank, size=4, rendezvous_addr="127.10.0.1", rendezvous_port=port,
           hostname=f"node{rank // 2}", secret=secret, job_id="udp-dropped",
           heartbeat=mode, heartbeat_interval_s=0.5, heartbeat_timeout_s=2.0)
try:
    x = np.full(1000, rank + 1.0)
    assert shoal.allreduce(x, op=shoal.Sum)[0] == 10.0
    if rank == 3:
        time.sleep(5.0)  # idle (computing) past the heartbeat timeout, the others waiting
    y = shoal.allreduce(np.full(7, float(rank)), op=shoal.Sum)
    print("result", y[0], flush=True)
except shoal.PeerLostError as exc:
    print("lost", exc, flush=True)
"""


def _udp_dropped(tmp_path, mode: str) -> tuple[list[str], list[str]]:
    from shoal.bench.common import free_port
    from shoal.bench.netns import ClusterUnavailableError, EmulatedCluster
    try:
        cluster = EmulatedCluster(2, "1gbit", tag=f"u{os.getpid() % 10000}", drop_udp=True)
        cluster.__enter__()
    except ClusterUnavailableError as exc:
        pytest.skip(str(exc))
    script = tmp_path / "worker.py"
    script.write_text(UDP_DROPPED_WORKER)
    port, secret = free_port(), "cd" * 16
    try:
        procs = [subprocess.Popen(cluster.command(r // 2, [sys.executable, str(script), str(r),
                                                           str(port), secret, mode]),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(4)]
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        cluster.__exit__(None, None, None)
    return [o for o, _ in outs], [e for _, e in outs]


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_heartbeats_fall_back_to_tcp_where_udp_is_dropped(tmp_path) -> None:
    """2 emulated hosts x 2 ranks, UDP dropped between the hosts: ``auto`` finds it at start,
    says so once, and a rank idle past the heartbeat timeout is still alive."""
    outs, errs = _udp_dropped(tmp_path, "auto")
    assert [o.strip() for o in outs] == ["result 6.0"] * 4, (outs, errs)
    said = [e.count("heartbeats go over TCP") for e in errs]
    assert said == [1, 0, 0, 0], errs


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_udp_only_heartbeats_lose_peers_where_udp_is_dropped(tmp_path) -> None:
    """The fault itself: forced to UDP, the same program reports live peers lost."""
    outs, _ = _udp_dropped(tmp_path, "udp")
    assert any(o.startswith("lost") for o in outs), outs


def _frozen_over_tcp(rank: int) -> tuple:
    import shoal
    shoal.allreduce(np.ones(3), name="warm")
    assert shoal.communicator().liveness.mode == "tcp"
    if rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    start = time.monotonic()
    try:
        shoal.allreduce(np.ones(3), name="after")
        time.sleep(1.0)
        shoal.allreduce(np.ones(3), name="again")
    except shoal.PeerLostError as exc:
        return ("lost", exc.rank, time.monotonic() - start)
    return ("no error", None, 0.0)


def test_tcp_heartbeats_find_a_frozen_peer() -> None:
    # rank 1 stays frozen and never reports: killed once rank 0 has (``hung``)
    out = run_ranks(_frozen_over_tcp, 2, heartbeat="tcp", heartbeat_interval_s=0.3,
                    heartbeat_timeout_s=2.0, timeout=15, expect_errors=True, hung=[1])
    status, value = out[0]
    assert status == "ok" and value[0] == "lost" and value[1] == 1, out


def _idle_over_tcp(rank: int) -> float:
    import shoal
    if rank == 0:
        time.sleep(3.0)  # past the timeout: only heartbeats keep rank 0 alive for rank 1
    return float(shoal.allreduce(np.full(2, rank + 1.0), op=shoal.Sum)[0])


def test_tcp_heartbeats_keep_an_idle_peer_alive() -> None:
    assert run_ranks(_idle_over_tcp, 2, heartbeat="tcp", heartbeat_interval_s=0.3,
                     heartbeat_timeout_s=1.5, timeout=40) == [3.0, 3.0]


def _pair(mode: str = "udp"):
    from shoal.core.liveness import Liveness
    a = Liveness(0, b"k" * 32, b"uid12345", "127.0.0.1", interval=0.1, timeout=1.0,
                 stall_warning=0)
    b = Liveness(1, b"k" * 32, b"uid12345", "127.0.0.1", interval=0.1, timeout=1.0,
                 stall_warning=0)
    peers = {0: a.address, 1: b.address}
    tcp = {0: a.tcp_address, 1: b.tcp_address}
    a.start(peers, tcp, mode)
    b.start(peers, tcp, mode)
    return a, b


def test_replayed_heartbeat_is_refused() -> None:
    from shoal.core.liveness import Liveness
    a = Liveness(0, b"k" * 32, b"uid12345", "127.0.0.1", interval=10.0, timeout=1.0,
                 stall_warning=0)
    a._seen = {1: time.monotonic()}  # rank 1 known, no thread
    sender = Liveness(1, b"k" * 32, b"uid12345", "127.0.0.1", interval=10.0, timeout=1.0,
                      stall_warning=0)
    first, second = sender._packet(1), sender._packet(2)
    try:
        assert a.accept(first) and a.accept(second)
        assert not a.accept(first) and not a.accept(second)  # recorded and played back
        other = Liveness(1, b"x" * 32, b"uid12345", "127.0.0.1", interval=10.0, timeout=1.0,
                         stall_warning=0)
        assert not a.accept(other._packet(3))  # another key
        other.close()
    finally:
        a.close()
        sender.close()


def test_replay_over_the_wire_keeps_no_dead_rank_alive() -> None:
    """A rank's heartbeats recorded, the rank gone, the recording replayed: lost all the
    same."""
    a, b = _pair()
    recorded = [b._packet(seq) for seq in range(1, 4)]
    b.close()
    spoof = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            for packet in recorded:
                spoof.sendto(packet, a.address)
            time.sleep(0.05)
        assert a.silent_for(1) > 1.0
        with pytest.raises(Exception, match="sent no heartbeat"):
            a.check([1], "a test", 2.0)
    finally:
        spoof.close()
        a.close()


def test_a_stranger_on_the_tcp_heartbeat_port_stalls_nothing() -> None:
    a, b = _pair("tcp")
    strangers = [socket.create_connection(a.tcp_address) for _ in range(3)]
    try:
        strangers[1].sendall(os.urandom(4096))
        time.sleep(1.5)
        assert a.silent_for(1) < 0.6 and b.silent_for(0) < 0.6
    finally:
        for s in strangers:
            s.close()
        a.close()
        b.close()
