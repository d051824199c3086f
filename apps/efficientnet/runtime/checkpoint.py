"""PyTorch checkpoints of the application, in a :class:`~.ckptdir.CheckpointDir`.

A checkpoint holds the model, the optimizer (its moments included), the weight EMA, the AMP
grad scaler, Lookahead's slow weights, the epoch and global step, the training stream's
position, and every rank's random-number state (Python, numpy, torch), so that a resumed run
continues with identical weights, optimizer state, data and random streams. Rank 0 reads it on
resume and sends it to the others (no shared file system needed).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from apps.efficientnet.runtime import ckptdir
from apps.efficientnet.runtime.ckptdir import atomic_write, checkpoint_name

__all__ = ["CHECKPOINT_NAME", "capture_rng", "checkpoint_dir", "checkpoint_name",
           "load_checkpoint", "restore_rng", "save_checkpoint"]

#: The single file name earlier versions wrote; still found (as the oldest) on resume.
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


def _write(state: dict[str, Any], f: IO[bytes]) -> None:
    torch.save(state, f)


def _read(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


def checkpoint_dir(root: str | os.PathLike[str], keep: int = 3) -> ckptdir.CheckpointDir:
    """The PyTorch checkpoints in ``root`` (``ckpt-<step>.pt``), the newest ``keep`` kept."""
    return ckptdir.CheckpointDir(root, keep, _write, _read, ".pt", CHECKPOINT_NAME)


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically (see :func:`.ckptdir.atomic_write`)."""
    return atomic_write(path, lambda f: _write(state, f))


def load_checkpoint(where: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint file, or the newest intact one in a directory, onto the CPU.

    Raises:
        FileNotFoundError: there is no (readable) checkpoint there.
    """
    path = Path(where)
    if path.is_dir():
        found = checkpoint_dir(path).newest()
        if found is None:
            raise FileNotFoundError(f"no readable checkpoint in {os.fspath(where)!r}")
        return found[1]
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {os.fspath(where)!r}")
    return _read(path)
