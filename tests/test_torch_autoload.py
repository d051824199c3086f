"""Backend "shoal" registered by installation: torch runs shoal's ``torch.backends`` entry
point at ``import torch``, so a process that never imports shoal can name the backend; the
hook imports neither ``shoal.core`` nor ``shoal.torch`` until the first group is made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from harness import free_port_pair

ROOT = Path(__file__).resolve().parents[1]

STOCK = """
import sys
import torch
import torch.distributed as dist
before = sorted(m for m in ("shoal.core", "shoal.torch") if m in sys.modules)
assert before == [], before
assert "SHOAL" in dist.Backend._plugins  # the hook ran at torch's import
dist.init_process_group("shoal", init_method="env://")
t = torch.full((3,), float(dist.get_rank() + 1))
dist.all_reduce(t)
print("result", before, t.tolist(), flush=True)
dist.destroy_process_group()
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHOAL_", "MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "TORCH_"))}
    env.update(extra)
    return env


def _entry_point_installed() -> bool:
    from importlib.metadata import entry_points
    return any(ep.name == "shoal" for ep in entry_points(group="torch.backends"))


@pytest.mark.skipif(not _entry_point_installed(),
                    reason="shoal is not installed with its torch.backends entry point "
                           "(pip install -e .)")
def test_a_stock_script_names_the_backend_without_importing_shoal(tmp_path: Path) -> None:
    port = free_port_pair()
    procs = [subprocess.Popen([sys.executable, "-c", STOCK], cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port), OMP_NUM_THREADS="1"))
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert "result [] [3.0, 3.0, 3.0]" in out, out + err[-2000:]


def test_the_hook_imports_nothing_of_shoal_and_never_raises() -> None:
    code = ("import sys, warnings\n"
            "import shoal._torch_hook as hook\n"
            "import torch.distributed as dist\n"
            "hook.register(); hook.register()\n"  # again: harmless
            "assert 'SHOAL' in dist.Backend._plugins\n"
            "assert not [m for m in sys.modules if m.startswith(('shoal.core', 'shoal.torch'))]\n"
            "real = dist.Backend.register_backend\n"
            "dist.Backend._plugins.pop('SHOAL')\n"
            "def boom(*a, **k): raise RuntimeError('no')\n"
            "dist.Backend.register_backend = boom\n"
            "with warnings.catch_warnings(record=True) as seen:\n"
            "    warnings.simplefilter('always')\n"
            "    hook.register()\n"
            "assert any('was not registered' in str(w.message) for w in seen), seen\n"
            "dist.Backend.register_backend = real\n"
            "import shoal.torch\n"  # the import registers it, as it always did
            "assert 'SHOAL' in dist.Backend._plugins\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=_env(TORCH_DEVICE_BACKEND_AUTOLOAD="0",
                                                PYTHONPATH=str(ROOT / "src")))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
