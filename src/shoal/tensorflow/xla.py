"""XLA and shoal: keep the compute compiled, reduce between two compiled halves.

XLA compiles whole functions of TensorFlow ops into device code; a shoal collective is a
Python op (the engine is Python), which XLA cannot compile. Horovod solved this with a C++
XLA custom call; shoal stays pure Python, so it splits the step instead, at the one place
where data leaves the rank:

1. ``compute`` (forward and backward) runs as one XLA-compiled function and returns the
   local gradients;
2. the gradients are reduced by a shoal graph op, outside XLA (one fused allreduce);
3. ``apply`` (the optimizer update) runs as a second XLA-compiled function.

Both halves keep XLA's fusion; the price is one extra function boundary per step, which is
where a reduction has to wait for every rank anyway. ``model.fit`` with a shoal
``DistributedOptimizer`` and ``jit_compile=True`` is split this way by shoal itself
(:mod:`shoal._keras.split`); for custom loops, :func:`compiled_step`::

    def compute(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables), loss

    def apply(grads, loss):
        optimizer.apply(grads, model.trainable_variables)
        return loss

    step = hvd.xla.compiled_step(compute, apply)
    for x, y in data:
        loss = step(x, y)

A reduction reached *inside* a compiled function (``DistributedGradientTape`` under
``tf.function(jit_compile=True)``) raises a :class:`~shoal.ShoalError` naming this helper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from shoal.core import process_sets as ps_
from shoal.core.compression import Compression
from shoal.core.reduction import ReduceOp

from .tape import reduce_gradients

__all__ = ["compiled_step"]


def compiled_step(compute: Callable[..., Any], apply: Callable[..., Any], *,
                  jit_compile: bool = True, compression: Any = Compression.none,
                  op: ReduceOp | None = None, gradient_predivide_factor: float = 1.0,
                  sparse_as_dense: bool = False, groups: Any = None,
                  process_set: Any = ps_.global_process_set,
                  name: str | None = None) -> Callable[..., Any]:
    """A ``tf.function`` running ``compute(*args)`` compiled, reducing the gradients it
    returns across the process set, then running ``apply(grads, *rest)`` compiled.

    ``compute`` returns the gradients (any nest; ``None`` entries stay ``None``), or a tuple
    ``(grads, *rest)`` whose ``rest`` is passed on to ``apply``. The reduction takes the
    arguments of :class:`~shoal.tensorflow.DistributedGradientTape`.
    """
    first = tf.function(compute, jit_compile=jit_compile, reduce_retracing=True)
    second = tf.function(apply, jit_compile=jit_compile, reduce_retracing=True)

    def step(*args: Any) -> Any:
        out = first(*args)
        grads, rest = (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, ())
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = reduce_gradients(flat, compression=compression, sparse_as_dense=sparse_as_dense,
                                   op=op, gradient_predivide_factor=gradient_predivide_factor,
                                   groups=groups if isinstance(groups, int) else None,
                                   process_set=process_set, name=name)
        return second(tf.nest.pack_sequence_as(grads, reduced), *rest)

    step.__name__ = getattr(compute, "__name__", "compiled_step")
    return tf.function(step, reduce_retracing=True)
