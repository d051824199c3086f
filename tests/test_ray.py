"""shoal on Ray, on one local Ray cluster of two nodes for the whole file (conftest.py: a head
and a second ``ray start`` node, one CPU each, so two workers sit on different Ray nodes and so
on different shoal hosts):

* Ray Train: ``TorchTrainer`` naming backend "shoal" with unchanged user code,
  ``ShoalTrainer`` with a Horovod-style training function, and a worker killed under
  ``FailureConfig(max_failures=1)`` resuming from the last checkpoint;
* Horovod's Ray API (``shoal.ray.RayExecutor``): 4 workers on the two nodes, executables,
  callbacks, placement errors, and an elastic job losing a worker;
* backend "shoal" of ``ray.util.collective`` between actors on the two nodes.

The file is the only one that starts Ray: the cluster goes with its last test."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
# the cluster below uses token authentication (Ray's default for a head), which Ray's client
# reads at its import: every node and this driver present the token the head writes
# (~/.ray/auth_token)
os.environ.setdefault("RAY_AUTH_MODE", "token")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.train")

# one worker runs every Ray test (one cluster), each alone: Ray picks its nodes' addresses
# from the machine's interfaces at start, which other tests' network namespaces change (a run
# beside them started its GCS on another test's address), and `ray stop --force` is
# machine-wide
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray"), pytest.mark.serial]


@pytest.fixture
def cluster(ray_cluster: str) -> str:
    return ray_cluster  # the one cluster of the test run (conftest.py)


def _weights_equal(out: Path) -> list[list[float]]:
    import torch
    got = [torch.load(out / f"w{r}.pt") for r in range(2)]
    for a, b in zip(got[0], got[1], strict=True):
        assert torch.equal(a, b)
    return [t.flatten().tolist() for t in got[0]]


def _torch_loop(config: dict) -> None:
    """Unchanged Ray Train user code: prepare_model wraps the model in DDP."""
    import ray.train.torch
    import torch
    import torch.distributed as dist
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):  # epochs
        for _ in range(3):
            loss = model(torch.randn(8, 4, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert dist.get_backend() == config["backend"]
    torch.save([p.detach() for p in model.parameters()],
               f"{config['out']}/w{dist.get_rank()}.pt")


def test_torch_trainer_names_backend_shoal_as_gloo(cluster: str, tmp_path: Path) -> None:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    weights = {}
    for backend in ("gloo", "shoal"):
        out = tmp_path / backend
        out.mkdir()
        TorchTrainer(_torch_loop, train_loop_config={"backend": backend, "out": str(out)},
                     torch_config=TorchConfig(backend=backend),
                     scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(storage_path=str(tmp_path / "runs"))).fit()
        weights[backend] = _weights_equal(out)
    assert weights["shoal"] == weights["gloo"]  # the same training, bit for bit


def _hvd_loop(config: dict) -> None:
    """A Horovod-style training function, as HorovodTrainer ran it, with a checkpoint per
    epoch; the first attempt's rank 1 dies at the start of epoch 2 when asked to (a moment
    after the last report, which Ray Train registers asynchronously)."""
    import tempfile
    import time

    import torch
    from ray import train

    import shoal.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    start = 0
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(Path(d) / "state.pt")
        model.load_state_dict(state["model"])
        start = state["epoch"] + 1
        Path(config["out"], f"resumed{hvd.rank()}").write_text(str(start))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for epoch in range(start, 3):
        marker = Path(config["out"], "died")
        if config["kill"] and epoch == 2 and hvd.rank() == 1 and not marker.exists():
            marker.write_text("1")
            time.sleep(3)
            os._exit(1)
        g = torch.Generator().manual_seed(100 * epoch + hvd.rank())
        for _ in range(3):
            loss = model(torch.randn(8, 4, generator=g)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        with tempfile.TemporaryDirectory() as d:
            if hvd.rank() == 0:
                torch.save({"model": model.state_dict(), "epoch": epoch}, Path(d) / "state.pt")
            train.report({"epoch": epoch},
                         checkpoint=train.Checkpoint.from_directory(d) if hvd.rank() == 0
                         else None)
    assert (hvd.size(), hvd.local_size(), hvd.cross_size()) == (2, 1, 2)  # two Ray nodes
    torch.save([p.detach() for p in model.parameters()], f"{config['out']}/w{hvd.rank()}.pt")


def test_shoal_trainer_and_a_worker_lost_resumes(cluster: str, tmp_path: Path) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    from shoal.ray import ShoalConfig, ShoalTrainer
    weights = {}
    for kill in (False, True):
        out = tmp_path / f"kill{kill}"
        out.mkdir()
        ShoalTrainer(_hvd_loop, train_loop_config={"out": str(out), "kill": kill},
                     shoal_config=ShoalConfig(timeout_s=60),
                     scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(storage_path=str(tmp_path / "runs"),
                                          name=f"kill{kill}",
                                          failure_config=FailureConfig(max_failures=1))).fit()
        weights[kill] = _weights_equal(out)
    killed = tmp_path / "killTrue"
    assert (killed / "died").exists()
    assert {(killed / f"resumed{r}").read_text() for r in range(2)} == {"2"}
    assert weights[True] == weights[False]  # resumed after epoch 1: the same end


N = 4


def _input(rank: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(1001).astype(np.float32)


def _allreduce(scale: float) -> dict:
    """In a worker: join shoal as Horovod's scripts do; where this rank sits and its sum."""
    import shoal.torch as hvd
    hvd.init()
    import shoal
    x = _input(hvd.rank())
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
            "host": shoal.communicator().world.hosts[hvd.rank()],
            "algorithm": shoal.communicator().algorithm,
            "sum": shoal.allreduce(x * scale, op=shoal.Sum, name="ray.sum"),
            "env": {k: os.environ.get(k) for k in ("HOROVOD_RANK", "HOROVOD_LOCAL_RANK",
                                                   "HOROVOD_CROSS_RANK", "HOROVOD_HOSTNAME")}}


