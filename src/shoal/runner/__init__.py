"""Launching shoal jobs: the ``shoalrun`` command (``python -m shoal.runner``)."""

from __future__ import annotations

from .launch import main

__all__ = ["main"]
