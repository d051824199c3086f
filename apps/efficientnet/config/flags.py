"""Command-line flags of the EfficientNet application (NVIDIA's recipe names), and SageMaker.

Under SageMaker, hyperparameters arrive as ``--name value`` arguments and/or as the JSON
object in ``SM_HPS``; data as the channel directories ``SM_CHANNEL_TRAIN`` / ``SM_CHANNEL_EVAL``;
the output directory as ``SM_MODEL_DIR``. Explicit arguments win over ``SM_HPS``, which wins
over the ``SM_*`` directories, which win over the defaults. Boolean flags accept a bare
``--use_amp`` as well as SageMaker's ``--use_amp True`` / ``false``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from collections.abc import Mapping, Sequence

from apps.efficientnet.config.variants import SMALL_CNN, VARIANTS

__all__ = ["LR_BATCH_BASE", "LR_RULE", "MODES", "build_parser", "parse_args", "peak_lr",
           "sagemaker_argv", "str2bool"]

MODES = ("train", "eval", "train_and_eval", "training_benchmark")

#: The global batch ``--lr_init`` is given for. NVIDIA's EfficientNet recipe
#: (DeepLearningExamples, TensorFlow2/Classification/ConvNets) scales its ``lr_init`` by
#: ``scale_by_batch_size = 1/128`` times the global batch (``runtime/runner_utils.py``,
#: ``get_learning_rate_params``; applied in ``utils/optimizer_factory.py``,
#: ``build_learning_rate``: ``base_lr *= lr_multiplier * batch_size``), so its commands carry
#: over unchanged: B0's ``--lr_init 0.008`` at 8 x 256 images peaks at 0.128.
LR_BATCH_BASE = 128
LR_RULE = f"peak lr = lr_init x global batch / {LR_BATCH_BASE} (NVIDIA's EfficientNet rule)"


def peak_lr(lr_init: float, global_batch: int) -> float:
    """The learning rate the warm-up reaches: :data:`LR_RULE`."""
    return lr_init * global_batch / LR_BATCH_BASE


def str2bool(text: str | bool) -> bool:
    """``true/yes/1/on`` or ``false/no/0/off`` (any case)."""
    if isinstance(text, bool):
        return text
    value = text.strip().lower()
    if value in ("true", "yes", "1", "on", "y", "t"):
        return True
    if value in ("false", "no", "0", "off", "n", "f", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser; every flag has a default, so ``[]`` parses."""
    p = argparse.ArgumentParser(prog="python -m apps.efficientnet.main",
                                description="EfficientNet training on shoal.")

    def flag(g: argparse._ArgumentGroup, name: str, text: str, default: bool = False) -> None:
        g.add_argument(name, type=str2bool, nargs="?", const=True, default=default, help=text)

    g = p.add_argument_group("job")
    a = g.add_argument
    a("--mode", choices=MODES, default="train_and_eval")
    a("--framework", choices=("torch", "tensorflow"), default="torch",
      help="tensorflow: Keras's EfficientNet through shoal.keras (model.fit)")
    a("--arch", default="efficientnet-b0", choices=[*sorted(VARIANTS), SMALL_CNN],
      type=lambda s: s if s.startswith("efficientnet-") or s == SMALL_CNN
      else f"efficientnet-{s}",
      help=f"an EfficientNet, or {SMALL_CNN} (a small CNN for communication-bound benchmarks)")
    a("--num_classes", type=int, default=1000)
    a("--image_size", type=int, default=None, help="input resolution (default: the variant's)")
    a("--backend", choices=("shoal", "ddp-gloo", "ddp-shoal", "horovod", "mwms"),
      default="shoal", help="horovod: Horovod's own horovod.torch, under horovodrun; mwms: "
      "TensorFlow's MultiWorkerMirroredStrategy from TF_CONFIG (--framework tensorflow); "
      "both the comparison runs of the benchmarks")
    a("--compression", choices=("none", "fp16", "bf16"), default="none",
      help="gradient compression on the wire")
    flag(g, "--use_amp", "torch: autocast (bf16 on CPU, fp16 with a GradScaler on CUDA); "
         "tensorflow: the mixed_float16 policy")
    flag(g, "--use_xla", "torch: torch.compile; tensorflow: XLA (jit_compile)")
    a("--seed", type=int, default=0)
    g = p.add_argument_group("schedule")
    a = g.add_argument
    a("--max_epochs", type=int, default=300)
    a("--steps_per_epoch", type=int, default=None,
      help="default: training examples // global batch")
    a("--benchmark_warmup_steps", type=int, default=10,
      help="steps left out of the training_benchmark statistics")
    a("--train_batch_size", type=int, default=32, help="per worker")
    a("--eval_batch_size", type=int, default=32, help="per worker")
    a("--lr_init", type=float, default=0.008,
      help=f"for a global batch of {LR_BATCH_BASE}, scaled linearly: {LR_RULE}")
    a("--lr_decay", choices=("exponential", "cosine"), default="exponential")
    a("--lr_decay_rate", type=float, default=0.97)
    a("--lr_decay_epochs", type=float, default=2.4)
    a("--lr_warmup_epochs", type=float, default=5.0)
    a("--optimizer", choices=("rmsprop", "sgd", "adamw"), default="rmsprop")
    a("--momentum", type=float, default=0.9)
    a("--rmsprop_decay", type=float, default=0.9)
    a("--rmsprop_epsilon", type=float, default=0.001)
    a("--weight_decay", type=float, default=5e-6, help="not applied to BatchNorm or biases")
    a("--label_smoothing", type=float, default=0.1)
    a("--mixup_alpha", type=float, default=0.0)
    a("--moving_average_decay", type=float, default=0.0,
      help="EMA of the weights, used for evaluation (0: off; the recipe uses 0.9999)")
    g = p.add_argument_group("model")
    a = g.add_argument
    a("--optimizer_sharding", action="store_true",
      help="shard the optimizer state over the ranks (ZeRO stages 1 and 2): shoal's "
           "DistributedOptimizer(sharded=True); with --backend ddp-*, torch's "
           "ZeroRedundancyOptimizer")
    a("--batch_norm", choices=("default", "syncbn"), default="default")
    a("--drop_connect_rate", type=float, default=0.2)
    a("--bn_momentum", type=float, default=0.99,
      help="BatchNorm moving-average decay, TF convention (torch momentum = 1 - this)")
    a("--bn_epsilon", type=float, default=1e-3)
    g = p.add_argument_group("data")
    a = g.add_argument
    a("--data_dir", default=None, help="TFRecords (train-*, validation-*) or train/<class>/")
    a("--train_data_dir", default=None, help="default: --data_dir")
    a("--eval_data_dir", default=None, help="default: --data_dir")
    flag(g, "--synthetic", "random images (throughput only)")
    a("--augmenter_name", choices=("autoaugment", "randaugment", "none"),
      default="autoaugment")
    a("--raug_num_layers", type=int, default=2)
    a("--raug_magnitude", type=float, default=10.0)
    a("--crop_min_scale", type=float, default=0.08, help="smallest random-crop area")
    a("--eval_crop_fraction", type=float, default=0.875)
    flag(g, "--random_flip", "random horizontal flips", default=True)
    a("--label_offset", type=int, default=1, help="subtracted from TFRecord labels")
    a("--num_workers", type=int, default=2, help="DataLoader workers per rank")
    g = p.add_argument_group("output")
    a = g.add_argument
    a("--model_dir", default="results/efficientnet")
    a("--resume_checkpoint", default=None,
      help="checkpoint file or directory; training continues exactly where it stopped (the "
           "data stream too); --mode eval scores it (default: --model_dir's checkpoint)")
    a("--eval_untrained", action="store_true",
      help="let --mode eval score a freshly initialised model when there is no checkpoint")
    a("--save_checkpoint_freq", type=int, default=5, help="epochs (0: only at the end)")
    a("--log_steps", type=int, default=100)
    a("--log_filename", default="log.json")
    return p


