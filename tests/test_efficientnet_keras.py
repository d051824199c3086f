"""The Keras application (``--framework tensorflow``): TFRecords read the same by the
application's own reader and by ``tf.data``; a 2-rank run with syncbn, mixup, weight decay
and an EMA that trains and checkpoints on rank 0; a resumed run that ends bitwise where the
uninterrupted one does.

TensorFlow is imported in the ranks only; the model is ``small-cnn`` (Keras's EfficientNet
costs most of a minute to trace on 2 cores; ``scripts/main.sh --framework tensorflow`` runs it).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from harness import run_ranks, single_threaded_tf

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                                reason="tensorflow is not installed")


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from apps.efficientnet.dataloader.digits import digits_jpegs, write_imagenet_layout
    out = tmp_path_factory.mktemp("digits")
    jpegs, labels = digits_jpegs(32)
    order = np.random.default_rng(0).permutation(len(jpegs))
    for split, idx, shards in (("validation", order[:200], 3), ("train", order[200:], 4)):
        write_imagenet_layout(out, [jpegs[i] for i in idx], [labels[i] for i in idx], split,
                              shards)
    return out


def _both_readers(rank: int, data_dir: str) -> dict:
    import tensorflow as tf

    from apps.efficientnet.config import parse_args
    from apps.efficientnet.dataloader import parse_image_record, read_records
    from apps.efficientnet.dataloader.augment import decode as pil_decode
    from apps.efficientnet.keras import data as kdata
    args = parse_args(["--framework", "tensorflow", "--data_dir", data_dir])
    files = kdata.read_split(args, "eval")
    ours = []
    for f in files:
        for record in read_records(f):
            jpeg, label = parse_image_record(record)
            ours.append((label, np.asarray(pil_decode(jpeg))))
    theirs = [(int(label), image.numpy()) for image, label in
              tf.data.TFRecordDataset(files).map(lambda r: kdata.decode(r, 1))]
    shards = [sum(1 for _ in kdata._records(files, r, 3, by_file=False)) for r in range(3)]
    return {"ours": ours, "theirs": theirs, "shards": shards}


def test_tfrecords_read_the_same_both_ways(digits: Path) -> None:
    (result,) = run_ranks(_both_readers, 1, str(digits), timeout=120)
    ours, theirs = result["ours"], result["theirs"]
    assert len(ours) == len(theirs) == 200
    for (la, a), (lb, b) in zip(ours, theirs, strict=True):  # same order, labels, pixels
        assert la == lb
        np.testing.assert_array_equal(a, b)
    assert sum(result["shards"]) == 200 and max(result["shards"]) - min(result["shards"]) <= 1


def _flags(data_dir: str, model_dir: str, epochs: int, *extra: str) -> list[str]:
    return ["--framework", "tensorflow", "--mode", "train_and_eval", "--arch", "small-cnn",
            "--data_dir", data_dir, "--num_classes", "10", "--image_size", "32",
            "--max_epochs", str(epochs), "--steps_per_epoch", "8", "--train_batch_size", "16",
            "--eval_batch_size", "50", "--optimizer", "sgd", "--lr_init", "0.25",
            "--lr_warmup_epochs", "1", "--weight_decay", "1e-4", "--mixup_alpha", "0.2",
            "--moving_average_decay", "0.5", "--batch_norm", "syncbn", "--bn_momentum", "0.6",
            "--save_checkpoint_freq", "1", "--log_steps", "0", "--model_dir", model_dir,
            "--augmenter_name", "none", *extra]  # (AutoAugment by default: too strong here)


def _train_and_resume(rank: int, data_dir: str, root: str) -> dict:
    single_threaded_tf()
    from apps.efficientnet.config import parse_args
    from apps.efficientnet.keras.train import run
    straight = run(parse_args(_flags(data_dir, f"{root}/straight", 3)))
    run(parse_args(_flags(data_dir, f"{root}/first", 2)))
    resumed = run(parse_args(_flags(data_dir, f"{root}/resumed", 3, "--resume_checkpoint",
                                    f"{root}/first")))
    # --mode eval scores the newest checkpoint of the straight run (no EMA swap: the weights)
    evaluation = run(parse_args([*_flags(data_dir, f"{root}/straight", 3), "--mode", "eval"]))
    return {"straight": straight, "resumed": resumed, "eval": evaluation}


def test_keras_app_trains_and_resumes_identically(digits: Path, tmp_path: Path) -> None:
    results = run_ranks(_train_and_resume, 2, str(digits), str(tmp_path), timeout=400)
    straight = results[0]["straight"]
    assert straight["eval_accuracy_top_1"] > 30.0  # 10 classes: chance is 10%
    assert straight["avg_exp_per_second_training"] > 0
    assert all(r["straight"]["eval_accuracy_top_1"] == straight["eval_accuracy_top_1"]
               for r in results)  # the global evaluation, the same on every rank
    from apps.efficientnet.keras.checkpoint import keras_checkpoints
    (_, a), (_, b) = (keras_checkpoints(tmp_path / run).newest()  # type: ignore[misc]
                      for run in ("straight", "resumed"))
    assert int(a["epoch"]) == int(b["epoch"]) == 3 and int(a["step"]) == 24
    assert a.keys() == b.keys()
    for key in a:  # model, BatchNorm statistics, EMA, optimizer state, seeds
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert results[0]["resumed"]["training_loss"] == straight["training_loss"]
    assert sorted(p.name for p in (tmp_path / "straight").iterdir()) == [
        "ckpt-000000008.npz", "ckpt-000000016.npz", "ckpt-000000024.npz", "log.json"]
    assert results[0]["eval"]["checkpoint"] == str(tmp_path / "straight" / "ckpt-000000024.npz")
    assert results[0]["eval"]["eval_accuracy_top_1"] == straight["eval_accuracy_top_1"]


def _augmenters(rank: int, data_dir: str) -> dict:
    import random

    import tensorflow as tf
    from PIL import Image

    from apps.efficientnet.config import parse_args
    from apps.efficientnet.dataloader.augment import make_augmenter
    from apps.efficientnet.keras import data as kdata
    out = {}
    for name in ("none", "autoaugment", "randaugment"):
        args = parse_args(["--framework", "tensorflow", "--data_dir", data_dir,
                           "--augmenter_name", name, "--train_batch_size", "8",
                           "--max_epochs", "1"])
        images, _ = next(iter(kdata.train_dataset(args, 0, 1, 32, 1, 0)))
        out[name] = images.numpy()
    # the op is the application's Pillow augmenter, seeded by the pipeline's seed
    image = np.asarray(out["none"][0]).round().astype(np.uint8)
    seed = np.array([5, 9], np.int64)
    got = kdata.augmented(tf.constant(image, tf.float32), tf.constant(seed), "autoaugment",
                          2, 10.0).numpy()
    want = make_augmenter("autoaugment")(Image.fromarray(image),
                                         random.Random(5 * 1_000_003 + 9))
    out["op"] = (got, np.asarray(want, np.float32))
    return out


def test_keras_path_applies_the_named_augmenter(digits: Path) -> None:
    (out,) = run_ranks(_augmenters, 1, str(digits), timeout=120)
    none, auto, rand = out["none"], out["autoaugment"], out["randaugment"]
    assert none.shape == auto.shape == rand.shape == (8, 32, 32, 3)
    # the same crops and flips, then the augmenter: some images changed, differently
    assert not np.array_equal(none, auto) and not np.array_equal(auto, rand)
    got, want = out["op"]
    np.testing.assert_array_equal(got, want)
