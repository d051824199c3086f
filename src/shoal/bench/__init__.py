"""``shoal bench``: side-by-side measurements of shoal against its peers and the physical floor."""

from __future__ import annotations

__all__ = ["stats"]

from .stats import stats
