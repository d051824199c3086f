"""Small helpers of the Ray executors (Horovod's ``horovod.ray.utils``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import ray

__all__ = ["detect_nics", "map_blocking", "nics_to_env_var"]


def map_blocking(fn: Callable[[Any], Any], collection: Iterable[Any]) -> list[Any]:
    """``ray.get`` of ``fn(x)`` (an object ref) for every ``x``, in order."""
    return ray.get([fn(x) for x in collection])


def detect_nics(settings: Any, all_host_names: list[str] | None = None,
                node_workers: list[Any] | None = None) -> list[str]:
    """The network interfaces to use: ``settings.nics`` when given. shoal needs none named:
    each worker reaches the executor's store and its peers through the route to the
    executor's node, so without ``nics`` this is empty."""
    return sorted(settings.nics) if getattr(settings, "nics", None) else []


def nics_to_env_var(nics: list[str]) -> dict[str, str]:
    """The variables that restrict NCCL (and Horovod's Gloo) to ``nics``; none for none."""
    if not nics:
        return {}
    return {"HOROVOD_GLOO_IFACE": nics[0], "NCCL_SOCKET_IFNAME": ",".join(nics)}
