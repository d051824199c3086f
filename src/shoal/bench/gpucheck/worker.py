"""One check of the GPU check in one rank: ``python -m shoal.bench.gpucheck.worker CHECK
OUTDIR`` under shoalrun. Joins the job (shoal.torch and backend "shoal" over a FileStore),
takes this rank's device (a GPU shared by the ranks, or the CPU in a dry run, with the device
stage's stand-in on), runs the check and writes ``OUTDIR/CHECK.RANK.json``."""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import shoal.torch as hvd
import shoal.torch.backend
from shoal.torch.device import local_device

from .checks import CHECKS


def main(argv: list[str]) -> int:
    """Run check ``argv[0]``, writing its result under directory ``argv[1]``."""
    name, out = argv[0], Path(argv[1])
    hvd.init()
    rank = hvd.rank()
    device = local_device(hvd.local_rank(), hvd.local_size())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shoal.torch.backend.register()
    store = hvd.broadcast_object(tempfile.mktemp(prefix=f"shoal-gpucheck-{name}-"), 0,
                                 name="gpucheck.store")  # one host: a FileStore path
    dist.init_process_group("shoal", rank=rank, world_size=hvd.size(),
                            store=dist.FileStore(str(store), hvd.size()))
    result: dict = {"check": name, "rank": rank, "device": str(device)}
    start = time.perf_counter()
    try:
        result.update(CHECKS[name](device))
        result["ok"] = True
    except BaseException as exc:  # reported in the JSON, and by the exit status
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}",
                      traceback=traceback.format_exc()[-4000:])
    result["seconds"] = round(time.perf_counter() - start, 3)
    (out / f"{name}.{rank}.json").write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    hvd.shutdown()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
