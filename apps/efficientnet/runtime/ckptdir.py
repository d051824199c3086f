"""A directory of the last K checkpoints, each written atomically, and the newest intact one
found on resume; the file format is the caller's (PyTorch's ``torch.save``, Keras's ``.npz``).

Files are ``ckpt-<step><suffix>`` (nine digits, so names sort by step). Each is written to a
temporary file in the same directory, fsynced, renamed into place, and the directory fsynced:
a crash at any point leaves every earlier checkpoint intact, and the newest is either whole or
absent. Only then are the oldest beyond ``keep`` removed. No framework is imported here: the
PyTorch and the Keras applications share it.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["CheckpointDir", "atomic_write", "checkpoint_name", "resume"]


def checkpoint_name(step: int, suffix: str = ".pt") -> str:
    """The file name of the checkpoint taken after ``step`` optimizer steps."""
    return f"ckpt-{step:09d}{suffix}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], None]) -> Path:
    """``write`` the file at ``path`` atomically: a temporary file in the same directory,
    fsync, ``os.replace``, fsync of the directory; a crash leaves what was there intact."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class CheckpointDir:
    """The checkpoints of one run: ``root/ckpt-<step><suffix>``, the last ``keep`` of them,
    written with ``write(state, file)`` and read with ``read(path)``; ``legacy`` names a
    single file an earlier version wrote, found as the oldest."""

    def __init__(self, root: str | os.PathLike[str], keep: int,
                 write: Callable[[Any, IO[bytes]], None], read: Callable[[Path], Any],
                 suffix: str = ".pt", legacy: str | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, not {keep}")
        self.root, self.keep, self.suffix, self.legacy = Path(root), keep, suffix, legacy
        self._write, self._read = write, read
        self._name = re.compile(rf"^ckpt-(\d+){re.escape(suffix)}$")

    def files(self) -> list[Path]:
        """The checkpoints here, newest (highest step) first; the legacy file last."""
        if not self.root.is_dir():
            return []
        steps = {p: int(m.group(1)) for p in self.root.iterdir()
                 if (m := self._name.match(p.name))}
        found = sorted(steps, key=steps.__getitem__, reverse=True)
        legacy = self.root / self.legacy if self.legacy else None
        return found + ([legacy] if legacy is not None and legacy.is_file() else [])

    def save(self, state: Any, step: int) -> Path:
        """Write the checkpoint of ``step``, then remove the oldest beyond ``keep``."""
        path = atomic_write(self.root / checkpoint_name(step, self.suffix),
                            lambda f: self._write(state, f))
        for old in [p for p in self.files() if p.name != self.legacy][self.keep:]:
            old.unlink(missing_ok=True)
        return path

    def at(self, root: str | os.PathLike[str]) -> CheckpointDir:
        """The checkpoints of the same format in another directory."""
        return CheckpointDir(root, self.keep, self._write, self._read, self.suffix, self.legacy)

    def read(self, path: str | os.PathLike[str]) -> Any:
        """One checkpoint file's state."""
        return self._read(Path(path))

    def newest(self, say: Callable[[str], None] = print) -> tuple[Path, Any] | None:
        """The newest checkpoint that reads whole, and its state; a newer one that does not
        (truncated, corrupt) is skipped, saying so. None when there is none."""
        for path in self.files():
            try:
                return path, self._read(path)
            except Exception as exc:  # a damaged file fails in many ways
                say(f"WARNING: checkpoint {path} is unreadable ({type(exc).__name__}: "
                    f"{str(exc)[:120]}); falling back to the one before it")
        return None


def resume(args: argparse.Namespace, store: CheckpointDir, is_root: bool,
           broadcast: Callable[[str | None], str | None],
           say: Callable[[str], None]) -> tuple[str | None, Any]:
    """What ``--resume`` restores, for either application: the checkpoint's path on every
    rank (``broadcast`` from rank 0) and its state on rank 0; ``(None, None)`` for a fresh
    start. ``auto`` looks in ``store`` (the checkpoint directory), a path is a file or a
    directory, ``none`` and a benchmark's ``auto`` start fresh (a benchmark writes none).
    ``--mode eval`` without a checkpoint stops, unless ``--eval_untrained``."""
    where, state = None, None
    skip = args.resume == "none" or (args.resume == "auto" and args.mode == "training_benchmark")
    if is_root and not skip:
        path = Path(args.resume)
        if args.resume == "auto":
            found = store.newest(say)
        elif path.is_dir():
            found = store.at(path).newest(say)
            if found is None:
                raise FileNotFoundError(f"no readable checkpoint in {args.resume!r}")
        elif path.is_file():
            found = path, store.read(path)
        else:
            raise FileNotFoundError(f"no checkpoint at {args.resume!r}")
        if found is not None:
            where, state = str(found[0]), found[1]
    if not skip:  # (MultiWorkerMirrored's benchmark backend has no broadcast)
        where = broadcast(where)
    if where is None and args.mode == "eval":
        if not args.eval_untrained:
            raise SystemExit(f"--mode eval needs a trained model: there is no checkpoint in "
                             f"--checkpoint_dir {args.checkpoint_dir}; give --resume PATH, or "
                             f"--eval_untrained to score a freshly initialised model on "
                             f"purpose")
        say("WARNING: --eval_untrained: scoring an UNTRAINED, randomly initialised model (no "
            "checkpoint); expect chance accuracy")
    elif where is None and args.resume == "auto" and not skip:
        say("no checkpoint to resume from: starting fresh")
    return where, state
