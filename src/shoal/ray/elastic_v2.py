"""Elastic jobs on Ray (Horovod's ``horovod.ray.elastic_v2``):
``RayExecutor(settings, min_workers=2, max_workers=8, cpus_per_worker=1)``.

The executor runs shoal's elastic driver (:mod:`shoal.runner.elastic.driver`) with workers
that are Ray actors: every discovery interval it asks Ray for its nodes
(:class:`RayHostDiscovery`; or ``settings.discovery`` with ``override_discovery=False``),
starts an actor per free slot on each node (up to ``max_workers``), and publishes each world
in the store it serves. ``run(train)`` runs the training function in every actor; the
function is Horovod's elastic one: ``hvd.init()``, then ``hvd.elastic.run`` around the loop
with ``hvd.elastic.TorchState`` (or the TensorFlow/Keras states), commit, restore and reset
as under ``shoalrun``. An actor that fails, or a node that leaves, shrinks the world; the
host is blacklisted as horovodrun does (``cooldown_range`` lets it back); nodes that join
grow it. ``run`` returns what the functions of the workers that finished returned, and raises
when the job fails (below ``min_workers`` for ``elastic_timeout`` seconds, or past
``reset_limit`` resets).
"""

from __future__ import annotations

import contextlib
import math
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from shoal.runner.common import ExitCode
from shoal.runner.elastic import driver as elastic_driver
from shoal.runner.elastic.discovery import HostDiscovery
from shoal.runner.elastic.driver import Driver, ElasticOptions, Member, drive
from shoal.runner.util import network

from .adapter import Adapter, BaseParams
from .worker import BaseHorovodWorker

__all__ = ["ElasticAdapter", "ElasticParams", "RayHostDiscovery"]


