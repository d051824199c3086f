"""The suite's time budget (tests/conftest.py): pytest prints its own time, and a run past
the budget fails even where every test passed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def _pytest(budget: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTEST_BUDGET_S": budget}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(TESTS / "test_negotiator.py"), "-k", "steady_state"],
                          capture_output=True, text=True, timeout=120, env=env,
                          cwd=TESTS.parent)


def test_a_run_past_its_budget_fails_and_says_so() -> None:
    within, past = _pytest("600"), _pytest("0.001")
    assert within.returncode == 0 and "pytest's time:" in within.stdout, within.stdout
    assert past.returncode == 1, past.stdout
    assert "past its budget" in past.stdout and " passed" in past.stdout, past.stdout


PROBE = '''
import json, os, time
import pytest

def _note(name):
    start = time.monotonic()
    time.sleep(0.6)
    with open(os.path.join(os.environ["PROBE_DIR"], name), "w") as f:
        json.dump([start, time.monotonic()], f)

@pytest.mark.parametrize("i", range(6))
def test_shared(i):
    _note(f"shared{i}")

@pytest.mark.serial
@pytest.mark.parametrize("i", range(2))
def test_alone(i):
    _note(f"alone{i}")
'''


def test_serial_tests_run_alone_on_several_workers(tmp_path: Path) -> None:
    """scripts/test.sh runs the suite on pytest-xdist's workers; a test marked ``serial``
    overlaps no other test, while the others do overlap (the lock in tests/conftest.py)."""
    import json
    (tmp_path / "test_probe.py").write_text(PROBE)
    env = {**os.environ, "PROBE_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent / "src")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "conftest", "-n", "3", "-o", "addopts=", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    spans = {p.name: json.loads(p.read_text()) for p in tmp_path.iterdir()
             if p.name.startswith(("shared", "alone"))}
    assert len(spans) == 8, sorted(spans)

    def overlap(a: str, b: str) -> bool:
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
    for alone in ("alone0", "alone1"):
        assert not [o for o in spans if o != alone and overlap(alone, o)], spans
    shared = [n for n in spans if n.startswith("shared")]
    assert any(overlap(a, b) for a in shared for b in shared if a < b), spans