class _Model:
    """An executable: made once in each worker by ``start(executable_cls=...)``."""

    def __init__(self, epochs: int) -> None:
        import shoal.torch as hvd
        hvd.init()
        self.hvd, self.epochs = hvd, epochs

    def rank_epochs(self) -> int:
        from shoal.ray import ray_logger
        if self.hvd.rank() == 0:
            ray_logger.log({"epochs": self.epochs})
        return self.hvd.rank() * self.epochs


def test_executor_runs_four_workers_on_two_nodes(ray_cluster: str) -> None:
    from shoal.ray import RayExecutor
    settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)
    executor = RayExecutor(settings, num_hosts=2, num_workers_per_host=2, cpus_per_worker=0.5)
    executor.start()
    try:
        got = executor.run(_allreduce, args=[2.0])
        want = sum(_input(r) * 2.0 for r in range(N))
        assert [g["rank"] for g in got] == list(range(N))
        for g in got:
            np.testing.assert_allclose(g["sum"], want, rtol=1e-5, atol=1e-5)
            assert g["size"] == N and g["local_size"] == 2
            assert g["algorithm"] == "hierarchical"  # two shoal hosts of two ranks each
            assert g["env"]["HOROVOD_RANK"] == str(g["rank"])
            assert g["env"]["HOROVOD_LOCAL_RANK"] == str(g["local_rank"])
        hosts = [g["host"] for g in got]
        assert hosts[0] == hosts[1] != hosts[2] == hosts[3]  # a host per Ray node
        assert [g["local_rank"] for g in got] == [0, 1, 0, 1]
        assert [g["cross_rank"] for g in got] == [0, 0, 1, 1]
        assert len({g["env"]["HOROVOD_HOSTNAME"] for g in got}) == 2  # the Ray node ids
        refs = executor.run_remote(lambda: 7)
        assert ray.get(refs) == [7] * N
        assert executor.execute_single(lambda _: os.environ["SHOAL_RANK"]) == "0"
    finally:
        executor.shutdown()


