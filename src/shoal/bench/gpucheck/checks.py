"""What each rank of the GPU check runs. Every check returns a dict of figures and raises
``AssertionError`` on a wrong result; inputs come from seeded generators, so each rank
rebuilds every rank's input and compares its own result with a numpy or single-process
reference."""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

import shoal.torch as hvd

__all__ = ["CHECKS"]

LENGTHS = (0, 1, 1001)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32)


def _rand(case: str, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}/{rank}".encode()))
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    return torch.randint(-50, 50, shape, generator=gen, dtype=dtype)


def _close(got: torch.Tensor, want: np.ndarray, dtype: torch.dtype, what: str,
           device: torch.device) -> None:
    assert got.device.type == device.type, f"{what}: result on {got.device}, not {device}"
    assert got.dtype == dtype, f"{what}: dtype {got.dtype} != {dtype}"
    g = got.detach().float().cpu().numpy().astype(np.float64)
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2}.get(dtype, 1e-5)
    scale = np.maximum(np.abs(want), 1.0)
    assert g.shape == want.shape, f"{what}: shape {g.shape} != {want.shape}"
    assert np.all(np.abs(g - want) <= tol * scale * 4), f"{what}: differs from numpy"


def _all(case: str, n: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[np.ndarray]:
    return [_rand(case, r, shape, dtype).double().numpy() for r in range(n)]


def collectives(device: torch.device) -> dict[str, Any]:
    """Every torch collective of shoal.torch and backend "shoal" on tensors of ``device``."""
    import torch.distributed as dist
    rank, n = hvd.rank(), hvd.size()
    count = 0
    for dtype in DTYPES:
        for length in LENGTHS:
            case = f"c/{dtype}/{length}"
            mine = _rand(case, rank, (length,), dtype).to(device)
            every = _all(case, n, (length,), dtype)
            total = np.sum(every, axis=0)
            _close(hvd.allreduce(mine, op=hvd.Sum, name=f"{case}.sum"), total, dtype,
                   f"allreduce {case}", device)
            if dtype.is_floating_point:
                _close(hvd.allreduce(mine, name=f"{case}.avg"), total / n, dtype,
                       f"allreduce average {case}", device)
                inplace = mine.clone()
                hvd.allreduce_(inplace, op=hvd.Sum, name=f"{case}.inplace")
                _close(inplace, total, dtype, f"allreduce_ {case}", device)
            rows = _rand(f"{case}/rows", rank, (rank + 1, 3), dtype).to(device)
            want = np.concatenate([_rand(f"{case}/rows", r, (r + 1, 3), dtype).double()
                                   .numpy() for r in range(n)])
            _close(hvd.allgather(rows, name=f"{case}.gather"), want, dtype,
                   f"allgather {case}", device)
            _close(hvd.broadcast(mine, root_rank=n - 1, name=f"{case}.bcast"), every[-1],
                   dtype, f"broadcast {case}", device)
            count += 4
    grouped = [_rand(f"g{i}", rank, (7 + i,), torch.float32).to(device) for i in range(3)]
    for i, out in enumerate(hvd.grouped_allreduce(grouped, op=hvd.Sum, name="grouped")):
        _close(out, np.sum(_all(f"g{i}", n, (7 + i,), torch.float32), axis=0), torch.float32,
               "grouped_allreduce", device)
    block = _rand("rs", rank, (4 * n, 5), torch.float32).to(device)
    want = np.sum(_all("rs", n, (4 * n, 5), torch.float32), axis=0)[4 * rank:4 * rank + 4]
    _close(hvd.reducescatter(block, op=hvd.Sum, name="rs"), want, torch.float32,
           "reducescatter", device)
    data = torch.arange(2 * n, dtype=torch.float32, device=device) + 100 * rank
    got, received = hvd.alltoall(data, splits=[2] * n, name="a2a")
    assert received.tolist() == [2] * n, f"alltoall received splits {received.tolist()}"
    want = np.concatenate([np.arange(2 * rank, 2 * rank + 2) + 100 * r for r in range(n)])
    _close(got, want.astype(np.float64), torch.float32, "alltoall", device)
    count += 4 + n
    # backend "shoal": the c10d collectives
    x = _rand("d", rank, (1001,), torch.float32).to(device)
    every = _all("d", n, (1001,), torch.float32)
    t = x.clone()
    dist.all_reduce(t)
    _close(t, np.sum(every, axis=0), torch.float32, "dist.all_reduce", device)
    t = x.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    _close(t, np.max(every, axis=0), torch.float32, "dist.all_reduce MAX", device)
    t = x.clone()
    dist.broadcast(t, src=0)
    _close(t, every[0], torch.float32, "dist.broadcast", device)
    outs = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(outs, x)
    for r in range(n):
        _close(outs[r], every[r], torch.float32, "dist.all_gather", device)
    flat = torch.empty(n * 1001, device=device)
    dist.all_gather_into_tensor(flat, x)
    _close(flat, np.concatenate(every), torch.float32, "dist.all_gather_into_tensor", device)
    big = _rand("rst", rank, (n * 6,), torch.float32).to(device)
    part = torch.empty(6, device=device)
    dist.reduce_scatter_tensor(part, big)
    _close(part, np.sum(_all("rst", n, (n * 6,), torch.float32), axis=0)[6 * rank:6 * rank + 6],
           torch.float32, "dist.reduce_scatter_tensor", device)
    swap = torch.empty(2 * n, device=device)
    dist.all_to_all_single(swap, data)
    _close(swap, want.astype(np.float64), torch.float32, "dist.all_to_all_single", device)
    t = x.clone()
    dist.reduce(t, dst=0)
    _close(t, np.sum(every, axis=0) if rank == 0 else every[rank], torch.float32,
           "dist.reduce", device)
    if n > 1:
        buf = torch.empty(1001, device=device)
        if rank == 0:
            dist.send(x, dst=1)
        elif rank == 1:
            dist.recv(buf, src=0)
            _close(buf, every[0], torch.float32, "dist.send/recv", device)
        # what the caller queued before a receive (a fill behind a long kernel) lands before
        # the bytes received: the copy stream is ordered after the caller's stream
        big = torch.full((1 << 22,), 7.0, device=device)
        if rank == 0:
            dist.send(big, dst=1)
        elif rank == 1:
            into = torch.empty(1 << 22, device=device)
            if device.type == "cuda":
                torch.cuda._sleep(100_000_000)
            into.fill_(0.0)
            dist.recv(into, src=0)
            assert float(into.min()) == 7.0, "a fill queued before recv landed after the bytes"
    dist.barrier()
    # sparse gradients on the device: coalesced in step(), not in backward
    torch.manual_seed(11)
    emb = torch.nn.Embedding(50, 4, sparse=True).to(device)
    start = emb.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                   named_parameters=[("emb.weight", emb.weight)])
    ids = [torch.tensor([r, r + 1, 7]) for r in range(n)]
    emb(ids[rank].to(device)).sum().backward()
    opt.step()
    want = start.cpu().double().numpy().copy()
    for r in range(n):
        for i in ids[r].tolist():
            want[i] -= 1.0 / n
    _close(emb.weight, want, torch.float32, "sparse gradient through DistributedOptimizer",
           device)
    return {"collectives_checked": count + 12}


