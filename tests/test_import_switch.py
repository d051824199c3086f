"""The import switch: unmodified Horovod and SMDDP scripts run on shoal with one launcher flag
(``shoalrun --as``) or ``python -m shoal.as`` under torchrun, at 2 ranks, and train to the
same weights as one process on the whole batch; without the switch nothing is aliased."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness import free_port_pair, port_clash

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[1]
SECRET = "5e" * 16

TRAIN = """
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
g = torch.Generator().manual_seed(1)
X = torch.randn(8, 4, generator=g)
Y = X.sum(1, keepdim=True)
def batches(rank, size):
    for _ in range(3):
        yield X[rank::size], Y[rank::size]
"""

HOROVOD = """
import json, subprocess, sys
import torch
import horovod.torch as hvd
from horovod.torch.mpi_ops import synchronize
from horovod.common.util import gloo_built
from horovod.runner.util.threads import in_thread
hvd.init()
""" + TRAIN + """
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                               named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
for x, y in batches(hvd.rank(), hvd.size()):
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
child = subprocess.run([sys.executable, "-c", "import horovod.torch as h; print(h.__name__)"],
                       capture_output=True, text=True).stdout.strip()
line = json.dumps({"rank": hvd.rank(), "size": hvd.size(), "gloo": gloo_built(),
                   "sgd": isinstance(opt, torch.optim.SGD), "child": child,
                   "weights": [p.detach().flatten().tolist() for p in model.parameters()]})
sys.stdout.write(line + "\\n")  # one write: the ranks share torchrun's pipe
sys.stdout.flush()
"""

DDP_LOOP = """
model = {ddp}(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in batches(dist.get_rank(), dist.get_world_size()):
    opt.zero_grad()
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
line = json.dumps({{"rank": dist.get_rank(), "size": dist.get_world_size(), **{extra},
                   "weights": [p.detach().flatten().tolist() for p in model.parameters()]}})
sys.stdout.write(line + "\\n")  # one write: the ranks share torchrun's pipe
sys.stdout.flush()
dist.destroy_process_group()
"""

SMDDP = """
import json, sys
import torch
import torch.distributed as dist
import smdistributed.dataparallel.torch.torch_smddp
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group(backend="smddp")
""" + TRAIN + DDP_LOOP.format(ddp="DDP", extra='{"backend": dist.get_backend()}')

SMDDP_V1 = """
import json, sys
import torch
import smdistributed.dataparallel.torch.distributed as dist
from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel
dist.init_process_group()
""" + TRAIN + DDP_LOOP.format(ddp="DistributedDataParallel",
                              extra='{"local": [dist.get_local_rank(), dist.get_local_size()]}')

def _reference() -> list[list[float]]:
    """One process, the whole batch: what every rank of the scripts must end with."""
    scope: dict = {"torch": torch}
    exec(TRAIN, scope)
    model = scope["model"]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in scope["batches"](0, 1):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SHOAL_", "HOROVOD_", "OMPI_", "PMI_", "MASTER_", "RANK",
                                "WORLD_SIZE", "LOCAL_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"),
                                                      env.get("PYTHONPATH")]))
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    for _attempt in range(3):  # a port taken between our pick and torchrun's bind: again
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        if proc.returncode == 0 or "--master-port" not in argv or \
                not port_clash(proc.stdout + proc.stderr):
            return proc
        argv = list(argv)
        argv[argv.index("--master-port") + 1] = str(free_port_pair())
    return proc


def _rows(proc: subprocess.CompletedProcess[str]) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line[line.index("{"):]) for line in proc.stdout.splitlines()
            if "{" in line]
    return sorted(rows, key=lambda r: r["rank"])


def _shoalrun(kind: str | None, script: Path) -> subprocess.CompletedProcess[str]:
    switch = ["--as", kind] if kind else []
    return _run([sys.executable, "-m", "shoal.runner", "-np", "2", *switch, sys.executable,
                 str(script)], _env())


def _torchrun(kind: str, script: Path) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                 "--master-port", str(free_port_pair()), "-m", "shoal.as", kind, str(script)],
                _env(SHOAL_SECRET=SECRET))


def _check_trained(rows: list[dict]) -> None:
    assert [r["rank"] for r in rows] == [0, 1] and all(r["size"] == 2 for r in rows)
    want = _reference()
    for r in rows:
        for mine, theirs in zip(r["weights"], want, strict=True):
            assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("launch", [_shoalrun, _torchrun], ids=["shoalrun", "torchrun"])
@pytest.mark.parametrize("kind", ["horovod", "smddp"])
def test_a_script_runs_unchanged(kind: str, launch, tmp_path: Path) -> None:
    script = tmp_path / f"train_{kind}.py"
    script.write_text(HOROVOD if kind == "horovod" else SMDDP)
    rows = _rows(launch(kind, script))
    _check_trained(rows)
    if kind == "horovod":  # the switch reaches the processes the script starts, and
        # Horovod's answers are shoal's
        assert all(r["gloo"] and r["sgd"] and r["child"] == "shoal.torch" for r in rows)
    else:
        assert all(r["backend"] == "smddp" for r in rows)


def test_smddp_version_one_api(tmp_path: Path) -> None:
    script = tmp_path / "train_smddp_v1.py"
    script.write_text(SMDDP_V1)
    rows = _rows(_shoalrun("smddp", script))
    _check_trained(rows)
    assert [r["local"] for r in rows] == [[0, 2], [1, 2]]


SMDDP_TF = """
import json, sys
import numpy as np
import tensorflow as tf
import smdistributed.dataparallel.tensorflow as sdp
import smdistributed.dataparallel.tensorflow.keras as sdp_keras
from smdistributed.dataparallel.tensorflow.keras import callbacks as sdp_callbacks
sdp.init()
tf.keras.utils.set_random_seed(sdp.rank())  # different until the broadcast
model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(1)])
opt = sdp_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.1),
                                     compression=sdp.Compression.fp16)
