"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients are averaged over ranks.

Used as in Horovod::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)

It is a real subclass of ``tf.GradientTape`` that *shares* the recording of the tape it wraps
(the recording state is read from and written to that tape), so it can wrap a tape before,
during or after the ``with`` block. ``gradient()`` computes the local gradients, then submits
them all as one grouped allreduce (one graph op inside ``tf.function``), so the engine fuses
them. Gradients that are ``None`` (unconnected sources) stay ``None``; sparse gradients are
reduced as dense tensors.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from shoal.core.compression import Codec, Compression
from shoal.core.ops import ReduceOp

from .ops import grouped_allreduce, reduction

__all__ = ["DistributedGradientTape", "reduce_gradients"]


def _shared(attr: str) -> property:
    """A ``tf.GradientTape`` attribute that lives on the wrapped tape."""
    return property(lambda self: getattr(self._gradtape, attr),
                    lambda self, value: setattr(self._gradtape, attr, value),
                    doc=f"The wrapped tape's ``{attr}``.")


class DistributedGradientTape(tf.GradientTape):
    """Wrap ``gradtape`` so that :meth:`gradient` returns gradients reduced over all ranks."""

    _tape = _shared("_tape")
    _persistent = _shared("_persistent")
    _watch_accessed_variables = _shared("_watch_accessed_variables")
    _watched_variables = _shared("_watched_variables")
    _recording = _shared("_recording")

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "",
                 device_sparse: str = "", compression: Codec = Compression.none,
                 sparse_as_dense: bool = True, op: ReduceOp | None = None,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Any = None, process_set: Any = None,
                 name: str | None = None) -> None:
        # tf.GradientTape.__init__ only sets the five shared attributes above; calling it
        # would reset the wrapped tape, so the wrapped tape's state is adopted instead
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, not "
                            f"{type(gradtape).__name__}")
        if process_set is not None:
            raise NotImplementedError("process sets are not supported yet")
        reduction(op, None, gradient_predivide_factor)  # validate now, not at gradient()
        self._gradtape = gradtape
        self._compression = compression
        self._op = op
        self._predivide = gradient_predivide_factor
        self._name = name
        # device_*, sparse_as_dense, num_groups and groups are accepted for Horovod
        # compatibility: reductions run on the host, sparse gradients are densified, and the
        # engine decides the fusion groups itself

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE
                 ) -> Any:
        """Local gradients of ``target`` w.r.t. ``sources``, reduced over all ranks (same
        structure as ``sources``)."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads)
        reduced = reduce_gradients(flat, compression=self._compression, op=self._op,
                                   gradient_predivide_factor=self._predivide, name=self._name)
        return tf.nest.pack_sequence_as(grads, reduced)


def reduce_gradients(grads: list[Any], *, compression: Codec = Compression.none,
                     op: ReduceOp | None = None, gradient_predivide_factor: float = 1.0,
                     name: str | None = None) -> list[Any]:
    """A flat list of gradients reduced across ranks as one group (``None`` entries stay
    ``None``); what :class:`DistributedGradientTape` and Keras's ``DistributedOptimizer``
    both do with their gradients."""
    present = [i for i, g in enumerate(grads) if g is not None]
    op, pre, post = reduction(op, None, gradient_predivide_factor)
    # eagerly, fixed names (so the engine's cache hits every step); in a graph, without a
    # name, the bridge names the call site
    name = name or ("tape.grad" if tf.executing_eagerly() else None)
    reduced = grouped_allreduce([grads[i] for i in present], compression=compression, op=op,
                                prescale_factor=pre, postscale_factor=post, name=name)
    out = list(grads)
    for i, g in zip(present, reduced, strict=True):
        out[i] = g
    return out

