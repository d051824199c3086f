"""Ray Train on shoal, on a local Ray cluster of two nodes (a head and a second ``ray start``
node, one CPU each, so the two workers sit on different Ray nodes and so on different shoal
hosts): ``TorchTrainer`` naming backend "shoal" with unchanged user code, ``ShoalTrainer``
with a Horovod-style training function, and a worker killed under ``FailureConfig
(max_failures=1)`` resuming from the last checkpoint. One cluster serves every test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("torch")
# the cluster below uses token authentication (Ray's default for a head), which Ray's client
# reads at its import: every node and this driver present the token the head writes
# (~/.ray/auth_token)
os.environ.setdefault("RAY_AUTH_MODE", "token")
ray = pytest.importorskip("ray")
pytest.importorskip("ray.train")

pytestmark = pytest.mark.slow


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
