"""``shoalrun --check-build``: what this installation of shoal can do, as a table.

Frameworks are looked up by their installed distribution, without importing them (TensorFlow
takes seconds to import); only torch is imported, to ask whether CUDA is available.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable
from importlib import metadata
from typing import TextIO

__all__ = ["Row", "capabilities", "check_build", "format_table"]

Row = tuple[str, bool, str]  # (name, available, detail)

_FRAMEWORKS = {  # module -> (distributions that provide it, shoal's adapter module)
    "torch": (("torch",), "shoal.torch"),
    "tensorflow": (("tensorflow", "tensorflow-cpu", "tensorflow-macos"), "shoal.tensorflow"),
    "keras": (("keras",), "shoal.keras"),
}


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _version(distributions: tuple[str, ...]) -> str:
    for dist in distributions:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown version"


def _framework_rows() -> list[Row]:
    rows = []
    for module, (dists, adapter) in _FRAMEWORKS.items():
        if not _found(module):
            rows.append((module, False, "not installed"))
            continue
        glue = f"adapter {adapter}" if _found(adapter) else f"no {adapter} adapter yet"
        rows.append((module, True, f"{_version(dists)} ({glue})"))
    return rows


def _gpu_rows() -> list[Row]:
    if not _found("torch"):
        return [("CUDA", False, "torch is not installed, so CUDA cannot be checked")]
    try:
        import torch

        if torch.cuda.is_available():
            return [("CUDA", True, f"torch.cuda: {torch.cuda.device_count()} device(s); "
                                   "tensors are staged through pinned host memory")]
        return [("CUDA", False, "torch.cuda.is_available() is False")]
    except Exception as exc:  # a broken torch install should not break the table
        return [("CUDA", False, f"torch failed to import: {exc}")]


def capabilities() -> list[tuple[str, list[Row]]]:
    """Sections of the table, each a list of (name, available, detail) rows."""
    import numpy

    from .. import __version__
    from ..core.algorithms import ALGORITHMS
    from ..core.compression import Compression

    shm = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    codecs = [Compression.none, Compression.fp16, Compression.bf16]
    sections: list[tuple[str, Callable[[], list[Row]]]] = [
        ("shoal", lambda: [("shoal", True, __version__),
                           ("python", True, sys.version.split()[0]),
                           ("numpy", True, numpy.__version__)]),
        ("Frameworks", _framework_rows),
        ("Transports", lambda: [
            ("shm", shm, "/dev/shm is writable: shared memory between ranks of one host"
             if shm else "/dev/shm is missing or read-only: ranks of one host use tcp"),
            ("tcp", True, "between hosts (and wherever shm is off)")]),
        ("Allreduce algorithms", lambda: [(name, True, "") for name in sorted(ALGORITHMS)]),
        ("GPU support", _gpu_rows),
        ("Compression", lambda: [(c.name, True, f"wire dtype {c.wire or 'unchanged'}")
                                 for c in codecs]),
    ]
    return [(title, rows()) for title, rows in sections]


def format_table(sections: list[tuple[str, list[Row]]]) -> str:
    """Horovod-style text: a heading per section, ``[X]``/``[ ]`` per row."""
    width = max(len(name) for _, rows in sections for name, _, _ in rows)
    lines = []
    for title, rows in sections:
        lines.append(f"{title}:")
        lines += [f"    [{'X' if ok else ' '}] {name:{width}}  {detail}".rstrip()
                  for name, ok, detail in rows]
        lines.append("")
    return "\n".join(lines)


def check_build(out: TextIO | None = None) -> int:
    """Print the table; the exit code (always 0)."""
    print(format_table(capabilities()), file=out or sys.stdout, end="", flush=True)
    return 0
