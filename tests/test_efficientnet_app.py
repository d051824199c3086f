"""The EfficientNet application: TFRecords and Examples, data, losses, optimizer, flags, and
training on 1-2 ranks (steps, syncbn agreement, resume, a whole run()).

Multi-rank tests call the runtime functions directly inside ``run_ranks`` jobs; models use
32x32 inputs and batches of 2, so that the whole file stays well under two minutes here.
"""

from __future__ import annotations

import hashlib
import json
import math
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")
pytest.importorskip("crc32c")
pytest.importorskip("google.protobuf")
from apps.efficientnet.config import parse_args  # noqa: E402
from apps.efficientnet.dataloader import (  # noqa: E402
    Preprocess,
    TFRecordError,
    TFRecordWriter,
    build_dataset,
    count_records,
    make_example,
    parse_example,
    parse_image_record,
    read_records,
)
from apps.efficientnet.dataloader.augment import OPS, AutoAugment, RandAugment  # noqa: E402
from apps.efficientnet.dataloader.digits import digits_jpegs, write_imagenet_layout  # noqa: E402
from apps.efficientnet.runtime.losses import (  # noqa: E402
    mixup,
    smooth_targets,
    soft_cross_entropy,
    topk_correct,
)
from apps.efficientnet.runtime.optim import LRSchedule, TFRMSprop, param_groups  # noqa: E402
from harness import run_ranks  # noqa: E402

TINY = ["--image_size", "32", "--num_classes", "10", "--train_batch_size", "2",
        "--eval_batch_size", "2", "--num_workers", "0", "--log_steps", "0"]


def _jpeg(color: tuple[int, int, int], size: int = 16) -> bytes:
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (size, size), color).save(buf, format="JPEG")
    return buf.getvalue()


# -- TFRecords and Examples ------------------------------------------------------------------

def test_tfrecord_round_trip_and_corruption(tmp_path):
    path = tmp_path / "train-00000-of-00001"
    records = [b"", b"first", bytes(range(256)) * 40]
    with TFRecordWriter(path) as w:
        w.write_all(records)
    assert list(read_records(path)) == records
    assert count_records(path) == 3
    raw = bytearray(path.read_bytes())
    second = 12 + len(records[0]) + 4  # header (8 + 4), data, footer (4)
    raw[second + 12 + 2] ^= 0xFF  # a byte of the second record's data
    bad = tmp_path / "bad"
    bad.write_bytes(bytes(raw))
    with pytest.raises(TFRecordError, match=rf"{bad}.*byte offset {second}\b.*data CRC"):
        list(read_records(bad))
    raw = bytearray(path.read_bytes())
    raw[second] ^= 0x01  # the second record's length
    bad.write_bytes(bytes(raw))
    with pytest.raises(TFRecordError, match=rf"offset {second}\b.*length CRC"):
        list(read_records(bad))
    with pytest.raises(TFRecordError, match=rf"offset {second}\b"):
        count_records(bad)
    bad.write_bytes(path.read_bytes()[:-3])  # truncated inside the last record
    with pytest.raises(TFRecordError, match="file ends inside"):
        list(read_records(bad))


def test_example_wire_format_and_parsing():
    # Example{features{feature{key: "a", value{int64_list{value: [1]}}}}}, encoded by hand
    assert make_example({"a": 1}) == bytes.fromhex("0a0c0a0a0a01611205" "1a030a0101")
    data = make_example({"image/encoded": b"\xff\xd8jpeg", "image/class/label": 7,
                         "floats": [0.5, 1.5], "ids": [3, 4, 5], "names": [b"x", b"y"]})
    parsed = parse_example(data)
    assert parsed == {"image/encoded": [b"\xff\xd8jpeg"], "image/class/label": [7],
                      "floats": [0.5, 1.5], "ids": [3, 4, 5], "names": [b"x", b"y"]}
    with pytest.raises(TypeError):
        make_example({"mixed": [1, b"x"]})
    with pytest.raises(KeyError, match="image/encoded"):
        parse_image_record(make_example({"image/class/label": 3}))


