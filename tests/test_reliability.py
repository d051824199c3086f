"""Dead and silent peers, a cut cable, and strangers on the ports: typed errors, no hangs,
no leaked shared memory or processes."""

from __future__ import annotations

import glob
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from harness import run_ranks

VARIANTS = [  # (ranks, hosts, algorithm, elements): shm and tcp paths, small and large
    (3, None, "auto", 1 << 20),
    (3, None, "auto", 1000),
    (4, ["a", "a", "b", "b"], "auto", 1 << 20),
    (3, None, "ring", 1 << 18),
]


def _victim(rank: int, victim: int, elements: int, sig: int, delay: float) -> tuple:
    import shoal
    x = np.ones(elements, np.float32)
    shoal.allreduce(x, name="warm-up")
    if rank == victim:  # die (or freeze) in the middle of the traffic below
        threading.Timer(delay, os.kill, (os.getpid(), sig)).start()
    start = time.monotonic()
    try:
        for i in range(100_000):
            shoal.allreduce(x, name=f"step{i % 7}")
    except shoal.PeerLostError as exc:
        return ("lost", exc.rank, time.monotonic() - start, str(exc))
    return ("no error", None, 0.0, "")


def _check_run(n, hosts, algo, elements, sig, timeout_s, wait=60.0):
    victim = random.randrange(n)
    mine = f"/dev/shm/shoal-t{os.getpid()}-*"  # the harness names jobs t<pid>-<random>
    outcomes = run_ranks(_victim, n, victim, elements, sig, random.uniform(0.05, 0.3),
                         hosts=hosts, allreduce_algorithm=algo, expect_errors=True,
                         timeout=wait, timeout_s=timeout_s, hung=[victim])
    for rank, outcome in enumerate(outcomes):
        if rank == victim:
            continue
        assert outcome is not None, f"rank {rank} hung (victim {victim})"
        status, value = outcome
        assert status == "ok" and value[0] == "lost", (rank, victim, outcome)
        assert value[1] == victim, f"rank {rank} blamed {value[1]}, victim {victim}: {value}"
    assert not glob.glob(mine), "leaked shared-memory segments"


def test_killed_peer_is_named_every_time() -> None:
    """SIGKILL mid-allreduce, 20 runs in a row over shm and tcp paths, small and large."""
    random.seed(7)
    for i in range(20):
        n, hosts, algo, elements = VARIANTS[i % len(VARIANTS)]
        _check_run(n, hosts, algo, elements, signal.SIGKILL, timeout_s=10)


@pytest.mark.parametrize("variant", [0, 2, 3])
def test_silent_peer_is_detected_by_the_timeout(variant: int) -> None:
    """SIGSTOP: alive but silent; the timeout, not a hang, ends it."""
    n, hosts, algo, elements = VARIANTS[variant]
    start = time.monotonic()
    _check_run(n, hosts, algo, elements, signal.SIGSTOP, timeout_s=2, wait=15)
    assert time.monotonic() - start < 30


def test_stranger_on_the_data_port_is_refused(caplog) -> None:
    from shoal.core.transport.tcp import TcpMesh
    secret = b"k" * 32
    a = TcpMesh(0, 2, secret, timeout=5, buffer_bytes=1 << 20, bind_addr="127.0.0.1")
    b = TcpMesh(1, 2, secret, timeout=5, buffer_bytes=1 << 20, bind_addr="127.0.0.1")
    assert a.address[0] == "127.0.0.1"  # never all interfaces unless asked
    t = threading.Thread(target=a.connect, args=([a.address, b.address], 10))
    t.start()  # rank 0 now accepts; strangers come first: garbage, silence, a wrong secret
    for payload in (b"garbage" * 10, b""):
        s = socket.create_connection(a.address)
        s.sendall(payload)
        s.close()
    wrong = TcpMesh(1, 2, b"w" * 32, timeout=5, buffer_bytes=1 << 20, bind_addr="127.0.0.1")
    with pytest.raises(Exception, match="secret"):
        wrong._dial(0, 0, a.address, time.monotonic() + 5)
    wrong.close()
    b.connect([a.address, b.address], 10)
    t.join(10)
    data = np.arange(1000, dtype=np.float64)
    got = np.empty_like(data)
    b.exchange([(0, memoryview(data).cast("B"))], [])
    a.exchange([], [(1, memoryview(got).cast("B"))])
    np.testing.assert_array_equal(got, data)
    assert any("refused data connection" in r.getMessage() for r in caplog.records)
    a.close()
    b.close()


CABLE_WORKER = """
import sys, time, numpy as np, shoal
rank, port, secret = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
shoal.init(rank=rank, size=2, rendezvous_addr="127.10.0.1", rendezvous_port=port,
           hostname=f"node{rank}", secret=secret, job_id="cable", timeout_s=3)
x = np.ones(1 << 18, np.float32)
print("ready", flush=True)
t = time.monotonic()
try:
    while True:
        shoal.allreduce(x, name="grad")
except shoal.PeerLostError as exc:
    print("lost", exc.rank, round(time.monotonic() - t, 1), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_cable_cut_between_nodes_is_peer_lost(tmp_path) -> None:
    from shoal.bench.common import free_port
    from shoal.bench.netns import ClusterUnavailableError, EmulatedCluster
    try:
        cluster = EmulatedCluster(2, "1gbit", tag=f"c{os.getpid() % 10000}")
    except ClusterUnavailableError as exc:
        pytest.skip(str(exc))
    script = tmp_path / "worker.py"
    script.write_text(CABLE_WORKER)
    port, secret = free_port(), "ab" * 16
    with cluster:
        procs = [subprocess.Popen(cluster.command(r, [sys.executable, str(script), str(r),
                                                      str(port), secret]),
                                  stdout=subprocess.PIPE, text=True) for r in range(2)]
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        time.sleep(0.5)
        subprocess.run(cluster.command(0, ["ip", "link", "set", cluster.devices[0], "down"]),
                       check=True, timeout=10)
        outs = [p.communicate(timeout=40)[0] for p in procs]
    for out in outs:
        assert "lost" in out, outs
