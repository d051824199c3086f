"""Mixed precision with ``torch.amp.GradScaler``: DistributedOptimizer in torch's stock recipe
(``scale(loss).backward(); unscale_; clip; step; update``: backward returns with reduced
gradients) and in Horovod's (synchronize, unscale_, skip_synchronize), fp16 compression of
fp16 and fp32 gradients, and the sharded optimizer, whose overflow check is made global. An
overflow on one rank makes every rank skip the same step and keep the same scale; the result
equals one process training on the global batch, at 2 and 3 ranks. Clipping between
backward and step clips the reduced gradients."""

from __future__ import annotations

import pytest
import torch

from harness import run_ranks

STEPS = 4
BAD_STEP = 2  # rank 1's loss overflows at this step


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 40), torch.nn.ReLU(), torch.nn.Linear(40, 3))


def _batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(n * 4, 6, generator=gen) for _ in range(STEPS)]


def _train(model, opt, scaler, batches, part, sync, skip, overflows, clip=None
           ) -> list[float]:
    """``overflows``: whether this process's loss overflows at BAD_STEP; only the last
    bias's gradient does (one shard's owner alone sees it in the sharded optimizer).
    ``clip(max_norm)`` clips by the global norm (torch's over the model by default)."""
    scales = []
    clip = clip or (lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m))
    for step, x in enumerate(batches):
        bump = float("inf") if overflows and step == BAD_STEP else 0.0
        loss = model(x[part]).pow(2).mean() + bump * model[2].bias.sum()
        scaler.scale(loss).backward()
        sync()
        scaler.unscale_(opt)
        clip(0.5)
        with skip():
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(float(scaler.get_scale()))
    return scales


def _reference(n: int) -> tuple[list[torch.Tensor], list[float]]:
    import contextlib
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    scales = _train(model, opt, scaler, _batches(n), slice(None), lambda: None,
                    contextlib.nullcontext, True)
    return [p.detach().clone() for p in model.parameters()], scales


def _distributed(rank: int, kind: str, recipe: str) -> tuple[list[torch.Tensor], list[float]]:
    import contextlib

    import shoal.torch as hvd
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    clip = None
    if kind == "sharded":
        opt = hvd.ShardedOptimizer(sgd, named_parameters=model.named_parameters())
        clip = opt.clip_grad_norm_  # (torch's would see this rank's shard only)
    else:
        compression = hvd.Compression.fp16 if kind == "fp16" else hvd.Compression.none
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                       compression=compression)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=1)
    n = hvd.size()
    part = slice(rank * 4, (rank + 1) * 4)
    sync, skip = (opt.synchronize, opt.skip_synchronize) if recipe == "horovod" else \
        (lambda: None, contextlib.nullcontext)
    scales = _train(model, opt, scaler, _batches(n), part, sync, skip, rank == 1, clip)
    # plain lists: tensors would travel back through shared memory the exiting rank frees
    return [p.detach().tolist() for p in model.parameters()], scales


@pytest.mark.parametrize(("kind", "recipe", "n"), [
    ("plain", "horovod", 2), ("fp16", "horovod", 2), ("sharded", "horovod", 2),
    ("plain", "stock", 2), ("plain", "stock", 3), ("fp16", "stock", 2),
    ("sharded", "stock", 2), ("sharded", "stock", 3)])
def test_grad_scaler_skips_alike_and_matches_the_global_batch(kind: str, recipe: str,
                                                              n: int) -> None:
    want, want_scales = _reference(n)
    assert want_scales[BAD_STEP] < want_scales[BAD_STEP - 1]  # the reference skipped it
    results = run_ranks(_distributed, n, kind, recipe, timeout=120)
    tol = {"rtol": 2e-3, "atol": 2e-3} if kind == "fp16" else {"rtol": 1e-6, "atol": 1e-6}
    for params, scales in results:
        assert scales == want_scales, (scales, want_scales)
        for got, ref in zip(params, want, strict=True):
            torch.testing.assert_close(torch.tensor(got), ref, **tol)
    assert all(r[0] == results[0][0] for r in results)


def _clipped(rank: int, sharded: bool) -> list[list[float]]:
    import shoal.torch as hvd
    torch.manual_seed(7)
    model = torch.nn.Linear(8, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                   sharded=sharded)
    x = torch.randn(hvd.size() * 3, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        opt.zero_grad()
        model(x[rank * 3:(rank + 1) * 3]).pow(2).mean().backward()
        if sharded:
            opt.clip_grad_norm_(1e-3)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


@pytest.mark.parametrize(("n", "sharded"), [(2, False), (3, False), (2, True)])
def test_clipping_between_backward_and_step_clips_the_reduced_gradients(
        n: int, sharded: bool) -> None:
    torch.manual_seed(7)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.randn(n * 3, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        opt.zero_grad()
        # the mean of the ranks' means is the global batch's mean (equal parts)
        model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        opt.step()
    want = [p.detach().reshape(-1) for p in model.parameters()]
    for params in run_ranks(_clipped, n, sharded, timeout=120):
        for got, ref in zip(params, want, strict=True):
            torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-6, atol=1e-6)


def _half(rank: int) -> list[float]:
    import shoal.torch as hvd
    torch.manual_seed(5)
    model = torch.nn.Linear(8, 4).half()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    x = torch.full((2, 8), float(rank + 1), dtype=torch.float16)
    model(x).float().sum().backward()
    local = [p.grad.float().clone() for p in model.parameters()]
    opt.synchronize()
    assert all(p.grad.dtype == torch.float16 for p in model.parameters())
    reduced = [p.grad.float() for p in model.parameters()]
    total = hvd.allreduce(torch.cat([g.reshape(-1) for g in local]), op=hvd.Average)
    return [float((torch.cat([g.reshape(-1) for g in reduced]) - total).abs().max())]


def test_fp16_compression_of_fp16_gradients() -> None:
    for (err,) in run_ranks(_half, 2):
        assert err <= 1e-3, err
