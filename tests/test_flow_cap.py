"""Across network namespaces under a per-flow cap (root, ``iptables``): the emulation holds one
TCP flow to the cap and not the link, and shoal's collectives over several streams between
real network stacks match numpy, with the shared-memory chunk grown for the streams."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
              pytest.mark.skipif(shutil.which("iptables") is None,
                                 reason="the per-flow cap needs iptables")]


def _cluster(nodes: int, rate: str, cap: str):
    from shoal.bench.netns import ClusterUnavailableError, EmulatedCluster
    try:
        return EmulatedCluster(nodes, rate, tag=f"f{os.getpid() % 10000}", flow_cap=cap)
    except ClusterUnavailableError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("nodes", [2, 3])  # a veth pair; a switch (the hub's ports shaped)
def test_the_cap_holds_one_flow_and_not_the_link(nodes: int) -> None:
    from shoal.bench.flows import probe
    cap, link = 50e6 / 8, 200e6 / 8
    with _cluster(nodes, "200mbit", "50mbit") as cluster:
        one = probe(cluster, 0, 1, 1, 3 << 20)
        eight = probe(cluster, 0, 1, 8, 8 << 20)
        back = probe(cluster, 1, 0, 1, 3 << 20)
    assert one <= 1.1 * cap and back <= 1.1 * cap, (one, back)
    assert eight >= 2.5 * cap, eight  # flows together pass the cap ...
    assert eight <= 1.1 * link, eight  # ... and stop at the link


WORKER = """
import json, sys, numpy as np, shoal
from reference import assert_matches, rank_input, reference
rank, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
shoal.init(rank=rank, size=4, rendezvous_addr="127.10.0.1", rendezvous_port=port,
           hostname=f"node{rank // 2}", secret="cd" * 16, job_id="capped", timeout_s=60,
           tcp_streams=3, tcp_stripe_bytes=16 << 10)
comm = shoal.communicator()
for dtype, op, length in [("float32", "SUM", 1_500_007), ("float64", "AVERAGE", 200_003),
                          ("int32", "MAX", 70_001), ("float16", "SUM", 99_999)]:
    case = f"cap/{dtype}/{op}/{length}"
    inputs = [rank_input(case, r, (length,), dtype) for r in range(4)]
    got = shoal.allreduce(inputs[rank], op=shoal.ReduceOp[op], name=case)
    assert_matches(got, reference(inputs, op, dtype), dtype, case,
                   inputs if op in ("SUM", "AVERAGE") else None)
x = [np.arange(400_004, dtype=np.float32) * (r + 1) for r in range(4)]
got = shoal.reducescatter(x[rank], op=shoal.Sum, name="cap/rs")
np.testing.assert_allclose(got, sum(x)[rank * 100_001:(rank + 1) * 100_001], rtol=1e-6)
mesh = comm.transport.mesh
with open(out, "w") as f:
    json.dump({"algorithm": comm.transport.algorithm, "chunk": comm.transport.shm.chunk_bytes,
               "streams": [mesh.streams(p) for p in range(4)]}, f)
shoal.shutdown()
"""


def test_collectives_over_capped_streams_match_numpy(tmp_path) -> None:
    from shoal.bench.common import free_port
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
    port = free_port()
    with _cluster(2, "1gbit", "250mbit") as cluster:
        procs = [subprocess.Popen(cluster.command(r // 2, [sys.executable, str(script), str(r),
                                                           str(port), str(tmp_path / f"{r}")]),
                                  env=env) for r in range(4)]
        codes = [p.wait(timeout=240) for p in procs]
    assert codes == [0] * 4
    for rank in range(4):
        res = json.loads((tmp_path / f"{rank}").read_text())
        assert res["algorithm"] == "hierarchical"
        assert res["streams"] == [3 if r // 2 != rank // 2 else 1 for r in range(4)]
        assert res["chunk"] == 2 * 2 * 3 * (512 << 10)  # each stream 512 KiB per ring step