def sagemaker_argv(environ: Mapping[str, str], parser: argparse.ArgumentParser
                   ) -> list[str]:
    """``SM_HPS`` as arguments (known flags only; others are warned about)."""
    raw = environ.get("SM_HPS")
    if not raw:
        return []
    known = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for key, value in json.loads(raw).items():
        dest = key.replace("-", "_")
        if dest not in known:
            if not key.startswith("sagemaker_"):
                warnings.warn(f"SM_HPS: ignoring unknown hyperparameter {key!r}", stacklevel=2)
            continue
        argv += [f"--{dest}", str(value)]
    return argv


def parse_args(argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default ``sys.argv[1:]``) over SageMaker's environment (default
    ``os.environ``)."""
    environ = os.environ if environ is None else environ
    parser = build_parser()
    defaults = {dest: environ[var] for dest, var in (("train_data_dir", "SM_CHANNEL_TRAIN"),
                                                     ("eval_data_dir", "SM_CHANNEL_EVAL"),
                                                     ("model_dir", "SM_MODEL_DIR"))
                if environ.get(var)}
    parser.set_defaults(**defaults)
    args = parser.parse_args([*sagemaker_argv(environ, parser),
                              *(argv if argv is not None else sys.argv[1:])])
    args.train_data_dir = args.train_data_dir or args.data_dir
    args.eval_data_dir = args.eval_data_dir or args.data_dir
    torch_only = args.backend in ("ddp-gloo", "ddp-shoal", "horovod")
    if args.framework == "tensorflow" and torch_only:
        parser.error(f"--backend {args.backend} is PyTorch's; --framework tensorflow runs "
                     f"--backend shoal or mwms")
    if args.framework == "torch" and args.backend == "mwms":
        parser.error("--backend mwms is TensorFlow's: add --framework tensorflow")
    for name in ("train_batch_size", "eval_batch_size", "max_epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return args
