"""Keras 2 (``tf_keras``, under ``TF_USE_LEGACY_KERAS=1``): where a distributed optimizer
reduces, and how it aggregates ``backward_passes_per_step`` backward passes.

Keras 2 aggregates gradients across replicas in one method that every update calls once:
``aggregate_gradients`` of its optimizers, ``_aggregate_gradients`` of ``optimizers.legacy``
ones. Its ``LossScaleOptimizer`` calls that method itself, *before* its overflow check, so
that every replica checks the same gradients; a shoal reduction there gives every rank the
same check, as a distribution strategy's all-reduce would. Keras 2 has no gradient
accumulation of its own, so ``backward_passes_per_step=N`` is :class:`LocalGradientAggregation`:
passes add into local accumulators, and every N-th applies their sum (or mean) through the
reduction, once; the others only count the optimizer's ``iterations`` (Horovod's helper,
kept under Horovod's attribute name ``_agg_helper``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["Keras2Mixin", "LocalGradientAggregation"]


class LocalGradientAggregation:
    """Aggregates ``passes`` backward passes locally, in graph and eager mode alike.
    ``counter`` holds the passes since the last update."""

    def __init__(self, passes: int, average: bool) -> None:
        self.passes, self.average = passes, average
        self.counter: Any = None
        self.accumulators: list[Any] = []

    def _build(self, variables: list[Any]) -> None:
        import tensorflow as tf
        with tf.init_scope():  # made once, outside any tf.function being traced
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False,
                                       name="shoal_aggregation_counter")
            self.accumulators = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False,
                                             name="shoal_aggregated_gradient")
                                 for v in variables]

    def apply(self, optimizer: Any, grads_and_vars: Any,
              apply_fn: Callable[[list[tuple[Any, Any]]], Any]) -> Any:
        """Add this pass's gradients; on every ``passes``-th, ``apply_fn`` their sum or mean
        (gradients that are None this pass stay None) and start again."""
        import tensorflow as tf
        pairs = list(grads_and_vars)
        variables = [v for _, v in pairs]
        if self.counter is None:
            self._build(variables)
        if len(self.accumulators) != len(pairs):
            raise ValueError(f"backward_passes_per_step: the optimizer was given "
                             f"{len(pairs)} variables, earlier {len(self.accumulators)}; "
                             f"aggregate over one fixed set of variables")
        for acc, (grad, _) in zip(self.accumulators, pairs, strict=True):
            if grad is not None:
                acc.assign_add(tf.convert_to_tensor(grad))  # IndexedSlices add densely
        self.counter.assign_add(1)
        scale = 1.0 / self.passes if self.average else 1.0

        def update() -> Any:
            grads = [None if g is None else acc.read_value() * tf.cast(scale, acc.dtype)
                     for acc, (g, _) in zip(self.accumulators, pairs, strict=True)]
            applied = apply_fn(list(zip(grads, variables, strict=True)))
            with tf.control_dependencies([applied] if applied is not None else []):
                resets = [acc.assign(tf.zeros_like(acc)) for acc in self.accumulators]
                resets.append(self.counter.assign(0))
                with tf.control_dependencies(resets):
                    return tf.constant(True)

        def skip() -> Any:
            with tf.control_dependencies([optimizer.iterations.assign_add(1)]):
                return tf.constant(False)

        tf.cond(self.counter >= self.passes, update, skip)
        return optimizer.iterations


class Keras2Mixin:
    """The Keras 2 half of a distributed optimizer (mixed into the optimizer's own class with
    :class:`~shoal._keras.optimizer.DistributedOptimizerMixin`).

    Gradients are reduced where Keras 2 aggregates them, unless they come reduced (from
    ``_compute_gradients``, or an aggregation before: a loss-scale optimizer aggregates, then
    applies with aggregation skipped). With ``backward_passes_per_step`` the aggregate is
    reduced when it is applied, whether or not the caller skips Keras's aggregation
    (``experimental_aggregate_gradients=False``, as Horovod's tests do).
    """

    _shoal_reduced: bool = False
    _agg_helper: LocalGradientAggregation | None = None

    def _shoal_accumulates(self) -> bool:
        return self._agg_helper is not None

    def _shoal_reduce(self, grads_and_vars: Any) -> list[tuple[Any, Any]]:
        pairs = list(grads_and_vars)
        if self._shoal_reduced or not pairs:  # type: ignore[attr-defined]
            return pairs
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if not self._shoal_take_note(grads, variables):  # type: ignore[attr-defined]
            grads = self._shoal_reduce_grads(grads, variables)  # type: ignore[attr-defined]
        self._shoal_note(grads, variables)  # type: ignore[attr-defined]  # for apply_gradients
        return list(zip(grads, variables, strict=True))

    def aggregate_gradients(self, grads_and_vars: Any) -> Any:
        return self._shoal_reduce(super().aggregate_gradients(grads_and_vars))  # type: ignore[misc]

    def _aggregate_gradients(self, grads_and_vars: Any) -> Any:
        return self._shoal_reduce(super()._aggregate_gradients(grads_and_vars))  # type: ignore[misc]

    def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        apply = super().apply_gradients  # type: ignore[misc]
        pairs = list(grads_and_vars)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        try:
            reduced = bool(pairs) and (self._shoal_reduced or  # type: ignore[attr-defined]
                                       self._shoal_take_note(grads, variables))  # type: ignore[attr-defined]
            if self._agg_helper is None:
                if not reduced:
                    return apply(pairs, *args, **kwargs)
                with self._shoal_passing():  # type: ignore[attr-defined]
                    return apply(pairs, *args, **kwargs)

            def update(aggregated: list[tuple[Any, Any]]) -> Any:
                if not reduced:
                    done = self._shoal_reduce_grads(  # type: ignore[attr-defined]
                        [g for g, _ in aggregated], [v for _, v in aggregated])
                    aggregated = list(zip(done, [v for _, v in aggregated], strict=True))
                with self._shoal_passing():  # type: ignore[attr-defined]
                    return apply(aggregated, *args, **kwargs)

            return self._agg_helper.apply(self, pairs, update)
        finally:
            self._shoal_own()["note"] = None  # type: ignore[attr-defined]
