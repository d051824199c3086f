"""The sharded optimizer (ZeRO stages 1 and 2): against the unsharded DistributedOptimizer
over 5 steps with SGD + momentum and with Adam at 2 and 3 ranks (float32 tolerance), the same
bits on every rank, optimizer state divided among the ranks, a consolidated state dict that
an ordinary optimizer loads, gradient clipping over every shard, and checkpoint resume."""

from __future__ import annotations

import hashlib

import pytest

torch = pytest.importorskip("torch")

from harness import run_ranks  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam([{"params": ps[:3], "lr": 1e-2},
                                         {"params": ps[3:], "lr": 3e-3}]),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3))
    model[2].bias.requires_grad_(False)  # frozen: stepped by nobody
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _train(model, opt, rank: int, steps: range, clip: float | None = None) -> None:
    for step in steps:
        x, y = _batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            if hasattr(opt, "clip_grad_norm_"):
                opt.clip_grad_norm_(clip)
            else:
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if clip is not None and not hasattr(opt, "clip_grad_norm_"):
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()


def _digest(model) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()


def _state_elements(opt) -> int:
    return sum(v.numel() for s in opt.state.values() for v in s.values()
               if torch.is_tensor(v) and v.dim() > 0)


def _against_unsharded(rank: int, kind: str, bucket_bytes: int | None,
                       clip: float | None) -> dict:
    import shoal.torch as hvd
    plain_model, sharded_model = _model(), _model()
    plain = hvd.DistributedOptimizer(OPTIMIZERS[kind](list(plain_model.parameters())),
                                     plain_model.named_parameters())
    sharded = hvd.DistributedOptimizer(OPTIMIZERS[kind](list(sharded_model.parameters())),
                                       sharded_model.named_parameters(), sharded=True,
                                       bucket_bytes=bucket_bytes)
    assert isinstance(sharded, hvd.ShardedOptimizer)
    _train(plain_model, plain, rank, range(5), clip)
    _train(sharded_model, sharded, rank, range(5), clip)
    for (name, a), b in zip(plain_model.named_parameters(), sharded_model.parameters(),
                            strict=True):
        torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-6, msg=name)
    full = sharded.state_dict()
    reference = plain.state_dict()
    assert full["param_groups"] == reference["param_groups"]
    assert sorted(full["state"]) == sorted(reference["state"])
    for i, state in reference["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(full["state"][i][key], value, rtol=2e-5, atol=2e-6)
    # an ordinary optimizer takes the consolidated dict
    OPTIMIZERS[kind](list(_model().parameters())).load_state_dict(full)
    return {"digest": _digest(sharded_model), "mine": _state_elements(sharded),
            "all": _state_elements(plain)}


@pytest.mark.parametrize(("n", "kind", "bucket_bytes", "clip"),
                         [(2, "sgd", None, None), (2, "adam", 256, 0.05),
                          (3, "adam", None, None), (3, "sgd", 200, 0.05)])
def test_sharded_matches_unsharded(n: int, kind: str, bucket_bytes, clip) -> None:
    results = run_ranks(_against_unsharded, n, kind, bucket_bytes, clip, timeout=120)
    assert len({r["digest"] for r in results}) == 1  # bitwise the same on every rank
    total = results[0]["all"]
    assert sum(r["mine"] for r in results) == total
    assert max(r["mine"] for r in results) <= total / n * 1.6, [r["mine"] for r in results]


def _resume(rank: int, tmp: str) -> str:
    import shoal.torch as hvd
    # five steps in one go
    model = _model()
    opt = hvd.DistributedOptimizer(OPTIMIZERS["adam"](list(model.parameters())), sharded=True)
    _train(model, opt, rank, range(5))
    straight = _digest(model)
    # three steps, a checkpoint, a new process's worth of objects, two more steps
    model = _model()
    opt = hvd.ShardedOptimizer(OPTIMIZERS["adam"](list(model.parameters())))
    _train(model, opt, rank, range(3))
    checkpoint = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if rank == 0:
        torch.save(checkpoint, f"{tmp}/ckpt.pt")
    hvd.barrier()
    saved = torch.load(f"{tmp}/ckpt.pt")
    model = _model()
    model.load_state_dict(saved["model"])
    opt = hvd.ShardedOptimizer(OPTIMIZERS["adam"](list(model.parameters())))
    opt.load_state_dict(saved["optimizer"])
    _train(model, opt, rank, range(3, 5))
    assert _digest(model) == straight
    return straight


def test_sharded_checkpoint_resume(tmp_path) -> None:
    digests = run_ranks(_resume, 2, str(tmp_path), timeout=120)
    assert len(set(digests)) == 1


def _refusals(rank: int) -> str:
    import shoal.torch as hvd
    model = _model()
    with pytest.raises(ValueError, match="compression"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sharded=True,
                                 compression=hvd.Compression.fp16)
    opt = hvd.ShardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = _batch(rank, 0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="computed again"):
        torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    return "ok"


def test_sharded_refusals() -> None:
    assert run_ranks(_refusals, 2, timeout=60) == ["ok"] * 2


def _accumulated(rank: int, passes: int) -> dict:
    """Three steps of ``passes`` backward passes each, sharded against unsharded; what the
    sharded optimizer holds between backward and step, and after the step."""
    import shoal.torch as hvd
    plain_model, sharded_model = _model(), _model()
    plain = hvd.DistributedOptimizer(OPTIMIZERS["adam"](list(plain_model.parameters())),
                                     backward_passes_per_step=passes)
    sharded = hvd.DistributedOptimizer(OPTIMIZERS["adam"](list(sharded_model.parameters())),
                                       sharded=True, bucket_bytes=300,
                                       backward_passes_per_step=passes)
    held = []
    for model, opt in ((plain_model, plain), (sharded_model, sharded)):
        for step in range(3):
            opt.zero_grad()
            for micro in range(passes):
                x, y = _batch(rank, 10 * step + micro)
                torch.nn.functional.mse_loss(model(x), y).backward()
            if opt is sharded:
                # ZeRO-2: backward returns with this rank's reduced shard only (autograd's
                # gradients released, each flat gradient dropped as its reduction finished)
                assert all(s.grad is None for s in opt._shards)
                opt.synchronize()  # (nothing left to wait for)
                held.append(sum(p.grad.numel() for p in model.parameters()
                                if p.grad is not None))
            opt.step()
            if opt is sharded:
                assert all(s.grad is None for s in opt._shards)  # no flat gradient left
    for (name, a), b in zip(plain_model.named_parameters(), sharded_model.parameters(),
                            strict=True):
        torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-6, msg=name)
    total = sum(p.numel() for p in sharded_model.parameters() if p.requires_grad)
    return {"digest": _digest(sharded_model), "held": held, "total": total}


