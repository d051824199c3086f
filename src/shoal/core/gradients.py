"""The reduction rules every framework adapter follows, written once.

An adapter maps its tensors to the core's arrays; what a reduction *means* is decided here:

- ``gradient_predivide_factor`` (Horovod's): an Average whose division is split around the
  sum, ``1/f`` before and ``f/size`` after, so large gradients do not overflow half
  precision; only Average takes it (:func:`predivide`).
- a sparse gradient (torch's sparse COO tensor, TensorFlow's ``IndexedSlices``) is reduced as
  Horovod does, by allgathering its indices and values: duplicates sum where the result is
  used, so only Sum and Average are possible, and an Average divides the gathered values by
  the set's size (:func:`sparse_scale`).
- the gradient of a reduce-scatter is the allgather of the upstream gradient, times the
  set's size for Sum and times both scale factors (:func:`reducescatter_grad_scale`).
"""

from __future__ import annotations

from .reduction import ReduceOp

__all__ = ["check_predivide", "predivide", "reducescatter_grad_scale", "sparse_scale"]


def check_predivide(op: ReduceOp, factor: float) -> None:
    """Refuse ``gradient_predivide_factor`` with any op but Average (ValueError)."""
    if factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError(f"gradient_predivide_factor only applies to op=Average (got "
                         f"op={op.name.capitalize()} with factor {factor:g}); pass op=Average "
                         f"or leave the factor at 1.0")


def predivide(op: ReduceOp, factor: float, size: int) -> tuple[ReduceOp, float, float]:
    """``(op, prescale, postscale)`` of a reduction over ``size`` ranks with
    ``gradient_predivide_factor``: a Sum scaled by ``1/factor`` before and ``factor/size``
    after when the factor is not 1, else ``op`` unscaled."""
    check_predivide(op, factor)
    if factor == 1.0:
        return op, 1.0, 1.0
    return ReduceOp.SUM, 1.0 / factor, factor / size


def sparse_scale(op: ReduceOp, size: int, prescale: float = 1.0, postscale: float = 1.0,
                 *, rank: int | None = None, what: str = "a sparse gradient") -> float:
    """The factor the allgathered values of a sparse reduction are multiplied by (1.0: none);
    NotImplementedError for an op a gather cannot express."""
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        who = "" if rank is None else f"rank {rank}: "
        raise NotImplementedError(f"{who}{what} reduces by allgathering its indices and values, "
                                  f"which only Sum and Average can do, not "
                                  f"{op.name.capitalize()}; make it dense first (for "
                                  f"Horovod's optimizers: sparse_as_dense=True)")
    factor = prescale * postscale
    return factor / size if op == ReduceOp.AVERAGE else factor


def reducescatter_grad_scale(op: ReduceOp, size: int, prescale: float = 1.0,
                             postscale: float = 1.0) -> float:
    """The factor on the upstream gradient of a reduce-scatter before it is allgathered
    (Horovod's rule: the set's size for Sum, 1 for Average, times both scale factors)."""
    return (size if op == ReduceOp.SUM else 1) * prescale * postscale
