"""The README's main job, exactly as ``scripts/main.sh`` runs it, shortened to one epoch:
set-up (a no-op once done), the bundled digits prepared, 2 ranks through shoalrun; it must
print a summary with accuracy and images/second."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "python").exists(),
                    reason="scripts/main.sh runs the project's .venv (scripts/setup.sh)")
def test_main_job_one_epoch(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "MASTER_"))}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "main.sh"), "--max_epochs", "1",
                           "--model_dir", str(tmp_path / "run")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = [line for line in proc.stdout.splitlines() if "SUMMARY" in line]
    assert summary, proc.stdout[-3000:]
    accuracy = re.search(r"eval_accuracy_top_1 ([\d.]+)%", summary[0])
    speed = re.search(r"avg_exp_per_second_training ([\d.]+) samples/s", summary[0])
    assert accuracy and speed, summary[0]
    assert 0.0 <= float(accuracy.group(1)) <= 100.0 and float(speed.group(1)) > 0
    assert "on 2 rank(s)" in proc.stdout, proc.stdout[-2000:]
