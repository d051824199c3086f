"""``model.fit`` split at the optimizer, for XLA and for loss scaling.

Keras compiles one train function per model: ``train_step`` (forward, backward, optimizer
update, metrics) under ``tf.function(jit_compile=model.jit_compile)``. A shoal reduction is a
Python op, so it cannot run inside XLA, and under ``mixed_float16`` Keras's
``LossScaleOptimizer`` checks the *local* gradients for overflow before the distributed
optimizer inside it reduces, so one rank may skip a reduction the others run.

For a model whose optimizer is (or wraps) a shoal ``DistributedOptimizer`` and that is
compiled with ``jit_compile=True`` or with a loss-scale optimizer, shoal builds the train
function from three parts instead:

1. the model's own ``train_step`` (a user's override included), XLA-compiled when asked,
   with the model optimizer's ``apply`` intercepted while it is traced: the gradients it
   was given are returned instead of applied;
2. one grouped allreduce of those gradients, outside XLA;
3. the model optimizer's real ``apply`` on the reduced gradients (loss-scale check, update),
   XLA-compiled when asked, with the distributed optimizer told not to reduce again.

Every rank then checks the same reduced gradients, so every rank takes the same branch.
Keras's ``make_train_function`` is wrapped once, when a ``DistributedOptimizer`` is first
made; models without one are untouched. Keras 2 (``tf_keras``) is split for XLA only: its
``LossScaleOptimizer`` aggregates, and so reduces, before its overflow check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

__all__ = ["SplitStep", "distributed_inside", "install"]

_INSTALLED: set[type] = set()


def distributed_inside(optimizer: Any) -> Any:
    """The shoal distributed optimizer that ``optimizer`` is or wraps (``inner_optimizer``
    chains), or None."""
    from .optimizer import DistributedOptimizerMixin
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, DistributedOptimizerMixin):
            return optimizer
        optimizer = getattr(optimizer, "inner_optimizer", None)
        seen += 1
    return None


@contextlib.contextmanager
def _override(obj: Any, attr: str, value: Any) -> Iterator[None]:
    """``obj.attr`` is ``value`` for the block (an instance attribute shadowing the class's;
    set past Keras's attribute tracking)."""
    object.__setattr__(obj, attr, value)
    try:
        yield
    finally:
        object.__delattr__(obj, attr)


class SplitStep:
    """The train step of the module docstring, for one model; called where Keras calls
    ``train_step`` (inside its outer, non-XLA ``tf.function``). Keras 3's optimizers apply
    with ``apply(grads, variables)``, Keras 2's with ``apply_gradients(pairs)``."""

    def __init__(self, model: Any, distributed: Any, jit_compile: bool,
                 keras2: bool = False) -> None:
        import tensorflow as tf
        self.model = model
        self.outer = model.optimizer
        self.distributed = distributed
        self.keras2 = keras2
        self.variables: list[Any] | None = None
        self.compute = tf.function(self._compute, jit_compile=jit_compile,
                                   reduce_retracing=True)
        self.update = tf.function(self._update, jit_compile=jit_compile,
                                  reduce_retracing=True)

    def _compute(self, data: Any) -> tuple[Any, list[Any]]:
        captured: dict[str, Any] = {}

        def keep(grads: Any, variables: Any) -> None:
            if captured:
                raise NotImplementedError("shoal splits model.fit's step at the optimizer: "
                                          "its train_step may apply gradients once")
            captured.update(grads=list(grads), variables=list(variables))

        def capture(grads: Any, trainable_variables: Any = None) -> None:  # Keras 3
            keep(grads, trainable_variables if trainable_variables is not None else
                 self.outer._trainable_variables)

        def capture_pairs(grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:  # Keras 2
            pairs = list(grads_and_vars)
            keep([g for g, _ in pairs], [v for _, v in pairs])
            return self.outer.iterations

        if self.keras2:  # its compute_gradients would reduce: the split reduces instead
            with _override(self.outer, "apply_gradients", capture_pairs), \
                    _override(self.distributed, "_shoal_reduced", True):
                logs = self.model.train_step(data)
        else:
            with _override(self.outer, "apply", capture):
                logs = self.model.train_step(data)
        if not captured:
            return logs, []
        self.variables = captured["variables"]
        return logs, captured["grads"]

    def _update(self, grads: list[Any]) -> None:
        with _override(self.distributed, "_shoal_reduced", True):
            if self.keras2:
                self.outer.apply_gradients(list(zip(grads, self.variables or [], strict=True)))
            else:
                self.outer.apply(grads, self.variables)

    def __call__(self, data: Any) -> Any:
        logs, grads = self.compute(data)
        if self.variables is None:  # the step applied nothing (no trainable weights)
            return logs
        reduction = self.distributed._shoal_reduction
        if reduction is not None:
            grads = reduction(list(grads), list(self.variables))
        self.update(grads)
        return logs


def install(keras: ModuleType) -> None:
    """Wrap the trainer's ``make_train_function`` (once per trainer class): Keras 3's
    TensorFlow trainer for ``jit_compile=True`` or a loss-scale optimizer; Keras 2's ``Model``
    for ``jit_compile=True`` only (its ``LossScaleOptimizer`` aggregates, so reduces, before
    its check)."""
    from .compat import is_keras2
    if is_keras2(keras):
        try:
            from tf_keras.src.engine.training import Model
        except ImportError:  # pragma: no cover - tf_keras moved its Model
            return
        _wrap(Model, lambda model, distributed: bool(model.jit_compile), _keras2_function,
              keras2=True)
        return
    try:
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    except ImportError:  # pragma: no cover - Keras moved its trainer
        return
    _wrap(TensorFlowTrainer, lambda model, distributed: bool(
        model.jit_compile or distributed is not model.optimizer), _keras3_function)


def _wrap(trainer: type, split_for: Callable[[Any, Any], bool],
          build: Callable[[Any, SplitStep], Any], keras2: bool = False) -> None:
    """Make ``trainer.make_train_function`` build a split step where ``split_for(model,
    distributed)`` says so, and the train function around it with ``build``."""
    if trainer in _INSTALLED:
        return
    original = trainer.make_train_function

    def make_train_function(self: Any, force: bool = False) -> Any:
        distributed = distributed_inside(getattr(self, "optimizer", None))
        if distributed is None or self.run_eagerly or not split_for(self, distributed):
            return original(self, force)
        if self.train_function is not None and not force:
            return self.train_function
        step = SplitStep(self, distributed, bool(self.jit_compile), keras2=keras2)
        object.__setattr__(self, "_shoal_split", step)  # for inspection; not tracked
        self.train_function = build(self, step)
        return self.train_function

    make_train_function.__doc__ = original.__doc__
    trainer.make_train_function = make_train_function
    _INSTALLED.add(trainer)


def _keras3_function(model: Any, step: SplitStep) -> Any:
    jit = model.jit_compile
    model.jit_compile = False  # the outer function holds a Python op; its parts compile
    try:
        return model._make_function(step)
    finally:
        model.jit_compile = jit


def _keras2_function(model: Any, step: SplitStep) -> Any:
    import tensorflow as tf
    steps = model._steps_per_execution
    if (steps is not None and int(steps.numpy()) != 1) or \
            model.autotune_steps_per_execution or model._cluster_coordinator:
        raise NotImplementedError("shoal's distributed optimizer under jit_compile=True runs "
                                  "one step per execution: compile with "
                                  "steps_per_execution=1")

    def train_function(iterator: Any) -> Any:
        outputs = step(next(iterator))
        model._train_counter.assign_add(1)
        return outputs

    model.train_tf_function = tf.function(train_function, reduce_retracing=True)
    return model.train_tf_function