# -- training ------------------------------------------------------------------------------------
def _net() -> torch.nn.Module:
    torch.manual_seed(7)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(16, 16, 3),
        torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(),
        torch.nn.Linear(64, 10))


def _amp(device: torch.device) -> tuple[Callable[[], Any], Any]:
    if device.type == "cuda":
        return (lambda: torch.autocast("cuda", dtype=torch.float16)), \
            (lambda: torch.amp.GradScaler("cuda", init_scale=2.0 ** 12))
    return (lambda: torch.autocast("cpu", dtype=torch.bfloat16)), \
        (lambda: torch.amp.GradScaler("cpu", init_scale=2.0 ** 12))


def _train(model: torch.nn.Module, opt: Any, batches: list[tuple[torch.Tensor, torch.Tensor]],
           device: torch.device, distributed: bool) -> float:
    autocast, make_scaler = _amp(device)
    scaler = make_scaler()
    loss_fn = torch.nn.CrossEntropyLoss()
    for x, y in batches:
        with autocast():
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        if distributed:
            opt.synchronize()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        with opt.skip_synchronize() if distributed else contextlib.nullcontext():
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return float(scaler.get_scale())


def amp_training(device: torch.device) -> dict[str, Any]:
    """DistributedOptimizer with AMP (GradScaler; fp16 compression; the sharded optimizer)
    against one process on the global batch."""
    rank, n, per = hvd.rank(), hvd.size(), 4
    gen = torch.Generator().manual_seed(5)
    data = [(torch.randn(n * per, 3, 12, 12, generator=gen),
             torch.randint(0, 10, (n * per,), generator=gen)) for _ in range(5)]
    ref = _net().to(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    _train(ref, ref_opt, [(x.to(device), y.to(device)) for x, y in data], device, False)
    mine = [(x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per]
             .to(device)) for x, y in data]
    worst: dict[str, float] = {}
    finals: dict[str, list[torch.Tensor]] = {}
    for kind in ("none", "fp16", "sharded"):
        model = _net().to(device)
        sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        opt = hvd.ShardedOptimizer(sgd, model.named_parameters()) if kind == "sharded" else \
            hvd.DistributedOptimizer(sgd, model.named_parameters(),
                                     compression=hvd.Compression.fp16 if kind == "fp16"
                                     else hvd.Compression.none)
        _train(model, opt, mine, device, True)
        err = max(float((p - q).abs().max()) for p, q in zip(model.parameters(),
                                                              ref.parameters(), strict=True))
        worst[kind] = err
        finals[kind] = [p.detach().clone() for p in model.parameters()]
        assert err < 5e-3, f"AMP training ({kind}) differs from the global batch by {err:.2e}"
        if hasattr(opt, "remove_hooks"):
            opt.remove_hooks()
    moved = max(float((a - b).abs().max()) for a, b in zip(finals["fp16"], finals["none"],
                                                            strict=True))
    return {**{f"amp_max_param_error_{k}": v for k, v in worst.items()},
            "fp16_compression_effect": moved}