def test_executor_executables_callbacks_and_placement_errors(ray_cluster: str) -> None:
    from shoal.ray import RayExecutor
    settings = RayExecutor.create_settings(timeout_s=60, placement_group_timeout_s=60)
    executor = RayExecutor(settings, num_workers=2, cpus_per_worker=0.5)
    executor.start(executable_cls=_Model, executable_args=[3])
    try:
        logged: list[dict] = []
        assert executor.execute(lambda model: model.rank_epochs(),
                                callbacks=[logged.append]) == [0, 3]
        assert logged == [{"epochs": 3}]  # rank 0's value, through the driver's callback
    finally:
        executor.shutdown()
    with pytest.raises(RuntimeError, match="start"):
        executor.run(lambda: 1)
    with pytest.raises(ValueError, match="Both `min_workers` and `num_workers`"):
        RayExecutor(settings, num_workers=2, min_workers=1)
    # 4 CPUs on one node: the cluster's nodes have one each
    tight = RayExecutor(RayExecutor.create_settings(placement_group_timeout_s=2),
                        num_hosts=1, num_workers_per_host=4)
    with pytest.raises(TimeoutError, match="placement group"):
        tight.start()
    tight.shutdown()


@ray.remote(num_cpus=0.25)
class _Peer:
    def __init__(self) -> None:
        import shoal.ray.collective  # noqa: F401 - registers backend "shoal" here

    def run(self, world: int, rank: int) -> dict:
        import ray.util.collective as col
        import torch
        col.init_collective_group(world, rank, backend="shoal", group_name="pair")
        x = _input(rank)
        summed = x.copy()
        col.allreduce(summed, group_name="pair")
        t = torch.from_numpy(x.copy())
        col.allreduce(t, group_name="pair", op=col.types.ReduceOp.MAX)
        gathered = [np.zeros(1001, np.float32) for _ in range(world)]
        col.allgather(gathered, x.copy(), group_name="pair")
        b = x.copy()
        col.broadcast(b, src_rank=1, group_name="pair")
        mine = np.zeros(3, np.float64)
        col.reducescatter(mine, [np.full(3, 10.0 * rank + i) for i in range(world)],
                          group_name="pair")
        got = np.zeros(5, np.float32)
        if rank == 0:
            col.send(np.arange(5, dtype=np.float32), 1, group_name="pair")
        else:
            col.recv(got, 0, group_name="pair")
        col.barrier(group_name="pair")
        col.destroy_collective_group("pair")
        return {"sum": summed, "max": t.numpy(), "gathered": gathered, "bcast": b,
                "rs": mine, "recv": got}


def test_ray_collective_backend_shoal(ray_cluster: str) -> None:
    import shoal.ray.collective  # noqa: F401 - the driver knows the backend too
    peers = [_Peer.options(scheduling_strategy="SPREAD").remote() for _ in range(2)]
    try:
        out = ray.get([p.run.remote(2, r) for r, p in enumerate(peers)], timeout=120)
    finally:
        for p in peers:
            ray.kill(p)
    xs = [_input(r) for r in range(2)]
    for rank, o in enumerate(out):
        np.testing.assert_allclose(o["sum"], xs[0] + xs[1], rtol=1e-6)
        np.testing.assert_array_equal(o["max"], np.maximum(xs[0], xs[1]))
        for r in range(2):
            np.testing.assert_array_equal(o["gathered"][r], xs[r])
        np.testing.assert_array_equal(o["bcast"], xs[1])
        np.testing.assert_array_equal(o["rs"], np.full(3, 10.0 * 0 + rank + 10.0 * 1 + rank))
    np.testing.assert_array_equal(out[1]["recv"], np.arange(5, dtype=np.float32))


