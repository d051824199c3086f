"""FSDP2 (``fully_shard``) over backend "shoal" on CPU (issue 31, item 3): per-layer
sharding, whose all-gathers and reduce-scatters are asynchronous here, trains to the very
weights the same run gets over gloo in the same processes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from harness import run_ranks  # noqa: E402


def _fsdp(rank: int) -> float:
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shoal
    import shoal.torch.backend as b
    torch.set_num_threads(1)
    b.register()
    path = f"{tempfile.gettempdir()}/shoal-{shoal.communicator().job_id}-torchstore"
    n = shoal.size()
    dist.init_process_group("shoal", rank=rank, world_size=n,
                            store=dist.FileStore(path, n))
    gloo = dist.new_group(backend="gloo")
    weights = {}
    for name, mesh in (("shoal", init_device_mesh("cpu", (n,))),
                       ("gloo", DeviceMesh.from_group(gloo, "cpu"))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()) for _ in range(3)],
            torch.nn.Linear(16, 5))  # 5 rows: shards of uneven size
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for step in range(4):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        weights[name] = torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])
    dist.destroy_process_group()
    return (weights["shoal"] - weights["gloo"]).abs().max().item()


def test_fully_shard_matches_gloo_at_2_ranks() -> None:
    assert run_ranks(_fsdp, 2, timeout=120) == [0.0, 0.0]