class RayHostDiscovery(HostDiscovery):
    """The hosts of the Ray cluster: one per alive node, named by its address, with as many
    slots as its resources hold workers (``CPU // cpus_per_worker``, and with GPUs at most
    ``GPU // gpus_per_worker``). Nodes that share an address (several Ray nodes on one
    machine) are told apart as ``<address>#<node id>``; :attr:`nodes` maps each host to its
    node, where the workers are placed."""

    def __init__(self, use_gpu: bool = False, cpus_per_worker: float = 1,
                 gpus_per_worker: float = 1) -> None:
        self.use_gpu = use_gpu
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus_per_worker or 1
        self.nodes: dict[str, str] = {}

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        hosts: dict[str, int] = {}
        nodes: dict[str, str] = {}
        for node in ray.nodes():
            if not node.get("alive", node.get("Alive", False)):
                continue
            resources = node.get("Resources", {})
            slots = (resources.get("CPU", 0) // self.cpus_per_worker if self.cpus_per_worker
                     else math.inf)
            if self.use_gpu:
                slots = min(slots, resources.get("GPU", 0) // self.gpus_per_worker)
            if not slots or math.isinf(slots):
                continue
            host, node_id = node["NodeManagerAddress"], node.get("NodeID")
            if host in hosts and node_id:
                host = f"{host}#{node_id[:12]}"
            hosts[host] = int(slots)
            if node_id:
                nodes[host] = node_id
        self.nodes = nodes
        return hosts


@dataclass
class ElasticParams(BaseParams):
    """An elastic job's limits (Horovod's arguments)."""

    min_workers: int = 1
    max_workers: int | None = None
    reset_limit: int | None = None
    cooldown_range: list[int] | None = None
    elastic_timeout: float = 600
    override_discovery: bool = True
    elastic: ClassVar[bool] = True


class _RayDriver(Driver):
    """The elastic driver with workers that are Ray actors, placed on their host's node (or,
    for a host a discovery of the user's names, by its ``node:<host>`` resource)."""

    def __init__(self, opts: ElasticOptions, adapter: ElasticAdapter, fn: Callable[[Any], Any],
                 queue: Any, callbacks: Sequence[Callable] | None) -> None:
        super().__init__(opts, adapter.job_id)
        self.adapter, self.fn, self.queue, self.callbacks = adapter, fn, queue, callbacks
        self.results: dict[int, Any] = {}  # serial -> what the function returned
        self.errors: list[str] = []

    def say(self, message: str) -> None:
        import sys
        print(f"shoal.ray: {message}", file=sys.stderr, flush=True)

    def discover(self) -> list[tuple[str, int]]:
        return list(self.adapter.discovery.find_available_hosts_and_slots().items())

    def discovery_interval(self) -> float:
        return elastic_driver.DISCOVER_HOSTS_FREQUENCY_SECS  # read now: tests patch it

    def launch(self, host: str, slot: int, member_id: str) -> Any:
        a = self.adapter
        node = getattr(a.discovery, "nodes", {}).get(host)
        where: dict[str, Any] = {"resources": {f"node:{host}": 0.01}} if node is None else {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
        actor = ray.remote(BaseHorovodWorker).options(
            num_cpus=a.cpus_per_worker, num_gpus=a.gpus_per_worker * int(a.use_gpu),
            **where).remote(world_rank=-1, world_size=-1)
        env = {**a.env, "SHOAL_ELASTIC_ID": member_id, "SHOAL_HOSTNAME": host}
        actor.update_env_vars.remote(env)
        if self.queue is not None:
            actor.set_queue.remote(self.queue)
        actor.start_executable.remote(*a.executable)
        return actor, actor.execute.remote(self.fn)  # (calls run in order on an actor)

    def exit_code(self, member: Member) -> int | None:
        ref = member.handle[1]
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return None
        try:
            self.results[member.serial] = ray.get(ref)
            return 0
        except Exception as exc:  # the function raised, or the actor died
            self.errors.append(f"{member.id}: {type(exc).__name__}: {exc}"[:2000])
            return 1

    def reap(self, member: Member) -> None:
        with contextlib.suppress(Exception):
            ray.kill(member.handle[0])

    def stop(self, members: Sequence[Member]) -> None:
        for m in members:
            with contextlib.suppress(Exception):
                ray.kill(m.handle[0])

    def tick(self) -> None:
        if self.queue is None:
            return
        while not self.queue.empty():
            item = self.queue.get()
            for callback in self.callbacks or ():
                callback(item)


class ElasticAdapter(Adapter):
    """The elastic job behind ``RayExecutor(min_workers=...)``."""

    def __init__(self, settings: Any, min_workers: int = 1, max_workers: int | None = None,
                 reset_limit: int | None = None, cooldown_range: list[int] | None = None,
                 elastic_timeout: float = 600, override_discovery: bool = True,
                 cpus_per_worker: float = 1, use_gpu: bool = False,
                 gpus_per_worker: float | None = None) -> None:
        self.settings = settings
        self.min_workers, self.max_workers = min_workers, max_workers
        self.reset_limit, self.cooldown_range = reset_limit, cooldown_range
        self.elastic_timeout = elastic_timeout
        self.cpus_per_worker, self.use_gpu = cpus_per_worker, use_gpu
        self.gpus_per_worker = gpus_per_worker or 1
        if override_discovery or getattr(settings, "discovery", None) is None:
            settings.discovery = RayHostDiscovery(use_gpu, cpus_per_worker,
                                                  self.gpus_per_worker)
        self.discovery: HostDiscovery = settings.discovery
        self.job_id = f"ray-elastic-{secrets.token_hex(6)}"
        self.env: dict[str, str] = {}
        self.executable: tuple[Any, Any, Any] = (None, None, None)
        self._server: Any = None

    def start(self, executable_cls: type | None = None, executable_args: list | None = None,
              executable_kwargs: dict | None = None,
              extra_env_vars: dict | None = None) -> None:
        """Serve the job's store; the workers start with :meth:`run`."""
        from shoal.core.auth import secret_bytes
        from shoal.core.rendezvous import StoreServer
        nics = getattr(self.settings, "nics", None)
        addr = network.get_driver_ip(nics) if nics else ray.util.get_node_ip_address()
        secret = secrets.token_hex(32)
        self._server = StoreServer(secret_bytes(secret), host=addr, port=0).start()
        self._secret = secret
        self.env = {k: str(v) for k, v in (extra_env_vars or {}).items()}
        self.env.update({
            "SHOAL_RENDEZVOUS_ADDR": addr, "SHOAL_RENDEZVOUS_PORT": str(self._server.address[1]),
            "SHOAL_SECRET": secret, "SHOAL_JOB_ID": self.job_id,
            "SHOAL_ELASTIC_TIMEOUT_S": str(float(self.elastic_timeout)),
            "SHOAL_START_TIMEOUT_S": str(float(self.settings.timeout_s))})
        self.executable = (executable_cls, executable_args, executable_kwargs)

    def _options(self) -> ElasticOptions:
        max_np = self.max_workers or 1 << 20
        opts = ElasticOptions(np=self.min_workers, min_np=self.min_workers, max_np=max_np,
                              elastic_timeout_s=float(self.elastic_timeout),
                              reset_limit=self.reset_limit,
                              cooldown_range=tuple(self.cooldown_range)
                              if self.cooldown_range else None)
        opts.check()
        return opts

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable] | None = None
                ) -> list[Any]:
        """Run the elastic job: ``fn(executable)`` in every worker, workers coming and going
        with the cluster; what the workers that finished returned.

        Raises:
            RuntimeError: the job failed (the driver's reason and the workers' errors).
        """
        if self._server is None:
            raise RuntimeError("ElasticAdapter: call start() first")
        from shoal.core.auth import secret_bytes
        from shoal.core.rendezvous import StoreClient
        queue = None
        if callbacks:
            from ray.util.queue import Queue
            queue = Queue(actor_options={"num_cpus": 0})
        d = _RayDriver(self._options(), self, fn, queue, callbacks)
        store = StoreClient(self.env["SHOAL_RENDEZVOUS_ADDR"], int(self._server.address[1]),
                            secret_bytes(self._secret), timeout=10.0)
        try:
            code = drive(d, store)
            d.tick()
        finally:
            d.stop(list(d.members.values()))
            store.close()
            if queue is not None:
                queue.shutdown()
        if code != ExitCode.OK:
            raise RuntimeError("the elastic Ray job failed: one or more workers exited with "
                               "an error, and no world could go on (see the driver's "
                               "messages above)" + "".join(f"\n  {e}" for e in d.errors[-5:]))
        return [d.results[k] for k in sorted(d.results)]

    def run_remote(self, fn: Callable[..., Any], args: list | None = None,
                   kwargs: dict | None = None) -> list[Any]:
        raise NotImplementedError("an elastic job's workers change while it runs: use run() "
                                  "(Horovod's elastic executor has no run_remote either)")

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        raise NotImplementedError("an elastic job has no fixed rank 0 between runs: use run()")

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


ElasticParams.adapter = ElasticAdapter

