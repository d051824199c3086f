"""``DistributedOptimizer(op=Adasum)``, Horovod's delta optimizer: every rank steps on its own
gradients from the same weights, and the weights become the start plus the Adasum of the
ranks' changes, checked against a numpy reference at 2 and 3 ranks, with SGD and Adam, with
and without fp16 compression."""

from __future__ import annotations

import numpy as np
import pytest

from harness import run_ranks
from test_adasum import _reference

pytest.importorskip("torch")


def _trained(rank: int, opt_name: str, fp16: bool) -> dict[str, object]:
    import torch

    import shoal.torch as hvd
    torch.manual_seed(0)  # the same start everywhere
    model = torch.nn.Linear(5, 3)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    base = (torch.optim.SGD(model.parameters(), lr=0.1) if opt_name == "sgd"
            else torch.optim.Adam(model.parameters(), lr=0.01))
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(),
                                   op=hvd.Adasum,
                                   compression=hvd.Compression.fp16 if fp16 else
                                   hvd.Compression.none)
    g = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    # this rank's own step, from the same start, for the reference
    local = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    shadow = torch.nn.Linear(5, 3)
    shadow.load_state_dict(model.state_dict())
    sbase = (torch.optim.SGD(shadow.parameters(), lr=0.1) if opt_name == "sgd"
             else torch.optim.Adam(shadow.parameters(), lr=0.01))
    for (n, sp) in shadow.named_parameters():
        sp.grad = grads[n]
    sbase.step()
    delta = {n: (sp.detach() - local[n]).numpy().reshape(-1)
             for n, sp in shadow.named_parameters()}
    opt.step()
    return {"after": {n: p.detach().numpy().reshape(-1) for n, p in model.named_parameters()},
            "start": {n: v.numpy().reshape(-1) for n, v in start.items()}, "delta": delta}


@pytest.mark.parametrize(("n", "opt_name", "fp16"), [(2, "sgd", False), (3, "adam", False),
                                                     (2, "sgd", True)])
def test_delta_optimizer_applies_the_adasum_of_the_steps(n: int, opt_name: str,
                                                         fp16: bool) -> None:
    results = run_ranks(_trained, n, opt_name, fp16)
    tol = 2e-3 if fp16 else 1e-6
    for name, start in results[0]["start"].items():
        want = start + _reference([r["delta"][name] for r in results])
        for rank, r in enumerate(results):
            np.testing.assert_allclose(r["after"][name], want, rtol=tol, atol=tol,
                                       err_msg=f"{name} on rank {rank}")


def _refusals(rank: int) -> list[str]:
    import torch

    import shoal.torch as hvd
    model = torch.nn.Linear(2, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   op=hvd.Adasum)
    out = []
    try:
        with opt.skip_synchronize():
            pass
    except AssertionError as exc:
        out.append(str(exc))
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum,
                                 gradient_predivide_factor=2.0)
    except ValueError as exc:
        out.append(str(exc))
    return out


def test_what_the_delta_optimizer_refuses() -> None:
    for seen in run_ranks(_refusals, 2):
        assert "not supported when using Adasum" in seen[0]
        assert "gradient_predivide_factor" in seen[1]
