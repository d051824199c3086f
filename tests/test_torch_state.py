"""broadcast_optimizer_state leaves a fresh optimizer fresh (issue 31, item 5): the state it
creates for broadcasting acts as no state at all (step counts 0, moments 0), so 5 steps at 3
ranks match one process on the global batch, for every optimizer below; the zero gradients
stay, as Horovod leaves them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from harness import run_ranks  # noqa: E402

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.3, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.05, weight_decay=0.1),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.05),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.01, momentum=0.5, centered=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1, initial_accumulator_value=0.1),
    "sparseadam": lambda p: torch.optim.SparseAdam(p, lr=0.05),
}


def _model(sparse: bool) -> torch.nn.Module:
    torch.manual_seed(3)
    if sparse:
        return torch.nn.Embedding(12, 4, sparse=True)
    return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _loss(model: torch.nn.Module, sparse: bool, step: int, ranks: list[int]) -> torch.Tensor:
    """The mean loss over the shards of ``ranks`` (4 samples each) at ``step``."""
    xs, ys = [], []
    for r in ranks:
        g = torch.Generator().manual_seed(100 * step + r)
        if sparse:
            xs.append(torch.randint(0, 12, (4,), generator=g))
            ys.append(torch.randn(4, 4, generator=g, dtype=torch.float64))
        else:
            xs.append(torch.randn(4, 5, generator=g, dtype=torch.float64))
            ys.append(torch.randn(4, 2, generator=g, dtype=torch.float64))
    x, y = torch.cat(xs), torch.cat(ys)
    return ((model(x) - y) ** 2).mean()


def _fresh(rank: int, name: str) -> dict[str, float]:
    import shoal.torch as hvd
    torch.set_default_dtype(torch.float64)
    sparse = name == "sparseadam"
    model = _model(sparse)
    if not sparse:  # rank-dependent start: the broadcast must fix it
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank)
    opt = hvd.DistributedOptimizer(OPTIMIZERS[name](model.parameters()),
                                   model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    created = not opt._inner.state  # Adagrad makes its state at construction
    hvd.broadcast_optimizer_state(opt, root_rank=0, model=model)
    inner = opt._inner
    steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
    grads_zero = not created or all(p.grad is not None and not p.grad.to_dense().any()
                                    for p in model.parameters())
    ref = _model(sparse)
    ref_opt = OPTIMIZERS[name](ref.parameters())
    n = hvd.size()
    for step in range(5):
        opt.zero_grad()
        _loss(model, sparse, step, [rank]).backward()
        opt.step()
        ref_opt.zero_grad()
        _loss(ref, sparse, step, list(range(n))).backward()
        ref_opt.step()
    err = max((a - b).abs().max().item()
              for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    return {"err": err, "max_step": max(steps, default=0.0), "grads_zero": grads_zero}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_broadcast_optimizer_state_keeps_a_fresh_optimizer_fresh(name: str) -> None:
    for out in run_ranks(_fresh, 3, name, timeout=120):
        assert out["max_step"] == 0.0, out  # created state counts no step
        assert out["grads_zero"], out       # the zero gradients stay, as in Horovod
        assert out["err"] < 1e-10, out      # 5 steps = one process on the global batch


def _no_grad_param(rank: int) -> tuple[bool, bool]:
    import shoal.torch as hvd
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters())
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = model.weight.grad
    same = bool(torch.equal(hvd.broadcast(grad, root_rank=0), grad))
    return model.bias.grad is None, same


def test_a_frozen_parameter_keeps_no_gradient() -> None:
    assert run_ranks(_no_grad_param, 2, timeout=60) == [(True, True)] * 2


def _trained_state(rank: int, same_structure: bool) -> tuple[bool, list[float], float]:
    import shoal.torch as hvd
    torch.manual_seed(rank)  # every rank its own weights and moments
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    for _ in range(rank + 1):  # and its own step count
        opt.zero_grad()
        model(torch.randn(2, 5)).sum().backward()
        if not same_structure and rank == 1:
            model[1].weight.grad = None  # rank 1 then has no state for this parameter
        opt.step()
    before = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    after = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    in_place = len(before) == len(after) and all(a is b for a, b in zip(before, after,
                                                                      strict=True))
    values = [float(t.double().sum()) for s in opt.state.values() for t in s.values()
              if isinstance(t, torch.Tensor)]
    return in_place, values, opt.param_groups[0]["lr"]


@pytest.mark.parametrize("same_structure", [True, False])
def test_optimizer_state_is_the_roots_broadcast_in_place_when_it_fits(
        same_structure: bool) -> None:
    """The same structure on every rank: each state tensor is overwritten in place (no
    pickled copy of the state); a structure that differs anywhere: the root's state dict is
    loaded on every rank. Either way every rank ends with the root's state and settings."""
    (_, v0, lr0), *others = run_ranks(_trained_state, 3, same_structure, timeout=60)
    assert lr0 == 0.01
    for in_place, values, lr in others:
        assert in_place is same_structure and values == v0 and lr == lr0
