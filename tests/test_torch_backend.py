"""The ``"shoal"`` torch.distributed backend: every collective against a reference, and DDP.

Each test is one job (starting processes is the expensive part on a 2-core machine) whose
ranks run ``init_process_group("shoal")`` on top of the harness's shoal job. Inputs come from
seeded generators, so every rank rebuilds every other rank's input and checks its own result.
DDP runs are checked against one process training on the concatenated batch.
"""

from __future__ import annotations

import zlib

import pytest

torch = pytest.importorskip("torch")
from harness import run_ranks  # noqa: E402


def _init(rank: int) -> None:
    import torch.distributed as dist

    import shoal
    import shoal.torch.backend as b
    torch.set_num_threads(1)
    b.register()
    b.register()  # idempotent
    import tempfile
    path = f"{tempfile.gettempdir()}/shoal-{shoal.communicator().job_id}-torchstore"
    dist.init_process_group("shoal", rank=rank, world_size=shoal.size(),
                            store=dist.FileStore(path, shoal.size()))


def _rand(case: str, rank: int, shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{case}/{rank}".encode()))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=dtype)


def _collectives(rank: int) -> str:
    import torch.distributed as dist
    _init(rank)
    n = dist.get_world_size()
    assert dist.get_backend() == "shoal" and dist.get_rank() == rank
    close = torch.testing.assert_close
    # all_reduce: ops, dtypes, async with a future callback, non-contiguous
    ops = {"SUM": lambda s: s.sum(0), "AVG": lambda s: s.mean(0), "MAX": lambda s: s.amax(0),
           "MIN": lambda s: s.amin(0), "PRODUCT": lambda s: s.prod(0)}
    for name, ref in ops.items():
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            if name == "AVG" and not dtype.is_floating_point:
                continue
            case = f"ar/{name}/{dtype}"
            t = _rand(case, rank, (5, 7), dtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
            want = ref(torch.stack([_rand(case, r, (5, 7), dtype).double() for r in range(n)]))
            tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else {}
            close(t.double(), want.to(dtype).double(), **tol)
    for name, fn in (("BAND", torch.bitwise_and), ("BOR", torch.bitwise_or),
                     ("BXOR", torch.bitwise_xor)):
        t = _rand(f"bit/{name}", rank, (9,), torch.int64)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        want = _rand(f"bit/{name}", 0, (9,), torch.int64)
        for r in range(1, n):
            want = fn(want, _rand(f"bit/{name}", r, (9,), torch.int64))
        assert torch.equal(t, want), name
    t = _rand("async", rank, (33,))
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    want = torch.stack([_rand("async", r, (33,)) for r in range(n)]).sum(0)
    close(fut.wait(), want * 2)
    close(t, want)
    base = _rand("nc", rank, (6, 4))
    dist.all_reduce(base.t())  # a transposed view: reduced in place through a copy
    close(base, torch.stack([_rand("nc", r, (6, 4)) for r in range(n)]).sum(0))
    # broadcast from every root, reduce
    for root in range(n):
        t = _rand(f"bc{root}", rank, (3, 4))
        work = dist.broadcast(t, src=root, async_op=True)
        assert work.wait()
        close(t, _rand(f"bc{root}", root, (3, 4)))
    t = _rand("reduce", rank, (9,))
    mine = t.clone()
    dist.reduce(t, dst=n - 1)
    close(t, torch.stack([_rand("reduce", r, (9,)) for r in range(n)]).sum(0)
          if rank == n - 1 else mine)
    # all_gather, all_gather_into_tensor
    parts = [_rand("ag", r, (2, 3)) for r in range(n)]
    got = [torch.empty(2, 3) for _ in range(n)]
    dist.all_gather(got, parts[rank])
    close(torch.stack(got), torch.stack(parts))
    out = torch.empty(2 * n, 3, dtype=torch.int32)
    dist.all_gather_into_tensor(out, _rand("agt", rank, (2, 3), torch.int32))
    close(out, torch.cat([_rand("agt", r, (2, 3), torch.int32) for r in range(n)]))
    # reduce_scatter_tensor, reduce_scatter (list)
    inputs = [_rand("rs", r, (n * 4, 2)) for r in range(n)]
    out = torch.empty(4, 2)
    dist.reduce_scatter_tensor(out, inputs[rank])
    close(out, torch.stack(inputs).sum(0)[rank * 4:(rank + 1) * 4])
    out = torch.empty(3)
    dist.reduce_scatter(out, list(_rand("rsl", rank, (n, 3)).unbind(0)), op=dist.ReduceOp.MAX)
    close(out, torch.stack([_rand("rsl", r, (n, 3)) for r in range(n)]).amax(0)[rank])
    # all_to_all_single: even, then with uneven (some empty) splits
    src = [_rand("a2a", r, (n * 2, 3)) for r in range(n)]
    out = torch.empty(n * 2, 3)
    dist.all_to_all_single(out, src[rank])
    close(out, torch.cat([src[r][rank * 2:rank * 2 + 2] for r in range(n)]))

    def splits(r: int) -> list[int]:
        return [(r + d) % 3 for d in range(n)]
    src = [_rand("a2as", r, (sum(splits(r)), 2)) for r in range(n)]
    recv = [splits(r)[rank] for r in range(n)]
    out = torch.empty(sum(recv), 2)
    dist.all_to_all_single(out, src[rank], recv, splits(rank))
    want = [src[r][sum(splits(r)[:rank]):sum(splits(r)[:rank + 1])] for r in range(n)]
    close(out, torch.cat(want))
    # alltoall (lists), gather, scatter
    outs = [torch.empty(r + 1) for r in range(n)]
    dist.all_to_all(outs, [_rand(f"l{rank}>{d}", 0, (rank + 1,)) for d in range(n)])
    for r in range(n):
        close(outs[r], _rand(f"l{r}>{rank}", 0, (r + 1,)))
    got = [torch.empty(4) for _ in range(n)] if rank == 0 else None
    dist.gather(_rand("g", rank, (4,)), got, dst=0)
    if rank == 0:
        close(torch.stack(got), torch.stack([_rand("g", r, (4,)) for r in range(n)]))
    out = torch.empty(5)
    dist.scatter(out, [_rand("s", r, (5,)) for r in range(n)] if rank == n - 1 else None,
                 src=n - 1)
    close(out, _rand("s", rank, (5,)))
    # barrier and the object collectives (uint8 allgather / broadcast underneath)
    dist.barrier()
    objs: list = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "blob": "x" * (10 * rank)})
    assert objs == [{"rank": r, "blob": "x" * (10 * r)} for r in range(n)]
    items = [f"from {rank}", rank, None]
    dist.broadcast_object_list(items, src=n - 1)
    assert items == [f"from {n - 1}", n - 1, None]
    # more calls in flight than name slots: a reused name waits for its previous user
    import shoal.torch.backend as b
    b._WINDOW = 4
    ts = [_rand(f"w{i}", rank, (3,)) for i in range(10)]
    works = [dist.all_reduce(t, async_op=True) for t in ts]
    for i, (t, work) in enumerate(zip(ts, works, strict=True)):
        work.wait()
        close(t, torch.stack([_rand(f"w{i}", r, (3,)) for r in range(n)]).sum(0))
    # subgroups are communicators of their own, usable alongside the default group
    ends = dist.new_group([0, n - 1])
    evens = dist.new_group(list(range(0, n, 2)))
    t = _rand("sub", rank, (4, 3))
    if rank in (0, n - 1):
        dist.all_reduce(t, group=ends)
        close(t, _rand("sub", 0, (4, 3)) + _rand("sub", n - 1, (4, 3)))
        assert dist.get_world_size(ends) == 2
    u = torch.full((2,), float(rank))
    if rank % 2 == 0:  # in flight on one group while another runs
        work = dist.all_reduce(u, group=evens, async_op=True)
    if rank in (0, n - 1):
        v = torch.ones(3)
        dist.all_reduce(v, group=ends)
        assert v.tolist() == [2.0] * 3
    if rank % 2 == 0:
        work.wait()
        assert u.tolist() == [float(sum(range(0, n, 2)))] * 2
    dist.barrier()
    dist.destroy_process_group()
    return "ok"


