"""What every Ray executor's adapter provides (Horovod's ``horovod.ray.adapter``): the static
one (:class:`shoal.ray.runner.StaticAdapter`) and the elastic one run the same calls."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["Adapter", "BaseParams"]


@dataclass
class BaseParams:
    """Resources of each worker."""

    cpus_per_worker: float = 1
    use_gpu: bool = False
    gpus_per_worker: float | None = None
    #: whether the job is elastic, and the :class:`Adapter` that runs it (per subclass)
    elastic: ClassVar[bool] = False
    adapter: ClassVar[type[Adapter]]

    def __post_init__(self) -> None:
        if self.gpus_per_worker and not self.use_gpu:
            raise ValueError("gpus_per_worker is set, but use_gpu is False: pass use_gpu=True "
                             "with gpus_per_worker")
        if self.use_gpu and self.gpus_per_worker is not None and self.gpus_per_worker <= 0:
            raise ValueError(f"gpus_per_worker must be > 0, not {self.gpus_per_worker}")
        if self.cpus_per_worker is not None and self.cpus_per_worker < 0:
            raise ValueError(f"cpus_per_worker must be >= 0, not {self.cpus_per_worker}")
        self.gpus_per_worker = self.gpus_per_worker or int(self.use_gpu)


class Adapter(ABC):
    """Starts the workers and runs functions on them."""

    @abstractmethod
    def start(self, executable_cls: type | None = None, executable_args: list | None = None,
              executable_kwargs: dict | None = None,
              extra_env_vars: dict | None = None) -> None:
        """Start the workers (each holding ``executable_cls(*args, **kwargs)``)."""

    @abstractmethod
    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable] | None = None
                ) -> list[Any]:
        """``fn(executable)`` on every worker; the results in rank order."""

    def run(self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None,
            callbacks: list[Callable] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order."""
        args, kwargs = list(args or []), dict(kwargs or {})
        return self.execute(lambda _: fn(*args, **kwargs), callbacks)

    @abstractmethod
    def run_remote(self, fn: Callable[..., Any], args: list | None = None,
                   kwargs: dict | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; object refs of the results."""

    @abstractmethod
    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free their resources."""