@pytest.mark.parametrize(("n", "passes"), [(2, 2), (3, 3), (2, 1)])
def test_gradient_accumulation_and_zero2_memory(n: int, passes: int) -> None:
    results = run_ranks(_accumulated, n, passes, timeout=120)
    assert len({r["digest"] for r in results}) == 1
    for step in range(3):  # after synchronize each rank holds its shard of the gradient only
        assert sum(r["held"][step] for r in results) == results[0]["total"]


def _overlapped(rank: int) -> dict:
    """Four steps with the parameter gather overlapping the next forward, against the same
    steps waiting for it in step(); the per-module waits seen directly."""
    import shoal.torch as hvd
    digests = {}
    for overlap in (False, True):
        model = _model()
        opt = hvd.ShardedOptimizer(OPTIMIZERS["sgd"](list(model.parameters())),
                                   bucket_bytes=300, overlap_param_gather=overlap)
        _train(model, opt, rank, range(4))
        if overlap:
            assert all(s.gathering is not None for s in opt._shards)  # all still in flight
            first = {id(p) for p in model[0].parameters()}
            model[0](torch.zeros(1, 6))  # the first layer's forward waits for its own only
            for s in opt._shards:
                holds_first = any(id(p) in first for p in s.params)
                assert (s.gathering is None) == holds_first
            assert len(opt._shards) > 1
            state = model.state_dict()  # waits for the rest
            assert all(s.gathering is None for s in opt._shards)
            assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
        digests[overlap] = _digest(model)
    assert digests[True] == digests[False]
    return {"digest": digests[True]}


def test_overlapped_parameter_gather_gives_the_blocking_weights() -> None:
    results = run_ranks(_overlapped, 2, timeout=120)
    assert len({r["digest"] for r in results}) == 1


def _app_wrap(rank: int) -> int:
    import torch

    import shoal
    from apps.efficientnet.runtime.distributed import Dist, wrap
    dist = Dist("shoal", rank, shoal.size(), rank, shoal.size(), torch.device("cpu"))
    model = _model()
    _, opt = wrap(model, OPTIMIZERS["sgd"](list(model.parameters())), dist, sharded=True,
                  backward_passes=2)
    return opt.backward_passes_per_step


def test_the_application_shards_with_accumulation() -> None:
    assert run_ranks(_app_wrap, 2, timeout=60) == [2, 2]


def _small_model(rank: int, scaled: bool) -> dict:
    """Linear(4, 2) at 3 ranks: two parameters, so one rank owns nothing. It joins every
    collective; with a GradScaler (the stock recipe) it skips the step an overflow on
    another rank's shard makes every rank skip."""
    import shoal.torch as hvd
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), sharded=True)
    owned = sum(p.numel() for g in opt._inner.param_groups for p in g["params"])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1,
                                  enabled=scaled)
    gen = torch.Generator().manual_seed(2)
    scales = []
    for step in range(4):
        x = torch.randn(3 * hvd.size(), 4, generator=gen)
        opt.zero_grad()
        loss = model(x[rank * 3:(rank + 1) * 3]).pow(2).mean()
        if scaled and step == 2 and rank == 0:  # only rank 0's gradients overflow
            loss = loss + float("inf") * model.weight.sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"owned": owned, "scales": scales,
            "params": [p.detach().reshape(-1).tolist() for p in model.parameters()]}


@pytest.mark.parametrize("scaled", [False, True])
def test_a_rank_that_owns_nothing_joins_every_collective(scaled: bool) -> None:
    results = run_ranks(_small_model, 3, scaled, timeout=120)
    assert sorted(r["owned"] for r in results)[0] == 0, results  # one rank owns nothing
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    for step in range(4):
        x = torch.randn(9, 4, generator=gen)
        if scaled and step == 2:
            continue  # the step every rank skipped
        opt.zero_grad()
        model(x).pow(2).mean().backward()  # (equal parts: the mean of the ranks' means)
        opt.step()
    for r in results:
        assert r["params"] == results[0]["params"] and r["scales"] == results[0]["scales"]
        for got, ref in zip(r["params"], model.parameters(), strict=True):
            torch.testing.assert_close(torch.tensor(got), ref.detach().reshape(-1),
                                       rtol=1e-6, atol=1e-6)
