"""The application's data at scale and over time: the record index (a start on 1,024 shards
counts nothing twice), every data-loading worker reading its own part when workers outnumber
files, exact resume of the data stream, and ``--mode eval`` without a checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")
pytest.importorskip("crc32c")
pytest.importorskip("google.protobuf")
from apps.efficientnet.config import parse_args  # noqa: E402
from apps.efficientnet.dataloader import (  # noqa: E402
    Preprocess,
    TFRecordImages,
    TFRecordWriter,
    build_dataset,
    make_example,
    make_loader,
)
from apps.efficientnet.dataloader import index as index_mod  # noqa: E402
from apps.efficientnet.dataloader.datasets import stream_position  # noqa: E402
from apps.efficientnet.dataloader.index import Team, assign, record_counts  # noqa: E402
from apps.efficientnet.dataloader.tfrecord import count_records  # noqa: E402
from apps.efficientnet.runtime.checkpoint import load_checkpoint  # noqa: E402
from harness import run_ranks  # noqa: E402


def _jpeg(value: int, size: int = 8) -> bytes:
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (value % 256, (7 * value) % 256, 90)).save(buf, "JPEG")
    return buf.getvalue()


def _shards(root: Path, split: str, files: int, per_file: int, jpeg: bytes | None = None,
            classes: int = 10) -> list[str]:
    """``files`` ImageNet-layout shards of ``per_file`` records each; record ``k`` overall
    has label ``k % classes`` (+1, as ImageNet stores them)."""
    root.mkdir(parents=True, exist_ok=True)
    paths, k = [], 0
    for i in range(files):
        path = root / f"{split}-{i:05d}-of-{files:05d}"
        with TFRecordWriter(path) as w:
            for _ in range(per_file):
                w.write(make_example({"image/encoded": jpeg or _jpeg(k),
                                      "image/class/label": k % classes + 1,
                                      "image/index": k}))
                k += 1
        paths.append(str(path))
    return paths


class _Counter:
    def __init__(self) -> None:
        self.files: list[str] = []

    def __call__(self, path: str) -> int:
        self.files.append(path)
        return count_records(path)


# -- the record index -----------------------------------------------------------------------

def test_start_on_1024_shards_counts_each_once(tmp_path, monkeypatch):
    """The first start walks each of 1,024 shards' headers once and writes the index; the
    next start reads only the index; a shard that changed is counted again, alone."""
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "cache"))
    files = _shards(tmp_path / "data", "train", 1024, 2, jpeg=b"\xff\xd8tiny")
    spy = _Counter()
    monkeypatch.setattr(index_mod, "count_records", spy)
    pp = Preprocess(8, training=True)
    ds = build_dataset(str(tmp_path / "data"), "train", pp, rank=0, size=1, seed=0,
                       num_classes=10)
    assert ds.num_examples() == 2048 and sorted(spy.files) == sorted(files)
    assert (tmp_path / "data/.shoal-index.json").is_file()
    spy.files.clear()
    again = build_dataset(str(tmp_path / "data"), "train", pp, rank=0, size=1, seed=0,
                          num_classes=10)
    assert again.num_examples() == 2048 and spy.files == []  # no shard opened
    with TFRecordWriter(files[7]) as w:  # shard 7 rewritten with 3 records
        w.write_all([b"a", b"bb", b"ccc"])
    assert record_counts(files)[7] == 3 and spy.files == [files[7]]
    assert sum(record_counts(files)) == 2049 and spy.files == [files[7]]


def _count_on_ranks(rank: int, data: str) -> tuple[int, int]:
    import shoal
    spy = _Counter()
    files = sorted(str(p) for p in Path(data).glob("train-*"))
    team = Team(rank, shoal.size(), lambda o: shoal.broadcast_object(o, root_rank=0),
                lambda o: shoal.allgather_object(o))
    counts = record_counts(files, team, counter=spy)
    return sum(counts), len(spy.files)


def test_first_start_shares_the_counting_over_ranks(tmp_path):
    _shards(tmp_path, "train", 64, 3, jpeg=b"\xff\xd8x")
    got = run_ranks(_count_on_ranks, 2, str(tmp_path), timeout=60)
    assert got == [(192, 32), (192, 32)]  # each rank walked half of the shards
    assert run_ranks(_count_on_ranks, 2, str(tmp_path), timeout=60) == [(192, 0), (192, 0)]


def test_index_of_read_only_data_goes_to_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(cache))
    files = _shards(tmp_path / "ro", "train", 3, 2, jpeg=b"\xff\xd8x")
    # beside the data is unwritable: the index's place there is under a regular file
    monkeypatch.setattr(index_mod, "INDEX_NAME", "train-00000-of-00003/index.json")
    assert record_counts(files) == [2, 2, 2]
    assert len(list(cache.glob("index-*.json"))) == 1
    spy = _Counter()
    assert record_counts(files, counter=spy) == [2, 2, 2] and spy.files == []


# -- more data-loading workers than files ---------------------------------------------------

def test_assign_contiguous_ranges_when_workers_outnumber_files():
    counts = [5, 5, 5]
    parts = [assign(counts, c, 8) for c in range(8)]
    flat = [(i, r) for part in parts for i, a, b in part for r in range(a, b)]
    assert sorted(flat) == [(i, r) for i in range(3) for r in range(5)]  # each record once
    assert all(len({i for i, _, _ in part}) <= 2 for part in parts)  # at most 2 files each
    assert [sum(b - a for _, a, b in p) for p in parts] == [1, 2, 2, 2, 2, 2, 2, 2]
    assert assign([4, 4, 4], 1, 2) == [(1, 0, 4)]  # enough files: whole files


class _Reads(TFRecordImages):
    """Records which records were read (not passed over) from which file."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.read: list[tuple[str, int, int]] = []

    def _items(self, unit, start, stop, lazy):
        self.read.append((unit, start, stop))
        return super()._items(unit, start, stop, lazy)


