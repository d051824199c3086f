"""The rest of the c10d ProcessGroup surface on backend "shoal": point-to-point (send/recv,
isend/irecv, batch_isend_irecv, receive from any source), and what torch's own tests use."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from harness import run_ranks  # noqa: E402
from test_torch_backend import _init, _rand  # noqa: E402


def _p2p(rank: int) -> str:
    import torch.distributed as dist
    _init(rank)
    n = dist.get_world_size()
    # blocking send/recv to rank 0, which receives from any source and learns the sender
    if rank == 0:
        seen = set()
        for _ in range(n - 1):
            y = torch.zeros(3, 5)
            src = dist.recv(y, tag=3)  # the ring below sends to rank 0 with tag 0
            assert torch.equal(y, _rand("to0", src, (3, 5))), src
            seen.add(src)
        assert seen == set(range(1, n))
    else:
        dist.send(_rand("to0", rank, (3, 5)), 0, tag=3)
    # a ring through batch_isend_irecv, several dtypes and an empty tensor, odd sizes
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    cases = [((1001,), torch.float64), ((7, 3), torch.int32), ((0,), torch.float32),
             ((5,), torch.bfloat16)]
    ops, outs = [], []
    for i, (shape, dtype) in enumerate(cases):
        ops.append(dist.P2POp(dist.isend, _rand(f"ring{i}", rank, shape, dtype), nxt))
        outs.append(torch.empty(shape, dtype=dtype))
        ops.append(dist.P2POp(dist.irecv, outs[-1], prv))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for i, (shape, dtype) in enumerate(cases):
        assert torch.equal(outs[i], _rand(f"ring{i}", prv, shape, dtype)), i
    # tags keep messages apart; a non-contiguous receive buffer is written back
    if rank == 0:
        a = dist.isend(torch.tensor([1.0, 2.0]), 1, tag=7)
        b = dist.isend(torch.tensor([3.0, 4.0]), 1, tag=8)
        a.wait()
        b.wait()
    elif rank == 1:
        buf = torch.zeros(2, 2)
        col = buf[:, 1]  # a strided view
        dist.recv(col, 0, tag=8)
        first = torch.zeros(2)
        dist.irecv(first, 0, tag=7).wait()
        assert buf[:, 1].tolist() == [3.0, 4.0] and first.tolist() == [1.0, 2.0]
    # errors: a bad peer is refused at once, and the group stays usable
    with pytest.raises(ValueError, match="another rank"):
        dist.distributed_c10d._get_default_group().send([torch.zeros(1)], n + 3, 0)
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert total.item() == n * (n - 1) / 2
    dist.destroy_process_group()
    return "ok"


@pytest.mark.parametrize("n", [2, 3])
def test_point_to_point(n: int) -> None:
    assert run_ranks(_p2p, n, timeout=60) == ["ok"] * n


def _ops_and_barriers(rank: int) -> str:
    import time

    import torch.distributed as dist
    _init(rank)
    n = dist.get_world_size()
    # PREMUL_SUM, with a float factor and a tensor factor, through all_reduce and
    # reduce_scatter_tensor, against the float64 reference
    for factor in (2.5, torch.tensor([0.25])):
        op = dist._make_nccl_premul_sum(factor)
        f = float(factor) if not isinstance(factor, torch.Tensor) else factor.item()
        x = _rand("premul", rank, (11,), torch.float64)
        want = f * sum(_rand("premul", r, (11,), torch.float64) for r in range(n))
        dist.all_reduce(x, op=op)
        torch.testing.assert_close(x, want)
        inp = _rand("premul-rs", rank, (3 * n,), torch.float64)
        out = torch.empty(3, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, inp, op=op)
        full = f * sum(_rand("premul-rs", r, (3 * n,), torch.float64) for r in range(n))
        torch.testing.assert_close(out, full[3 * rank:3 * rank + 3])
    # reduce-scatter: bfloat16 blocks, uneven parts (rank r keeps r + 1 elements), AVG
    inp = _rand("rs-bf16", rank, (2 * n, 3), torch.bfloat16)
    out = torch.empty(2, 3, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(out, inp)
    want = sum(_rand("rs-bf16", r, (2 * n, 3), torch.bfloat16).float() for r in range(n))
    torch.testing.assert_close(out.float(), want[2 * rank:2 * rank + 2], rtol=2e-2, atol=2e-2)
    parts = [_rand(f"rs-uneven{q}", rank, (q + 1,), torch.float64) for q in range(n)]
    out = torch.empty(rank + 1, dtype=torch.float64)
    dist.reduce_scatter(out, parts, op=dist.ReduceOp.AVG)
    want = sum(_rand(f"rs-uneven{rank}", r, (rank + 1,), torch.float64) for r in range(n)) / n
    torch.testing.assert_close(out, want)
    # sparse COO all_reduce: indices gathered from every rank, values summed, coalesced
    sp = torch.sparse_coo_tensor(torch.tensor([[rank, 4]]), torch.tensor([1.0 + rank, 2.0]),
                                 (6,))
    dist.all_reduce(sp)
    want = torch.zeros(6)
    for r in range(n):
        want[r] += 1.0 + r
        want[4] += 2.0
    assert sp.is_sparse and torch.equal(sp.to_dense(), want)
    # monitored_barrier: passes when everyone comes
    dist.monitored_barrier()
    dist.monitored_barrier(timeout=5.0, wait_all_ranks=True)
    # a late rank is named on rank 0; the late ones time out waiting for the release
    late = {1} if n == 2 else {1, 2}
    for wait_all in (False, True):
        if rank in late:
            time.sleep(2.5)
        try:
            dist.monitored_barrier(timeout=__import__("datetime").timedelta(seconds=1),
                                   wait_all_ranks=wait_all)
            raise AssertionError("monitored_barrier passed with a late rank")
        except RuntimeError as exc:
            if rank == 0:
                want = ("Ranks 1, 2 failed" if n == 3 and wait_all else
                        "Ranks 1 failed" if wait_all else "Rank 1 failed")
                assert want in str(exc), str(exc)
        dist.barrier()
    # and after failures, a round where everyone comes passes again
    dist.monitored_barrier(timeout=10.0)
    if rank == 0:  # a zero timeout has expired before anyone is waited for
        with pytest.raises(RuntimeError, match="Rank 0 timed out in monitoredBarrier"):
            dist.monitored_barrier(timeout=__import__("datetime").timedelta(seconds=0))
    dist.destroy_process_group()
    return "ok"


@pytest.mark.parametrize("n", [2, 3])
def test_premul_sum_and_monitored_barrier(n: int) -> None:
    assert run_ranks(_ops_and_barriers, n, timeout=90) == ["ok"] * n


def _train_pair(rank: int, make_ddp, steps: int = 4):
    """The same model trained twice from the same start, once over a shoal group and once
    over a gloo group of the same ranks; both final weight lists."""
    import torch.distributed as dist
    out = []
    for group in (dist.group.WORLD, dist.new_group(backend="gloo")):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                                  torch.nn.Linear(16, 16), torch.nn.ReLU(),
                                  torch.nn.Linear(16, 3))
        model, opt = make_ddp(net, group)
        for step in range(steps):
            x = _rand(f"x{step}", rank, (5, 12))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        out.append([p.detach().clone() for p in net.parameters()])
    return out


def _client_features(rank: int) -> str:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    _init(rank)

    def plain(net, group, **kw):
        model = DistributedDataParallel(net, process_group=group, **kw)
        return model, torch.optim.SGD(net.parameters(), lr=0.05)

    def unused(net, group):  # a branch that only some steps use
        return plain(net, group, find_unused_parameters=True)

    def fp16(net, group):
        model, opt = plain(net, group)
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
        return model, opt

    def power(net, group):
        model, opt = plain(net, group)
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, random_seed=0,
                                       min_compression_rate=0.5)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
        return model, opt

    def zero(net, group):
        model = DistributedDataParallel(net, process_group=group)
        return model, ZeroRedundancyOptimizer(net.parameters(), torch.optim.Adam, lr=0.01,
                                              process_group=group)

    for name, make in [("plain", plain), ("unused", unused), ("fp16", fp16),
                       ("powersgd", power), ("zero", zero)]:
        shoal_w, gloo_w = _train_pair(rank, make)
        for a, b in zip(shoal_w, gloo_w, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        everyone = [torch.empty_like(shoal_w[0]) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, shoal_w[0])
        assert all(torch.equal(w, everyone[0]) for w in everyone), name
    dist.destroy_process_group()
    return "ok"


def test_ddp_hooks_unused_parameters_and_zero_match_gloo() -> None:
    assert run_ranks(_client_features, 2, timeout=120) == ["ok", "ok"]


def _barrier_timeouts(rank: int) -> str:
    import time
    from datetime import timedelta

    import torch.distributed as dist
    _init(rank)
    group = dist.new_group(timeout=timedelta(seconds=1))  # the group's timeout bounds waits
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="Timed out waiting 1000ms"):
            dist.barrier(group)
        assert time.monotonic() - start < 20
        wide = dist.new_group(timeout=timedelta(seconds=300))  # a per-call timeout wins
        with pytest.raises(RuntimeError, match="Timed out waiting 200ms"):
            dist.barrier(wide, timeout=timedelta(milliseconds=200))
    else:
        dist.new_group(timeout=timedelta(seconds=300))
    dist.destroy_process_group()
    return "ok"


def test_barrier_timeouts_are_the_groups_or_the_calls() -> None:
    assert run_ranks(_barrier_timeouts, 2, timeout=60) == ["ok", "ok"]
