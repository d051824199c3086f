"""``scripts/gpu-check.sh --dry-run``: every step of the GPU check walked on CPU tensors
through the device stage's stand-in, proving the script before GPU time is spent on it."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


#: The application's data modules' needs, which the GPU machine lacks: the check must not
#: import them (the blocker packages below fail any import of them).
BLOCKED = ("crc32c", "PIL", "tqdm", "google")


def test_gpu_check_dry_run_passes_and_writes_one_json(tmp_path) -> None:
    out = tmp_path / "gpu-check.json"
    blockers = tmp_path / "blocked"
    for name in BLOCKED:
        (blockers / name).mkdir(parents=True)
        (blockers / name / "__init__.py").write_text(
            f"raise ImportError('{name} is not on the GPU machine')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env["PYTHONPATH"] = str(blockers)
    proc = subprocess.run([str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(out.read_text())
    assert report["ok"] and report["dry_run"] and report["complete"]
    checks = report["checks"]
    assert set(checks) == {"collectives", "amp", "syncbn_ddp", "profile", "device_group",
                           "benchmark"}
    for name in ("collectives", "amp", "syncbn_ddp", "profile", "device_group"):
        ranks = checks[name]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1] and all(r["ok"] for r in ranks), ranks
        assert all(r["device"] == "cpu" for r in ranks)
    profile = checks["profile"]["ranks"][0]
    assert profile["shoal_host_waits_before_step"] == 0 and profile["buckets"] > 1
    assert profile["host_waits_by_shoal_threads"] > 0  # the stand-in's copies were waited for
    assert profile["training_threads"]  # the threads gradients became ready on were watched
    solo = checks["device_group"]["ranks"][0]
    assert solo["backend"] == "gloo" and solo["reductions"] == 12
    rows = checks["benchmark"]["rows"]
    assert [(r["amp"], r["ranks"]) for r in rows] == [(True, 1), (True, 2)]
    assert all(r["images_per_s"] > 0 for r in rows)
    assert all(r["independent_images_per_s"] > 0 for r in rows if r["ranks"] > 1)
    assert "passed" in proc.stdout


def test_gpu_check_without_a_gpu_fails_and_says_why(tmp_path) -> None:
    out = tmp_path / "gpu-check.json"
    env = dict({k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")},
               CUDA_VISIBLE_DEVICES="", PYTHON=str(ROOT / ".venv" / "bin" / "python"))
    proc = subprocess.run([str(ROOT / "scripts" / "gpu-check.sh"), "--out", str(out),
                           "--only", "collectives"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=200)
    assert proc.returncode == 1
    report = json.loads(out.read_text())
    assert not report["ok"] and "no CUDA GPU" in report["error"]
    assert report["complete"] and set(report["checks"]) == {"collectives"}


def test_a_cut_run_keeps_the_steps_it_finished(tmp_path) -> None:
    from shoal.bench.gpucheck.main import _write
    out = tmp_path / "gpu-check.json"
    report: dict = {"dry_run": True}
    _write(out, report, {"collectives": {"ok": True}}, 0.0, complete=False)
    saved = json.loads(out.read_text())
    assert saved["checks"] == {"collectives": {"ok": True}}
    assert saved["complete"] is False and saved["ok"] is False  # not done is not passed


def test_a_gpu_report_becomes_a_benchmarks_section_and_a_dry_run_does_not(tmp_path) -> None:
    from shoal.bench.report import build
    report = {"dry_run": False, "ok": True, "gpu": "NVIDIA H200", "torch": "2.11",
              "checks": {"profile": {"ranks": [{"shoal_host_waits_before_step": 0,
                                                "gpu_idle_share_of_step": 0.12}]},
                         "benchmark": {"rows": [
                             {"image_size": 224, "amp": True, "ranks": 2, "images_per_s": 10.0,
                              "independent_images_per_s": 11.0, "share_of_independent": 0.9}]}}}
    (tmp_path / "gpu-check.json").write_text(json.dumps(report))
    text = build(str(tmp_path))
    assert "## GPU: scripts/gpu-check.sh" in text and "| 224 | True | 2 | 10.0 | 11.0" in text
    (tmp_path / "gpu-check.json").write_text(json.dumps({**report, "dry_run": True}))
    assert "## GPU" not in build(str(tmp_path))
