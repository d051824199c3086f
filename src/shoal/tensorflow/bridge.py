"""Running a numpy collective on TensorFlow tensors, eagerly or as an op inside a graph.

Eagerly, tensors are read as numpy arrays (``Tensor.numpy()`` shares the buffer of a CPU
tensor), handed to the core, and the results wrapped as tensors. Inside a ``tf.function`` the
same Python function becomes one ``tf.numpy_function`` op that calls the engine each time the
graph runs. Two rules make graph collectives safe across ranks:

* **Names fixed per call site.** A collective's name is chosen once, when the function is
  traced: the explicit ``name=`` or ``tf.<function>.<label>.<k>``, where ``<function>`` is the
  outermost ``tf.function``'s Python name and ``k`` counts the collectives of that trace. Every
  rank traces the same code in the same order, so every rank bakes the same names into its
  graph, whatever else (checkpoints on rank 0, other functions) it traced before; a retrace
  (a new input shape) reuses them.
* **One order.** A numpy-function op blocks a TensorFlow thread until its collective
  completes; two independent collective ops run in different orders on two ranks (or with one
  inter-op thread) would wait for each other forever. So each collective op of a graph gets a
  control dependency on the previous one: they run in the order they were traced.

XLA cannot compile a Python op: a collective traced inside ``jit_compile=True`` code raises
a :class:`~shoal.ShoalError` that says so and names the way out (:mod:`shoal.tensorflow.xla`),
rather than failing later inside XLA.

Errors keep their shoal type and gain TensorFlow's, as Horovod's ops raise them: a mismatch
between ranks is also a ``tf.errors.FailedPreconditionError``, a bad argument a
``tf.errors.InvalidArgumentError``, a lost peer ``tf.errors.UnavailableError``, a timeout
``tf.errors.DeadlineExceededError``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf

from shoal.core.errors import (
    CollectiveMismatchError,
    PeerLostError,
    ShoalError,
    ShoalTimeoutError,
)

__all__ = ["Collective", "as_tf_error", "run", "site_name"]

_TF_ERRORS: list[tuple[type[BaseException], type[tf.errors.OpError]]] = [
    (CollectiveMismatchError, tf.errors.FailedPreconditionError),
    (PeerLostError, tf.errors.UnavailableError),
    (ShoalTimeoutError, tf.errors.DeadlineExceededError),
    (ValueError, tf.errors.InvalidArgumentError),
    (TypeError, tf.errors.InvalidArgumentError),
]
_MIXED: dict[tuple[type, type], type] = {}


def as_tf_error(exc: BaseException) -> BaseException:
    """``exc`` as an instance of both its own class and the TensorFlow error that matches
    it (``exc`` itself when none does, or when it is one already)."""
    if isinstance(exc, tf.errors.OpError):
        return exc
    for base, tf_type in _TF_ERRORS:
        if isinstance(exc, base):
            key = (type(exc), tf_type)
            cls = _MIXED.get(key)
            if cls is None:
                def init(self: Any, message: str, _tf: type = tf_type) -> None:
                    _tf.__init__(self, None, None, message)
                    self.args = (message,)
                cls = _MIXED[key] = type(type(exc).__name__, key, {
                    "__init__": init, "__module__": type(exc).__module__,
                    "__str__": lambda self: self.args[0]})
            return cls(str(exc))
    return exc

# fn(name or None, input arrays) -> output arrays (same count as the output specs)
Collective = Callable[[str | None, list[np.ndarray]], list[np.ndarray]]


@dataclass
class _TraceState:
    """What one graph remembers about the collectives traced into it."""

    count: int = 0                    # collectives named so far (outermost graph only)
    last: list[Any] = field(default_factory=list)  # outputs of the previous collective op


def _state(graph: Any) -> _TraceState:
    state = getattr(graph, "_shoal_state", None)
    if state is None:  # lives and dies with the graph (a traced function keeps it alive)
        state = _TraceState()
        graph._shoal_state = state
    return state


def _outermost(graph: Any) -> Any:
    """The graph of the ``tf.function`` being traced (not a cond/while branch inside it)."""
    while isinstance(getattr(graph, "outer_graph", None), tf.__internal__.FuncGraph):
        graph = graph.outer_graph
    return graph


def _check_not_xla(graph: Any, label: str) -> None:
    try:
        from tensorflow.python.ops import control_flow_util
        in_xla = control_flow_util.GraphOrParentsInXlaContext(graph)
    except (ImportError, AttributeError):  # pragma: no cover - TensorFlow internals moved
        return
    if in_xla:
        raise ShoalError(f"shoal {label} cannot run inside XLA-compiled code (jit_compile=True): "
                         f"XLA compiles no Python op. Keep the compute compiled and reduce "
                         f"outside it with shoal.tensorflow.xla.compiled_step(compute, apply) "
                         f"(model.fit does this by itself with a shoal DistributedOptimizer), "
                         f"or compile without XLA")


def site_name(label: str, name: str | None) -> str | None:
    """The name every rank gives this collective: ``name``; eagerly ``None`` (the core then
    names it by call order); in a graph, a name fixed for this call site."""
    if name or tf.executing_eagerly():
        return name
    outer = _outermost(tf.compat.v1.get_default_graph())
    state = _state(outer)
    state.count += 1
    return f"tf.{getattr(outer, 'name', 'graph')}.{label}.{state.count}"


def run(fn: Collective, tensors: Sequence[Any], *, label: str, name: str | None,
        out_dtypes: Sequence[tf.DType] | None = None,
        out_shapes: Sequence[tf.TensorShape] | None = None) -> list[tf.Tensor]:
    """Apply the numpy collective ``fn`` to ``tensors``; outputs default to the inputs'
    dtypes and shapes. Eagerly it runs now; in a graph it becomes one ordered op."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    dtypes = list(out_dtypes) if out_dtypes is not None else [t.dtype for t in tensors]
    shapes = list(out_shapes) if out_shapes is not None else [t.shape for t in tensors]
    if not tensors:
        return []
    if tf.executing_eagerly():
        try:
            results = fn(name, [np.asarray(t.numpy()) for t in tensors])
        except Exception as exc:
            raise as_tf_error(exc) from exc
        return [tf.convert_to_tensor(r, dtype=d) for r, d in zip(results, dtypes, strict=True)]
    graph = tf.compat.v1.get_default_graph()
    _check_not_xla(graph, label)
    name = site_name(label, name)

    def call(*arrays: np.ndarray) -> list[np.ndarray]:
        try:
            results = fn(name, [np.asarray(a) for a in arrays])
        except Exception as exc:
            raise as_tf_error(exc) from exc
        return [np.asarray(r, dtype=d.as_numpy_dtype) for r, d in
                zip(results, dtypes, strict=True)]

    state = _state(graph)
    with tf.control_dependencies(state.last):
        outs = tf.numpy_function(call, tensors, dtypes, stateful=True,
                                 name=f"shoal_{label}")
    outs = list(outs) if isinstance(outs, list | tuple) else [outs]
    for out, shape in zip(outs, shapes, strict=True):
        out.set_shape(shape)
    state.last = outs[:1]
    return outs
