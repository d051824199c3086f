"""Horovod's first elastic Ray API (``horovod.ray.elastic``): ``ElasticRayExecutor``.

Built as Horovod's elastic documentation builds it::

    settings = ElasticRayExecutor.create_settings(verbose=True)   # min_num_proc=..., ...
    executor = ElasticRayExecutor(settings, use_gpu=False, cpus_per_slot=1,
                                  env_vars={"NAME": "value"})
    executor.start()
    results = executor.run(train_fn)        # train_fn() on every worker, workers come and go

It runs on :class:`shoal.ray.RayExecutor`'s elastic job (``min_workers=``), the same driver as
``shoalrun``'s elastic mode; the settings carry the job's bounds, the executor the resources.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from .runner import MiniSettings, RayExecutor

__all__ = ["ElasticRayExecutor", "ElasticSettings"]


@dataclass
class ElasticSettings(MiniSettings):
    """An elastic job's settings (Horovod's ``ElasticSettings``): ``min_num_proc`` workers
    keep the job going, at most ``max_num_proc`` run (None: as many as the cluster holds),
    ``reset_limit`` world changes at most, ``elastic_timeout`` seconds below the minimum
    before the job fails, ``cooldown_range`` for a failed host's return."""

    min_num_proc: int = 1
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600
    num_proc: int = 1
    cooldown_range: tuple[int, int] | None = None
    discovery: Any = None
    elastic: bool = True


class ElasticRayExecutor:
    """Horovod's ``ElasticRayExecutor(settings, use_gpu, cpus_per_slot, gpus_per_slot,
    env_vars, override_discovery)``: ``start()``, then ``run(worker_fn)`` calls
    ``worker_fn()`` on every worker and returns what the workers that finished returned."""

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: int | None = None,
                        reset_limit: int | None = None, elastic_timeout: float = 600,
                        timeout_s: float = 30, ssh_identity_file: str | None = None,
                        nics: set | None = None, min_np: int | None = None,
                        max_np: int | None = None, **kwargs: Any) -> ElasticSettings:
        """Horovod's arguments (``min_np``/``max_np`` are its deprecated spellings of
        ``min_num_proc``/``max_num_proc``); of its other settings, ``verbose``,
        ``cooldown_range``, ``key`` and ``ssh_port`` are taken."""
        if min_np is not None:
            warnings.warn("min_np is deprecated, use min_num_proc instead", DeprecationWarning,
                          stacklevel=2)
            min_num_proc = min_np
        if max_np is not None:
            warnings.warn("max_np is deprecated, use max_num_proc instead", DeprecationWarning,
                          stacklevel=2)
            max_num_proc = max_np
        known = {f.name for f in fields(ElasticSettings)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"ElasticRayExecutor.create_settings() got unexpected arguments "
                            f"{unknown}; it takes min_num_proc, max_num_proc, reset_limit, "
                            f"elastic_timeout, timeout_s, nics, verbose, cooldown_range")
        return ElasticSettings(min_num_proc=min_num_proc, max_num_proc=max_num_proc,
                               reset_limit=reset_limit, elastic_timeout=elastic_timeout,
                               num_proc=min_num_proc, timeout_s=timeout_s,
                               ssh_identity_file=ssh_identity_file, nics=nics, **kwargs)

    def __init__(self, settings: Any, use_gpu: bool = False, cpus_per_slot: float = 1,
                 gpus_per_slot: float | None = None, env_vars: dict | None = None,
                 override_discovery: bool = True, **bounds: Any) -> None:
        if gpus_per_slot and not use_gpu:
            raise ValueError("gpus_per_slot is set, but use_gpu is False. use_gpu must be "
                             "True if gpus_per_slot is set.")
        gpus_per_slot = gpus_per_slot or int(use_gpu)
        if use_gpu and gpus_per_slot < 1:
            raise ValueError(f"gpus_per_slot must be >= 1: Got {gpus_per_slot}.")
        # the bounds live in the settings; RayExecutor's names (min_workers=...) win
        unknown = sorted(set(bounds) - {"min_workers", "max_workers", "reset_limit",
                                        "cooldown_range", "elastic_timeout"})
        if unknown:
            raise TypeError(f"ElasticRayExecutor() got unexpected arguments {unknown}")
        cooldown = bounds.get("cooldown_range", getattr(settings, "cooldown_range", None))
        self.settings, self.env_vars = settings, dict(env_vars or {})
        self.cpus_per_slot, self.gpus_per_slot, self.use_gpu = cpus_per_slot, gpus_per_slot, \
            use_gpu
        self._executor = RayExecutor(
            settings, min_workers=bounds.get("min_workers",
                                             getattr(settings, "min_num_proc", 1)),
            max_workers=bounds.get("max_workers", getattr(settings, "max_num_proc", None)),
            reset_limit=bounds.get("reset_limit", getattr(settings, "reset_limit", None)),
            cooldown_range=list(cooldown) if cooldown else None,
            elastic_timeout=bounds.get("elastic_timeout",
                                       getattr(settings, "elastic_timeout", 600)),
            cpus_per_worker=cpus_per_slot, use_gpu=use_gpu,
            gpus_per_worker=gpus_per_slot or None, override_discovery=override_discovery)

    def start(self) -> None:
        """Serve the job's rendezvous; ``env_vars`` go to every worker it starts."""
        self._executor.start(extra_env_vars=self.env_vars)

    def run(self, worker_fn: Callable[[], Any], callbacks: list[Callable] | None = None
            ) -> list[Any]:
        """``worker_fn()`` on every worker until the job ends; what the workers that finished
        returned. ``callbacks`` get what rank 0 logs (:func:`shoal.ray.ray_logger.log`)."""
        return self._executor.run(worker_fn, callbacks=callbacks)

    def shutdown(self) -> None:
        """Stop the job's rendezvous."""
        self._executor.shutdown()
