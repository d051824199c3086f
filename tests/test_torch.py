"""shoal.torch: Horovod's API, DistributedOptimizer equivalence and overlap, SyncBatchNorm."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from harness import run_ranks  # noqa: E402


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 8, 3, padding=1, groups=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(2), torch.nn.Flatten(), torch.nn.Linear(32, 10))


def _data(step: int, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch, 3, 8, 8, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _train(rank: int, opt_name: str, compression: str, passes: int) -> list[np.ndarray]:
    import shoal.torch as hvd
    n, b, steps = hvd.size(), 4, 5
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adam": lambda p: torch.optim.Adam(p, lr=0.01)}[opt_name]
    model = _model()
    opt = hvd.DistributedOptimizer(make(model.parameters()), model.named_parameters(),
                                   compression=hvd.Compression.by_name(compression),
                                   backward_passes_per_step=passes)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ref = _model()
    ref_opt = make(ref.parameters())
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(steps):
        opt.zero_grad()
        for k in range(passes):
            x, y = _data(step * passes + k, rank, b)
            (loss_fn(model(x), y) / passes).backward()
        opt.step()
        # the reference: one process, the whole global batch of every pass
        ref_opt.zero_grad()
        for k in range(passes):
            xs, ys = zip(*[_data(step * passes + k, r, b) for r in range(n)], strict=True)
            (loss_fn(ref(torch.cat(xs)), torch.cat(ys)) / passes).backward()
        ref_opt.step()
    tol = 2e-3 if compression != "none" else 2e-5
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=tol, atol=tol,
                                   err_msg=name)
    return [p.detach().numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize(("opt", "compression", "passes", "n"), [
    ("sgd", "none", 1, 2), ("adam", "none", 1, 3), ("sgd", "fp16", 1, 2),
    ("adam", "none", 2, 2), ("sgd", "none", 1, 4)])
def test_distributed_optimizer_matches_one_process_on_the_global_batch(opt, compression,
                                                                        passes, n) -> None:
    results = run_ranks(_train, n, opt, compression, passes, timeout=120)
    for theirs in results[1:]:  # every rank ends bitwise identical
        for a, b in zip(results[0], theirs, strict=True):
            np.testing.assert_array_equal(a, b)


def _overlap(rank: int, path: str) -> tuple[float, float, float]:
    import shoal
    import shoal.torch as hvd
    torch.manual_seed(0)
    layers = []
    for _ in range(24):
        layers += [torch.nn.Linear(256, 256), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   model.named_parameters(), bucket_bytes=1 << 20)
    x = torch.randn(1024, 256)
    import time
    windows = []
    for _ in range(4):
        opt.zero_grad()
        loss = model(x).square().mean()
        backward_start = time.perf_counter()
        loss.backward()
        windows.append((backward_start, time.perf_counter()))
        opt.step()
    tl = shoal.communicator().engine.timeline
    return windows, tl._t0


def test_reductions_start_before_backward_ends(tmp_path) -> None:
    import json
    path = str(tmp_path / "t{rank}.json")
    results = run_ranks(_overlap, 2, path, timeline=path, cycle_time_ms=0.5, timeout=120)
    windows, t0 = results[0]
    events = json.loads((tmp_path / "t0.json").read_text())
    starts = sorted(e["ts"] / 1e6 + t0 for e in events if e.get("name") == "ALLREDUCE" and
                    "buffer" in e.get("args", {}))
    during = [s for s in starts if any(a < s < b for a, b in windows)]
    # buffers were reduced while backward was still running (in at least one step: a loaded
    # machine may keep the other rank's backward behind in some)
    assert during, (windows, starts)


def _mismatch(rank: int) -> str:
    import shoal.torch as hvd
    model = torch.nn.Linear(4, 3 if rank == 0 else 5)
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             model.named_parameters())
    return "wrapped"


def test_different_models_fail_at_wrap_time() -> None:
    outcomes = run_ranks(_mismatch, 2, expect_errors=True, timeout=60)
    for outcome in outcomes:
        assert outcome is not None and outcome[0] == "err", outcome
        etype, text = outcome[1]
        assert etype == "CollectiveMismatchError" and "weight" in text, text


def _api(rank: int) -> None:
    import shoal.torch as hvd
    n = hvd.size()
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    mine = base * (rank + 1)
    tri = n * (n + 1) / 2
    torch.testing.assert_close(hvd.allreduce(mine, name="a"), base * tri / n)
    torch.testing.assert_close(hvd.allreduce(mine, op=hvd.Sum, name="s"), base * tri)
    torch.testing.assert_close(hvd.allreduce(mine, average=False, name="s2"), base * tri)
    t = mine.clone()
    assert hvd.allreduce_(t, op=hvd.Max, name="m") is t
    torch.testing.assert_close(t, base * n)
    torch.testing.assert_close(hvd.allreduce(mine, op=hvd.Sum, name="pre", prescale_factor=2.0,
                                             postscale_factor=0.5), base * tri)
    h = hvd.allreduce_async(mine.t(), name="noncontig")  # non-contiguous input
    torch.testing.assert_close(hvd.synchronize(h), (base * tri / n).t())
    b16 = mine.to(torch.bfloat16)
    torch.testing.assert_close(hvd.allreduce(b16, op=hvd.Sum, name="bf16").float(), base * tri,
                               rtol=1e-2, atol=1e-1)
    outs = hvd.grouped_allreduce([mine, mine[0]], op=hvd.Sum, name="g")
    torch.testing.assert_close(outs[1], base[0] * tri)
    gathered = hvd.allgather(torch.full((rank + 1, 2), float(rank)), name="ag")
    assert gathered.shape == (n * (n + 1) // 2, 2)
    w = torch.full((5,), float(rank))
    hvd.broadcast_(w, root_rank=n - 1, name="bc")
    torch.testing.assert_close(w, torch.full((5,), float(n - 1)))
    data = hvd.alltoall(torch.arange(2.0 * n) + 100 * rank, name="a2a")  # Horovod: no splits,
    assert data.shape == (2 * n,) and data[0].item() == 2 * rank          # no received splits
    data, recv = hvd.alltoall(torch.arange(2.0 * n) + 100 * rank, splits=[2] * n, name="a2b")
    assert recv.tolist() == [2] * n and data[0].item() == 2 * rank
    part = hvd.reducescatter(torch.ones(2 * n, 3), op=hvd.Sum, name="rs")
    torch.testing.assert_close(part, torch.full((2, 3), float(n)))
    torch.testing.assert_close(hvd.oob_allreduce(torch.tensor(float(rank))),
                               torch.tensor((n - 1) / 2))
    assert hvd.broadcast_object({"r": rank}, root_rank=0) == {"r": 0}
    assert hvd.allgather_object(rank) == list(range(n))
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1 * (rank + 1))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    assert hvd.join() in range(n)
    hvd.barrier()


def test_horovod_api() -> None:
    run_ranks(_api, 3, timeout=90)


def _syncbn(rank: int) -> None:
    import shoal.torch as hvd
    n, b = hvd.size(), 3
    torch.manual_seed(0)
    sync = hvd.SyncBatchNorm(4, momentum=0.3)
    plain = torch.nn.BatchNorm2d(4, momentum=0.3)
    with torch.no_grad():
        plain.weight.copy_(torch.rand(4) + 0.5)
        plain.bias.copy_(torch.rand(4))
        sync.weight.copy_(plain.weight)
        sync.bias.copy_(plain.bias)
    import shoal
    engine = shoal.communicator().engine
    for step in range(3):  # the same layer every step: after the first, one round a call
        if step == 1:
            before = engine.small_rounds
        sync.weight.grad = plain.weight.grad = None
        xs = [torch.randn(b, 4, 5, 5, generator=torch.Generator().manual_seed(r + 9 * step))
              * (r + 1) for r in range(n)]
        gs = [torch.randn(b, 4, 5, 5, generator=torch.Generator().manual_seed(50 + r + step))
              for r in range(n)]
        x = xs[rank].clone().requires_grad_(True)
        out = sync(x)
        (out * gs[rank]).sum().backward()
        full = torch.cat(xs).requires_grad_(True)
        ref = plain(full)
        (ref * torch.cat(gs)).sum().backward()
        torch.testing.assert_close(out, ref[rank * b:(rank + 1) * b], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(x.grad, full.grad[rank * b:(rank + 1) * b], rtol=1e-4,
                                   atol=1e-5)
    # forward and backward of steps 2 and 3
    assert engine.small_rounds - before >= 4, engine.small_rounds - before
    # parameter gradients are local sums; summed over ranks they are the global ones
    wsum = hvd.allreduce(sync.weight.grad, op=hvd.Sum, name="wg")
    torch.testing.assert_close(wsum, plain.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sync.running_mean, plain.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sync.running_var, plain.running_var, rtol=1e-5, atol=1e-6)
    # no affine parameters, 2-D and 3-D inputs
    for shape in ((5, 4), (3, 4, 6)):
        sync1, plain1 = hvd.SyncBatchNorm(4, affine=False), torch.nn.BatchNorm1d(4,
                                                                                   affine=False)
        xs1 = [torch.randn(*shape, generator=torch.Generator().manual_seed(7 + r)) * (r + 2)
               for r in range(n)]
        x1 = xs1[rank].clone().requires_grad_(True)
        out1 = sync1(x1)
        (out1 * out1).sum().backward()
        full1 = torch.cat(xs1).requires_grad_(True)
        ref1 = plain1(full1)
        (ref1 * ref1).sum().backward()
        k = shape[0]
        torch.testing.assert_close(out1, ref1[rank * k:(rank + 1) * k], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(x1.grad, full1.grad[rank * k:(rank + 1) * k], rtol=1e-4,
                                   atol=1e-4)
    converted = hvd.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(4)))
    assert isinstance(converted[0], hvd.SyncBatchNorm)


def test_sync_batch_norm_matches_batch_norm_on_the_global_batch() -> None:
    run_ranks(_syncbn, 2, timeout=60)
