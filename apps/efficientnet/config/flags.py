"""Command-line flags of the EfficientNet application (NVIDIA's recipe names), and SageMaker.

Under SageMaker, hyperparameters arrive as ``--name value`` arguments and/or as the JSON
object in ``SM_HPS``; data as the channel directories ``SM_CHANNEL_TRAIN`` / ``SM_CHANNEL_EVAL``;
the output directory as ``SM_MODEL_DIR``. Explicit arguments win over ``SM_HPS``, which wins
over the ``SM_*`` directories, which win over the defaults.

Boolean flags take SageMaker's dialect: a bare ``--use_amp``, ``--use_amp ""`` (an empty
hyperparameter means "set"), ``--use_amp True`` / ``1`` turn it on; ``False`` / ``0`` or
``--nouse_amp`` turn it off. Every flag of the recipe's command line (the SMDDP fork of
NVIDIA's TensorFlow 2 EfficientNet, and the v2 recipe's names for the same things) is accepted:
:mod:`apps.efficientnet.config.recipe` says what becomes of each.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from apps.efficientnet.config import recipe
from apps.efficientnet.config.variants import SMALL_CNN, VARIANTS

__all__ = ["LR_BATCH_BASE", "LR_RULE", "MODES", "UnsupportedFlagError", "build_parser",
           "default_framework", "default_loader_workers", "parse_args", "peak_lr",
           "sagemaker_argv", "str2bool"]

MODES = ("train", "eval", "train_and_eval", "training_benchmark")
UnsupportedFlagError = recipe.UnsupportedFlagError

#: The global batch ``--lr_init`` is given for. NVIDIA's EfficientNet recipe
#: (DeepLearningExamples, TensorFlow2/Classification/ConvNets) scales its ``lr_init`` by
#: ``scale_by_batch_size = 1/128`` times the global batch (``runtime/runner_utils.py``,
#: ``get_learning_rate_params``; applied in ``utils/optimizer_factory.py``,
#: ``build_learning_rate``: ``base_lr *= lr_multiplier * batch_size``), so its commands carry
#: over unchanged: B0's ``--lr_init 0.008`` at 8 x 256 images peaks at 0.128.
LR_BATCH_BASE = 128
LR_RULE = f"peak lr = lr_init x global batch / {LR_BATCH_BASE} (NVIDIA's rule)"


def peak_lr(lr_init: float, global_batch: int) -> float:
    """The learning rate the warm-up reaches: :data:`LR_RULE`."""
    return lr_init * global_batch / LR_BATCH_BASE


def str2bool(text: str | bool) -> bool:
    """``true/yes/1/on`` or an empty string (SageMaker's bare flag) is True,
    ``false/no/0/off`` False (any case)."""
    if isinstance(text, bool):
        return text
    value = text.strip().lower()
    if value in ("", "true", "yes", "1", "on", "y", "t"):
        return True
    if value in ("false", "no", "0", "off", "n", "f"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false, 1/0, or nothing), "
                                     f"got {text!r}")


def _optional_int(text: str) -> int | None:
    """An integer, or nothing (the recipe's ``--intraop_threads ''`` means "not set")."""
    return int(text) if text.strip() else None


def _mode(text: str) -> str:
    return {"evaluate": "eval"}.get(text, text)


def default_framework() -> str:
    """``torch``, unless only TensorFlow is installed (the walkthrough's container)."""
    has = {name: importlib.util.find_spec(name) is not None for name in ("torch", "tensorflow")}
    return "tensorflow" if has["tensorflow"] and not has["torch"] else "torch"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; every flag has a default, so ``[]`` parses."""
    p = argparse.ArgumentParser(prog="python -m apps.efficientnet.main", allow_abbrev=False,
                                description="EfficientNet training on shoal.")

    def flag(g: argparse._ArgumentGroup, *names: str, help: str, default: bool = False
             ) -> None:
        dest = names[0][2:]
        g.add_argument(*names, dest=dest, type=str2bool, nargs="?", const=True,
                       default=default, metavar="BOOL", help=help)
        g.add_argument(*(f"--no{n[2:]}" for n in names), dest=dest, action="store_false",
                       help=argparse.SUPPRESS)

    g = p.add_argument_group("job")
    a = g.add_argument
    a("--mode", type=_mode, choices=MODES, default="train_and_eval",
      help="also the recipe's 'evaluate' (= eval)")
    a("--framework", choices=("torch", "tensorflow"), default=None,
      help="tensorflow: Keras's EfficientNet through shoal.keras (model.fit); default: torch, "
           "or tensorflow where only TensorFlow is installed")
    a("--arch", default="efficientnet-b0", choices=[*sorted(VARIANTS), SMALL_CNN],
      type=lambda s: s if s.startswith("efficientnet-") or s == SMALL_CNN
      else f"efficientnet-{s}",
      help=f"an EfficientNet, or {SMALL_CNN} (a small CNN for communication-bound benchmarks)")
    a("--num_classes", type=int, default=1000)
    a("--image_size", "--train_img_size", dest="image_size", type=int, default=None,
      help="training (and evaluation) resolution (default: the variant's)")
    a("--eval_img_size", type=int, default=None, help="evaluation resolution (default: "
      "--image_size)")
    a("--backend", choices=("shoal", "ddp-gloo", "ddp-shoal", "horovod", "mwms"),
      default="shoal", help="horovod: Horovod's own horovod.torch, under horovodrun; mwms: "
      "TensorFlow's MultiWorkerMirroredStrategy from TF_CONFIG (--framework tensorflow); "
      "both the comparison runs of the benchmarks")
    a("--compression", choices=("none", "fp16", "bf16"), default="none",
      help="gradient compression on the wire")
    flag(g, "--hvd_fp16_compression", help="the v2 recipe's name for --compression fp16")
    flag(g, "--use_amp", help="torch: autocast (bf16 on CPU, fp16 with a GradScaler on CUDA; "
         "--dtype picks); tensorflow: the mixed_float16 policy")
    flag(g, "--use_xla", help="torch: torch.compile; tensorflow: XLA (jit_compile, or "
         "TensorFlow's auto-clustering with --batch_norm syncbn, as the recipe does)")
    a("--dtype", choices=("float32", "fp32", "float16", "fp16", "bfloat16", "bf16"),
      default="float32", help="compute precision: float16/bfloat16 run mixed precision in "
      "that type (as --use_amp)")
    a("--seed", type=int, default=0)
    a("--intraop_threads", type=_optional_int, default=None,
      help="threads inside one operation (default: the host's cores shared by its ranks)")
    a("--interop_threads", type=_optional_int, default=None,
      help="operations run at once")
    flag(g, "--run_eagerly", help="tensorflow: run model.fit's steps eagerly (debugging); "
         "torch runs eagerly anyway")
    g = p.add_argument_group("schedule")
    a = g.add_argument
    a("--max_epochs", type=int, default=300)
    a("--steps_per_epoch", type=int, default=None,
      help="default: --train_num_examples (or the training records) // global batch")
    a("--train_num_examples", type=int, default=None,
      help="examples an epoch stands for (default: the training records)")
    a("--eval_num_examples", type=int, default=None,
      help="evaluate on at most this many examples (default: all)")
    a("--num_epochs_between_eval", type=int, default=1)
    flag(g, "--skip_eval", help="train_and_eval without the evaluations")
    a("--benchmark_warmup_steps", type=int, default=10,
      help="steps left out of the training_benchmark statistics")
    a("--train_batch_size", type=int, default=32, help="per worker")
    a("--eval_batch_size", type=int, default=32, help="per worker")
    a("--grad_accum_steps", type=int, default=1,
      help="batches whose gradients one optimizer step averages (the global batch of the "
           "learning-rate rule counts them)")
    a("--lr_init", type=float, default=0.008,
      help=f"for a global batch of {LR_BATCH_BASE}, scaled linearly: {LR_RULE}")
    a("--lr_decay", choices=("exponential", "cosine"), default="exponential")
    a("--lr_decay_rate", type=float, default=0.97)
    a("--lr_decay_epochs", type=float, default=2.4)
    a("--lr_warmup_epochs", type=float, default=5.0)
    a("--optimizer", choices=("rmsprop", "sgd", "momentum", "adam", "adamw"),
      default="rmsprop", help="sgd and momentum: SGD with --momentum (Nesterov with "
      "--nesterov)")
    a("--momentum", type=float, default=0.9)
    flag(g, "--nesterov", help="Nesterov momentum for sgd/momentum")
    a("--rmsprop_decay", "--decay", dest="rmsprop_decay", type=float, default=0.9)
    a("--epsilon", "--opt_epsilon", "--rmsprop_epsilon", dest="epsilon", type=float,
      default=0.001, help="the optimizer's epsilon (rmsprop, adam, adamw)")
    a("--beta_1", type=float, default=None, help="adam/adamw (default 0.9)")
    a("--beta_2", type=float, default=None, help="adam/adamw (default 0.999)")
    a("--grad_clip_norm", type=float, default=0.0,
      help="clip the averaged gradients to this global norm (0: off)")
    a("--weight_decay", type=float, default=5e-6, help="not applied to BatchNorm or biases")
    a("--label_smoothing", type=float, default=0.1)
    a("--mixup_alpha", type=float, default=0.0)
    a("--cutmix_alpha", type=float, default=0.0,
      help="CutMix (a box of another image pasted, labels mixed by area; 0: off); with "
           "--mixup_alpha too, each batch takes one of the two")
    a("--moving_average_decay", type=float, default=0.0,
      help="EMA of the weights, used for evaluation (0: off; the recipe uses 0.9999)")
    g = p.add_argument_group("model")
    a = g.add_argument
    a("--optimizer_sharding", action="store_true",
      help="shard the optimizer state over the ranks (ZeRO stages 1 and 2): shoal's "
           "DistributedOptimizer(sharded=True); with --backend ddp-*, torch's "
           "ZeroRedundancyOptimizer")
    a("--batch_norm", choices=("default", "syncbn"), default="default")
    a("--activation", default="swish", help="swish (silu), relu, relu6, gelu, hard_swish, ...")
    a("--weight_init", choices=("fan_in", "fan_out"), default="fan_out",
      help="variance-scaling mode of the convolution and dense weights")
    a("--drop_connect_rate", type=float, default=0.2)
    a("--bn_momentum", type=float, default=0.99,
      help="BatchNorm moving-average decay, TF convention (torch momentum = 1 - this)")
    a("--bn_epsilon", type=float, default=1e-3)
    g = p.add_argument_group("data")
    a = g.add_argument
    a("--data_dir", default=None, help="TFRecords (train-*, validation-*) or train/<class>/")
    a("--train_data_dir", default=None, help="default: --data_dir")
    a("--eval_data_dir", default=None, help="default: --data_dir")
    flag(g, "--synthetic", help="random images (throughput only)")
    a("--augmenter_name", choices=("autoaugment", "randaugment", "none"),
      default="autoaugment")
    a("--raug_num_layers", "--num_layers", dest="raug_num_layers", type=int, default=2)
    a("--raug_magnitude", "--magnitude", dest="raug_magnitude", type=float, default=10.0)
    a("--crop_min_scale", type=float, default=0.08, help="smallest random-crop area")
    a("--eval_crop_fraction", type=float, default=0.875)
    flag(g, "--random_flip", help="random horizontal flips", default=True)
    a("--label_offset", type=int, default=1, help="subtracted from TFRecord labels")
    a("--num_workers", type=int, default=None,
      help="DataLoader workers per rank (default: the cores this rank may run on, which "
           "shoalrun binds, less one for training; at least 1)")
    g = p.add_argument_group("output")
    a = g.add_argument
    a("--model_dir", default="results/efficientnet")
    a("--checkpoint_dir", default=None, metavar="DIR",
      help="where checkpoints go and --resume auto looks (default: --model_dir; under "
           "SageMaker /opt/ml/checkpoints when it exists, the directory checkpoint_s3_uri "
           "syncs)")
    a("--resume", default="auto", metavar="auto|none|PATH",
      help="auto (default): continue from the newest intact checkpoint in --checkpoint_dir "
           "(a damaged newest falls back to the one before it; none there: a fresh start); "
           "none: a fresh start; PATH: that checkpoint file or directory. Training "
           "continues exactly where it stopped, the data stream too; --mode eval scores it")
    a("--resume_checkpoint", nargs="?", const=recipe.RESUME_FROM_MODEL_DIR,
      type=recipe.resume_value, default=None, metavar="PATH",
      help="the recipe's spelling of --resume: bare (or true) is --resume auto, PATH is "
           "--resume PATH, false is --resume none")
    a("--eval_untrained", action="store_true",
      help="let --mode eval score a freshly initialised model when there is no checkpoint")
    a("--save_checkpoint_freq", type=int, default=5, help="epochs (0: only at the end)")
    a("--save_checkpoint_steps", type=int, default=0,
      help="also a checkpoint every N optimizer steps (0: none between epochs)")
    a("--keep_checkpoints", type=int, default=3, help="the newest K checkpoints are kept")
    a("--stop_grace_s", type=float, default=30.0,
      help="on SIGTERM every rank stops at the next step boundary and rank 0 checkpoints; "
           "a worker that cannot within this many seconds exits without one")
    flag(g, "--enable_checkpoint_and_export", default=True,
         help="write checkpoints (off: none at all)")
    flag(g, "--time_history", default=True,
         help="record images/s of every --log_steps window of steps")
    a("--log_steps", type=int, default=100)
    a("--log_filename", default="log.json")
    recipe.add_ignored(p, flag)
    return p


def _option_names(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every long option's name without its dashes (aliases too) -> its action."""
    return {opt[2:]: action for action in parser._actions for opt in action.option_strings
            if opt.startswith("--")}


def sagemaker_argv(environ: Mapping[str, str], parser: argparse.ArgumentParser
                   ) -> list[str]:
    """``SM_HPS`` as arguments (known flags only; others are warned about)."""
    raw = environ.get("SM_HPS")
    if not raw:
        return []
    known = _option_names(parser)
    argv: list[str] = []
    for key, value in json.loads(raw).items():
        name = key.replace("-", "_")
        if name not in known:
            if not key.startswith("sagemaker_"):
                warnings.warn(f"SM_HPS: ignoring unknown hyperparameter {key!r}", stacklevel=2)
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        argv += [f"--{name}", str(value)]
    return argv


def parse_args(argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) over SageMaker's environment (default
    ``os.environ``). A recipe flag whose value shoal cannot honour raises
    :class:`UnsupportedFlagError` naming it; one ignored is listed in ``args.ignored``."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    defaults = {dest: environ[var] for dest, var in (("train_data_dir", "SM_CHANNEL_TRAIN"),
                                                     ("eval_data_dir", "SM_CHANNEL_EVAL"),
                                                     ("model_dir", "SM_MODEL_DIR"))
                if environ.get(var)}
    parser.set_defaults(**defaults)
    args = parser.parse_args([*sagemaker_argv(environ, parser),
                              *(argv if argv is not None else sys.argv[1:])])
    args.framework = args.framework or default_framework()
    if args.num_workers is None:
        args.num_workers = default_loader_workers()
    elif args.num_workers < 0:
        parser.error("--num_workers must be 0 (load in the training process) or more")
    args.train_data_dir = args.train_data_dir or args.data_dir
    args.eval_data_dir = args.eval_data_dir or args.data_dir
    if args.hvd_fp16_compression and args.compression == "none":
        args.compression = "fp16"
    torch_only = args.backend in ("ddp-gloo", "ddp-shoal", "horovod")
    if args.framework == "tensorflow" and torch_only:
        parser.error(f"--backend {args.backend} is PyTorch's; --framework tensorflow runs "
                     f"--backend shoal or mwms")
    if args.framework == "torch" and args.backend == "mwms":
        parser.error("--backend mwms is TensorFlow's: add --framework tensorflow")
    for name in ("train_batch_size", "eval_batch_size", "max_epochs", "grad_accum_steps",
                 "num_epochs_between_eval"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.keep_checkpoints < 1:
        parser.error("--keep_checkpoints must be at least 1")
    args.checkpoint_dir = args.checkpoint_dir or sagemaker_checkpoints(environ) or \
        args.model_dir
    recipe.settle(args)
    return args


def default_loader_workers() -> int:
    """A rank's data-loading workers: the cores it may run on (shoalrun binds each rank to
    its share of the machine's), less one for the training process; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def sagemaker_checkpoints(environ: Mapping[str, str]) -> str | None:
    """Under SageMaker, its checkpoint directory (``/opt/ml/checkpoints``, which
    ``checkpoint_s3_uri`` syncs, and spot training restores) when it exists."""
    if not (environ.get("SM_MODEL_DIR") or environ.get("SM_TRAINING_ENV")):
        return None
    where = Path(environ.get("SAGEMAKER_BASE_DIR", "/opt/ml")) / "checkpoints"
    return str(where) if where.is_dir() else None