def test_each_worker_reads_only_its_part(tmp_path):
    """3 validation files of 5 records, 8 consumers (4 ranks x 2 workers): each reads its own
    records, from at most 2 files, and together they read every record once."""
    files = _shards(tmp_path, "validation", 3, 5)
    pp = Preprocess(8, training=False)
    labels, reads = [], []
    for consumer in range(8):  # one consumer per dataset: rank c of 8, no DataLoader workers
        ds = _Reads(files, pp, rank=consumer, size=8, repeat=False)
        labels += [label for _, label in ds]
        reads.append(ds.read)
    assert sorted(labels) == sorted(k % 10 for k in range(15))
    assert all(len(r) <= 2 for r in reads)
    assert sum(stop - start for r in reads for _, start, stop in r) == 15


def test_workers_get_distinct_parts_through_dataloader(tmp_path):
    files = _shards(tmp_path, "validation", 2, 9)
    pp = Preprocess(8, training=False)
    seen = []
    for rank in range(2):
        ds = TFRecordImages(files, pp, rank=rank, size=2, repeat=False)
        for _, labels in make_loader(ds, 2, num_workers=2, drop_last=False):
            seen += labels.tolist()
    assert sorted(seen) == sorted(k % 10 for k in range(18))


# -- exact resume ---------------------------------------------------------------------------

def test_stream_position_maps_workers_to_roles():
    # 3 workers, 7 batches consumed: batches 0..6 came from workers 0,1,2,0,1,2,0
    assert [stream_position(w, 3, 7, 4) for w in range(3)] == [(1, 8), (2, 8), (0, 12)]
    assert stream_position(0, 1, 5, 2) == (0, 10)


