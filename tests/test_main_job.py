"""The README's main job, exactly as ``scripts/main.sh`` runs it, shortened to one epoch:
set-up (a no-op once done), the bundled digits prepared, 2 ranks through shoalrun; it must
print a summary with accuracy and images/second."""

from __future__ import annotations

import os
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
    lines = [line.split(": ", 1)[-1] for line in proc.stdout.splitlines()]
    head = [i for i, line in enumerate(lines) if line.split()[:1] == ["summary"]]
    assert head, proc.stdout[-3000:]
    table = {row.split()[0]: row.split()[1:] for row in lines[head[0] + 1:head[0] + 3]}
    assert lines[head[0]].split() == ["summary", "loss", "top-1", "top-5", "img/s"]
    _, top1, _, speed = table["eval"][:4]
    assert 0.0 <= float(top1.rstrip("%")) <= 100.0
    assert float(table["training"][3]) > 0  # images/s of the training
    assert float(speed) > 0
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80  # fits a terminal
    assert ": 2 ranks (shoal, cpu)" in proc.stdout, proc.stdout[-2000:]
