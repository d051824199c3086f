"""``--data_dir s3://bucket/prefix``: TFRecords read through fsspec/s3fs from a real
S3-compatible server that the test starts (moto in server mode, over HTTP on loopback):
listing, the record index (kept in the cache directory), reading, resuming mid-pass, and the
application trained and evaluated from the bucket under shoalrun."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
s3fs = pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("flask")
from apps.efficientnet.dataloader import Preprocess, build_dataset, find_split  # noqa: E402
from apps.efficientnet.dataloader.datasets import TFRecordImages  # noqa: E402
from test_efficientnet_data import _shards  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_server() -> Iterator[str]:
    """An S3-compatible server (moto's, in its own process); its endpoint URL."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto server did not start: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.1)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def bucket(s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A bucket holding 3 train and 2 validation shards (also kept locally in tmp/local);
    its ``s3://`` prefix. This process's AWS variables point at the server."""
    for key, value in {**CREDENTIALS, "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "cache"))
    local = tmp_path / "local"
    _shards(local, "train", 3, 9)
    _shards(local, "validation", 2, 5)
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}, skip_instance_cache=True)
    name = f"data-{os.getpid()}-{tmp_path.name[-12:].lower().replace('_', '-')}"
    fs.mkdir(name)
    fs.put(str(local) + "/", f"{name}/imagenet/", recursive=True)
    return f"s3://{name}/imagenet"


def test_list_count_and_read_from_s3(bucket: str, tmp_path: Path) -> None:
    kind, files = find_split(bucket, "train")
    assert kind == "tfrecord"
    assert files == [f"{bucket}/train-0000{i}-of-00003" for i in range(3)]
    assert find_split(bucket, "eval")[1] == [f"{bucket}/validation-0000{i}-of-00002"
                                             for i in range(2)]
    pp = Preprocess(8, training=False)
    remote = build_dataset(bucket, "eval", pp, rank=0, size=1, seed=0, num_classes=10)
    local = build_dataset(str(tmp_path / "local"), "eval", pp, rank=0, size=1, seed=0,
                          num_classes=10)
    assert remote.num_examples() == local.num_examples() == 10
    for (a, la), (b, lb) in zip(remote, local, strict=True):
        assert la == lb and torch.equal(a, b)
    (index,) = (tmp_path / "cache").glob("index-*.json")  # one per directory, in the cache
    assert sorted(json.loads(index.read_text())["files"]) == ["validation-00000-of-00002",
                                                               "validation-00001-of-00002"]


def test_resume_mid_pass_from_s3(bucket: str, tmp_path: Path) -> None:
    """Passed-over records are located by their headers, and those still in the shuffle
    buffer at the resume point are fetched one by one (ranged GETs): same batches."""
    _kind, files = find_split(bucket, "train")
    pp = Preprocess(8, training=True, min_scale=0.5)

    def stream(where: list[str], start: int, n: int) -> list[torch.Tensor]:
        ds = TFRecordImages(where, pp, rank=0, size=1, seed=1, shuffle_buffer=5)
        ds.resume(start, 2)
        it = iter(ds)
        return [torch.cat([x.flatten().float(), torch.tensor([float(y)])])
                for x, y in (next(it) for _ in range(n))]

    local = sorted(str(p) for p in (tmp_path / "local").glob("train-*"))
    straight = stream(local, 0, 30)
    got = stream(files, 5, 20)  # 10 samples in: mid-pass, buffer full
    assert all(torch.equal(a, b) for a, b in zip(got, straight[10:], strict=True))


def test_application_trains_from_s3(bucket: str, s3_server: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "SM_"))}
    env.update(CREDENTIALS, AWS_ENDPOINT_URL=s3_server, OMP_NUM_THREADS="1",
               SHOAL_CACHE_DIR=str(tmp_path / "cache2"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    proc = subprocess.run([
        sys.executable, "-m", "shoal.runner", "-np", "2", sys.executable, "-m",
        "apps.efficientnet.main", "--arch", "small-cnn", "--image_size", "32",
        "--num_classes", "10", "--data_dir", bucket, "--train_batch_size", "4",
        "--eval_batch_size", "4", "--num_workers", "1", "--max_epochs", "1",
        "--mode", "train_and_eval", "--augmenter_name", "none", "--log_steps", "0",
        "--model_dir", str(tmp_path / "model")],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "3 steps/epoch" in proc.stdout  # 27 records // global batch 8, from the index
    assert "epoch 1/1  loss " in proc.stdout and "  eval " in proc.stdout
    assert (tmp_path / "model/ckpt-000000003.pt").is_file()
