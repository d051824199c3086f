"""torch's hook into shoal: installing shoal with torch registers the c10d backend "shoal" at
every ``import torch``, so an engine that starts the workers itself (Ray Train, Lightning,
Accelerate, torchrun with a stock script) can name it with no ``import shoal`` anywhere.

torch 2.5 and later call the entry points of the group ``torch.backends`` at the end of
``import torch`` (``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off); shoal's is
:func:`register`. It only records the name: neither ``shoal.core`` nor ``shoal.torch`` is
imported until the first process group of backend "shoal" is created. torch turns an
exception from the hook into a failure of ``import torch``, so the hook never raises: it warns
once and leaves the name to ``import shoal.torch``, which registers it as it always did.
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["register"]

BACKEND = "shoal"


def _create(*args: Any, **kwargs: Any) -> Any:
    """The backend's creator, imported on the first group (the full registration then)."""
    from shoal.torch import backend
    backend.register()
    return backend._create(*args, **kwargs)


def register() -> None:
    """Register "shoal" with ``torch.distributed`` (the ``torch.backends`` entry point)."""
    try:
        import torch.distributed as dist
        if not dist.is_available() or BACKEND.upper() in getattr(dist.Backend, "_plugins", {}):
            return
        dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                      devices=["cpu", "cuda"])
    except Exception as exc:
        warnings.warn(f"shoal: the torch.distributed backend 'shoal' was not registered at "
                      f"torch's import ({type(exc).__name__}: {exc}); `import shoal.torch` "
                      f"registers it", RuntimeWarning, stacklevel=2)
