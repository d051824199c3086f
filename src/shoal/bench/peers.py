"""Where the benchmark peers (torch gloo, Horovod, MPI, DeepSpeed) live, and which of them work.

The peers are installed by ``scripts/install-peers.sh`` into their own virtual environment,
``<repo>/.peers/venv`` (``SHOAL_PEERS_VENV`` overrides the path), never into shoal's. Nothing
here imports horovod or mpi4py: benchmarks run peer workers as subprocesses of that venv's
python, and this module only finds it and probes it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

__all__ = [
    "PEERS",
    "PEERS_VENV",
    "available_peers",
    "mpirun_command",
    "peer_python",
    "peers_venv",
]

#: The peers, in report order.
PEERS = ("gloo", "horovod", "mpi", "deepspeed")

#: Seconds one import probe may take (importing torch cold takes a few).
PROBE_TIMEOUT_S = 60.0

# One short program per peer: it prints the peer's version, or fails.
_PROBES = {
    "gloo": "import torch, torch.distributed as d; assert d.is_gloo_available(); "
            "print(torch.__version__)",
    "horovod": "import horovod, horovod.torch; print(horovod.__version__)",
    "mpi": "import mpi4py; from mpi4py import MPI; print(mpi4py.__version__)",
    "deepspeed": "import deepspeed; print(deepspeed.__version__)",
}


def _repo_root() -> Path:
    """The checkout this module sits in (src layout), else the working directory."""
    root = Path(__file__).resolve().parents[3]
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def peers_venv() -> Path:
    """The peers' virtual environment: ``$SHOAL_PEERS_VENV``, else ``<repo>/.peers/venv``."""
    override = os.environ.get("SHOAL_PEERS_VENV")
    return Path(override).expanduser() if override else _repo_root() / ".peers" / "venv"


#: The peers venv as resolved at import (call :func:`peers_venv` to see later changes).
PEERS_VENV = peers_venv()


def peer_python() -> str | None:
    """Path of the peers venv's python, or None when the venv has not been installed."""
    python = peers_venv() / "bin" / "python"
    return str(python) if os.access(python, os.X_OK) else None


def _probe(python: str, peer: str) -> str | None:
    """Run the peer's import probe in ``python``; its version, or None if it fails."""
    try:
        proc = subprocess.run(
            [python, "-c", _PROBES[peer]], capture_output=True, text=True,
            timeout=PROBE_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[-1].strip() if proc.returncode == 0 and lines else None


def available_peers() -> dict[str, str | None]:
    """Map each of :data:`PEERS` to the version installed in the peers venv, or None.

    Each peer is probed with a short import in a subprocess (a few seconds each). "mpi" also
    needs ``mpirun`` on PATH. Without a peers venv every peer is None.
    """
    python = peer_python()
    found: dict[str, str | None] = dict.fromkeys(PEERS)
    if python is None:
        return found
    for peer in PEERS:
        if peer == "mpi" and shutil.which("mpirun") is None:
            continue
        found[peer] = _probe(python, peer)
    return found


def mpirun_command(np: int) -> list[str]:
    """The ``mpirun`` prefix that starts ``np`` local ranks.

    Runs as root and past the core count (``--oversubscribe``), and ``--bind-to none``: Open
    MPI's default binds each rank to one core, which on a 2-core machine pins ranks on top of
    each other and of the other side of the benchmark.
    """
    if np < 1:
        raise ValueError(f"np must be >= 1, got {np}")
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np),
            "--bind-to", "none"]
