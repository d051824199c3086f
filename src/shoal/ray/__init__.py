"""shoal on Ray (the optional extra ``shoal[ray]``).

* :class:`RayExecutor` (elastic with ``min_workers=``; :class:`ElasticRayExecutor`):
  Horovod's ``horovod.ray`` API, its module paths included (``shoal.ray.runner``,
  ``.strategy``, ``.worker``, ``.utils``, ``.elastic``, ``.elastic_v2``, ``.ray_logger``);
* :class:`ShoalConfig` / :class:`ShoalTrainer`: Ray Train for Horovod-style training
  functions (``import shoal.torch as hvd; hvd.init()``), the successors of Ray's deprecated
  ``HorovodConfig``/``HorovodTrainer``. ``TorchTrainer(...,
  torch_config=TorchConfig(backend="shoal"))`` needs nothing from here: installing shoal
  registers the backend in every torch process, Ray's workers included;
* :mod:`shoal.ray.collective`: backend ``"shoal"`` of ``ray.util.collective``.
"""

from __future__ import annotations

import importlib
from typing import Any

try:
    import ray  # noqa: F401
except ModuleNotFoundError as exc:  # the optional extra is missing
    raise ModuleNotFoundError(f"shoal.ray needs Ray ({exc}); install it with "
                              f"pip install 'shoal[ray]'") from exc

from .runner import RayExecutor
from .worker import BaseHorovodWorker

_LAZY = {"ShoalConfig": ".train", "ShoalTrainer": ".train",  # Ray Train, imported on use
         "ElasticRayExecutor": ".elastic"}

__all__ = ["BaseHorovodWorker", "ElasticRayExecutor", "RayExecutor", "ShoalConfig",
           "ShoalTrainer"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
