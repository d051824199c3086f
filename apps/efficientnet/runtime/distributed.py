"""The four ways the application can run data-parallel, behind one small interface.

* ``shoal``: Horovod style: ``hvd.DistributedOptimizer`` averages gradients while backward
  runs; the initial weights and optimizer state are broadcast from rank 0.
* ``ddp-gloo``: stock ``torch.nn.parallel.DistributedDataParallel`` over torch's gloo.
* ``ddp-shoal``: stock DDP over the ``"shoal"`` ``torch.distributed`` backend.
* ``horovod``: the same code as ``shoal`` on Horovod's own ``horovod.torch`` (start it with
  ``horovodrun``; ``scripts/install-peers.sh`` builds Horovod into ``.peers/venv``). shoal's
  torch API is Horovod's, so the module is the only difference: this is the comparison run.

For the others shoal is initialised too: it tells each process its rank, carries the
statistics (``hvd.oob_allreduce``) and SyncBatchNorm, and bootstraps gloo's store.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

import shoal.torch
from shoal.torch.device import local_device

__all__ = ["BACKENDS", "Dist", "accumulating", "average", "compression", "init_distributed",
           "shutdown_distributed", "unwrap", "wrap"]

BACKENDS = ("shoal", "ddp-gloo", "ddp-shoal", "horovod")

#: The Horovod-style module the job runs on (``shoal.torch``, or ``horovod.torch``).
hvd: Any = shoal.torch


def _horovod() -> Any:
    try:
        import horovod.torch
    except ImportError as exc:
        raise RuntimeError(f"--backend horovod needs Horovod ({exc}); scripts/install-peers.sh "
                           f"builds it into .peers/venv: run .peers/venv/bin/horovodrun -np N "
                           f"--gloo .peers/venv/bin/python -m apps.efficientnet.main ...") from None
    return horovod.torch


@dataclass(frozen=True)
class Dist:
    """Who this process is in the job, and on which device it computes."""

    backend: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    hvd: Any = shoal.torch   # the Horovod-style API module this job runs on

    @property
    def is_root(self) -> bool:
        """Rank 0: the one that logs and writes checkpoints."""
        return self.rank == 0


def _torch_store(rank: int, size: int) -> tdist.Store:
    """A TCPStore served by rank 0 on a free port; its address travels over shoal."""
    store = None
    where: tuple[str, int] | None = None
    if rank == 0:
        host = "127.0.0.1" if hvd.cross_size() == 1 else socket.gethostbyname(
            socket.gethostname())
        store = tdist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False)
        where = (host, store.port)
    host, port = hvd.broadcast_object(where, root_rank=0, name="efficientnet.torch_store")
    if store is None:
        store = tdist.TCPStore(host, port, size, is_master=False)
    return store


def init_distributed(backend: str = "shoal", device: str | None = None) -> Dist:
    """Join the job (shoal reads whichever launcher started us) and set up ``backend``.

    Raises:
        ValueError: ``backend`` is unknown.
        RuntimeError: ``ddp-shoal`` was asked for but this shoal has no torch backend.
    """
    global hvd
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    hvd = _horovod() if backend == "horovod" else shoal.torch
    hvd.init()
    rank, size, local_rank = hvd.rank(), hvd.size(), hvd.local_rank()
    # the GPU the scheduler gave this process (CUDA_VISIBLE_DEVICES per process), else local
    # rank's, shared when there are fewer GPUs than local ranks (shoal says so once)
    dev = torch.device(device) if device is not None else \
        local_device(local_rank, hvd.local_size())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if backend == "ddp-shoal" and not tdist.is_backend_available("shoal"):
        raise RuntimeError("--backend ddp-shoal needs the 'shoal' torch.distributed backend "
                           "(shoal.torch.backend), which this shoal installation lacks; "
                           "use --backend shoal or ddp-gloo")
    if backend.startswith("ddp-") and not tdist.is_initialized():
        tdist.init_process_group(backend[4:], store=_torch_store(rank, size), rank=rank,
                                 world_size=size)
    return Dist(backend, rank, size, local_rank, hvd.local_size(), dev, hvd)


def shutdown_distributed(dist: Dist) -> None:
    """Leave the torch.distributed group (if any) and the shoal job."""
    if dist.backend.startswith("ddp-") and tdist.is_initialized():
        tdist.destroy_process_group()
    hvd.shutdown()


def compression(name: str) -> Any:
    """``hvd.Compression`` codec for ``fp16`` / ``bf16`` / ``none``."""
    if name not in ("none", "fp16", "bf16"):
        raise ValueError(f"unknown compression {name!r}; use fp16, bf16 or none")
    codec = getattr(hvd.Compression, name, None)
    if codec is None:
        raise ValueError(f"{hvd.__name__} has no Compression.{name}; use fp16 or none")
    return codec


def wrap(model: nn.Module, optimizer: torch.optim.Optimizer, dist: Dist,
         compression_name: str = "none", sharded: bool = False,
         backward_passes: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Make ``model`` / ``optimizer`` data-parallel, with every rank starting from rank 0's
    weights and optimizer state; ``sharded``: each rank keeps 1/N of the optimizer state;
    ``backward_passes``: backward passes whose gradients one step averages (a DDP model is
    then run under ``no_sync`` for all but the last, see :func:`accumulating`)."""
    if sharded and compression_name != "none":
        raise ValueError("--optimizer_sharding reduce-scatters gradients uncompressed; drop "
                         "--compression")
    if not dist.backend.startswith("ddp-"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        if dist.size == 1:
            return model, optimizer
        if sharded:  # the updated weights' gather overlaps the next forward
            return model, hvd.ShardedOptimizer(optimizer, model.named_parameters(),
                                               backward_passes_per_step=backward_passes,
                                               overlap_param_gather=True)
        return model, hvd.DistributedOptimizer(optimizer, model.named_parameters(),
                                               compression=compression(compression_name),
                                               backward_passes_per_step=backward_passes)
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if compression_name == "bf16" and dist.device.type != "cuda":
        raise ValueError("--compression bf16 with a ddp-* backend needs CUDA (torch's bf16 "
                         "comm hook requires NCCL); use fp16, or --backend shoal")
    ids = [dist.device.index] if dist.device.type == "cuda" else None
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    hook = {"fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook}.get(compression_name)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    if sharded:  # torch's own: DDP allreduces, ZeroRedundancyOptimizer shards the state
        from torch.distributed.optim import ZeroRedundancyOptimizer
        groups = [dict(g) for g in optimizer.param_groups]
        optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                            **optimizer.defaults)
    return ddp, optimizer


def accumulating(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """The context of one backward pass of several that one step averages: DDP's
    ``no_sync`` for all but the ``last`` (a DistributedOptimizer counts its passes itself)."""
    if last or not isinstance(model, nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside a DDP wrapper (or ``model`` itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def average(values: list[float], name: str) -> list[float]:
    """Average ``values`` over all ranks (``hvd.oob_allreduce``, Horovod's plain allreduce on
    Horovod; every rank must call it)."""
    t = torch.tensor(values, dtype=torch.float64)
    if hvd.size() == 1:
        return t.tolist()
    reduce = getattr(hvd, "oob_allreduce", hvd.allreduce)
    return reduce(t, name=name).tolist()

