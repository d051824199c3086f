"""DistributedOptimizer's gradient buckets and the corners of Horovod's semantics.

Frozen parameters, a branch that gets no gradient, two dtypes, a forward order unlike the
registration order (buckets are rebuilt after the first step), ``zero_grad`` both ways,
``gradient_predivide_factor`` and ``synchronize`` / clip / ``skip_synchronize``: each is checked
against one process training on the global batch.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from harness import run_ranks  # noqa: E402


class _Net(torch.nn.Module):
    """Registered in one order, used in another; a frozen layer; an unused branch; float64."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.head = torch.nn.Linear(16, 5)
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.stem = torch.nn.Linear(6, 16)
        self.unused = torch.nn.Linear(3, 3)
        self.scale = torch.nn.Parameter(torch.linspace(0.5, 1.5, 5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(self.frozen(x)))
        return self.head(h) * self.scale.float()


def _data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3, 6, generator=g), torch.randint(0, 5, (3,), generator=g)


def _train(rank: int, predivide: float, clip: bool) -> dict:
    import shoal.torch as hvd
    n = hvd.size()
    model, ref = _Net(), _Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters(), bucket_bytes=200,
                                   gradient_predivide_factor=predivide)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    first_layout = opt._buckets.describe()
    for step in range(4):
        opt.zero_grad(set_to_none=step % 2 == 0)
        x, y = _data(step, rank)
        loss_fn(model(x), y).backward()
        if clip:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            with opt.skip_synchronize():
                opt.step()
        else:
            if step == 1:  # synchronize() then step() without skip_synchronize: reduced twice,
                opt.synchronize()  # which must leave the (already equal) averages unchanged
            opt.step()
        ref_opt.zero_grad()
        xs, ys = zip(*[_data(step, r) for r in range(n)], strict=True)
        loss_fn(ref(torch.cat(xs)), torch.cat(ys)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    assert model.frozen.weight.grad is None  # frozen parameters are never touched
    assert torch.count_nonzero(model.unused.weight.grad) == 0  # reduced as zeros
    # after a step, .grad is a view of the bucket: no copy-in when zeroed in place
    b, j = opt._buckets._where[model.head.weight]
    assert model.head.weight.grad.data_ptr() == b.views[j].data_ptr()
    return {"first": first_layout, "settled": opt._buckets.describe(),
            "params": [p.detach().numpy().copy() for p in model.parameters()]}


@pytest.mark.parametrize(("n", "predivide", "clip"), [(2, 1.0, False), (3, 2.0, False),
                                                      (2, 1.0, True)])
def test_buckets_match_one_process_on_the_global_batch(n, predivide, clip) -> None:
    results = run_ranks(_train, n, predivide, clip, timeout=120)
    first, settled = results[0]["first"], results[0]["settled"]
    # two dtypes never share a bucket; 200-byte buckets split the float32 parameters
    assert len(first) >= 4
    assert any(b["params"] == ["grad.scale"] for b in first)
    # the first bucket now follows what backward produced first (the output side: head and
    # scale), not the reverse registration order (which starts with the unused layer)
    assert first[0]["params"][0] == "grad.unused.bias"
    assert settled[0]["params"][0] in ("grad.scale", "grad.head.bias", "grad.head.weight")
    for other in results[1:]:
        assert other["settled"] == settled
        for a, b in zip(results[0]["params"], other["params"], strict=True):
            np.testing.assert_array_equal(a, b)


def _twice(rank: int) -> str:
    import shoal.torch as hvd
    model = torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   model.named_parameters())
    model(torch.randn(2, 4)).sum().backward()
    try:
        model(torch.randn(2, 4)).sum().backward()
    except RuntimeError as exc:
        opt.synchronize()  # what was submitted still completes on every rank
        return str(exc)
    return "no error"


@pytest.mark.parametrize("n", [1, 2])
def test_second_backward_without_step_is_refused(n) -> None:
    for text in run_ranks(_twice, n, timeout=60):
        assert "computed again before step()" in text and "backward_passes_per_step" in text


def _alone(rank: int) -> None:
    import shoal.torch as hvd
    model, ref = _Net(), _Net()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters(), backward_passes_per_step=2,
                                   gradient_predivide_factor=4.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        for net in (model, ref):
            for k in range(2):
                x, y = _data(step, k)
                loss_fn(net(x), y).backward()
        if step == 1:
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)  # alone, every reduction is the identity: bit for bit
    # gradients stay where backward put them: no bucket exists, no .grad is a view of one
    assert model.unused.weight.grad is None and opt._buckets is None
    assert all(p.grad._base is None for p in model.parameters() if p.grad is not None)


def test_one_process_is_the_wrapped_optimizer() -> None:
    run_ranks(_alone, 1, timeout=60)


def test_automatic_bucket_size() -> None:
    from shoal.torch.buckets import OVERLAP_BUCKET_BYTES, auto_bucket_bytes
    fusion = 64 << 20
    # on an accelerator the CPU reduces while the device computes: overlap
    assert auto_bucket_bytes({"cuda"}, 8, 4, 16, fusion) == OVERLAP_BUCKET_BYTES
    # CPU workers with cores to spare: overlap
    assert auto_bucket_bytes({"cpu"}, 2, 1, 8, fusion) == OVERLAP_BUCKET_BYTES
    # every core already computing: reduce after backward, in as few buffers as fusion allows
    assert auto_bucket_bytes({"cpu"}, 2, 1, 2, fusion) == fusion
    assert auto_bucket_bytes({"cpu"}, 1, 16, 16, fusion) == fusion
