"""The recipe's command line on the EfficientNet application: every flag of the SMDDP fork of
NVIDIA's TensorFlow 2 EfficientNet (and the v2 recipe's names for the same things) is taken,
SageMaker's empty hyperparameter means "set", and each flag does what the README's table says.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from apps.efficientnet.config import flags as flags_mod  # noqa: E402
from apps.efficientnet.config import parse_args, recipe  # noqa: E402
from shoal.runner.sagemaker import hyperparameter_args  # noqa: E402

#: Each flag of the fork's command line with its default there (None: a bare switch), or a
#: plausible value where the fork's default is "unset".
FORK = {
    "model_dir": "/tmp/shoal-flags", "config_file": "config.yaml",
    "params_override": "{'train_batch_size': 64}", "save_checkpoint_freq": "1",
    "data_dir": "/data", "mode": "train_and_eval", "arch": "efficientnet-b0",
    "dataset": "ImageNet", "log_steps": "100", "time_history": None, "use_xla": None,
    "use_amp": None, "intraop_threads": "", "interop_threads": "", "export_dir": "/export",
    "results_dir": ".", "inference_checkpoint": "ckpt", "to_predict": "/images",
    "log_filename": "log.json", "display_every": "10", "num_classes": "1000",
    "batch_norm": "default", "activation": "swish", "optimizer": "rmsprop", "momentum": "0.9",
    "epsilon": "0.001", "decay": "0.9", "moving_average_decay": "0.0", "lookahead": None,
    "nesterov": None, "beta_1": "0.0", "beta_2": "0.0", "label_smoothing": "0.1",
    "mixup_alpha": "0.0", "max_epochs": "300", "num_epochs_between_eval": "1",
    "steps_per_epoch": "100", "warmup_epochs": "5", "lr_init": "0.008",
    "lr_decay": "exponential", "lr_decay_rate": "0.97", "lr_decay_epochs": "2.4",
    "lr_warmup_epochs": "5", "weight_decay": "5e-6", "weight_init": "fan_out",
    "train_num_examples": "1281167", "train_batch_size": "32", "augmenter_name": "autoaugment",
    "num_layers": "2", "magnitude": "10", "cutout_const": "40", "translate_const": "100",
    "autoaugmentation_name": "v0", "data_format": "NCHW", "eval_num_examples": "50000",
    "eval_batch_size": "32", "predict_batch_size": "32", "skip_eval": None,
    "resume_checkpoint": None, "use_dali": None, "use_dali_eval": None, "index_file": "",
    "benchmark": None, "enable_checkpoint_and_export": None, "enable_tensorboard": None,
    "write_model_weights": None, "seed": "1", "dtype": "float32", "run_eagerly": None,
}
V2 = {
    "train_img_size": "224", "eval_img_size": "224", "grad_accum_steps": "2",
    "grad_clip_norm": "1.0", "hvd_fp16_compression": None, "opt_epsilon": "0.001",
    "train_use_dali": None, "eval_use_dali": None, "cutmix_alpha": "1.0",
    "memory_limit": "16000", "raug_num_layers": "2", "raug_magnitude": "10",
}
#: The walkthrough's SageMaker hyperparameters, verbatim.
WALKTHROUGH = {"mode": "train", "arch": "efficientnet-b4", "use_amp": "", "use_xla": "",
               "max_epochs": 5, "train_batch_size": 64, "lr_init": 0.005,
               "batch_norm": "syncbn", "mixup_alpha": 0.2, "weight_decay": 5e-6}


def _argv(name: str, value: str | None) -> list[str]:
    return [f"--{name}"] if value is None else [f"--{name}", value]


def test_the_flag_lists_are_the_recipes() -> None:
    assert tuple(FORK) == recipe.RECIPE_FLAGS and len(FORK) == 69
    assert tuple(V2) == recipe.V2_FLAGS


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_every_recipe_flag_is_taken(framework: str) -> None:
    refused = {}
    for name, value in {**FORK, **V2}.items():
        try:
            args = parse_args(["--framework", framework, *_argv(name, value)], environ={})
        except recipe.UnsupportedFlagError as e:
            assert e.flag == name and f"--{name}" in str(e)
            refused[name] = str(e)
            continue
        assert isinstance(args, object)
    # only what a framework cannot do is refused, and only there
    expected = {"tensorflow": {"lookahead", "grad_accum_steps"},
                "torch": set()}[framework]
    assert set(refused) == expected, refused


def test_refused_values_name_the_flag() -> None:
    for argv, flag in ((["--cutout_const", "20"], "cutout_const"),
                       (["--translate_const", "50"], "translate_const"),
                       (["--autoaugmentation_name", "svhn"], "autoaugmentation_name"),
                       (["--activation", "mish"], "activation"),
                       (["--framework", "tensorflow", "--eval_img_size", "64"],
                        "eval_img_size")):
        with pytest.raises(recipe.UnsupportedFlagError, match=f"^--{flag}: "):
            parse_args(argv, environ={})


def test_main_reports_a_refusal_without_a_traceback(capsys: pytest.CaptureFixture) -> None:
    from apps.efficientnet.main import main
    with pytest.raises(SystemExit) as exc:
        main(["--framework", "tensorflow", "--lookahead"])
    assert exc.value.code != 2 and "--lookahead" in str(exc.value.code)


@pytest.mark.parametrize("given", [[""], [], ["True"], ["true"], ["1"]])
def test_empty_bare_and_true_set_a_flag(given: list[str]) -> None:
    args = parse_args(["--use_amp", *given, "--use_xla", *given], environ={})
    assert args.use_amp is True and args.use_xla is True


@pytest.mark.parametrize("off", [["--use_amp", "False"], ["--use_amp", "false"],
                                 ["--use_amp", "0"], ["--use_amp", "--nouse_amp"],
                                 ["--nouse_amp"]])
def test_false_zero_and_no_turn_a_flag_off(off: list[str]) -> None:
    assert parse_args(off, environ={}).use_amp is False
    assert parse_args(["--notime_history"], environ={}).time_history is False


def test_benchmark_is_not_a_prefix_of_another_flag() -> None:
    args = parse_args(["--benchmark"], environ={})
    assert args.benchmark is True and args.benchmark_warmup_steps == 10
    assert any(line.startswith("--benchmark ") for line in args.ignored)


def test_ignored_flags_warn_once_each() -> None:
    args = parse_args(["--use_dali", "--data_format", "NHWC", "--display_every", "10",
                       "--dataset", "ImageNet", "--use_dali_eval", "false"], environ={})
    assert [line.split()[0] for line in args.ignored] == ["--display_every", "--data_format",
                                                          "--use_dali"]
    assert "shoal's own loader" in args.ignored[-1]


def test_aliases_reach_shoals_flags() -> None:
    a = parse_args(["--epsilon", "0.01", "--decay", "0.8", "--num_layers", "3", "--magnitude",
                    "7", "--train_img_size", "64", "--hvd_fp16_compression"], environ={})
    assert (a.epsilon, a.rmsprop_decay, a.raug_num_layers, a.raug_magnitude, a.image_size,
            a.compression) == (0.01, 0.8, 3, 7.0, 64, "fp16")
    assert parse_args(["--opt_epsilon", "0.5"], environ={}).epsilon == 0.5
    assert parse_args(["--rmsprop_epsilon", "0.25"], environ={}).epsilon == 0.25
    assert parse_args(["--mode", "evaluate"], environ={}).mode == "eval"
    threads = parse_args(["--intraop_threads", "", "--interop_threads", "3"], environ={})
    assert (threads.intraop_threads, threads.interop_threads) == (None, 3)


def test_resume_checkpoint_bare_means_the_model_dir(tmp_path: Path) -> None:
    for given in ([], [""], ["True"]):
        a = parse_args(["--model_dir", str(tmp_path), "--resume_checkpoint", *given],
                       environ={})
        assert a.resume_checkpoint == str(tmp_path) and a.resume_optional
    a = parse_args(["--resume_checkpoint", str(tmp_path / "ckpt.pt")], environ={})
    assert a.resume_checkpoint == str(tmp_path / "ckpt.pt") and not a.resume_optional
    a = parse_args(["--resume_checkpoint", "false"], environ={})
    assert a.resume_checkpoint is None and not a.resume_optional


@pytest.mark.parametrize("path", ["SM_HPS", "shoalrun --sagemaker"])
def test_walkthrough_dictionary_is_the_walkthroughs_run(path: str) -> None:
    if path == "SM_HPS":
        args = parse_args([], environ={"SM_HPS": json.dumps(WALKTHROUGH)})
    else:  # what shoalrun --sagemaker puts on the worker's command line
        args = parse_args(hyperparameter_args(WALKTHROUGH), environ={})
    assert (args.mode, args.arch, args.use_amp, args.use_xla, args.max_epochs,
            args.train_batch_size, args.lr_init, args.batch_norm, args.mixup_alpha,
            args.weight_decay) == ("train", "efficientnet-b4", True, True, 5, 64, 0.005,
                                   "syncbn", 0.2, 5e-6)
    assert args.ignored == []


@pytest.mark.serial  # TensorFlow traces B4: the whole machine
@pytest.mark.timeout(900)
@pytest.mark.xdist_group("sagemaker-port")  # SageMaker's rendezvous is on a fixed port
@pytest.mark.slow
def test_walkthrough_job_under_shoalrun_sagemaker(tmp_path: Path) -> None:
    """The walkthrough's dictionary verbatim as a SageMaker job: shoalrun --sagemaker starts
    the worker with them as flags (and SM_HPS in its environment), main.py run as a file, as
    SageMaker's entry_point. Overridden so that a CPU runs it in a minute or two: the image size
    and the steps, and the framework (the walkthrough's container has only TensorFlow)."""
    import os
    import subprocess
    pytest.importorskip("tensorflow")
    from apps.efficientnet.dataloader.digits import digits_jpegs, write_imagenet_layout
    data, model_dir = tmp_path / "data", tmp_path / "model"
    jpegs, labels = digits_jpegs(32)
    write_imagenet_layout(data, jpegs[:256], labels[:256], "train", 2)
    conf = tmp_path / "input" / "config"
    conf.mkdir(parents=True)
    conf.joinpath("resourceconfig.json").write_text(json.dumps(
        {"current_host": "algo-1", "hosts": ["algo-1"], "network_interface_name": "lo"}))
    hps = {**WALKTHROUGH, "image_size": 32, "steps_per_epoch": 1, "framework": "tensorflow"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "SM_"))}
    env.update(SAGEMAKER_BASE_DIR=str(tmp_path), SM_NUM_GPUS="1", SM_HPS=json.dumps(hps),
               SM_CHANNEL_TRAIN=str(data), SM_MODEL_DIR=str(model_dir),
               PYTHONPATH=str(ROOT / "src"), TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-m", "shoal.runner", "--sagemaker", sys.executable,
                           str(ROOT / "apps" / "efficientnet" / "main.py")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "amp mixed_float16, xla auto-clustering" in proc.stdout, proc.stdout[-2000:]
    lines = _log(model_dir)
    params = next(x["data"] for x in lines if x.get("step") == "PARAMETER")
    assert {k: params[k] for k in WALKTHROUGH} == {
        "mode": "train", "arch": "efficientnet-b4", "use_amp": True, "use_xla": True,
        "max_epochs": 5, "train_batch_size": 64, "lr_init": 0.005, "batch_norm": "syncbn",
        "mixup_alpha": 0.2, "weight_decay": 5e-6}
    assert params["framework"] == "tensorflow" and params["ignored"] == []
    epochs = [x["step"][0] for x in lines if isinstance(x.get("step"), list)
              and "training_loss" in x["data"]]
    assert epochs == [1, 2, 3, 4, 5] and lines[-1]["step"] == "SUMMARY"


def test_framework_defaults_to_the_only_one_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = flags_mod.importlib.util.find_spec

    def only_tensorflow(name: str, *a: object) -> object:
        return None if name == "torch" else real(name, *a)

    monkeypatch.setattr(flags_mod.importlib.util, "find_spec", only_tensorflow)
    assert parse_args([], environ={}).framework == "tensorflow"
    assert parse_args(["--framework", "torch"], environ={}).framework == "torch"
    monkeypatch.setattr(flags_mod.importlib.util, "find_spec", real)
    assert parse_args([], environ={}).framework == "torch"  # both: the PyTorch application


def test_readme_table_lists_every_flag() -> None:
    text = (ROOT / "apps" / "efficientnet" / "README.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines()
            if line.startswith("| `--")}
    assert {f"--{n}" for n in (*FORK, *V2)} <= rows


def test_activations_match_both_applications() -> None:
    from apps.efficientnet.model.efficientnet import ACTIVATIONS
    assert tuple(ACTIVATIONS) == recipe.ACTIVATION_NAMES
    pytest.importorskip("keras")
    from apps.efficientnet.keras.model import KERAS_ACTIVATIONS
    assert tuple(KERAS_ACTIVATIONS) == recipe.ACTIVATION_NAMES


# -- what the implemented flags do (PyTorch application) -------------------------------------

TINY = ["--arch", "small-cnn", "--image_size", "32", "--num_classes", "10",
        "--train_batch_size", "4", "--eval_batch_size", "4", "--num_workers", "0",
        "--log_steps", "0", "--synthetic"]


def _log(model_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (model_dir / "log.json").read_text().splitlines()]


def _recipe_run(rank: int, model_dir: str) -> dict:
    import torch

    from apps.efficientnet.runtime import run
    torch.set_num_threads(1)
    return run(parse_args([
        *TINY, "--max_epochs", "3", "--steps_per_epoch", "2", "--log_steps", "1",
        "--num_epochs_between_eval", "2", "--noenable_checkpoint_and_export",
        "--grad_accum_steps", "2", "--cutmix_alpha", "1.0", "--mixup_alpha", "0.2",
        "--lookahead", "--dtype", "bf16", "--optimizer", "momentum", "--nesterov",
        "--grad_clip_norm", "1.0", "--intraop_threads", "1", "--eval_num_examples", "6",
        "--model_dir", model_dir], environ={}))


def test_recipe_flags_shape_the_run(tmp_path: Path) -> None:
    from harness import run_ranks
    s0, s1 = run_ranks(_recipe_run, 2, str(tmp_path), timeout=120)
    lines = _log(tmp_path)
    evaluated = [x["step"][0] for x in lines if x["type"] == "LOG"
                 and isinstance(x["step"], list) and "eval_accuracy_top_1" in x["data"]]
    assert evaluated == [2, 3]  # every 2nd epoch, and the last
    windows = [x["data"] for x in lines if isinstance(x.get("step"), list)
               and "examples_per_second" in x["data"]]
    assert len(windows) == 6 and all(w["examples_per_second"] > 0 for w in windows)
    params = next(x["data"] for x in lines if x.get("step") == "PARAMETER")
    assert params["grad_accum_steps"] == 2 and params["dtype"] == "bf16"
    assert not list(tmp_path.glob("ckpt-*.pt"))  # --noenable_checkpoint_and_export
    assert s0["eval_accuracy_top_1"] == s1["eval_accuracy_top_1"]


def _resume_run(rank: int, model_dir: str, epochs: int) -> tuple[int, int]:
    import torch

    from apps.efficientnet.runtime import run
    torch.set_num_threads(1)
    run(parse_args([*TINY, "--max_epochs", str(epochs), "--steps_per_epoch", "2",
                    "--save_checkpoint_freq", "1", "--model_dir", model_dir,
                    "--resume_checkpoint"], environ={}))
    from apps.efficientnet.runtime.checkpoint import load_checkpoint
    ckpt = load_checkpoint(model_dir)
    return ckpt["epoch"], ckpt["step"]


def test_bare_resume_starts_fresh_then_resumes(tmp_path: Path) -> None:
    from harness import run_ranks
    # no checkpoint yet: a fresh start, not an error; then the same command continues it
    assert run_ranks(_resume_run, 1, str(tmp_path), 1, timeout=60) == [(1, 2)]
    assert run_ranks(_resume_run, 1, str(tmp_path), 2, timeout=60) == [(2, 4)]


def _accumulate(rank: int) -> list[float]:
    import torch

    from apps.efficientnet.runtime import build_trainer, init_distributed, train_step
    from apps.efficientnet.runtime.losses import smooth_targets, soft_cross_entropy
    from apps.efficientnet.runtime.trainer import _normalize
    torch.set_num_threads(1)
    args = parse_args([*TINY, "--optimizer", "sgd", "--momentum", "0", "--weight_decay", "0",
                       "--label_smoothing", "0", "--lr_warmup_epochs", "0", "--lr_init", "0.4",
                       "--grad_accum_steps", "2"], environ={})
    tr = build_trainer(args, init_distributed("shoal"), steps_per_epoch=1)
    before = [p.detach().clone() for p in tr.model.parameters()]
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 255, (4, 3, 32, 32), dtype=torch.uint8, generator=g),
                torch.randint(0, 10, (4,), generator=g)) for _ in range(2)]
    reference = []
    for images, labels in batches:  # the same model, one batch at a time
        tr.model.zero_grad()
        logits = tr.model(_normalize(images, torch.device("cpu")))
        soft_cross_entropy(logits, smooth_targets(labels, 10)).backward()
        reference.append([p.grad.clone() for p in tr.model.parameters()])
    lr = 0.4 * 4 * 2 / 128  # the global batch of the rule counts the accumulated batches
    stats = train_step(tr, batches)
    assert stats.count == 8 and stats.lr == pytest.approx(lr)
    worst = 0.0
    for p, p0, g1, g2 in zip(tr.model.parameters(), before, *reference, strict=True):
        worst = max(worst, float((p.detach() - (p0 - lr * (g1 + g2) / 2)).abs().max()))
    return [worst, lr]


