"""The package as users get it: the sdist and the wheel built from it (``python -m build``),
the wheel installed into a fresh environment (not the editable tree), and from there a 2-rank
job through ``shoalrun``, a Horovod script under ``--as horovod``, and
``init_process_group("shoal")`` in a process that never imports shoal. Package data, entry
points and the import hook missing from the wheel fail here, not for a user. The fresh
environment reuses the suite's installed frameworks (numpy, torch) through a path file, and
shoal comes from the wheel alone."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

JOB = """
import numpy as np, shoal
shoal.init()
got = shoal.allreduce(np.full(3, shoal.rank() + 1.0), op=shoal.Sum, name="x")
print("job", shoal.rank(), got.tolist(), shoal.__file__, flush=True)
shoal.shutdown()
"""

HOROVOD = """
import torch, horovod.torch as hvd
hvd.init()
t = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum)
print("horovod", hvd.rank(), t.tolist(), hvd.__name__, flush=True)
"""

NO_IMPORT = """
import sys, tempfile, torch, torch.distributed as dist
path = tempfile.mkstemp()[1]
dist.init_process_group("shoal", init_method="file://" + path, rank=0, world_size=1)
t = torch.ones(2)
dist.all_reduce(t)
print("c10d", t.tolist(), "shoal" in sys.modules, sys.modules["shoal"].__file__, flush=True)
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_the_wheel_installs_and_runs_a_job(tmp_path: Path) -> None:
    pytest.importorskip("build")
    pytest.importorskip("torch")
    dist = tmp_path / "dist"
    # (no isolation: the build backend is the suite's, and nothing is fetched)
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist),
                    str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next(dist.glob("shoal-*.whl"))
    sdist = next(dist.glob("shoal-*.tar.gz"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith("dist-info/METADATA"))).decode()
        entry = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    for data in ("shoal/bench/data/", "shoal/alias/boot/", "shoal/bench/peer_workers/"):
        assert any(n.startswith(data) for n in names), (data, names[:20])
    assert "shoal = shoal._torch_hook:register" in entry and "shoalrun" in entry, entry
    for field in ("Name: shoal", "Requires-Python: >=3.11", "Requires-Dist: numpy",
                  "Provides-Extra: torch", "Classifier: ", "License"):
        assert field in meta, field
    with tarfile.open(sdist) as t:
        members = t.getnames()
    assert any(m.endswith("/pyproject.toml") for m in members)
    assert any(m.endswith("/src/shoal/__init__.py") for m in members)

    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True,
                   timeout=120)
    python = env / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--quiet", "--no-deps", "--disable-pip-version-check", str(wheel)],
                   check=True, capture_output=True, timeout=300)
    site = subprocess.run([str(python), "-c", "import sysconfig; "
                           "print(sysconfig.get_paths()['purelib'])"], check=True,
                          capture_output=True, text=True).stdout.strip()
    # the frameworks the suite installed, after the wheel's own shoal on the path
    (Path(site) / "suite.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SHOAL_", "PYTHONPATH", "OMPI_", "MASTER_", "RANK"))}
    clean.update(OMP_NUM_THREADS="1")

    def run(*argv: str) -> str:
        proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                              timeout=180, env=clean, cwd=tmp_path)
        assert proc.returncode == 0, (argv, proc.stdout[-2000:], proc.stderr[-3000:])
        return proc.stdout

    shoalrun = env / "bin" / "shoalrun"
    out = run(shoalrun, "-np", "2", python, "-c", JOB)
    rows = sorted(line.split("job ", 1)[1] for line in out.splitlines() if "job " in line)
    assert len(rows) == 2 and all("[3.0, 3.0, 3.0]" in r for r in rows), out
    assert all(str(env) in r for r in rows), rows  # shoal from the wheel, not the tree
    out = run(shoalrun, "--as", "horovod", "-np", "2", python, "-c", HOROVOD)
    assert out.count("[3.0] shoal.torch") == 2, out
    out = run(python, "-c", NO_IMPORT)
    assert "c10d [1.0, 1.0] True" in out and str(env) in out, out
