"""Where a Ray job's workers go (Horovod's ``horovod.ray.strategy``).

* :class:`ColocatedStrategy` (``num_hosts`` x ``num_workers_per_host``): one placement-group
  bundle per node (``STRICT_SPREAD``), each holding that node's workers, so every node has
  the same number;
* :class:`PGStrategy` (``num_workers``): a bundle per worker, packed (``PACK``), or the
  placement group the caller runs in.

With GPUs, the workers of a node all see the node's GPUs that Ray gave them
(``CUDA_VISIBLE_DEVICES``), so that CUDA can use peer access between them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from .utils import map_blocking
from .worker import BaseHorovodWorker

__all__ = ["BaseStrategy", "ColocatedStrategy", "PGStrategy", "create_placement_group"]


def create_placement_group(resources_per_bundle: dict[str, float], num_bundles: int,
                           pg_timeout: float, pg_strategy: str) -> tuple[Any, list[dict]]:
    """A placement group of ``num_bundles`` copies of ``resources_per_bundle``, ready.

    Raises:
        TimeoutError: the cluster could not place it within ``pg_timeout`` seconds (the
            group is removed again).
    """
    bundles = [dict(resources_per_bundle) for _ in range(num_bundles)]
    pg = ray.util.placement_group(bundles, strategy=pg_strategy)
    ready, _ = ray.wait([pg.ready()], timeout=pg_timeout)
    if not ready:
        ray.util.remove_placement_group(pg)
        raise TimeoutError(f"the placement group of {num_bundles} x {resources_per_bundle} "
                           f"({pg_strategy}) was not placed within {pg_timeout}s: the cluster "
                           f"has {ray.available_resources()} free; add nodes, or ask for "
                           f"fewer workers or resources")
    return pg, bundles


class BaseStrategy:
    """Makes the workers; removes what it made at :meth:`shutdown`."""

    placement_group: Any = None
    workers: list[Any] | None = None

    def create_workers(self) -> tuple[list[Any], list[Any]]:
        """The workers in rank order, and one worker per node."""
        raise NotImplementedError

    @property
    def num_workers(self) -> int:
        raise NotImplementedError

    @classmethod
    def get_node_workers(cls, workers: list[Any]) -> list[Any]:
        """One worker per Ray node."""
        nodes = map_blocking(lambda w: w.node_id.remote(), workers)
        return list({node: w for node, w in zip(nodes, workers, strict=True)}.values())

    def _spawn(self, rank: int, bundle: int, cpus: float, gpus: float) -> Any:
        return ray.remote(BaseHorovodWorker).options(
            num_cpus=cpus, num_gpus=gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=bundle,
                placement_group_capture_child_tasks=False)
        ).remote(world_rank=rank, world_size=self.num_workers)

    def _share_gpus(self, workers: list[Any]) -> None:
        """Each worker sees every GPU Ray gave the workers of its node."""
        nodes = map_blocking(lambda w: w.node_id.remote(), workers)
        gpus = map_blocking(lambda w: w.get_gpu_ids.remote(), workers)
        per_node: dict[str, list[int]] = defaultdict(list)
        for node, ids in zip(nodes, gpus, strict=True):
            per_node[node].extend(ids)
        ray.get([w.update_env_vars.remote({"CUDA_VISIBLE_DEVICES": ",".join(
            str(i) for i in per_node[node])}) for w, node in zip(workers, nodes, strict=True)])

    def shutdown(self) -> None:
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
        self.workers = []
        self.placement_group = None


class ColocatedStrategy(BaseStrategy):
    """``num_workers_per_host`` workers on each of ``num_hosts`` distinct nodes."""

    def __init__(self, *, settings: Any, num_hosts: int, num_workers_per_host: int,
                 use_gpu: bool, cpus_per_worker: float, gpus_per_worker: float | None) -> None:
        self.settings = settings
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker or 1

    @property
    def num_workers(self) -> int:
        return int(self.num_hosts * self.num_workers_per_host)

    def create_workers(self) -> tuple[list[Any], list[Any]]:
        gpus = self.gpus_per_worker * int(self.use_gpu)
        self.placement_group, bundles = create_placement_group(
            {"CPU": self.cpus_per_worker * self.num_workers_per_host,
             "GPU": gpus * self.num_workers_per_host}, self.num_hosts,
            self.settings.placement_group_timeout_s, "STRICT_SPREAD")
        self.workers = [self._spawn(self.num_workers_per_host * b + i, b,
                                    self.cpus_per_worker, gpus)
                        for b in range(len(bundles)) for i in range(self.num_workers_per_host)]
        if self.use_gpu:
            self._share_gpus(self.workers)
        return self.workers, self.get_node_workers(self.workers)


class PGStrategy(BaseStrategy):
    """``num_workers`` workers, a bundle each, packed onto as few nodes as fit; in the
    caller's placement group when it runs in one (unless ``force_create_placement_group``)."""

    def __init__(self, *, settings: Any, num_workers: int, use_gpu: bool,
                 cpus_per_worker: float, gpus_per_worker: float | None,
                 placement_group: Any = None, force_create_placement_group: bool = False
                 ) -> None:
        self.settings = settings
        self._num_workers = num_workers
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker or 1
        self.use_gpu = use_gpu
        self.placement_group = None if force_create_placement_group else (
            placement_group or get_current_placement_group())
        self._created_placement_group = False

    @property
    def num_workers(self) -> int:
        return int(self._num_workers)

    def resources_per_worker(self) -> dict[str, float]:
        return {"CPU": self.cpus_per_worker, "GPU": self.gpus_per_worker * int(self.use_gpu)}

    def create_workers(self) -> tuple[list[Any], list[Any]]:
        if self.placement_group is None:
            self.placement_group, _ = create_placement_group(
                self.resources_per_worker(), self.num_workers,
                self.settings.placement_group_timeout_s, "PACK")
            self._created_placement_group = True
        gpus = self.gpus_per_worker * int(self.use_gpu)
        self.workers = [self._spawn(i, i if self._created_placement_group else -1,
                                    self.cpus_per_worker, gpus)
                        for i in range(self.num_workers)]
        if self.use_gpu:
            self._share_gpus(self.workers)
        return self.workers, self.get_node_workers(self.workers)

    def shutdown(self) -> None:
        if self._created_placement_group and self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
        self.placement_group = None
        self.workers = []