def test_gradient_accumulation_averages_the_batches() -> None:
    from harness import run_ranks
    ((worst, _),) = run_ranks(_accumulate, 1, timeout=60)
    assert worst < 1e-6


def test_cutmix_lookahead_activation_and_fan() -> None:
    import numpy as np
    import torch
    from torch import nn

    from apps.efficientnet.model.efficientnet import efficientnet
    from apps.efficientnet.runtime.losses import cutmix
    from apps.efficientnet.runtime.optim import Lookahead
    images = torch.stack([torch.zeros(3, 8, 8), torch.ones(3, 8, 8)])
    targets = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    mixed, mixed_t = cutmix(images, targets, 0.75, np.random.default_rng(3))
    pasted = float(mixed[0].mean())  # image 0 is zeros: the pasted box is ones
    assert 0 < pasted < 1 and mixed_t[0, 1] == pytest.approx(pasted)
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    la = Lookahead(model, sync_period=2, slow_step_size=0.5)
    with torch.no_grad():
        model.weight.fill_(4.0)
    la.update(model)
    assert float(model.weight[0, 0]) == 4.0  # between synchronisations: the fast weights
    la.update(model)
    assert float(model.weight[0, 0]) == 2.0  # halfway from the slow weights (0) to 4
    relu = efficientnet("b0", num_classes=10, activation="relu")
    assert not any(isinstance(m, nn.SiLU) for m in relu.modules())
    assert any(isinstance(m, nn.ReLU) for m in relu.modules())
    torch.manual_seed(0)
    fan_in = efficientnet("b0", num_classes=10, weight_init="fan_in")
    fan_out = efficientnet("b0", num_classes=10)
    head_in, head_out = fan_in.head[0].weight, fan_out.head[0].weight  # 320 -> 1280, 1x1
    assert float(head_in.std()) == pytest.approx((2 / 320) ** 0.5, rel=0.05)
    assert float(head_out.std()) == pytest.approx((2 / 1280) ** 0.5, rel=0.05)


