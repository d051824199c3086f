"""Ray Train's backend for shoal: :class:`ShoalConfig` (a ``BackendConfig``) and
:class:`ShoalTrainer`.

At the start of a worker group (and again after Ray Train replaced a failed one) the backend
gives every worker the launcher environment shoal reads (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of worker 0, where rank
0 serves shoal's authenticated store), a fresh job secret, and the worker's Ray node id as its
shoal host, so that ranks on one node share memory and ranks on different nodes use TCP, also
where two Ray nodes run on one machine. The training function then calls ``hvd.init()`` as
under horovodrun; the group is shut down with the worker group.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Any

import ray
from ray.train.backend import Backend, BackendConfig

try:
    from ray.train.v2._internal.constants import is_v2_enabled
except ImportError:  # a Ray Train without its second API
    def is_v2_enabled() -> bool:
        return False

if is_v2_enabled():  # Ray Train's current API (the one ray.train.torch.TorchTrainer is)
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer
else:
    from ray.train.data_parallel_trainer import DataParallelTrainer

__all__ = ["ShoalConfig", "ShoalTrainer"]


@dataclass
class ShoalConfig(BackendConfig):
    """How Ray Train starts shoal in its workers.

    Args:
        timeout_s: longest wait for every worker to join (``SHOAL_START_TIMEOUT_S``).
    """

    timeout_s: float = 300.0

    @property
    def backend_cls(self) -> type[Backend]:
        return _ShoalBackend


def _where() -> tuple[str, str]:
    """This worker's Ray node id and its node's address."""
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()


def _free_ports() -> tuple[int, int]:
    """Two free ports on this worker's node: shoal's store, and torch's (``MASTER_PORT``) for
    a training function that makes a torch process group as well."""
    import socket
    with socket.socket() as a, socket.socket() as b:
        a.bind(("", 0))
        b.bind(("", 0))
        return int(a.getsockname()[1]), int(b.getsockname()[1])


def _set_env(env: dict[str, str]) -> None:
    os.environ.update(env)


def _leave() -> None:
    import shoal
    if shoal.is_initialized():
        shoal.shutdown()


def worker_environments(nodes: list[str], master: tuple[str, int, int], secret: str,
                        timeout_s: float) -> list[dict[str, str]]:
    """The environment of each worker (in worker order) from the workers' node ids: local
    ranks in worker order within a node, nodes numbered by their first worker."""
    order = list(dict.fromkeys(nodes))
    seen: dict[str, int] = {}
    out = []
    for rank, node in enumerate(nodes):
        local = seen.get(node, 0)
        seen[node] = local + 1
        out.append({"RANK": str(rank), "WORLD_SIZE": str(len(nodes)),
                    "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(nodes.count(node)),
                    "GROUP_RANK": str(order.index(node)), "MASTER_ADDR": master[0],
                    "MASTER_PORT": str(master[2]), "SHOAL_RENDEZVOUS_ADDR": master[0],
                    "SHOAL_RENDEZVOUS_PORT": str(master[1]),
                    "SHOAL_HOSTNAME": f"ray-{node[:12]}",
                    "SHOAL_SECRET": secret, "SHOAL_START_TIMEOUT_S": str(timeout_s)})
    return out


class _ShoalBackend(Backend):
    def on_start(self, worker_group: Any, backend_config: ShoalConfig) -> None:
        where = worker_group.execute(_where)
        store, torch_store = worker_group.execute_single(0, _free_ports)
        envs = worker_environments([node for node, _ in where],
                                   (where[0][1], store, torch_store), secrets.token_hex(32),
                                   backend_config.timeout_s)
        ray.get([worker_group.execute_single_async(i, _set_env, env)
                 for i, env in enumerate(envs)])

    def on_shutdown(self, worker_group: Any, backend_config: ShoalConfig) -> None:
        worker_group.execute(_leave)


class ShoalTrainer(DataParallelTrainer):
    """Ray Train's data-parallel trainer with shoal started in every worker: where
    ``HorovodTrainer(train_loop_per_worker, horovod_config=...)`` was, write
    ``ShoalTrainer(train_loop_per_worker, shoal_config=...)``; the training function keeps
    its ``import horovod.torch as hvd`` turned into ``import shoal.torch as hvd``."""

    def __init__(self, train_loop_per_worker: Any, *, shoal_config: ShoalConfig | None = None,
                 **kwargs: Any) -> None:
        super().__init__(train_loop_per_worker, backend_config=shoal_config or ShoalConfig(),
                         **kwargs)
