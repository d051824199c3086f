"""Horovod's module paths and signatures on shoal: every path a Horovod script or Horovod's own
tests import exists and holds the same objects as shoal's adapters; ``init(comm=...)``, static
process sets, the optimizer's class and ``set_backward_passes_per_step`` behave as Horovod's."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from harness import INIT_ARGS, mpirun, run_ranks

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]


def test_torch_paths_hold_the_adapters_objects() -> None:
    import shoal.torch as hvd
    from shoal.torch import functions, mpi_ops
    from shoal.torch.elastic import sampler, state

    for name in ("allreduce", "allreduce_async_", "grouped_allreduce", "synchronize", "poll",
                 "join", "barrier", "init", "shutdown", "size", "rank", "Average", "Adasum",
                 "is_homogeneous", "cuda_built", "nccl_built", "sparse_allreduce_async"):
        assert getattr(mpi_ops, name) is getattr(hvd, name), name
    for name in functions.__all__:
        assert getattr(functions, name) is getattr(hvd, name)
    assert hvd.elastic.TorchState is state.TorchState
    assert hvd.elastic.ElasticSampler is sampler.ElasticSampler
    with pytest.warns(DeprecationWarning, match="replaced with `op`"):
        assert mpi_ops.handle_average_backwards_compatibility(None, False) is hvd.Sum
    with pytest.raises(ValueError, match="supersedes"):
        mpi_ops.handle_average_backwards_compatibility(hvd.Sum, True)
    # the build queries answer for shoal: gloo's part yes, MPI no, NCCL where the device
    # path could use it
    assert hvd.gloo_built() and hvd.gloo_enabled() and mpi_ops._basics.gloo_built()
    assert not (hvd.mpi_built() or hvd.mpi_enabled() or hvd.ddl_built() or hvd.ccl_built())
    nccl = torch.cuda.is_available() and torch.distributed.is_nccl_available()
    assert bool(hvd.nccl_built()) is nccl and mpi_ops._basics.nccl_built() == hvd.nccl_built()
    if nccl:  # Horovod's encoding of the version: 2.21.5 is 22105
        assert hvd.nccl_built() >= 20900


def test_common_util() -> None:
    from shoal.common import util
    from shoal.common.exceptions import HorovodInternalError, HorovodVersionMismatchError
    from shoal.core.errors import PeerLostError

    assert HorovodInternalError is PeerLostError
    assert util.gloo_built() and util.gloo_enabled()
    assert not (util.mpi_built() or util.mpi_enabled())
    assert bool(util.nccl_built()) is (torch.cuda.is_available()
                                       and torch.distributed.is_nccl_available())
    assert util.extension_available("torch") and not util.extension_available("mxnet")
    os.environ.pop("SHOAL_TEST_A", None)
    os.environ["SHOAL_TEST_B"] = "old"
    with util.env(SHOAL_TEST_A="1", SHOAL_TEST_B="new", SHOAL_TEST_C=None):
        assert (os.environ["SHOAL_TEST_A"], os.environ["SHOAL_TEST_B"]) == ("1", "new")
        assert "SHOAL_TEST_C" not in os.environ
    assert "SHOAL_TEST_A" not in os.environ and os.environ.pop("SHOAL_TEST_B") == "old"
    assert util.is_version_greater_equal_than("2.13.0", "2.4.0")
    assert not util.is_version_greater_equal_than("2.3.1", "2.4.0")
    with pytest.raises(ValueError, match=r"major\.minor\.patch"):
        util.is_version_greater_equal_than("2.13.0", "2.4")
    with pytest.raises(ValueError, match="string"):
        util.is_version_greater_equal_than(2, "2.4.0")
    assert util.split_list(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert [util.num_rank_is_power_2(n) for n in (0, 1, 2, 3, 4, 6, 8)] == \
        [False, True, True, False, True, False, True]
    assert util.is_iterable([1]) and not util.is_iterable(3)
    with pytest.warns(UserWarning, match="installed with version"):
        util.check_installed_version("numpy", "0.0.1")
    with pytest.raises(HorovodVersionMismatchError):
        util.check_installed_version("numpy", "0.0.1", exception=RuntimeError("x"))
    util.check_installed_version("numpy", np.__version__)  # equal: silent


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_runner_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    from shoal.runner.common.util import env, secret
    from shoal.runner.util.threads import execute_function_multithreaded, in_thread, on_event

    for var in [v for pair in env.RANK_AND_SIZE_VARS for v in pair if v in os.environ]:
        monkeypatch.delenv(var)
    assert env.get_env_rank_and_size() == (0, 1)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    with pytest.raises(RuntimeError, match="only one of OMPI_COMM_WORLD_RANK"):
        env.get_env_rank_and_size()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert env.get_env_rank_and_size() == (1, 4)
    assert not env.is_exportable("CUDA_VISIBLE_DEVICES") and env.is_exportable("PATH")

    key = secret.make_secret_key()
    digest = secret.compute_digest(key, b"payload")
    assert secret.check_digest(key, b"payload", digest)
    assert not secret.check_digest(key, b"payload!", digest)

    seen: list[int] = []
    in_thread(seen.append, (1,)).join(5)
    in_thread(lambda: 1 / 0, silent=True).join(5)  # swallowed
    with pytest.raises(ValueError, match="tuple"):
        in_thread(seen.append, 2)  # type: ignore[arg-type]
    go, stop = threading.Event(), threading.Event()
    fired = on_event(go, seen.append, (3,), stop=stop, check_stop_interval_s=0.01)
    stopped = on_event(threading.Event(), seen.append, (4,), stop=stop,
                       check_stop_interval_s=0.01)
    go.set()
    fired.join(5)
    stop.set()
    stopped.join(5)
    assert seen == [1, 3] and not stopped.is_alive()
    assert execute_function_multithreaded(lambda a, b: a * b, [[2, 3], [4, 5], [6, 7]],
                                          max_concurrent_executions=2) == {0: 6, 1: 20, 2: 42}
    with pytest.raises(RuntimeError, match="did not complete"):
        execute_function_multithreaded(lambda a: 1 / a, [[1], [0]])


def test_tensorflow_paths() -> None:
    hvd = pytest.importorskip("shoal.tensorflow")
    from shoal.tensorflow import mpi_ops

    for name in ("allreduce", "allgather", "broadcast", "broadcast_", "alltoall", "join",
                 "size_op", "rank_op", "init", "barrier", "cuda_built", "is_homogeneous"):
        assert getattr(mpi_ops, name) is getattr(hvd, name), name
    assert mpi_ops._basics.cuda_built() is hvd.cuda_built()
    assert not hvd.nccl_built()  # TensorFlow tensors are reduced on the host


def _comm_and_static_sets(rank: int) -> dict:
    import shoal
    import shoal.torch as hvd
    from shoal.torch.mpi_ops import _basics

    n = hvd.size()
    args = {k: v for k, v in INIT_ARGS.items() if k not in ("rank", "size")}
    args["rank"], args["size"] = rank, n
    hvd.shutdown()
    out: dict = {}
    # bad lists: refused before anything is built, and shoal stays usable
    for bad, match in (([rank, n], "distinct ranks"), ([r for r in range(n) if r != rank],
                                                       "does not include this process")):
        with pytest.raises(ValueError, match=match):
            hvd.init(bad, **args)
        assert not hvd.is_initialized()
    # two independent jobs: even and odd ranks; Horovod's rank is the place in the list
    group = [r for r in range(n) if r % 2 == rank % 2][::-1]
    hvd.init(comm=group, **args)
    out["comm"] = (hvd.rank(), hvd.size(),
                   float(hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum)))
    hvd.shutdown()
    # static process sets: a duplicate is a ValueError before any set is built
    with pytest.raises(ValueError, match="duplicate"):
        hvd.init(process_sets=[hvd.ProcessSet([0]), hvd.ProcessSet(range(n - 1, -1, -1))],
                 **args)
    assert not hvd.is_initialized()
    mine = [hvd.ProcessSet([0]), hvd.ProcessSet(reversed(range(1, n)))]
    hvd.init(None, mine, **args)
    out["sets"] = _basics._get_process_set_ids_and_ranks()
    out["set_rank"] = [_basics._process_set_rank(i) for i in (1, 2)]
    sum1 = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=mine[1]) \
        if rank else None
    out["sum1"] = None if sum1 is None else float(sum1)
    hvd.shutdown()
    shoal.init(process_sets="dynamic", **args)  # Horovod's switch: shoal's normal state
    ps = hvd.add_process_set([0, 1])
    out["dynamic"] = ps.process_set_id
    return out


def test_init_comm_and_static_process_sets() -> None:
    results = run_ranks(_comm_and_static_sets, 4, timeout=120)
    for rank, out in enumerate(results):
        group = [r for r in range(4) if r % 2 == rank % 2][::-1]
        assert out["comm"] == (group.index(rank), 2, float(sum(r + 1 for r in group)))
        assert out["sets"] == {0: [0, 1, 2, 3], 1: [0], 2: [1, 2, 3]}
        assert out["set_rank"] == ([0, -1] if rank == 0 else [-1, rank - 1])
        assert out["sum1"] == (None if rank == 0 else 3.0)
        assert out["dynamic"] == 1


def _optimizer_class_and_passes(rank: int) -> list[float]:
    import shoal.torch as hvd

    model = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD) and isinstance(opt, hvd.DistributedOptimizer)
    assert type(opt) is type(hvd.DistributedOptimizer(
        torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)))  # one class per pair
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    opt.set_backward_passes_per_step(2)
    assert opt.backward_passes_per_step == 2
    for k in (1.0, 2.0):  # two passes accumulate, then one reduction
        model(torch.full((1, 2), k * (rank + 1))).sum().backward()
    opt.step()
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.5
    return model.weight.flatten().tolist()


def test_optimizer_is_the_wrapped_class_and_passes_can_change() -> None:
    n = 2
    want = -sum(3.0 * (r + 1) for r in range(n)) / n  # (1 + 2) x (rank + 1), averaged
    assert run_ranks(_optimizer_class_and_passes, n, timeout=60) == [[want, want]] * n


MPI_WORKER = """
import json, sys, numpy as np, shoal
from mpi4py import MPI
world = MPI.COMM_WORLD
sub = world.Split(color=world.rank % 2, key=-world.rank)  # reversed order inside each part
shoal.init(comm=sub)
total = shoal.allreduce(np.array([world.rank + 1.0]), op=shoal.Sum)
sys.stdout.write(json.dumps({"world": world.rank, "rank": shoal.rank(), "size": shoal.size(),
                             "sub": sub.rank, "sum": float(total[0])}) + "\\n")
sys.stdout.flush()
world.barrier()  # rank 0 serves the store both parts met at: it leaves last
shoal.shutdown()
"""


@pytest.mark.skipif(mpirun() is None, reason="Open MPI's mpirun is not installed")
def test_init_with_an_mpi4py_communicator() -> None:
    pytest.importorskip("mpi4py")
    from harness import free_port

    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHOAL_", "OMPI_", "PMI_", "MASTER_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      env.get("PYTHONPATH")]))
    proc = subprocess.run([mpirun(), *as_root, "--oversubscribe", "-np", "4",
                           "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={free_port()}",
                           "-x", "SHOAL_SECRET=" + "ab" * 16, "-x", "PYTHONPATH",
                           sys.executable, "-c", MPI_WORKER],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    rows = sorted((json.loads(line) for line in proc.stdout.splitlines()
                   if line.startswith("{")), key=lambda r: r["world"])
    assert [r["world"] for r in rows] == [0, 1, 2, 3], proc.stdout
    for r in rows:
        part = [w for w in range(4) if w % 2 == r["world"] % 2]
        assert (r["rank"], r["size"]) == (r["sub"], 2)
        assert r["sum"] == sum(w + 1.0 for w in part)

