"""A representative part of torch's own backend conformance tests (tests/torchdist/suite.py,
``DistributedTest._DistTestBase`` from the torch wheel) on backend "shoal", at world size 2.
``scripts/torch-suite.sh`` runs the whole suite for gloo and shoal side by side."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch's test utilities import it

SUITE = Path(__file__).parent / "torchdist"
CASES = [  # collectives, p2p, groups, DDP: one or two of each kind
    "test_all_reduce_sum", "test_all_reduce_full_group_max", "test_all_reduce_sum_complex",
    "test_all_reduce_coalesced_max_complex_unsupported", "test_broadcast",
    "test_all_gather_coalesced_simple", "test_reduce_sum", "test_scatter_checks",
    "test_gather", "test_send_recv", "test_send_recv_any_source", "test_send_recv_with_tag",
    "test_irecv", "test_barrier", "test_destroy_group", "test_get_rank_size_group",
    "test_DistributedDataParallelCPU",
]


@pytest.mark.timeout(900)
def test_torch_backend_conformance_subset(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "MASTER_"))}
    env.update(BACKEND="shoal", WORLD_SIZE="2", OMP_NUM_THREADS="1")
    report = tmp_path / "junit.xml"
    ids = [f"suite.py::TestDistBackendWithSpawn::{case}" for case in CASES]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", "--timeout", "200", *ids,
                           f"--junitxml={report}"], cwd=SUITE, env=env, capture_output=True,
                          text=True, timeout=900)
    outcome = {}
    for case in ET.parse(report).iter("testcase"):
        tags = {child.tag for child in case}
        outcome[case.get("name")] = ("fail" if tags & {"failure", "error"} else
                                     "skip" if "skipped" in tags else "pass")
    failed = [c for c in CASES if outcome.get(c) != "pass"]
    assert not failed, f"{failed} did not pass:\n{proc.stdout[-8000:]}"