model.compile(optimizer=opt, loss="mse")
x = np.random.default_rng(sdp.rank()).normal(size=(8, 4)).astype("float32")
model.fit(x, x.sum(1, keepdims=True), batch_size=4, epochs=1, verbose=0,
          callbacks=[sdp_callbacks.BroadcastGlobalVariablesCallback(0)])
mean = float(sdp.oob_allreduce(tf.constant(sdp.rank() + 1.0)))
sys.stdout.write(json.dumps({"rank": sdp.rank(), "size": sdp.size(), "mean": mean,
                             "weights": [w.tolist() for w in model.get_weights()]}) + "\\n")
"""


def test_the_smddp_tensorflow_api_runs_unchanged(tmp_path: Path) -> None:
    pytest.importorskip("tensorflow")
    script = tmp_path / "train_tf.py"
    script.write_text(SMDDP_TF)
    rows = _rows(_shoalrun("smddp", script))
    assert [(r["rank"], r["size"], r["mean"]) for r in rows] == [(0, 2, 1.5), (1, 2, 1.5)]
    assert rows[0]["weights"] == rows[1]["weights"]  # broadcast, then the same updates


def test_without_the_switch_nothing_is_aliased(tmp_path: Path) -> None:
    script = tmp_path / "train_hvd.py"
    script.write_text(HOROVOD)
    proc = _shoalrun(None, script)
    assert proc.returncode != 0
    assert "No module named 'horovod'" in proc.stdout + proc.stderr


def _in_fresh_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=_env(**env),
                          capture_output=True, text=True, timeout=60)


def test_the_finder_and_what_it_refuses() -> None:
    proc = _in_fresh_python("""
        import sys
        import shoal.alias as alias
        alias.install("horovod,smddp")
        import horovod.common.util, horovod.runner.common.util.env, shoal.common.util
        assert horovod.common.util is shoal.common.util
        import smdistributed.dataparallel.torch.torch_smddp as s
        import shoal.alias.smdistributed.dataparallel.torch.torch_smddp as t
        assert s is t
        try:
            import horovod.spark
        except ModuleNotFoundError as exc:
            assert "horovod.spark" in str(exc) and "shoal.spark" in str(exc), exc
        else:
            raise AssertionError("horovod.spark imported")
        alias.uninstall()
        for name in [m for m in sys.modules if m.split(".")[0] in ("horovod", "smdistributed")]:
            del sys.modules[name]
        try:
            import horovod
        except ModuleNotFoundError:
            print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_real_package_is_named_and_not_used(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "horovod"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise SystemExit('the real horovod was imported')\n")
    script = tmp_path / "s.py"
    script.write_text("import horovod.torch as hvd\nprint(hvd.__name__)\n")
    proc = subprocess.run([sys.executable, "-m", "shoal.as", "horovod", str(script)],
                          env=_env(PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                               str(fake.parent)])),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "shoal.torch"
    assert f"the horovod installed at {fake / '__init__.py'} is not used" in proc.stderr
    # without the switch, the same interpreter gets the real one
    plain = subprocess.run([sys.executable, str(script)],
                           env=_env(PYTHONPATH=str(fake.parent)),
                           capture_output=True, text=True, timeout=60)
    assert "the real horovod was imported" in plain.stderr


def test_code_given_with_dash_c_runs_as_python_runs_it() -> None:
    """``python -m shoal.as horovod -c CODE ARGS``: the code runs as ``__main__`` with
    ``sys.argv`` = ``["-c", *ARGS]``, its imports switched; its exit status passes through."""
    code = ("import sys, horovod.torch as hvd\nprint(hvd.__name__, sys.argv, __name__)\n"
            "sys.exit(int(sys.argv[1]))")
    proc = subprocess.run([sys.executable, "-m", "shoal.as", "horovod", "-c", code, "3", "-x"],
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.split("\n")[0] == "shoal.torch ['-c', '3', '-x'] __main__"
    proc = subprocess.run([sys.executable, "-m", "shoal.as", "horovod", "-c"], env=_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "-c CODE" in proc.stderr


def test_bad_kinds_are_refused_by_name(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    proc = subprocess.run([sys.executable, "-m", "shoal.as", "mpi", str(script)],
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown import switch mpi" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "shoal.runner", "-np", "1", "--as", "mpi",
                           sys.executable, str(script)], env=_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--as mpi" in proc.stderr and "ran" not in proc.stdout


def test_a_remote_worker_finds_its_hosts_boot_directory() -> None:
    from shoal.alias import BOOT_DIR
    from shoal.runner.bootstrap import switch_path

    env = {"SHOAL_AS": "horovod",
           "PYTHONPATH": os.pathsep.join(["/elsewhere/shoal/alias/boot", "/opt/lib"])}
    switch_path(env)
    assert env["PYTHONPATH"].split(os.pathsep) == [BOOT_DIR, "/opt/lib"]
    env = {"PYTHONPATH": "/opt/lib"}
    switch_path(env)  # switch off: untouched
    assert env == {"PYTHONPATH": "/opt/lib"}
