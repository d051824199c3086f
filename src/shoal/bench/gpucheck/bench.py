"""The GPU check's benchmark in one process: ``python -m shoal.bench.gpucheck.bench OUT
[--alone] [--amp] --px P --batch B --steps S --warmup W``.

The application's EfficientNet-B0 (its model module only: no data modules, so nothing beyond
torch and numpy needs installing on the GPU machine) trained on synthetic tensors that live on
the device, with shoal's ``DistributedOptimizer`` under shoalrun, or ``--alone`` with a plain
optimizer (the "independent" ceiling: no communication). AMP is autocast in float16 with a
GradScaler on a GPU, bfloat16 on the CPU. Writes ``{"images_per_s": ...}`` for the job (the
sum over the ranks) to OUT from rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 on success."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--alone", action="store_true")
    p.add_argument("--amp", action="store_true")
    p.add_argument("--px", type=int, default=224)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--share", type=int, default=0,
                   help="processes training at once on this host (CPU threads are split "
                        "between them); default: the job's local size")
    args = p.parse_args(argv)
    from apps.efficientnet.model.efficientnet import efficientnet  # the model module only
    hvd = None
    rank, size, local_rank, local_size = 0, 1, 0, 1
    if not args.alone:
        import shoal.torch as hvd
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
        local_rank, local_size = hvd.local_rank(), hvd.local_size()
    from shoal.torch.device import local_device
    device = local_device(local_rank, local_size)
    cuda = device.type == "cuda"
    if not cuda:  # processes sharing the cores each take their part, not all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // (args.share or local_size)))
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    model = efficientnet("b0", num_classes=1000).to(device, memory_format=torch.channels_last)
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if hvd is not None:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    x = torch.randn(args.batch, 3, args.px, args.px, device=device).to(
        memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    half = torch.float16 if cuda else torch.bfloat16
    scaler = torch.amp.GradScaler("cuda") if args.amp and cuda else None

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        with torch.autocast(device.type, dtype=half) if args.amp else contextlib.nullcontext():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
            return
        scaler.scale(loss).backward()
        if hvd is not None:  # Horovod's AMP recipe
            opt.synchronize()
            scaler.unscale_(opt)
            with opt.skip_synchronize():
                scaler.step(opt)
        else:
            scaler.step(opt)
        scaler.update()

    for _ in range(args.warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    rate = args.steps * args.batch / (time.perf_counter() - start)
    if hvd is not None:
        rate = float(hvd.allreduce(torch.tensor([rate], dtype=torch.float64), op=hvd.Sum,
                                   name="gpucheck.bench.rate")[0])
    if rank == 0:
        Path(args.out).write_text(json.dumps({"images_per_s": rate, "ranks": size,
                                              "device": str(device)}))
    if hvd is not None:
        hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