def test_dataset_resumes_mid_pass(tmp_path):
    """A training stream (shuffle buffer, several passes, 2 workers) resumed after any number
    of batches yields exactly the batches the uninterrupted stream yields next."""
    files = _shards(tmp_path, "train", 3, 7)
    pp = Preprocess(8, training=True, min_scale=0.5)

    def batches(start: int, n: int) -> list[torch.Tensor]:
        ds = TFRecordImages(files, pp, rank=1, size=2, seed=3, shuffle_buffer=4)
        ds.resume(start, 3)
        it = iter(make_loader(ds, 3, num_workers=2, drop_last=True))
        return [torch.cat([x.flatten().float(), y.float()]) for x, y in
                (next(it) for _ in range(n))]

    straight = batches(0, 12)
    for start in (1, 4, 7):  # mid-pass, and past a pass (21 records / 4 consumers)
        for a, b in zip(batches(start, 12 - start), straight[start:], strict=True):
            assert torch.equal(a, b)


def _train(data: Path, model_dir: Path, epochs: int, resume: bool) -> None:
    """The application under shoalrun, 2 ranks x 2 DataLoader workers."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "SM_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(root / "src"), str(root), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([
        sys.executable, "-m", "shoal.runner", "-np", "2", sys.executable, "-m",
        "apps.efficientnet.main", "--arch", "small-cnn", "--image_size", "32",
        "--num_classes", "10", "--data_dir", str(data), "--train_batch_size", "4",
        "--num_workers", "2", "--steps_per_epoch", "3", "--max_epochs", str(epochs),
        "--mode", "train", "--optimizer", "rmsprop", "--lr_warmup_epochs", "1",
        "--augmenter_name", "none", "--moving_average_decay", "0.9", "--mixup_alpha", "0.2",
        "--log_steps", "0", "--save_checkpoint_freq", "1", "--model_dir", str(model_dir),
        *(["--resume_checkpoint", str(model_dir)] if resume else [])],
        capture_output=True, text=True, timeout=240, env=env, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if resume:
        assert "the stream continues after batch 3 (exact resume)" in proc.stdout


def _tensors(obj: object) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, list | tuple):
        return [t for x in obj for t in _tensors(x)]
    return []


def _weights(model_dir: Path) -> list[torch.Tensor]:
    state = load_checkpoint(model_dir)
    return _tensors([state["model"], state["ema"], state["optimizer"]])


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    """2 ranks x 2 DataLoader workers train 3 epochs of 3 steps straight, and again stopped
    after the first epoch and resumed from its checkpoint: the final weights, EMA and
    optimizer state are bitwise equal (the stream continues after batch 3 of a pass that is
    longer than an epoch, so restarting the stream would differ)."""
    data = tmp_path / "data"
    _shards(data, "train", 3, 11, classes=10)
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    _train(data, straight, 3, False)
    _train(data, cut, 1, False)
    _train(data, cut, 3, True)
    a, b = _weights(straight), _weights(cut)
    assert len(a) > 20 and len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    state = load_checkpoint(cut)
    assert state["data"]["batches"] == 9 and state["epoch"] == 3


# -- honest modes ---------------------------------------------------------------------------

def _eval(rank: int, model_dir: str, *extra: str) -> object:
    from apps.efficientnet.runtime import run
    torch.set_num_threads(1)
    try:
        summary = run(parse_args(["--arch", "small-cnn", "--image_size", "32", "--num_classes",
                                  "10", "--synthetic", "--mode", "eval", "--eval_batch_size",
                                  "4", "--num_workers", "0", "--model_dir", model_dir,
                                  *extra], environ={}))
    except SystemExit as exc:
        return str(exc)
    return summary["checkpoint"]


def test_eval_needs_a_checkpoint(tmp_path):
    got = run_ranks(_eval, 2, str(tmp_path), timeout=60)
    assert got[0] == got[1] and "--mode eval needs a trained model" in got[0]
    assert "--eval_untrained" in got[0] and "--resume PATH" in got[0]
    assert run_ranks(_eval, 2, str(tmp_path), "--eval_untrained",
                     timeout=60) == ["none: untrained"] * 2
    assert run_ranks(_synthetic_train, 1, str(tmp_path), timeout=60) == [None]
    found = str(tmp_path / "ckpt-000000001.pt")
    assert run_ranks(_eval, 2, str(tmp_path), timeout=60) == [found, found]


def _synthetic_train(rank: int, model_dir: str) -> None:
    from apps.efficientnet.runtime import run
    torch.set_num_threads(1)
    run(parse_args(["--arch", "small-cnn", "--image_size", "32", "--num_classes", "10",
                    "--synthetic", "--mode", "train", "--max_epochs", "1", "--steps_per_epoch",
                    "1", "--train_batch_size", "2", "--num_workers", "0", "--model_dir",
                    model_dir], environ={}))


def test_unwritable_environment_is_not_needed(tmp_path, monkeypatch):
    """The index is an optimisation: with nowhere to write it, counting still works."""
    monkeypatch.setenv("SHOAL_CACHE_DIR", "/proc/no-such-place")
    monkeypatch.setattr(index_mod, "INDEX_NAME", "train-00000-of-00002/index.json")
    files = _shards(tmp_path, "train", 2, 3, jpeg=b"\xff\xd8x")
    with pytest.warns(UserWarning, match="could not write the record index"):
        assert record_counts(files) == [3, 3]
    assert sorted(os.listdir(tmp_path)) == ["train-00000-of-00002", "train-00001-of-00002"]


def test_reduced_decode_crops_the_same_region():
    """A JPEG decoded at a reduced DCT scale gives the crop of the same region as the full
    decode (the same box), with pixels within a small tolerance; large crops get reduced."""
    import random

    import numpy as np

    from apps.efficientnet.dataloader.augment import (
        _random_crop_box,
        eval_jpeg,
        open_for_crop,
        train_jpeg,
    )
    from apps.efficientnet.dataloader.photos import photo_jpegs
    jpegs, _ = photo_jpegs(24, seed=3)
    reduced = 0
    for i, data in enumerate(jpegs):
        def box_of(w, h, i=i):
            return _random_crop_box(w, h, random.Random(i), 0.08)
        full_img, full_box, box = open_for_crop(data, box_of, 96, reduce=False)
        small_img, small_box, same = open_for_crop(data, box_of, 96, reduce=True)
        assert box == same == full_box  # the crop, in the full image's pixels
        factor = full_img.width / small_img.width
        reduced += factor > 1.5
        np.testing.assert_allclose(np.array(small_box) * round(factor), box)
        a = train_jpeg(data, 96, random.Random(i), reduce=False).numpy().astype(int)
        b = train_jpeg(data, 96, random.Random(i), reduce=True).numpy().astype(int)
        assert np.abs(a - b).mean() < 6.0, i  # DCT scaling vs bicubic: close, not equal
        e_full = eval_jpeg(data, 64, reduce=False).numpy().astype(int)
        e_small = eval_jpeg(data, 64, reduce=True).numpy().astype(int)
        assert np.abs(e_full - e_small).mean() < 6.0, i
    assert reduced >= len(jpegs) // 3  # most crops of a 500x375 photo allow 1/2 at 96 px


def test_loader_workers_default_to_the_ranks_cores(monkeypatch):
    """--num_workers by default: the cores this rank may run on (shoalrun binds them), less
    one for training, at least one; an explicit number stands."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert parse_args(["--synthetic"], environ={}).num_workers == 3
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5})
    assert parse_args(["--synthetic"], environ={}).num_workers == 1
    assert parse_args(["--synthetic", "--num_workers", "0"], environ={}).num_workers == 0


def test_device_prefetcher_hands_out_every_batch_in_order():
    """On CPU the batches pass through unchanged, one loaded ahead; (on CUDA they would be
    copied on a side stream)."""
    from apps.efficientnet.dataloader.prefetch import DevicePrefetcher
    batches = [(torch.full((2, 3), float(i)), torch.tensor([i, i])) for i in range(5)]
    got = list(DevicePrefetcher(iter(batches), torch.device("cpu")))
    assert len(got) == 5
    for (x, y), (a, b) in zip(got, batches, strict=True):
        assert x is a and y is b
    assert list(DevicePrefetcher([], torch.device("cpu"))) == []
