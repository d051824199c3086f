"""``RayExecutor``: Horovod's Ray API on shoal (``horovod.ray.runner``).

::

    from shoal.ray import RayExecutor
    settings = RayExecutor.create_settings(timeout_s=30)
    executor = RayExecutor(settings, num_workers=4, use_gpu=False)
    executor.start()
    ranks = executor.run(train, args=[epochs])   # train calls hvd.init()
    executor.shutdown()

The workers are Ray actors (:class:`~shoal.ray.worker.BaseHorovodWorker`), placed by a
placement group (:mod:`shoal.ray.strategy`). The executor serves shoal's authenticated
rendezvous store itself, makes a fresh job secret, and gives each worker the environment
``hvd.init()`` reads: its rank, its Ray node as its shoal host (``SHOAL_HOSTNAME``), so ranks
on one node share memory and ranks on different nodes meet over TCP (several Ray nodes on one
machine are several hosts), its local rank among the node's workers, and Horovod's
``HOROVOD_*`` variables. With ``min_workers`` it is elastic (:mod:`shoal.ray.elastic_v2`).
Under Ray Client (``ray.init("ray://...")``) the adapter runs as an actor in the cluster, so
the store is reachable from the workers.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group

from .adapter import Adapter, BaseParams
from .strategy import BaseStrategy, ColocatedStrategy, PGStrategy
from .utils import detect_nics, map_blocking, nics_to_env_var

__all__ = ["Coordinator", "MiniSettings", "RayExecutor", "StaticAdapter", "StaticParams",
           "host_name"]

log = logging.getLogger(__name__)


def host_name(node_id: str) -> str:
    """The shoal host name of a Ray node: ranks on one node share memory."""
    return f"ray-{node_id[:16]}"


@dataclass
class MiniSettings:
    """The executor's settings (Horovod's). ``timeout_s``: the longest wait for every worker
    to join shoal; ``placement_group_timeout_s``: for Ray to place the workers; ``nics``:
    interfaces NCCL may use. ``ssh_*`` are accepted for Horovod's scripts and unused (Ray
    starts the workers)."""

    nics: set | None = None
    verbose: int = 1
    key: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    timeout_s: float = 300
    placement_group_timeout_s: float = 100
    elastic: bool = False


class Coordinator:
    """Ranks' places (from the Ray node of each) and the rendezvous store of one job."""

    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.node_id_by_rank: dict[str, list[int]] = defaultdict(list)
        self._hostnames: set[str] = set()
        self._server: Any = None
        self.job_id = f"ray-{secrets.token_hex(6)}"

    @property
    def world_size(self) -> int:
        return sum(len(ranks) for ranks in self.node_id_by_rank.values())

    @property
    def hostnames(self) -> set[str]:
        return self._hostnames

    @property
    def node_id_string(self) -> str:
        """``node:count,...`` in registration order."""
        return ",".join(f"{node}:{len(ranks)}" for node, ranks in self.node_id_by_rank.items())

    def register(self, hostname: str, node_id: str, world_rank: int) -> None:
        """Say that ``world_rank`` runs on Ray node ``node_id`` (of machine ``hostname``)."""
        self._hostnames.add(hostname)
        self.node_id_by_rank[node_id].append(world_rank)

    def finalize_registration(self) -> dict[int, dict[str, Any]]:
        """Each rank's variables: Horovod's ``HOROVOD_LOCAL_RANK/SIZE`` and
        ``HOROVOD_CROSS_RANK/SIZE`` (the cross rank of a local rank counts the nodes that have
        it), and shoal's rank, size, local rank, local size and host."""
        cross_sizes: dict[int, int] = defaultdict(int)
        cross_ranks: dict[int, int] = {}
        for ranks in self.node_id_by_rank.values():
            for local_rank, world_rank in enumerate(ranks):
                cross_ranks[world_rank] = cross_sizes[local_rank]
                cross_sizes[local_rank] += 1
        size = self.world_size
        info: dict[int, dict[str, Any]] = {}
        for node, ranks in self.node_id_by_rank.items():
            for local_rank, world_rank in enumerate(ranks):
                info[world_rank] = {
                    "HOROVOD_CROSS_RANK": cross_ranks[world_rank],
                    "HOROVOD_CROSS_SIZE": cross_sizes[local_rank],
                    "HOROVOD_LOCAL_RANK": local_rank, "HOROVOD_LOCAL_SIZE": len(ranks),
                    "SHOAL_RANK": world_rank, "SHOAL_SIZE": size,
                    "SHOAL_LOCAL_RANK": local_rank, "SHOAL_LOCAL_SIZE": len(ranks),
                    "SHOAL_HOSTNAME": host_name(node)}
        return info

    def establish_rendezvous(self) -> dict[str, str]:
        """Start the job's store (on this process's node address, authenticated by a fresh
        secret); the variables every worker needs to join."""
        from shoal.core.auth import secret_bytes
        from shoal.core.rendezvous import StoreServer
        secret = secrets.token_hex(32)
        addr = ray.util.get_node_ip_address()
        self._server = StoreServer(secret_bytes(secret), host=addr, port=0).start()
        return {"SHOAL_RENDEZVOUS_ADDR": addr,
                "SHOAL_RENDEZVOUS_PORT": str(self._server.address[1]),
                "SHOAL_SECRET": secret, "SHOAL_JOB_ID": self.job_id,
                "SHOAL_START_TIMEOUT_S": str(float(self.settings.timeout_s))}

    def close(self) -> None:
        """Stop the store; remove what workers on this node left in shared memory."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for path in Path("/dev/shm").glob(f"shoal-{self.job_id}-*"):
            path.unlink(missing_ok=True)


@dataclass
class StaticParams(BaseParams):
    """A job of a fixed size: ``num_workers``, or ``num_hosts`` x ``num_workers_per_host``."""

    num_workers: int | None = None
    num_hosts: int | None = None
    num_workers_per_host: int = 1
    use_current_placement_group: bool = True


class RayExecutor:
    """Horovod's job on Ray workers: ``start`` them, ``run``/``execute`` functions on all of
    them (``run_remote`` for object refs, ``execute_single`` on rank 0), ``shutdown``.

    Args:
        settings: :meth:`create_settings`'s object.
        num_workers: how many workers (packed onto as few nodes as fit), or
        num_hosts, num_workers_per_host: that many on each of that many distinct nodes.
        cpus_per_worker, use_gpu, gpus_per_worker: each worker's Ray resources.
        use_current_placement_group: inside a placement group, place the workers in it.
        min_workers, max_workers, reset_limit, cooldown_range, elastic_timeout,
        override_discovery: an elastic job (:mod:`shoal.ray.elastic_v2`): workers come and
            go with the cluster's nodes; ``run`` a training function that wraps its loop in
            ``hvd.elastic.run``.
    """

    @classmethod
    def create_settings(cls, timeout_s: float = 30, ssh_identity_file: str | None = None,
                        ssh_str: str | None = None, placement_group_timeout_s: float = 100,
                        nics: set | None = None) -> MiniSettings:
        """The settings (Horovod's arguments; the ssh ones are unused under Ray)."""
        return MiniSettings(ssh_identity_file=ssh_identity_file, timeout_s=timeout_s,
                            placement_group_timeout_s=placement_group_timeout_s, nics=nics)

    def __init__(self, settings: Any, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: float | None = None,
                 use_current_placement_group: bool = True, min_workers: int | None = None,
                 max_workers: int | None = None, reset_limit: int | None = None,
                 cooldown_range: list[int] | None = None, elastic_timeout: float = 600,
                 override_discovery: bool = True) -> None:
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError("`max_workers` provided without any positive `min_workers`: "
                             "elastic jobs need a positive `min_workers`")
        if min_workers and num_workers:
            raise ValueError("Both `min_workers` and `num_workers` provided. Only one of them "
                             "is allowed: a job is elastic or not.")
        if min_workers is None and num_workers is None and num_hosts is None:
            raise ValueError("pass num_workers, or num_hosts and num_workers_per_host (or "
                             "min_workers for an elastic job)")
        if num_workers is not None and num_hosts is not None:
            raise ValueError("pass num_workers or num_hosts, not both")
        if min_workers is not None:
            from .elastic_v2 import ElasticParams
            self.params: Any = ElasticParams(
                min_workers=min_workers, max_workers=max_workers, reset_limit=reset_limit,
                cooldown_range=cooldown_range, elastic_timeout=elastic_timeout,
                override_discovery=override_discovery, cpus_per_worker=cpus_per_worker,
                use_gpu=use_gpu, gpus_per_worker=gpus_per_worker)
        else:
            self.params = StaticParams(
                num_workers=num_workers, num_hosts=num_hosts,
                num_workers_per_host=num_workers_per_host, cpus_per_worker=cpus_per_worker,
                use_gpu=use_gpu, gpus_per_worker=gpus_per_worker,
                use_current_placement_group=use_current_placement_group)
        self.settings = settings
        self.settings.elastic = self.params.elastic
        self.adapter: Any = None
        self._is_remote = False

    def start(self, executable_cls: type | None = None, executable_args: list | None = None,
              executable_kwargs: dict | None = None,
              extra_env_vars: dict | None = None) -> None:
        """Start the workers; each makes ``executable_cls(*executable_args,
        **executable_kwargs)`` (if given), the object :meth:`execute` passes to functions.
        ``extra_env_vars`` are set in every worker first.

        Raises:
            TimeoutError: Ray could not place the workers within the settings'
                ``placement_group_timeout_s``.
        """
        cls = self.params.adapter
        kwargs = {k: v for k, v in asdict(self.params).items()}
        if ray.util.client.ray.is_connected():  # the store must live inside the cluster
            self.adapter = ray.remote(cls).options(num_cpus=0).remote(self.settings, **kwargs)
            self._is_remote = True
        else:
            self.adapter = cls(self.settings, **kwargs)
        self._call("start", executable_cls=executable_cls, executable_args=executable_args,
                   executable_kwargs=executable_kwargs, extra_env_vars=extra_env_vars)

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable] | None = None
                ) -> list[Any]:
        """``fn(executable)`` on every worker; the results in rank order. ``callbacks`` are
        called with every value rank 0 logs through :func:`shoal.ray.ray_logger.log`."""
        return self._call("execute", fn=fn, callbacks=callbacks)

    def run(self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None,
            callbacks: list[Callable] | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order."""
        return self._call("run", fn=fn, args=args, kwargs=kwargs, callbacks=callbacks)

    def run_remote(self, fn: Callable[..., Any], args: list | None = None,
                   kwargs: dict | None = None) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker, without waiting: object refs, for
        ``ray.get``."""
        return self._call("run_remote", fn=fn, args=args, kwargs=kwargs)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on rank 0 only."""
        return self._call("execute_single", fn=fn)

    def shutdown(self) -> None:
        """Stop the workers and the store; free the placement group."""
        if self.adapter is None:
            return
        try:
            self._call("shutdown")
        finally:
            if self._is_remote:
                ray.kill(self.adapter)
            self.adapter = None

    def _call(self, method: str, **kwargs: Any) -> Any:
        if self.adapter is None:
            raise RuntimeError(f"RayExecutor.{method}(): call start() first")
        if self._is_remote:
            return ray.get(getattr(self.adapter, method).remote(**kwargs))
        return getattr(self.adapter, method)(**kwargs)


def _wait_calling_back(refs: list[Any], queue: Any, callbacks: list[Callable] | None
                       ) -> list[Any]:
    """``ray.get(refs)``, calling every callback on each value rank 0 logged meanwhile."""
    pending = list(refs)
    while True:
        if queue is not None:
            while not queue.empty():
                item = queue.get()
                for callback in callbacks or ():
                    callback(item)
        if not pending:
            return ray.get(refs)
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1)


class StaticAdapter(Adapter):
    """The workers of a job of fixed size (see :class:`RayExecutor`)."""

    def __init__(self, settings: Any, num_workers: int | None = None,
                 num_hosts: int | None = None, num_workers_per_host: int = 1,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: float | None = None,
                 use_current_placement_group: bool = True) -> None:
        self.settings = settings
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = gpus_per_worker or 1
        self.use_current_placement_group = use_current_placement_group
        self.workers: list[Any] = []
        self.strategy: BaseStrategy | None = None
        self.coordinator: Coordinator | None = None

    def _create_strategy(self) -> BaseStrategy:
        use_pg = self.use_current_placement_group and get_current_placement_group()
        if self.num_workers or use_pg:
            return PGStrategy(settings=self.settings,
                              num_workers=self.num_workers or
                              self.num_workers_per_host * (self.num_hosts or 1),
                              use_gpu=self.use_gpu, cpus_per_worker=self.cpus_per_worker,
                              gpus_per_worker=self.gpus_per_worker,
                              force_create_placement_group=not self.use_current_placement_group)
        return ColocatedStrategy(settings=self.settings, num_hosts=self.num_hosts or 1,
                                 num_workers_per_host=self.num_workers_per_host,
                                 use_gpu=self.use_gpu, cpus_per_worker=self.cpus_per_worker,
                                 gpus_per_worker=self.gpus_per_worker)

    def start(self, executable_cls: type | None = None, executable_args: list | None = None,
              executable_kwargs: dict | None = None,
              extra_env_vars: dict | None = None) -> None:
        self.strategy = self._create_strategy()
        self.coordinator = Coordinator(self.settings)
        try:
            self.workers, node_workers = self.strategy.create_workers()
            nodes = map_blocking(lambda w: w.node_id.remote(), self.workers)
            hostnames = map_blocking(lambda w: w.hostname.remote(), self.workers)
            for rank, (hostname, node) in enumerate(zip(hostnames, nodes, strict=True)):
                self.coordinator.register(hostname, node, rank)
            env = self.coordinator.establish_rendezvous()
            env.update({k: str(v) for k, v in (extra_env_vars or {}).items()})
            env.update(nics_to_env_var(detect_nics(self.settings, list(self.coordinator.hostnames),
                                                   node_workers)))
            info = self.coordinator.finalize_registration()
            map_blocking(lambda rank: self.workers[rank].update_env_vars.remote(
                {**info[rank], **env}), range(len(self.workers)))
            map_blocking(lambda w: w.start_executable.remote(
                executable_cls, executable_args, executable_kwargs), self.workers)
        except BaseException:
            self.shutdown()
            raise

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable] | None = None
                ) -> list[Any]:
        queue = None
        if callbacks:
            from ray.util.queue import Queue
            queue = Queue(actor_options={"num_cpus": 0})
            ray.get(self.workers[0].set_queue.remote(queue))
        try:
            return _wait_calling_back([w.execute.remote(fn) for w in self.workers], queue,
                                      callbacks)
        finally:
            if queue is not None:
                ray.get(self.workers[0].set_queue.remote(None))
                queue.shutdown()

    def run_remote(self, fn: Callable[..., Any], args: list | None = None,
                   kwargs: dict | None = None) -> list[Any]:
        args, kwargs = list(args or []), dict(kwargs or {})
        return [w.execute.remote(lambda _: fn(*args, **kwargs)) for w in self.workers]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        return ray.get(self.workers[0].execute.remote(fn))

    def shutdown(self) -> None:
        workers, self.workers = self.workers, []
        if workers:  # leave shoal first (bounded: a worker stuck in user code is killed)
            refs = [w.leave.remote() for w in workers]
            ray.wait(refs, num_returns=len(refs), timeout=10.0)
            for w in workers:
                with contextlib.suppress(Exception):
                    ray.kill(w)
        if self.strategy is not None:
            self.strategy.shutdown()
        if self.coordinator is not None:
            self.coordinator.close()


StaticParams.adapter = StaticAdapter
