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
