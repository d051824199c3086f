"""shoal on Ray: Ray Train for Horovod-style training functions.

``TorchTrainer(..., torch_config=TorchConfig(backend="shoal"))`` needs nothing from here:
installing shoal registers the backend in every torch process, Ray's workers included.
:class:`ShoalConfig` and :class:`ShoalTrainer` are for training functions written against
shoal's (Horovod's) API, ``import shoal.torch as hvd; hvd.init()``: the successors of Ray's
``HorovodConfig`` and ``HorovodTrainer``, which Ray deprecated. Ray is the optional extra
``shoal[ray]``.
"""

from __future__ import annotations

try:
    import ray.train  # noqa: F401
except ModuleNotFoundError as exc:  # the optional extra is missing
    raise ModuleNotFoundError(f"shoal.ray needs Ray Train ({exc}); install it with "
                              f"pip install 'shoal[ray]'") from exc

from .train import ShoalConfig, ShoalTrainer

__all__ = ["ShoalConfig", "ShoalTrainer"]