def test_amp_dtype_follows_dtype_and_use_amp() -> None:
    import torch

    from apps.efficientnet.runtime.trainer import amp_dtype
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert amp_dtype(parse_args([], environ={}), cpu) is None
    assert amp_dtype(parse_args(["--use_amp"], environ={}), cpu) == torch.bfloat16
    assert amp_dtype(parse_args(["--use_amp"], environ={}), cuda) == torch.float16
    assert amp_dtype(parse_args(["--dtype", "float16"], environ={}), cpu) == torch.float16
    assert amp_dtype(parse_args(["--dtype", "bfloat16", "--use_amp"], environ={}),
                     cuda) == torch.bfloat16


def test_eval_num_examples_cuts_the_evaluation() -> None:
    import torch

    from apps.efficientnet.runtime.runner import _first_examples
    batches = [(torch.zeros(4, 1), torch.arange(4)) for _ in range(3)]
    got = list(_first_examples(batches, 6))
    assert [int(b[1].shape[0]) for b in got] == [4, 2]


def test_keras_cutmix_pastes_a_box_and_mixes_labels_by_its_area() -> None:
    tf = pytest.importorskip("tensorflow")
    from apps.efficientnet.keras.data import mix_batch
    images = tf.stack([tf.zeros((8, 8, 3)), tf.ones((8, 8, 3))])
    labels = tf.constant([[1.0, 0.0], [0.0, 1.0]])
    for s in range(5):
        seed = tf.constant([s, 7], tf.int64)
        mixed, mixed_labels = mix_batch(images, labels, 0.0, 1.0, seed)
        pasted = float(tf.reduce_mean(mixed[0]))  # image 0 is zeros: the box is ones
        assert float(mixed_labels[0, 1]) == pytest.approx(pasted)
        assert float(mixed_labels[1, 0]) == pytest.approx(1.0 - float(tf.reduce_mean(mixed[1])))
        again, _ = mix_batch(images, labels, 0.0, 1.0, seed)  # stateless: the same batch
        assert bool(tf.reduce_all(again == mixed))
