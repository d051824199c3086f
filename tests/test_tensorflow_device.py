"""One GPU per TensorFlow process (Horovod's recipe): the pinning logic against a stand-in
``tf.config`` with GPUs, and the real code path, through ``shoal.keras.init`` and the
application's Keras communicator, with no GPU visible (it must change nothing and not fail)."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

pytest.importorskip("tensorflow")

from shoal.tensorflow import device


class _Config:
    """What pin_gpu asks of ``tf.config``, recording what it was told."""

    def __init__(self, count: int, initialised: bool = False) -> None:
        self.gpus = [types.SimpleNamespace(name=f"/physical_device:GPU:{i}")
                     for i in range(count)]
        self.growth: list[str] = []
        self.visible: list[str] = []
        self.initialised = initialised
        self.experimental = types.SimpleNamespace(set_memory_growth=self._growth)

    def list_physical_devices(self, kind: str) -> list:
        assert kind == "GPU"
        return list(self.gpus)

    def _growth(self, gpu, on: bool) -> None:
        if self.initialised:
            raise RuntimeError("Physical devices cannot be modified after being initialized")
        assert on
        self.growth.append(gpu.name)

    def set_visible_devices(self, gpu, kind: str) -> None:
        assert kind == "GPU"
        self.visible.append(gpu.name)


def test_pin_gpu_keeps_one_gpu_per_local_rank_with_memory_growth() -> None:
    cfg = _Config(8)
    assert device.pin_gpu(3, types.SimpleNamespace(config=cfg)) == "/physical_device:GPU:3"
    assert cfg.visible == ["/physical_device:GPU:3"] and len(cfg.growth) == 8
    shared = _Config(2)
    assert device.pin_gpu(5, types.SimpleNamespace(config=shared)).endswith("GPU:1")


def test_pin_gpu_without_gpus_changes_nothing() -> None:
    cfg = _Config(0)
    assert device.pin_gpu(0, types.SimpleNamespace(config=cfg)) is None
    assert cfg.visible == [] and cfg.growth == []


def test_pin_gpu_after_tensorflow_set_up_its_gpus_warns(caplog) -> None:
    cfg = _Config(2, initialised=True)
    with caplog.at_level("WARNING", logger="shoal.tensorflow"):
        assert device.pin_gpu(1, types.SimpleNamespace(config=cfg)) is None
    assert "before any TensorFlow operation" in caplog.text and cfg.visible == []


def test_keras_init_pins_nothing_without_a_gpu() -> None:
    code = ("import tensorflow as tf, shoal.keras as hvd\n"
            "hvd.init()\n"
            "from apps.efficientnet.keras.comm import Comm\n"
            "c = Comm()\n"
            "print('gpus', len(tf.config.get_visible_devices('GPU')), hvd.size(), c.size)\n"
            "hvd.shutdown()\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=240, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "gpus 0 1 1" in out.stdout, out.stdout
