"""Launching shoal jobs: the ``shoalrun`` command (``python -m shoal.runner``).

Modules, from the command line down: :mod:`~shoal.runner.launch` (``main``, the worker
environment), :mod:`~shoal.runner.options` (every flag and its ``SHOAL_*`` variable, one
table), :mod:`~shoal.runner.hosts` (``-H``, hostfiles, placement, addresses),
:mod:`~shoal.runner.supervise` (start, tag output, watch the rendezvous, fail fast),
:mod:`~shoal.runner.runners` (local, ssh and netns hosts) with its remote end
:mod:`~shoal.runner.bootstrap`, :mod:`~shoal.runner.sagemaker` and
:mod:`~shoal.runner.checkbuild`.
"""

from __future__ import annotations

from .launch import main

__all__ = ["main"]
