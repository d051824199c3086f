"""Gradient reduction, written once for ``DistributedGradientTape`` and Keras's
``DistributedOptimizer``, and the tapes themselves.

Used as in Horovod::

    with tf.GradientTape() as tape:
        loss = loss_fn(model(x), y)
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)

The tape is a real subclass of ``tf.GradientTape`` that *shares* the recording of the tape it
wraps, so it can wrap a tape before, during or after the ``with`` block. ``gradient()``
computes the local gradients, then reduces them across the process set: all of them as one
grouped allreduce (one graph op inside ``tf.function``, fused by the engine), or in the groups
``groups``/``num_groups`` ask for. ``None`` gradients stay ``None``. ``IndexedSlices`` are
reduced as Horovod does (allgather of values and indices) unless ``sparse_as_dense=True``.
Inside ``tf.function(jit_compile=True)`` a reduction cannot run (XLA compiles no Python op):
:func:`shoal.tensorflow.xla.compiled_step` keeps the compute compiled and reduces between
two compiled halves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from shoal.core import process_sets as ps_
from shoal.core.compression import Compression
from shoal.core.gradients import check_predivide, predivide
from shoal.core.reduction import ReduceOp, resolve_op

from .differentiable import grouped_allreduce

__all__ = ["DistributedGradientTape", "PartialDistributedGradientTape", "local_key",
           "local_layer_variables", "reduce_except_local", "reduce_gradients"]


def local_key(variable: Any) -> Any:
    """A hashable identity for a TensorFlow or Keras variable."""
    return variable.ref() if hasattr(variable, "ref") else id(variable)


def _groups(count: int, variables: Sequence[Any] | None, groups: Any) -> list[list[int]]:
    """Index groups of the gradients to reduce (Horovod's ``groups``: a number of groups,
    or lists of variables that travel together, the others each alone)."""
    if groups is None or groups == 0:
        return [list(range(count))] if count else []
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups/num_groups must be >= 0, not {groups}")
        n = min(groups, count)
        return [list(range(count))[g::n] for g in range(n)] if n else []
    if variables is None:
        raise ValueError("groups given as lists of variables need the variables; pass them "
                         "to gradient()/apply")
    where = {local_key(v): i for i, v in enumerate(variables)}
    out, seen = [], set()
    for group in groups:
        idx = [where[local_key(v)] for v in group if local_key(v) in where]
        seen.update(idx)
        if idx:
            out.append(sorted(idx))
    out.extend([i] for i in range(count) if i not in seen)
    return out


def reduce_gradients(grads: Sequence[Any], variables: Sequence[Any] | None = None, *,
                     compression: Any = Compression.none, sparse_as_dense: bool = False,
                     op: ReduceOp | None = None, gradient_predivide_factor: float = 1.0,
                     groups: Any = None, process_set: Any = None,
                     name: str | None = None) -> list[Any]:
    """A flat list of gradients reduced across the process set (``None`` stays ``None``)."""
    sparse_op = op = resolve_op(None, op)
    size = ps_.communicator_for(process_set).size if gradient_predivide_factor != 1.0 else 1
    op, pre, post = predivide(op, gradient_predivide_factor, size)
    out = list(grads)
    if sparse_as_dense:
        out = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in out]
    present = [i for i, g in enumerate(out) if g is not None]
    vars_present = None if variables is None else [variables[i] for i in present]
    # eagerly, fixed names (so the engine's cache hits every step); in a graph, the bridge
    # names the call site
    base = name or ("tape.grad" if tf.executing_eagerly() else None)
    for k, group in enumerate(_groups(len(present), vars_present, groups)):
        at = [present[i] for i in group]
        part = base if base is None or k == 0 else f"{base}.g{k}"
        # IndexedSlices are gathered, not summed, so predividing has nothing to protect:
        # they take the plain op
        sparse = [i for i in at if isinstance(out[i], tf.IndexedSlices)]
        dense = [i for i in at if i not in sparse]
        for idx, kw, tag in ((dense, dict(op=op, prescale_factor=pre, postscale_factor=post),
                              ""), (sparse, dict(op=sparse_op), ".sparse")):
            if not idx:
                continue
            reduced = grouped_allreduce([out[i] for i in idx], compression=compression,
                                        process_set=process_set,
                                        name=None if part is None else part + tag, **kw)
            for i, g in zip(idx, reduced, strict=True):
                out[i] = g
    return out


def reduce_except_local(grads: Sequence[Any], sources: Sequence[Any], local: Any = (), *,
                        scale_local_gradients: bool = True, process_set: Any = None,
                        **reduce: Any) -> list[Any]:
    """:func:`reduce_gradients`, except the gradients of ``sources`` whose :func:`local_key` is
    in ``local``: those stay this rank's own, divided by the process set's size when
    ``scale_local_gradients`` (Horovod's rule for local layers, so that their update has the
    scale a reduced gradient would have)."""
    local = set(local)
    is_local = [bool(local) and local_key(s) in local for s in sources]
    shared = [i for i, own in enumerate(is_local) if not own]
    reduced = reduce_gradients([grads[i] for i in shared], [sources[i] for i in shared],
                               process_set=process_set, **reduce)
    out = list(grads)
    for i, g in zip(shared, reduced, strict=True):
        out[i] = g
    if scale_local_gradients and any(is_local):
        size = float(ps_.communicator_for(process_set).size)
        for i, own in enumerate(is_local):
            g = out[i]
            if own and g is not None:
                out[i] = tf.IndexedSlices(g.values / size, g.indices, g.dense_shape) \
                    if isinstance(g, tf.IndexedSlices) else g / size
    return out


def local_layer_variables(local_layers: Any) -> list[Any]:
    """The trainable variables of ``local_layers`` (a Keras layer, or a list of them; Keras 3
    and Keras 2's layers alike), for the ``Partial*`` wrappers."""
    if local_layers is None:
        return []
    layers = [local_layers] if _is_layer(local_layers) else list(local_layers)
    bad = [type(layer).__name__ for layer in layers if not _is_layer(layer)]
    if bad:
        raise ValueError(f"All local layers must be of tf.keras.layers.Layer type, not "
                         f"{', '.join(bad)}")
    return [v for layer in layers for v in layer.trainable_weights]


def _is_layer(obj: Any) -> bool:
    import sys
    bases = [getattr(getattr(sys.modules.get(m), "layers", None), "Layer", None)
             for m in ("keras", "tf_keras")]
    return any(isinstance(obj, b) for b in bases if isinstance(b, type))


def _shared(attr: str) -> property:
    """A ``tf.GradientTape`` attribute that lives on the wrapped tape."""
    return property(lambda self: getattr(self._gradtape, attr),
                    lambda self, value: setattr(self._gradtape, attr, value),
                    doc=f"The wrapped tape's ``{attr}``.")


class DistributedGradientTape(tf.GradientTape):
    """Wrap ``gradtape`` so that :meth:`gradient` returns gradients reduced over the process
    set (Horovod's arguments; ``device_*`` are accepted and ignored: reductions run on the
    host)."""

    _tape = _shared("_tape")
    _persistent = _shared("_persistent")
    _watch_accessed_variables = _shared("_watch_accessed_variables")
    _watched_variables = _shared("_watched_variables")
    _recording = _shared("_recording")

    def __init__(self, gradtape: tf.GradientTape, device_dense: str = "",
                 device_sparse: str = "", compression: Any = Compression.none,
                 sparse_as_dense: bool = False, op: ReduceOp | None = None,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                 groups: Any = None, process_set: Any = ps_.global_process_set,
                 scale_local_gradients: bool = True, name: str | None = None) -> None:
        # tf.GradientTape.__init__ only sets the five shared attributes above; calling it
        # would reset the wrapped tape, so the wrapped tape's state is adopted instead
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(f"DistributedGradientTape wraps a tf.GradientTape, not "
                            f"{type(gradtape).__name__}")
        if num_groups and groups is not None:
            raise ValueError("pass either num_groups or groups, not both")
        op = resolve_op(None, op)
        check_predivide(op, gradient_predivide_factor)
        self._gradtape = gradtape
        self._reduce = dict(compression=compression, sparse_as_dense=sparse_as_dense, op=op,
                            gradient_predivide_factor=gradient_predivide_factor,
                            groups=groups if groups is not None else num_groups,
                            process_set=process_set, name=name)
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources: set[Any] = set()

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local: not reduced (scaled by 1/size when
        ``scale_local_gradients``)."""
        self._local_sources.add(local_key(source))

    def gradient(self, target: Any, sources: Any, output_gradients: Any = None,
                 unconnected_gradients: tf.UnconnectedGradients = tf.UnconnectedGradients.NONE
                 ) -> Any:
        """Local gradients of ``target`` w.r.t. ``sources``, reduced over the process set
        (same structure as ``sources``)."""
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        out = reduce_except_local(tf.nest.flatten(grads), tf.nest.flatten(sources),
                                  self._local_sources,
                                  scale_local_gradients=self.scale_local_gradients,
                                  **self._reduce)
        return tf.nest.pack_sequence_as(grads, out)


def PartialDistributedGradientTape(gradtape: tf.GradientTape, device_dense: str = "",  # noqa: N802
                                   device_sparse: str = "", compression: Any = Compression.none,
                                   sparse_as_dense: bool = False, op: ReduceOp | None = None,
                                   gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None,
                                   process_set: Any = ps_.global_process_set,
                                   local_layers: Any = None,
                                   scale_local_gradients: bool = True
                                   ) -> DistributedGradientTape:
    """A :class:`DistributedGradientTape` that keeps the gradients of ``local_layers``'
    weights local (model parallelism inside data parallelism)."""
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression,
                                   sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                   groups, process_set, scale_local_gradients)
    for var in local_layer_variables(local_layers):
        tape.register_local_source(var)
    return tape
