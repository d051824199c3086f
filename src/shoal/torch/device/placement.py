"""Which GPU a process uses, the way schedulers start GPU jobs.

- A scheduler that gives each process its own ``CUDA_VISIBLE_DEVICES`` (Kubernetes device
  plugins, SLURM's ``--gpus-per-task``, SageMaker) leaves one visible GPU per process: that
  is the process's device, whatever its local rank.
- With every GPU visible, local rank ``r`` takes GPU ``r``.
- With fewer visible GPUs than local ranks (two ranks on a one-GPU machine) the ranks share
  them, ``local_rank % device_count``, and shoal says so once.
"""

from __future__ import annotations

import logging
import os

import torch

__all__ = ["local_device"]

log = logging.getLogger("shoal.torch.device")
_warned = False


def local_device(local_rank: int, local_size: int | None = None) -> torch.device:
    """The device for the process of ``local_rank`` among ``local_size`` on its host: a CUDA
    device when one is visible, else the CPU."""
    global _warned
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    index = local_rank % count
    per_process = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() not in ("", "all")
    if local_size is not None and count < local_size and not (per_process and count == 1) \
            and not _warned:
        _warned = True
        log.warning("%d local ranks share %d visible GPU%s (local rank %d uses cuda:%d); set "
                    "CUDA_VISIBLE_DEVICES per process or start one rank per GPU for full "
                    "speed", local_size, count, "" if count == 1 else "s", local_rank, index)
    return torch.device("cuda", index)
