"""DeepSpeed's C++ shared-memory allreduce, as a benchmark peer.

DeepSpeed compiles it with the machine's g++ (``ShareMemCommBuilder``, torch's JIT, cached
under ``~/.cache/torch_extensions``) and exposes it as ``torch.ops.deepspeed.
inference_all_reduce_``: float32, float16 and bfloat16 Sum, in place, every rank on one host.
It was written for tensor-parallel inference; as a collective it is the fastest CPU
shared-memory allreduce we know, so ``shoal bench allreduce --peers deepspeed`` times it in
the same processes as shoal. Runs in the peers venv (``scripts/install-peers.sh``), where
deepspeed is installed; nothing else in shoal imports it.

Its segments are named after ``MASTER_ADDR`` and ``MASTER_PORT`` and are never unlinked by
DeepSpeed (66 MiB per rank): :func:`cleanup` removes them once every rank has mapped them.
"""

from __future__ import annotations

import contextlib
import glob
import os
from collections.abc import Callable
from typing import Any

__all__ = ["cleanup", "load"]

_PREFIX = "deepspeed_allreduce_buffer"


def load(world_size: int, rank: int) -> Callable[[Any], Any]:
    """Build (or take from the cache) DeepSpeed's shared-memory op, attach this rank to the
    job's segments, and return its in-place Sum allreduce of a CPU torch tensor.

    Every rank of the job calls this with ``LOCAL_SIZE`` (= ``world_size``: one host only),
    ``MASTER_ADDR`` and ``MASTER_PORT`` set alike; attaching waits for every rank's segment.
    Raises ``RuntimeError`` where the op cannot run (no AVX2: its float32 kernel faults)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    module = ShareMemCommBuilder().load(verbose=False)
    if module.vector_kernel_level() < 1:
        raise RuntimeError("DeepSpeed's shared-memory allreduce needs AVX2 for float32")
    if int(os.environ.get("LOCAL_SIZE", "0")) != world_size:
        raise RuntimeError(f"LOCAL_SIZE must be the world size ({world_size}): DeepSpeed's "
                           f"shared-memory path works on one host only")
    module.initialize(world_size, rank)
    return torch.ops.deepspeed.inference_all_reduce_


def cleanup() -> None:
    """Unlink this job's DeepSpeed segments (once every rank has attached: a mapped segment
    stays usable after its name is gone)."""
    pattern = f"/dev/shm/{_PREFIX}_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
              f"{os.environ.get('MASTER_PORT', '')}_*"
    for path in glob.glob(pattern):
        with contextlib.suppress(FileNotFoundError):  # another rank unlinked it first
            os.unlink(path)
