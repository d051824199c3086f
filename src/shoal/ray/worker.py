"""The Ray actor every :class:`~shoal.ray.RayExecutor` worker is (Horovod's
``horovod.ray.worker``): it holds the user's executable object and runs functions on it, in
one process whose environment the executor fills in before ``hvd.init()`` reads it."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import ray

from . import ray_logger

__all__ = ["BaseHorovodWorker"]


class BaseHorovodWorker:
    """A worker process of a Ray job (made a Ray actor with ``ray.remote``)."""

    executable: Any = None

    def __init__(self, world_rank: int = 0, world_size: int = 1) -> None:
        os.environ["HOROVOD_HOSTNAME"] = self.node_id()
        os.environ["HOROVOD_RANK"] = str(world_rank)
        os.environ["HOROVOD_SIZE"] = str(world_size)

    def node_id(self) -> str:
        """The Ray node this worker runs on (hex id): its host, to shoal."""
        return ray.get_runtime_context().get_node_id()

    def hostname(self) -> str:
        """The machine's host name (several Ray nodes may share one)."""
        return socket.gethostname()

    def node_ip(self) -> str:
        """The address of this worker's Ray node."""
        return ray.util.get_node_ip_address()

    def get_gpu_ids(self) -> list[int]:
        """The CUDA devices Ray gave this worker."""
        return list(ray.get_gpu_ids())

    def update_env_vars(self, env_vars: dict[str, Any]) -> None:
        """Set environment variables in this worker's process (values as strings)."""
        os.environ.update({k: str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        """This worker's environment."""
        return dict(os.environ)

    def start_executable(self, executable_cls: type | None = None,
                         executable_args: list | None = None,
                         executable_kwargs: dict | None = None) -> None:
        """Make ``executable_cls(*args, **kwargs)`` the object functions run on (none: None)."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []),
                                             **(executable_kwargs or {}))

    def execute(self, func: Callable[[Any], Any]) -> Any:
        """``func(executable)`` in this worker."""
        return func(self.executable)

    def set_queue(self, queue: Any) -> None:
        """Where :func:`shoal.ray.ray_logger.log` sends rank 0's values (the driver's
        callbacks)."""
        ray_logger.configure(queue=queue)

    def leave(self) -> None:
        """Leave the shoal job (before the actor is killed), so its peers see a shutdown."""
        import shoal
        if shoal.is_initialized():
            shoal.shutdown()
