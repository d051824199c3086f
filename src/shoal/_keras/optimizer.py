"""Keras 3 ``DistributedOptimizer``: the wrapped optimizer's own class, plus one reduction.

``DistributedOptimizer(opt)`` returns an instance of a real subclass of ``type(opt)`` (made
once per optimizer class by an ordinary ``class`` statement, with zero-argument ``super()``,
so it can itself be subclassed), built from ``opt.get_config()`` as Horovod does: it *is* a
``keras.optimizers.SGD`` (or Adam, or the user's own class) for ``model.compile``, schedules,
callbacks and checkpoints.

Where the reduction happens: Keras 3 calls ``_clip_gradients`` exactly once per real update,
on the gradients that update will use: after loss-scale unscaling, after its own gradient
accumulation (``gradient_accumulation_steps``), before clipping and the update step. The
mixin averages them across ranks there, as one grouped allreduce (one graph op inside the
compiled train function). So clipping sees the global gradient (Horovod's order), and with
``backward_passes_per_step=N`` (mapped onto Keras's accumulation) ranks communicate once per
N batches.

Two cases cannot reduce there, and ``model.fit`` splits its step instead (:mod:`.split`):
XLA (``jit_compile=True``, Keras's default on a GPU: XLA compiles no Python op), and a
``LossScaleOptimizer`` around this one (``mixed_float16``: its finite check must see the
reduced gradients, or ranks whose local gradients overflowed would skip the reduction).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from shoal.core.compression import Codec, Compression
from shoal.core.reduction import ReduceOp

from .compat import is_keras2, loss_scale_class, optimizer_built
from .keras2 import Keras2Mixin, LocalGradientAggregation

__all__ = [
    "DistributedOptimizerMixin",
    "Keras3Mixin",
    "Reduction",
    "create_distributed_optimizer",
    "create_partial_distributed_optimizer",
    "distributed_class",
    "load_model",
]


@dataclass(frozen=True)
class Reduction:
    """How a distributed optimizer reduces its gradients (Horovod's arguments)."""

    name: str
    compression: Any = Compression.none
    op: ReduceOp = ReduceOp.AVERAGE
    gradient_predivide_factor: float = 1.0
    sparse_as_dense: bool = False
    groups: Any = None
    process_set: Any = None
    #: the update uses the sum of the accumulated batches' gradients, not their mean
    sum_aggregated: bool = False
    #: divide the gradients of local variables by the process set's size
    scale_local_gradients: bool = True

    def __call__(self, grads: list[Any], variables: list[Any] | None = None,
                 local: Any = ()) -> list[Any]:
        """``grads`` reduced across the process set (``None`` entries stay ``None``), except
        those of the variables whose key is in ``local``."""
        from shoal.core.process_sets import communicator_for
        if communicator_for(self.process_set).size == 1:
            return list(grads)
        from shoal.tensorflow.tape import reduce_except_local, reduce_gradients
        kwargs = dict(compression=self.compression, sparse_as_dense=self.sparse_as_dense,
                      op=self.op, gradient_predivide_factor=self.gradient_predivide_factor,
                      groups=self.groups, process_set=self.process_set, name=self.name)
        if local and variables is not None:
            return reduce_except_local(list(grads), list(variables), local,
                                       scale_local_gradients=self.scale_local_gradients,
                                       **kwargs)
        return reduce_gradients(list(grads), variables, **kwargs)


def _graph() -> Any:
    import tensorflow as tf
    return tf.compat.v1.get_default_graph()


def _present(grads: list[Any], variables: list[Any]) -> frozenset[int]:
    return frozenset(id(v) for g, v in zip(grads, variables, strict=True) if g is not None)


class DistributedOptimizerMixin:
    """What every shoal distributed optimizer is: its gradients are averaged across ranks
    once per update, by the Keras 3 half below or by :class:`.keras2.Keras2Mixin`, and
    Horovod's ``compute_gradients``/``_compute_gradients`` and ``register_local_var``.

    Gradients are reduced once: where the update takes them, unless they came from this
    optimizer's ``_compute_gradients``, which reduces (Horovod's contract) and leaves a note
    that the next update takes: the variables it reduced for, in the graph it reduced in, and
    the tensors it returned (a loss-scale optimizer unscales them into new tensors in the same
    graph, or hands the same tensors into a branch). ``apply_gradients`` drops the note.

    An instance made by ``from_config`` (a reloaded model) averages without compression.
    While ``_shoal_reduced`` is set (by :mod:`.split`, which reduced the gradients already,
    outside XLA, or while reduced gradients pass), updates use the gradients as given.
    """

    _shoal_reduction: Reduction | None = None
    _shoal_reduced: bool = False

    def _shoal_own(self) -> dict[str, Any]:
        # set past Keras's attribute tracking: none of this is optimizer state
        state = self.__dict__.get("_shoal_state")
        if state is None:
            state = {"local": set(), "note": None}
            object.__setattr__(self, "_shoal_state", state)
        return state

    def register_local_var(self, var: Any) -> None:
        """Keep ``var``'s gradient this rank's own: not reduced, divided by the process set's
        size unless ``scale_local_gradients=False`` (Horovod's local variables)."""
        from shoal.tensorflow.tape import local_key
        self._shoal_own()["local"].add(local_key(var))

    def _shoal_reduce_grads(self, grads: list[Any], variables: list[Any] | None) -> list[Any]:
        reduce = self._shoal_reduction or Reduction(type(self).__name__)
        return reduce(list(grads), variables, self._shoal_own()["local"])

    def _shoal_accumulates(self) -> bool:
        """Whether updates aggregate several backward passes (then reduced at the update)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def _shoal_passing(self) -> Iterator[None]:
        """Reduced gradients pass through: updates inside use them as given."""
        before = self._shoal_reduced
        object.__setattr__(self, "_shoal_reduced", True)
        try:
            yield
        finally:
            object.__setattr__(self, "_shoal_reduced", before)

    def _shoal_note(self, grads: list[Any], variables: list[Any]) -> None:
        self._shoal_own()["note"] = (_graph(), _present(grads, variables),
                                     [g for g in grads if g is not None])

    def _shoal_take_note(self, grads: list[Any], variables: list[Any]) -> bool:
        """Whether ``grads`` are the ones the last ``_compute_gradients`` reduced (the note
        is used up)."""
        state = self._shoal_own()
        note, state["note"] = state["note"], None
        if note is None or note[1] != _present(grads, variables):
            return False
        given = [g for g in grads if g is not None]
        return note[0] is _graph() or (len(given) == len(note[2]) and all(
            a is b for a, b in zip(given, note[2], strict=True)))

    def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None
                          ) -> list[tuple[Any, Any]]:
        """Horovod's: ``(gradient, variable)`` pairs of ``loss``, reduced across ranks."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                           tape: Any = None) -> list[tuple[Any, Any]]:
        """The gradients of ``loss`` (a tensor recorded on ``tape``, or a function of no
        arguments) for ``var_list``, reduced across ranks as the update would (local
        variables' stay local), for ``apply_gradients``. With ``backward_passes_per_step``
        they are this rank's own, and the update reduces their aggregate."""
        grads, variables = local_gradients(loss, var_list, grad_loss, tape)
        if not self._shoal_accumulates() and not self._shoal_reduced:
            grads = self._shoal_reduce_grads(grads, variables)
            self._shoal_note(grads, variables)
        return list(zip(grads, variables, strict=True))


def local_gradients(loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None
                    ) -> tuple[list[Any], list[Any]]:
    """This rank's gradients of ``loss`` for ``var_list`` (Keras 2's ``compute_gradients``
    rules: a callable loss is recorded on ``tape`` or a new one; a tensor needs its tape)."""
    import tensorflow as tf
    if not callable(loss) and tape is None:
        raise ValueError("a tensor loss needs the tf.GradientTape that recorded it: pass "
                         "tape=, or pass the loss as a function of no arguments")
    tape = tape if tape is not None else tf.GradientTape()
    if callable(loss):
        with tape:
            if not callable(var_list):
                # Keras 3's variables hold a tf.Variable in .value (tf.Variable's is a method)
                tape.watch([v if callable(getattr(v, "value", None)) else v.value
                            for v in tf.nest.flatten(var_list)])
            loss = loss()
    if callable(var_list):
        var_list = var_list()
    variables = tf.nest.flatten(var_list)
    grads = tape.gradient(loss, variables, grad_loss)
    return list(grads), variables


class Keras3Mixin(DistributedOptimizerMixin):
    """The Keras 3 half: the reduction in ``_clip_gradients`` (see the module docstring)."""

    _shoal_variables: Any = None

    def _shoal_accumulates(self) -> bool:
        return bool(getattr(self, "gradient_accumulation_steps", None))

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        variables = (trainable_variables if trainable_variables is not None else
                     getattr(self, "_trainable_variables", None))
        try:
            if (not self._shoal_reduced and variables is not None and
                    len(variables) == len(grads) and
                    self._shoal_take_note(grads, list(variables))):
                with self._shoal_passing():
                    return super().apply(grads, trainable_variables)  # type: ignore[misc]
            return super().apply(grads, trainable_variables)  # type: ignore[misc]
        finally:
            self._shoal_own()["note"] = None

    def _backend_apply_gradients(self, grads: Any, trainable_variables: Any) -> Any:
        # the variables of the gradients _clip_gradients gets (Keras filtered both lists),
        # for groups= given as variables and local variables
        object.__setattr__(self, "_shoal_variables", list(trainable_variables))
        return super()._backend_apply_gradients(grads, trainable_variables)  # type: ignore[misc]

    def _clip_gradients(self, grads: list[Any]) -> list[Any]:
        reduce = self._shoal_reduction or Reduction(type(self).__name__)
        if not self._shoal_reduced:
            variables = self._shoal_variables
            if variables is None or len(variables) != len(grads):
                variables = getattr(self, "_trainable_variables", None)
            grads = self._shoal_reduce_grads(
                list(grads), None if variables is None else list(variables))
        steps = getattr(self, "gradient_accumulation_steps", None)
        if reduce.sum_aggregated and steps:
            # Keras hands over the mean of the accumulated gradients; Horovod's default
            # (average_aggregated_gradients=False) applies their sum
            grads = [None if g is None else g * steps for g in grads]
        return super()._clip_gradients(grads)  # type: ignore[misc]


_CLASSES: dict[type, type] = {}


def distributed_class(base: type) -> type:
    """The distributed subclass of optimizer class ``base`` (one per class, cached), with
    the half for ``base``'s Keras: Keras 2's optimizers aggregate gradients across replicas
    in ``aggregate_gradients`` (``_aggregate_gradients``: ``optimizers.legacy``)."""
    cls = _CLASSES.get(base)
    if cls is None:
        keras2 = hasattr(base, "aggregate_gradients") or hasattr(base, "_aggregate_gradients")
        half = Keras2Mixin if keras2 else Keras3Mixin

        class Distributed(half, DistributedOptimizerMixin, base):  # type: ignore[valid-type,misc]
            __doc__ = f"{base.__name__} whose gradients are averaged over all shoal ranks."

        # Keras 2 has an Adam and a legacy Adam: saved models name their class, so the
        # distributed ones must differ too
        legacy = "Legacy" if ".legacy." in base.__module__ else ""
        Distributed.__name__ = Distributed.__qualname__ = f"Distributed{legacy}{base.__name__}"
        Distributed.__module__ = __name__
        cls = _CLASSES[base] = Distributed
    return cls


def create_distributed_optimizer(keras: ModuleType, optimizer: Any, name: str | None = None,
                                 device_dense: str = "", device_sparse: str = "",
                                 compression: Any = Compression.none,
                                 sparse_as_dense: bool = False,
                                 gradient_predivide_factor: float = 1.0,
                                 op: ReduceOp = ReduceOp.AVERAGE,
                                 backward_passes_per_step: int = 1,
                                 average_aggregated_gradients: bool = False,
                                 num_groups: int = 0, groups: Any = None,
                                 process_set: Any = None,
                                 scale_local_gradients: bool = True) -> Any:
    """Wrap a Keras optimizer (Keras 3, or Keras 2's and its ``optimizers.legacy`` ones) so
    that its updates use gradients averaged over the process set (all ranks by default).

    ``name`` prefixes the collectives' names: give each distributed optimizer of a process its
    own when several update in the same step. ``backward_passes_per_step=N`` accumulates N
    batches locally (Keras 3's ``gradient_accumulation_steps``; Keras 2:
    :class:`.keras2.LocalGradientAggregation`) and communicates once; the update
    then uses the sum of the N batches' gradients, as Horovod's does, or their mean with
    ``average_aggregated_gradients=True``. ``groups`` (a number, or lists of variables reduced
    together) and ``num_groups`` split the reduction into several grouped allreduces;
    ``sparse_as_dense`` densifies ``IndexedSlices`` first (otherwise they are allgathered, as
    Horovod does); ``gradient_predivide_factor`` divides before the sum and the rest after.
    ``device_*`` are accepted and ignored (reductions run on the host). With
    ``jit_compile=True`` or a loss-scale optimizer around it, ``model.fit`` splits its step
    (:mod:`.split`).
    """
    keras2 = is_keras2(keras)
    bases = (keras.optimizers.Optimizer, *((keras.optimizers.legacy.Optimizer,)
                                           if keras2 else ()))
    if not isinstance(optimizer, bases):
        raise TypeError(f"DistributedOptimizer wraps a keras.optimizers.Optimizer, not "
                        f"{type(optimizer).__name__}")
    if isinstance(optimizer, loss_scale_class(keras)):
        raise TypeError("wrap the inner optimizer instead: "
                        "LossScaleOptimizer(DistributedOptimizer(optimizer)); a loss-scale "
                        "optimizer delegates its updates and would bypass the reduction")
    if keras.backend.backend() != "tensorflow":
        raise NotImplementedError(f"shoal's Keras DistributedOptimizer needs the TensorFlow "
                                  f"backend (KERAS_BACKEND=tensorflow), not "
                                  f"{keras.backend.backend()!r}")
    if not keras2 and not callable(getattr(keras.optimizers.Optimizer, "_clip_gradients",
                                           None)):
        raise NotImplementedError(f"Keras {keras.__version__} has no Optimizer._clip_gradients, "
                                  f"where shoal reduces gradients; use Keras 3.0 to 3.15")
    if backward_passes_per_step < 1:
        raise ValueError("backward_passes_per_step must be >= 1")
    if num_groups and groups is not None:
        raise ValueError("pass either num_groups or groups, not both")
    if optimizer_built(optimizer):
        raise ValueError("wrap the optimizer in DistributedOptimizer before it is built (before "
                         "model.fit or optimizer.apply): its state would be lost")
    op = ReduceOp(op)
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor only applies to op=Average")
    if process_set is not None:
        from shoal.core.process_sets import communicator_for
        communicator_for(process_set)  # registered, and this rank is a member
    config = optimizer.get_config()
    if backward_passes_per_step > 1 and not keras2:
        if config.get("gradient_accumulation_steps"):
            raise ValueError("pass either backward_passes_per_step or the optimizer's "
                             "gradient_accumulation_steps, not both")
        config["gradient_accumulation_steps"] = backward_passes_per_step
    wrapped = distributed_class(type(optimizer)).from_config(config)
    wrapped._shoal_reduction = Reduction(
        name or f"Distributed{type(optimizer).__name__}", compression, op,
        gradient_predivide_factor, sparse_as_dense,
        groups if groups is not None else num_groups, process_set,
        sum_aggregated=backward_passes_per_step > 1 and not average_aggregated_gradients
        and not keras2, scale_local_gradients=scale_local_gradients)
    if keras2 and backward_passes_per_step > 1:
        wrapped._agg_helper = LocalGradientAggregation(backward_passes_per_step,
                                                       average_aggregated_gradients)
    from .split import install
    install(keras)
    return wrapped


def create_partial_distributed_optimizer(keras: ModuleType, optimizer: Any,
                                         name: str | None = None, *, local_layers: Any = None,
                                         scale_local_gradients: bool = True,
                                         **kwargs: Any) -> Any:
    """A ``DistributedOptimizer`` that keeps the gradients of ``local_layers``' trainable
    weights local (each rank updates its own copy of those layers; their gradients are
    divided by the process set's size unless ``scale_local_gradients=False``). The other
    arguments are ``DistributedOptimizer``'s; ``op`` is Average or Sum."""
    from shoal.tensorflow.tape import local_layer_variables
    if ReduceOp(kwargs.get("op", ReduceOp.AVERAGE)) not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise ValueError("PartialDistributedOptimizer: op is Average or Sum")
    local = local_layer_variables(local_layers)
    wrapped = create_distributed_optimizer(keras, optimizer, name,
                                           scale_local_gradients=scale_local_gradients,
                                           **kwargs)
    for var in local:
        wrapped.register_local_var(var)
    return wrapped


def load_model(keras: ModuleType, filepath: str, custom_optimizers: list[type] | None = None,
               custom_objects: dict[str, Any] | None = None,
               compression: Codec = Compression.none) -> Any:
    """Load a model saved with a ``DistributedOptimizer``; its optimizer (state included)
    comes back distributed, with ``compression``. ``custom_optimizers`` lists the model's
    optimizer class when it is not one of Keras's own."""
    modules = [keras.optimizers, *([keras.optimizers.legacy] if is_keras2(keras) else [])]
    bases = [c for m in modules for c in vars(m).values() if isinstance(c, type) and
             issubclass(c, m.Optimizer)] + list(custom_optimizers or [])
    objects = {distributed_class(c).__name__: distributed_class(c) for c in bases}
    model = keras.models.load_model(filepath, custom_objects={**objects,
                                                              **(custom_objects or {})})
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, DistributedOptimizerMixin):
        optimizer._shoal_reduction = Reduction(type(optimizer).__name__, compression)
    return model
