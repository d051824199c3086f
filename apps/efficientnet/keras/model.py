"""The Keras model, schedule and optimizer of the application.

``keras.applications`` EfficientNet B0-B7 (``weights=None``, Keras's own compound scaling,
stem rescaling and normalization inside), with the recipe's BatchNorm momentum and epsilon,
optionally shoal's ``SyncBatchNormalization``; logits in float32 also under
``mixed_float16``. The schedule is the PyTorch application's (linear warm-up, then staircase
exponential or cosine decay), written with Keras ops so that it compiles with XLA.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import keras
from keras import ops

from apps.efficientnet.config.variants import SMALL_CNN

__all__ = ["KERAS_ACTIVATIONS", "WarmupDecay", "build_model", "build_optimizer"]

#: The recipe's ``--activation`` names (TensorFlow's) as Keras names them.
KERAS_ACTIVATIONS = {
    "swish": "swish", "silu": "silu", "simple_swish": "swish", "relu": "relu",
    "relu6": "relu6", "hard_swish": "hard_silu", "gelu": "gelu", "elu": "elu", "selu": "selu",
    "tanh": "tanh", "sigmoid": "sigmoid", "identity": "linear", "linear": "linear",
}

_ARCHS = {f"efficientnet-b{i}": f"EfficientNetB{i}" for i in range(8)}


def _small_cnn(num_classes: int, image_size: int) -> keras.Model:
    """The benchmarks' communication-bound reference model (as the PyTorch application's
    ``small-cnn``): Conv-BN-ReLU x 4 with stride 2 (32..256 channels), pooling, classifier."""
    inputs = keras.Input((image_size, image_size, 3))
    x = keras.layers.Rescaling(1 / 127.5, offset=-1.0)(inputs)
    for channels in (32, 64, 128, 256):
        x = keras.layers.Conv2D(channels, 3, strides=2, padding="same", use_bias=False)(x)
        x = keras.layers.BatchNormalization()(x)
        x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(num_classes)(x))


def build_model(args: argparse.Namespace, image_size: int) -> keras.Model:
    """EfficientNet ``args.arch`` (or ``small-cnn``) for ``args.num_classes`` classes at
    ``image_size``."""
    if args.arch == SMALL_CNN:
        base = _small_cnn(args.num_classes, image_size)
    elif args.arch in _ARCHS:
        base = getattr(keras.applications, _ARCHS[args.arch])(
            weights=None, include_top=True, classes=args.num_classes,
            input_shape=(image_size, image_size, 3), classifier_activation=None)
    else:
        raise NotImplementedError(f"--framework tensorflow trains the EfficientNets "
                                  f"(b0..b7) and {SMALL_CNN}, not {args.arch!r}")
    sync = args.batch_norm == "syncbn"
    if sync:
        import shoal.tensorflow as hvd
        sync_bn = hvd.SyncBatchNormalization

    activation = KERAS_ACTIVATIONS[args.activation]

    def clone(layer: keras.layers.Layer) -> keras.layers.Layer:
        if not isinstance(layer, keras.layers.BatchNormalization):
            config = layer.get_config()
            if config.get("activation") == "swish":  # every activation of the EfficientNets
                config["activation"] = activation
            for key in ("kernel_initializer", "depthwise_initializer"):
                init = config.get(key)
                if isinstance(init, dict) and "mode" in init.get("config", {}):
                    init["config"]["mode"] = args.weight_init
            return layer.__class__.from_config(config)
        config = {**layer.get_config(), "momentum": args.bn_momentum,
                  "epsilon": args.bn_epsilon}
        return sync_bn.from_config(config) if sync else layer.__class__.from_config(config)

    model = keras.models.clone_model(base, clone_function=clone)
    logits = keras.layers.Activation("linear", dtype="float32", name="logits")(model.output)
    return keras.Model(model.input, logits, name=args.arch.replace("-", "_"))


@keras.saving.register_keras_serializable(package="shoal_apps")
class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from 0 over ``warmup_steps``, then staircase exponential decay
    (``base * rate ** floor(epoch / decay_epochs)``) or cosine decay to 0 at
    ``total_steps``."""

    def __init__(self, base_lr: float, steps_per_epoch: int, total_steps: int,
                 warmup_steps: int, decay: str, decay_rate: float,
                 decay_epochs: float) -> None:
        if decay not in ("exponential", "cosine"):
            raise ValueError(f"unknown lr_decay {decay!r}; use exponential or cosine")
        self.base_lr, self.steps_per_epoch = base_lr, max(1, steps_per_epoch)
        self.total_steps, self.warmup_steps = max(1, total_steps), warmup_steps
        self.decay, self.decay_rate, self.decay_epochs = decay, decay_rate, decay_epochs

    def __call__(self, step: Any) -> Any:
        step = ops.cast(step, "float32")
        warm = float(max(1, self.warmup_steps))
        after = ops.maximum(step - self.warmup_steps, 0.0)
        if self.decay == "cosine":
            t = ops.minimum(after / max(1, self.total_steps - self.warmup_steps), 1.0)
            decayed = self.base_lr * 0.5 * (1.0 + ops.cos(math.pi * t))
        else:
            epochs = ops.floor(after / self.steps_per_epoch / self.decay_epochs)
            decayed = self.base_lr * ops.power(self.decay_rate, epochs)
        return ops.where(step < self.warmup_steps, self.base_lr * (step + 1.0) / warm, decayed)

    def get_config(self) -> dict[str, Any]:
        return {"base_lr": self.base_lr, "steps_per_epoch": self.steps_per_epoch,
                "total_steps": self.total_steps, "warmup_steps": self.warmup_steps,
                "decay": self.decay, "decay_rate": self.decay_rate,
                "decay_epochs": self.decay_epochs}