def _elastic_train(epochs: int) -> dict:
    """Horovod's elastic training function; the worker that started as rank 1 fails once,
    in epoch 2."""
    import torch

    import shoal.torch as hvd
    from shoal.ray import ray_logger
    hvd.init()
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    start_rank = int(os.environ["HOROVOD_RANK"])
    ray_logger.log({"started": start_rank})

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < epochs:
            if state.epoch == 2 and start_rank == 1:
                raise RuntimeError("a planned failure of the worker that started as rank 1")
            x = torch.full((8, 4), float(hvd.rank() + 1))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            state.epoch += 1
            state.commit()

    state = hvd.elastic.TorchState(model, opt, epoch=0)
    train(state)
    return {"start_rank": start_rank, "size": hvd.size(), "epoch": state.epoch,
            "host": os.environ["SHOAL_HOSTNAME"]}


def test_elastic_executor_finishes_at_the_smaller_size(ray_cluster: str) -> None:
    from shoal.ray import RayExecutor
    settings = RayExecutor.create_settings(timeout_s=60)
    executor = RayExecutor(settings, min_workers=1, max_workers=2, cpus_per_worker=1,
                           elastic_timeout=60)
    executor.start()
    logged: list[dict] = []
    try:
        results = executor.run(_elastic_train, args=[5], callbacks=[logged.append])
    finally:
        executor.shutdown()
    # the two Ray nodes share one address yet are two hosts; the failure blacklisted the
    # failed worker's host, and the other finished alone
    assert len(results) == 1, results
    assert results[0]["start_rank"] == 0 and results[0]["size"] == 1
    assert results[0]["epoch"] == 5
    assert sorted(e["started"] for e in logged) == [0, 1]


def _v1_train() -> dict:
    import numpy as np

    import shoal
    shoal.init()
    total = shoal.allreduce(np.ones(3, np.float32), op=shoal.Sum, name="v1")
    return {"size": shoal.size(), "total": total.tolist(), "mark": os.environ.get("V1_MARK")}


def test_horovods_first_elastic_executor_as_its_documentation_builds_it(
        ray_cluster: str) -> None:
    """``horovod.ray.ElasticRayExecutor`` exactly as Horovod's elastic documentation writes it
    (on CPUs): settings from ``create_settings(verbose=True)``, resources and ``env_vars`` on
    the executor, ``start()``, ``run(train_fn)`` with no arguments."""
    from shoal.ray.elastic import ElasticRayExecutor
    settings = ElasticRayExecutor.create_settings(verbose=True)
    executor = ElasticRayExecutor(settings, use_gpu=False, cpus_per_slot=1,
                                  env_vars={"V1_MARK": "from env_vars"})
    executor.start()
    try:
        results = executor.run(_v1_train)
    finally:
        executor.shutdown()
    # no max_num_proc: as many workers as the cluster's CPUs hold (two nodes of one)
    assert results == [{"size": 2, "total": [2.0] * 3, "mark": "from env_vars"}] * 2, results


def test_elastic_settings_take_horovods_arguments() -> None:
    from shoal.ray import ElasticRayExecutor
    s = ElasticRayExecutor.create_settings(min_num_proc=2, max_num_proc=4, reset_limit=3,
                                           elastic_timeout=30, timeout_s=9, verbose=2)
    assert (s.min_num_proc, s.max_num_proc, s.reset_limit, s.elastic_timeout, s.num_proc,
            s.timeout_s, s.verbose, s.elastic) == (2, 4, 3, 30, 2, 9, 2, True)
    with pytest.warns(DeprecationWarning, match="min_np is deprecated"):
        s = ElasticRayExecutor.create_settings(min_np=3, max_np=5)
    assert (s.min_num_proc, s.max_num_proc) == (3, 5)
    with pytest.raises(TypeError, match=r"unexpected arguments \['colour'\]"):
        ElasticRayExecutor.create_settings(colour="red")
    with pytest.raises(ValueError, match="gpus_per_slot is set, but use_gpu is False"):
        ElasticRayExecutor(s, gpus_per_slot=1)
    import importlib
    assert importlib.import_module("shoal.ray.elastic").ElasticRayExecutor is ElasticRayExecutor