_TF_CROSS_CHECK = """
import os, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import tensorflow as tf
from apps.efficientnet.dataloader import TFRecordWriter, make_example, parse_example, read_records
ours, theirs = sys.argv[1], sys.argv[2]
with TFRecordWriter(ours) as w:
    w.write(make_example({"image/encoded": b"jpg", "image/class/label": 7, "f": [0.5]}))
spec = {"image/encoded": tf.io.FixedLenFeature([], tf.string),
        "image/class/label": tf.io.FixedLenFeature([], tf.int64),
        "f": tf.io.FixedLenFeature([1], tf.float32)}
(raw,) = list(tf.data.TFRecordDataset(ours))
ex = tf.io.parse_single_example(raw, spec)
assert ex["image/encoded"].numpy() == b"jpg" and int(ex["image/class/label"]) == 7
with tf.io.TFRecordWriter(theirs) as w:
    w.write(tf.train.Example(features=tf.train.Features(feature={
        "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[3])),
        "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"x"]))})
    ).SerializeToString())
got = [parse_example(r) for r in read_records(theirs)]
assert got == [{"image/class/label": [3], "image/encoded": [b"x"]}], got
"""


def test_tfrecords_agree_with_tensorflow(tmp_path):
    """Our files parse in TensorFlow and TensorFlow's in ours (in a child process: TF's
    threads must not be forked by the multi-rank tests)."""
    import importlib.util
    import os
    import subprocess
    import sys
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root}
    proc = subprocess.run([sys.executable, "-c", _TF_CROSS_CHECK, str(tmp_path / "ours"),
                           str(tmp_path / "theirs")], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_label_offset_and_sharding(tmp_path):
    colors = [(250, 0, 0), (0, 250, 0), (0, 0, 250)]
    # ImageNet stores classes 1-based: 1..3 here, read back as 0..2
    for shard in range(2):
        with TFRecordWriter(tmp_path / f"validation-0000{shard}-of-00002") as w:
            for label, color in enumerate(colors):
                w.write(make_example({"image/encoded": _jpeg(color),
                                      "image/class/label": label + 1}))
    assert parse_image_record(make_example({"image/encoded": b"j",
                                            "image/class/label": 1})) == (b"j", 0)
    pp = Preprocess(8, training=False)
    seen = []
    for rank in range(2):
        ds = build_dataset(str(tmp_path), "eval", pp, rank=rank, size=2, seed=0,
                           num_classes=3)
        assert ds.num_examples() == 6
        items = list(ds)
        assert len(items) == 3  # one file per rank
        for img, label in items:
            assert img.shape == (3, 8, 8) and img.dtype == torch.uint8
            assert int(img[label].float().mean()) > 200  # the channel the label names
        seen += [label for _, label in items]
    assert sorted(seen) == [0, 0, 1, 1, 2, 2]
    # three consumers, two files: records are split by index instead, still once each
    labels = [lbl for r in range(3) for _, lbl in build_dataset(
        str(tmp_path), "eval", pp, rank=r, size=3, seed=0, num_classes=3)]
    assert sorted(labels) == [0, 0, 1, 1, 2, 2]


def test_image_folder_and_augmenters(tmp_path):
    for label, name in enumerate(["cat", "dog"]):
        (tmp_path / "train" / name).mkdir(parents=True)
        for i in range(3):
            (tmp_path / "train" / name / f"{i}.jpg").write_bytes(_jpeg((100 * label, 50, 9)))
    pp = Preprocess(12, training=True, augmenter="randaugment")
    ds = build_dataset(str(tmp_path), "train", pp, rank=0, size=1, seed=1, num_classes=2)
    it = iter(ds)
    got = [next(it) for _ in range(9)]  # repeats past the 6 images
    assert {lbl for _, lbl in got} == {0, 1} and got[0][0].shape == (3, 12, 12)
    from apps.efficientnet.dataloader.augment import decode
    img, rng = decode(_jpeg((10, 120, 240), 20)), random.Random(0)
    for name, op in OPS.items():
        out = op(img, 7.0, rng)
        assert out.size == img.size and out.mode == "RGB", name
    for aug in (AutoAugment(), RandAugment(2, 10)):
        assert aug(img, rng).size == img.size


# -- losses, optimizer, schedule --------------------------------------------------------------

def test_label_smoothing_and_mixup_by_hand():
    t = smooth_targets(torch.tensor([0, 2]), 3, smoothing=0.3)
    torch.testing.assert_close(t, torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.1, 0.8]]))
    x = torch.tensor([[1.0, 2.0], [3.0, 5.0]])
    xm, tm = mixup(x, t, lam=0.75)  # each sample blends with the mirrored one
    torch.testing.assert_close(xm, torch.tensor([[1.5, 2.75], [2.5, 4.25]]))
    torch.testing.assert_close(tm, torch.tensor([[0.625, 0.1, 0.275], [0.275, 0.1, 0.625]]))
    assert mixup(x, t, 1.0)[0] is x
    logits = torch.log(torch.tensor([[1.0, 2.0, 1.0], [1.0, 1.0, 1.0]]))
    want = -(0.625 * math.log(0.25) + 0.1 * math.log(0.5) + 0.275 * math.log(0.25)
             + math.log(1 / 3)) / 2
    assert soft_cross_entropy(logits, tm).item() == pytest.approx(want, rel=1e-6)
    assert topk_correct(torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.3]]),
                        torch.tensor([0, 2]), ks=(1, 2)) == [0, 2]


