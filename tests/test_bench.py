"""The benchmark tool itself: tiny runs finish and write valid JSON; the report is rebuilt
from a fixed fixture (Markdown and plots)."""

from __future__ import annotations

import importlib.util
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
    assert res["link_Bps"] > 0 and res["flow_Bps"] > 0
    assert {"shoal-hierarchical@1", "shoal-hierarchical@auto"} <= set(res["methods"])
    assert res["streams"]["shoal-hierarchical@1"] == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_three_node_cluster_through_a_switch(tmp_path) -> None:
    """More than two emulated nodes meet at a bridge; 2 MiB takes the pipelined path."""
    out = tmp_path / "cluster.json"
    proc = _shoal("bench", "cluster", "--nodes", "3", "--sizes", "2M", "--trials", "1",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"][0]
    assert res["nodes"] == 3 and res["np"] == 6 and res["link_Bps"] > 0
    assert set(res["methods"]) >= {"shoal-hierarchical@1", "shoal-ring@auto"}


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_tiny_latency_run_times_shoal_against_the_raw_round_trip(tmp_path) -> None:
    out = tmp_path / "latency.json"
    proc = _shoal("bench", "latency", "--local", "1", "--sizes", "4K", "--trials", "2",
                  "--reps", "5", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"][0]
    assert res["nodes"] == 2 and res["np"] == 2 and {"shoal", "rtt"} <= set(res["methods"])
    rtt = res["methods"]["rtt"]["4096"]
    assert 0 < rtt["min"] <= rtt["median"]
    from shoal.bench.latency import format_table
    assert "it / rtt" in format_table(res)


def test_report_from_fixture(tmp_path) -> None:
    folder = tmp_path / "benchmarks"
    shutil.copytree(FIXTURE, folder)
    out = tmp_path / "BENCHMARKS.md"
    proc = _shoal("bench", "report", "--results", str(folder), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    for heading in ("## AllReduce on one host", "## Gradient exchange of a real model",
                    "## Emulated cluster", "## End-to-end training throughput", "## Reading"):
        assert heading in text
    assert "| 4 KiB |" in text and "efficientnet-b0: 213 tensors" in text
    assert "shoal / ddp-gloo" in text and "hidden behind backward" in text
    assert "Peak resident set per worker" in text and "| 416 | 0.0% |" in text
    for plot in ("allreduce.png", "train.png", "train-overlap.png"):
        assert (folder / "plots" / plot).stat().st_size > 1000


def test_tiny_train_run(tmp_path) -> None:
    out = tmp_path / "train.json"
    env = {**os.environ, "SHOAL_PEERS_VENV": str(tmp_path / "no-venv")}
    proc = subprocess.run([sys.executable, "-m", "shoal.cli", "bench", "train", "--np", "1",
                           "2", "--backends", "shoal,horovod,independent", "--settings", "32:2",
                           "--steps", "3", "--warmup", "2", "--overlap", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {(r["backend"], r["np"]): r for r in data["results"]}
    assert rows[("shoal", 1)]["median"] > 0 and rows[("shoal", 2)]["efficiency"] > 0
    # every job's peak resident set per worker: torch and the model are well over 100 MiB
    assert all(r["peak_rss_mib"]["median"] > 100 for r in data["results"]), data["results"]
    # the ceiling: two single-worker jobs at once, throughputs added up
    assert rows[("independent", 2)]["median"] > 0 and rows[("independent", 2)]["n"] == 1
    assert "shoal throughput / theirs, efficientnet-b0 32:2 base np=2: " in proc.stdout
    assert "x independent" in proc.stdout  # the console table gives the ratios too
    # a peer that is not installed is reported, never silently dropped
    assert "horovod" in data["missing"]
    # overlap is measured with the automatic bucket size and with 2 MiB buckets
    assert [o["buckets"] for o in data["overlap"]] == ["auto", "2 MiB"]
    for o in data["overlap"]:
        assert o["np"] == 2 and o["images_per_s"] > 0
        assert o["steps"] >= 1 and o["comm_ms"] > 0 and 0.0 <= o["hidden_share"] <= 1.0
        assert {s[1] for s in o["excerpt"]} >= {"FORWARD", "BACKWARD", "STEP", "ALLREDUCE"}


@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="tensorflow is not installed")
def test_tiny_keras_train_run_against_multiworker_mirrored(tmp_path) -> None:
    out = tmp_path / "train-keras.json"
    proc = subprocess.run([sys.executable, "-m", "shoal.cli", "bench", "train", "--framework",
                           "tensorflow", "--np", "1", "2", "--backends", "shoal,mwms",
                           "--archs", "small-cnn", "--settings", "32:4", "--steps", "2",
                           "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["framework"] == "tensorflow"
    rows = {(r["backend"], r["np"]): r for r in data["results"]}
    # MultiWorkerMirroredStrategy ran as a real 2-worker TF_CONFIG cluster; one worker is
    # shoal's np=1 job
    assert set(rows) == {("shoal", 1), ("shoal", 2), ("mwms", 2)}
    assert all(r["median"] > 0 for r in rows.values())
    assert "x mwms" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "shoal.cli", "bench", "train", "--backends",
                          "mwms", "--out", str(tmp_path / "x.json")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "for torch" in bad.stderr


def test_train_run_records_a_failed_job_and_goes_on(tmp_path) -> None:
    out = tmp_path / "train.json"
    proc = subprocess.run([sys.executable, "-m", "shoal.cli", "bench", "train", "--np", "1",
                           "--backends", "shoal", "--archs", "efficientnet-b99,efficientnet-b0",
                           "--settings", "32:2", "--steps", "1", "--warmup", "1",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 1 and "efficientnet-b99" in proc.stdout  # the table names it
    data = json.loads(out.read_text())
    (failed,) = data["failed"]
    assert failed["arch"] == "efficientnet-b99" and failed["backend"] == "shoal"
    assert failed["error"]  # the job's own error message, for the report
    assert [r["arch"] for r in data["results"]] == ["efficientnet-b0"]  # the run went on


def test_overlap_split_of_a_known_timeline() -> None:
    from shoal.bench import overlap

    def span(track: int, name: str, start_ms: float, end_ms: float) -> dict:
        return {"name": name, "ph": "X", "pid": 0, "tid": track, "ts": start_ms * 1e3,
                "dur": (end_ms - start_ms) * 1e3}

    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": 1,
               "args": {"name": "training"}},
              {"name": "thread_name", "ph": "M", "pid": 0, "tid": 2,
               "args": {"name": "fusion buffers"}}]
    for k in range(3):  # steps of 40 ms: forward 10, backward 20, step 10
        t = 40.0 * k
        events += [span(1, "FORWARD", t, t + 10), span(1, "BACKWARD", t + 10, t + 30),
                   span(1, "STEP", t + 30, t + 40),
                   span(2, "ALLREDUCE", t + 15, t + 25), span(2, "ALLREDUCE", t + 26, t + 34)]
    got = overlap.analyse(events, skip=1)
    assert got["steps"] == 2 and got["buffers"] == 2
    assert got["comm_ms"] == pytest.approx(18.0) and got["hidden_ms"] == pytest.approx(14.0)
    assert got["hidden_share"] == pytest.approx(14 / 18) and got["exposed_ms"] == pytest.approx(4)
    spans = overlap.excerpt(events)
    assert spans[0] == ["training", "FORWARD", 0.0, 10.0] and len(spans) == 5


def test_tiny_soak_checks_every_result(tmp_path) -> None:
    out = tmp_path / "soak.json"
    proc = _shoal("bench", "soak", "--np", "2", "--ops", "300", "--max-bytes", "64K",
                  "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    data = json.loads(out.read_text())
    assert data["verdict"]["mismatches"] == 0 and data["verdict"]["pass"]
    ranks = data["ranks"]
    assert len(ranks) == 2 and all(r["errors_injected"] > 0 for r in ranks)
    assert sum(ranks[0]["counts"].values()) == 300


def test_faults_detected_and_reported(tmp_path) -> None:
    out = tmp_path / "benchmarks" / "faults.json"
    proc = _shoal("bench", "faults", "--only", "kill9-same-host", "mismatch-names",
                  "strangers-every-port", "checkpoint-kill", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    scenarios = json.loads(out.read_text())["scenarios"]
    assert all(s["ok"] for s in scenarios.values()), scenarios
    assert scenarios["kill9-same-host"]["detected_s"] < 15
    assert "cannot match" in scenarios["mismatch-names"]["message"]
    proc = _shoal("bench", "report", "--results", str(out.parent),
                  "--out", str(tmp_path / "BENCHMARKS.md"))
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "RELIABILITY.md").read_text()
    assert "| `kill9-same-host`" in text and "as designed" in text and "**wrong**" not in text


def test_elastic_section_reports_medians_and_targets() -> None:
    from shoal.bench.elastic import section
    data = {"workers": 3, "targets_s": {"default": 10.0, "fast": 3.0},
            "median_recovery_s": {"default": 0.5, "fast": 0.4},
            "trials": [{"setting": "default", "recovery_s": 0.5},
                       {"setting": "fast", "recovery_s": 0.4}]}
    text = "\n".join(section(data))
    assert "| default | 0.50 s | 0.50 | < 10 s |" in text
    assert "| fast | 0.40 s | 0.40 | < 3 s |" in text and "--trials 1" in text


def test_fsdp_bench_times_both_backends_and_compares_weights(tmp_path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "fsdp.json"
    proc = _shoal("bench", "fsdp", "--np", "2", "--trials", "2", "--steps", "1", "--layers",
                  "1", "--width", "32", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"][0]
    assert res["np"] == 2 and set(res["step_s"]) == {"shoal", "gloo"}
    assert res["step_s"]["shoal"]["n"] == 2 and res["ratio_gloo_over_shoal"] > 0
    assert res["max_weight_diff"] < 1e-5  # same data, same model: the same training
    # the overlap measurement saw the same collectives on both backends, and replaying them
    # (on copies) changed no weight
    shoal_o, gloo_o = res["overlap"]["shoal"], res["overlap"]["gloo"]
    assert shoal_o["collectives"] == gloo_o["collectives"] >= 2
    for o in (shoal_o, gloo_o):
        assert o["alone_s"] > 0 and o["exposed_s"] > 0 and 0 <= o["hidden"] <= 1
    from shoal.bench.fsdp import section
    assert "FSDP2" in "\n".join(section({"results": [res]}))


def test_ddp_bench_alternates_both_backends_in_one_job_and_compares_weights(tmp_path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "ddp.json"
    proc = _shoal("bench", "ddp", "--np", "2", "--archs", "small-cnn", "--settings", "16:4",
                  "--trials", "3", "--steps", "1", "--breakdown", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"][0]
    (row,) = res["rows"]
    assert (row["arch"], row["image_size"], row["batch"], row["np"]) == ("small-cnn", 16, 4, 2)
    assert row["step_s"]["shoal"]["n"] == row["step_s"]["gloo"]["n"] == 3
    assert row["ratio_gloo_over_shoal"]["n"] == 3 and row["ratio_gloo_over_shoal"]["median"] > 0
    assert row["images_per_s"]["shoal"] > 0 and row["images_per_s"]["gloo"] > 0
    assert row["max_weight_diff"] < 1e-5  # same data, same model: the same training
    assert set(row["breakdown_ms_over_local"]) == {
        "shoal", "gloo", "shoal-no-buffer-sync", "gloo-no-buffer-sync"}
    from shoal.bench.ddp import section
    text = "\n".join(section({"results": [res]}))
    assert "| 2 | small-cnn | 16, 4 |" in text


def test_tiny_loader_run(tmp_path) -> None:
    """``shoal bench loader`` on a few dozen photographs, both pipelines, with and without
    AutoAugment: a rate for each, and its BENCHMARKS.md section."""
    from shoal.bench.loader import section
    out = tmp_path / "loader.json"
    frameworks = "torch,tensorflow" if importlib.util.find_spec("tensorflow") else "torch"
    proc = subprocess.run([sys.executable, "-m", "shoal.cli", "bench", "loader", "--data",
                           str(tmp_path / "photos"), "--records", "40", "--trials", "1",
                           "--images", "32", "--frameworks", frameworks, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {(r["framework"], r["augmenter"]): r for r in data["results"]}
    assert set(rows) == {(f, a) for f in frameworks.split(",") for a in ("none", "autoaugment")}
    assert all(r["images_per_s"] > 0 and len(r["trials"]) == 1 for r in rows.values())
    assert len(list((tmp_path / "photos").glob("train-*"))) == 8
    text = "\n".join(section(data))
    assert "| torch | none |" in text and "target 400 images/s" in text


def _result(times: dict[str, float]) -> dict:
    stat = {m: {"1024": {"min": t, "median": t * 1.1, "busbw_GBps": 1.0}}
            for m, t in times.items()}
    return {"np": 2, "missing": {}, "sizes": [1024], "algorithm": "shm", "methods": stat}


def test_deepspeed_is_compared_with_shoal_on_torch_tensors_and_runs_are_summarised() -> None:
    from shoal.bench.allreduce import format_summary, format_table, ratios, summarize_runs
    runs = [_result({"shoal": 1.0, "shoal-torch": 2.0, "deepspeed": 4.0, "gloo": 0.5,
                     "memcpy": 0.1}),
            _result({"shoal": 1.0, "shoal-torch": 6.0, "deepspeed": 4.0, "gloo": 1.0,
                     "memcpy": 0.1}),
            _result({"shoal": 1.0, "shoal-torch": 3.0, "deepspeed": 4.0, "gloo": 2.0,
                     "memcpy": 0.1})]
    # the medians' ratio, shoal through the peer's kind of array
    assert ratios(runs[0]) == {"deepspeed": {"1024": 0.5}, "gloo": {"1024": 2.0}}
    table = format_table(runs[0])
    assert "shoal/deepspeed" in table and "0.50x" in table and "shoal-torch ms" in table
    rep = summarize_runs(runs)
    assert rep["summary"]["deepspeed"]["1024"] == {"median": 0.75, "worst": 1.5, "best": 0.5}
    assert rep["summary"]["gloo"]["1024"]["median"] == 1.0
    assert "worst 1.50x" in format_summary(rep)
    from shoal.bench.allreduce import section
    text = "\n".join(section({"command": "shoal bench allreduce --peers deepspeed",
                              "results": [runs[-1]], "repeats": [rep]}))
    assert "| 1 KiB | 0.75x | 0.50x | 1.50x |" in text and "2 ranks" in text


def test_deepspeed_without_its_venv_is_reported_missing(tmp_path) -> None:
    out = tmp_path / "ds.json"
    env = {**os.environ, "SHOAL_PEERS_VENV": str(tmp_path / "none")}
    proc = subprocess.run([sys.executable, "-m", "shoal.cli", "bench", "allreduce", "--np",
                           "2", "--sizes", "4K", "--trials", "1", "--peers", "deepspeed",
                           "--out", str(out)], capture_output=True, text=True, timeout=240,
                          env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())["results"][0]
    assert "deepspeed" in res["missing"] and "deepspeed" not in res["methods"]
