"""Summary statistics shared by every benchmark."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["human_bytes", "parse_size", "stats"]


def stats(samples: Sequence[float]) -> dict[str, float]:
    """min, median and spread ((p90 - p10) / median) of a list of seconds."""
    a = np.asarray(samples, dtype=np.float64)
    med = float(np.median(a))
    p10, p90 = np.percentile(a, [10, 90])
    return {"min": float(a.min()), "median": med, "spread": float((p90 - p10) / med)
            if med else 0.0, "n": int(a.size)}


def parse_size(text: str) -> int:
    """``4K`` -> 4096, ``64M`` -> 67108864 (binary units)."""
    from ..core.config import parse_bytes
    return parse_bytes(text)


def human_bytes(n: int) -> str:
    """4096 -> ``4 KiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"
