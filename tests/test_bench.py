"""The benchmark tool itself: tiny runs finish and write valid JSON; the report is rebuilt
from a fixed fixture (Markdown and plots)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "bench")


def _shoal(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal.cli", *args], capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_tiny_allreduce_and_exchange_runs_write_json(tmp_path) -> None:
    out = tmp_path / "allreduce.json"
    proc = _shoal("bench", "allreduce", "--np", "2", "--sizes", "4K", "--trials", "2",
                  "--peers", "gloo", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    res = data["results"][0]
    assert {"shoal", "memcpy"} <= set(res["methods"]) and res["np"] == 2
    assert "cpu" in data["machine"]
    out = tmp_path / "exchange.json"
    proc = _shoal("bench", "exchange", "--np", "2", "--trials", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"][0]
    assert res["tensors"] == 213 and "shoal" in res["methods"]
    # a peer that is not installed is reported, never silently dropped
    assert any(m.startswith("horovod") for m in res["methods"]) or "horovod" in res["missing"]


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_tiny_cluster_run(tmp_path) -> None:
    out = tmp_path / "cluster.json"
    proc = _shoal("bench", "cluster", "--sizes", "256K", "--trials", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"][0]
    assert res["link_Bps"] > 0 and "shoal-hierarchical" in res["methods"]


def test_report_from_fixture(tmp_path) -> None:
    folder = tmp_path / "benchmarks"
    shutil.copytree(FIXTURE, folder)
    out = tmp_path / "BENCHMARKS.md"
    proc = _shoal("bench", "report", "--results", str(folder), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    for heading in ("## AllReduce on one host", "## Gradient exchange of a real model",
                    "## Emulated cluster", "## Reading"):
        assert heading in text
    assert "| 4 KiB |" in text and "efficientnet-b0: 213 tensors" in text
    assert (folder / "plots" / "allreduce.png").stat().st_size > 1000


def test_tiny_train_run(tmp_path) -> None:
    out = tmp_path / "train.json"
    proc = _shoal("bench", "train", "--np", "1", "--backends", "shoal", "--settings", "32:2",
                  "--steps", "2", "--warmup", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"][0]
    assert res["settings"]["32:2"]["shoal"]["1"]["median"] > 0