def build_optimizer(args: argparse.Namespace, schedule: WarmupDecay) -> keras.Optimizer:
    """``rmsprop`` (TF's), ``sgd``/``momentum`` (Nesterov's with ``--nesterov``), ``adam`` or
    ``adamw``; ``--grad_clip_norm`` clips the global norm; weight decay (decoupled, Keras's)
    spares BatchNorm and biases; ``--moving_average_decay`` keeps an EMA of the weights,
    swapped in for evaluation."""
    common: dict[str, Any] = {"learning_rate": schedule}
    if args.weight_decay:
        common["weight_decay"] = args.weight_decay
    if args.moving_average_decay:
        common.update(use_ema=True, ema_momentum=args.moving_average_decay)
    if args.grad_clip_norm:
        common["global_clipnorm"] = args.grad_clip_norm
    betas = {"beta_1": 0.9 if args.beta_1 is None else args.beta_1,
             "beta_2": 0.999 if args.beta_2 is None else args.beta_2}
    if args.optimizer == "rmsprop":
        opt = keras.optimizers.RMSprop(rho=args.rmsprop_decay, momentum=args.momentum,
                                       epsilon=args.epsilon, **common)
    elif args.optimizer in ("sgd", "momentum"):
        opt = keras.optimizers.SGD(momentum=args.momentum,
                                   nesterov=bool(args.nesterov) and args.momentum > 0, **common)
    elif args.optimizer == "adam":
        opt = keras.optimizers.Adam(epsilon=args.epsilon, **betas, **common)
    elif args.optimizer == "adamw":
        opt = keras.optimizers.AdamW(**{"weight_decay": 0.0, **common}, epsilon=args.epsilon,
                                     **betas)
    else:
        raise ValueError(f"unknown optimizer {args.optimizer!r}; use rmsprop, sgd, momentum, "
                         f"adam or adamw")
    if args.weight_decay:
        opt.exclude_from_weight_decay(var_names=["gamma", "beta", "bias"])
    return opt
