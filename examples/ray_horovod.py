"""Horovod's Ray API on shoal: a RayExecutor training job, the same job elastic, and Ray actors
averaging through ``ray.util.collective`` backend "shoal".

Run ``python examples/ray_horovod.py`` (a local Ray of 4 CPUs is started), or
``RAY_ADDRESS=host:port python examples/ray_horovod.py`` on a running cluster. Needs
``pip install 'shoal[ray]' torch``. Each part checks its result and prints one line.
"""

from __future__ import annotations

import argparse

import numpy as np
import ray


def train(epochs: int) -> dict:
    """A Horovod training function: every worker ends with the same weights."""
    import torch

    import shoal.torch as hvd
    hvd.init()
    torch.manual_seed(hvd.rank())  # different starts: the broadcast makes them rank 0's
    model = torch.nn.Linear(8, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    data = torch.Generator().manual_seed(100 + hvd.rank())
    for _ in range(epochs):
        x = torch.randn(32, 8, generator=data)
        loss = (model(x).squeeze(1) - x.sum(1)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"rank": hvd.rank(), "size": hvd.size(), "loss": float(loss.detach()),
            "weights": model.weight.detach().numpy().copy()}


def train_elastic(epochs: int) -> dict:
    """The same training, elastic: the loop survives workers that come and go."""
    import torch

    import shoal.torch as hvd
    hvd.init()
    model = torch.nn.Linear(8, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())

    @hvd.elastic.run
    def loop(state: hvd.elastic.TorchState) -> None:
        while state.epoch < epochs:
            x = torch.randn(32, 8)
            opt.zero_grad()
            (model(x).squeeze(1) - x.sum(1)).pow(2).mean().backward()
            opt.step()
            state.epoch += 1
            state.commit()

    state = hvd.elastic.TorchState(model, opt, epoch=0)
    loop(state)
    return {"size": hvd.size(), "epoch": state.epoch}


@ray.remote(num_cpus=0.5)
class Peer:
    """A Ray actor that averages with its peers through backend "shoal"."""

    def __init__(self) -> None:
        import shoal.ray.collective  # noqa: F401 - registers the backend in this actor

    def average(self, world: int, rank: int) -> np.ndarray:
        import ray.util.collective as col
        col.init_collective_group(world, rank, backend="shoal", group_name="peers")
        x = np.full(4, float(rank + 1), np.float32)
        col.allreduce(x, group_name="peers")
        col.destroy_collective_group("peers")
        return x / world


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    ray.init(num_cpus=4, logging_level="ERROR")  # joins RAY_ADDRESS's cluster when it is set
    from shoal.ray import RayExecutor

    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, num_workers=args.workers, cpus_per_worker=0.5)
    executor.start()
    try:
        out = executor.run(train, args=[args.epochs])
    finally:
        executor.shutdown()
    assert all(np.array_equal(o["weights"], out[0]["weights"]) for o in out)
    print(f"RayExecutor: {len(out)} workers trained {args.epochs} epochs to the same weights, "
          f"loss {out[0]['loss']:.4f}")

    elastic = RayExecutor(settings, min_workers=1, max_workers=args.workers,
                          cpus_per_worker=0.5)
    elastic.start()
    try:
        done = elastic.run(train_elastic, args=[args.epochs])
    finally:
        elastic.shutdown()
    assert done and all(d["epoch"] == args.epochs for d in done)
    print(f"elastic RayExecutor: {len(done)} workers finished at size {done[0]['size']}")

    import shoal.ray.collective  # noqa: F401 - the driver knows the backend too
    peers = [Peer.remote() for _ in range(args.workers)]
    means = ray.get([p.average.remote(args.workers, r) for r, p in enumerate(peers)])
    want = (args.workers + 1) / 2
    assert all(np.allclose(m, want) for m in means)
    print(f"ray.util.collective backend shoal: {args.workers} actors averaged to {want}")
    ray.shutdown()


if __name__ == "__main__":
    main()