def test_tf_rmsprop_matches_hand_computation():
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = TFRMSprop([p], lr=0.1, rho=0.9, momentum=0.9, eps=1e-3, weight_decay=0.01)
    w, ms, mom = [1.0, -2.0], [1.0, 1.0], [0.0, 0.0]  # TF starts the mean square at one
    for g in ([0.5, 0.25], [-0.3, 1.0]):
        p.grad = torch.tensor(g)
        opt.step()
        for i in range(2):
            gi = g[i] + 0.01 * w[i]  # L2 weight decay enters the gradient
            ms[i] = 0.9 * ms[i] + 0.1 * gi * gi
            mom[i] = 0.9 * mom[i] + 0.1 * gi / math.sqrt(ms[i] + 1e-3)  # eps inside the root
            w[i] -= mom[i]
        assert p.tolist() == pytest.approx(w, rel=1e-6)


def test_weight_decay_groups_and_schedule():
    from apps.efficientnet.model import efficientnet
    model = efficientnet("b0", num_classes=10)
    decay, no_decay = param_groups(model, 1e-5)
    assert decay["weight_decay"] == 1e-5 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim > 1 for p in decay["params"])
    bn_layers = sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    biases = sum(name.endswith("bias") for name, _ in model.named_parameters())  # BN's too
    assert len(no_decay["params"]) == biases + bn_layers
    s = LRSchedule(0.1, steps_per_epoch=10, total_steps=100, warmup_epochs=1,
                   decay="exponential", decay_rate=0.5, decay_epochs=2)
    assert [s(0), s(9), s(10), s(29), s(30)] == pytest.approx([0.01, 0.1, 0.1, 0.1, 0.05])
    c = LRSchedule(0.1, 10, 100, warmup_epochs=0, decay="cosine")
    assert [c(0), c(50), c(100)] == pytest.approx([0.1, 0.05, 0.0])


# -- flags -----------------------------------------------------------------------------------

def test_flags_parse_and_sagemaker():
    a = parse_args([], environ={})
    assert (a.mode, a.arch, a.optimizer, a.batch_norm, a.use_amp) == \
        ("train_and_eval", "efficientnet-b0", "rmsprop", "default", False)
    a = parse_args(["--arch", "b3", "--use_amp", "--use_xla", "false", "--batch_norm", "syncbn",
                    "--data_dir", "/d", "--lr_decay", "cosine"], environ={})
    assert (a.arch, a.use_amp, a.use_xla, a.train_data_dir, a.eval_data_dir) == \
        ("efficientnet-b3", True, False, "/d", "/d")
    env = {"SM_HPS": json.dumps({"max_epochs": 7, "use_amp": True, "mixup_alpha": 0.2}),
           "SM_CHANNEL_TRAIN": "/ch/train", "SM_CHANNEL_EVAL": "/ch/eval",
           "SM_MODEL_DIR": "/opt/ml/model"}
    a = parse_args(["--max_epochs", "9"], environ=env)  # argv beats SM_HPS
    assert (a.max_epochs, a.use_amp, a.mixup_alpha) == (9, True, 0.2)
    assert (a.train_data_dir, a.eval_data_dir, a.model_dir) == \
        ("/ch/train", "/ch/eval", "/opt/ml/model")
    for bad in (["--mode", "fly"], ["--arch", "b9"], ["--use_amp", "maybe"],
                ["--train_batch_size", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad, environ={})


# -- training on ranks -----------------------------------------------------------------------

def _digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _state_digest(tr) -> str:
    from apps.efficientnet.runtime.distributed import unwrap
    opt = [v for s in tr.optimizer.state_dict()["state"].values() for v in s.values()
           if isinstance(v, torch.Tensor)]
    return _digest([*unwrap(tr.model).state_dict().values(), *opt])


def _batch(seed: int, n: int = 2):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (n, 3, 32, 32), generator=g, dtype=torch.uint8),
            torch.randint(0, 10, (n,), generator=g))