def syncbn_and_ddp(device: torch.device) -> dict[str, Any]:
    """SyncBatchNorm against BatchNorm on the global batch; DDP over backend "shoal"."""
    rank, n = hvd.rank(), hvd.size()
    xs = [_rand("bn", r, (4, 8, 5, 5), torch.float32) for r in range(n)]
    bn = torch.nn.BatchNorm2d(8).to(device)
    sbn = hvd.SyncBatchNorm(8).to(device)
    x = xs[rank].clone().to(device).requires_grad_(True)
    out = sbn(x)
    (out * torch.arange(8, device=device).view(1, 8, 1, 1)).sum().backward()
    xf = torch.cat(xs).detach().to(device).requires_grad_(True)
    ref = bn(xf)
    (ref * torch.arange(8, device=device).view(1, 8, 1, 1)).sum().backward()
    err_out = float((out - ref[4 * rank:4 * rank + 4]).abs().max())
    err_grad = float((x.grad - xf.grad[4 * rank:4 * rank + 4]).abs().max())
    err_stats = float((sbn.running_var - bn.running_var).abs().max())
    wgrad = hvd.allreduce(sbn.weight.grad, op=hvd.Sum, name="bn.wgrad")
    err_w = float((wgrad - bn.weight.grad).abs().max())
    for what, err in (("output", err_out), ("input grad", err_grad),
                      ("running var", err_stats), ("weight grad", err_w)):
        assert err < 1e-3, f"SyncBatchNorm {what} differs from BatchNorm by {err:.2e}"
    model = _net().to(device)
    ref_model = _net().to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(9)
    for _ in range(3):
        x = torch.randn(n * 4, 3, 12, 12, generator=gen).to(device)
        y = torch.randint(0, 10, (n * 4,), generator=gen).to(device)
        torch.nn.functional.cross_entropy(ddp(x[4 * rank:4 * rank + 4]),
                                          y[4 * rank:4 * rank + 4]).backward()
        opt.step()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref_model(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    err_ddp = max(float((p - q).abs().max()) for p, q in zip(model.parameters(),
                                                              ref_model.parameters(),
                                                              strict=True))
    assert err_ddp < 1e-4, f"DDP over backend shoal differs from one process by {err_ddp:.2e}"
    return {"syncbn_max_error": max(err_out, err_grad, err_stats, err_w),
            "ddp_max_param_error": err_ddp}


# -- the profiled step ---------------------------------------------------------------------------
_SYNCS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")


@contextlib.contextmanager
def _host_waits(phase: list[str], seen: list[tuple[str, str, str]]) -> Iterator[None]:
    """Record every Python-level wait for the device: who (thread), when (phase), what."""
    patched = []
    from shoal.torch.device.streams import Download
    targets = [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"),
               (Download, "wait")]
    for owner, attr in targets:
        original = getattr(owner, attr)

        def wrapper(self, *a, _original=original, _what=f"{owner.__name__}.{attr}", **k):
            seen.append((threading.current_thread().name, phase[0], _what))
            return _original(self, *a, **k)
        setattr(owner, attr, wrapper)
        patched.append((owner, attr, original))
    original_sync = torch.cuda.synchronize

    def device_sync(*a, **k):
        seen.append((threading.current_thread().name, phase[0], "torch.cuda.synchronize"))
        return original_sync(*a, **k)
    torch.cuda.synchronize = device_sync
    try:
        yield
    finally:
        torch.cuda.synchronize = original_sync
        for owner, attr, original in patched:
            setattr(owner, attr, original)


def _busy_share(intervals: list[tuple[float, float]], lo: float, hi: float) -> float | None:
    if hi <= lo:
        return None
    spans = sorted((max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi)
    busy, end = 0.0, lo
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy / (hi - lo)


def profiled_step(device: torch.device) -> dict[str, Any]:
    """One training step under torch.profiler: the host waits shoal causes before step()
    (target: none on the training thread), and the GPU's idle share of the step."""
    from torch.profiler import ProfilerActivity, profile, record_function
    torch.manual_seed(3)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024),
                                                      torch.nn.ReLU()) for _ in range(8)],
                                torch.nn.Linear(1024, 10)).to(device)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   model.named_parameters(), bucket_bytes=2 << 20)
    x = torch.randn(256, 1024, device=device)
    y = torch.randint(0, 10, (256,), device=device)
    # backward's hooks (shoal's among them) run on autograd's device thread on a GPU, not the
    # main one: mark where gradients become ready, so that every training thread is watched
    training_threads: set[str] = set()

    def grad_ready(_: torch.Tensor) -> None:
        training_threads.add(threading.current_thread().name)
        with record_function("check.grad_ready"):
            pass
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(grad_ready)

    def step(phase: list[str]) -> None:
        phase[0] = "forward"
        with record_function("check.forward"):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        phase[0] = "backward"
        with record_function("check.backward"):
            loss.backward()
        phase[0] = "step"
        with record_function("check.step"):
            opt.step()
            opt.zero_grad(set_to_none=False)
        phase[0] = "after"

    phase = ["warmup"]
    for _ in range(3):
        step(phase)
    seen: list[tuple[str, str, str]] = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                          if device.type == "cuda" else [])
    with _host_waits(phase, seen), profile(activities=activities) as prof:
        step(phase)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    events = list(prof.events())
    marks = {e.name: e for e in events if e.name.startswith("check.")}
    tids = {marks["check.backward"].thread} | {e.thread for e in events
                                               if e.name == "check.grad_ready"}
    lo = marks["check.forward"].time_range.start
    bwd_end = marks["check.backward"].time_range.end
    hi = marks["check.step"].time_range.end
    runtime_waits = [e.name for e in events if e.name in _SYNCS and e.thread in tids
                     and lo <= e.time_range.start <= bwd_end]
    kernels = [(e.time_range.start, e.time_range.end) for e in events
               if str(getattr(e, "device_type", "")).endswith("CUDA")]
    busy = _busy_share(kernels, lo, hi) if kernels else None
    # shoal's own waits (Download.wait; on a GPU it synchronises an event): none may run
    # before step() on any thread but shoal's own (the engine's and its pool's: the design),
    # whether the main thread or autograd's
    before_step = [w for w in seen if not w[0].startswith("shoal-")
                   and w[1] in ("forward", "backward")]
    by_thread: dict[str, int] = {}
    for w in seen:
        by_thread[w[0]] = by_thread.get(w[0], 0) + 1
    result = {"buckets": opt._buckets.count if opt._buckets is not None else 0,
              "shoal_host_waits_before_step": len(before_step),
              "host_waits_by_shoal_threads": sum(1 for w in seen if w[0].startswith("shoal-")),
              "host_waits_by_thread": by_thread,
              "training_threads": sorted(training_threads),
              "runtime_syncs_on_training_thread_in_backward": len(runtime_waits),
              "gpu_idle_share_of_step": None if busy is None else round(1.0 - busy, 4),
              "step_ms": round((hi - lo) / 1000.0, 3)}
    assert not before_step, f"shoal waited for the device before step(): {before_step}"
    assert not runtime_waits, f"device syncs on the training thread in backward: " \
        f"{runtime_waits}"
    return result


