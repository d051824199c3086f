"""``shoal.run`` (Horovod's ``horovod.run``): a function on N ranks started by shoalrun, its
results returned by rank, a rank's exception raised to the caller with its rank."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _allreduce_then(scale: float, shift: float = 0.0) -> dict:
    import numpy as np

    import shoal
    shoal.init()
    total = shoal.allreduce(np.full(3, shoal.rank() + 1.0), op=shoal.Sum, name="run")
    return {"rank": shoal.rank(), "size": shoal.size(), "v": float(total[0]) * scale + shift}


def _fails_on_one() -> int:
    import shoal
    shoal.init()
    if shoal.rank() == 1:
        raise KeyError("boom on rank 1")
    return shoal.rank()


@pytest.fixture
def _workers_find_this_file(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = [str(Path(__file__).parent), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
    for var in [v for v in os.environ if v.startswith("SHOAL_")]:
        monkeypatch.delenv(var)


@pytest.mark.usefixtures("_workers_find_this_file")
@pytest.mark.parametrize("n", [2, 3])
def test_run_returns_each_ranks_result_in_rank_order(n: int) -> None:
    import shoal
    got = shoal.run(_allreduce_then, args=(2.0,), kwargs={"shift": 1.0}, np=n)
    want = n * (n + 1) / 2 * 2.0 + 1.0
    assert got == [{"rank": r, "size": n, "v": want} for r in range(n)]


@pytest.mark.usefixtures("_workers_find_this_file")
def test_run_raises_the_ranks_error_and_a_bad_np() -> None:
    import shoal
    from shoal.runner.func import RunFuncError
    with pytest.raises(RunFuncError, match=r"rank 1 raised KeyError: 'boom on rank 1'") as info:
        shoal.run(_fails_on_one, np=2)
    assert "Traceback" in str(info.value) and "rank 0 raised" not in str(info.value)
    with pytest.raises(ValueError, match="np must be at least 1"):
        shoal.run(_fails_on_one, np=0)
    with pytest.raises(TypeError):
        shoal.run(_fails_on_one, np=2, no_such_argument=1)  # type: ignore[call-arg]


def test_horovod_run_under_the_switch_takes_a_function_from_main() -> None:
    """A script's own function (defined in ``__main__``), as Horovod's examples pass it."""
    code = ("import horovod\n"
            "def fn(x):\n    import shoal\n    shoal.init()\n    return (shoal.rank(), x)\n"
            "print(horovod.run(fn, args=('a',), np=2, use_gloo=True, verbose=False))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "shoal.as", "horovod", "-c", code], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[(0, 'a'), (1, 'a')]", proc.stdout