def _one_step(rank: int, backend: str, extra: list[str]) -> tuple[str, str, float]:
    from apps.efficientnet.runtime import build_trainer, init_distributed, train_step
    torch.set_num_threads(1)
    args = parse_args([*TINY, "--synthetic", "--backend", backend, *extra], environ={})
    dist = init_distributed(backend)
    tr = build_trainer(args, dist, steps_per_epoch=4)
    before = _state_digest(tr)
    stats = train_step(tr, [_batch(rank)])  # every rank has its own batch
    return before, _state_digest(tr), stats.loss


def _syncbn_then_gloo(rank: int) -> list[tuple[str, str, float]]:
    return [_one_step(rank, "shoal", ["--batch_norm", "syncbn", "--mixup_alpha", "0.2"]),
            _one_step(rank, "ddp-gloo", ["--batch_norm", "syncbn", "--optimizer", "sgd",
                                         "--compression", "fp16"])]


def test_step_on_two_ranks_leaves_identical_weights():
    results = run_ranks(_syncbn_then_gloo, 2, timeout=80)
    for (b0, a0, l0), (b1, a1, l1) in zip(*results, strict=True):
        assert b0 == b1, "ranks started from different weights"
        assert a0 == a1, "ranks differ after one step"
        assert a0 != b0 and l0 != l1  # it did train, on different batches


def _sharded_against_unsharded(rank: int, clip: str) -> list[list[np.ndarray]]:
    from apps.efficientnet.runtime import build_trainer, init_distributed, train_step
    torch.set_num_threads(1)
    out = []
    for sharding in ([], ["--optimizer_sharding"]):
        args = parse_args([*TINY, "--synthetic", "--grad_clip_norm", clip,
                           "--moving_average_decay", "0.5", "--drop_connect_rate", "0",
                           *sharding], environ={})
        tr = build_trainer(args, init_distributed("shoal"), steps_per_epoch=4)
        for step in range(3):
            train_step(tr, [_batch(10 * step + rank)])
        model = tr.model.state_dict()  # waits for the weights still being gathered
        out.append([t.numpy().copy() for t in
                    [*model.values(), *tr.ema.module.state_dict().values()]])
    return out


@pytest.mark.parametrize("clip", ["0", "0.05"])
def test_sharded_optimizer_with_clipping_and_weight_averaging_trains_as_unsharded(clip):
    """The same bits as the unsharded optimizer: the application's sharded optimizer leaves
    the weights' gather in flight after step() (the weight average and state_dict() wait for
    it, from the first step on), and the parameters' aligned places in the buckets keep the
    convolutions on the unsharded model's code paths. Clipping sees every rank's shard: its
    norm is summed in float64 over the shards where torch's sums float32 norms of tensors at
    other alignments, so a clipped run agrees to float32 rounding (README: "Sharded
    optimizer"); one of 864 values differed by 2.9e-11 in a run)."""
    for plain, sharded in run_ranks(_sharded_against_unsharded, 2, clip, timeout=80):
        for a, b in zip(plain, sharded, strict=True):
            if clip == "0":
                np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _ddp_shoal(rank: int) -> tuple[str, str, float] | str:
    import torch.distributed as tdist

    from apps.efficientnet.runtime import init_distributed  # imports shoal.torch
    if not tdist.is_backend_available("shoal"):
        with pytest.raises(RuntimeError, match="ddp-shoal needs"):
            init_distributed("ddp-shoal")
        return "unavailable"
    return _one_step(rank, "ddp-shoal", ["--optimizer", "sgd", "--batch_norm", "syncbn"])


def test_ddp_shoal_backend():
    r0, r1 = run_ranks(_ddp_shoal, 2, timeout=60)
    if r0 == "unavailable":
        pytest.skip("the 'shoal' torch.distributed backend is not in this build")
    assert r0[1] == r1[1] and r0[1] != r0[0]


