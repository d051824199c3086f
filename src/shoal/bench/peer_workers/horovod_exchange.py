"""Horovod's side of ``shoal bench exchange``; runs under horovodrun in the peers venv.

Two ways Horovod users reduce a gradient set: ``grouped_allreduce`` of every tensor at once,
and one ``allreduce_async_`` per tensor then ``synchronize`` on each (what its
DistributedOptimizer does). Rank 0 writes per-trial times (max over ranks) as JSON.
"""

import argparse
import json
import time

import horovod.torch as hvd
import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", required=True)
    p.add_argument("--trials", type=int, required=True)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    with open(args.shapes) as f:
        shapes = [tuple(s) for _, s in json.load(f)["shapes"]]
    g = torch.Generator().manual_seed(hvd.rank())
    grads = [torch.randn(s, generator=g) for s in shapes][::-1]  # backward order

    def grouped() -> None:
        hvd.grouped_allreduce_(grads, name="grads")

    def per_tensor() -> None:
        hs = [hvd.allreduce_async_(t, name=f"g{i}") for i, t in enumerate(grads)]
        for h in hs:
            hvd.synchronize(h)

    methods = {"horovod-grouped": grouped, "horovod-per-tensor": per_tensor}
    for fn in methods.values():
        fn()
    times = {name: [] for name in methods}
    names = list(methods)
    for trial in range(args.trials):
        k = trial % len(names)
        for name in names[k:] + names[:k]:
            hvd.allreduce(torch.zeros(1), name="barrier")
            t0 = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - t0)
    worst = {name: hvd.allreduce(torch.tensor(v), op=hvd.Max, name=f"t.{name}").tolist()
             for name, v in times.items()}
    if hvd.rank() == 0:
        with open(args.json, "w") as f:
            json.dump(worst, f)


if __name__ == "__main__":
    main()
