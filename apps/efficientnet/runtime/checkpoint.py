"""Checkpoints: a directory of the last ``--keep_checkpoints`` ones, each written atomically by
rank 0, and the newest intact one found on resume.

A checkpoint holds the model, the optimizer (its moments included), the weight EMA, the AMP
grad scaler, Lookahead's slow weights, the epoch and global step, the training stream's
position, and every rank's random-number state (Python, numpy, torch), so that a resumed run
continues with identical weights, optimizer state, data and random streams. Rank 0 reads it on
resume and sends it to the others (no shared file system needed).

Files are ``ckpt-<step>.pt`` (nine digits, so names sort by step). Each is written to a
temporary file in the same directory, fsynced, renamed into place, and the directory fsynced:
a crash at any point leaves every earlier checkpoint intact, and the newest is either whole or
absent. Only then are the oldest beyond ``keep`` removed.
"""

from __future__ import annotations

import os
import random
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["CHECKPOINT_NAME", "CheckpointDir", "capture_rng", "checkpoint_name",
           "load_checkpoint", "restore_rng", "save_checkpoint"]

#: The single file name earlier versions wrote; still found (as the oldest) on resume.
CHECKPOINT_NAME = "checkpoint.pt"
_NAME = re.compile(r"^ckpt-(\d+)\.pt$")


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint taken after ``step`` optimizer steps."""
    return f"ckpt-{step:09d}.pt"


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically: a temporary file in the same directory, fsync,
    ``os.replace``, fsync of the directory; a crash leaves what was there intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _read(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)


class CheckpointDir:
    """The checkpoints of one run: ``root/ckpt-<step>.pt``, the last ``keep`` of them."""

    def __init__(self, root: str | os.PathLike[str], keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, not {keep}")
        self.root, self.keep = Path(root), keep

    def files(self) -> list[Path]:
        """The checkpoints here, newest (highest step) first; an earlier version's
        ``checkpoint.pt`` last."""
        if not self.root.is_dir():
            return []
        found = sorted((p for p in self.root.iterdir() if _NAME.match(p.name)),
                       key=lambda p: int(_NAME.match(p.name).group(1)),  # type: ignore[union-attr]
                       reverse=True)
        legacy = self.root / CHECKPOINT_NAME
        return found + ([legacy] if legacy.is_file() else [])

    def save(self, state: dict[str, Any], step: int) -> Path:
        """Write the checkpoint of ``step``, then remove the oldest beyond ``keep``."""
        path = save_checkpoint(self.root / checkpoint_name(step), state)
        for old in [p for p in self.files() if p.name != CHECKPOINT_NAME][self.keep:]:
            old.unlink(missing_ok=True)
        return path

    def newest(self, say: Callable[[str], None] = print
               ) -> tuple[Path, dict[str, Any]] | None:
        """The newest checkpoint that reads whole, and its state; a newer one that does not
        (truncated, corrupt) is skipped, saying so. None when there is none."""
        for path in self.files():
            try:
                return path, _read(path)
            except Exception as exc:  # torch raises several kinds for a damaged file
                say(f"WARNING: checkpoint {path} is unreadable ({type(exc).__name__}: "
                    f"{str(exc)[:120]}); falling back to the one before it")
        return None


def load_checkpoint(where: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint file, or the newest intact one in a directory, onto the CPU.

    Raises:
        FileNotFoundError: there is no (readable) checkpoint there.
    """
    path = Path(where)
    if path.is_dir():
        found = CheckpointDir(path).newest()
        if found is None:
            raise FileNotFoundError(f"no readable checkpoint in {os.fspath(where)!r}")
        return found[1]
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {os.fspath(where)!r}")
    return _read(path)