def _loss_falls(rank: int, data_dir: str) -> list[float]:
    from apps.efficientnet.dataloader import make_loader
    from apps.efficientnet.runtime import build_trainer, init_distributed, train_step
    torch.set_num_threads(1)  # a forked child must not reuse the parent's OpenMP pool
    args = parse_args([*TINY, "--data_dir", data_dir, "--train_batch_size", "32",
                       "--optimizer", "adamw", "--lr_init", "0.004", "--lr_warmup_epochs", "0",
                       "--augmenter_name", "none", "--label_smoothing", "0",
                       "--drop_connect_rate", "0"], environ={})
    tr = build_trainer(args, init_distributed("shoal"), steps_per_epoch=10)
    pp = Preprocess(32, training=True, min_scale=0.6, flip=False)
    ds = build_dataset(data_dir, "train", pp, rank=0, size=1, seed=0, num_classes=10)
    batches = iter(make_loader(ds, 32, 0, drop_last=True))
    fixed = [next(batches) for _ in range(2)]  # a few steps: two batches, seen in turn
    return [train_step(tr, [fixed[i % 2]]).loss for i in range(10)]


def test_loss_falls_on_digits(tmp_path):
    jpegs, labels = digits_jpegs(32)
    write_imagenet_layout(tmp_path, jpegs[:400], labels[:400], "train", 2)
    losses = run_ranks(_loss_falls, 1, str(tmp_path), timeout=80)[0]
    first, last = sum(losses[:2]) / 2, sum(losses[-2:]) / 2
    assert last < 0.4 * first, losses


def _resume(rank: int, model_dir: str) -> tuple[str, str, str, str]:
    from apps.efficientnet.runtime import (
        build_trainer,
        init_distributed,
        load_checkpoint,
        restore_trainer,
        save,
        train_step,
    )
    torch.set_num_threads(1)
    # syncbn: BatchNorm statistics agree across ranks too, so rank 0's checkpoint is every
    # rank's state (with per-rank statistics, only rank 0's are saved, as in Horovod)
    args = parse_args([*TINY, "--synthetic", "--moving_average_decay", "0.9", "--batch_norm",
                       "syncbn", "--mixup_alpha", "0.4", "--model_dir", model_dir], environ={})
    dist = init_distributed("shoal")
    tr = build_trainer(args, dist, steps_per_epoch=4)
    for step in range(2):
        train_step(tr, [_batch(10 * step + rank)])
    tr.epoch = 1
    save(tr)
    saved = _state_digest(tr)
    train_step(tr, [_batch(99 + rank)])
    straight = _state_digest(tr), _digest(tr.ema.module.state_dict().values())
    args.seed = 5  # a fresh trainer that starts elsewhere
    again = build_trainer(args, dist, steps_per_epoch=4)
    restore_trainer(again, load_checkpoint(model_dir) if rank == 0 else None)
    assert (again.step, again.epoch) == (2, 1)
    restored = _state_digest(again)
    train_step(again, [_batch(99 + rank)])
    resumed = _state_digest(again), _digest(again.ema.module.state_dict().values())
    assert resumed == straight, "the resumed step differs from the uninterrupted one"
    return saved, restored, straight[0], resumed[0]


def test_resume_continues_identically(tmp_path):
    results = run_ranks(_resume, 2, str(tmp_path), timeout=80)
    for saved, restored, straight, resumed in results:
        assert saved == restored and straight == resumed
    assert results[0] == results[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000002.pt"]  # no temps


def _whole_run(rank: int, model_dir: str) -> dict:
    from apps.efficientnet.runtime import run
    torch.set_num_threads(1)
    return run(parse_args([*TINY, "--synthetic", "--max_epochs", "1", "--steps_per_epoch", "2",
                           "--log_steps", "1", "--model_dir", model_dir], environ={}))


def test_whole_run_logs_and_checkpoints(tmp_path):
    s0, s1 = run_ranks(_whole_run, 2, str(tmp_path), timeout=80)
    assert s0.pop("training_time") > 0 and s1.pop("training_time") > 0  # per rank
    assert s0 == s1  # statistics are averaged over the ranks
    assert 0 <= s0["eval_accuracy_top_1"] <= 100 and s0["avg_exp_per_second_training"] > 0
    lines = [json.loads(x) for x in (tmp_path / "log.json").read_text().splitlines()]
    units = {x["metric"]: x["metadata"]["unit"] for x in lines if x["type"] == "METADATA"}
    assert units["avg_exp_per_second_training"] == "samples/s"
    assert units["peak_rss_per_worker"] == "MiB" and s0["peak_rss_per_worker"] > 100
    steps = [x["step"] for x in lines if x["type"] == "LOG"]
    assert steps[0] == "PARAMETER" and [1, 1] in steps and steps[-1] == "SUMMARY"
    assert (tmp_path / "ckpt-000000002.pt").is_file()
