"""Atomic checkpoints: written by rank 0 only, to a temporary file renamed into place.

A checkpoint holds the model, the optimizer (its moments included), the weight EMA, the AMP
grad scaler, the epoch and global step, and every rank's random-number state (Python, numpy,
torch), so that a resumed run continues with identical weights, optimizer state and random
streams. Rank 0 reads it on resume and sends it to the others (no shared file system needed).
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["CHECKPOINT_NAME", "capture_rng", "load_checkpoint", "resolve_checkpoint",
           "restore_rng", "save_checkpoint"]

#: The file name of the latest checkpoint inside ``--model_dir``.
CHECKPOINT_NAME = "checkpoint.pt"


def capture_rng(np_rng: np.random.Generator | None = None) -> dict[str, Any]:
    """This process's random-number state (and that of ``np_rng`` if given)."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if np_rng is not None:
        state["np_rng"] = np_rng.bit_generator.state
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any], np_rng: np.random.Generator | None = None) -> None:
    """Undo everything since :func:`capture_rng` took ``state``."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if np_rng is not None and "np_rng" in state:
        np_rng.bit_generator.state = state["np_rng"]
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically: a temporary file in the same directory, fsync,
    then ``os.replace``; a crash leaves the previous checkpoint intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def resolve_checkpoint(where: str | os.PathLike[str]) -> Path:
    """A checkpoint file, or the :data:`CHECKPOINT_NAME` inside a directory.

    Raises:
        FileNotFoundError: there is no checkpoint there.
    """
    path = Path(where)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {os.fspath(where)!r} (looked for {path})")
    return path


def load_checkpoint(where: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` onto the CPU."""
    return torch.load(resolve_checkpoint(where), map_location="cpu", weights_only=False)