@pytest.mark.parametrize("n", [2, 3])
def test_collectives_match_reference(n: int) -> None:
    assert run_ranks(_collectives, n, timeout=50) == ["ok"] * n


def _net(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                   torch.nn.Linear(16, 3))
    return torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(),
                               torch.nn.Linear(16, 3))


def _batch(kind: str, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn((4, 6) if kind == "mlp" else (4, 2, 6, 6), generator=g)
    return x, torch.randint(0, 3, (4,), generator=g)


def _ddp_case(rank: int, n: int, kind: str, variant: str) -> None:
    """5 SGD steps under DDP equal one process's steps on the concatenated batches."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel
    extra = {"static_graph": variant == "static",
             "gradient_as_bucket_view": variant == "bucket_view"}
    model = _net(kind, seed=rank)  # different per rank: DDP must broadcast rank 0's
    # tiny buckets: several allreduces in flight at once
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001, **extra)
    if variant == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    ref = _net(kind, seed=0)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    micro = 2 if variant == "no_sync" else 1
    for step in range(5):
        opt.zero_grad()
        ref_opt.zero_grad()
        for k in range(micro):
            x, y = _batch(kind, step * micro + k, rank)
            if k < micro - 1:
                with ddp.no_sync():
                    loss_fn(ddp(x), y).backward()
            else:
                loss_fn(ddp(x), y).backward()
            xs, ys = zip(*(_batch(kind, step * micro + k, r) for r in range(n)), strict=True)
            loss_fn(ref(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        ref_opt.step()
    tol = dict(rtol=2e-3, atol=2e-3) if variant == "fp16" else dict(rtol=1e-5, atol=1e-5)
    for (name, got), want in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name: f"{name}: {m}")


def _ddp(rank: int, cases: list[tuple[str, str]]) -> str:
    import torch.distributed as dist
    _init(rank)
    for kind, variant in cases:
        _ddp_case(rank, dist.get_world_size(), kind, variant)
    dist.destroy_process_group()
    return "ok"


ALL_CASES = [(kind, variant) for kind in ("mlp", "conv")
             for variant in ("plain", "no_sync", "static", "bucket_view", "fp16")]


def test_ddp_matches_single_process_2_ranks() -> None:
    assert run_ranks(_ddp, 2, ALL_CASES, timeout=50) == ["ok"] * 2


def test_ddp_alone() -> None:
    # one rank: every collective completes when submitted; DDP still trains as one process
    cases = [("conv", "plain"), ("mlp", "no_sync"), ("mlp", "fp16"), ("conv", "static")]
    assert run_ranks(_ddp, 1, cases, timeout=50) == ["ok"]


def _alone(rank: int) -> list:
    import torch.distributed as dist
    _init(rank)
    out = []
    for op, want in ((dist.ReduceOp.SUM, 3.0), (dist.ReduceOp.AVG, 3.0), (dist.ReduceOp.MAX, 3.0),
                     (dist._make_nccl_premul_sum(2.0), 6.0),
                     (dist._make_nccl_premul_sum(torch.tensor(0.5)), 1.5)):
        t = torch.full((4,), 3.0)
        work = dist.all_reduce(t, op=op, async_op=True)
        out.append(work.is_completed() and work.wait() and bool((t == want).all())
                   and work.get_future().value()[0] is t)
    b = torch.arange(3.0)
    out.append(dist.broadcast(b, src=0, async_op=True).wait() and b.tolist() == [0, 1, 2])
    dist.barrier()
    seq = dist.group.WORLD._get_sequence_number_for_group()
    out.append(seq >= 7)
    import shoal
    # a process group's calls start at once; Horovod's API keeps the fusion cycle
    out.append(dist.group.WORLD.communicator.start_at_once
               and not shoal.communicator().start_at_once)
    return out


def test_a_group_of_one_completes_reductions_and_broadcasts_at_once() -> None:
    assert all(run_ranks(_alone, 1, timeout=50)[0])


def test_ddp_3_ranks_and_2x2_nodes() -> None:
    cases = [("conv", "plain"), ("mlp", "no_sync"), ("mlp", "fp16")]
    assert run_ranks(_ddp, 3, cases, timeout=50) == ["ok"] * 3
    assert run_ranks(_ddp, 4, [("mlp", "plain")], hosts=["a", "a", "b", "b"],
                     timeout=50) == ["ok"] * 4


def _steady(rank: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    _init(rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 10),
                                torch.nn.Linear(10, 3))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)  # several buckets, buffers
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    names = dist.group.WORLD.communicator.engine.names
    seen = []
    for step in range(12):
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(step * 7 + rank))
        opt.zero_grad()
        ddp(x).square().mean().backward()
        opt.step()
        seen.append(names.negotiated)
    return {"seen": seen, "weights": [p.detach().numpy().tobytes() for p in model.parameters()]}


def test_a_steady_ddp_loop_negotiates_no_name_after_its_first_steps() -> None:
    # DDP rebuilds its buckets after the first step and its buffer broadcasts settle in the
    # next; names come back 4 steps later (shoal.core.callnames): from then on every
    # collective's name and description recur, and every one is a cache hit
    out = run_ranks(_steady, 2, timeout=60)
    for got in out:
        seen = got["seen"]
        assert seen[0] > 0 and seen[6] == seen[-1], seen
    assert out[0]["weights"] == out[1]["weights"]


def _mismatched(rank: int) -> str:
    from torch.nn.parallel import DistributedDataParallel
    _init(rank)
    width = 5 if rank == 1 else 4
    model = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Linear(width, 2))
    DistributedDataParallel(model)
    return "wrapped"


def test_mismatched_models_fail_instead_of_hanging() -> None:
    outcomes = run_ranks(_mismatched, 2, expect_errors=True, timeout=40, timeout_s=3.0)
    assert None not in outcomes, f"a rank hung: {outcomes}"
    assert all(status == "err" for status, _ in outcomes), outcomes
    assert "appears not to match sizes" in outcomes[1][1][1], outcomes[1][1][1]
    assert outcomes[0][1][0] == "PeerLostError", outcomes[0]  # rank 1 left: no hang


def _spawned(rank: int, world_size: int, ports: tuple[int, int], folder: str) -> None:
    import os

    import torch.distributed as dist

    import shoal.torch  # noqa: F401  (registers the backend)
    for var in [v for v in os.environ if v.startswith(("SHOAL_", "MASTER_", "RANK", "WORLD"))]:
        del os.environ[var]
    torch.set_num_threads(1)
    for attempt in range(2):  # destroy, then init again in the same process
        dist.init_process_group("shoal", init_method=f"tcp://127.0.0.1:{ports[attempt]}",
                                rank=rank, world_size=world_size)
        model = torch.nn.parallel.DistributedDataParallel(_net("mlp"))
        x = _rand(f"spawn{attempt}", rank, (4, 6))
        model(x).square().sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        everyone = [torch.empty_like(grads) for _ in range(world_size)]
        dist.all_gather(everyone, grads)
        assert all(torch.equal(g, everyone[0]) for g in everyone)
        dist.destroy_process_group()
    with open(f"{folder}/rank{rank}", "w") as f:
        f.write("ok")


def test_mp_spawn_with_tcp_init_method(tmp_path) -> None:
    from harness import free_port
    ports = (free_port(), free_port())
    torch.multiprocessing.spawn(_spawned, args=(2, ports, str(tmp_path)), nprocs=2,
                                join=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]