def solo_device_group(device: torch.device) -> dict[str, Any]:
    """SMDDP's orchestration over a one-rank device group per rank (NCCL on a GPU; on the
    CPU gloo, made to connect lazily as NCCL always does): the group meets through shoal's
    store at its first collective, after a garbage collection, so a store that does not
    outlive its group fails here even on a machine with one GPU. Results against numpy."""
    import gc
    import os

    import shoal
    from shoal.core.reduction import ReduceOp
    from shoal.torch.device.group import make_device_group
    os.environ["TORCH_GLOO_LAZY_INIT"] = "1"
    comm = shoal.communicator()
    rank, n = comm.rank, comm.size
    backend = "nccl" if device.type == "cuda" else "gloo"
    group = make_device_group(comm, device, backend, 0, 1, list(range(n)),
                              f"gpucheck/solo/{rank}")
    gc.collect()
    count = 0
    try:
        for dtype in (torch.float32, torch.float16):
            for length in LENGTHS:
                for op in (ReduceOp.SUM, ReduceOp.AVERAGE):
                    case = f"solo/{dtype}/{length}/{op.name}"
                    flat = _rand(case, rank, (length,), dtype).to(device)
                    red = group.allreduce_async(flat, op, case)
                    red.wait()
                    total = np.sum(_all(case, n, (length,), dtype), axis=0)
                    _close(red.finish(), total / n if op is ReduceOp.AVERAGE else total, dtype,
                           f"device group {case}", device)
                    count += 1
    finally:
        group.close()
    return {"backend": backend, "reductions": count}


CHECKS: dict[str, Callable[[torch.device], dict[str, Any]]] = {
    "collectives": collectives, "amp": amp_training, "syncbn_ddp": syncbn_and_ddp,
    "profile": profiled_step, "device_group": solo_device_group}
