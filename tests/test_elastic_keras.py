"""Elastic training with Keras's ``model.fit`` and Horovod's elastic callbacks, through
``shoalrun``'s elastic mode, on Keras 3 and on Keras 2 (``TF_USE_LEGACY_KERAS=1``): a worker
killed with SIGKILL mid-epoch, the others restore the last commit and finish the epochs with
identical weights."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras")
from test_elastic import _discovery, _env, _finals

ROOT = Path(__file__).resolve().parents[1]

FIT = r"""
import hashlib, os, signal, sys
import numpy as np
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)
keras = tf.keras  # Keras 3, or Keras 2 under TF_USE_LEGACY_KERAS=1; shoal.keras follows it
import shoal.keras as hvd

hvd.init()
me = os.environ["SHOAL_ELASTIC_ID"]
keras.utils.set_random_seed(hvd.rank())  # different initial weights: sync makes them equal
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32")
y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32"))[:, None]
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")


class Kill(keras.callbacks.Callback):
    def on_batch_end(self, batch, logs=None):
        if me == os.environ.get("KILL_ID") and state.epoch == 0 and batch == 3:
            os.kill(os.getpid(), signal.SIGKILL)


state = hvd.elastic.KerasState(model, batch=0, epoch=0)
callbacks = [Kill(), hvd.elastic.CommitStateCallback(state),
             hvd.elastic.UpdateBatchStateCallback(state),
             hvd.elastic.UpdateEpochStateCallback(state)]


@hvd.elastic.run
def train(state):
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4).repeat()
    state.model.fit(data, steps_per_epoch=6, epochs=3 - state.epoch, callbacks=callbacks,
                    verbose=0)


train(state)
w = np.concatenate([v.numpy().ravel() for v in model.weights])
print("final", hvd.rank(), hvd.size(), hashlib.sha256(w.tobytes()).hexdigest(), state.epoch)
"""


@pytest.mark.parametrize("legacy", [False, pytest.param(True, marks=pytest.mark.skipif(
    importlib.util.find_spec("tf_keras") is None, reason="tf_keras is not installed"))],
    ids=["keras3", "keras2"])
def test_keras_fit_survives_a_killed_worker(tmp_path: Path, legacy: bool) -> None:
    import subprocess
    _discovery(tmp_path, "localhost:3\n")
    script = tmp_path / "fit.py"
    script.write_text(FIT)
    proc = subprocess.run([sys.executable, "-m", "shoal.runner", "-np", "3", "--min-np", "2",
                           "--blacklist-after", "2",
                           "--host-discovery-script", str(tmp_path / "discover.sh"),
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**_env(), "KILL_ID": "localhost:1",
                                                      "TF_USE_LEGACY_KERAS": str(int(legacy))})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "worker localhost:1 failed (signal 9)" in proc.stderr
    finals = _finals(proc.stdout)
    assert [(r, n) for r, n, _ in finals] == [(0, 2), (1, 2)]
    assert finals[0][2] == finals[1][2]
    ends = [line.split()[-1] for line in proc.stdout.splitlines() if "final " in line]
    assert ends == ["3", "3"]  # both finished the 3 epochs
