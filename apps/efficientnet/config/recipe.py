"""The recipe's command line, flag by flag: what shoal does with each.

The SMDDP walkthrough trains with the AWS fork of NVIDIA's TensorFlow 2 EfficientNet v1 recipe
(HerringForks/SMDDP-Examples, ``tensorflow/efficientnet/utils/cmdline_helper.py``);
``shoalrun --sagemaker`` hands every hyperparameter to the script as a flag, so no flag of that
command line may end a job. Each one is

* **shoal's own** (same name, same meaning), or an **alias** of one (``--epsilon`` is
  ``--rmsprop_epsilon``, ``--train_img_size`` is ``--image_size``);
* **ignored with a warning** where ignoring it cannot change the run (the recipe ignores it
  too, or it only concerns a loader, a log or an export shoal does not make);
* **refused** (:class:`UnsupportedFlagError`, naming the flag and why) where its value asks
  for something shoal cannot do and ignoring it would change the run.

:data:`RECIPE_FLAGS` is the fork's 69 flags, :data:`V2_FLAGS` the v2 recipe's names for the
same things; the application's README has the table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from apps.efficientnet.config.variants import training_resolution

__all__ = ["ACTIVATION_NAMES", "IGNORED", "RECIPE_FLAGS", "RESUME_FROM_MODEL_DIR", "V2_FLAGS",
           "UnsupportedFlagError", "add_ignored", "resume_value", "settle"]

#: The fork's flags, in its order (booleans are bare switches there).
RECIPE_FLAGS = (
    "model_dir", "config_file", "params_override", "save_checkpoint_freq", "data_dir", "mode",
    "arch", "dataset", "log_steps", "time_history", "use_xla", "use_amp", "intraop_threads",
    "interop_threads", "export_dir", "results_dir", "inference_checkpoint", "to_predict",
    "log_filename", "display_every", "num_classes", "batch_norm", "activation", "optimizer",
    "momentum", "epsilon", "decay", "moving_average_decay", "lookahead", "nesterov", "beta_1",
    "beta_2", "label_smoothing", "mixup_alpha", "max_epochs", "num_epochs_between_eval",
    "steps_per_epoch", "warmup_epochs", "lr_init", "lr_decay", "lr_decay_rate",
    "lr_decay_epochs", "lr_warmup_epochs", "weight_decay", "weight_init", "train_num_examples",
    "train_batch_size", "augmenter_name", "num_layers", "magnitude", "cutout_const",
    "translate_const", "autoaugmentation_name", "data_format", "eval_num_examples",
    "eval_batch_size", "predict_batch_size", "skip_eval", "resume_checkpoint", "use_dali",
    "use_dali_eval", "index_file", "benchmark", "enable_checkpoint_and_export",
    "enable_tensorboard", "write_model_weights", "seed", "dtype", "run_eagerly")

#: The v2 recipe's flags (NVIDIA DeepLearningExamples, TensorFlow2/Classification/ConvNets)
#: that mean the same for v1.
V2_FLAGS = ("train_img_size", "eval_img_size", "grad_accum_steps", "grad_clip_norm",
            "hvd_fp16_compression", "opt_epsilon", "train_use_dali", "eval_use_dali",
            "cutmix_alpha", "memory_limit", "raug_num_layers", "raug_magnitude")

#: ``--resume_checkpoint`` given bare (or ``""``/``true``): the recipe's "resume from a
#: checkpoint in the model_dir", which starts afresh when there is none yet.
RESUME_FROM_MODEL_DIR = "<model_dir>"

_STR, _INT, _BOOL = "str", "int", "bool"
#: Flags accepted and ignored: (kind, value that asks for nothing, why ignoring is harmless).
IGNORED: dict[str, tuple[str, Any, str]] = {
    "config_file": (_STR, None, "the recipe parses it but never reads it"),
    "params_override": (_STR, None, "the recipe parses it but never reads it"),
    "dataset": (_STR, "ImageNet", "shoal reads whatever --data_dir holds"),
    "export_dir": (_STR, None, "the recipe exports nothing in training; the checkpoint in "
                   "--model_dir holds the weights"),
    "results_dir": (_STR, ".", "the recipe never reads it; logs go to --model_dir"),
    "inference_checkpoint": (_STR, None, "only the recipe's predict mode reads it"),
    "to_predict": (_STR, None, "only the recipe's predict mode reads it"),
    "predict_batch_size": (_INT, None, "only the recipe's predict mode reads it"),
    "display_every": (_INT, None, "shoal prints per epoch and every --log_steps"),
    "data_format": (_STR, None, "the layout is the framework's choice; results are the same"),
    "index_file": (_STR, None, "a DALI index; shoal indexes the records itself"),
    "warmup_epochs": (_INT, None, "the recipe never reads it; the learning-rate warm-up is "
                      "--lr_warmup_epochs"),
    "benchmark": (_BOOL, False, "only the recipe's predict mode reads it; "
                  "--mode training_benchmark measures training"),
    "use_dali": (_BOOL, False, "shoal's own loader reads the data; the run's result does "
                 "not depend on the loader"),
    "use_dali_eval": (_BOOL, False, "shoal's own loader reads the data"),
    "train_use_dali": (_BOOL, False, "shoal's own loader reads the data"),
    "eval_use_dali": (_BOOL, False, "shoal's own loader reads the data"),
    "write_model_weights": (_BOOL, False, "weight images go to TensorBoard only"),
    "memory_limit": (_INT, None, "a cap on GPU memory, which changes no result; shoal "
                     "leaves the device's memory to the framework"),
    "enable_tensorboard": (_BOOL, False, "shoal writes no TensorBoard events; the metrics "
                           "go to --log_filename (JSON lines)"),
    "lookahead": (_BOOL, False, ""),
    "cutout_const": (_STR, None, ""),
    "translate_const": (_STR, None, ""),
    "autoaugmentation_name": (_STR, None, ""),
}
#: ``--activation`` values (TensorFlow's names) both applications build.
ACTIVATION_NAMES = ("swish", "silu", "simple_swish", "relu", "relu6", "hard_swish", "gelu",
                    "elu", "selu", "tanh", "sigmoid", "identity", "linear")
#: The augmentation constants shoal's augmenter has (TF's: pixels at 224, scaled to the image).
_AUGMENT_CONSTANTS = {"cutout_const": 40.0, "translate_const": 100.0}


class UnsupportedFlagError(ValueError):
    """A flag whose value asks for something this application cannot do."""

    def __init__(self, flag: str, why: str) -> None:
        super().__init__(f"--{flag}: {why}")
        self.flag = flag


def resume_value(text: str) -> str:
    """``--resume_checkpoint VALUE``: a path, or the recipe's on/off (``""``, ``true``/
    ``false``, which are ``--resume auto`` and ``--resume none``)."""
    value = text.strip().lower()
    if value in ("", "true", "1", "yes", "on"):
        return RESUME_FROM_MODEL_DIR
    if value in ("false", "0", "no", "off", "none"):
        return "none"
    return text


def add_ignored(parser: argparse.ArgumentParser,
                flag: Callable[..., None]) -> None:
    """The ignored and refusable flags of :data:`IGNORED`, in a group of their own."""
    g = parser.add_argument_group("the recipe's flags shoal accepts without acting on them "
                                  "(see the README's table)")
    for name, (kind, _, why) in IGNORED.items():
        if kind == _BOOL:
            flag(g, f"--{name}", help=why or argparse.SUPPRESS)
        else:
            g.add_argument(f"--{name}", default=None, type=int if kind == _INT else str,
                           help=why or argparse.SUPPRESS)


def _given(args: argparse.Namespace, name: str) -> bool:
    kind, idle, _ = IGNORED[name]
    value = getattr(args, name)
    return value is not None and value != idle and not (kind == _BOOL and not value)


def _refusals(args: argparse.Namespace) -> None:
    keras = args.framework == "tensorflow"
    if args.activation not in ACTIVATION_NAMES:
        raise UnsupportedFlagError("activation", f"{args.activation!r} is not one of "
                                   f"{', '.join(ACTIVATION_NAMES)}")
    for name, have in _AUGMENT_CONSTANTS.items():
        value = getattr(args, name)
        if value not in (None, "") and float(value) != have:
            raise UnsupportedFlagError(name, f"shoal's augmenter uses TensorFlow's constant "
                                       f"({have:g} px at 224, scaled to the image); "
                                       f"{value} is not supported")
    if args.autoaugmentation_name not in (None, "", "v0"):
        raise UnsupportedFlagError("autoaugmentation_name", "shoal's AutoAugment is "
                                   "TensorFlow's 'v0' ImageNet policy; "
                                   f"{args.autoaugmentation_name!r} is not available")
    if args.lookahead and keras:
        raise UnsupportedFlagError("lookahead", "Lookahead is implemented for the PyTorch "
                                   "application only (--framework torch)")
    trained = training_resolution(args.arch, args.image_size)
    if keras and args.eval_img_size and args.eval_img_size != trained:
        raise UnsupportedFlagError("eval_img_size", "Keras's EfficientNet is built for one "
                                   "input size; evaluating at another is implemented for the "
                                   "PyTorch application only (--framework torch)")
    if keras and args.grad_accum_steps > 1:
        raise UnsupportedFlagError("grad_accum_steps", "gradient accumulation is implemented "
                                   "for the PyTorch application only (--framework torch)")


def settle(args: argparse.Namespace) -> None:
    """After parsing: refuse what cannot be honoured, resolve the bare
    ``--resume_checkpoint``, and list the ignored flags in ``args.ignored`` (one line each,
    for the job's log)."""
    _refusals(args)
    if args.resume_checkpoint is not None:  # the recipe's spelling of --resume
        args.resume = "auto" if args.resume_checkpoint == RESUME_FROM_MODEL_DIR else \
            args.resume_checkpoint
    # what the Keras application reads: auto looks in the checkpoint directory
    args.resume_optional = args.resume == "auto"
    args.resume_checkpoint = None if args.resume == "none" else \
        args.checkpoint_dir if args.resume == "auto" else args.resume
    args.ignored = []
    for name, (_, _, why) in IGNORED.items():
        if not why or not _given(args, name):
            continue
        args.ignored.append(f"--{name} is accepted and ignored: {why}")
